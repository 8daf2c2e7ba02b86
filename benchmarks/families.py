"""Decode step of five HF MLA families at 32K: eager HF vs torch.compile (default, reduce-overhead) vs mla_dcp.

usage:  python benchmarks/families.py OUT.json [--families deepseek_v3 deepseek_v32 glm4_moe_lite kimi_linear mistral4]
                                               [--kv 32768] [--batch 8] [--layers 4] [--vocab 32768]
                                               [--modes eager default default-ro mla mla-ro] [--steps 10]
                                               [--check-steps 2] [--runs 3] [--budget-s 440] [--no-fp32-ref]
        python benchmarks/families.py OUT.json --smoke     # tiny shapes, CPU ok (checks the script itself)

Models (random weights, bf16 on CUDA): each family's own config class with its defaults, i.e. the real attention:
head count, MLA dims (kv_lora, rope, nope, v), q_lora, hidden size, DSA indexer (V3.2: 64 heads x 128, top-k 2048).
Scaled (`scaled` in the JSON, per family): num_hidden_layers 4; vocab_size 32768; every MLP dense at the family's
own intermediate_size (MoE off: the router and experts are the same work in every mode, and HF's expert loops
break graphs); Kimi-Linear's layer pattern 3 KDA layers + 1 MLA layer (its real 3:1 ratio); max_position_embeddings
at least 64K. The cache (HF StaticCache; `DSAStaticCache` for V3.2) is filled to kv_len by writing random latents
(and indexer keys) straight into its buffers; no 32K prefill is run or timed.

Cases: one per family at `--kv`; V3.2 twice, its dense graph (kv_len + steps <= index_topk, the indexer dropped)
and its sparse one (--kv). Modes, in this order, each from the same restored cache state:
  eager       HF eager (expands the whole latent cache through kv_b_proj every step)
  default     torch.compile(model)                                        (Inductor)
  default-ro  torch.compile(model, mode="reduce-overhead")                (+ CUDA-graph trees)
  mla         torch.compile(model, backend="mla_dcp")
  mla-ro      torch.compile(model, backend="mla_dcp", mode="reduce-overhead")
Numerics first: an fp32 copy of the model, eager, over the same cache state (converted), teacher-forced on eager's
greedy tokens, gives reference logits; every mode's first `--check-steps` logits are compared with it
(`max_rel_err_vs_fp32`) and with eager's; "ok": within max(2x eager's own error vs fp32, 2e-2). Timing: ms per step,
median of `--runs` runs of `--steps` greedy steps after one warm-up run (CUDA: synchronised wall time around the
steps). `--budget-s`: a mode that would start past it is skipped (recorded): the whole run stays under the device
call's limit. The JSON is rewritten after every mode.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_decode import decode, max_rel_err, sync  # noqa: E402  (the decode loop and checks of the V3 benchmark)
from mla_compile.integrations.hf import cache_kwargs  # noqa: E402

FAMILIES = ("deepseek_v3", "deepseek_v32", "glm4_moe_lite", "kimi_linear", "mistral4")
MODES = ("eager", "default", "default-ro", "mla", "mla-ro")
MIN_POSITIONS = 1 << 16


def model_class(family: str, config_cls):
    """`family`'s causal LM: the auto mapping's, else the `*ForCausalLM` of its module built on `config_cls`."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(family)
    if name is not None:
        return getattr(transformers, name)
    mod = importlib.import_module(f"transformers.models.{family}")
    for n in dir(mod):
        cls = getattr(mod, n)
        if n.endswith("ForCausalLM") and getattr(cls, "config_class", None) is config_cls:
            return cls
    raise LookupError(f"{family}: no ForCausalLM for {config_cls.__name__}")


def family_config(family: str, layers: int = 4, vocab: int = 32768, tiny: bool = False):
    """(config, scaled): the family's default config with the fields in `scaled` changed (see the docstring);
    tiny: also hidden 64, 4 heads, small MLP / q_lora, top-k 16 (CPU smoke; MLA dims stay real)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[family]
    d = cls().to_dict()
    layers0 = d.get("num_hidden_layers")
    scaled = {"num_hidden_layers": layers, "vocab_size": vocab}
    if (d.get("max_position_embeddings") or MIN_POSITIONS) < MIN_POSITIONS:
        scaled["max_position_embeddings"] = MIN_POSITIONS
    if "first_k_dense_replace" in d:
        scaled["first_k_dense_replace"] = layers  # every MLP dense
    for k, v in d.items():  # per-layer lists: cut to `layers`
        if isinstance(v, list) and len(v) == layers0 and k not in scaled:
            scaled[k] = ["dense"] * layers if k == "mlp_layer_types" else v[:layers]
    if family == "kimi_linear":
        scaled["layer_types"] = ["linear_attention"] * (layers - 1) + ["full_attention"]
    if tiny:
        scaled.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128)
        if d.get("q_lora_rank"):
            scaled["q_lora_rank"] = 96
        if "index_topk" in d:  # 64 indexer heads stay: with few, relu(scores) ties at 0 make the top-k arbitrary
            scaled["index_topk"] = 16
        for k in ("linear_num_heads", "num_heads"):
            if k in d:
                scaled[k] = 4
    cfg = cls(**{**d, **scaled, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": None})
    impl = "sdpa" if model_class(family, cls)._supports_sdpa else "eager"
    cfg._attn_implementation = impl
    return cfg, scaled


def build(family: str, dtype, device, layers: int = 4, vocab: int = 32768, tiny: bool = False):
    from mla_compile.models import spread_weights

    cfg, scaled = family_config(family, layers, vocab, tiny)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(family, type(cfg))(cfg)
    return spread_weights(model, seed=0, dtype=dtype).eval(), scaled


def new_cache(model, max_len: int):
    from transformers import StaticCache

    from mla_compile.integrations.hf import DSAStaticCache

    if getattr(model.config, "index_topk", None) is not None:
        return DSAStaticCache(model.config, max_len)
    return StaticCache(config=model.config, max_cache_len=max_len)


def _init_cache(model, cache, B: int, device):
    """One 1-token forward: HF allocates the cache buffers lazily."""
    with torch.no_grad():
        model(torch.zeros(B, 1, dtype=torch.long, device=device), **cache_kwargs(model, cache),
              attention_mask=torch.ones(B, 1, dtype=torch.long, device=device),
              cache_position=torch.arange(1, device=device))


def state(cache) -> list[torch.Tensor]:
    """Every tensor of every cache layer (latent, rope, indexer keys, lengths, linear-attention states), in a fixed
    order: a snapshot to restore, or to copy into another cache of the same model."""
    out = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    for layer in cache.layers:
        for k in sorted(vars(layer)):
            walk(vars(layer)[k])
    return out


def rewind(cache, kv_len: int):
    """Lengths back to kv_len cached tokens (device counters, and our caches' host count)."""
    for layer in cache.layers:
        for name in ("cumulative_length", "indexer_cumulative_length"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                t.fill_(kv_len)
    if hasattr(cache, "max_kv_len"):
        cache.max_kv_len = kv_len + 1  # DSADenseMixin: the kv length of the next one-token step


def fill(cache, kv_len: int, seed: int = 1):
    """kv_len random tokens in every latent / rope / indexer-key buffer (normalised scale)."""
    g = None
    for layer in cache.layers:
        for name in ("keys", "values", "indexer_keys"):
            buf = getattr(layer, name, None)
            if not isinstance(buf, torch.Tensor):
                continue
            if g is None:
                g = torch.Generator(device=buf.device).manual_seed(seed)
            buf.zero_()
            part = buf[:, :, :kv_len] if buf.dim() == 4 else buf[:, :kv_len]  # [B,1,L,R] / indexer [B,L,D]
            part.copy_(torch.randn(part.shape, generator=g, device=buf.device, dtype=torch.float32))
    rewind(cache, kv_len)


def compiled(model, mode: str):
    if mode == "eager":
        return model
    kw = {"mode": "reduce-overhead"} if mode.endswith("-ro") else {}
    if mode.startswith("default"):
        return torch.compile(model, **kw)
    return torch.compile(model, backend="mla_dcp", options=kw or None)


def cases(args, family: str, topk: int | None):
    """(label, kv_len) per case: V3.2's dense graph at the largest kv_len that stays <= topk through every step."""
    out = []
    if topk is not None:
        dense = topk - (args.check_steps + args.steps + 1)
        if 0 < dense < args.kv:
            out.append(("dense", dense))
    out.append(("sparse" if topk is not None and args.kv > topk else "", args.kv))
    return out


def run_family(family, args, device, dtype, report, save, t_start):
    model, scaled = build(family, dtype, device, args.layers, args.vocab, tiny=args.smoke)
    cfg = model.config
    B = args.batch
    topk = getattr(cfg, "index_topk", None)
    for label, kv_len in cases(args, family, topk):
        max_len = kv_len + args.check_steps + args.steps + 64
        cache = new_cache(model, max_len)
        _init_cache(model, cache, B, device)
        fill(cache, kv_len)
        snapshot = [t.clone() for t in state(cache)]
        mask = torch.ones(B, max_len, dtype=torch.long, device=device)
        torch._dynamo.mark_static_address(mask)  # a serving loop's persistent mask: no per-replay copy
        tok = torch.randint(1, cfg.vocab_size, (B, 1), device=device,
                            generator=torch.Generator(device=device).manual_seed(2))
        case = {"family": family, "graph": label, "kv_len": kv_len, "batch": B, "heads": cfg.num_attention_heads,
                "kv_lora_rank": cfg.kv_lora_rank, "qk_rope_head_dim": cfg.qk_rope_head_dim,
                "qk_nope_head_dim": cfg.qk_nope_head_dim, "v_head_dim": cfg.v_head_dim,
                "q_lora_rank": getattr(cfg, "q_lora_rank", None), "hidden_size": cfg.hidden_size,
                "attn_implementation": cfg._attn_implementation, "scaled": scaled, "modes": {}}
        report["cases"].append(case)

        def restore(at=kv_len):
            for t, s in zip(state(cache), snapshot):
                t.copy_(s)
            rewind(cache, at)

        ref32 = ref_tokens = eager_err = None
        for mode in args.modes:
            entry = case["modes"][mode] = {}
            if time.perf_counter() - t_start > args.budget_s:
                entry["skipped"] = f"time budget {args.budget_s} s spent"
                save()
                continue
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            try:
                fn = compiled(model, mode)
                restore()
                t0 = time.perf_counter()
                logits = decode(fn, cache, tok, mask, kv_len, args.check_steps, keep_logits=True, forced=ref_tokens)
                sync(device)
                entry["first_steps_s"] = time.perf_counter() - t0  # includes compilation / graph capture
                if ref_tokens is None:  # the first mode run (eager by default) picks the tokens every mode is fed
                    ref_tokens = torch.cat([tok] + [lg.argmax(-1, keepdim=True) for lg in logits[:-1]], 1)
                    if args.fp32_ref:
                        ref32 = _fp32_reference(model, snapshot, kv_len, max_len, B, tok, mask, ref_tokens, args,
                                                device, case)
                if ref32 is not None:
                    entry["max_rel_err_vs_fp32"] = err = max_rel_err(logits, ref32)
                    if mode == "eager":
                        eager_err = err
                    if eager_err is not None:
                        entry["ok"] = bool(err <= max(2 * eager_err, 2e-2))
                c = torch._dynamo.utils.counters
                entry["rewritten"] = int(c["mla_compile"].get("mla_attention_rewritten", 0))
                entry["not_rewritten"] = int(c["mla_compile"].get("mla_attention_not_rewritten", 0))
                entry["graphs"] = int(c["stats"].get("unique_graphs", 0))
                times = []
                for rep in range(args.runs + 1):
                    restore(kv_len + args.check_steps)
                    sync(device)
                    t0 = time.perf_counter()
                    decode(fn, cache, tok, mask, kv_len + args.check_steps, args.steps)
                    sync(device)
                    if rep:
                        times.append((time.perf_counter() - t0) / args.steps)
                entry.update(ms_per_step=statistics.median(times) * 1e3, all_ms=[t * 1e3 for t in times])
            except Exception as e:  # noqa: BLE001 - recorded; the next mode still runs
                entry["error"] = f"{type(e).__name__}: {e}"[:2000]
                traceback.print_exc()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            print(f"{family} {label or ''} kv={kv_len} {mode}: {json.dumps(entry)}", flush=True)
            save()
        for a, b in (("mla-ro", "default-ro"), ("mla", "default"), ("mla-ro", "eager")):
            ma, mb = case["modes"].get(a, {}), case["modes"].get(b, {})
            if "ms_per_step" in ma and "ms_per_step" in mb:
                case[f"speedup_{a}_vs_{b}"] = mb["ms_per_step"] / ma["ms_per_step"]
        del cache, snapshot
        torch._dynamo.reset()
        save()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _fp32_reference(model, snapshot, kv_len, max_len, B, tok, mask, forced, args, device, case):
    """Logits of an fp32 copy of `model`, eager, over the snapshot's cache state (converted), teacher-forced."""
    try:
        model32 = copy.deepcopy(model).float()
        cache = new_cache(model32, max_len)
        _init_cache(model32, cache, B, device)
        for t, s in zip(state(cache), snapshot):
            t.copy_(s)
        rewind(cache, kv_len)
        logits = decode(model32, cache, tok, mask, kv_len, args.check_steps, keep_logits=True, forced=forced)
        del model32, cache
        return logits
    except torch.OutOfMemoryError as e:
        case["fp32_ref_error"] = f"OutOfMemoryError: {e}"[:300]
        torch.cuda.empty_cache()
        return None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--kv", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--check-steps", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=440.0, help="no mode starts after this many seconds")
    ap.add_argument("--no-fp32-ref", dest="fp32_ref", action="store_false")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU ok, fp32): checks the script")
    args = ap.parse_args(argv)
    if args.smoke:
        args.kv, args.batch, args.vocab, args.steps, args.check_steps, args.runs = 24, 2, 128, 2, 2, 1
    if args.layers < 1 or args.kv < 1 or args.batch < 1:
        ap.error("--layers, --kv and --batch must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    import mla_compile  # noqa: F401  (registers the ops; the backend is also found by entry point)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    report = {"env": env, "args": vars(args), "cases": []}

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    t_start = time.perf_counter()
    for family in args.families:
        try:
            run_family(family, args, device, dtype, report, save, t_start)
        except Exception as e:  # noqa: BLE001 - a family that cannot be built is recorded, the others still run
            report["cases"].append({"family": family, "error": f"{type(e).__name__}: {e}"[:2000]})
            traceback.print_exc()
            save()
    report["wall_s"] = time.perf_counter() - t_start
    save()
    from report import families_table

    print("\n".join(families_table(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
