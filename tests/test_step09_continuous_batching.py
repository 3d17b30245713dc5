import pytest

from step06_sampler.params import SamplingParams
from step07_kv_cache.generate import generate_cached
from step09_continuous_batching.engine import LLMEngine
from step09_continuous_batching.scheduler import Scheduler, SchedulerConfig
from step09_continuous_batching.sequence import Sequence, SequenceStatus


def test_engine_equals_naive(smol_fp32, engine_workload):
    prompts, params, ref = engine_workload
    engine = LLMEngine(smol_fp32, SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=120))
    seqs = engine.generate(prompts, params)
    assert [s.output_token_ids for s in seqs] == ref
    assert all(s.is_finished and s.kv_cache is None for s in seqs)


def test_seeded_request_same_alone_or_batched(smol_fp32, engine_workload):
    prompts = engine_workload[0]
    sp = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, seed=42, ignore_eos=True)
    alone = generate_cached(smol_fp32, prompts[3], sp).token_ids
    engine = LLMEngine(smol_fp32, SchedulerConfig(max_num_seqs=4))
    noise = [SamplingParams(temperature=1.0, max_tokens=n, seed=n) for n in (3, 9, 5)]
    seqs = engine.generate([prompts[0], prompts[3], prompts[1], prompts[4]], [noise[0], sp, noise[1], noise[2]])
    assert seqs[1].output_token_ids == alone


def _seq(n_prompt: int, max_tokens: int = 4) -> Sequence:
    return Sequence(list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens))


def test_scheduler_fcfs_and_limits():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=10))
    a, b, c = _seq(4), _seq(5), _seq(3)
    for q in (a, b, c):
        s.add(q)
    batch = s.schedule()                     # prefill a and b (9 tokens), c must wait for a seat
    assert batch.seqs == [a, b] and batch.num_tokens == [4, 5]
    assert a.status is b.status is SequenceStatus.RUNNING and c.status is SequenceStatus.WAITING
    for q, n in zip(batch.seqs, batch.num_tokens):
        q.num_computed_tokens += n
        q.token_ids.append(0)
    batch = s.schedule()                     # no seat: decode both
    assert batch.seqs == [a, b] and batch.num_tokens == [1, 1]
    s.finish(a, "stop")
    assert a.status is SequenceStatus.FINISHED and a not in s.running
    batch = s.schedule()                     # a's seat goes to c, as a prefill step
    assert batch.seqs == [c] and list(s.waiting) == []


def test_token_budget_holds_back_prompts():
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10))
    a, b = _seq(6), _seq(6)
    s.add(a)
    s.add(b)
    assert s.schedule().seqs == [a]          # 6 + 6 > 10: b waits, order kept
    assert s.waiting[0] is b


def test_prompt_over_budget_is_rejected():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=8))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        s.add(_seq(9))


def test_bad_config_and_requests(smol_fp32):
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    engine = LLMEngine(smol_fp32)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.generate([[1, 2]], [SamplingParams(), SamplingParams()])
