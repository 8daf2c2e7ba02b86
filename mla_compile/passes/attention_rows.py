"""The proof that a multi-token step's mask fits `mla.decode`'s multi-token contract (the emission and the
contract itself: `passes/attention_tokens.py`): every query row's valid tokens are a position prefix of the last
row's. Proven from the graph, never from values (see `attention_tokens`' docstring for the forms)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from . import attention_mask as masks
from ._fx import NoMatch, arg, is_fn, is_op, val

MAX_QUERY_TOKENS = 8  # the most query tokens per request a step may have and still be rewritten as a decode step
_AND = {operator.and_, torch.logical_and, torch.bitwise_and}


def condition(mask: fx.Node) -> fx.Node:
    """The boolean condition (True = attend) of a proven mask: the mask itself (bool), or eager's
    where(cond, 0, c)."""
    if val(mask).dtype == torch.bool:
        return mask
    if is_fn(mask, {torch.where}) and len(mask.args) == 3 and masks._is_zero(mask.args[1]):
        return mask.args[0]
    raise NoMatch(f"mask {mask.name} of a multi-token step is not a bool mask or where(cond, 0, min)")


def _unwrap(n):
    """Through shape-keeping wrappers: .to(device / bool), .expand(...)."""
    while isinstance(n, fx.Node) and is_op(n, "to", "expand") and isinstance(n.args[0], fx.Node):
        if is_op(n, "to") and val(n).dtype != val(n.args[0]).dtype:
            break
        n = n.args[0]
    return n


def _terms(cond) -> list:
    cond = _unwrap(cond)
    if isinstance(cond, fx.Node) and (is_fn(cond, _AND) or is_op(cond, "__and__", "logical_and", "bitwise_and")):
        return _terms(cond.args[0]) + _terms(cond.args[1])
    return [cond]


def _query_size(t) -> int:
    """Size of a term along the query dim (dim -2 of the broadcast [B, 1, S, L]); 1 for a 0-/1-D term."""
    v = val(t)
    if not isinstance(v, torch.Tensor):
        return 1
    return v.shape[-2] if v.dim() >= 2 else 1


def _arange_plus(n, length: int, axis: int, int_offset: bool) -> bool:
    """n is arange(length) (+ an offset: an int when int_offset, else anything) laid along `axis` of a 4-D
    broadcast (index with None elsewhere), through HF's `[None, None, :, None]`-style getitem."""
    if not (is_fn(n, {operator.getitem}) and isinstance(n.args[1], tuple) and len(n.args[1]) == 4):
        return False
    idx = n.args[1]
    if not all((i is None) if d != axis else (i == slice(None)) for d, i in enumerate(idx)):
        return False
    a = n.args[0]
    if is_fn(a, {operator.add, torch.add}) or is_op(a, "add", "__add__"):
        base, off = a.args[0], a.args[1]
        if isinstance(base, (int, float)):
            base, off = off, base
        if int_offset and not isinstance(off, int):
            return False
        if isinstance(off, fx.Node) and val(off).numel() != 1:
            return False
        a = base
    if not is_fn(a, {torch.arange}):
        return False
    start, end = (0, arg(a, 0, "end")) if len(a.args) < 2 else (a.args[0], a.args[1])
    step = a.args[2] if len(a.args) > 2 else a.kwargs.get("step", 1)
    return start == 0 and end == length and step == 1


def _causal(t, S: int, L: int) -> bool:
    if is_fn(t, {operator.le, torch.le}) or is_op(t, "le", "__le__"):
        kv, q = t.args[0], t.args[1]
    elif is_fn(t, {operator.ge, torch.ge}) or is_op(t, "ge", "__ge__"):
        q, kv = t.args[0], t.args[1]
    else:
        return False
    return _arange_plus(_unwrap(kv), L, 3, int_offset=True) and _arange_plus(_unwrap(q), S, 2, int_offset=False)


def prove_rows(mask, S: int, L: int) -> None:
    """NoMatch unless every query row of `mask` [B|1, 1, S, L] is a position prefix of its last row (module
    docstring)."""
    if mask is None:
        raise NoMatch(f"a {S}-token step without a mask (no causal boundary between its query tokens)")
    causal = 0
    for t in _terms(condition(mask)):
        if _query_size(t) == 1:
            continue  # the same for every query token
        if isinstance(t, fx.Node) and _causal(_unwrap(t), S, L):
            causal += 1
            continue
        raise NoMatch(f"{S}-token mask {mask.name}: term {getattr(t, 'name', t)} differs per query token and is not "
                      f"HF's causal kv_idx <= q_idx over arange(L) / arange(S) + offset (a graph-input or "
                      f"per-token mask: build it in the graph, optimize_generate)")
    if causal == 0:
        raise NoMatch(f"{S}-token mask {mask.name} has no causal term")
