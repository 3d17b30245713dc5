"""What this CPU can do, and what follows from it: the dtype, the kernels' build flags.

A learner's CPU is one of a few classes, and the fast path differs for each:

    x86-64, AMX + AVX-512 BF16   bf16 matmuls on tiles (oneDNN), bf16 dot products in our kernels
    x86-64, AVX-512 BF16         bf16 dot products (VDPBF16PS) in oneDNN and in our kernels
    x86-64, AVX-512 / AVX2       no bf16 arithmetic: emulated, several times slower than fp32
    aarch64 (Linux, Apple)       NEON; our kernels compile portable loops the compiler vectorises

`auto_dtype()` is the rule every lesson's `--dtype auto` uses: bf16 where the CPU computes
bf16 natively, else float32 (vLLM's CPU backend also picks by what the CPU supports).

Baseline mode, MINIVLLM_BASELINE=1, makes an AVX-512 machine behave as an AVX2-only one, so
its tests and figures can be checked without the hardware: our kernels are built for
`-march=x86-64-v3` (AVX2 + FMA + F16C), bf16 is reported as not native, and torch's own
libraries are capped at AVX2 through their environment variables. They read those variables
when first used, not when torch is imported, so `apply_baseline()` (run when this package is
imported, before any lesson computes) is in time; `describe()` says if it was not.
"""
from __future__ import annotations

import os
import platform
import subprocess
from functools import lru_cache

import torch

BASELINE_VAR = "MINIVLLM_BASELINE"
# What makes torch's libraries act as on an AVX2-only CPU: ATen's vectorised kernels,
# oneDNN (bf16 then reports unsupported), and MKL (fp32 GEMMs do not go through oneDNN).
TORCH_BASELINE_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                      "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


# glibc 2.35+ reads this when a process starts: its malloc then advises every large block it
# maps from the OS (torch's tensors, oneDNN's packed weights) as transparent huge pages, which
# Linux grants where THP is in `madvise` or `always` mode. Older glibc and other OSes ignore it.
HUGE_PAGE_MALLOC_ENV = "glibc.malloc.hugetlb=1"


def huge_page_malloc_env(env: dict | None = None) -> dict[str, str]:
    """`env` (default: this process's) with glibc's malloc asked for huge pages, for a child."""
    env = dict(os.environ if env is None else env)
    tunables = env.get("GLIBC_TUNABLES", "")
    if HUGE_PAGE_MALLOC_ENV not in tunables.split(":"):
        env["GLIBC_TUNABLES"] = f"{tunables}:{HUGE_PAGE_MALLOC_ENV}" if tunables else HUGE_PAGE_MALLOC_ENV
    return env


def baseline() -> bool:
    return os.environ.get(BASELINE_VAR, "0") not in ("", "0")


def arch() -> str:
    """'x86_64' or 'aarch64' (macOS calls the latter arm64), else what the platform says."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def apply_baseline() -> None:
    if baseline() and arch() == "x86_64":
        os.environ.update(TORCH_BASELINE_ENV)


def set_inductor_cache(root) -> None:
    """Lesson 16's compiled code goes to `root`/inductor-<ATen CPU capability> (unless
    TORCHINDUCTOR_CACHE_DIR is set): inductor's cache key does not tell code built with ATen
    capped at AVX2 (baseline mode) from the rest, and such an entry aborted a later uncapped
    run here. Set at import: the first caller of inductor's cache_dir() (importing triton is
    one) fixes the folder for the process."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          os.path.join(root, f"inductor-{torch.backends.cpu.get_cpu_capability().lower()}"))


@lru_cache(maxsize=None)
def features() -> frozenset[str]:
    """The instruction-set features that matter here, as this CPU reports them (baseline mode
    hides everything beyond AVX2). torch's cpuinfo answers on every OS."""
    if arch() == "x86_64":
        probe = {"avx2": torch.cpu._is_avx2_supported, "avx512": torch.cpu._is_avx512_supported,
                 "avx512_bf16": torch.cpu._is_avx512_bf16_supported, "amx": torch.cpu._is_amx_tile_supported}
        found = {name for name, fn in probe.items() if fn()}
        return frozenset(found & {"avx2"} if baseline() else found)
    if arch() == "aarch64":
        return frozenset({"neon"} | ({"bf16"} if _arm_has_bf16() else set()))
    return frozenset()


def _arm_has_bf16() -> bool:
    try:
        if platform.system() == "Darwin":
            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True)
            return out.stdout.strip() == "1"
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("Features") and "bf16" in line.split() for line in f)
    except OSError:
        return False


def bf16_native() -> bool:
    """True where the CPU multiplies bf16 itself (AVX-512 BF16, AMX). On ARM we have not
    measured torch's bf16 matmuls against fp32, so fp32 stays the choice there."""
    return bool(features() & {"avx512_bf16", "amx"})


def auto_dtype() -> torch.dtype:
    return torch.bfloat16 if bf16_native() else torch.float32


def cpu_class() -> str:
    """The class a speed figure belongs to, e.g. 'x86-64 AVX-512 BF16 (no AMX)'."""
    f = features()
    if arch() == "x86_64":
        if "amx" in f:
            name = "x86-64 AMX + AVX-512 BF16"
        elif "avx512_bf16" in f:
            name = "x86-64 AVX-512 BF16 (no AMX)"
        elif "avx512" in f:
            name = "x86-64 AVX-512 (no BF16)"
        elif "avx2" in f:
            name = "x86-64 AVX2"
        else:
            name = "x86-64 (no AVX2)"
        return name + (" [baseline mode]" if baseline() else "")
    if arch() == "aarch64":
        return "aarch64 NEON" + (" + BF16" if "bf16" in f else "")
    return arch()


def describe() -> str:
    """cpu_class(), plus a warning when baseline mode did not reach torch (set too late)."""
    text = cpu_class()
    if baseline() and arch() == "x86_64" and torch.backends.cpu.get_cpu_capability() != "AVX2":
        text += " (WARNING: torch still uses " + torch.backends.cpu.get_cpu_capability() + \
                ": set MINIVLLM_BASELINE before the process starts)"
    return text


# ---- build flags for our C++ kernels (lesson 14's builder uses them) ------------------------
# -ffast-math lets the compiler reorder float sums into vector lanes; -fno-finite-math-only
# keeps infinities (masked scores are -inf). It is a compile flag only: passed at link time it
# links crtfastmath.o, whose constructor turns on flush-to-zero for the whole process.
_COMMON = ["-O3", "-fPIC", "-std=c++17", "-ffast-math", "-fno-finite-math-only"]


def kernel_flags(target: str | None = None, system: str | None = None) -> tuple[list[str], list[str]]:
    """(compile flags, link flags) for `target`: None = this machine (-march=native, or
    x86-64-v3 in baseline mode); 'aarch64' = any ARMv8 (what a cross-build checks)."""
    system = system or platform.system()
    arch_flags: list[str]
    if target == "aarch64":
        arch_flags = ["-march=armv8-a"]
    elif arch() == "x86_64":
        arch_flags = ["-march=x86-64-v3"] if baseline() else ["-march=native"]
        arch_flags.append("-mprefer-vector-width=512")   # where AVX-512 is there, use all of it
    elif arch() == "aarch64":
        arch_flags = ["-mcpu=native"]
    else:
        arch_flags = []
    if system == "Darwin":   # Apple clang has no OpenMP runtime: the kernels run on one thread
        return _COMMON + arch_flags + ["-fopenmp-simd", "-Wno-unknown-pragmas"], ["-shared", "-undefined", "dynamic_lookup"]
    return _COMMON + arch_flags + ["-fopenmp"], ["-shared", "-fopenmp"]


def cpu_id() -> bytes:
    """What -march/-mcpu=native depends on, for a cache key: a library built for one CPU may
    not run on another (a home folder shared between machines)."""
    keys = ("flags", "Features", "CPU implementer", "CPU part", "model name")
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in keys and key not in found:
                    found[key] = line
    except OSError:
        pass
    if not found and platform.system() == "Darwin":
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
        found["brand"] = out.stdout
    return ("".join(found[k] for k in sorted(found)) + platform.machine() + platform.processor()).encode()
