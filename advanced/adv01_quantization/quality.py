"""What quantization costs in quality: perplexity on a fixed text, and agreement with the
unquantized model token by token.

The text is a few paragraphs written for this lesson (plain English prose, no code, nothing
the model could have memorised word for word). One whole-sequence forward (lesson 04's
model, causal attention over all tokens) gives the model's distribution after every prefix;
from it:
  - perplexity = exp(mean negative log-likelihood of each next token): how surprised the model
    is by the real text. Lower is better; a quantized model should barely move it.
  - top-1 agreement: how often the quantized model's most likely next token is the reference
    model's. Greedy decoding follows exactly these argmaxes, so this is the share of
    positions where greedy output would not change.
  - KL(reference || quantized), averaged over positions, in nats: how far the whole
    distribution moved, not just its top.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

TEXT = """\
The lighthouse keeper kept two notebooks. In the first he wrote the weather every four hours: \
the wind, the height of the waves, the colour of the sky at dawn and at dusk. In the second he \
wrote everything else, which turned out to be much more. A gull that came every morning and \
refused to eat bread. A ship that passed at the same hour for eleven days and then never again. \
The sound the stairs made in winter, which was not the sound they made in summer.

When the light was automated, an engineer came from the city to install the new lamp. She \
stayed for three days, measured everything twice, and asked to see the notebooks. She read the \
first one in an afternoon and said it was a fine record. She read the second one for two \
nights and said nothing at all. On the morning she left, she told him that the new lamp would \
never need a keeper, but that the island might.

Most of what we know about the sea was learned this way, by people who were paid to watch one \
thing and could not help noticing others. Tide tables, currents, the migrations of fish and \
birds: each began as a column of numbers kept by someone who was bored, or careful, or both. \
The numbers were rarely interesting on their own. What mattered was that they were kept every \
day, in the same way, for a very long time, so that a change could be seen against them.

The keeper still lives on the island. He no longer climbs the tower at night, but he still \
writes in the second notebook. Last spring he counted the gull's great-grandchildren, or so he \
believes, and noted that they, too, refuse to eat bread.
"""


@dataclass
class Quality:
    perplexity: float
    agreement: float        # share of positions whose argmax equals the reference's
    kl: float               # mean KL(reference || this), nats
    tokens: int             # positions scored


@torch.inference_mode()
def log_probs(model: nn.Module, ids: list[int]) -> Tensor:
    """float32 log-probabilities [T, vocab] after each prefix, one whole-sequence forward."""
    hidden = model(torch.tensor(ids), torch.arange(len(ids)))
    return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)


def score(logp: Tensor, ids: list[int], reference: Tensor | None = None) -> Quality:
    """Perplexity of `ids` under logp; agreement and KL against the reference log-probs."""
    targets = torch.tensor(ids[1:])
    lp = logp[:-1]
    nll = -lp.gather(1, targets[:, None]).mean()
    if reference is None:
        return Quality(float(nll.exp()), 1.0, 0.0, len(targets))
    ref = reference[:-1]
    agreement = (lp.argmax(-1) == ref.argmax(-1)).float().mean()
    kl = torch.nn.functional.kl_div(lp, ref, log_target=True, reduction="none").sum(-1).mean()
    return Quality(float(nll.exp()), float(agreement), float(kl), len(targets))
