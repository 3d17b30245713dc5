"""Lesson 16's fast-path engine (or lesson 16's, or 15's) with speculative decoding.

One engine step, with k draft tokens per decoding sequence:

    1. lookahead   each decoding sequence asks for 1 + k tokens: k placeholders are appended
                   for the length of schedule(), so lesson 11's scheduler grants and allocates
                   KV blocks for them like a small prompt chunk (or fewer, or none, or
                   preempts someone: all its usual rules hold). The placeholders go again.
    2. propose     the proposer fills the granted slots (n - 1 of them) with draft tokens.
    3. verify      one target forward over the whole batch: a decoding sequence's last token
                   and its drafts are a chunk with context, like a prompt chunk in lesson 10;
                   logits for its 1 + k rows; rejection sampling keeps a prefix of the drafts
                   and adds one token (rejection.py).
    4. roll back   num_computed_tokens = len(token_ids) - 1 again: the rejected drafts' K/V
                   stay in their slots as garbage that the next writes overwrite, and every
                   block past the kept tokens goes back to the pool (SpecBlockManager.truncate).
    5. stop        tokens are appended one by one, each checked against max_tokens, EOS and
                   stop tokens: nothing is kept past the first token that ends the request.

The engine is lesson 15's `Engine` with the mixin in front (`SpecEngine`), given its parts by
lesson 16's `build_engine` (either part): `build_spec_engine` passes it the engine class, the block
manager class and the mixin's two options.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step13_prefix_cache.block_manager import PrefixCachingBlockManager
from step15_flash_attention.engine import Engine
from step16_cuda_graph import engine as lesson16
from step16_cuda_graph.cpu import engine as fast_path_engine

from .proposers import Draft, NgramProposer, Proposer
from .rejection import verify_batch

PLACEHOLDER = -1    # never reaches the model: an out-of-range id would fail loudly if it did


class SpecBlockManager(PrefixCachingBlockManager):
    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the blocks that hold seq's first num_tokens tokens; give the others back.

        Those were allocated for drafts that were rejected (or never proposed). They are private
        (lesson 13 shares only full blocks of computed tokens) and hold nothing worth caching,
        so they go to the front of the free list: reused before any cached block is evicted.
        """
        table = self.table(seq)
        keep = self.blocks_for(num_tokens)
        for block_id in reversed(table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                if block_id not in self.hash_of:
                    self.free_block_ids.move_to_end(block_id, last=False)
        del table[keep:]


@dataclass
class SpecStats:
    drafted: int = 0          # draft tokens the target verified
    accepted: int = 0         # of which it accepted
    verifications: int = 0    # (decoding sequence, step) pairs: one target forward for that sequence
    emitted: int = 0          # tokens those verifications appended
    target_forwards: int = 0  # engine steps (each one forward of the target over the whole batch)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(1, self.drafted)

    @property
    def tokens_per_forward(self) -> float:
        """Tokens a decoding sequence gets per target forward: 1 without speculation."""
        return self.emitted / max(1, self.verifications)


def check_num_speculative_tokens(k: int) -> None:
    if k < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")


class SpeculativeMixin:
    """Put in front of lesson 15's Engine: `class SpecEngine(SpeculativeMixin, Engine)`. It takes
    the Engine's arguments, plus the proposer and k; its scheduler's block manager must be a
    SpecBlockManager (build_spec_engine gives it one)."""

    def __init__(self, *args, proposer: Proposer | None = None, num_speculative_tokens: int = 4, **kwargs):
        check_num_speculative_tokens(num_speculative_tokens)
        super().__init__(*args, **kwargs)
        if not isinstance(self.scheduler.block_manager, SpecBlockManager):
            raise TypeError(f"speculative decoding needs a SpecBlockManager (it rolls tables back), got "
                            f"{type(self.scheduler.block_manager).__name__}: build the engine with build_spec_engine")
        if getattr(self, "output_processor", None) is not None:
            raise ValueError("speculative decoding emits several tokens a step: an output processor (lesson "
                             "20's logprobs) reads one logits row per sequence, and is not combined with it")
        self.proposer = proposer if proposer is not None else NgramProposer()
        self.num_speculative_tokens = num_speculative_tokens
        self.spec = SpecStats()

    def step(self) -> list[Sequence]:
        """One scheduled batch; returns the sequences that received tokens (one or more each)."""
        s = self.scheduler
        # 1. Lookahead: the scheduler sees 1 + k uncomputed tokens per decoding sequence. At most
        #    max_tokens - generated - 1 drafts: accepted drafts + 1 token never pass max_tokens.
        decoding = {seq for seq in s.running if seq.num_uncomputed_tokens == 1}
        lookahead: dict[Sequence, int] = {}
        for seq in decoding:
            k = min(self.num_speculative_tokens, seq.params.max_tokens - len(seq.output_token_ids) - 1)
            if k > 0:
                seq.token_ids.extend([PLACEHOLDER] * k)
                lookahead[seq] = k
        try:
            batch = s.schedule()
        finally:
            for seq, k in lookahead.items():      # scheduled, partly scheduled or preempted: out again
                del seq.token_ids[-k:]
        if not batch:
            return []
        # 2. Drafts for the slots that were granted.
        spec = [(i, seq, n - 1) for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                if seq in lookahead and n > 1]
        drafts: dict[Sequence, Draft] = {}
        if spec:
            proposed = self.proposer.propose(self, [seq for _, seq, _ in spec], [k for _, _, k in spec])
            for (i, seq, k), d in zip(spec, proposed):
                if len(d.tokens) > k:
                    raise RuntimeError(f"proposer returned {len(d.tokens)} drafts for {k} slots")
                drafts[seq] = d
                seq.token_ids.extend(d.tokens)
        for i, seq in enumerate(batch.seqs):
            if seq in lookahead:                  # slots the proposer left empty are not computed
                batch.num_tokens[i] = 1 + len(drafts[seq].tokens) if seq in drafts else 1
        # 3. One target forward; logits for every draft row and each sequence's last row.
        self.prepare_kv(batch)
        ids, positions, rows, sampled = [], [], [], []
        off = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            off += n
            if start + n == seq.num_tokens:       # lesson 09's rule: its last token is computed
                m = 1 + len(drafts[seq].tokens) if seq in drafts else 1
                rows.extend(range(off - m, off))
                sampled.append(seq)
        hidden = self.run_model(batch, torch.tensor(ids, device=self.device),
                                torch.tensor(positions, device=self.device))
        results = []
        if sampled:
            logits = self.compute_logits(hidden[torch.tensor(rows, device=self.device)])
            results = verify_batch(self.sampler, logits, sampled, [drafts.get(seq) for seq in sampled])
        self.spec.target_forwards += 1
        # 4. Bookkeeping and roll-back.
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
        now, finished, new_tokens = time.perf_counter(), [], 0
        for seq, (tokens, accepted) in zip(sampled, results):
            d = drafts.get(seq)
            if d is not None and d.tokens:
                del seq.token_ids[-len(d.tokens):]   # the accepted ones come back in `tokens`
                self.spec.drafted += len(d.tokens)
                self.spec.accepted += accepted
            kept = 0
            for tok in tokens:                       # 5. stop at the first token that ends it
                seq.token_ids.append(tok)
                seq.token_times.append(now)
                kept += 1
                reason = seq.params.finish_reason(tok, len(seq.output_token_ids), self.eos_ids)
                if reason:
                    finished.append((seq, reason))
                    break
            # K/V are valid for every kept token but the last (the next step feeds it, as always).
            seq.num_computed_tokens = seq.num_tokens - 1
            s.block_manager.truncate(seq, seq.num_computed_tokens)
            new_tokens += kept
            if seq in decoding:
                self.spec.verifications += 1
                self.spec.emitted += kept
        s.after_step(batch)                          # lesson 13 caches full blocks of kept tokens only
        for seq, reason in finished:
            s.finish(seq, reason)
        self.num_steps += 1
        self.counters.generation_tokens += new_tokens   # Engine.step() counts them; this step replaces it
        return sampled


class SpecEngine(SpeculativeMixin, Engine):
    """Lesson 15's engine with speculative decoding. Whatever runner it is given: verification
    steps (1 + k tokens a sequence) take the runner's prompt-step path, steps where no sequence
    has a guess its recorded decode step (lesson 16, either part)."""


def build_spec_engine(model: nn.Module, config: PagedSchedulerConfig | None = None, proposer: Proposer | None = None,
                      num_speculative_tokens: int = 4, fast_path: bool = True, **options) -> SpecEngine:
    """Lesson 16's engine with its CPU fast path (fast_path=False: graph capture only) with
    speculative decoding. options: that build_engine's options (use_graph=False: eager steps; with
    fast_path=False also pack_weights=False: the model's own linears, i.e. lesson 15's engine unpacked)."""
    if not isinstance(fast_path, bool):
        raise TypeError(f"fast_path must be True or False, got {fast_path!r}")
    check_num_speculative_tokens(num_speculative_tokens)      # before anything is recorded
    build = fast_path_engine.build_engine if fast_path else lesson16.build_engine
    return build(model, config, engine_class=SpecEngine, block_manager_class=SpecBlockManager,
                            proposer=proposer, num_speculative_tokens=num_speculative_tokens, **options)
