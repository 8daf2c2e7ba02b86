"""HF's batched_mm experts -> `mla.expert_linear`: the selected experts' weights are read in place, not gathered.

`generate()` runs HF MoE layers with the "batched_mm" experts at decode (transformers' `batched_mm_experts_forward`,
`_batched_linear`): per (token, expert) pair it copies the expert's weight, `W[expert_ids]` -> [S, O, I], and
multiplies the copy with the pair's activations:

    bmm(W[ids], x.unsqueeze(-1)).squeeze(-1)          # W [E, O, I]
    bmm(x.unsqueeze(1), W[ids]).squeeze(1)            # is_transposed: W [E, I, O]

The copy is a pointwise kernel writing S whole weights that the bmm then reads back (ops/experts.py has the
measured cost). Each bmm here becomes `mla.expert_linear(x, W, ids)` (W.transpose(1, 2) for the transposed
form) unsqueezed to the bmm's shape; a bias (`out.add_(b[ids])`) stays as HF adds it, its gather is small.

Exact up to summation order: out[s] = W[ids[s]] @ x[s] is what the bmm computes for each pair, and the op reads
ids as indexing does (negative ids from the end). Fires on a bmm / matmul of rank-3 operands where one is
`W[ids]` (or `W[(ids,)]`, or its per-pair transpose `W[ids].transpose(1, 2)`) with W a graph input or parameter [E, O, I] and ids one
1-D int64 / int32 vector, the other operand the pairs' activations with a contraction and a unit dim that line
up, one float dtype, and nothing writing W or ids between the gather and the product. Any other product of a
gathered rank-3 tensor is a site left unchanged, counted in `counters["mla_compile"]["expert_gather_not_rewritten"]`
and logged with the reason; rewrites are counted in `..."expert_gather_rewritten"`. Runs on the Dynamo graph.
"""

from __future__ import annotations

import logging
import operator
from typing import NamedTuple

import torch
import torch.fx as fx

from ..ops import _checks
from ..ops import experts  # noqa: F401  (registers mla::expert_linear)
from . import _fx
from ._fx import (Builder, NoMatch, arg, check_same_result, erase_dead, fake_mode_of, finish_edits, first_write,
                  graph_of, is_call, meta_val, same)

log = logging.getLogger(__name__)

COUNTER = "expert_gather_rewritten"
SKIP_COUNTER = "expert_gather_not_rewritten"
# the files whose code decides what the rewrite emits (the pass manager's uuid hashes them)
SOURCES = (__file__, _fx.__file__, _checks.__file__, experts.__file__)

_PRODUCT_FUNCTIONS = {torch.bmm, torch.matmul, operator.matmul}
_PRODUCT_METHODS = {"bmm", "matmul", "__matmul__"}
_UNSQUEEZE_FUNCTIONS = {torch.unsqueeze}
_UNSQUEEZE_METHODS = {"unsqueeze"}


class Gather(NamedTuple):
    node: fx.Node  # W[ids]
    weight: fx.Node  # W
    index: object  # what indexes W (a node when it is one id vector)


def _tensor(node) -> torch.Tensor | None:
    v = meta_val(node)
    return v if isinstance(v, torch.Tensor) else None


def as_gather(node) -> Gather | None:
    """`W[index]` / `W.index_select(0, index)` / `torch.index_select(W, 0, index)` of a rank-3 tensor W by a tensor
    (or a tuple holding one), else None."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2:
        weight, index = node.args
        leaves = index if isinstance(index, (tuple, list)) else (index,)
        if not any(isinstance(i, fx.Node) and _tensor(i) is not None for i in leaves):
            return None
    elif is_call(node, {torch.index_select}, {"index_select"}):
        weight, dim, index = arg(node, 0, "input"), arg(node, 1, "dim"), arg(node, 2, "index")
        if dim != 0 or set(node.kwargs) - {"input", "dim", "index"}:
            return None
    else:
        return None
    w = _tensor(weight)
    return Gather(node, weight, index) if w is not None and w.dim() == 3 else None


def _ids(g: Gather) -> fx.Node:
    """The one 1-D integer id vector that indexes W's dim 0, or NoMatch."""
    if g.node.op != "call_function" or g.node.target is not operator.getitem:
        raise NoMatch("index_select refuses negative ids, which indexing (and mla.expert_linear) reads from the end")
    index = g.index
    if isinstance(index, (tuple, list)):
        if len(index) != 1:
            raise NoMatch(f"W is indexed by {len(index)} indices (only one id vector over the experts is rewritten)")
        index = index[0]
    v = _tensor(index)
    if v is None:
        raise NoMatch("the index of W is not a tensor")
    if v.dtype not in experts.ID_DTYPES:
        raise NoMatch(f"the index of W has dtype {v.dtype} (a mask or other non-id index), not int64 / int32")
    if v.dim() != 1:
        raise NoMatch(f"the index of W has shape {tuple(v.shape)}, not a 1-D vector of expert ids")
    return index


def _weight(g: Gather) -> fx.Node:
    w = g.weight
    if not (isinstance(w, fx.Node) and w.op in ("placeholder", "get_attr")):
        raise NoMatch(f"W ({getattr(w, 'name', w)}) is computed in the graph, not a graph input or parameter")
    return w


def _pairs(operand: fx.Node, unit_dim: int, b: Builder) -> fx.Node:
    """The pairs' activations x [S, I] behind the product's other operand (x.unsqueeze(unit_dim)): the unsqueeze's
    input, else a select of that unit dim."""
    if is_call(operand, _UNSQUEEZE_FUNCTIONS, _UNSQUEEZE_METHODS) and len(operand.args) == 2 and not operand.kwargs:
        src, dim = operand.args
        v = _tensor(src)
        if v is not None and v.dim() == 2 and isinstance(dim, int) and dim % 3 == unit_dim:
            return src
    return b.call(torch.select, operand, unit_dim, 0)


def _swaps_last_two(node) -> bool:
    """transpose(t, 1, 2) / t.transpose(-1, -2) / t.permute(0, 2, 1) of a rank-3 t (a view)."""
    if is_call(node, {torch.transpose}, {"transpose"}) and len(node.args) == 3 and not node.kwargs:
        dims = node.args[1:]
        return all(isinstance(d, int) for d in dims) and {d % 3 for d in dims} == {1, 2}
    if is_call(node, {torch.permute}, {"permute"}) and not node.kwargs:
        dims = node.args[1:] if len(node.args) == 4 else node.args[1] if len(node.args) == 2 else None
        return (isinstance(dims, (tuple, list)) and all(isinstance(d, int) for d in dims)
                and tuple(d % 3 for d in dims) == (0, 2, 1))
    return False


class Operand(NamedTuple):
    """A product's operand that is W[ids], or its per-pair transpose (`W[ids].transpose(1, 2)`)."""

    node: fx.Node  # the operand itself
    gather: Gather
    swapped: bool  # the operand is the gather's transposed view


def as_gathered(node) -> Operand | None:
    g = as_gather(node)
    if g is not None:
        return Operand(node, g, False)
    if _swaps_last_two(node):
        g = as_gather(node.args[0])
        if g is not None:
            return Operand(node, g, True)
    return None


class Site(NamedTuple):
    operand: Operand
    ids: fx.Node
    other: fx.Node  # the activations operand [S, I, 1] (or [S, 1, I])
    on_the_right: bool  # the gathered operand is the right one: x[:, None, :] @ [S, I, O]

    @property
    def transposed(self) -> bool:
        """W is [E, I, O] (HF's `is_transposed`): the op reads it as W.transpose(1, 2)."""
        return self.on_the_right != self.operand.swapped


def as_site(node: fx.Node) -> Operand | None:
    """The gathered operand of a product this pass looks at (a bmm / matmul with an operand `W[ids]` of a rank-3 W,
    or its transpose)."""
    if not is_call(node, _PRODUCT_FUNCTIONS, _PRODUCT_METHODS):
        return None
    for a in node.args[:2]:
        op = as_gathered(a)
        if op is not None:
            return op
    return None


def prove(graph: fx.Graph, node: fx.Node, op: Operand) -> Site:
    """The site's parts once every condition of the rewrite holds (module docstring), else NoMatch saying which
    does not."""
    if len(node.args) != 2 or node.kwargs:
        raise NoMatch("the product has keyword arguments (out=) or not two operands")
    a, b = node.args
    on_the_right = op.node is b
    other = a if on_the_right else b
    if as_gathered(other) is not None:
        raise NoMatch("both operands are gathered")
    g = op.gather
    w = _weight(g)
    ids = _ids(g)
    wv, ov, pv = _tensor(w), _tensor(other), _tensor(op.node)
    if ov is None or ov.dim() != 3:
        raise NoMatch(f"the activations operand has shape {None if ov is None else tuple(ov.shape)}, not rank 3")
    if not (wv.dtype == ov.dtype and wv.dtype in _checks.REFERENCE_DTYPES):
        raise NoMatch(f"dtypes {wv.dtype} (W) and {ov.dtype} (activations): not one float dtype")
    if wv.device != ov.device or _tensor(ids).device != wv.device:
        raise NoMatch("W, ids and the activations are not on one device")
    S = pv.shape[0]  # = len(ids)
    if on_the_right:  # [S, 1, I] @ [S, I, O]
        ok = same(ov.shape[0], S) and same(ov.shape[1], 1) and same(ov.shape[2], pv.shape[1])
        want = "[S, 1, I] with S = len(ids), I = the per-pair weight's rows"
    else:  # [S, O, I] @ [S, I, 1]
        ok = same(ov.shape[0], S) and same(ov.shape[1], pv.shape[2]) and same(ov.shape[2], 1)
        want = "[S, I, 1] with S = len(ids), I = the per-pair weight's columns"
    if not ok:
        raise NoMatch(f"the activations operand has shape {tuple(ov.shape)}, not {want}")
    # W[ids] is a copy: the product reads what W, ids (and the copy itself) held at the gather
    written = first_write(graph, {w: g.node, ids: g.node, g.node: g.node}, node)
    if written is not None:
        raise NoMatch(f"{written[1].name} is written by {written[0].name} between the gather and the product")
    return Site(op, ids, other, on_the_right)


def emit_expert_linear(b: Builder, x, w, ids) -> fx.Node:
    """`mla.expert_linear(x, w, ids)` inserted by `b`; NoMatch where the op's own argument checks (its fake impl)
    refuse the operands."""
    try:
        return b.call(torch.ops.mla.expert_linear.default, x, w, ids)
    except ValueError as e:
        raise NoMatch(f"mla.expert_linear refuses the operands: {e}") from None


def rewrite(graph: fx.Graph, node: fx.Node, site: Site, fake_mode) -> fx.Node:
    """Insert `expert_linear(x, W (transposed view), ids).unsqueeze(unit dim)` before the product; returns it."""
    unit_dim = 1 if site.on_the_right else 2
    with Builder(graph, node, fake_mode, node).all_or_nothing() as b:
        x = _pairs(site.other, unit_dim, b)
        w = site.operand.gather.weight
        if site.transposed:
            w = b.call(torch.transpose, w, 1, 2)
        y = emit_expert_linear(b, x, w, site.ids)
        out = b.call(torch.unsqueeze, y, unit_dim)
        # what the product gave, dtype included (under autocast a float32 bmm computes and returns bfloat16; the
        # op would not): anything else stays HF's
        check_same_result(out, node, "the product")
    return out


def rewrite_expert_gathers(gm: fx.GraphModule | fx.Graph) -> int:
    """Rewrite every provable batched_mm expert product of `gm` (a Dynamo graph, or its fx.Graph) in place; returns
    the number rewritten. Sites left unchanged are counted and logged with the reason."""
    graph = graph_of(gm)
    counters = torch._dynamo.utils.counters["mla_compile"]
    fake_mode = None
    rewritten = 0
    for node in list(graph.nodes):
        op = as_site(node)
        if op is None:
            continue
        g = op.gather
        try:
            site = prove(graph, node, op)
            if fake_mode is None:
                fake_mode = fake_mode_of(graph)
            out = rewrite(graph, node, site, fake_mode)
        except NoMatch as e:
            counters[SKIP_COUNTER] += 1
            log.info("expert_gather: not rewritten: product %s of %s: %s", node.name, g.node.name, e)
            continue
        except Exception as e:  # noqa: BLE001 - a bug in the pass must not break the user's model
            counters[SKIP_COUNTER] += 1
            log.warning("expert_gather: not rewritten: product %s of %s: internal error %s: %s (site left unchanged; "
                        "please report)", node.name, g.node.name, type(e).__name__, e, exc_info=True)
            continue
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        erase_dead(graph, [op.node, site.other])
        rewritten += 1
        log.info("expert_gather: %s of %s[%s] -> mla.expert_linear%s", node.name, g.weight.name, site.ids.name,
                 " (transposed experts)" if site.transposed else "")
    if rewritten:
        counters[COUNTER] += rewritten
        finish_edits(graph)
    return rewritten
