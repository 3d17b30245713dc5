"""Advanced 10 across machines: two 'machines' on loopback with lesson 17's launch path. Node 1 is
`python -m advanced.adv10_pd_disaggregation.node`, its own process tree, holding one engine; the
KV crosses between the nodes over gloo. The tokens are the colocated engine's; a node started for
another configuration is refused by name and exits non-zero; a killed node 1 is a clear error
with nothing left running. The store transport, which cannot cross machines, is refused by name.
The shared helpers and the colocated reference are the first file's."""
from __future__ import annotations

import pytest

from advanced.adv10_pd_disaggregation.cluster import EngineFailed, PDCluster
from advanced.adv10_pd_disaggregation.records import PDRequest
from step17_tensor_parallel.control import RendezvousError
from step17_tensor_parallel.launch import NodeLaunch
from tests.processes import free_port, gone, kill_tree, start_node
from tests.test_adv10_pd_disaggregation import CONFIG, WAIT_S, _prompts, colocated_tokens  # noqa: F401

NODE = "advanced.adv10_pd_disaggregation.node"


def _launch(port: int) -> NodeLaunch:
    return NodeLaunch(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port, rendezvous_timeout_s=20)


def _requests() -> list[PDRequest]:
    return [PDRequest(0.02 * i, p, 6) for i, p in enumerate(_prompts())]


def test_the_store_cannot_cross_machines():
    with pytest.raises(ValueError, match="/dev/shm, which another machine cannot read"):
        PDCluster("nowhere", transport="store", launch=_launch(29999))
    with pytest.raises(ValueError, match="a disaggregated run on 2 nodes"):
        PDCluster("nowhere", transport="gloo", launch=NodeLaunch(3, 0, "127.0.0.1", 29999))


@pytest.mark.slow
@pytest.mark.parametrize("remote", ["decode", "prefill"])
def test_one_engine_on_another_node(tiny_qwen3_dir, colocated_tokens, remote, no_leftovers):
    port = free_port()
    node1 = start_node(NODE, tiny_qwen3_dir, port, "--engines", "2", "--role", remote)
    try:
        with PDCluster(tiny_qwen3_dir, "disaggregated", config=CONFIG, transport="gloo", launch=_launch(port),
                       remote=remote, transfer_timeout_s=5.0, fault="drop-once:2",
                       start_timeout_s=WAIT_S) as c:
            assert list(c.proc_of) == [{"decode": "prefill", "prefill": "decode"}[remote]]   # one engine here
            recs = c.run(_requests(), WAIT_S)
            stats, timelines = c.stats(), c.timelines()
        assert [r.token_ids for r in recs] == colocated_tokens
        assert [r.retry is not None for r in recs] == [False, False, True, False]
        assert all(r.fallback is None and r.transfer["bytes"] > 0 for r in recs)
        assert all(r.transfer["first_layer"] <= r.token_times[0] for r in recs)     # one clock after alignment
        assert all(s["free_blocks"] == s["num_blocks"] and not s["unfinished"] for s in stats.values())
        assert {"save L0", "load L1"} <= {s.name for tl in timelines for s in tl.spans}
        out = gone(node1)
        assert node1.returncode == 0, out
    finally:
        kill_tree(node1)


@pytest.mark.slow
def test_a_node_started_for_another_role_is_refused(tiny_qwen3_dir, no_leftovers):
    port = free_port()
    bad = start_node(NODE, tiny_qwen3_dir, port, "--engines", "2", "--role", "prefill")   # node 0 wants decode
    try:
        with pytest.raises(RendezvousError, match="extra: node 0 has 'transport=gloo, node 1 runs the decode "
                                                  "engine', this node has '.*prefill engine'"):
            PDCluster(tiny_qwen3_dir, "disaggregated", config=CONFIG, transport="gloo", launch=_launch(port),
                      start_timeout_s=WAIT_S)
        out = gone(bad)
        assert bad.returncode == 2 and "refused by rank 0" in out, out
    finally:
        kill_tree(bad)


@pytest.mark.slow
def test_node_1_killed_is_a_clear_error_and_nothing_is_left(tiny_qwen3_dir, no_leftovers):
    port = free_port()
    node1 = start_node(NODE, tiny_qwen3_dir, port, "--engines", "2", "--role", "decode")
    try:
        with pytest.raises(EngineFailed, match="the decode engine on node 1 closed its connection"):
            with PDCluster(tiny_qwen3_dir, "disaggregated", config=CONFIG, transport="gloo", launch=_launch(port),
                           start_timeout_s=WAIT_S) as c:
                c.run(_requests()[:1], WAIT_S)
                kill_tree(node1)                                      # the machine is gone
                c.run(_requests(), WAIT_S)
        assert c.procs == [] and c.exit_codes["prefill"] is not None
    finally:
        kill_tree(node1)
