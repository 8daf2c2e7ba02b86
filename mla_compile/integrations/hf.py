"""Latent caches for HF transformers MLA models (DeepseekV3 / V3.2 / GLM-MoE-DSA), through HF's Cache API.

HF's MLA attention stores the compressed latent through `past_key_values.update(kv_nope [B,1,T,R],
k_rot [B,1,T,P], layer_idx)` and attends over whatever tensors `update` returns. HF's own `StaticCache` already
works with the `mla_dcp` backend (its [B, 1, Lmax, R] buffers are viewed as a token-slot cache). The caches
here keep the latent in OUR paged layout instead:

* `MLAPagedCache(config, max_cache_len, page_size=64)`: single rank, pages [NP, PS, R] / [NP, PS, P] with a
  per-request block table (what a serving engine allocates). Static shapes, static addresses: CUDA graphs ok.
* `MLAPagedCache(..., dcp=group)`: DCP-sharded. One process per rank; rank r stores only the tokens it owns
  (token t -> rank t % n at local position t // n, `mla_compile.layout`), so capacity grows n-fold.

`update` writes the new tokens with `mla::cache_write` (owner slots only) and returns
`mla_hf::gather_latent(...)`: the full latent [B, 1, Lmax, R] / [B, 1, Lmax, P] in token order (for DCP: the
shards all-gathered and interleaved back). So in eager mode, or compiled without our backend, HF's attention
runs unchanged over the full latent and gives HF's results. Compiled with `backend="mla_dcp"`, the pass
(`mla_compile.passes.mla_attention`) sees gather -> kv_b_proj -> attention and replaces all of it with
`mla.decode` (single rank) or `mla.dcp_decode` (sharded) over the pages: no gather, no expansion.

DSA models (V3.2 / GLM-5) also call `update_indexer`; the layers inherit HF's `StaticIndexedLayer` for it.

Host-side length (`DSADenseMixin`, in `MLAPagedCache` and `DSAStaticCache` — HF's `StaticCache` plus this): the
cache keeps a Python int `max_kv_len` (the per-request kv length a one-token step will have: tokens cached + 1;
it knows each step's token count S from the static shapes, no device sync). At the step's first layer it checks
`max_kv_len + S - 1 <= max_cache_len` (a step past the cache raises, eagerly and compiled, instead of dropping
tokens) and, for DSA models, compares it with `config.index_topk` once for the whole step, in plain Python, so
under torch.compile Dynamo guards on it (`max_kv_len <= topk` / `topk + 1 <= max_kv_len`) and keeps exactly two
graphs whichever layers have indexers. When the comparison holds every cached token is in the top-k, so while
tracing the cache returns the indexer keys through the marker `mla_hf::all_selected`; the pass then drops the
index mask and with it the indexer's logits and top-k (only the indexer key-cache write stays). Eagerly nothing
changes (HF's result).

The cache advances the int itself (`max_kv_len += S` at the step's first layer), inside the compiled code, and
moves it back in `crop(-n)` (HF's rollback of rejected draft tokens: assisted generation, prompt lookup).
Dynamo makes that write a SymInt graph output (so the int becomes a graph input); the `mla_dcp` backend moves
such host-int-only outputs out of the graph (`passes.host_ints`) before Inductor, so the compiled graph has no
int input and CUDA-graph trees record each variant once. The int's Dynamo source (e.g.
`L['past_key_values'].max_kv_len`) is marked dynamic from the start by a regex in
`torch.compiler.config.dynamic_sources` (no value-specialized third graph).
"""

from __future__ import annotations

import inspect

import torch

from .. import layout, ops  # noqa: F401  (registers torch.ops.mla.*)
from . import fp8_cache
from ..ops.hf_cache import ALL_SELECTED_OPS, GATHER_OPS, all_selected, gather_latent  # noqa: F401  (re-exported)
from .tp import check_cache_group
from .generate import compile_config, create_masks_in_graph, optimize_generate  # noqa: F401  (the generate road)
from .generate import recurrent_layer_indices

try:  # transformers >= 5.17 (both the GPU machine's 5.17 and the latest have it)
    from transformers.cache_utils import Cache, StaticIndexedLayer as _BaseLayer
except ImportError:  # pragma: no cover - older transformers: no indexer cache
    try:
        from transformers.cache_utils import Cache, StaticLayer as _BaseLayer
    except ImportError:
        Cache = _BaseLayer = None




def cache_kwargs(model, cache) -> dict:
    """The keyword that hands `cache` to an HF model's forward: `cache` from transformers 5.24 on (where
    `past_key_values` is deprecated; removed in 5.40), `past_key_values` before. `model` may be the
    `torch.compile` wrapper of the model: `model(ids, **cache_kwargs(model, cache), ...)`."""
    return {_cache_arg_name(type(getattr(model, "_orig_mod", model))): cache}


_CACHE_ARG_NAMES: dict = {}


# a constant per model class: Dynamo calls it while tracing a compiled step that uses `cache_kwargs` and keeps the
# result (an lru_cache here made Dynamo warn of possible silent incorrectness: it traces through the wrapper)
@torch.compiler.assume_constant_result
def _cache_arg_name(cls) -> str:
    name = _CACHE_ARG_NAMES.get(cls)
    if name is None:
        name = _CACHE_ARG_NAMES[cls] = ("cache" if "cache" in inspect.signature(cls.forward).parameters
                                        else "past_key_values")
    return name



MAX_KV_LEN_ATTR = "max_kv_len"
# regex over Dynamo source names (torch.compiler.config.dynamic_sources), whatever the entry point calls the
# cache (L['past_key_values'], L['kwargs']['past_key_values'], ...); no ',' or ' ' allowed in it
MAX_KV_LEN_SOURCE = r".*\." + MAX_KV_LEN_ATTR + "$"


class DSADenseMixin:
    """Host-side token count for our caches: the overflow check before a step writes, and the DSA dense / sparse
    choice (see the module docstring).

    Mix in before an HF `Cache`; call `_init_dsa(config, max_cache_len)` after the Cache's __init__. A cache used
    for a fresh batch must start empty (`reset()` sets the count back).

    A step begins at the first layer's `update` (the first layer that ever wrote, learned from the first step:
    hybrid models' linear layers never call it). There, from host ints only (Dynamo guards on them; no device
    sync): the step's largest kv length `max_kv_len + S - 1` is checked against `max_cache_len` (a step that would
    write past the cache raises instead of losing tokens) and compared with `index_topk` once (dense for every
    indexer layer of the step, whichever layers have indexers), then the count advances by the step's S tokens.
    """

    def _init_dsa(self, config, max_cache_len: int) -> None:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.index_topk = getattr(text, "index_topk", None)
        self._host_capacity = max_cache_len
        self._first_layer = None
        self._step_dense = False
        setattr(self, MAX_KV_LEN_ATTR, 1)  # kv length of a one-token step on the empty cache
        from ..dsa import mark_max_kv_len_dynamic

        mark_max_kv_len_dynamic(MAX_KV_LEN_SOURCE)

    def _begin_step(self, layer_idx: int, S: int) -> None:
        if self._first_layer is None:
            self._first_layer = layer_idx
        if layer_idx != self._first_layer:
            return
        kv_len = getattr(self, MAX_KV_LEN_ATTR) + (S - 1)  # every request's kv length after this step's write
        if kv_len > self._host_capacity:
            raise ValueError(
                f"cache: this step writes {S} token(s) after {kv_len - S} cached, past max_cache_len="
                f"{self._host_capacity}: allocate the cache with a larger max_cache_len (or reset() it for a new "
                f"batch)")
        self._step_dense = bool(self.index_topk is not None and kv_len <= self.index_topk)
        setattr(self, MAX_KV_LEN_ATTR, kv_len + 1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if getattr(layer, "is_initialized", False) and key_states.shape[0] != layer.batch_size:
            # the buffers (pages and block table) were sized by the first write
            raise ValueError(f"key_states: batch size {key_states.shape[0]}, but this cache was allocated for batch "
                             f"size {layer.batch_size} by its first write (reset() keeps that size): use a cache per "
                             f"batch size")
        self._begin_step(layer_idx, key_states.shape[-2])
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        keys = super().update_indexer(indexer_key_states, layer_idx)
        if self._step_dense and torch.compiler.is_compiling():
            keys = torch.ops.mla_hf.all_selected(keys, self.index_topk)
        return keys

    def reset(self) -> None:
        super().reset()
        self._step_dense = False
        setattr(self, MAX_KV_LEN_ATTR, 1)

    def crop(self, tokens_to_remove: int) -> None:
        """HF's rollback of rejected draft tokens (assisted generation, prompt lookup: `crop(-n)` drops the last
        n): the layers move their device lengths back, and the host count with them (else the overflow check
        and the DSA dense / sparse choice would run ahead of the cache)."""
        super().crop(tokens_to_remove)  # HF's static layers refuse a positive count (keep-the-first form)
        setattr(self, MAX_KV_LEN_ATTR, max(1, getattr(self, MAX_KV_LEN_ATTR) - abs(int(tokens_to_remove))))


# ----------------------------------------------------------------------------------------------- caches
if _BaseLayer is not None:

    class MLAPagedLayer(_BaseLayer):
        """One layer's latent cache in pages; `keys`/`values` alias the ckv/kpe page pools (FP8: both are the
        layer's token buffer, `integrations.fp8_cache`)."""

        def __init__(self, max_cache_len: int, page_size: int = 64, dcp_size: int = 1, dcp_rank: int = 0,
                     group_name: str = "", shuffle_pages: bool = False, kv_cache_dtype: str | None = None,
                     heads_sharded: bool = False, fused_rows: bool = False, fp8_scale_fmt: str | None = None,
                     **kwargs):
            super().__init__(max_cache_len=max_cache_len)
            self.fused_rows = fused_rows
            self.page_size, self.dcp_size, self.dcp_rank, self.group_name = page_size, dcp_size, dcp_rank, group_name
            self.heads_sharded = heads_sharded
            self.shuffle_pages = shuffle_pages
            self.fp8 = fp8_cache.check_kv_cache_dtype(kv_cache_dtype)
            self.fp8_scale_fmt = fp8_cache.check_scale_fmt(fp8_scale_fmt, self.fp8)

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.batch_size = key_states.shape[0]
            self.num_heads = 1
            self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
            cap = layout.local_capacity(self.max_cache_len, self.dcp_size)
            self.max_pages = -(-cap // self.page_size)
            num_pages = self.batch_size * self.max_pages
            order = torch.arange(num_pages)
            if self.shuffle_pages:
                # scrambled by a multiplicative hash, not drawn: a draw from the global RNG would change a seeded
                # generate()'s samples, and a Generator of its own cannot be made inside a compiled first step
                order = torch.argsort((order * 2654435761) % (1 << 32))
            self.block_table = order.to(torch.int32).view(self.batch_size, self.max_pages).to(self.device)
            if self.fp8:
                self.keys = self.values = fp8_cache.allocate(num_pages, self.page_size, self.k_head_dim,
                                                             self.v_head_dim, self.dtype, self.device)
            elif self.fused_rows:  # one [NP, PS, R + P] buffer: ckv and kpe its two column ranges
                rows = torch.zeros((num_pages, self.page_size, self.k_head_dim + self.v_head_dim), dtype=self.dtype,
                                   device=self.device)
                self.keys, self.values = rows[..., :self.k_head_dim], rows[..., self.k_head_dim:]
            else:
                self.keys = torch.zeros((num_pages, self.page_size, self.k_head_dim), dtype=self.dtype,
                                        device=self.device)
                self.values = torch.zeros((num_pages, self.page_size, self.v_head_dim), dtype=self.dtype,
                                          device=self.device)
            self.cumulative_length = self.cumulative_length.to(self.device)
            if not torch.compiler.is_compiling():
                for t in (self.keys, self.values, self.block_table, self.cumulative_length):
                    torch._dynamo.mark_static_address(t)
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            """key_states: kv_nope [B, 1, T, R]; value_states: k_rot [B, 1, T, P] (HF MLA's latent pair)."""
            if key_states.dim() != 4 or key_states.shape[1] != 1 or value_states.shape[1] != 1:
                raise ValueError(
                    f"key_states: MLAPagedCache stores the MLA latent ([B, 1, T, R] / [B, 1, T, P]) but got "
                    f"{tuple(key_states.shape)} / {tuple(value_states.shape)}: this attention caches per-head K/V "
                    f"(e.g. transformers 5.17's DeepseekV32 / GlmMoeDsa); use HF's StaticCache for it")
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            B, _, T, R = key_states.shape
            positions = torch.arange(T, device=self.device) + self.cumulative_length  # GLOBAL positions
            self.cumulative_length.add_(T)
            req = torch.arange(B, device=self.device).repeat_interleave(T)
            slots = layout.owner_slots(self.block_table, req, positions.repeat(B), self.page_size,
                                       self.dcp_size, self.dcp_rank)
            ckv, kpe = key_states.reshape(B * T, R), value_states.reshape(B * T, value_states.shape[-1])
            if self.fp8:
                fp8_cache.write(self.keys, ckv, kpe, slots, self.fp8_scale_fmt)
                return fp8_cache.gather(self.keys, R, self.dtype, self.block_table, self.max_cache_len,
                                        self.dcp_size, self.dcp_rank, self.group_name, self.heads_sharded)
            torch.ops.mla.cache_write(self.keys, self.values, ckv, kpe, slots)
            return torch.ops.mla_hf.gather_latent(self.keys, self.values, self.block_table, self.max_cache_len,
                                                  self.dcp_size, self.dcp_rank, self.group_name,
                                                  heads_sharded=self.heads_sharded)

        def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
            """DSA indexer keys [B, T, Di]. Single rank: HF's static buffer. DCP: this rank's token-cyclic shard in
            pages of the latent's block table (the same slots), read back whole through `mla_hf::gather_latent`
            (the pass replaces HF's indexer over it by `dsa.dcp_indexer_topk` over the shard)."""
            if self.dcp_size == 1:
                return super().update_indexer(indexer_key_states)
            B, T, Di = indexer_key_states.shape
            if not self.is_indexer_initialized:
                if not self.is_initialized:
                    raise ValueError("indexer_key_states: the DCP cache places indexer keys in the latent's pages: "
                                     "call update() for this layer first (HF's DSA attention does)")
                self.indexer_keys = torch.zeros((self.keys.shape[0], self.page_size, Di),
                                                dtype=indexer_key_states.dtype, device=self.device)
                self.indexer_no_rope = self.indexer_keys.new_zeros((self.keys.shape[0], self.page_size, 0))
                self.indexer_cumulative_length = torch.zeros((), dtype=torch.long, device=self.device)
                if not torch.compiler.is_compiling():
                    for t in (self.indexer_keys, self.indexer_no_rope, self.indexer_cumulative_length):
                        torch._dynamo.mark_static_address(t)
                self.is_indexer_initialized = True
            positions = torch.arange(T, device=self.device) + self.indexer_cumulative_length
            self.indexer_cumulative_length.add_(T)
            req = torch.arange(B, device=self.device).repeat_interleave(T)
            slots = layout.owner_slots(self.block_table, req, positions.repeat(B), self.page_size, self.dcp_size,
                                       self.dcp_rank)
            torch.ops.mla.cache_write(self.indexer_keys, self.indexer_no_rope, indexer_key_states.reshape(B * T, Di),
                                      indexer_key_states.new_zeros((B * T, 0)), slots)
            keys, _ = torch.ops.mla_hf.gather_latent(self.indexer_keys, self.indexer_no_rope, self.block_table,
                                                     self.max_cache_len, self.dcp_size, self.dcp_rank,
                                                     self.group_name)
            return keys.squeeze(1)

        def reset(self) -> None:
            if self.is_initialized:
                self.keys.zero_()
                self.values.zero_()
            self.cumulative_length.zero_()
            if getattr(self, "is_indexer_initialized", False):
                self.indexer_keys.zero_()
                self.indexer_cumulative_length.zero_()

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            """Beam search: request b continues with request beam_idx[b]'s tokens. HF's static layers index_select
            their [B, ...] buffers; ours are page pools (dim 0: pages), so the pages are copied through the block
            table instead, in place (every buffer keeps its address: marked static, read by CUDA graphs). The
            source pages are gathered before any is written: a beam kept twice is read, not overwritten. Under DCP
            each rank copies its own shard (the same requests everywhere)."""
            if not self.is_initialized:
                return
            beam_idx = beam_idx.to(self.device)
            if beam_idx.shape != (self.batch_size,):
                raise ValueError(f"beam_idx: expected one source request per request ({self.batch_size}), got "
                                 f"shape {tuple(beam_idx.shape)}")
            dst = self.block_table.reshape(-1).long()
            src = self.block_table.index_select(0, beam_idx).reshape(-1).long()
            pools = [self.keys] if self.keys is self.values else [self.keys, self.values]
            indexed = getattr(self, "is_indexer_initialized", False)
            if indexed and self.dcp_size > 1:
                pools.append(self.indexer_keys)  # the DCP indexer keys live in the latent's pages
            elif indexed:  # one rank: HF's [B, L, Di] buffer, one row per request
                self.indexer_keys.copy_(self.indexer_keys.index_select(0, beam_idx))
            for pool in pools:
                pool.index_copy_(0, dst, pool.index_select(0, src))
            if getattr(self, "indexer_position_ids", None) is not None:
                self.indexer_position_ids = self.indexer_position_ids.index_select(1, beam_idx)

    class MLAPagedCache(DSADenseMixin, Cache):
        """HF `Cache` keeping each layer's MLA latent in a paged (optionally DCP-sharded) cache.

        config: the model config; max_cache_len: tokens per request (global); page_size: tokens per page;
        dcp: None (single rank) or an object with `size`, `rank`, `group_name` (e.g.
        `mla_compile.distributed.init_dcp()`), one process per rank, every rank running the same model on the
        same inputs. kv_cache_dtype: None / "auto" (the model's dtype) or "fp8_e4m3" (the FP8 latent cache,
        `mla_compile/fp8.py`: quantized on write, 656 bytes a token for a bf16 model; DCP shards too);
        fp8_scale_fmt with it: None (scales amax / 448) or "ue8m0" (power-of-two scales, DeepSeek's own). Use it
        like HF's StaticCache: `model(ids, **cache_kwargs(model, cache), ...)`.
        TP x DCP: dcp from `init_dcp(tp_size=...)` and the model sharded with `integrations.tp.shard_mla_heads`
        (the same group; a mismatch is a ValueError). DSA models under DCP keep the indexer keys sharded too.
        Hybrid families (linear-attention layers beside the MLA ones: kimi_linear, bailing_hybrid): those layers keep
        the cache layer HF's StaticCache makes for them (their fixed-size states, the same on every DCP rank); only
        the MLA layers are paged and sharded.
        fused_rows=True (model-dtype caches): each layer's ckv and kpe are the two column ranges of one
        [NP, PS, R + P] buffer, the K layout FlashMLA reads in place for a `mla.decode` call with this cache's block
        table (`kernels/dispatch.select_decode_kernel` takes it there at >= 64 heads and >= 256K tokens per call).
        The HF attention pass hands page-size-1 token tables instead (exact for any mask), which FlashMLA does not
        read: a compiled model over this cache runs our kernels, which read its rows (1152 bytes apart) wherever
        they read a packed cache's (TMA descriptors at the rows' stride).
        """

        def __init__(self, config, max_cache_len: int, *, page_size: int = 64, dcp=None,
                     shuffle_pages: bool = False, kv_cache_dtype: str | None = None, fused_rows: bool = False,
                     fp8_scale_fmt: str | None = None):
            if fused_rows and fp8_cache.check_kv_cache_dtype(kv_cache_dtype):
                raise ValueError("fused_rows: an FP8 cache is one token buffer already (mla_compile/fp8.py); "
                                 "fused_rows=True is for model-dtype caches")
            text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            n = getattr(dcp, "size", 1) if dcp is not None else 1
            kw = dict(page_size=page_size, dcp_size=n, dcp_rank=getattr(dcp, "rank", 0) if dcp is not None else 0,
                      group_name=getattr(dcp, "group_name", "") if n > 1 else "", shuffle_pages=shuffle_pages,
                      kv_cache_dtype=kv_cache_dtype, heads_sharded=check_cache_group(config, dcp),
                      fused_rows=fused_rows, fp8_scale_fmt=fp8_scale_fmt)
            # a hybrid's recurrent layers (linear attention: fixed-size states, no tokens to page or shard) keep the
            # layer HF's StaticCache makes for them, replicated on every DCP rank
            recurrent = set(recurrent_layer_indices(config))
            hf_layers = _StaticCache(config=config, max_cache_len=max_cache_len).layers if recurrent else None
            layers = [hf_layers[i] if i in recurrent else MLAPagedLayer(max_cache_len=max_cache_len, **kw)
                      for i in range(text.num_hidden_layers)]
            super().__init__(layers=layers)
            self.dcp_size = n
            self._init_dsa(config, max_cache_len)

    try:
        from transformers import StaticCache as _StaticCache
        from transformers.cache_utils import StaticLayer
    except ImportError:  # pragma: no cover
        _StaticCache = None

    if _StaticCache is not None:

        class DSAStaticCache(DSADenseMixin, _StaticCache):
            """HF's `StaticCache` plus the DSA dense / sparse choice (host-side `max_kv_len`): a drop-in for
            `StaticCache(config=..., max_cache_len=...)` with DeepseekV32 / GlmMoeDsa models.

            kv_cache_dtype="fp8_e4m3": each full-attention layer's latent is an FP8 token buffer of one page per
            request ([B, max_cache_len, 656] bytes for a bf16 model; `MLAPagedLayer` with page_size = max_cache_len,
            an identity block table; fp8_scale_fmt as for `MLAPagedCache`); None / "auto": HF's own layers."""

            def __init__(self, config, max_cache_len: int, kv_cache_dtype: str | None = None,
                         fp8_scale_fmt: str | None = None, **kwargs):
                fp8 = fp8_cache.check_kv_cache_dtype(kv_cache_dtype)
                fp8_cache.check_scale_fmt(fp8_scale_fmt, fp8)
                super().__init__(config=config, max_cache_len=max_cache_len, **kwargs)
                if fp8:
                    self.layers = [MLAPagedLayer(max_cache_len, page_size=max_cache_len, kv_cache_dtype=kv_cache_dtype,
                                                 fp8_scale_fmt=fp8_scale_fmt)
                                   if isinstance(layer, StaticLayer) and not layer.is_sliding else layer
                                   for layer in self.layers]
                self._init_dsa(config, max_cache_len)
