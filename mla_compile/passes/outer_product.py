"""A matmul whose contraction has length 1 -> a broadcast multiply (an outer product needs no GEMM).

HF's rotary embeddings (transformers <= 5.17's DeepSeek-V3 among them) compute their angles as
`inv_freq[None, :, None] @ position_ids[:, None, :]` in fp32: at decode that is a [B, 32, 1] x [B, 1, 1]
product, which Inductor hands to cuBLAS as a SIMT sgemm of its own (3 us + a launch gap on the H200 per step,
every step). As `a * b` it is a pointwise op that Inductor fuses into the cos/sin kernel that follows.

Exact: with one term there is nothing to accumulate, so each output is the single product a[..., i, 0] * b[..., 0, j]
rounded once to the result dtype, as the GEMM rounds it (a GEMM allowed to use TF32 would round its inputs
first; the multiply does not). Matmul's batch broadcasting is elementwise broadcasting of the leading dims, so
the shapes agree. Fires only for floating operands of one dtype, both at least 2-D, with a static K of 1.
Runs on the Dynamo graph; counted in `counters["mla_compile"]["outer_product_matmuls"]`.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ._fx import is_call, meta_val, replace_each

COUNTER = "outer_product_matmuls"
_MATMUL_FUNCTIONS = {operator.matmul, torch.matmul, torch.bmm}
_MATMUL_METHODS = {"matmul", "bmm", "__matmul__"}


def _operands(node: fx.Node):
    """(a, b) of a matmul-like node with a length-1 contraction that may become a * b, else None."""
    if not is_call(node, _MATMUL_FUNCTIONS, _MATMUL_METHODS) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    av, bv = meta_val(a), meta_val(b)
    if not (isinstance(av, torch.Tensor) and isinstance(bv, torch.Tensor)):
        return None
    if not (av.dtype == bv.dtype and av.dtype.is_floating_point and av.dim() >= 2 and bv.dim() >= 2):
        return None
    k_a, k_b = av.shape[-1], bv.shape[-2]
    if not (isinstance(k_a, int) and isinstance(k_b, int) and k_a == k_b == 1):
        return None
    return a, b


def matmuls_to_outer_products(gm: fx.GraphModule | fx.Graph) -> int:
    """Rewrite every matmul / bmm with a contraction of length 1 into a broadcast multiply; returns the count."""
    return replace_each(gm, _outer_product, COUNTER)


def _outer_product(graph: fx.Graph, node: fx.Node) -> fx.Node | None:
    ops = _operands(node)
    if ops is None:
        return None
    with graph.inserting_before(node):
        mul = graph.call_function(operator.mul, ops)
    mul.meta.update(node.meta)
    return mul
