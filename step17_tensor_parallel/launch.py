"""Where the ranks run: one machine, several machines ("nodes"), or under torchrun.

    node 0 (the one you talk to)                      node 1 .. nnodes-1 (headless)
    rank 0: scheduler, sampler, LLM API, server       python -m step17_tensor_parallel.node \\
            + its shard; hosts the rendezvous             --nnodes N --node-rank R \\
    ranks 1 .. k-1: spawned by rank 0                     --master-addr HOST --master-port PORT
            ^                                         ranks R*k .. R*k+k-1: spawned by the node
            +---- every worker dials HOST:PORT (the store), then rank 0's control socket ----+

The flags are vLLM's and SGLang's names (--nnodes, --node-rank, --master-addr, --master-port).
Ranks are handed out node by node, k = world / nnodes per node, so neighbouring ranks share a
node: with tensor parallel inside a node and pipeline parallel across nodes (vLLM's rule), a TP
group's all-reduces never leave its machine, and only the stage-to-stage hidden states do.

Under torchrun every rank is started by torchrun itself and reads RANK, WORLD_SIZE, LOCAL_RANK,
GROUP_RANK (the node), MASTER_ADDR and MASTER_PORT from the environment; rank 0 then spawns
nobody, and the store is torchrun's own (we join it as a client).

The network card gloo uses is chosen by gloo's own variable: GLOO_SOCKET_IFNAME=eth1 (NCCL_SOCKET_IFNAME
for NCCL on GPUs). Without it gloo takes the interface of the machine's hostname.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class NodeLaunch:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0             # 0: a free port picked by the OS (one machine only)
    rendezvous_timeout_s: float = 60.0
    torchrun: bool = False           # every rank was started by torchrun; nobody spawns

    def __post_init__(self):
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1} for --nnodes {self.nnodes}, "
                             f"got {self.node_rank}")
        if self.nnodes > 1 and not self.master_port and not self.torchrun:
            raise ValueError("--master-port is needed with --nnodes > 1: every node must dial the same port")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"--master-port must be a TCP port (0..65535), got {self.master_port}")

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    def ranks_per_node(self, world: int) -> int:
        if world % self.nnodes:
            raise ValueError(f"{world} ranks do not split evenly over --nnodes {self.nnodes}")
        return world // self.nnodes

    def node_of(self, rank: int, world: int) -> int:
        return rank // self.ranks_per_node(world)

    def local_ranks(self, world: int) -> list[int]:
        """The ranks this node runs (node 0's list includes rank 0, the calling process)."""
        k = self.ranks_per_node(world)
        return list(range(self.node_rank * k, self.node_rank * k + k))

    @classmethod
    def from_env(cls, env=os.environ) -> "NodeLaunch | None":
        """torchrun's variables, or None when this process was not started by torchrun."""
        if not all(v in env for v in TORCHRUN_VARS):
            return None
        world = int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        return cls(nnodes=max(1, world // local_world), node_rank=int(env.get("GROUP_RANK", 0)),
                   master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]), torchrun=True)


def torchrun_rank(env=os.environ) -> int | None:
    return int(env["RANK"]) if all(v in env for v in TORCHRUN_VARS) else None


def check_torchrun_world(needed: int, what: str, env=os.environ) -> None:
    """Under torchrun, refuse on every rank a world that is not `needed` processes, naming both
    numbers: a wrong count would otherwise wait out the rendezvous (or leave a rank with no part).
    what: the engine's size in words, e.g. "tensor_parallel_size=2". A no-op without torchrun."""
    if torchrun_rank(env) is None:
        return
    world = int(env["WORLD_SIZE"])
    if world != needed:
        raise ValueError(f"torchrun started {world} processes (WORLD_SIZE = --nnodes x --nproc-per-node), "
                         f"but {what} needs {needed}")


def add_launch_flags(parser, node_command: str = "python -m step17_tensor_parallel.node") -> None:
    """The multi-node flags, for every entry point that starts a multi-process engine; node_command:
    what the other nodes run (named in the help)."""
    g = parser.add_argument_group("several machines (default: this one)")
    g.add_argument("--nnodes", type=int, default=1, help="machines the ranks span")
    g.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0 .. nnodes-1 "
                   f"(node 0 runs the engine; the others run `{node_command}`)")
    g.add_argument("--master-addr", default="127.0.0.1", help="node 0's address, as the others reach it")
    g.add_argument("--master-port", type=int, default=0, help="the rendezvous port on node 0 (any free "
                   "port; needed with --nnodes > 1)")
    g.add_argument("--rendezvous-timeout-s", type=float, default=60.0,
                   help="how long node 0 waits for every node to join before it names the missing ones")


def launch_from_args(args) -> NodeLaunch:
    """torchrun's environment wins over the flags (it already decided every rank)."""
    return NodeLaunch.from_env() or NodeLaunch(args.nnodes, args.node_rank, args.master_addr, args.master_port,
                                               args.rendezvous_timeout_s)


@dataclass(frozen=True)
class Place:
    rank: int
    node: int
    pp_stage: int
    tp_rank: int


def placement(tp: int, pp: int, nnodes: int) -> list[Place]:
    """vLLM's rule: TP groups inside a node, PP stages across nodes. rank = stage * tp + tp_rank,
    so a stage's TP group is tp consecutive ranks, and consecutive ranks share a node."""
    world = tp * pp
    if world % nnodes:
        raise ValueError(f"tp x pp = {world} ranks do not split evenly over {nnodes} nodes")
    per_node = world // nnodes
    if per_node % tp and tp % per_node:
        raise ValueError(f"a node holds {per_node} ranks: a TP group of {tp} would straddle nodes unevenly")
    return [Place(r, r // per_node, r // tp, r % tp) for r in range(world)]


def placement_table(places: list[Place]) -> str:
    rows = ["rank  node  pp stage  tp rank"]
    rows += [f"{p.rank:>4}  {p.node:>4}  {p.pp_stage:>8}  {p.tp_rank:>7}" for p in places]
    spans = {p.pp_stage: {q.node for q in places if q.pp_stage == p.pp_stage} for p in places}
    if any(len(nodes) > 1 for nodes in spans.values()):
        rows.append("note: a TP group spans nodes: its all-reduces cross the network every layer")
    return "\n".join(rows)
