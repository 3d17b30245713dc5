"""Advanced lesson 07: context-parallel prefill with ring attention. Zigzag balances the causal
work; the ring's merge equals full attention; cp = 2 and 3 leave the single-process engine's K/V
in the pool and produce its tokens (fp32); every worker fault is a clear error within seconds
with nothing left running; the timeline validates; a second "machine" (lesson 17's node
launch on loopback) gives the same tokens, and a node that never joins is named."""
from __future__ import annotations

import gc
import os
import signal
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from advanced.adv07_context_parallel.engine import CPEngine
from advanced.adv07_context_parallel.ring import RingAttention, attend_chunk, attend_chunk_math
from advanced.adv07_context_parallel.worker import FAULT_ENV
from advanced.adv07_context_parallel.zigzag import imbalance, make_layout, split_even, work_per_rank
from minivllm_support.models import chat_prompt_ids
from minivllm_support.timeline import chrome_trace, validate_trace, write_chrome_trace
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step16_cuda_graph.cpu.engine import build_engine
from step17_tensor_parallel.control import RendezvousError
from step17_tensor_parallel.launch import NodeLaunch
from step17_tensor_parallel.workers import WorkerFailed
from tests.processes import free_port, gone, kill_tree, start_node


def _prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(5, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CONFIG = PagedSchedulerConfig(block_size=4, kv_cache_bytes=8 * 2**20, max_num_batched_tokens=64)


# ---- zigzag -------------------------------------------------------------------------------------
def test_zigzag_layout_covers_the_prompt_and_balances_the_work():
    for T, cp in [(203, 2), (203, 3), (48, 4), (6, 3)]:
        lay = make_layout(T, cp)
        got = sorted(p for r in range(cp) for p in lay.positions(r))
        assert got == list(range(T))                                   # every token once
        assert lay.rank_of_last_token() == 0                           # rank 0 samples
        sizes = [b - a for a, b in lay.chunks]
        assert max(sizes) - min(sizes) <= 1
        assert sum(work_per_rank(lay)) == T * (T + 1) // 2             # the whole causal triangle
    even = work_per_rank(make_layout(4096, 4))
    assert len(set(even)) == 1                                         # a multiple of 2cp: exactly even
    assert imbalance(work_per_rank(make_layout(4097, 3))) < 1.001
    contiguous = imbalance(work_per_rank(make_layout(4096, 4, zigzag=False)))
    assert contiguous == pytest.approx(7 / 4, rel=1e-3)                # the last piece: (2cp-1)/cp
    with pytest.raises(ValueError, match="5 tokens cannot be split over 6 chunks"):
        make_layout(5, 3)
    with pytest.raises(ValueError, match="context_parallel_size must be an int >= 1"):
        make_layout(10, 0)
    with pytest.raises(ValueError, match="cannot cut 2 tokens into 3"):
        split_even(2, 3)


# ---- the ring's merge against full attention ----------------------------------------------------
@pytest.mark.parametrize("cp,zigzag", [(1, True), (2, True), (3, True), (3, False)])
def test_ring_merge_equals_full_sdpa(cp, zigzag):
    T, Hq, Hkv, D = 37, 6, 2, 16
    g = torch.Generator().manual_seed(cp)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    full = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          is_causal=True, enable_gqa=True).transpose(0, 1)
    lay = make_layout(T, cp, zigzag)
    blocks = [torch.stack([k, v])[:, lay.positions(r)] for r in range(cp)]
    for rank in range(cp):
        ring = RingAttention(lay, rank, None)
        mine = lay.positions(rank)
        acc = {}
        for r in range(cp):                        # the rounds' order, without the processes
            src = (rank - r) % cp
            ring._attend(q[mine], blocks[src], src, acc, D ** -0.5)
        for chunk, rows in ring.rows.items():
            pos = list(range(*chunk))
            torch.testing.assert_close(acc[chunk][0], full[pos], atol=2e-6, rtol=1e-5)


def test_flash_chunk_equals_the_math_with_its_lse():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(9, 6, 8, generator=g), torch.randn(9, 3, 8, generator=g), torch.randn(9, 3, 8, generator=g)
    for causal in (True, False):
        o1, l1 = attend_chunk(q, k, v, causal, 0.3)
        o2, l2 = attend_chunk_math(q, k, v, causal, 0.3)
        torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)


# ---- engines: the single-process engine's K/V and tokens ----------------------------------------
@pytest.mark.slow          # ~8 s: CI runs it (make test-slow)
def test_cp2_and_cp3_leave_the_single_process_kv_and_tokens(tiny_qwen3_dir, tmp_path, no_leftovers):
    prompt = _prompt(203, 512)                       # not a multiple of 4 or 6 chunks
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = build_engine(load_model(tiny_qwen3_dir, torch.float32), CONFIG, use_graph=False)
    ref_seq = ref.add_request(prompt, sp)
    ref.step()                                       # chunked prefill: 64 tokens a step
    while ref_seq.num_computed_tokens < len(prompt):
        ref.step()
    table = torch.tensor(ref_seq.block_table)
    ref_kv = [ref.kv_pool.gather(layer, table, len(prompt)) for layer in range(2)]
    while ref.has_unfinished():
        ref.step()
    threads = torch.get_num_threads()
    for cp in (2, 3):
        with CPEngine(tiny_qwen3_dir, CONFIG, context_parallel_size=cp, dtype=torch.float32,
                      threads_per_rank=1, timeout_s=20, min_cp_tokens=32) as engine:
            seq = engine.add_request(prompt, sp)     # long enough: prefilled over the ring at once
            assert seq.num_computed_tokens == len(prompt) and len(seq.output_token_ids) == 1
            table = torch.tensor(seq.block_table)
            for layer in range(2):
                for got, want in zip(engine.kv_pool.gather(layer, table, len(prompt)), ref_kv[layer]):
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            while engine.has_unfinished():
                engine.step()
            assert seq.output_token_ids == ref_seq.output_token_ids
            info = engine.last_prefill
            stats = info["stats"]
            assert [s.pairs for s in stats] == [2 * w for w in work_per_rank(info["layout"])]   # 2 layers
            assert all(s.bytes_per_layer > 0 for s in stats)
            trace = chrome_trace(info["timelines"])
            assert validate_trace(trace) == []
            names = {e["name"] for e in trace["traceEvents"]}
            assert {"linears", "attention round 0", f"attention round {cp - 1}", "ring wait", "sample"} <= names
            assert {e["pid"] for e in trace["traceEvents"]} == set(range(cp))
            write_chrome_trace(info["timelines"], tmp_path / f"cp{cp}.json")
        assert engine.closed and all(not p.is_alive() for p in engine.workers)
        engine.close()                                   # idempotent
    assert torch.get_num_threads() == threads            # rank 0's thread count restored

@pytest.mark.slow
def test_cp2_equals_the_single_process_engine_on_smollm2(smol_dir, smol_tokenizer, no_leftovers):
    text = ("Here are some notes about the sea, the weather and the boats in the harbour. " * 7
            + "Summarise the notes in one sentence.")
    long = chat_prompt_ids(smol_tokenizer, text)
    short = chat_prompt_ids(smol_tokenizer, "Hi")
    assert len(long) % 4 and len(long) > 100
    sp = SamplingParams(temperature=0, max_tokens=10)
    config = PagedSchedulerConfig(block_size=16, kv_cache_bytes=64 * 2**20)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ref = build_engine(load_model(smol_dir, torch.float32), config, use_graph=False)
        want = [s.output_token_ids for s in ref.generate([long, short], sp)]
    finally:
        torch.set_num_threads(threads)
    with CPEngine(smol_dir, config, context_parallel_size=2, dtype=torch.float32, threads_per_rank=1,
         min_cp_tokens=64) as engine:
        seqs = engine.generate([long, short], sp)   # the long prompt over the ring, "Hi" the usual way
        assert engine.last_prefill["layout"].T == len(long)
        assert [s.output_token_ids for s in seqs] == want
    assert torch.get_num_threads() == threads


# ---- faults and shutdown ---------------------------------------------------------------------------
def _fail_within(engine, seconds: float, prompt) -> WorkerFailed:
    t0 = time.perf_counter()
    with pytest.raises(WorkerFailed) as info:
        engine.add_request(prompt, SamplingParams(max_tokens=2))
    assert time.perf_counter() - t0 < seconds
    assert engine.closed and all(not p.is_alive() for p in engine.workers)
    with pytest.raises(RuntimeError, match="closed"):
        engine.add_request(prompt, SamplingParams(max_tokens=2))
    return info.value


def test_worker_that_raises(tiny_qwen3_dir, monkeypatch, no_leftovers):
    monkeypatch.setenv(FAULT_ENV, "raise@2")             # the second prompt, inside layer 1's ring
    with CPEngine(tiny_qwen3_dir, CONFIG, context_parallel_size=2, dtype=torch.float32,
                  threads_per_rank=1, timeout_s=30, min_cp_tokens=8) as engine:
        engine.add_request(_prompt(40, 512), SamplingParams(max_tokens=2))     # healthy first
        error = _fail_within(engine, 10, _prompt(41, 512))
        assert "rank 1" in str(error) and "injected fault" in str(error) and "Traceback" in str(error)


@pytest.mark.slow
def test_worker_that_hangs_hits_the_timeout(tiny_qwen3_dir, monkeypatch, no_leftovers):
    monkeypatch.setenv(FAULT_ENV, "hang@1")
    with CPEngine(tiny_qwen3_dir, CONFIG, context_parallel_size=2, dtype=torch.float32,
                  threads_per_rank=1, timeout_s=2, min_cp_tokens=8) as engine:
        error = _fail_within(engine, 15, _prompt(40, 512))
        assert "not answering" in str(error)


def test_worker_that_is_killed_mid_prefill(tiny_qwen3_dir, monkeypatch, no_leftovers):
    monkeypatch.setenv(FAULT_ENV, "hang@1")             # keeps rank 0 waiting in the ring ...
    with CPEngine(tiny_qwen3_dir, CONFIG, context_parallel_size=2, dtype=torch.float32,
                  threads_per_rank=1, timeout_s=60, min_cp_tokens=8) as engine:
        killer = threading.Timer(0.5, os.kill, (engine.workers[0].pid, signal.SIGKILL))   # ... until killed
        killer.start()
        error = _fail_within(engine, 10, _prompt(40, 512))   # far less than the 60 s timeout
        killer.join()
        assert "rank 1: process ended (killed by signal 9)" in str(error)


def test_gc_leaves_nothing_and_bad_sizes_are_refused(tiny_qwen3_dir, no_leftovers):
    engine = CPEngine(tiny_qwen3_dir, CONFIG, context_parallel_size=2, dtype=torch.float32, threads_per_rank=1)
    workers = engine.workers
    del engine
    gc.collect()                                        # the finalizer stops the workers
    for p in workers:
        p.join(10)
        assert not p.is_alive()
    with pytest.raises(ValueError, match="context_parallel_size must be an int >= 1"):
        CPEngine(tiny_qwen3_dir, CONFIG, context_parallel_size=0)


# ---- two "machines" on loopback (lesson 17's NodeLaunch) ------------------------------------------
@pytest.mark.slow
def test_a_second_node_gives_the_same_tokens(tiny_qwen3_dir, no_leftovers):
    prompt, sp = _prompt(61, 512), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = build_engine(load_model(tiny_qwen3_dir, torch.float32), CONFIG, use_graph=False)
    want = ref.generate([prompt], sp)[0].output_token_ids
    port = free_port()
    node1 = start_node("advanced.adv07_context_parallel.node", tiny_qwen3_dir, port, "--context-parallel-size", "2",
                       "--timeout-s", "20")
    try:
        launch = NodeLaunch(nnodes=2, node_rank=0, master_port=port, rendezvous_timeout_s=30)
        with CPEngine(tiny_qwen3_dir, CONFIG, context_parallel_size=2, dtype=torch.float32, threads_per_rank=1,
                      timeout_s=20, min_cp_tokens=8, launch=launch) as engine:
            assert engine.workers == [] and engine.worker_set.ranks == [1]          # rank 1 lives on "node 1"
            assert engine.generate([prompt], sp)[0].output_token_ids == want
            assert engine.last_prefill["layout"].T == len(prompt)              # it went over the ring
            engine.zigzag = False           # contiguous: rank 1 holds the last token and sends its row
            seq = engine.prefill_prompt(prompt, sp)
            while engine.has_unfinished():
                engine.step()
            assert seq.output_token_ids == want
        out = gone(node1, 20)                                   # node 0 closed the run: node 1 ends, code 0
        assert node1.returncode == 0, out
    finally:
        kill_tree(node1)


def test_a_node_that_never_joins_is_named(tiny_qwen3_dir, no_leftovers):
    launch = NodeLaunch(nnodes=2, node_rank=0, master_port=free_port(), rendezvous_timeout_s=2)
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=r"node rank\(s\) \[1\] never joined"):
        CPEngine(tiny_qwen3_dir, CONFIG, context_parallel_size=2, dtype=torch.float32, launch=launch)
    assert time.monotonic() - t0 < 15
    with pytest.raises(ValueError, match="runs on node 0"):
        CPEngine(tiny_qwen3_dir, CONFIG, context_parallel_size=2, launch=NodeLaunch(2, 1, master_port=29500))
