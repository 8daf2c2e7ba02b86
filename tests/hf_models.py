"""Tiny HF MLA models (real MLA head dims, small everything else, random weights, nothing downloaded)."""

from __future__ import annotations

import functools

import torch

from mla_compile import models
from mla_compile.integrations.hf import cache_kwargs

# the tests' models: mla_compile.models' builders at a short max_position_embeddings
deepseek_v3 = functools.partial(models.deepseek_v3, max_positions=512)
deepseek_v32 = functools.partial(models.deepseek_v32, max_positions=512)
glm_moe_dsa = functools.partial(models.glm_moe_dsa, max_positions=512)


def greedy(step, model, ids, attention_mask, cache, steps: int, *, prefill=None):
    """Prefill `ids` [B, T] (through `prefill`, default `step`), then `steps` greedy decode steps through
    `step` (the compiled or eager model). `attention_mask` [B, Lmax] is the 2D padding mask over the whole
    static cache (fixed shape: one decode graph). Returns (tokens [B, steps], last-position logits
    [B, steps, V])."""
    B, T = ids.shape
    prefill = step if prefill is None else prefill
    toks, logits = [], []
    with torch.no_grad():
        out = prefill(ids, attention_mask=attention_mask[:, :T], **cache_kwargs(prefill, cache),
                      cache_position=torch.arange(T, device=ids.device))
        tok = out.logits[:, -1].argmax(-1)
        for i in range(steps):
            toks.append(tok)
            out = step(tok[:, None], attention_mask=attention_mask, **cache_kwargs(step, cache),
                       cache_position=torch.tensor([T + i], device=ids.device))
            logits.append(out.logits[:, -1].float().clone())  # a CUDA-graph output is overwritten next step
            tok = out.logits[:, -1].argmax(-1)
    return torch.stack(toks, 1), torch.stack(logits, 1)


def forced(step, model, ids, attention_mask, cache, tokens):
    """Teacher-forced decode: prefill with `model`, then feed `tokens` [B, N] through `step`; logits [B, N, V].
    (bf16 comparisons: HF eager rounds probabilities to bf16, so free-running greedy paths may part at near-ties.)"""
    B, T = ids.shape
    logits = []
    with torch.no_grad():
        model(ids, attention_mask=attention_mask[:, :T], **cache_kwargs(model, cache),
              cache_position=torch.arange(T, device=ids.device))
        for i in range(tokens.shape[1]):
            out = step(tokens[:, i:i + 1], attention_mask=attention_mask, **cache_kwargs(step, cache),
                       cache_position=torch.tensor([T + i], device=ids.device))
            logits.append(out.logits[:, -1].float().clone())  # a CUDA-graph output is overwritten next step
    return torch.stack(logits, 1)


def batch(B: int = 2, T: int = 5, L: int = 32, vocab: int = 128, pad: int = 2, seed: int = 1):
    """Prompt ids [B, T] with row 1 left-padded by `pad`, and the [B, L] padding mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, T), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    if B > 1 and pad:
        ids[1, :pad] = 0
        mask[1, :pad] = 0
    return ids, mask


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def dcp_worker(rank: int, world: int, init_file: str, result_dir: str, impl: str, steps: int, L: int) -> None:
    """One DCP rank (gloo, CPU): single-rank eager HF reference vs (a) eager HF over the sharded cache and
    (b) torch.compile(backend="mla_dcp") over it. Writes its numbers to result_dir/rank{rank}.pt."""
    import types

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        import mla_compile  # noqa: F401
        from mla_compile.integrations.hf import MLAPagedCache
        from transformers import StaticCache

        dcp = types.SimpleNamespace(size=world, rank=rank, group_name=dist.group.WORLD.group_name)
        model = deepseek_v3(attn_impl=impl, num_layers=1)
        ids, mask = batch(L=L)
        ref_t, ref_l = greedy(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), steps)
        e_t, e_l = greedy(model, model, ids, mask, MLAPagedCache(model.config, L, page_size=4, dcp=dcp), steps)
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(model, backend="mla_dcp", fullgraph=True)
        c_t, c_l = greedy(compiled, model, ids, mask, MLAPagedCache(model.config, L, page_size=4, dcp=dcp), steps,
                          prefill=model)
        counters = dict(torch._dynamo.utils.counters["mla_compile"])
        torch.save(dict(ref_t=ref_t, ref_l=ref_l, e_t=e_t, e_l=e_l, c_t=c_t, c_l=c_l, counters=counters),
                   f"{result_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def node_target(n) -> str:
    """A stable name for an FX node's target (for graph snapshots)."""
    if n.op == "call_method":
        return "." + n.target
    t = n.target
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(t)
    mod = getattr(t, "__module__", None) or ""
    return f"{mod}.{getattr(t, '__name__', str(t))}".lstrip(".")
