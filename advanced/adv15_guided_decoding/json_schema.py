"""A subset of JSON Schema -> one regex, compact JSON (no whitespace), keys in the schema's order.

    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer"}}, "required": ["name", "age"]}
    ->  \\{"name":"(chars){0,20}","age":-?(0|[1-9][0-9]{0,15})\\}

Supported: string (minLength/maxLength), integer and number (at most 16 digits each side of
the point), boolean, null, enum and const (of any JSON values), object with properties (nested),
array of any supported item schema (minItems/maxItems). Every listed property is produced, in
the order the schema lists them: a fixed order keeps the language regular and the DFA small,
and the output still validates (an optional property may be present). Anything else fails
with an error naming the path of the unsupported part, so a server answers 400 instead of
producing JSON the schema does not describe.

json_object (OpenAI's response_format {"type": "json_object"}) is any JSON value nested at most
`depth` levels: nesting without a bound is not regular, which is why grammar engines (xgrammar,
llguidance) carry a stack; a bounded depth keeps this lesson's DFA exact.
"""
from __future__ import annotations

import json

# A JSON string: any ASCII character but '"', '\\' and control bytes, or an escape.
STRING_CHAR = r'([^"\\\x00-\x1f]|\\["\\/bfnrt])'
# Numbers have bounded digits (16, what a float64 holds exactly; exponents 3): with maxLength on
# strings and maxItems on arrays, every schema's language is then finite, so a guided answer
# always reaches an accepting state with nothing left but EOS, and ends.
INTEGER = r"-?(0|[1-9][0-9]{0,15})"
NUMBER = INTEGER + r"(\.[0-9]{1,16})?([eE][-+]?[0-9]{1,3})?"
SCALARS = {"integer": INTEGER, "number": NUMBER, "boolean": "(true|false)", "null": "null"}
META = set(r"\.^$|?*+()[]{}/")


def escape(text: str) -> str:
    """A regex that matches exactly `text` (our parser's metacharacters escaped)."""
    return "".join("\\" + c if c in META else c for c in text)


def choice_regex(choices: list[str]) -> str:
    if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    return "(" + "|".join(escape(c) for c in choices) + ")"


def _string(schema: dict, path: str) -> str:
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    if not isinstance(lo, int) or (hi is not None and (not isinstance(hi, int) or hi < lo)):
        raise ValueError(f"json_schema {path}: minLength/maxLength must be integers with min <= max")
    if hi is not None and hi > 1000:
        raise ValueError(f"json_schema {path}: maxLength above 1000 is not supported")
    return '"' + STRING_CHAR + ("{%d,%d}" % (lo, hi) if hi is not None else "{%d,}" % lo) + '"'


def _array(schema: dict, path: str) -> str:
    if "items" not in schema:
        raise ValueError(f"json_schema {path}: an array needs 'items'")
    item = schema_regex(schema["items"], path + ".items")
    lo, hi = schema.get("minItems", 0), schema.get("maxItems")
    if not isinstance(lo, int) or (hi is not None and (not isinstance(hi, int) or hi < lo)) or (hi or lo) > 50:
        raise ValueError(f"json_schema {path}: minItems/maxItems must be integers, min <= max <= 50")
    if hi == 0:
        return r"\[\]"
    more = "(,%s)" % item + ("{%d,%s}" % (max(lo - 1, 0), "" if hi is None else hi - 1))
    body = item + more
    return r"\[" + (body if lo > 0 else "(" + body + ")?") + r"\]"


def _object(schema: dict, path: str) -> str:
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise ValueError(f"json_schema {path}: 'properties' must be an object")
    missing = [k for k in schema.get("required", []) if k not in props]
    if missing:
        raise ValueError(f"json_schema {path}: required keys {missing} are not in 'properties'")
    parts = [escape(json.dumps(k)) + ":" + schema_regex(sub, f"{path}.{k}") for k, sub in props.items()]
    return r"\{" + ",".join(parts) + r"\}"


def schema_regex(schema, path: str = "$") -> str:
    """The regex of every compact JSON text this (subset of a) schema produces."""
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema {path}: a schema must be an object, got {type(schema).__name__}")
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if not isinstance(values, list) or not values:
            raise ValueError(f"json_schema {path}: enum must be a non-empty list")
        return "(" + "|".join(escape(json.dumps(v, separators=(",", ":"))) for v in values) + ")"
    kind = schema.get("type")
    if kind == "string":
        return _string(schema, path)
    if kind in SCALARS:
        return SCALARS[kind]
    if kind == "array":
        return _array(schema, path)
    if kind == "object":
        return _object(schema, path)
    if kind is None:
        raise ValueError(f"json_schema {path}: needs a 'type' (or 'enum'/'const')")
    raise ValueError(f"json_schema {path}: type {kind!r} is not supported "
                     f"(supported: string, integer, number, boolean, null, object, array, enum, const)")


def json_value_regex(depth: int = 2) -> str:
    """Any JSON value (objects and arrays nested at most `depth` deep), compact form."""
    key = '"' + STRING_CHAR + '*"'
    value = "(" + "|".join([key, NUMBER, "true", "false", "null"]) + ")"
    for _ in range(depth):
        obj = r"\{(" + key + ":" + value + "(," + key + ":" + value + r")*)?\}"
        arr = r"\[(" + value + "(," + value + r")*)?\]"
        value = "(" + "|".join([key, NUMBER, "true", "false", "null", obj, arr]) + ")"
    return value


def json_object_regex(depth: int = 3) -> str:
    """OpenAI's json_object: the answer is a JSON object (whose values nest depth - 1 more)."""
    if not isinstance(depth, int) or not 1 <= depth <= 5:
        raise ValueError(f"json_object depth must be an integer in [1, 5], got {depth!r}")
    key = '"' + STRING_CHAR + '*"'
    value = json_value_regex(depth - 1)
    return r"\{(" + key + ":" + value + "(," + key + ":" + value + r")*)?\}"
