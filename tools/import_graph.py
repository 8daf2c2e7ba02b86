"""The package's import graph, read from the source (ast; nothing imported): import circles and upward imports.

usage: python tools/import_graph.py [--package mla_compile] [--layers kernels ops passes backend]

Every import counts, at module level or inside a function (a deferred import still ties the two modules
together), except those under `if TYPE_CHECKING:` (never executed: annotations only). Layers go from the bottom up: a module of one layer may import its own layer and the ones below, never
one above ("upward"). Modules in no layer: a leaf one (importing nothing of the package, e.g. tuning.py) may be
imported from anywhere. Prints the circles (strongly connected components of more than one module) and the upward
imports; exit status 1 if there is either.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules(package: str) -> dict[str, Path]:
    base = ROOT / package
    out = {}
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports (resolving relative imports and `from pkg import module`)."""
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    type_only = {id(n) for block in ast.walk(tree) if _is_type_checking_block(block)
                 for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names]
            # `from pkg import module`: an edge to the module only; a name defined by pkg itself: to pkg
            targets = subs + ([base] if any(t not in known for t in subs) else [])
        else:
            continue
        for t in targets:
            while t and t not in known:  # `from pkg import name`: the module pkg.name, else pkg itself
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _is_type_checking_block(node) -> bool:
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def graph(package: str) -> dict[str, set[str]]:
    mods = modules(package)
    known = set(mods)
    # a package's __init__ is not an edge to every submodule: only what it imports itself
    return {m: imports(m, p, known) for m, p in mods.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative enough for a package)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def layer_of(module: str, package: str, layers: list[str]) -> int | None:
    rest = module[len(package) + 1:] if module.startswith(package + ".") else ""
    head = rest.split(".")[0]
    return layers.index(head) if head in layers else None


def upward(g: dict[str, set[str]], package: str, layers: list[str]) -> list[tuple[str, str]]:
    """(importer, imported) where the imported module sits in a higher layer, or in no layer while importing
    something of the package itself (not a leaf)."""
    bad = []
    for a, targets in sorted(g.items()):
        la = layer_of(a, package, layers)
        if la is None:
            continue
        for b in sorted(targets):
            lb = layer_of(b, package, layers)
            if b == package:  # the package's own __init__
                continue
            if (lb is not None and lb > la) or (lb is None and g.get(b) - {package}):
                bad.append((a, b))
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", default="mla_compile")
    ap.add_argument("--layers", nargs="+", default=["kernels", "ops", "passes", "backend"],
                    help="bottom to top")
    a = ap.parse_args(argv)
    g = graph(a.package)
    circ, up = circles(g), upward(g, a.package, a.layers)
    print(f"{len(g)} modules, {sum(map(len, g.values()))} imports")
    print(f"import circles: {len(circ)}")
    for c in circ:
        print("  " + " <-> ".join(c))
    print(f"upward imports (layers {' < '.join(a.layers)}): {len(up)}")
    for x, y in up:
        print(f"  {x} -> {y}")
    return 1 if circ or up else 0


if __name__ == "__main__":
    sys.exit(main())
