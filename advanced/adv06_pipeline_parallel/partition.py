"""Which layers each pipeline stage holds: the partition rule.

    30 layers, 4 stages:   stage 0      stage 1      stage 2      stage 3
                           embedding, LM head                     final norm
                           layers 0-6   layers 7-14  layers 15-22 layers 23-29
                           (7)          (8)          (8)          (7)

The layers are split as evenly as they can be. When they do not divide, the extra layers
go to the middle stages, from the second-to-last backwards, never to the ends. That is vLLM's
`get_pp_indices`, where the first stage holds the embedding and the last the LM head. Here the
first stage carries more (it is rank 0: the scheduler, the LM head, a [rows, vocab] matmul as
big as a few layers, and the sampler) and the last only the final norm, so the even split
leaves rank 0 the slowest stage; as in vLLM (its VLLM_PP_LAYER_PARTITION), a list of layer
counts overrides the rule: `partition_layers(..., override=...)`.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

# Same format as the `override` argument written as text: "7,8,8,7".
PARTITION_ENV = "MINIVLLM_PP_LAYER_PARTITION"


def parse_partition(text: str) -> list[int]:
    """"7,8,8,7" -> [7, 8, 8, 7]; anything else is a ValueError that quotes it."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"layer partition {text!r} must be comma-separated layer counts, e.g. '7,8,8,7'") from None


def partition_layers(num_layers: int, pp_size: int,
                     override: Sequence[int] | str | None = None) -> list[tuple[int, int]]:
    """[start, end) of the layers of each stage. `override`: the layer count of every stage
    (a list, or text as in PARTITION_ENV); None reads PARTITION_ENV, else the even rule."""
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp_size}")
    if num_layers < pp_size:
        raise ValueError(f"cannot split {num_layers} layers into {pp_size} stages: every stage needs a layer")
    if override is None and os.environ.get(PARTITION_ENV):
        override = os.environ[PARTITION_ENV]
    if isinstance(override, str):
        override = parse_partition(override)
    if override is not None:
        counts = [int(n) for n in override]
        if len(counts) != pp_size:
            raise ValueError(f"layer partition {counts} has {len(counts)} entries for pipeline_parallel_size="
                             f"{pp_size}: give one layer count per stage")
        if any(n < 1 for n in counts):
            raise ValueError(f"layer partition {counts}: every stage needs at least one layer")
        if sum(counts) != num_layers:
            raise ValueError(f"layer partition {counts} adds up to {sum(counts)} layers, the model has {num_layers}")
    else:
        counts = [num_layers // pp_size] * pp_size
        for i in range(num_layers % pp_size):   # remainder < pp_size: one each, never the last
            counts[-2 - i] += 1
    bounds, start = [], 0
    for n in counts:
        bounds.append((start, start + n))
        start += n
    return bounds
