"""Lesson 04 demo: the whole model on real weights, checked against Hugging Face, and the strict loader.

    python step04_transformer/run.py [--model PATH] [--dtype bf16|fp32] [--threads N]
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from minivllm_support.cli import base_parser, machine, setup
from minivllm_support.models import chat_prompt_ids, load_tokenizer, resolve_model
from minivllm_support.tiny import build_tiny_qwen3
from step04_transformer.loader import load_model

CHAT_QUESTION = "Explain in one sentence why the sky is blue."
PLAIN_PROMPTS = ["The capital of France is", "def fibonacci(n):"]
DROPPED = "model.layers.1.mlp.up_proj.weight"  # the tensor the strict-loader demo deletes


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits at every position of one sequence: [T] -> [T, vocab] float32."""
    return model.compute_logits(model(ids, torch.arange(len(ids))))


def compare(ours: torch.Tensor, ref: torch.Tensor) -> str:
    diff = (ours - ref).abs().max().item()
    rel = diff / ref.abs().max().item()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() * 100
    return (f"max |diff| {diff:.2e}, relative to max |logit| {rel:.1e}, "
            f"argmax agrees at {agree:.1f}% of {ours.shape[0]} positions")


def top5(model, ids: torch.Tensor, show) -> str:
    hidden = model(ids, torch.arange(len(ids)))                       # [T, hidden]
    probs = torch.softmax(model.compute_logits(hidden[-1:])[0], -1)  # only the row we need
    top = torch.topk(probs, 5)
    return "  ".join(f"{show(i)} {p:.3f}" for i, p in zip(top.indices.tolist(), top.values.tolist()))


def greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens, recomputing the whole sequence each step (lesson 05 makes this a lesson)."""
    ids = list(ids)
    for _ in range(n):
        hidden = model(torch.tensor(ids), torch.arange(len(ids)))
        ids.append(int(model.compute_logits(hidden[-1:]).argmax()))
        if ids[-1] in model.config.eos_token_ids:
            break
    return ids


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    dtype = setup(args)
    folder = resolve_model(args.model)
    print(f"model: {folder} ({args.dtype})")

    # 1. Config and size ---------------------------------------------------------------
    t0 = time.perf_counter()
    model = load_model(folder, dtype)
    load_s = time.perf_counter() - t0
    cfg = model.config
    print(f"\n[1] config.json -> {cfg.architecture}")
    print(f"    layers {cfg.num_layers}, hidden {cfg.hidden_size}, MLP inner {cfg.intermediate_size}, "
          f"vocab {cfg.vocab_size}")
    print(f"    heads: {cfg.num_heads} query / {cfg.num_kv_heads} key-value (GQA group of "
          f"{cfg.num_heads // cfg.num_kv_heads}), head_dim {cfg.head_dim}")
    print(f"    switches: qk_norm={cfg.qk_norm} attention_bias={cfg.attention_bias} "
          f"tie_word_embeddings={cfg.tie_word_embeddings}")
    print(f"    RoPE theta {cfg.rope_theta:g}, context {cfg.max_position_embeddings} positions, "
          f"rms_norm_eps {cfg.rms_norm_eps:g}, EOS ids {cfg.eos_token_ids}")

    groups: dict[str, int] = {}
    for name, p in model.named_parameters():
        part = ("embedding (also the LM head)" if "embed_tokens" in name and model.lm_head is None
                else "embedding" if "embed_tokens" in name
                else "LM head" if name.startswith("lm_head")
                else "q/k-norm" if "q_norm" in name or "k_norm" in name
                else "RMSNorm weights" if "norm" in name
                else "attention q/k/v/o" if "self_attn" in name
                else "MLP gate/up/down" if "mlp" in name else name)
        groups[part] = groups.get(part, 0) + p.numel()
    n_params = sum(groups.values())
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"\n    parameters: {n_params / 1e6:.1f} M = {n_bytes / 2**20:.0f} MiB in {args.dtype} "
          f"(loaded in {load_s:.1f} s)")
    for part, n in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"      {part:<30} {n / 1e6:7.2f} M  {n / n_params * 100:5.1f}%")
    kv = cfg.kv_bytes_per_token
    print(f"    KV cache per token (K and V, {cfg.num_layers} layers x {cfg.num_kv_heads} kv heads x "
          f"{cfg.head_dim} dims, bf16): {kv} B = {kv / 2**10:.1f} KiB")
    print(f"    -> one full {cfg.max_position_embeddings}-token context: "
          f"{kv * cfg.max_position_embeddings / 2**20:.0f} MiB of KV, next to {n_bytes / 2**20:.0f} MiB of weights")

    # 2. What the model predicts next -------------------------------------------------
    tok = load_tokenizer(folder)
    show = lambda i: repr(tok.decode([int(i)]))  # noqa: E731  repr shows leading spaces
    print(f"\n[2] next-token top-5 ({args.dtype}), from the last position's logits")
    for text in PLAIN_PROMPTS:
        ids = torch.tensor(tok.encode(text, add_special_tokens=False))
        print(f"    {text!r} ({len(ids)} tokens): {top5(model, ids, show)}")

    # 3. Equal to Hugging Face transformers, in fp32 ------------------------------------
    import transformers
    from transformers import AutoModelForCausalLM
    transformers.logging.set_verbosity_error()      # no warnings: we print what matters ourselves
    transformers.logging.disable_progress_bar()

    chat_ids = torch.tensor(chat_prompt_ids(tok, CHAT_QUESTION))
    ours32 = model if dtype == torch.float32 else load_model(folder, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ref = hf(chat_ids[None]).logits[0].float()
    print(f"\n[3] logits vs HF {type(hf).__name__} on the chat prompt {CHAT_QUESTION!r} "
          f"({len(chat_ids)} tokens, chat template applied)")
    print(f"    ours fp32 vs HF fp32: {compare(logits_of(ours32, chat_ids), ref)}")
    if dtype != torch.float32:
        print(f"    ours {args.dtype} vs HF fp32: {compare(logits_of(model, chat_ids), ref)}")
    del hf

    # 4. The Qwen3 path and the strict loader, on a tiny random Qwen3 --------------------
    tmp = Path(tempfile.mkdtemp(prefix="minivllm-step04-"))
    try:
        good, broken = build_tiny_qwen3(tmp / "tiny"), tmp / "broken"
        tiny = load_model(good, torch.float32)
        tiny_hf = AutoModelForCausalLM.from_pretrained(str(good), dtype=torch.float32).eval()
        ids = torch.randint(0, tiny.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
        tiny_ref = tiny_hf(ids[None]).logits[0]
        print(f"\n[4] tiny random {tiny.config.architecture} (qk_norm={tiny.config.qk_norm}, "
              f"{tiny.config.num_layers} layers, hidden {tiny.config.hidden_size}) vs HF, fp32:")
        print(f"    {compare(logits_of(tiny, ids), tiny_ref)}")

        broken.mkdir()
        shutil.copy(good / "config.json", broken / "config.json")
        state = load_file(str(good / "model.safetensors"))
        deleted = state.pop(DROPPED)
        save_file(state, str(broken / "model.safetensors"))
        print(f"    deleted {DROPPED!r} from a copy of its model.safetensors; our loader says:")
        try:
            load_model(broken, torch.float32)
            print("    (no error -- the loader is NOT strict)")
        except KeyError as e:
            print(f"      KeyError: {e.args[0]}")

        # A lenient loader on the same folder: no exception, only a logged warning.
        lenient, info = AutoModelForCausalLM.from_pretrained(str(broken), dtype=torch.float32,
                                                             output_loading_info=True)
        print(f"    HF from_pretrained on the same folder raises nothing; it returns "
              f"missing_keys={sorted(info['missing_keys'])} and logs a warning")
        print(f"    the weight its model runs with equals the deleted tensor: "
              f"{torch.equal(lenient.get_parameter(DROPPED), deleted)}")
    finally:
        shutil.rmtree(tmp)

    # 5. What that silent hole costs on the real model -----------------------------------
    # Simulate the lenient load: re-initialise ONE matrix the way HF's init does, N(0, initializer_range).
    name = f"model.layers.{cfg.num_layers // 2}.mlp.up_proj.weight"
    param = dict(ours32.named_parameters())[name]
    std = float(json.loads((folder / "config.json").read_text()).get("initializer_range", 0.02))
    question = "What is the capital of France?"
    q_ids = chat_prompt_ids(tok, question)
    france = torch.tensor(tok.encode(PLAIN_PROMPTS[0], add_special_tokens=False))
    n_mats = sum(1 for p in ours32.parameters() if p.dim() == 2)
    print(f"\n[5] if the loader had silently skipped {name!r} (1 of {n_mats} weight matrices, "
          f"{param.numel() / n_params * 100:.2f}% of the parameters), fp32, greedy:")
    for label in ("intact", "skipped"):
        if label == "skipped":
            torch.manual_seed(0)
            param.normal_(0.0, std)
        answer = tok.decode(greedy(ours32, q_ids, 12)[len(q_ids):], skip_special_tokens=True)
        print(f"    {label:<8} {PLAIN_PROMPTS[0]!r} -> {top5(ours32, france, show)}")
        print(f"    {'':<8} {question!r} -> {answer.strip()!r}")
    del ours32

    print(f"\nmachine: {machine()}")


if __name__ == "__main__":
    main()
