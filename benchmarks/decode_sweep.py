"""Tile-config sweep of the Triton `mla::decode` kernels on the GPU (picks `default_config`; not a test).

usage: python benchmarks/decode_sweep.py OUT.json [--quick]
       python benchmarks/decode_sweep.py OUT.json --splits 8 16 33   # the default configs at forced split counts
       python benchmarks/decode_sweep.py OUT.json --scaling          # stage 1 / merge time vs kv_len (fixed cost)
       python benchmarks/decode_sweep.py OUT.json --aot     # no GPU: each config compiled for sm_90a
                                                             # (kernel, registers, spills, PTX instructions)

Every config is first checked against the float64 reference (tests/reference.py) on a small batch with
ragged lengths, a 0-length row, NaN in unused slots and forced splits; a config that fails is reported and
not timed. Then each (H, B, kv_len) shape is timed by CUDA-graph replay (`do_bench_cudagraph` median) for
every config, on random data (never zeros), bf16, R 512 / P 64, page 64 with a shuffled block table. The
"page 1" rows time the same KV through a page-size-1 view (a token table: what the HF pass emits for a
StaticCache), so the cost of token-granular gathers is visible. Prints one line per shape with the best.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
from triton.testing import do_bench, do_bench_cudagraph

import mla_compile  # noqa: F401
from mla_compile import paged
from mla_compile.kernels import decode as D
from mla_compile.kernels import dispatch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import reference as ref  # noqa: E402

R, P, PS = 512, 64, 64
DT = torch.bfloat16
C = D.DecodeConfig
# The round files (data/decode_sweep_roundN.json) are read at commit 20a0395: git show 20a0395:benchmarks/<file>.
# Round 1 (2026-12-01, data/decode_sweep_round1.json) compared the pointer kernel with the TMA kernel over
# tiles 16-64, 2-6 stages, 4-8 warps: TMA n32w4s3 (H=16) and TMA h64n64w8s2 (H=128) won every shape. Round 2
# (data/decode_sweep_round2.json): 16 warps and 128-head tiles lose 2-4x at H=128; 1-3 CTAs/SM of splits and
# 512 splits move < 4%; the page-1 pointer path (HF StaticCache) is 6-10% behind TMA with n32w4s3.
# Round 3 (data/decode_sweep_round3.json): Triton 3.6's automatic warp specialization of the TMA tile loop
# (`tl.range(..., warp_specialize=True)`) changed nothing (+-1%) at H=16 and H=128; dropped.
# Round 4 (data/decode_sweep_round4.json, kernel resources recorded): H=128 h64n64w8s2 uses 255 registers, 0
# spills, 221 KB shared; re-loading q every tile only adds spills there. H=16 n32w4s3: 255 registers and 120
# SPILLS: with M = 16 heads every one of the 4 warps holds all of q [16, 576] as its MMA operand.
# Round 5 (data/decode_sweep_round5.json): H=16 with q re-loaded every tile: spills 120 -> 18, 1-5% faster
# (adopted); 8 warps: 0 spills but 1.6x slower; 2 warps: 816 spills, 10x slower. The spills are not the bound.
# Round 6 (data/decode_sweep_round6.json): tokens as the MMA's M side (swap AB: s^T = ckv.q^T, M = 64 tokens,
# N = 16 heads, Hopper warpgroup MMA from shared memory) is 25-80% SLOWER than heads as M at H=16 (ptr-T n64w4s2
# 131 us vs 103 at B=8 32K) and at H=128, and Triton 3.6 miscompiles its TMA variant at N=16 when a split ends in
# a partial tile (wrong out, right lse; 1 stage: illegal address): dropped. The same round found the pointer
# kernel, with R/P now constexprs (16-byte vector loads, async-copy pipelining), ahead of the TMA kernel at H=16.
# Round 7 (data/decode_sweep_round7.json): the pointer kernel with 64-token tiles wins every H=16 shape (page 1:
# 0.79 of copy bandwidth at B=8 32K, 0.89-0.92 at B>=32 or 128K; TMA n32 0.71-0.83); 8 warps, 16-token tiles and
# 3 CTAs/SM of splits lose; at page 64 it trailed its own page-1 run by ~10% (page size was a runtime value).
# H=128: TMA h64n64w8s2 stays ahead of the pointer kernel (253-279 vs 206-215 TFLOP/s).
# Round 8 (data/decode_sweep_round8.json, page size now a constexpr): at page 64, 2 stages beat 3 by 1.5-6%
# (B=8 32K 90.6 vs 96.3 us) and stay ~2-6% behind the page-1 run with 3 stages; 8 warps, 128-token tiles and
# 1 CTA/SM of splits lose. Round 9 (data/decode_sweep_round9.json): on page 1, 2 stages are 20% slower than 3.
# Defaults: ptr n64w4, 2 stages where pages hold whole tiles, else 3.
# Round 10 (data/decode_sweep_round10.json, 2026-12-01): one table load per tile at page 64 (`page_per_tile`:
# 1716 instead of 2053 PTX instructions) ran 5-13% slower than the per-token page math (255 registers, 20-24 B
# spilled; B=8 128K 333 vs 296 us): dropped. Page 64 with 2 stages matched the page-1 table with 3 (89.6 vs 89.4
# us at B=8 32K; 0.80-0.97 of copy bandwidth).
CONFIGS = {
    16: {"ptr n64w4s2": C(16, 64, 4, 2, 2, 256)},
    128: {},
}
# H=16 pointer-kernel configs timed on a page-size-1 token table (the HF StaticCache path)
PAGE1 = {"ptr n64w4s3": C(16, 64, 4, 3, 2, 256)}
SHAPES = {16: [(1, 131072), (8, 32768), (8, 131072), (32, 32768), (128, 8192)],
          128: [(1, 131072), (8, 32768), (32, 32768), (128, 8192)]}


def check(cfg: D.DecodeConfig, H: int, page: int = PS) -> str:
    """'ok' or the failure: the config vs the float64 reference (ragged lengths, NaN in unused slots)."""
    gen = torch.Generator().manual_seed(H)
    lens = [1000, 0, 129, 64, 3000]
    ckv = [torch.randn(n, R, generator=gen).to(DT) for n in lens]
    kpe = [torch.randn(n, P, generator=gen).to(DT) for n in lens]
    cpu = paged.fill_paged(ckv, kpe, page, shuffle=True, spare_pages=2, generator=gen)  # unused slots: NaN
    b = dataclasses.replace(cpu, **{f.name: getattr(cpu, f.name).cuda() for f in dataclasses.fields(cpu)})
    qn = torch.randn(len(lens), H, R, generator=gen).to(DT).cuda()
    qp = torch.randn(len(lens), H, P, generator=gen).to(DT).cuda()
    want_o, want_l = ref.ref_decode(qn.cpu(), qp.cpu(), cpu.ckv_cache, cpu.kpe_cache, cpu.block_table, cpu.seq_lens,
                                    0.07)
    for splits in (1, 5, None):
        out, lse = D.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.07, cfg=cfg, splits=splits)
        err = float((out.double().cpu() - want_o).norm() / want_o.norm())
        fin = torch.isfinite(want_l)
        lerr = float((lse.double().cpu() - want_l)[fin].abs().max())
        if not (err < 1e-2 and lerr < 1e-2 and torch.equal(torch.isfinite(lse.cpu()), fin)):
            return f"splits={splits}: out rel err {err:.2e}, lse err {lerr:.2e}"
    return "ok"


def kernel_resources(cfg: D.DecodeConfig, H: int) -> dict:
    """Registers / spills / shared memory of the stage-1 kernel this config compiles to (one launch)."""
    pages = 4
    ckv = torch.randn(pages, PS, R, dtype=DT, device="cuda")
    kpe = torch.randn(pages, PS, P, dtype=DT, device="cuda")
    table = torch.arange(pages, dtype=torch.int32, device="cuda")[None]
    lens = torch.full((1,), pages * PS, dtype=torch.int32, device="cuda")
    qn, qp = torch.randn(1, H, R, dtype=DT, device="cuda"), torch.randn(1, H, P, dtype=DT, device="cuda")
    out = torch.empty_like(qn)
    lse = torch.empty(1, H, device="cuda")
    launch = D._launch_tma if D.tma_eligible(ckv, kpe, False, cfg) else D._launch_pointer
    args = (qn, qp, ckv, kpe, table, lens) + (() if launch is D._launch_tma else (None,))
    k = launch(*args, 0.1, out, lse, 0, 0, 2, cfg)  # 2 splits (1 compiles a specialized variant); outputs discarded
    info = {a: getattr(k, a, None) for a in ("n_regs", "n_spills")}
    info["shared"] = getattr(getattr(k, "metadata", None), "shared", None)
    print(f"  kernel H={H} {cfg}: {info}", flush=True)
    return info


def checked(res: dict, H: int, name: str, cfg: D.DecodeConfig, page: int) -> bool:
    """Check one config (recording its verdict and kernel resources in res); True when it may be timed."""
    try:
        verdict = check(cfg, H, page)
        res.setdefault("kernels", {})[f"H{H} {name}"] = kernel_resources(cfg, H)
    except Exception as e:  # noqa: BLE001 - a config that does not compile is a result too
        verdict = f"{type(e).__name__}: {e}"[:300]
    res["checks"][f"H{H} {name}"] = verdict
    print(f"check H={H} {name}: {verdict}", flush=True)
    return verdict == "ok"


def aot_report(path: str) -> None:
    """Every config of this round compiled for sm_90a on this machine (tools/aot.py): a GPU-free first look (a
    config that spills or lost its async copies is rarely worth device time)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tools import aot

    res = {}
    for H, configs in CONFIGS.items():
        for page, named in ((PS, configs), (1, PAGE1 if H == 16 else {})):
            for name, cfg in named.items():
                key = f"H{H} {name}" + (" page1" if page == 1 else "")
                out = aot.stage1_sm90(cfg, R, P, page)
                res[key] = {k: out[k] for k in ("kernel", "registers", "spill_bytes", "instructions")}
                print(f"{key}: {res[key]}", flush=True)
    with open(path, "w") as fh:
        json.dump({"aot_sm90": res}, fh, indent=1)


def token_table(table: torch.Tensor) -> torch.Tensor:
    """The same tokens as a page-PS block table, as a page-size-1 token table (what the HF pass emits)."""
    B = table.shape[0]
    return (table.long()[:, :, None] * PS + torch.arange(PS, device=table.device)).view(B, -1).int()


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write), the reference the bandwidth fractions use."""
    x = torch.randn(1 << 29, device="cuda", dtype=torch.float16)
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / (do_bench(lambda: y.copy_(x), return_mode="median") * 1e-3)


# the H=16 shapes the ops table has at ratio > 1 vs FlashInfer (B=8 128K, B=32 8K / 32K, B=128 8K) and neighbours:
# session 5's probe saw fewer splits in one wave beat the policy's ~2 waves (B=32 32K: 8 splits 308 vs 16 splits
# 314 us) and 32 beat 33 at B=8 128K (309 vs 323 us)
SPLIT_SHAPES = [(16, 8, 32768), (16, 8, 131072), (16, 32, 8192), (16, 32, 32768), (16, 128, 8192), (16, 128, 32768),
                (128, 8, 32768), (128, 8, 131072)]


def split_probe(path: str, split_counts: list[int], shapes=None, page1: bool = True) -> None:
    """The default config of each shape (H, B, L; default SPLIT_SHAPES) at forced split counts (and the policy's
    own, "policy"): whole-op time (stage 1 + merge) by CUDA-graph replay, page 64 and, at H=16 unless `page1` is
    False, the page-1 token table. Every forced count is checked against the policy's output first."""
    from mla_compile.kernels._util import sm_count

    shapes = shapes or SPLIT_SHAPES

    copy_bw = copy_bandwidth()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bw_TBps": copy_bw / 1e12,
           "sms": sm_count(torch.device("cuda")), "rows": []}
    pages = max(b * n for _, b, n in shapes) // PS
    ckv = torch.empty(pages, PS, R, dtype=DT, device="cuda").normal_()
    kpe = torch.empty(pages, PS, P, dtype=DT, device="cuda").normal_()
    for H, B, L in shapes:
        table = torch.randperm(pages, device="cuda")[: B * L // PS].view(B, L // PS).int()
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        qn = torch.randn(B, H, R, dtype=DT, device="cuda")
        qp = torch.randn(B, H, P, dtype=DT, device="cuda")
        tok = token_table(table)
        layouts = {"page64": (ckv, kpe, table)}
        if H == 16 and page1:
            layouts["page1"] = (ckv.view(-1, 1, R), kpe.view(-1, 1, P), tok)
        for layout, (c, k, t) in layouts.items():
            cfg = dispatch.own_decode_config(qn, qp, c, k)  # the kernel of ours auto runs (Gluon at H 128)
            row = {"H": H, "B": B, "L": L, "layout": layout, "cfg": str(cfg),
                   "policy_splits": D.num_splits(B, H, t.shape[1] * c.shape[1], qn.device, cfg), "us": {}}
            want = D.decode(qn, qp, c, k, t, lens, 0.07, cfg=cfg)
            row["check"] = {}
            for ns in [None] + split_counts:
                fn = lambda ns=ns: D.decode(qn, qp, c, k, t, lens, 0.07, cfg=cfg, splits=ns)  # noqa: E731
                got = fn()
                row["check"][str(ns)] = max((got[0].float() - want[0].float()).abs().max().item(),
                                            (got[1] - want[1]).abs().max().item())
                row["us"]["policy" if ns is None else str(ns)] = do_bench_cudagraph(fn, rep=40,
                                                                                      return_mode="median") * 1e3
            nbytes = D.kv_bytes(B, L, R, P, 2)
            row["bw_frac"] = {k_: nbytes / (v * 1e-6) / copy_bw for k_, v in row["us"].items()}
            res["rows"].append(row)
            times = " ".join(f"{k_}={v:.1f}us({row['bw_frac'][k_]:.2f})" for k_, v in row["us"].items())
            print(f"H={H} B={B} L={L // 1024}K {layout} policy={row['policy_splits']} "
                  f"(max diff vs policy {max(row['check'].values()):.1e}): {times}", flush=True)
            with open(path, "w") as fh:
                json.dump(res, fh, indent=1)


SCALING_LENS = [8192, 16384, 32768, 65536, 131072]


def fit_fixed_and_rate(rows: list[dict], part: str, copy_bw: float) -> dict:
    """Least squares t_us = fixed + bytes / rate over `rows` ({"bytes", part + "_us"}); copy_bw in bytes/s."""
    xs = torch.tensor([r["bytes"] for r in rows], dtype=torch.float64)
    ts = torch.tensor([r[part + "_us"] for r in rows], dtype=torch.float64)
    A = torch.stack([torch.ones_like(xs), xs], 1)
    fixed, us_per_byte = torch.linalg.lstsq(A, ts[:, None]).solution[:, 0].tolist()
    rate = 1e6 / us_per_byte  # bytes/s
    return {"fixed_us": fixed, "rate_TBps": rate / 1e12, "rate_frac_of_copy": rate / copy_bw}


def scaling_probe(path: str) -> None:
    """H=16, B=8, page-1 token table (the HF path) and page 64: stage 1 alone, the merge alone and the whole op
    by CUDA-graph replay at growing kv_len (same split count), then a least-squares fit t = fixed + bytes / bw per
    part: where a 32K decode's distance from copy bandwidth goes (a per-launch fixed cost, or a lower rate)."""
    copy_bw = copy_bandwidth()
    H, B = 16, 8
    pages = B * max(SCALING_LENS) // PS
    ckv = torch.empty(pages, PS, R, dtype=DT, device="cuda").normal_()
    kpe = torch.empty(pages, PS, P, dtype=DT, device="cuda").normal_()
    qn = torch.randn(B, H, R, dtype=DT, device="cuda")
    qp = torch.randn(B, H, P, dtype=DT, device="cuda")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bw_TBps": copy_bw / 1e12,
           "H": H, "B": B, "rows": [], "fits": {}}
    for layout in ("page1", "page64"):
        for L in SCALING_LENS:
            table = torch.randperm(pages, device="cuda")[: B * L // PS].view(B, L // PS).int()
            lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
            c, k, t = ckv, kpe, table
            if layout == "page1":
                t = token_table(table)
                c, k = ckv.view(-1, 1, R), kpe.view(-1, 1, P)
            cfg = D.default_config(H, R, c.shape[1])
            ns = D.num_splits(B, H, L, qn.device, cfg)  # capacity = L: the policy's count for this length
            o = torch.empty((ns, B, H, R), dtype=torch.float32, device="cuda")
            lo = torch.empty((ns, B, H), dtype=torch.float32, device="cuda")
            out, lse = torch.empty_like(qn), torch.empty((B, H), dtype=torch.float32, device="cuda")
            stage1 = lambda: D._launch_pointer(qn, qp, c, k, t, lens, None, 0.07, o, lo, o.stride(0),  # noqa: E731
                                               lo.stride(0), ns, cfg)
            merge = lambda: D.merge_into(o, lo, out, lse)  # noqa: E731
            whole = lambda: D.decode(qn, qp, c, k, t, lens, 0.07, cfg=cfg, splits=ns)  # noqa: E731
            row = {"layout": layout, "L": L, "splits": ns, "bytes": D.kv_bytes(B, L, R, P, 2)}
            for name, fn in (("stage1", stage1), ("merge", merge), ("whole", whole)):
                row[name + "_us"] = do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3
            row["whole_bw_frac"] = row["bytes"] / (row["whole_us"] * 1e-6) / copy_bw
            res["rows"].append(row)
            print(f"{layout} L={L // 1024}K splits={ns}: stage1 {row['stage1_us']:.1f} merge {row['merge_us']:.1f} "
                  f"whole {row['whole_us']:.1f} us ({row['whole_bw_frac']:.2f} of copy bw)", flush=True)
        rows = [r for r in res["rows"] if r["layout"] == layout]
        for part in ("stage1", "whole"):
            fit = fit_fixed_and_rate(rows, part, copy_bw)
            res["fits"][f"{layout} {part}"] = fit
            print(f"  fit {layout} {part}: fixed {fit['fixed_us']:.1f} us + bytes at {fit['rate_TBps']:.2f} TB/s "
                  f"({fit['rate_frac_of_copy']:.2f} of copy bw)", flush=True)
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default=os.path.join(os.environ.get("OUT", "."), "decode_sweep.json"))
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="two configs per head count, two shapes")
    mode.add_argument("--splits", type=int, nargs="+", metavar="N", help="the default configs at forced split counts")
    ap.add_argument("--shapes", nargs="+", metavar="H:B:L", help="--splits: these shapes (e.g. 16:32:1024)")
    ap.add_argument("--no-page1", action="store_true", help="--splits: page 64 only")
    mode.add_argument("--scaling", action="store_true", help="stage 1 / merge time vs kv_len (fixed cost)")
    mode.add_argument("--aot", action="store_true", help="no GPU: each config compiled for sm_90a")
    a = ap.parse_args(argv)
    path = a.out
    if a.aot:
        return aot_report(path)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (CUDA-graph timing; --aot compiles without one); none here")
    if a.scaling:
        return scaling_probe(path)
    if a.splits:
        shapes = [tuple(int(x) for x in sh.split(":")) for sh in a.shapes] if a.shapes else None
        return split_probe(path, a.splits, shapes, page1=not a.no_page1)
    quick = a.quick
    t_start = time.time()
    copy_bw = copy_bandwidth()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bw_TBps": copy_bw / 1e12,
           "checks": {}, "rows": []}
    max_tokens = max(b * n for hs in SHAPES.values() for b, n in hs)
    pages = max_tokens // PS
    ckv = torch.empty(pages, PS, R, dtype=DT, device="cuda").normal_()
    kpe = torch.empty(pages, PS, P, dtype=DT, device="cuda").normal_()
    for H, configs in CONFIGS.items():
        if not configs:
            continue
        if quick:
            configs = dict(list(configs.items())[:2])
        good = {name: cfg for name, cfg in configs.items() if checked(res, H, name, cfg, PS)}
        page1 = {name: cfg for name, cfg in PAGE1.items() if H == 16 and checked(res, H, name + " page1", cfg, 1)}
        for B, L in SHAPES[H][:2] if quick else SHAPES[H]:
            table = torch.randperm(pages, device="cuda")[: B * L // PS].view(B, L // PS).int()
            lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
            qn = torch.randn(B, H, R, dtype=DT, device="cuda")
            qp = torch.randn(B, H, P, dtype=DT, device="cuda")
            row = {"H": H, "B": B, "L": L, "us": {}}
            nbytes, flop = D.kv_bytes(B, L, R, P, 2), D.flops(B, H, L, R, P)
            for name, cfg in good.items():
                fn = lambda c=cfg: D.decode(qn, qp, ckv, kpe, table, lens, 0.07, cfg=c)  # noqa: E731
                row["us"][name] = do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3
            if H == 16:  # the same tokens through a page-size-1 token table (the HF StaticCache path)
                tok = token_table(table)
                c1, k1 = ckv.view(-1, 1, R), kpe.view(-1, 1, P)
                for name, cfg in page1.items():
                    fn = lambda c=cfg: D.decode(qn, qp, c1, k1, tok, lens, 0.07, cfg=c)  # noqa: E731
                    row["us"][name + " page1"] = do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3
            best = min(row["us"], key=row["us"].get)
            row.update(best=best, best_us=row["us"][best],
                       best_bw_frac=nbytes / (row["us"][best] * 1e-6) / copy_bw,
                       best_tflops=flop / (row["us"][best] * 1e-6) / 1e12)
            res["rows"].append(row)
            cols = " ".join(f"{k}={v:.1f}" for k, v in row["us"].items())
            print(f"H={H} B={B} L={L // 1024}K best {best} {row['best_us']:.1f} us bw {row['best_bw_frac']:.2f} "
                  f"{row['best_tflops']:.0f} TF/s | {cols}", flush=True)
            with open(path, "w") as fh:
                json.dump(res, fh, indent=1)
    res["wall_s"] = time.time() - t_start
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
