"""Lab probe of the FP8 cache's swap-AB Gluon stage 1 (mla_compile/kernels/decode_fp8_swapab.py: the kernel and
its design are explained there): checks it on the GPU against float64, times it beside the other decode paths, and
compiles its builds for sm_90a on the CPU.

Builds are written N:W:S[:PRE[:SLAB]][:bf16] (`Build`: the product's `Tiling` fields, N heads per program, W warps,
S staging slots, PRE rows of group 0 converted before the wait, SLAB rows per store; `:bf16` the comparison
variant EXACT=False, which rounds value x scale to a bf16 tile, instead of the product's exact scheme: the raw e4m3
values in an fp16 tile, the scales applied to the fp32 products).

    python benchmarks/lab/fp8_swapab.py OUT.json [--shapes H:B:KV ...] [--configs N:W:S ...]
                                        [--table pages tiles runs holes shuffled]
    python benchmarks/lab/fp8_swapab.py --aot          (CPU: compile for sm_90a, registers / shared / spills)
    python benchmarks/lab/fp8_swapab.py --emulate      (CPU: both schemes' arithmetic vs float64, the tolerances)
    FP8SWAP_ARGS="..." bash benchmarks/device.sh fp8swap

On the GPU: check() against a float64 reference over the exactly dequantized cache (several shapes, lengths that
are no multiple of 64, a request of length 0 and 1, shuffled pages, NaN bytes in every unused slot), then CUDA-graph
replay medians (do_bench_cudagraph) side by side on the same tokens: the product default (stage1_plan / run_stage1)
+ merge (and stage 1 alone), `torch.ops.mla.decode` on the FP8 cache (kernels/decode_fp8.py), the op on a bf16 cache
of the same values, FlashMLA's dense bf16 / FP8 decode when `flash_mla` imports (benchmarks/fp8_decode.py's calls),
and other builds (EXTRA, --configs).

--table: "pages" (default: the above, page 64, the TMA form) and page-size-1 token tables (what the HF pass hands over),
each timed in the GATHER form (row copies through the table) and the TOKENS form (a tile of consecutive rows as the TMA
form's boxes, others row copies), stage 1 + merge and stage 1 alone, request 0 checked against float64 first: "tiles" (a
buffer laid out as the "pages" row's, shuffled pages of 64, through a token table of their slots: every tile one page,
so the TOKENS form takes boxes throughout, over the layout the TMA form reads), "runs" (each request one run of
consecutive rows off the tile edges: a static cache), "holes" (each request's rows from a range 64 longer: ~64 tiles of
its 512 at 32K broken), "shuffled" (rows anywhere: every tile row copies, what the check costs the TOKENS form).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # fp8_decode's / bench_ops' helpers, op_timing_out
sys.path.insert(0, str(ROOT))  # tools/aot.py (--aot)

from mla_compile import fp8  # noqa: E402
from mla_compile.kernels import _gluon as G  # noqa: E402
from mla_compile.kernels import decode_fp8_swapab as K  # noqa: E402
from mla_compile.kernels._util import cdiv  # noqa: E402

R, P, GW, GROUPS, W_TOKEN, BLOCK_T, BLOCK_HS = K.R, K.P, K.GW, K.GROUPS, K.W_TOKEN, K.BLOCK_T, K.BLOCK_HS


@dataclasses.dataclass(frozen=True)
class Build:
    """A product `Tiling` (its `exact`: the product's arithmetic; False: the bf16-dequantizing comparison variant,
    the kernel's EXACT=False). Written N:W:S[:PRE[:SLAB]][:bf16]."""
    tiling: K.Tiling

    @property
    def exact(self) -> bool:
        return self.tiling.exact

    @property
    def name(self) -> str:
        t = self.tiling
        return f"{t.N}:{t.warps}:{t.stages}:{t.pre}:{t.slab}" + ("" if t.exact else ":bf16")

    @staticmethod
    def parse(text: str) -> Build:
        parts = text.split(":")
        exact = parts[-1] != "bf16"
        return Build(K.Tiling(*(int(x) for x in (parts if exact else parts[:-1])), exact=exact))

    def constexprs(self, page_size: int) -> dict:
        return self.tiling.constexprs(page_size)


def default_build(H: int) -> Build:
    return Build(K.default_tiling(H))


def auto_splits(programs: int, capacity: int, device) -> int:
    """KV splits so that programs x splits fills the SMs once (one program per SM: ~190-225 KB of shared memory
    each), never more splits than 64-token tiles in the block table's capacity."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(sms // max(programs, 1), cdiv(max(capacity, 1), BLOCK_T)))


def stage1(q_nope, q_pe, buf, block_table, seq_lens, sm_scale, n_splits=None, *, build: Build | None = None,
           outs=None, lses=None, tokens: bool | None = None):
    """Stage 1 only: (outs fp32 [n_splits, B, H, 512] normalised partial outs, lses fp32 [n_splits, B, H]
    natural-log lses; -inf, out 0, for a split without tokens). build: default `default_build(H)`; n_splits:
    default `auto_splits`; outs / lses: preallocated outputs to write; tokens: over a page-size-1 buffer, the
    TOKENS form (True) or GATHER (False; None: the product's choice). Launched through the product's `stage1_plan`
    / `run_stage1` (its `descriptors` over fp8.views)."""
    B, H, _ = q_nope.shape
    bld = build or default_build(H)
    t = bld.tiling
    ckv, scale, kpe = fp8.views(buf, R)
    PS = buf.shape[1]
    assert q_nope.shape[2] == R and q_pe.shape[2] == P and q_nope.dtype == q_pe.dtype == torch.bfloat16
    assert K.eligible(ckv, kpe, scale) or K.gather_eligible(ckv, kpe, scale)
    assert block_table.dtype == seq_lens.dtype == torch.int32
    hb = cdiv(H, t.N)
    ns = n_splits or auto_splits(B * hb, block_table.shape[1] * PS, q_nope.device)
    if outs is None:
        outs = torch.empty(ns, B, H, R, dtype=torch.float32, device=q_nope.device)
        lses = torch.empty(ns, B, H, dtype=torch.float32, device=q_nope.device)
    assert outs.shape == (ns, B, H, R) and outs.stride(3) == 1 and lses.shape == (ns, B, H)
    plan = K.stage1_plan(q_nope, q_pe, ckv, kpe, scale, block_table, sm_scale, outs, lses, outs.stride(0),
                         lses.stride(0), ns, t, tokens)
    K.run_stage1(plan, q_nope, q_pe, ckv, kpe, scale, block_table, seq_lens, outs, lses)
    return outs, lses


def launch(q_nope, q_pe, buf, block_table, seq_lens, sm_scale, n_splits=None, *, build: Build | None = None,
           tokens: bool | None = None):
    """q_nope [B, H, 512] bf16, q_pe [B, H, 64] bf16, buf uint8 [NP, PS, 656] (fp8.py's format; PS a multiple of
    64, or 1 under a token table: `tokens` as in `stage1`), block_table int32 [B, max_pages], seq_lens int32 [B] ->
    (out [B, H, 512] bf16, lse [B, H] fp32, natural log; an empty request gives (0, -inf)): stage 1 (`stage1`), then
    kernels/merge.py over the splits."""
    from mla_compile.kernels.merge import merge_into

    outs, lses = stage1(q_nope, q_pe, buf, block_table, seq_lens, sm_scale, n_splits, build=build, tokens=tokens)
    B, H, _ = q_nope.shape
    out = torch.empty(B, H, R, dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.empty(B, H, dtype=torch.float32, device=q_nope.device)
    merge_into(outs, lses, out, lse)
    return out, lse


# ------------------------------------------------------------------------------------------------- correctness


def reference(q_nope, q_pe, buf, block_table, seq_lens, sm_scale, tile_values: bool = False):
    """float64 (out [B, H, 512], lse [B, H]) over the dequantized cache (fp8.dequantize in float64, the rope from the
    buffer): token t of request b at slot block_table[b, t // PS] * PS + t % PS; an empty request gives (0, -inf).
    tile_values: the values the bf16 variant's tile holds instead, bf16(float32(e4m3) * scale) (then float64 math):
    what is left between that variant and this is P in bf16, fp32 sums and the bf16 out. (The exact builds' tile
    holds the dequantized values exactly: the plain reference is theirs.)"""
    B, H, _ = q_nope.shape
    PS = buf.shape[1]
    ckv, scale, kpe = fp8.views(buf, R)
    ckv, scale, kpe = ckv.reshape(-1, R), scale.reshape(-1, GROUPS), kpe.reshape(-1, P)
    out = torch.zeros(B, H, R, dtype=torch.float64, device=q_nope.device)
    lse = torch.full((B, H), float("-inf"), dtype=torch.float64, device=q_nope.device)
    for b in range(B):
        n = int(seq_lens[b])
        if n == 0:
            continue
        t = torch.arange(n, device=buf.device)
        slots = block_table[b].long()[t // PS] * PS + t % PS
        if tile_values:
            c = fp8.dequantize(ckv[slots], scale[slots], torch.float32).to(torch.bfloat16).double()
        else:
            c = fp8.dequantize(ckv[slots], scale[slots], torch.float64)
        s = sm_scale * (q_nope[b].double() @ c.T + q_pe[b].double() @ kpe[slots].double().T)
        out[b] = torch.softmax(s, -1) @ c
        lse[b] = torch.logsumexp(s, -1)
    return out, lse


# Tolerances, from a CPU emulation of the kernels' arithmetic on these CHECKS cases (`emulate`, --emulate):
# EXACT (the product): e4m3 in fp16 and q prescaled to fp16 (exact), the scales on the fp32 products, P x scale / top
# in fp16, fp32 sums, the bf16 out: vs `reference` out <= 3.6e-3 (the bf16 out's rounding), lse <= 2.1e-6.
# bf16 variant (value x scale rounded to bf16, P in bf16): vs `reference` over the values the tile holds
# (tile_values) out 3.5e-3, lse 2.4e-6; vs the exact dequantized values out 1.1e-2, lse 2.9e-2 (rounding the values
# to bf16 moves scores of up to ~+-10 by ~1e-2). A masked row leaking, a wrong scale or a dropped tile is far
# outside either pair.
OUT_TOL, LSE_TOL = 1e-2, 1e-3  # exact builds vs reference(): the product contract (fp32-accumulation tolerance)
TILE_OUT_TOL, TILE_LSE_TOL = 1e-2, 2e-4  # bf16 variant vs reference(tile_values=True)
BF16_OUT_TOL, BF16_LSE_TOL = 3e-2, 5e-2  # bf16 variant vs reference(): the accuracy of bf16 dequantized values
LENS = [0, 1, 63, 65, 1000, 4097, 64, 130]  # none a multiple of 64 but 0 and 64; an empty request, a 1-token one
CHECKS = [  # (H, lens, page size, n_splits (None: auto), build (None: default_build(H)))
    (16, LENS, 64, None, None),
    (16, LENS, 64, 7, None),  # several splits per request: empty splits, partial last tiles of splits
    (16, LENS, 64, 40, None),  # mostly empty splits
    (16, [777], 64, 1, None),  # one split: the whole request in one program
    (16, [5000, 129], 128, None, None),  # pages of two tiles (tile row offset t0 % PS = 64)
    (16, LENS, 64, None, "16:8:3"),
    (16, LENS, 64, None, "16:4:2:0:64"),
    (16, LENS, 64, 5, "16:4:3:64:16"),
    (16, LENS, 64, 7, "16:4:3:bf16"),  # the bf16-dequantizing comparison variant
    (24, [300, 2049, 0], 64, None, None),  # heads past H inside the block
    (40, [300, 2049, 0], 64, None, None),  # heads past H inside a block of 64
    (32, LENS, 64, None, None),
    (32, [3000, 70], 64, 3, "32:4:2"),
    (64, LENS, 64, None, None),
    (64, [2500, 1], 64, 9, None),
    (80, [700, 65], 64, None, None),  # two head blocks of 64, the second partial
    (64, LENS, 64, 4, "64:8:2:64:64:bf16"),
]


def build(lens, H, seed: int, page_size: int = 64, spare_pages: int = 3, device="cuda"):
    """(q_nope, q_pe, buf, block_table, seq_lens) on `device`: every byte of the buffer starts 0xFF (NaN in all three
    views: e4m3, the float32 scales, the bf16 rope), then each request's tokens are written quantized into shuffled
    pages, so every unused slot (past a request's length, unused pages) holds NaN. Token magnitudes vary (0.01..3)
    per token and scale group, so the scales differ."""
    gen = torch.Generator(device=device).manual_seed(seed)
    B = len(lens)
    per = max(cdiv(max(lens), page_size), 1)
    NP = B * per + spare_pages
    buf, ckv, scale, kpe = fp8.allocate(NP, page_size, R, P, device=device)
    buf.fill_(0xFF)
    table = torch.randperm(NP, generator=gen, device=device)[:B * per].view(B, per).to(torch.int32)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        t = torch.arange(n, device=device)
        slots = table[b].long()[t // page_size] * page_size + t % page_size
        mag = 10 ** (torch.rand(n, GROUPS, 1, generator=gen, device=device) * 2.5 - 2)
        x = (torch.randn(n, GROUPS, GW, generator=gen, device=device) * mag).view(n, R)
        q8, sc = fp8.quantize(x)
        ckv.reshape(-1, R)[slots] = q8
        scale.reshape(-1, GROUPS)[slots] = sc
        kpe.reshape(-1, P)[slots] = torch.randn(n, P, generator=gen, device=device).to(torch.bfloat16)
    q_nope = torch.randn(B, H, R, generator=gen, device=device).to(torch.bfloat16)
    q_pe = torch.randn(B, H, P, generator=gen, device=device).to(torch.bfloat16)
    return q_nope, q_pe, buf, table, torch.tensor(lens, dtype=torch.int32, device=device)


def emulate(q_nope, q_pe, buf, block_table, seq_lens, sm_scale, exact: bool = True, n_splits: int = 1):
    """The kernel's arithmetic on the CPU (torch, float32 matmuls for the fp32-accumulating MMAs), one split of a
    request after another, then the splits merged as kernels/merge.py does (float32) -> (out bf16 [B, H, 512], lse
    [B, H]). exact: the product's scheme (`_tile`, EXACT): the e4m3 values in fp16, q_nope x 2^-e in fp16 (one power
    of two for all heads), S^T = scale_log2 rope + sum_g scale_g (K8_g . q_g) 2^e scale_log2, P^T x scale_g / top_g in
    fp16, acc_g in units of top_g; else the bf16 variant (bf16(value x scale) tile, one P^T in bf16)."""
    B, H, _ = q_nope.shape
    PS = buf.shape[1]
    ckv, scale, kpe = fp8.views(buf, R)
    ckv, scale, kpe = ckv.reshape(-1, R), scale.reshape(-1, GROUPS), kpe.reshape(-1, P)
    out = torch.zeros(B, H, R, dtype=torch.bfloat16)
    lse = torch.full((B, H), float("-inf"))
    log2e, f32 = 1.4426950408889634, torch.float32
    scale_log2 = torch.tensor(sm_scale * log2e, dtype=f32)
    for b in range(B):
        n = int(seq_lens[b])
        qp = q_pe[b].to(f32)
        if exact:
            qf = q_nope[b].to(f32)
            ex = max(int((qf.abs().max().view(torch.int32) >> 23) & 255), 14)
            pre = torch.tensor(2.0 ** (140 - ex), dtype=f32)
            qh = (qf * pre).to(torch.float16).to(f32).view(H, GROUPS, GW)
            uq = torch.tensor(2.0 ** (ex - 140), dtype=f32) * scale_log2
        else:
            qh = q_nope[b].to(f32).view(H, GROUPS, GW)
        split_len = cdiv(cdiv(n, n_splits), BLOCK_T) * BLOCK_T
        parts = []
        for sp in range(n_splits):
            start, end = sp * split_len, min(n, (sp + 1) * split_len)
            m = torch.full((H,), float("-inf"))
            l_ = torch.zeros(H)
            acc = torch.zeros(GROUPS, GW, H)
            tops = torch.ones(GROUPS)
            for t0 in range(start, end, BLOCK_T):
                t = torch.arange(t0, min(t0 + BLOCK_T, end))
                slots = block_table[b].long()[t // PS] * PS + t % PS
                k8 = ckv[slots].to(f32).view(-1, GROUPS, GW)  # e4m3 values: exact in fp16 and float32
                sg = scale[slots]  # [T, GROUPS]
                s = (kpe[slots].to(f32) @ qp.T) * scale_log2  # [T, H]
                if exact:
                    lat = sum((k8[:, g] @ qh[:, g].T) * sg[:, g:g + 1] for g in range(GROUPS))
                    s = s + lat * uq
                    vals = k8
                else:
                    vals = (k8 * sg[:, :, None]).to(torch.bfloat16).to(f32)
                    s = s + sum(vals[:, g] @ qh[:, g].T for g in range(GROUPS)) * scale_log2
                m_new = torch.maximum(m, s.max(0).values)
                alpha = torch.exp2(m - m_new)
                p = torch.exp2(s - m_new)
                l_ = l_ * alpha + p.sum(0)
                m = m_new
                if exact:
                    u = sg.max(0).values
                    for g in range(GROUPS):
                        pg = (p * (sg[:, g:g + 1] * (1.0 / u[g]))).to(torch.float16).to(f32)
                        acc[g] = acc[g] * (alpha * (tops[g] / u[g]))[None, :] + vals[:, g].T @ pg
                    tops = u
                else:
                    pb = p.to(torch.bfloat16).to(f32)
                    for g in range(GROUPS):
                        acc[g] = acc[g] * alpha[None, :] + vals[:, g].T @ pb
            if end > start:
                o = (acc * tops[:, None, None]).permute(2, 0, 1).reshape(H, R) / l_[:, None]
                parts.append((o, (m + torch.log2(l_)) * 0.6931471805599453))
        if parts:
            ls = torch.stack([x[1] for x in parts])
            lse[b] = torch.logsumexp(ls, 0)
            w = torch.exp(ls - lse[b])
            out[b] = sum(w[j][:, None] * parts[j][0] for j in range(len(parts))).to(torch.bfloat16)
    return out, lse


def emulation(exact: bool = True, sm_scale: float = (128 + 64) ** -0.5) -> list[dict]:
    """`emulate` on every CHECKS case (CPU, splits as the case says, 8 when automatic) against `reference`."""
    rows = []
    for k, (H, lens, page_size, ns, _) in enumerate(CHECKS):
        qn, qp, buf, table, lens_t = build(lens, H, seed=k, page_size=page_size, device="cpu")
        out, lse = emulate(qn, qp, buf, table, lens_t, sm_scale, exact, ns or 8)
        row = dict(H=H, lens=lens, exact=exact, **errors(out, lse, *reference(qn, qp, buf, table, lens_t, sm_scale)))
        if not exact:
            tile = errors(out, lse, *reference(qn, qp, buf, table, lens_t, sm_scale, tile_values=True))
            row.update(tile_out_err=tile["out_err"], tile_lse_err=tile["lse_err"])
        print("emulate", row, flush=True)
        rows.append(row)
    return rows


def errors(out, lse, want_out, want_lse) -> dict:
    """out_err: max over requests of max |out - want| / max |want| (its request's); lse_err: max |lse - want| over
    the non-empty rows; empty_ok: the empty rows are exactly (0, -inf); finite: no NaN / inf in out."""
    empty = torch.isneginf(want_lse)
    full = ~empty.all(1)
    scale = want_out.abs().amax((1, 2)).clamp_min(1e-30)
    out_err = float(((out.double() - want_out).abs().amax((1, 2)) / scale)[full].max()) if bool(full.any()) else 0.0
    lse_err = float((lse.double()[~empty] - want_lse[~empty]).abs().max()) if bool((~empty).any()) else 0.0
    empty_ok = bool(torch.isneginf(lse[empty]).all()) and bool((out[empty] == 0).all())
    return dict(out_err=out_err, lse_err=lse_err, empty_ok=empty_ok, finite=bool(torch.isfinite(out).all()))


def check(sm_scale: float = (128 + 64) ** -0.5) -> list[dict]:
    """Every CHECKS case against `reference` over the exactly dequantized values (exact builds: OUT_TOL / LSE_TOL;
    the bf16 variant also over its tile's bf16 values: TILE_*, and BF16_* vs exact); prints one line each; returns
    the rows ("ok": within the tolerances, no NaN / inf, the empty rows exactly (0, -inf))."""
    rows = []
    for k, (H, lens, page_size, ns, text) in enumerate(CHECKS):
        bld = Build.parse(text) if text else default_build(H)
        row = {"H": H, "lens": lens, "page_size": page_size, "n_splits": ns, "build": bld.name}
        try:
            qn, qp, buf, table, lens_t = build(lens, H, seed=k, page_size=page_size)
            out, lse = launch(qn, qp, buf, table, lens_t, sm_scale, ns, build=bld)
            torch.cuda.synchronize()
            row.update(errors(out, lse, *reference(qn, qp, buf, table, lens_t, sm_scale)))
            ok = row["empty_ok"] and row["finite"]
            if bld.exact:
                row["ok"] = ok and row["out_err"] <= OUT_TOL and row["lse_err"] <= LSE_TOL
                what = ""
            else:
                tile = errors(out, lse, *reference(qn, qp, buf, table, lens_t, sm_scale, tile_values=True))
                row.update(tile_out_err=tile["out_err"], tile_lse_err=tile["lse_err"])
                row["ok"] = (ok and row["tile_out_err"] <= TILE_OUT_TOL and row["tile_lse_err"] <= TILE_LSE_TOL
                             and row["out_err"] <= BF16_OUT_TOL and row["lse_err"] <= BF16_LSE_TOL)
                what = f"vs tile values out {row['tile_out_err']:.1e} lse {row['tile_lse_err']:.1e}, "
        except Exception as e:  # noqa: BLE001 - reported per case
            row.update(ok=False, error=repr(e)[:400])
        print(f"check H {H:3d} page {page_size} splits {ns} build {bld.name} lens {lens}: " + (
            what + f"vs exact out {row['out_err']:.1e} lse {row['lse_err']:.1e}, empty {row['empty_ok']}, finite "
            f"{row['finite']}" if "error" not in row else row["error"]) + ("  ok" if row["ok"] else "  FAILED"),
            flush=True)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ ahead of time (CPU)

AOT_CONFIGS = ["16:4:3", "32:8:2", "64:8:2", "16:8:3", "32:4:2", "16:4:3:0:64", "16:4:3:64:16", "16:4:3:bf16",
               "32:8:2:64:64:bf16", "64:8:2:64:64:bf16"]


def aot(configs=None) -> list[dict]:
    """Compile the kernel for sm_90a without a GPU (tools/aot.py: Triton's compiler + its bundled ptxas), page size
    64, for each build (default: the product's tilings for H = 16 / 32 / 64 / 128 first, then variants): registers,
    shared bytes (against the 227 KB limit), spill bytes, ptxas' wgmma advisories (C7514 / C7515: every wgmma
    serialised), wgmma instructions by shape, TMA copies, bar.sync count."""
    import collections
    import re

    from tools import aot as A

    builds = [default_build(h) for h in (16, 32, 64, 128)]
    builds = list({b.name: b for b in builds + [Build.parse(t) for t in configs or AOT_CONFIGS]}.values())
    rows = []
    for bld in builds:
        t = bld.tiling
        row = dict(config=bld.name, p_rope=t.p_rope, smem_estimate=K.smem_bytes(t.N, t.stages, t.p_rope))
        try:
            out = A.fp8_swapab_sm90(t)
        except Exception as e:  # noqa: BLE001 - reported per build
            row["error"] = repr(e)[-2000:]
            rows.append(row)
            print(f"aot {bld.name}: {row['error']}", flush=True)
            continue
        ptx = out["ptx"]
        row.update(registers=out["registers"], spill_bytes=out["spill_bytes"], shared_bytes=out["shared_bytes"],
                   fits=out["shared_bytes"] <= G.SMEM_LIMIT, advisories=out["advisories"],
                   wgmma=dict(collections.Counter(
                       re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+\.\w+\.\w+)", ptx))),
                   tma_copies=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                   bar_sync=len(re.findall(r"\bbar\.sync", ptx)))
        rows.append(row)
        print(f"aot {bld.name:19s} p_rope {t.p_rope!s:5s}: {out['registers']:3d} registers, {out['spill_bytes']} "
              f"spill bytes, {out['shared_bytes']} shared bytes (limit {G.SMEM_LIMIT}), advisories "
              f"{out['advisories']}, wgmma {row['wgmma']}, {row['tma_copies']} TMA copies, {row['bar_sync']} bar.sync",
              flush=True)
    return rows


# ----------------------------------------------------------------------------------------------------- timing

SHAPES = ["16:8:32768", "16:32:32768", "16:8:131072", "32:8:32768", "64:8:32768"]  # H:B:kv per request
# other builds timed per head block (--configs adds more): the bf16-dequantizing variant of the default, variants
EXTRA = {16: ["16:4:3:64:64:bf16", "16:8:3", "16:4:3:0:64"], 32: ["32:8:2:64:64:bf16", "64:8:2", "64:8:2:64:64:bf16"],
         64: ["64:8:2:64:64:bf16"]}


def token_buffer(ckv8: torch.Tensor) -> torch.Tensor:
    """The uint8 [NP, PS, 656] buffer behind fp8_decode.caches' views (it returns the views only)."""
    NP, PS, _ = ckv8.shape
    buf = torch.empty(0, dtype=torch.uint8, device=ckv8.device).set_(ckv8.untyped_storage()).view(NP, PS, W_TOKEN)
    assert buf.data_ptr() == ckv8.data_ptr()
    return buf


def bench(args) -> tuple[list[dict], float]:
    """The timing rows, one per --shapes entry and --table kind (module docstring), and the copy bandwidth (GB/s,
    read + write) their *_bw_frac divide by."""
    from bench_ops import copy_bandwidth

    copy_gbps = copy_bandwidth() / 1e9
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for text in args.shapes:
        H, B, KV = (int(x) for x in text.split(":"))
        for kind in args.table:
            try:
                rows.append(bench_shape(H, B, KV, args, gen, copy_gbps) if kind == "pages" else
                            bench_table(H, B, KV, kind, args, gen, copy_gbps))
            except Exception as e:  # noqa: BLE001 - reported per row, the next still run
                rows.append(dict(H=H, B=B, kv_len=KV, table=kind, error=repr(e)[:400]))
                print(rows[-1], flush=True)
            torch.cuda.empty_cache()  # this row's caches are gone with its frame
    return rows, copy_gbps


def token_table(B: int, KV: int, kind: str, gen):
    """(buf uint8 [N, 1, 656], token table int32 [B, KV], lengths): B requests of KV tokens in a page-size-1 FP8
    buffer (random bf16 tokens quantized by mla.cache_write_fp8), the table `--table`'s kind: "tiles" the pages of
    fp8_decode.caches (shuffled pages of 64, each page's slots in order), "runs" / "holes" / "shuffled" over a buffer
    of B (KV + 64) rows (module docstring)."""
    import fp8_decode as F8

    dev = "cuda"
    if kind == "tiles":
        _, _, (c8, _, _), pages, lens = F8.caches(B, KV, gen)
        tokens = (pages.long()[:, :, None] * F8.PS + torch.arange(F8.PS, device=dev)).reshape(B, KV).int()
        return token_buffer(c8).reshape(-1, 1, W_TOKEN), tokens, lens
    span = KV + 64
    buf, ckv, scale, kpe = fp8.allocate(B * span, 1, R, P, device=dev)
    for b in range(B):  # a request's rows at a time: the bf16 tokens of the whole buffer would double its bytes
        rows = torch.arange(b * span, (b + 1) * span, device=dev)
        torch.ops.mla.cache_write_fp8(ckv, kpe, scale, torch.randn(span, R, generator=gen, device=dev).bfloat16(),
                                      torch.randn(span, P, generator=gen, device=dev).bfloat16(), rows)
    base = torch.arange(B, device=dev)[:, None] * span
    if kind == "runs":
        table = base + torch.randint(1, 64, (B, 1), generator=gen, device=dev) + torch.arange(KV, device=dev)
    elif kind == "holes":
        keep = torch.stack([torch.randperm(span, generator=gen, device=dev)[:KV].sort().values for _ in range(B)])
        table = base + keep
    elif kind == "shuffled":
        table = torch.randperm(B * span, generator=gen, device=dev)[:B * KV].view(B, KV)
    else:
        raise ValueError(f"--table: unknown kind {kind!r}")
    return buf, table.int(), torch.full((B,), KV, dtype=torch.int32, device=dev)


def bench_table(H: int, B: int, KV: int, kind: str, args, gen, copy_gbps: float) -> dict:
    """One shape over a page-size-1 token table of `kind` (`token_table`): the GATHER and TOKENS forms, stage 1 +
    merge and stage 1 alone, each checked on request 0 against float64 first, then timed by CUDA-graph replay."""
    import fp8_decode as F8
    from triton.testing import do_bench_cudagraph

    def us(fn):
        return do_bench_cudagraph(fn, rep=args.rep, return_mode="median") * 1e3

    buf, table, lens = token_table(B, KV, kind, gen)
    c8, s8, k8 = fp8.views(buf, R)
    qn = torch.randn(B, H, R, generator=gen, device="cuda").to(torch.bfloat16)
    qp = torch.randn(B, H, P, generator=gen, device="cuda").to(torch.bfloat16)
    bld = default_build(H)
    ns = args.splits or auto_splits(B * cdiv(H, bld.tiling.N), KV, qn.device)
    outs = torch.empty(ns, B, H, R, dtype=torch.float32, device="cuda")
    lses = torch.empty(ns, B, H, dtype=torch.float32, device="cuda")
    row = {"H": H, "B": B, "kv_len": KV, "table": kind, "config": bld.name, "splits": ns}

    def fp8_rows(s):
        return fp8.dequantize(c8.reshape(-1, R)[s], s8.reshape(-1, GROUPS)[s], torch.float64)

    for form, tokens in (("gather", False), ("tokens", True)):
        def call(tokens=tokens):
            return launch(qn, qp, buf, table, lens, F8.SCALE, ns, build=bld, tokens=tokens)

        def alone(tokens=tokens):
            return stage1(qn, qp, buf, table, lens, F8.SCALE, ns, build=bld, outs=outs, lses=lses, tokens=tokens)

        try:
            row[f"{form}_check"] = ok = F8.check_request0(*call(), qn, qp, fp8_rows, k8, table, page_size=1)
            if ok == "ok":
                row[f"{form}_us"], row[f"{form}_stage1_us"] = us(call), us(alone)
                row[f"{form}_gbps"] = B * KV * W_TOKEN / row[f"{form}_us"] / 1e3
                row[f"{form}_bw_frac"] = row[f"{form}_gbps"] / copy_gbps
        except Exception as e:  # noqa: BLE001 - reported, the other form still timed
            row[f"{form}_error"] = repr(e)[:400]
    if isinstance(row.get("gather_us"), float) and isinstance(row.get("tokens_us"), float):
        row["tokens_vs_gather"] = row["tokens_us"] / row["gather_us"]
    F8.row_done(row)
    return row


def bench_shape(H: int, B: int, KV: int, args, gen, copy_gbps: float) -> dict:
    """One shape: fp8_decode.caches' tokens (bf16 caches and the FP8 buffer of the same values, shuffled pages, every
    request KV long), each call checked against float64 (request 0), then timed by CUDA-graph replay."""
    import fp8_decode as F8
    from triton.testing import do_bench_cudagraph

    def us(fn):
        return do_bench_cudagraph(fn, rep=args.rep, return_mode="median") * 1e3

    ckv, kpe, (c8, s8, k8), table, lens = F8.caches(B, KV, gen)
    buf = token_buffer(c8)
    qn = torch.randn(B, H, R, generator=gen, device="cuda").to(torch.bfloat16)
    qp = torch.randn(B, H, P, generator=gen, device="cuda").to(torch.bfloat16)
    capacity = table.shape[1] * F8.PS
    cfg = default_build(H)
    ns = args.splits or auto_splits(B * cdiv(H, cfg.tiling.N), capacity, qn.device)
    outs = torch.empty(ns, B, H, R, dtype=torch.float32, device="cuda")
    lses = torch.empty(ns, B, H, dtype=torch.float32, device="cuda")

    def fp8_rows(s):
        return fp8.dequantize(c8.reshape(-1, R)[s], s8.reshape(-1, GROUPS)[s], torch.float64)

    def swapab(c=cfg, n=ns):
        return launch(qn, qp, buf, table, lens, F8.SCALE, n, build=c)

    calls = {
        "swapab": swapab,
        "swapab_stage1": lambda: stage1(qn, qp, buf, table, lens, F8.SCALE, ns, build=cfg, outs=outs, lses=lses),
        "fp8_op": lambda: torch.ops.mla.decode(qn, qp, c8, k8, table, lens, F8.SCALE, s8),
        "bf16_op": lambda: torch.ops.mla.decode(qn, qp, ckv, kpe, table, lens, F8.SCALE),
    }
    fm_bf16, fm_fp8 = F8.flashmla_calls(qn, qp, ckv, kpe, table, lens)
    if fm_bf16 is not None:
        calls.update(flashmla_bf16=fm_bf16, flashmla_fp8=fm_fp8)
    row = {"H": H, "B": B, "kv_len": KV, "config": cfg.name, "splits": ns}
    try:
        out, lse = swapab()
        row["swapab_check"] = F8.check_request0(out, lse, qn, qp, fp8_rows, k8, table)
        o8 = calls["fp8_op"]()[0].double()
        row["swapab_vs_fp8_op_max_row_rel_err"] = float(((out.double() - o8).norm(dim=-1) / o8.norm(dim=-1)).max())
    except Exception as e:  # noqa: BLE001 - reported; the peers are still timed
        row["swapab_error"] = repr(e)[:400]
    for name, fn in calls.items():
        if name.startswith("swapab") and "swapab_error" in row:
            continue
        try:
            row[f"{name}_us"] = us(fn)
        except Exception as e:  # noqa: BLE001 - a peer's failure is reported, not fatal
            row[f"{name}_error"] = repr(e)[:300]
    row["configs_us"] = {}
    for text in EXTRA.get(cfg.tiling.N, []) + list(args.configs):
        c = Build.parse(text)
        n = args.splits or auto_splits(B * cdiv(H, c.tiling.N), capacity, qn.device)
        try:
            ok = F8.check_request0(*swapab(c, n), qn, qp, fp8_rows, k8, table)
            row["configs_us"][c.name] = us(lambda c=c, n=n: swapab(c, n)) if ok == "ok" else ok
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: reported per config
            row["configs_us"][c.name] = repr(e)[:200]
    tokens = B * KV
    for name in ("swapab", "swapab_stage1", "fp8_op", "flashmla_fp8", "bf16_op", "flashmla_bf16"):
        t = row.get(f"{name}_us")
        if isinstance(t, float):
            # bytes of the cache read: our FP8 format 656 a token, FlashMLA's FP8 576 (one scale per tensor), bf16 1152
            per_token = {"fp8_op": W_TOKEN, "flashmla_fp8": R + P, "bf16_op": 2 * (R + P),
                         "flashmla_bf16": 2 * (R + P)}.get(name, W_TOKEN)
            row[f"{name}_gbps"] = tokens * per_token / t / 1e3  # bytes / us / 1e3 = GB/s
            row[f"{name}_bw_frac"] = row[f"{name}_gbps"] / copy_gbps
    F8.row_done(row)
    return row


def table(rows) -> str:
    """The timing rows as a text table: us (and GB/s of the cache read, 656 bytes a token for FP8, 1152 for bf16);
    the token-table rows (`bench_table`) in a second one."""
    pages = [r for r in rows if r.get("table", "pages") == "pages" and "error" not in r]
    tables = [r for r in rows if r.get("table", "pages") != "pages" and "error" not in r]
    text = _pages_table(pages) if pages else ""
    if tables:
        head = f"{'H':>3} {'B':>3} {'kv':>7} {'table':>8} " + " ".join(
            f"{label:>22}" for label in ("GATHER+merge", "TOKENS+merge", "GATHER stage 1", "TOKENS stage 1"))
        lines = [head, "-" * len(head)]
        for r in tables:
            cells = [f"{r[k]:9.1f} us" if isinstance(r.get(k), float) else r.get(k.replace("_stage1_us", "_us")
                     .replace("_us", "_check"), "-") for k in ("gather_us", "tokens_us", "gather_stage1_us",
                                                                "tokens_stage1_us")]
            lines.append(f"{r['H']:>3} {r['B']:>3} {r['kv_len']:>7} {r['table']:>8} "
                         + " ".join(f"{str(c)[:22]:>22}" for c in cells))
        text += ("\n\n" if text else "") + "\n".join(lines)
    return text


def _pages_table(rows) -> str:
    cols = [("swapab", "swapab+merge"), ("swapab_stage1", "stage 1"), ("fp8_op", "mla.decode fp8"),
            ("bf16_op", "mla.decode bf16"), ("flashmla_fp8", "FlashMLA fp8"), ("flashmla_bf16", "FlashMLA bf16")]
    head = f"{'H':>3} {'B':>3} {'kv':>7} " + " ".join(f"{label:>22}" for _, label in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for key, _ in cols:
            t, g = r.get(f"{key}_us"), r.get(f"{key}_gbps")
            cells.append(f"{t:9.1f} us {g:6.0f} GB/s" if isinstance(t, float) else f"{'-':>22}")
        lines.append(f"{r['H']:>3} {r['B']:>3} {r['kv_len']:>7} " + " ".join(f"{c:>22}" for c in cells))
        if r.get("configs_us"):
            lines.append("    other builds (N:W:S:PRE:SLAB, us): " + ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r["configs_us"].items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", help="write the JSON document here")
    ap.add_argument("--aot", action="store_true", help="compile for sm_90a only (no GPU): registers, shared, spills")
    ap.add_argument("--emulate", action="store_true", help="CPU: the kernels' arithmetic vs float64 (`emulate`)")
    ap.add_argument("--no-check", action="store_true", help="skip check() before timing")
    ap.add_argument("--check-only", action="store_true", help="check(), no timing")
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="H:B:kv per request (default: %(default)s)")
    ap.add_argument("--configs", nargs="*", default=[],
                    help="more builds to time (--aot: to compile), N:W:S[:PRE[:SLAB]][:bf16]")
    ap.add_argument("--splits", type=int, default=None, help="KV splits (default: one wave over the SMs)")
    ap.add_argument("--table", nargs="+", default=["pages"], choices=["pages", "tiles", "runs", "holes", "shuffled"],
                    help="page 64 (the TMA form) and / or page-size-1 token tables (GATHER and TOKENS forms)")
    ap.add_argument("--rep", type=int, default=50, help="do_bench_cudagraph rep (ms)")
    args = ap.parse_args(argv)
    from op_timing_out import emit

    if args.aot:
        rows = aot(args.configs or None)
        emit(dict(device="cpu (sm_90a ahead of time)", aot=rows), [args.out] if args.out else [])
        # the exit status: the product's tilings build clean (variants: listed)
        defaults = {default_build(n).name for n in (16, 32, 64, 128)}
        return 0 if all("error" not in r and r["spill_bytes"] == 0 and r["fits"] and not r["advisories"]
                        for r in rows if r["config"] in defaults) else 1
    if args.emulate:
        rows = emulation(True) + emulation(False)
        emit(dict(device="cpu (emulation)", emulation=rows), [args.out] if args.out else [])
        return 0 if all(r["out_err"] <= OUT_TOL and r["lse_err"] <= LSE_TOL for r in rows if r["exact"]) else 1
    if not torch.cuda.is_available():
        print("fp8_swapab: no CUDA device (use --aot to compile for sm_90a on the CPU)", file=sys.stderr)
        return 2
    checks = [] if args.no_check else check()
    ok = all(r["ok"] for r in checks)
    doc = dict(device=torch.cuda.get_device_name(), token_bytes=W_TOKEN, checks=checks, checks_ok=ok)
    if not args.check_only:
        rows, copy_gbps = bench(args)
        doc.update(copy_gbps=copy_gbps, rows=rows)
        print(table(rows), flush=True)
    emit(doc, [args.out] if args.out else [])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
