import pytest

from step06_sampler.params import SamplingParams
from step09_continuous_batching.sequence import Sequence, SequenceStatus
from step11_preemption.engine import PreemptingEngine
from step11_preemption.scheduler import PreemptingScheduler, PreemptionSchedulerConfig


def test_tiny_budget_preempts_and_matches_naive(smol_fp32, engine_workload):
    prompts, params, ref = engine_workload
    longest = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params))
    engine = PreemptingEngine(smol_fp32, PreemptionSchedulerConfig(
        max_num_seqs=6, max_num_batched_tokens=64, max_kv_tokens=longest + 16))
    seqs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert [s.output_token_ids for s in seqs] == ref


def test_seeded_sampling_survives_preemption(smol_fp32, engine_workload):
    prompts = engine_workload[0]
    sp = [SamplingParams(temperature=0.8, max_tokens=12, seed=i, ignore_eos=True) for i in range(4)]
    roomy = PreemptingEngine(smol_fp32, PreemptionSchedulerConfig(max_kv_tokens=4096))
    tight = PreemptingEngine(smol_fp32, PreemptionSchedulerConfig(max_kv_tokens=110))
    a = roomy.generate(prompts[:4], sp)
    b = tight.generate(prompts[:4], sp)
    assert tight.scheduler.num_preemptions > 0
    assert [s.output_token_ids for s in a] == [s.output_token_ids for s in b]


def test_impossible_request_is_rejected(smol_fp32):
    engine = PreemptingEngine(smol_fp32, PreemptionSchedulerConfig(max_kv_tokens=32))
    with pytest.raises(ValueError, match="could never finish"):
        engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=8))
    assert not engine.has_unfinished()


def test_newest_is_preempted_to_front_of_queue():
    s = PreemptingScheduler(PreemptionSchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_kv_tokens=10))
    a = Sequence([1, 2, 3, 4], SamplingParams(max_tokens=6))
    b = Sequence([1, 2, 3, 4], SamplingParams(max_tokens=6))
    c = Sequence([9], SamplingParams(max_tokens=2))
    for q in (a, b, c):
        s.add(q)
    batch = s.schedule()
    assert batch.seqs == [a, b, c] and batch.num_tokens == [4, 4, 1]
    for q, n in zip(batch.seqs, batch.num_tokens):
        q.num_computed_tokens += n
        q.token_ids.append(0)
    batch = s.schedule()   # 9 of 10 held: a takes the last slot, b needs one more, so c yields
    assert batch.seqs == [a, b] and batch.num_tokens == [1, 1]
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert s.waiting[0] is c and s.running == [a, b]
