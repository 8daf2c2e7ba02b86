"""The attention rewrite's second form: HF's attention over the latent in absorbed form, with HF's own mask.

Where the decode ops cannot take a site (`attention_match.match_site` says why: a mask it cannot prove to be a hard
mask, such as a graph-input 4-D mask; more query tokens than a decode step has; rows that are not prefixes of each
other) the site may still be an MLA attention over a latent expanded by kv_b_proj (`match_structure`). HF
continuous batching is the road that needs it: `generate_batch()` / `transformers serve` flatten every request's new
tokens into one query row block and hand attention a 4-D float mask built on the host, block-causal per request,
over every request's cached latents gathered into one key block; HF then expands all of those latents through
kv_b_proj on every step. The same algebra as the decode rewrite (q.(W_UK c) = (W_UK^T q).c, p.(W_UV c) = W_UV (p.c))
computes that attention without the expansion, the mask applied exactly as HF applies it::

    q'  = [Q_nope W_UK | Q_rope]                              # [B, H*S, R + P] (heads folded into rows)
    k'  = [c | kpe]                                           # [B, L, R + P], shared by every head
    s   = (q' @ k'^T).view(B, H, S, L) * scale                # HF's scores, no K materialized
    p   = softmax(s + M) as HF computes it                    # the same mask, dtypes, empty-row result
    out = (p.view(B, H*S, L) @ c).view(B, H, S, R) W_UV^T     # [B, H, S, v], no V materialized

Semantics kept: SDPA (`impl` "sdpa") runs as PyTorch's math backend does, in float32 with `_safe_softmax` (a row
whose keys are all masked gives 0), a bool mask filling -inf, a float mask added; HF eager keeps its dtypes (scores
in q's dtype, the softmax in HF's dtype, probabilities cast back). Any mask that broadcasts to [B, H, S, L] is
taken as it is, proven or not: nothing about its values is assumed. Attention sinks are not taken here.

When: only where it does no more multiply-adds than HF's own form (`multiply_adds`): the expansion costs
L H R (nope + v) whatever S is, while the absorbed scores and output cost S L H (2R + P) plus S H R (nope + v) for
the absorption. Decode-like sites (S of a few tokens to ~100 over a long latent) win by up to the expansion's whole
cost; a prefill over its own tokens (S close to L) loses and stays HF's. Counted in
`counters["mla_compile"]["mla_attention_dense_rewritten"]` (not in `mla_attention_rewritten`, which counts sites
turned into the decode ops); a site neither form takes is counted as not rewritten, both reasons logged.

Sizes must be static but for the batch (the matcher's `batch_shape`): a query or key length Dynamo made symbolic
after it changed between calls (continuous batching's token counts from its second graph on; HF's DynamicCache)
keeps HF's attention, counted and logged. The form itself needs no static size; the matcher's comparisons would have
to be made symbolic-safe (no guards) first.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ._fx import Builder, NoMatch, batch_shape as _shape, val
from .attention_match import Site

aten = torch.ops.aten

COUNTER = "mla_attention_dense_rewritten"


def multiply_adds(H: int, S: int, L: int, R: int, P: int, nope: int, v: int) -> tuple[int, int]:
    """(HF's multiply-adds, the absorbed form's) for one batch row of a site (both scale with B alike): H heads, S
    query rows, L keys, latent width R, rope width P, per-head K nope / V widths."""
    hf = L * H * R * (nope + v) + S * L * H * (nope + P + v)
    ours = S * H * R * (nope + v) + S * L * H * (2 * R + P)
    return hf, ours


def _cost(site: Site) -> tuple[int, int]:
    L, R = _shape(site.latent)[-2:]
    return multiply_adds(site.heads, site.tokens, L, R, site.rope, site.nope, site.v_dim)


def check(site: Site) -> None:
    """NoMatch unless the absorbed form may replace the site (see the module docstring)."""
    if site.sinks is not None:
        raise NoMatch("attention sinks (the absorbed form with HF's mask does not take them)")
    if not isinstance(site.tokens, int):
        raise NoMatch(f"query length {site.tokens} is symbolic")
    hf, ours = _cost(site)
    if ours > hf:
        raise NoMatch(f"the absorbed form costs more than HF's expansion here ({ours / hf:.2f}x its multiply-adds: "
                      f"{site.tokens} query tokens over {_shape(site.latent)[-2]} keys)")


def _rows_of_heads(b: Builder, x: fx.Node, H: int, S: int) -> fx.Node:
    """[B, H, S, D] -> [B, H * S, D] (heads folded into rows, head-major)."""
    return b.call(aten.reshape.default, x, [-1, H * S, _shape(x)[-1]])


def _per_head(b: Builder, x: fx.Node, w: fx.Node, H: int, S: int) -> fx.Node:
    """y[b, h, s] = x[b, h, s] @ w[h]: x [B, H, S, K], w [H, K, N] -> [B, H, S, N] (one bmm over the heads)."""
    K, N = _shape(x)[-1], _shape(w)[-1]
    xh = b.call(aten.reshape.default, b.call(aten.permute.default, x, [1, 0, 2, 3]), [H, -1, K])  # [H, B*S, K]
    y = b.call(aten.bmm.default, xh, w)  # [H, B*S, N]
    return b.call(aten.permute.default, b.call(aten.reshape.default, y, [H, -1, S, N]), [1, 0, 2, 3])


def _softmax_as_sdpa(b: Builder, s: fx.Node, mask) -> fx.Node:
    """PyTorch's math SDPA from its scaled float32 scores: a bool mask fills -inf where False, a float mask is
    added; `_safe_softmax` gives a row with every key masked 0."""
    if mask is not None:
        if val(mask).dtype == torch.bool:
            s = b.call(aten.masked_fill.Scalar, s, b.call(aten.logical_not.default, mask), float("-inf"))
        else:
            s = b.call(aten.add.Tensor, s, mask)
    return b.call(aten._safe_softmax.default, s, -1)


def _softmax_as_eager(b: Builder, site: Site, s: fx.Node) -> fx.Node:
    """HF eager from its scaled scores in q's dtype: + mask, softmax in HF's dtype, cast to what its matmul takes."""
    if site.mask is not None:
        s = b.call(aten.add.Tensor, s, site.mask)
    if val(s).dtype != site.dtypes[0]:
        raise NoMatch(f"masked scores would be {val(s).dtype}, HF's are {site.dtypes[0]}")
    if site.dtypes[-1] != val(s).dtype:
        s = b.call(aten._to_copy.default, s, dtype=site.dtypes[-1])
    p = b.call(aten._softmax.default, s, -1, False)
    p_dtype = val(site.out.args[0]).dtype  # the probabilities HF's matmul with V takes
    return p if val(p).dtype == p_dtype else b.call(aten._to_copy.default, p, dtype=p_dtype)


def emit_dense(b: Builder, site: Site) -> fx.Node:
    """The absorbed attention with HF's mask (module docstring); returns the node replacing the output
    [B, H, S, v]."""
    H, S = site.heads, site.tokens
    L, R = _shape(site.latent)[-2:]
    nope, v_dim, P = site.nope, site.v_dim, site.rope
    dtype = val(site.q).dtype
    w = b.call(aten.reshape.default, site.weight, [H, nope + v_dim, R])
    w_uk = b.call(aten.slice.Tensor, w, 1, 0, nope)  # [H, nope, R]
    w_uv_t = b.call(aten.transpose.int, b.call(aten.slice.Tensor, w, 1, nope, nope + v_dim), 1, 2)  # [H, R, v]
    q_nope = b.call(aten.slice.Tensor, site.q, 3, site.nope_offset, site.nope_offset + nope)
    q_rope = b.call(aten.slice.Tensor, site.q, 3, site.rope_offset, site.rope_offset + P)
    q_abs = _per_head(b, q_nope, w_uk, H, S)  # [B, H, S, R]
    q2 = b.call(aten.cat.default, [_rows_of_heads(b, q_abs, H, S), _rows_of_heads(b, q_rope, H, S)], -1)
    c = b.call(aten.reshape.default, site.latent, [-1, L, R])
    k2 = b.call(aten.cat.default, [c, b.call(aten.reshape.default, site.kpe, [-1, L, P])], -1)  # [B, L, R + P]
    if site.impl == "sdpa" and dtype in (torch.float16, torch.bfloat16):  # the math backend's float32
        q2 = b.call(aten._to_copy.default, q2, dtype=torch.float32)
        k2 = b.call(aten._to_copy.default, k2, dtype=torch.float32)
    s = b.call(aten.bmm.default, q2, b.call(aten.transpose.int, k2, 1, 2))  # [B, H*S, L]
    s = b.call(aten.mul.Tensor, b.call(aten.reshape.default, s, [-1, H, S, L]), site.scale)
    p = _softmax_as_sdpa(b, s, site.mask) if site.impl == "sdpa" else _softmax_as_eager(b, site, s)
    v2 = b.call(aten.slice.Tensor, k2, 2, 0, R)  # the latent itself (float32 for SDPA)
    if val(p).dtype != val(v2).dtype:  # a mask of a wider dtype than the scores widened them (SDPA)
        p = b.call(aten._to_copy.default, p, dtype=val(v2).dtype)
    lat = b.call(aten.bmm.default, _rows_of_heads(b, p, H, S), v2)  # [B, H*S, R]
    if val(lat).dtype != dtype:
        lat = b.call(aten._to_copy.default, lat, dtype=dtype)
    lat = b.call(aten.reshape.default, lat, [-1, H, S, R])
    return _per_head(b, lat, w_uv_t, H, S)  # [B, H, S, v]
