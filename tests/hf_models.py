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
                seed: int = 0, index_topk: int = 2048, dtype=torch.float32):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cfg = GlmMoeDsaConfig(q_lora_rank=96, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
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
