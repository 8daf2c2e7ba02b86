"""Probe (issue 29): what an eager op call would cost with its kernel registered in C++ instead of Python.

Question: after every Python-side cut (benchmarks/lab/host_cpu.py), how much of an eager `mla.decode` call is the
dispatcher's hop into a Python kernel plus the Python around the launches, i.e. what a C++ kernel (a plan cache and
the launches in C++, the Python impl only on a plan miss) would save. Measured on a CPU, no GPU: two ops of
`mla.decode`'s schema (7 tensors, a float), one with a Python kernel, one with a C++ kernel (`load_inline`, ~25 s of
compile), each allocating decode's two outputs and launching nothing; beside them our `mla.decode` through its CUDA
impl on CPU tensors with the launches stubbed (host_cpu.py's route), eager `torch.add` and two allocations from
Python, all timed side by side (host_overhead.host_us_interleaved).

    python benchmarks/lab/cpp_kernel_floor.py [--calls 50000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # host_cpu's route: plans build their launches without a GPU
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import host_cpu  # noqa: E402
import host_overhead as HO  # noqa: E402

SCHEMA = ("(Tensor q_nope, Tensor q_pe, Tensor ckv_cache, Tensor kpe_cache, Tensor block_table, Tensor seq_lens, "
          "float sm_scale) -> (Tensor, Tensor)")
CPP = r"""
#include <ATen/ATen.h>
#include <torch/library.h>

std::tuple<at::Tensor, at::Tensor> cpp_kernel(const at::Tensor& q_nope, const at::Tensor& q_pe,
    const at::Tensor& ckv_cache, const at::Tensor& kpe_cache, const at::Tensor& block_table,
    const at::Tensor& seq_lens, double sm_scale) {
  return {at::empty(q_nope.sizes(), q_nope.options()),
          at::empty({q_nope.size(0), q_nope.size(1)}, q_nope.options().dtype(at::kFloat))};
}

TORCH_LIBRARY_IMPL(cpp_floor_probe, CPU, m) { m.impl("cpp_kernel", &cpp_kernel); }
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=50000)
    ap.add_argument("--json")
    args = ap.parse_args()
    from torch.utils.cpp_extension import load_inline

    lib = torch.library.Library("cpp_floor_probe", "DEF")
    lib.define("py_kernel" + SCHEMA)
    lib.define("cpp_kernel" + SCHEMA)
    empty = torch.empty

    def py_kernel(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale):
        return empty(q_nope.shape, dtype=q_nope.dtype), empty(q_nope.shape[:-1], dtype=torch.float32)

    lib.impl("py_kernel", py_kernel, "CPU")
    load_inline("cpp_floor_probe_ext", cpp_sources=CPP, is_python_module=False)
    host_cpu._cpu_as_cuda()
    t = HO.tensors("cpu")
    q, q_pe, ckv, kpe, table, lens = (t[k] for k in ("qn", "qp", "ckv", "kpe", "table", "lens"))
    ops = torch.ops.cpp_floor_probe
    rows = {
        "mla.decode (CUDA impl, launches stubbed)": HO.op_calls(t)["mla.decode"],
        "op, Python kernel (2 allocations)": lambda: ops.py_kernel(q, q_pe, ckv, kpe, table, lens, 0.1),
        "op, C++ kernel (2 allocations)": lambda: ops.cpp_kernel(q, q_pe, ckv, kpe, table, lens, 0.1),
        "floor: torch.add": lambda: torch.add(t["x"], 1),
        "floor: 2x torch.empty from Python": lambda: (empty(q.shape, dtype=q.dtype),
                                                       empty(q.shape[:-1], dtype=torch.float32)),
    }
    with torch.no_grad():
        result = HO.host_us_interleaved(rows, args.calls)
    for name, us in result.items():
        print(f"{name:40s} {us:6.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
