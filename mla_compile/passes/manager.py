"""The pass manager: an Inductor `CustomGraphPass` with a content-derived `uuid()`.

Inductor's FX graph cache keys on the custom pass's uuid; a pass without one disables the cache. The uuid
hashes the source of every registered pass file, so editing a pass invalidates exactly the right entries.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

log = logging.getLogger(__name__)

GraphPass = Callable[[torch.fx.Graph], int]  # returns the number of rewrites it made


class PassManager(CustomGraphPass):
    """Runs graph passes in order on an Inductor FX graph; each returns how many sites it rewrote."""

    def __init__(self, passes: list[tuple[str, GraphPass, str]] | None = None, sources: tuple[str, ...] = ()):
        # (name, pass, source file) — the file feeds the uuid; `sources`: more files whose code ends up in the
        # compiled graph without being a pass (e.g. composite ops that AOTAutograd decomposes)
        self.passes = list(passes or [])
        self.sources = tuple(sources)

    def add(self, name: str, graph_pass: GraphPass, source_file: str) -> None:
        self.passes.append((name, graph_pass, source_file))

    def __call__(self, graph: torch.fx.Graph) -> None:
        for name, graph_pass, _ in self.passes:
            n = graph_pass(graph)
            if n:
                torch._dynamo.utils.counters["mla_compile"][name] += n
                log.debug("pass %s rewrote %d site(s)", name, n)
        graph.lint()

    def uuid(self) -> bytes:
        files = (__file__,) + tuple(sorted({f for _, _, f in self.passes} | set(self.sources)))
        return get_hash_for_files(files) + ",".join(n for n, _, _ in self.passes).encode()
