import pytest
import torch
import torch.nn.functional as F

from step03_attention.attention import (apply_rope, attention, causal_mask, repeat_kv,
                                        rope_cos_sin, rope_inv_freq)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (16, 8)])
@pytest.mark.parametrize("causal", [True, False])
def test_equals_torch_sdpa(hq, hkv, causal):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, hq, 33, 16), torch.randn(2, hkv, 33, 16), torch.randn(2, hkv, 33, 16)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(attention(q, k, v, causal=causal), ref, atol=1e-5, rtol=1e-5)


def test_queries_at_the_end_of_a_longer_sequence():
    # 3 new queries over 10 keys equal the last 3 rows of full causal attention.
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    full = attention(q, k, v)
    torch.testing.assert_close(attention(q[:, :, -3:], k, v), full[:, :, -3:])


def test_causal_mask_shape_and_decode_row():
    m = causal_mask(4, 4)
    assert torch.equal(m, torch.ones(4, 4, dtype=torch.bool).tril())
    assert causal_mask(1, 7).all()


def test_extra_mask_blocks_keys():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    keep = torch.tensor([False, True, True, True, True])  # e.g. a left pad
    ref = F.scaled_dot_product_attention(q[:, :, 1:], k[:, :, 1:], v[:, :, 1:], is_causal=True)
    torch.testing.assert_close(attention(q, k, v, mask=keep)[:, :, 1:], ref, atol=1e-5, rtol=1e-5)


def test_repeat_kv_groups_heads_in_order():
    x = torch.arange(2).float().view(1, 2, 1, 1)
    assert repeat_kv(x, 3).flatten().tolist() == [0, 0, 0, 1, 1, 1]


def test_bad_head_ratio_errors():
    with pytest.raises(ValueError, match="multiple"):
        attention(torch.randn(1, 3, 2, 4), torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))


def test_rope_scores_depend_only_on_distance():
    torch.manual_seed(3)
    inv = rope_inv_freq(64, 10000.0)
    q, k = torch.randn(64), torch.randn(64)

    def score(pq, pk):
        cq, sq = rope_cos_sin(torch.tensor(pq), inv)
        ck, sk = rope_cos_sin(torch.tensor(pk), inv)
        return apply_rope(q, cq, sq) @ apply_rope(k, ck, sk)

    torch.testing.assert_close(score(5, 2), score(105, 102), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_rope_position_zero_is_identity_and_norm_preserving():
    x = torch.randn(3, 64)
    inv = rope_inv_freq(64, 10000.0)
    c0, s0 = rope_cos_sin(torch.zeros(3, dtype=torch.long), inv)
    torch.testing.assert_close(apply_rope(x, c0, s0), x)
    c, s = rope_cos_sin(torch.tensor([1, 50, 999]), inv)
    torch.testing.assert_close(apply_rope(x, c, s).norm(dim=-1), x.norm(dim=-1))
