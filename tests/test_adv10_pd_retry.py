"""Advanced 10: a failed transfer is asked for again once before the decode engine recomputes the
prompt. A layer lost once is retried and the request gets no fallback; a layer lost every time
falls back after its retry; both are counted, and every pool is full at the end on both sides.
The shared helpers and the colocated reference are the first file's."""
from __future__ import annotations

import time

import pytest
import torch

from advanced.adv10_pd_disaggregation.cluster import PDCluster
from advanced.adv10_pd_disaggregation.connector import prompt_key
from advanced.adv10_pd_disaggregation.engines import build_pd_engine
from advanced.adv10_pd_disaggregation.process import parse_fault
from advanced.adv10_pd_disaggregation.records import PDRequest
from advanced.adv10_pd_disaggregation.store import KVStore, StoreConnectorWorker
from step04_transformer.loader import load_model
from tests.test_adv10_pd_disaggregation import (CONFIG, LENGTHS, WAIT_S, _full, _params,  # noqa: F401
                                                _prefill_all, _prompts, colocated_tokens)


def test_drop_once_is_a_fault_of_its_own():
    assert parse_fault("drop-once:1,drop:2") == {"drop-once": 1, "drop": 2}
    with pytest.raises(ValueError, match="distinct"):
        parse_fault("drop-once:1,drop-once:2")


def test_a_lost_layer_is_asked_for_again_once_then_recomputed(tiny_qwen3_dir, tmp_path, colocated_tokens):
    model = load_model(tiny_qwen3_dir, torch.float32)
    last, store, asked = model.config.num_layers - 1, KVStore(tmp_path), []
    pre = build_pd_engine(model, "prefill", lambda pool, n: StoreConnectorWorker(
        store, pool, n, 10.0, drop_layers={(2, last)}, drop_once={(1, last)}), CONFIG)   # 1: once; 2: always
    dec = build_pd_engine(model, "decode", lambda pool, n: StoreConnectorWorker(store, pool, n, 10.0), CONFIG,
                          on_retry=asked.append)
    prompts = _prompts()
    _prefill_all(pre, prompts)
    seqs = [dec.add_consumer(rid, p, _params(), prompt_key(p, rid)) for rid, p in enumerate(prompts)]
    dec.advance_transfers()
    for rid in (1, 2):
        dec.worker.producer_done(rid)                                # done, and a layer missing
    dec.advance_transfers()
    assert [(r.req_id, r.from_layer) for r in asked] == [(1, last), (2, last)] and dec.fallbacks == []
    computed = pre.prompt_tokens
    for r in asked:                                                  # what the launcher does on "retry"
        pre.add_prefill(r.req_id, prompts[r.req_id], prompt_key(prompts[r.req_id], r.req_id))
    while pre.has_unfinished():
        pre.step()
    assert pre.prompt_tokens - computed == 2                         # its prefix cache: a copy, one token each
    for r in asked:
        dec.worker.producer_done(r.req_id)
    while dec.has_unfinished():
        dec.step()
    assert [(f.req_id, f.tokens_recomputed) for f in dec.fallbacks] == [(2, LENGTHS[2])]
    assert "never arrived" in dec.fallbacks[0].reason and "after a retry" in dec.fallbacks[0].reason
    assert [r.req_id for r in dec.retries] == [1, 2]
    assert [s.output_token_ids for s in seqs] == colocated_tokens
    assert dec.prompt_tokens == len(prompts) - 1 + LENGTHS[2]        # only request 2 recomputed its prompt
    assert _full(pre) and _full(dec) and store.keys() == []


def test_a_damaged_or_late_layer_is_retried_and_lands(tiny_qwen3_dir, tmp_path, colocated_tokens):
    """The retry's other two causes: a damaged file (its folder is removed before the second
    send) and a layer late past the timeout; both land the second time, no fallback."""
    model = load_model(tiny_qwen3_dir, torch.float32)
    last, store, asked = model.config.num_layers - 1, KVStore(tmp_path), []
    pre = build_pd_engine(model, "prefill", lambda pool, n: StoreConnectorWorker(
        store, pool, n, 0.2, drop_once={(0, last)}), CONFIG)
    dec = build_pd_engine(model, "decode", lambda pool, n: StoreConnectorWorker(store, pool, n, 0.2), CONFIG,
                          on_retry=asked.append)
    prompts = _prompts()
    _prefill_all(pre, prompts)
    store.layer_path(prompt_key(prompts[2], 2), 0).write_bytes(b"\0" * 100)
    seqs = [dec.add_consumer(rid, p, _params(), prompt_key(p, rid)) for rid, p in enumerate(prompts)]
    dec.advance_transfers()
    dec.worker.arm(0)                                                # started, then silent
    deadline = time.monotonic() + 30                                 # bounded: a missing retry fails, never hangs
    while len(asked) < 2 and time.monotonic() < deadline:
        dec.step()
    assert sorted(r.req_id for r in asked) == [0, 2]
    reasons = {r.req_id: r.reason for r in asked}
    assert "within 0.2 s" in reasons[0] and "unreadable" in reasons[2]
    for r in asked:
        pre.add_prefill(r.req_id, prompts[r.req_id], prompt_key(prompts[r.req_id], r.req_id))
    while pre.has_unfinished():
        pre.step()
    for r in asked:
        dec.worker.producer_done(r.req_id)
    while dec.has_unfinished():
        dec.step()
    assert dec.fallbacks == [] and [s.output_token_ids for s in seqs] == colocated_tokens
    assert dec.prompt_tokens == len(prompts) and _full(pre) and _full(dec) and store.keys() == []


@pytest.mark.slow
def test_retry_in_processes_then_fallback(tiny_qwen3_dir, colocated_tokens, no_leftovers):
    """gloo: a lost layer is found by the timeout (the store's case, found when the prefill reports
    done, is the in-process test above); the launcher routes the retry to the prefill engine."""
    with PDCluster(tiny_qwen3_dir, "disaggregated", config=CONFIG, transport="gloo", fault="drop-once:1,drop:2",
                   transfer_timeout_s=2.0, start_timeout_s=WAIT_S) as c:
        recs = c.run([PDRequest(0.02 * i, p, 6) for i, p in enumerate(_prompts())], WAIT_S)
        stats = c.stats()
    assert [r.token_ids for r in recs] == colocated_tokens
    assert [r.retry is not None for r in recs] == [False, True, True, False]
    assert [r.fallback is not None for r in recs] == [False, False, True, False]
    assert "after a retry" in recs[2].fallback and recs[1].transfer["bytes"] > 0
    assert stats["decode"]["retries"] == 2 and stats["decode"]["fallbacks"] == 1 and stats["prefill"]["resends"] == 2
    assert all(s["free_blocks"] == s["num_blocks"] and not s["unfinished"] for s in stats.values())
    assert c.exit_codes == {"prefill": 0, "decode": 0}
