"""Snapshots of one HF DeepseekV3 layer's decode graph (sdpa, StaticCache) before and after the pass.

A stable text form: the op nodes of the layer's attention (nodes whose module stack is `self_attn`), one
line each from the latent cache write to the attention output, `%i = target(args) -> shape dtype`, with graph inputs / nodes
outside that region as `%in`.
Regenerate with `EXPECTTEST_ACCEPT=1 pytest tests/passes/test_pass_snapshots.py`.
"""

from __future__ import annotations

import copy

import expecttest
import torch
import torch.fx as fx

import hf_models as M
import mla_compile  # noqa: F401
from mla_compile.integrations.hf import cache_kwargs
from mla_compile.passes.mla_attention import rewrite_mla_attention


def op_text(gm: fx.GraphModule) -> str:
    region = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")
              and any("self_attn" in str(v) for v in (n.meta.get("nn_module_stack") or {}).values())]
    start = next((i for i, n in enumerate(region) if n.target == "index_copy_"), 0)
    # from the cache write to the attention output (sdpa, or the rewrite's last node): projections, rope and
    # HF's output reshapes are not the pass's business (and differ between transformers versions)
    end = max(i for i, n in enumerate(region) if n.target in (torch._C._nn.scaled_dot_product_attention,)
              or isinstance(n.target, torch._ops.OpOverload))
    return M.node_lines(region[start:end + 1])


def _decode_graphs():
    from transformers import StaticCache

    torch._dynamo.reset()
    model = M.deepseek_v3(num_layers=1, attn_impl="sdpa")
    L = 16
    ids, mask = M.batch(L=L)
    cache = StaticCache(config=model.config, max_cache_len=L)
    seen = {}

    def backend(gm, example_inputs):
        before = copy.deepcopy(gm)
        n = rewrite_mla_attention(gm, example_inputs)
        seen["before"], seen["after"], seen["n"] = op_text(before), op_text(gm), n
        return gm.forward

    with torch.no_grad():
        model(ids, attention_mask=mask[:, :5], **cache_kwargs(model, cache))
        torch.compile(model, backend=backend, fullgraph=True)(ids[:, :1], attention_mask=mask, **cache_kwargs(model, cache))
    torch._dynamo.reset()
    return seen


class TestPassSnapshots(expecttest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.graphs = _decode_graphs()

    def test_rewrites_one_site(self):
        self.assertEqual(self.graphs["n"], 1)

    def test_before(self):
        self.assertExpectedInline(self.graphs["before"], """\
%0 = .index_copy_(%in, 2, %in, %in) -> [2, 1, 16, 512] float32
%1 = .index_copy_(%in, 2, %in, %in) -> [2, 1, 16, 64] float32
%2 = torch.cat((%in, %in), dim=-1) -> [2, 4, 1, 192] float32
%3 = torch._C._nn.linear(%in, %in, None) -> [2, 1, 16, 1024] float32
%4 = .view(%3, (2, 16, -1, 256)) -> [2, 16, 4, 256] float32
%5 = .transpose(%4, 1, 2) -> [2, 4, 16, 256] float32
%6 = torch.functional.split(%5, [128, 128], dim=-1) -> ([2, 4, 16, 128], [2, 4, 16, 128])
%7 = _operator.getitem(%6, 0) -> [2, 4, 16, 128] float32
%8 = _operator.getitem(%6, 1) -> [2, 4, 16, 128] float32
%9 = .expand(%in, -1, 4, -1, -1) -> [2, 4, 16, 64] float32
%10 = .new_empty(%5, 2, 4, 16, 192) -> [2, 4, 16, 192] float32
%11 = _operator.getitem(%10, (Ellipsis, slice(None, 128, None))) -> [2, 4, 16, 128] float32
%12 = .copy_(%11, %7) -> [2, 4, 16, 128] float32
%13 = _operator.getitem(%10, (Ellipsis, slice(128, None, None))) -> [2, 4, 16, 64] float32
%14 = .copy_(%13, %9) -> [2, 4, 16, 64] float32
%15 = torch._C._nn.scaled_dot_product_attention(%2, %10, %8, attn_mask=%in, dropout_p=0, scale=0.0721688, is_causal=False) -> [2, 4, 1, 128] float32""")

    def test_after(self):
        self.assertExpectedInline(self.graphs["after"], """\
%0 = .index_copy_(%in, 2, %in, %in) -> [2, 1, 16, 512] float32
%1 = .index_copy_(%in, 2, %in, %in) -> [2, 1, 16, 64] float32
%2 = torch.cat((%in, %in), dim=-1) -> [2, 4, 1, 192] float32
%3 = aten.select.int(%in, 2, 0) -> [2, 4, 128] float32
%4 = aten.select.int(%in, 2, 0) -> [2, 4, 64] float32
%5 = aten.reshape.default(%in, [4, 256, 512]) -> [4, 256, 512] float32
%6 = aten.slice.Tensor(%5, 1, 0, 128) -> [4, 128, 512] float32
%7 = aten.slice.Tensor(%5, 1, 128, 256) -> [4, 128, 512] float32
%8 = aten.transpose.int(%3, 0, 1) -> [4, 2, 128] float32
%9 = aten.bmm.default(%8, %6) -> [4, 2, 512] float32
%10 = aten.transpose.int(%9, 0, 1) -> [2, 4, 512] float32
%11 = aten.expand.default(%in, [2, 1, 1, 16]) -> [2, 1, 1, 16] bool
%12 = aten.reshape.default(%11, [2, 16]) -> [2, 16] bool
%13 = aten.cumsum.default(%12, -1, dtype=int64) -> [2, 16] int64
%14 = aten.select.int(%13, 1, 15) -> [2] int64
%15 = aten._to_copy.default(%14, dtype=int32) -> [2] int32
%16 = aten.sub.Tensor(%13, 1) -> [2, 16] int64
%17 = aten.where.ScalarOther(%12, %16, 16) -> [2, 16] int64
%18 = aten.arange.default(16, dtype=int32) -> [16] int32
%19 = aten.expand.default(%18, [2, 16]) -> [2, 16] int32
%20 = aten.zeros.default([2, 17], dtype=int32) -> [2, 17] int32
%21 = aten.scatter.src(%20, 1, %17, %19) -> [2, 17] int32
%22 = aten.slice.Tensor(%21, 1, 0, 16) -> [2, 16] int32
%23 = aten.arange.start_step(0, 32, 16, dtype=int32) -> [2] int32
%24 = aten.unsqueeze.default(%23, 1) -> [2, 1] int32
%25 = aten.add.Tensor(%22, %24) -> [2, 16] int32
%26 = aten.reshape.default(%in, [32, 1, 512]) -> [32, 1, 512] float32
%27 = aten.reshape.default(%in, [32, 1, 64]) -> [32, 1, 64] float32
%28 = mla.decode.default(%10, %4, %26, %27, %25, %15, 0.0721688) -> ([2, 4, 512], [2, 4])
%29 = _operator.getitem(%28, 0) -> [2, 4, 512] float32
%30 = aten.transpose.int(%29, 0, 1) -> [4, 2, 512] float32
%31 = aten.transpose.int(%7, 1, 2) -> [4, 512, 128] float32
%32 = aten.bmm.default(%30, %31) -> [4, 2, 128] float32
%33 = aten.transpose.int(%32, 0, 1) -> [2, 4, 128] float32
%34 = aten.unsqueeze.default(%33, 2) -> [2, 4, 1, 128] float32""")
