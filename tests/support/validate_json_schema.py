#!/usr/bin/env python3
"""The independent validator of test_grammar_schema: Debian's python3-jsonschema (Draft 2020-12,
with that draft's format checker). Reads JSON lines {"schema": ..., "instance": "<text>"} on stdin and
prints one line per input: "ok", or "invalid: <reason>".

The "date-time" and "time" formats are checked here, from RFC 3339's grammar (section 5.6):
jsonschema checks them only where the rfc3339-validator module is installed, which Debian does
not package, and a format left unchecked would let a wrong date-time pass."""
import datetime
import json
import re
import sys

import jsonschema

_TIME = re.compile(r"(\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-](\d{2}):(\d{2}))")
_DATE_TIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})[Tt](.*)", re.S)

checker = jsonschema.Draft202012Validator.FORMAT_CHECKER


@checker.checks("time")
def _time_ok(s):
    if not isinstance(s, str):
        return True
    m = _TIME.fullmatch(s)
    if not m or int(m[1]) > 23 or int(m[2]) > 59 or int(m[3]) > 60:  # 60: a leap second
        return False
    return m[6] is None or (int(m[6]) <= 23 and int(m[7]) <= 59)


@checker.checks("date-time")
def _date_time_ok(s):
    if not isinstance(s, str):
        return True
    m = _DATE_TIME.fullmatch(s)
    if not m:
        return False
    try:
        datetime.date(int(m[1]), int(m[2]), int(m[3]))
    except ValueError:
        return False
    return _time_ok(m[4])


for line in sys.stdin:
    case = json.loads(line)
    try:
        instance = json.loads(case["instance"])
        v = jsonschema.Draft202012Validator(case["schema"], format_checker=checker)
        errors = list(v.iter_errors(instance))
        print("ok" if not errors else "invalid: " + errors[0].message.replace("\n", " ")[:300])
    except Exception as e:  # a parse error is a finding too
        print("invalid: " + type(e).__name__ + ": " + str(e).replace("\n", " ")[:300])
