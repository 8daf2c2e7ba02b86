"""Tensor-parallel attention heads for HF MLA models, under a TP x DCP group (`distributed.init_dcp(tp_size=...)`).

transformers' own tensor-parallel plan does not cover these models' attention (DeepseekV3's `base_model_tp_plan`
lists only the MLP; V3.2's needs a checkpoint loaded with `from_pretrained(tp_plan=...)`), so this is ours:
`shard_mla_heads(model, group)` keeps, in every MLA attention module, only this rank's block of heads
(`group.head_rank` of `group.head_shards`):

    q_b_proj (or q_proj)   rows    [h0 * (nope + rope), h1 * (nope + rope))     column-parallel
    kv_b_proj              rows    [h0 * (nope + v),    h1 * (nope + v))        column-parallel
    o_proj                 columns [h0 * v,             h1 * v)                 row-parallel: partial sums, then
                                                                                ONE all_reduce over the head group

HF's attention reshapes with -1 heads, so it runs unchanged on the slice; everything else (the latent projection,
norms, the DSA indexer, MLP) stays replicated. The latent cache must then be `MLAPagedCache(..., dcp=group)` with the
same group: it tells the attention pass that the heads are split (the pass emits `mla.tp_dcp_decode`: q heads
all-gathered over the DCP group, attention over this rank's KV shard, states exchanged back by head owner); the
cache refuses a group whose heads_sharded differs from the model's.
"""

from __future__ import annotations

import torch

SHARDED_ATTR = "_mla_head_shards"  # on the text config: (head_shards, head_rank, head_group_name)


class HeadParallelOut(torch.nn.Module):
    """o_proj over this rank's heads: y = all_reduce(x @ W[:, cols]^T) + bias (the bias added once, after the sum)."""

    def __init__(self, weight: torch.Tensor, bias, group_name: str, shards: int):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.group_name, self.shards = group_name, shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.weight)
        if self.shards > 1:
            y = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(y, "sum", self.group_name))
        return y if self.bias is None else y + self.bias


def _rows(linear: torch.nn.Linear, start: int, stop: int) -> torch.nn.Linear:
    out = torch.nn.Linear(linear.in_features, stop - start, bias=linear.bias is not None, device=linear.weight.device,
                          dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight[start:stop])
        if linear.bias is not None:
            out.bias.copy_(linear.bias[start:stop])
    return out.requires_grad_(False)


def mla_attention_modules(model):
    """The MLA attention modules of an HF model (each has kv_b_proj and o_proj)."""
    return [m for m in model.modules() if hasattr(m, "kv_b_proj") and hasattr(m, "o_proj")]


def shard_mla_heads(model, group):
    """Keep this rank's block of attention heads in every MLA attention module of `model` (in place; returns it).

    group: a `DCPGroup` from `init_dcp(tp_size=...)` (heads_sharded). The head count must divide evenly. Call once,
    before compiling, on every rank (the weights must be the same on every rank beforehand)."""
    if not getattr(group, "heads_sharded", False):
        raise ValueError("group: heads are not sharded in this group (make it with init_dcp(tp_size=...))")
    text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    if getattr(text, SHARDED_ATTR, None) is not None:
        raise ValueError("model: its attention heads are sharded already")
    n, r = group.head_shards, group.head_rank
    H = text.num_attention_heads
    if H % n:
        raise ValueError(f"group: {H} attention heads do not split evenly over {n} ranks (tp_size x dcp_size)")
    attns = mla_attention_modules(model)
    if not attns:
        raise ValueError("model: no MLA attention module (kv_b_proj + o_proj) found")
    h0, h1 = r * H // n, (r + 1) * H // n
    # every module checked before any is changed: a refused model is left whole
    q_names = [_q_projection(a) for a in attns]
    for a, q_name in zip(attns, q_names):
        nope, rope, v = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        setattr(a, q_name, _rows(getattr(a, q_name), h0 * (nope + rope), h1 * (nope + rope)))
        a.kv_b_proj = _rows(a.kv_b_proj, h0 * (nope + v), h1 * (nope + v))
        o = a.o_proj
        a.o_proj = HeadParallelOut(o.weight.detach()[:, h0 * v:h1 * v].clone(),
                                   None if o.bias is None else o.bias.detach().clone(), group.head_group_name, n)
        if hasattr(a, "num_heads"):
            a.num_heads = h1 - h0
    setattr(text, SHARDED_ATTR, (n, r, group.head_group_name))
    return model


def _q_projection(a) -> str:
    """The name of an MLA attention module's per-head q projection (q_proj, or q_b_proj after a q LoRA); a ValueError
    for a module this helper does not shard (attention sinks are per head; another q layout)."""
    if getattr(a, "sinks", None) is not None:
        raise ValueError("model: attention sinks are per head and not sharded by this helper")
    for name in ("q_proj", "q_b_proj"):
        if isinstance(getattr(a, name, None), torch.nn.Linear):
            return name
    raise ValueError(f"model: {type(a).__name__} has no q_proj / q_b_proj linear (its query heads are laid out in a "
                     f"way this helper does not shard)")


def check_cache_group(config, dcp) -> bool:
    """heads_sharded for a cache over `config`'s model with group `dcp` (None: one rank); a ValueError when the
    model's heads and the group disagree (the attention would merge different heads as one, or miss a sum)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    sharded = getattr(text, SHARDED_ATTR, None)
    group_sharded = bool(getattr(dcp, "heads_sharded", False)) if dcp is not None else False
    if sharded is None and group_sharded:
        raise ValueError("dcp: this group splits attention heads (init_dcp(tp_size=...)) but the model's are whole: "
                         "call mla_compile.integrations.tp.shard_mla_heads(model, group) first")
    if sharded is not None and not (group_sharded and sharded == (dcp.head_shards, dcp.head_rank,
                                                                  dcp.head_group_name)):
        raise ValueError(f"dcp: the model's heads were sharded as (shards, rank, group) = {sharded}; pass that "
                         f"group (from init_dcp(tp_size=...)) as the cache's dcp")
    return group_sharded
