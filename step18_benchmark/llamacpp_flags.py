"""The CMake flags `make compare-llamacpp` builds llama.cpp (llama-cpp-python) with on this CPU.

    python -m step18_benchmark.llamacpp_flags        # prints them, e.g. -DGGML_NATIVE=OFF -DGGML_AVX512=ON ...

Not -DGGML_NATIVE=ON on x86: in a virtual machine the CPU may report instructions (AMX) whose
state the kernel has not granted to the process, and a natively tuned build then dies with an
illegal instruction. Each instruction set is switched on where /proc/cpuinfo lists it, and AMX
only where torch could also get the kernel's permission for its tiles (minivllm_support.cpu).
With MINIVLLM_BASELINE=1 nothing beyond AVX2 is switched on, as on our side.
"""
from __future__ import annotations

from minivllm_support import cpu

X86 = {                       # llama.cpp option -> /proc/cpuinfo flag
    "GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c", "GGML_BMI2": "bmi2",
    "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi", "GGML_AVX512_VNNI": "avx512_vnni",
    "GGML_AVX512_BF16": "avx512_bf16",
}
AMX = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def cmake_flags() -> list[str]:
    if cpu.arch() != "x86_64":
        return ["-DGGML_NATIVE=ON"]                     # ARM, macOS: the compiler's own target is safe
    have = cpu_flags()
    if cpu.baseline():                                  # MINIVLLM_BASELINE=1: both sides on AVX2
        have -= {"avx512f", "avx512vbmi", "avx512_vnni", "avx512_bf16"}
    out = ["-DGGML_NATIVE=OFF"] + [f"-D{opt}={'ON' if flag in have else 'OFF'}" for opt, flag in X86.items()]
    amx = "amx" in cpu.features()                       # torch asked the kernel for the tiles
    return out + [f"-D{opt}={'ON' if amx else 'OFF'}" for opt in AMX]


if __name__ == "__main__":
    print(" ".join(cmake_flags()))
