"""README's main-job command runs end to end on CPU and passes (it exits non-zero on any mismatch)."""

import subprocess
import sys
from pathlib import Path


def test_demo_passes_on_cpu():
    proc = subprocess.run([sys.executable, "-m", "mla_compile", "demo", "--device", "cpu"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "DeepSeek-V3, DCP-sharded latent cache" in out
    assert "max_kv_len <= 20" in out and "21 <= " in out  # both DSA graphs, guarded on the host int
    assert out.rstrip().splitlines()[-1].startswith("PASS")


def test_demo_rejects_a_topk_that_is_never_crossed():
    proc = subprocess.run([sys.executable, "-m", "mla_compile", "demo", "--topk", "500"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--topk" in proc.stderr
