"""Where the replicas run: which node holds which replica, started by us or by torchrun.

The rule that holds everywhere: the front end is rank 0 and replica i is rank i + 1, so a run of
N replicas is a world of N + 1 ranks (lesson 17's "everyone but rank 0 dials rank 0", unchanged).

    our launch (DPFrontEnd on node 0, node.py elsewhere)   torchrun --nnodes M --nproc-per-node K
    node 0: front end + replicas 0 .. k-1                  rank 0: the front end only (no weights)
    node r: replicas r*k .. r*k+k-1                        rank r > 0: replica r-1, in place
    k = N / nnodes (the front end is extra)                world = M*K = N + 1, ranks node by node

Under torchrun the placement is torchrun's own (ranks handed out node by node, K per node), so a
rank's node is lesson 17's rule; under our own launch the front end rides on top of node 0's share.
"""
from __future__ import annotations

import os

from step17_tensor_parallel.launch import NodeLaunch
from step17_tensor_parallel.launch import check_torchrun_world as check_world
from step17_tensor_parallel.workers import WorkerSet


def replicas_per_node(num_replicas: int, launch: NodeLaunch) -> int:
    if num_replicas % launch.nnodes:
        raise ValueError(f"--data-parallel-size {num_replicas} does not split evenly over --nnodes {launch.nnodes}")
    return num_replicas // launch.nnodes


def local_replicas(num_replicas: int, launch: NodeLaunch) -> list[int]:
    """The replica indices this node runs (rank = index + 1; rank 0 is the front end)."""
    k = replicas_per_node(num_replicas, launch)
    return list(range(launch.node_rank * k, launch.node_rank * k + k))


def check_torchrun_world(num_replicas: int, env=os.environ) -> None:
    """torchrun started WORLD_SIZE processes: exactly one front end and num_replicas replicas, or an
    error naming both numbers (a wrong count would otherwise wait out the rendezvous timeout)."""
    check_world(num_replicas + 1, f"data-parallel size {num_replicas} (rank 0 the front end, ranks "
                f"1..{num_replicas} the replicas)", env)


def replicas_spawned_here(num_replicas: int, launch: NodeLaunch) -> list[int]:
    """The replicas node 0's front end starts itself: its share, or none under torchrun (which
    started every rank: they turn into replicas with node.run_torchrun_replica)."""
    if launch.torchrun:
        check_torchrun_world(num_replicas)
        return []
    return local_replicas(num_replicas, launch)              # checks N against --nnodes, too


class ReplicaSet(WorkerSet):
    """Lesson 17's WorkerSet with the data-parallel placement: under our own launch, nodes named by
    replicas_per_node, because world = N + 1 (the front end) rarely splits evenly over nodes."""

    def node_of(self, rank: int) -> int:
        if self.launch.torchrun:
            return super().node_of(rank)                     # torchrun's: K consecutive ranks a node
        return 0 if rank == 0 else (rank - 1) // replicas_per_node(self.world - 1, self.launch)
