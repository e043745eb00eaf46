#!/usr/bin/env python3
"""Renders every case of tests/data/chat_templates/goldens.json with Python Jinja2 set up as
transformers' apply_chat_template sets it up, and lists the cases where it differs from the
golden (rendered by @huggingface/jinja). Kestrel's interpreter follows Python Jinja2; this shows
where the two references disagree. Needs the jinja2 package (not needed by the tests).

    python3 scripts/check-jinja-goldens-python.py
"""
import datetime
import json
import pathlib
import sys

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "chat_templates"


class AssistantTracker(Extension):
    """transformers' {% generation %} tag (it marks the assistant's tokens; renders as is)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class Raised(Exception):
    pass


def environment(fixed_date):
    def raise_exception(message):
        raise Raised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime(fixed_date["year"], fixed_date["month"], fixed_date["day"],
                                 fixed_date["hour"], fixed_date["minute"]).strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def main():
    goldens = json.loads((DATA / "goldens.json").read_text(encoding="utf-8"))
    env = environment(goldens["strftime_now"])
    differ = 0
    for case in goldens["cases"]:
        source = (DATA / case["template"]).read_text(encoding="utf-8")
        try:
            got = {"expected": env.from_string(source).render(**case["context"])}
        except Raised as e:
            got = {"error": str(e)}
        want = {k: case[k] for k in ("expected", "error") if k in case}
        if got != want:
            differ += 1
            print(f"{case['template']} / {case['name']}:\n  golden: {want!r}\n  python: {got!r}")
    print(f"{len(goldens['cases']) - differ} of {len(goldens['cases'])} cases render the same "
          f"in Python Jinja2 {jinja2.__version__}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
