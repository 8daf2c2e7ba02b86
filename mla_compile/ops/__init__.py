"""The op registry: importing this module registers every `torch.ops.mla.*` / `torch.ops.dsa.*` op."""

from .attention import decode, sparse_decode
from .cache import cache_write
from .dsa import indexer_topk, k_only_indices
from .experts import expert_linear
from .linear import fused_linear, linear_partials
from .merge import merge_states
from . import dcp  # noqa: F401,E402  (mla::dcp_decode + DCP owner-write helpers)
from . import tp_dcp  # noqa: F401,E402  (mla::tp_dcp_decode: TP heads x DCP tokens)
from . import hf_cache  # noqa: F401,E402  (mla_hf::gather_latent / all_selected: what our HF caches emit)

__all__ = ["decode", "sparse_decode", "cache_write", "indexer_topk", "k_only_indices", "merge_states", "fused_linear",
           "linear_partials", "expert_linear"]
from . import dcp_dsa  # noqa: F401,E402  (dsa::dcp_indexer_topk: exact global top-k over DCP shards)
