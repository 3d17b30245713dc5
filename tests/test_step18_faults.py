"""Issue 28: a failing engine step fails only its own requests (lesson 18's front end and
faults.py); repeated faults or unbalanced books make the engine dead."""
import asyncio

import pytest
import torch

from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step15_flash_attention.engine import build_engine
from step18_benchmark.faults import EngineDead, FaultPlan, FaultPolicy, StepFailed, block_problems, inject_faults
from step18_benchmark.frontend import AsyncEngine

PROMPTS = [[5 + i, 17, 33 + i, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54 + i][: 10 + 3 * i]
           for i in range(4)]
SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_dir):
    return load_model(tiny_qwen3_dir, torch.float32)


def make(tiny, max_num_seqs=4):
    cfg = PagedSchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, block_size=4,
                               kv_cache_bytes=256 * 2**10)
    return build_engine(tiny, cfg, pack_weights=False)


async def _run_all(front: AsyncEngine, prompts, params=SP):
    async def one(ids):
        try:
            return [e.token_id async for e in front.generate(ids, params)]
        except Exception as e:  # noqa: BLE001 - the test looks at which error each request got
            return e
    return await asyncio.gather(*(one(p) for p in prompts))


def run_front(engine, prompts, **kw):
    front = AsyncEngine(engine, **kw)
    try:
        return asyncio.run(asyncio.wait_for(_run_all(front, prompts), 120)), front   # a hang fails, naming where
    finally:
        front.shutdown()


def is_the_victim(prompt):
    return lambda seq: seq.token_ids[:seq.num_prompt_tokens] == prompt


def test_a_failed_step_fails_only_its_requests_and_the_rest_finish_unchanged(tiny):
    """max_num_seqs=1: the step that holds request 2 holds nothing else; the waiting requests
    finish with the tokens they get without any fault, and every block comes back."""
    clean, _ = run_front(make(tiny, max_num_seqs=1), PROMPTS)
    engine = make(tiny, max_num_seqs=1)
    runner = inject_faults(engine, FaultPlan(when=is_the_victim(PROMPTS[2])))
    out, front = run_front(engine, PROMPTS)
    assert isinstance(out[2], StepFailed) and "injected fault" in str(out[2])
    assert [out[i] for i in (0, 1, 3)] == [clean[i] for i in (0, 1, 3)]
    assert runner.raised == 1 and front.error is None and front.faults == 1
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and block_problems(engine) == []
    assert not engine.has_unfinished()


@pytest.mark.parametrize("call", [1, 3])
def test_a_fault_after_the_kv_writes_leaves_no_poisoned_prefix_for_later_requests(tiny, call):
    """The forward runs (K/V written) and then the step raises; the step holds all four requests.
    Call 1 is their prefill: its blocks were written but never counted as computed, so none may
    be named in the prefix cache. Call 3 is a decode step: the prefill's full blocks were named
    two steps earlier and stay valid. Either way the same prompts sent again give the clean
    run's tokens."""
    clean, _ = run_front(make(tiny), PROMPTS)
    engine = make(tiny)
    inject_faults(engine, FaultPlan(at_calls={call}, after_forward=True))
    first, front = run_front(engine, PROMPTS)
    assert all(isinstance(o, StepFailed) for o in first) and front.error is None
    bm = engine.scheduler.block_manager
    assert (len(bm.cached) == 0) == (call == 1)
    assert block_problems(engine) == [] and bm.num_free_blocks == bm.num_blocks
    hits_before = bm.hit_tokens
    again, _ = run_front(engine, PROMPTS)
    assert again == clean
    assert (bm.hit_tokens > hits_before) == (call == 3)
    assert block_problems(engine) == []


def test_repeated_faults_make_the_engine_dead_and_new_requests_are_refused(tiny):
    engine = make(tiny, max_num_seqs=1)
    inject_faults(engine, FaultPlan(at_calls={1, 2, 3, 4, 5, 6}))
    dead_calls = []
    out, front = run_front(engine, PROMPTS, policy=FaultPolicy(max_faults=3, window_s=60), on_dead=dead_calls.append)
    assert [type(o) for o in out[:2]] == [StepFailed, StepFailed]
    assert all(isinstance(o, (StepFailed, EngineDead)) for o in out) and isinstance(out[3], EngineDead)
    assert isinstance(front.error, EngineDead) and "3 faults within 60 s" in str(front.error)
    assert len(dead_calls) == 1

    async def later():
        return [e async for e in front.generate(PROMPTS[0], SP)]
    with pytest.raises(EngineDead):
        asyncio.run(later())


def test_faults_spread_out_in_time_stay_isolated():
    policy = FaultPolicy(max_faults=3, window_s=60)
    assert [policy.record(t) for t in (0.0, 30.0, 61.0, 95.0)] == [False, False, False, False]
    assert policy.record(100.0) is True                     # 61, 95, 100: three within 60 s


def test_the_books_check_catches_a_corrupted_block_table(tiny):
    engine = make(tiny)
    for p in PROMPTS:
        engine.add_request(p, SP)
    engine.step()
    assert block_problems(engine) == []
    seq = engine.scheduler.running[0]
    bm = engine.scheduler.block_manager
    free_block = next(iter(bm.free_block_ids))
    seq.block_table.append(free_block)                     # a table that holds a free block
    problems = block_problems(engine)
    assert any(f"block {free_block}" in p for p in problems)
    seq.block_table.pop()
    bm.blocks[seq.block_table[0]].ref_count += 1           # a ref count nobody accounts for
    assert any("ref_count" in p for p in block_problems(engine))


def test_unbalanced_books_after_a_fault_make_the_engine_dead(tiny):
    """A fault whose step also corrupted the books (here: a ref count): not isolated, dead."""
    engine = make(tiny, max_num_seqs=1)

    def corrupt(seq):
        bm = engine.scheduler.block_manager
        bm.blocks[seq.block_table[0]].ref_count += 5
        return True
    inject_faults(engine, FaultPlan(when=lambda s: s.token_ids[:s.num_prompt_tokens] == PROMPTS[1] and corrupt(s)))
    out, front = run_front(engine, PROMPTS)
    assert isinstance(front.error, EngineDead) and "books" in str(front.error)
    assert isinstance(out[1], StepFailed) and all(isinstance(o, EngineDead) for o in out[2:])


def test_fault_plan_needs_a_runner_part():
    class NoRunner:
        pass
    with pytest.raises(TypeError, match="runner"):
        inject_faults(NoRunner(), FaultPlan(at_calls={1}))
