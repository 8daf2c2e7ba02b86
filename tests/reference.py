"""Independent float64 references, written as plainly as possible (per request, per token).

They share no code with `mla_compile` on purpose: the ops are checked against these, not against themselves.
"""

from __future__ import annotations

import math

import torch


def request_slots(block_table: torch.Tensor, page_size: int, b: int, n: int) -> list[int]:
    """Physical slots of request b's first n tokens, looked up one token at a time."""
    return [int(block_table[b, t // page_size]) * page_size + t % page_size for t in range(n)]


def ref_attend(q_nope, q_pe, ckv_rows, kpe_rows, sm_scale):
    """One request: q [H, R]/[H, P], tokens [T, R]/[T, P] -> (out [H, R], lse [H]) in float64. P = 0 (no rope):
    qp @ k.T is an [H, T] matrix of zeros, so the scores are sm_scale * qn @ c.T."""
    H = q_nope.shape[0]
    if ckv_rows.shape[0] == 0:
        return torch.zeros(H, q_nope.shape[1], dtype=torch.float64), torch.full((H,), -math.inf, dtype=torch.float64)
    qn, qp = q_nope.double(), q_pe.double()
    c, k = ckv_rows.double(), kpe_rows.double()
    scores = sm_scale * (qn @ c.T + qp @ k.T)  # [H, T]
    m = scores.max(dim=1, keepdim=True).values
    e = torch.exp(scores - m)
    lse = m.squeeze(1) + torch.log(e.sum(dim=1))
    out = (e / e.sum(dim=1, keepdim=True)) @ c
    return out, lse


def slot_rows(cache):
    """[NP, PS, D] -> [NP * PS, D]; sizes spelled out because D may be 0 (rope-less MLA: reshape(-1, 0) fails)."""
    return cache.reshape(cache.shape[0] * cache.shape[1], cache.shape[2])


def ref_decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale):
    PS = ckv_cache.shape[1]
    flat_c, flat_k = slot_rows(ckv_cache), slot_rows(kpe_cache)
    outs, lses = [], []
    for b in range(q_nope.shape[0]):
        slots = request_slots(block_table, PS, b, int(seq_lens[b]))
        o, l = ref_attend(q_nope[b], q_pe[b], flat_c[slots], flat_k[slots], sm_scale)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)


def ref_sparse_decode(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale):
    flat_c, flat_k = slot_rows(ckv_cache), slot_rows(kpe_cache)
    outs, lses = [], []
    for b in range(q_nope.shape[0]):
        slots = [int(s) for s in indices[b] if int(s) >= 0]
        o, l = ref_attend(q_nope[b], q_pe[b], flat_c[slots], flat_k[slots], sm_scale)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)


def ref_query_limits(seq_lens, S):
    """[B][S] ints: query token j of request b sees its first seq_lens[b] - S + 1 + j tokens (seq_lens counts the S
    new tokens); a [B, S] seq_lens lists the limits already. A limit <= 0 sees nothing."""
    if seq_lens.dim() == 2:
        return [[int(v) for v in row] for row in seq_lens]
    return [[int(n) - S + 1 + j for j in range(S)] for n in seq_lens]


def ref_decode_multi(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale):
    """S query tokens per request: q [B, S, H, R] / [B, S, H, P] -> (out [B, S, H, R], lse [B, S, H]) float64,
    one query token at a time over the tokens it may see (`ref_query_limits`)."""
    PS = ckv_cache.shape[1]
    flat_c, flat_k = slot_rows(ckv_cache), slot_rows(kpe_cache)
    B, S = q_nope.shape[:2]
    limits = ref_query_limits(seq_lens, S)
    outs, lses = [], []
    for b in range(B):
        o_b, l_b = [], []
        for j in range(S):
            slots = request_slots(block_table, PS, b, max(limits[b][j], 0))
            o, l = ref_attend(q_nope[b, j], q_pe[b, j], flat_c[slots], flat_k[slots], sm_scale)
            o_b.append(o)
            l_b.append(l)
        outs.append(torch.stack(o_b))
        lses.append(torch.stack(l_b))
    return torch.stack(outs), torch.stack(lses)


def ref_sparse_decode_multi(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale):
    """q [B, S, H, *], indices [B, S, K] (each query token its own slots, -1 ignored) -> float64 [B, S, H, R],
    [B, S, H]."""
    outs, lses = [], []
    for j in range(q_nope.shape[1]):
        o, l = ref_sparse_decode(q_nope[:, j], q_pe[:, j], ckv_cache, kpe_cache, indices[:, j], sm_scale)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs, 1), torch.stack(lses, 1)


def ref_merge(outs, lses):
    """Merge N partial states; non-finite lse parts are dropped. float64."""
    N, B, H, R = outs.shape
    out = torch.zeros(B, H, R, dtype=torch.float64)
    lse = torch.full((B, H), -math.inf, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            parts = [i for i in range(N) if math.isfinite(float(lses[i, b, h]))]
            if not parts:
                continue
            ls = torch.tensor([float(lses[i, b, h]) for i in parts], dtype=torch.float64)
            total = torch.logsumexp(ls, dim=0)
            lse[b, h] = total
            for j, i in enumerate(parts):
                out[b, h] += torch.exp(ls[j] - total) * outs[i, b, h].double()
    return out, lse


def ref_indexer_scores(q, weights, k_cache, block_table, seq_lens, sm_scale, b):
    """Request b: (slots, scores) for its tokens; score(t) = sum_h w[h] * relu(sm_scale * q[h] . k[t])."""
    PS = k_cache.shape[1]
    flat = k_cache.reshape(-1, k_cache.shape[-1]).double()
    slots = request_slots(block_table, PS, b, int(seq_lens[b]))
    if not slots:
        return [], torch.zeros(0, dtype=torch.float64)
    logits = torch.relu(sm_scale * (q[b].double() @ flat[slots].T))  # [Hi, T]
    return slots, weights[b].double() @ logits


def ref_k_only(block_table, seq_lens, page_size, topk):
    rows = []
    for b in range(block_table.shape[0]):
        s = request_slots(block_table, page_size, b, int(seq_lens[b]))
        rows.append(s + [-1] * (topk - len(s)))
    return torch.tensor(rows, dtype=torch.int32).reshape(block_table.shape[0], topk)


# ------------------------------------------------------------------------------------------ test inputs
# A paged cache built by hand, one token at a time (independent of mla_compile.paged / mla::cache_write).

def build_paged(lens, page_size, dims, dtype=torch.float32, *, generator=None, shuffle=True, extra_pages=0,
                extra_cols=0, garbage_unused=True):
    """Requests of the given lengths laid out in fresh paged caches, one cache per entry of `dims`.

    Returns (tokens, caches, block_table, seq_lens, num_pages): tokens[c][b] is request b's [L_b, dims[c]]
    tokens of cache c; caches[c] is [NP, PS, dims[c]] with NaN in every unused slot; block_table int32
    [B, max_pages + extra_cols] with pages taken from a (shuffled) pool. Block-table entries past a request's
    last page hold garbage (out-of-range page numbers, -1) when `garbage_unused`: ops must never read them.
    """
    g = generator
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + extra_pages + 1
    pool = torch.randperm(num_pages, generator=g).tolist() if shuffle else list(range(num_pages))
    cols = max(need + [1]) + extra_cols
    rows, start = [], 0
    for b, n in enumerate(need):
        row = pool[start:start + n]
        start += n
        for j in range(n, cols):
            row.append((num_pages + 3 + j) if (garbage_unused and j % 2 == 0) else (-1 if garbage_unused else 0))
        rows.append(row)
    block_table = torch.tensor(rows, dtype=torch.int32).reshape(len(lens), cols)
    caches, tokens = [], []
    for d in dims:
        cache = torch.full((num_pages, page_size, d), math.nan, dtype=dtype)
        toks = []
        for b, n in enumerate(lens):
            x = torch.randn(n, d, generator=g).to(dtype)
            for t in range(n):
                cache[int(block_table[b, t // page_size]), t % page_size] = x[t]
            toks.append(x)
        caches.append(cache)
        tokens.append(toks)
    seq_lens = torch.tensor(list(lens), dtype=torch.int32)
    return tokens, caches, block_table, seq_lens, num_pages


def ref_cache_write(ckv_cache, kpe_cache, ckv, kpe, slots):
    """Copies of the caches with token i written at flat slot slots[i] (skipped when -1)."""
    c, k = ckv_cache.clone(), kpe_cache.clone()
    PS = c.shape[1]
    for i in range(slots.shape[0]):
        s = int(slots[i])
        if s == -1:
            continue
        c[s // PS, s % PS] = ckv[i]
        k[s // PS, s % PS] = kpe[i]
    return c, k


def ref_topk_scores(q, weights, k_cache, block_table, seq_lens, sm_scale, topk, b):
    """Request b: (slot -> score dict, the top-min(topk, L) scores sorted descending)."""
    slots, scores = ref_indexer_scores(q, weights, k_cache, block_table, seq_lens, sm_scale, b)
    by_slot = {s: float(v) for s, v in zip(slots, scores)}
    top = sorted(by_slot.values(), reverse=True)[:topk]
    return by_slot, top


def rel_err(a, ref, floor=1.0):
    """max |a - ref| / max(max |ref|, floor) over the whole tensor; float64.

    The floor is the scale of the inputs (tests draw them at unit scale): an attention output is a convex
    combination of values of that scale, and when they cancel (tiny R and H) max|ref| alone would measure
    fp32 round-off of the unit-scale terms against a near-zero result. lse is a log: absolute error counts.

    Positions where ref is -inf must be -inf in `a` too (checked by the caller); they are excluded here.
    """
    a, ref = a.double(), ref.double()
    fin = torch.isfinite(ref)
    if not bool(fin.any()):
        return 0.0
    diff = (a[fin] - ref[fin]).abs().max().item()
    return diff / max(ref[fin].abs().max().item(), floor)


def ref_dequantize_fp8(values, scales, group: int = 128):
    """An FP8 latent cache read in float64: every e4m3 value times the float32 scale of its group of `group`
    channels (values [..., R], scales [..., R / group]), written out element by element's group index."""
    R = values.shape[-1]
    group_of = torch.arange(R) // group
    return values.double() * scales.double()[..., group_of]
