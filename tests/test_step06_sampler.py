"""Lesson 06: the sampler draws from exactly the distribution it claims to, reproducibly."""
import math

import pytest
import torch

from step06_sampler import (SamplingParams, Sampler, apply_min_p, apply_temperature, apply_top_k,
                            apply_top_p, exponential_race, make_generator)
from step06_sampler.stats import chi2_critical, chi2_sf, chi_square, frequency_test

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ALPHA = 1e-3          # a fixed seed makes each test deterministic; alpha bounds a false alarm
INF = float("-inf")


def kept(logits: torch.Tensor) -> list[list[int]]:
    """Token ids left finite, per row."""
    return [torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in logits]


# A hand-made distribution, shuffled so that "most likely" is not "lowest id":
# token:   0     1     2     3     4
# prob:  0.10  0.50  0.05  0.20  0.15
PROBS5 = torch.tensor([[0.10, 0.50, 0.05, 0.20, 0.15]])
LOGITS5 = PROBS5.log()


# ----------------------------------------------------------------------------- params

def test_params_defaults_and_greedy():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.max_tokens) == (1.0, -1, 1.0, 0.0, 16)
    assert p.stop_token_ids == [] and p.ignore_eos is False and p.seed is None
    assert SamplingParams().stop_token_ids is not p.stop_token_ids   # no shared default list
    assert SamplingParams(temperature=0).greedy and not p.greedy


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_k", -2), ("top_k", 2.5), ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5),
    ("min_p", -0.01), ("min_p", 1.5), ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 1.5),
    ("stop_token_ids", [1, -1]), ("stop_token_ids", "12"), ("seed", 1.5), ("ignore_eos", "yes"),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_finish_reason():
    p = SamplingParams(max_tokens=3, stop_token_ids=[7])
    assert p.finish_reason(5, 1, eos_token_id=2) is None
    assert p.finish_reason(2, 1, eos_token_id=2) == "stop"
    assert p.finish_reason(7, 2, eos_token_id=2) == "stop"
    assert p.finish_reason(5, 3, eos_token_id=2) == "length"
    q = SamplingParams(ignore_eos=True, stop_token_ids=[7])
    assert q.finish_reason(2, 1, eos_token_id=2) is None
    assert q.finish_reason(7, 1, eos_token_id=2) == "stop"
    assert p.finish_reason(9, 1, eos_token_id=[2, 9]) == "stop"        # several EOS ids
    assert p.finish_reason(9, 1, eos_token_id=None) is None


# ----------------------------------------------------------------------------- the statistics

def test_chi2_tail_matches_closed_forms():
    for x in [0.05, 0.7, 2.0, 9.0, 30.0]:
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-10, abs=1e-300)
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-10)
        assert chi2_sf(x, 4) == pytest.approx(math.exp(-x / 2) * (1 + x / 2), rel=1e-10)
    for df, alpha in [(1, 0.05), (7, 0.001), (30, 0.01)]:
        assert chi2_sf(chi2_critical(df, alpha), df) == pytest.approx(alpha, rel=1e-8)
    assert chi_square([10, 10], [10, 10]) == (0.0, 1)


# ----------------------------------------------------------------------------- filters, exact

def test_temperature_divides_rows_and_leaves_greedy_rows():
    logits = torch.tensor([[1.0, 2.0, 4.0]] * 3)
    out = apply_temperature(logits, torch.tensor([0.5, 2.0, 0.0]))
    assert torch.equal(out, torch.tensor([[2.0, 4.0, 8.0], [0.5, 1.0, 2.0], [1.0, 2.0, 4.0]]))
    assert out.dtype == torch.float32


def test_top_k_exact():
    logits = LOGITS5.repeat(4, 1)
    out = apply_top_k(logits, torch.tensor([1, 2, 0, -1]))
    assert kept(out) == [[1], [1, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    assert torch.equal(out[0, 1], logits[0, 1])               # kept logits are unchanged
    # Ties with the k-th value are all kept (documented): k=2 keeps the three 2.0s.
    tied = apply_top_k(torch.tensor([[2.0, 5.0, 2.0, 2.0, 0.0]]), torch.tensor([2]))
    assert kept(tied) == [[0, 1, 2, 3]]


def test_top_p_exact():
    # Sorted: 1 (0.50), 3 (0.20), 4 (0.15), 0 (0.10), 2 (0.05); mass before each: 0, .5, .7, .85, .95
    ps = torch.tensor([0.01, 0.3, 0.6, 0.8, 0.9, 0.99, 1.0])
    out = apply_top_p(LOGITS5.repeat(len(ps), 1), ps)
    assert kept(out) == [[1], [1], [1, 3], [1, 3, 4], [0, 1, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    # Only the top token survives even when it alone has almost all of the mass... and p is tiny.
    assert kept(apply_top_p(torch.tensor([[0.0, 30.0, 0.0]]), torch.tensor([1e-6]))) == [[1]]


def _top_p_by_full_sort(logits, p):
    """The textbook definition, one row at a time: sort everything, cut where the mass reaches p."""
    out = logits.clone()
    for row, pr in zip(out, p.tolist()):
        probs = row.softmax(-1)
        order = probs.argsort(descending=True)
        before = torch.cumsum(probs[order], 0) - probs[order]
        drop = order[1:][before[1:] >= pr] if pr < 1 else order[:0]
        row[drop] = INF
    return out


def test_top_p_fast_path_equals_full_sort():
    """apply_top_p looks at the top 64, then 512, ... tokens; the answer must not change."""
    torch.manual_seed(5)
    flat = torch.randn(4, 20_000) * 0.1                        # needs thousands of tokens
    peaked = torch.randn(4, 20_000) * 4                        # needs a handful
    logits = torch.cat([flat, peaked])
    p = torch.tensor([0.3, 0.9, 0.999, 1.0, 0.3, 0.9, 0.999, 1.0])
    fast = apply_top_p(logits, p)
    assert kept(fast) == kept(_top_p_by_full_sort(logits, p))
    assert len(kept(fast)[2]) > 512 and len(kept(fast)[4]) < 64    # both paths were exercised


def test_min_p_exact():
    # Threshold = min_p * 0.5: 0.35 -> 0.175 keeps {0.5, 0.2}; 0.25 -> 0.125 adds 0.15.
    out = apply_min_p(LOGITS5.repeat(4, 1), torch.tensor([0.35, 0.25, 0.0, 1.0]))
    assert kept(out) == [[1, 3], [1, 3, 4], [0, 1, 2, 3, 4], [1]]


def test_filters_do_not_modify_their_input():
    logits = LOGITS5.clone()
    for fn, arg in [(apply_temperature, 0.5), (apply_top_k, 2), (apply_top_p, 0.5), (apply_min_p, 0.5)]:
        fn(logits, torch.tensor([arg]))
    assert torch.equal(logits, LOGITS5)


def test_batched_filters_equal_one_row_at_a_time():
    """Per-row parameters really are per row: a row's result does not depend on its neighbours."""
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(top_p=0.6),
              SamplingParams(min_p=0.2, top_p=0.9), SamplingParams(),
              SamplingParams(temperature=1.3, top_k=12, top_p=0.8, min_p=0.05), SamplingParams(top_k=1)]
    sampler = Sampler()
    batched = sampler.filtered_logits(logits, params)
    for i, p in enumerate(params):
        assert torch.equal(batched[i:i + 1], sampler.filtered_logits(logits[i:i + 1], [p]))


def test_order_is_min_p_then_top_k_then_top_p():
    # After min_p=0.25 removes tokens 0 and 2, top-p=0.75 on the renormalised {.5,.2,.15}/.85
    # (mass before token 4 = .70/.85 = .82 >= .75) drops token 4.
    p = SamplingParams(min_p=0.25, top_p=0.75)
    assert kept(Sampler().filtered_logits(LOGITS5, [p])) == [[1, 3]]


# ----------------------------------------------------------------------------- drawing

@pytest.mark.parametrize("device", DEVICES)
def test_temperature_zero_is_argmax(device):
    torch.manual_seed(1)
    logits = torch.randn(8, 100, device=device)
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=i) for i in range(8)]
    gens = [make_generator(p, device) for p in params]
    out = Sampler()(logits, params, gens)
    assert out.dtype == torch.long and out.shape == (8,)
    assert torch.equal(out, logits.argmax(-1))
    # Mixed batch: greedy rows are argmax, the others are drawn.
    mixed = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(seed=i) for i in range(8)]
    out = Sampler()(logits, mixed, [make_generator(p, device) for p in mixed])
    assert torch.equal(out[1::2], logits.argmax(-1)[1::2])


def test_make_generator():
    assert make_generator(SamplingParams()) is None
    a, b = make_generator(SamplingParams(seed=5)), make_generator(SamplingParams(seed=5))
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def _check_frequencies(samples, target):
    res = frequency_test(samples, target)
    crit = chi2_critical(res["df"], ALPHA)
    assert res["impossible"] == 0, "a token with probability 0 was sampled"
    assert res["statistic"] < crit, (res, crit)
    return res


def test_frequencies_match_target_global_rng():
    """20k draws over 8 categories, unseeded rows: the vectorised global-RNG path."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5])
    params = SamplingParams(temperature=0.8)
    target = torch.softmax(logits / 0.8, dim=-1)
    n = 20_000
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        samples = Sampler()(logits.repeat(n, 1), [params] * n)
    res = _check_frequencies(samples, target)
    assert res["df"] == 7


def test_frequencies_match_target_seeded_stream():
    """20k draws from one request's own generator (rows share it, like 20k decode steps)."""
    logits = torch.tensor([0.3, -1.0, 2.2, 0.0, 1.1, -0.4, 0.8, -2.0])
    params = SamplingParams(seed=7)
    gen = make_generator(params)
    n = 20_000
    samples = Sampler()(logits.repeat(n, 1), [params] * n, [gen] * n)
    _check_frequencies(samples, torch.softmax(logits, dim=-1))


def test_frequencies_match_filtered_target():
    """top-k/top-p/min-p renormalise over the kept tokens; removed tokens are never drawn."""
    torch.manual_seed(3)
    logits = torch.randn(30) * 1.5
    params = SamplingParams(temperature=0.9, top_k=10, top_p=0.85, min_p=0.02, seed=11)
    sampler = Sampler()
    target = sampler.probs(logits[None], [params])[0]
    # The target, built by hand from the definition: keep the top-k, then the top-p prefix.
    order = (logits / 0.9).argsort(descending=True)
    p_sorted = torch.softmax(logits / 0.9, -1)[order]
    keep = order[:10][(torch.cumsum(p_sorted[:10] / p_sorted[:10].sum(), 0) - p_sorted[:10] / p_sorted[:10].sum()) < 0.85]
    assert p_sorted[0] * 0.02 < p_sorted[9]                   # min-p removes nothing from this top-10
    expected = torch.zeros(30)
    expected[keep] = torch.softmax(logits / 0.9, -1)[keep] / torch.softmax(logits / 0.9, -1)[keep].sum()
    assert torch.allclose(target, expected, atol=1e-6)
    assert 2 < len(keep) < 10
    n = 20_000
    samples = sampler(logits.repeat(n, 1), [params] * n, [make_generator(params)] * n)
    _check_frequencies(samples, target)


def test_chi_square_rejects_a_wrong_distribution():
    """The frequency test has teeth: samples at T=1 are told apart from a T=1.15 target."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5])
    n = 20_000
    gen = torch.Generator().manual_seed(0)
    samples = exponential_race(torch.softmax(logits, -1).repeat(n, 1), [gen] * n)
    res = frequency_test(samples, torch.softmax(logits / 1.15, -1))
    assert res["statistic"] > chi2_critical(res["df"], ALPHA)


def test_p_values_are_uniform_across_seeds():
    """Under a correct sampler the p-value is uniform on [0, 1]: about 5 % of seeds below 0.05.
    (A biased draw pushes p-values towards 0; a test statistic computed wrongly skews them.)"""
    logits = torch.tensor([1.0, 0.2, -0.3, 0.7, -1.2, 0.0, 0.4, -0.6])
    target = torch.softmax(logits, -1)
    sampler, n = Sampler(), 2_000
    pvals = []
    for seed in range(200):
        params = SamplingParams(seed=seed)
        samples = sampler(logits.repeat(n, 1), [params] * n, [make_generator(params)] * n)
        pvals.append(frequency_test(samples, target)["p_value"])
    below = sum(p < 0.05 for p in pvals) / len(pvals)
    assert 0.01 <= below <= 0.11, below                         # binomial(200, .05): 2..22 hits
    assert 0.4 <= sum(pvals) / len(pvals) <= 0.6


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_tokens(device):
    torch.manual_seed(2)
    logits = torch.randn(50, 1000, device=device)              # 50 "decode steps"
    sampler = Sampler()

    def run(seed):
        p = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
        g = make_generator(p, device)
        return torch.cat([sampler(logits[t:t + 1], [p], [g]) for t in range(50)])

    assert torch.equal(run(42), run(42))
    assert not torch.equal(run(42), run(43))


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_is_independent_of_its_batch(device):
    """A seeded request gets the same tokens alone and batched with others, at any position."""
    torch.manual_seed(4)
    steps, vocab = 20, 500
    mine = SamplingParams(temperature=1.2, top_k=50, seed=123)
    others = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_p=0.5, seed=9)]
    logits = torch.randn(steps, 4, vocab, device=device)
    sampler = Sampler()

    g = make_generator(mine, device)
    alone = [int(sampler(logits[t, 2:3], [mine], [g])) for t in range(steps)]

    params = [others[0], others[1], mine, others[2]]
    gens = [make_generator(p, device) for p in params]
    batched = [int(sampler(logits[t], params, gens)[2]) for t in range(steps)]
    assert alone == batched


def test_rejects_mismatched_inputs():
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), [SamplingParams()] * 3)
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), [SamplingParams()] * 2, [None])
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), [SamplingParams(temperature=0.0)] * 3)   # all-greedy too
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(5), [SamplingParams()])
