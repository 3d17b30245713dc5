"""Lesson 15: the two implementations of bf16 prompt tiles (float32 FMAs, bf16 dot products),
each forced with MINIVLLM_PREFILL_TILES, against float32 attention; and the automatic choice."""
import pytest
import torch

from step15_flash_attention import flash_cpu
from step15_flash_attention.flash_cpu import flash_attention_cpu
from step15_flash_attention.reference import random_paged_case, reference_attention

LIB = flash_cpu.load()
needs_kernel = pytest.mark.skipif(LIB is None, reason="flash attention kernel could not be built")
needs_bf16_tiles = pytest.mark.skipif(LIB is None or not LIB.flash_prefill_bf16_built(),
                                      reason="the kernel was built without AVX512-BF16 (no dot-product tiles)")
TILES = [pytest.param("f32", marks=needs_kernel), pytest.param("bf16", marks=needs_bf16_tiles)]
BF16_TOL = 2e-2        # lesson 15's tolerance for bf16 kernels


def _cases(bs: int, group: int) -> list[tuple[list[int], list[int]]]:
    """(q_lens, seq_lens): whole prompts, chunks at the end of a longer context, tiles whose rows
    are not a multiple of 16 (padded), odd key counts, a decode next to the chunks."""
    q_tile = 64 // group
    return [
        ([3 * bs + 1], [3 * bs + 1]),                                   # one whole prompt
        ([q_tile + 3], [5 * bs + q_tile + 3]),                          # a chunk after a prefix, two tiles
        ([7, 1, 2 * bs + 5], [9 * bs + 2, 4 * bs, 6 * bs + 1]),        # short chunk, a decode, a longer chunk
        ([2], [bs + 3]),                                                 # a tile of 2 * group rows of 16
    ]


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("bs, D", [(16, 128), (16, 64), (4, 64), (5, 128), (8, 128), (32, 64), (5, 48)])
def test_tiles_equal_reference(monkeypatch, tiles, group, bs, D):
    monkeypatch.setenv(flash_cpu.TILES_VAR, tiles)
    assert flash_cpu.prefill_tiles() == tiles
    for i, (q_lens, seq_lens) in enumerate(_cases(bs, group)):
        case = random_paged_case(q_lens, seq_lens, 2, group, bs, D, torch.bfloat16, seed=i)
        out = flash_attention_cpu(*case)
        assert out.dtype == torch.bfloat16 and out.shape == case[0].shape
        torch.testing.assert_close(out.float(), reference_attention(*case), atol=BF16_TOL, rtol=BF16_TOL)


@needs_bf16_tiles
@pytest.mark.parametrize("group, D", [(2, 128), (3, 64)])
def test_both_paths_agree_on_a_long_chunk(monkeypatch, group, D):
    case = random_paged_case([300], [700], 2, group, 16, D, torch.bfloat16, seed=3)
    outs = {}
    for tiles in ("f32", "bf16"):
        monkeypatch.setenv(flash_cpu.TILES_VAR, tiles)
        outs[tiles] = flash_attention_cpu(*case).float()
    torch.testing.assert_close(outs["bf16"], outs["f32"], atol=BF16_TOL, rtol=BF16_TOL)
    torch.testing.assert_close(outs["bf16"], reference_attention(*case), atol=BF16_TOL, rtol=BF16_TOL)
    # and the setting reached the kernel: P rounded to bf16 moves some of 300 x heads x D outputs
    assert not torch.equal(outs["bf16"], outs["f32"])


@pytest.mark.parametrize("tiles", TILES)
def test_keys_past_the_length_are_never_read(monkeypatch, tiles):
    """Odd key counts leave half a pair: it must be filled with zeros, not the pool's next row."""
    monkeypatch.setenv(flash_cpu.TILES_VAR, tiles)
    bs = 8
    q, k_pool, v_pool, cu, lens, tables = random_paged_case([5, 9], [13, 27], 2, 2, bs, 64, torch.bfloat16,
                                                            spare_blocks=4)
    out = flash_attention_cpu(q, k_pool, v_pool, cu, lens, tables)
    k2, v2 = k_pool.clone(), v_pool.clone()
    used = set()
    for b, n in enumerate(lens.tolist()):
        last = int(tables[b, (n - 1) // bs])
        k2[last, :, (n - 1) % bs + 1:] = float("nan")
        v2[last, :, (n - 1) % bs + 1:] = float("nan")
        used.update(tables[b, :(n - 1) // bs + 1].tolist())
    for blk in set(range(k_pool.shape[0])) - used:
        k2[blk], v2[blk] = float("nan"), float("nan")
    torch.testing.assert_close(flash_attention_cpu(q, k2, v2, cu, lens, tables), out)


@needs_kernel
def test_float32_ignores_the_tile_choice(monkeypatch):
    case = random_paged_case([40, 1], [90, 30], 2, 2, 16, 64, torch.float32)
    monkeypatch.setenv(flash_cpu.TILES_VAR, "bf16")
    torch.testing.assert_close(flash_attention_cpu(*case), reference_attention(*case), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_auto_follows_the_measured_rates(monkeypatch):
    monkeypatch.delenv(flash_cpu.TILES_VAR, raising=False)
    expected = "bf16" if LIB.flash_prefill_bf16_built() and flash_cpu.dot_beats_fma() else "f32"
    assert flash_cpu.prefill_tiles() == expected
    fma, dot = flash_cpu.core_peaks(200_000)
    assert fma > 0 and (dot > 0) == bool(LIB.flash_prefill_bf16_built())


@needs_kernel
def test_bad_choice_is_refused(monkeypatch):
    monkeypatch.setenv(flash_cpu.TILES_VAR, "fp8")
    with pytest.raises(ValueError, match=flash_cpu.TILES_VAR):
        flash_cpu.prefill_tiles()
