"""Tiny HF MLA models (real MLA head dims, small everything else, random weights, nothing downloaded)."""

from __future__ import annotations

import contextlib
import functools

import torch

from mla_compile import models
from mla_compile.integrations.hf import cache_kwargs, create_masks_in_graph  # noqa: F401  (tests use M.create_masks_in_graph)

# the tests' models: mla_compile.models' builders at a short max_position_embeddings
deepseek_v3 = functools.partial(models.deepseek_v3, max_positions=512)
deepseek_v32 = functools.partial(models.deepseek_v32, max_positions=512)
glm_moe_dsa = functools.partial(models.glm_moe_dsa, max_positions=512)


def greedy(step, model, ids, attention_mask, cache, steps: int, *, prefill=None):
    """Prefill `ids` [B, T] (through `prefill`, default `step`), then `steps` greedy decode steps through
    `step` (the compiled or eager model). `attention_mask` [B, Lmax] is the 2D padding mask over the whole
    static cache (fixed shape: one decode graph). Returns (tokens [B, steps], last-position logits
    [B, steps, V])."""
    B, T = ids.shape
    prefill = step if prefill is None else prefill
    toks, logits = [], []
    with torch.no_grad():
        out = prefill(ids, attention_mask=attention_mask[:, :T], **cache_kwargs(prefill, cache),
                      cache_position=torch.arange(T, device=ids.device))
        tok = out.logits[:, -1].argmax(-1)
        for i in range(steps):
            toks.append(tok)
            out = step(tok[:, None], attention_mask=attention_mask, **cache_kwargs(step, cache),
                       cache_position=torch.tensor([T + i], device=ids.device))
            logits.append(out.logits[:, -1].float().clone())  # a CUDA-graph output is overwritten next step
            tok = out.logits[:, -1].argmax(-1)
    return torch.stack(toks, 1), torch.stack(logits, 1)


def forced(step, model, ids, attention_mask, cache, tokens):
    """Teacher-forced decode: prefill with `model`, then feed `tokens` [B, N] through `step`; logits [B, N, V].
    (bf16 comparisons: HF eager rounds probabilities to bf16, so free-running greedy paths may part at near-ties.)"""
    B, T = ids.shape
    logits = []
    with torch.no_grad():
        model(ids, attention_mask=attention_mask[:, :T], **cache_kwargs(model, cache),
              cache_position=torch.arange(T, device=ids.device))
        for i in range(tokens.shape[1]):
            out = step(tokens[:, i:i + 1], attention_mask=attention_mask, **cache_kwargs(step, cache),
                       cache_position=torch.tensor([T + i], device=ids.device))
            logits.append(out.logits[:, -1].float().clone())  # a CUDA-graph output is overwritten next step
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


def dcp_worker(rank: int, world: int, init_file: str, result_dir: str, cases: list) -> None:
    """One DCP rank (gloo, CPU) running every case of `cases` [(impl, steps, L, empty_row)] in one process group:
    single-rank eager HF reference vs (a) eager HF over the sharded cache and (b) torch.compile(backend="mla_dcp")
    over it. empty_row: request 1 is padding everywhere (mask row all 0). Writes case i's numbers to
    result_dir/rank{rank}_case{i}.pt."""
    import types

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        import mla_compile  # noqa: F401
        from mla_compile.integrations.hf import MLAPagedCache
        from transformers import StaticCache

        dcp = types.SimpleNamespace(size=world, rank=rank, group_name=dist.group.WORLD.group_name)
        for i, (impl, steps, L, empty_row) in enumerate(cases):
            torch._dynamo.reset()
            model = deepseek_v3(attn_impl=impl, num_layers=1)
            ids, mask = batch(L=L)
            if empty_row:
                mask[1] = 0
            ref_t, ref_l = greedy(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), steps)
            e_t, e_l = greedy(model, model, ids, mask, MLAPagedCache(model.config, L, page_size=4, dcp=dcp), steps)
            torch._dynamo.utils.counters.clear()
            compiled = torch.compile(model, backend="mla_dcp", fullgraph=True)
            c_t, c_l = greedy(compiled, model, ids, mask, MLAPagedCache(model.config, L, page_size=4, dcp=dcp), steps,
                              prefill=model)
            counters = dict(torch._dynamo.utils.counters["mla_compile"])
            torch.save(dict(ref_t=ref_t, ref_l=ref_l, e_t=e_t, e_l=e_l, c_t=c_t, c_l=c_l, counters=counters),
                       f"{result_dir}/rank{rank}_case{i}.pt")
    finally:
        dist.destroy_process_group()


def node_target(n) -> str:
    """A stable name for an FX node's target (for graph snapshots)."""
    if n.op == "call_method":
        return "." + n.target
    t = n.target
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(t)
    mod = getattr(t, "__module__", None) or ""
    return f"{mod}.{getattr(t, '__name__', str(t))}".lstrip(".")


def node_lines(nodes) -> str:
    """Graph nodes as stable text for snapshots: one line each, `%i = target(args) -> shape dtype`, nodes outside
    `nodes` (graph inputs, other regions) as `%in`."""
    import torch.fx as fx

    index = {n: i for i, n in enumerate(nodes)}

    def fmt(a):
        if isinstance(a, fx.Node):
            return f"%{index[a]}" if a in index else "%in"
        if isinstance(a, (list, tuple)):
            inner = ", ".join(fmt(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, float):
            return f"{a:.6g}"
        if isinstance(a, torch.dtype):
            return str(a).replace("torch.", "")
        return repr(a)

    lines = []
    for n in nodes:
        args = [fmt(a) for a in n.args] + [f"{k}={fmt(v)}" for k, v in n.kwargs.items() if k != "device"]
        v = n.meta.get("example_value")
        meta = ""
        if isinstance(v, torch.Tensor):
            meta = f" -> {list(v.shape)} {str(v.dtype).replace('torch.', '')}"
        elif isinstance(v, (tuple, list)):
            meta = " -> (" + ", ".join(str(list(x.shape)) for x in v if isinstance(x, torch.Tensor)) + ")"
        lines.append(f"%{index[n]} = {node_target(n)}({', '.join(args)}){meta}")
    return "\n".join(lines)


# ------------------------------------------------------------------- synthetic sites (no HF model: fast)
def mla_attention_site(q, latent, kpe, w, mask, *, impl="sdpa", cat=True, scale=0.07, between=None):
    """HF's expand_kv + attention, written out: latent [B,1,L,R], kpe [B,1,L,P], q [B,H,1,192], w the
    kv_b_proj weight [H*256, R]; eager adds `mask` to the scores, sdpa passes it as attn_mask. `between()` runs
    after the expansion read the latent and before the attention (to put writes in that window)."""
    B, _, L, _ = latent.shape
    kv = torch.nn.functional.linear(latent, w).view(B, L, -1, 256).transpose(1, 2)
    k_nope, v = torch.split(kv, [128, 128], dim=-1)
    k_rot = kpe.expand(-1, k_nope.shape[1], -1, -1)
    if cat:
        k = torch.cat([k_nope, k_rot], dim=-1)
    else:
        k = kv.new_empty(*kv.shape[:-1], 192)
        k[..., :128].copy_(k_nope)
        k[..., 128:].copy_(k_rot)
    if between is not None:
        between()
    if impl == "sdpa":
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s = torch.matmul(q, k.transpose(2, 3)) * scale
    if mask is not None:
        s = s + mask
    # HF's softmax runs in float32; float64 sites keep float64 (an exact reference)
    p = torch.softmax(s, dim=-1, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    return torch.matmul(p.to(q.dtype), v)


def synthetic_site_inputs(B=3, H=4, L=24, dtype=torch.float32, seed=0):
    """(q, latent, kpe, w, valid [B, 1, 1, L] bool with arbitrary holes, token 0 valid)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, 1, 192, generator=g, dtype=torch.float64).to(dtype)
    latent = torch.randn(B, 1, L, 512, generator=g, dtype=torch.float64).to(dtype)
    kpe = torch.randn(B, 1, L, 64, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(H * 256, 512, generator=g, dtype=torch.float64) / 512 ** 0.5).to(dtype)
    valid = torch.rand(B, 1, 1, L, generator=g) < 0.6  # arbitrary holes: exact through the token table
    valid[..., 0] = True
    return q, latent, kpe, w, valid


# ------------------------------------------------------------------------ generate(): masks in the graph
def step_masks(mask2d: torch.Tensor, position: int) -> torch.Tensor:
    """HF's decode mask for `position` as a user's 4-D bool mask [B, 1, 1, L]: causal & padding."""
    L = mask2d.shape[1]
    return (mask2d.bool() & (torch.arange(L) <= position))[:, None, None, :]


def fresh(model) -> None:
    """Forget every compiled graph and counter, and HF's own cached compiled call on `model` (generate() keeps
    it on the model), so the next generate() compiles anew and the counters count only it."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for attr in ("_compiled_call", "_last_compile_config"):
        if hasattr(model, attr):
            delattr(model, attr)


@contextlib.contextmanager
def constructions(cls):
    """Within the block, the class names of every `cls` (or subclass) instance constructed, in a list."""
    built, own = [], "__init__" in vars(cls)
    init = cls.__init__

    def counting(self, *args, **kwargs):
        built.append(type(self).__name__)
        init(self, *args, **kwargs)

    cls.__init__ = counting
    try:
        yield built
    finally:
        if own:
            cls.__init__ = init
        else:
            del cls.__init__
