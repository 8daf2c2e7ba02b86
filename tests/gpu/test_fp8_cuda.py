"""The FP8 latent cache on the GPU (mla_compile/fp8.py): `mla::cache_write_fp8` quantizing on write (the Triton kernel,
byte-identical to the CPU op), `mla::decode` / `mla::sparse_decode` over an FP8 cache (bf16 q: the swap-AB Gluon
kernel, decode_fp8_swapab.py, TMA tiles on pages of whole 64-token tiles, its GATHER form on token tables and page 16;
fp16 q, index lists: decode_fp8.py, the scales folded into the products) against the float64 reference over the
dequantized cache; H 16 and 128, pages 1 and 64, ragged lengths with an empty request, S 1 and 2, one CUDA-graph
capture replayed with new lengths;
HF models over an FP8 cache (`kv_cache_dtype="fp8_e4m3"`) compiled with `mla_dcp` under "reduce-overhead" against
eager HF over the same FP8 cache: V3 (paged), V3.2 (`DSAStaticCache`, dense then sparse graph), generate().

Run: python -m pytest -q tests/gpu/test_fp8_cuda.py
"""

from __future__ import annotations

import pytest
import torch

import reference as ref
from gpu_util import capture, rel, token_table_rows

import mla_compile  # noqa: F401  (registers torch.ops.mla: this file may run alone)
from mla_compile import fp8, paged

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
R, P = 512, 64
SCALE = 192 ** -0.5
TOL = 2e-2  # out: relative norm error vs float64 (the dequantized tile is rounded to bf16 for the MMA)
LSE_TOL = 2e-2  # lse: absolute
LENS = [0, 1, 63, 64, 65, 1000, 4097, 3]  # on and off page / tile edges, an empty request


def build(lens, H, PS, seed, S=None, dtype=torch.bfloat16):
    """(FP8 batch on the GPU, q_nope, q_pe in `dtype`); unused slots hold NaN (every byte 0xFF)."""
    g = torch.Generator().manual_seed(seed)
    ckv = [torch.randn(n, R, generator=g).to(dtype).to(DEV) for n in lens]
    kpe = [torch.randn(n, P, generator=g).to(dtype).to(DEV) for n in lens]
    batch = paged.fill_paged(ckv, kpe, PS, generator=g, spare_pages=2, kv_cache_dtype="fp8_e4m3")
    lead = (len(lens), H) if S is None else (len(lens), S, H)
    qn = torch.randn(*lead, R, generator=g).to(dtype).to(DEV)
    qp = torch.randn(*lead, P, generator=g).to(dtype).to(DEV)
    return batch, qn, qp


def reference(batch, qn, qp):
    deq = ref.ref_dequantize_fp8(batch.ckv_cache.cpu(), batch.ckv_scale.cpu())
    args = (qn.cpu(), qp.cpu(), deq, batch.kpe_cache.cpu(), batch.block_table.cpu(), batch.seq_lens.cpu(), SCALE)
    return ref.ref_decode(*args) if qn.dim() == 3 else ref.ref_decode_multi(*args)


def check(out, lse, want, shape, dtype=torch.bfloat16, lse_tol=LSE_TOL):
    ref_out, ref_lse = want
    assert out.shape == shape and out.dtype == dtype and lse.dtype == torch.float32
    out, lse = out.cpu(), lse.cpu()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "empty rows differ"
    assert (out[empty] == 0).all(), "empty rows must be exactly 0"
    assert rel(out[~empty], ref_out[~empty]) < TOL
    assert float((lse[~empty].double() - ref_lse[~empty]).abs().max()) < lse_tol


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_cache_write_kernel_matches_cpu_op_bytes(scale_fmt):
    g = torch.Generator().manual_seed(0)
    x, kp = torch.randn(9, R, generator=g).to(torch.bfloat16), torch.randn(9, P, generator=g).to(torch.bfloat16)
    slots = torch.tensor([5, -1, 0, 130, 64, 7, -1, 255, 1])
    bufs = []
    for dev in ("cpu", DEV):
        buf, c, s, k = fp8.allocate(4, 64, device=dev)
        buf.fill_(0x5A)
        torch.ops.mla.cache_write_fp8(c, k, s, x.to(dev), kp.to(dev), slots.to(dev), scale_fmt)
        bufs.append(buf.cpu())
        whole = torch.full_like(buf, 0x5A)  # the buffer-level write the HF caches use
        torch.ops.mla.cache_write_fp8_tokens(whole, x.to(dev), kp.to(dev), slots.to(dev), scale_fmt)
        bufs.append(whole.cpu())
    for other in bufs[1:]:
        diff = (bufs[0] != other).nonzero().tolist()
        where = [(page, tok, byte, int(bufs[0][page, tok, byte]), int(other[page, tok, byte]))
                 for page, tok, byte in diff[:12]]
        assert not diff, f"{len(diff)} bytes differ (page, token, byte, cpu, other): {where}"


@pytest.mark.parametrize("PS", [1, 64])
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("S", [1, 2])
def test_decode_matches_reference(S, H, PS, fp8_kernels):
    lens = [n if n == 0 else max(n, S) for n in LENS]
    batch, qn, qp = build(lens, H, PS, seed=S * 10 + H + PS, S=None if S == 1 else S)
    out, lse = torch.ops.mla.decode(qn, qp, batch.ckv_cache, batch.kpe_cache, batch.block_table, batch.seq_lens,
                                    SCALE, batch.ckv_scale)
    check(out, lse, reference(batch, qn, qp), qn.shape)


@pytest.mark.parametrize("PS", [1, 64])
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scores_are_not_rounded(dtype, H, PS, fp8_kernels):
    """bf16 / fp16 q (decode_fp8.py): scores are q . stored e4m3 values times the scale in fp32, so lse matches
    float64 to fp32-accumulation precision (rounding value x scale to bf16 first, as the dequantizing kernel did,
    moves it by ~2e-2)."""
    batch, qn, qp = build(LENS, H, PS, seed=5 + H + PS, dtype=dtype)
    out, lse = torch.ops.mla.decode(qn, qp, batch.ckv_cache, batch.kpe_cache, batch.block_table, batch.seq_lens,
                                    SCALE, batch.ckv_scale)
    check(out, lse, reference(batch, qn, qp), qn.shape, dtype, lse_tol=1e-3)


def test_q_beyond_fp16_range(fp8_kernels):
    """bf16 q whose values exceed fp16's range (2^16 times the usual): the kernel's fp16 MMAs take q times a
    power of two per row, so nothing overflows and the result is the float64 one (lse relative to its size)."""
    batch, qn, qp = build(LENS, 16, 64, seed=9)
    qn[1:3] *= 2.0 ** 16
    qp[1:3] *= 2.0 ** 16
    out, lse = torch.ops.mla.decode(qn, qp, batch.ckv_cache, batch.kpe_cache, batch.block_table, batch.seq_lens,
                                    SCALE, batch.ckv_scale)
    ref_out, ref_lse = reference(batch, qn, qp)
    assert torch.isfinite(out).all()
    empty = torch.isneginf(ref_lse)
    assert rel(out.cpu()[~empty], ref_out[~empty]) < TOL
    lse_err = (lse.cpu().double()[~empty] - ref_lse[~empty]).abs() / ref_lse[~empty].abs().clamp(min=1)
    assert float(lse_err.max()) < 1e-5


@pytest.mark.parametrize("H", [16, 128])
def test_sparse_decode_matches_reference(H):
    batch, qn, qp = build([700, 0, 90], H, 64, seed=H)
    g = torch.Generator().manual_seed(H)
    rows = []
    for b, n in enumerate([700, 0, 90]):
        t = torch.randperm(max(n, 1), generator=g)[:64] if n else torch.empty(0, dtype=torch.long)
        slots = batch.block_table[b].cpu().long()[t // 64] * 64 + t % 64
        rows.append(torch.cat([slots, torch.full((64 - len(slots),), -1)]))
    idx = torch.stack(rows).int().to(DEV)
    out, lse = torch.ops.mla.sparse_decode(qn, qp, batch.ckv_cache, batch.kpe_cache, idx, SCALE, batch.ckv_scale)
    deq = ref.ref_dequantize_fp8(batch.ckv_cache.cpu(), batch.ckv_scale.cpu())
    want = ref.ref_sparse_decode(qn.cpu(), qp.cpu(), deq, batch.kpe_cache.cpu(), idx.cpu(), SCALE)
    check(out, lse, want, qn.shape)


@pytest.mark.parametrize("H", [16, 128])
def test_cuda_graph_replay_with_new_lengths(H, fp8_kernels):
    """One captured FP8 decode step (write the new token, then attend), replayed as the lengths grow."""
    lens = [0, 5, 500, 1500]
    batch, qn, qp = build([n + 4 for n in lens], H, 64, seed=H + 1)
    sl = batch.seq_lens
    sl.copy_(torch.tensor(lens, dtype=torch.int32))
    new_c = torch.randn(len(lens), R, device=DEV).to(torch.bfloat16)
    new_k = torch.randn(len(lens), P, device=DEV).to(torch.bfloat16)

    def step():
        slots = (batch.block_table.long().gather(1, (sl.long() // 64)[:, None])[:, 0] * 64 + sl.long() % 64)
        torch.ops.mla.cache_write_fp8(batch.ckv_cache, batch.kpe_cache, batch.ckv_scale, new_c, new_k, slots)
        return torch.ops.mla.decode(qn, qp, batch.ckv_cache, batch.kpe_cache, batch.block_table, sl + 1, SCALE,
                                    batch.ckv_scale)

    graph, (out, lse) = capture(step)
    for grow in range(2):
        sl.copy_(torch.tensor([n + grow for n in lens], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = reference(paged.PagedBatch(batch.ckv_cache, batch.kpe_cache, batch.block_table, sl + 1,
                                          batch.ckv_scale), qn, qp)
        check(out, lse, want, qn.shape)


def _switch_swapab(monkeypatch, on: bool):
    """decode_fp8_swapab.ENABLED (on by default, MLA_COMPILE_FP8_SWAPAB=0 turns it off) set for one test; plans made
    under the other setting dropped before and after."""
    from mla_compile.kernels import decode_fp8_swapab

    monkeypatch.setattr(decode_fp8_swapab, "ENABLED", on)
    _drop_plans()


def _drop_plans():
    """Plans made under one setting of the kernel switch (also after a test: monkeypatch then restores the default)."""
    from mla_compile.ops import attention

    attention._DECODE_PLANS.clear()


@pytest.fixture
def swapab_on(monkeypatch):
    _switch_swapab(monkeypatch, True)
    yield
    _drop_plans()


@pytest.fixture(params=[False, True], ids=["swapab_off", "swapab_on"])
def fp8_kernels(request, monkeypatch):
    """Each paged FP8 test both ways: with the swap-AB kernel switched off (the Triton FP8 kernels) and on, as by
    default (bf16 q, pages of whole 64-token tiles then take it; other calls the Triton FP8 kernels either way)."""
    _switch_swapab(monkeypatch, request.param)
    yield request.param
    _drop_plans()


@pytest.mark.parametrize("PS,dtype,want", [(64, torch.bfloat16, "fp8_swapab"), (1, torch.bfloat16, "fp8_swapab"),
                                           (1, torch.float16, "pointer")])
def test_fp8_takes_an_fp8_kernel(PS, dtype, want, monkeypatch, swapab_on):
    """FlashMLA, FlashInfer and the bf16 Gluon kernels take fp16/bf16 caches only: an FP8 call reaches the swap-AB
    Gluon kernel (bf16 q: TMA tiles on pages of whole 64-token tiles, its GATHER form on a page-size-1 token table,
    what the HF pass hands over) or the Triton pointer kernel (fp16 q), each made with the call's scales."""
    from mla_compile.kernels import decode as D
    from mla_compile.kernels import dispatch

    batch, qn, qp = build([100, 3], 128, PS, seed=3, dtype=dtype)
    seen = []
    original = D._fp8_swapab.stage1_plan if want == "fp8_swapab" else D._pointer_stage1

    def spy(*args, **kwargs):
        seen.append(args[4] if want == "fp8_swapab" else args[-1] if len(args) > 15 else kwargs.get("ckv_scale"))
        return original(*args, **kwargs)

    monkeypatch.setattr(D._fp8_swapab if want == "fp8_swapab" else D,
                        "stage1_plan" if want == "fp8_swapab" else "_pointer_stage1", spy)
    out, lse = dispatch.decode(qn, qp, batch.ckv_cache, batch.kpe_cache, batch.block_table, batch.seq_lens, SCALE,
                               ckv_scale=batch.ckv_scale)
    assert len(seen) == 1 and seen[0] is batch.ckv_scale
    check(out, lse, reference(batch, qn, qp), qn.shape, dtype)


@pytest.mark.parametrize("H,lens", [(24, [300, 2049, 0]), (80, [700, 65]), (16, [129] * 140), (32, [3000, 1, 70])])
def test_fp8_swapab_head_blocks_and_split_counts(H, lens, swapab_on):
    """The swap-AB kernel's head blocks (16 / 32 / 64 heads: partial blocks at H 24 and 80) and split counts (140
    requests: one split, the final bf16 out written by stage 1 itself, no merge)."""
    from mla_compile.kernels import dispatch

    batch, qn, qp = build(lens, H, 64, seed=H + len(lens))
    assert dispatch.decode_kernel(qn, qp, batch.ckv_cache, batch.kpe_cache, block_table=batch.block_table,
                                  ckv_scale=batch.ckv_scale).name == "fp8_swapab"
    out, lse = torch.ops.mla.decode(qn, qp, batch.ckv_cache, batch.kpe_cache, batch.block_table, batch.seq_lens,
                                    SCALE, batch.ckv_scale)
    check(out, lse, reference(batch, qn, qp), qn.shape, lse_tol=1e-3)


def _token_table(batch, poison: bool = True):
    """`batch` as the HF pass hands a cache to mla.decode: page-size-1 views [NP * PS, 1, *] of the same buffer and
    a token table [B, MP * PS] of each request's slots. poison: the entries past each request's length (and, at
    PS > 1 in `batch` itself, the pages past it) point at a slot of a spare page (NaN bytes), so a kernel that reads
    through them shows NaN."""
    PS = batch.page_size
    used = set(batch.block_table.cpu().flatten().tolist())
    spare = next(p for p in range(batch.ckv_cache.shape[0]) if p not in used)  # build's spare pages: every byte 0xFF
    views = [t.reshape(-1, 1, t.shape[-1]) for t in (batch.ckv_cache, batch.ckv_scale, batch.kpe_cache)]
    table = batch.block_table.cpu().long()
    tokens = (table[:, :, None] * PS + torch.arange(PS)).reshape(table.shape[0], -1)
    if poison:
        for b, n in enumerate(batch.seq_lens.cpu().tolist()):
            tokens[b, n:] = spare * PS + (b % PS)
            table[b, -(-n // PS):] = spare
    return (paged.PagedBatch(views[0], views[2], tokens.int().to(DEV), batch.seq_lens, views[1]),
            paged.PagedBatch(batch.ckv_cache, batch.kpe_cache, table.int().to(DEV), batch.seq_lens, batch.ckv_scale))


@pytest.mark.parametrize("layout", ["page1", "page16", "tokens_of_page64"])
@pytest.mark.parametrize("H,lens", [(16, LENS), (32, [3000, 1, 70]), (24, [300, 2049, 0]), (16, [129] * 140)])
def test_fp8_swapab_gather_form(H, lens, layout, monkeypatch, swapab_on):
    """The swap-AB kernel's GATHER form (cp.async row copies through the table): pages of 1 and 16 tokens, and a
    page-64 cache seen as the HF pass's page-size-1 token table; table entries past each request's length point at
    NaN slots (never read). Dispatch takes "fp8_swapab", its plan the GATHER form (no TMA templates), and the result
    matches float64 as the TMA form's does (lse within 1e-3); H 24: a partial head block; 140 requests: one split.
    (The TOKENS form switched off (MLA_COMPILE_SWAPAB_TOKENS=0): the page-size-1 layouts would take it with
    MLA_COMPILE_SWAPAB_TOKENS=1, `test_fp8_swapab_tokens_form`.)"""
    from mla_compile.kernels import decode as D
    from mla_compile.kernels import dispatch

    monkeypatch.setenv("MLA_COMPILE_SWAPAB_TOKENS", "0")

    PS = {"page1": 1, "page16": 16, "tokens_of_page64": 64}[layout]
    batch, qn, qp = build(lens, H, PS, seed=H + PS + len(lens))
    tokens, paged_poisoned = _token_table(batch)
    batch = tokens if layout == "tokens_of_page64" else paged_poisoned
    F = D._fp8_swapab
    assert not F.eligible(batch.ckv_cache, batch.kpe_cache, batch.ckv_scale)
    assert F.gather_eligible(batch.ckv_cache, batch.kpe_cache, batch.ckv_scale)
    assert dispatch.decode_kernel(qn, qp, batch.ckv_cache, batch.kpe_cache, block_table=batch.block_table,
                                  ckv_scale=batch.ckv_scale).name == "fp8_swapab"
    plans, original = [], F.stage1_plan

    def spy(*args, **kwargs):
        plans.append(original(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(F, "stage1_plan", spy)
    out, lse = torch.ops.mla.decode(qn, qp, batch.ckv_cache, batch.kpe_cache, batch.block_table, batch.seq_lens,
                                    SCALE, batch.ckv_scale)
    assert len(plans) == 1 and plans[0][1] is None, "not the GATHER form"
    check(out, lse, reference(batch, qn, qp), qn.shape, lse_tol=1e-3)


def _fp8_token_table(lens, H, kind, seed, spare=64):
    """(batch, q_nope, q_pe): a page-size-1 FP8 buffer [N, 1, 656] (fp8.allocate's views, written by
    mla.cache_write_fp8) under a token table (`gpu_util.token_table_rows`: "runs" every tile the TOKENS form's TMA
    boxes, "holes", "shuffled" every tile row copies). Every row no token uses holds NaN bytes (0xFF)."""
    g = torch.Generator().manual_seed(seed)
    table, rows_of, N = token_table_rows(lens, kind, g, spare)
    B = len(lens)
    buf, ckv, scale, kpe = fp8.allocate(N, 1, R, P, device=DEV)
    buf.fill_(0xFF)
    for n, rows in zip(lens, rows_of):
        if n:
            torch.ops.mla.cache_write_fp8(ckv, kpe, scale, torch.randn(n, R, generator=g).to(torch.bfloat16).to(DEV),
                                          torch.randn(n, P, generator=g).to(torch.bfloat16).to(DEV), rows.to(DEV))
    qn = torch.randn(B, H, R, generator=g).to(torch.bfloat16).to(DEV)
    qp = torch.randn(B, H, P, generator=g).to(torch.bfloat16).to(DEV)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    return paged.PagedBatch(ckv, kpe, table.to(DEV), lens_t, scale), qn, qp


@pytest.mark.parametrize("H,kind", [(16, "runs"), (16, "holes"), (16, "shuffled"), (40, "runs"), (40, "holes"),
                                    (40, "shuffled"), (32, "holes")])
def test_fp8_swapab_tokens_form(H, kind, monkeypatch, swapab_on):
    """The swap-AB kernel's TOKENS form over a page-size-1 token table (the HF pass's): each tile's 64 entries are
    checked on the device; consecutive rows at any offset are the TMA form's boxes, tiles with a gap or shuffled rows
    GATHER's row copies. Against float64 (lse within 1e-3, as the other forms): lengths on and off tile edges (a
    run's partial last tile reads NaN rows past it), empty requests; asked for (`tokens=True`, the switch off) with
    one split (a whole request in one program); switched on (MLA_COMPILE_SWAPAB_TOKENS=1)
    through decode's plan at forced and policy split counts and the op (auto). H 16 (N 16, one warpgroup), 32 (N 32,
    two), 40 (N 64: P^T in the staging slot, a partial head block). At H 16, a CUDA graph replayed after the cache
    and the table are rewritten in place (runs to shuffled rows and back), then with new lengths."""
    from mla_compile.kernels import decode as K
    from mla_compile.kernels import dispatch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("warpgroup MMA: sm_90 only")
    F = K._fp8_swapab
    lens = [0, 1, 63, 64, 65, 777, 2101, 0, 33, 256, 128, 191]
    batch, qn, qp = _fp8_token_table(lens, H, kind, seed=H + len(kind))
    c, k, s, table, sl = batch.ckv_cache, batch.kpe_cache, batch.ckv_scale, batch.block_table, batch.seq_lens
    assert F.token_rows(c, k, s)
    assert dispatch.decode_kernel(qn, qp, c, k, block_table=table, ckv_scale=s).name == "fp8_swapab"
    want = reference(batch, qn, qp)
    monkeypatch.setenv("MLA_COMPILE_SWAPAB_TOKENS", "0")
    out, lse = torch.empty_like(qn), torch.empty(len(lens), H, dtype=torch.float32, device=DEV)
    plan = F.stage1_plan(qn, qp, c, k, s, table, SCALE, out, lse, 0, 0, 1, tokens=True)
    assert plan[3], "not the TOKENS form"
    F.run_stage1(plan, qn, qp, c, k, s, table, sl, out, lse)
    check(out, lse, want, qn.shape, lse_tol=1e-3)

    monkeypatch.setenv("MLA_COMPILE_SWAPAB_TOKENS", "1")
    plans, original = [], F.stage1_plan

    def spy(*args, **kwargs):
        plans.append(original(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(F, "stage1_plan", spy)
    cfg = dispatch._config(qn, c, False, "fp8_swapab")
    for splits in (2, 3, 40, None):
        out, lse = K.decode(qn, qp, c, k, table, sl, SCALE, cfg=cfg, splits=splits, ckv_scale=s)
        check(out, lse, want, qn.shape, lse_tol=1e-3)
    out, lse = torch.ops.mla.decode(qn, qp, c, k, table, sl, SCALE, s)
    check(out, lse, want, qn.shape, lse_tol=1e-3)
    assert len(plans) >= 5 and all(p[3] for p in plans), "not the TOKENS form"
    if H != 16:
        return
    tbl, lens_t = table.clone(), sl.clone()
    graph, (out, lse) = capture(lambda: K.decode(qn, qp, c, k, tbl, lens_t, SCALE, cfg=cfg, ckv_scale=s))
    for other in ("shuffled", "runs", kind):
        o = _fp8_token_table(lens, H, other, seed=H + len(other) + 1)[0]  # other values, other rows
        for dst, src in ((c.view(torch.uint8), o.ckv_cache.view(torch.uint8)), (s, o.ckv_scale), (k, o.kpe_cache),
                         (tbl, o.block_table)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        check(out, lse, reference(paged.PagedBatch(c, k, tbl, lens_t, s), qn, qp), qn.shape, lse_tol=1e-3)
    lens_t.copy_(torch.tensor([0, 1, 60, 64, 1, 700, 2000, 0, 0, 255, 127, 191], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    check(out, lse, reference(paged.PagedBatch(c, k, tbl, lens_t, s), qn, qp), qn.shape, lse_tol=1e-3)


# ------------------------------------------------------------------------------------ HF models, FP8 cache
def _hf_compiled_vs_eager(model, cache_fn, T=7, steps=10, **options):
    """(compiled logits, eager logits, eager logits over HF's unquantized StaticCache, counters): the same tokens
    teacher-forced through eager HF over an FP8 cache and through the model compiled with mla_dcp under
    reduce-overhead over another FP8 cache (both prefilled eagerly)."""
    import hf_models as M
    from transformers import StaticCache

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = model.cuda()
    L = T + steps + 1
    ids, mask = M.batch(B=4, T=T, L=L, pad=3)
    ids, mask = ids.cuda(), mask.cuda()
    toks = torch.randint(1, 128, (4, steps), generator=torch.Generator().manual_seed(7)).cuda()
    eager = M.forced(model, model, ids, mask, cache_fn(model.config, L), toks)
    compiled = torch.compile(model, backend="mla_dcp", options={"mode": "reduce-overhead", **options}, fullgraph=True)
    got = M.forced(compiled, model, ids, mask, cache_fn(model.config, L), toks)
    plain = M.forced(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), toks)
    return got, eager, plain, dict(torch._dynamo.utils.counters["mla_compile"])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_hf_v3_over_fp8_paged_cache_reduce_overhead(dtype, tol):
    import hf_models as M
    from mla_compile.integrations.hf import MLAPagedCache

    model = M.deepseek_v3(num_layers=2, heads=16, hidden=256, dtype=dtype)
    got, eager, plain, c = _hf_compiled_vs_eager(
        model, lambda cfg, L: MLAPagedCache(cfg, L, page_size=64, kv_cache_dtype="fp8_e4m3"))
    assert M.rel_err(got, eager) < tol
    assert (got.argmax(-1) == eager.argmax(-1)).float().mean() >= (1.0 if dtype == torch.float32 else 0.9)
    assert M.rel_err(eager, plain) > 5e-3  # the FP8 cache is what both read (e4m3: ~3% noise a value)
    assert c.get("mla_attention_rewritten") == 2 and not c.get("mla_attention_not_rewritten"), c


def test_hf_v3_128_heads_over_a_promised_ue8m0_cache_runs_flashmla_fp8(monkeypatch):
    """A ue8m0 FP8 cache (`fp8_scale_fmt="ue8m0"`) promised to the compiled model (options fp8_scale_fmt): at 128
    heads the HF step's mla.decode runs FlashMLA's FP8 kernel (the pass's token views read in place), and the
    logits follow eager HF over the same cache as closely as our own FP8 kernel's do (bf16 model)."""
    import hf_models as M
    from mla_compile.integrations.hf import MLAPagedCache
    from mla_compile.kernels import flashmla as FM
    from mla_compile.kernels import flashmla_fp8 as FM8

    if not FM.available():
        pytest.skip("needs flash_mla on an SM90 GPU")
    runs = []
    real = FM8._run
    monkeypatch.setattr(FM8, "_run", lambda *a, **k: runs.append(1) or real(*a, **k))
    model = M.deepseek_v3(num_layers=2, heads=128, hidden=256, dtype=torch.bfloat16)
    cache = lambda cfg, L: MLAPagedCache(cfg, L, page_size=64, kv_cache_dtype="fp8_e4m3",  # noqa: E731
                                         fp8_scale_fmt="ue8m0")
    got, eager, _, c = _hf_compiled_vs_eager(model, cache, fp8_scale_fmt="ue8m0")
    assert runs, "FlashMLA's FP8 kernel was not run"
    assert M.rel_err(got, eager) < 2e-2 and (got.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.9
    assert c.get("mla_attention_rewritten") == 2, c


def test_hf_generate_at_128_heads_over_a_ue8m0_cache_runs_flashmla_fp8(monkeypatch):
    """The generate() road with one setting: optimize_generate (no option) over a passed cache written with
    power-of-two scales (`fp8_scale_fmt="ue8m0"`): the call promises them itself, so at 128 heads the decode steps
    run FlashMLA's FP8 kernel (recorded under CUDA graphs, then replayed), and the first compiled step's logits
    follow eager generate()'s over the same cache (bf16 model: within 2e-2; the prefill is eager in both, so the
    first new token is the same)."""
    import hf_models as M
    from mla_compile.integrations.hf import MLAPagedCache, cache_kwargs, optimize_generate
    from mla_compile.kernels import flashmla as FM
    from mla_compile.kernels import flashmla_fp8 as FM8

    if not FM.available():
        pytest.skip("needs flash_mla on an SM90 GPU")
    runs = []
    real = FM8._run
    monkeypatch.setattr(FM8, "_run", lambda *a, **k: runs.append(1) or real(*a, **k))
    torch._dynamo.reset()
    model = M.deepseek_v3(num_layers=2, heads=128, hidden=256, dtype=torch.bfloat16).cuda()
    ids, mask = M.batch(B=4, T=9, L=9, pad=3)
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)

    def cache():
        return cache_kwargs(model, MLAPagedCache(model.config, 32, page_size=64, kv_cache_dtype="fp8_e4m3",
                                                 fp8_scale_fmt="ue8m0"))

    with torch.no_grad():
        ref = model.generate(ids, cache_implementation=None, disable_compile=True, **cache(), **kw)
        assert not runs  # eager HF dequantizes (mla_hf::gather_latent): no decode kernel
        optimize_generate(model)
        out = model.generate(ids, **cache(), **kw)
    assert runs, "FlashMLA's FP8 kernel was not run"
    assert torch.equal(out.sequences[:, ids.shape[1]], ref.sequences[:, ids.shape[1]])
    assert M.rel_err(out.logits[1].float(), ref.logits[1].float()) < 2e-2
    torch._dynamo.reset()


def test_hf_v32_over_fp8_dsa_static_cache_reduce_overhead_both_graphs():
    """kv length 8 .. 17 crosses index_topk 12: the dense graph, then the sparse one (mla.sparse_decode over FP8)."""
    import hf_models as M
    from mla_compile.integrations.hf import DSAStaticCache

    model = M.deepseek_v32(num_layers=2, heads=16, hidden=256, index_topk=12)
    got, eager, plain, c = _hf_compiled_vs_eager(
        model, lambda cfg, L: DSAStaticCache(cfg, L, kv_cache_dtype="fp8_e4m3"))
    assert M.rel_err(got, eager) < 1e-4 and M.rel_err(eager, plain) > 3e-4
    assert c.get("dsa_index_mask_dropped", 0) >= 1 and c.get("dsa_sparse_rewritten", 0) >= 1, c


def test_hf_generate_over_fp8_cache_cuda():
    """optimize_generate (HF's auto-compile, reduce-overhead, deferred stop check) over a passed FP8 cache: the
    tokens of eager generate() over an FP8 cache (fp32 model)."""
    import hf_models as M
    from mla_compile.integrations.hf import MLAPagedCache, cache_kwargs, optimize_generate

    torch._dynamo.reset()
    model = M.deepseek_v3(num_layers=2, heads=16, hidden=256).cuda()
    ids, mask = M.batch(B=4, T=9, L=9, pad=3)
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)

    def cache():
        return cache_kwargs(model, MLAPagedCache(model.config, 32, page_size=16, kv_cache_dtype="fp8_e4m3"))

    with torch.no_grad():
        ref = model.generate(ids, cache_implementation=None, disable_compile=True, **cache(), **kw)
        optimize_generate(model)
        out = model.generate(ids, **cache(), **kw)
        again = model.generate(ids, **cache(), **kw)  # CUDA-graph replays over a fresh cache
    assert torch.equal(out, ref) and torch.equal(again, ref)
