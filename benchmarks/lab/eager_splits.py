"""Lab probe (issue 29): does an eager `mla.decode` want the split count the policy picks for graph replay?

`kernels/decode.num_splits` fills one wave of programs: the best GPU time, what a CUDA-graph replay sees. An eager
call (default-mode compile, no CUDA graphs) also pays its host time, and a split call launches twice (stage 1, then
the merge); when the host is the bottleneck, the GPU time saved by splitting is hidden behind it and only the second
launch is felt. The question: at which shapes would fewer splits (one: no merge launch) make back-to-back eager
calls faster, wall clock, without touching what graph replay runs?

Per shape and split count (the policy's, a quarter of it, one): the CUDA-graph replay median of the plan's call
(`do_bench_cudagraph`), and the eager wall time per call of a loop of calls each followed by FILLER small torch ops
(what else an eager decode step launches between two attention calls), the GPU drained once at the end.

    python benchmarks/lab/eager_splits.py OUT.json [--shapes B:KV ...] [--heads 16 32] [--filler 8]   (GPU)
    TRITON_INTERPRET=1 python benchmarks/lab/eager_splits.py --check-only                          (CPU: the plans)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import mla_compile.ops  # noqa: E402,F401  (registers the ops: the CPU reference)
from mla_compile.kernels import decode as D  # noqa: E402
from mla_compile.kernels._util import cdiv  # noqa: E402

R, P, PS = 512, 64, 64
SCALE = 192 ** -0.5


def problem(B: int, kv: int, H: int, device, seed: int = 0):
    """(q_nope, q_pe, ckv, kpe, table, lens): B requests of kv tokens on shuffled pages, bf16."""
    g = torch.Generator(device=device).manual_seed(seed)
    pages = B * cdiv(kv, PS)
    ckv = torch.randn(pages, PS, R, dtype=torch.bfloat16, device=device, generator=g)
    kpe = torch.randn(pages, PS, P, dtype=torch.bfloat16, device=device, generator=g)
    table = torch.randperm(pages, device=device, generator=g).view(B, -1).int()
    lens = torch.full((B,), kv, dtype=torch.int32, device=device)
    qn = torch.randn(B, H, R, dtype=torch.bfloat16, device=device, generator=g)
    qp = torch.randn(B, H, P, dtype=torch.bfloat16, device=device, generator=g)
    return qn, qp, ckv, kpe, table, lens


def split_counts(args) -> list[int]:
    policy = D.decode_plan(*args, SCALE).ns
    return sorted({policy, max(1, policy // 4), 1}, reverse=True)


def check(device) -> list[dict]:
    """Every split count's plan against the CPU op (float64 of the same values) on a small problem."""
    rows = []
    for B, kv, H in ((2, 300, 16), (1, 1024, 16)):
        args = problem(B, kv, H, device)
        cpu = [t.cpu() for t in args]
        want_out, want_lse = torch.ops.mla.decode(cpu[0].double(), cpu[1].double(), cpu[2].double(), cpu[3].double(),
                                                  cpu[4], cpu[5], SCALE)
        for ns in sorted({1, 2, 4}):
            out, lse = D.decode_plan(*args, SCALE, splits=ns).run(*args)
            e_out = float((out.cpu().double() - want_out).abs().max() / want_out.abs().max())
            e_lse = float((lse.cpu().double() - want_lse).abs().max())
            ok = e_out < 2e-2 and e_lse < 1e-3
            rows.append(dict(B=B, kv=kv, H=H, splits=ns, out_err=e_out, lse_err=e_lse, ok=ok))
            print(f"check B {B} kv {kv} H {H} splits {ns}: out {e_out:.1e} lse {e_lse:.1e} {'ok' if ok else 'FAILED'}")
    return rows


def eager_us(call, filler: int, calls: int = 300) -> float:
    """Wall time per call of `calls` back-to-back eager calls, each followed by `filler` small torch ops."""
    x = torch.zeros(64, device="cuda")

    def step():
        call()
        for _ in range(filler):
            x.add_(1.0)

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def bench(shapes, heads, filler: int) -> list[dict]:
    from triton.testing import do_bench_cudagraph

    rows = []
    for H in heads:
        for B, kv in shapes:
            args = problem(B, kv, H, "cuda")
            policy = D.decode_plan(*args, SCALE).ns
            for ns in split_counts(args):
                run = D.decode_plan(*args, SCALE, splits=ns).run
                call = lambda: run(*args)  # noqa: E731
                row = dict(H=H, B=B, kv=kv, splits=ns, policy_splits=policy,
                           graph_us=1e3 * do_bench_cudagraph(call, rep=50, return_mode="median"),
                           eager_us=eager_us(call, 0), eager_with_filler_us=eager_us(call, filler))
                rows.append(row)
                print(json.dumps(row))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--shapes", nargs="*", default=["1:1024", "1:4096", "1:16384", "8:1024", "8:4096", "8:16384",
                                                    "32:4096"])
    # few heads: auto's kernel there is the Triton one this probe plans (kernels/decode.py); many heads take the
    # Gluon kernels, whose split policy is another (kernels/dispatch.py `_config`)
    ap.add_argument("--heads", nargs="*", type=int, default=[16, 32])
    ap.add_argument("--filler", type=int, default=8, help="small torch ops after each call (the rest of a step)")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("no GPU: run the check under TRITON_INTERPRET=1")
        return 2
    res = {"provenance": f"cuda: {torch.cuda.get_device_name()}" if device == "cuda" else "cpu (interpreter)",
           "check": check(device)}
    if device == "cuda" and not a.check_only:
        res["bench"] = bench([tuple(int(x) for x in s.split(":")) for s in a.shapes], a.heads, a.filler)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0 if all(r["ok"] for r in res["check"]) else 1


if __name__ == "__main__":
    sys.exit(main())
