"""What the default decode kernels compile to on Hopper, checked on a CPU machine: Triton compiles for sm_90a
ahead of time (no GPU needed) and its bundled ptxas reports registers and spills (tools/aot.py).

These guard the properties the H200 sweeps showed the speed depends on (RESULTS.md, decode sweep rounds 6-9, linear
sweeps 1-2):
the pointer kernel's cache loads must be 16-byte async copies (a runtime R/P once left 2-byte loads and cost
~10%), nothing spills, the H=128 TMA kernel runs Hopper's warpgroup MMA on TMA-loaded tiles, and the Gluon kernel
that replaced it on sm_90 computes each score once.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tools/ is dev tooling
from mla_compile.kernels import decode as D  # noqa: E402
from tools import aot  # noqa: E402

pytestmark = pytest.mark.skipif(not aot.available(), reason="triton's bundled ptxas is missing")
# an MMA layout in TTGIR: (warpsPerCTA, instrShape)
MMA_LAYOUT = r"nvidia_mma<\{[^}]*warpsPerCTA = (\[\d+, \d+\]), instrShape = (\[[\d, ]+\])"


@pytest.mark.parametrize("page_size", [1, 64])
def test_few_heads_pointer_kernel_streams_the_cache_in_16_byte_async_copies(page_size):
    out = aot.stage1_sm90(D.default_config(16, 512, page_size), page_size=page_size)
    ptx = out["ptx"]
    assert out["kernel"] == "pointer"
    assert re.search(r"cp\.async\.cg\.shared\.global[^;]*, 0x10,", ptx), "cache tiles are not 16-byte async copies"
    assert not re.search(r"ld\.global(\.[a-z:0-9]+)*\.[bu]16 ", ptx), "2-byte global loads in the tile loop"
    assert "mma.sync" in ptx
    assert out["spill_bytes"] == 0, out["registers"]


def test_many_heads_tma_kernel_feeds_warpgroup_mma():
    out = aot.stage1_sm90(D.default_config(128, 512, 64), page_size=64)
    assert out["kernel"] == "tma"
    assert "cp.async.bulk.tensor" in out["ptx"], "full tiles are not TMA copies"
    assert "wgmma.mma_async" in out["ptx"], "no warpgroup MMA"
    assert out["spill_bytes"] <= 1024, out["spill_bytes"]  # ptxas' offline count; the H200 reports 0 for this config


@pytest.mark.parametrize("dtype,multi", [("bf16", False), ("fp16", False), ("bf16", True)])
def test_many_heads_gluon_kernel_computes_each_score_once(dtype, multi):
    """The Gluon kernel (kernels/decode_wgmma.py) exists because Triton laid the score MMA out as 8 warps along
    M (warpsPerCTA [8, 1]): both warpgroups computed the same scores. Here the score MMA must split the tile's
    tokens over the two warpgroups ([4, 2], 32 tokens each) and the output's columns likewise, q and the tiles
    must fit one SM's shared memory, and nothing may spill. `multi` (several query tokens, a limit per row):
    the same MMAs, the per-row mask costing no spill."""
    pytest.importorskip("triton.experimental.gluon")
    from mla_compile.kernels import _gluon as G
    from mla_compile.kernels import decode_wgmma as W

    out = aot.wgmma_stage1_sm90(dtype=dtype, multi=multi)
    mma_layouts = set(re.findall(MMA_LAYOUT, out["ttgir"]))
    assert mma_layouts == {("[4, 2]", "[16, 32, 16]"), ("[4, 2]", "[16, 128, 16]")}, mma_layouts
    assert "cp.async.bulk.tensor" in out["ptx"], "full tiles are not TMA copies"
    # per tile and warpgroup: q.ckv^T = 576 / 16 instructions, p.ckv = 2 x 64 / 16; once for the full tiles'
    # loop and once for a split's partial last tile
    assert len(re.findall(r"wgmma\.mma_async", out["ptx"])) == 2 * (576 // 16 + 2 * 64 // 16)
    assert out["spill_bytes"] == 0, out["registers"]
    assert out["advisories"] == [], out["advisories"]  # ptxas neither serialises the MMAs nor adds waits
    assert out["shared_bytes"] <= G.SMEM_LIMIT
    assert out["shared_bytes"] >= W.smem_bytes(512, 64) - 64  # q, both stages and p are all there


# (TILE_N, SLOT_SETS): the product's tiling and the double-buffered one measured against it (benchmarks/lab/seesaw_n32.py)
@pytest.mark.parametrize("tiling", [(64, 1), (32, 2)], ids=["64x1", "32x2"])
@pytest.mark.parametrize("dtype,multi", [("bf16", False), ("fp16", False), ("bf16", True)])
def test_many_heads_seesaw_kernel_gives_each_warpgroup_whole_tiles(dtype, multi, tiling, monkeypatch):
    """The warp-specialised kernel (kernels/decode_seesaw.py): each warpgroup scores whole tiles of TILE_N tokens
    (an m64nTILE_N MMA over one warpgroup, [4, 1]) and accumulates one latent half (m64n256), a one-warp partition
    issues the TMA copies, and the register file is split between the partitions (setmaxnreg)."""
    pytest.importorskip("triton.experimental.gluon")
    from mla_compile.kernels import _gluon as G
    from mla_compile.kernels import decode_seesaw as S

    monkeypatch.setattr(S, "TILE_N", tiling[0])
    monkeypatch.setattr(S, "SLOT_SETS", tiling[1])
    out = aot.wgmma_stage1_sm90(dtype=dtype, kernel="seesaw", multi=multi)
    mma_layouts = set(re.findall(MMA_LAYOUT, out["ttgir"]))
    assert mma_layouts == {("[4, 1]", f"[16, {S.TILE_N}, 16]"), ("[4, 1]", "[16, 256, 16]")}, mma_layouts
    ptx = out["ptx"]
    # per warpgroup and pair of tiles: its own tile's q.ckv^T (576 / 16) and two p.ckv (TILE_N / 16 each)
    assert len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{S.TILE_N}k16", ptx)) == 2 * 576 // 16
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16", ptx)) == 2 * 2 * S.TILE_N // 16
    assert "cp.async.bulk.tensor" in ptx, "tiles are not TMA copies"
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{int(S.LOADER_REGS)};", ptx), "loader keeps its registers"
    assert re.search(r"\.reqntid 384", ptx), "4 + 4 + 1 warps launch as three warpgroups"
    assert out["spill_bytes"] <= S.SPILL_BUDGET, out["spill_bytes"]
    assert S.smem_bytes(512, 64) - 256 <= out["shared_bytes"] <= G.SMEM_LIMIT
    # ptxas must not serialise the MMAs (C7514: each waits for the one before; a "defer" variant, which
    # read warpgroup 0's accumulator while an MMA was in flight, got it and ran 40% slower on the H200). The one
    # wait ptxas adds (C7517) is warpgroup 1's before rescaling its accumulator, while its score MMAs are in flight;
    # a second one would be a new serialisation point
    assert "C7514" not in out["advisories"], out["advisories"]
    assert out["advisories"].count("C7517") <= 1, out["advisories"]


@pytest.mark.parametrize("page_size,sparse,multi", [(1, False, False), (16, False, False), (1, True, False),
                                                    (16, False, True)])
def test_many_heads_gluon_gather_kernel_copies_rows_in_16_byte_async_copies(page_size, sparse, multi):
    """The Gluon kernel for tiles that are not TMA boxes (pages < 64 tokens, sparse index lists): every cache row
    arrives by 16-byte cp.async whose source size zero-fills masked rows (unused slots may hold NaN), the same
    hand-laid MMAs as the TMA kernel, no spills."""
    pytest.importorskip("triton.experimental.gluon")
    out = aot.wgmma_stage1_sm90(page_size=page_size, kernel="gather", sparse=sparse, multi=multi)
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10, %r\d+;", out["ptx"])
    # [64, 256] x 2 latent halves + [64, 64] rope, 16 B each, over 256 threads: 18 per thread and tile, at the
    # prologue's and at the loop's issue
    assert len(copies) == 2 * 18, len(copies)
    mma_layouts = set(re.findall(MMA_LAYOUT, out["ttgir"]))
    assert mma_layouts == {("[4, 2]", "[16, 32, 16]"), ("[4, 2]", "[16, 128, 16]")}, mma_layouts
    assert out["spill_bytes"] == 0, out["registers"]
    assert out["advisories"] == [], out["advisories"]


@pytest.mark.parametrize("M,K,N", [(8, 2048, 2112), (8, 2048, 16384), (8, 8192, 2048), (1, 7168, 2112)])
def test_few_token_linear_streams_weights_in_16_byte_async_copies(M, K, N):
    """The default few-token linear configs (kernels/linear.py; H200 sweeps rounds 1-2): weight tiles as
    pipelined 16-byte async copies, tensor-core MMA, no spills."""
    out = aot.linear_sm90(M, K, N)
    ptx = out["ptx"]
    assert re.search(r"cp\.async\.cg\.shared\.global[^;]*, 0x10,", ptx), "weight tiles are not 16-byte async copies"
    assert not re.search(r"ld\.global(\.[a-z:0-9]+)*\.[bu]16 ", ptx), "2-byte global loads"
    assert "mma.sync" in ptx
    assert out["spill_bytes"] == 0, out["registers"]


_MEMORY_OP = re.compile(r"^\s+(?:@!?%p\d+ )?(?:ld\.global|st\.global|cp\.async|atom|red\.global)", re.M)


@pytest.mark.parametrize("transposed", [False, True])
def test_per_head_linear_compiles_to_tensor_core_mma_without_spills(transposed):
    """W_UV (K-contiguous rows) and W_UK (a transposed weight view): vectorised weight loads, MMA, no spills."""
    out = aot.per_head_linear_sm90(transposed, K=512 if not transposed else 128)
    assert "mma.sync" in out["ptx"]
    assert not re.search(r"ld\.global(\.[a-z:0-9]+)*\.[bu]16 ", out["ptx"]), "2-byte global loads"
    assert out["spill_bytes"] == 0, out["registers"]


@pytest.mark.parametrize("kernel", ["stage1 page 1", "stage1 page 64", "stage1 H=128 tma", "linear split-K",
                                    "per-head linear", "gluon swapab tokens", "gluon fp8 swapab gather",
                                    "gluon wgmma gather", "stage1 merged page 1", "gluon swapab merged"])
def test_pdl_kernels_wait_for_the_previous_kernel_before_any_memory_access(kernel):
    """Launched with programmatic dependent launch (on by default on sm_90+; MLA_COMPILE_PDL=0 /
    MLA_COMPILE_GLUON_PDL=0 turn it off), a kernel may start while its predecessor still runs: `griddepcontrol.wait` must come before every global load /
    store / async copy (RAW and WAR), and dependents are released only after it (kernels/_util.py pdl_enter,
    kernels/_gluon.py pdl_enter). Without PDL, neither instruction."""
    if kernel.startswith("gluon"):
        pytest.importorskip("triton.experimental.gluon")
    build = {"stage1 page 1": lambda pdl: aot.stage1_sm90(D.default_config(16, 512, 1), page_size=1, pdl=pdl),
             "stage1 page 64": lambda pdl: aot.stage1_sm90(D.default_config(16, 512, 64), page_size=64, pdl=pdl),
             "stage1 H=128 tma": lambda pdl: aot.stage1_sm90(D.default_config(128, 512, 64), page_size=64, pdl=pdl),
             "linear split-K": lambda pdl: aot.linear_sm90(8, 8192, 2048, pdl=pdl),
             "per-head linear": lambda pdl: aot.per_head_linear_sm90(True, K=128, pdl=pdl),
             "gluon swapab tokens": lambda pdl: aot.swapab_sm90(H=16, page_size=1, pdl=pdl),
             "gluon fp8 swapab gather": lambda pdl: aot.fp8_swapab_sm90(H=16, page_size=1, gather=True, pdl=pdl),
             "gluon wgmma gather": lambda pdl: aot.wgmma_stage1_sm90(page_size=1, kernel="gather", pdl=pdl),
             # the self-merging builds: the ticket's atomic is a memory access too (the previous launch's last merge
             # program may still be zeroing the same counters)
             "stage1 merged page 1": lambda pdl: aot.stage1_sm90(D.default_config(16, 512, 1), page_size=1, pdl=pdl,
                                                                 merged=True),
             "gluon swapab merged": lambda pdl: aot.swapab_sm90(H=16, pdl=pdl, merged=True)}[kernel]
    ptx = build(True)["ptx"]
    wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    first_access = _MEMORY_OP.search(ptx)
    assert 0 <= wait < launch, "no wait, or dependents released before it"
    assert first_access is not None and wait < first_access.start(), first_access
    assert "griddepcontrol" not in build(False)["ptx"]


@pytest.mark.parametrize("H,page_size,P", [(16, 64, 64), (16, 1, 1), (128, 64, 64), (128, 1, 1), (128, 64, 1)])
def test_fp32_pointer_kernel_fits_shared_memory_without_spills(H, page_size, P):
    """fp32 operands at the default tiling for their shapes (P = 1: the rope-less route's zero column): the build
    stays inside the H200's 227 KB of shared memory per block, with no spill (the half-precision tiling in fp32
    needed 396-432 KB at 64 rows and failed on the H200 with OutOfResources)."""
    import torch

    if not aot.available():
        pytest.skip("triton's bundled ptxas is missing")
    cfg = D.default_config(H, 512, page_size, torch.float32)
    assert not cfg.tma and cfg.kernel == "triton"
    got = aot.compile_sm90(D._stage1_kernel,
                           dict(D.pointer_constexprs(cfg, 512, P, page_size, False, torch.float32, False), PDL=False),
                           {k: "*fp32" for k in ("Qn", "Qp", "Ckv", "Kpe")}, cfg.num_warps, cfg.num_stages)
    assert got["shared_bytes"] <= 200 * 1024, got["shared_bytes"]
    assert got["spill_bytes"] == 0, got["registers"]


def test_flashmla_empty_row_fixup_writes_16_byte_rows_without_spills():
    """kernels/flashmla.py's fix-up (FlashMLA's empty rows -> (0, -inf)): the zero rows as 16-byte stores, no
    spills, no shared memory; only seq_lens read (one 4-byte load per row)."""
    from mla_compile.kernels import flashmla as F

    out = aot.compile_sm90(F._empty_rows_kernel, dict(R=512, BLOCK_ROWS=16, BLOCK_R=512),
                           {"Out": "*bf16", "Lse": "*fp32", "SeqLens": "*i32"}, 4, 1,
                           divisible={"Out", "Lse", "SeqLens"}, gluon=True)  # gluon: no dot-mode constexprs
    assert "st.global.v4.b32" in out["ptx"] and out["spill_bytes"] == 0 and out["shared_bytes"] == 0
    assert set(re.findall(r"ld\.global[.a-z0-9]*", out["ptx"])) == {"ld.global.b32"}


@pytest.mark.parametrize("H,gather,page_size", [(16, False, 64), (32, False, 64), (64, False, 64), (16, True, 1),
                                                (32, True, 1), (64, True, 1), (16, True, 64), (32, True, 64)])
def test_fp8_swap_ab_kernel_reads_tma_tiles_into_warpgroup_mmas_without_spills(H, gather, page_size):
    """The FP8 cache's Gluon kernel (kernels/decode_fp8_swapab.py) at the tiling each head count gets: tiles arrive by
    TMA (GATHER form, any page size: 16-byte cp.async row copies through the table, arriving on the slots'
    mbarriers), both products are warpgroup MMAs with the 64 tokens as M (m64nNk16, N the heads per program),
    nothing spills (a few bytes at 64 heads), shared memory fits, and ptxas does not serialise the MMAs (C7514: a
    variant that waited for one P.V at a time got it)."""
    pytest.importorskip("triton.experimental.gluon")
    from mla_compile.kernels import _gluon as G
    from mla_compile.kernels import decode_fp8_swapab as F

    t = F.default_tiling(H)
    out = aot.fp8_swapab_sm90(t, page_size=page_size, gather=gather)
    ptx = out["ptx"]
    if gather:
        assert "cp.async.bulk" not in ptx
        sizes = set(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], (\w+)", ptx))
        assert sizes == {"0x10"}, f"row copies are not all 16-byte cp.async: {sizes}"
        assert "cp.async.mbarrier.arrive.noinc.shared.b64" in ptx
    else:
        assert "cp.async.bulk.tensor" in ptx, "tiles are not TMA copies"
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
    # the scores split the heads over the warpgroups, P.V the channels
    assert shapes == {f"m64n{t.N // (t.warps // 4)}k16", f"m64n{t.N}k16"}, shapes
    # blocks of 64 heads spill a few bytes (the exact scores beside a 128-register O^T) and are still 1.5x faster
    # than two blocks of 32 (decode_fp8_swapab.py's docstring); anything more is a regression
    assert out["spill_bytes"] <= (0 if t.N <= 32 else 64), out["registers"]
    assert out["shared_bytes"] <= G.SMEM_LIMIT
    assert "C7514" not in out["advisories"] and "C7515" not in out["advisories"], out["advisories"]


@pytest.mark.parametrize("H", [16, 32, 64])
def test_fp8_swap_ab_kernel_over_a_token_table_takes_tma_boxes_or_row_copies(H):
    """The FP8 kernel's TOKENS form (a page-size-1 token table, the HF pass's): each tile's 64 entries are checked on
    the device; a run of consecutive rows is the TMA form's boxes (e4m3, scales, rope) whose barrier gets the rest of
    its count from one thread, any other tile GATHER's 16-byte cp.async row copies arriving from every thread (the
    barrier counts every thread). Both paths are in the build, the MMAs are the other forms', nothing spills (at 64
    heads no more than the other forms' few bytes), shared memory fits, and ptxas does not serialise the MMAs."""
    pytest.importorskip("triton.experimental.gluon")
    from mla_compile.kernels import _gluon as G
    from mla_compile.kernels import decode_fp8_swapab as F

    t = F.default_tiling(H)
    out = aot.fp8_swapab_sm90(t, page_size=1, tokens=True)
    ptx = out["ptx"]
    assert "cp.async.bulk.tensor" in ptx
    sizes = set(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], (\w+)", ptx))
    assert sizes == {"0x10"}, f"row copies are not all 16-byte cp.async: {sizes}"
    assert "cp.async.mbarrier.arrive.noinc.shared.b64" in ptx
    inits = set(re.findall(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], (\d+);", ptx))
    assert inits == {str(32 * t.warps)}, inits  # every thread's row copies arrive
    counts = set(re.findall(r"mbarrier\.arrive\.shared::cta\.b64 _, \[%r\d+\], (\d+);", ptx))
    assert counts == {str(32 * t.warps - 1)}, counts  # the TMA path's arrival: every thread but the expect's
    # the expect: the whole token (656 bytes: e4m3, scales, rope) of each of the tile's 64 rows
    assert set(re.findall(r"mbarrier\.arrive\.expect_tx\.shared\.b64 _, \[%r\d+\], (\d+);", ptx)) == {str(64 * 656)}
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
    assert shapes == {f"m64n{t.N // (t.warps // 4)}k16", f"m64n{t.N}k16"}, shapes
    assert out["spill_bytes"] <= (0 if t.N <= 32 else 64), out["registers"]
    assert out["shared_bytes"] <= G.SMEM_LIMIT
    assert "C7514" not in out["advisories"] and "C7515" not in out["advisories"], out["advisories"]


@pytest.mark.parametrize("H,dtype", [(16, "bf16"), (32, "bf16"), (16, "fp16"), (40, "bf16")])
def test_swap_ab_kernel_reads_tma_tiles_into_warpgroup_mmas_without_spills(H, dtype):
    """The few-head Gluon kernel over a bf16 / fp16 cache (kernels/decode_swapab.py): tiles arrive by TMA and feed
    warpgroup MMAs as they landed (no copy or conversion in shared memory, so no shared-memory stores of a tile),
    with the 64 tokens as M (m64nNk16, N the heads per program: split over the warpgroups for the scores, whole for
    P.V); nothing spills, shared memory fits, ptxas does not serialise the MMAs (C7514 / C7515: issuing the refill
    between the barrier and the score MMAs got C7515, or crashed ptxas)."""
    pytest.importorskip("triton.experimental.gluon")
    from mla_compile.kernels import _gluon as G
    from mla_compile.kernels import decode_swapab as S

    t = S.default_tiling(H)  # 64: the tiling of 33-63 heads
    out = aot.swapab_sm90(t, dtype=dtype)
    ptx = out["ptx"]
    assert "cp.async.bulk.tensor" in ptx, "tiles are not TMA copies"
    assert "cp.async.cg" not in ptx
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
    assert shapes == {f"m64n{t.N // (t.warps // 4)}k16", f"m64n{t.N}k16"}, shapes
    assert out["spill_bytes"] == 0, out["registers"]
    assert out["shared_bytes"] <= G.SMEM_LIMIT
    assert "C7514" not in out["advisories"] and "C7515" not in out["advisories"], out["advisories"]


@pytest.mark.parametrize("H", [16, 32, 40])
def test_swap_ab_kernel_over_a_token_table_takes_tma_boxes_or_row_copies(H):
    """swapab's TOKENS form (a page-size-1 token table, the HF pass's): each tile's 64 entries are checked on the
    device; a run of consecutive rows is three TMA boxes whose barrier gets the rest of its count from one thread, any
    other tile 16-byte cp.async row copies arriving from every thread. Both paths are in the build, the MMAs are the
    TMA form's, nothing spills, and ptxas does not serialise the MMAs."""
    pytest.importorskip("triton.experimental.gluon")
    from mla_compile.kernels import _gluon as G
    from mla_compile.kernels import decode_swapab as S

    t = S.default_tiling(H)  # 64: the tiling of 33-63 heads
    out = aot.swapab_sm90(t, page_size=1)
    ptx = out["ptx"]
    assert "cp.async.bulk.tensor" in ptx and "cp.async.cg.shared.global" in ptx
    assert "cp.async.mbarrier.arrive.noinc" in ptx
    counts = set(re.findall(r"mbarrier\.arrive\.shared::cta\.b64 _, \[%r\d+\], (\d+);", ptx))
    assert counts == {str(32 * t.warps - 1)}, counts  # the TMA path's arrival: every thread but the expect's
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
    assert shapes == {f"m64n{t.N // (t.warps // 4)}k16", f"m64n{t.N}k16"}, shapes
    assert out["spill_bytes"] == 0, out["registers"]
    assert out["shared_bytes"] <= G.SMEM_LIMIT
    assert "C7514" not in out["advisories"] and "C7515" not in out["advisories"], out["advisories"]


@pytest.mark.parametrize("page_size,sparse", [(1, True), (64, False)])
def test_self_merging_pointer_kernel_keeps_the_stage1_code(page_size, sparse):
    """The Triton pointer kernel's build that merges its own splits (kernels/merge.py, `_stage1_merged_kernel`):
    the stage-1 part as in `_stage1_kernel` (16-byte async copies of the cache, MMAs), no spills; the protocol is one
    relaxed ticket, one release arrival, acquire polls of the group's counter and acq_rel departures."""
    out = aot.stage1_sm90(D.default_config(16, 512, page_size), page_size=page_size, sparse=sparse, merged=True)
    ptx = out["ptx"]
    assert re.search(r"cp\.async\.cg\.shared\.global[^;]*, 0x10,", ptx), "cache tiles are not 16-byte async copies"
    assert "mma.sync" in ptx and out["spill_bytes"] == 0, out["registers"]
    atomics = re.findall(r"atom\.global\.gpu\.(\w+)\.add", ptx)
    assert sorted(set(atomics)) == ["acq_rel", "relaxed", "release"], atomics
    assert "ld.global.gpu.acquire" in ptx


@pytest.mark.parametrize("page_size", [64, 1])
def test_self_merging_swapab_kernel_keeps_its_mmas(page_size):
    """The swap-AB Gluon kernel's self-merging build: TMA tiles into the same warpgroup MMAs, shared memory as the
    plain build's, ptxas does not serialise the MMAs; no spills in the paged form (the TOKENS form, at 252 registers
    without the merge, spills a few bytes with it: benchmarks/RESULTS.md times it)."""
    pytest.importorskip("triton.experimental.gluon")
    plain, merged = aot.swapab_sm90(H=16, page_size=page_size), aot.swapab_sm90(H=16, page_size=page_size,
                                                                                merged=True)
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", merged["ptx"]))
    assert shapes == set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", plain["ptx"]))
    assert "cp.async.bulk.tensor" in merged["ptx"]
    assert merged["shared_bytes"] == plain["shared_bytes"]
    assert "C7514" not in merged["advisories"] and "C7515" not in merged["advisories"], merged["advisories"]
    if page_size == 64:
        assert merged["spill_bytes"] == 0, merged["registers"]
