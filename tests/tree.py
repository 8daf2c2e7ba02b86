"""Where the tests import from. The test modules live in one directory per layer (ops, passes, dcp, hf, kernels,
docs, gpu); the shared helpers (hf_models, reference, argmax_cases, interpreter_child) live in tests/ itself, and
a few test modules are imported by others by name (test_dcp_gloo's gloo harness, test_fused_linear_pass's
op_lines, test_triton_interpret's interpreter patch). The root conftest puts these directories on sys.path;
child processes (interpreter children) get them, with the repository root, as PYTHONPATH."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
LAYERS = ("ops", "passes", "dcp", "hf", "kernels", "docs", "gpu")


def import_roots() -> list[str]:
    return [str(TESTS), *(str(TESTS / d) for d in LAYERS)]


def child_pythonpath() -> str:
    return os.pathsep.join([str(ROOT), *import_roots()])
