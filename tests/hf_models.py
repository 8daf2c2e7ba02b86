"""Tiny HF MLA models (real MLA head dims, small everything else, random weights, nothing downloaded)."""

from __future__ import annotations

import torch

MLA_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


def _common(num_layers: int, hidden: int, heads: int, vocab: int, attn_impl: str) -> dict:
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
                num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=heads,
                max_position_embeddings=512, attn_implementation=attn_impl, pad_token_id=0, bos_token_id=0,
                eos_token_id=None, tie_word_embeddings=False, **MLA_DIMS)


def deepseek_v3(*, q_lora_rank: int | None = 96, rope_interleave: bool = True, num_layers: int = 2,
                hidden: int = 64, heads: int = 4, vocab: int = 128, attn_impl: str = "sdpa", seed: int = 0,
                dtype=torch.float32):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(q_lora_rank=q_lora_rank, rope_interleave=rope_interleave, n_routed_experts=4,
                           num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=num_layers,
                           **_common(num_layers, hidden, heads, vocab, attn_impl))
    return _build(DeepseekV3ForCausalLM, cfg, seed, dtype)


def deepseek_v32(*, num_layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 128, attn_impl: str = "sdpa",
                 seed: int = 0, index_topk: int = 2048, dtype=torch.float32):
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    cfg = DeepseekV32Config(q_lora_rank=96, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                            first_k_dense_replace=num_layers, index_topk=index_topk, index_n_heads=4,
                            index_head_dim=128, **_common(num_layers, hidden, heads, vocab, attn_impl))
    return _build(DeepseekV32ForCausalLM, cfg, seed, dtype)


def glm_moe_dsa(*, num_layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 128, attn_impl: str = "sdpa",
                seed: int = 0, index_topk: int = 2048, dtype=torch.float32, indexer_types: list | None = None):
    """indexer_types: e.g. ["full", "shared"] (a "shared" layer reuses the previous full layer's top-k)."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    extra = {} if indexer_types is None else dict(indexer_types=list(indexer_types))
    cfg = GlmMoeDsaConfig(**extra, q_lora_rank=96, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                          first_k_dense_replace=num_layers, index_topk=index_topk, index_n_heads=4,
                          index_head_dim=128, **_common(num_layers, hidden, heads, vocab, attn_impl))
    return _build(GlmMoeDsaForCausalLM, cfg, seed, dtype)


def _build(cls, cfg, seed, dtype):
    torch.manual_seed(seed)
    model = cls(cfg).eval().to(dtype)
    with torch.no_grad():  # HF init is tiny (std 0.02): make logits spread so greedy tokens are decisive
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    return model


def greedy(step, model, ids, attention_mask, cache, steps: int, *, prefill=None):
    """Prefill `ids` [B, T] (through `prefill`, default `step`), then `steps` greedy decode steps through
    `step` (the compiled or eager model). `attention_mask` [B, Lmax] is the 2D padding mask over the whole
    static cache (fixed shape: one decode graph). Returns (tokens [B, steps], last-position logits
    [B, steps, V])."""
    B, T = ids.shape
    prefill = step if prefill is None else prefill
    toks, logits = [], []
    with torch.no_grad():
        out = prefill(ids, attention_mask=attention_mask[:, :T], past_key_values=cache,
                      cache_position=torch.arange(T))
        tok = out.logits[:, -1].argmax(-1)
        for i in range(steps):
            toks.append(tok)
            out = step(tok[:, None], attention_mask=attention_mask, past_key_values=cache,
                       cache_position=torch.tensor([T + i]))
            logits.append(out.logits[:, -1].float())
            tok = out.logits[:, -1].argmax(-1)
    return torch.stack(toks, 1), torch.stack(logits, 1)


def forced(step, model, ids, attention_mask, cache, tokens):
    """Teacher-forced decode: prefill with `model`, then feed `tokens` [B, N] through `step`; logits [B, N, V].
    (bf16 comparisons: HF eager rounds probabilities to bf16, so free-running greedy paths may part at near-ties.)"""
    B, T = ids.shape
    logits = []
    with torch.no_grad():
        model(ids, attention_mask=attention_mask[:, :T], past_key_values=cache, cache_position=torch.arange(T))
        for i in range(tokens.shape[1]):
            out = step(tokens[:, i:i + 1], attention_mask=attention_mask, past_key_values=cache,
                       cache_position=torch.tensor([T + i]))
            logits.append(out.logits[:, -1].float())
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
