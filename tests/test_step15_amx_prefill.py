"""Lesson 15: the prompt attention on AMX tiles (amx_prefill.cpp) is the same tiled online softmax as
flash_attention.cpp, so it is held to the same reference attention. On a CPU without AMX the library
must say so (None), and nothing may route a step to it."""
from __future__ import annotations

import pytest
import torch

from minivllm_support import cpu
from step15_flash_attention import amx_prefill
from step15_flash_attention.reference import random_paged_case, reference_attention


def test_the_library_is_there_exactly_where_the_cpu_has_amx_tiles():
    """If this fails, a CPU without AMX would run the stub, or an AMX CPU would never use its tiles."""
    lib = amx_prefill.amx_library()
    q, k_pool = torch.zeros(4, 4, 64, dtype=torch.bfloat16), torch.zeros(2, 2, 16, 64, dtype=torch.bfloat16)
    if "amx" not in cpu.features():
        assert lib is None and not amx_prefill.amx_prefill_fits(q, k_pool)
        return
    if lib is None:
        pytest.skip("AMX here, but no C++ compiler (or MINIVLLM_KERNEL=0)")
    assert amx_prefill.amx_prefill_fits(q, k_pool)                 # bf16, D 64, 2 heads a group: fits
    assert not amx_prefill.amx_prefill_fits(q.float(), k_pool.float())   # float32 stays with flash_attention.cpp


@pytest.mark.skipif(amx_prefill.amx_library() is None, reason="no AMX tiles on this CPU (or no compiler)")
@pytest.mark.parametrize("Hkv, group, bs, D, q_lens, seq_lens", [
    (2, 2, 16, 64, [5, 24, 40], [30, 24, 40]),             # a later chunk, two whole prompts
    (2, 3, 4, 128, [37, 70], [101, 70]),                   # 3 heads a group, tiny blocks, many tiles
    (1, 8, 16, 128, [129], [300]),                         # a long prefix behind a long chunk
])
def test_prompt_rows_equal_the_reference(Hkv, group, bs, D, q_lens, seq_lens):
    q, k, v, cu, lens, tables = case = random_paged_case(q_lens, seq_lens, Hkv, group, bs, D, torch.bfloat16)
    assert amx_prefill.amx_prefill_fits(q, k)
    out = torch.zeros_like(q)
    amx_prefill.amx_prefill(q, k, v, cu, lens, tables, out)
    torch.testing.assert_close(out.float(), reference_attention(*case), atol=2e-2, rtol=2e-2)
