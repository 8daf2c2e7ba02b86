"""HF `generate()` through the `mla_dcp` backend: the compile config, the in-graph mask, and the one call that sets
up both plus deferred stop checks (`optimize_generate`).

Where the time of a generate() decode step goes once the attention is absorbed (H200, 4-layer DeepSeek-V3 with MoE,
H 16, batch 8, 4K prompt; `benchmarks/lab/generate_host.py`, benchmarks/RESULTS.md "HF generate()"): the GPU runs a
step in ~1.2 ms, but the host spends ~0.5 ms in HF's `prepare_inputs_for_generation` (most of it building the 4-D
attention mask in Python), ~0.7 ms in the compiled call (Dynamo guards, cudagraph-tree bookkeeping, the graph
launch), ~0.2 ms updating kwargs, and then waits for the device every step (HF's stop check reads
`unfinished_sequences.max() == 0` on the host). Host and device take turns instead of overlapping.

`optimize_generate(model)` removes the two parts that are not inherent:
* the mask is built inside the compiled step (`create_masks_in_graph`): on the device, and provable by the pass;
* HF's own `DeferredStopCheck` (HF enables it on mps only) runs on CUDA for this model: the host reads the stop
  flag one step late, so it queues step t+1 while the device runs step t;
and one that is not a host cost but a re-record: transformers 5.24 builds a new StaticCache per generate() call,
whose tensors are static addresses of the CUDA graphs, so each call recorded the decode graph again; the cache is
kept and reset instead (`reuse_cache`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging

import torch

from .. import fp8, tuning
from ..passes import step_kind

log = logging.getLogger(__name__)


def compile_config(mode: str | None = "reduce-overhead", *, dynamic: bool | None = False, fullgraph: bool = False,
                   **options):
    """HF `CompileConfig` that makes `generate()`'s own auto-compile use the `mla_dcp` backend:

        model.generate(ids, ..., cache_implementation="static", compile_config=compile_config())
        # or once: model.generation_config.compile_config = compile_config()

    HF prefills eagerly and compiles the decode step itself (`model.get_compiled_call`); with this config the
    step is `torch.compile(model.__call__, backend="mla_dcp", mode=mode)`: absorbed MLA decode over the latent
    cache, CUDA-graph trees with "reduce-overhead" (the default, as HF's own). `mode="default"`: no CUDA graphs.
    `dynamic=False` (not HF's None): a batch of another size compiles its own static graph instead of a
    dynamic one; ints that advance every decode step (HF's sliding-window token count) stay symbolic instead of a
    recompile per step (`passes/step_kind.STEP_COUNTER_SOURCES`). `options`:
    our backend keys and Inductor keys (`mla_compile.backend.BACKEND_OPTIONS`); with options the mode travels
    inside them (torch.compile refuses `mode=` together with `options=`). On a device HF does not auto-compile on
    (CPU) the config asks HF to compile anyway. Without CUDA graphs the step is host-bound; `mode="default",
    cpp_wrapper=True` (an Inductor key) launches its kernels from Inductor's C++ wrapper instead of Python: on an
    H100 (benchmarks/RESULTS.md, 2026-12-07) 2.13 vs 3.72 ms a token at 4K, for a longer first compile.
    """
    from transformers import CompileConfig

    from ..dsa import mark_max_kv_len_dynamic

    for source in step_kind.STEP_COUNTER_SOURCES:
        mark_max_kv_len_dynamic(source)
    if options:
        cfg = CompileConfig(backend="mla_dcp", mode=None, dynamic=dynamic, fullgraph=fullgraph,
                            options={"mode": mode, **options} if mode is not None else dict(options))
    else:
        cfg = CompileConfig(backend="mla_dcp", mode=mode, dynamic=dynamic, fullgraph=fullgraph)
    cfg._compile_all_devices = True  # HF skips auto-compile off CUDA/XPU otherwise
    return cfg


def create_masks_in_graph(config, inputs_embeds, attention_mask, cache=None, past_key_values=None, **kwargs):
    """A `create_masks_for_generate` for static caches (install it: `model.create_masks_for_generate =
    create_masks_in_graph`, or `optimize_generate(model)`): instead of HF's precomputed 4-D mask, built before the
    compiled forward (so an eager float mask is a graph input of unknown values and the attention pass cannot
    prove it, and building it costs host time every step), hand the forward the 2-D padding mask padded to the
    cache's fixed length [B, Lmax]. The forward then builds HF's own mask inside the graph (the same values:
    positions past the current one are causally masked anyway), at one fixed shape.

    Except for a multi-token step (the prefill, a verification step) of a model with recurrent layers (linear
    attention, convolutions: `has_recurrent_layers`): such a layer's mask is the trailing positions of the 2-D mask
    it is given (HF's `create_recurrent_attention_mask`), which in the padded mask are padding, not the step's
    tokens (a hybrid model's generate() went wrong from its prefill on). Those steps get the 2-D mask as given, HF's
    own path. A one-token step's recurrent layers take no mask (a generated token is never padding)."""
    from transformers.masking_utils import find_first_full_attention_index, prepare_padding_mask

    cache = cache if cache is not None else past_key_values  # transformers < 5.24 passes past_key_values=
    if attention_mask is None or cache is None or attention_mask.ndim != 2:
        return attention_mask
    if inputs_embeds.shape[1] > 1 and has_recurrent_layers(config):
        return attention_mask
    kv_length, kv_offset = cache.get_mask_sizes(inputs_embeds.shape[1], find_first_full_attention_index(cache))
    return prepare_padding_mask(attention_mask, kv_length, kv_offset)


# layer types whose mask is built from the whole padded 2-D mask like an attention layer's (older transformers do not
# list them all in LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING); any other type is taken as recurrent
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "indexed_attention",
                                   "deepseek_sparse_attention", "compressed_sparse_attention",
                                   "heavily_compressed_attention", "minimax_m3_sparse"})


def recurrent_layer_indices(config) -> list[int]:
    """The layers of the (text) config's `layer_types` that are not attention: those whose mask HF makes with
    `create_recurrent_attention_mask` (linear attention, conv; a "hybrid" pattern's), or of a type neither
    ATTENTION_LAYER_TYPES nor HF's mask table knows (taken as recurrent: a multi-token step then keeps HF's own mask,
    and `MLAPagedCache` keeps HF's cache layer for it)."""
    from transformers import masking_utils

    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    table = getattr(masking_utils, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {})
    recurrent = getattr(masking_utils, "create_recurrent_attention_mask", None)

    def attention(layer_type) -> bool:
        if layer_type in ATTENTION_LAYER_TYPES:
            return True
        fn = table.get(layer_type)
        fns = fn.values() if isinstance(fn, dict) else () if fn is None else (fn,)
        return bool(fns) and all(getattr(f, "func", f) is not recurrent for f in fns)

    return [i for i, t in enumerate(getattr(text, "layer_types", None) or ()) if not attention(t)]


def has_recurrent_layers(config) -> bool:
    """Whether any layer is recurrent (`recurrent_layer_indices`)."""
    return bool(recurrent_layer_indices(config))


def optimize_generate(model, mode: str | None = "reduce-overhead", *, masks_in_graph: bool = True,
                      defer_stop_check: bool = True, reuse_cache: bool = True, **options):
    """Make `model.generate()` decode through `mla_dcp` with little host time per step; returns `model`.

        optimize_generate(model)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False)

    * `generation_config.compile_config = compile_config(mode, **options)`: HF's auto-compile with our backend;
      `generation_config.cache_implementation = "static"` unless one is set (HF auto-compiles static caches only;
      a cache passed to generate() still wins: HF refuses both at once, so generate() then drops the default).
    * `masks_in_graph`: `model.create_masks_for_generate = create_masks_in_graph` (the mask is built inside the
      compiled step; eager attention is rewritten too).
    * `defer_stop_check`: HF's own `DeferredStopCheck` on CUDA for this model's generate() calls. On a stop by
      EOS it runs one extra step whose token HF drops (and, for a cache handed back to the caller, crops: HF only
      defers then when the cache is croppable — its own rule, unchanged — and we not at all where the cache has
      layers that record their past for that crop: `_records_past`). Streamers get tokens one step late.
      Other models and devices keep HF's default.
    * Families that need a Dynamo setting for their decode step to stay one graph (`dynamo_config`: glm5_next
      captures data-dependent output shapes) get it for the duration of each generate() call.
    * Dynamo's recompile limit is at least `RECOMPILE_LIMIT` during each generate() call: every batch size gets
      a graph of its own (`dynamic=False`), a DSA model two (dense and sparse), and another cache class others,
      so Dynamo's default of 8 ran a model's ninth such step shape eagerly (a warning, then the slow path).
    * `reuse_cache`: the static cache HF builds for a call is kept and reset (zeroed in place) for the next call of
      the same batch size, cache length, dtype and device, instead of a new one per call (transformers 5.24 builds
      a new StaticCache every generate()). Its tensors are static addresses of the CUDA graphs, so a new cache means
      the cudagraph trees record the decode graph again in every call (~7-12 ms a call on an H200, seen in
      benchmarks/lab/generate_profile.py); a reused one replays (H200: 0.83 vs 1.10 ms a token at 4K, H 16 batch
      8). A call that hands its cache back (`return_dict_in_generate=True`: `out.past_key_values`) may take the
      kept cache but never keeps it, so a cache the caller holds is never reset by a later call. Cost: one cache's
      memory stays held between calls (until `optimize_generate` is called again). `reuse_cache=False`: HF's own
      cache per call.
    """
    if not all(isinstance(v, bool) for v in (masks_in_graph, defer_stop_check, reuse_cache)):
        raise ValueError(f"masks_in_graph / defer_stop_check / reuse_cache: expected bools, got {masks_in_graph!r} / "
                         f"{defer_stop_check!r} / {reuse_cache!r}")
    gen_cfg = model.generation_config
    gen_cfg.compile_config = compile_config(mode, **options)
    if gen_cfg.cache_implementation is None:
        gen_cfg.cache_implementation = "static"
    if masks_in_graph:
        model.create_masks_for_generate = create_masks_in_graph
    elif vars(model).get("create_masks_for_generate") is create_masks_in_graph:
        del model.create_masks_for_generate
    defer = defer_stop_check and _install_deferral_hook()
    hf_generate = getattr(model.generate, _WRAPS, model.generate)  # a second call re-wraps HF's own generate
    model.generate = _wrap_generate(model, hf_generate, defer, dynamo_config(model))
    vars(model).pop("_prepare_static_cache", None)  # a previous call's reused cache is dropped
    if reuse_cache:
        if hasattr(type(model), "_prepare_static_cache"):
            model._prepare_static_cache = _reusing_static_cache(model)
        else:
            log.warning("mla_compile: reuse_cache=True needs transformers' _prepare_static_cache (5.x); this "
                        "transformers builds its static cache elsewhere: each generate() keeps its own cache")
    return model


def _reusing_static_cache(model):
    """model._prepare_static_cache (HF's generate() asks it for each call's static cache) that hands back the
    previous call's cache, reset, when batch size, length, implementation, dtype and device are the same
    (`optimize_generate(reuse_cache=True)`). Keyed on HF's own arguments, whatever their order. A cache that
    leaves generate() (`_RETURNS_CACHE`) is the caller's from then on: not kept."""
    import inspect

    hf_prepare = type(model)._prepare_static_cache
    params = inspect.signature(hf_prepare)
    kept = {}

    def prepare_static_cache(*args, **kwargs):
        a = params.bind(model, *args, **kwargs).arguments
        # HF sizes the cache to the longest length seen (its _previous_max_cache_length): the same rule here
        length = max(a["max_cache_len"], getattr(model, "_previous_max_cache_length", -1))
        key = (a.get("cache_implementation"), a["batch_size"], length, a.get("prefill_chunk_size"), model.dtype,
               model.device)
        cache = kept.pop(key, None)
        kept.clear()  # one cache held at a time
        if cache is not None:
            cache.reset()
        else:
            cache = hf_prepare(model, *args, **kwargs)
        # an encoder-decoder pair sizes its cross cache per call
        if not _RETURNS_CACHE.get() and not model.config.is_encoder_decoder:
            kept[key] = cache
        return cache

    return prepare_static_cache


def _returns_cache(model, kwargs: dict) -> bool:
    """Whether this generate() call hands its cache back to the caller (HF's GenerateOutput.past_key_values):
    `return_dict_in_generate` from the call, else from the generation config it passes, else the model's."""
    if "return_dict_in_generate" in kwargs:
        return bool(kwargs["return_dict_in_generate"])
    config = kwargs.get("generation_config") or model.generation_config
    return bool(getattr(config, "return_dict_in_generate", False))


# Families whose attention computes a tensor of data-dependent shape between HF's kv expansion and the attention
# (glm5_next's kpool indexer: `pool_keys[:, keep]`). With Dynamo's defaults the graph breaks there and K reaches the
# attention as a graph input the pass cannot prove (counted, not rewritten); capturing such ops keeps one graph per
# decode step (passes/attention_match.KVInput, tests/passes/test_graph_breaks.py).
_DYNAMO_CONFIG = {t: {"capture_dynamic_output_shape_ops": True} for t in ("glm5_next", "glm5_next_text")}


def dynamo_config(model) -> dict:
    """The torch._dynamo.config entries `model`'s generate() runs under (empty for most families)."""
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = {getattr(config, "model_type", None), getattr(text, "model_type", None)}
    return next((dict(_DYNAMO_CONFIG[t]) for t in types if t in _DYNAMO_CONFIG), {})


# Graphs one compiled decode step may have (Dynamo's recompile_limit, default 8) during generate(): one per batch
# size, cache class and, for DSA models, dense / sparse graph.
RECOMPILE_LIMIT = 64


# --------------------------------------------------------------------------- generate(), wrapped once
_DEFERRING = contextvars.ContextVar("mla_compile_defer_stop_check", default=False)
_RETURNS_CACHE = contextvars.ContextVar("mla_compile_generate_returns_cache", default=True)
_WRAPS = "_mla_compile_wraps"  # on our wrapper: the generate it wraps
_DEFERS = "_mla_compile_defers_stop_check"  # on our wrapper: whether it defers the stop check
_CACHE_KWARGS = ("cache", "past_key_values")


def _cache_promise(kwargs: dict):
    """The tuning promise a generate() call's own cache makes, as a context: a cache whose FP8 layers were all
    written with power-of-two scales (`MLAPagedCache` / `DSAStaticCache(..., kv_cache_dtype="fp8_e4m3",
    fp8_scale_fmt="ue8m0")`) runs the call under `Tuning.fp8_scale_fmt="ue8m0"` (kernels that are exact only for
    such scales may take it: FlashMLA's FP8 kernel at 128 heads), so the cache's setting is the only one to make.
    Any other cache, or none: nothing changes."""
    cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
    fp8_layers = [layer for layer in getattr(cache, "layers", ()) if getattr(layer, "fp8", False)]
    if not fp8_layers or any(getattr(layer, "fp8_scale_fmt", None) != fp8.UE8M0 for layer in fp8_layers):
        return contextlib.nullcontext()
    return tuning.use(dataclasses.replace(tuning.current(), fp8_scale_fmt=fp8.UE8M0))


def _beam_search(model, kwargs: dict) -> bool:
    """Whether this generate() call asks for beam search (num_beams > 1), from the call or its generation config."""
    config = kwargs.get("generation_config") or model.generation_config
    return (kwargs.get("num_beams") or getattr(config, "num_beams", 1) or 1) > 1


def _wrap_generate(model, generate, defer: bool, dynamo: dict | None = None):
    @functools.wraps(generate)
    def mla_generate(*args, **kwargs):
        if _beam_search(model, kwargs):
            # HF's beam search calls the model itself, never its auto-compiled step (and it reorders the cache by
            # replacing its tensors, which CUDA graphs cannot follow): said, not skipped silently
            log.warning("mla_compile: generate() with num_beams > 1 runs HF's beam search, which does not use "
                        "generate()'s auto-compile: unless you compiled the model's forward yourself, these steps "
                        "decode with HF's own attention, not mla_dcp")
        if any(kwargs.get(k) is not None for k in _CACHE_KWARGS):
            kwargs.setdefault("cache_implementation", None)  # the caller's cache replaces our "static" default
        token = _DEFERRING.set(defer)
        returns = _RETURNS_CACHE.set(_returns_cache(model, kwargs))
        config = {"recompile_limit": max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT), **(dynamo or {})}
        try:
            with torch._dynamo.config.patch(**config), _cache_promise(kwargs):
                return generate(*args, **kwargs)
        finally:
            _RETURNS_CACHE.reset(returns)
            _DEFERRING.reset(token)

    setattr(mla_generate, _WRAPS, generate)
    setattr(mla_generate, _DEFERS, defer)
    return mla_generate


def _records_past(cache) -> bool:
    """Whether a cache has layers with HF's past recording (`activate_past_recording`: transformers >= 5.25's
    linear-attention and sliding-window layers). A deferred stop check turns it on for a cache it hands back, to undo
    its extra step; such a layer then assigns its growing states instead of copying them in place, so they are
    outputs of one CUDA-graph replay that the next one overwrites (cudagraph trees refuse to read them)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        layers = getattr(getattr(cache, "self_attention_cache", None), "layers", None) or ()
    return any(hasattr(layer, "activate_past_recording") for layer in layers)


def _install_deferral_hook() -> bool:
    """Wrap HF's `DeferredStopCheck.is_supported` once so that, inside a deferring generate() on CUDA, it answers
    with HF's own rule for mps (the device HF enables deferral on). False (nothing to do) on a transformers
    without `DeferredStopCheck`."""
    try:
        from transformers.generation import utils as gen_utils
    except ImportError:  # pragma: no cover - transformers is optional
        return False
    cls = getattr(gen_utils, "DeferredStopCheck", None)
    if cls is None or not hasattr(cls, "is_supported"):
        log.info("mla_compile: this transformers has no DeferredStopCheck; generate() keeps its per-step stop sync")
        return False
    if getattr(cls.is_supported, _DEFERS, False):
        return True
    hf_rule = cls.is_supported

    def is_supported(device, cache, cache_is_returned, *args, **kwargs):
        if _DEFERRING.get() and torch.device(device).type == "cuda":
            if cache_is_returned and _records_past(cache):
                log.info("mla_compile: generate() keeps its per-step stop sync: the cache it hands back has layers "
                         "that would record their past (recurrent / sliding states) to undo a deferred step, which "
                         "CUDA graphs cannot keep")
                return False
            return hf_rule(torch.device("mps"), cache, cache_is_returned, *args, **kwargs)
        return hf_rule(device, cache, cache_is_returned, *args, **kwargs)

    setattr(is_supported, _DEFERS, True)
    cls.is_supported = staticmethod(is_supported)
    return True
