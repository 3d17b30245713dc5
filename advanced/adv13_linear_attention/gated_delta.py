"""The two recurrences of a gated DeltaNet layer, each in two forms: token by token and in chunks.

1. A short causal convolution over q|k|v (kernel 4): each output mixes a token with the 3 before
   it. Its state is those last 3 inputs, [channels, kernel - 1].

2. The gated delta rule. Per value head a matrix S [dk, dv] is the layer's whole memory: it maps
   a key to a value, like a tiny associative table. For each token t (q, k unit vectors):
        S   <- exp(g_t) * S                       forget a little (g_t <= 0, learned per token)
        err  = v_t - k_t^T S                      what S recalls for k_t, against what it should
        S   <- S + beta_t * k_t err^T             write back only the error (the "delta")
        o_t  = q_t^T S
   Attention keeps every past k and v and reads them all; this keeps one S per head, however
   long the sequence. The price: S is a lossy summary.

Token by token (`delta_rule_recurrent`) is what a decode step runs: one token, one update. A
prompt of T tokens would take T small sequential steps, so prefill runs `delta_rule_chunked`:
within a chunk of C tokens starting from S0, unrolling the recurrence gives (G_t = exp of the
cumulative gate, all products below taken within the chunk)
        u   = (I + A)^-1 (beta * v)  -  (I + A)^-1 (beta * G * k) S0      A[t, j] = beta_t G_t/G_j k_t.k_j, j < t
        o   = (G * q) S0  +  ((q k^T) * G_t/G_j, j <= t) u
        S_C = G_C S0  +  (k * G_C/G)^T u
so a chunk is a few [C, C] and [C, d] matmuls and one triangular solve; only the hand-over of S
from chunk to chunk is sequential. Both forms give the same numbers (tested), so a prompt may
be cut anywhere: chunked prefill (lesson 10) hands S from one chunk to the next.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


# ---- the short convolution ---------------------------------------------------------------------
def conv_prefill(x: Tensor, state: Tensor | None, weight: Tensor) -> tuple[Tensor, Tensor]:
    """x [T, C] after `state` [C, K-1] (None: the sequence starts here, zeros before it);
    weight [C, K]. Returns silu(causal depthwise conv) [T, C] and the new state [C, K-1]."""
    C, K = weight.shape
    if state is None:
        state = x.new_zeros(C, K - 1)
    window = torch.cat([state, x.t()], dim=1)                              # [C, K-1+T]
    out = F.conv1d(window[None], weight[:, None, :], groups=C)[0]          # [C, T]
    return F.silu(out).t(), window[:, window.shape[1] - (K - 1):]


def conv_decode(x: Tensor, state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """One token for each of B sequences: x [B, C], state [B, C, K-1] -> out [B, C], new state."""
    window = torch.cat([state, x[:, :, None]], dim=2)                      # [B, C, K]
    return F.silu((window * weight).sum(-1)), window[:, :, 1:]


# ---- the gated delta rule ------------------------------------------------------------------------
def prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    """[B, T, H, d] inputs (q, k with key heads, v with value heads) -> float32 [B, Hv, T, d]
    with q and k unit length (q also scaled by dk^-1/2), each key head shared by Hv/Hk value heads."""
    rep = v.shape[2] // k.shape[2]
    q, k = (x.repeat_interleave(rep, dim=2) if rep > 1 else x for x in (q, k))
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q, k, v, g.transpose(1, 2).float(), beta.transpose(1, 2).float()


def delta_rule_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         state: Tensor) -> tuple[Tensor, Tensor]:
    """Prepared inputs [B, H, T, d] (g, beta [B, H, T]), state [B, H, dk, dv] float32.
    Returns outputs [B, H, T, dv] and the state after the last token."""
    out = torch.empty_like(v)
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        kt = k[:, :, t]
        err = v[:, :, t] - torch.einsum("bhk,bhkv->bhv", kt, state)
        state = state + kt[..., :, None] * (beta[:, :, t, None] * err)[..., None, :]
        out[:, :, t] = torch.einsum("bhk,bhkv->bhv", q[:, :, t], state)
    return out, state


def delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                       chunk: int = 64) -> tuple[Tensor, Tensor]:
    """Same contract as delta_rule_recurrent, computed chunk by chunk (formulas in the docstring)."""
    B, H, T, dk = k.shape
    pad = -T % chunk
    if pad:  # padded tokens change nothing: g = 0 (no decay), beta = 0 (no write)
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, -1) for x in (q, k, v))
    g, beta = (x.reshape(B, H, n, chunk) for x in (g, beta))
    cum = g.cumsum(-1)                                                     # log G_t within the chunk
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # G_t / G_j for j <= t, 0 above the diagonal (masked before exp: it would overflow there).
    ratio = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    strict = (k @ k.transpose(-1, -2)) * ratio * beta[..., :, None]
    system = strict.masked_fill(causal.logical_not() | torch.eye(chunk, dtype=torch.bool, device=q.device), 0)
    system = system + torch.eye(chunk, device=q.device)                    # I + A, unit lower triangular
    rhs = torch.cat([v * beta[..., None], k * (beta * cum.exp())[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_free, w = solved[..., :v.shape[-1]], solved[..., v.shape[-1]:]       # u = u_free - w S0
    scores = (q @ k.transpose(-1, -2)) * ratio                             # intra-chunk q.k, decayed
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    out = torch.empty_like(v)
    for c in range(n):                                                     # the only sequential part
        u = u_free[:, :, c] - w[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + scores[:, :, c] @ u
        state = state * cum[:, :, c, -1, None, None].exp() + k_to_end[:, :, c].transpose(-1, -2) @ u
    return out.reshape(B, H, n * chunk, -1)[:, :, :T], state
