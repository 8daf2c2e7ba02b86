"""benchmarks/indexer_select.py's CPU smoke test under the Triton interpreter (its two selects agree), so the
benchmark runs when it reaches the GPU. The kernels themselves: tests/kernels/test_indexer_kernels.py."""

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
import indexer_select
indexer_select.main(["--check"])
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_indexer_select_benchmark_checks_under_the_interpreter():
    path = os.pathsep.join([tree.child_pythonpath(), str(ROOT / "tests" / "kernels"), str(ROOT / "benchmarks")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    verdict = [ln for ln in proc.stdout.splitlines() if ln.startswith("VERDICT ")]
    assert verdict, f"child failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert verdict[-1] == "VERDICT ok", verdict[-1]
