"""Advanced lesson 03, sampling: speculative decoding samples from the target's distribution
(chi-square on a 16-token model, with both proposers, seeded and not), and the test has power:
it catches a broken rejection rule."""
from __future__ import annotations

import itertools

import pytest
import torch

from advanced.adv03_speculative import rejection
from advanced.adv03_speculative.proposers import LayerSkipProposer
from minivllm_support.tiny import build_tiny_qwen3
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step06_sampler.sampler import Sampler, exponential_race
from step06_sampler.stats import chi2_critical, frequency_test
from tests.test_adv03_speculative import ALPHA, PROPOSERS, _config, spec_engine

# ---- sampling: the target's distribution -----------------------------------------------------
V = 16


@pytest.fixture(scope="module")
def tiny16(tmp_path_factory):
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny16"), vocab_size=V, initializer_range=0.2)


PROMPT16 = [5, 9, 3, 12, 5, 9, 7, 3, 12, 14, 6, 5, 9]
SP16 = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def joint16(tiny16):
    """P(t1, t2, t3, t4) of the target, exactly: HF transformers on every prefix, lesson 06's probs."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tiny16), dtype=torch.float32).eval()

    def probs(prefixes):
        logits = hf(torch.tensor([PROMPT16 + list(x) for x in prefixes])).logits[:, -1].float()
        return Sampler().probs(logits, [SP16] * len(prefixes))

    joint = probs([()])[0]
    for depth in range(1, 4):
        nxt = probs(list(itertools.product(range(V), repeat=depth))).view(*([V] * depth), V)
        joint = joint.unsqueeze(-1) * nxt
    return joint.flatten()


def _sample_joint(model, proposer, n, seeded: bool):
    config = _config(model, blocks=n * 5 + 10, max_num_seqs=n, max_num_batched_tokens=n * len(PROMPT16))
    engine = spec_engine(model, config, proposer=proposer, num_speculative_tokens=3)
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=i) for i in range(n)] \
        if seeded else [SP16] * n
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        outs = torch.tensor([s.output_token_ids for s in engine.generate([PROMPT16] * n, params)])
    return ((outs[:, 0] * V + outs[:, 1]) * V + outs[:, 2]) * V + outs[:, 3], engine.spec


@pytest.mark.parametrize("proposer,seeded", [("ngram", False), ("skip1", True)])
def test_sampled_tokens_follow_the_target_distribution(tiny16, joint16, proposer, seeded, one_thread):
    """The first four tokens, jointly (t2 .. t4 come from verification steps: 2 drafts and a bonus)."""
    model = load_model(tiny16, torch.float32)
    samples, spec = _sample_joint(model, PROPOSERS[proposer](), 4000, seeded)
    assert spec.drafted > 2000 and 0.05 < spec.acceptance_rate < 0.95      # both branches, many times
    res = frequency_test(samples, joint16)
    assert res["impossible"] == 0 and res["statistic"] < chi2_critical(res["df"], ALPHA), res


def test_chi_square_catches_a_wrong_rejection_rule(tiny16, joint16, monkeypatch, one_thread):
    """The test above has power: resampling from p (instead of max(0, p - q)) after a rejection
    over-weights the drafts, and the same chi-square rejects it."""
    right = rejection.rejection_sample

    def wrong(p, draft, q, generator):
        tokens, a = right(p, draft, q, generator)
        if a < len(draft):
            tokens[-1] = int(exponential_race(p[a][None], [generator])[0])
        return tokens, a

    monkeypatch.setattr(rejection, "rejection_sample", wrong)
    samples, _ = _sample_joint(load_model(tiny16, torch.float32), LayerSkipProposer(1), 4000, False)
    res = frequency_test(samples, joint16)
    assert res["statistic"] > chi2_critical(res["df"], ALPHA), res
