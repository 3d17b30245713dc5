"""The engine on one page equals the lesson chain token for token: lesson 05's greedy tokens on
the embedded model, and lesson 16's fast-path engine on a mixed workload (chunks, prefix hits, several
buckets, a batch past the largest bucket)."""
from __future__ import annotations

import pytest
import torch

from step06_sampler.params import SamplingParams
from step12_paged_attention.kv_pool import KVPool
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step15_flash_attention import flash_cpu
from step16_cuda_graph.cpu.engine import build_engine as fast_path_engine
from step19_real_model.engine_on_one_page import OnePageEngine, build_engine

needs_kernel = pytest.mark.skipif(flash_cpu.load() is None, reason="no C++ compiler for the kernel")


def _config(model, blocks=400, **kw):
    bpb = KVPool.bytes_per_block(model.config, 16, model.model.embed_tokens.weight.dtype)
    return PagedSchedulerConfig(kv_cache_bytes=blocks * bpb, **{"max_num_seqs": 4, "max_num_batched_tokens": 24, **kw})


@needs_kernel
def test_one_page_engine_equals_lesson_05(smol_fp32, engine_workload):
    prompts, params, ref = engine_workload
    engine = build_engine(smol_fp32, _config(smol_fp32))
    assert isinstance(engine, OnePageEngine)
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    assert [s.output_token_ids for s in seqs] == ref


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_page_engine_equals_lesson_16_with_its_fast_path(tiny_qwen3_dir, dtype):
    from step04_transformer.loader import load_model
    model = load_model(tiny_qwen3_dir, dtype)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 40, 9, 17, 5, 30)]
    prompts.append(prompts[1][:33] + [7, 8])               # shares two full blocks with prompt 1
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    config = PagedSchedulerConfig(block_size=4, kv_cache_bytes=80 * KVPool.bytes_per_block(model.config, 4, dtype),
                                  max_num_seqs=6, max_num_batched_tokens=16)
    ours = build_engine(model, config)
    assert ours.runner.buckets == [1, 2, 4, 6]
    ref = [s.output_token_ids for s in fast_path_engine(model, config).generate(prompts, sp)]
    assert [s.output_token_ids for s in ours.generate(prompts, sp)] == ref
    assert sum(ours.runner.replays.values()) > 0 and ours.scheduler.block_manager.hit_tokens > 0
