"""Lesson 02 demo: the real embedding matrix, its neighbourhoods, and the tied LM head.

    python step02_embedding/run.py [--model PATH] [--dtype bf16|fp32] [--threads N]
"""
from __future__ import annotations

import json
import math
import time

import torch
import torch.nn.functional as F
from safetensors import safe_open

from minivllm_support.cli import base_parser, machine, setup
from minivllm_support.models import load_tokenizer, resolve_model
from step02_embedding.embedding import TokenEmbedding, load_embedding, nearest_neighbours, tied_lm_head

SENTENCE = "The cat sat on the mat."
WORDS = [" king", " Paris", " dog", " 1", " blue"]
SAMPLE = 2048  # random token ids for the tied-head statistics


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=6, help="neighbours to show per word (itself included)")
    args = p.parse_args()
    dtype = setup(args)
    model_dir = resolve_model(args.model)
    tok = load_tokenizer(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    show = lambda i: repr(tok.decode([int(i)]))  # noqa: E731  repr makes leading spaces visible

    print(f"model: {model_dir}")
    print(f"config: vocab_size={config.get('vocab_size')} hidden_size={config.get('hidden_size')} "
          f"tie_word_embeddings={config.get('tie_word_embeddings')}")

    # 1. The table itself ------------------------------------------------------------
    t0 = time.perf_counter()
    weight = load_embedding(model_dir, dtype)
    load_s = time.perf_counter() - t0
    nbytes = weight.numel() * weight.element_size()
    print(f"\n[1] embedding matrix: shape {tuple(weight.shape)}, {weight.dtype}, "
          f"{nbytes / 2**20:.1f} MiB in memory, loaded in {load_s * 1000:.0f} ms")
    total = 0
    for file in model_dir.glob("*.safetensors"):  # headers only: shapes, no tensor data read
        with safe_open(str(file), framework="pt") as st:
            total += sum(math.prod(st.get_slice(name).get_shape()) for name in st.keys())
    share = f"{weight.numel() / 1e6:.1f} M of the checkpoint's {total / 1e6:.1f} M parameters " \
            f"({weight.numel() / total * 100:.0f}%)"
    if config.get("tie_word_embeddings"):
        print(f"    that is {share}, stored once and used twice (input lookup and LM head)")
    else:
        print(f"    that is {share}; this model is NOT tied: its LM head is a second matrix")
    norms = weight.float().norm(dim=-1)
    print(f"    row lengths (L2): min {norms.min():.3f}, median {norms.median():.3f}, max {norms.max():.3f}")

    # 2. Lookup ----------------------------------------------------------------------
    emb = TokenEmbedding.from_weight(weight)
    ids = tok(SENTENCE, return_tensors="pt", add_special_tokens=False).input_ids[0]
    rows = emb(ids)
    print(f"\n[2] lookup of {SENTENCE!r}: ids {ids.tolist()} -> rows of shape {tuple(rows.shape)}")
    for i, r in zip(ids.tolist(), rows):
        vals = ", ".join(f"{v:+.3f}" for v in r[:4].float().tolist())
        print(f"    {i:>6} {show(i):<10} [{vals}, ...]  |row| = {r.float().norm():.3f}")
    one_hot = F.one_hot(ids, emb.vocab_size).to(weight.dtype)
    print(f"    lookup == F.embedding: {torch.equal(rows, F.embedding(ids, weight))}; "
          f"lookup == one_hot(ids) @ E: {torch.equal(rows, one_hot @ weight)}")
    try:
        emb(torch.tensor([ids[0].item(), emb.vocab_size]))
    except IndexError as e:
        print(f"    an id past the vocabulary raises: IndexError: {e}")

    # 3. Nearest neighbours (cosine similarity between rows) --------------------------
    print(f"\n[3] nearest neighbours by cosine similarity (k={args.k}, the word itself included)")
    word_ids = []
    for w in WORDS:
        pieces = tok.encode(w, add_special_tokens=False)
        if len(pieces) > 1:
            print(f"    {w!r} is {len(pieces)} tokens {[tok.decode([x]) for x in pieces]}; using the last one")
        t = pieces[-1]
        word_ids.append(t)
        nid, sim = nearest_neighbours(weight, t, args.k)
        pairs = "  ".join(f"{show(j)} {s:.3f}" for j, s in zip(nid.tolist(), sim.tolist()))
        print(f"    {show(t):<9} (id {t:>5}): {pairs}")

    # 4. The tied LM head: feed a row back out through h @ E^T -------------------------
    print("\n[4] tied LM head: logits = E[t] @ E^T, i.e. pretend the last hidden state is the input row")
    if not config.get("tie_word_embeddings"):
        print("    (this checkpoint is not tied; its real LM head is another matrix, E is used here anyway)")
    for t in word_ids:
        logits = tied_lm_head(weight[t], weight).float()
        rank = int((logits > logits[t]).sum()) + 1
        top = torch.topk(logits, 5)
        pairs = "  ".join(f"{show(j)} {v:.2f}" for j, v in zip(top.indices.tolist(), top.values.tolist()))
        print(f"    {show(t):<9} its own rank {rank:>5}; top-5: {pairs}")

    g = torch.Generator().manual_seed(0)
    sample = torch.randperm(weight.shape[0], generator=g)[:SAMPLE]
    t0 = time.perf_counter()
    logits = tied_lm_head(weight[sample], weight).float()  # [SAMPLE, vocab]
    head_s = time.perf_counter() - t0
    own = logits.gather(1, sample[:, None])
    ranks = (logits > own).sum(dim=1) + 1
    winners = logits.argmax(dim=1)
    print(f"    over {SAMPLE} random token ids ({head_s * 1000:.0f} ms for the [{SAMPLE}, {weight.shape[1]}] "
          f"x [{weight.shape[1]}, {weight.shape[0]}] product):")
    print(f"      token itself ranked #1: {(ranks == 1).float().mean() * 100:.1f}%   "
          f"in top 10: {(ranks <= 10).float().mean() * 100:.1f}%   median rank: {int(ranks.median())}")
    lost = ranks > 1
    if lost.any():
        # A row never beats itself on direction (cos <= 1), so a winner must be a longer row.
        hubs, counts = winners[lost].unique(return_counts=True)
        order = counts.argsort(descending=True)[:5]
        print(f"      when it is not #1 the winner is a longer row: median |row| of winners "
              f"{norms[winners[lost]].median():.3f} vs {norms.median():.3f} over the vocabulary")
        print("      most frequent winners: " + "  ".join(
            f"{show(hubs[i])} x{int(counts[i])} (|row| {norms[hubs[i]]:.2f})" for i in order.tolist()))

    print(f"\nmachine: {machine()}")


if __name__ == "__main__":
    main()
