"""A DeepSeek-Sparse-Attention decode layer in plain PyTorch (no HF), compiled with `mla_dcp`.

Shows the two graphs: while every request fits in `topk` tokens the indexer is skipped (k-only, identity
physical slots); once any request is longer the full indexer runs. Dynamo guards on `max_kv_len <= topk`.

    python examples/dsa_decode.py            # CPU; prints graphs compiled and the guard crossings
"""

from __future__ import annotations

import math

import torch
from torch import nn

import mla_compile  # noqa: F401  (registers the ops; the backend itself needs no import)
from mla_compile.dsa import mark_max_kv_len_dynamic, select_indices


class DSADecodeLayer(nn.Module):
    """Absorbed MLA attention (queries already in latent space) with a DSA indexer, one token per request."""

    def __init__(self, hidden=256, heads=8, kv_lora_rank=64, rope_dim=16, index_heads=4, index_dim=32, topk=64):
        super().__init__()
        self.R, self.P, self.H, self.Hi, self.Di, self.topk = kv_lora_rank, rope_dim, heads, index_heads, index_dim, topk
        self.kv_a = nn.Linear(hidden, kv_lora_rank + rope_dim, bias=False)
        self.q_proj = nn.Linear(hidden, heads * (kv_lora_rank + rope_dim), bias=False)
        self.index_q = nn.Linear(hidden, index_heads * index_dim, bias=False)
        self.index_k = nn.Linear(hidden, index_dim, bias=False)
        self.index_w = nn.Linear(hidden, index_heads, bias=False)
        self.o_proj = nn.Linear(heads * kv_lora_rank, hidden, bias=False)
        self.sm_scale = 1 / math.sqrt(128 + rope_dim)

    def forward(self, x, ckv_cache, kpe_cache, index_cache, block_table, seq_lens, new_slots, max_kv_len: int):
        """x [B, hidden]; caches paged [NP, PS, *]; seq_lens int32 [B] count the new token; new_slots int64 [B]."""
        B = x.shape[0]
        ckv, kpe = self.kv_a(x).split([self.R, self.P], dim=-1)
        torch.ops.mla.cache_write(ckv_cache, kpe_cache, ckv.contiguous(), kpe.contiguous(), new_slots)
        index_cache.view(-1, self.Di).index_copy_(0, new_slots, self.index_k(x))  # the indexer key cache write
        q_nope, q_pe = self.q_proj(x).view(B, self.H, self.R + self.P).split([self.R, self.P], dim=-1)
        indices = select_indices(self.index_q(x).view(B, self.Hi, self.Di), self.index_w(x).float() * self.Hi ** -0.5,
                                 index_cache, block_table, seq_lens, topk=self.topk, sm_scale=self.Di ** -0.5,
                                 max_kv_len=max_kv_len)
        out, _ = torch.ops.mla.sparse_decode(q_nope.contiguous(), q_pe.contiguous(), ckv_cache, kpe_cache, indices,
                                             self.sm_scale)
        return self.o_proj(out.reshape(B, -1))


class DecodeState:
    """A tiny paged-cache scheduler: B requests of different starting lengths, one token per step."""

    def __init__(self, layer: DSADecodeLayer, start_lens: list[int], max_len: int, page_size=16, dtype=torch.float32,
                 seed=0):
        g = torch.Generator().manual_seed(seed)
        self.page_size = page_size
        pages = -(-max_len // page_size)
        B = len(start_lens)
        num_pages = B * pages
        self.block_table = torch.randperm(num_pages, generator=g).view(B, pages).to(torch.int32)
        self.ckv = torch.randn(num_pages, page_size, layer.R, generator=g).to(dtype)
        self.kpe = torch.randn(num_pages, page_size, layer.P, generator=g).to(dtype)
        self.index = torch.randn(num_pages, page_size, layer.Di, generator=g).to(dtype)
        self.lens = list(start_lens)  # host-side lengths: the scheduler knows them without a device sync

    def step_inputs(self):
        """Lengths after this step's token is appended, its slots, and the host-side max."""
        device = self.block_table.device
        pos = torch.tensor(self.lens, device=device)  # the new token's position
        page = self.block_table[torch.arange(len(self.lens), device=device), pos // self.page_size].long()
        slots = page * self.page_size + pos % self.page_size
        self.lens = [n + 1 for n in self.lens]
        return torch.tensor(self.lens, dtype=torch.int32, device=device), slots, max(self.lens)


def run(steps=120, start_lens=(3, 10, 40, 1), topk=64, backend="mla_dcp"):
    torch.manual_seed(0)
    layer = DSADecodeLayer(topk=topk).eval()
    mark_max_kv_len_dynamic()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    state = DecodeState(layer, list(start_lens), max_len=max(start_lens) + steps + 1)
    with torch.no_grad():
        for _ in range(steps):
            seq_lens, slots, max_kv_len = state.step_inputs()
            x = torch.randn(len(start_lens), 256)
            compiled(x, state.ckv, state.kpe, state.index, state.block_table, seq_lens, slots, max_kv_len)
    return state


if __name__ == "__main__":
    from torch._dynamo.utils import counters

    run()
    print("graphs compiled:", counters["stats"]["unique_graphs"])
