"""Run a test module as a child process under TRITON_INTERPRET=1 and read its verdict.

TRITON_INTERPRET must be set before triton is imported, and other test modules import triton normally, so a
module's interpreter checks run in a child (the module run as a script) that prints `VERDICT <json>` last."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import tree


def interpreter_verdict(path: str, timeout: int = 600):
    """The JSON verdict the script `path` prints under TRITON_INTERPRET=1 (with the repo and tests/ importable);
    AssertionError with its output when it printed none."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=tree.child_pythonpath())
    proc = subprocess.run([sys.executable, os.path.abspath(path)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VERDICT ")]
    assert lines, f"interpreter child failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("VERDICT "):])
