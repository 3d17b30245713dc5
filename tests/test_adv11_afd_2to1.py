"""Advanced lesson 11 at 2 attention ranks : 1 FFN rank. The split of a step by owner; the cost
model's layer with two attention ranks; the engine giving the single-process tokens (fp32) with
requests that leave one attention rank idle while the other works; a killed peer or FFN process a
clear error in seconds with nothing left running."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from minivllm_support.timeline import chrome_trace, validate_trace
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step09_continuous_batching.scheduler import ScheduledBatch
from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step16_cuda_graph.cpu.engine import build_engine
from step17_tensor_parallel.workers import WorkerFailed
from advanced.adv11_afd.costmodel import LayerCost, StepShape, layer_times, measured_loops, step_shapes
from advanced.adv11_afd.engine import AFDEngine
from advanced.adv11_afd.owned_cache import OwnedPrefixBlockManager
from advanced.adv11_afd.runner import split_by_owner


def _prompts(vocab: int, lengths, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


def _config() -> PagedSchedulerConfig:
    return PagedSchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, kv_cache_bytes=2**20)


def test_split_by_owner_keeps_batch_order_and_rows():
    seqs = [Sequence(list(range(5, 9)), SamplingParams()) for _ in range(4)]
    batch = ScheduledBatch(seqs, [3, 1, 2, 1])
    parts = split_by_owner(batch, 2)
    assert [len(p.seqs) for p, _ in parts] == [2, 2]
    by_rank = {s.seq_id % 2: [] for s in seqs}
    for s in seqs:
        by_rank[s.seq_id % 2].append(s)
    for a, (part, rows) in enumerate(parts):
        assert part.seqs == by_rank[a]                                     # owner = seq_id % 2, order kept
    starts = [0, 3, 4, 6]
    want = {a: [r for s, n, st in zip(seqs, batch.num_tokens, starts) if s.seq_id % 2 == a for r in range(st, st + n)]
            for a in (0, 1)}
    assert [rows.tolist() for _, rows in parts] == [want[0], want[1]]
    assert split_by_owner(ScheduledBatch(seqs[:1], [2]), 2)[1 - seqs[0].seq_id % 2][0].seqs == []   # one idle


def test_cost_model_layer_with_two_attention_ranks():
    attn, ffn, hop = LayerCost(0.0, 1.0), LayerCost(1.0, 3.0), 0.5
    two = StepShape(0, 1, [(2, 0)], peers=[[(2, 0)]])                      # each attention rank: 2 tokens
    # attention ranks in parallel (2 each), one FFN call on 4 rows: 1 + 12 = 13, chain 2 + 13 + 0.5
    assert layer_times(two, attn, ffn, hop, 1) == (15.5, 2, 13)
    idle = StepShape(0, 1, [], peers=[[(4, 0)]])                           # rank 0 idle this step
    assert layer_times(idle, attn, ffn, hop, 1) == (4 + 13 + 0.5, 4, 13)


@pytest.fixture(scope="module")
def two_to_one_case(tiny4):
    """Requests whose lengths leave first one attention rank, then the other, working alone."""
    waves = [_prompts(512, (9, 33, 5, 21)), _prompts(512, (14, 6, 40, 3), seed=4)]
    lengths = [[14, 2, 14, 3], [2, 12, 3, 12]]                             # owners alternate with seq_id
    sps = [[SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in w] for w in lengths]
    ref_engine = build_engine(load_model(tiny4, torch.float32), _config(), use_graph=False)
    refs = [[s.output_token_ids for s in ref_engine.generate(p, sp)] for p, sp in zip(waves, sps)]
    return waves, sps, refs


@pytest.mark.slow
def test_two_to_one_equals_single_process_with_idle_ranks(tiny4, two_to_one_case, no_leftovers):
    """2:1 at m = 1 and 2: one process's tokens, token for token (fp32), while the requests of one
    attention rank finish first (its rank idles, the FFN serves the other alone), then of the other;
    the second pass finds the prompts in each rank's own prefix cache."""
    waves, sps, refs = two_to_one_case
    with AFDEngine(tiny4, _config(), num_attention=2, dtype=torch.float32, timeout_s=20) as engine:
        assert engine.world == 3 and len(engine.workers) == 2
        for m in (1, 2):
            engine.set_micro_batches(m)
            for prompts, sp, ref in zip(waves, sps, refs):
                seqs = engine.generate(prompts, sp)
                assert [s.output_token_ids for s in seqs] == ref, m
                assert len({s.seq_id % 2 for s in seqs}) == 2                 # both ranks had requests
        assert engine.scheduler.block_manager.hit_tokens > 0                # m = 2 found m = 1's prompts, per rank
        tls = engine.collect_timelines()
        assert validate_trace(chrome_trace(tls)) == [] and len(tls) == 3
        shapes = step_shapes(tls[0], [tls[2]])
        assert any(not s.micro_batches and s.peers[0] for s in shapes)      # rank 0 idle, the peer working
        assert any(s.micro_batches and not s.peers[0] for s in shapes)      # and the other way round
        ffn_rows = {(s.args["step"], s.args["layer"], s.args["micro_batch"]): s.args["tokens"]
                    for s in tls[1].spans if s.cat == "compute"}
        both = [s for s in shapes if s.micro_batches and s.peers[0] and s.layers]
        assert both and all(ffn_rows[(s.step, 0, 0)] == s.micro_batches[0][0] + s.peers[0][0][0] for s in both)
        assert measured_loops(tls).seconds > 0


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["peer", "ffn"])
def test_two_to_one_killed_process_is_a_clear_error(tiny4, victim, no_leftovers):
    with AFDEngine(tiny4, _config(), num_attention=2, dtype=torch.float32, timeout_s=20) as engine:
        rank = 2 if victim == "peer" else 1
        proc = next(p for p in engine.workers if p.name == f"afd-rank-{rank}")
        for prompt in _prompts(512, (20, 30, 40, 25)):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        killer = threading.Timer(0.3, os.kill, (proc.pid, signal.SIGKILL))
        killer.start()
        t0 = time.perf_counter()
        with pytest.raises(WorkerFailed) as info:
            for _ in range(100_000):
                engine.step()
        killer.join()
        assert time.perf_counter() - t0 < 15
        assert f"rank {rank}: process ended (killed by signal 9)" in str(info.value)
        assert engine.closed and not any(w.is_alive() for w in engine.workers)


def test_each_attention_rank_has_its_own_prefix_cache():
    """One block-id space, one cache per rank: a prefix cached by one rank's sequence serves a later
    sequence of that rank, never one of the other rank (whose pool holds nothing at those ids);
    eviction removes a hash from the map of the rank that cached it."""
    bm = OwnedPrefixBlockManager(num_blocks=6, block_size=4, n_attention=2)
    prompt = list(range(10, 23))                                            # 13 tokens: 3 full blocks

    def run(seq: Sequence) -> None:                                         # admit, compute, cache, finish
        bm.match_prefix(seq)
        bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)

    seqs = [Sequence(list(prompt), SamplingParams()) for _ in range(4)]
    first = seqs[0]
    same = next(s for s in seqs[1:] if s.seq_id % 2 == first.seq_id % 2)
    other = next(s for s in seqs[1:] if s.seq_id % 2 != first.seq_id % 2)
    run(first)
    assert bm.match_prefix(other) == 0                                      # the other rank: nothing cached
    bm.free(other)
    assert bm.match_prefix(same) == 12                                      # its own rank: 3 blocks reused
    assert bm.table(same) == first.block_table[:3]
    bm.free(same)
    bm.free(first)
    other = Sequence(list(prompt), SamplingParams())
    other = other if other.seq_id % 2 != first.seq_id % 2 else Sequence(list(prompt), SamplingParams())
    run(other)                                        # takes 2 never-used blocks and 2 of first's: evicts one
    assert [len(c) for c in bm.caches][::1 if other.seq_id % 2 else -1] == [2, 3] and bm.num_free_blocks == 2
    assert set(bm.rank_of_block) == set(bm.hash_of) and all(
        bm.caches[r][bm.hash_of[b]] == b for b, r in bm.rank_of_block.items())
