"""Split-K few-token linear: the splits' sum in the split launch (arrival counters) vs a second launch (not a test).

usage: python benchmarks/lab/linear_sum_in_kernel.py [OUT.json]

GPU time per call of `linear_small_m` with the default config at split-K shapes, queued behind a sleep kernel so
the host's launch cost is hidden (the stream runs the calls back to back: launch gaps included), on the default
stream: `sum_in_kernel=False` (two launches) vs None (one: the scratch counters) vs True (a memset of the call's
own counters + one launch). Also each as CUDA-graph replays (None runs the two launches there: graphs are
captured off the default stream). Rotating weight copies, so every call reads its weights from HBM. Checked
against float64 first.
"""

from __future__ import annotations

import json
import sys

import torch
from triton.testing import do_bench_cudagraph

from mla_compile.kernels.linear import default_linear_config, linear_small_m, small_m_plan

SHAPES = {  # name: (M, K, [N of each weight sharing x]) - the split-K projections of a decode step
    "q_a+kv_a": (8, 2048, [1536, 576]),
    "down": (8, 8192, [2048]),
    "o_proj h128": (8, 16384, [2048]),
    "dsv3 q_a+kv_a": (8, 7168, [1536, 576]),
    "dsv3 o_proj": (8, 16384, [7168]),
    "q_a+kv_a m1": (1, 2048, [1536, 576]),
}
MODES = {"two launches": False, "counters (scratch)": None, "counters (memset)": True}
L2_BYTES = 50 << 20


def queued_us(fn, calls: int = 200) -> float:
    """GPU us per call with the host far ahead: a sleep kernel first, the calls queued behind it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(calls * 100e-6 * 2e9))  # ~100 us of host time per call to absorb
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def main(out: str | None) -> None:
    rows = []
    for name, (M, K, Ns) in SHAPES.items():
        cfg = default_linear_config(M, K, sum(Ns))
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        copies = max(2, -(-4 * L2_BYTES // sum(N * K * 2 for N in Ns)))
        ws = [[(torch.randn(N, K, device="cuda") * K ** -0.5).to(torch.bfloat16) for N in Ns] for _ in range(copies)]
        row = {"shape": name, "M": M, "K": K, "N": Ns, "split_k": cfg.split_k}
        for mode, summed in MODES.items():
            for y, w in zip(linear_small_m(x, ws[0], sum_in_kernel=summed), ws[0]):
                want = x.double() @ w.double().T
                err = ((y.double() - want).abs().max() / want.abs().max()).item()
                assert err < 1e-2, (name, mode, err)
            plan = small_m_plan(x, ws[0], None, summed)  # built once: the calls below pay launches only
            it = iter(range(1 << 30))

            def call(plan=plan):
                plan(x, *ws[next(it) % copies])

            row[f"{mode} queued us"] = queued_us(call)

            def all_copies(plan=plan):
                for c in ws:
                    plan(x, *c)

            row[f"{mode} graph us"] = do_bench_cudagraph(all_copies, rep=200) * 1e3 / copies
        rows.append(row)
        print(json.dumps(row), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
