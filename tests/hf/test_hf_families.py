"""Coverage matrix: every MLA model family in the installed transformers, compiled decode vs eager HF.

A family is a model type whose config (or, for multimodal models, text config) has `kv_lora_rank`; the list is
discovered from `CONFIG_MAPPING_NAMES`, so a new MLA family in a later transformers shows up here untested-as-
failing rather than missing. Each is built tiny (FAMILIES below: 2 layers, hidden 64, 4 heads, the real MLA
dims kv_lora 512 / rope 64 / nope 128 / v 128, q_lora 96, vocab 128, random weights), fp32, batch 2 with row
1 left-padded, prefilled eagerly into a static cache (`DSAStaticCache` for DSA families: config has
`index_topk`), then decoded a few steps by `torch.compile(model, backend="mla_dcp")` and by eager HF. DSA
families get `index_topk` = prompt + 1, so decode crosses it: the dense graph runs, then the sparse one.

Asserted per family x attention implementation (sdpa / eager, where HF supports them):
- every MLA site of every decode graph is either rewritten or counted as not rewritten (a site neither is a
  silent skip),
- all of them are rewritten, logits within 1e-4 (relative) of eager and tokens equal,
- DSA: exactly the two graphs, dense (index mask dropped) and sparse (`mla.sparse_decode`).
Families that do not pass yet are strict xfails carrying the measured reason (KNOWN, empty now): a fix flips
the xfail into a failure that says to remove the mark. A family may run under a Dynamo config (DYNAMO, with why)
or keep HF's indexer (HF_INDEXER: then no dense drop / sparse op, its top-k mask is the token table).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":  # run as the README table's generator: the tests' helpers live in tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_models as M  # noqa: E402
import mla_compile  # noqa: E402, F401
from mla_compile import models  # noqa: E402
from mla_compile.backend import mla_dcp  # noqa: E402
from mla_compile.passes import mla_attention  # noqa: E402

transformers = pytest.importorskip("transformers")
from transformers import StaticCache  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from mla_compile.integrations.hf import DSAStaticCache, cache_kwargs  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

COUNTERS = torch._dynamo.utils.counters
TOL = 1e-4
LAYERS = 2
PROMPT = 5
STEPS = 3  # DSA: kv_len 6 (dense, = topk), 7, 8 (sparse)
TOPK = PROMPT + 1

# the families transformers 5.24 has (the test discovers them; this list only names what a skip means)
EXPECTED_FAMILIES = ("axk1", "axk2", "bailing_hybrid", "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots3_note",
                     "glm4_moe_lite", "glm5_next", "glm_moe_dsa", "hy_v4", "hy_v4_vl", "kimi_linear", "longcat_flash",
                     "minicpm3", "mistral4", "mistral_large4", "sarvam_mla", "youtu")

# every family: the fields its config has of these (MoE small and after the last layer: the router is
# irrelevant to attention and slow on CPU; 64 indexer heads: exact index-score ties are then practically
# impossible, see tests/hf/test_hf_dsa_graphs.py dsa_model)
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=LAYERS,
            num_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
            pad_token_id=0, bos_token_id=0, eos_token_id=None, tie_word_embeddings=False,
            q_lora_rank=96, **models.MLA_DIMS,
            n_routed_experts=4, num_experts=4, num_experts_per_tok=2, num_experts_per_token=2, n_group=1,
            topk_group=1, num_expert_group=1, first_k_dense_replace=LAYERS, expert_ffn_hidden_size=32,
            zero_expert_num=2, moe_topk=2, shared_experts_intermediate_size=32,
            index_topk=TOPK, index_n_heads=64, index_head_dim=128, linear_num_heads=4, linear_head_dim=32,
            per_layer_config={})

# per family, on top of BASE and of every per-layer list cut to LAYERS entries (MLP layers dense)
FAMILIES = {
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention"]),  # hybrid: one MLA layer
    "bailing_hybrid": dict(layer_types=["linear_attention", "full_attention"]),
    # its DSA layers are rope-less (P = 0, HF validates it); topk % kpool == 0
    # DSA_LAYER: the family's own name for its DSA layers (5.24 "indexed_attention", 5.17 "deepseek_sparse_attention")
    "glm5_next": dict(layer_types=["linear_attention", "DSA_LAYER"], qk_rope_head_dim=0, index_kpool=2),
    "dots3_note": dict(layer_types=["indexed_attention", "indexed_attention"]),  # uniform layers (no per-layer dims)
}

# extra cases of a family: "family:variant" -> overrides on top of the family's
VARIANTS = {
    "mistral_large4:no_rope": dict(no_rope_layers=[1, 0]),  # layer 1 rope-less (P = 0), as every 4th real layer
    # a sliding-window MLA layer whose window (4) the decode kv lengths (6..8) exceed
    "dots3_note:sliding": dict(layer_types=["indexed_attention", "sliding_attention"], sliding_window=4, head_dim=192),
}

# per family, the Dynamo config its decode needs to be one graph per step. glm5_next's kpool indexer selects pools
# with a data-dependent shape (`pool_keys[:, keep]`, a nonzero) between HF's kv expansion and the attention: by
# default Dynamo breaks the graph there and K / V reach the attention as graph inputs (counted not rewritten, with
# this fix in the WARNING; tests/passes/test_graph_breaks.py); traced, the step is one graph per DSA regime
DYNAMO = {"glm5_next": dict(capture_dynamic_output_shape_ops=True)}

# DSA families whose indexer is not HF's per-token DeepseekV32 one (what dsa.indexer_topk computes): the indexer
# stays HF's in both graphs and its top-k mask (any bool mask) becomes mla.decode's token table, exact
HF_INDEXER = {"glm5_next": "kpool indexer: pooled keys scored per pool, selected pools + the visible tail"}

# README's table notes (what a family needs or takes that others do not)
NOTES = {"longcat_flash": "eager: its MoE loop's graph breaks bring the eager mask in as a graph input, proven in the "
                          "graph that built it and checked per call (mla_compile/passes/mask_origin.py)"}



def caches_expanded_kv(family: str) -> bool:
    """The installed family's MLA attention expands the latent (`expand_kv`) BEFORE `cache.update`, i.e. its cache
    holds per-head K / V (transformers 5.17's DSA families): no latent anywhere to attend over. Read from the code."""
    try:
        mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        return False
    for cls in vars(mod).values():
        if isinstance(cls, type) and hasattr(cls, "expand_kv") and cls.__module__ == mod.__name__:
            src = inspect.getsource(cls.forward)
            if "expand_kv(" in src and ".update(" in src and src.index("expand_kv(") < src.index(".update("):
                return True
    return False


_PER_HEAD = ("transformers {v}'s {f} caches per-head K / V (expand_kv runs before cache.update): no latent in the "
             "cache to attend over; K is a graph input, every site counted not rewritten (exact)")
# (case, impl) -> the measured reason it does not pass (strict xfail)
KNOWN: dict = {(case, impl): _PER_HEAD.format(v=transformers.__version__, f=case)
               for case in EXPECTED_FAMILIES for impl in ("sdpa", "eager") if caches_expanded_kv(case)}


# the CI subset (cases, or "case-impl" ids), ~2 minutes on 2 CPU cores: every dense family with a quick build,
# hybrids, one DSA family (the others' DSA path is tests/hf/test_hf_dsa_graphs.py's too), P = 0 layers and
# attention sinks (hy_v4, eager: a DSA family whose indexer folds its scale into the weights). The rest (~2.5 more
# minutes: bigger DSA families, graph-break-heavy ones) is `-m slow`. deepseek_v32 runs eager only: its sdpa case
# (DSAStaticCache, both graphs, tokens, logits, rewrite counts) is test_hf_dsa_graphs' v32-sdpa-static.
CI = {"deepseek_v2", "deepseek_v3", "sarvam_mla", "youtu", "glm4_moe_lite", "mistral4", "minicpm3", "kimi_linear",
      "bailing_hybrid", "axk1", "deepseek_v32-eager", "hy_v4-eager", "mistral_large4:no_rope-sdpa"}


def _has_mla(config_cls) -> bool:
    return "kv_lora_rank" in inspect.signature(config_cls.__init__).parameters or hasattr(config_cls, "kv_lora_rank")


def text_config_class(model_type: str):
    """(config class with kv_lora_rank, is_text_sub_config) for `model_type`, or (None, False)."""
    cls = CONFIG_MAPPING[model_type]
    if _has_mla(cls):
        return cls, False
    sub = (getattr(cls, "sub_configs", None) or {}).get("text_config")
    if sub is not None and _has_mla(sub):
        return sub, True
    return None, False


def mla_families() -> list[str]:
    """Model types of the installed transformers with an MLA (text) config; a multimodal family's own text
    config type (e.g. dots3_note_text) is that family, not another one."""
    found, text_types = [], set()
    for model_type in CONFIG_MAPPING_NAMES:
        try:
            cls, is_sub = text_config_class(model_type)
        except (ImportError, AttributeError, KeyError):  # a family whose optional deps are missing
            continue
        if cls is not None:
            found.append(model_type)
            if is_sub:
                text_types.add(cls.model_type)
    return [f for f in found if f not in text_types]


class TextCausalLM(torch.nn.Module):
    """A multimodal family's text decoder + LM head (its ForConditionalGeneration would also build the vision
    tower; text-only decode runs exactly these modules)."""

    def __init__(self, text_model_cls, config):
        super().__init__()
        self.config = config
        self.model = text_model_cls(config)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, cache=None, cache_position=None):
        h = self.model(input_ids=input_ids, attention_mask=attention_mask, cache_position=cache_position,
                       use_cache=True, **cache_kwargs(self.model, cache)).last_hidden_state
        return transformers.modeling_outputs.CausalLMOutputWithPast(logits=self.lm_head(h))


def _model_class(family: str, config_cls):
    """The causal LM for `family`'s text config: `<X>ForCausalLM` of the family's module whose config class is
    it, else `<X>TextModel` under TextCausalLM."""
    auto = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(family)  # e.g. sarvam_mla -> DeepseekV3ForCausalLM
    if auto is not None and CONFIG_MAPPING[family] is config_cls:
        return getattr(transformers, auto), False
    mod = importlib.import_module(f"transformers.models.{family}")
    for suffix in ("ForCausalLM", "TextModel"):
        for name in dir(mod):
            cls = getattr(mod, name)
            if name.endswith(suffix) and getattr(cls, "config_class", None) is config_cls:
                return cls, suffix == "TextModel"
    raise LookupError(f"{family}: no ForCausalLM / TextModel for {config_cls.__name__}")


def tiny_config(case: str, impl: str):
    family = case.split(":")[0]
    config_cls, _ = text_config_class(family)
    default = config_cls().to_dict()
    layers0 = default.get("num_hidden_layers", default.get("num_layers"))
    kw = {k: v for k, v in BASE.items() if k in default}
    for k, v in default.items():
        if isinstance(v, list) and len(v) == layers0 and k not in kw:
            kw[k] = ["dense"] * LAYERS if k == "mlp_layer_types" else v[:LAYERS]
    kw.update(FAMILIES.get(family, {}))
    kw.update(VARIANTS.get(case, {}))
    if "DSA_LAYER" in kw.get("layer_types", ()):
        dsa = sorted({t for t in default.get("layer_types") or () if t not in ("linear_attention", "full_attention")})
        if len(dsa) != 1:
            raise LookupError(f"{family}: no single DSA layer type among its defaults {default.get('layer_types')}")
        kw["layer_types"] = [dsa[0] if t == "DSA_LAYER" else t for t in kw["layer_types"]]
    return config_cls(attn_implementation=impl, **kw)


def tiny_model(case: str, impl: str, seed: int = 0):
    """`case`: a family, or "family:variant" (VARIANTS)."""
    config = tiny_config(case, impl)
    cls, text_only = _model_class(case.split(":")[0], type(config))
    model = TextCausalLM(cls, config) if text_only else cls(config)
    return models.spread_weights(model, seed, torch.float32)


def impls(case: str) -> list[str]:
    family = case.split(":")[0]
    config_cls, _ = text_config_class(family)
    cls, _ = _model_class(family, config_cls)
    return ["sdpa", "eager"] if cls._supports_sdpa else ["eager"]


def mla_layers(model) -> int:
    """MLA attention modules: those with the latent up-projection (hybrids' linear-attention layers have none)."""
    return sum(hasattr(m, "kv_b_proj") for m in model.modules())


def _cases():
    found = set()
    try:
        found = set(mla_families())
    except Exception as e:  # noqa: BLE001 (an older transformers' registry: report, don't crash collection)
        return [pytest.param("?", "?", marks=pytest.mark.skip(reason=f"family discovery failed: {e!r}"))]
    cases = []
    for family in sorted(found | set(EXPECTED_FAMILIES)):
        if family not in found:
            cases.append(pytest.param(family, "-", id=f"{family}-missing", marks=pytest.mark.skip(
                reason=f"{family} not in transformers {transformers.__version__}")))
            continue
        for case in [family] + [v for v in VARIANTS if v.split(":")[0] == family]:
            for impl in impls(case):
                marks = [pytest.mark.xfail(strict=True, reason=KNOWN[case, impl])] if (case, impl) in KNOWN else []
                if case not in CI and f"{case}-{impl}" not in CI:
                    marks.append(pytest.mark.slow)
                cases.append(pytest.param(case, impl, id=f"{case}-{impl}", marks=marks))
    return cases


class SiteCounter:
    """mla_dcp, first counting the MLA sites of each Dynamo graph it is handed (before the pass changes it):
    one `kv_b_proj` linear (HF's latent up-projection, expand_kv) per MLA attention. An independent count of
    what the pass should have rewritten or counted as not rewritten."""

    def __init__(self):
        self.sites = 0

    def __call__(self, gm, example_inputs):
        for n in gm.graph.nodes:
            stack = n.meta.get("nn_module_stack") or {}
            innermost = next(reversed(stack.values()), ("", None))[0] if stack else ""
            if n.op == "call_function" and n.target is torch._C._nn.linear and innermost.endswith("kv_b_proj"):
                self.sites += 1
        return mla_dcp(gm, example_inputs)


def run_family(case: str, impl: str) -> dict:
    model = tiny_model(case, impl)
    dsa = "index_topk" in model.config.to_dict()
    L = PROMPT + STEPS + 1
    ids, mask = M.batch(T=PROMPT, L=L, vocab=model.config.vocab_size)

    def cache():
        return DSAStaticCache(model.config, L) if dsa else StaticCache(config=model.config, max_cache_len=L)

    ref_t, ref_l = M.greedy(model, model, ids, mask, cache(), STEPS)
    backend = SiteCounter()
    compiled = torch.compile(model, backend=backend, fullgraph=False)
    with torch._dynamo.config.patch(**DYNAMO.get(case.split(":")[0], {})):
        t, logits = M.greedy(compiled, model, ids, mask, cache(), STEPS, prefill=model)
    c = COUNTERS["mla_compile"]
    return dict(dsa=dsa, layers=mla_layers(model), sites=backend.sites, graphs=2 if dsa else 1, tokens=t, ref_tokens=ref_t,
                err=M.rel_err(logits, ref_l), rewritten=c[mla_attention.COUNTER],
                not_rewritten=c[mla_attention.SKIP_COUNTER], dropped=c["dsa_index_mask_dropped"],
                sparse=c["dsa_sparse_rewritten"], unique_graphs=COUNTERS["stats"]["unique_graphs"])


# hybrids: MLA layers beside linear-attention ones (whose 2-D mask generate()'s mask helper must not pad)
HYBRIDS = ("kimi_linear", "bailing_hybrid")


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_generate_through_optimize_generate_equals_eager(family):
    """The README's generate() recipe on a hybrid family: `optimize_generate` installs `create_masks_in_graph`,
    which pads the 2-D mask to the cache's length; a linear-attention layer's mask is the trailing positions of the
    mask it is given, so a padded prefill mask zeroed the prompt for it and generate() went off from the first
    token. Greedy tokens now equal eager generate()'s (fp32), and the MLA layer is rewritten."""
    from mla_compile.integrations.hf import optimize_generate

    model = tiny_model(family, "sdpa").eval()
    ids, mask = M.batch(T=PROMPT, L=PROMPT, vocab=model.config.vocab_size)
    kw = dict(max_new_tokens=STEPS + 1, min_new_tokens=STEPS + 1, do_sample=False, pad_token_id=0)

    def cache():
        return cache_kwargs(model, StaticCache(config=model.config, max_cache_len=PROMPT + STEPS + 1))

    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, disable_compile=True, **cache(), **kw)
    M.fresh(model)
    optimize_generate(model, mode=None)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **cache(), **kw)
    assert torch.equal(out, ref)
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == mla_layers(model)


def test_sliding_window_generate_keeps_a_graph_per_window_state(monkeypatch):
    """generate() through `optimize_generate` on a family with sliding-window MLA layers (dots3_note): HF's sliding
    cache layer counts its tokens in a Python int the mask sizes read, and under generate()'s dynamic=False every
    decode step compiled a graph of its own (11 for 12 new tokens; past the recompile limit HF's attention would run
    eagerly). With that count symbolic: one graph per window state (filling, full) and DSA graph (dense, sparse), every
    site rewritten, greedy tokens equal eager generate()'s."""
    from mla_compile.integrations.hf import optimize_generate

    case, new = "dots3_note:sliding", 12
    monkeypatch.setitem(VARIANTS, case, {**VARIANTS[case], "sliding_window": 8})  # fills during the decode
    monkeypatch.setattr(torch.compiler.config, "dynamic_sources", torch.compiler.config.dynamic_sources)
    model = tiny_model(case, "sdpa").eval()
    ids, mask = M.batch(T=PROMPT, L=PROMPT, vocab=model.config.vocab_size)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    def cache():
        return cache_kwargs(model, DSAStaticCache(model.config, PROMPT + new))

    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, disable_compile=True, **cache(), **kw)
    M.fresh(model)
    optimize_generate(model, mode=None)
    flagged = _spy_cuda_graph_choice(monkeypatch)
    with torch._dynamo.config.patch(**DYNAMO.get("dots3_note", {})), torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **cache(), **kw)
    assert torch.equal(out, ref)
    c, layers = COUNTERS["mla_compile"], mla_layers(model)
    assert c[mla_attention.SKIP_COUNTER] == 0 and c[mla_attention.COUNTER] % layers == 0, dict(c)
    assert c[mla_attention.COUNTER] // layers <= 4, dict(c)
    # the count stays a graph input (the window's mask reads it): under CUDA graphs each decode graph would be
    # recorded once per step, so the backend compiles them without
    assert flagged and all(flagged), flagged


def _spy_cuda_graph_choice(monkeypatch) -> list:
    """Record, for each graph the backend compiles, whether it would drop CUDA graphs were they on (they are off on
    the CPU): a list of booleans."""
    import mla_compile.backend as backend

    choose, flagged = backend._step_counter_without_cudagraphs, []

    def spy(gm, patches, inductor_patches):
        flagged.append(choose(gm, {**patches, "triton.cudagraphs": True}, inductor_patches)["triton.cudagraphs"]
                       is False)
        return choose(gm, patches, inductor_patches)

    monkeypatch.setattr(backend, "_step_counter_without_cudagraphs", spy)
    return flagged


def test_decode_steps_without_step_counters_keep_cuda_graphs(monkeypatch):
    """The other side of the sliding-window rule: a DeepSeek-V3 decode step (no int that advances per step reaches
    the graph: HF's StaticCache counts on the device) keeps CUDA graphs."""
    model = tiny_model("deepseek_v3", "sdpa").eval()
    L = PROMPT + STEPS + 1
    ids, mask = M.batch(T=PROMPT, L=L, vocab=model.config.vocab_size)
    flagged = _spy_cuda_graph_choice(monkeypatch)
    compiled = torch.compile(model, backend="mla_dcp")
    M.greedy(compiled, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), STEPS, prefill=model)
    assert flagged and not any(flagged), flagged


def sinks_step(T: int, make_cache) -> tuple:
    """A 3-token step (speculative verification, prompt lookup) on hy_v4 (attention sinks, DSA, eager attention)
    after a T-token prefill, request 1's first query token at a padding position (that row sees no token: with a
    sink it attends the sink alone, 0): (eager HF's logits, the rewritten graph's (no Inductor), the pass's
    counters, the model's MLA layers), each over a fresh `make_cache(model, L)`."""
    from mla_compile.passes import mla_attention as pass_

    torch.manual_seed(0)
    model = tiny_model("hy_v4", "eager").eval()
    L = T + 3
    ids, mask = M.batch(B=2, T=T, L=L, vocab=model.config.vocab_size)
    mask[1, :T + 1] = 0
    new = torch.randint(1, model.config.vocab_size, (2, 3), generator=torch.Generator().manual_seed(0))

    def rewrite_only(gm, example_inputs):
        pass_.rewrite_mla_attention(gm)
        return gm.forward

    logits = []
    torch._dynamo.reset()
    for step in (model, torch.compile(model, backend=rewrite_only, fullgraph=True, dynamic=False)):
        cache = make_cache(model, L)
        COUNTERS.clear()
        with torch.no_grad():
            model(ids, attention_mask=mask[:, :T], **cache_kwargs(model, cache))
            logits.append(step(new, attention_mask=mask, **cache_kwargs(model, cache)).logits)
    return logits[0], logits[1], dict(COUNTERS["mla_compile"]), mla_layers(model)


@pytest.mark.parametrize("T", [2, 10], ids=["dense", "sparse"])
def test_sinks_verification_step_matches_hf(T):
    """`sinks_step` over DSAStaticCache: the compiled step's logits equal HF's, every site rewritten as a
    multi-token site, over the dense DSA graph (kv lengths <= index_topk) and the sparse one (each query token its
    own top-k). These sites were left to HF before (counted as not rewritten)."""
    from mla_compile.passes import mla_attention as pass_

    topk = tiny_config("hy_v4", "eager").get_text_config(decoder=True).index_topk
    assert (T + 3 <= topk) == (T == 2), topk  # the two cases sit on either side of index_topk
    ref, got, c, layers = sinks_step(T, lambda model, L: DSAStaticCache(model.config, L))
    assert c.get(pass_.TOKENS_COUNTER) == layers and not c.get(pass_.SKIP_COUNTER), c
    assert M.rel_err(got, ref) < 1e-5, M.rel_err(got, ref)


def sinks_dcp_worker(rank: int, world: int, init_file: str, result_dir: str, T: int) -> None:
    """One DCP rank (gloo): `sinks_step` over `MLAPagedCache(dcp=...)`, eager HF vs the rewritten graph over the
    same sharded cache."""
    import types

    import torch.distributed as dist

    from mla_compile.integrations.hf import MLAPagedCache

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        dcp = types.SimpleNamespace(size=world, rank=rank, group_name=dist.group.WORLD.group_name)
        ref, got, c, layers = sinks_step(T, lambda model, L: MLAPagedCache(model.config, L, page_size=2, dcp=dcp))
        torch.save(dict(err=M.rel_err(got, ref), counters=c, layers=layers), f"{result_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("T", [2, 10], ids=["dense", "sparse"])
def test_sinks_verification_step_under_dcp(T, tmp_path):
    """The sinks' 3-token step on two DCP ranks: the dense graph is rewritten (`mla.dcp_decode` returns the merged
    lse the sinks scale by), the DSA-sparse one stays HF's, counted (its DCP emission merges without lse); both
    give eager HF's logits over the same sharded cache."""
    import torch.multiprocessing as mp

    from mla_compile.passes import mla_attention as pass_

    mp.spawn(sinks_dcp_worker, args=(2, str(tmp_path / "init"), str(tmp_path), T), nprocs=2, join=True)
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt")
        assert res["err"] < 1e-5, res
        c = res["counters"]
        if T == 2:
            assert c.get(pass_.TOKENS_COUNTER) == res["layers"] and not c.get(pass_.SKIP_COUNTER), c
        else:
            assert c.get(pass_.SKIP_COUNTER) == res["layers"] and not c.get(pass_.COUNTER), c


ROADS = ("static", "paged", "fp8")  # generate()'s cache: HF's StaticCache, MLAPagedCache, an FP8 latent cache
ROADS_IN_CI = {("kimi_linear", "paged"), ("deepseek_v32", "fp8")}


def _road_cases():
    out = []
    for p in _cases():
        case, impl = p.values
        if impl not in ("sdpa", "eager") or (impl == "eager" and "sdpa" in impls(case)):
            continue  # one implementation per case: sdpa where HF has it
        for road in ROADS:
            marks = [m for m in p.marks if m.name != "slow"]
            if (case, road) not in ROADS_IN_CI:
                marks.append(pytest.mark.slow)
            out.append(pytest.param(case, impl, road, id=f"{case}-{road}", marks=marks))
    return out


@pytest.mark.parametrize("case, impl, road", _road_cases())
def test_family_generate_roads_equal_eager(case, impl, road):
    """Every family through the README's generate() recipe (`optimize_generate`, without CUDA graphs here; the GPU
    file runs them) over each cache a user may hand generate(): greedy tokens equal eager generate()'s over the same
    kind of cache (an FP8 cache's eager reference reads the dequantized latent), every MLA site rewritten. A
    sliding-window family compiles a graph per window fill level: a multiple of the layers."""
    from mla_compile.integrations.hf import MLAPagedCache, optimize_generate

    torch.manual_seed(0)
    model = tiny_model(case, impl).eval()
    if not hasattr(model, "generate"):
        pytest.skip(f"{case}: a multimodal family's text decoder (no causal-LM class with generate())")
    dsa = "index_topk" in model.config.to_dict()
    ids, mask = M.batch(T=PROMPT, L=PROMPT, vocab=model.config.vocab_size)
    L = PROMPT + STEPS + 1

    def cache():
        if road == "static":
            c = DSAStaticCache(model.config, L) if dsa else StaticCache(config=model.config, max_cache_len=L)
        elif road == "paged":
            c = MLAPagedCache(model.config, L, page_size=4, shuffle_pages=True)
        else:
            c = (DSAStaticCache(model.config, L, kv_cache_dtype="fp8_e4m3") if dsa else
                 MLAPagedCache(model.config, L, page_size=4, kv_cache_dtype="fp8_e4m3"))
        return cache_kwargs(model, c)

    kw = dict(max_new_tokens=STEPS + 1, min_new_tokens=STEPS + 1, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, disable_compile=True, **cache(), **kw)
    M.fresh(model)
    optimize_generate(model, mode=None)
    with torch._dynamo.config.patch(**DYNAMO.get(case.split(":")[0], {})), torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **cache(), **kw)
    assert torch.equal(out, ref)
    c, layers = COUNTERS["mla_compile"], mla_layers(model)
    assert c[mla_attention.SKIP_COUNTER] == 0 and c[mla_attention.COUNTER] >= layers * (2 if dsa else 1), dict(c)
    assert c[mla_attention.COUNTER] % layers == 0, dict(c)


def paged_dcp_worker(rank: int, world: int, init_file: str, result_dir: str, case: str, tp: int = 0,
                     impl: str = "sdpa") -> None:
    """One DCP rank (gloo, CPU): single-rank eager HF over StaticCache / DSAStaticCache (the reference) vs eager HF
    and the compiled model over `MLAPagedCache(dcp=...)`. tp 0: pure DCP over the world (heads replicated); tp > 0:
    TP x DCP, `init_dcp(tp_size=tp, dcp_size=world // tp)` and `shard_mla_heads` (each rank its block of heads).
    Writes the numbers to result_dir/rank{rank}.pt."""
    import types

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from mla_compile.distributed import init_dcp
        from mla_compile.integrations.hf import MLAPagedCache
        from mla_compile.integrations.tp import shard_mla_heads

        torch.manual_seed(0)  # every rank the same model: parameters `spread_weights` leaves (e.g. A_log) too
        model = tiny_model(case, impl).eval()
        dsa = "index_topk" in model.config.to_dict()
        L = PROMPT + STEPS + 1
        ids, mask = M.batch(T=PROMPT, L=L, vocab=model.config.vocab_size)
        ref = DSAStaticCache(model.config, L) if dsa else StaticCache(config=model.config, max_cache_len=L)
        ref_t, ref_l = M.greedy(model, model, ids, mask, ref, STEPS)
        if tp:
            dcp = init_dcp(tp_size=tp, dcp_size=world // tp)
            shard_mla_heads(model, dcp)
        else:
            dcp = types.SimpleNamespace(size=world, rank=rank, group_name=dist.group.WORLD.group_name)
        e_t, e_l = M.greedy(model, model, ids, mask, MLAPagedCache(model.config, L, page_size=4, dcp=dcp), STEPS)
        torch._dynamo.reset()
        COUNTERS.clear()
        compiled = torch.compile(model, backend="mla_dcp")
        with torch._dynamo.config.patch(**DYNAMO.get(case.split(":")[0], {})):
            c_t, c_l = M.greedy(compiled, model, ids, mask, MLAPagedCache(model.config, L, page_size=4, dcp=dcp),
                                STEPS, prefill=model)
        torch.save(dict(ref_t=ref_t, ref_l=ref_l, e_t=e_t, e_l=e_l, c_t=c_t, c_l=c_l,
                        counters=dict(COUNTERS["mla_compile"])), f"{result_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _check_ranks(result_dir, world: int, sites: int) -> None:
    """Every rank: eager HF and the compiled model over the sharded cache give the reference's tokens and logits,
    every MLA site rewritten, and every rank the same logits."""
    first = None
    for r in range(world):
        res = torch.load(result_dir / f"rank{r}.pt")
        assert torch.equal(res["e_t"], res["ref_t"]) and M.rel_err(res["e_l"], res["ref_l"]) < TOL
        assert torch.equal(res["c_t"], res["ref_t"]) and M.rel_err(res["c_l"], res["ref_l"]) < TOL
        assert res["counters"].get(mla_attention.COUNTER) == sites, res["counters"]
        assert not res["counters"].get(mla_attention.SKIP_COUNTER), res["counters"]
        first = res["c_l"] if first is None else first
        assert torch.equal(res["c_l"], first)


@pytest.mark.parametrize("case", ["kimi_linear", "mistral_large4:no_rope",  # CI: one hybrid, one rope-less family
                                  *(pytest.param(c, marks=pytest.mark.slow) for c in ("bailing_hybrid", "glm5_next"))])
def test_paged_cache_single_rank_and_dcp(case, tmp_path):
    """`MLAPagedCache` under families that differ from DeepSeek's layer stack: the hybrids, whose linear-attention
    layers keep HF's cache layer (only the MLA layers are paged), and rope-less MLA layers (P = 0: the pass's flat
    view of a paged latent could not infer its slot count from 0 elements, so those sites were left unchanged,
    logged as an internal error). Eager HF and the compiled model give the StaticCache reference's tokens with
    every site rewritten, on one rank and on two gloo DCP ranks (every rank the same logits)."""
    import torch.multiprocessing as mp

    from mla_compile.integrations.hf import MLAPagedCache

    torch.manual_seed(0)
    model = tiny_model(case, "sdpa").eval()
    dsa = "index_topk" in model.config.to_dict()
    sites = mla_layers(model) * (2 if dsa else 1)
    L = PROMPT + STEPS + 1
    ids, mask = M.batch(T=PROMPT, L=L, vocab=model.config.vocab_size)
    ref = DSAStaticCache(model.config, L) if dsa else StaticCache(config=model.config, max_cache_len=L)
    ref_t, ref_l = M.greedy(model, model, ids, mask, ref, STEPS)
    cache = MLAPagedCache(model.config, L, page_size=4, shuffle_pages=True)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds.count("MLAPagedLayer") == mla_layers(model)
    compiled = torch.compile(model, backend="mla_dcp")
    with torch._dynamo.config.patch(**DYNAMO.get(case.split(":")[0], {})):
        t, logits = M.greedy(compiled, model, ids, mask, cache, STEPS, prefill=model)
    assert torch.equal(t, ref_t) and M.rel_err(logits, ref_l) < TOL
    c = COUNTERS["mla_compile"]
    assert c[mla_attention.COUNTER] == sites and c[mla_attention.SKIP_COUNTER] == 0, dict(c)
    mp.spawn(paged_dcp_worker, args=(2, str(tmp_path / "init"), str(tmp_path), case), nprocs=2, join=True)
    _check_ranks(tmp_path, 2, sites)


# in CI: a hybrid with a per-head output gate (`tp.PER_HEAD`); every other family `-m slow` (the CI machine's two
# cores run each case's two ranks for ~40 s)
_TP_CI = ("bailing_hybrid",)


def _tp_cases():
    """One case per family variant, on its first attention implementation (sdpa where it has one)."""
    out = []
    for p in _cases():
        case, impl = p.values
        if impl not in ("-", "?") and impl != impls(case)[0]:
            continue
        marks = [m for m in p.marks if m.name == "skip"] + ([] if case in _TP_CI else [pytest.mark.slow])
        out.append(pytest.param(case, impl, id=case, marks=marks))
    return out


@pytest.mark.parametrize("case, impl", _tp_cases())
def test_tp_dcp_heads_sharded_across_families(case, impl, tmp_path):
    """TP x DCP on two gloo ranks, heads split over the DCP group (`init_dcp(tp_size=1, dcp_size=2)`: each rank half
    the heads, each DCP shard half the tokens; `mla.tp_dcp_decode`), through `shard_mla_heads` on every family: eager
    HF and the compiled model over the sharded cache give single-rank HF's tokens, every site rewritten. The families
    with per-head gates (bailing_hybrid, dots3_note), per-head query scaling (mistral_large4), sinks (hy_v4) or a
    fused q + gate projection (axk2) had a shape mismatch or a refusal before their pieces were cut too."""
    import torch.multiprocessing as mp

    model = tiny_model(case, impl)
    sites = mla_layers(model) * (2 if "index_topk" in model.config.to_dict() else 1)
    mp.spawn(paged_dcp_worker, args=(2, str(tmp_path / "init"), str(tmp_path), case, 1, impl), nprocs=2, join=True)
    _check_ranks(tmp_path, 2, sites)


def test_recurrent_layer_types_are_told_from_attention():
    """`has_recurrent_layers`: the hybrids (linear attention) and a layer type nobody knows are recurrent; every
    attention-only family (full, sliding, indexed / DSA layers) is not."""
    from mla_compile.integrations.generate import has_recurrent_layers

    for family in mla_families():
        assert has_recurrent_layers(tiny_config(family, "eager")) == (family in HYBRIDS + ("glm5_next",)), family
    config = tiny_config("deepseek_v32", "eager")
    config.layer_types = ["indexed_attention", "some_future_state_space"]
    assert has_recurrent_layers(config)
    config.layer_types = ["full_attention", "sliding_attention"]
    assert not has_recurrent_layers(config)


def test_discovers_the_known_families():
    """Discovery finds MLA families (all of 5.24's on 5.24): a broken discovery would skip everything."""
    found = mla_families()
    assert "deepseek_v3" in found
    if transformers.__version__.startswith("5.24"):
        assert sorted(found) == sorted(EXPECTED_FAMILIES)


@pytest.mark.parametrize("case, impl", _cases())
def test_family_decode_matches_eager(case, impl):
    r = run_family(case, impl)
    assert r["layers"] > 0
    # every MLA site of every decode graph is rewritten or counted (and logged) as not rewritten
    assert r["rewritten"] + r["not_rewritten"] == r["sites"], f"silent skip: {r}"
    # one site per MLA layer per decode graph (DSA: the dense and the sparse graph)
    assert r["sites"] == r["layers"] * r["graphs"], r
    assert r["rewritten"] == r["sites"], r
    assert torch.equal(r["tokens"], r["ref_tokens"]), r
    assert r["err"] < TOL, r
    if r["dsa"]:
        assert r["unique_graphs"] == 2, r
        if case.split(":")[0] in HF_INDEXER:
            assert r["dropped"] == 0 and r["sparse"] == 0, r
        else:
            assert r["dropped"] > 0 and r["sparse"] > 0, r


def family_table(only=()) -> str:
    """README's "HF families" table, from running every case here (`python tests/hf/test_hf_families.py`), or only
    the rows of the families / cases named in `only` (`python tests/hf/test_hf_families.py glm5_next`)."""
    rows = {}
    for p in _cases():
        case, impl = p.values
        if only and case not in only and case.split(":")[0] not in only:
            continue
        if impl == "-":
            rows.setdefault(case, {})["note"] = p.marks[0].kwargs["reason"]
            continue
        torch._dynamo.reset()
        COUNTERS.clear()
        try:
            test_family_decode_matches_eager(case, impl)
            cell = "pass" if (case, impl) not in KNOWN else "XPASS (remove the xfail)"
        except AssertionError:
            cell = "xfail" if (case, impl) in KNOWN else "FAIL"
        row = rows.setdefault(case, {})
        row[impl] = cell
        if (case, impl) in KNOWN:
            row.setdefault("reasons", {}).setdefault(KNOWN[case, impl], []).append(impl)
    lines = ["| family | sdpa | eager | status / reason |", "|---|---|---|---|"]
    for case, row in rows.items():
        notes = [f"{', '.join(i)}: {r}" for r, i in row.get("reasons", {}).items()]
        family = case.split(":")[0]
        if family in DYNAMO and case == family:
            notes.append("needs torch._dynamo.config " + ", ".join(f"{k}={v}" for k, v in DYNAMO[family].items())
                         + " (else counted not rewritten: K is a graph input)")
        if family in HF_INDEXER and case == family:
            notes.append(f"HF's indexer kept ({HF_INDEXER[family]}); its top-k mask is the token table")
        if family in NOTES and case == family:
            notes.append(NOTES[family])
        note = row.get("note") or "; ".join(notes)
        lines.append(f"| {case} | {row.get('sdpa', 'n/a (HF: no sdpa)')} | {row.get('eager', '')} | {note} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(family_table(tuple(sys.argv[1:])))


def _unknown_head_param(attn) -> None:
    attn.head_temperature = torch.nn.Parameter(torch.ones(attn.num_heads))


def _no_q_projection(attn) -> None:
    attn.q_b_proj = torch.nn.Identity()


@pytest.mark.parametrize("change, why", [
    (_unknown_head_param, r"DeepseekV3Attention\.head_temperature \(4,\) is a parameter whose layout over the "
                          r"attention heads this helper does not know"),
    (_no_q_projection, r"DeepseekV3Attention has no single q projection"),
])
def test_shard_mla_heads_refuses_what_it_cannot_shard_and_leaves_the_model_whole(change, why):
    """TP x DCP's head sharding on an attention module it cannot split (a parameter of unknown layout: it may be per
    head; no q projection it knows): a ValueError naming the module and the parameter, raised before any module
    changed (the change sits in the last layer, so the first would have been cut by then)."""
    import types

    from mla_compile.integrations.tp import mla_attention_modules, shard_mla_heads

    model = tiny_model("deepseek_v3", "sdpa")
    change(mla_attention_modules(model)[-1])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    group = types.SimpleNamespace(heads_sharded=True, head_shards=2, head_rank=0, head_group_name="g")
    with pytest.raises(ValueError, match=f"^model: {why}"):
        shard_mla_heads(model, group)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
