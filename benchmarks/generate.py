"""HF `generate()` end to end, the road users take: HF eager vs HF's own static-cache compile vs `mla_dcp`.

usage:  python benchmarks/generate.py OUT.json [--heads 16 128] [--prompt 1024 4096 16384 32768] [--batch 1 4 8]
                                              [--new 64] [--layers 4] [--modes eager hf mla] [--runs 2]
        python benchmarks/generate.py OUT.json --smoke        # tiny shapes, CPU ok (checks the script itself)

Model: DeepseekV3ForCausalLM with real MLA dims (kv_lora 512, rope 64, nope 128, v 128, q_lora 1536), hidden 2048,
`--layers` layers of which the first is dense and the rest MoE (8 routed experts, top-2), random weights spread to
1/sqrt(fan_in) (decisive greedy tokens), bf16, sdpa attention. Prompts are random ids; batch rows after the first are
left-padded by a few tokens (a real batch of unequal prompts).

Modes, each a plain `model.generate(ids, attention_mask=..., max_new_tokens=N, do_sample=False,
cache_implementation="static", ...)`:
  eager    `disable_compile=True`: HF eager decode (kv_b_proj over the whole cache every step)
  hf       HF's own auto-compile of the decode step (torch.compile(mode="reduce-overhead"), Inductor, CUDA graphs)
  mla      the documented road: `mla_compile.integrations.hf.optimize_generate(model)` once (HF's auto-compile with
           our backend, mode "reduce-overhead": CUDA-graph trees; the mask built in the graph; HF's DeferredStopCheck
           on CUDA; the static cache kept and reset across calls), then plain generate() calls
  mla_config   only `compile_config=mla_compile.integrations.hf.compile_config()` (CompileConfig(backend="mla_dcp"))
  mla_default  `optimize_generate(model, mode="default")`: our backend without CUDA graphs
  mla_default_cpp  the same with Inductor's C++ wrapper (`cpp_wrapper=True`): the step's launches from C++, not
               Python (a default-mode step is host-bound)
  mla_fresh    `optimize_generate(model, reuse_cache=False)`: a new static cache per generate() call, as HF builds it
               (so the CUDA-graph trees record the decode graph again in every call)
  hf_deferred  HF's own auto-compile plus the deferred stop check alone (what HF would get from that part)
  mla_forward  the compiled-forward recipe: `model.forward = torch.compile(model.forward, backend="mla_dcp",
               mode="reduce-overhead")` + `disable_compile=True` (prefill compiled too, without CUDA graphs)
HF prefills eagerly in every mode but mla_forward (its auto-compile covers decode steps only).

Per (H, batch, prompt, mode): `first_call_s` (the first generate, compile and CUDA-graph capture included),
`e2e_s` (median of `--runs` later calls; tokens/s = batch * new / e2e_s), `prefill_s` (median generate with
max_new_tokens=1: prefill and the first pick, no decode step) and `decode_ms_per_token` = the median over runs
of (e2e - prefill) / (new - 1), each run's prefill timed right after its generate; `stop_checks`: which stop check
HF's generate() took in those runs (`count_stop_checks`). `env` names the host (`host_facts`: its CPU and the host
time of an eager torch.add, the unit host-bound steps scale with). Correctness: greedy tokens vs
eager's (`agree`: the fraction of rows x positions equal before each row's first disagreement; bf16 paths may part
at near-ties) and the rewrite counters. The JSON is rewritten after every
mode (a crash or timeout later keeps what is done).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_decode  # noqa: E402  (the same model builder and sync)
from cpu_timing import NOTE, cpu_threads  # noqa: E402
from hf_decode import sync  # noqa: E402


STOP_CHECKS = collections.Counter()  # this process's generate() calls by the stop check each took (count_stop_checks)


def count_stop_checks() -> collections.Counter:
    """Count in STOP_CHECKS, by class name, the stop checks HF's generate() makes from now on (once per process):
    which one a call took (DeferredStopCheck: the host reads the stop flag one step late and queues the next step
    meanwhile; StopCheck: it waits for the device every step, so host and device take turns). Every stop check runs
    StopCheck's __init__ (the deferred one through super()), so that is the one place counted. Returns STOP_CHECKS."""
    try:
        from transformers.generation.utils import StopCheck
    except ImportError:  # a transformers without stop-check classes: nothing to count
        return STOP_CHECKS
    init = StopCheck.__init__
    if not getattr(init, "_counted", False):
        def counted(self, *args, **kwargs):
            STOP_CHECKS[type(self).__name__] += 1
            return init(self, *args, **kwargs)

        counted._counted = True
        StopCheck.__init__ = counted
    return STOP_CHECKS


def host_facts(device) -> dict:
    """What a run's host is, so runs on other machines compare: the CPU model, and the host time of one eager
    `torch.add` on the device (us a call, the median of 5 loops of 400 calls: default-mode steps are host-bound, and
    this is the unit they scale with)."""
    facts = {}
    try:
        with open("/proc/cpuinfo") as f:
            facts["host_cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                                     None)
    except OSError:
        pass
    x = torch.zeros(16, device=device)
    loops = []
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(400):
            torch.add(x, 1)
        sync(device)
        loops.append((time.perf_counter() - t0) / 400 * 1e6)
    facts["host_floor_us"] = statistics.median(loops)
    return facts


def speedups_vs_hf(modes: dict) -> dict:
    """Each of our modes against HF's own compile ("hf"), from one case's mode results: `decode_speedup_<mode>_vs_hf`
    (HF's decode ms per token over the mode's; NaN where either is not positive: timing noise swamped the decode),
    `e2e_speedup_<mode>_vs_hf` (HF's generate() time over the mode's), and for "mla" `compile_ratio_mla_vs_hf`
    (first-call overhead over HF's)."""
    h, out = modes.get("hf", {}), {}
    if "decode_ms_per_token" not in h:
        return out
    for name, m in modes.items():
        if name in ("hf", "eager", "hf_deferred") or "decode_ms_per_token" not in m:
            continue
        both = m["decode_ms_per_token"] > 0 and h["decode_ms_per_token"] > 0
        out[f"decode_speedup_{name}_vs_hf"] = (h["decode_ms_per_token"] / m["decode_ms_per_token"] if both
                                               else float("nan"))
        out[f"e2e_speedup_{name}_vs_hf"] = h["e2e_s"] / m["e2e_s"]
        if name == "mla":
            out["compile_ratio_mla_vs_hf"] = (m["first_call_s"] - m["e2e_s"]) / max(h["first_call_s"] - h["e2e_s"],
                                                                                     1e-9)
    return out


def summary_lines(cases: list, modes: list) -> list[str]:
    """The printed table: decode ms per token of every mode, then each of our modes' decode and end-to-end speedup
    over HF's compile (the `speedups_vs_hf` of the case)."""
    ours = [m for m in modes if m not in ("hf", "eager", "hf_deferred")]
    lines = [f"{'H':>4} {'B':>3} {'prompt':>6} " + " ".join(f"{m + ' ms/tok':>18}" for m in modes)
             + "".join(f"  {'decode ' + m + '/hf':>20} {'e2e ' + m + '/hf':>17}" for m in ours)]
    for c in cases:
        cols = [f"{c['modes'].get(m, {}).get('decode_ms_per_token', float('nan')):18.3f}" for m in modes]
        ratios = "".join(f"  {c.get(f'decode_speedup_{m}_vs_hf', float('nan')):19.2f}x"
                         f" {c.get(f'e2e_speedup_{m}_vs_hf', float('nan')):16.2f}x" for m in ours)
        lines.append(f"{c['H']:>4} {c['batch']:>3} {c['prompt']:>6} " + " ".join(cols) + ratios)
    return lines


def build_model(H: int, layers: int, hidden: int, vocab: int, dtype, device, small: bool = False,
                attn_impl: str = "sdpa"):
    """hf_decode's model with MoE layers after the first (what a DeepSeek-V3 layer stack looks like)."""
    return hf_decode.build_model(H, layers, hidden, vocab, dtype, device, small=small, dense_layers=1,
                                 attn_impl=attn_impl)


def prompts(B: int, T: int, vocab: int, device, pad: int = 3):
    g = torch.Generator().manual_seed(T * 31 + B)
    ids = torch.randint(1, vocab, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for b in range(1, B):
        ids[b, :pad * b % max(T // 4, 1)] = 0
        mask[b, :pad * b % max(T // 4, 1)] = 0
    return ids.to(device), mask.to(device)


def _hf_compile_config():
    from transformers import CompileConfig

    cfg = CompileConfig()  # HF's defaults: Inductor, "reduce-overhead"
    cfg._compile_all_devices = True  # CPU smoke runs: HF auto-compiles on CUDA only
    return cfg


def set_up_mode(model, mode: str) -> None:
    """What a mode installs on the model once (`optimize_generate`), after undoing the previous mode's."""
    from mla_compile.integrations.hf import optimize_generate

    for attr in ("generate", "create_masks_for_generate", "_prepare_static_cache", "forward"):  # what modes set
        vars(model).pop(attr, None)
    model.generation_config.compile_config = None
    if mode == "mla_forward":
        model.forward = torch.compile(model.forward, backend="mla_dcp", mode="reduce-overhead")
    elif mode == "mla":
        optimize_generate(model)
    elif mode == "mla_fresh":
        optimize_generate(model, reuse_cache=False)
    elif mode == "mla_default":
        optimize_generate(model, mode="default")
    elif mode == "mla_default_cpp":
        optimize_generate(model, mode="default", cpp_wrapper=True)
    elif mode == "hf_deferred":
        optimize_generate(model, masks_in_graph=False)
        model.generation_config.compile_config = _hf_compile_config()


def generate_kwargs(mode: str) -> dict:
    """generate() keywords of a mode (after `set_up_mode`)."""
    if mode in ("eager", "mla_forward"):
        return dict(disable_compile=True)
    if mode == "hf":
        return dict(compile_config=_hf_compile_config())
    if mode == "mla_config":
        from mla_compile.integrations.hf import compile_config

        return dict(compile_config=compile_config())
    if mode in ("mla", "mla_default", "mla_default_cpp", "mla_fresh", "hf_deferred"):
        return {}
    raise ValueError(f"unknown mode {mode!r}")


def agreement(tokens: torch.Tensor, ref: torch.Tensor) -> float:
    """Fraction of (row, position) equal to ref before the row's first disagreement."""
    same = (tokens == ref).int().cumprod(-1)
    return same.float().mean().item()


def fp32_error(model32, ids, mask, toks, logits) -> float:
    """max over steps of max|logits - ref| / max|ref|, ref = the fp32 model teacher-forced on the same tokens
    (one eager forward over prompt + generated tokens): a mode's own error, apart from bf16 greedy paths parting."""
    seq = torch.cat([ids, toks], 1)
    full_mask = torch.cat([mask, torch.ones_like(toks)], 1)
    with torch.no_grad():
        ref = model32(seq, attention_mask=full_mask).logits[:, ids.shape[1] - 1:-1].float()
    err = (logits.float() - ref).abs().amax(dim=(0, 2)) / ref.abs().amax(dim=(0, 2))
    return err.max().item()


def run_case(H, B, T, args, device, dtype, log, result, save):
    model = build_model(H, args.layers, args.hidden, args.vocab, dtype, device, small=args.smoke)
    model.generation_config.pad_token_id = 0
    ids, mask = prompts(B, T, args.vocab, device)
    result.update(H=H, batch=B, prompt=T, new=args.new, layers=args.layers, hidden=args.hidden,
                  dtype=str(dtype).replace("torch.", ""), modes={})

    def gen(mode, new, logits=False):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 cache_implementation="static", output_logits=logits, return_dict_in_generate=logits,
                                 **generate_kwargs(mode))
        sync(device)
        if logits:
            return out.sequences[:, T:], torch.stack(out.logits, 1)
        return out[:, T:]

    model32 = None
    if args.fp32_check_max_prompt >= T and dtype != torch.float32:
        import copy

        model32 = copy.deepcopy(model).float()

    ref = None
    for mode in args.modes:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        for attr in ("_compiled_call", "_last_compile_config"):  # HF keeps its compiled call on the model
            if hasattr(model, attr):
                delattr(model, attr)
        set_up_mode(model, mode)
        entry = {}
        try:
            t0 = time.perf_counter()
            toks, logits = gen(mode, args.new, logits=True)
            entry["first_call_s"] = time.perf_counter() - t0
            if model32 is not None:
                entry["max_rel_err_vs_fp32"] = fp32_error(model32, ids, mask, toks, logits)
            c = torch._dynamo.utils.counters
            entry["rewritten"] = int(c["mla_compile"].get("mla_attention_rewritten", 0))
            entry["not_rewritten"] = int(c["mla_compile"].get("mla_attention_not_rewritten", 0))
            entry["graphs"] = int(c["stats"].get("unique_graphs", 0))
            if mode == "eager":
                ref = toks
            elif ref is not None:
                entry["agree"] = agreement(toks, ref)
            e2e, pre = [], []
            made = dict(STOP_CHECKS)
            for _ in range(args.runs):
                t0 = time.perf_counter()
                gen(mode, args.new)
                e2e.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                gen(mode, 1)
                pre.append(time.perf_counter() - t0)
            e, p = statistics.median(e2e), statistics.median(pre)
            # paired per run (each prefill timed right after its generate): a difference of two noisy medians can
            # go negative where decode is a small part of the call (tiny CPU smoke runs)
            decode = statistics.median(a - b for a, b in zip(e2e, pre))
            entry["stop_checks"] = {k: v - made.get(k, 0) for k, v in STOP_CHECKS.items() if v - made.get(k, 0)}
            entry.update(e2e_s=e, prefill_s=p, tokens_per_s=B * args.new / e,
                         decode_ms_per_token=decode / (args.new - 1) * 1e3, all_e2e_s=e2e)
        except Exception as exc:  # noqa: BLE001 - recorded; the next mode still runs
            entry["error"] = f"{type(exc).__name__}: {exc}"[:3000]
            traceback.print_exc()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        result["modes"][mode] = entry
        log(f"H={H} B={B} T={T} {mode}: {json.dumps(entry)}")
        save()
    result.update(speedups_vs_hf(result["modes"]))
    m = result["modes"].get("mla", {})
    if "max_rel_err_vs_fp32" in m and "max_rel_err_vs_fp32" in result["modes"].get("eager", {}):
        result["fp32_err_mla_over_eager"] = m["max_rel_err_vs_fp32"] / result["modes"]["eager"]["max_rel_err_vs_fp32"]
    del model, model32
    save()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--prompt", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--new", type=int, default=64, help="new tokens per generate")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--runs", type=int, default=2, help="timed calls per mode after the first")
    ap.add_argument("--modes", nargs="+", default=["eager", "hf", "mla"])
    ap.add_argument("--fp32-check-max-prompt", type=int, default=4096,
                    help="compare each mode's logits with an fp32 copy of the model at prompts up to this length")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU ok, fp32): checks the script")
    args = ap.parse_args(argv)

    import mla_compile

    count_stop_checks()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.smoke:
        args.heads, args.prompt, args.batch, args.layers, args.hidden, args.vocab = [4], [12], [2], 2, 64, 128
        args.new, args.runs = 4, 1
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "mla_compile": str(Path(mla_compile.__file__).parent), **host_facts(device)}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    report = {"env": env, "args": vars(args), "cases": []}

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    if device.type == "cpu":
        env["cpu_threads"] = 1 if args.smoke else torch.get_num_threads()
        print(f"[generate] {NOTE}", flush=True)
    with cpu_threads(device, args.smoke):
        for H in args.heads:
            for B in args.batch:
                for T in args.prompt:
                    report["cases"].append({})
                    run_case(H, B, T, args, device, dtype, lambda s: print(s, flush=True), report["cases"][-1], save)
    if device.type == "cpu":
        print(f"({NOTE})")
    print("\n".join(summary_lines(report["cases"], args.modes)))
    errors = [m for c in report["cases"] for m, e in c["modes"].items() if "error" in e]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
