"""Advanced lesson 08: routing policies on scripted request streams (cache-aware keeps a
conversation on the replica holding its prefix, the imbalance override, vLLM issue 52463's
rotating tie-break), DP=2 tokens identical to one engine (fp32, greedy), lesson 20's API on
top, replica faults (a step that raises, an engine that dies, a hang, a kill) surfacing in
seconds with the replica's own account and no process left behind. Across machines:
test_adv08_multi_node.py."""
from __future__ import annotations

import asyncio
import gc
import signal
import os
import time

import psutil
import pytest
import torch

from advanced.adv08_data_parallel.frontend import DPFrontEnd
from advanced.adv08_data_parallel.faults import FAULT_ENV, parse_fault
from advanced.adv08_data_parallel.router import CacheAware, ReplicaLoad, create_router
from advanced.adv08_data_parallel.server import DPAsyncLLM
from advanced.adv08_data_parallel.workload import chat_workload, run_chat, send_turn
from step18_benchmark.faults import EngineDead, StepFailed
from step18_benchmark.loadgen import Request, engine_sender
from minivllm_support.timeline import chrome_trace, validate_trace
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step19_real_model.engine import LogprobsEngine
from step19_real_model.params import SamplingParams
from tests.processes import our_children

WAIT_S = 20.0            # the bound on any wait here: a failure must show well before it


def _running(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _none_left(pids: list[int] | None = None) -> bool:
    """The given processes (default: every child of ours) are gone, within WAIT_S."""
    def left() -> list:
        return _running(pids) if pids is not None else our_children()
    deadline = time.monotonic() + WAIT_S
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    return left() == []


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, WAIT_S))


def _idle(n: int = 2) -> list[ReplicaLoad]:
    return [ReplicaLoad() for _ in range(n)]


# ---- the routers, on scripted streams (no processes) --------------------------------------------
SYS = list(range(100, 164))                                  # a 64-token system prompt


def test_cache_aware_sends_the_follow_up_turn_where_its_prefix_is():
    r = create_router("cache_aware", 2)
    a1, b1 = SYS + [1, 2, 3], [7] * 40 + [8]
    first = r.route(a1, _idle())
    other = r.route(b1, [ReplicaLoad(in_flight=int(i == first)) for i in range(2)])
    assert other != first                                    # nothing matches: the idle replica
    loads = [ReplicaLoad(in_flight=1 if i == first else 0) for i in range(2)]   # busier, still balanced
    assert r.route(a1 + [50, 51, 4, 5], loads) == first
    assert r.decisions["prefix"] == 1 and r.decisions["balance"] == 2


def test_imbalance_override_fires_when_the_prefix_replica_is_swamped():
    r = create_router("cache_aware", 2, balance_abs=4, balance_rel=1.5)
    home = r.route(SYS + [1], _idle())
    swamped = [ReplicaLoad(in_flight=12 if i == home else 1, running=1) for i in range(2)]
    assert r.route(SYS + [1, 2], swamped) != home and r.decisions["imbalance"] == 1   # prefix ignored
    r.forget(1 - home)                                       # (forget what that taught replica 1)
    # all running: scores 4 and 1, 3 apart, within balance_abs: the prefix wins again
    near = [ReplicaLoad(in_flight=4 if i == home else 1, running=4) for i in range(2)]
    assert r.route(SYS + [1, 3], near) == home and r.decisions["prefix"] == 1


def test_rotating_tie_break_loses_multi_turn_locality_cache_aware_keeps_it():
    """vLLM issue 52463: at low load every decision is a tie; a tie-break that rotates sends
    each turn of a conversation to another replica than the one holding its prefix."""
    routers = {name: create_router(name, 2, **opts) for name, opts in
               [("least_load", {"tie_break": "rotate"}), ("cache_aware", {}), ("round_robin", {})]}
    convs = [[9] * 30 + [c] for c in range(3)]             # three conversations, turns interleaved
    places = {name: [[] for _ in convs] for name in routers}
    for turn in range(4):
        for c in range(len(convs)):
            convs[c] = convs[c] + [turn + 20, c + 40]
            for name, router in routers.items():
                places[name][c].append(router.route(convs[c], _idle()))   # one at a time: all tied
    for c in range(len(convs)):
        assert len(set(places["cache_aware"][c])) == 1                  # every turn at home
        assert len(set(places["least_load"][c])) == 2                   # rotated away every turn
        assert len(set(places["round_robin"][c])) == 2
    first = create_router("least_load", 2, tie_break="first")
    assert {first.route([1, 2, 3], _idle()) for _ in range(4)} == {0}   # fixed start: sticky by accident


def test_router_trees_stay_within_their_budget_and_errors_name_the_problem():
    r = CacheAware(2, tree_tokens=100)
    for i in range(20):
        r.route([i] * 30, _idle())
    assert max(r.sizes) <= 100 and sum(r.sizes) > 0
    assert r.route(list(range(5)), [ReplicaLoad(alive=False), ReplicaLoad()]) == 1
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        create_router("fastest", 2)
    with pytest.raises(ValueError, match="round_robin.*tie_break"):
        create_router("round_robin", 2, tie_break="first")
    with pytest.raises(ValueError, match="tie_break"):
        create_router("least_load", 2, tie_break="random")
    with pytest.raises(RuntimeError, match="no live replica"):
        r.route([1], [ReplicaLoad(alive=False)] * 2)
    with pytest.raises(ValueError, match=FAULT_ENV):
        parse_fault("explode", 0, 2)
    assert parse_fault("hang@3", 1, 2) == ("hang", 3) and parse_fault("hang@3", 0, 2) is None


# ---- real replicas --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_front(smol_dir):
    front = DPFrontEnd(smol_dir, 2, "cache_aware", dtype=torch.float32, kv_cache_bytes=64 * 2**20)
    yield front
    front.close()
    assert _none_left(front.pids())


def test_dp2_tokens_identical_to_one_engine_fp32(smol_front, smol_dir, smol_prompts):
    """Greedy, fp32: whichever replica a request lands on, its tokens are one engine's."""
    params, prompts = SamplingParams(temperature=0, max_tokens=8), smol_prompts[:4]
    # The replicas' engine (lesson 19's, eager), here in this process, on one thread like them.
    engine = LogprobsEngine(smol_dir, PagedSchedulerConfig(kv_cache_bytes=64 * 2**20), dtype=torch.float32,
                            threads_per_rank=1, use_graph=False)
    try:
        expected = [s.output_token_ids for s in engine.generate(prompts, params)]
    finally:
        engine.close()
    smol_front.set_policy("round_robin")                     # both replicas get some

    async def all_at_once():
        return await asyncio.gather(*(send_turn(smol_front, p, 8) for p in prompts))
    outs = _run(all_at_once())
    got = [out[:len(e)] for (rec, out), e in zip(outs, expected)]   # ignore_eos: cut at one engine's end
    assert all(rec.success for rec, _ in outs) and got == expected


def test_conversation_keeps_its_prefix_under_cache_aware_not_under_rotation(smol_front):
    """End to end: the replicas' own prefix-cache counters, one turn at a time (all tied)."""
    hits = {}
    for seed, policy, opts in [(1, "least_load", {"tie_break": "rotate"}), (2, "cache_aware", {})]:
        smol_front.set_policy(policy, **opts)
        convs = chat_workload(1, 2, 1, 64, 8, vocab=49152, seed=seed)   # fresh tokens: no old hits
        before = sum(s.prefix_cache_hits for s in smol_front.replica_stats() if s)
        run = run_chat(smol_front, convs, rate=float("inf"), max_tokens=4)
        assert all(r.success for r in run.records)
        hits[policy] = sum(s.prefix_cache_hits for s in smol_front.replica_stats()) - before
    assert hits["least_load"] == 0 and hits["cache_aware"] >= 64      # turn 2: turn 1 at least


def test_lesson20_api_serves_from_the_replicas(smol_front):
    from fastapi.testclient import TestClient
    from step20_http_serve.api import build_app
    smol_front.set_policy("cache_aware")
    llm = DPAsyncLLM(smol_front, "smol")
    routed = sum(smol_front.routed())
    generated = sum(s.generation_tokens for s in smol_front.replica_stats())
    with TestClient(build_app(llm)) as client:
        assert client.get("/health").status_code == 200
        body = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                "temperature": 0}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
        n = answer["usage"]["completion_tokens"]
        assert 1 <= n <= 5 and answer["choices"][0]["message"]["content"], answer
        # It went through the router to a replica, whose engine made those tokens.
        assert sum(smol_front.routed()) == routed + 1
        assert sum(s.generation_tokens for s in smol_front.replica_stats()) == generated + n
        assert "vllm:prefix_cache_queries_total" in client.get("/metrics").text


# ---- faults (the tiny model: quick to start) --------------------------------------------------------
def _greedy(n: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


async def _tokens(front, prompt, n=4):
    return [e.token_id async for e in front.generate(prompt, _greedy(n))]


def test_failed_step_and_dead_engine_stay_on_their_replica(tiny_qwen3_dir, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "dead@1:1")                # replica 1: every forward raises
    with DPFrontEnd(tiny_qwen3_dir, 2, "round_robin") as front:
        pids = front.pids()

        async def six():
            out = []
            for i in range(6):
                try:
                    out.append(await _tokens(front, [5 + i] * 8))
                except Exception as e:  # noqa: BLE001 - collected for the asserts
                    out.append(e)
            return out
        out = _run(six())
        errors = [e for e in out if isinstance(e, Exception)]
        # Each was in the step that raised (lesson 18: StepFailed); the third fault kills the engine.
        assert [type(e) for e in errors] == [StepFailed] * 3 and "replica 1" in str(errors[0])
        assert sum(isinstance(o, list) for o in out) == 3
        deadline = time.monotonic() + WAIT_S
        while front.alive()[1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert front.alive() == [True, False]
        assert "3 faults within 60 s" in front._hub.replicas[1].account    # the replica's own words
        assert front._hub.replicas[1].proc.exitcode == 3         # lesson 20's EXIT_ENGINE_DEAD
        assert _run(_tokens(front, [9] * 8))                     # the live replica serves on
    assert _none_left(pids)


def test_hung_then_killed_replicas_fail_or_reroute_their_requests_in_seconds(tiny_qwen3_dir, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "hang@5:0")                # replica 0's 5th forward: the 3rd request's first
    with DPFrontEnd(tiny_qwen3_dir, 2, "round_robin", hang_timeout_s=1.5) as front:
        pids = front.pids()
        assert _run(_tokens(front, [7] * 8)) and _run(_tokens(front, [8] * 8))   # both warm: 4 forwards each
        tokens = _run(_tokens(front, [9] * 8))                # replica 0 hangs; stopped; re-routed to 1
        assert tokens == _run(_tokens(front, [9] * 8))        # what replica 1 makes of it, as if nothing happened
        assert front.alive() == [False, True]
        account = front._hub.replicas[0].account
        assert "hung" in account and "sleep" in account        # the replica's own stack

        async def killed_midway():                          # tokens came, then the error: never silence
            got = []
            with pytest.raises(EngineDead, match="replica 1 died.*SIGKILL"):
                async for e in front.generate([3] * 8, _greedy(400)):
                    got.append(e.token_id)
                    if len(got) == 2:
                        os.kill(pids[1], signal.SIGKILL)
            return got
        assert len(_run(killed_midway())) >= 2
        assert front.error is not None and front.alive() == [False, False]
        with pytest.raises(EngineDead, match="no replica is alive"):
            _run(_tokens(front, [4] * 8))
    assert _none_left(pids)


def test_abort_frees_the_request_and_garbage_collection_leaves_no_process(tiny_qwen3_dir):
    front = DPFrontEnd(tiny_qwen3_dir, 1, "least_load", trace=True)
    pids = front.pids()
    try:
        async def hang_up(dp: DPFrontEnd) -> tuple[int, list[int]]:
            got = 0
            async for _ in dp.generate([6] * 8, _greedy(400)):
                got += 1
                if dp.replica_stats()[0].num_running == 1:
                    break                                   # a client that hung up, mid-stream
            return got, await _tokens(dp, [6] * 8)          # the replica's next report comes with this
        got, after = _run(hang_up(front))
        assert 1 <= got < 400 and after, "the client must hang up before its request ends"
        last = front.replica_stats()[0]
        assert last.num_running == 0 and last.num_waiting == 0 and last.kv_blocks_used == 0   # aborted there
        assert last.generation_tokens < 400                 # it did not run on to max_tokens
        rec = _run(engine_sender(front)(Request([5] * 8, 3)))  # lesson 18's load generator, unchanged
        assert rec.success and rec.output_len == 3
        (tl,) = front.timelines()                           # the replica's engine steps, on our clock
        assert tl.spans and {s.cat for s in tl.spans} == {"compute"} and not validate_trace(chrome_trace([tl]))
        # Its clock offset, measured when it started (answer_offset over its connection): one machine, ~0.
        assert tl.offset_ns == front._hub.replicas[0].offset_ns and abs(tl.offset_ns) < 50_000_000
        assert front.timelines()[0].spans == []             # taken: the next call starts afresh
    except BaseException:
        front.close()
        raise
    del front
    gc.collect()                                            # the finalizer stops the replicas
    assert _none_left(pids)
    before = len(our_children())
    with pytest.raises(ValueError, match="unknown routing policy"):
        DPFrontEnd(tiny_qwen3_dir, 2, "fastest")             # refused before any process starts
    assert len(our_children()) == before


def test_a_replica_that_fails_to_start_says_why_and_nothing_is_left(tiny_qwen3_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_qwen3_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a checkpoint")
    before = len(our_children())
    with pytest.raises(RuntimeError, match="(?s)replica 0 failed while starting.*SafetensorError"):
        DPFrontEnd(broken, 1, "round_robin")                # its own traceback, in the error
    deadline = time.monotonic() + WAIT_S
    while len(our_children()) > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(our_children()) <= before
