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


# The q projection an MLA attention module has one of: rows in one block per head, [nope | rope] (axk2's fused
# q_gate_proj: [nope | rope | gate]).
Q_PROJECTIONS = ("q_proj", "q_b_proj", "q_gate_proj")
# The families' other per-head pieces besides kv_b_proj and o_proj, by attribute: how each is cut to heads [h0, h1).
# "rows": a Linear whose output rows come in one block per head (the block's width: its rows over the head count);
# "entries": a parameter with one value per head.
PER_HEAD = {
    "g_proj": "rows",  # a head-wise output gate (bailing_hybrid, dots3_note)
    "gate_proj": "rows",  # an output gate per head and value channel (hy_v4)
    "sinks": "entries",  # one sink logit per head (hy_v4)
    "softmax_scaling.scale": "entries",  # per-head query scaling by log position (mistral_large4)
    "softmax_scaling.bias": "entries",
}
# Replicated on every rank: the latent projections and their norms, and the DSA indexer (its own heads score tokens
# for all query heads). Any other parameter is one this helper cannot tell the layout of: it refuses the model.
REPLICATED = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm", "k_rope_only_layernorm", "indexer")


def _plan(a, H: int) -> tuple[str, list[str]]:
    """(q projection's name, the PER_HEAD pieces present) of attention module `a`; a ValueError naming what this
    helper cannot split (no q projection it knows, a parameter of unknown layout, a per-head piece of odd size)."""
    q_names = [n for n in Q_PROJECTIONS if isinstance(getattr(a, n, None), torch.nn.Linear)]
    if len(q_names) != 1:
        raise ValueError(f"model: {type(a).__name__} has no single q projection of {Q_PROJECTIONS} (its query heads "
                         f"are laid out in a way this helper does not shard)")
    known = (*q_names, "kv_b_proj", "o_proj", *REPLICATED)
    pieces = []
    for name, param in a.named_parameters():
        if name.split(".")[0] in known:
            continue
        linear, _, leaf = name.rpartition(".")
        if PER_HEAD.get(linear) == "rows" and isinstance(_owner_attr(a, linear), torch.nn.Linear):
            piece = linear  # its weight and bias, cut together
        elif PER_HEAD.get(name) == "entries":
            piece = name
        else:
            raise ValueError(f"model: {type(a).__name__}.{name} {tuple(param.shape)} is a parameter whose layout over "
                             f"the attention heads this helper does not know; it shards {Q_PROJECTIONS}, kv_b_proj, "
                             f"o_proj and {sorted(PER_HEAD)}, and keeps {REPLICATED} whole")
        if param.shape[0] % H:
            raise ValueError(f"model: {type(a).__name__}.{name} has {param.shape[0]} rows, not a multiple of the "
                             f"{H} attention heads")
        if piece not in pieces:
            pieces.append(piece)
    return q_names[0], pieces


def _owner_attr(a, piece: str):
    """The object at dotted path `piece` under module `a`."""
    for part in piece.split("."):
        a = getattr(a, part)
    return a


def _cut(a, piece: str, h0: int, h1: int, H: int) -> None:
    """Piece `piece` of module `a` (a Linear with a block of rows per head, or a parameter with a value per head) cut
    to heads [h0, h1)."""
    *path, leaf = piece.split(".")
    owner = _owner_attr(a, ".".join(path)) if path else a
    value = getattr(owner, leaf)
    if isinstance(value, torch.nn.Linear):
        w = value.out_features // H
        setattr(owner, leaf, _rows(value, h0 * w, h1 * w))
    else:
        setattr(owner, leaf, torch.nn.Parameter(value.detach()[h0:h1].clone(), requires_grad=False))


def shard_mla_heads(model, group):
    """Keep this rank's block of attention heads in every MLA attention module of `model` (in place; returns it).

    group: a `DCPGroup` from `init_dcp(tp_size=...)` (heads_sharded). The head count must divide evenly. Call once,
    before compiling, on every rank (the weights must be the same on every rank beforehand). Besides the q, kv_b and
    o projections, the families' per-head pieces (`PER_HEAD`: output gates, sinks, per-head query scaling) are cut
    too; a module with a parameter of another layout is refused (ValueError) before anything is changed."""
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
    plans = [_plan(a, H) for a in attns]  # every module checked before any is changed: a refused model is left whole
    for a, (q_name, pieces) in zip(attns, plans):
        _cut(a, q_name, h0, h1, H)
        nope, v = a.qk_nope_head_dim, a.v_head_dim
        a.kv_b_proj = _rows(a.kv_b_proj, h0 * (nope + v), h1 * (nope + v))
        o = a.o_proj
        a.o_proj = HeadParallelOut(o.weight.detach()[:, h0 * v:h1 * v].clone(),
                                   None if o.bias is None else o.bias.detach().clone(), group.head_group_name, n)
        for piece in pieces:
            _cut(a, piece, h0, h1, H)
        for count in ("num_heads", "n_heads"):
            if hasattr(a, count):
                setattr(a, count, h1 - h0)
    setattr(text, SHARDED_ATTR, (n, r, group.head_group_name))
    return model


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
