"""Advanced lesson 07 under torchrun: `torchrun --nnodes 2 --nproc-per-node 1` twice on loopback,
rank 0 builds the CPEngine from torchrun's environment and rank 1 turns into its CP worker in
place. cp=2 gives one process's tokens (zigzag and contiguous splits); a worker that fails is
named on rank 0 with its traceback; a torchrun world of another size than cp is refused on
every rank before anything starts. (The two-node tests with node.py are in
test_adv07_context_parallel.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from advanced.adv07_context_parallel.engine import CPEngine
from advanced.adv07_context_parallel.node import run_torchrun_rank
from advanced.adv07_context_parallel.worker import FAULT_ENV
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step16_cuda_graph.cpu.engine import build_engine
from tests.processes import fake_torchrun_env, free_port, gone, kill_tree, torchrun_tokens
from tests.test_adv07_context_parallel import CONFIG, _prompt


# Two 'machines' on loopback, torchrun included: about a minute for the four files; CI runs them (make test-slow).
pytestmark = pytest.mark.slow

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

# Rank 1 never gets past run_torchrun_rank: it serves rank 0's prefills and exits when the engine closes.
TORCHRUN_SCRIPT = """
import json, sys, torch
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step17_tensor_parallel.workers import WorkerFailed
from advanced.adv07_context_parallel.engine import CPEngine
from advanced.adv07_context_parallel.node import run_torchrun_rank
folder, prompt = sys.argv[1], json.loads(sys.argv[2])
run_torchrun_rank(folder, 2, torch.float32, timeout_s=20)
config = PagedSchedulerConfig(block_size=4, kv_cache_bytes=8 * 2**20, max_num_batched_tokens=64)
sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
try:
    with CPEngine(folder, config, context_parallel_size=2, dtype=torch.float32, threads_per_rank=1,
                  timeout_s=20, min_cp_tokens=8) as engine:
        assert engine.workers == [] and engine.worker_set.ranks == [1]     # torchrun started rank 1
        tokens = [engine.generate([prompt], sp)[0].output_token_ids]
        assert engine.last_prefill["layout"].T == len(prompt)         # it went over the ring
        engine.zigzag = False            # contiguous: rank 1 holds the last token and sends its row
        seq = engine.prefill_prompt(prompt, sp)
        while engine.has_unfinished():
            engine.step()
        tokens.append(seq.output_token_ids)
except WorkerFailed as e:
    print("FAILED", json.dumps(str(e)), flush=True)
    sys.exit(3)                          # a failed rank 0 too: torchrun's agents then end at once
print("TOKENS", json.dumps(tokens))
"""


@pytest.fixture(scope="module")
def one_process(tiny_qwen3_dir):
    """(a prompt that is not a multiple of 2cp = 4 chunks, lesson 16's fast-path tokens for it, fp32)."""
    prompt = _prompt(61, 512)
    ref = build_engine(load_model(tiny_qwen3_dir, torch.float32), CONFIG, use_graph=False)
    return prompt, ref.generate([prompt], SP)[0].output_token_ids


def test_torchrun_cp2_gives_the_tokens_of_one_process(tiny_qwen3_dir, one_process, tmp_path, no_leftovers):
    prompt, want = one_process
    got = torchrun_tokens(tmp_path, TORCHRUN_SCRIPT, str(tiny_qwen3_dir), json.dumps(prompt))
    assert got == [want, want]                            # zigzag, then contiguous


def _torchrun_both(tmp_path, script: str, *args: str, env: dict) -> tuple[list[int], list[str]]:
    """Both torchrun launches, as tests/processes.py's torchrun_tokens, but any exit codes allowed."""
    path = tmp_path / "under_torchrun.py"
    path.write_text(script)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    procs = [subprocess.Popen([*torchrun, "--node-rank", str(n), str(path), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True) for n in (0, 1)]
    try:
        outs = [gone(p, 90) for p in procs]
    finally:
        for p in procs:
            kill_tree(p)
    return [p.returncode for p in procs], outs


def test_torchrun_worker_failure_is_named_on_rank_0(tiny_qwen3_dir, one_process, tmp_path, no_leftovers):
    env = {**os.environ, "OMP_NUM_THREADS": "1", FAULT_ENV: "raise@1"}     # rank 1, its first prompt
    codes, outs = _torchrun_both(tmp_path, TORCHRUN_SCRIPT, str(tiny_qwen3_dir), json.dumps(one_process[0]), env=env)
    assert codes[0] != 0 and codes[1] != 0, outs
    line = next((x for x in outs[0].splitlines() if x.startswith("FAILED")), None)
    assert line is not None, outs[0]
    error = json.loads(line.split(" ", 1)[1])
    assert "rank 1" in error and "injected fault" in error and "Traceback" in error, error


def test_a_torchrun_world_other_than_cp_is_refused_on_every_rank(tiny_qwen3_dir, monkeypatch, no_leftovers):
    """Checked before a model is loaded or a store dialled: nothing to wait for, nothing started."""
    refusal = r"torchrun started 3 processes \(WORLD_SIZE = .*\), but context_parallel_size=2 .* needs 2"
    for rank in (0, 1):
        fake_torchrun_env(monkeypatch, rank, 3)
        with pytest.raises(ValueError, match=refusal):
            run_torchrun_rank(str(tiny_qwen3_dir), 2, torch.float32)
    fake_torchrun_env(monkeypatch, 0, 3)
    with pytest.raises(ValueError, match=refusal):
        CPEngine(tiny_qwen3_dir, CONFIG, context_parallel_size=2, dtype=torch.float32)
    fake_torchrun_env(monkeypatch, 0, 2)
    assert run_torchrun_rank(str(tiny_qwen3_dir), 2, torch.float32) is None   # rank 0: goes on to the engine
    fake_torchrun_env(monkeypatch, 1, 2)                   # the right size, but rank 1 builds the engine
    with pytest.raises(ValueError, match="under torchrun CPEngine runs on rank 0; rank 1 becomes its worker"):
        CPEngine(tiny_qwen3_dir, CONFIG, context_parallel_size=2, dtype=torch.float32)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name)
    assert run_torchrun_rank(str(tiny_qwen3_dir), 2, torch.float32) is None     # not torchrun: a no-op
