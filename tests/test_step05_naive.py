import pytest
import torch

from step05_naive.generate import generate_naive


def test_greedy_tokens_equal_hf_generate(smol_fp32, smol_hf, smol_prompts):
    eos = smol_fp32.config.eos_token_ids
    for ids in smol_prompts[:2]:
        ours = generate_naive(smol_fp32, ids, 12, eos)
        ref = smol_hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                               eos_token_id=eos, pad_token_id=eos[0])[0, len(ids):].tolist()
        assert ours.token_ids == ref  # both include the EOS token when they stop on it
        assert ours.finished_by_eos == (ref[-1] in eos)


def test_stops_at_eos_unless_ignored(smol_fp32, smol_prompts):
    eos = smol_fp32.config.eos_token_ids
    out = generate_naive(smol_fp32, smol_prompts[0], 40, eos)
    assert out.finished_by_eos and out.token_ids[-1] in eos and len(out.token_ids) < 40
    forced = generate_naive(smol_fp32, smol_prompts[0], len(out.token_ids) + 3, eos, ignore_eos=True)
    assert len(forced.token_ids) == len(out.token_ids) + 3
    assert forced.token_ids[: len(out.token_ids)] == out.token_ids


def test_bad_prompts_are_clear_errors(smol_fp32):
    with pytest.raises(ValueError, match="empty"):
        generate_naive(smol_fp32, [], 4)
    with pytest.raises(ValueError, match="out of range"):
        generate_naive(smol_fp32, [1, 10**9], 4)
    with pytest.raises(ValueError, match="context"):
        generate_naive(smol_fp32, [1] * 10, smol_fp32.config.max_position_embeddings)
