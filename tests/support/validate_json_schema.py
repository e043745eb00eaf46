#!/usr/bin/env python3
"""The independent validator of test_grammar_schema: Debian's python3-jsonschema (Draft 2020-12,
with that draft's format checker). Reads JSON lines {"schema": ..., "instance": "<text>"} on stdin and
prints one line per input: "ok", or "invalid: <reason>"."""
import json
import sys

import jsonschema

for line in sys.stdin:
    case = json.loads(line)
    try:
        instance = json.loads(case["instance"])
        v = jsonschema.Draft202012Validator(case["schema"], format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        errors = list(v.iter_errors(instance))
        print("ok" if not errors else "invalid: " + errors[0].message.replace("\n", " ")[:300])
    except Exception as e:  # a parse error is a finding too
        print("invalid: " + type(e).__name__ + ": " + str(e).replace("\n", " ")[:300])
