"""The live page's event stream: its schema, and what a snapshot says on a real engine run.

A real engine (lesson 13's prefix-caching engine on the tiny random Qwen3) with a pool so small
that six requests sharing a 32-token prefix must share blocks and preempt each other."""
import json

import jsonschema
import pytest
import torch

from minivllm_support.watch import Watcher
from minivllm_support.watch.schema import EVENT_SCHEMA, validate_event
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.kv_pool import KVPool
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step13_prefix_cache.engine import PrefixCachingEngine
from step16_cuda_graph.engine import build_engine

pytestmark = pytest.mark.usefixtures("one_thread")     # tiny steps: one thread is fastest beside others
PREFIX = list(range(10, 42))                                # two full 16-token blocks


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_dir):
    return load_model(tiny_qwen3_dir, torch.float32)


def _engine(model, blocks: int):
    bpb = KVPool.bytes_per_block(model.config, 16, torch.float32)
    return PrefixCachingEngine(model, PagedSchedulerConfig(kv_cache_bytes=blocks * bpb, max_num_seqs=8,
                                                           max_num_batched_tokens=128))


def _drain(viewer) -> list[dict]:
    out = []
    while (data := viewer.next(0)) is not None:
        out.append(json.loads(data))
    return out


def _run_watched(engine, prompts, max_tokens: int):
    watcher = Watcher(hub=None)
    watcher.hub.maxlen = 100_000                           # keep every step's event for the asserts
    watcher.attach(engine)
    viewer = watcher.hub.subscribe()
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    return watcher, _drain(viewer), outs


def test_schema_is_a_valid_json_schema_and_rejects_a_broken_event():
    jsonschema.Draft202012Validator.check_schema(EVENT_SCHEMA)
    bad = {"v": 1, "kind": "step", "engine": "X", "step": -1}
    with pytest.raises(jsonschema.ValidationError):
        validate_event(bad)


def test_shared_prefix_and_a_burst_show_sharing_preemption_and_balanced_books(tiny):
    engine = _engine(tiny, blocks=12)
    prompts = [PREFIX + [100 + i, 101 + i, 102 + i] for i in range(6)]
    watcher, events, outs = _run_watched(engine, prompts, max_tokens=40)
    assert watcher.errors == 0, watcher.last_error
    assert len(events) == engine.num_steps                   # one event per step, none dropped
    for e in events:
        validate_event(e)
        kv = e["kv"]
        assert len(kv["state"]) == len(kv["owner"]) == len(kv["ref"]) == kv["num_blocks"] == 12
        assert kv["used"] + kv["cached"] + kv["free"] + kv["scratch"] == kv["num_blocks"]
        assert kv["cached"] + kv["free"] == kv["free_books"]    # the grid agrees with the block manager
        b = e["batch"]
        assert b["prefill_tokens"] + b["decode_tokens"] <= 128 and b["size"] <= 8
    # sharing: some step shows a block held by more than one request, owned by a live request
    shared = [(e, i) for e in events for i, r in enumerate(e["kv"]["ref"]) if r > 1]
    assert shared
    e, i = shared[0]
    assert e["kv"]["state"][i] == "u" and e["kv"]["owner"][i] in {r["id"] for r in e["requests"]}
    # the burst ran out of blocks: a preemption is counted and shown on a request row
    assert events[-1]["totals"]["preemptions"] == engine.scheduler.num_preemptions > 0
    assert any(r["phase"] == "preempted" for e in events for r in e["requests"])
    # phases seen, and every request ends as a finished row with its TTFT
    phases = {r["phase"] for e in events for r in e["requests"]}
    assert {"prefill", "decode", "finished", "preempted"} <= phases
    last = events[-1]
    finished = {r["id"]: r for r in last["requests"] if r["queue"] == "finished"}
    assert set(finished) == {s.seq_id for s in outs} and last["totals"]["finished"] == 6
    for s in outs:
        assert finished[s.seq_id]["output"] == len(s.output_token_ids)
        assert finished[s.seq_id]["ttft_ms"] == pytest.approx((s.token_times[0] - s.arrival_time) * 1e3, abs=0.01)
    # at the end: nothing used, the grid's counts equal the block manager's books
    bm = engine.scheduler.block_manager
    assert last["kv"]["used"] == 0 and last["kv"]["cached"] + last["kv"]["free"] == bm.num_free_blocks == 12
    # the prefix tree: the shared prefix's two blocks form a chain whose root was hit by every admission
    nodes = {n["id"]: n for n in last["prefix"]["nodes"]}
    root = [n for n in nodes.values() if n["parent"] is None and n["hits"]]
    assert root and root[0]["hits"] >= 5
    assert any(n["parent"] == root[0]["id"] and n["hits"] for n in nodes.values())


def test_no_viewer_no_snapshot_and_detach_restores_the_engine(tiny):
    engine = _engine(tiny, blocks=40)
    watcher = Watcher()
    watcher.attach(engine)
    engine.generate([PREFIX + [7]], SamplingParams(max_tokens=4))
    assert watcher.hub.published == 0                       # nobody watched: nothing was built
    watcher.detach(engine)
    assert "step" not in engine.__dict__ and "match_prefix" not in engine.scheduler.block_manager.__dict__


def test_scratch_block_of_lesson_16_and_a_class_watch(tiny):
    from step15_flash_attention.engine import Engine
    watcher = Watcher()
    watcher.watch_class(Engine)
    try:                                # the torch backend: decode steps replayed eagerly, no compiling
        engine = build_engine(tiny, PagedSchedulerConfig(max_num_seqs=4, kv_cache_bytes=2 * 2**20),
                              attention_backend="torch", record_now=False, pack_weights=False)
        assert "_watch_original_step" in engine.__dict__      # built while the class was watched
    finally:
        watcher.close()
    assert Engine.__init__ is Engine.__dict__["__init__"] and "_watch_original_step" not in engine.__dict__
    watcher = Watcher()
    watcher.attach(engine)
    viewer = watcher.hub.subscribe()
    engine.generate([PREFIX + [5, 6]], SamplingParams(max_tokens=3))
    events = _drain(viewer)
    kv = events[-1]["kv"]
    validate_event(events[-1])
    assert kv["scratch"] == 1 and kv["state"][-1] == "s" and kv["num_blocks"] == engine.kv_pool.num_blocks


def test_advanced_05s_radix_tree_is_drawn_as_its_nodes(tiny):
    from advanced.adv05_radix_cache.engine import build_radix_engine
    bpb = KVPool.bytes_per_block(tiny.config, 16, torch.float32)
    engine = build_radix_engine(tiny, PagedSchedulerConfig(kv_cache_bytes=40 * bpb, max_num_seqs=4),
                                fast_path=False, use_graph=False, pack_weights=False)
    watcher = Watcher()
    watcher.attach(engine)
    viewer = watcher.hub.subscribe()
    engine.generate([PREFIX + [100 + i] for i in range(3)], SamplingParams(max_tokens=4))
    events = _drain(viewer)
    for e in events:
        validate_event(e)
    tree = events[-1]["prefix"]
    assert tree["kind"] == "radix" and tree["total"] == len(engine.scheduler.block_manager.tree.nodes()) >= 2
    ids = {n["id"] for n in tree["nodes"]}
    assert all(n["parent"] is None or n["parent"] in ids for n in tree["nodes"])
    assert events[-1]["kv"]["used"] == 0 and events[-1]["kv"]["cached"] > 0    # held by the tree, no one's
