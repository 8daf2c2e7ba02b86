"""What a pointer argument costs Triton's C launcher (question: pass data pointers as ints from our plans?).

Triton 3.6's generated launcher turns each pointer argument into an address by calling the object's `data_ptr()`
and then `cuPointerGetAttribute` on it (a driver call per tensor per launch, to reject CPU tensors); an int argument
is taken as the address directly. This probe launches an empty kernel with ten pointer arguments through the bound
C launcher (`kernels/_launch.bind`, as our plans do) three ways and reports the host time per launch:
tensors as they are, ints computed once (the floor), and `t.data_ptr()` computed in Python per launch (what a plan
would pay to hand the launcher ints). GPU only.

    python benchmarks/lab/launch_args.py [out.json] [--launches 20000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402

from mla_compile.kernels import _launch  # noqa: E402


@triton.jit
def _empty10(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, n):
    pass


def _time(call, launches: int, repeats: int = 5) -> float:
    """Median over `repeats` loops of the host time per launch (us), the GPU drained between loops."""
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(launches):
            call()
        out.append((time.perf_counter() - t0) / launches * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?")
    ap.add_argument("--launches", type=int, default=20000)
    a = ap.parse_args(argv)
    ts = [torch.empty(256, device="cuda") for _ in range(10)]
    ptrs = [t.data_ptr() for t in ts]
    bound = _launch.bind(_empty10, (1,))
    bound(*ts, 1)
    bound(*ts, 1)
    assert bound.raw is not None, "the raw C launcher was not taken"
    rows = {
        "tensors": _time(lambda: bound(*ts, 1), a.launches),
        "ints (precomputed)": _time(lambda: bound(*ptrs, 1), a.launches),
        "ints (t.data_ptr() per launch)": _time(lambda: bound(*[t.data_ptr() for t in ts], 1), a.launches),
        "floor: torch.empty(1)": _time(lambda: torch.empty(1, device="cuda"), a.launches),
    }
    for name, us in rows.items():
        print(f"{name:34s} {us:7.2f} us")
    if a.out:
        Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "us_per_launch": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
