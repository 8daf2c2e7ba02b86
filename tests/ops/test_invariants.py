"""Invariants the rest of the system relies on: DCP layout math, split-decode-merge = unsplit decode,
k-only indices = the indexer's selection when everything fits, sparse over all slots = dense, and the
merge's treatment of empty / foreign partial states."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mla_compile  # noqa: F401
import reference as ref
from mla_compile import layout, paged

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


# ------------------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_local_lens_sum_and_growth(n):
    for L in range(0, 65):
        lens = [layout.local_lens(L, n, r) for r in range(n)]
        assert sum(lens) == L, (n, L, lens)
        assert max(lens) - min(lens) <= 1
        t = torch.full((3,), L, dtype=torch.int32)
        for r in range(n):
            lt = layout.local_lens(t, n, r)
            assert lt.dtype == torch.int32 and lt.tolist() == [lens[r]] * 3
            assert layout.local_token_positions(L, n, r).tolist() == [p for p in range(L) if p % n == r]
            assert lens[r] <= layout.local_capacity(L, n)
        if L >= 1:
            prev = [layout.local_lens(L - 1, n, r) for r in range(n)]
            grew = [r for r in range(n) if lens[r] != prev[r]]
            assert grew == [(L - 1) % n], (n, L, grew)
            assert lens[(L - 1) % n] == prev[(L - 1) % n] + 1


@given(n=st.integers(1, 8), data=st.data(), PS=st.sampled_from([1, 2, 3, 4, 64]), seed=st.integers(0, 2**31 - 1))
def test_owner_slots(n, data, PS, seed):
    """-1 for tokens another rank owns; else block_table[req, local // PS] * PS + local % PS, local = pos // n."""
    g = torch.Generator().manual_seed(seed)
    rank = data.draw(st.integers(0, n - 1))
    B, MP = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    bt = torch.randperm(B * MP + 5, generator=g)[: B * MP].reshape(B, MP).to(torch.int32)
    T = data.draw(st.integers(0, 20))
    req = torch.randint(0, B, (T,), generator=g)
    pos = torch.randint(0, MP * PS * n, (T,), generator=g)
    pos = torch.where(pos // n < MP * PS, pos, pos % n)  # every owned position within this rank's capacity
    got = layout.owner_slots(bt, req, pos, PS, n, rank)
    assert got.dtype == torch.int64 and got.shape == (T,)
    for i in range(T):
        p, b = int(pos[i]), int(req[i])
        want = -1 if p % n != rank else int(bt[b, (p // n) // PS]) * PS + (p // n) % PS
        assert int(got[i]) == want, (i, p, b, n, rank)


def test_owner_slots_past_capacity():
    """An owned token past the block table's capacity must not be written into another token's slot."""
    bt = torch.tensor([[3, 1]], dtype=torch.int32)
    req, pos = torch.zeros(10, dtype=torch.long), torch.arange(10)
    with pytest.raises(ValueError, match="^positions"):
        layout.owner_slots(bt, req, pos, 2, 2, 1)
    # tokens another rank owns never need a slot here, however far out they are
    assert layout.owner_slots(bt, req[:1], torch.tensor([100]), 2, 2, 1).tolist() == [-1]


def test_owner_slots_bad_group():
    bt = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="^dcp_rank"):
        layout.owner_slots(bt, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 1, 2, 2)
    with pytest.raises(ValueError, match="^dcp_size"):
        layout.local_lens(3, 0, 0)
    with pytest.raises(ValueError, match="^page_size"):
        layout.owner_slots(bt, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 0)


@given(n=st.integers(1, 5), data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_local_mask_and_lens_holding(n, data, seed):
    """local_mask: rank r's local position j is global token j * n + r (False past the length, however wide the
    capacity); lens_holding: a global length whose share on rank r is the rank's own count."""
    g = torch.Generator().manual_seed(seed)
    r, B, L = data.draw(st.integers(0, n - 1)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 20))
    cap = data.draw(st.integers(1, 2 * (L // n + 1)))
    valid = torch.rand(B, L, generator=g) > 0.4
    got = layout.local_mask(valid, L, n, r, cap)
    assert got.dtype == torch.bool and got.shape == (B, cap)
    for b in range(B):
        for j in range(cap):
            t = j * n + r
            assert bool(got[b, j]) == (t < L and bool(valid[b, t])), (b, j, t)
    counts = got.sum(-1, dtype=torch.int32)
    assert torch.equal(layout.local_lens(layout.lens_holding(counts, n), n, r), counts)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_interleave_shards_undoes_sharding(n):
    """Each rank's tokens in local order (local_token_positions), stacked and interleaved: the request again."""
    cap, B, L = 4, 2, 4 * n - 1  # the last rank is one token short of its capacity
    x = torch.randn(B, L, 3)
    shards = torch.zeros(n, B, cap, 3)
    for r in range(n):
        pos = layout.local_token_positions(L, n, r)
        shards[r, :, :len(pos)] = x[:, pos]
    assert torch.equal(layout.interleave_shards(shards)[:, :L], x)


@given(data=st.data(), PS=st.sampled_from([1, 2, 3, 64]), seed=st.integers(0, 2**31 - 1))
def test_page_slots(data, PS, seed):
    """block_table[row, t // PS] * PS + t % PS, row by row ([B, T]) and token by token (rows=)."""
    g = torch.Generator().manual_seed(seed)
    B, MP, T = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4)), data.draw(st.integers(0, 9))
    bt = torch.randperm(B * MP + 3, generator=g)[: B * MP].reshape(B, MP).to(torch.int32)
    t = torch.randint(0, MP * PS, (B, T), generator=g, dtype=torch.int32)
    got = layout.page_slots(bt, t, PS)
    assert got.dtype == torch.int32
    rows = torch.randint(0, B, (T,), generator=g)
    flat = torch.randint(0, MP * PS, (T,), generator=g)
    by_token = layout.page_slots(bt.long(), flat, PS, rows=rows)
    for b in range(B):
        for i in range(T):
            p = int(t[b, i])
            assert int(got[b, i]) == int(bt[b, p // PS]) * PS + p % PS
    for i in range(T):
        p, b = int(flat[i]), int(rows[i])
        assert int(by_token[i]) == int(bt[b, p // PS]) * PS + p % PS


def test_check_group():
    for size, rank, bad in ((0, 0, "dcp_size"), (True, 0, "dcp_size"), (2.0, 0, "dcp_size"), (2, 2, "dcp_rank"),
                            (2, -1, "dcp_rank"), (2, False, "dcp_rank")):
        with pytest.raises(ValueError, match=f"^{bad}:"):
            layout.check_group(size, rank)
    layout.check_group(3, 2)


# --------------------------------------------------------------------------- split over n, decode, merge
def split_decode_merge(lens, n, PS, H, R, P, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    ckv = [torch.randn(L, R, generator=g).to(dtype) for L in lens]
    kpe = [torch.randn(L, P, generator=g).to(dtype) for L in lens]
    q_nope = torch.randn(B, H, R, generator=g).to(dtype)
    q_pe = torch.randn(B, H, P, generator=g).to(dtype)
    scale = (R + P) ** -0.5
    full = paged.fill_paged(ckv, kpe, PS, generator=g)
    want_out, want_lse = torch.ops.mla.decode(q_nope, q_pe, full.ckv_cache, full.kpe_cache, full.block_table,
                                              full.seq_lens, scale)
    outs, lses = [], []
    for r in range(n):
        part = paged.fill_sharded(ckv, kpe, PS, n, r, generator=g)
        assert part.seq_lens.tolist() == [layout.local_lens(L, n, r) for L in lens]
        o, l = torch.ops.mla.decode(q_nope, q_pe, part.ckv_cache, part.kpe_cache, part.block_table,
                                    part.seq_lens, scale)
        outs.append(o)
        lses.append(l)
    out, lse = torch.ops.mla.merge_states(torch.stack(outs), torch.stack(lses))
    r_out, r_lse = ref.ref_decode(q_nope, q_pe, full.ckv_cache, full.kpe_cache, full.block_table, full.seq_lens,
                                  scale)
    for o, l in ((out, lse), (want_out, want_lse)):
        assert not torch.isnan(o).any() and not torch.isnan(l).any()
        assert torch.equal(torch.isneginf(l), torch.isneginf(r_lse))
        assert ref.rel_err(o, r_out) < TOL[dtype] and ref.rel_err(l, r_lse, floor=1.0) < TOL[dtype]
    empty = torch.tensor([L == 0 for L in lens])
    assert (out[empty] == 0).all()
    if dtype == torch.float32:  # merged == unsplit, directly
        assert ref.rel_err(out, want_out) < 1e-5 and ref.rel_err(lse, want_lse, floor=1.0) < 1e-5


@pytest.mark.parametrize("n", range(1, 9))
def test_split_merge_equals_unsplit_r512(n):
    # lengths below, at and above n: some ranks own no token of some requests
    split_decode_merge([0, 1, n - 1, n, 3 * n + 1, 70], n, 64, 16, 512, 64, torch.float32, seed=n)


@given(n=st.integers(1, 8), lens=st.lists(st.integers(0, 24), min_size=1, max_size=3),
       PS=st.sampled_from([1, 2, 3, 16]), H=st.integers(1, 3), R=st.integers(1, 12), P=st.integers(1, 6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31 - 1))
def test_split_merge_equals_unsplit_fuzz(n, lens, PS, H, R, P, dtype, seed):
    split_decode_merge(lens, n, PS, H, R, P, dtype, seed)


# ----------------------------------------------------------------------------- k-only == indexer selection
@given(lens=st.lists(st.integers(0, 40), min_size=1, max_size=4), extra=st.integers(0, 10),
       PS=st.sampled_from([1, 2, 3, 4, 64]), Hi=st.integers(1, 4), Di=st.integers(1, 16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31 - 1))
def test_k_only_equals_indexer_selection(lens, extra, PS, Hi, Di, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    _, (kc,), bt, sl, _ = ref.build_paged(lens, PS, (Di,), dtype, generator=g, shuffle=True, extra_cols=1)
    topk = max(lens) + extra  # every seq_len <= topk
    if topk == 0:
        topk = 1
    B = len(lens)
    q, w = torch.randn(B, Hi, Di, generator=g).to(dtype), torch.randn(B, Hi, generator=g)
    sel = torch.ops.dsa.indexer_topk(q, w, kc, bt, sl, topk, Di ** -0.5)
    konly = torch.ops.dsa.k_only_indices(bt, sl, PS, topk)
    for b in range(B):
        a = sorted(s for s in sel[b].tolist() if s >= 0)
        k = konly[b].tolist()
        assert a == sorted(s for s in k if s >= 0)
        assert k[: lens[b]] == ref.request_slots(bt, PS, b, lens[b]) and all(s == -1 for s in k[lens[b]:])


# --------------------------------------------------------------------------------- sparse over all == dense
@given(lens=st.lists(st.integers(0, 30), min_size=1, max_size=4), PS=st.sampled_from([1, 2, 3, 4, 64]),
       H=st.integers(1, 4), R=st.integers(1, 16), P=st.integers(1, 8), pad=st.integers(0, 5),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31 - 1))
def test_sparse_over_all_slots_equals_decode(lens, PS, H, R, P, pad, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    _, (c, k), bt, sl, _ = ref.build_paged(lens, PS, (R, P), dtype, generator=g, shuffle=True)
    B = len(lens)
    K = max(lens) + pad
    rows = []
    for b in range(B):  # every valid slot once, shuffled, -1 interleaved
        row = ref.request_slots(bt, PS, b, lens[b]) + [-1] * (K - lens[b])
        rows.append([row[i] for i in torch.randperm(K, generator=g).tolist()])
    idx = torch.tensor(rows, dtype=torch.int32).reshape(B, K)
    q_nope, q_pe = torch.randn(B, H, R, generator=g).to(dtype), torch.randn(B, H, P, generator=g).to(dtype)
    d_out, d_lse = torch.ops.mla.decode(q_nope, q_pe, c, k, bt, sl, 0.3)
    s_out, s_lse = torch.ops.mla.sparse_decode(q_nope, q_pe, c, k, idx, 0.3)
    assert torch.equal(torch.isneginf(d_lse), torch.isneginf(s_lse))
    assert not torch.isnan(s_out).any() and not torch.isnan(s_lse).any()
    assert ref.rel_err(s_out, d_out.double()) < TOL[dtype] and ref.rel_err(s_lse, d_lse, floor=1.0) < TOL[dtype]
    # and through the k-only indices (physical slots in order), when they fit
    if K > 0:
        ko = torch.ops.dsa.k_only_indices(bt, sl, PS, K)
        o2, l2 = torch.ops.mla.sparse_decode(q_nope, q_pe, c, k, ko, 0.3)
        assert ref.rel_err(o2, d_out.double()) < TOL[dtype] and ref.rel_err(l2, d_lse, floor=1.0) < TOL[dtype]


# ------------------------------------------------------------------------------- merge: bad parts weigh 0
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [-math.inf, math.inf, math.nan])
def test_merge_bad_parts_weigh_exactly_zero(bad, dtype):
    g = torch.Generator().manual_seed(0)
    N, B, H, R = 4, 2, 3, 8
    outs = torch.randn(N, B, H, R, generator=g).to(dtype)
    lses = torch.randn(N, B, H, generator=g) * 3
    good = torch.tensor([0, 2])
    want_out, want_lse = torch.ops.mla.merge_states(outs[good], lses[good])
    outs[1] = math.nan  # the bad parts' outs are garbage too
    outs[3] = math.nan if bad != -math.inf else 1e4
    lses[1] = bad
    lses[3] = bad
    out, lse = torch.ops.mla.merge_states(outs, lses)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    # every part bad -> (0, -inf)
    out, lse = torch.ops.mla.merge_states(outs[[1, 3]], lses[[1, 3]])
    assert torch.equal(out, torch.zeros(B, H, R, dtype=dtype)) and torch.isneginf(lse).all()


def test_merge_mixed_bad_kinds_and_single_part():
    outs = torch.tensor([[[[1.0, 2.0]]], [[[math.nan, math.nan]]], [[[math.nan, 5.0]]], [[[3.0, 4.0]]]])
    lses = torch.tensor([[[0.5]], [[math.inf]], [[math.nan]], [[-math.inf]]])
    out, lse = torch.ops.mla.merge_states(outs, lses)
    assert out.tolist() == [[[1.0, 2.0]]] and lse.tolist() == [[0.5]]
    # N == 1 is the identity on finite rows
    o1, l1 = torch.ops.mla.merge_states(outs[:1], lses[:1])
    assert torch.equal(o1, outs[0]) and torch.equal(l1, lses[0])
