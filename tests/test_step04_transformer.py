import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from minivllm_support.models import resolve_model
from step04_transformer.config import ModelConfig
from step04_transformer.loader import load_model


def _logits(model, ids):
    return model.compute_logits(model(ids, torch.arange(len(ids))))


def test_logits_equal_hf_qwen3_tiny(tiny_qwen3_dir):
    ours = load_model(tiny_qwen3_dir, torch.float32)
    assert ours.config.architecture == "Qwen3ForCausalLM" and ours.config.qk_norm
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_dir), dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (57,), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(ours, ids), hf(ids[None]).logits[0], atol=1e-5, rtol=1e-4)


def test_a_model_cast_after_loading_keeps_float32_rope_tables(tiny_qwen3_dir):
    """model.to(dtype) casts the weights; the cos/sin tables stay float32 (later lessons' kernels
    read them as float32), so the cast model computes what one loaded in that dtype computes."""
    loaded = load_model(tiny_qwen3_dir, torch.bfloat16)
    cast = load_model(tiny_qwen3_dir, torch.float32).to(torch.bfloat16)
    assert cast.rotary.cos.dtype == cast.rotary.sin.dtype == torch.float32
    assert torch.equal(cast.rotary.cos, loaded.rotary.cos)
    ids = torch.randint(0, loaded.config.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(cast, ids), _logits(loaded, ids))


def test_logits_equal_hf_llama_on_smollm2(smol_fp32, smol_hf, smol_prompts):
    assert smol_fp32.config.architecture == "LlamaForCausalLM" and not smol_fp32.config.qk_norm
    ids = torch.tensor(smol_prompts[4])
    ref = smol_hf(ids[None]).logits[0]
    ours = _logits(smol_fp32, ids)
    assert (ours - ref).abs().max() < 1e-3 * ref.abs().max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_qwen2_switch_loads_qkv_bias(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    hf = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("bias"):
                p.normal_()
    hf.save_pretrained(str(tmp_path))
    ours = load_model(tmp_path, torch.float32)
    assert ours.config.attention_bias and not ours.config.qk_norm
    ids = torch.arange(20) * 7 % 256
    torch.testing.assert_close(_logits(ours, ids), hf(ids[None]).logits[0], atol=1e-5, rtol=1e-4)


def test_missing_tensor_is_a_clear_error(tiny_qwen3_dir, tmp_path):
    shutil.copy(tiny_qwen3_dir / "config.json", tmp_path / "config.json")
    state = load_file(str(tiny_qwen3_dir / "model.safetensors"))
    state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(tmp_path, torch.float32)


def test_unexpected_and_misshapen_tensors_are_errors(tiny_qwen3_dir, tmp_path):
    shutil.copy(tiny_qwen3_dir / "config.json", tmp_path / "config.json")
    state = load_file(str(tiny_qwen3_dir / "model.safetensors"))
    state["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="extra"):
        load_model(tmp_path, torch.float32)
    state.pop("model.layers.0.mlp.extra.weight")
    state["model.norm.weight"] = torch.ones(3)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_model(tmp_path, torch.float32)


def test_unsupported_architecture_is_named(tiny_qwen3_dir):
    cfg = json.loads((tiny_qwen3_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelConfig.from_dict(cfg)


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(tmp_path)


def test_position_beyond_context_errors(tiny_qwen3_dir):
    m = load_model(tiny_qwen3_dir, torch.float32)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        m(torch.tensor([1]), torch.tensor([m.config.max_position_embeddings]))


def test_model_lookup_order(tmp_path, monkeypatch, tiny_qwen3_dir):
    """--model beats $MINIVLLM_MODEL, which beats a Qwen3-0.6B in the HF cache."""
    snap = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").write_bytes(b"")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("MINIVLLM_MODEL", raising=False)
    assert resolve_model(None) == snap
    monkeypatch.setenv("MINIVLLM_MODEL", str(tiny_qwen3_dir))
    assert resolve_model(None) == tiny_qwen3_dir
    assert resolve_model(str(snap)) == snap
