"""Beam search over the paged engine, step for step the algorithm of Hugging Face `generate(
num_beams=k, do_sample=False)` (transformers 5), so its answers can be compared token for token.

    round t:  live beams of every prompt ---> engine: one request each, max_tokens=1, logprobs=K
              (a beam is a Sequence: prompt + its tokens; lesson 13's prefix cache finds the
               full blocks the beam shares with its parent, only the tail is recomputed)
                  |  each beam's top K next tokens with their log-probabilities
                  v
              candidates: beam score + logprob, best K over all beams (K = (1 + #EOS) * k)
                  |-- the best k that do not end (no EOS, not at max_tokens) -> next live beams
                  '-- among the best k, those that end -> finished, scored
                      cum_logprob / (generated length ** length_penalty), k best kept
              stop: k finished and early_stopping=True; or no live beam can beat the worst
              finished one (the early_stopping heuristic); or max_tokens reached.

Why K candidates and not k: up to #EOS of each beam's best continuations can end it, and k
beams must still go on. Why only the best k may finish: a candidate ranked below k would not
have survived as a live beam either. Scores are added in float32, like HF's tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from step06_sampler.params import _is_int, _is_real
from step19_real_model.params import MAX_LOGPROBS
from step19_real_model.params import SamplingParams as LLMSamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams, plus early_stopping as HF defines it (True, False or "never")."""
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, rule: str):
            raise ValueError(f"BeamSearchParams.{name} {rule}, got {getattr(self, name)!r}")

        if not _is_int(self.beam_width) or self.beam_width < 1:
            bad("beam_width", "must be an integer >= 1")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not _is_real(self.length_penalty) or self.length_penalty != self.length_penalty:
            bad("length_penalty", "must be a number")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            bad("early_stopping", "must be True, False or 'never'")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be True or False")


@dataclass
class BeamSequence:
    token_ids: list[int]                 # generated tokens (an EOS that ended it included)
    cum_logprob: float                   # sum of the log-probabilities of token_ids
    score: float                         # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: str                   # "stop" (EOS) or "length"
    text: str | None = None


@dataclass
class _Beam:
    tokens: list[int]
    cum: torch.Tensor                    # float32 scalar: the running sum, rounded as HF's


@dataclass
class _Search:
    """One prompt's search: its live beams and its k best finished hypotheses."""
    prompt: list[int]
    live: list[_Beam]
    finished: list[BeamSequence] = field(default_factory=list)
    can_improve: bool = True             # HF's is_early_stop_heuristic_unsatisfied
    done: bool = False


def beam_search(engine, prompts: list[list[int]], params: BeamSearchParams) -> list[list[BeamSequence]]:
    """The k best sequences of each prompt, best first. `engine`: lesson 19's engine (anything
    with lesson 19's logprobs output processor) or an LLM (its .engine). All prompts' beams share each engine step."""
    engine = getattr(engine, "engine", engine)
    k = params.beam_width
    eos = set() if params.ignore_eos else set(engine.eos_ids)
    K = max(2, 1 + len(eos)) * k                              # candidates kept per step (HF's rule)
    if K > MAX_LOGPROBS:
        raise ValueError(f"BeamSearchParams.beam_width {k} needs the top {K} logprobs per beam; "
                         f"at most {MAX_LOGPROBS} are served (beam_width <= {MAX_LOGPROBS // max(2, 1 + len(eos))})")
    # One token per beam per round, greedy (the token is thrown away), with the top K logprobs.
    probe = LLMSamplingParams(temperature=0, max_tokens=1, logprobs=K, ignore_eos=True)
    searches = [_Search(list(p), [_Beam([], torch.zeros((), dtype=torch.float32))]) for p in prompts]
    while True:
        active = [s for s in searches if not s.done]
        if not active:
            break
        seqs = engine.generate([s.prompt + b.tokens for s in active for b in s.live], probe)
        it = iter(seqs)
        for s in active:
            _advance(s, [next(it).logprobs[0] for _ in s.live], k, K, eos, params)
    return [s.finished for s in searches]


def _advance(s: _Search, tops: list[dict], k: int, K: int, eos: set[int], params: BeamSearchParams) -> None:
    """One HF beam-search step for one prompt, given each live beam's top-K {token: Logprob}."""
    ids = torch.tensor([sorted(e, key=lambda t: e[t].rank)[:K] for e in tops])              # [beams, K]
    lps = torch.tensor([[e[t].logprob for t in row] for e, row in zip(tops, ids.tolist())],
                       dtype=torch.float32)
    acc = lps + torch.stack([b.cum for b in s.live]).unsqueeze(1)                          # float32 sums
    scores, flat = acc.flatten().topk(K)                      # the best K over all beams, best first
    beam_of, token_of = (flat // K).tolist(), ids.flatten()[flat].tolist()
    length = len(s.live[0].tokens) + 1                        # tokens generated with this step
    ends = [t in eos or length >= params.max_tokens for t in token_of]

    # Finished: only among the best k, only while it can still matter (HF's two rules).
    full = len(s.finished) == k
    if s.can_improve and not (full and params.early_stopping is True):
        for j in range(k):
            if ends[j]:
                b = s.live[beam_of[j]]
                score = float(scores[j] / (length ** params.length_penalty))
                reason = "stop" if token_of[j] in eos else "length"
                s.finished.append(BeamSequence(b.tokens + [token_of[j]], float(scores[j]), score, reason))
        s.finished = sorted(s.finished, key=lambda h: -h.score)[:k]     # stable: earlier first on ties

    # Live: the best k candidates that go on (only at max_tokens are there fewer: then we stop).
    go_on = [j for j in range(K) if not ends[j]][:k]
    s.live = [_Beam(s.live[beam_of[j]].tokens + [token_of[j]], scores[j]) for j in go_on]

    # Can a live beam still beat the worst finished one? (HF: _check_early_stop_heuristic)
    if len(s.finished) == k and s.live:
        best_len = params.max_tokens if params.early_stopping == "never" and params.length_penalty > 0 else length
        best = float(s.live[0].cum / (best_len ** params.length_penalty))
        s.can_improve = s.can_improve and best > min(h.score for h in s.finished)
    full = len(s.finished) == k
    s.done = not s.can_improve or (full and params.early_stopping is True) or all(ends) or not s.live


def llm_beam_search(llm, prompts, params: BeamSearchParams) -> list[list[BeamSequence]]:
    """LLM.beam_search: prompts as lesson 19's generate() takes them; each sequence gets its text."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    ids = [llm._prompt(i, p)[1] for i, p in enumerate(prompts)]
    for i, p in enumerate(ids):
        if len(p) + params.max_tokens > llm.max_model_len:
            raise ValueError(f"prompt {i}: {len(p)} prompt tokens + max_tokens {params.max_tokens} exceeds "
                             f"max_model_len {llm.max_model_len}")
    results = beam_search(llm.engine, ids, params)
    for beams in results:
        for b in beams:
            b.text = llm.tokenizer.decode(b.token_ids, skip_special_tokens=True)
    return results
