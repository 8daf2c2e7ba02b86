"""The `mla_dcp` torch.compile backend: our graph rewrites, then Inductor with our pass manager.

Found by Dynamo through the `torch_dynamo_backends` entry point, so `torch.compile(m, backend="mla_dcp")`
works without importing this package. `mode=` takes Inductor's modes ("reduce-overhead" turns on
CUDA-graph trees); `options=` takes our keys (BACKEND_OPTIONS) and any `torch._inductor.config` key.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from . import ops  # noqa: F401  (registers torch.ops.mla / torch.ops.dsa)
from . import tuning as tuning_
from .passes.manager import GraphPass, PassManager

log = logging.getLogger(__name__)


def _dynamo_passes_through():
    """Base classes of an error Dynamo re-raises unwrapped when a backend raises it: its traceback-shortening
    error (torch >= 2.6). Without one, Dynamo wraps our error in BackendCompilerFailed, whose message and
    `.inner_exception` still carry it."""
    try:
        from torch._dynamo.exc import ShortenTraceback
    except ImportError:
        return ()
    return (ShortenTraceback,)


class OptionsError(ValueError, *_dynamo_passes_through()):
    """A bad `options=` value (a ValueError). torch.compile hands `options` to a backend only when it compiles,
    i.e. at the compiled model's first call, and Dynamo wraps whatever a backend raises in BackendCompilerFailed
    except its own traceback-shortening errors: being one of those as well, this reaches the user as itself."""

    def __init__(self, msg: str):
        super().__init__(msg)
        self.first_useful_frame = None  # what Dynamo's traceback shortening reads (None: keep the whole traceback)


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    """Our own `options=` keys, type-checked on construction (OptionsError)."""

    mode: str | None = None  # Inductor mode; torch.compile refuses mode= and options= together, so it fits here
    rewrite_attention: bool = True  # rewrite HF MLA attention into absorbed mla.decode / mla.dcp_decode
    fuse_linears: str = "auto"  # linears sharing x -> mla.fused_linear: auto | always | never (passes/fused_linear.py)
    # HF MoE experts -> mla.expert_linear: batched_mm's W[ids] @ x (passes/expert_gather.py), grouped_mm's fallback
    # op (passes/grouped_mm.py)
    rewrite_experts: bool = True
    # run-time choices (mla_compile/tuning.py): given as their own keys (options={"decode_kernel": "triton"}) or
    # whole (options={"tuning": Tuning(...)}); the rewrites compile under it and the compiled graph runs under it
    tuning: tuning_.Tuning = tuning_.DEFAULT

    def __post_init__(self):
        from .passes.fused_linear import WHERE

        if self.mode is not None:
            if not isinstance(self.mode, str):
                raise OptionsError(f"options: 'mode' must be a str or None, got {self.mode!r}")
            try:
                mode_config(self.mode)
            except ValueError as e:
                raise OptionsError(f"options: {e}") from None
        for name in ("rewrite_attention", "rewrite_experts"):
            value = getattr(self, name)
            if not isinstance(value, bool):  # "no" or 0 must not pass as a truth value
                raise OptionsError(f"options: {name!r} must be a bool (True / False), got {value!r} "
                                   f"({type(value).__name__})")
        if not isinstance(self.tuning, tuning_.Tuning):
            raise OptionsError(f"options: 'tuning' must be a mla_compile.tuning.Tuning, got {type(self.tuning).__name__}")
        if not (isinstance(self.fuse_linears, str) and self.fuse_linears in WHERE):
            raise OptionsError(f"options: 'fuse_linears' must be one of {', '.join(WHERE)}, got {self.fuse_linears!r}")


BACKEND_OPTIONS = tuple(f.name for f in dataclasses.fields(BackendOptions))


def _inductor_config_keys() -> set[str]:
    return set(torch._inductor.config.get_config_copy().keys())


def parse_options(options: dict[str, Any] | None) -> tuple[BackendOptions, dict[str, Any]]:
    """Split `options` into our keys (type-checked) and Inductor config patches; a bad key or value raises
    OptionsError (a ValueError). Callable on its own, to validate options before the first compile."""
    if options is not None and not isinstance(options, Mapping):
        raise OptionsError(f"options: expected a dict, got {type(options).__name__}")
    try:
        tune, options = tuning_.from_options(options)
    except ValueError as e:
        raise OptionsError(str(e)) from None
    ours, inductor = {}, {}
    if tune != tuning_.DEFAULT:
        if isinstance(options.get("tuning"), tuning_.Tuning):
            raise OptionsError(f"options: give 'tuning' or its keys ({', '.join(tuning_.FIELDS)}), not both")
        ours["tuning"] = tune
    inductor_keys = _inductor_config_keys()
    for key, value in options.items():
        if key in BACKEND_OPTIONS:
            ours[key] = value
        elif key in inductor_keys:
            inductor[key] = value
        else:
            raise OptionsError(
                f"options: unknown key {key!r}. Valid keys: {', '.join(BACKEND_OPTIONS + tuning_.FIELDS)}, "
                f"or any torch._inductor.config key (e.g. 'triton.cudagraphs', 'max_autotune')")
    return BackendOptions(**ours), inductor


# Inductor settings this backend changes for CUDA graphs (a user's `options=` still overrides them).
# combo_kernels: data-independent small kernels share one launch. A decode step is ~90 kernels of a few us,
# each paying a launch gap inside the CUDA graph; HF DeepSeek-V3 (H 16, batch 8, 32K) on the H200: 95 -> 84
# kernels a step, 770 -> 736 us (benchmarks/RESULTS.md).
# triton.enable_pdl: Inductor's kernels use programmatic dependent launch (sm_90+), as ours do by default
# (kernels/_util.py, MLA_COMPILE_PDL): a kernel's launch overlaps its predecessor's tail; the same step 736 -> 716 us
# with both (benchmarks/RESULTS.md).
CUDA_INDUCTOR_DEFAULTS = {"combo_kernels": True, "triton.enable_pdl": True}


def _on_cuda(example_inputs) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in example_inputs)


def mode_config(mode: str | None) -> dict[str, Any]:
    modes = torch._inductor.list_mode_options()
    if mode is None:
        return {}
    if mode not in modes:
        raise ValueError(f"mode: unknown mode {mode!r}; valid: {', '.join(modes)}")
    return dict(modes[mode])


def build_pass_manager(opts: BackendOptions) -> PassManager:
    """The graph passes `opts` asks for, in order, on the Dynamo graph (where attention still has one form on every
    device; `rewrite_graph` runs them):

    mla_attention (rewrite_attention): HF MLA decode attention -> absorbed `mla.decode` / `mla.dcp_decode`
    (`passes/mla_attention.py`); sites it cannot prove equivalent are left unchanged and logged.
    fused_linear: bias-free linears over the same x -> one `mla.fused_linear` (`passes/fused_linear.py`).
    expert_gather (rewrite_experts): HF batched_mm experts' `bmm(W[ids], x[..., None])` -> `mla.expert_linear`, no
    per-(token, expert) weight copy (`passes/expert_gather.py`); sites it cannot prove are kept, counted, logged.
    grouped_mm (rewrite_experts): HF's grouped_mm fallback op (fp32 / fp16 experts under compile: a host loop that
    reads the group offsets on the host) -> `mla.expert_linear` with ids from the offsets (`passes/grouped_mm.py`).
    outer_product (always): matmuls with a contraction of length 1 -> broadcast multiplies (exact).
    split_argmax (always): argmax / argmin of a few long rows -> two-stage reductions (exact).

    Its uuid keys Inductor's caches (`PassManager.cache_key`). It also hashes our op modules and `layout.py`:
    composite ops (`mla::dcp_decode`, `mla::tp_dcp_decode`) are decomposed by AOTAutograd after the cache key is
    taken from the Dynamo graph, so an edit to their Python would otherwise keep serving a stale compiled graph."""
    from .passes import _fx, expert_gather, fused_linear, grouped_mm, mla_attention, outer_product, split_argmax

    fused = functools.partial(fused_linear.fuse_shared_input_linears, where=opts.fuse_linears)
    passes = [
        GraphPass("mla_attention", mla_attention.rewrite_mla_attention, mla_attention.SOURCES)
        if opts.rewrite_attention else None,
        GraphPass("fused_linear", fused, (fused_linear.__file__, _fx.__file__)),
        GraphPass("expert_gather", expert_gather.rewrite_expert_gathers, expert_gather.SOURCES)
        if opts.rewrite_experts else None,
        GraphPass("grouped_mm", grouped_mm.rewrite_grouped_mm_fallbacks, grouped_mm.SOURCES)
        if opts.rewrite_experts else None,
        GraphPass("outer_product", outer_product.matmuls_to_outer_products, (outer_product.__file__, _fx.__file__)),
        GraphPass("split_argmax", split_argmax.split_arg_reductions, (split_argmax.__file__, _fx.__file__)),
    ]
    return PassManager([p for p in passes if p is not None], sources=_op_sources(), key=repr(opts.tuning))


@functools.lru_cache(maxsize=None)
def _op_sources() -> tuple[str, ...]:
    here = Path(__file__).parent
    return tuple(sorted(str(p) for p in (here / "ops").glob("*.py"))) + (str(here / "layout.py"),)


def rewrite_graph(gm: torch.fx.GraphModule, example_inputs, opts: BackendOptions) -> torch.fx.GraphModule:
    """Our rewrites on the Dynamo graph: `build_pass_manager(opts)`'s passes, in order."""
    return build_pass_manager(opts)(gm)


def config_patches(opts: BackendOptions, mode: str | None, inductor_patches: dict[str, Any],
                   on_cuda: bool) -> dict[str, Any]:
    """Inductor config for one compile: our CUDA defaults, then the mode's settings, then the user's keys."""
    defaults = CUDA_INDUCTOR_DEFAULTS if on_cuda else {}
    return {**defaults, **mode_config(mode or opts.mode), **inductor_patches,
            "post_grad_custom_pre_pass": build_pass_manager(opts).cache_key()}


def _ours_to_drop_cudagraphs(patches: dict[str, Any], inductor_patches: dict[str, Any]) -> bool:
    """CUDA graphs are on and the user did not set `triton.cudagraphs` explicitly (theirs always wins)."""
    return bool(patches.get("triton.cudagraphs")) and "triton.cudagraphs" not in inductor_patches


def _prefill_without_cudagraphs(gm: torch.fx.GraphModule, patches: dict[str, Any],
                                inductor_patches: dict[str, Any]) -> None:
    """CUDA graphs for decode steps only (`passes/step_kind.py` says why): a graph that attends with several
    query tokens per request compiles without them, unless the user set `triton.cudagraphs` explicitly."""
    if not _ours_to_drop_cudagraphs(patches, inductor_patches):
        return
    from .passes.step_kind import multi_token_attention

    site = multi_token_attention(gm)
    if site is not None:
        patches["triton.cudagraphs"] = False
        log.info("mla_dcp: multi-token attention at %s (a prefill step): compiled without CUDA graphs", site)


def _cache_state_as_static_inputs(gm: torch.fx.GraphModule, patches: dict[str, Any]) -> None:
    """For a graph compiled with CUDA graphs: the cache-layer tensors it writes in place that HF could not mark static
    addresses (allocated while Dynamo traced: `passes/step_kind.CACHE_STATE_SOURCES` says why) marked as HF would,
    so Inductor captures the step instead of running it without CUDA graphs ("mutated inputs"). Unguarded: a new
    cache at another address makes the CUDA-graph trees record the step again, as a new HF cache would."""
    if not patches.get("triton.cudagraphs", torch._inductor.config.triton.cudagraphs):
        return
    from .passes.step_kind import unmarked_cache_state

    found = unmarked_cache_state(gm)
    for node, _ in found:
        node.meta.setdefault("tensor_dict", {})["_dynamo_static_input_type"] = "unguarded"
    if found:
        log.info("mla_dcp: %d cache tensor(s) written in place and not static addresses (allocated inside a compiled "
                 "call), marked static for CUDA graphs: %s", len(found), ", ".join(name for _, name in found))


def _step_counter_without_cudagraphs(gm: torch.fx.GraphModule, patches: dict[str, Any],
                                     inductor_patches: dict[str, Any]) -> dict[str, Any]:
    """`patches`, or a copy without CUDA graphs for a graph that reads an int advancing every decode step
    (`passes/step_kind.STEP_COUNTER_SOURCES` says why), unless the user set `triton.cudagraphs` explicitly."""
    if not _ours_to_drop_cudagraphs(patches, inductor_patches):
        return patches
    from .passes.step_kind import step_counter_input

    source = step_counter_input(gm)
    if source is None:
        return patches
    log.info("mla_dcp: the graph reads %s, an int that advances every decode step (a CUDA graph would be recorded "
             "per step): compiled without CUDA graphs", source)
    return {**patches, "triton.cudagraphs": False}


def mla_dcp(gm: torch.fx.GraphModule, example_inputs, *, mode: str | None = None,
            options: dict[str, Any] | None = None):
    """torch.compile backend: `torch.compile(model, backend="mla_dcp", mode=..., options=...)`."""
    from torch._inductor.compile_fx import compile_fx

    opts, inductor_patches = parse_options(options)
    if mode is not None and opts.mode is not None and mode != opts.mode:
        raise OptionsError(f"options: 'mode' ({opts.mode!r}) contradicts mode= ({mode!r})")
    patches = config_patches(opts, mode, inductor_patches, _on_cuda(example_inputs))
    _prefill_without_cudagraphs(gm, patches, inductor_patches)
    _cache_state_as_static_inputs(gm, patches)

    def compile_graph(gm, example_inputs):
        from .passes.fused_linear import compiling_for_cuda_graphs

        with tuning_.use(tuning_.within(opts.tuning)), compiling_for_cuda_graphs(
                patches.get("triton.cudagraphs", torch._inductor.config.triton.cudagraphs)):
            gm = rewrite_graph(gm, example_inputs, opts)
            # host-int bookkeeping (e.g. the DSA cache's max_kv_len += 1) stays out of the Inductor graph: no int input
            from .passes.host_ints import split_host_outputs

            gm, example_inputs, wrap = split_host_outputs(gm, example_inputs)
            compiled = compile_fx(gm, example_inputs, config_patches=_step_counter_without_cudagraphs(
                gm, patches, inductor_patches))
        return tuning_.bind(compiled if wrap is None else wrap(compiled), opts.tuning)

    if not opts.rewrite_attention:
        return compile_graph(gm, example_inputs)
    # eager float masks that cross a graph break: proven in the graph that builds them, checked where used
    from .passes import mask_origin

    return mask_origin.compile_tracking_masks(gm, example_inputs, compile_graph)
