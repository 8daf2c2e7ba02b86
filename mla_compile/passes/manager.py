"""The pass manager: the backend's graph passes in order, and the key of their code in Inductor's caches.

The passes run on the Dynamo graph, before AOTAutograd (`backend.rewrite_graph`): there attention still has one
form on every device. Inductor's caches key on the graph they are handed (the rewritten one) and on the Inductor
config, which carries `cache_key()`: a post-grad custom pass that changes nothing (the graph was rewritten already)
and whose uuid hashes the passes' source files plus `sources` (code that ends up in the compiled graph without being
a pass: composite ops that AOTAutograd decomposes after the key is taken). Inductor turns its FX graph cache off
for a custom pass without a uuid.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GraphPass:
    """One pass: `run(gm)` rewrites the Dynamo graph in place (each pass counts and logs its own rewrites) and
    returns how many sites it rewrote; `sources`: the files whose code decides what it does."""

    name: str
    run: Callable[[fx.GraphModule], int]
    sources: tuple[str, ...]


class PassManager:
    """Runs graph passes in order on a Dynamo graph."""

    def __init__(self, passes: Sequence[GraphPass] = (), sources: Sequence[str] = (), key: str = ""):
        """`key`: what else decides the passes' output (the backend's Tuning), hashed into the uuid."""
        self.passes = list(passes)
        self.sources = tuple(sources)
        self.key = key

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        for p in self.passes:
            n = p.run(gm)
            log.debug("pass %s rewrote %d site(s)", p.name, n)
        return gm

    def uuid(self) -> bytes:
        files = {f for p in self.passes for f in p.sources} | set(self.sources)
        names = ",".join(p.name for p in self.passes)
        return get_hash_for_files((__file__,) + tuple(sorted(files))) + f"{names};{self.key}".encode()

    def cache_key(self) -> CustomGraphPass:
        """The post-grad custom pass for Inductor's config (`post_grad_custom_pre_pass`): does nothing, keys the
        caches on this manager's uuid."""
        return _CacheKey(self)


class _CacheKey(CustomGraphPass):
    def __init__(self, manager: PassManager):
        self.manager = manager

    def __call__(self, graph: fx.Graph) -> None:
        pass  # the passes ran on the Dynamo graph, before AOTAutograd

    def uuid(self) -> bytes:
        return self.manager.uuid()
