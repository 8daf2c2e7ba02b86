"""Float attention masks that cross a graph break: proven where they are made, checked where they are used.

An eager HF model builds its additive mask `where(valid, 0, finfo.min)` once, in the model's forward, and hands
it to every layer. A graph break between the two (longcat_flash: the MoE expert loop's `.item()` / `nonzero`)
makes the mask a graph INPUT of the layer graphs: its values are not in that graph, so the attention rewrite
cannot prove it is a hard mask (`passes.attention_mask.InputMask`) and the site stays HF's.

The graph that built it is one of ours too, compiled earlier in the same call. So:

* producer: for each float output of a graph that `attention_mask.prove_mask` proves to be a hard additive mask
  (all entries 0 or one constant c <= -1e30), every call records the output tensor object with c, its dtype and
  its version counter (`_FACTS`, weak: the entry dies with the tensor);
* consumer: a float placeholder whose example input (the real tensor Dynamo compiles with) is such a recorded
  tensor is compiled as the mask `input == 0` with constant c (`attention_mask.assume_input_masks`), and every
  call checks on the host, before running the graph, that the tensor it gets is a recorded one with the same c
  and dtype and an unchanged version counter (no in-place write since the producer made it: views share the
  counter). A call that fails the check runs the graph compiled without the assumption (compiled on first
  need, its sites counted not rewritten and logged), so a mask from anywhere else gets HF's attention.

No device sync and no extra graph on the proven road; the check is a dict lookup per assumed input. Inference-mode
tensors have no version counter: they are never recorded (the consumer then keeps HF's attention). What the version
counter cannot see is not seen here either: a write through `.data` (a tensor with its own counter), or a caller
holding a CUDA-graph output past the producer's next replay (the cudagraph trees free such an output: using it raises).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils.weak import WeakIdKeyDictionary

from . import attention_mask
from ._fx import NoMatch

log = logging.getLogger(__name__)

COUNTER = "mask_origin_fallbacks"  # calls whose mask input failed the check (ran the graph without the rewrite)

_FACTS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> (version, dtype, constant)


def _val(n: fx.Node):
    return n.meta.get("example_value", n.meta.get("val"))


def _version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:  # an inference tensor: no version counter
        return None


def output_facts(gm: fx.GraphModule) -> dict[int, tuple]:
    """{output index: (dtype, constant)} for the outputs of `gm` proven hard additive masks."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    if not isinstance(out, (tuple, list)):
        return {}
    facts = {}
    for i, o in enumerate(out):
        v = _val(o) if isinstance(o, fx.Node) else None
        if o is None or not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point or o.op == "placeholder":
            continue
        try:
            proof = attention_mask.prove_mask(o, additive=True)
        except NoMatch:
            continue
        except Exception as e:  # noqa: BLE001 - a proof that breaks records nothing (the consumer keeps HF's attention)
            log.info("mask_origin: output %d (%s) not examined: %s: %s", i, o.name, type(e).__name__, e)
            continue
        facts[i] = (v.dtype, proof.const)
    return facts


def holds(t: Any, fact: tuple) -> bool:
    """`t` is a tensor recorded with `fact` = (dtype, constant) and not written since."""
    if not isinstance(t, torch.Tensor):
        return False
    entry = _FACTS.get(t)
    return entry is not None and entry[0] is not None and entry[0] == _version(t) and entry[1:] == fact


def input_facts(gm: fx.GraphModule, example_inputs) -> dict[int, tuple]:
    """{placeholder index: fact} for float placeholders whose example input is a recorded mask."""
    facts = {}
    for i, (p, x) in enumerate(zip(gm.graph.find_nodes(op="placeholder"), example_inputs)):
        if isinstance(x, torch.Tensor) and x.dtype.is_floating_point and x in _FACTS:
            entry = _FACTS[x]
            if holds(x, entry[1:]):
                facts[i] = entry[1:]
    return facts


def compile_tracking_masks(gm: fx.GraphModule, example_inputs, compile_fn: Callable) -> Callable:
    """`compile_fn(gm, example_inputs)` (the backend's pipeline, which rewrites `gm` in place), with mask facts
    recorded for the outputs that are proven masks and assumed (checked per call) for the inputs that were."""
    from .host_ints import _copy_graph_module

    produced = output_facts(gm)
    assumed = input_facts(gm, example_inputs)
    if not assumed:
        compiled = compile_fn(gm, example_inputs)
    else:
        names = [p.name for p in gm.graph.find_nodes(op="placeholder")]
        original = _copy_graph_module(gm)  # the graph as Dynamo gave it, for calls that fail the check
        with attention_mask.assume_input_masks({names[i]: f[1] for i, f in assumed.items()}) as used:
            compiled = compile_fn(gm, example_inputs)
        checks = {i: f for i, f in assumed.items() if names[i] in used}
        if checks:
            log.info("mask_origin: %s proven from the graph that made them (checked every call)",
                     ", ".join(names[i] for i in checks))
            compiled = _checked(compiled, checks, original, compile_fn, names)
    return _recording(compiled, produced) if produced else compiled


def _checked(compiled: Callable, checks: dict, original: fx.GraphModule, compile_fn: Callable, names) -> Callable:
    unchecked: list = []

    def run(*args):
        for i, fact in checks.items():
            if not holds(args[i], fact):
                torch._dynamo.utils.counters["mla_compile"][COUNTER] += 1
                if not unchecked:
                    log.warning("mask_origin: input %s is not the proven mask this graph was compiled for (another "
                                "tensor, or written since): this call and later failing ones run the graph without "
                                "the attention rewrite", names[i])
                    unchecked.append(compile_fn(original, list(args)))
                return unchecked[0](*args)
        return compiled(*args)

    return run


def _recording(compiled: Callable, produced: dict) -> Callable:
    def run(*args):
        out = compiled(*args)
        for i, (dtype, const) in produced.items():
            t = out[i]
            if isinstance(t, torch.Tensor) and t.dtype == dtype:
                v = _version(t)
                if v is not None:
                    _FACTS[t] = (v, dtype, const)
        return out

    return run
