"""The control channel: one TCP connection from every worker to rank 0, on one machine or many.

    worker rank r                          store (node 0)               rank 0
    dial the store at master-addr:port --> "control port", "token" <-- listens on a free port
    dial rank 0's control port ---------------------------------------> accept, read the hello:
        {"token", "rank", "flags", "who"} (JSON)                        right token? a rank it waits
                                                                        for? the same flags as mine?
    <------------------------------------ ("welcome",) or ("refused", why naming the field)
    then, for the whole run: one StepMetadata per step in, ("ready"/"error", ...) out, b"" = stop

Why a socket and not the process group: between steps a worker may wait for minutes (an idle
server); a collective would time out, a socket read waits for ever and ends (EOFError) the
moment rank 0's process is gone, so no worker outlives its engine, on any machine. Why not
lesson 17's first version, a multiprocessing pipe: a pipe cannot leave the machine. The
connection object is the same (`multiprocessing.connection.Connection`), so the step code did
not change, and one machine uses the same path as many.
"""
from __future__ import annotations

import json
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path

KEY_PORT, KEY_TOKEN = "minivllm/control_port", "minivllm/control_token"
HELLO_TIMEOUT_S = 10.0


class RendezvousError(RuntimeError):
    """Nodes did not all join, or joined with different flags."""


@dataclass(frozen=True)
class RunFlags:
    """What every node must agree on; compared field by field at the rendezvous."""
    model: str          # a fingerprint of the checkpoint (model_fingerprint): paths may differ per node
    dtype: str
    world: int          # ranks in the whole run
    nnodes: int
    extra: str = ""     # what a particular engine must also agree on (a pipeline's layer split, ...)

    def mismatch(self, other: "RunFlags") -> str | None:
        for name, mine in asdict(self).items():
            theirs = getattr(other, name)
            if mine != theirs:
                return f"{name}: node 0 has {mine!r}, this node has {theirs!r}"
        return None


def model_fingerprint(folder: str | Path) -> str:
    """The architecture numbers of config.json and the checkpoint's size in bytes: two nodes
    with different models (or one with a half-copied folder) differ here."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size")
    size = sum(f.stat().st_size for f in sorted(folder.glob("*.safetensors")))
    return " ".join(f"{k}={cfg.get(k)}" for k in keys) + f" safetensors_bytes={size}"


class ControlServer:
    """Rank 0's side: publish where to dial, then admit exactly the expected ranks."""

    def __init__(self, store):
        self.sock = socket.create_server(("", 0))       # every interface: remote nodes dial master-addr
        self.sock.settimeout(0.2)
        self.token = secrets.token_hex(16)
        store.set(KEY_PORT, str(self.sock.getsockname()[1]))
        store.set(KEY_TOKEN, self.token)

    def accept_all(self, expected: list[int], flags: RunFlags, timeout_s: float, node_of: Callable[[int], int],
                   check_local: Callable[[], None] = lambda: None) -> dict[int, Connection]:
        """{rank: connection} for every expected rank, or RendezvousError naming the missing nodes
        after `timeout_s`. check_local raises if a worker this process spawned died meanwhile."""
        conns: dict[int, Connection] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(conns) < len(expected):
                check_local()
                if time.monotonic() > deadline:
                    missing = sorted(set(expected) - set(conns))
                    nodes = sorted({node_of(r) for r in missing})
                    raise RendezvousError(
                        f"node rank(s) {nodes} never joined within {timeout_s:.0f} s (missing ranks {missing}): "
                        f"start them with the same --nnodes/--master-addr/--master-port, and check that node 0's "
                        f"ports are reachable from them")
                try:
                    sock, _ = self.sock.accept()
                except TimeoutError:
                    continue
                sock.settimeout(None)
                conn = Connection(sock.detach())
                rank = self._admit(conn, expected, conns, flags, node_of)
                if rank is not None:
                    conns[rank] = conn
        except BaseException:
            for conn in conns.values():
                conn.close()
            raise
        finally:
            self.sock.close()
        return conns

    def _admit(self, conn: Connection, expected, conns, flags: RunFlags, node_of) -> int | None:
        if not conn.poll(HELLO_TIMEOUT_S):
            conn.close()
            return None                                  # a stray connection that said nothing
        try:   # JSON, not pickle: nothing a stranger sends to this port is ever unpickled
            hello = json.loads(conn.recv_bytes(maxlength=1 << 16))
            token, rank, who = hello["token"], hello["rank"], hello["who"]
            theirs = RunFlags(**hello["flags"])
        except (EOFError, OSError, ValueError, TypeError, KeyError):
            conn.close()
            return None
        if token != self.token:
            conn.close()
            return None
        why = None
        diff = flags.mismatch(theirs)     # first: a node with other sizes also claims other ranks
        if diff:
            why = (f"node rank {node_of(rank) if rank in expected else '?'} ({who}) was started with different "
                   f"flags than node 0 - {diff}; start every node with the same model, dtype and sizes")
        elif rank not in expected or rank in conns:
            why = f"rank {rank} is not expected (or joined twice): expected ranks {expected}"
        if why:
            conn.send(("refused", why))
            conn.close()
            raise RendezvousError(why)
        conn.send(("welcome",))
        return rank


def connect_to_rank0(store, master_addr: str, rank: int, flags: RunFlags, who: str,
                     timeout_s: float) -> Connection:
    """A worker's side: find rank 0's control port in the store, dial it, say hello."""
    try:
        port, token = int(store.get(KEY_PORT)), store.get(KEY_TOKEN).decode()
    except Exception as e:  # noqa: BLE001 - the store raises DistStoreError / RuntimeError on timeout
        raise RendezvousError(f"rank {rank}: rank 0 never published its control port ({e})") from e
    try:
        sock = socket.create_connection((master_addr, port), timeout=timeout_s)
    except OSError as e:           # published, but no one listens: rank 0 stopped waiting (it refused a rank)
        raise RendezvousError(f"rank {rank}: rank 0's control port {master_addr}:{port} did not take the "
                              f"connection ({e}); rank 0 has stopped waiting for workers") from e
    sock.settimeout(None)
    conn = Connection(sock.detach())
    conn.send_bytes(json.dumps({"token": token, "rank": rank, "who": who, "flags": asdict(flags)}).encode())
    if not conn.poll(timeout_s):
        raise RendezvousError(f"rank {rank}: rank 0 did not answer the hello within {timeout_s:.0f} s")
    reply = conn.recv()
    if reply[0] != "welcome":
        conn.close()
        raise RendezvousError(f"rank {rank} refused by rank 0: {reply[1]}")
    return conn
