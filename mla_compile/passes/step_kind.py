"""What kind of model step a Dynamo graph is: a decode step (one query token per request) or a prefill.

The backend CUDA-graphs decode steps only, as serving engines do. A prefill is compute-bound (graphs buy it
nothing) and, under HF, is where a lazily allocated cache is created: HF's `StaticCache` allocates its buffers
at the first `update`, so when the prefill itself runs as a CUDA graph the cache tensors are outputs of that
graph, owned by the CUDA-graph trees' memory pool. The next graph's replay frees or overwrites them and the
decode step then reads a dead cache (on the H200: `TypeError: Pointer argument must be either uint64 or have
data_ptr method` in an Inductor launcher, or a segfault, with Inductor alone as with `mla_dcp`).
"""

from __future__ import annotations

import torch
import torch.fx as fx

_SDPA = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}
_SOFTMAX = {torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax}


def _val(n):
    return n.meta.get("example_value", n.meta.get("val")) if isinstance(n, fx.Node) else None


def _query_len(t) -> int | None:
    """Query rows of an attention input / score tensor [..., Sq, D]; None when symbolic."""
    if not isinstance(t, torch.Tensor) or t.dim() < 3:
        return None
    s = t.shape[-2]
    return s if isinstance(s, int) else None


def multi_token_attention(gm: fx.GraphModule) -> str | None:
    """The name of an attention node that attends with more than one query token per request (a prefill or
    chunked-prefill step: SDPA with a query of Sq != 1, or a softmax over 4-D scores [B, H, Sq, L] with Sq != 1;
    a symbolic Sq counts as more than one), or None when every attention is a one-token decode."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _SDPA and n.args:
            q = _val(n.args[0])
        elif (n.op == "call_function" and n.target in _SOFTMAX) or (n.op == "call_method" and n.target == "softmax"):
            q = _val(n.args[0]) if n.args else None
            if not (isinstance(q, torch.Tensor) and q.dim() == 4):
                continue  # not attention scores (e.g. a MoE router's softmax over [T, E])
        else:
            continue
        if isinstance(q, torch.Tensor) and _query_len(q) != 1:
            return n.name
    return None
