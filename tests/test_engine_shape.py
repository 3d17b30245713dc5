"""The shape of the code the restructure of issue 26 promised: from lesson 15 on the engine is
composed from parts, so its class chain stops growing; one class is called LLMEngine; engines
never change the model they are given."""
from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
import torch

from step14_batched_forward.engine import BatchedEngine
from step15_flash_attention.engine import Engine
from step17_tensor_parallel.engine import TPEngine
from step19_real_model.engine import LogprobsEngine

ROOT = Path(__file__).resolve().parents[1]


def depth(cls: type) -> int:
    return len(cls.__mro__) - 1          # classes above object, mixins included


def test_engine_chain_stops_growing_after_lesson_14():
    limit = depth(BatchedEngine)
    for cls in (Engine, TPEngine, LogprobsEngine):
        assert depth(cls) <= limit, f"{cls.__name__}: {[c.__name__ for c in cls.__mro__]}"


def test_one_class_is_called_llmengine():
    found = set()
    for folder in sorted(ROOT.glob("step[0-9][0-9]_*")):
        for info in pkgutil.iter_modules([str(folder)]):
            if info.name in ("run", "bench", "bench_gpu", "vllm_bench", "microbench", "profile_decode", "__main__"):
                continue
            module = importlib.import_module(f"{folder.name}.{info.name}")
            for name, obj in vars(module).items():
                if inspect.isclass(obj) and obj.__name__ == "LLMEngine":
                    found.add(f"{obj.__module__}.{obj.__qualname__}")
    assert found == {"step09_continuous_batching.engine.LLMEngine"}


def test_no_lesson_calls_the_block_managers_private_method():
    users = [p.relative_to(ROOT) for p in ROOT.glob("step*/*.py") if "._take_free_block(" in p.read_text()]
    assert [str(p) for p in users] == ["step12_paged_attention/block_manager.py"]


def _snapshot(model):
    return {name: (id(m), type(m)) for name, m in model.named_modules()}, \
        {name: p.clone() for name, p in model.state_dict().items()}


@pytest.mark.parametrize("lesson", ["14", "15", "16", "16+"])
def test_building_an_engine_leaves_the_model_alone(tiny_qwen3_dir, lesson):
    from step04_transformer.loader import load_model
    from step12_paged_attention.scheduler import PagedSchedulerConfig
    from step15_flash_attention import engine as lesson15
    from step16_cuda_graph import engine as lesson16
    from step16_cuda_graph.cpu import engine as fast_path
    model = load_model(tiny_qwen3_dir, torch.bfloat16)
    modules, weights = _snapshot(model)
    config = PagedSchedulerConfig(block_size=4, kv_cache_bytes=2**20, max_num_seqs=2, max_num_batched_tokens=16)
    build = {"14": BatchedEngine, "15": lesson15.build_engine, "16": lesson16.build_engine,
             "16+": fast_path.build_engine}[lesson]
    engine = build(model, config)
    engine.generate([[5, 6, 7]], None)
    after_modules, after_weights = _snapshot(model)
    assert after_modules == modules
    assert all(torch.equal(weights[k], after_weights[k]) for k in weights)
