"""CUDA entry points of the ops. Each picks a kernel backend; the ops have already validated the inputs."""

from __future__ import annotations


def _missing(name):
    raise NotImplementedError(f"mla_compile: no CUDA kernel for {name} yet (CPU tensors work)")


def decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale):
    _missing("mla::decode")


def sparse_decode(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale):
    _missing("mla::sparse_decode")


def merge_states(outs, lses):
    _missing("mla::merge_states")


def cache_write(ckv_cache, kpe_cache, ckv, kpe, slots):
    _missing("mla::cache_write")


def indexer_topk(q, weights, k_cache, block_table, seq_lens, topk, sm_scale):
    _missing("dsa::indexer_topk")


def k_only_indices(block_table, seq_lens, page_size, topk):
    _missing("dsa::k_only_indices")
