"""argmax / argmin over one long last dim of a few rows -> a two-stage reduction (a greedy sampler's shape).

A decode step that picks its token in the graph ends in `logits.argmax(-1)` over [B, vocab]: a few rows of 32K-
129K values. Inductor never splits arg-reductions (`ir.Reduction.num_splits`), so that is one program per row
streaming the whole vocab: 7.3 us on the H200 for 8 x 32768 bf16 (benchmarks/RESULTS.md profile), with 8 of 132 SMs busy.
Here the row is viewed as S chunks of C (C divides N): per chunk its arg-index and extreme value (one reduction
over B * S short rows, which fill the GPU), then the arg-index over the S chunk extremes, and
index = chunk * C + local index of that chunk.

Exact, ties and NaN included: within a chunk argmax returns the first index of the maximum (of the first NaN,
which compares above everything) and amax that value (NaN propagates); across chunks the first chunk holding the
maximum (the first NaN) wins, so the result is the first index of the global maximum - torch's definition.
Argmin mirrors it with amin. Fires for floating inputs with a static shape, dim = the last dim (any spelling),
N >= MIN_N with a divisor C in [256, 4096], and at most `tuning.Tuning.split_argmax_max_rows` rows (more rows
already fill the GPU).
Runs on the Dynamo graph; counted in `counters["mla_compile"]["split_arg_reductions"]`.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from .. import tuning
from ._fx import Builder, arg, fake_mode_of, meta_val, replace_each

COUNTER = "split_arg_reductions"
MIN_N = 8192
_EXTREME = {"argmax": torch.amax, "argmin": torch.amin}
_FUNCTIONS = {torch.argmax: "argmax", torch.argmin: "argmin"}


def chunk_width(n: int) -> int | None:
    """The chunk length C (a divisor of n in [256, 4096], nearest 1024 on a log scale), or None."""
    divisors = [c for c in range(256, 4097) if n % c == 0]
    return min(divisors, key=lambda c: (abs(math.log2(c) - 10), c)) if divisors else None


def _site(node: fx.Node):
    """(kind, x, keepdim, C) for an argmax / argmin this pass splits, else None."""
    if node.op == "call_function" and node.target in _FUNCTIONS:
        kind = _FUNCTIONS[node.target]
    elif node.op == "call_method" and node.target in _EXTREME:
        kind = node.target
    else:
        return None
    x, dim, keepdim = arg(node, 0, "input"), arg(node, 1, "dim"), arg(node, 2, "keepdim", False)
    xv = meta_val(x)
    if set(node.kwargs) - {"input", "dim", "keepdim"} or not isinstance(xv, torch.Tensor):
        return None
    if not (xv.dtype.is_floating_point and xv.dim() >= 1 and isinstance(dim, int) and isinstance(keepdim, bool)):
        return None
    shape = tuple(xv.shape)
    if not all(isinstance(s, int) for s in shape) or dim % len(shape) != len(shape) - 1:
        return None
    n, rows = shape[-1], math.prod(shape[:-1])
    c = chunk_width(n) if n >= MIN_N and rows <= tuning.current().split_argmax_max_rows else None
    return None if c is None else (kind, x, keepdim, c)


def split_arg_reductions(gm: fx.GraphModule | fx.Graph) -> int:
    """Rewrite every eligible argmax / argmin (see the module docstring); returns the count."""
    return replace_each(gm, _two_stage, COUNTER)


def _two_stage(graph: fx.Graph, node: fx.Node) -> fx.Node | None:
    site = _site(node)
    if site is None:
        return None
    kind, x, keepdim, c = site
    xv = meta_val(x)
    b = Builder(graph, node, fake_mode_of(graph), node)
    chunks = b.call(torch.reshape, x, (*xv.shape[:-1], xv.shape[-1] // c, c))
    local = b.call(getattr(torch, kind), chunks, -1)  # [*lead, S]: index in its chunk
    extreme = b.call(_EXTREME[kind], chunks, -1)  # [*lead, S]: the chunk's value there
    best = b.call(getattr(torch, kind), extreme, -1, True)  # [*lead, 1]: the first best chunk
    index = b.call(operator.add, b.call(operator.mul, best, c), b.call(torch.gather, local, -1, best))
    return index if keepdim else b.call(torch.squeeze, index, -1)
