"""Support code that no lesson is about: finding the model, timing, the tiny test checkpoint,
what the CPU can do."""
from minivllm_support.cpu import apply_baseline, set_inductor_cache
from minivllm_support.models import cache_dir

apply_baseline()   # MINIVLLM_BASELINE=1: torch's libraries act as on an AVX2 CPU (cpu.py)
set_inductor_cache(cache_dir())
