"""Where the Gluon many-head decode kernel's time goes (kernels/decode_wgmma.py; not a test).

usage: python benchmarks/wgmma_probe.py OUT.json [--gather | --seesaw]
       (--gather: only the gather kernel's rows, vs the Triton pointer kernel;
        --seesaw: only the warp-specialised kernel (decode_seesaw.py): its variants and probes, the two-warpgroup
        kernel and FlashInfer)

Times stage 1 alone by CUDA-graph replay (`do_bench_cudagraph` median) with phases dropped through the kernel's
PROBE constexpr (1 softmax, 2 p.ckv, 4 q.ckv^T, 8 the accumulator rescale, 16 p through shared memory; such runs
compute wrong results and only say what a phase costs), for both loop schedules (PIPE), next to the whole op, the
Triton TMA kernel and FlashInfer at the same shapes. bf16, R 512 / P 64, page 64, shuffled pages, random data.
Then the gather kernel's rows (page-1 token table, sparse index lists) against the Triton pointer kernel.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from triton.testing import do_bench_cudagraph

import mla_compile  # noqa: F401
from mla_compile.kernels import decode as D
from mla_compile.kernels import decode_seesaw as S
from mla_compile.kernels import decode_wgmma as W
from mla_compile.kernels import flashinfer_mla as FI

R, P, PS, H = 512, 64, 64, 128
DT = torch.bfloat16
SHAPES = [(8, 131072), (128, 32768)]
PROBES = {"all phases": 0, "no softmax": 1, "no p.ckv": 2, "no q.ckv^T": 4, "no rescale": 8,
          "no p via smem": 16, "q.ckv^T only": 1 | 2 | 8 | 16, "p.ckv only": 1 | 4 | 8, "loads and loop only": 31}
PIPES = {"": False, "pipe: ": True}  # the kernel's two loop schedules (decode_wgmma.PIPE)
PIPE_PROBES = ("all phases", "no softmax", "no p.ckv", "loads and loop only")


def case(pages, B, L):
    """Random q, a shuffled page-64 table over `pages`, full lengths, the default config's split count and
    stage-1 partial buffers for B requests of L tokens."""
    table = torch.randperm(pages, device="cuda")[: B * L // PS].view(B, L // PS).int()
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    qn = torch.randn(B, H, R, dtype=DT, device="cuda")
    qp = torch.randn(B, H, P, dtype=DT, device="cuda")
    cfg = D.default_config(H, R, PS)
    ns = D.num_splits(B, H, L, qn.device, cfg)
    o = torch.empty(ns, B, H, R, dtype=torch.float32, device="cuda")
    lse = torch.empty(ns, B, H, dtype=torch.float32, device="cuda")
    return table, lens, qn, qp, cfg, ns, o, lse


def us(fn):
    return do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3


def gather_rows(ckv, kpe):
    """The gather kernel (pages smaller than a tile, sparse index lists) vs the Triton pointer kernel it replaces,
    whole op, H=128: a page-1 token table (HF StaticCache) and DSA's sparse decode (topk 2048 of 32K)."""
    rows = []
    pages = ckv.shape[0]
    tok_ckv, tok_kpe = ckv.view(-1, 1, R), kpe.view(-1, 1, P)
    for B, L, sparse in ((8, 32768, False), (32, 32768, True), (128, 32768, True)):
        slots = torch.randperm(pages * PS, device="cuda")[: B * L].view(B, L).int()
        qn = torch.randn(B, H, R, dtype=DT, device="cuda")
        qp = torch.randn(B, H, P, dtype=DT, device="cuda")
        cfg = D.default_config(H, R, 1)
        ptr = dataclasses.replace(cfg, wgmma=False)
        if sparse:
            idx = slots[:, :2048].contiguous()
            run = lambda c: D.sparse_decode(qn, qp, ckv, kpe, idx, 0.07, cfg=c)  # noqa: E731
            n_tok = 2048
        else:
            lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
            run = lambda c: D.decode(qn, qp, tok_ckv, tok_kpe, slots, lens, 0.07, cfg=c)  # noqa: E731
            n_tok = L
        row = {"B": B, "L": L, "sparse": sparse, "tokens": n_tok, "gather_us": us(lambda: run(cfg)),
               "pointer_us": us(lambda: run(ptr))}
        flops = D.flops(B, H, n_tok, R, P)
        row["tflops"] = {k: flops / (row[k + "_us"] * 1e-6) / 1e12 for k in ("gather", "pointer")}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


SEESAW_SHAPES = [(1, 131072), (8, 32768), (8, 131072), (32, 32768), (128, 8192), (128, 32768)]
# the seesaw kernel's stage-1 variants (decode_seesaw.constexprs); probe ones compute wrong results (timing only)
SEESAW_VARIANTS = {"seesaw": {}, "no copies": dict(probe=1), "no softmax": dict(probe=2),
                   "no copies, no softmax": dict(probe=3)}


def seesaw_rows(ckv, kpe):
    """Stage 1 alone: the warp-specialised kernel's variants (SEESAW_VARIANTS) and the two-warpgroup kernel (PIPE
    schedule); the whole op vs FlashInfer. Same data, same run."""
    rows = []
    for B, L in SEESAW_SHAPES:
        table, lens, qn, qp, cfg, ns, o, lse = case(ckv.shape[0], B, L)
        row = {"B": B, "L": L, "H": H, "splits": ns, "flops": D.flops(B, H, L, R, P)}
        args = (qn, qp, ckv, kpe, table, lens, 0.07, o, lse, o.stride(0), lse.stride(0), ns)
        row["stage1_us"] = {name: us(lambda: S.launch(*args, **v)) for name, v in SEESAW_VARIANTS.items()}
        row["stage1_us"]["pipe"] = us(lambda: W.launch(*args, pipe=True))
        row["stage1_tflops"] = {k: row["flops"] / (v * 1e-6) / 1e12 for k, v in row["stage1_us"].items()}
        row["op_us"] = {"seesaw": us(lambda: D.decode(qn, qp, ckv, kpe, table, lens, 0.07, cfg=cfg))}
        if FI.available():
            fi_run = FI.plan(qn, qp, ckv, table, lens, 0.07).raw
            fi_run(qn, qp, ckv, kpe)
            row["op_us"]["flashinfer"] = us(lambda: fi_run(qn, qp, ckv, kpe))
        row["tflops"] = {k: row["flops"] / (v * 1e-6) / 1e12 for k, v in row["op_us"].items()}
        if "flashinfer" in row["op_us"]:
            row["ratio_vs_flashinfer"] = row["op_us"]["seesaw"] / row["op_us"]["flashinfer"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(path, only_gather=False, only_seesaw=False):
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    pages = max(b * n for b, n in SHAPES) // PS
    ckv = torch.empty(pages, PS, R, dtype=DT, device="cuda").normal_()
    kpe = torch.empty(pages, PS, P, dtype=DT, device="cuda").normal_()
    if only_seesaw:
        res["seesaw"] = seesaw_rows(ckv, kpe)
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1)
        return
    for B, L in ([] if only_gather else SHAPES):
        table, lens, qn, qp, cfg, ns, o, lse = case(pages, B, L)
        row = {"B": B, "L": L, "H": H, "splits": ns, "flops": D.flops(B, H, L, R, P), "stage1_us": {}}
        for tag, pipe in PIPES.items():
            for name, probe in PROBES.items():
                if pipe and name not in PIPE_PROBES:
                    continue
                row["stage1_us"][tag + name] = us(lambda: W.launch(qn, qp, ckv, kpe, table, lens, 0.07, o, lse,
                                                                   o.stride(0), lse.stride(0), ns, probe=probe,
                                                                   pipe=pipe))
        row["op_us"] = us(lambda: D.decode(qn, qp, ckv, kpe, table, lens, 0.07))
        row["tma_op_us"] = us(lambda: D.decode(qn, qp, ckv, kpe, table, lens, 0.07,
                                               cfg=dataclasses.replace(cfg, wgmma=False)))
        if FI.available():
            fi_run = FI.plan(qn, qp, ckv, table, lens, 0.07).raw
            fi_run(qn, qp, ckv, kpe)
            row["flashinfer_us"] = us(lambda: fi_run(qn, qp, ckv, kpe))
        row["tflops"] = {k: row["flops"] / (v * 1e-6) / 1e12 for k, v in
                         [("op", row["op_us"]), ("tma_op", row["tma_op_us"]), ("flashinfer", row.get("flashinfer_us"))]
                         if v}
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
    res["gather"] = gather_rows(ckv, kpe)
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1)


def cli(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--gather", action="store_true", help="only the gather kernel's rows")
    only.add_argument("--seesaw", action="store_true", help="only the warp-specialised kernel's rows")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (sm_90 Gluon kernels, CUDA-graph timing); none here")
    main(a.out, only_gather=a.gather, only_seesaw=a.seesaw)


if __name__ == "__main__":
    cli()
