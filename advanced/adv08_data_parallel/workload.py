"""A multi-turn chat workload with shared system prompts, driven at Poisson arrival times.

    conversation c (starts at lesson 18's Poisson time t_c):
      turn 1: [system s(c)][user 1]                                  -> tokens a1
      turn 2: [system s(c)][user 1][a1][user 2]                      -> tokens a2
      turn 3: [system s(c)][user 1][a1][user 2][a2][user 3]          -> ...
    a turn is sent when the previous one has finished (a user reads, then types)

Every turn's prompt begins with everything its conversation has said so far, and every
conversation begins with one of a few system prompts: the two kinds of prefix a router can keep
local. Token ids are drawn at random (seeded): the prefix cache does not care what they mean.

Each turn is timed by lesson 18's RequestRecord and summed up by its `summarize`; arrival times
are lesson 18's `arrival_times`. The sender differs from lesson 18's `engine_sender` in one
thing: it keeps the reply, which the next turn's prompt contains.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from step18_benchmark.loadgen import arrival_times
from step18_benchmark.metrics import RequestRecord
from step19_real_model.params import SamplingParams


@dataclass
class Conversation:
    system: list[int]
    users: list[list[int]]              # one new user message per turn


@dataclass
class ChatRun:
    records: list[RequestRecord]        # every turn of every conversation
    replies: list[list[list[int]]]      # [conversation][turn] -> generated token ids
    duration_s: float                   # first send to last token


def chat_workload(conversations: int, turns: int, systems: int, system_len: int, user_len: int,
                  vocab: int, seed: int = 0) -> list[Conversation]:
    """Conversation c uses system prompt c % systems; ids in [10, vocab): no special tokens."""
    if min(conversations, turns, systems, system_len, user_len) < 1 or vocab <= 10:
        raise ValueError("conversations, turns, systems, system_len, user_len must be >= 1 and vocab > 10")
    rng = random.Random(seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]
    prompts = [text(system_len) for _ in range(systems)]
    return [Conversation(prompts[c % systems], [text(user_len) for _ in range(turns)]) for c in range(conversations)]


async def send_turn(front, prompt: list[int], max_tokens: int) -> tuple[RequestRecord, list[int]]:
    """One request through the front end, greedy, exactly max_tokens long: (its record, its tokens)."""
    rec, out = RequestRecord(prompt_len=len(prompt), start=time.perf_counter()), []
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    try:
        async for event in front.generate(prompt, params):
            rec.token_times.append(time.perf_counter())
            out.append(event.token_id)
    except Exception as e:  # noqa: BLE001 - a failed turn is a record, not a crash
        rec.success, rec.error = False, repr(e)
    rec.output_len, rec.end = len(out), time.perf_counter()
    return rec, out


async def _conversation(front, conv: Conversation, max_tokens: int, at: float, t0: float
                        ) -> tuple[list[RequestRecord], list[list[int]]]:
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    history, records, replies = list(conv.system), [], []
    for user in conv.users:
        prompt = history + user
        rec, reply = await send_turn(front, prompt, max_tokens)
        records.append(rec)
        replies.append(reply)
        if not rec.success:
            break                       # the user saw an error: the conversation ends there
        history = prompt + reply
    return records, replies


def run_chat(front, conversations: list[Conversation], rate: float, max_tokens: int, seed: int = 0) -> ChatRun:
    """Start conversation c at lesson 18's Poisson time c (rate conversations per second)."""
    times = arrival_times(len(conversations), rate, seed)

    async def main():
        t0 = time.perf_counter()
        done = await asyncio.gather(*(_conversation(front, c, max_tokens, t, t0) for c, t in zip(conversations, times)))
        return done, t0
    done, t0 = asyncio.run(main())
    records = [r for recs, _ in done for r in recs]
    end = max((r.end for r in records), default=t0)
    return ChatRun(records, [replies for _, replies in done], end - t0)
