"""Split-KV decode: the splits merged in the stage-1 launch itself (kernels/merge.py, ticketed merge programs) vs a
second launch (not a test).

usage: python benchmarks/lab/decode_merge_in_kernel.py [OUT.json]

Per shape (auto's kernel on this device: the swap-AB Gluon kernel at few heads on sm_90, the Triton pointer kernel
for index lists and small pages), each mode's plan built once (`merge_in_kernel` False: two launches; None: one, the
default stream's scratch counters; True: a memset of the call's own counters + one launch):
  queued us   GPU us per call with the host far ahead (a sleep kernel first, the calls queued behind it: the GPU
              time an eager call costs where the host is not the bottleneck, launch gaps included)
  wall us     wall us per call of calls back to back, the GPU drained between loops (what an eager caller sees)
  graph us    CUDA-graph replay (None takes two launches there: graphs are captured off the default stream)
Checked against the two-launch result first (bitwise for the Triton kernel).
"""

from __future__ import annotations

import json
import sys
import time

import torch
from triton.testing import do_bench_cudagraph

from mla_compile import paged
from mla_compile.kernels import decode as D
from mla_compile.kernels import dispatch
from linear_sum_in_kernel import queued_us  # this folder's: GPU us per call queued behind a sleep kernel

BF16 = torch.bfloat16
SHAPES = {  # name: (H, lens, page size, sparse top-k or 0)
    "H16 B1 1K": (16, [1024], 64, 0),
    "H16 B1 2K": (16, [2048], 64, 0),
    "H16 B1 4K": (16, [4096], 64, 0),
    "H16 B1 8K": (16, [8192], 64, 0),
    "H16 B2 2K": (16, [2048] * 2, 64, 0),
    "H16 B4 4K": (16, [4096] * 4, 64, 0),
    "H16 B1 4K token table": (16, [4096], 1, 0),
    "H128 B1 4K": (128, [4096], 64, 0),
    "H16 B1 sparse 256": (16, [4096], 64, 256),
    "H16 B1 sparse 2048": (16, [8192], 64, 2048),
    "H16 B4 sparse 2048": (16, [8192] * 4, 64, 2048),
    "H32 B2 2K page 16": (32, [2048] * 2, 16, 0),
}
MODES = {"two launches": False, "one launch (scratch counters)": None, "one launch (memset)": True}


def wall_us(fn, calls: int = 300) -> float:
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    return sorted(times)[len(times) // 2]


def case(H, lens, PS, topk, seed=0):
    g = torch.Generator().manual_seed(seed)
    ckv = [torch.randn(n, 512, generator=g).to(BF16) for n in lens]
    kpe = [torch.randn(n, 64, generator=g).to(BF16) for n in lens]
    b = paged.fill_paged(ckv, kpe, PS, shuffle=True, generator=g)
    qn = torch.randn(len(lens), H, 512, generator=g).to(BF16).cuda()
    qp = torch.randn(len(lens), H, 64, generator=g).to(BF16).cuda()
    ckv_c, kpe_c, table, seq = (t.cuda() for t in (b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens))
    if topk:
        from mla_compile.ops.attention import token_slots

        slots = token_slots(table, PS, min(lens))
        pick = torch.stack([torch.randperm(min(lens), generator=g)[:topk] for _ in lens]).cuda()
        idx = slots.gather(1, pick).int()
        return (qn, qp, ckv_c, kpe_c, idx, 0.07), True
    return (qn, qp, ckv_c, kpe_c, table, seq, 0.07), False


def main(out: str | None) -> None:
    rows = []
    for name, (H, lens, PS, topk) in SHAPES.items():
        args, sparse = case(H, lens, PS, topk)
        cfg = dispatch.own_decode_config(*args[:4], sparse)
        make = D.sparse_decode_plan if sparse else D.decode_plan
        plans = {mode: make(*args, cfg=cfg, merge_in_kernel=m) for mode, m in MODES.items()}
        call_args = (*args[:5], None) if sparse else args[:6]
        two = plans["two launches"](*call_args)
        row = {"shape": name, "kernel": plans["two launches"].kind, "splits": plans["two launches"].ns,
               "one launch": plans["one launch (memset)"].merged is not None}  # else every mode takes two
        for mode, plan in plans.items():
            out_, lse = plan(*call_args)
            torch.cuda.synchronize()
            err = float((out_.double() - two[0].double()).norm() / two[0].double().norm())
            row[f"{mode} bitwise"] = bool(torch.equal(out_, two[0]) and torch.equal(lse, two[1]))
            row[f"{mode} rel err"] = err
            assert err < 1e-3, (name, mode, err)
            row[f"{mode} queued us"] = queued_us(lambda: plan(*call_args))
            row[f"{mode} wall us"] = wall_us(lambda: plan(*call_args))
            row[f"{mode} graph us"] = do_bench_cudagraph(lambda: plan(*call_args), rep=200) * 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
