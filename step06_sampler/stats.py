"""Pearson's chi-square goodness-of-fit test, written out so it needs nothing beyond `math`.

Used by run.py and the tests to check that sampled token frequencies match the distribution
the sampler was asked to draw from.

    statistic = sum_i (observed_i - expected_i)^2 / expected_i,    df = categories - 1

If the samples really come from the target, the statistic follows a chi-square law with df
degrees of freedom (for large counts), and the p-value is the chance of a statistic at least
this large: the upper tail Q(df/2, x/2) of the regularized incomplete gamma function.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def _log_gamma_prefactor(a: float, x: float) -> float:
    return -x + a * math.log(x) - math.lgamma(a)


def gamma_q(a: float, x: float) -> float:
    """Regularized upper incomplete gamma Q(a, x) (series below a+1, continued fraction above)."""
    if x <= 0.0:
        return 1.0
    if x < a + 1.0:                                 # P(a, x) = x^a e^-x / Gamma(a+1) * sum ...
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1.0
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(_log_gamma_prefactor(a, x)))
    tiny = 1e-300                                   # modified Lentz for the continued fraction
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return math.exp(_log_gamma_prefactor(a, x)) * h


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): the p-value of a statistic x."""
    return gamma_q(df / 2.0, x / 2.0)


def chi2_critical(df: int, alpha: float) -> float:
    """The x with P(X >= x) = alpha: reject "same distribution" when the statistic exceeds it."""
    lo, hi = 0.0, float(df) + 10.0
    while chi2_sf(hi, df) > alpha:
        hi *= 2.0
    for _ in range(200):                            # bisection; chi2_sf decreases in x
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return 0.5 * (lo + hi)


def chi_square(observed: Sequence[float], expected: Sequence[float]) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom (categories - 1)."""
    if len(observed) != len(expected) or len(observed) < 2:
        raise ValueError("need at least two categories, as many observed as expected")
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return stat, len(observed) - 1


def frequency_test(samples: torch.Tensor, target: torch.Tensor, min_expected: float = 5.0):
    """Chi-square test of integer samples against a target distribution over 0..V-1.

    Categories whose expected count is below `min_expected` (the usual rule of thumb for
    the chi-square approximation) are pooled into one "rest" category; if even the pooled
    rest is too small it joins the least likely separate category. Tokens with target
    probability 0 must never be sampled; such draws are counted as `impossible`.

    Returns a dict: labels (token id, "rest" or "ID+rest" per category), observed, expected,
    statistic, df, p_value, impossible.
    """
    n = samples.numel()
    target = target.double().cpu()
    counts = torch.bincount(samples.cpu().long().flatten(), minlength=target.numel()).double()
    expected = target * n
    impossible = int(counts[target == 0].sum())
    big = torch.nonzero(expected >= min_expected).flatten()
    big = big[expected[big].argsort(descending=True)]
    labels: list = big.tolist()
    observed, expect = counts[big].tolist(), expected[big].tolist()
    rest = torch.ones_like(target, dtype=torch.bool)
    rest[big] = False
    rest &= target > 0
    if bool(rest.any()):
        rest_obs, rest_exp = float(counts[rest].sum()), float(expected[rest].sum())
        if rest_exp >= min_expected or not labels:
            labels.append("rest")
            observed.append(rest_obs)
            expect.append(rest_exp)
        else:
            labels[-1] = f"{labels[-1]}+rest"
            observed[-1] += rest_obs
            expect[-1] += rest_exp
    result = dict(labels=labels, observed=observed, expected=expect, impossible=impossible)
    if len(observed) < 2:                           # a single category: nothing to test
        return dict(result, statistic=0.0, df=0, p_value=1.0)
    stat, df = chi_square(observed, expect)
    return dict(result, statistic=stat, df=df, p_value=chi2_sf(stat, df))
