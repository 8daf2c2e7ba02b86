"""What an attention mask means, proven from the graph: the tokens each query attends to, and what a row with no
such token gives.

The attention rewrite turns a mask into a token table (`mla_attention`), which is exact only where the mask is a
hard mask: every entry either leaves the score unchanged or gives it exactly zero probability. Proven forms:

- SDPA `attn_mask` of dtype bool: True = attend.
- Additive (eager `softmax(scores + M)`, or a float SDPA `attn_mask`): `where(cond, 0, c)`, `where(cond, c, 0)`
  and `M.masked_fill(cond, c)` over a proven M, with constants c <= -1e30 (`_fx.BIG_NEGATIVE`) as the mask and
  the scores' dtypes realize them (HF: `where(mask, 0, finfo(dtype).min)`, DSA: `.masked_fill(index_mask, min)`).

Anything else is not a mask the rewrite can reproduce: an arbitrary float bias, a bool tensor ADDED to the scores
(it shifts them by +1 / +0; HF eager with a user's 4-D bool mask does exactly that), a graph-input float mask
(generate() precomputes HF's for static caches; its values are not in the graph). `prove_mask` raises NoMatch
for those, saying why.

A row with no valid token (e.g. a request whose mask row is all False) gives (`MaskProof.empty_rows`):
- "zero": SDPA with a bool mask, or a float one whose constants are all -inf (torch's safe softmax: 0).
- "uniform": additive constants all equal and finite: every score plus c rounds to c, so softmax is flat over
  all L positions of the static cache (HF eager with `finfo.min`: the mean of V over the whole cache).
- "nan": eager with constants all -inf (softmax of a row of -inf).
Mixed constants (a row would attend the entries masked with the larger one) are not reproduced: NoMatch.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Callable

import torch
import torch.fx as fx

from ._fx import BIG_NEGATIVE, NoMatch, is_big_negative, is_fn, is_op, meta_val, val

aten = torch.ops.aten

EMPTY_ZERO, EMPTY_UNIFORM, EMPTY_NAN = "zero", "uniform", "nan"


class InputMask(NoMatch):
    """A float mask handed to the graph as an input: nothing in the graph says what its values are."""


@dataclasses.dataclass
class MaskProof:
    """build(b): emits bool `valid` [B|1, 1, 1, L] (True = attend; None: every token valid) from existing nodes.
    nodes: the mask expression's nodes (HF evaluates them where they stand: their inputs are read there).
    empty_rows: what a row with no valid token gives (EMPTY_ZERO / EMPTY_UNIFORM / EMPTY_NAN)."""

    build: Callable
    nodes: set
    empty_rows: str
    const: float | None = None  # the masking constant, realized through the dtypes given; None: nothing masked


# placeholder name -> masking constant (or None) of float mask INPUTS whose values the caller guarantees are
# 0 / that constant (`mla_compile.passes.mask_origin`: produced by a proven where(.., 0, c) of an earlier graph of the
# same call, checked per call on the host); with the set of names a proof used
_ASSUMED: contextvars.ContextVar = contextvars.ContextVar("mla_compile_assumed_input_masks", default=None)


@contextlib.contextmanager
def assume_input_masks(facts: dict):
    """Within: a float mask placeholder named in `facts` is proven a hard mask with constant facts[name] (None:
    all zero). Yields the set of names a proof relied on."""
    used: set = set()
    token = _ASSUMED.set((dict(facts), used))
    try:
        yield used
    finally:
        _ASSUMED.reset(token)


def prove_mask(mask, *, additive: bool, dtypes: tuple = ()) -> MaskProof:
    """The proof for an attention mask: `additive` for eager `scores + mask`, else an SDPA `attn_mask`.
    dtypes: what the masked scores are cast to on their way through the softmax (eager: the addition's dtype,
    then the softmax's: HF runs it in float32, so a float64 model's finfo.min becomes -inf there); the mask's
    constants are realized through them."""
    if mask is None:
        return MaskProof(lambda b: None, set(), EMPTY_ZERO)  # no row is ever empty
    if not isinstance(mask, fx.Node):
        raise NoMatch(f"attention mask is a constant {type(mask).__name__}")
    v = val(mask)
    if v.dtype == torch.bool:
        if additive:
            raise NoMatch(f"attention mask {mask.name} is a bool tensor added to the scores (it shifts them by "
                          f"+1 / +0; it does not mask)")
        return MaskProof(lambda b: mask, set(), EMPTY_ZERO)
    if not v.dtype.is_floating_point:
        raise NoMatch(f"attention mask {mask.name} has dtype {v.dtype}")
    build, consts, nodes = _additive(mask)
    realized = {_realize(c, v.dtype, *dtypes) for c in consts}
    if any(c > BIG_NEGATIVE for c in realized):
        raise NoMatch(f"attention mask {mask.name}: a constant {sorted(realized)} is above -1e30 in "
                      f"{(v.dtype, *dtypes)}")
    if len(realized) > 1:
        raise NoMatch(f"attention mask {mask.name} masks with different constants {sorted(realized)}: a row masked "
                      f"everywhere would attend only the entries with the largest")
    c = next(iter(realized), None)
    if c is None or math.isinf(c):
        empty = EMPTY_NAN if additive and c is not None else EMPTY_ZERO
    else:
        empty = EMPTY_UNIFORM
    return MaskProof(build, nodes, empty, c)


def _realize(c: float, *dtypes: torch.dtype) -> float:
    """The value constant c has after being cast to each of `dtypes` in turn."""
    t = torch.tensor(c, dtype=torch.float64)
    for d in dtypes:
        t = t.to(d)
    return float(t.to(torch.float64))


def _additive(mask: fx.Node):
    """(build valid, constants, expression nodes) of a proven additive mask; NoMatch otherwise."""
    v = val(mask)
    if _is_zero(mask):
        return (lambda b: None), set(), {mask}
    if is_fn(mask, {torch.where}) and len(mask.args) == 3:
        cond, a, c = mask.args
        if isinstance(cond, fx.Node) and val(cond).dtype == torch.bool:
            if _is_zero(a) and _constant(c) is not None:
                return (lambda b: cond), {_constant(c)}, {mask}
            if _constant(a) is not None and _is_zero(c):
                return (lambda b: b.call(aten.bitwise_not.default, cond)), {_constant(a)}, {mask}
    if is_op(mask, "masked_fill") and len(mask.args) >= 3:
        x, cond, c = mask.args[0], mask.args[1], mask.args[2]
        if (isinstance(cond, fx.Node) and val(cond).dtype == torch.bool and _constant(c) is not None
                and isinstance(x, fx.Node) and val(x).dtype == v.dtype):
            inner, consts, nodes = _additive(x)

            def build(b, inner=inner, cond=cond):
                keep = b.call(aten.bitwise_not.default, cond)
                base = inner(b)
                return keep if base is None else b.call(aten.bitwise_and.Tensor, base, keep)

            return build, consts | {_constant(c)}, nodes | {mask}
    if mask.op == "placeholder":
        assumed = _ASSUMED.get()
        if assumed is not None and mask.name in assumed[0]:
            c = assumed[0][mask.name]
            assumed[1].add(mask.name)
            return (lambda b: b.call(aten.eq.Scalar, mask, 0)), (set() if c is None else {c}), {mask}
        raise InputMask(f"attention mask {mask.name} is an additive float mask not provably 0 / -inf: a graph "
                        f"input (generate() builds HF's 4-D mask for static caches outside the compiled forward; "
                        f"its values are not in the graph)")
    raise NoMatch(f"attention mask {mask.name} is an additive float mask not provably 0 / -inf "
                  f"(only HF's where(mask, 0, finfo.min) [+ masked_fill(.., min)] is understood)")


def _is_zero(x) -> bool:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return x == 0
    if isinstance(x, fx.Node) and is_op(x, "zeros", "zeros_like", "new_zeros"):
        return True
    if isinstance(x, fx.Node) and is_fn(x, {torch.tensor, torch.scalar_tensor}):
        return bool(x.args) and isinstance(x.args[0], (int, float)) and x.args[0] == 0
    if isinstance(x, fx.Node) and is_fn(x, {torch.full}) and len(x.args) >= 2:
        return isinstance(x.args[1], (int, float)) and x.args[1] == 0
    return False


def _constant(x) -> float | None:
    """The value of a big-negative constant (a number, or torch.tensor / scalar_tensor / full of one, realized in
    that node's dtype), else None."""
    if is_big_negative(x):
        return float(x)
    if isinstance(x, fx.Node) and is_fn(x, {torch.tensor, torch.scalar_tensor, torch.full}):
        c = x.args[1] if is_fn(x, {torch.full}) and len(x.args) >= 2 else (x.args[0] if x.args else None)
        v = meta_val(x)
        if is_big_negative(c) and isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
            return _realize(c, v.dtype)
    return None
