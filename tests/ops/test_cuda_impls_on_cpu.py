"""The ops' CUDA impls (plans, folded multi-token plans, index-list and query-token batches, output makers) without a
GPU:
benchmarks/lab/host_cpu.py --check reroutes them to CPU tensors with their Triton kernels interpreted and compares
every result with the CPU impl's on the same call, each call made twice (the plan made, then found as a recent
signature). A subprocess: TRITON_INTERPRET must be set before triton is imported, and the probe rewires torch._C's
CUDA getters."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_cuda_impls_match_the_cpu_impls_under_the_interpreter(tmp_path):
    out = tmp_path / "check.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "benchmarks/lab/host_cpu.py"), "--check",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert set(d["check"]) == {"decode", "decode S=2", "decode S=2 limits", "decode S=1 limits", "sparse_decode",
                               "sparse_decode S=2", "indexer_topk", "indexer_topk S=2", "k_only_indices",
                               "k_only_indices S=2", "cache_write_fp8_tokens", "cache_write_fp8",
                               "decode S=2 padded rows", "decode S=2 heads first", "sparse_decode S=2 padded",
                               "sparse_decode S=2 tokens first", "indexer_topk S=2 tokens first"}
    for name, (e_out, e_lse, same_empty, same_shape) in d["check"].items():
        assert same_shape and same_empty and e_out < 2e-2 and e_lse < 1e-2, (name, e_out, e_lse)
    assert d["ok"]
