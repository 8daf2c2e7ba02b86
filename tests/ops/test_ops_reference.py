"""Every op against the independent float64 references in tests/reference.py.

Relative error (reference.rel_err): max|op - ref| / max(max|ref|, 1) over a whole output tensor, in float64
(-inf positions compared separately). Inputs are drawn at unit scale, so the floor 1 is the scale of the
values being averaged: with tiny R/H an output can cancel to ~1e-3 while its round-off is that of its unit-
scale terms. For `lse` (a log) the floor makes it an absolute error near 0.
Bounds: fp32 < 1e-5, bf16/fp16 < 1e-2. Rows the reference marks empty must be exactly (0, -inf). No output
may ever hold a NaN (unused cache slots are NaN, so reading one shows up).

Fuzzing uses small R/P (P from 0: rope-less MLA) so the CI profile (200 examples per op) stays fast; fixed
cases cover R=512/P=64 and R=512/P=0.
The slow variants (`-m slow`, HYPOTHESIS_PROFILE=slow) run >= 2,000 examples per op.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mla_compile  # noqa: F401  (registers the ops)
import reference as ref

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
PAGE_SIZES = st.sampled_from([1, 2, 3, 4, 16, 64])
LENS = st.lists(st.integers(0, 40), min_size=1, max_size=4)


def slow_settings():
    """>= 2,000 examples whatever the active profile (the slow variants run only with -m slow)."""
    return settings(max_examples=max(2000, settings.default.max_examples))


def assert_state_close(out, lse, ref_out, ref_lse, dtype, what=""):
    """(out, lse) vs float64 reference: dtypes, no NaN, empty rows exactly (0, -inf), rel. error bounds."""
    assert out.dtype == dtype and lse.dtype == torch.float32, what
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape, what
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"NaN in output {what}"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), f"-inf rows differ {what}"
    assert torch.isfinite(lse[~empty]).all(), what
    assert (out[empty] == 0).all(), f"empty rows must be exactly 0 {what}"
    tol = TOL[dtype]
    e_out = ref.rel_err(out, ref_out)
    e_lse = ref.rel_err(lse, ref_lse, floor=1.0)
    assert e_out < tol, f"out rel err {e_out:.3g} >= {tol} {what}"
    assert e_lse < tol, f"lse rel err {e_lse:.3g} >= {tol} {what}"


# ----------------------------------------------------------------------------------------------- decode
def run_decode(lens, PS, H, R, P, dtype, seed, shuffle=True, sm_scale=None, extra_cols=0):
    g = torch.Generator().manual_seed(seed)
    _, (ckv_c, kpe_c), bt, sl, _ = ref.build_paged(lens, PS, (R, P), dtype, generator=g, shuffle=shuffle,
                                                   extra_cols=extra_cols)
    B = len(lens)
    q_nope = torch.randn(B, H, R, generator=g).to(dtype)
    q_pe = torch.randn(B, H, P, generator=g).to(dtype)
    sm_scale = (R + P) ** -0.5 if sm_scale is None else sm_scale
    out, lse = torch.ops.mla.decode(q_nope, q_pe, ckv_c, kpe_c, bt, sl, sm_scale)
    r_out, r_lse = ref.ref_decode(q_nope, q_pe, ckv_c, kpe_c, bt, sl, sm_scale)
    assert_state_close(out, lse, r_out, r_lse, dtype, f"lens={lens} PS={PS} H={H} R={R} P={P} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("PS,H,lens", [(64, 16, [0, 1, 64, 130]), (1, 128, [3, 0, 17]), (64, 128, [200, 65]),
                                       (1, 1, [0, 0])])
def test_decode_fixed_r512(PS, H, lens, dtype):
    run_decode(lens, PS, H, 512, 64, dtype, seed=PS * 1000 + H)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("PS,H,lens", [(64, 16, [0, 1, 64, 130]), (1, 64, [3, 0, 17])])
def test_decode_fixed_r512_rope_less(PS, H, lens, dtype):
    """P = 0 (glm5_next's nope 256 / v 256 over kv_lora 512): scores are sm_scale * q_nope . ckv alone."""
    run_decode(lens, PS, H, 512, 0, dtype, seed=PS * 1000 + H + 1)


def test_decode_all_empty_and_no_nan():
    g = torch.Generator().manual_seed(0)
    _, (c, k), bt, sl, _ = ref.build_paged([0, 0, 0], 4, (8, 4), generator=g)
    out, lse = torch.ops.mla.decode(torch.randn(3, 2, 8), torch.randn(3, 2, 4), c, k, bt, sl, 0.5)
    assert torch.equal(out, torch.zeros(3, 2, 8)) and torch.isneginf(lse).all()


decode_args = dict(lens=LENS, PS=PAGE_SIZES, H=st.integers(1, 4), R=st.integers(1, 16), P=st.integers(0, 8),
                   dtype=DTYPES, seed=st.integers(0, 2**31 - 1), shuffle=st.booleans(),
                   sm_scale=st.floats(0.01, 2.0), extra_cols=st.integers(0, 2))


@given(**decode_args)
def test_decode_fuzz(lens, PS, H, R, P, dtype, seed, shuffle, sm_scale, extra_cols):
    run_decode(lens, PS, H, R, P, dtype, seed, shuffle, sm_scale, extra_cols)


@pytest.mark.slow
@slow_settings()
@given(**decode_args)
def test_decode_fuzz_slow(lens, PS, H, R, P, dtype, seed, shuffle, sm_scale, extra_cols):
    run_decode(lens, PS, H, R, P, dtype, seed, shuffle, sm_scale, extra_cols)


# ---------------------------------------------------------------------------------------- sparse_decode
def run_sparse(lens, PS, H, R, P, K, dtype, seed, shuffle=True, sm_scale=0.3, neg_frac=0.3):
    """Indices: a random subset (no repeats) of all filled slots plus -1 entries, in random order."""
    g = torch.Generator().manual_seed(seed)
    _, (ckv_c, kpe_c), bt, sl, _ = ref.build_paged(lens, PS, (R, P), dtype, generator=g, shuffle=shuffle)
    filled = [s for b, n in enumerate(lens) for s in ref.request_slots(bt, PS, b, n)]
    B = len(lens)
    rows = []
    for _ in range(B):
        perm = torch.randperm(len(filled), generator=g).tolist()
        row = [filled[i] for i in perm[:K]]
        row = [s if float(torch.rand(1, generator=g)) >= neg_frac else -1 for s in row]
        rows.append(row + [-1] * (K - len(row)))
    indices = torch.tensor(rows, dtype=torch.int32).reshape(B, K)
    q_nope = torch.randn(B, H, R, generator=g).to(dtype)
    q_pe = torch.randn(B, H, P, generator=g).to(dtype)
    out, lse = torch.ops.mla.sparse_decode(q_nope, q_pe, ckv_c, kpe_c, indices, sm_scale)
    r_out, r_lse = ref.ref_sparse_decode(q_nope, q_pe, ckv_c, kpe_c, indices, sm_scale)
    assert_state_close(out, lse, r_out, r_lse, dtype, f"lens={lens} PS={PS} K={K} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("PS,H,K", [(64, 16, 96), (1, 128, 8), (64, 1, 1)])
def test_sparse_decode_fixed_r512(PS, H, K, dtype):
    run_sparse([70, 0, 33], PS, H, 512, 64, K, dtype, seed=PS + H + K, sm_scale=576 ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_decode_fixed_r512_rope_less(dtype):
    run_sparse([70, 0, 33], 64, 16, 512, 0, 96, dtype, seed=7, sm_scale=512 ** -0.5)


def test_sparse_decode_all_minus_one():
    g = torch.Generator().manual_seed(1)
    _, (c, k), _, _, _ = ref.build_paged([5], 2, (8, 4), generator=g)
    out, lse = torch.ops.mla.sparse_decode(torch.randn(2, 3, 8), torch.randn(2, 3, 4), c, k,
                                           torch.full((2, 4), -1, dtype=torch.int32), 0.5)
    assert torch.equal(out, torch.zeros(2, 3, 8)) and torch.isneginf(lse).all()


sparse_args = dict(lens=LENS, PS=PAGE_SIZES, H=st.integers(1, 4), R=st.integers(1, 16), P=st.integers(0, 8),
                   K=st.integers(1, 24), dtype=DTYPES, seed=st.integers(0, 2**31 - 1), shuffle=st.booleans(),
                   sm_scale=st.floats(0.01, 2.0), neg_frac=st.sampled_from([0.0, 0.3, 1.0]))


@given(**sparse_args)
def test_sparse_decode_fuzz(**kw):
    run_sparse(**kw)


@pytest.mark.slow
@slow_settings()
@given(**sparse_args)
def test_sparse_decode_fuzz_slow(**kw):
    run_sparse(**kw)


# ----------------------------------------------------------------------------------------- merge_states
def run_merge(N, B, H, R, dtype, seed, bad_frac=0.3, lse_scale=5.0):
    """Random partial states; a fraction of parts is 'bad' (lse -inf, +inf or NaN, out NaN or garbage)."""
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(N, B, H, R, generator=g).to(dtype)
    lses = torch.randn(N, B, H, generator=g) * lse_scale
    bad = torch.rand(N, B, H, generator=g) < bad_frac
    kind = torch.randint(0, 3, (N, B, H), generator=g)
    bad_val = torch.tensor([-math.inf, math.inf, math.nan])[kind]
    lses = torch.where(bad, bad_val, lses)
    outs = torch.where(bad[..., None] & (kind[..., None] > 0), torch.tensor(math.nan, dtype=dtype), outs)
    out, lse = torch.ops.mla.merge_states(outs, lses)
    r_out, r_lse = ref.ref_merge(outs, lses)
    assert_state_close(out, lse, r_out, r_lse, dtype, f"N={N} B={B} H={H} R={R} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,H", [(1, 128), (2, 16), (8, 1)])
def test_merge_fixed_r512(N, H, dtype):
    run_merge(N, 3, H, 512, dtype, seed=N * 7 + H)


merge_args = dict(N=st.integers(1, 8), B=st.integers(1, 3), H=st.integers(1, 4), R=st.integers(1, 16),
                  dtype=DTYPES, seed=st.integers(0, 2**31 - 1), bad_frac=st.sampled_from([0.0, 0.3, 0.8, 1.0]),
                  lse_scale=st.sampled_from([0.0, 1.0, 5.0, 80.0]))


@given(**merge_args)
def test_merge_fuzz(**kw):
    run_merge(**kw)


@pytest.mark.slow
@slow_settings()
@given(**merge_args)
def test_merge_fuzz_slow(**kw):
    run_merge(**kw)


# ------------------------------------------------------------------------------------------ cache_write
def run_cache_write(NP, PS, R, P, T, dtype, seed, skip_frac=0.3):
    """Distinct random target slots (some -1) into a NaN cache; untouched slots must stay NaN."""
    g = torch.Generator().manual_seed(seed)
    T = min(T, NP * PS)
    ckv_c = torch.full((NP, PS, R), math.nan, dtype=dtype)
    kpe_c = torch.full((NP, PS, P), math.nan, dtype=dtype)
    ckv_c[0, 0] = 1.5  # something that is not NaN and must survive if slot 0 is not written
    kpe_c[0, 0] = -2.5
    slots = torch.randperm(NP * PS, generator=g)[:T]
    slots = torch.where(torch.rand(T, generator=g) < skip_frac, -1, slots)
    ckv, kpe = torch.randn(T, R, generator=g).to(dtype), torch.randn(T, P, generator=g).to(dtype)
    r_c, r_k = ref.ref_cache_write(ckv_c, kpe_c, ckv, kpe, slots)
    assert torch.ops.mla.cache_write(ckv_c, kpe_c, ckv, kpe, slots) is None
    assert torch.allclose(ckv_c, r_c, rtol=0, atol=0, equal_nan=True)
    assert torch.allclose(kpe_c, r_k, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("PS", [1, 64])
def test_cache_write_fixed_r512(PS, dtype):
    run_cache_write(6, PS, 512, 64, 50, dtype, seed=PS)


def test_cache_write_fixed_r512_rope_less():
    run_cache_write(6, 64, 512, 0, 50, torch.bfloat16, seed=3)


def test_cache_write_zero_tokens():
    c, k = torch.zeros(2, 4, 8), torch.zeros(2, 4, 2)
    torch.ops.mla.cache_write(c, k, torch.zeros(0, 8), torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64))
    assert not c.any() and not k.any()


def test_cache_write_repeated_slot_holds_values_of_its_tokens():
    """Padding tokens sharing a dummy slot (SGLang's pattern): each value of that slot is one of its tokens' (the
    mix unspecified), and every other slot is written as usual."""
    g = torch.Generator().manual_seed(5)
    c, k = torch.zeros(2, 4, 8), torch.zeros(2, 4, 2)
    slots = torch.tensor([0, 5, 0, 0, 7])
    ckv, kpe = torch.randn(5, 8, generator=g), torch.randn(5, 2, generator=g)
    torch.ops.mla.cache_write(c, k, ckv, kpe, slots)
    rows_c, rows_k = c.view(8, 8), k.view(8, 2)
    for row, new in ((rows_c[0], ckv), (rows_k[0], kpe)):
        assert ((row[None] == new[[0, 2, 3]]).any(0)).all()
    assert torch.equal(rows_c[5], ckv[1]) and torch.equal(rows_c[7], ckv[4]) and torch.equal(rows_k[7], kpe[4])


cache_args = dict(NP=st.integers(1, 6), PS=PAGE_SIZES, R=st.integers(1, 16), P=st.integers(0, 8),
                  T=st.integers(0, 30), dtype=DTYPES, seed=st.integers(0, 2**31 - 1),
                  skip_frac=st.sampled_from([0.0, 0.3, 1.0]))


@given(**cache_args)
def test_cache_write_fuzz(**kw):
    run_cache_write(**kw)


@pytest.mark.slow
@slow_settings()
@given(**cache_args)
def test_cache_write_fuzz_slow(**kw):
    run_cache_write(**kw)


# ------------------------------------------------------------------------------------------ indexer_topk
def run_indexer(lens, PS, Hi, Di, topk, dtype, seed, shuffle=True, sm_scale=0.5, signed_weights=True):
    """Ties are common (relu zeros), so compare what can be compared: the picked slots are distinct valid
    slots of the request, there are min(topk, L) of them then -1, their reference scores are the top scores,
    and they come in descending score order for rows longer than topk, token order for the rest (op docstring)."""
    g = torch.Generator().manual_seed(seed)
    _, (k_cache,), bt, sl, _ = ref.build_paged(lens, PS, (Di,), dtype, generator=g, shuffle=shuffle)
    B = len(lens)
    q = torch.randn(B, Hi, Di, generator=g).to(dtype)
    weights = torch.randn(B, Hi, generator=g)
    if not signed_weights:
        weights = weights.abs()
    got = torch.ops.dsa.indexer_topk(q, weights, k_cache, bt, sl, topk, sm_scale)
    assert got.dtype == torch.int32 and got.shape == (B, topk)
    tol = TOL[dtype]
    for b in range(B):
        by_slot, top = ref.ref_topk_scores(q, weights, k_cache, bt, sl, sm_scale, topk, b)
        n = min(topk, int(sl[b]))
        row = got[b].tolist()
        assert all(s == -1 for s in row[n:]), (b, row)
        picked = row[:n]
        assert len(set(picked)) == n and all(s in by_slot for s in picked), (b, row)
        picked_scores = [by_slot[s] for s in picked]
        scale = max([abs(v) for v in by_slot.values()] + [1e-6])
        assert max([abs(a - r) for a, r in zip(sorted(picked_scores, reverse=True), top)] + [0.0]) <= tol * scale
        if int(sl[b]) > topk:
            assert all(picked_scores[i] >= picked_scores[i + 1] - tol * scale for i in range(n - 1)), "not descending"
        else:  # a row that fits in topk skips its logits: identity (token-order) slots
            assert picked == ref.request_slots(bt, PS, b, n), (b, row)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("PS,topk,lens", [(64, 32, [100, 0, 31]), (1, 8, [20, 8, 3]), (64, 2048, [130, 0])])
def test_indexer_fixed(PS, topk, lens, dtype):
    run_indexer(lens, PS, 64, 128, topk, dtype, seed=PS + topk, sm_scale=128 ** -0.5)


indexer_args = dict(lens=LENS, PS=PAGE_SIZES, Hi=st.integers(1, 4), Di=st.integers(1, 16), topk=st.integers(1, 48),
                    dtype=DTYPES, seed=st.integers(0, 2**31 - 1), shuffle=st.booleans(),
                    sm_scale=st.floats(0.01, 2.0), signed_weights=st.booleans())


@given(**indexer_args)
def test_indexer_fuzz(**kw):
    run_indexer(**kw)


@pytest.mark.slow
@slow_settings()
@given(**indexer_args)
def test_indexer_fuzz_slow(**kw):
    run_indexer(**kw)


# ----------------------------------------------------------------------------------------- k_only_indices
def run_k_only(lens, PS, topk_extra, seed, shuffle=True, extra_cols=0):
    g = torch.Generator().manual_seed(seed)
    _, _, bt, sl, _ = ref.build_paged(lens, PS, (1,), generator=g, shuffle=shuffle, extra_cols=extra_cols)
    topk = max(lens + [1]) + topk_extra
    got = torch.ops.dsa.k_only_indices(bt, sl, PS, topk)
    assert got.dtype == torch.int32
    assert torch.equal(got, ref.ref_k_only(bt, sl, PS, topk)), (lens, PS, topk, got)


@pytest.mark.parametrize("PS,lens,topk_extra", [(64, [2048, 0, 1], 0), (1, [5, 0], 2043), (64, [0], 0)])
def test_k_only_fixed(PS, lens, topk_extra):
    run_k_only(lens, PS, topk_extra, seed=PS)


k_only_args = dict(lens=LENS, PS=PAGE_SIZES, topk_extra=st.integers(0, 70), seed=st.integers(0, 2**31 - 1),
                   shuffle=st.booleans(), extra_cols=st.integers(0, 3))


@given(**k_only_args)
def test_k_only_fuzz(**kw):
    run_k_only(**kw)


@pytest.mark.slow
@slow_settings()
@given(**k_only_args)
def test_k_only_fuzz_slow(**kw):
    run_k_only(**kw)


def test_indexer_overflowing_scores_still_select_every_valid_token():
    """A valid token whose score overflowed to +-inf must still be selected (it used to come back as -1)."""
    q, kc = torch.full((1, 1, 8), 1e19), torch.full((1, 4, 8), 1e19)
    bt, sl = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    for w in (1e10, -1e10):
        got = torch.ops.dsa.indexer_topk(q, torch.tensor([[w]]), kc, bt, sl, 4, 1.0)
        assert sorted(got[0, :3].tolist()) == [0, 1, 2] and got[0, 3] == -1
    got = torch.ops.dsa.indexer_topk(q, torch.tensor([[1e10]]), kc, bt, sl, 2, 1.0)
    assert len(set(got[0].tolist())) == 2 and all(0 <= s < 3 for s in got[0].tolist())


@pytest.mark.parametrize("B,H", [(0, 3), (1, 0)])
def test_empty_batch_or_heads(B, H):
    c, k = torch.randn(2, 4, 8), torch.randn(2, 4, 2)
    bt, sl = torch.zeros(B, 2, dtype=torch.int32), torch.full((B,), 3, dtype=torch.int32)
    out, lse = torch.ops.mla.decode(torch.randn(B, H, 8), torch.randn(B, H, 2), c, k, bt, sl, 0.5)
    assert out.shape == (B, H, 8) and lse.shape == (B, H)
    out, lse = torch.ops.mla.sparse_decode(torch.randn(B, H, 8), torch.randn(B, H, 2), c, k,
                                           torch.zeros(B, 4, dtype=torch.int32), 0.5)
    assert out.shape == (B, H, 8) and lse.shape == (B, H)
    out, lse = torch.ops.mla.merge_states(torch.randn(2, B, H, 8), torch.randn(2, B, H))
    assert out.shape == (B, H, 8) and lse.shape == (B, H)
    assert torch.ops.dsa.indexer_topk(torch.randn(B, H, 8), torch.randn(B, H), c, bt, sl, 4, 0.5).shape == (B, 4)
    assert torch.ops.dsa.k_only_indices(bt, sl, 4, 4).shape == (B, 4)


# ----------------------------------------------------------------------------------------- fused_linear
def run_fused_linear(lead, K, Ns, dtype, seed, transposed_x):
    """[x @ W_i^T] vs float64, any leading dims (0-sized too), 1-3 weights, a transposed (strided) x."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, K, generator=g).to(dtype)
    if transposed_x and len(lead) >= 1:
        x = torch.randn(K, *lead, generator=g).to(dtype).movedim(0, -1)
    ws = [torch.randn(N, K, generator=g).to(dtype) for N in Ns]
    ys = torch.ops.mla.fused_linear(x, ws)
    assert len(ys) == len(ws)
    for y, w in zip(ys, ws):
        want = x.double() @ w.double().T
        assert y.shape == want.shape and y.dtype == dtype
        assert ref.rel_err(y, want) < TOL[dtype], (lead, K, w.shape, dtype)


fused_linear_args = dict(lead=st.lists(st.integers(0, 4), min_size=1, max_size=3), K=st.integers(1, 40),
                         Ns=st.lists(st.integers(1, 20), min_size=1, max_size=3), dtype=DTYPES,
                         seed=st.integers(0, 2**31 - 1), transposed_x=st.booleans())


@given(**fused_linear_args)
def test_fused_linear_fuzz(**kw):
    run_fused_linear(**kw)



# -------------------------------------------------------------------------------------------- linear_partials
def run_linear_partials(M, K, Ns, splits, dtype, seed):
    """Each partial vs float64 over its K range (whole multiples of 128); their sum vs x @ W^T."""
    from mla_compile.ops.linear import split_ranges

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    ws = [torch.randn(N, K, generator=g).to(dtype) for N in Ns]
    p = torch.ops.mla.linear_partials(x, ws, splits)
    W = torch.cat(ws).double()
    assert p.shape == (splits, M, W.shape[0])
    assert p.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    ranges = split_ranges(K, splits)
    assert ranges[0][0] == 0 and ranges[-1][1] == K and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all((hi - lo) % 128 == 0 for lo, hi in ranges[:-1] if hi < K)
    for s, (lo, hi) in enumerate(ranges):
        want = x[:, lo:hi].double() @ W[:, lo:hi].T
        assert ref.rel_err(p[s], want) < 1e-5 if want.abs().sum() else not p[s].any()
    assert ref.rel_err(p.sum(0), x.double() @ W.T) < 1e-5


@given(M=st.integers(0, 5), K=st.integers(0, 700), Ns=st.lists(st.integers(1, 20), min_size=1, max_size=3),
       splits=st.integers(1, 8), dtype=DTYPES, seed=st.integers(0, 2**31 - 1))
def test_linear_partials_fuzz(**kw):
    run_linear_partials(**kw)


# -------------------------------------------------------------------------------------------- per_head_linear
def run_per_head_linear(B, H, K, N, transposed, dtype, seed):
    """y[b, h] = x[b, h] @ W[h]^T vs float64, for a weight in linear layout or a transposed view (W_UK's)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, K, generator=g).to(dtype)
    w = torch.randn(H, K, N, generator=g).to(dtype).transpose(1, 2) if transposed else \
        torch.randn(H, N, K, generator=g).to(dtype)
    y = torch.ops.mla.per_head_linear(x, w)
    want = torch.einsum("bhk,hnk->bhn", x.double(), w.double())
    assert y.shape == (B, H, N) and y.dtype == dtype and y.is_contiguous()
    assert ref.rel_err(y, want) < TOL[dtype] if want.abs().sum() else not y.any()


@given(B=st.integers(0, 17), H=st.integers(1, 6), K=st.integers(0, 300), N=st.integers(1, 40),
       transposed=st.booleans(), dtype=DTYPES, seed=st.integers(0, 2**31 - 1))
def test_per_head_linear_fuzz(**kw):
    run_per_head_linear(**kw)

