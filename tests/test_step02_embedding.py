"""Lesson 02: the embedding table and tied LM head match Hugging Face transformers."""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from minivllm_support.models import load_tokenizer, resolve_model
from minivllm_support.tiny import build_tiny_qwen3
from step02_embedding.embedding import TokenEmbedding, load_embedding, nearest_neighbours, tied_lm_head


@pytest.fixture(scope="module")
def real():
    """(folder, HF model in fp32, tokenizer, our fp32 embedding) for the default checkpoint."""
    from transformers import AutoModelForCausalLM

    folder = resolve_model(None)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return folder, hf, load_tokenizer(folder), load_embedding(folder, torch.float32)


def test_embedding_equals_hf_input_embeddings(real):
    _, hf, _, weight = real
    assert torch.equal(weight, hf.get_input_embeddings().weight.detach())


def test_load_embedding_casts_dtype(real):
    folder, _, _, weight = real
    bf16 = load_embedding(folder, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.shape == weight.shape
    assert torch.equal(bf16, weight.to(torch.bfloat16))


def test_lookup_equals_f_embedding(real):
    _, _, tok, weight = real
    emb = TokenEmbedding.from_weight(weight)
    ids = tok("The cat sat on the mat.", return_tensors="pt").input_ids
    assert torch.equal(emb(ids), F.embedding(ids, weight))
    batch = torch.randint(0, weight.shape[0], (3, 5), generator=torch.Generator().manual_seed(0))
    out = emb(batch)
    assert out.shape == (3, 5, weight.shape[1])
    assert torch.equal(out, F.embedding(batch, weight))
    one_hot = F.one_hot(batch, weight.shape[0]).float()
    assert torch.equal(out, one_hot @ weight)  # a lookup is a matmul with a one-hot matrix


def test_tied_head_equals_hf_lm_head(real):
    _, hf, tok, weight = real
    assert hf.config.tie_word_embeddings
    h = torch.randn(4, weight.shape[1], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(tied_lm_head(h, weight), hf.lm_head(h))
        # and on the model's own final hidden states: our head reproduces HF's logits
        ids = tok("The capital of France is", return_tensors="pt").input_ids
        last = hf.model(ids).last_hidden_state
        torch.testing.assert_close(tied_lm_head(last, weight), hf(ids).logits)


def test_nearest_neighbour_is_itself(real):
    _, _, tok, weight = real
    for word in [" king", " Paris", " dog", " blue"]:
        (t,) = tok.encode(word, add_special_tokens=False)
        ids, sims = nearest_neighbours(weight, t, k=5)
        assert ids[0] == t
        assert sims[0].item() == pytest.approx(1.0, abs=1e-5)
        assert torch.all(sims[:-1] >= sims[1:])  # best first
        brute = F.cosine_similarity(weight[ids], weight[t][None], dim=-1)
        torch.testing.assert_close(sims, brute, atol=1e-5, rtol=1e-5)


def test_out_of_range_ids_raise_clear_error(real):
    _, _, _, weight = real
    emb = TokenEmbedding.from_weight(weight)
    vocab = weight.shape[0]
    with pytest.raises(IndexError, match=rf"token id {vocab} at position \(2,\).*vocab_size {vocab}"):
        emb(torch.tensor([5, 6, vocab, 7]))
    with pytest.raises(IndexError, match="token id -1"):
        emb(torch.tensor([[0, 1], [-1, 2]]))
    with pytest.raises(TypeError):
        emb(torch.tensor([1.0, 2.0]))
    with pytest.raises(IndexError, match=str(vocab + 3)):
        nearest_neighbours(weight, vocab + 3, k=2)
    with pytest.raises(ValueError):
        tied_lm_head(torch.zeros(2, weight.shape[1] + 1), weight)


def test_tiny_qwen3_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = build_tiny_qwen3(tmp_path / "tiny")
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    weight = load_embedding(folder)
    assert torch.equal(weight, hf.get_input_embeddings().weight.detach())
    h = torch.randn(3, weight.shape[1])
    with torch.no_grad():
        torch.testing.assert_close(tied_lm_head(h, weight), hf.lm_head(h))


def test_sharded_checkpoint_with_other_prefix(tmp_path):
    # a two-file checkpoint with an index, the embedding under a multimodal-style prefix
    weight = torch.randn(16, 8)
    name = "model.language_model.embed_tokens.weight"
    save_file({"model.norm.weight": torch.ones(8)}, str(tmp_path / "a.safetensors"))
    save_file({name: weight}, str(tmp_path / "b.safetensors"))
    index = {"weight_map": {"model.norm.weight": "a.safetensors", name: "b.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(load_embedding(tmp_path), weight)
    (tmp_path / "model.safetensors.index.json").unlink()  # without the index: scan the files
    assert torch.equal(load_embedding(tmp_path), weight)
    (tmp_path / "b.safetensors").unlink()
    with pytest.raises(KeyError, match="embed_tokens"):
        load_embedding(tmp_path)
