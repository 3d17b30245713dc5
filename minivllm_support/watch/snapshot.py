"""One picture of an engine's state, as a JSON-ready dict, read by duck typing.

Everything is read through attributes that lessons 09-20 (and advanced 05) already have:

    engine.scheduler.waiting / .running      the two queues of Sequences (lesson 09)
    seq.num_computed_tokens, .token_ids, .token_times, .num_preemptions, .block_table
    scheduler.num_preemptions                lesson 11
    scheduler.block_manager.blocks[i].ref_count, .free_block_ids, .block_size   lesson 12
    block_manager.hash_of / .cached / .seq_hashes / .tokens_of                  lesson 13's hash chain
    block_manager.tree.root, .evictable                                         advanced 05's radix tree
    engine.kv_pool.num_blocks > block_manager.num_blocks: the extra is lesson 16's scratch block

An attribute an engine lacks is simply left out of the picture (lessons 09-11 have no blocks).
Nothing here writes to the engine; it runs in the engine's thread, between two steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_TREE_NODES = 300          # a page cannot draw thousands of nodes usefully; the rest are counted


@dataclass
class Scheduled:
    """What the scheduler handed one sequence for the step that just ran (captured before it ran)."""
    num_tokens: int
    computed_before: int
    tokens_before: int
    outputs_before: int


@dataclass
class StepInfo:
    """The step that just ran: its batch, per sequence id, and how long it took."""
    scheduled: dict[int, Scheduled] = field(default_factory=dict)
    seqs: list = field(default_factory=list)             # the Sequences themselves, same order
    seconds: float | None = None


def phase_of(seq, where: str, sched: Scheduled | None) -> str:
    if getattr(seq, "is_finished", False) or where == "finished":
        return "finished"
    if where == "waiting":
        return "preempted" if getattr(seq, "num_preemptions", 0) else "waiting"
    if sched is None:
        return "idle"                       # running, but left out of this step (budget, KV room)
    if sched.num_tokens == 1 and sched.outputs_before > 0 and sched.computed_before == sched.tokens_before - 1:
        return "decode"
    if sched.computed_before + sched.num_tokens < sched.tokens_before:
        return "prefill-chunk"              # more of its prompt is left for later steps
    return "prefill"


def request_row(seq, where: str, sched: Scheduled | None) -> dict:
    prompt = len(getattr(seq, "prompt_token_ids", ()))
    times = getattr(seq, "token_times", None) or []
    arrival = getattr(seq, "arrival_time", None)
    ttft = (times[0] - arrival) * 1e3 if times and arrival is not None else None
    return {"id": int(seq.seq_id), "queue": where, "phase": phase_of(seq, where, sched),
            "prompt": prompt, "output": len(seq.token_ids) - prompt,
            "computed": int(seq.num_computed_tokens), "scheduled": sched.num_tokens if sched else 0,
            "blocks": len(getattr(seq, "block_table", None) or ()),
            "preemptions": int(getattr(seq, "num_preemptions", 0)),
            "ttft_ms": None if ttft is None else round(ttft, 2),
            "finish": getattr(seq, "finish_reason", None)}


def kv_grid(engine, live: list) -> dict | None:
    """The pool as parallel lists, one entry per block: state, owner (a seq id or -1), ref count.
    States: u used, c cached (no reference, contents kept for a prefix hit), f free, s scratch."""
    bm = getattr(getattr(engine, "scheduler", None), "block_manager", None)
    if bm is None or not hasattr(bm, "blocks"):
        return None
    n = len(bm.blocks)
    refs = [int(b.ref_count) for b in bm.blocks]
    owner = [-1] * n
    for seq in live:                       # oldest first: a shared block shows its first owner
        for b in getattr(seq, "block_table", None) or ():
            if 0 <= b < n and owner[b] < 0:
                owner[b] = int(seq.seq_id)
    cached = set(getattr(bm, "hash_of", ()) or ()) | set(getattr(bm, "evictable", ()) or ())
    state = ["u" if r > 0 else "c" if i in cached else "f" for i, r in enumerate(refs)]
    pool = getattr(engine, "kv_pool", None)
    scratch = max(0, int(getattr(pool, "num_blocks", n)) - n)
    state += ["s"] * scratch
    owner += [-1] * scratch
    refs += [0] * scratch
    return {"num_blocks": n + scratch, "block_size": int(bm.block_size), "state": "".join(state),
            "owner": owner, "ref": refs, "used": state.count("u"), "cached": state.count("c"),
            "free": state.count("f"), "scratch": scratch, "free_books": int(bm.num_free_blocks)}


def hash_chain_tree(bm, hits: dict[int, int], parents: dict[int, int | None]) -> dict:
    """Lesson 13's cached blocks as a tree: each block's parent is the block before it in the
    chain. The block manager keeps hash -> block but not a block's parent hash, so parents are
    learned from the chains of live sequences (seq_hashes) and remembered in `parents`."""
    for chain in list(getattr(bm, "seq_hashes", {}).values()):
        prev = None
        for h in chain:
            parents[h] = prev
            prev = h
    nodes = []
    for h, block in list(bm.cached.items()):
        parent = parents.get(h, "?")
        nodes.append({"id": _key(h), "parent": None if parent is None or parent == "?" else _key(parent),
                      "known_parent": parent != "?", "block": int(block),
                      "tokens": len(bm.tokens_of.get(block, ())), "hits": int(hits.get(h, 0)),
                      "ref": int(bm.blocks[block].ref_count)})
    for h in [h for h in parents if h not in bm.cached]:   # forget blocks the cache evicted
        del parents[h]
    return _limit({"kind": "hash-chain", "nodes": nodes})


def radix_tree(bm) -> dict:
    """Advanced 05's radix tree: each node a run of tokens over some blocks."""
    ids: dict[int, str] = {}
    nodes = []
    for node in bm.tree.nodes():
        ids[id(node)] = f"n{len(ids)}"
    for node in bm.tree.nodes():
        parent = node.parent if node.parent is not bm.tree.root else None
        refs = [int(bm.blocks[b].ref_count) for b in node.blocks if 0 <= b < len(bm.blocks)]
        nodes.append({"id": ids[id(node)], "parent": None if parent is None else ids.get(id(parent)),
                      "known_parent": True, "block": int(node.blocks[0]) if node.blocks else -1,
                      "tokens": len(node.tokens), "hits": None, "ref": max(refs, default=0)})
    return _limit({"kind": "radix", "nodes": nodes})


def prefix_tree(engine, hits: dict[int, int], parents: dict[int, int | None]) -> dict | None:
    bm = getattr(getattr(engine, "scheduler", None), "block_manager", None)
    if bm is not None and hasattr(bm, "tree") and hasattr(bm.tree, "nodes"):
        return radix_tree(bm)
    if bm is not None and hasattr(bm, "cached") and hasattr(bm, "tokens_of"):
        return hash_chain_tree(bm, hits, parents)
    return None


def _limit(tree: dict) -> dict:
    tree["total"] = len(tree["nodes"])
    if len(tree["nodes"]) > MAX_TREE_NODES:       # keep the most used: hits, then references
        tree["nodes"].sort(key=lambda n: (-(n["hits"] or 0), -n["ref"]))
        tree["nodes"] = tree["nodes"][:MAX_TREE_NODES]
        kept = {n["id"] for n in tree["nodes"]}
        for n in tree["nodes"]:
            if n["parent"] not in kept:
                n["parent"] = None
    return tree


def _key(h: int) -> str:
    return format(h & 0xFFFFFFFFFFFF, "x")    # a short stable name for a hash


def totals(engine, finished_total: int) -> dict:
    sched = getattr(engine, "scheduler", None)
    bm = getattr(sched, "block_manager", None)
    return {"preemptions": int(getattr(sched, "num_preemptions", 0)),
            "prefix_queries": int(getattr(bm, "query_tokens", 0)),
            "prefix_hits": int(getattr(bm, "hit_tokens", 0)), "finished": finished_total}


def batch_summary(step: StepInfo) -> dict:
    prefill = decode = 0
    for s in step.scheduled.values():
        is_decode = s.num_tokens == 1 and s.outputs_before > 0 and s.computed_before == s.tokens_before - 1
        decode += s.num_tokens if is_decode else 0
        prefill += 0 if is_decode else s.num_tokens
    return {"size": len(step.scheduled), "prefill_tokens": prefill, "decode_tokens": decode}


def live_sequences(engine) -> tuple[list, list]:
    sched = engine.scheduler
    return list(sched.running), list(sched.waiting)


def build_snapshot(engine, kind: str, t: float, step: StepInfo | None, finished_rows: list[dict],
                   finished_total: int, hits: dict[int, int], parents: dict[int, int | None]) -> dict[str, Any]:
    """The event the page draws (its schema: schema.py)."""
    running, waiting = live_sequences(engine)
    scheduled = step.scheduled if step else {}
    rows = [request_row(s, "running", scheduled.get(s.seq_id)) for s in running]
    rows += [request_row(s, "waiting", None) for s in waiting]
    return {"v": 1, "kind": kind, "engine": type(engine).__name__, "step": int(getattr(engine, "num_steps", 0)),
            "t": round(t, 4), "step_ms": None if step is None or step.seconds is None else round(step.seconds * 1e3, 3),
            "batch": batch_summary(step) if step else None, "totals": totals(engine, finished_total),
            "requests": rows + finished_rows, "kv": kv_grid(engine, running + waiting),
            "prefix": prefix_tree(engine, hits, parents)}
