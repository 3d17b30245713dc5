"""Which split should cross the network between two machines: TP=2 or PP=2? Bytes measured here.

    python advanced/adv06_pipeline_parallel/wire.py        # Qwen3-0.6B shape, random weights, bf16

Both engines run on this machine (gloo over loopback), exactly as they would across two: what
rank 0 hands the process group and the control socket is what would cross the link. Counted:

    TP=2 (lesson 17)   every layer: 2 all-reduces of [T, hidden]; the embedding's all-reduce;
                       the logits gather (rank 1's half of the vocabulary); the step's metadata
    PP=2 (this lesson) one hop of [T, hidden] from stage 0 to 1; the sampled rows' hidden states
                       back; the step's metadata
    TP=2 x PP=2        four ranks, a stage's TP pair on each machine (placement's rule): what
                       crosses is the hidden state from each of stage 0's ranks to its peer, the
                       rows back, and the metadata to the two ranks over there; the all-reduces
                       stay inside each machine and are not counted

For 2 ranks an all-reduce of S bytes sends S bytes each way (ring: S/2 reduce-scatter + S/2
all-gather), so rank 0's payload is the traffic in each direction. Then a link model, not a
measurement: time = bytes x 8 / bandwidth + messages x latency, at 10, 25 and 100 Gbit/s.
"""
from __future__ import annotations

import argparse

import torch

from minivllm_support.cli import machine
from minivllm_support.workloads import random_qwen3_06b
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step17_tensor_parallel import parallel
from step17_tensor_parallel.engine import TPEngine
from advanced.adv06_pipeline_parallel.engine import PPEngine

LINKS_GBIT = (10, 25, 100)
LATENCY_US = 20.0        # one message across a rack's switch, TCP (an assumption, stated as such)


def _config() -> PagedSchedulerConfig:
    return PagedSchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, kv_cache_bytes=256 * 2**20)


class Counter:
    """bytes and messages crossing between the two machines, read from each engine's own counters."""

    def __init__(self, engine):
        self.engine = engine
        self.launches = 0

    def read(self) -> tuple[int, int]:
        e = self.engine
        if isinstance(e, TPEngine):
            return parallel.COMM.bytes + e.runner.metadata_bytes, parallel.COMM.calls + e.runner.metadata_messages
        sent = e.bytes_sent
        if e.tp == 1:
            return sum(sent.values()), e.messages_sent
        # TP x PP: of rank 0's control messages only those to the other machine's ranks cross
        workers, remote = e.world - 1, e.world - e.tp
        local_messages = (e.num_steps - self.launches) * (workers - remote)
        return sent["hidden"] + sent["returned"] + sent["metadata"] * remote // workers, e.messages_sent - local_messages

    def reset(self) -> None:
        e = self.engine
        if isinstance(e, TPEngine):
            parallel.COMM.reset()
            e.runner.metadata_bytes = e.runner.metadata_messages = 0
        else:
            e.bytes_sent = dict.fromkeys(e.bytes_sent, 0)
            e.messages_sent, self.launches = 0, e.num_steps


def measure(engine, prompt_len: int, batch: int, steps: int) -> dict:
    """Bytes and messages per prompt token (one prompt, one step) and per decode step at `batch`."""
    c = Counter(engine)
    vocab = engine.model.config.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    c.reset()
    engine.add_request([(7 * i) % (vocab - 10) + 5 for i in range(prompt_len)], sp)
    engine.step()
    prefill = c.read()
    while engine.has_unfinished():
        engine.step()
    seqs = [engine.add_request([(11 * i + b) % (vocab - 10) + 5 for i in range(32)], sp) for b in range(batch)]
    while any(not s.output_token_ids for s in seqs):
        engine.step()
    if sum(not s.is_finished for s in seqs) < batch:
        raise RuntimeError(f"only {sum(not s.is_finished for s in seqs)} of {batch} sequences are decoding")
    c.reset()
    for _ in range(steps):
        engine.step()
    decode = c.read()
    while engine.has_unfinished():
        engine.step()
    return {"prompt_token": (prefill[0] / prompt_len, prefill[1]), "decode_step": (decode[0] / steps, decode[1] / steps)}


def link_ms(nbytes: float, messages: float, gbit: float) -> float:
    return (nbytes * 8 / (gbit * 1e9) + messages * LATENCY_US * 1e-6) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    print(machine())
    folder = random_qwen3_06b()
    rows = {}
    for name, make in (("TP=2", lambda: TPEngine(folder, _config(), tensor_parallel_size=2, dtype=torch.bfloat16,
                                                   all_reduce="gloo", threads_per_rank=1)),
                       ("PP=2", lambda: PPEngine(folder, _config(), pipeline_parallel_size=2, num_micro_batches=1,
                                                 dtype=torch.bfloat16, threads_per_rank=1)),
                       ("TPxPP", lambda: PPEngine(folder, _config(), pipeline_parallel_size=2, num_micro_batches=1,
                                                  tensor_parallel_size=2, dtype=torch.bfloat16, threads_per_rank=1))):
        with make() as engine:
            for b in args.batches:
                rows[(name, b)] = measure(engine, args.prompt_len, b, args.steps)
    print(f"\nbytes crossing between the two machines (each direction, measured; Qwen3-0.6B shape, bf16, "
          f"a {args.prompt_len}-token prompt, decode over {args.steps} steps):")
    names = ("TP=2", "PP=2", "TPxPP")
    print(f"  {'':24} {'TP=2 across':>16} {'PP=2 across':>16} {'TP=2 x PP=2':>16}")
    print(f"  {'per prompt token':24} " + " ".join(
        f"{rows[(n, args.batches[0])]['prompt_token'][0] / 1024:>12.1f} KiB" for n in names))
    for b in args.batches:
        print(f"  {f'per decode step, batch {b}':24} " + " ".join(
            f"{rows[(n, b)]['decode_step'][0] / 1024:>12.1f} KiB" for n in names))
        print(f"  {'  messages per step':24} " + " ".join(f"{rows[(n, b)]['decode_step'][1]:>16.0f}" for n in names))
    print("  (TP=2 x PP=2: 4 ranks, each stage's TP pair inside one machine; its all-reduces are not on the link)")
    print(f"\nlink model (computed from the bytes above, not measured): ms per decode step = bytes x 8 / bandwidth "
          f"+ messages x {LATENCY_US:.0f} us")
    print(f"  {'':24} " + " ".join(f"{f'{g} Gbit/s':>18}" for g in LINKS_GBIT))
    for b in args.batches:
        for name in names:
            nbytes, msgs = rows[(name, b)]["decode_step"]
            label = "TP=2 x PP=2" if name == "TPxPP" else name
            print(f"  {f'{label}, batch {b}':24} " + " ".join(f"{link_ms(nbytes, msgs, g):>15.2f} ms" for g in LINKS_GBIT))


if __name__ == "__main__":
    main()
