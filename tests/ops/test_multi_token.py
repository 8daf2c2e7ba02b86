"""S >= 1 query tokens per request (MTP, speculative verification): `mla::decode`, `mla::sparse_decode`,
`mla::dcp_decode`, `mla::tp_dcp_decode`, `dsa::indexer_topk` and `dsa::k_only_indices` against the float64
references of tests/reference.py (one query token at a time).

Contract: q [B, S, H, *] -> out [B, S, H, R], lse [B, S, H]; seq_lens counts the S new tokens (already in the
cache) and query token j sees tokens t < seq_lens[b] - S + 1 + j; a row whose limit is <= 0 gives (0, -inf).
The Triton kernel's S > 1 path runs under the interpreter in tests/kernels/test_triton_interpret.py
(check_decode_multi_token); the CUDA impls in tests/gpu/test_multi_token_cuda.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import mla_compile  # noqa: F401  (registers the ops)
import reference as ref
from mla_compile import layout
from mla_compile.ops import dcp
from test_ops_reference import assert_state_close

F64 = torch.float64


def paged(lens, PS, R, P, dtype=torch.float32, seed=0, extra_cols=1):
    g = torch.Generator().manual_seed(seed)
    _, (c, k), bt, sl, _ = ref.build_paged(lens, PS, (R, P), dtype, generator=g, shuffle=True, extra_cols=extra_cols)
    return g, c, k, bt, sl


def queries(g, B, S, H, R, P, dtype=torch.float32):
    return torch.randn(B, S, H, R, generator=g).to(dtype), torch.randn(B, S, H, P, generator=g).to(dtype)


def run_decode(lens, S, PS, H, R, P, dtype, seed, sm_scale=0.3):
    g, c, k, bt, sl = paged(lens, PS, R, P, dtype, seed)
    qn, qp = queries(g, len(lens), S, H, R, P, dtype)
    out, lse = torch.ops.mla.decode(qn, qp, c, k, bt, sl, sm_scale)
    r_out, r_lse = ref.ref_decode_multi(qn, qp, c, k, bt, sl, sm_scale)
    if dtype == F64:
        torch.testing.assert_close(out, r_out, atol=1e-12, rtol=1e-12)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(r_lse))
        fin = torch.isfinite(r_lse)
        torch.testing.assert_close(lse[fin], r_lse[fin], atol=1e-12, rtol=1e-12)
    else:
        assert_state_close(out, lse, r_out, r_lse, dtype, f"S={S} lens={lens} PS={PS} H={H} R={R} P={P}")


# ----------------------------------------------------------------------------------------------- decode
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
@pytest.mark.parametrize("S", [1, 2, 3, 4])
@pytest.mark.parametrize("PS,H,R,P,lens", [(4, 3, 16, 8, [9, 0, 4, 17]), (1, 16, 32, 16, [5, 70, 0]),
                                           (3, 2, 8, 0, [6, 4, 0])])  # P = 0: rope-less
def test_decode_matches_reference(PS, H, R, P, lens, S, dtype):
    run_decode(lens, S, PS, H, R, P, dtype, seed=S + PS)


def test_decode_rows_are_causal_per_query_token():
    """A request of exactly S tokens: query token j sees j + 1 tokens, so token 0 attends to token 0 alone
    (out = its latent, lse = its score); a later token's result does not depend on tokens after it."""
    S, H, R, P, PS = 3, 2, 8, 4, 2
    g, c, k, bt, sl = paged([S], PS, R, P, F64, seed=4)
    qn, qp = queries(g, 1, S, H, R, P, F64)
    out, lse = torch.ops.mla.decode(qn, qp, c, k, bt, sl, 0.5)
    slot0 = ref.request_slots(bt, PS, 0, 1)[0]
    c0, k0 = ref.slot_rows(c)[slot0], ref.slot_rows(k)[slot0]
    torch.testing.assert_close(out[0, 0], c0.expand(H, R))
    torch.testing.assert_close(lse[0, 0], 0.5 * (qn[0, 0] @ c0 + qp[0, 0] @ k0))
    c2 = c.clone()
    last = ref.request_slots(bt, PS, 0, S)[-1]
    c2.view(-1, R)[last] += 100.0  # the newest token: only query token S-1 sees it
    out2, _ = torch.ops.mla.decode(qn, qp, c2, k, bt, sl, 0.5)
    assert torch.equal(out2[0, :S - 1], out[0, :S - 1]) and not torch.equal(out2[0, S - 1], out[0, S - 1])


def test_one_token_forms_agree():
    """S = 1 as q [B, 1, H, *] is the 3-D op; S tokens equal S one-token calls at the shifted lengths."""
    S, H, R, P, PS = 3, 4, 16, 8, 4
    lens = [7, 0, 3, 12]
    g, c, k, bt, sl = paged(lens, PS, R, P, F64, seed=6)
    qn, qp = queries(g, len(lens), S, H, R, P, F64)
    o1, l1 = torch.ops.mla.decode(qn[:, :1], qp[:, :1], c, k, bt, sl, 0.2)
    o3, l3 = torch.ops.mla.decode(qn[:, 0], qp[:, 0], c, k, bt, sl, 0.2)
    assert o1.shape == (4, 1, H, R) and l1.shape == (4, 1, H)
    torch.testing.assert_close(o1[:, 0], o3, atol=1e-14, rtol=0)
    torch.testing.assert_close(l1[:, 0], l3, atol=1e-14, rtol=0)
    out, lse = torch.ops.mla.decode(qn, qp, c, k, bt, sl, 0.2)
    for j in range(S):
        lj = (sl - S + 1 + j).clamp_min(0).to(torch.int32)
        oj, ej = torch.ops.mla.decode(qn[:, j], qp[:, j], c, k, bt, lj, 0.2)
        torch.testing.assert_close(out[:, j], oj, atol=1e-14, rtol=0)
        torch.testing.assert_close(lse[:, j], ej, atol=1e-14, rtol=0)


def test_decode_limits_table():
    """seq_lens [B, S]: each query token's own limit (non-decreasing, 0 allowed) vs the reference."""
    S, H, R, P, PS = 3, 2, 8, 4, 4
    g, c, k, bt, _ = paged([10, 6, 5], PS, R, P, seed=8)
    limits = torch.tensor([[0, 4, 10], [2, 2, 6], [0, 0, 0]], dtype=torch.int32)
    qn, qp = queries(g, 3, S, H, R, P)
    out, lse = torch.ops.mla.decode(qn, qp, c, k, bt, limits, 0.4)
    assert_state_close(out, lse, *ref.ref_decode_multi(qn, qp, c, k, bt, limits, 0.4), torch.float32)


def test_decode_strided_q():
    """q as absorption hands it over: a permuted bmm output [H, B, S, R] -> [B, S, H, R]."""
    S, H, R, P, PS = 2, 3, 16, 8, 4
    g, c, k, bt, sl = paged([9, 2, 0], PS, R, P, seed=9)
    qn = torch.randn(H, 3, S, R, generator=g).permute(1, 2, 0, 3)
    qp = torch.randn(3, S, H, 2 * P, generator=g)[..., P:]
    assert not qn.is_contiguous() and not qp.is_contiguous()
    out, lse = torch.ops.mla.decode(qn, qp, c, k, bt, sl, 0.3)
    assert out.is_contiguous()
    assert_state_close(out, lse, *ref.ref_decode_multi(qn, qp, c, k, bt, sl, 0.3), torch.float32)


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(0, 30), min_size=1, max_size=3), S=st.integers(2, 4),
       PS=st.sampled_from([1, 3, 4, 16]), H=st.integers(1, 4), R=st.integers(1, 12), P=st.integers(0, 6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31 - 1))
def test_decode_fuzz(lens, S, PS, H, R, P, dtype, seed):
    lens = [0 if n == 0 else max(n, S) for n in lens]  # the contract: 0 or >= S
    run_decode(lens, S, PS, H, R, P, dtype, seed)


# ----------------------------------------------------------------------------------------- sparse_decode
def sparse_case(S, H, R, P, PS, dtype=torch.float32, seed=0):
    g, c, k, bt, sl = paged([12, 5, 0], PS, R, P, dtype, seed)
    s0, s1 = ref.request_slots(bt, PS, 0, 12), ref.request_slots(bt, PS, 1, 5)
    rows = [[[s0[j], -1, s0[(3 * j) % 12], s0[(5 + j) % 12]] for j in range(S)],
            [[-1, s1[j % 5], s1[0], s1[0]] for j in range(S)],  # a slot listed twice
            [[-1] * 4 for _ in range(S)]]  # nothing: (0, -inf)
    idx = torch.tensor(rows, dtype=torch.int32)
    qn, qp = queries(g, 3, S, H, R, P, dtype)
    return qn, qp, c, k, idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S", [1, 2, 4])
def test_sparse_decode_matches_reference(S, dtype):
    qn, qp, c, k, idx = sparse_case(S, 3, 16, 8, 4, dtype, seed=S)
    out, lse = torch.ops.mla.sparse_decode(qn, qp, c, k, idx, 0.3)
    assert out.shape == (3, S, 3, 16) and lse.shape == (3, S, 3)
    assert_state_close(out, lse, *ref.ref_sparse_decode_multi(qn, qp, c, k, idx, 0.3), dtype)


# ----------------------------------------------------------------------------------------- DSA selection
def _limits(sl, S):
    return [[max(int(n) - S + 1 + j, 0) for j in range(S)] for n in sl]


@pytest.mark.parametrize("S", [1, 2, 3])
def test_k_only_indices_per_query_token(S):
    PS, topk = 4, 16
    g, c, k, bt, sl = paged([16, 0, S, 9], PS, 4, 2, seed=S)
    got = torch.ops.dsa.k_only_indices(bt, sl, PS, topk, S)
    assert got.shape == ((4, S, topk) if S > 1 else (4, topk))
    got = got.view(4, S, topk)
    lim = _limits(sl, S)
    for j in range(S):
        want = ref.ref_k_only(bt, torch.tensor([row[j] for row in lim]), PS, topk)
        assert torch.equal(got[:, j], want), j


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S", [2, 3])
def test_indexer_topk_per_query_token(S, dtype):
    """Each query token ranks the tokens it may see by its own score: the picked slots are distinct seen slots,
    their reference scores are that token's top scores, in descending order (rows longer than topk) or the
    identity (rows that fit)."""
    PS, Hi, Di, topk = 4, 3, 8, 6
    g = torch.Generator().manual_seed(S)
    lens = [20, 0, S, topk + S - 1, 9]  # a long row, an empty one, limits 1..S, one crossing topk at its last token
    _, (kc,), bt, sl, _ = ref.build_paged(lens, PS, (Di,), dtype, generator=g, shuffle=True)
    B = len(lens)
    q = torch.randn(B, S, Hi, Di, generator=g).to(dtype)
    w = torch.randn(B, S, Hi, generator=g)
    got = torch.ops.dsa.indexer_topk(q, w, kc, bt, sl, topk, 0.5)
    assert got.shape == (B, S, topk) and got.dtype == torch.int32
    lim = _limits(sl, S)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for j in range(S):
        lens_j = torch.tensor([row[j] for row in lim], dtype=torch.int32)
        for b in range(B):
            by_slot, top = ref.ref_topk_scores(q[:, j], w[:, j], kc, bt, lens_j, 0.5, topk, b)
            n = min(topk, int(lens_j[b]))
            row = got[b, j].tolist()
            assert all(s == -1 for s in row[n:]) and len(set(row[:n])) == n, (b, j, row)
            assert all(s in by_slot for s in row[:n]), (b, j, row)
            scores = [by_slot[s] for s in row[:n]]
            scale = max([abs(v) for v in by_slot.values()] + [1e-6])
            assert max([abs(a - r) for a, r in zip(sorted(scores, reverse=True), top)] + [0.0]) <= tol * scale
            if int(lens_j[b]) <= topk:
                assert row[:n] == ref.request_slots(bt, PS, b, n), (b, j, row)
            else:
                assert all(scores[i] >= scores[i + 1] - tol * scale for i in range(n - 1)), "not descending"


def test_dsa_selection_feeds_sparse_decode():
    """k-only slots per query token through sparse_decode equal causal dense decode (every row fits topk)."""
    S, H, R, P, PS, topk = 3, 2, 8, 4, 4, 32
    g, c, k, bt, sl = paged([11, 0, 3, 20], PS, R, P, seed=12)
    qn, qp = queries(g, 4, S, H, R, P)
    idx = torch.ops.dsa.k_only_indices(bt, sl, PS, topk, S)
    o_s, l_s = torch.ops.mla.sparse_decode(qn, qp, c, k, idx, 0.3)
    o_d, l_d = torch.ops.mla.decode(qn, qp, c, k, bt, sl, 0.3)
    torch.testing.assert_close(o_s, o_d, atol=1e-6, rtol=1e-5)
    assert torch.equal(torch.isneginf(l_s), torch.isneginf(l_d))
    torch.testing.assert_close(l_s[torch.isfinite(l_d)], l_d[torch.isfinite(l_d)], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------- DCP, one process
def test_local_query_limits_count_each_query_tokens_share():
    """Per rank and query token: how many of the tokens t < L - S + 1 + j rank r owns (t % n == r), counted
    one token at a time; they sum over the ranks to the global limit."""
    S = 4
    sl = torch.tensor([0, 4, 5, 9, 17, 30], dtype=torch.int32)
    for n in (1, 2, 3, 5):
        total = torch.zeros(len(sl), S, dtype=torch.int32)
        for r in range(n):
            got = dcp.local_query_limits(sl, S, n, r)
            assert got.dtype == torch.int32 and got.shape == (len(sl), S)
            want = [[sum(1 for t in range(max(int(L) - S + 1 + j, 0)) if t % n == r) for j in range(S)] for L in sl]
            assert got.tolist() == want, (n, r)
            assert torch.equal(got[:, -1], layout.local_lens(sl, n, r))
            total += got
        assert total.tolist() == _limits(sl, S)


def test_dcp_size_one_is_decode():
    S, H, R, P, PS = 2, 3, 16, 8, 4
    g, c, k, bt, sl = paged([9, 0, 2], PS, R, P, seed=13)
    qn, qp = queries(g, 3, S, H, R, P)
    want = torch.ops.mla.decode(qn, qp, c, k, bt, sl, 0.3)
    for op in (torch.ops.mla.dcp_decode, torch.ops.mla.tp_dcp_decode):
        got = op(qn, qp, c, k, bt, sl, 0.3, 1, 0, "")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_dcp_merge_of_simulated_ranks_equals_whole_cache():
    """The per-rank decodes of a sharded cache at `local_query_limits`, merged by mla::merge_states row by row,
    equal the float64 reference over the whole cache (the math dcp_decode runs around its all-gather)."""
    from mla_compile import paged as P_

    S, H, R, P, PS, n = 3, 2, 16, 8, 4, 3
    lens = [0, 3, 4, 10, 17]
    g = torch.Generator().manual_seed(14)
    ckv = [torch.randn(L, R, generator=g) for L in lens]
    kpe = [torch.randn(L, P, generator=g) for L in lens]
    qn, qp = queries(g, len(lens), S, H, R, P)
    sl = torch.tensor(lens, dtype=torch.int32)
    full = P_.fill_paged(ckv, kpe, PS, generator=torch.Generator().manual_seed(1))
    outs, lses = [], []
    for r in range(n):
        sh = P_.fill_sharded(ckv, kpe, PS, n, r, generator=torch.Generator().manual_seed(2 + r))
        o, l = torch.ops.mla.decode(qn, qp, sh.ckv_cache, sh.kpe_cache, sh.block_table,
                                    dcp.local_query_limits(sl, S, n, r), 0.3)
        outs.append(o.reshape(len(lens), S * H, R))
        lses.append(l.reshape(len(lens), S * H))
    out, lse = torch.ops.mla.merge_states(torch.stack(outs), torch.stack(lses))
    r_out, r_lse = ref.ref_decode_multi(qn, qp, full.ckv_cache, full.kpe_cache, full.block_table, sl, 0.3)
    assert_state_close(out.view(len(lens), S, H, R), lse.view(len(lens), S, H), r_out, r_lse, torch.float32)


# ----------------------------------------------------------------------------------------- DCP, gloo ranks
def cmd_multi_token_dcp(ctx, seed: int, S: int):
    """dcp_decode (all heads) and tp_dcp_decode (this rank's heads) with S query tokens vs float64 decode of the
    whole cache."""
    from mla_compile import paged as P_

    import test_dcp_gloo as base

    n, rank, hl, R, P, PS = ctx.n, ctx.rank, 2, base.R, base.P, base.PS
    g = torch.Generator().manual_seed(seed)
    lens = [0, S, S + 1, n * 3 + 1, 17]
    ckv = [torch.randn(L, R, generator=g) for L in lens]
    kpe = [torch.randn(L, P, generator=g) for L in lens]
    q, qp = torch.randn(len(lens), S, n * hl, R, generator=g), torch.randn(len(lens), S, n * hl, P, generator=g)
    full = P_.fill_paged(ckv, kpe, PS, generator=torch.Generator().manual_seed(seed + 1))
    sh = P_.fill_sharded(ckv, kpe, PS, n, rank, generator=torch.Generator().manual_seed(seed + 2 + rank))
    seq, scale = torch.tensor(lens, dtype=torch.int32), R ** -0.5
    o64, l64 = ref.ref_decode_multi(q, qp, full.ckv_cache, full.kpe_cache, full.block_table, seq, scale)
    out, lse = torch.ops.mla.dcp_decode(q, qp, sh.ckv_cache, sh.kpe_cache, sh.block_table, seq, scale, n, rank,
                                        ctx.group_name)
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    base._close(out, o64, torch.float32, "dcp out")
    base._close_lse(lse, l64, "dcp lse")
    mine = slice(rank * hl, (rank + 1) * hl)
    out, lse = torch.ops.mla.tp_dcp_decode(q[:, :, mine].contiguous(), qp[:, :, mine].contiguous(), sh.ckv_cache,
                                           sh.kpe_cache, sh.block_table, seq, scale, n, rank, ctx.group_name)
    base._close(out, o64[:, :, mine], torch.float32, "tp out")
    base._close_lse(lse, l64[:, :, mine], "tp lse")
    return "ok"


COMMANDS = {"multi_token_dcp": cmd_multi_token_dcp}


@pytest.mark.parametrize("n,S", [(2, 3), (3, 2)])
def test_dcp_and_tp_dcp_decode_with_query_tokens_across_gloo_ranks(n, S):
    import test_dcp_gloo as base

    group = base.GlooGroup(n, commands=__name__)
    try:
        assert group.run("multi_token_dcp", 20 + n, S) == ["ok"] * n
    finally:
        if not group.broken:
            group.close()


# ----------------------------------------------------------------------------------------- bad inputs
def _base(S=2):
    g, c, k, bt, sl = paged([5, 0], 4, 8, 4, seed=15)
    qn, qp = queries(g, 2, S, 3, 8, 4)
    idx = torch.zeros(2, S, 3, dtype=torch.int32)
    return dict(q_nope=qn, q_pe=qp, ckv_cache=c, kpe_cache=k, block_table=bt, seq_lens=sl, sm_scale=0.5), idx


BASE, IDX = _base()
DEC = torch.ops.mla.decode
BAD = [  # (op, changes, argument named, metadata only)
    ("decode", dict(q_pe=torch.randn(2, 3, 3, 4)), "q_pe", True),  # S mismatch
    ("decode", dict(q_pe=torch.randn(2, 3, 4)), "q_pe", True),  # 3-D q_pe with 4-D q_nope
    ("decode", dict(q_nope=torch.randn(2, 2, 3, 8, 1)), "q_nope", True),
    ("decode", dict(q_nope=torch.randn(2, 0, 3, 8), q_pe=torch.randn(2, 0, 3, 4)), "q_nope", True),  # S = 0
    ("decode", dict(q_pe=torch.randn(2, 2, 4, 4)), "q_pe", True),  # heads
    ("decode", dict(seq_lens=torch.tensor([1, 0], dtype=torch.int32)), "seq_lens", False),  # 0 < len < S
    ("decode", dict(seq_lens=torch.zeros(2, 3, dtype=torch.int32)), "seq_lens", True),  # table not [B, S]
    ("decode", dict(seq_lens=torch.zeros(2, 2, dtype=torch.int64)), "seq_lens", True),
    ("decode", dict(seq_lens=torch.tensor([[3, 2], [0, 0]], dtype=torch.int32)), "seq_lens", False),  # decreasing
    ("decode", dict(seq_lens=torch.tensor([[-1, 2], [0, 0]], dtype=torch.int32)), "seq_lens", False),
    ("decode", dict(seq_lens=torch.tensor([[0, 99], [0, 0]], dtype=torch.int32)), "seq_lens", False),  # > capacity
    ("sparse_decode", dict(indices=torch.zeros(2, 3, 3, dtype=torch.int32)), "indices", True),  # S mismatch
    ("sparse_decode", dict(indices=torch.zeros(2, 3, dtype=torch.int32)), "indices", True),  # 2-D for 4-D q
    ("sparse_decode", dict(q_pe=torch.randn(2, 1, 3, 4)), "q_pe", True),
    ("dcp_decode", dict(seq_lens=torch.zeros(2, 3, dtype=torch.int32)), "seq_lens", True),  # limits not [B, S]
    ("dcp_decode", dict(seq_lens=torch.tensor([[3, 2], [2, 2]], dtype=torch.int32)), "seq_lens", False),  # decreasing
    ("dcp_decode", dict(seq_lens=torch.tensor([1, 0], dtype=torch.int32)), "seq_lens", False),
    ("dcp_decode", dict(q_pe=torch.randn(2, 1, 3, 4)), "q_pe", True),
    ("tp_dcp_decode", dict(seq_lens=torch.tensor([1, 0], dtype=torch.int32)), "seq_lens", False),
    ("tp_dcp_decode", dict(seq_lens=torch.zeros(2, 3, dtype=torch.int32)), "seq_lens", True),  # limits not [B, S]
    ("tp_dcp_decode", dict(seq_lens=torch.tensor([[3, 2], [2, 2]], dtype=torch.int32)), "seq_lens", False),
    ("k_only_indices", dict(n_query=0), "n_query", True),
    ("k_only_indices", dict(seq_lens=torch.tensor([2, 0], dtype=torch.int32), n_query=3), "seq_lens", False),
    ("indexer_topk", dict(weights=torch.randn(2, 3, 2)), "weights", True),  # [B, S', Hi]
    ("indexer_topk", dict(weights=torch.randn(2, 2)), "weights", True),  # 2-D for 4-D q
    ("indexer_topk", dict(seq_lens=torch.tensor([1, 0], dtype=torch.int32)), "seq_lens", False),
]


def _call_args(op, changes):
    a = dict(BASE)
    if op == "sparse_decode":
        a = {k: v for k, v in a.items() if k not in ("block_table", "seq_lens")}
        a = dict(list(a.items())[:4] + [("indices", IDX), ("sm_scale", 0.5)])
    elif op in ("dcp_decode", "tp_dcp_decode"):
        a.update(dcp_size=1, dcp_rank=0, group_name="")
    elif op == "k_only_indices":
        a = dict(block_table=BASE["block_table"], seq_lens=BASE["seq_lens"], page_size=4, topk=8, n_query=2)
    elif op == "indexer_topk":
        ki = torch.randn(BASE["ckv_cache"].shape[0], 4, 6)
        a = dict(q=torch.randn(2, 2, 2, 6), weights=torch.randn(2, 2, 2), k_cache=ki,
                 block_table=BASE["block_table"], seq_lens=BASE["seq_lens"], topk=4, sm_scale=0.5)
    a.update(changes)
    return a


def _op(name):
    return getattr(torch.ops.dsa if name in ("k_only_indices", "indexer_topk") else torch.ops.mla, name)


@pytest.mark.parametrize("op", sorted({c[0] for c in BAD}))
def test_base_inputs_are_valid(op):
    _op(op)(**_call_args(op, {}))


@pytest.mark.parametrize("op,changes,name,meta", BAD, ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(BAD)])
def test_bad_input_names_the_argument(op, changes, name, meta):
    with pytest.raises(ValueError, match=f"^{re.escape(name)}: "):
        _op(op)(**_call_args(op, changes))


@pytest.mark.parametrize("op,changes,name,meta", [c for c in BAD if c[3]],
                         ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(BAD) if c[3]])
def test_bad_metadata_raises_in_fake_mode(op, changes, name, meta):
    args = _call_args(op, changes)
    with FakeTensorMode() as mode:
        fake = torch.utils._pytree.tree_map_only(torch.Tensor, mode.from_tensor, args)
        with pytest.raises(ValueError, match=f"^{re.escape(name)}: "):
            _op(op)(**fake)


# ----------------------------------------------------------------------------------------- opcheck, autograd
@pytest.mark.parametrize("S", [1, 3])
def test_opcheck(S):
    g, c, k, bt, sl = paged([9, 0, S], 4, 16, 8, seed=16)
    qn, qp = queries(g, 3, S, 2, 16, 8)
    torch.library.opcheck(torch.ops.mla.decode.default, (qn, qp, c, k, bt, sl, 0.3))
    lim = dcp.local_query_limits(sl, S, 2, 1)
    torch.library.opcheck(torch.ops.mla.decode.default, (qn, qp, c, k, bt, lim, 0.3))
    idx = torch.ops.dsa.k_only_indices(bt, sl, 4, 12, S).view(3, S, 12)
    torch.library.opcheck(torch.ops.mla.sparse_decode.default, (qn, qp, c, k, idx, 0.3))
    torch.library.opcheck(torch.ops.dsa.k_only_indices.default, (bt, sl, 4, 12, S))
    ki = torch.randn(c.shape[0], 4, 6, generator=g)
    torch.library.opcheck(torch.ops.dsa.indexer_topk.default,
                          (torch.randn(3, S, 2, 6, generator=g), torch.randn(3, S, 2, generator=g), ki, bt, sl, 4, 0.5))


def _finite_lse(fn):
    def wrapped(*args):
        out, lse = fn(*args)
        return out, torch.where(torch.isfinite(lse), lse, 0.0)
    return wrapped


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


@pytest.mark.parametrize("limits_table", [False, True])
def test_gradcheck_decode(limits_table):
    S, H, R, P, PS = 3, 2, 4, 2, 3
    g, c, k, bt, sl = paged([7, 0, 3], PS, R, P, F64, seed=17)
    lens = dcp.local_query_limits(sl, S, 2, 0) if limits_table else sl
    qn, qp = queries(g, 3, S, H, R, P, F64)
    fn = _finite_lse(lambda a, b, x, y: torch.ops.mla.decode(a, b, x, y, bt, lens, 0.7))
    assert torch.autograd.gradcheck(fn, _leaves(qn, qp, c, k))


def test_gradcheck_sparse_decode():
    qn, qp, c, k, idx = sparse_case(2, 2, 4, 2, 3, F64, seed=18)
    fn = _finite_lse(lambda a, b, x, y: torch.ops.mla.sparse_decode(a, b, x, y, idx, 0.4))
    assert torch.autograd.gradcheck(fn, _leaves(qn, qp, c, k))


def test_compiled_decode_matches_eager():
    """fullgraph torch.compile (Inductor) of an S = 3 decode with DSA k-only selection: the fake impls' shapes."""
    S, H, R, P, PS = 3, 2, 16, 8, 4
    g, c, k, bt, sl = paged([9, 0, 5], PS, R, P, seed=19)
    qn, qp = queries(g, 3, S, H, R, P)

    def step(qn, qp, c, k, bt, sl):
        out, lse = torch.ops.mla.decode(qn, qp, c, k, bt, sl, 0.3)
        idx = torch.ops.dsa.k_only_indices(bt, sl, PS, 16, S)
        o2, _ = torch.ops.mla.sparse_decode(qn, qp, c, k, idx, 0.3)
        return out + o2, lse

    got = torch.compile(step, fullgraph=True)(qn, qp, c, k, bt, sl)
    want = step(qn, qp, c, k, bt, sl)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


# ----------------------------------------------------------------------------------------- kernel build (sm_90a)
def _aot():
    try:
        from tools import aot
    except ImportError:
        aot = pytest.importorskip("mla_compile.kernels.aot")
    if not aot.available():
        pytest.skip("triton's bundled ptxas is missing")
    return aot


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,page_size", [(32, 64), (64, 1), (512, 64)])
def test_multi_token_kernel_builds_without_spills_within_shared_memory(rows, page_size, dtype):
    """The S > 1 pointer kernel at its default tiling compiled for sm_90a (no GPU needed): nothing spills and its
    shared memory stays well inside the H200's 227 KB per block (a 64-row, 64-token tile config needed 216 KB)."""
    pytest.importorskip("triton")
    from mla_compile.kernels import decode as D

    aot = _aot()
    cfg = D.multi_token_config(rows, page_size, dtype)
    ptr = "*fp32" if dtype == torch.float32 else "*bf16"
    got = aot.compile_sm90(D._stage1_kernel,
                           dict(D.pointer_constexprs(cfg, 512, 64, page_size, False, dtype, True), PDL=False),
                           {k: ptr for k in ("Qn", "Qp", "Ckv", "Kpe")}, cfg.num_warps, cfg.num_stages)
    assert got["spill_bytes"] == 0, got["registers"]
    assert got["shared_bytes"] <= 160 * 1024, got["shared_bytes"]
    assert cfg.block_h == min(64 if dtype == torch.bfloat16 else 32, rows)
