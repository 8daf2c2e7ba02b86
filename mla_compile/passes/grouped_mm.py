"""HF's grouped_mm experts fallback -> `mla.expert_linear`: the expert products on the device, CUDA-graph safe.

transformers >= 5.25 runs a "grouped_mm" MoE layer (its default experts implementation) through torch's
`grouped_mm` where it can; under torch.compile with weights other than bf16 it calls its own custom op instead,
`transformers::grouped_mm_fallback(x, W, offs)`: a host loop over the experts that reads `offs` on the host
(`offs.tolist()`). That read is a device sync per call and no CUDA graph can capture it (HF's own reduce-overhead
compile fails: "Cannot copy between CPU and CUDA tensors during CUDA graph capture"). generate() avoids it by
switching to batched_mm while decoding; a model stepped by hand does not.

The op's definition: x [S, I] holds the pairs grouped by expert, offs [E] where each expert's group ends (a running
count), W [E, I, O]; out[s] = x[s] @ W[e] for offs[e - 1] <= s < offs[e], and rows from offs[-1] on stay zero. Where
offs is nondecreasing that is, for every row, e(s) = searchsorted(offs, s, right=True) (E past the last group):

    out = where(e(s) < E, expert_linear(x, W.transpose(1, 2), min(e(s), E - 1)), 0)

The rewrite takes only an offs the graph proves nondecreasing: a cumsum over dim 0 of expert counts (`histc` /
`bincount`, casts allowed between), HF's own form. Anything else is a site left unchanged, counted in
`counters["mla_compile"]["grouped_mm_not_rewritten"]` and logged with the reason; rewrites are counted in
`..."grouped_mm_rewritten"`. Runs on the Dynamo graph.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from ..ops import experts  # noqa: F401  (registers mla::expert_linear)
from . import _fx, expert_gather
from ._fx import Builder, NoMatch, arg, check_same_result, fake_mode_of, finish_edits, graph_of, meta_val, same
from .expert_gather import emit_expert_linear

log = logging.getLogger(__name__)

COUNTER = "grouped_mm_rewritten"
SKIP_COUNTER = "grouped_mm_not_rewritten"
OP_NAME = "transformers::grouped_mm_fallback"
SOURCES = (__file__, _fx.__file__, expert_gather.__file__, experts.__file__)

_COUNTS = {torch.histc, torch.bincount}
_CASTS = ("to", "int", "long", "float", "type")


def _is_fallback(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    name = getattr(target, "_qualified_op_name", None) or getattr(getattr(target, "_schema", None), "name", None)
    return name == OP_NAME


def _uncast(n):
    while isinstance(n, fx.Node) and n.op == "call_method" and n.target in _CASTS:
        n = n.args[0]
    return n


def _prove_nondecreasing(offs) -> None:
    """offs = cumsum(counts, dim=0) of expert counts (histc / bincount: nonnegative), casts allowed around it."""
    n = _uncast(offs)
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target is torch.cumsum):
        raise NoMatch(f"offs ({getattr(n, 'name', n)}) is not a cumsum of expert counts: cannot prove it "
                      "nondecreasing")
    if arg(n, 1, "dim") not in (0, -1):
        raise NoMatch("offs is a cumsum over another dim than the experts'")
    counts = _uncast(n.args[0])
    if not (isinstance(counts, fx.Node) and counts.op == "call_function" and counts.target in _COUNTS):
        raise NoMatch(f"offs sums {getattr(counts, 'name', counts)}, not histc / bincount counts")


def rewrite(graph: fx.Graph, node: fx.Node, fake_mode) -> fx.Node:
    """The expert_linear form of the fallback call `node` (module docstring), inserted before it; returns its out."""
    x, w = arg(node, 0, "input"), arg(node, 1, "weight")
    offs = arg(node, 2, "offs")
    xv, wv, ov = meta_val(x), meta_val(w), meta_val(offs)
    if not all(isinstance(v, torch.Tensor) for v in (xv, wv, ov)):
        raise NoMatch("input / weight / offs are not tensors of the graph")
    if xv.dim() != 2 or wv.dim() != 3 or ov.dim() != 1 or not same(ov.shape[0], wv.shape[0]):
        raise NoMatch(f"shapes input {tuple(xv.shape)}, weight {tuple(wv.shape)}, offs {tuple(ov.shape)} are not "
                      "[S, I], [E, I, O], [E]")
    _prove_nondecreasing(offs)
    E = wv.shape[0]
    with Builder(graph, node, fake_mode, node).all_or_nothing() as b:
        S = xv.shape[0] if isinstance(xv.shape[0], int) else b.call(torch.ops.aten.sym_size.int, x, 0)
        rows = b.call(torch.arange, S, device=xv.device, dtype=ov.dtype)
        group = b.call(torch.searchsorted, offs, rows, right=True)
        ids = b.call(torch.clamp, group, max=E - 1)
        y = emit_expert_linear(b, x, b.call(torch.transpose, w, 1, 2), ids)
        grouped = b.call(torch.unsqueeze, b.call(torch.lt, group, E), 1)
        out = b.call(torch.where, grouped, y, b.call(torch.zeros_like, y))
        check_same_result(out, node, "the op")
    return out


def rewrite_grouped_mm_fallbacks(gm: fx.GraphModule | fx.Graph) -> int:
    """Rewrite every provable `transformers::grouped_mm_fallback` call of `gm` in place; returns the number
    rewritten. Sites left unchanged are counted and logged with the reason."""
    graph = graph_of(gm)
    counters = torch._dynamo.utils.counters["mla_compile"]
    fake_mode, rewritten = None, 0
    for node in list(graph.nodes):
        if not _is_fallback(node):
            continue
        try:
            if fake_mode is None:
                fake_mode = fake_mode_of(graph)
            out = rewrite(graph, node, fake_mode)
        except NoMatch as e:
            counters[SKIP_COUNTER] += 1
            log.info("grouped_mm: not rewritten: %s: %s", node.name, e)
            continue
        except Exception as e:  # noqa: BLE001 - a bug in the pass must not break the user's model
            counters[SKIP_COUNTER] += 1
            log.warning("grouped_mm: not rewritten: %s: internal error %s: %s (site left unchanged; please report)",
                        node.name, type(e).__name__, e, exc_info=True)
            continue
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        rewritten += 1
        log.info("grouped_mm: %s -> mla.expert_linear (expert ids from the group offsets)", node.name)
    if rewritten:
        counters[COUNTER] += rewritten
        finish_edits(graph)
    return rewritten
