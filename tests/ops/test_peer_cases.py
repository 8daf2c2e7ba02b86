"""Edge cases the peers' MLA decode suites check, run against our ops' CPU impls.

Peers read (each test's docstring names the one it mirrors):
  FlashMLA  tests/test_flash_mla.py, test_flash_mla_dense_decoding.py, test_flash_mla_sparse_decoding.py (+ lib.py,
            ref.py), test_flash_mla_sparse_decoding_v32_bit_equal.py
  FlashInfer tests/attention/test_deepseek_mla.py (varlen / oob-NaN / page attention, without-kpe, cutlass, FP8 KV)
  vLLM      tests/kernels/attention/test_mla_decode_cpu.py, test_flashmla.py, test_cutlass_mla_decode.py,
            tests/kernels/test_top_k_per_row.py
  SGLang    sgl-kernel/tests/test_cutlass_mla.py (random block tables: pages shared and repeated)

Every op result is compared with an independent float64 reference written in this file (per request, per query
token, per token slot looked up one at a time; it shares no code with mla_compile). Low-precision inputs are
compared with the reference over the SAME rounded inputs (the reference upcasts the bf16/fp16 tensors the op got).

Tolerances (`assert_state`): the ops compute in float32.
  * scores: a float32 dot product of R + P terms; its error is bounded by SCORE_EPS (1e-6, ~16 float32 ulps: blocked
    / pairwise summation of <= 600 terms) times the row's largest |score| computed from absolute values
    (`score_abs`, per test). A score error d moves lse by <= d and each softmax weight by a relative 2d, hence out
    by <= 2d * max|latent|.
  * out: additionally float32 accumulation of a convex combination (OUT_EPS = 2e-5 of the values' scale, max(1,
    max|ref|)) and, for bf16 / fp16 outputs, the final rounding to the output dtype: half an ulp, at most 2^-8 /
    2^-11 relative (8 / 11 significant bits); we allow one ulp (2^-7 / 2^-10).
  * lse: additionally float32 rounding of the log-sum-exp (2e-5 of max(1, |lse|)).
Rows the reference finds empty must be exactly (0, -inf); no output may hold NaN (unused cache slots hold NaN).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mla_compile  # noqa: F401  (registers the ops)
from mla_compile import (
    paged as _paged,  # only to lay out FP8 caches (quantize on write); read back independently
)

F64 = torch.float64
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)
FLASHMLA_PAD = 2147480000  # FlashMLA's dense test fills unused block-table entries with this
SCORE_EPS = 1e-6
OUT_EPS = 2e-5
LSE_EPS = 2e-5
ROUND = {FP32: 0.0, BF16: 2.0**-7, FP16: 2.0**-10, F64: 0.0}

decode = torch.ops.mla.decode
sparse_decode = torch.ops.mla.sparse_decode


# ------------------------------------------------------------------------------------------------ inputs
def paged_cache(lens, PS, R, P, dtype, g, *, pad=(FLASHMLA_PAD,), extra_cols=1, shared=False, scale=1.0):
    """A paged latent cache holding requests of the given lengths, built by hand.

    Returns (ckv [NP, PS, R], kpe [NP, PS, P], block_table int32 [B, cols], seq_lens int32 [B]). Pages are a
    shuffled pool (shared=False) or drawn with repetition from a pool smaller than needed (shared=True: SGLang's
    `torch.randint` block table, pages shared across and repeated within requests). Every slot no request reads
    holds NaN; block-table entries past a request's last page cycle through `pad`."""
    B = len(lens)
    need = [-(-n // PS) for n in lens]
    cols = max(need + [1]) + extra_cols
    if shared:
        NP = max(sum(need) // 2, 1) + 1
        bt = torch.randint(0, NP, (B, cols), generator=g, dtype=torch.int32)
    else:
        NP = sum(need) + 2
        pool = torch.randperm(NP, generator=g).to(torch.int32)
        bt = torch.zeros(B, cols, dtype=torch.int32)
        start = 0
        for b, n in enumerate(need):
            bt[b, :n] = pool[start:start + n]
            start += n
    for b, n in enumerate(need):
        for j in range(n, cols):
            bt[b, j] = pad[j % len(pad)]
    ckv = (torch.randn(NP, PS, R, generator=g) * scale).to(dtype)
    kpe = (torch.randn(NP, PS, P, generator=g) * scale).to(dtype)
    used = torch.zeros(NP * PS, dtype=torch.bool)
    for b, n in enumerate(lens):
        for t in range(n):
            used[int(bt[b, t // PS]) * PS + t % PS] = True
    ckv.view(NP * PS, R)[~used] = math.nan
    kpe.view(NP * PS, P)[~used] = math.nan
    return ckv, kpe, bt, torch.tensor(lens, dtype=torch.int32)


def causal_limits(lens, S):
    """[B][S]: query token j of a request of length L (counting its S new tokens) sees L - S + 1 + j tokens."""
    return [[max(int(L) - S + 1 + j, 0) for j in range(S)] for L in lens]


def rows_of(cache):
    """[NP, PS, D] (any strides) -> [NP * PS, D] float64 copy; D may be 0."""
    return cache.to(F64).reshape(cache.shape[0] * cache.shape[1], cache.shape[2])


# --------------------------------------------------------------------------------------------- reference
def ref_attend(qn, qp, c, k, scale):
    """One query token: qn [H, R], qp [H, P], tokens c [T, R], k [T, P] (float64) -> (out [H, R], lse [H],
    score_abs: max over heads and tokens of scale * (|qn| . |c| + |qp| . |k|))."""
    H = qn.shape[0]
    if c.shape[0] == 0:
        return torch.zeros(H, qn.shape[1], dtype=F64), torch.full((H,), -math.inf, dtype=F64), 0.0
    s = scale * (qn @ c.T + qp @ k.T)
    m = s.max(dim=1, keepdim=True).values
    e = torch.exp(s - m)
    lse = m[:, 0] + torch.log(e.sum(1))
    out = (e / e.sum(1, keepdim=True)) @ c
    sabs = abs(scale) * float((qn.abs() @ c.abs().T + qp.abs() @ k.abs().T).max())
    return out, lse, sabs


def _ref_rows(q_nope, q_pe, C, K, scale, slots_of):
    """The float64 reference over every (request b, query token j): `slots_of(b, j)` the slots it attends to (rows
    of C / K). q [B, S, H, *] or [B, H, *] -> (out, lse) in q's layout, score_abs, max |latent| read."""
    three = q_nope.dim() == 3
    qn = (q_nope.unsqueeze(1) if three else q_nope).to(F64)
    qp = (q_pe.unsqueeze(1) if three else q_pe).to(F64)
    out = torch.zeros(*qn.shape, dtype=F64)
    lse = torch.zeros(*qn.shape[:-1], dtype=F64)
    sabs, cmax = 0.0, 0.0
    for b in range(qn.shape[0]):
        for j in range(qn.shape[1]):
            slots = slots_of(b, j)
            c, k = C[slots], K[slots]
            out[b, j], lse[b, j], sa = ref_attend(qn[b, j], qp[b, j], c, k, scale)
            sabs = max(sabs, sa)
            if slots:
                cmax = max(cmax, float(c.abs().max()))
    if three:
        out, lse = out[:, 0], lse[:, 0]
    return out, lse, sabs, cmax


def ref_decode(q_nope, q_pe, ckv, kpe, bt, limits, scale):
    """q [B, S, H, *] (or [B, H, *]); limits [B][S] tokens each query token sees. -> (out, lse) float64 in q's
    layout, score_abs, max |latent| read."""
    PS = ckv.shape[1]
    return _ref_rows(q_nope, q_pe, rows_of(ckv), rows_of(kpe), scale,
                     lambda b, j: [int(bt[b, t // PS]) * PS + t % PS for t in range(max(limits[b][j], 0))])


def ref_sparse(q_nope, q_pe, ckv, kpe, indices, scale, ckv_rows=None):
    """indices [B, K] or [B, S, K] flat slots, -1 ignored, a slot listed twice counts twice (FlashMLA's ref:
    gather, then softmax). ckv_rows: the latent rows in float64 if not ckv itself (an FP8 cache dequantized)."""
    idx = indices.unsqueeze(1) if q_nope.dim() == 3 else indices
    return _ref_rows(q_nope, q_pe, rows_of(ckv) if ckv_rows is None else ckv_rows, rows_of(kpe), scale,
                     lambda b, j: [int(s) for s in idx[b, j] if int(s) != -1])


def assert_state(out, lse, ref, dtype, what=""):
    """(out, lse) of an op vs (r_out, r_lse, score_abs, max|latent|) of the reference; see the module docstring."""
    r_out, r_lse, sabs, cmax = ref
    assert out.dtype == dtype, what
    assert lse.dtype == (F64 if dtype == F64 else FP32), what
    assert out.shape == r_out.shape and lse.shape == r_lse.shape, (what, out.shape, r_out.shape)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"NaN in the output {what}"
    empty = torch.isneginf(r_lse)
    assert torch.equal(torch.isneginf(lse), empty), f"-inf rows differ {what}"
    assert bool((out[empty] == 0).all()), f"empty rows must be exactly 0 {what}"
    d = SCORE_EPS * sabs
    scale = max(1.0, float(r_out.abs().max()) if r_out.numel() else 1.0)
    tol = OUT_EPS * scale + 2 * d * cmax + ROUND[dtype] * r_out.abs()
    err = (out.to(F64) - r_out).abs()
    assert bool((err <= tol).all()), f"out: max err {float(err.max()):.3g}, worst excess " \
                                     f"{float((err - tol).max()):.3g} {what}"
    fin = ~empty
    if bool(fin.any()):
        e_lse = (lse.to(F64)[fin] - r_lse[fin]).abs()
        t_lse = LSE_EPS * max(1.0, float(r_lse[fin].abs().max())) + d
        assert float(e_lse.max()) <= t_lse, f"lse: max err {float(e_lse.max()):.3g} > {t_lse:.3g} {what}"


def varlen(b, mean, s_q, rng, zero_frac=0.0):
    """FlashMLA / vLLM's lengths: max(normalvariate(mean, mean / 2), s_q), some rows 0 (have_zero_seqlen_k)."""
    lens = [max(int(rng.normalvariate(mean, mean / 2)), s_q) for _ in range(b)]
    return [0 if rng.random() < zero_frac else n for n in lens]


# --------------------------------------------------------------------------------------- dense decoding
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("h_q,s_q", [(16, 1), (32, 2), (64, 1), (128, 2), (3, 2), (63, 1)])
def test_flashmla_dense_decoding(h_q, s_q, dtype):
    """FlashMLA test_flash_mla_dense_decoding.py / test_flash_mla.py, vLLM test_flashmla.py: d 576 / dv 512, page 64,
    h_q 16..128 (and the odd 3, 63), s_q 1 / 2 (MTP, causal), varlen lengths >= s_q with zero-length rows, q =
    randn / 10 clamped to +-1, a shuffled block table whose unused entries hold 2147480000, NaN past every length."""
    rng = random.Random(h_q * 10 + s_q)
    g = torch.Generator().manual_seed(h_q * 10 + s_q)
    lens = varlen(5, 140, s_q, rng, zero_frac=0.3) + [s_q, 0]
    ckv, kpe, bt, sl = paged_cache(lens, 64, 512, 64, dtype, g)
    q = (torch.randn(len(lens), s_q, h_q, 576, generator=g) / 10).clamp(-1, 1).to(dtype)
    qn, qp = q[..., :512], q[..., 512:]
    scale = 576 ** -0.5
    out, lse = decode(qn, qp, ckv, kpe, bt, sl, scale)
    assert_state(out, lse, ref_decode(qn, qp, ckv, kpe, bt, causal_limits(lens, s_q), scale), dtype)


@pytest.mark.parametrize("dtype", [FP32, FP16, BF16])
@pytest.mark.parametrize("varlen_", [False, True])
def test_vllm_mla_decode_cpu(dtype, varlen_):
    """vLLM test_mla_decode_cpu.py: bs 4, mean length 256 (varlen: normal(256, 128) clipped to >= 2), h_q 16,
    d 576 / dv 512, block 16, scale d^-0.5, float / half / bfloat16, NaN past every length ("likely read out of
    bounds"), an arange block table."""
    g = torch.Generator().manual_seed(7)
    if varlen_:
        lens = torch.empty(4).normal_(256, 128, generator=g).clip(2).to(torch.int32).tolist()
    else:
        lens = [256] * 4
    ckv, kpe, bt, sl = paged_cache(lens, 16, 512, 64, dtype, g)
    q = torch.randn(4, 16, 576, generator=g).to(dtype)
    out, lse = decode(q[..., :512], q[..., 512:], ckv, kpe, bt, sl, 576 ** -0.5)
    assert_state(out, lse, ref_decode(q[..., :512], q[..., 512:], ckv, kpe, bt, causal_limits(lens, 1),
                                      576 ** -0.5), dtype)


@pytest.mark.parametrize("PS", [1, 2, 16, 32, 53, 61, 64, 69, 128, 576])
def test_page_sizes(PS):
    """Page sizes of the peers: FlashInfer 1 / 16 / 32, SGLang cutlass 16 / 128, FlashMLA sparse 2 / 53 / 61 / 64 /
    69 / 576 (not powers of two); lengths 1, PS - 1, PS, PS + 1 and 3 PS + 7 (not page multiples) and 0."""
    g = torch.Generator().manual_seed(PS)
    lens = sorted({1, max(PS - 1, 1), PS, PS + 1, 3 * PS + 7}) + [0]
    ckv, kpe, bt, sl = paged_cache(lens, PS, 512, 64, BF16, g, pad=(FLASHMLA_PAD, -1), extra_cols=2)
    qn, qp = torch.randn(len(lens), 16, 512, generator=g).to(BF16), torch.randn(len(lens), 16, 64, generator=g).to(BF16)
    out, lse = decode(qn, qp, ckv, kpe, bt, sl, 192 ** -0.5)
    assert_state(out, lse, ref_decode(qn, qp, ckv, kpe, bt, causal_limits(lens, 1), 192 ** -0.5), BF16, f"PS={PS}")


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("PS", [16, 128])
def test_shared_and_repeated_pages(PS, dtype):
    """SGLang sgl-kernel test_cutlass_mla.py: `block_table = torch.randint(0, bs * block_num, ...)`, so a page may
    be listed by several requests (prefix sharing) and twice within one request; h_q 128, scale (128 + 64)^-0.5,
    varlen lengths clipped to >= 2. Token t of request b is still whatever sits at its table's slot."""
    g = torch.Generator().manual_seed(PS + 1)
    lens = [2, 300, 128, 513]
    ckv, kpe, bt, sl = paged_cache(lens, PS, 512, 64, dtype, g, shared=True)
    need = [-(-n // PS) for n in lens]
    rows = [bt[b, :n].tolist() for b, n in enumerate(need)]
    flat = [p for row in rows for p in row]
    assert len(set(flat)) < len(flat), "the draw must share pages"
    qn, qp = torch.randn(4, 128, 512, generator=g).to(dtype), torch.randn(4, 128, 64, generator=g).to(dtype)
    scale = (128 + 64) ** -0.5
    out, lse = decode(qn, qp, ckv, kpe, bt, sl, scale)
    assert_state(out, lse, ref_decode(qn, qp, ckv, kpe, bt, causal_limits(lens, 1), scale), dtype)


@pytest.mark.parametrize("pad", [(FLASHMLA_PAD,), (INT32_MAX, INT32_MIN, -1), (-1,)])
@pytest.mark.parametrize("S", [1, 2])
def test_block_table_padding_and_strided_metadata(pad, S):
    """FlashMLA dense test: unused block-table entries set to 2147480000 (here also INT32_MAX / INT32_MIN / -1),
    and FlashMLA lib.py `kk.non_contiguousify(block_table)`: a strided block table and seq_lens, and a transposed q.
    Entries past a request's pages are never read."""
    g = torch.Generator().manual_seed(len(pad) * 10 + S)
    lens = [S, 37, 0, 64, 65]
    ckv, kpe, bt, sl = paged_cache(lens, 16, 64, 16, FP32, g, pad=pad, extra_cols=3)
    wide = torch.full((bt.shape[0], bt.shape[1] * 2), 7, dtype=torch.int32)
    wide[:, ::2] = bt
    bt_nc = wide[:, ::2]
    sl_nc = torch.stack([sl, sl + 1000], 1)[:, 0]
    assert not bt_nc.is_contiguous() and not sl_nc.is_contiguous()
    B = len(lens)
    qn = torch.randn(4, B, S, 64, generator=g).permute(1, 2, 0, 3)  # [B, S, H=4, R], heads outermost in memory
    qp = torch.randn(B, S, 4, 32, generator=g)[..., ::2]  # every other rope column
    out, lse = decode(qn, qp, ckv, kpe, bt_nc, sl_nc, 0.2)
    assert out.is_contiguous()
    assert_state(out, lse, ref_decode(qn, qp, ckv, kpe, bt, causal_limits(lens, S), 0.2), FP32)


@pytest.mark.parametrize("S", [1, 2])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_q_and_cache_as_views_of_packed_buffers(S, dtype):
    """vLLM test_cutlass_mla_decode.py / FlashInfer test_cutlass_mla: q_nope = q[..., :512], q_pe = q[..., 512:] of
    one [B, (S,) H, 576] q, and the latent and rope caches as the two column ranges of one [NP, PS, 576]
    kv_c_and_k_pe cache (vLLM's layout, FlashMLA's blocked_k); the op reads the views as they are."""
    g = torch.Generator().manual_seed(S)
    lens = [S, 200, 0, 65]
    ckv, kpe, bt, sl = paged_cache(lens, 64, 512, 64, dtype, g)
    buf = torch.cat([ckv, kpe], -1)
    c_view, k_view = buf[..., :512], buf[..., 512:]
    assert not c_view.is_contiguous() and c_view.data_ptr() == buf.data_ptr()
    q = torch.randn(4, S, 8, 576, generator=g).to(dtype)
    q = q[:, 0] if S == 1 else q
    qn, qp = q[..., :512], q[..., 512:]
    out, lse = decode(qn, qp, c_view, k_view, bt, sl, 576 ** -0.5)
    assert_state(out, lse, ref_decode(qn, qp, ckv, kpe, bt, causal_limits(lens, S), 576 ** -0.5), dtype)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("PS", [1, 64])
def test_large_q_magnitude(PS, dtype):
    """FlashInfer test_cutlass_mla: q * 100 "to detect bugs such as flashinfer#1055" (scores in the hundreds, a
    softmax close to one-hot), h 128, scale (128 + 64)^-0.5; lengths 128 / 1024 and an odd one."""
    g = torch.Generator().manual_seed(PS)
    lens = [128, 1024, 77]
    ckv, kpe, bt, sl = paged_cache(lens, PS, 512, 64, dtype, g)
    q = (torch.randn(3, 128, 576, generator=g) * 100).to(dtype)
    scale = (128 + 64) ** -0.5
    out, lse = decode(q[..., :512], q[..., 512:], ckv, kpe, bt, sl, scale)
    assert float(lse.max()) > 100  # the case the peer means: large scores
    assert_state(out, lse, ref_decode(q[..., :512], q[..., 512:], ckv, kpe, bt, causal_limits(lens, 1), scale),
                 dtype)


@pytest.mark.parametrize("scale", [576 ** -0.5, 192 ** -0.5, 576 ** -0.55, 512 ** -0.5, 1.0, 1, 0.5, -0.3, 0.0])
def test_softmax_scale_values(scale):
    """Scales the peers pass: d^-0.5 (FlashMLA, vLLM), (128 + 64)^-0.5 (FlashInfer, SGLang: the head dim before
    absorption), d^-0.55 (FlashMLA sparse), 512^-0.5 (V32 no-rope), 1.0 (FlashInfer kpe test) / int 1, 0.5
    (FlashMLA sparse prefill); also -0.3 and 0 (a uniform softmax: out = the mean latent, lse = ln L)."""
    g = torch.Generator().manual_seed(3)
    lens = [1, 50, 0, 129]
    ckv, kpe, bt, sl = paged_cache(lens, 64, 128, 32, FP32, g)
    qn, qp = torch.randn(4, 8, 128, generator=g), torch.randn(4, 8, 32, generator=g)
    out, lse = decode(qn, qp, ckv, kpe, bt, sl, scale)
    assert_state(out, lse, ref_decode(qn, qp, ckv, kpe, bt, causal_limits(lens, 1), scale), FP32, f"scale={scale}")
    if scale == 0.0:
        for b, L in enumerate(lens):
            if L:
                torch.testing.assert_close(lse[b], torch.full((8,), math.log(L)), atol=1e-6, rtol=0)


def test_lse_is_natural_log_and_empty_rows_are_neg_inf():
    """LSE convention. FlashInfer returns base-2 lse (lse_mode="base2": the reference multiplies by log2 e), FlashMLA
    natural log with +inf for a row with nothing to attend (its ref.py `lonely_q_mask`). Ours: natural log, and an
    empty row is (0, -inf); mla::merge_states weighs a foreign kernel's +inf empty part exactly 0."""
    R, P = 16, 8
    c = torch.randn(2, 4, R, dtype=F64)
    k = torch.randn(2, 4, P, dtype=F64)
    bt = torch.tensor([[0], [1], [0]], dtype=torch.int32)
    c[1, 1] = c[1, 0]  # request 1: two identical tokens
    k[1, 1] = k[1, 0]
    sl = torch.tensor([1, 2, 0], dtype=torch.int32)
    qn, qp = torch.randn(3, 2, R, dtype=F64), torch.randn(3, 2, P, dtype=F64)
    out, lse = decode(qn, qp, c, k, bt, sl, 0.7)
    s0 = 0.7 * (qn[0] @ c[0, 0] + qp[0] @ k[0, 0])
    s1 = 0.7 * (qn[1] @ c[1, 0] + qp[1] @ k[1, 0])
    torch.testing.assert_close(lse[0], s0, atol=1e-12, rtol=0)  # one token: lse = its score (not score * log2 e)
    torch.testing.assert_close(lse[1], s1 + math.log(2), atol=1e-12, rtol=0)  # two equal tokens: + ln 2
    torch.testing.assert_close(out[0], c[0, 0].expand(2, R), atol=1e-12, rtol=0)
    assert torch.equal(out[2], torch.zeros(2, R, dtype=F64)) and bool(torch.isneginf(lse[2]).all())
    # a FlashMLA-style empty part (lse +inf, output left unwritten: NaN) merged with ours changes nothing
    outs = torch.stack([out.float(), torch.full_like(out.float(), math.nan)])
    lses = torch.stack([lse.float(), torch.full_like(lse.float(), math.inf)])
    m_out, m_lse = torch.ops.mla.merge_states(outs, lses)
    assert torch.equal(m_out, out.float()) and torch.equal(m_lse, lse.float())


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_zero_latent_gives_zero_output(dtype):
    """FlashInfer test_batch_mla_fp8_kv_zero_kv_gives_zero_output (here a bf16 / fp16 cache; FP8 below): an
    all-zero latent cache gives exactly zero output; every score is 0, so lse = ln L."""
    NP, PS = 4, 64
    ckv, kpe = torch.zeros(NP, PS, 512, dtype=dtype), torch.zeros(NP, PS, 64, dtype=dtype)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    sl = torch.tensor([128, 100], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    qn = (torch.randn(2, 128, 512, generator=g) * 0.1).to(dtype)
    qp = (torch.randn(2, 128, 64, generator=g) * 0.1).to(dtype)
    out, lse = decode(qn, qp, ckv, kpe, bt, sl, 576 ** -0.5)
    assert not out.any()
    torch.testing.assert_close(lse, torch.tensor([[math.log(128)] * 128, [math.log(100)] * 128]), atol=1e-6, rtol=0)


def _rope_dominant_case(dtype):
    """FlashInfer test_fp8_kv_kpe_dominant_no_row_aliasing: q_nope 0, q_pe all ones, kpe token 4 = +1 and token 8 =
    -1 (all else 0), latent token 4 [0] = 100 and token 8 [0] = -100, scale 1: token 4 wins (weight ~1 - 63 e^-64),
    so out[..., 0] ~ +100; a kernel aliasing kpe rows 4 and 8 flips it."""
    ckv = torch.zeros(1, 64, 512)
    kpe = torch.zeros(1, 64, 64)
    kpe[0, 4], kpe[0, 8] = 1.0, -1.0
    ckv[0, 4, 0], ckv[0, 8, 0] = 100.0, -100.0
    qn = torch.zeros(1, 16, 512, dtype=dtype)
    qp = torch.ones(1, 16, 64, dtype=dtype)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    sl = torch.tensor([64], dtype=torch.int32)
    return qn, qp, ckv, kpe.to(dtype), bt, sl


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_rope_dominant_no_row_aliasing(dtype):
    """FlashInfer test_fp8_kv_kpe_dominant_no_row_aliasing over a bf16 / fp16 / fp32 cache."""
    qn, qp, ckv, kpe, bt, sl = _rope_dominant_case(dtype)
    ckv = ckv.to(dtype)
    out, lse = decode(qn, qp, ckv, kpe, bt, sl, 1.0)
    assert float(out[0, 0, 0]) > 50.0
    assert_state(out, lse, ref_decode(qn, qp, ckv, kpe, bt, [[64]], 1.0), dtype)


def test_rope_zero_equals_rope_less_bit_exact():
    """FlashMLA test_flash_mla_sparse_decoding_v32_bit_equal.py: a rope part of zeros (q_pe = 0, kpe = 0, P 64)
    gives bit-identical out and lse to the rope-less call (P = 0) over the same latent, same scale 512^-0.5,
    dense and sparse (indices with ~5% -1), s_q 1 and 3."""
    g = torch.Generator().manual_seed(5)
    lens = [300, 64, 3]
    ckv, kpe, bt, sl = paged_cache(lens, 64, 512, 64, BF16, g)
    kpe0 = torch.zeros_like(kpe)
    kp_none = kpe[..., :0]
    for S in (1, 3):
        sl_s = sl
        qn = torch.randn(3, S, 64, 512, generator=g).clamp(-1, 1).to(BF16)
        out_a, lse_a = decode(qn, torch.zeros(3, S, 64, 64, dtype=BF16), ckv, kpe0, bt, sl_s, 512 ** -0.5)
        out_b, lse_b = decode(qn, torch.zeros(3, S, 64, 0, dtype=BF16), ckv, kp_none, bt, sl_s, 512 ** -0.5)
        assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b), S
        idx = torch.tensor([[[int(bt[b, t // 64]) * 64 + t % 64 if random.Random(b * 7 + j * 13 + t).random() > 0.05
                              else -1 for t in range(64)] for j in range(S)] for b in range(3)], dtype=torch.int32)
        idx[2, :, 3:] = -1  # request 2 has three tokens
        out_a, lse_a = sparse_decode(qn, torch.zeros(3, S, 64, 64, dtype=BF16), ckv, kpe0, idx, 512 ** -0.5)
        out_b, lse_b = sparse_decode(qn, torch.zeros(3, S, 64, 0, dtype=BF16), ckv, kp_none, idx, 512 ** -0.5)
        assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b), S


# ------------------------------------------------------------------------------------- query tokens (MTP)
@pytest.mark.parametrize("S", [3, 7, 17])
@pytest.mark.parametrize("PS", [1, 16])
def test_many_query_tokens_causal(S, PS):
    """FlashInfer test_batch_mla_varlen_page_attention / test_batch_mla_page_attention: qo_len 1..17, causal (query
    token j of S sees kv_len - S + 1 + j tokens: torch.tril(diagonal=s_k - s_q)), kv_len 0 and kv_len == qo_len
    (the first query token sees one token), page 1 / 16, h 16, fp16, scale (128 + 64)^-0.5."""
    g = torch.Generator().manual_seed(S * 100 + PS)
    lens = [S, S + 1, 97, 0, max(33, S)]
    ckv, kpe, bt, sl = paged_cache(lens, PS, 512, 64, FP16, g)
    qn, qp = torch.randn(5, S, 16, 512, generator=g).to(FP16), torch.randn(5, S, 16, 64, generator=g).to(FP16)
    scale = (128 + 64) ** -0.5
    out, lse = decode(qn, qp, ckv, kpe, bt, sl, scale)
    assert_state(out, lse, ref_decode(qn, qp, ckv, kpe, bt, causal_limits(lens, S), scale), FP16, f"S={S}")


@pytest.mark.parametrize("P", [0, 64])
def test_non_causal_query_tokens_via_limits_table(P):
    """FlashInfer test_batch_mla_without_kpe (qo_len 3, kv_len 97, page 16, h 16, fp16, head_dim_kpe 0, scale
    1/sqrt(128), causal=False) and the causal=False rows of its page-attention tests: every query token sees all
    kv_len tokens, which our [B, S] table of per-token limits states as equal limits."""
    g = torch.Generator().manual_seed(P)
    lens = [97, 97, 40]
    S = 3
    ckv, kpe, bt, _ = paged_cache(lens, 16, 512, P, FP16, g)
    limits = [[L] * S for L in lens]
    table = torch.tensor(limits, dtype=torch.int32)
    qn, qp = torch.randn(3, S, 16, 512, generator=g).to(FP16), torch.randn(3, S, 16, P, generator=g).to(FP16)
    scale = 1 / math.sqrt(128)
    out, lse = decode(qn, qp, ckv, kpe, bt, table, scale)
    assert_state(out, lse, ref_decode(qn, qp, ckv, kpe, bt, limits, scale), FP16)
    # each query token equals a one-token call over the whole request
    for j in range(S):
        o1, l1 = decode(qn[:, j], qp[:, j], ckv, kpe, bt, table[:, 0].contiguous(), scale)
        assert torch.equal(out[:, j], o1) and torch.equal(lse[:, j], l1), j


@pytest.mark.parametrize("S", [1, 2])
def test_very_long_kv(S):
    """FlashMLA / vLLM test_flashmla: s_k 4096..16384 (FlashMLA's peak-perf rows 32768), h 16, page 64, bf16; here
    one request of 16384 tokens beside a varlen one and an empty one (the CPU keeps it to seconds)."""
    g = torch.Generator().manual_seed(S)
    lens = [16384, 5001, 0]
    ckv, kpe, bt, sl = paged_cache(lens, 64, 512, 64, BF16, g)
    q = (torch.randn(3, S, 16, 576, generator=g) / 10).clamp(-1, 1).to(BF16)
    out, lse = decode(q[..., :512], q[..., 512:], ckv, kpe, bt, sl, 576 ** -0.5)
    assert_state(out, lse, ref_decode(q[..., :512], q[..., 512:], ckv, kpe, bt, causal_limits(lens, S), 576 ** -0.5),
                 BF16)


# ------------------------------------------------------------------------------------------ sparse decode
def _abs_to_slots(abs_idx, bt, PS):
    """FlashMLA quant.abs_indices2indices_in_kvcache: token index -> physical slot through the block table; -1 stays."""
    safe = abs_idx.clamp_min(0).long()
    B = abs_idx.shape[0]
    page = bt.long()[torch.arange(B).view(B, *([1] * (abs_idx.dim() - 1))), safe // PS]
    return torch.where(abs_idx >= 0, page * PS + safe % PS, -1).to(torch.int32)


@pytest.mark.parametrize("d_qk,s_k,topk,PS,h_q,s_q", [
    (576, 512, 64, 2, 64, 3), (576, 512, 64, 69, 128, 1), (576, 1024, 576, 61, 64, 3),
    (576, 2046, 2048, 64, 128, 1), (512, 650, 576, 53, 64, 3), (512, 512, 64, 64, 128, 1)])
def test_flashmla_sparse_decoding(d_qk, s_k, topk, PS, h_q, s_q):
    """FlashMLA test_flash_mla_sparse_decoding.py (lib.generate_testcase_for_decode, ref.ref_sparse_attn_decode):
    d_qk 576 (V3.2) or 512 (no rope), (s_k, topk, block) rows of its matrix, h_q 64 / 128, s_q 1 / 3, varlen
    lengths with zero-length rows, each query token's indices a random permutation of its request's tokens
    (unique) padded with -1 where the request is shorter than topk, some rows all -1 (is_all_indices_invalid),
    mapped to slots through a shuffled block table; non-contiguous q and indices; scale d_qk^-0.55; NaN in every
    slot no index lists."""
    rng = random.Random(s_k + topk + PS)
    g = torch.Generator().manual_seed(s_k + topk + PS)
    B = 2 if topk >= 2048 else 4
    P = d_qk - 512
    lens = varlen(B, s_k, s_q, rng)[:B - 1] + [0]  # the last request empty (have_zero_seqlen_k)
    ckv, kpe, bt, _ = paged_cache(lens, PS, 512, P, BF16, g)
    abs_idx = torch.full((B, s_q, topk), -1, dtype=torch.int32)
    for b, L in enumerate(lens):
        for j in range(s_q):
            perm = torch.randperm(L, generator=g)[:topk]
            abs_idx[b, j, :perm.numel()] = perm.to(torch.int32)
    abs_idx[0, -1] = -1  # one query token with every index invalid
    idx = _abs_to_slots(abs_idx, bt, PS)
    idx_nc = torch.stack([idx, idx], -1)[..., 0]  # non_contiguousify
    assert not idx_nc.is_contiguous()
    q = torch.randn(B, s_q, h_q, d_qk * 2, generator=g).clamp(-1, 1).to(BF16)[..., ::2]
    qn, qp = q[..., :512], q[..., 512:]
    if s_q == 1:
        qn, qp, idx_nc, idx = qn[:, 0], qp[:, 0], idx_nc[:, 0], idx[:, 0]
    scale = d_qk ** -0.55
    out, lse = sparse_decode(qn, qp, ckv, kpe, idx_nc, scale)
    assert_state(out, lse, ref_sparse(qn, qp, ckv, kpe, idx, scale), BF16)


def test_sparse_duplicated_indices_count_each_listing():
    """A slot listed k times weighs k times (FlashMLA ref.py gathers the listed rows, then softmaxes): [s, s, s, -1]
    gives out = latent(s), lse = score(s) + ln 3; [s, s, t] vs the reference."""
    g = torch.Generator().manual_seed(11)
    c, k = torch.randn(3, 4, 32, dtype=F64, generator=g), torch.randn(3, 4, 8, dtype=F64, generator=g)
    qn, qp = torch.randn(2, 4, 32, dtype=F64, generator=g), torch.randn(2, 4, 8, dtype=F64, generator=g)
    idx = torch.tensor([[5, 5, 5, -1], [5, 5, 9, -1]], dtype=torch.int32)
    out, lse = sparse_decode(qn, qp, c, k, idx, 0.3)
    s5 = 0.3 * (qn[0] @ c.view(-1, 32)[5] + qp[0] @ k.view(-1, 8)[5])
    torch.testing.assert_close(lse[0], s5 + math.log(3), atol=1e-12, rtol=0)
    torch.testing.assert_close(out[0], c.view(-1, 32)[5].expand(4, 32), atol=1e-12, rtol=0)
    r_out, r_lse, _, _ = ref_sparse(qn, qp, c, k, idx, 0.3)
    torch.testing.assert_close(out, r_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, r_lse, atol=1e-12, rtol=0)


@pytest.mark.parametrize("bad", [INT32_MIN, -123456, -2, "s_kv", 114514, 2147480000, INT32_MAX])
def test_sparse_foreign_invalid_index_values_are_refused(bad):
    """FlashMLA lib.generate_testcase fills indices with `invalid_indices_candidate` (-2147483648, -123456, -1, s_kv,
    114514, 1919810, 2147480000, 2147483647) that its kernel ignores. Our contract: -1 is the only padding; any
    other value outside [0, NP * PS) is refused with a ValueError naming `indices` (never read as a slot)."""
    c, k = torch.randn(2, 4, 16), torch.randn(2, 4, 4)
    v = 8 if bad == "s_kv" else bad
    idx = torch.tensor([[0, v, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="^indices: "):
        sparse_decode(torch.randn(1, 2, 16), torch.randn(1, 2, 4), c, k, idx, 0.5)


def _topk_rows(lens, k, S, g):
    """Per request: a random permutation of its token indices, the first min(L, k), -1 after; the same for each of S
    query tokens -> int32 [B, S, k]."""
    rows = []
    for n in lens:
        m = min(n, k)
        row = torch.cat([torch.randperm(n, generator=g)[:m].to(torch.int32), torch.full((k - m,), -1, dtype=torch.int32)])
        rows.append(row.repeat(S, 1))
    return torch.stack(rows)


@pytest.mark.parametrize("S", [1, 3])
def test_two_kv_scopes_merged(S):
    """FlashMLA test_flash_mla_sparse_decoding.py with extra_k (MODEL1 configs: indices into a main cache and an
    `extra_kv_scope` cache of another block size, one softmax over both, each scope with its own -1 tail as its
    topk_length gives): here one sparse_decode per cache, combined by mla.merge_states, equals the float64 attention
    over the rows of both; a query token with nothing in one scope (or in both) weighs 0 there."""
    g = torch.Generator().manual_seed(S)
    B, H = 3, 16
    l1, l2 = [70, 40, 9], [33, 20, 5]
    c1, k1, bt1, _ = paged_cache(l1, 64, 512, 0, BF16, g)
    c2, k2, bt2, _ = paged_cache(l2, 2, 512, 0, BF16, g)
    i1 = _abs_to_slots(_topk_rows(l1, 16, S, g), bt1, 64)
    i2 = _abs_to_slots(_topk_rows(l2, 8, S, g), bt2, 2)
    i1[1, :, 4:] = -1  # topk_length 4 in the main scope
    i2[2] = -1  # request 2: nothing in the extra scope
    i1[0, -1], i2[0, -1] = -1, -1  # a query token with nothing in either scope
    q = torch.randn(B, S, H, 512, generator=g).clamp(-1, 1).to(BF16)
    qp = torch.zeros(B, S, H, 0, dtype=BF16)
    scale = 512 ** -0.55
    o1, s1 = sparse_decode(q, qp, c1, k1, i1, scale)
    o2, s2 = sparse_decode(q, qp, c2, k2, i2, scale)
    out, lse = torch.ops.mla.merge_states(torch.stack([o1, o2]).flatten(1, 2), torch.stack([s1, s2]).flatten(1, 2))
    out, lse = out.view(o1.shape), lse.view(s1.shape)
    # the reference: one softmax over the rows both scopes list (the extra cache's slots placed after the main's)
    n1 = c1.shape[0] * c1.shape[1]
    C = torch.cat([c1.reshape(n1, 512), c2.reshape(-1, 512)]).view(-1, 1, 512)
    both = torch.cat([i1, torch.where(i2 >= 0, i2 + n1, -1)], -1)
    r_out, r_lse, sabs, cmax = ref_sparse(q, qp, C, torch.zeros(C.shape[0], 1, 0, dtype=BF16), both, scale)
    empty = torch.isneginf(r_lse)
    assert bool(empty.any()) and bool((~empty).any())
    assert torch.equal(torch.isneginf(lse), empty) and not out[empty].any() and not torch.isnan(out).any()
    # as assert_state, with two bf16 roundings (each part's out, then the merged out) of values within max|latent|
    d = SCORE_EPS * sabs
    tol = OUT_EPS * max(1.0, cmax) + 2 * d * cmax + 2 * 2.0**-8 * cmax
    assert float((out.to(F64) - r_out).abs().max()) <= tol
    assert float((lse.to(F64)[~empty] - r_lse[~empty]).abs().max()) <= \
        LSE_EPS * max(1.0, float(r_lse[~empty].abs().max())) + d


# -------------------------------------------------------------------------------- batch-level properties
def test_batch_permutation_invariance():
    """FlashMLA lib.KVScope.apply_perm (its batch-invariance check): permuting the requests permutes the results,
    bit for bit; a request decoded alone matches its row of the batch to float32 round-off (not bit for bit: the
    batch's longest request sets the width the CPU impl reduces over, so lse may differ in its last bits and a bf16
    out element may round the other way)."""
    g = torch.Generator().manual_seed(21)
    lens = [5, 300, 77, 1, 0]
    ckv, kpe, bt, sl = paged_cache(lens, 64, 512, 64, BF16, g)
    qn, qp = torch.randn(5, 16, 512, generator=g).to(BF16), torch.randn(5, 16, 64, generator=g).to(BF16)
    out, lse = decode(qn, qp, ckv, kpe, bt, sl, 576 ** -0.5)
    p = torch.tensor([2, 4, 0, 3, 1])
    o2, l2 = decode(qn[p], qp[p], ckv, kpe, bt[p], sl[p], 576 ** -0.5)
    assert torch.equal(o2, out[p]) and torch.equal(l2, lse[p])
    for b in range(5):
        oa, la = decode(qn[b:b + 1], qp[b:b + 1], ckv, kpe, bt[b:b + 1], sl[b:b + 1], 576 ** -0.5)
        torch.testing.assert_close(oa[0], out[b], atol=0, rtol=2.0**-7)  # one bf16 ulp (its rounding may flip)
        assert torch.equal(torch.isneginf(la[0]), torch.isneginf(lse[b]))
        torch.testing.assert_close(la[0], lse[b], atol=1e-5, rtol=1e-6)


def test_garbage_rows_do_not_leak():
    """vLLM test_cutlass_mla_decode.py pads the heads to 128 with `new_empty` (garbage) and slices the real ones
    back: NaN / inf in padded heads and in an empty (seq_len 0) request must not touch any other row; the empty
    request still gives (0, -inf)."""
    g = torch.Generator().manual_seed(4)
    lens = [40, 0, 17]
    ckv, kpe, bt, sl = paged_cache(lens, 16, 64, 16, FP32, g)
    qn, qp = torch.randn(3, 8, 64, generator=g), torch.randn(3, 8, 16, generator=g)
    out, lse = decode(qn, qp, ckv, kpe, bt, sl, 0.3)
    qn2, qp2 = qn.clone(), qp.clone()
    qn2[:, 5:] = math.nan  # padded heads
    qp2[:, 6:] = math.inf
    qn2[1] = math.nan  # the empty request's whole q
    out2, lse2 = decode(qn2, qp2, ckv, kpe, bt, sl, 0.3)
    assert torch.equal(out2[:, :5], out[:, :5]) and torch.equal(lse2[:, :5], lse[:, :5])
    assert not out2[1].any() and bool(torch.isneginf(lse2[1]).all())


# --------------------------------------------------------------------------------------- DSA indexer top-k
@pytest.mark.parametrize("next_n", [1, 2])
def test_indexer_topk_exact_ties(next_n):
    """vLLM test_top_k_per_row.py ("10LSBits" data: many equal / nearly equal logits; next_n query rows with causal
    ends seq_len - next_n + 1 + j): with small-integer q and keys every score is exact in float32, so the answer
    is unique under our order (score descending, equal scores to the lower token index): compared exactly,
    including rows with many exact zeros (relu) and negative weights (-0.0 vs +0.0 one tie class)."""
    g = torch.Generator().manual_seed(next_n)
    PS, Hi, Di, topk = 4, 3, 8, 6
    lens = [40, 9, next_n, 0, topk + next_n]
    B = len(lens)
    need = [-(-n // PS) for n in lens]
    NP = sum(need) + 1
    pool = torch.randperm(NP, generator=g).to(torch.int32)
    bt = torch.full((B, max(need) + 1), FLASHMLA_PAD, dtype=torch.int32)
    s = 0
    for b, n in enumerate(need):
        bt[b, :n] = pool[s:s + n]
        s += n
    kc = torch.randint(-2, 3, (NP, PS, Di), generator=g).float()
    q = torch.randint(-1, 2, (B, next_n, Hi, Di), generator=g).float()
    w = torch.randint(-2, 3, (B, next_n, Hi), generator=g).float()
    w[1] = -w[1].abs()  # request 1: every score <= 0, many of them -0.0 / +0.0
    sl = torch.tensor(lens, dtype=torch.int32)
    qq, ww = (q[:, 0], w[:, 0]) if next_n == 1 else (q, w)
    got = torch.ops.dsa.indexer_topk(qq, ww, kc, bt, sl, topk, 0.5)
    got = got.view(B, next_n, topk)
    K = kc.reshape(-1, Di).double()
    for b, L in enumerate(lens):
        for j in range(next_n):
            n = max(L - next_n + 1 + j, 0) if L else 0
            slots = [int(bt[b, t // PS]) * PS + t % PS for t in range(n)]
            scores = [float(sum(float(w[b, j, h]) * max(0.5 * float(q[b, j, h].double() @ K[sl_]), 0.0)
                                for h in range(Hi))) for sl_ in slots]
            order = sorted(range(n), key=lambda t: (-scores[t], t)) if n > topk else list(range(n))
            want = [slots[t] for t in order[:topk]] + [-1] * (topk - min(n, topk))
            assert got[b, j].tolist() == want, (b, j, got[b, j].tolist(), want)


# ------------------------------------------------------------------------------------------------ FP8 cache
def _fp8_batch(lens, PS, dtype, g, scale=1.0, zero=False):
    R, P = 512, 64
    ckv = [torch.zeros(n, R) if zero else torch.randn(n, R, generator=g) * scale for n in lens]
    kpe = [(torch.zeros(n, P) if zero else torch.randn(n, P, generator=g) * scale).to(dtype) for n in lens]
    b = _paged.fill_paged([x.to(dtype) for x in ckv], kpe, PS, generator=g, spare_pages=1, kv_cache_dtype="fp8_e4m3")
    return b


def _dequant64(values, scales):
    """The FP8 cache read in float64, element by element: e4m3 value times its 128-channel group's float32 scale."""
    R = values.shape[-1]
    v = values.to(F64).reshape(-1, R)
    s = scales.to(F64).reshape(-1, R // 128)
    return v * s[:, torch.arange(R) // 128]


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_fp8_zero_cache_gives_zero_output(dtype):
    """FlashInfer test_batch_mla_fp8_kv_zero_kv_gives_zero_output: an all-zero FP8 latent cache (h 128, page 64,
    kv_len 256, q * 0.1) gives exactly zero output; lse = ln 256."""
    g = torch.Generator().manual_seed(0)
    b = _fp8_batch([256, 256], 64, dtype, g, zero=True)
    qn = (torch.randn(2, 128, 512, generator=g) * 0.1).to(dtype)
    qp = (torch.randn(2, 128, 64, generator=g) * 0.1).to(dtype)
    out, lse = decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 576 ** -0.5, b.ckv_scale)
    assert not out.any() and not torch.isnan(out).any()
    torch.testing.assert_close(lse, torch.full((2, 128), math.log(256)), atol=1e-6, rtol=0)


@pytest.mark.parametrize("magnitude", [0.01, 0.1, 1.0])
def test_fp8_scale_sensitivity(magnitude):
    """FlashInfer test_batch_mla_fp8_kv_scale_sensitivity: latent magnitudes 0.01 / 0.1 / 1 (q scaled by 0.1 /
    magnitude), h 64, page 64, kv_len 256: the scales must be applied at every magnitude. Compared with the float64
    reference over the exactly dequantized cache (value * scale), dense and sparse."""
    g = torch.Generator().manual_seed(int(magnitude * 100))
    b = _fp8_batch([256, 100], 64, BF16, g, scale=magnitude)
    qs = 0.1 / magnitude
    qn = (torch.randn(2, 64, 512, generator=g) * qs).to(BF16)
    qp = (torch.randn(2, 64, 64, generator=g) * qs).to(BF16)
    scale = 576 ** -0.5
    out, lse = decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, scale, b.ckv_scale)
    C = _dequant64(b.ckv_cache, b.ckv_scale).view(b.ckv_cache.shape)
    ref = ref_decode(qn, qp, C, b.kpe_cache, b.block_table, causal_limits([256, 100], 1), scale)
    assert_state(out, lse, ref, BF16, f"magnitude={magnitude}")
    idx = torch.stack([b.block_table[0, t // 64] * 64 + t % 64 for t in range(0, 256, 3)]).to(torch.int32)
    idx = torch.stack([idx, torch.where(idx < 0, idx, -1)])  # request 1 lists nothing
    out, lse = sparse_decode(qn, qp, b.ckv_cache, b.kpe_cache, idx, scale, b.ckv_scale)
    assert_state(out, lse, ref_sparse(qn, qp, C, b.kpe_cache, idx, scale), BF16, f"sparse magnitude={magnitude}")


def test_fp8_rope_dominant_no_row_aliasing():
    """FlashInfer test_fp8_kv_kpe_dominant_no_row_aliasing over our FP8 cache: bf16 baseline and FP8 cache agree
    (max diff < 1e-3 in the peer) and out[..., 0] > 50."""
    qn, qp, ckv, kpe, bt, sl = _rope_dominant_case(BF16)
    b = _paged.fill_paged([ckv[0].to(BF16)], [kpe[0]], 64, shuffle=False, kv_cache_dtype="fp8_e4m3")
    out8, lse8 = decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 1.0, b.ckv_scale)
    out, lse = decode(qn, qp, ckv.to(BF16), kpe, bt, sl, 1.0)
    assert float(out[0, 0, 0]) > 50.0
    assert float((out8.float() - out.float()).abs().max()) < 1e-3
    torch.testing.assert_close(lse8, lse, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------ fuzzing
@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(0, 150), min_size=1, max_size=4), S=st.integers(1, 3),
       PS=st.sampled_from([1, 2, 16, 32, 53, 61, 64, 69, 128]), H=st.sampled_from([1, 3, 16]),
       R=st.sampled_from([16, 64]), P=st.sampled_from([0, 8]), dtype=st.sampled_from([FP32, BF16, FP16]),
       pad=st.sampled_from([(FLASHMLA_PAD,), (INT32_MAX, INT32_MIN, -1), (0,)]), shared=st.booleans(),
       causal=st.booleans(), scale=st.sampled_from([576 ** -0.5, 192 ** -0.5, 1.0, 0.0]),
       q_mag=st.sampled_from([0.1, 1.0, 100.0]), seed=st.integers(0, 2**31 - 1))
def test_peer_parameter_space_fuzz(lens, S, PS, H, R, P, dtype, pad, shared, causal, scale, q_mag, seed):
    """The peers' parameter space at small widths: page sizes of every peer, S 1-3 causal (lengths 0 or >= S,
    FlashMLA's max(len, s_q); limits from the lengths) or non-causal (FlashInfer causal=False: a [B, S] table of
    equal limits, any length), every padding FlashMLA / FlashInfer put in unused block-table entries, SGLang's shared pages,
    the peers' scales, q magnitudes 0.1 (FlashInfer FP8), 1, 100 (FlashInfer cutlass)."""
    g = torch.Generator().manual_seed(seed)
    if causal:  # non-causal rows (a limits table) may be shorter than S: FlashInfer's kv_len 1 / 3 with qo_len 17
        lens = [0 if n == 0 else max(n, S) for n in lens]
    ckv, kpe, bt, sl = paged_cache(lens, PS, R, P, dtype, g, pad=pad, shared=shared)
    B = len(lens)
    qn = (torch.randn(B, S, H, R, generator=g) * q_mag).to(dtype)
    qp = (torch.randn(B, S, H, P, generator=g) * q_mag).to(dtype)
    if causal:
        limits = causal_limits(lens, S)
        out, lse = decode(qn, qp, ckv, kpe, bt, sl, scale)
    else:
        limits = [[L] * S for L in lens]
        out, lse = decode(qn, qp, ckv, kpe, bt, torch.tensor(limits, dtype=torch.int32).view(B, S), scale)
    assert_state(out, lse, ref_decode(qn, qp, ckv, kpe, bt, limits, scale), dtype,
                 f"lens={lens} S={S} PS={PS} H={H} R={R} P={P} {dtype} causal={causal}")


@pytest.mark.parametrize("S", [1, 2])
def test_opcheck_on_peer_shaped_inputs(S):
    """The peers' inputs through torch.library.opcheck (schema, fake impl, autograd registration, AOT dispatch:
    what torch.compile relies on): page 61, INT32_MAX / INT32_MIN / -1 padding, shared pages, q as column views of
    a packed [.., 576]-style q; sparse with non-contiguous indices (FlashMLA non_contiguousify)."""
    from torch.library import opcheck

    g = torch.Generator().manual_seed(S)
    lens = [S, 70, 0, 130]
    ckv, kpe, bt, sl = paged_cache(lens, 61, 64, 16, BF16, g, pad=(INT32_MAX, INT32_MIN, -1), shared=True)
    q = torch.randn(4, S, 4, 80, generator=g).to(BF16)
    q = q[:, 0] if S == 1 else q
    opcheck(decode.default, (q[..., :64], q[..., 64:], ckv, kpe, bt, sl, 0.3))
    ckv, kpe, bt, _ = paged_cache(lens, 61, 64, 16, BF16, g)
    idx = _abs_to_slots(_topk_rows(lens, 12, S, g), bt, 61)
    idx = torch.stack([idx, idx], -1)[..., 0]
    idx = idx[:, 0] if S == 1 else idx
    opcheck(sparse_decode.default, (q[..., :64], q[..., 64:], ckv, kpe, idx, 0.3))
