"""benchmarks/lab/topk_probe.py's radix-select top-k kernel (a lab candidate for `dsa::indexer_topk`'s torch.topk,
issue 29) under the Triton interpreter: equal to torch.topk's values on small rows, with ties at the k-th place,
NONE padding and early-exit rows. Kept in CI so the probe is right when it reaches the GPU (it times it there)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tree

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
from test_triton_interpret import _patch_interpreter_for_numpy2
_patch_interpreter_for_numpy2()
import topk_probe
topk_probe.main(["--check"])
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_radix_topk_equals_torch_topk_under_the_interpreter():
    path = os.pathsep.join([tree.child_pythonpath(), str(ROOT / "tests" / "kernels"), str(ROOT / "benchmarks" / "lab")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    verdict = [ln for ln in proc.stdout.splitlines() if ln.startswith("VERDICT ")]
    assert verdict, f"child failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert verdict[-1] == "VERDICT ok", verdict[-1]
