"""Advanced lesson 06 with tensor parallelism inside each stage (tp_stage.py): TP=2 x PP=2, four
ranks, gives one process's tokens with micro-batches in flight and chunked prefill, on one
machine and over two "nodes" placed as vLLM places them (a stage's TP group on one node, the
pipeline across); the split stage loads strictly; a rank killed mid-run is named in seconds."""
from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm_support.tiny import build_tiny_qwen3
from step04_transformer.loader import load_model
from step04_transformer.model import SingleSequenceAttention
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step16_cuda_graph.cpu.engine import build_engine
from step17_tensor_parallel.control import RendezvousError
from step17_tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from advanced.adv06_pipeline_parallel.engine import PPEngine
from advanced.adv06_pipeline_parallel.stage import Stage
from advanced.adv06_pipeline_parallel.tp_stage import load_tp_stage
from advanced.adv06_pipeline_parallel.node import run_torchrun_stage
from tests.processes import fake_torchrun_env, free_port, gone, kill_tree, start_node
from tests.test_adv06_multi_node import _launch
from tests.test_adv06_pipeline_parallel import _generate_until_failure, _prompts

CONFIG = PagedSchedulerConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, kv_cache_bytes=1 << 20)
SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def one_process(tiny4):
    prompts = _prompts(512, (3, 40, 17, 64, 9))
    engine = build_engine(load_model(tiny4, torch.float32), CONFIG, use_graph=False)
    return prompts, [s.output_token_ids for s in engine.generate(prompts, SP)]


@pytest.mark.slow
def test_tp2_pp2_equals_one_process(tiny4, one_process, no_leftovers):
    prompts, ref = one_process
    with PPEngine(tiny4, CONFIG, pipeline_parallel_size=2, tensor_parallel_size=2, dtype=torch.float32,
         timeout_s=20) as engine:
        assert len(engine.workers) == 3 and engine.last_stage_rank == 2
        for m in (1, 2):
            engine.set_micro_batches(m)
            assert [s.output_token_ids for s in engine.generate(prompts, SP)] == ref, m
        # every TP rank of stage 0 sends its copy of the hidden state; one rank sends the rows back
        assert engine.bytes_sent["hidden"] > 0 and engine.bytes_sent["returned"] > 0
        weights = [m["weight_bytes"] for m in engine.rank_memory]
        assert weights[0] == weights[1] > weights[2] == weights[3]    # stage 0 ranks: the whole embedding each


def test_tp_stage_loader_splits_the_linears_and_keeps_the_head_on_rank_0(tmp_path):
    """Loaded without processes (a split forward needs its all-reduce partner, so the tokens are
    the engine tests' job): each rank's stage holds its half of every linear of its layers (rows
    of the column-parallel ones, columns of the row-parallel ones) and nothing of the other
    stage's layers; the untied LM head only on rank 0, and it equals the full model's; the whole
    embedding on every rank of stage 0; a model that cannot be split is refused naming the field."""
    folder = build_tiny_qwen3(tmp_path / "untied", num_hidden_layers=4, tie_word_embeddings=False)
    full = load_model(folder, torch.float32)
    whole = dict(full.named_parameters())
    parts = {(s, r): load_tp_stage(folder, Stage(s, 2, 2 * s, 2 * s + 2), r, 2) for s in (0, 1) for r in (0, 1)}
    assert parts[0, 0].lm_head is not None and parts[0, 1].lm_head is None and parts[1, 0].lm_head is None
    for (stage, rank), part in parts.items():
        seen = set()
        for name, module in part.named_modules():
            if isinstance(module, ColumnParallelLinear):
                w = whole[f"{name}.weight"]
                rows = w.shape[0] // 2
                assert torch.equal(module.linear.weight, w[rank * rows:(rank + 1) * rows]), (stage, rank, name)
            elif isinstance(module, RowParallelLinear):
                w = whole[f"{name}.weight"]
                cols = w.shape[1] // 2
                assert torch.equal(module.linear.weight, w[:, rank * cols:(rank + 1) * cols]), (stage, rank, name)
            else:
                continue
            seen.add(name)
        mine = {f"model.layers.{i}.{m}" for i in (2 * stage, 2 * stage + 1) for m in LINEARS}
        assert seen == mine, (stage, rank, sorted(seen ^ mine))
        for name, t in part.named_parameters():          # what is not split is whole: norms, stage 0's embedding
            if name in whole and "proj" not in name:
                assert torch.equal(t, whole[name]), (stage, rank, name)
    assert all(parts[0, r].model.embed_tokens.weight.shape == whole["model.embed_tokens.weight"].shape for r in (0, 1))
    with pytest.raises(ValueError, match="num_attention_heads"):
        load_tp_stage(folder, Stage(0, 2, 0, 2), 0, 3)
    ids, pos = torch.tensor([3, 8, 100, 7]), torch.arange(4)
    ref = full.compute_logits(full(ids, pos, SingleSequenceAttention()))
    assert torch.equal(parts[0, 1].model.embed_tokens(ids), full.model.embed_tokens(ids))
    assert torch.equal(parts[0, 0].compute_logits(full(ids, pos)), ref)


def test_tp_stage_loader_is_strict_about_its_own_stage(tmp_path):
    """A tensor of stage 1 missing: stage 1's ranks refuse naming it, stage 0's (which never read
    it) load; a tensor that matches no parameter of a stage that reads it is refused naming it."""
    folder = build_tiny_qwen3(tmp_path / "m", num_hidden_layers=4)
    tensors = load_file(str(folder / "model.safetensors"))
    missing, extra = tmp_path / "missing", tmp_path / "extra"
    for out, change in ((missing, lambda t: t.pop("model.layers.3.mlp.down_proj.weight")),
                        (extra, lambda t: t.__setitem__("model.layers.2.mlp.surprise.weight", torch.zeros(2)))):
        shutil.copytree(folder, out)
        edited = dict(tensors)
        change(edited)
        save_file(edited, str(out / "model.safetensors"))
    for rank in (0, 1):
        with pytest.raises(KeyError, match=r"missing tensors: \['model.layers.3.mlp.down_proj.linear.weight'\]"):
            load_tp_stage(missing, Stage(1, 2, 2, 4), rank, 2)
        load_tp_stage(missing, Stage(0, 2, 0, 2), rank, 2)
        with pytest.raises(KeyError, match="'model.layers.2.mlp.surprise.weight'.*matches no model parameter"):
            load_tp_stage(extra, Stage(1, 2, 2, 4), rank, 2)


@pytest.mark.slow
def test_tp2_pp2_over_two_nodes_keeps_each_tp_group_on_one_node(tiny4, one_process, capfd, no_leftovers):
    prompts, ref = one_process
    port = free_port()
    node1 = start_node("advanced.adv06_pipeline_parallel.node", tiny4, port, "--pipeline-parallel-size", "2",
                       "--tensor-parallel-size", "2")
    try:
        with PPEngine(tiny4, CONFIG, pipeline_parallel_size=2, tensor_parallel_size=2, dtype=torch.float32,
                      timeout_s=20, launch=_launch(port)) as engine:
            assert len(engine.workers) == 1                    # rank 1 here; ranks 2, 3 on node 1
            assert [s.output_token_ids for s in engine.generate(prompts, SP)] == ref
        out = gone(node1, 30)
    finally:
        kill_tree(node1)
    assert node1.returncode == 0, out
    assert "ranks [2, 3] (stages [1] of 2, tensor parallel 2)" in out
    table = capfd.readouterr().out
    assert "all 4 ranks joined" in table and "spans nodes" not in table


def test_tp_size_mismatch_between_nodes_is_refused(tiny4, no_leftovers):
    """Node 1 started without --tensor-parallel-size: its world is 2 ranks, node 0's is 4."""
    port = free_port()
    bad = start_node("advanced.adv06_pipeline_parallel.node", tiny4, port, "--pipeline-parallel-size", "2")
    try:
        with pytest.raises(RendezvousError, match="world"):
            PPEngine(tiny4, CONFIG, pipeline_parallel_size=2, tensor_parallel_size=2, dtype=torch.float32,
                     timeout_s=20, launch=_launch(port))
        out = gone(bad)
        assert bad.returncode == 2 and "refused by rank 0" in out, out
    finally:
        kill_tree(bad)


def test_tp_rank_killed_mid_run_is_named(tiny4, no_leftovers):
    with PPEngine(tiny4, CONFIG, pipeline_parallel_size=2, tensor_parallel_size=2, dtype=torch.float32,
                  timeout_s=10) as engine:
        os.kill(engine.workers[-1].pid, signal.SIGKILL)          # rank 3: stage 1, TP rank 1
        error = _generate_until_failure(engine)
        assert "rank 3" in str(error) or "pp-rank-3" in str(error), error


def test_a_torchrun_world_other_than_pp_x_tp_is_refused(tiny4, monkeypatch, no_leftovers):
    refusal = r"torchrun started 2 processes .*, but pipeline_parallel_size=2 x tensor_parallel_size=2 needs 4"
    fake_torchrun_env(monkeypatch, 1, 2)
    with pytest.raises(ValueError, match=refusal):
        run_torchrun_stage(str(tiny4), 2, torch.float32, tp=2)
    fake_torchrun_env(monkeypatch, 0, 2)
    with pytest.raises(ValueError, match=refusal):
        PPEngine(tiny4, CONFIG, pipeline_parallel_size=2, tensor_parallel_size=2, dtype=torch.float32)
