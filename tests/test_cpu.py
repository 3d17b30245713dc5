"""minivllm_support/cpu.py and the kernel builder: what they report follows the CPU (and
baseline mode), every kernel library says which build it is, and none changes the process's
floating-point mode."""
from __future__ import annotations

import ctypes
import os
import shutil

import pytest
import torch

from minivllm_support import cpu
from minivllm_support.cli import resolve_dtype_name
from step14_batched_forward import kernel


KERNEL_LIBRARIES = ("paged_decode", "flash_attention", "flash_decode", "elementwise")


def _libraries() -> dict[str, ctypes.CDLL]:
    from advanced.adv04_flash_decoding import flash_decode_cpu
    from step15_flash_attention import flash_cpu
    from step16_cuda_graph.cpu import ops
    libs = {"paged_decode": kernel.load(), "flash_attention": flash_cpu.load(),
            "flash_decode": flash_decode_cpu.load(), "elementwise": ops.kernels_library()}
    return {name: lib for name, lib in libs.items() if lib is not None}


def _linux_x86_flags() -> set[str] | None:
    """The feature flags the Linux kernel lists for this CPU (None off Linux): a source apart
    from torch's cpuinfo, which cpu.features() asks."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def _expect_auto(native: bool) -> None:
    assert cpu.bf16_native() is native, f"bf16_native() says {cpu.bf16_native()}, the CPU says {native}"
    assert cpu.auto_dtype() == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype_name("auto") == ("bf16" if native else "fp32")
    assert resolve_dtype_name("fp32") == "fp32" and resolve_dtype_name("bf16") == "bf16"


def test_auto_dtype_is_bf16_exactly_where_the_cpu_computes_bf16():
    """What the CPU computes, read from /proc/cpuinfo (not from the code under test): x86-64
    with AVX-512 BF16 or AMX-BF16 multiplies bf16 natively; baseline mode and ARM do not."""
    forced_off = os.environ.get("MINIVLLM_BASELINE", "0") not in ("", "0")
    if forced_off or cpu.arch() != "x86_64":
        _expect_auto(False)               # ARM: fp32 by the module's stated choice (not measured there)
        return
    flags = _linux_x86_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags line (not Linux): nothing independent to check bf16_native() against")
    _expect_auto(bool(flags & {"avx512_bf16", "amx_bf16"}))


def test_baseline_mode_makes_bf16_not_native(monkeypatch):
    """MINIVLLM_BASELINE=1 hides everything beyond AVX2 from the dtype rule (whatever this CPU
    is); features() is cached, so the cache is cleared on the way in and on the way out."""
    try:
        with monkeypatch.context() as m:
            m.setenv("MINIVLLM_BASELINE", "1")
            cpu.features.cache_clear()
            if cpu.arch() == "x86_64":
                assert cpu.features() <= {"avx2"}, f"baseline mode still reports {sorted(cpu.features())}"
            _expect_auto(False)
    finally:
        cpu.features.cache_clear()


@pytest.mark.skipif(os.environ.get("MINIVLLM_KERNEL") == "0", reason="MINIVLLM_KERNEL=0: no kernel is built")
def test_every_library_says_which_build_it_is():
    libs = _libraries()
    assert libs, "no kernel library could be built"
    expected = {"avx2"} if cpu.baseline() else {"amx", "avx512_bf16", "avx512", "avx2", "neon", "portable"}
    for name, lib in libs.items():
        assert kernel.isa(lib) in expected, name
    if not cpu.baseline() and cpu.arch() == "x86_64":   # -march=native follows the CPU
        want = "avx512_bf16" if "avx512_bf16" in cpu.features() else "avx512" if "avx512" in cpu.features() else "avx2"
        assert kernel.isa(libs["paged_decode"]) in (want, "amx")


@pytest.mark.skipif(not cpu.baseline(), reason="only in baseline mode (MINIVLLM_BASELINE=1)")
def test_baseline_mode_reaches_torch_and_the_kernels():
    assert cpu.features() <= {"avx2"} and not cpu.bf16_native()
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert not torch.ops.mkldnn._is_mkldnn_bf16_supported()      # oneDNN capped at AVX2: no bf16
    assert "-march=x86-64-v3" in cpu.kernel_flags()[0]
    assert "baseline" in cpu.describe() and "WARNING" not in cpu.describe()


def _why_no_kernels() -> str | None:
    """Why no kernel library can be built here, judged without the builder under test."""
    if os.environ.get("MINIVLLM_KERNEL") == "0":
        return "MINIVLLM_KERNEL=0: no kernel is built"
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ('{cxx}') on PATH: no kernel library can be built"
    return None


def test_loading_the_kernels_leaves_flush_to_zero_off():
    """-ffast-math at link time would add crtfastmath.o, whose constructor sets flush-to-zero
    (and denormals-are-zero) for the whole process: subnormal numbers would become 0 everywhere.
    With a compiler every library must really be built and loaded first (each answers a call),
    or the subnormal check below would prove nothing."""
    reason = _why_no_kernels()
    if reason:
        pytest.skip(reason)
    libs = _libraries()
    missing = [name for name in KERNEL_LIBRARIES if name not in libs]
    assert not missing, f"a compiler is here, yet these kernel libraries did not build or load: {missing}"
    for name, lib in libs.items():
        assert kernel.isa(lib), f"{name}: the loaded library does not answer kernel_isa()"
    tiny = float.fromhex("0x1p-1022")        # the smallest normal double; half of it is subnormal
    assert tiny / 2 > 0
    t = torch.tensor([2.0 ** -126], dtype=torch.float32)
    assert float(t / 4) > 0


def test_flags_follow_the_target():
    arm_compile, arm_link = cpu.kernel_flags("aarch64", "Linux")
    assert "-march=armv8-a" in arm_compile and not any("x86" in f or "vector-width" in f for f in arm_compile)
    mac_compile, mac_link = cpu.kernel_flags("aarch64", "Darwin")
    assert "-fopenmp" not in mac_compile + mac_link               # Apple clang has no OpenMP runtime
    for compile_flags, link_flags in (cpu.kernel_flags(), (arm_compile, arm_link), (mac_compile, mac_link)):
        assert "-ffast-math" not in link_flags                     # see the flush-to-zero test


def test_bind_skips_what_the_library_does_not_export():
    lib = _libraries().get("elementwise")
    if lib is None:
        pytest.skip("no compiler (or MINIVLLM_KERNEL=0)")
    assert kernel.bind(lib, "row_argmax_f32", [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                               ctypes.c_void_p])
    assert not kernel.bind(lib, "no_such_kernel", [])


def test_huge_page_malloc_env_adds_the_tunable_once():
    """The environment vs_vllm.py and steady.py's thp variant start engines with: glibc's tunable
    appended to whatever GLIBC_TUNABLES already holds, never twice."""
    env = cpu.huge_page_malloc_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert cpu.huge_page_malloc_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] == \
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert cpu.huge_page_malloc_env(env) == env
