import pytest

from step06_sampler.params import SamplingParams
from step09_continuous_batching.scheduler import SchedulerConfig
from step09_continuous_batching.sequence import Sequence
from step10_chunked_prefill.engine import ChunkedPrefillEngine
from step10_chunked_prefill.scheduler import ChunkedPrefillScheduler


@pytest.mark.parametrize("budget", [1, 7, 4096])
def test_chunked_equals_naive(smol_fp32, engine_workload, budget):
    prompts, params, ref = engine_workload
    if budget == 1:                      # 1 token per step: slow, so a smaller slice of the workload
        prompts, params, ref = prompts[:2], params[:2], ref[:2]
    engine = ChunkedPrefillEngine(smol_fp32, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget))
    seqs = engine.generate(prompts, params)
    assert [s.output_token_ids for s in seqs] == ref


def test_decodes_first_then_chunks():
    s = ChunkedPrefillScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8))
    a = Sequence(list(range(1, 4)), SamplingParams())
    long = Sequence(list(range(1, 21)), SamplingParams())
    s.add(a)
    batch = s.schedule()
    assert batch.num_tokens == [3]
    a.num_computed_tokens = 3
    a.token_ids.append(5)
    s.add(long)                           # 20 > budget: accepted anyway, cut into chunks
    batch = s.schedule()
    assert batch.seqs == [a, long] and batch.num_tokens == [1, 7]
    a.num_computed_tokens += 1
    a.token_ids.append(6)
    long.num_computed_tokens += 7
    batch = s.schedule()
    assert batch.seqs == [a, long] and batch.num_tokens == [1, 7]
