"""The package's shape (issue 26): no import circle, no upward import between the layers kernels < ops < passes <
backend (tools/import_graph.py reads the imports from the source: deferred ones count, type-only ones do not), and
no module in mla_compile/ over 500 lines."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools import import_graph as ig  # noqa: E402


def test_no_import_circle_and_no_upward_import():
    g = ig.graph("mla_compile")
    assert ig.circles(g) == []
    assert ig.upward(g, "mla_compile", ["kernels", "ops", "passes", "backend"]) == []


def test_type_only_imports_are_not_edges(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    (pkg / "b.py").write_text("from . import a\n")
    monkeypatch.setattr(ig, "ROOT", tmp_path)
    g = ig.graph("pkg")
    assert g["pkg.a"] == set() and g["pkg.b"] == {"pkg.a"}


def test_no_module_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "mla_compile").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_tests_live_in_their_layer_directories():
    """tests/ holds the shared helpers and conftest; every test module sits in one layer directory
    (tests/tree.py lists them; the root conftest puts each on sys.path)."""
    import tree

    tests = ROOT / "tests"
    assert sorted(p.name for p in tests.glob("test_*.py")) == []
    layers = sorted(p.name for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py")))
    assert layers == sorted(tree.LAYERS)
