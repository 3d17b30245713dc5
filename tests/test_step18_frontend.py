"""Lesson 18's async front end: concurrent streams get the synchronous engine's tokens, an
abandoned stream frees its KV blocks, and errors reach the callers."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.kv_pool import KVPool
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.engine import BatchedEngine
from step18_benchmark.frontend import AsyncEngine, collect


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_dir):
    return load_model(tiny_qwen3_dir, torch.float32)


def _engine(model, blocks=64, **kw) -> BatchedEngine:
    bpb = KVPool.bytes_per_block(model.config, 4, torch.float32)
    return BatchedEngine(model, PagedSchedulerConfig(block_size=4, kv_cache_bytes=blocks * bpb, max_num_seqs=4,
                                                     max_num_batched_tokens=32, **kw), pack_weights=False)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 500, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_concurrent_streams_equal_the_synchronous_engine(tiny):
    prompts = _prompts(10)
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True) for i in range(10)]
    ref = [s.output_token_ids for s in _engine(tiny).generate(prompts, params)]
    front = AsyncEngine(_engine(tiny))

    async def staggered(i):
        await asyncio.sleep(0.002 * i)             # requests join while others are running
        return await collect(front, prompts[i], params[i])

    async def main():
        return await asyncio.gather(*(staggered(i) for i in range(10)))
    try:
        assert asyncio.run(main()) == ref
    finally:
        front.shutdown()


def test_driven_from_the_main_thread_equals_the_synchronous_engine(tiny):
    """threaded=False: the engine loop runs in this thread, the event loop in a helper one."""
    prompts = _prompts(6, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=5 + i, ignore_eos=True) for i in range(6)]
    ref = [s.output_token_ids for s in _engine(tiny).generate(prompts, params)]
    front = AsyncEngine(_engine(tiny), threaded=False)
    main_thread = threading.get_ident()

    async def main():
        assert threading.get_ident() != main_thread          # the event loop is the helper's
        return await asyncio.gather(*(collect(front, p, sp) for p, sp in zip(prompts, params)))
    assert front.drive(lambda: asyncio.run(main())) == ref
    assert not front.engine.has_unfinished()
    with pytest.raises(ZeroDivisionError):                   # what fn raised reaches the caller
        front.drive(lambda: 1 / 0)
    front.shutdown()


def test_abandoned_stream_is_aborted_and_frees_its_blocks(tiny):
    engine = _engine(tiny)
    front = AsyncEngine(engine)

    async def main():
        got = []
        async for event in front.generate(_prompts(1)[0], SamplingParams(max_tokens=200, ignore_eos=True)):
            got.append(event)
            if len(got) == 3:
                break                               # the client hangs up
        other = await collect(front, [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        return got, other
    try:
        got, other = asyncio.run(main())
        assert len(got) == 3 and not got[-1].finished and len(other) == 4
        deadline = time.time() + 5
        while engine.has_unfinished() and time.time() < deadline:
            time.sleep(0.01)
        assert not engine.has_unfinished()
        assert engine.scheduler.num_used_blocks == 0       # every block back in the pool
    finally:
        front.shutdown()


def test_bad_request_errors_reach_only_its_caller(tiny):
    front = AsyncEngine(_engine(tiny))

    async def main():
        bad = collect(front, [10_000], SamplingParams(max_tokens=3))            # token id outside the vocabulary
        good = collect(front, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        return await asyncio.gather(bad, good, return_exceptions=True)
    try:
        bad, good = asyncio.run(main())
        assert isinstance(bad, ValueError) and "10000" in str(bad)
        assert len(good) == 3
    finally:
        front.shutdown()


def test_a_failure_outside_a_known_batch_fails_every_request_in_flight_and_the_front_end_goes_on(tiny):
    """Lesson 14's engine keeps no `current_batch` (lesson 15's does: test_step18_faults.py):
    a step that raises then takes every request in flight with it, the books are checked, and
    the front end serves the next request. With max_faults=1 the first fault is fatal."""
    from step18_benchmark.faults import EngineDead, FaultPolicy, StepFailed
    for max_faults in (3, 1):
        engine = _engine(tiny)
        real_step, calls = engine.step, []

        def failing_step():
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("boom in step")
            return real_step()
        engine.step = failing_step
        front = AsyncEngine(engine, policy=FaultPolicy(max_faults=max_faults))

        async def main():
            runs = [collect(front, p, SamplingParams(max_tokens=50, ignore_eos=True)) for p in _prompts(3)]
            return await asyncio.gather(*runs, return_exceptions=True)

        async def after():
            return await collect(front, [5, 6], SamplingParams(max_tokens=2))
        try:
            results = asyncio.run(main())
            assert all(isinstance(r, StepFailed) and "boom" in str(r) for r in results)
            assert engine.scheduler.num_used_blocks == 0
            if max_faults == 3:
                assert front.error is None and len(asyncio.run(after())) == 2
            else:
                assert isinstance(front.error, EngineDead)
                with pytest.raises(EngineDead, match="dead"):
                    asyncio.run(after())
        finally:
            front.shutdown()
