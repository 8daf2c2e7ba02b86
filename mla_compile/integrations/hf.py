"""Caches for HF transformers MLA models (placeholder: filled in below)."""

from __future__ import annotations

GATHER_OPS: set = set()


def describe_gather(node, LatentSource):
    raise NotImplementedError
