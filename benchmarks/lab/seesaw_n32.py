"""Lab probe of the many-head seesaw kernel (mla_compile/kernels/decode_seesaw.py: its design is explained there) with
half-size tiles and two sets of tile slots. Question: the product kernel holds q and ONE pair of 64-token tiles in
shared memory, so each pair's second tile (slot B) frees only when the pair's last MMAs finish and is needed again
by the next pair's first scores: every pair waits for one tile's copy (timing probes: 23-26% of stage 1 at H 128,
B >= 8; benchmarks/lab/README.md). With 32-token tiles the same bytes hold TWO pairs: the next pair's tiles load
while this pair computes (a full double buffer), for twice the softmax / barrier steps per token. Does that win?

    python benchmarks/lab/seesaw_n32.py OUT.json [--shapes H:B:KV ...] [--variants 32:2 64:1]
    SEESAW_ARGS="..." bash benchmarks/device.sh seesaw

A variant "BN:NSETS" is this file's kernel with BN-token tiles and NSETS sets of (A, B) slots ("64:1" is the product
kernel's schedule rebuilt here: a control for this copy). Per shape (the same data for every column): each variant's
request 0 against float64 and the whole batch against the product kernel (out, lse), then CUDA-graph replay medians
(do_bench_cudagraph) side by side: auto's kernel (the product), the product seesaw, each variant (stage 1 + the
product merge, at the product's split count), FlashInfer's `run` (planned outside the graph) and FlashMLA alone when
they import. Timing only in this file: nothing in mla_compile imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_ops' helpers

import bench_ops as BO  # noqa: E402
from mla_compile.kernels import _gluon as G  # noqa: E402
from mla_compile.kernels import decode as D  # noqa: E402
from mla_compile.kernels import decode_seesaw as S  # noqa: E402
from mla_compile.kernels import dispatch  # noqa: E402
from mla_compile.kernels._launch import bind, templated_at, without_bases  # noqa: E402
from mla_compile.kernels._util import cdiv, query_limit_args, slot_stride  # noqa: E402

SHAPES = ("128:1:32768", "128:1:131072", "128:8:8192", "128:8:32768", "128:32:8192", "128:32:32768",
          "128:128:8192", "128:128:32768")

if G.gluon is not None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    @gluon.jit
    def _load_part(CkvDesc, KpeDesc, c0_s, c1_s, k_s, full, empty, row, free, ST, PART: gl.constexpr,
                   RH: gl.constexpr):
        """Part PART (0 rope, 1 c0, 2 c1) of the tile at cache row `row` into slot ST, once its last reader released
        the slot's previous one (empty, parity `free`)."""
        i = 3 * ST + PART
        mbarrier.wait(empty.index(i), free)
        if PART == 0:
            mbarrier.expect(full.index(i), KpeDesc.block_type.nbytes)
            tma.async_copy_global_to_shared(KpeDesc, [row, 0], full.index(i), k_s.index(ST))
        elif PART == 1:
            mbarrier.expect(full.index(i), CkvDesc.block_type.nbytes)
            tma.async_copy_global_to_shared(CkvDesc, [row, 0], full.index(i), c0_s.index(ST))
        else:
            mbarrier.expect(full.index(i), CkvDesc.block_type.nbytes)
            tma.async_copy_global_to_shared(CkvDesc, [row, RH], full.index(i), c1_s.index(ST))

    @gluon.jit
    def _loader(CkvDesc, KpeDesc, Table, c0_s, c1_s, k_s, full, empty, b, s_tb, start, n_tiles,
                PS: gl.constexpr, RH: gl.constexpr, NSETS: gl.constexpr):
        """Pair j's tiles A (slot 2 (j % NSETS)) and B (the next slot), part by part, each once its last reader
        released it: with two sets, pair j + 1 loads while pair j computes."""
        BN: gl.constexpr = c0_s.shape[1]
        for j in range(gl.cdiv(n_tiles, 2)):
            sa = (j % NSETS) * 2
            free = ((j // NSETS) & 1) ^ 1  # a fresh barrier passes parity 1 at once
            t_a = start + 2 * j * BN
            row_a = gl.load(Table + b * s_tb + t_a // PS) * PS + t_a % PS
            row_b = -BN
            if 2 * j + 1 < n_tiles:
                t_b = t_a + BN
                row_b = gl.load(Table + b * s_tb + t_b // PS) * PS + t_b % PS
            for part in gl.static_range(3):
                _load_part(CkvDesc, KpeDesc, c0_s, c1_s, k_s, full, empty, row_a, free, sa, part, RH)
            for part in gl.static_range(3):
                _load_part(CkvDesc, KpeDesc, c0_s, c1_s, k_s, full, empty, row_b, free, sa + 1, part, RH)

    @gluon.jit
    def _p_view(k_s, s, BLOCK_H: gl.constexpr, BN: gl.constexpr, P_SL: gl.constexpr):
        """Slot s's rope buffer [BN, P] as p [BLOCK_H, BN] (same bytes; p is written once the rope scores are done)."""
        if BN == k_s.shape[2]:
            v = k_s.index(s)
        else:
            v = k_s.index(s)._reinterpret(k_s.dtype, [BLOCK_H, BN], P_SL)
        return v

    @gluon.jit
    def _warpgroup(WG: gl.constexpr, q0_s, q1_s, qp_s, c0_s, c1_s, k_s, full, empty, p_ready, m_x, l_x, l_ready, O, L,
                   b, hb, split, H, start, end, n_tiles, scale_log2, s_on, s_ob, s_oh, s_ln, s_lb, s_lh,
                   RH: gl.constexpr, NSETS: gl.constexpr):
        """decode_seesaw._seesaw_warpgroup (one query token) over BN-token tiles in NSETS sets of slots."""
        BLOCK_H: gl.constexpr = q0_s.shape[0]
        BN: gl.constexpr = c0_s.shape[1]
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, RH, 16])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        P_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BN], c0_s.dtype)
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        ROW: gl.constexpr = gl.SliceLayout(1, S_L)
        OTHER: gl.constexpr = 1 - WG
        if WG == 0:
            c_own = c0_s
        else:
            c_own = c1_s
        dt: gl.constexpr = c0_s.dtype
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=ROW)
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=ROW)
        acc = gl.zeros([BLOCK_H, RH], gl.float32, layout=O_L)
        s0 = gl.zeros([BLOCK_H, BN], gl.float32, layout=S_L)
        for j in range(gl.cdiv(n_tiles, 2)):
            ph = (j // NSETS) & 1
            sa = (j % NSETS) * 2
            sb = sa + 1
            so = sa + WG
            t_own = start + (2 * j + WG) * BN
            partial = (t_own < end) & (t_own + BN > end)
            if partial:
                for part in gl.static_range(3):
                    mbarrier.wait(full.index(3 * so + part), ph)
                _zero_rows(c0_s.index(so), t_own, end, LD)
                _zero_rows(c1_s.index(so), t_own, end, LD)
                _zero_rows(k_s.index(so), t_own, end, LD)
                fence_async_shared()
                gl.thread_barrier()
            mbarrier.wait(full.index(3 * so), ph)
            s = warpgroup_mma(qp_s, k_s.index(so).permute((1, 0)), s0, use_acc=False, is_async=True)
            mbarrier.wait(full.index(3 * so + 1), ph)
            s = warpgroup_mma(q0_s, c0_s.index(so).permute((1, 0)), s, is_async=True)
            mbarrier.wait(full.index(3 * so + 2), ph)
            s = warpgroup_mma(q1_s, c1_s.index(so).permute((1, 0)), s, is_async=True)
            if WG == 0:
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                m_a, alpha, p = _softmax(s, t_own, end, m_i, scale_log2, S_L)
                _p_view(k_s, sa, BLOCK_H, BN, P_SL).store(p.to(dt))
                m_x.index(0).store(m_a)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(p_ready.index(0))
                l_i = l_i * alpha + gl.sum(p, 1)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
                acc = warpgroup_mma(gl.convert_layout(p.to(dt), P_L), c_own.index(sa), acc, is_async=True)
                mbarrier.wait(p_ready.index(1), j & 1)
                m_b = m_x.index(1).load(ROW)
                alpha = _rescale(m_a, m_b)
                l_i = l_i * alpha
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index(3 * sa + 1))  # c0_A read for the last time
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
                acc = warpgroup_mma(_p_view(k_s, sb, BLOCK_H, BN, P_SL), c_own.index(sb), acc, is_async=True)
            else:
                mbarrier.wait(p_ready.index(0), j & 1)
                m_a = m_x.index(0).load(ROW)
                alpha = _rescale(m_i, m_a)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
                acc = warpgroup_mma(_p_view(k_s, sa, BLOCK_H, BN, P_SL), c_own.index(sa), acc, is_async=True)
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
                m_b, alpha_b, p = _softmax(s, t_own, end, m_a, scale_log2, S_L)
                _p_view(k_s, sb, BLOCK_H, BN, P_SL).store(p.to(dt))
                m_x.index(1).store(m_b)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(p_ready.index(1))
                l_i = l_i * alpha * alpha_b + gl.sum(p, 1)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index(3 * sa))  # rope_A (p_A) and c1_A read for the last time
                mbarrier.arrive(empty.index(3 * sa + 2))
                acc = acc * gl.convert_layout(alpha_b, gl.SliceLayout(1, O_L))[:, None]
                acc = warpgroup_mma(gl.convert_layout(p.to(dt), P_L), c_own.index(sb), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if WG == 0:  # rope_B (p_B) and c0_B read for the last time
                mbarrier.arrive(empty.index(3 * sb))
                mbarrier.arrive(empty.index(3 * sb + 1))
            else:  # c1_B
                mbarrier.arrive(empty.index(3 * sb + 2))
            m_i = m_b

        l_x.index(WG).store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(l_ready)
        mbarrier.wait(l_ready, 0)
        l_i = l_i + l_x.index(OTHER).load(ROW)
        has = l_i > 0
        inv = gl.convert_layout(1.0 / gl.where(has, l_i, 1.0), gl.SliceLayout(1, O_L))[:, None]
        oh = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
        orr = gl.arange(0, RH, layout=gl.SliceLayout(0, O_L))
        o_ptr = O + split.to(gl.int64) * s_on + b * s_ob + oh[:, None] * s_oh + WG * RH + orr[None, :]
        gl.store(o_ptr, acc * inv, mask=(oh < H)[:, None] & (orr < RH)[None, :])
        if WG == 0:
            lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
            lh = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW)
            gl.store(L + split * s_ln + b * s_lb + lh * s_lh, lse, mask=lh < H)

    @gluon.jit
    def _zero_rows(buf, t0, end, LD: gl.constexpr):
        rows = t0 + gl.arange(0, buf.shape[0], layout=gl.SliceLayout(1, LD))
        v = buf.load(LD)
        buf.store(gl.where((rows < end)[:, None], v, gl.zeros_like(v)))

    @gluon.jit
    def _softmax(s, t0, end, m_prev, scale_log2, S_L: gl.constexpr):
        t = t0 + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, S_L))
        s = gl.where((t < end)[None, :], s * scale_log2, float("-inf"))
        m_new = gl.maximum(m_prev, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        return m_new, gl.exp2(m_prev - m_use), gl.exp2(s - m_use[:, None])

    @gluon.jit
    def _rescale(m_from, m_to):
        return gl.exp2(m_from - gl.where(m_to == float("-inf"), 0.0, m_to))

    @gluon.jit
    def _kernel(Qn, Qp, CkvDesc, KpeDesc, Ckv, Kpe, Table, Lens, O, L, scale_log2, H,
                s_qnb, s_qnh, s_qpb, s_qph, s_cp, s_cs, s_kp, s_ks, s_tb, s_on, s_ob, s_oh, s_ln, s_lb, s_lh,
                n_splits, n_query, heads_per_query, s_lenb, s_lenq, causal,
                PS: gl.constexpr, RH: gl.constexpr, P: gl.constexpr, BLOCK_H: gl.constexpr, BN: gl.constexpr,
                NSETS: gl.constexpr):
        gl.static_assert(BLOCK_H * BN == BN * P, "p [heads, tokens] reuses the [tokens, rope] buffer")
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        dt: gl.constexpr = CkvDesc.dtype
        hb = gl.program_id(0)
        b = gl.program_id(1).to(gl.int64)
        split = gl.program_id(2)
        n = gl.load(Lens + b)
        start, end, _ = G.split_bounds(n, split, n_splits, BN)
        n_tiles = gl.cdiv(gl.maximum(end - start, 0), BN)
        q0_s, q1_s, qp_s = G.q_to_smem(Qn, Qp, b, hb, H, s_qnb, s_qnh, s_qpb, s_qph, dt, RH, P, BLOCK_H, LD)
        c0_s = gl.allocate_shared_memory(dt, [2 * NSETS, BN, RH], CkvDesc.layout)
        c1_s = gl.allocate_shared_memory(dt, [2 * NSETS, BN, RH], CkvDesc.layout)
        k_s = gl.allocate_shared_memory(dt, [2 * NSETS, BN, P], KpeDesc.layout)
        VEC_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        m_x = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], VEC_SL)
        l_x = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], VEC_SL)
        full = gl.allocate_shared_memory(gl.int64, [2 * NSETS * 3, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2 * NSETS * 3, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        l_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2 * NSETS * 3):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(l_ready, count=2)
        fence_async_shared()
        gl.thread_barrier()
        gl.warp_specialize([
            (_warpgroup, (0, q0_s, q1_s, qp_s, c0_s, c1_s, k_s, full, empty, p_ready, m_x, l_x, l_ready, O, L,
                          b, hb, split, H, start, end, n_tiles, scale_log2, s_on, s_ob, s_oh, s_ln, s_lb, s_lh, RH,
                          NSETS)),
            (_warpgroup, (1, q0_s, q1_s, qp_s, c0_s, c1_s, k_s, full, empty, p_ready, m_x, l_x, l_ready, O, L,
                          b, hb, split, H, start, end, n_tiles, scale_log2, s_on, s_ob, s_oh, s_ln, s_lb, s_lh, RH,
                          NSETS)),
            (_loader, (CkvDesc, KpeDesc, Table, c0_s, c1_s, k_s, full, empty, b, s_tb, start, n_tiles, PS, RH,
                       NSETS)),
        ], [4, 1], [S.WG_REGS, S.LOADER_REGS])


def constexprs(R: int, P: int, page_size: int, BN: int, NSETS: int) -> dict:
    return dict(PS=page_size, RH=R // 2, P=P, BLOCK_H=G.BLOCK_H, BN=BN, NSETS=NSETS)


def descriptor_templates(ckv_cache, kpe_cache, BN: int) -> tuple:
    """_gluon.descriptor_templates with BN-row boxes."""
    NP, PS, R = ckv_cache.shape
    P = kpe_cache.shape[2]
    gdt = G._gl_dtype(ckv_cache.dtype)
    c_layout = gl.NVMMASharedLayout.get_default_for([BN, R // 2], gdt)
    k_layout = gl.NVMMASharedLayout.get_default_for([BN, P], gdt)
    return without_bases((
        TensorDescriptor(ckv_cache, [NP * PS, R], [slot_stride(ckv_cache), 1], [BN, R // 2], c_layout),
        TensorDescriptor(kpe_cache, [NP * PS, P], [slot_stride(kpe_cache), 1], [BN, P], k_layout)))


def stage1_plan(BN: int, NSETS: int):
    """A maker with decode_seesaw.stage1_plan's contract for the variant (run by decode_wgmma.run_stage1)."""
    def make(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, o, l, s_on, s_ln, ns, n_query=1):
        B, H, R = q_nope.shape
        PS, P = ckv_cache.shape[1], kpe_cache.shape[2]
        templates = descriptor_templates(ckv_cache, kpe_cache, BN)
        bound = bind(_kernel, (cdiv(H, G.BLOCK_H), B, ns), templated_at(2, templates),
                     **constexprs(R, P, PS, BN, NSETS), num_warps=S.NUM_WARPS, maxnreg=S.MAX_REGS)
        numbers = (sm_scale * G.LOG2E, H,
                   *G.strides(q_nope, q_pe, ckv_cache, kpe_cache, block_table, o, l, s_on, s_ln, ns),
                   *query_limit_args(seq_lens, n_query, H))
        return bound, templates, numbers
    return make


def aot(BN: int, NSETS: int, R: int = 512, P: int = 64, page_size: int = 64) -> dict:
    """The variant compiled for sm_90a without a GPU (tools/aot.py): shared bytes, registers, spills, advisories."""
    sys.path.insert(0, str(ROOT))
    from tools import aot as A

    desc = {name: f"tensordesc<bf16[{BN}, {w}],{gl.NVMMASharedLayout.get_default_for([BN, w], gl.bfloat16)!r}>"
            for name, w in (("CkvDesc", R // 2), ("KpeDesc", P))}
    desc.update({name: "*bf16" for name in ("Qn", "Qp", "Ckv", "Kpe")})
    return A.compile_sm90(_kernel, constexprs(R, P, page_size, BN, NSETS), desc, S.NUM_WARPS, 1, gluon=True)


def variant_plan(qn, qp, ckv, kpe, table, lens, scale, BN: int, NSETS: int):
    """The product's seesaw plan (split count, partials, merge) with this file's stage 1."""
    cfg = dispatch._config(qn, ckv, False, "seesaw")
    plan = D.decode_plan(qn, qp, ckv, kpe, table, lens, scale, cfg=cfg)
    assert plan.kind == "seesaw", plan.kind
    meta = torch.device("meta")
    ns = plan.ns
    o, l = ((torch.empty(plan.out_shape, device=meta), torch.empty(plan.lse_shape, device=meta)) if ns == 1 else
            (torch.empty(plan.partial_shapes[0], device=meta), torch.empty(plan.partial_shapes[1], device=meta)))
    s_on, s_ln = (0, 0) if ns == 1 else (o.stride(0), l.stride(0))
    plan.stage1 = stage1_plan(BN, NSETS)(qn, qp, ckv, kpe, table, lens, scale, o, l, s_on, s_ln, ns)
    plan.run = plan._runner()
    return plan


def reference(qn, qp, ckv, kpe, table, n, scale, b=0):
    """float64 (out [H, R], lse [H]) of request b's first n tokens (any n: token t at page table[b, t // PS], row
    t % PS), on the device."""
    t = torch.arange(n, device=qn.device)
    pages, rows = table[b, t // ckv.shape[1]].long(), t % ckv.shape[1]
    c, k = ckv[pages, rows].double(), kpe[pages, rows].double()
    s = scale * (qn[b].double() @ c.T + qp[b].double() @ k.T)
    return torch.softmax(s, dim=-1) @ c, torch.logsumexp(s, dim=-1)


def run_shape(H: int, B: int, L: int, variants, copy_bw: float) -> dict:
    R, P, DT = BO.R, BO.P, BO.DT
    scale = 192 ** -0.5
    ckv = torch.empty(B * L // BO.PS + 1, BO.PS, R, dtype=DT, device="cuda").normal_()
    kpe = torch.empty(B * L // BO.PS + 1, BO.PS, P, dtype=DT, device="cuda").normal_()
    table = (torch.randperm(B * L // BO.PS, device="cuda").to(torch.int32) + 1).view(B, L // BO.PS)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    lens[0] = L - 37  # a partial last tile in request 0
    qn = torch.randn(B, H, R, dtype=DT, device="cuda")
    qp = torch.randn(B, H, P, dtype=DT, device="cuda")
    row = dict(H=H, B=B, L=L)
    seesaw = dispatch._config(qn, ckv, False, "seesaw")
    own = dispatch.own_decode_config(qn, qp, ckv, kpe)
    row.update(auto_kernel=own.kernel, splits=D.num_splits(B, H, L, qn.device, seesaw))

    def product(cfg):
        return lambda: D.decode(qn, qp, ckv, kpe, table, lens, scale, cfg=cfg)

    ref = product(seesaw)()
    want = reference(qn, qp, ckv, kpe, table, int(lens[0]), scale)
    times = {"auto": BO.ms(product(own), graph=True), "seesaw": BO.ms(product(seesaw), graph=True)}
    row["check"] = "ok"
    for spec in variants:
        BN, NSETS = map(int, spec.split(":"))
        name = f"v{BN}x{NSETS}"
        plan = variant_plan(qn, qp, ckv, kpe, table, lens, scale, BN, NSETS)
        got = plan(qn, qp, ckv, kpe, table, lens)
        row[f"{name}_err_out"], row[f"{name}_err_lse"] = BO.attention_errors(got[0][0], got[1][0], *want)
        row[f"{name}_vs_seesaw_out"], row[f"{name}_vs_seesaw_lse"] = BO.attention_errors(*got, *ref)
        if row[f"{name}_err_out"] > BO.OUT_TOL or row[f"{name}_err_lse"] > BO.LSE_TOL or \
                row[f"{name}_vs_seesaw_out"] > BO.OUT_TOL or row[f"{name}_vs_seesaw_lse"] > BO.LSE_TOL:
            row["check"] = "FAILED"
        times[name] = BO.ms(lambda: plan(qn, qp, ckv, kpe, table, lens), graph=True)
    if BO.FI.available():
        try:
            fi_run = BO.FI.plan(qn, qp, ckv, table, lens, scale).raw
            times["flashinfer"] = BO.ms(lambda: fi_run(qn, qp, ckv, kpe), graph=True)
        except Exception as e:  # report, keep going
            row["flashinfer_error"] = repr(e)[:300]
    if BO.FMLA.available():
        try:
            import flash_mla as fm

            fkv = BO.flashmla_copy(ckv, kpe)[2]
            times["flashmla"] = BO.ms(BO.flashmla_alone(fm, qn, qp, fkv, table, lens, scale), graph=True)
            del fkv
        except Exception as e:  # report, keep going
            row["flashmla_error"] = repr(e)[:300]
    row["us"] = {k: round(v * 1e3, 2) for k, v in times.items()}
    flops = D.flops(B, H, L, R, P)
    row["tflops"] = {k: round(flops / (v * 1e-3) / 1e12, 1) for k, v in times.items()}
    peers = [times[k] for k in ("flashinfer", "flashmla") if k in times]
    if peers:
        row["vs_best_peer"] = {k: round(v / min(peers), 3) for k, v in times.items()}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default="seesaw_n32.json")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="H:B:KV")
    ap.add_argument("--variants", nargs="+", default=["32:2", "64:1"], help="BN:NSETS")
    args = ap.parse_args()
    copy_bw = BO.copy_bandwidth()
    results = dict(device=torch.cuda.get_device_name(), copy_bw_TBps=copy_bw / 1e12, rows=[])
    for spec in args.shapes:
        H, B, L = map(int, spec.split(":"))
        try:
            row = run_shape(H, B, L, args.variants, copy_bw)
        except Exception as e:  # report, keep going
            row = dict(H=H, B=B, L=L, error=repr(e)[:800])
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
