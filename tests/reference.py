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
    """One request: q [H, R]/[H, P], tokens [T, R]/[T, P] -> (out [H, R], lse [H]) in float64."""
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


def ref_decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale):
    PS = ckv_cache.shape[1]
    flat_c = ckv_cache.reshape(-1, ckv_cache.shape[-1])
    flat_k = kpe_cache.reshape(-1, kpe_cache.shape[-1])
    outs, lses = [], []
    for b in range(q_nope.shape[0]):
        slots = request_slots(block_table, PS, b, int(seq_lens[b]))
        o, l = ref_attend(q_nope[b], q_pe[b], flat_c[slots], flat_k[slots], sm_scale)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)


def ref_sparse_decode(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale):
    flat_c = ckv_cache.reshape(-1, ckv_cache.shape[-1])
    flat_k = kpe_cache.reshape(-1, kpe_cache.shape[-1])
    outs, lses = [], []
    for b in range(q_nope.shape[0]):
        slots = [int(s) for s in indices[b] if int(s) >= 0]
        o, l = ref_attend(q_nope[b], q_pe[b], flat_c[slots], flat_k[slots], sm_scale)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)


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
