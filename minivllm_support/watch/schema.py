"""The event's JSON schema: what the page may rely on, written down once and tested against.

One event per engine step (kind "step") and, while the engine is idle and a page is open, at
most one a second (kind "idle", no batch). Lists of blocks are parallel arrays, one entry per
block of the pool, so a 1,500-block pool costs a few kilobytes, not a list of objects.
"""
from __future__ import annotations

_INT = {"type": "integer", "minimum": 0}
_NUM_OR_NULL = {"type": ["number", "null"]}

REQUEST = {
    "type": "object",
    "required": ["id", "queue", "phase", "prompt", "output", "computed", "scheduled", "blocks",
                 "preemptions", "ttft_ms", "finish"],
    "additionalProperties": False,
    "properties": {
        "id": _INT,
        "queue": {"enum": ["waiting", "running", "finished"]},
        "phase": {"enum": ["waiting", "prefill", "prefill-chunk", "decode", "idle", "preempted", "finished"]},
        "prompt": _INT, "output": _INT, "computed": _INT, "scheduled": _INT, "blocks": _INT,
        "preemptions": _INT,
        "ttft_ms": _NUM_OR_NULL,                      # first token time - arrival time
        "finish": {"type": ["string", "null"]},       # "stop", "length", "abort", ...
    },
}

KV = {
    "type": ["object", "null"],                       # null: the engine has no paged pool (09-11)
    "required": ["num_blocks", "block_size", "state", "owner", "ref", "used", "cached", "free", "scratch",
                 "free_books"],
    "additionalProperties": False,
    "properties": {
        "num_blocks": _INT, "block_size": {"type": "integer", "minimum": 1},
        "state": {"type": "string", "pattern": "^[ucfs]*$"},   # used, cached, free, scratch
        "owner": {"type": "array", "items": {"type": "integer", "minimum": -1}},
        "ref": {"type": "array", "items": _INT},
        "used": _INT, "cached": _INT, "free": _INT, "scratch": _INT,
        "free_books": _INT,                           # the block manager's own num_free_blocks
    },
}

TREE_NODE = {
    "type": "object",
    "required": ["id", "parent", "known_parent", "block", "tokens", "hits", "ref"],
    "additionalProperties": False,
    "properties": {
        "id": {"type": "string"}, "parent": {"type": ["string", "null"]}, "known_parent": {"type": "boolean"},
        "block": {"type": "integer", "minimum": -1}, "tokens": _INT,
        "hits": {"type": ["integer", "null"], "minimum": 0}, "ref": _INT,
    },
}

PREFIX = {
    "type": ["object", "null"],
    "required": ["kind", "nodes", "total"],
    "additionalProperties": False,
    "properties": {"kind": {"enum": ["hash-chain", "radix"]}, "nodes": {"type": "array", "items": TREE_NODE},
                   "total": _INT},
}

EVENT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "mini-vllm engine snapshot",
    "type": "object",
    "required": ["v", "kind", "engine", "step", "t", "step_ms", "batch", "totals", "requests", "kv", "prefix"],
    "additionalProperties": False,
    "properties": {
        "v": {"const": 1},
        "kind": {"enum": ["step", "idle"]},
        "engine": {"type": "string"},                 # the engine's class name
        "step": _INT,                                 # engine.num_steps
        "t": {"type": "number", "minimum": 0},        # seconds since watching began
        "step_ms": _NUM_OR_NULL,
        "batch": {"type": ["object", "null"], "required": ["size", "prefill_tokens", "decode_tokens"],
                  "additionalProperties": False,
                  "properties": {"size": _INT, "prefill_tokens": _INT, "decode_tokens": _INT}},
        "totals": {"type": "object", "required": ["preemptions", "prefix_queries", "prefix_hits", "finished"],
                   "additionalProperties": False,
                   "properties": {"preemptions": _INT, "prefix_queries": _INT, "prefix_hits": _INT,
                                  "finished": _INT}},
        "requests": {"type": "array", "items": REQUEST},
        "kv": KV,
        "prefix": PREFIX,
    },
}


def validate_event(event: dict) -> None:
    """Raise jsonschema.ValidationError if `event` breaks the schema (used by the tests)."""
    import jsonschema
    jsonschema.validate(event, EVENT_SCHEMA)
