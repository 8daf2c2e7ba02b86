"""Benchmark tooling that runs on any machine: the HF step profile's categories, on a recorded H200 profile."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import hf_profile  # noqa: E402


def test_profile_categories_split_the_step_exactly():
    rows = json.loads((ROOT / "benchmarks/data/hf_profile_round5.json").read_text())["rows"]
    row = next(r for r in rows if r["kv_len"] == 32768)
    cats = hf_profile.categorize(row)
    assert sum(cats.values()) == pytest.approx(row["wall_us_per_step"])
    # the stage-1 + merge kernels, the fused pairs and cuBLAS GEMMs, the harness's mask copy and argmax
    stage1 = sum(k["us_per_step"] for k in row["top"] if k["name"] == "_stage1_kernel")
    assert stage1 < cats["attention"] < stage1 + 25
    assert cats["projections"] > sum(k["us_per_step"] for k in row["top"] if k["name"] == "_linear_kernel")
    assert 0 < cats["harness (mask copy, argmax)"] < 40
    assert all(v > 0 for v in cats.values())
