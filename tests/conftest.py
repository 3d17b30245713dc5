"""Shared fixtures: the tiny random Qwen3 and the embedded SmolLM2, each built/loaded once."""
from __future__ import annotations

import itertools
import os
import time
import warnings

import pytest
import torch

from minivllm_support.tiny import build_tiny_qwen3
from tests.processes import MARK, marked, reap

torch.set_grad_enabled(False)
# Triton's interpreter must be chosen before any @triton.jit runs, and a lesson module imported
# by an earlier test file may define its kernels first (TRITON_INTERPRET=0 still selects a GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")

# Every process started during this run carries MARK (tests/processes.py): RUN while session and
# module fixtures start theirs, RUN.<n> while test n runs.
RUN = f"pytest-{os.getpid()}"
os.environ[MARK] = RUN
_test_numbers = itertools.count(1)


@pytest.fixture(autouse=True)
def owned_processes():
    """Owns what the test starts, whatever the outcome: at teardown (after the test's own
    fixtures have ended theirs) any process still carrying the test's mark is killed, in its
    own session or re-parented to init as it may be, and named in a warning."""
    tag = f"{RUN}.{next(_test_numbers)}"
    os.environ[MARK] = tag
    yield tag
    os.environ[MARK] = RUN
    if left := reap(marked(tag)):
        warnings.warn("killed processes the test left behind:\n  " + "\n  ".join(left), pytest.PytestWarning)


def pytest_sessionfinish(session, exitstatus):
    """What session and module fixtures started, and anything a test left that escaped its reaping."""
    if left := reap(marked(RUN, and_below=True)):
        print("\nkilled processes left at the end of the run:\n  " + "\n  ".join(left))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def smol_dir():
    return _embedded()  # always the embedded model: tests must not depend on what a user has cached


def _embedded():
    from minivllm_support.models import embedded_smollm2
    return embedded_smollm2()


@pytest.fixture(scope="session")
def smol_fp32(smol_dir):
    from step04_transformer.loader import load_model
    return load_model(smol_dir, torch.float32)


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    from minivllm_support.models import load_tokenizer
    return load_tokenizer(smol_dir)


@pytest.fixture(scope="session")
def smol_hf(smol_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32).eval()


# Prompts used by every engine test: different lengths, chat and plain text.
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Hi",
    "Explain in one sentence why the sky is blue, and then say goodbye politely.",
]


@pytest.fixture(scope="session")
def smol_prompts(smol_tokenizer):
    from minivllm_support.models import chat_prompt_ids
    return [chat_prompt_ids(smol_tokenizer, p) for p in PROMPTS]


# The engine workload: prompts of different lengths, different max_tokens, and requests that
# stop at EOS at different steps (3, 8, 10 and 12 tokens with the embedded model).
ENGINE_QUESTIONS = [
    ("Reply with one word: yes or no?", 12),
    ("What is the capital of France?", 20),
    ("Hi", 16),
    ("What colour is the sky?", 18),
    ("What is 2+2?", 24),
    ("Explain in one sentence why the sky is blue, and then say goodbye politely.", 10),
]


@pytest.fixture(scope="session")
def engine_workload(smol_fp32, smol_tokenizer):
    """(prompts, greedy SamplingParams, lesson 05's tokens for each) on the embedded model, fp32."""
    from minivllm_support.models import chat_prompt_ids
    from step05_naive.generate import generate_naive
    from step06_sampler.params import SamplingParams

    prompts = [chat_prompt_ids(smol_tokenizer, q) for q, _ in ENGINE_QUESTIONS]
    params = [SamplingParams(temperature=0, max_tokens=n) for _, n in ENGINE_QUESTIONS]
    eos = smol_fp32.config.eos_token_ids
    ref = [generate_naive(smol_fp32, p, sp.max_tokens, eos) for p, sp in zip(prompts, params)]
    assert sum(r.finished_by_eos for r in ref) >= 3, "workload should include EOS stops"
    return prompts, params, [r.token_ids for r in ref]


@pytest.fixture
def one_thread():
    """Exact-token tests need no parallelism, and one thread stays fast beside other processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_leftovers(owned_processes):
    """A test of a multi-process engine ends with no process of its own left: none of our new
    children, nothing carrying its mark (waited for up to 10 s). What is left is named, then
    killed. Lesson 17's own test file has a stricter one (shared-memory files too)."""
    from tests.processes import our_children
    before = {p.pid for p in our_children()}
    yield
    deadline = time.monotonic() + 10
    while (left := leftovers(owned_processes, before)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        pytest.fail("processes left behind by the test (now killed):\n  " + "\n  ".join(reap(left)))


def leftovers(tag: str, before: set[int]) -> list:
    from tests.processes import our_children
    found = {p.pid: p for p in marked(tag)}
    found.update({p.pid: p for p in our_children() if p.pid not in before})
    return list(found.values())


@pytest.fixture(scope="session")
def tiny4(tmp_path_factory):
    """The tiny random Qwen3 with 4 layers, so that 3 pipeline stages have a middle one."""
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-4l"), num_hidden_layers=4)
