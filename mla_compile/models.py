"""Tiny HF MLA models built from config: real MLA head dims, small everything else, random weights.

Nothing is downloaded. Used by the demo, the benchmarks and the tests so every one of them builds the same
models. Needs `transformers` (the `hf` extra).
"""

from __future__ import annotations

import torch

MLA_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


def _common(num_layers: int, hidden: int, heads: int, vocab: int, attn_impl: str, max_positions: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
                num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=heads,
                max_position_embeddings=max_positions, attn_implementation=attn_impl, pad_token_id=0,
                bos_token_id=0, eos_token_id=None, tie_word_embeddings=False, **MLA_DIMS)


def _moe(num_layers: int) -> dict:
    # all layers dense MLP: the MoE router is irrelevant to attention and slow on CPU
    return dict(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=num_layers)


def deepseek_v3(*, q_lora_rank: int | None = 96, rope_interleave: bool = True, num_layers: int = 2, hidden: int = 64,
                heads: int = 4, vocab: int = 128, attn_impl: str = "sdpa", seed: int = 0, dtype=torch.float32,
                max_positions: int = 4096):
    """A DeepseekV3ForCausalLM (MLA: kv_lora_rank 512, rope 64, nope 128, v 128)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(q_lora_rank=q_lora_rank, rope_interleave=rope_interleave, **_moe(num_layers),
                           **_common(num_layers, hidden, heads, vocab, attn_impl, max_positions))
    return spread_weights(DeepseekV3ForCausalLM(cfg), seed, dtype)


def deepseek_v32(*, num_layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 128, attn_impl: str = "sdpa",
                 seed: int = 0, index_topk: int = 2048, dtype=torch.float32, max_positions: int = 4096,
                 index_heads: int = 64):
    """A DeepseekV32ForCausalLM: MLA plus the DSA indexer (index heads of dim 128; 64 heads as in V3.2).

    Fewer index heads make exact score ties common (relu zeroes a token's score when q.k <= 0 in every head),
    and tied tokens at the top-k boundary may be picked differently by different (valid) top-k kernels."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    cfg = DeepseekV32Config(q_lora_rank=96, index_topk=index_topk, index_n_heads=index_heads, index_head_dim=128,
                            **_moe(num_layers), **_common(num_layers, hidden, heads, vocab, attn_impl, max_positions))
    return spread_weights(DeepseekV32ForCausalLM(cfg), seed, dtype)


def glm_moe_dsa(*, num_layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 128, attn_impl: str = "sdpa",
                seed: int = 0, index_topk: int = 2048, dtype=torch.float32, max_positions: int = 4096,
                indexer_types: list | None = None, index_heads: int = 64):
    """A GlmMoeDsaForCausalLM (GLM-5 style DSA attention). indexer_types: e.g. ["full", "shared"] (a "shared"
    layer reuses the previous full layer's top-k)."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    extra = {} if indexer_types is None else dict(indexer_types=list(indexer_types))
    cfg = GlmMoeDsaConfig(q_lora_rank=96, index_topk=index_topk, index_n_heads=index_heads, index_head_dim=128, **extra,
                          **_moe(num_layers), **_common(num_layers, hidden, heads, vocab, attn_impl, max_positions))
    return spread_weights(GlmMoeDsaForCausalLM(cfg), seed, dtype)


def spread_weights(model, seed: int, dtype):
    """HF init is tiny (std 0.02): re-draw 2-D weights at 1/sqrt(fan_in) so logits spread and greedy tokens
    are decisive (a comparison of tokens then means something)."""
    torch.manual_seed(seed)
    model = model.eval().to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    return model
