"""Which Triton decode kernel runs (pure host logic, no GPU): TMA eligibility and the default configs."""

from __future__ import annotations

import unittest.mock as mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("triton")
from mla_compile.kernels import decode as D  # noqa: E402


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
    wide = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
    assert not D.tma_eligible(wide[..., :512], kpe, False, cfg)  # rows not contiguous at R


def test_tma_needs_hopper(monkeypatch):
    cfg = D.DecodeConfig(block_n=16, tma=True)
    monkeypatch.setattr(D, "has_tma", lambda device: False)  # e.g. an A100: the pointer kernel runs
    assert not D.tma_eligible(*caches(PS=16), False, cfg)


@pytest.mark.parametrize("H,B,L,want", [(16, 1, 131072, 256), (16, 8, 32768, 33), (16, 32, 32768, 8),
                                        (16, 128, 8192, 2), (16, 512, 8192, 1), (16, 32, 256, 4),
                                        (128, 1, 131072, 66), (128, 8, 32768, 8), (128, 128, 32768, 1)])
def test_splits_fill_one_wave_of_an_h200(monkeypatch, H, B, L, want):
    # 132 SMs; the probe (data/session8_call1) found one wave of programs faster than ~two at every shape
    monkeypatch.setattr(D, "sm_count", lambda device: 132)
    cfg = D.default_config(H, 512, 64)
    ns = D.num_splits(B, H, L, torch.device("cpu"), cfg)
    assert ns == want
    programs = B * -(-H // cfg.block_h)
    assert programs * ns <= max(cfg.ctas_per_sm * 132, programs)  # never a second wave of splits
    assert ns == 1 or -(-L // ns) >= cfg.min_split_tokens


def test_gluon_kernels_choose_tma_boxes_only_for_whole_tile_pages():
    # decode_wgmma: the TMA kernel needs pages of whole 64-token tiles in a [slots, width] view; everything else
    # (page 1 / 16 tables, sparse index lists, strided caches) is the gather kernel's
    from mla_compile.kernels import decode_wgmma as W

    for PS in (64, 128):
        assert W.tma_layout(*caches(PS=PS), sparse=False)
        assert not W.tma_layout(*caches(PS=PS), sparse=True)
    for PS in (1, 16, 32, 96):
        assert not W.tma_layout(*caches(PS=PS), sparse=False)
    ckv, kpe = torch.zeros(4, 64, 1024, dtype=torch.bfloat16)[..., :512], torch.zeros(4, 64, 64, dtype=torch.bfloat16)
    assert not W.tma_layout(ckv, kpe, sparse=False)  # rows 1024 apart: not a [slots, 512] view
    # q + two tiles + p fit Hopper's 227 KB at R 512 / P 64; a wider latent would not
    assert W.smem_bytes(512, 64) <= W.SMEM_LIMIT < W.smem_bytes(1024, 64)


def test_gluon_kernels_never_run_off_sm90():
    # CPU tensors (the interpreter), whatever the shapes: the Triton kernels serve them
    from mla_compile.kernels import decode_wgmma as W

    q = torch.zeros(2, 128, 512, dtype=torch.bfloat16)
    assert not W.eligible(q, *caches(PS=64))
    assert not W.eligible(q, *caches(PS=1), sparse=True)
    assert D.default_config(128, 512, 64).wgmma and not D.default_config(16, 512, 64).wgmma



def test_tma_layout_calls_take_the_warp_specialised_kernel(monkeypatch):
    # decode_wgmma.launch on the TMA layout: the seesaw kernel (decode_seesaw.py) unless switched off, asked for the
    # other kernel's schedule / phase probe, or the rope width does not fit its p buffer (P != 64)
    pytest.importorskip("triton.experimental.gluon")
    from mla_compile.kernels import decode_seesaw as S
    from mla_compile.kernels import decode_wgmma as W

    if not S.HAS_WARP_SPECIALIZE:
        pytest.skip("this Triton's Gluon has another warp_specialize")
    launched = []
    monkeypatch.setattr(S, "launch", lambda *a, **k: launched.append("seesaw"))
    other = mock.MagicMock()
    other.__getitem__.return_value = lambda *a, **k: launched.append("two-warpgroup")
    monkeypatch.setattr(W, "_stage1_wgmma_kernel", other)

    def launch(P=64, **kw):
        ckv, kpe = caches(PS=64, P=P)
        q_nope, q_pe = torch.zeros(2, 128, 512, dtype=torch.bfloat16), torch.zeros(2, 128, P, dtype=torch.bfloat16)
        o, lse = torch.zeros(2, 128, 512), torch.zeros(2, 128)
        table, lens = torch.zeros(2, 2, dtype=torch.int32), torch.full((2,), 100, dtype=torch.int32)
        W.launch(q_nope, q_pe, ckv, kpe, table, lens, 0.1, o, lse, 0, 0, 1, **kw)
        return launched.pop()

    assert launch() == "seesaw"
    assert launch(pipe=True) == launch(pipe=False) == launch(probe=4) == "two-warpgroup"
    assert launch(P=32) == "two-warpgroup"
    monkeypatch.setattr(W, "SEESAW", False)
    assert launch() == "two-warpgroup"
    # q + two slots (p in their rope buffers) fit 227 KB at R 512 / P 64
    assert S.eligible(512, 64) and S.smem_bytes(512, 64) <= W.SMEM_LIMIT
    assert not S.eligible(512, 32) and not S.eligible(1024, 64)


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
