"""Lesson 06: the sampler (greedy, temperature, top-k, top-p, min-p, seeded exponential race)."""
from .params import SAMPLING_EPS, SamplingParams
from .sampler import (Sampler, apply_min_p, apply_temperature, apply_top_k, apply_top_p,
                      exponential_race, make_generator)

__all__ = ["SAMPLING_EPS", "SamplingParams", "Sampler", "apply_min_p", "apply_temperature",
           "apply_top_k", "apply_top_p", "exponential_race", "make_generator"]
