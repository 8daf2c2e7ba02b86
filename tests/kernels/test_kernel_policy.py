"""Which decode kernel runs (pure host logic, no GPU): `dispatch.select_decode_kernel`'s table checked with fake
device capabilities, the override (tuning, env var), that the choice is what runs, the Triton kernels' TMA
eligibility and default configs."""

from __future__ import annotations

import dataclasses
import re
import unittest.mock as mock
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("triton")
from mla_compile import tuning  # noqa: E402
from mla_compile.kernels import _gluon as G  # noqa: E402
from mla_compile.kernels import decode as D  # noqa: E402
from mla_compile.kernels import decode_seesaw as S  # noqa: E402
from mla_compile.kernels import decode_swapab as SW  # noqa: E402
from mla_compile.kernels import decode_wgmma as W  # noqa: E402
from mla_compile.kernels import dispatch as D_  # noqa: E402
from mla_compile.kernels._util import slot_stride  # noqa: E402


def caches(NP=4, PS=64, R=512, P=64, dtype=torch.bfloat16):
    return torch.zeros(NP, PS, R, dtype=dtype), torch.zeros(NP, PS, P, dtype=dtype)


def test_many_heads_default_to_tma_on_page_multiples():
    cfg = D.default_config(128, 512, 64)
    assert cfg.tma
    assert D.tma_eligible(*caches(PS=64), False, cfg)
    assert D.tma_eligible(*caches(PS=128), False, cfg)
    # a page smaller than the tile, or not a multiple of it: the pointer kernel
    assert not D.tma_eligible(*caches(PS=1), False, cfg)
    assert not D.tma_eligible(*caches(PS=cfg.block_n + 16), False, cfg)


@pytest.mark.parametrize("PS", [1, 16, 64, 128])
def test_few_heads_default_to_the_pointer_kernel(PS):
    # sweep round 7: at H=16 the pointer kernel beats the TMA kernel on every shape
    cfg = D.default_config(16, 512, PS)
    assert not D.tma_eligible(*caches(PS=PS), False, cfg)
    # a tile inside one page needs 2 stages; tiles that span pages (per-token table loads) get a third
    assert cfg.num_stages == (2 if PS % cfg.block_n == 0 else 3)


@pytest.mark.parametrize("R,P,ok", [(512, 64, True), (64, 16, True), (1024, 64, False), (96, 64, False),
                                    (512, 24, False), (512, 512, False)])
def test_tma_needs_power_of_two_halves_within_a_box(R, P, ok):
    cfg = D.DecodeConfig(block_n=16, tma=True)
    assert D.tma_eligible(*caches(PS=16, R=R, P=P), False, cfg) == ok


def test_tma_not_for_sparse_strided_or_when_off():
    cfg = D.DecodeConfig(block_n=16, tma=True)
    ckv, kpe = caches(PS=16)
    assert not D.tma_eligible(ckv, kpe, True, cfg)  # sparse_decode: index lists, no tiles
    assert not D.tma_eligible(ckv, kpe, False, D.DecodeConfig(block_n=16))
    odd = torch.zeros(4, 16, 516, dtype=torch.bfloat16)
    assert not D.tma_eligible(odd[..., :512], kpe, False, cfg)  # rows 1032 bytes apart: no TMA stride
    wide = torch.zeros(4, 16, 576, dtype=torch.bfloat16)  # one buffer's column ranges: rows 1152 bytes apart
    assert D.tma_eligible(wide[..., :512], wide[..., 512:], False, cfg)


def test_tma_needs_hopper(monkeypatch):
    cfg = D.DecodeConfig(block_n=16, tma=True)
    monkeypatch.setattr(D, "has_tma", lambda device: False)  # e.g. an A100: the pointer kernel runs
    assert not D.tma_eligible(*caches(PS=16), False, cfg)


@pytest.mark.parametrize("H,B,L,want", [(16, 1, 131072, 256), (16, 8, 32768, 33), (16, 32, 32768, 8),
                                        (16, 128, 8192, 2), (16, 512, 8192, 1), (16, 32, 256, 4),
                                        (128, 1, 131072, 64), (128, 1, 8192, 64), (128, 1, 1024, 16),
                                        (128, 8, 32768, 8), (128, 128, 32768, 1)])
def test_splits_fill_one_wave_of_an_h200(monkeypatch, H, B, L, want):
    # 132 SMs; an H200 probe (benchmarks/RESULTS.md) found one wave of programs faster than ~two at every shape
    monkeypatch.setattr(D, "sm_count", lambda device: 132)
    cfg = D.default_config(H, 512, 64)
    ns = D.num_splits(B, H, L, torch.device("cpu"), cfg)
    assert ns == want
    programs = B * -(-H // cfg.block_h)
    assert programs * ns <= max(cfg.ctas_per_sm * 132, programs)  # never a second wave of splits
    assert ns == 1 or -(-L // ns) >= cfg.min_split_tokens


def test_gluon_kernels_choose_tma_boxes_only_for_whole_tile_pages():
    # the Gluon kernels' TMA layout: pages of whole 64-token tiles in a [slots, width] view; everything else
    # (page 1 / 16 tables, sparse index lists, strided caches) is the gather kernel's
    for PS in (64, 128):
        assert G.tma_layout(*caches(PS=PS), sparse=False)
        assert not G.tma_layout(*caches(PS=PS), sparse=True)
    for PS in (1, 16, 32, 96):
        assert not G.tma_layout(*caches(PS=PS), sparse=False)
    # rows at a stride (pages back to back) are TMA rows too: the two column ranges of one [NP, PS, R + P] buffer
    # (FlashMLA's K layout; vLLM's and SGLang's MLA caches), rows 1152 bytes apart
    fused = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    assert G.tma_layout(fused[..., :512], fused[..., 512:], sparse=False)
    assert slot_stride(fused[..., :512]) == 576 and slot_stride(fused[:, :1, :512]) == 64 * 576
    odd = torch.zeros(4, 64, 516, dtype=torch.bfloat16)  # rows 1032 bytes apart: no TMA stride
    assert not G.tma_layout(odd[..., :512], torch.zeros(4, 64, 64, dtype=torch.bfloat16), sparse=False)
    gaps = torch.zeros(4, 128, 512, dtype=torch.bfloat16)[:, :64]  # pages with a gap between them
    assert not G.tma_layout(gaps, torch.zeros(4, 64, 64, dtype=torch.bfloat16), sparse=False)
    # page 1 under a token table (the HF pass): swapab's TOKENS form takes consecutive rows as TMA boxes, so the
    # caches must view as [slots, width] too; not for index lists, other page sizes or strided rows
    assert G.token_rows(*caches(PS=1), sparse=False) and not G.token_rows(*caches(PS=1), sparse=True)
    assert not any(G.token_rows(*caches(PS=PS), sparse=False) for PS in (16, 64))
    wide = torch.zeros(256, 1, 576, dtype=torch.bfloat16)  # one buffer's column ranges (SGLang's page-1 MLA cache)
    assert G.token_rows(wide[..., :512], wide[..., 512:], sparse=False)
    assert not G.token_rows(torch.zeros(256, 1, 516, dtype=torch.bfloat16)[..., :512], wide[..., 512:], sparse=False)
    # q + two tiles + p fit Hopper's 227 KB at R 512 / P 64; a wider latent would not
    assert W.smem_bytes(512, 64) <= G.SMEM_LIMIT < W.smem_bytes(1024, 64)
    # q + two slots (p in their rope buffers) fit 227 KB at R 512 / P 64; the seesaw kernel needs rope 64
    assert S.smem_bytes(512, 64) <= G.SMEM_LIMIT
    assert not S.fits(512, 32) and not S.fits(1024, 64)


# ================================================================================ select_decode_kernel's table
BF16, H200, A100, H100_LIKE = torch.bfloat16, (9, 0), (8, 0), (9, 0)
GLUON = G.gluon is not None
SEESAW = GLUON and S.HAS_WARP_SPECIALIZE
FEW = "swapab" if GLUON else "triton"  # one query token of few heads on sm_90's TMA layout


def select(H=128, R=512, P=64, PS=64, sparse=False, dtype=BF16, cap=H200, n_query=1, **kw):
    return D_.select_decode_kernel(H, R, P, PS, sparse, dtype, cap, n_query, **kw).name


@pytest.mark.parametrize("case,want", [
    # FlashMLA where it is installed, takes the call, reads the caches in place, and is faster than ours: many
    # heads and >= 256K tokens per call (batch x capacity; H200 2026-12-02)
    (dict(flashmla=True), "flashmla"),
    (dict(flashmla=True, tokens=32 * 8192), "flashmla"),
    (dict(flashmla=True, tokens=8 * 8192), "seesaw" if SEESAW else "wgmma" if GLUON else "triton"),
    (dict(flashmla=True, tokens=128 * 1024), "seesaw" if SEESAW else "wgmma" if GLUON else "triton"),
    (dict(H=16, flashmla=True), FEW),  # few heads: ours (the swap-AB kernel: at or above FlashMLA's speed)
    (dict(P=0, flashmla=True), "flashmla"),
    # several query tokens (H = rows = S x heads): FlashMLA takes one; from 32 rows the Gluon kernels with a limit per
    # row (one head block: decode_wgmma; more on the TMA layout: the seesaw; wgmma's gather form elsewhere), below 32
    # the pointer kernel
    (dict(flashmla=True, n_query=2), "seesaw" if SEESAW else "wgmma" if GLUON else "triton"),  # 128 rows: two head blocks, the seesaw
    (dict(H=32, n_query=2), "wgmma" if GLUON else "triton"),  # H 16 x S 2: one block, decode_wgmma faster
    (dict(H=64, n_query=4), "wgmma" if GLUON else "triton"),  # H 16 x S 4
    (dict(H=256, n_query=2), "seesaw" if SEESAW else "wgmma" if GLUON else "triton"),  # H 128 x S 2
    (dict(H=64, n_query=4, PS=16, tma_layout=False), "wgmma" if GLUON else "triton"),  # its gather form
    (dict(H=16, n_query=2), "triton"),  # H 8 x S 2: 16 rows
    (dict(H=32, n_query=2, sparse=True, PS=1, tma_layout=False), "triton"),
    (dict(H=32, n_query=2, P=0), "triton"),
    (dict(H=32, n_query=2, dtype=torch.float32), "triton"),
    (dict(H=32, n_query=2, cap=A100), "triton"),
    (dict(flashmla=True, cap=(10, 0)), "triton"),  # FlashMLA's dense decode is sm_90's
    # no FlashMLA: H 128, page 64, rope 64 on an H200 -> the warp-specialised Gluon kernel
    (dict(), "seesaw" if SEESAW else "wgmma" if GLUON else "triton"),
    (dict(H=64, PS=128), "seesaw" if SEESAW else "wgmma" if GLUON else "triton"),
    # many heads, other layouts: the two-warpgroup Gluon kernel (its gather form for small pages / sparse lists)
    (dict(PS=16, tma_layout=False), "wgmma" if GLUON else "triton"),
    (dict(PS=1, sparse=True, tma_layout=False), "wgmma" if GLUON else "triton"),
    (dict(P=32), "wgmma" if GLUON else "triton"),  # rope 32: no seesaw p buffer
    (dict(PS=16, tma_layout=False, rows_aligned=False), "triton"),
    # the Triton kernels: few heads, not sm_90, fp32, P = 0, several query tokens, shapes Gluon does not take
    # few heads, one query token, on the TMA layout: the swap-AB Gluon kernel; other layouts the Triton kernels
    (dict(H=16), FEW),
    (dict(H=63), FEW),
    (dict(H=1, PS=128, dtype=torch.float16), FEW),
    (dict(H=16, PS=1, tma_layout=False), "triton"),  # a token table over caches that are no [slots, width] view
    # the HF pass's token table: swapab's TOKENS form serves it, auto's only where `tokens_form` says so
    # (tuning.swapab_tokens: test_the_token_table_form_is_in_auto_only_when_switched_on)
    (dict(H=16, PS=1, tma_layout=False, token_rows=True), "triton"),
    (dict(H=16, PS=1, tma_layout=False, token_rows=True, tokens_form=True), FEW),
    (dict(H=40, PS=1, tma_layout=False, token_rows=True, tokens_form=True), FEW),
    (dict(H=16, PS=1, tma_layout=False, token_rows=False, tokens_form=True), "triton"),
    (dict(H=16, PS=1, tma_layout=False, token_rows=True, n_query=2), "triton"),
    (dict(H=16, PS=1, tma_layout=False, token_rows=True, cap=A100), "triton"),
    (dict(H=16, PS=1, tma_layout=False, token_rows=True, P=0), "triton"),
    (dict(PS=1, tma_layout=False, token_rows=True), "wgmma" if GLUON else "triton"),  # many heads: the gather form
    (dict(H=16, PS=1, sparse=True, tma_layout=False), "triton"),
    (dict(H=16, P=0), "triton"),
    (dict(H=16, R=256), "triton"),
    (dict(cap=A100), "triton"),
    (dict(cap=(10, 0)), "triton"),
    (dict(dtype=torch.float32), "triton"),
    (dict(P=0), "triton"),
    (dict(H=16, n_query=4, cap=(10, 0)), "triton"),
    (dict(R=1024), "triton"),  # q + tiles would not fit shared memory
    (dict(cap="interpreter"), "triton"),  # CPU tensors handed to the kernels: Triton's interpreter
    (dict(cap=None), "torch"),  # CPU tensors at the op: its CPU impl
    (dict(cap=None, flashmla=True), "torch"),
    # FlashInfer is never auto's choice (cudagraph-tree pool check; slower than FlashMLA)
    (dict(flashinfer=True), "seesaw" if SEESAW else "wgmma" if GLUON else "triton"),
    (dict(H=16, flashinfer=True), FEW),
])
def test_auto_is_the_fastest_measured_kernel_per_shape_class(case, want):
    assert select(**case) == want


def test_the_token_table_form_is_in_auto_unless_switched_off(monkeypatch):
    """The TOKENS form's switch: decode_swapab.TOKENS_IN_AUTO (the measured default, on), overridden per plan by
    MLA_COMPILE_SWAPAB_TOKENS (tuning.swapab_tokens, read where dispatch gathers the call's facts); a bad value is a
    ValueError naming the variable."""
    case = dict(H=16, PS=1, tma_layout=False, token_rows=True)
    choice = D_.select_decode_kernel(*_args(**case), **_facts(**case))
    assert choice.name == "triton" and "MLA_COMPILE_SWAPAB_TOKENS" in choice.reason
    assert D_.select_decode_kernel(*_args(**case), kernel="swapab", **_facts(**case)).name == FEW
    choice = D_.select_decode_kernel(*_args(**case), tokens_form=True, **_facts(**case))
    assert choice.name == FEW and (not GLUON or "token table" in choice.reason)
    monkeypatch.delenv(tuning.SWAPAB_TOKENS_ENV, raising=False)
    assert tuning.swapab_tokens(False) is False and tuning.swapab_tokens(True) is True
    for env, want in (("1", True), ("0", False), ("auto", SW.TOKENS_IN_AUTO), ("", SW.TOKENS_IN_AUTO)):
        monkeypatch.setenv(tuning.SWAPAB_TOKENS_ENV, env)
        assert tuning.swapab_tokens(SW.TOKENS_IN_AUTO) is want
    monkeypatch.setenv(tuning.SWAPAB_TOKENS_ENV, "yes")
    with pytest.raises(ValueError, match=tuning.SWAPAB_TOKENS_ENV):
        tuning.swapab_tokens(False)
    assert select(H=16, PS=1, tma_layout=False) == "triton"  # caches that are no [slots, width] view
    # through dispatch's facts: the HF pass's page-size-1 views of one [tokens, 576] buffer on an sm_90
    monkeypatch.setattr(D_, "_capability", lambda device: H200)
    buf = torch.zeros(256, 1, 576, dtype=BF16)
    call = (torch.zeros(2, 16, 512, dtype=BF16), torch.zeros(2, 16, 64, dtype=BF16), buf[..., :512], buf[..., 512:])
    table = torch.zeros(2, 128, dtype=torch.int32)
    for env, want in (("0", "triton"), ("1", FEW), ("auto", FEW if SW.TOKENS_IN_AUTO else "triton")):
        monkeypatch.setenv(tuning.SWAPAB_TOKENS_ENV, env)
        assert D_.decode_kernel(*call, block_table=table).name == want, env


SWAPAB = "fp8_swapab" if GLUON else "triton"


@pytest.mark.parametrize("case,want", [
    # an FP8 cache: the swap-AB Gluon kernel where its layout, shapes and device allow, else the Triton FP8 kernels;
    # never a kernel that reads fp16/bf16 caches (FlashInfer, the bf16 Gluon kernels), nor FlashMLA's FP8 kernel
    # (`flashmla`: it takes the call; bf16 numerics, asked-for only)
    (dict(H=16, fp8_rows=True), SWAPAB),
    (dict(H=128, fp8_rows=True, flashmla=True, flashinfer=True), SWAPAB),
    (dict(H=16), "triton"),  # views that are neither TMA rows in whole-tile pages nor 16-byte aligned rows
    (dict(H=16, fp8_rows=True, dtype=torch.float16), "triton"),
    (dict(H=16, fp8_rows=True, dtype=torch.float32), "triton"),
    (dict(H=16, fp8_rows=True, n_query=2), "triton"),
    (dict(H=16, fp8_rows=True, sparse=True, PS=1), "triton"),
    (dict(H=16, fp8_rows=True, R=256), "triton"),
    (dict(H=16, fp8_rows=True, P=0), "triton"),
    (dict(H=16, fp8_rows=True, cap=A100), "triton"),
    (dict(H=128, flashmla=True), "triton"),
    (dict(H=16, fp8_rows=True, cap=None), "torch"),
])
def test_fp8_cache_takes_the_fp8_kernels(case, want):
    assert select(fp8_cache=True, **case) == want


@pytest.mark.parametrize("asked,case,want", [
    ("triton", dict(fp8_rows=True), "triton"),
    ("fp8_swapab", dict(fp8_rows=True), SWAPAB),
    ("fp8_swapab", dict(), "triton"),
    ("seesaw", dict(fp8_rows=True), SWAPAB),
    ("flashmla", dict(fp8_rows=True), SWAPAB),  # FlashMLA's FP8 kernel does not take the call
    ("flashmla", dict(fp8_rows=True, flashmla=True), "flashmla"),  # it does: FlashMLA's V3.2 FP8 kernel
    ("flashmla", dict(fp8_rows=True, flashmla=True, n_query=2), "triton"),  # one query token a request only
    ("flashmla", dict(flashmla=True, cap=A100), "triton"),
])
def test_fp8_an_asked_for_kernel_runs_where_it_can_else_auto_says_why(asked, case, want):
    choice = D_.select_decode_kernel(*_args(H=16, **{k: case.pop(k) for k in ("n_query", "cap") if k in case}),
                                     kernel=asked, fp8_cache=True, **case)
    assert choice.name == want
    if want == asked:
        assert choice.reason == "asked for" or (asked == "flashmla" and choice.reason.startswith("asked for: "))
    else:
        assert choice.reason.startswith(f"asked for {asked}, which cannot serve this call")


def test_fp8_swapab_asked_for_a_bf16_cache_falls_back_saying_why():
    choice = D_.select_decode_kernel(*_args(H=16), kernel="fp8_swapab")
    assert choice.name == FEW and choice.reason.startswith("asked for fp8_swapab, which cannot serve this call")


def test_decode_kernel_reads_the_fp8_layout_from_the_three_views(monkeypatch):
    """`decode_kernel` on an FP8 cache's tensors (fp8.allocate's views): the views of pages of whole 64-token tiles
    are TMA rows (the swap-AB kernel's TMA form), a page-size-1 token view of the same buffer (what the HF pass hands
    over) and page 16 are 16-byte aligned rows (its GATHER form; the token view's rows are TMA rows too: its TOKENS
    form, `token_rows`, page size 1 only); a buffer 8 bytes off 16-byte alignment is neither (the Triton FP8
    kernels)."""
    from mla_compile import fp8

    from mla_compile.kernels import decode_fp8_swapab

    monkeypatch.setattr(D_, "_capability", lambda device: H200)
    monkeypatch.setattr(decode_fp8_swapab, "ENABLED", True)
    _, ckv, scale, kpe = fp8.allocate(4, 64)
    qn, qp = torch.zeros(2, 16, 512, dtype=BF16), torch.zeros(2, 16, 64, dtype=BF16)
    table = torch.zeros(2, 2, dtype=torch.int32)
    assert decode_fp8_swapab.eligible(ckv, kpe, scale)
    assert D_.decode_kernel(qn, qp, ckv, kpe, block_table=table, ckv_scale=scale).name == SWAPAB
    tokens = [t.reshape(-1, 1, t.shape[-1]) for t in (ckv, scale, kpe)]  # the HF pass's page-size-1 view
    assert not decode_fp8_swapab.eligible(tokens[0], tokens[2], tokens[1])
    assert decode_fp8_swapab.gather_eligible(tokens[0], tokens[2], tokens[1])
    assert decode_fp8_swapab._strides16(tokens[1]) == (41, 0)  # 656-byte tokens: 41 chunks of 16 bytes
    assert decode_fp8_swapab.token_rows(tokens[0], tokens[2], tokens[1])
    assert not decode_fp8_swapab.token_rows(ckv, kpe, scale)  # pages of 64: the TMA form
    assert D_.decode_kernel(qn, qp, tokens[0], tokens[2], block_table=table, ckv_scale=tokens[1]).name == SWAPAB
    _, c16, s16, k16 = fp8.allocate(16, 16)
    assert decode_fp8_swapab._strides16(k16) == (16 * 41, 41)
    assert not decode_fp8_swapab.token_rows(c16, k16, s16)  # page 16: GATHER's only
    assert D_.decode_kernel(qn, qp, c16, k16, block_table=table, ckv_scale=s16).name == SWAPAB
    raw = torch.zeros(4 * 64 * fp8.token_bytes() + 16, dtype=torch.uint8)
    off = (8 - raw.data_ptr()) % 16
    bad = fp8.views(raw[off:off + 4 * 64 * fp8.token_bytes()].view(4, 64, -1))  # 8 bytes off 16-byte alignment
    assert not decode_fp8_swapab.gather_eligible(bad[0], bad[2], bad[1])
    assert not decode_fp8_swapab.token_rows(*(t.reshape(-1, 1, t.shape[-1]) for t in (bad[0], bad[2], bad[1])))
    assert D_.decode_kernel(qn, qp, bad[0], bad[2], block_table=table, ckv_scale=bad[1]).name == "triton"
    assert D_.decode_kernel(qn.half(), qp.half(), ckv, kpe, block_table=table, ckv_scale=scale).name == "triton"
    # what the compiled HF step hands mla.decode over DSAStaticCache's FP8 buffer [B, L, 656] (fp8.read_views, then
    # the pass's page-size-1 reshape; benchmarks/lab/hf_call_args.py --kv-cache-dtype fp8_e4m3), q [B, H, R] with the
    # absorbed product's head-major strides: the gather form
    buf = torch.zeros(2, 896, fp8.token_bytes(), dtype=torch.uint8)
    hf_c, hf_s, hf_k = (t.reshape(-1, 1, t.shape[-1]) for t in fp8.read_views(buf))
    hf_q = torch.zeros(16, 2, 512, dtype=BF16).transpose(0, 1)
    assert decode_fp8_swapab.token_rows(hf_c, hf_k, hf_s)  # the TOKENS form's too, where switched on
    assert D_.decode_kernel(hf_q, qp, hf_c, hf_k, block_table=torch.zeros(2, 896, dtype=torch.int32),
                            ckv_scale=hf_s).name == SWAPAB
    monkeypatch.setattr(decode_fp8_swapab, "ENABLED", False)  # switched off (MLA_COMPILE_FP8_SWAPAB=0)
    assert D_.decode_kernel(qn, qp, ckv, kpe, block_table=table, ckv_scale=scale).name == "triton"
    assert D_.decode_kernel(qn, qp, tokens[0], tokens[2], block_table=table, ckv_scale=tokens[1]).name == "triton"


@pytest.mark.parametrize("asked,case,want", [
    ("triton", dict(flashmla=True), "triton"),
    ("wgmma", dict(), "wgmma" if GLUON else "triton"),
    ("flashinfer", dict(flashinfer=True), "flashinfer"),
    ("flashinfer", dict(flashinfer=False), "seesaw" if SEESAW else "wgmma" if GLUON else "triton"),  # capture
    ("flashinfer", dict(flashinfer=True, P=0), "triton"),  # built for P = 64
    ("flashinfer", dict(flashinfer=True, sparse=True, PS=1, tma_layout=False), "wgmma" if GLUON else "triton"),
    ("flashmla", dict(flashmla=False, H=16), FEW),
    ("seesaw", dict(H=16), FEW),
    ("seesaw", dict(PS=16, tma_layout=False), "wgmma" if GLUON else "triton"),
    ("wgmma", dict(n_query=2, H=16), "triton"),
    ("seesaw", dict(n_query=2), "seesaw" if SEESAW else "wgmma" if GLUON else "triton"),
    ("wgmma", dict(n_query=2, H=32), "wgmma" if GLUON else "triton"),
    # the few-head swap-AB kernel: one query token, fp16/bf16, pages of whole 64-token tiles, R 512 / P 64, sm_90
    ("swapab", dict(H=16), "swapab" if GLUON else "triton"),
    ("swapab", dict(H=1, PS=128, dtype=torch.float16), "swapab" if GLUON else "triton"),
    ("swapab", dict(H=16, PS=16, tma_layout=False), "triton"),
    ("swapab", dict(H=16, PS=1, tma_layout=False, token_rows=True), "swapab" if GLUON else "triton"),
    ("swapab", dict(PS=1, tma_layout=False, token_rows=True), "swapab" if GLUON else "triton"),  # asked, at H 128
    ("swapab", dict(H=16, PS=1, sparse=True, tma_layout=False), "triton"),
    ("swapab", dict(H=16, n_query=2), "triton"),
    ("swapab", dict(H=16, P=32), "triton"),
    ("swapab", dict(H=16, dtype=torch.float32), "triton"),
    ("swapab", dict(H=16, cap=A100), "triton"),
    ("swapab", dict(H=16, fp8_cache=True, fp8_rows=True), SWAPAB),  # an FP8 cache: the FP8 kernels
])
def test_an_asked_for_kernel_runs_where_it_can_else_auto_says_why(asked, case, want):
    choice = D_.select_decode_kernel(*_args(**case), kernel=asked, **_facts(**case))
    assert choice.name == want
    if want == asked:
        assert choice.reason == "asked for"
    else:
        assert choice.reason.startswith(f"asked for {asked}, which cannot serve this call")


def _args(H=128, R=512, P=64, PS=64, sparse=False, dtype=BF16, cap=H200, n_query=1, **_):
    return H, R, P, PS, sparse, dtype, cap, n_query


def _facts(**case):
    return {k: v for k, v in case.items() if k in ("tma_layout", "rows_aligned", "flashmla", "flashinfer", "tokens",
                                                   "fp8_cache", "fp8_rows", "token_rows", "tokens_form")}


def test_unknown_kernel_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="kernel: expected one of .*'fastest'"):
        select(kernel="fastest")
    with pytest.raises(ValueError, match="decode_kernel"):
        tuning.Tuning(decode_kernel="fastest")


def test_selection_is_cached_and_queries_no_device(monkeypatch):
    # called per op call: the table lookup is an lru_cache hit on hashable arguments, never a device query
    def no_query(*a):
        raise AssertionError("device queried")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_query)
    D_.select_decode_kernel.cache_clear()
    first = D_.select_decode_kernel(128, 512, 64, 64, False, BF16, H200, 1, kernel="auto")
    assert D_.select_decode_kernel(128, 512, 64, 64, False, BF16, H200, 1, kernel="auto") is first
    assert D_.select_decode_kernel.cache_info().hits >= 1


def test_the_table_in_architecture_md_names_every_choice():
    # the human-readable table lives in the function's docstring and in ARCHITECTURE.md's kernel section
    doc = D_.select_decode_kernel.__doc__
    arch = (Path(__file__).resolve().parents[2] / "ARCHITECTURE.md").read_text()
    for name in ("flashmla", "seesaw", "wgmma", "swapab", "fp8_swapab", "triton", "torch"):
        assert re.search(rf"\| {name} +\|", doc), name
        assert f"`{name}`" in arch, name


# ================================================================================ the override: tuning and env
def _cpu_call(H=128, P=64):
    ckv, kpe = caches(PS=64, P=P)
    return torch.zeros(2, H, 512, dtype=BF16), torch.zeros(2, H, P, dtype=BF16), ckv, kpe


def test_decode_kernel_takes_the_tuning_then_the_env_var(monkeypatch):
    call = _cpu_call()
    monkeypatch.delenv(tuning.DECODE_KERNEL_ENV, raising=False)
    monkeypatch.setattr(D_._fi, "usable", lambda *a: True)  # as if FlashInfer were installed (not on CPU)
    assert D_.decode_kernel(*call).name == "triton"  # CPU tensors: the interpreter's kernels
    monkeypatch.setenv(tuning.DECODE_KERNEL_ENV, "flashinfer")  # the process-wide switch
    assert D_.decode_kernel(*call) == ("flashinfer", "asked for")
    with tuning.use(tuning.Tuning(decode_kernel="triton")):  # a compiled model's option wins over the env var
        assert D_.decode_kernel(*call).name == "triton"
        with tuning.use(tuning.Tuning()):  # "auto": the env var again
            assert D_.decode_kernel(*call).name == "flashinfer"
    assert D_.decode_kernel(*call).name == "flashinfer"
    monkeypatch.setenv(tuning.DECODE_KERNEL_ENV, "fastest")
    with pytest.raises(ValueError, match=tuning.DECODE_KERNEL_ENV):
        D_.decode_kernel(*call)


def test_backend_options_carry_a_tuning():
    t, rest = tuning.from_options({"decode_kernel": "wgmma", "triton.cudagraphs": True})
    assert t == tuning.Tuning(decode_kernel="wgmma") and rest == {"triton.cudagraphs": True}
    assert tuning.from_options(None) == (tuning.DEFAULT, {})
    with pytest.raises(ValueError, match="options: decode_kernel"):
        tuning.from_options({"decode_kernel": 3})
    seen = []
    fn = tuning.bind(lambda: seen.append(tuning.current().decode_kernel), t)
    fn()
    assert seen == ["wgmma"] and tuning.current() == tuning.DEFAULT
    plain = object()
    assert tuning.bind(plain, tuning.DEFAULT) is plain  # the defaults add nothing per call


def test_a_bound_tuning_keeps_a_data_promise_made_outside():
    """fp8_scale_fmt is a promise about the data (a cache of power-of-two scales handed to generate()): a compiled
    graph's bound Tuning of other fields keeps it where its caller made it, and makes none where nobody did."""
    seen = []
    fn = tuning.bind(lambda: seen.append(tuning.current()), tuning.Tuning(decode_kernel="triton"))
    fn()
    with tuning.use(tuning.Tuning(fp8_scale_fmt="ue8m0")):
        fn()
    promising = tuning.bind(lambda: seen.append(tuning.current()), tuning.Tuning(fp8_scale_fmt="ue8m0"))
    promising()
    assert seen == [tuning.Tuning(decode_kernel="triton"), tuning.Tuning(decode_kernel="triton", fp8_scale_fmt="ue8m0"),
                    tuning.Tuning(fp8_scale_fmt="ue8m0")]
    assert tuning.within(tuning.Tuning(absorb="bmm")) == tuning.Tuning(absorb="bmm")
    with tuning.use(tuning.Tuning(fp8_scale_fmt="ue8m0", decode_kernel="wgmma")):
        assert tuning.within(tuning.Tuning(absorb="bmm")) == tuning.Tuning(absorb="bmm", fp8_scale_fmt="ue8m0")


# ================================================================================ the choice is what runs
@pytest.mark.parametrize("kernel", ["seesaw", "wgmma", "swapab", "triton-tma", "triton-pointer"])
def test_decode_runs_exactly_the_configured_stage1_kernel(kernel, monkeypatch):
    # decode._attend re-checks nothing: the kernel in the config (dispatch's choice) is the one launched
    launched = []
    # every kernel's plan: a stand-in bound launch (no descriptor templates, no numbers)
    for name in ("seesaw", "wgmma", "swapab"):
        monkeypatch.setattr(getattr(D, "_" + name), "stage1_plan",
                            lambda *a, name=name, **k: (lambda *x: launched.append(name), (), ()))
    monkeypatch.setattr(D, "_tma_stage1", lambda *a, **k: (lambda *x: launched.append("triton-tma"), (), ()))
    monkeypatch.setattr(D, "_pointer_stage1", lambda *a, **k: (lambda *x: launched.append("triton-pointer"), (),
                                                                 None))
    q_nope, q_pe, ckv, kpe = _cpu_call()
    table, lens = torch.zeros(2, 2, dtype=torch.int32), torch.full((2,), 100, dtype=torch.int32)
    cfg = D.default_config(128, 512, 64)
    cfg = dataclasses.replace(cfg, tma=kernel != "triton-pointer",
                              kernel=kernel if kernel in ("seesaw", "wgmma", "swapab") else "triton")
    D.decode(q_nope, q_pe, ckv, kpe, table, lens, 0.1, cfg=cfg, splits=1)
    assert launched == [kernel]


def test_a_swapab_config_for_calls_it_cannot_serve_is_refused():
    # dispatch never hands the swap-AB kernel several query tokens or an index list; a caller of decode.py that does
    # gets an error before any launch, not rows computed with the wrong limits
    q_nope, q_pe, ckv, kpe = _cpu_call(H=16)
    cfg = dataclasses.replace(D.default_config(16, 512, 64), kernel="swapab")
    table, lens = torch.zeros(2, 2, dtype=torch.int32), torch.full((2,), 100, dtype=torch.int32)
    with pytest.raises(ValueError, match="cfg: the swapab kernel takes one query token of a paged cache"):
        D.decode(torch.zeros(2, 32, 512, dtype=BF16), torch.zeros(2, 32, 64, dtype=BF16), ckv, kpe, table, lens, 0.1,
                 cfg=cfg, n_query=2)
    with pytest.raises(ValueError, match="cfg: the swapab kernel"):
        D.sparse_decode(q_nope, q_pe, ckv, kpe, torch.zeros(2, 8, dtype=torch.int32), 0.1, cfg=cfg)


@pytest.mark.parametrize("choice", ["flashmla", "flashinfer", "seesaw", "wgmma", "swapab", "triton"])
def test_dispatch_decode_runs_the_selected_kernel(choice, monkeypatch):
    """The op's plan runs the kernel dispatch chose, each of them (swapab once fell through to the Triton kernels'
    default config: auto's choice at few heads on sm_90 never reached the op)."""
    ran = []
    monkeypatch.setattr(D_._fmla, "decode", lambda *a: ran.append("flashmla"))
    monkeypatch.setattr(D_._fi, "decode", lambda *a: ran.append("flashinfer"))
    monkeypatch.setattr(D_._decode, "decode_plan",
                        lambda *a, cfg=None, **k: SimpleNamespace(run=lambda *x: ran.append(cfg.kernel if cfg else
                                                                                              "triton")))
    monkeypatch.setattr(D_, "decode_kernel", lambda *a, **k: D_.Choice(choice, "test"))
    q_nope, q_pe, ckv, kpe = _cpu_call()
    D_.decode(q_nope, q_pe, ckv, kpe, torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 0.1)
    assert ran == [choice]


def test_own_decode_config_is_what_auto_runs_without_flashmla(monkeypatch):
    monkeypatch.setattr(D_, "_capability", lambda device: H200)
    q_nope, q_pe, ckv, kpe = _cpu_call()
    cfg = D_.own_decode_config(q_nope, q_pe, ckv, kpe)
    assert cfg.kernel == ("seesaw" if SEESAW else "wgmma" if GLUON else "triton")
    assert dataclasses.replace(cfg, kernel="triton") == D.default_config(128, 512, 64)  # same tiling and splits
    assert D_.own_decode_config(*_cpu_call(H=16)).kernel == FEW


@given(B=st.integers(1, 4096), H=st.sampled_from([1, 8, 16, 32, 64, 96, 128]), capacity=st.integers(0, 1 << 20),
       sms=st.integers(1, 200))
def test_split_policy_invariants(B, H, capacity, sms):
    # whatever the shapes: at least one split, at most max_splits, never a second wave of splits, never more
    # splits than min_split_tokens-long chunks of the capacity
    cfg = D.default_config(H, 512, 64)
    with mock.patch.object(D, "sm_count", lambda device: sms):
        ns = D.num_splits(B, H, capacity, torch.device("cpu"), cfg)
    programs = B * -(-H // cfg.block_h)
    assert 1 <= ns <= cfg.max_splits
    assert ns == 1 or programs * ns <= cfg.ctas_per_sm * sms
    assert ns <= max(1, -(-capacity // cfg.min_split_tokens))
    # empty splits (the kernels round a split to whole tiles) only where dropping them saves no merge pass
    split_len = -(-max(capacity, 1) // ns)
    split_len = -(-split_len // cfg.block_n) * cfg.block_n
    filled = -(-max(capacity, 1) // split_len)
    with mock.patch.object(D, "sm_count", lambda device: sms):
        width = D.one_pass_parts(B * H, 512, sms)
    assert filled == ns or ns <= width or filled > width


def test_kernels_sit_below_the_ops_in_no_import_circle():
    # tools/import_graph.py reads every import (deferred ones too) from the source
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tools import import_graph as ig

    assert ig.circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the checker finds one
    g = ig.graph("mla_compile")
    assert not [c for c in ig.circles(g) if any(m.startswith("mla_compile.kernels") for m in c)]
    assert ig.upward(g, "mla_compile", ["kernels"]) == []
    # what the kernels import from the package outside kernels/: leaf modules only (the configuration, a format
    # definition: modules that import nothing of the package), never ops or passes
    outside = {t for m, ts in g.items() if m.startswith("mla_compile.kernels") for t in ts
               if not t.startswith("mla_compile.kernels")}
    assert "mla_compile.tuning" in outside and all(not g[t] for t in outside), {t: g[t] for t in outside}


def test_flashmla_only_where_it_reads_the_caches_in_place(monkeypatch):
    # FlashMLA over two separate caches would copy them every call (more bytes than the attention reads): auto
    # takes it for one shared [NP, PS, R + P] buffer (flashmla.fused_caches) or P = 0, and never without it
    from mla_compile.kernels import flashmla

    monkeypatch.setattr(D_, "_capability", lambda device: H200)
    monkeypatch.setattr(flashmla, "supported", lambda *a: (True, ""))  # installed, and the CPU stands in for sm_90
    q_nope, q_pe, ckv, kpe = _cpu_call()
    assert D_.decode_kernel(q_nope, q_pe, ckv, kpe).name != "flashmla"
    ckv2, kpe2 = flashmla.fused_caches(4, 64, 512, 64, BF16, "cpu")
    assert D_.decode_kernel(q_nope, q_pe, ckv2, kpe2).name != "flashmla"  # 256 tokens: ours is faster
    big = torch.zeros(2, 2048, dtype=torch.int32)  # a block table of 2 x 2048 pages x 64 tokens: 256K tokens
    assert D_.decode_kernel(q_nope, q_pe, ckv2, kpe2, block_table=big).name == "flashmla"
    assert D_.decode_kernel(q_nope, q_pe, ckv2, kpe2, block_table=big[:, :1024]).name != "flashmla"
    ckv2, kpe2 = flashmla.fused_caches(4096, 64, 512, 64, BF16, "cpu")  # no table: the whole cache bounds it
    assert D_.decode_kernel(q_nope, q_pe, ckv2, kpe2).name == "flashmla"
    assert D_.decode_kernel(*_cpu_call(H=16)[:2], ckv2, kpe2).name == FEW  # few heads: ours, TMA rows of the buffer
    assert D_.decode_kernel(q_nope, q_pe, ckv2, kpe2, kernel="triton").name == "triton"
    assert D_.decode_kernel(q_nope, q_pe[..., :0], ckv, kpe[..., :0], block_table=big).name == "flashmla"  # P = 0
    monkeypatch.setattr(flashmla, "supported", lambda *a: (False, "page size"))  # or not installed
    assert D_.decode_kernel(q_nope, q_pe, ckv2, kpe2).name != "flashmla"


def test_every_choice_has_a_plan(monkeypatch):
    """Whatever select_decode_kernel chooses (every kernel asked for, every layout fact, FP8 or not, dense or sparse),
    dispatch's plan functions have a branch for it: none reaches their last (Triton) branch as another kernel, which
    would silently run the Triton kernels instead (`_planned` raises there; a "swapab" choice once did that)."""
    import itertools

    dense_planned = {"flashmla", "flashinfer", "seesaw", "wgmma", "swapab", "fp8_swapab", "triton"}
    sparse_planned = {"flashmla", "wgmma", "triton"}
    seen = set()
    facts = ("tma_layout", "rows_aligned", "flashmla", "flashinfer", "fp8_cache", "fp8_rows", "token_rows",
             "tokens_form", "pow2_scales")
    for H, PS, sparse, n_query, cap, kernel in itertools.product(
            (1, 16, 40, 64, 128), (1, 64), (False, True), (1, 2), (H200, A100, "interpreter"), tuning.DECODE_KERNELS):
        for flags in itertools.product((False, True), repeat=len(facts)):
            kw = dict(zip(facts, flags))
            if sparse and (kw["tma_layout"] or kw["token_rows"]):  # never true of an index list (_gluon)
                continue
            name = D_.select_decode_kernel(H, 512, 64, 1 if sparse else PS, sparse, BF16, cap, n_query,
                                           kernel=kernel, **kw).name
            seen.add((sparse, name))
            assert name in (sparse_planned if sparse else dense_planned), (H, PS, sparse, n_query, cap, kernel, kw)
            # the branches read the cache as the kernel does: FP8 kernels for FP8 caches (a sparse "flashmla" is
            # FlashMLA's FP8 kernel), bf16 ones for the rest
            if name == "fp8_swapab" or (sparse and name == "flashmla"):
                assert kw["fp8_cache"], (name, kw)
            if name in ("seesaw", "wgmma", "swapab", "flashinfer"):
                assert not kw["fp8_cache"], (name, kw)
    assert {n for s, n in seen if not s} == dense_planned  # the grid reaches every branch
    assert {n for s, n in seen if s} == sparse_planned
    with pytest.raises(RuntimeError, match="no plan for the kernel 'swapab'"):
        D_._planned("swapab", "decode_plan")
