"""Do our C++ kernels build and compute right on ARM? Checked from an x86 machine.

    python -m tests.arm_check      (or `make check-arm`)

Every kernel source is cross-compiled by `aarch64-linux-gnu-g++` with the flags lesson 14's
builder uses on any ARMv8 Linux (`cpu.kernel_flags("aarch64", "Linux")`), compiled then linked
into a shared library as `build_library` does. A small aarch64 program (arm_check.cpp) loads
each one under `qemu-aarch64` and makes one call per case. Inputs and references come from the
tests' own reference functions (some live in tests/: the test extras must be installed), with
the tests' tolerances. qemu emulates instructions, not timing: this says nothing about speed.
Exit status: 0 all passed, 1 something failed, 2 the tools are missing.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from minivllm_support import cpu

CXX, QEMU, SYSROOT = "aarch64-linux-gnu-g++", "qemu-aarch64", Path("/usr/aarch64-linux-gnu")
INSTALL = "apt-get install g++-aarch64-linux-gnu qemu-user"
ROOT = Path(__file__).resolve().parent.parent
S14, S15, S16 = ROOT / "step14_batched_forward", ROOT / "step15_flash_attention", ROOT / "step16_cuda_graph" / "cpu"
# library -> (source, include folders), as each Python binding hands them to build_library
LIBRARIES = {
    "paged_decode": (S14 / "paged_decode.cpp", ()),
    "flash_attention": (S15 / "flash_attention.cpp", (S14,)),
    "flash_decode": (ROOT / "advanced/adv04_flash_decoding/flash_decode.cpp", (S15, S14)),
    "amx_prefill": (S15 / "amx_prefill.cpp", (S14,)),
    "elementwise": (S16 / "elementwise.cpp", (S14,)),
    "peak": (S15 / "peak.cpp", (S14,)),            # a benchmark: only built, never run here
}
Result = tuple[bool, str]                        # (passed, what was measured)


@dataclass
class Out:             # an output, read back with `like`'s dtype and shape; `inout`: sent in first
    name: str
    like: torch.Tensor
    inout: bool = False


@dataclass
class Case:
    label: str
    library: str
    fn: str
    args: list                     # in C order: tensors (inputs), Out, None (null), int (i64), float (f32)
    check: Callable[[dict], Result]              # outputs by name (and "ret") -> Result
    ret: str = "void"


def close(got: torch.Tensor, want: torch.Tensor, tol: float, rtol: float | None = None) -> Result:
    """torch.testing.assert_close's rule, |got - want| <= atol + rtol |want| (tol 0: equal); NaN never passes."""
    rtol = tol if rtol is None else rtol
    ok = bool(torch.isclose(got.float(), want.float(), rtol=rtol, atol=tol).all())
    tols = f"tol {tol:g}" if rtol == tol else f"atol {tol:g}, rtol {rtol:.2g}"
    return ok, f"max err {float((got.float() - want.float()).abs().max()):.1e} ({tols})"


def bf16_steps(got: torch.Tensor, want: torch.Tensor) -> Result:
    """The element-wise tests' rule: within one bf16 step (rtol 2^-7) and over 99% equal."""
    ok, detail = close(got, want, 1e-5, 2 ** -7)
    same = float((got == want).float().mean())
    return ok and same > 0.99, f"{detail}, {same:.1%} equal"


def both(**results: Result) -> Result:
    """Several outputs of one call: passed if all did; the details under each output's name."""
    return all(ok for ok, _ in results.values()), "; ".join(f"{k}: {d}" for k, (_, d) in results.items())


def attention_cases() -> list[Case]:
    from step15_flash_attention.reference import random_paged_case, reference_attention
    from tests.test_adv04_flash_decoding import reference_lse
    from tests.test_step14_kernel import random_case, reference_decode
    cases = []
    for dtype, tol, dt in [(torch.bfloat16, 2e-2, "bf16"), (torch.float32, 1e-5, "f32")]:
        for Hkv, group, bs, D in [(2, 3, 16, 64), (2, 2, 4, 128)]:
            shape, scale = f"Hkv={Hkv} group={group} bs={bs} D={D}", D ** -0.5
            # lesson 14: decodes of one token, a partial block, a full one, spill-over, many blocks
            q, k, v, tables, lens = random_case(dtype, Hkv, group, bs, D, [1, bs - 1, bs, bs + 1, 5 * bs + 3])
            B, max_len = len(lens), tables.shape[1] * bs
            want, scores = reference_decode(q, k, v, tables, lens), torch.empty(B * q.shape[1] * max_len)
            cases.append(Case(f"paged_decode     {dt:4} {shape}", "paged_decode", f"paged_decode_{dt}",
                              [q, k, v, tables, lens, Out("out", q), Out("scores", scores),
                               B, tables.shape[1], Hkv, group, bs, D, max_len, scale],
                              lambda o, want=want, tol=tol: close(o["out"], want, tol)))
            # lesson 15: a later chunk of a prompt (prefix in the pool), a decode, a fresh prompt, a decode
            q_lens, seq_lens = ([5, 1, 24, 1], [30, 17, 24, 40]) if bs == 16 else ([37, 1, 40, 1], [101, 9, 40, 33])
            q, k, v, cu, lens, tables = case = random_paged_case(q_lens, seq_lens, Hkv, group, bs, D, dtype)
            cases.append(Case(f"flash_attention  {dt:4} {shape}", "flash_attention", f"flash_attention_{dt}",
                              [q, k, v, cu, lens, tables, Out("out", q), len(lens), tables.shape[1], Hkv, group,
                               bs, D, scale, max(1, 64 // group)],        # q_tile, as the binding: kMaxRows = 64
                              lambda o, want=reference_attention(*case), tol=tol: close(o["out"], want, tol)))
        # advanced 04: decodes cut into splits of 3 blocks (1 and 16 keys fit in one, 83 and 200 do not)
        Hkv, group, bs, D = 2, 2, 16, 128
        q, k, v, cu, lens, tables = case = random_paged_case([1] * 4, [1, 16, 83, 200], Hkv, group, bs, D, dtype)
        want = (reference_attention(*case), reference_lse(*case))
        cases.append(Case(f"flash_decode     {dt:4} Hkv={Hkv} group={group} bs={bs} D={D} split={3 * bs}",
                          "flash_decode", f"flash_decode_{dt}",
                          [q, k, v, lens, tables, Out("out", q), Out("lse", torch.empty(q.shape[:2])), len(lens),
                           tables.shape[1], Hkv, group, bs, D, D ** -0.5, 3 * bs],   # split: 3 blocks
                          lambda o, want=want, tol=tol: both(out=close(o["out"], want[0], tol),
                                                             lse=close(o["lse"].double(), want[1], 1e-4, 1e-5))))
    return cases


def fast_path_cases() -> list[Case]:
    from step03_attention.attention import apply_rope
    from step04_transformer.layers import RMSNorm, RotaryEmbedding
    cases = [Case("amx_prefill      stub: amx_prefill_available() = 0", "amx_prefill", "amx_prefill_available", [],
                  lambda o: (o["ret"] == 0, f"returned {o['ret']}"), ret="i64")]
    g = torch.Generator().manual_seed(0)
    # elementwise.cpp against lesson 04's bf16 code, as tests/test_step16_cpu_fast_path.py compares them
    T, nh, nkv, D, inner = 37, 4, 2, 64, 96
    qkv = torch.randn(T, (nh + 2 * nkv) * D, generator=g).bfloat16()
    q_norm, k_norm = RMSNorm(D, 1e-6).bfloat16(), RMSNorm(D, 1e-6).bfloat16()
    with torch.no_grad():
        q_norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=g))
        k_norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=g))
        cos, sin = RotaryEmbedding(D, 1e6, 512)(torch.arange(300, 300 + T))
        q_heads, k_heads = qkv[:, :nh * D].view(T, nh, D), qkv[:, nh * D:(nh + nkv) * D].view(T, nkv, D)
        for norms in (True, False):                  # Qwen3's q/k norms, and a model without them
            want = (apply_rope(q_norm(q_heads) if norms else q_heads, cos, sin),
                    apply_rope(k_norm(k_heads) if norms else k_heads, cos, sin))
            qw, kw, eps = (q_norm.weight, k_norm.weight, 1e-6) if norms else (None, None, 0.0)
            cases.append(Case(f"qk_norm_rope     bf16 T={T} D={D} {'with' if norms else 'without'} q/k norms",
                              "elementwise", "qk_norm_rope_bf16",
                              [qkv, T, qkv.shape[1], nh, nkv, D, qw, kw, cos.reshape(T, D), sin.reshape(T, D), eps,
                               Out("q", want[0]), Out("k", want[1])],
                              lambda o, want=want: both(q=bf16_steps(o["q"], want[0]), k=bf16_steps(o["k"], want[1]))))
        gate_up = (3 * torch.randn(T, 2 * inner, generator=g)).bfloat16()
        silu = torch.nn.functional.silu(gate_up[:, :inner]) * gate_up[:, inner:]
    cases.append(Case(f"silu_mul         bf16 N={T} I={inner}", "elementwise", "silu_mul_bf16",
                      [gate_up, T, inner, Out("out", silu)], lambda o: bf16_steps(o["out"], silu)))
    # write_kv against index_copy_: k from a wider row (as out of a fused projection), v contiguous
    Hkv, bs, blocks = 2, 4, 12
    k_rows = torch.randn(T, 3 * Hkv * D, generator=g).bfloat16()
    k, v = k_rows[:, :Hkv * D].view(T, Hkv, D), torch.randn(T, Hkv, D, generator=g).bfloat16()
    pools = [torch.randn(blocks, Hkv, bs, D, generator=g).bfloat16() for _ in range(2)]
    rows = torch.randperm(blocks * Hkv * bs, generator=g)[:T * Hkv]
    written = [p.clone() for p in pools]
    for p, x in zip(written, (k, v)):
        p.view(-1, D).index_copy_(0, rows, x.reshape(-1, D))
    cases.append(Case(f"write_kv         bf16 T={T} Hkv={Hkv} D={D}", "elementwise", "write_kv",
                      [k_rows, v, k.stride(0) * 2, k.stride(1) * 2, v.stride(0) * 2, v.stride(1) * 2, Hkv,
                       Out("k_pool", pools[0], True), Out("v_pool", pools[1], True), rows, rows.numel(), D * 2],
                      lambda o: both(k_pool=close(o["k_pool"], written[0], 0), v_pool=close(o["v_pool"], written[1], 0))))
    # row_argmax against max(dim=-1): random rows, ties, all -inf, NaNs; every other half row (a stride)
    for V in (33, 1003):
        x = torch.randn(6, 2 * V, generator=g)
        x[1] = torch.randint(0, 3, (2 * V,), generator=g).float()
        x[2] = float("-inf")
        x[3, V // 2] = x[4, V - 1] = x[5, 0] = float("nan")
        idx = x[:, :V].max(dim=-1).indices
        cases.append(Case(f"row_argmax       f32  rows=6 cols={V} stride={2 * V}", "elementwise", "row_argmax_f32",
                          [x, 6, V, 2 * V, Out("out", idx)], lambda o, idx=idx: close(o["out"], idx, 0)))
    return cases


def build(name: str, out: Path) -> tuple[Path | None, str]:
    """Compile, then link, as lesson 14's builder does, with the aarch64 flags: (library, errors)."""
    source, includes = LIBRARIES[name]
    compile_flags, link_flags = cpu.kernel_flags(target="aarch64", system="Linux")
    obj, lib = out / f"{name}.o", out / f"lib{name}.so"
    for cmd in ([CXX, *compile_flags, *(f"-I{d}" for d in includes), "-c", str(source), "-o", str(obj)],
                [CXX, *link_flags, str(obj), "-o", str(lib)]):
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            return None, res.stderr.strip()[-1500:]
    return lib, ""


def run(case: Case, lib: Path, driver: Path, folder: Path) -> tuple[bool, str, str]:
    """One call under qemu: write the inputs and call.txt, run, read the outputs back, check.
    Returns (passed, detail, what kernel_isa() said)."""
    folder.mkdir()
    lines = [f"{case.fn} {case.ret}"]
    for i, a in enumerate(case.args):
        if isinstance(a, torch.Tensor) or isinstance(a, Out) and a.inout:
            t, name = (a.like, a.name) if isinstance(a, Out) else (a, f"arg{i}")
            t = t.contiguous()
            (folder / f"{name}.bin").write_bytes(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
            lines.append(f"{'io' if isinstance(a, Out) else 'in'} {name}")
        elif isinstance(a, Out):
            lines.append(f"out {a.name} {a.like.numel() * a.like.element_size()}")
        elif a is None:
            lines.append("null")
        else:
            lines.append(f"i64 {a}" if isinstance(a, int) else f"f32 {float(a).hex()}")
    (folder / "call.txt").write_text("\n".join(lines) + "\n")
    try:
        res = subprocess.run([QEMU, "-L", str(SYSROOT), str(driver), str(lib), "call.txt"], cwd=folder,
                             capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "2"})
    except subprocess.TimeoutExpired:
        return False, "timed out under qemu (120 s)", "?"
    said = dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)
    isa = said.get("isa", "-")                       # "-": the library has no kernel_isa()
    if res.returncode != 0:
        why = "not exported by the ARM build" if res.returncode == 3 else f"exit {res.returncode}: {res.stderr[-300:]}"
        return False, why, isa
    outs: dict = {"ret": int(said["ret"])} if "ret" in said else {}
    for a in case.args:
        if isinstance(a, Out):
            data = bytearray((folder / f"{a.name}.out").read_bytes())
            outs[a.name] = torch.frombuffer(data, dtype=a.like.dtype).view(a.like.shape)
    ok, detail = case.check(outs)
    if isa not in ("neon", "-"):
        ok, detail = False, f"{detail}; kernel_isa() says {isa}, expected neon"
    return ok, detail, isa


def main() -> int:
    missing = [t for t in (CXX, QEMU) if shutil.which(t) is None] + ([] if SYSROOT.is_dir() else [str(SYSROOT)])
    if missing:
        print(f"arm_check: missing {', '.join(missing)} (Debian/Ubuntu: {INSTALL})")
        return 2
    t0 = time.time()
    cases = attention_cases() + fast_path_cases()       # inputs and references, on this machine
    t1, results = time.time(), []

    def report(ok: bool, label: str, detail: str = "") -> None:
        results.append(ok)
        print(f"{'PASS' if ok else 'FAIL'}  {label:58} {detail}")

    with tempfile.TemporaryDirectory(prefix="arm_check-") as tmp_name:
        tmp, driver_src = Path(tmp_name), Path(__file__).with_suffix(".cpp")
        driver = tmp / "arm_check"
        with ThreadPoolExecutor(2) as pool:            # the compiler is the slow part: both cores
            drv = pool.submit(subprocess.run, [CXX, "-O2", "-std=c++17", str(driver_src), "-o", str(driver), "-ldl"],
                              capture_output=True, text=True)
            built = dict(zip(LIBRARIES, pool.map(lambda name: build(name, tmp), LIBRARIES)))
        if drv.result().returncode != 0:
            print(f"FAIL  the driver did not build:\n{drv.result().stderr}")
            return 1
        print(f"references {t1 - t0:.0f} s; {len(LIBRARIES)} libraries built for aarch64 in {time.time() - t1:.0f} s: "
              f"{' '.join(cpu.kernel_flags('aarch64', 'Linux')[0])}")
        for name, (lib, err) in built.items():
            if lib is None:
                report(False, f"{LIBRARIES[name][0].name} does not build", f"\n{err}")
        if all(lib for lib, _ in built.values()):
            report(True, f"all {len(built)} sources build", "(peak.cpp, a benchmark, is only built)")
        for i, case in enumerate(cases):
            lib = built[case.library][0]
            ok, detail, isa = run(case, lib, driver, tmp / f"case{i}") if lib else (False, "library did not build", "-")
            report(ok, case.label, f"{detail}  isa={isa}")
    print(f"{sum(results)} passed, {len(results) - sum(results)} failed, {time.time() - t0:.0f} s "
          f"(qemu-aarch64, OMP_NUM_THREADS=2)")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
