"""Build `paged_decode.cpp` once with the system C++ compiler and call it through ctypes.

No torch headers are involved (they take a minute to compile); the kernel sees raw pointers
and sizes, so the build is one `g++` call of about a second. The shared library is cached
under `~/.cache/mini-vllm/kernels/`, named by a hash of the source, the flags and the CPU's
feature flags, so an edited kernel (or a home folder shared with another CPU) gets a rebuild.
It is compiled for the machine it runs on (`-march=native`; flags per CPU architecture and OS
in `minivllm_support/cpu.py`) and with `-fopenmp`: torch ships its own `libgomp.so.1`, which is
loaded first, so the kernel's parallel loop runs on torch's OpenMP threads rather than a second
pool fighting for the cores. Compiling and linking are two steps, so that -ffast-math stays a
compile flag: at link time it would add a constructor that sets flush-to-zero for the process.

Without a compiler (or with MINIVLLM_KERNEL=0) `load()` returns None and lesson 14 falls back
to its gather-then-matmul path, which gives the same results, slower.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from minivllm_support import cpu
from minivllm_support.models import cache_dir

SOURCE = Path(__file__).with_name("paged_decode.cpp")
_FUNCS = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}


def _build(target: Path, source: Path = SOURCE, include_dirs: tuple[Path, ...] = ()) -> None:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler '{cxx}' on PATH (set CXX or install g++)")
    compile_flags, link_flags = cpu.kernel_flags()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, out = Path(tmp) / "kernel.o", Path(tmp) / target.name
        includes = [f"-I{d}" for d in include_dirs]
        for cmd in ([cxx, *compile_flags, *includes, "-c", str(source), "-o", str(obj)],
                    [cxx, *link_flags, str(obj), "-o", str(out)]):
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"{cxx} failed to build {source.name}:\n{res.stderr[-2000:]}")
        os.replace(out, target)         # atomic: a concurrent reader sees no half-written library


def build_library(source: Path, include_dirs: tuple[Path, ...] = ()) -> ctypes.CDLL:
    """Compile `source` (with the headers/sources it includes from `include_dirs`) once, cached.

    Raises RuntimeError or OSError when it cannot be built or loaded. Lesson 15 builds its
    kernel with this too.
    """
    headers = [*source.parent.glob("*.h"), *(p for d in include_dirs for p in [*d.glob("*.cpp"), *d.glob("*.h")])]
    included = b"".join(p.read_bytes() for p in sorted(headers))
    key = hashlib.sha256(source.read_bytes() + included + " ".join(sum(cpu.kernel_flags(), [])).encode()
                         + cpu.cpu_id())
    target = cache_dir() / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not target.is_file():
        _build(target, source, include_dirs)
    return ctypes.CDLL(str(target))


def build_or_warn(source: Path, what: str, include_dirs: tuple[Path, ...] = ()) -> ctypes.CDLL | None:
    """`build_library`, or None with a warning naming `what` the caller falls back to.

    MINIVLLM_KERNEL=0 disables every kernel of the tutorial (the torch paths run instead).
    """
    if os.environ.get("MINIVLLM_KERNEL", "1") == "0":
        return None
    try:
        return build_library(source, include_dirs)
    except (RuntimeError, OSError) as e:
        warnings.warn(f"{what}: {e}")
        return None


def bind(lib: ctypes.CDLL, name: str, argtypes: list, restype=None) -> bool:
    """Give `name` its C signature if the library exports it; False if it does not (a path the
    build left out on this CPU must not be called, and must not crash the binding either)."""
    try:
        fn = getattr(lib, name)
    except AttributeError:
        return False
    fn.argtypes, fn.restype = argtypes, restype
    return True


def isa(lib: ctypes.CDLL) -> str:
    """The instruction set the library was built for (isa.h): 'amx', 'avx512_bf16', 'avx512',
    'avx2', 'neon' or 'portable'."""
    lib.kernel_isa.restype = ctypes.c_char_p
    return lib.kernel_isa().decode()


@lru_cache(maxsize=None)
def load() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; None if it cannot be built or is disabled."""
    lib = build_or_warn(SOURCE, "paged decode kernel unavailable, using the slower gather path")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in _FUNCS.values():
        bind(lib, name, [ptr] * 7 + [i64] * 7 + [ctypes.c_float])
    lib.paged_decode_max_group.restype = lib.paged_decode_max_head_dim.restype = i64
    return lib


def paged_decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor,
                           seq_lens: Tensor, scores: Tensor | None = None, check: bool = True) -> Tensor:
    """softmax(q K^T / sqrt(D)) V for one query token per sequence, K/V read through block tables.

    q [B, Hq, D]; k_pool, v_pool [num_blocks, Hkv, block_size, D]; block_tables [B, max_blocks]
    and seq_lens [B] int64. `scores` is optional float32 scratch to reuse across layers.
    `check=False` skips the input checks: for a caller that already ran them on the same
    tables and pool shapes (the engine checks at layer 0 of a step, not at all 28 layers).
    """
    lib = load()
    if lib is None:
        raise RuntimeError("the paged decode kernel is not available (see the warning above)")
    B, Hq, D = q.shape
    num_blocks, Hkv, bs, Dk = k_pool.shape
    if check:
        _check(lib, q, k_pool, v_pool, block_tables, seq_lens)
    group, max_blocks = Hq // Hkv, block_tables.shape[1]
    max_len = max_blocks * bs
    q, k_pool, v_pool = q.contiguous(), k_pool.contiguous(), v_pool.contiguous()
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    need = B * Hq * max_len
    if scores is None or scores.numel() < need or scores.dtype != torch.float32:
        scores = torch.empty(need, dtype=torch.float32)
    out = torch.empty_like(q)
    getattr(lib, _FUNCS[q.dtype])(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), block_tables.data_ptr(),
                                  seq_lens.data_ptr(), out.data_ptr(), scores.data_ptr(),
                                  B, max_blocks, Hkv, group, bs, D, max_len, D ** -0.5)
    return out


def _check(lib: ctypes.CDLL, q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor,
           seq_lens: Tensor) -> None:
    """Everything the C++ side trusts: wrong sizes there read outside the pool, not raise."""
    B, Hq, D = q.shape
    num_blocks, Hkv, bs, Dk = k_pool.shape
    if q.dtype not in _FUNCS or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise TypeError(f"q/k/v must share one dtype among {list(_FUNCS)}, got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}")
    if v_pool.shape != k_pool.shape or Dk != D or Hq % Hkv:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)}")
    group = Hq // Hkv
    if group > lib.paged_decode_max_group() or D > lib.paged_decode_max_head_dim():
        raise ValueError(f"kernel supports group <= {lib.paged_decode_max_group()} and "
                         f"head_dim <= {lib.paged_decode_max_head_dim()}, got {group} and {D}")
    if block_tables.dtype != torch.int64 or seq_lens.dtype != torch.int64:
        raise TypeError("block_tables and seq_lens must be int64")
    if block_tables.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} do not match batch {B}")
    max_len = block_tables.shape[1] * bs
    if B and (int(seq_lens.min()) < 1 or int(seq_lens.max()) > max_len):
        raise ValueError(f"seq_lens must lie in [1, {max_len}] (the block tables' capacity)")
    if B and (int(block_tables.min()) < 0 or int(block_tables.max()) >= num_blocks):
        raise ValueError(f"block_tables hold ids outside the pool's {num_blocks} blocks")
