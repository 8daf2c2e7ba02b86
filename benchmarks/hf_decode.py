"""HF DeepseekV3 decode throughput: eager HF vs torch.compile (default, reduce-overhead) vs backend="mla_dcp".

usage:  python benchmarks/hf_decode.py OUT.json [--heads 16 128] [--kv 4096 32768] [--batch 8] [--layers 4]
                                                [--modes eager default mla] [--steps 30] [--check-steps 4] [--runs 3]
                                                [--mask input|static] [--step model|greedy] [--mla-options JSON]
                                                [--kv-cache-dtype auto fp8_e4m3]
                                                [--tokens S]
        python benchmarks/hf_decode.py OUT.json --smoke      # tiny shapes, CPU ok (checks the script itself)

Model: DeepseekV3ForCausalLM, real MLA dims (kv_lora 512, rope 64, nope 128, v 128, q_lora 1536), hidden 2048,
`--layers` dense layers (no MoE: this measures attention), random weights, bf16, `attn_implementation="sdpa"`,
HF's own StaticCache (max_cache_len = kv_len + steps + slack). The cache is filled to kv_len by writing random
latents straight into its buffers (a 32K prefill is not what is measured), then every mode decodes greedily
from that same state:

  eager    HF eager (expands the whole latent cache through kv_b_proj every step)
  default  torch.compile(model, mode="reduce-overhead")                 (Inductor + CUDA-graph trees)
  mla      torch.compile(model, backend="mla_dcp", mode="reduce-overhead") (absorbed mla.decode, CUDA graphs)
           (`--mla-options` adds backend options, e.g. '{"triton.enable_pdl": true}')
  mla:K    mla with the decode kernel K asked for (`options={"decode_kernel": K}`, mla_compile/tuning.py), timed
           in the same run as mla, e.g. `--modes mla mla:swapab mla:triton` (an A/B of kernels on the HF step)

`--step greedy` compiles (and runs eagerly, for eager) a step function instead of the model: the same HF model
call plus the greedy pick (argmax over the last logits) inside, as gpt-fast / serving loops do; by default the
pick runs eagerly after the compiled model (what an HF user gets), costing every mode the same ~10 us argmax
and a few launch gaps between graphs per step.

`--kv-cache-dtype`: one case per value, side by side. "auto": HF's StaticCache in the model's dtype (1152 bytes a
token, bf16); "fp8_e4m3": `DSAStaticCache(kv_cache_dtype="fp8_e4m3")`, the FP8 latent cache (656 bytes a token:
e4m3 latent, 4 float32 scales, bf16 rope; one page per request), filled with the same kind of random latents
through the quantizing write. eager / default then run HF's attention over the dequantized latent; mla runs
mla.decode over the FP8 pages. The fp32 reference runs over the FP8 cache's dequantized latent (so
max_rel_err_vs_fp32 leaves out the filled tokens' quantization and counts only that of the steps' own new tokens;
the quantization itself is measured by tests/hf/test_hf_fp8_cache.py).
"fp8_ue8m0": the same FP8 cache written with power-of-two scales (`fp8_scale_fmt="ue8m0"`) and promised to mla
(`options={"fp8_scale_fmt": "ue8m0"}`: at 128 heads auto then runs FlashMLA's FP8 kernel).
E.g. the FP8 acceptance case (issue 25): --heads 16 --kv 32768 --batch 8 --modes mla --kv-cache-dtype auto fp8_e4m3

The attention mask is one tensor for the whole run (all ones: no padding). `--mask input` hands it over as a
plain tensor, which the CUDA-graph trees copy into their own buffer before every replay (2 MB at 32K: ~18 us a
step, every compiled mode); `--mask static` marks it static (`torch._dynamo.mark_static_address`), as a serving
loop's persistent mask buffer would be: no copy. The same mask goes to every mode.

`--tokens S` (S = 2 .. 8): every step is a speculative-verification step (what HF's assisted generation and
prompt lookup run, MTP too): S query tokens per request (the step's token repeated), the cache grows by S a step,
and the mask is built in the graph from the 2-D mask (HF 5.24), which the pass proves causal over the S tokens
(passes/attention_tokens.py: mla.decode with per-query-token limits). tokens/s then counts S tokens a step
(all verified, the upper bound); the check compares all S positions' logits. Default 1: one-token decode.

Reported per (H, kv_len, mode): ms/step (median of `--runs` timed runs, default 3, of `--steps` steps, after warm-up) and decode
tokens/s = batch / step time; speedup of mla over default. Correctness: the first `--check-steps` steps' logits
of default and mla vs eager from the same filled cache, teacher-forced on eager's greedy tokens: max relative
error (bf16 tolerance 2e-2: "ok") and the steps whose argmax agrees. Every mode (eager included) is also
compared with an fp32 copy of the model run eagerly on the same tokens and cache (`max_rel_err_vs_fp32`): that
separates a mode's own error from the bf16 noise of the eager reference (`--no-fp32-ref` skips it).
The JSON is rewritten after every mode (a later OOM / crash / timeout keeps what is done). A full run compiles
8 graphs (2 per case); under a per-command time limit split it, e.g. `--heads 16` then `--heads 128`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from mla_compile.integrations.hf import cache_kwargs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_timing import NOTE, cpu_threads  # noqa: E402


def build_model(H: int, layers: int, hidden: int, vocab: int, dtype, device, small: bool = False,
                dense_layers: int | None = None, attn_impl: str = "sdpa"):
    """DeepseekV3ForCausalLM with real MLA dims; the first `dense_layers` layers (default: all) have a dense MLP,
    the rest MoE (8 routed experts, top-2)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden if not small else 2 * hidden,
        moe_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=H, num_key_value_heads=H,
        q_lora_rank=1536 if not small else 96, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=layers if dense_layers is None else dense_layers, max_position_embeddings=1 << 17,
        rope_interleave=True, attn_implementation=attn_impl, pad_token_id=0, bos_token_id=0, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(cfg)
    from mla_compile.models import spread_weights

    return spread_weights(model, seed=0, dtype=dtype)


def filled_cache(model, B: int, kv_len: int, max_len: int, device, seed: int = 1, kv_cache_dtype: str = "auto"):
    """A StaticCache holding kv_len random (normalized-scale) latent tokens per request (FP8: a DSAStaticCache
    with FP8 layers, the tokens quantized on write)."""
    from transformers import StaticCache

    scale_fmt = "ue8m0" if kv_cache_dtype == "fp8_ue8m0" else None
    if kv_cache_dtype != "auto":
        from mla_compile.integrations.hf import DSAStaticCache

        cache = DSAStaticCache(model.config, max_len, kv_cache_dtype="fp8_e4m3", fp8_scale_fmt=scale_fmt)
    else:
        cache = StaticCache(config=model.config, max_cache_len=max_len)
    with torch.no_grad():  # one short forward allocates the buffers (lazy init)
        model(torch.zeros(B, 1, dtype=torch.long, device=device), **cache_kwargs(model, cache),
              attention_mask=torch.ones(B, max_len, dtype=torch.long, device=device)[:, :1],
              cache_position=torch.arange(1, device=device))
    g = torch.Generator(device=device).manual_seed(seed)
    if kv_cache_dtype != "auto":
        _fill_fp8(cache, B, kv_len, max_len, device, g, model.dtype, scale_fmt)
        return cache
    for layer in cache.layers:
        for buf in (layer.keys, layer.values):  # [B, 1, max_len, R] / [B, 1, max_len, P]
            buf.zero_()
            buf[:, :, :kv_len] = torch.randn(buf[:, :, :kv_len].shape, generator=g, device=device,
                                             dtype=torch.float32).to(buf.dtype)
        layer.cumulative_length.fill_(kv_len)
    return cache


def _fill_fp8(cache, B, kv_len, max_len, device, g, dtype, scale_fmt=None):
    from mla_compile.integrations import fp8_cache

    for layer in cache.layers:  # one page per request: token t of request b at slot block_table[b, 0] * max_len + t
        buf = layer.keys
        buf.zero_()
        R, P = layer.k_head_dim, layer.v_head_dim
        slots = (layer.block_table[:, :1].long() * max_len + torch.arange(kv_len, device=device)).reshape(-1)
        for part in slots.split(1 << 16):  # bounded temporaries
            n = part.numel()
            ckv = torch.randn(n, R, generator=g, device=device, dtype=torch.float32).to(dtype)
            kpe = torch.randn(n, P, generator=g, device=device, dtype=torch.float32).to(dtype)
            fp8_cache.write(buf, ckv, kpe, part, scale_fmt)
    rewind(cache, kv_len)


def dequantized_snapshot(cache, max_len: int):
    """An FP8 DSAStaticCache's latent per layer as HF StaticCache tensors ([B, 1, max_len, R] / [.., P], float32)."""
    from mla_compile import fp8

    out = []
    for layer in cache.layers:
        ckv, scale, kpe = fp8.views(layer.keys, layer.k_head_dim, layer.dtype)
        pages = layer.block_table[:, 0].long()  # [B]
        out.append((fp8.dequantize(ckv[pages], scale[pages]).unsqueeze(1), kpe[pages].float().unsqueeze(1)))
    return out


def greedy_step(model):
    """The decode step with the greedy pick inside (`--step greedy`): (last logits, next token)."""
    def step(input_ids, attention_mask, cache_position, **cache):
        logits = model(input_ids, attention_mask=attention_mask, cache_position=cache_position, **cache).logits[:, -1]
        return logits, logits.argmax(-1, keepdim=True)
    return step


def decode(fn, cache, tok, mask, start: int, steps: int, keep_logits: bool = False, forced=None, model=None,
           tokens: int = 1):
    """`steps` greedy steps from position `start` (or teacher-forced on `forced` [B, steps]): logits list.
    fn: the model (compiled or not), or with `model` given a `greedy_step(model)` function (compiled or not).
    tokens: query tokens a step (> 1: a verification step of the step's token repeated; logits [B, S * V])."""
    logits = []
    # positions live on the device: a host tensor per step would be a blocking copy (a sync every step that
    # exposes all host overhead, as no serving loop does); the same loop runs every mode
    positions = torch.arange(start, start + steps * tokens, device=tok.device)
    with torch.no_grad():
        for i in range(steps):
            if forced is not None:
                tok = forced[:, i:i + 1]
            pos = positions[i * tokens:(i + 1) * tokens].clone()
            ids = tok if tokens == 1 else tok.expand(-1, tokens)
            if model is not None:
                lg, nxt = fn(ids, mask, pos, **cache_kwargs(model, cache))
            elif tokens > 1:
                out = fn(ids, attention_mask=mask, **cache_kwargs(fn, cache), cache_position=pos).logits
                lg, nxt = out.flatten(1), out[:, -1].argmax(-1, keepdim=True)
            else:
                lg = fn(ids, attention_mask=mask, **cache_kwargs(fn, cache), cache_position=pos).logits[:, -1]
                nxt = lg.argmax(-1, keepdim=True)
            if keep_logits:
                logits.append(lg.float().clone())
            # a compiled step's token is a CUDA-graph output, which its next replay overwrites: feed a copy
            tok = nxt.clone() if model is not None else nxt
    return logits


def fp32_logits(model, snapshot, kv_len: int, max_len: int, tok, mask, forced, steps: int, tokens: int = 1):
    """Logits of an fp32 copy of `model`, eager, over an fp32 copy of the cache state in `snapshot` (a list of
    (keys, values) per layer), teacher-forced on `forced`: the reference the bf16 modes are measured against."""
    import copy

    from transformers import StaticCache

    model32 = copy.deepcopy(model).float()
    cache = StaticCache(config=model32.config, max_cache_len=max_len)
    B = tok.shape[0]
    with torch.no_grad():  # allocate the fp32 buffers (lazy init), then load the snapshot into them
        model32(torch.zeros(B, 1, dtype=torch.long, device=tok.device), **cache_kwargs(model32, cache),
                attention_mask=mask[:, :1], cache_position=torch.arange(1, device=tok.device))
    for layer, (k, v) in zip(cache.layers, snapshot):
        layer.keys.copy_(k)
        layer.values.copy_(v)
    rewind(cache, kv_len)
    logits = decode(model32, cache, tok, mask, kv_len, steps, keep_logits=True, forced=forced, tokens=tokens)
    del model32, cache
    return logits


def max_rel_err(logits, ref_logits) -> float:
    """max over steps of max |logits - ref| / max |ref| (per step, all rows and vocab)."""
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(logits, ref_logits))


def rewind(cache, kv_len: int):
    for layer in cache.layers:
        layer.cumulative_length.fill_(kv_len)
    if hasattr(cache, "max_kv_len"):  # our caches' host-side count: the kv length of the next one-token step
        cache.max_kv_len = kv_len + 1


def run_case(H, kv_len, args, device, dtype, modes, log, result, save, kv_cache_dtype="auto"):
    B = args.batch
    S = args.tokens
    max_len = kv_len + (args.steps * 3 + args.check_steps) * S + 64
    model = build_model(H, args.layers, args.hidden, args.vocab, dtype, device, small=args.smoke)
    cache = filled_cache(model, B, kv_len, max_len, device, kv_cache_dtype=kv_cache_dtype)
    mask = torch.ones(B, max_len, dtype=torch.long, device=device)
    if args.mask == "static":
        torch._dynamo.mark_static_address(mask)
    tok = torch.randint(1, args.vocab, (B, 1), device=device, generator=torch.Generator(device=device).manual_seed(2))
    result.update({"H": H, "kv_len": kv_len, "batch": B, "layers": args.layers, "hidden": args.hidden,
                   "dtype": str(dtype).replace("torch.", ""), "mask": args.mask, "step": args.step,
                   "mla_options": args.mla_options, "kv_cache_dtype": kv_cache_dtype, "tokens": S,
                   "modes": {}})
    snapshot = [(lay.keys.clone(), lay.values.clone()) for lay in cache.layers]

    def restore():
        for lay, (k, v) in zip(cache.layers, snapshot):
            lay.keys.copy_(k)
            lay.values.copy_(v)
        rewind(cache, kv_len)

    ref_logits = ref_tokens = ref32_logits = None
    for mode in modes:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        entry = {}
        try:
            target = greedy_step(model) if args.step == "greedy" else model
            step_model = model if args.step == "greedy" else None
            if mode == "eager":
                fn = target
            elif mode == "default":
                fn = torch.compile(target, mode="reduce-overhead", fullgraph=True)
            elif mode == "mla" or mode.startswith("mla:"):
                asked = {"decode_kernel": mode[4:]} if mode.startswith("mla:") else {}
                if kv_cache_dtype == "fp8_ue8m0":
                    asked["fp8_scale_fmt"] = "ue8m0"
                fn = torch.compile(target, backend="mla_dcp",
                                   options={"mode": "reduce-overhead", **args.mla_options, **asked}, fullgraph=True)
            else:
                raise ValueError(f"unknown mode {mode}")
            # correctness: the same first steps from the same cache state
            restore()
            t0 = time.perf_counter()
            forced = ref_tokens if mode != "eager" else None  # same inputs every step as eager's greedy path
            logits = decode(fn, cache, tok, mask, kv_len, args.check_steps, keep_logits=True, forced=forced,
                            model=step_model, tokens=S)
            sync(device)
            entry["first_steps_s"] = time.perf_counter() - t0  # includes compilation / graph capture
            if mode == "eager":
                ref_logits = logits
                ref_tokens = torch.cat([tok] + [lg[:, -args.vocab:].argmax(-1, keepdim=True) for lg in logits[:-1]], 1)
                if args.fp32_ref:
                    try:
                        latent = snapshot if kv_cache_dtype == "auto" else dequantized_snapshot(cache, max_len)
                        ref32_logits = fp32_logits(model, latent, kv_len, max_len, tok, mask, ref_tokens,
                                                   args.check_steps, S)
                    except torch.OutOfMemoryError as e:  # the fp32 eager expansion is the largest tensor here
                        result["fp32_ref_error"] = f"OutOfMemoryError: {e}"[:300]
                        torch.cuda.empty_cache()
            elif ref_logits is not None:
                err = max_rel_err(logits, ref_logits)
                agree = sum(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(logits, ref_logits))
                entry["max_rel_err_vs_eager"] = err
                entry["token_steps_agree"] = f"{agree}/{len(logits)}"
                entry["ok"] = bool(err < (2e-2 if dtype == torch.bfloat16 else 1e-4))
            if ref32_logits is not None:
                entry["max_rel_err_vs_fp32"] = max_rel_err(logits, ref32_logits)
            entry["rewrites"] = int(torch._dynamo.utils.counters["mla_compile"].get("mla_attention_rewritten", 0))
            entry["multi_token_rewrites"] = int(torch._dynamo.utils.counters["mla_compile"].get(
                "mla_attention_multi_token_rewritten", 0))
            # timing: warm-up, then `runs` timed runs of `steps` steps (the cache keeps growing; rewound each run)
            times = []
            for rep in range(args.runs + 1):
                rewind(cache, kv_len + args.check_steps * S)
                sync(device)
                t0 = time.perf_counter()
                decode(fn, cache, tok, mask, kv_len + args.check_steps * S, args.steps, model=step_model, tokens=S)
                sync(device)
                if rep:
                    times.append((time.perf_counter() - t0) / args.steps)
            ms = statistics.median(times) * 1e3
            entry.update(ms_per_step=ms, tokens_per_s=B * S / (ms / 1e3), all_ms=[t * 1e3 for t in times])
        except Exception as e:  # noqa: BLE001 - recorded, the next mode still runs
            entry["error"] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        result["modes"][mode] = entry
        log(f"H={H} kv={kv_len} {mode}: {json.dumps(entry)}")
        save()  # after every mode: a timeout later keeps what is done
    m, d = result["modes"].get("mla", {}), result["modes"].get("default", {})
    if "ms_per_step" in m and "ms_per_step" in d:
        result["speedup_mla_vs_default"] = d["ms_per_step"] / m["ms_per_step"]
    e = result["modes"].get("eager", {})
    if "ms_per_step" in m and "ms_per_step" in e:
        result["speedup_mla_vs_eager"] = e["ms_per_step"] / m["ms_per_step"]
    del model, cache, snapshot
    save()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--kv", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--check-steps", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per mode (ms/step is their median)")
    ap.add_argument("--modes", nargs="+", default=["eager", "default", "mla"])
    ap.add_argument("--mask", choices=["input", "static"], default="input",
                    help="how the attention mask reaches the compiled modes (see the module docstring)")
    ap.add_argument("--step", choices=["model", "greedy"], default="model",
                    help="what each mode compiles: the HF model (the greedy pick runs eagerly after it), or a step "
                         "function = model + greedy pick (one graph, as serving loops compile it)")
    ap.add_argument("--mla-options", type=json.loads, default={}, help="JSON dict of extra mla_dcp options")
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "fp8_e4m3", "fp8_ue8m0"],
                    help="latent cache dtypes, one case each: auto (HF StaticCache, model dtype), fp8_e4m3 (the FP8 "
                         "latent cache, DSAStaticCache), fp8_ue8m0 (that cache with power-of-two scales, promised "
                         "to mla)")
    ap.add_argument("--tokens", type=int, default=1, choices=range(1, 9), metavar="S",
                    help="query tokens per request a step: 2 .. 8 times a speculative-verification step")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU ok, fp32): checks the script")
    ap.add_argument("--no-fp32-ref", dest="fp32_ref", action="store_false",
                    help="skip the fp32-model reference logits (max_rel_err_vs_fp32)")
    args = ap.parse_args(argv)

    import mla_compile  # noqa: F401  (the backend is also found by entry point; import registers the ops)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.smoke:
        args.heads, args.kv, args.batch, args.layers, args.hidden, args.vocab = [4], [64], 2, 1, 64, 128
        args.steps, args.check_steps = 3, 2
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    report = {"env": env, "args": vars(args), "cases": []}

    def log(msg):
        print(msg, flush=True)

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    if device.type == "cpu":
        env["cpu_threads"] = 1 if args.smoke else torch.get_num_threads()
        print(f"[hf_decode] {NOTE}", flush=True)
    with cpu_threads(device, args.smoke):
        for H in args.heads:
            for kv in args.kv:
                for kv_dtype in args.kv_cache_dtype:
                    report["cases"].append({})
                    run_case(H, kv, args, device, dtype, args.modes, log, report["cases"][-1], save, kv_dtype)
    if device.type == "cpu":
        print(f"({NOTE})")
    print(f"S = {args.tokens} query tokens a step")
    print(f"{'H':>4} {'kv':>6} {'cache':>9} " + " ".join(f"{m + ' tok/s':>14}" for m in args.modes) + "  mla/default")
    for c in report["cases"]:
        cols = [f"{c['modes'].get(m, {}).get('tokens_per_s', float('nan')):14.1f}" for m in args.modes]
        print(f"{c['H']:>4} {c['kv_len']:>6} {c['kv_cache_dtype']:>9} " + " ".join(cols)
              + f"  {c.get('speedup_mla_vs_default', float('nan')):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
