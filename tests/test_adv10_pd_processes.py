"""Advanced 10 as processes: the prefill and decode engines apart (1:1 on the store and on
gloo, 2:2), the faults that end in a counted local recompute or a clear error, and the embedded
model in one process. The shared helpers and the colocated reference are the first file's."""
from __future__ import annotations

import pytest
import torch

from advanced.adv10_pd_disaggregation.cluster import EngineFailed, PDCluster
from advanced.adv10_pd_disaggregation.connector import prompt_key
from advanced.adv10_pd_disaggregation.engines import build_pd_engine
from advanced.adv10_pd_disaggregation.records import PDRequest
from step04_transformer.loader import load_model
from step12_paged_attention.scheduler import PagedSchedulerConfig
from tests.test_adv10_pd_disaggregation import (BS, CONFIG, LENGTHS, WAIT_S, _engines, _full, _params,  # noqa: F401
                                                _prefill_all, _prompts, colocated_tokens)


# ---- processes ---------------------------------------------------------------------------------------
def _requests(gap_s: float = 0.02) -> list[PDRequest]:
    return [PDRequest(gap_s * i, p, 6) for i, p in enumerate(_prompts())]


def _all_full(stats: dict) -> bool:
    return all(s["free_blocks"] == s["num_blocks"] and not s["unfinished"] for s in stats.values())


def test_two_processes_give_the_colocated_tokens(tiny_qwen3_dir, colocated_tokens, no_leftovers):
    with PDCluster(tiny_qwen3_dir, "disaggregated", config=CONFIG, start_timeout_s=WAIT_S) as c:
        recs = c.run(_requests(), WAIT_S)
        stats, timelines = c.stats(), c.timelines()
    assert [r.token_ids for r in recs] == colocated_tokens
    assert all(r.fallback is None and r.prefill_done is not None for r in recs)
    for rec, n in zip(recs, LENGTHS):            # blocks holding all but the last prompt token, 2 layers
        per_block = 2 * 2 * 2 * BS * 16 * 4      # K and V, layers, kv heads, slots, head dim, fp32
        assert rec.transfer["bytes"] == -(-(n - 1) // BS) * per_block
        assert rec.transfer["first_layer"] <= rec.transfer["landed"] <= rec.token_times[0]
    assert _all_full(stats) and stats["decode"]["fallbacks"] == 0
    names = {s.name for tl in timelines for s in tl.spans}
    assert {"prefill step", "decode step", "save L0", "load L1"} <= names
    assert c.exit_codes == {"prefill": 0, "decode": 0} and not c.root.exists()


@pytest.mark.slow
def test_lost_layer_then_prefill_killed_fall_back_on_decode(tiny_qwen3_dir, colocated_tokens, no_leftovers):
    with PDCluster(tiny_qwen3_dir, "disaggregated", config=CONFIG, fault="drop:0,exit-prefill:2",
                   start_timeout_s=WAIT_S) as c:
        recs = c.run(_requests(gap_s=0.3), WAIT_S)          # apart: one request per prefill step
        stats = c.stats()
        assert "exited with code 3" in (c.prefill_lost or "")
    assert [r.token_ids for r in recs] == colocated_tokens
    assert "layer 1 never arrived" in recs[0].fallback                # lost on the way, the prefill lived on
    assert recs[1].fallback is None and recs[1].transfer is not None
    assert "exited with code 3" in recs[2].fallback                   # killed mid-transfer
    assert "exited with code 3" in recs[3].fallback                   # after it: no prefill engine at all
    assert list(stats) == ["decode"] and _all_full(stats) and stats["decode"]["fallbacks"] >= 2


@pytest.mark.slow
def test_gloo_transport_gives_the_colocated_tokens_and_counts_a_lost_layer(tiny_qwen3_dir, colocated_tokens,
                                                                         no_leftovers):
    with PDCluster(tiny_qwen3_dir, "disaggregated", config=CONFIG, transport="gloo", fault="drop:1",
                   transfer_timeout_s=2.0, start_timeout_s=WAIT_S) as c:
        recs = c.run(_requests(), WAIT_S)
        stats = c.stats()
    assert c.exit_codes == {"prefill": 0, "decode": 0}                 # the receiver thread ended cleanly
    assert [r.token_ids for r in recs] == colocated_tokens
    assert [r.fallback is not None for r in recs] == [False, True, False, False]
    assert "layer 1 did not arrive within 2 s" in recs[1].fallback       # gloo: found by the timeout
    assert all(r.transfer["bytes"] > 0 for i, r in enumerate(recs) if i != 1)
    assert _all_full(stats) and stats["decode"]["fallbacks"] == 1


@pytest.mark.slow
def test_two_prefill_and_two_decode_engines(tiny_qwen3_dir, colocated_tokens, no_leftovers):
    with PDCluster(tiny_qwen3_dir, "disaggregated", config=CONFIG, num_prefill=2, num_decode=2,
                   start_timeout_s=WAIT_S) as c:
        recs = c.run(_requests(gap_s=0.0), WAIT_S)                 # all at once: the router spreads them
        stats = c.stats()
    assert [r.token_ids for r in recs] == colocated_tokens
    assert {r.prefill_on for r in recs} == {"prefill-0", "prefill-1"}
    assert {r.decode_on for r in recs} == {"decode-0", "decode-1"}
    assert all(r.fallback is None and r.transfer for r in recs)
    assert sorted(stats) == ["decode-0", "decode-1", "prefill-0", "prefill-1"] and _all_full(stats)
    with pytest.raises(ValueError, match="exactly one of each with the gloo transport"):
        PDCluster(tiny_qwen3_dir, transport="gloo", num_prefill=2)


@pytest.mark.slow
def test_decode_killed_is_a_clear_error_and_nothing_is_left(tiny_qwen3_dir, no_leftovers):
    with pytest.raises(EngineFailed, match=r"the decode engine \(pid \d+\) exited with code 3"):
        with PDCluster(tiny_qwen3_dir, "disaggregated", config=CONFIG, fault="exit-decode:1",
                       start_timeout_s=WAIT_S) as c:
            c.run(_requests(), WAIT_S)
    assert c.procs == [] and not c.root.exists()


@pytest.mark.slow
def test_smollm2_disaggregated_equals_colocated(smol_dir, smol_prompts, tmp_path, one_thread):
    params, config = _params(8), PagedSchedulerConfig(block_size=16, kv_cache_bytes=32 << 20)
    _, store, pre, dec = _engines(smol_dir, tmp_path, config=config)
    col = build_pd_engine(load_model(smol_dir, torch.float32), "colocated", config=config)
    want = [s.output_token_ids for s in col.generate(smol_prompts, params)]
    _prefill_all(pre, smol_prompts)
    seqs = [dec.add_consumer(rid, p, params, prompt_key(p, rid)) for rid, p in enumerate(smol_prompts)]
    while dec.has_unfinished():
        dec.step()
    assert [s.output_token_ids for s in seqs] == want
    assert dec.fallbacks == [] and dec.prompt_tokens == len(smol_prompts) and _full(pre) and _full(dec)
