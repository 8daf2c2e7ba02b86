"""Export the decode step, after our graph rewrites, to torch-dialect MLIR through torch-mlir's FX importer.

    text = mla_compile.mlir.export_mlir(model_or_fn, example_args, example_kwargs)

Pipeline (each step is the one the `mla_dcp` backend uses, so the exported graph is the graph we compile):

1. Dynamo captures `model_or_fn(*example_args, **example_kwargs)` as ONE graph (`fullgraph=True`); the
   capture never runs the model, so caches passed in are not advanced.
2. `backend.rewrite_graph` rewrites it (HF MLA attention -> `mla.decode` / `mla.dcp_decode`, ...).
3. `torch.export` (non-strict) traces the rewritten graph to ATen, with auto-functionalization **v1**
   (`torch._export.config.enable_auto_functionalized_v2_for_export=False`): torch-mlir imports
   `auto_functionalized` but not `auto_functionalized_v2`; then torch-mlir's decomposition table runs (the
   backend has no ATen-level passes: all of `backend.build_pass_manager`'s run in step 2).
4. `FxImporter.import_program` imports it with mutation support: a mutated input (the paged latent cache
   written by `mla.cache_write`) becomes a `!torch.tensor` argument; the write is
   `torch.operator "torch.mla.cache_write"` returning the new cache values, followed by
   `torch.overwrite.tensor.contents ... overwrites %argN`, and later readers use the written values.

Why not `decomposition_table=[]` (torch-mlir's `export_and_import`)? The graph then stays non-functional
and the importer turns `mla.cache_write` into a result-less op on value tensors: the write silently
disappears. `export_mlir` always functionalizes, and the tests check the overwrite is there.

Our custom ops come out as `torch.operator "torch.mla.decode"(...)` etc. (torch-mlir has no lowering for
them; a downstream compiler maps them to its own kernels).
"""

from __future__ import annotations

import inspect
import re
import types
import warnings
from typing import Any, Callable

import torch

from . import ops  # noqa: F401  (registers torch.ops.mla / torch.ops.dsa)
from .integrations.hf import cache_kwargs

INSTALL_HINT = "pip install 'mla-compile[mlir]'  (or: pip install torch-mlir, which does not pull a torch)"

WEIGHTS_MODES = ("arguments", "constants")


def _torch_mlir():
    """Import torch-mlir's FX importer pieces, or say exactly what to install."""
    try:
        from torch_mlir import ir
        from torch_mlir.dialects import torch as torch_d
        from torch_mlir.extras.fx_decomp_util import get_decomposition_table
        from torch_mlir.extras.fx_importer import FxImporter
    except ImportError as e:
        raise ImportError(f"mla_compile.mlir needs torch-mlir (its FX importer): {INSTALL_HINT}. "
                          f"Import failed with: {e}") from e
    return ir, torch_d, FxImporter, get_decomposition_table


def is_available() -> bool:
    try:
        _torch_mlir()
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------------------ 1. Dynamo capture
class _Captured(Exception):
    """Raised from the captured graph's callable so the model never runs during export."""


def _fresh_entry(target: Callable) -> Callable:
    """A one-off top-level function around `target` with its OWN code object: Dynamo's compiled entry hangs
    on that code object and dies with it, so repeated exports neither hit the recompile limit nor touch
    the caches of the user's own `torch.compile` of the same model."""

    def entry(*args, **kwargs):
        return target(*args, **kwargs)

    return types.FunctionType(entry.__code__.replace(), entry.__globals__, "mla_compile_export",
                              entry.__defaults__, entry.__closure__)


def capture_graph(model_or_fn: Callable, example_args: tuple, example_kwargs: dict | None = None):
    """Dynamo graph of one call: (GraphModule, example inputs, placeholder sources) without running it."""
    state: dict[str, Any] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs):
        state["gm"], state["inputs"] = gm, list(example_inputs)

        def never_run(*_args):
            raise _Captured

        return never_run

    fn = torch.compile(_fresh_entry(model_or_fn), backend=backend, fullgraph=True, dynamic=False)
    try:
        with torch.no_grad():
            fn(*example_args, **(example_kwargs or {}))
    except _Captured:
        pass
    except torch._dynamo.exc.Unsupported as e:
        raise RuntimeError(f"export_mlir needs the step to trace as one graph (fullgraph=True); Dynamo "
                           f"broke the graph: {e}") from e
    if "gm" not in state:
        raise RuntimeError("export_mlir: Dynamo produced no graph (the step ran no tensor code?)")
    return state["gm"], state["inputs"]


# ------------------------------------------------------------------------------------- 2/3. rewrite + export
def _positional_names(model_or_fn) -> list[str]:
    fn = model_or_fn.forward if isinstance(model_or_fn, torch.nn.Module) else model_or_fn
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _clean_name(name: str, positional: list[str]) -> str:
    """Dynamo placeholder names (`l_args_4_`, `l_kwargs_past_key_values_layers_0_keys`) -> readable ones
    (`ckv_cache`, `cache_layers_0_keys`: HF's cache argument reads `cache` whatever the transformers
    version calls it, `past_key_values` before 5.24)."""
    name = re.sub(r"_$", "", re.sub(r"^l_", "", name))
    m = re.match(r"^args_(\d+)(.*)$", name)
    if m:
        i = int(m.group(1))
        name = (positional[i] if i < len(positional) else f"arg{i}") + m.group(2)
    name = re.sub(r"^kwargs_", "", name)
    name = re.sub(r"^past_key_values_", "cache_", name)
    name = re.sub(r"\W", "_", name) or "arg"
    return name if name[0].isalpha() or name[0] == "_" else f"arg_{name}"


def _weight_names(model_or_fn) -> dict[int, str]:
    if not isinstance(model_or_fn, torch.nn.Module):
        return {}
    names = {id(t): n for n, t in model_or_fn.named_buffers()}
    names.update({id(p): n for n, p in model_or_fn.named_parameters()})
    return names


def _prepare_module(gm: torch.fx.GraphModule, inputs: list, weight_names: dict[int, str], weights: str,
                    positional: list[str]):
    """Rename and order placeholders; with weights='constants', turn weight placeholders into attributes of
    `gm` (export lifts them as parameters/buffers, which torch-mlir imports as literals). Returns (module,
    user args, argument names)."""
    kept, used = [], set()  # (sort key, node, example value, display name) of the function arguments
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise RuntimeError(f"export_mlir: graph has {len(placeholders)} inputs but {len(inputs)} examples")
    for k, (node, value) in enumerate(zip(placeholders, inputs)):
        fqn = weight_names.get(id(value)) if isinstance(value, torch.Tensor) else None
        if fqn is not None and weights == "constants":
            attr = re.sub(r"\W", "_", fqn)
            if isinstance(value, torch.nn.Parameter):
                gm.register_parameter(attr, value)
            else:
                gm.register_buffer(attr, value)
            with gm.graph.inserting_before(node):
                get = gm.graph.get_attr(attr)
            get.meta = dict(node.meta)
            node.replace_all_uses_with(get)
            gm.graph.erase_node(node)
            continue
        m = re.match(r"^l_args_(\d+)_", node.name)
        # argument order: the call's positional args, then its kwargs, then weights (Dynamo orders by use)
        key = (0, int(m.group(1)), k) if m else (1, 0, k) if fqn is None else (2, 0, k)
        base = re.sub(r"\W", "_", fqn) if fqn is not None else _clean_name(node.name, positional)
        name, i = base, 1
        while name in used:
            name, i = f"{base}_{i}", i + 1
        used.add(name)
        node.name = node.target = name
        kept.append((key, node, value, fqn or name))
    kept.sort(key=lambda t: t[0])
    first_op = next((n for n in gm.graph.nodes if n.op != "placeholder"), None)
    for _, node, _, _ in kept:
        if first_op is not None:
            first_op.prepend(node)
    user_args = [v for _, _, v, _ in kept]
    arg_names = [n for _, _, _, n in kept]
    gm.graph.lint()
    gm.recompile()
    return gm, user_args, arg_names


def export_program(model_or_fn: Callable, example_args: tuple, example_kwargs: dict | None = None, *,
                   rewrite: bool = True, options: dict | None = None, weights: str = "arguments",
                   decompose: bool = True):
    """The ExportedProgram `export_mlir` imports (ATen, functional, auto_functionalized v1), and the names of
    its user inputs. Useful to inspect the graph without torch-mlir."""
    from . import backend

    if weights not in WEIGHTS_MODES:
        raise ValueError(f"weights: expected one of {WEIGHTS_MODES}, got {weights!r}")
    example_args = tuple(example_args) if isinstance(example_args, (tuple, list)) else (example_args,)
    opts, _ = backend.parse_options(options)
    gm, inputs = capture_graph(model_or_fn, example_args, example_kwargs)
    if rewrite:
        gm = backend.rewrite_graph(gm, inputs, opts)
    module, user_args, arg_names = _prepare_module(gm, inputs, _weight_names(model_or_fn), weights,
                                                   _positional_names(model_or_fn))
    with torch._export.config.patch(enable_auto_functionalized_v2_for_export=False), torch.no_grad(), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)  # torch's own pytree
        ep = torch.export.export(module, tuple(user_args), strict=False)
        if decompose:
            table = _torch_mlir()[3]() if is_available() else torch.export.default_decompositions()
            ep = ep.run_decompositions(table)
    return ep, arg_names


# ---------------------------------------------------------------------------------------------- 4. import
def export_mlir(model_or_fn: Callable, example_args, example_kwargs: dict | None = None, *,
                rewrite: bool = True, options: dict | None = None, weights: str = "arguments",
                func_name: str = "main", annotate: bool = True) -> str:
    """Torch-dialect MLIR (text) of one call of `model_or_fn`, after our graph rewrites.

    model_or_fn: an `nn.Module` (e.g. HF `DeepseekV3ForCausalLM`) or a function; example_args /
    example_kwargs: one decode step's inputs (a cache object is fine: its tensors become arguments; it is
    not advanced). rewrite: run `mla_compile.backend.rewrite_graph` first.
    options: the backend's `options=` keys. weights: "arguments" (parameters/buffers become function
    arguments: small text) or "constants" (embedded as `dense_resource` literals). annotate: prefix a
    `//` comment per function argument naming the Python input it binds (`%arg3 = ckv_cache (mutated)`).

    Our ops appear as `torch.operator "torch.mla.decode"` etc.; an in-place `mla.cache_write` appears as a
    value-returning op plus `torch.overwrite.tensor.contents` into the mutable `!torch.tensor` argument.
    Raises ImportError naming the pip command when torch-mlir is missing.
    """
    ir, torch_d, FxImporter, _ = _torch_mlir()
    ep, arg_names = export_program(model_or_fn, example_args, example_kwargs, rewrite=rewrite,
                                   options=options, weights=weights)
    context = ir.Context()
    torch_d.register_dialect(context)
    importer = FxImporter(context=context)
    importer.import_program(ep, func_name=func_name)
    text = str(importer.module)
    if not annotate:
        return text
    mutated = set(ep.graph_signature.user_inputs_to_mutate.values())
    user_inputs = ep.graph_signature.user_inputs
    lines = [f"// mla_compile.export_mlir: @{func_name} arguments"]
    for i, (placeholder, name) in enumerate(zip(user_inputs, arg_names)):
        lines.append(f"//   %arg{i} = {name}" + ("  (mutated in place)" if placeholder in mutated else ""))
    return "\n".join(lines) + "\n" + text


_RESOURCE_RE = re.compile(r"\{-#\s*dialect_resources:.*?#-\}", re.S)


def normalize_mlir(text: str) -> str:
    """Stable form for snapshots: no locations, no embedded weight blobs, no trailing spaces."""
    text = _RESOURCE_RE.sub("{-# dialect_resources: <elided> #-}", text)
    text = re.sub(r"\s*loc\((?:[^()]|\([^()]*\))*\)", "", text)
    text = re.sub(r"#loc\d*\s*=.*\n", "", text)
    return "\n".join(line.rstrip() for line in text.splitlines()).strip() + "\n"


_SSA_RE = re.compile(r"%[A-Za-z0-9_.$-]+")


def summarize_mlir(text: str, keep=(r"torch\.operator", r"torch\.copy\.to_vtensor", r"torch\.overwrite\.tensor\.contents", r"func\.func",
                                   r"^\s*return", r"^//")) -> str:
    """The lines a reader (and a snapshot) cares about: argument comments, the signature, our ops, cache
    overwrites and the return; SSA names renumbered by first appearance (%0, %1, ...) so the summary is stable
    when unrelated ops upstream change, while still showing which value feeds which op."""
    pat = re.compile("|".join(keep))
    names: dict[str, str] = {}

    def rename(m):
        name = m.group(0)
        if re.fullmatch(r"%arg\d+", name):
            return name
        base, _, sub = name.partition("#")
        if base not in names:
            names[base] = f"%{len(names)}"
        return names[base] + (f"#{sub}" if sub else "")

    out = [_SSA_RE.sub(rename, line) for line in normalize_mlir(text).splitlines() if pat.search(line)]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------- built-in examples
def example_op_step(batch: int = 2, heads: int = 4, kv_lora_rank: int = 8, rope_dim: int = 4,
                    page_size: int = 4, pages_per_req: int = 2, dtype: torch.dtype = torch.float32):
    """The op-level decode step (write the new token's latent, then absorbed-MLA decode) and inputs."""

    def decode_step(q_nope, q_pe, ckv, kpe, ckv_cache, kpe_cache, block_table, seq_lens, slots):
        torch.ops.mla.cache_write(ckv_cache, kpe_cache, ckv, kpe, slots)
        return torch.ops.mla.decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, 0.25)

    g = torch.Generator().manual_seed(0)
    B, H, R, P, PS, MP = batch, heads, kv_lora_rank, rope_dim, page_size, pages_per_req
    num_pages = B * MP
    block_table = torch.randperm(num_pages, generator=g).to(torch.int32).view(B, MP)
    seq_lens = torch.randint(1, MP * PS + 1, (B,), generator=g).to(torch.int32)
    pos = seq_lens.long() - 1
    slots = block_table.long()[torch.arange(B), pos // PS] * PS + pos % PS
    args = (torch.randn(B, H, R, generator=g).to(dtype), torch.randn(B, H, P, generator=g).to(dtype),
            torch.randn(B, R, generator=g).to(dtype), torch.randn(B, P, generator=g).to(dtype),
            torch.randn(num_pages, PS, R, generator=g).to(dtype), torch.randn(num_pages, PS, P, generator=g).to(dtype),
            block_table, seq_lens, slots)
    return decode_step, args


def example_hf_step(*, attn_implementation: str = "sdpa", batch: int = 2, prefix: int = 5, max_cache_len: int = 8,
                    seed: int = 0):
    """A one-layer HF DeepseekV3 decode step from a tiny config (random weights, nothing downloaded):
    (model, args, kwargs) with HF's own `StaticCache` already holding `prefix` tokens (the cache the pass
    rewrites; its in-place update is exported as `torch.overwrite.tensor.contents`)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, StaticCache

    cfg = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=64)
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    cache = StaticCache(config=cfg, max_cache_len=max_cache_len)
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (batch, prefix), generator=g), **cache_kwargs(model, cache),
              use_cache=True)
    next_ids = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g)
    return model, (next_ids,), {**cache_kwargs(model, cache), "use_cache": True,
                                "cache_position": torch.tensor([prefix])}


def main(argv: list[str] | None = None) -> int:
    """`python -m mla_compile export-mlir [--example op|hf] [--no-rewrite] [-o FILE]`."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m mla_compile export-mlir",
                                description="Print (or write) the torch-dialect MLIR of a built-in decode step.")
    p.add_argument("--example", choices=("op", "hf"), default="op",
                   help="op: mla.cache_write + mla.decode; hf: one-layer HF DeepseekV3 decode step (tiny config)")
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="HF attn_implementation (--example hf)")
    p.add_argument("--no-rewrite", action="store_true", help="skip our graph rewrites")
    p.add_argument("--weights", choices=WEIGHTS_MODES, default="arguments")
    p.add_argument("-o", "--output", help="write to this file instead of stdout")
    a = p.parse_args(argv)
    try:
        _torch_mlir()
    except ImportError as e:
        print(f"error: {e}")
        return 1
    if a.example == "op":
        fn, args = example_op_step()
        text = export_mlir(fn, args, rewrite=not a.no_rewrite, weights=a.weights)
    else:
        model, args, kwargs = example_hf_step(attn_implementation=a.attn)
        text = export_mlir(model, args, kwargs, rewrite=not a.no_rewrite, weights=a.weights)
    if a.output:
        with open(a.output, "w") as f:
            f.write(text)
        print(f"wrote {a.output} ({len(text.splitlines())} lines)")
    else:
        print(text, end="")
    return 0
