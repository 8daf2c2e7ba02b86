"""Benchmark tooling that runs on any machine: the HF step profile's categories, on a recorded H200 profile."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import hf_profile  # noqa: E402


def test_profile_categories_split_the_step_exactly():
    rows = json.loads((ROOT / "benchmarks/data/hf_profile_round5.json").read_text())["rows"]
    row = next(r for r in rows if r["kv_len"] == 32768)
    cats = hf_profile.categorize(row)
    assert sum(cats.values()) == pytest.approx(row["wall_us_per_step"])
    # the stage-1 + merge kernels, the fused pairs and cuBLAS GEMMs, the harness's mask copy and argmax
    stage1 = sum(k["us_per_step"] for k in row["top"] if k["name"] == "_stage1_kernel")
    assert stage1 < cats["attention"] < stage1 + 25
    assert cats["projections"] > sum(k["us_per_step"] for k in row["top"] if k["name"] == "_linear_kernel")
    assert 0 < cats["harness (mask copy, argmax)"] < 40
    assert all(v > 0 for v in cats.values())


def test_profile_variants_set_their_tuning_and_env_then_restore(monkeypatch):
    # every experiment goes through the public surface: a Tuning and process-wide env switches, no private names
    from mla_compile import tuning

    monkeypatch.delenv("MLA_COMPILE_PDL", raising=False)
    for name, (_, _, tune, env) in hf_profile.VARIANTS.items():
        assert isinstance(tune, tuning.Tuning) and all(k.startswith("MLA_COMPILE_") for k in env), name
        with hf_profile.experiment(name):
            assert tuning.current() == tune
            assert all(os.environ[k] == v for k, v in env.items())
        assert tuning.current() == tuning.DEFAULT and "MLA_COMPILE_PDL" not in os.environ
    with hf_profile.experiment("static+nopdl"):
        assert os.environ["MLA_COMPILE_PDL"] == "0"
    with hf_profile.experiment("static+cublas_small"):
        assert tuning.current().lone_linear_min_k == 8192
    assert "MLA_COMPILE_PDL" not in os.environ


def test_gap_stats_buckets_and_largest_gaps():
    # two steps of three kernels: 0.5 us and 3 us gaps inside a step, 30 us between the steps
    spans = [(0, 10, "a"), (10.5, 20, "b"), (23, 30, "c"), (60, 70, "a"), (70.5, 80, "b"), (83, 90, "c")]
    stats = hf_profile.gap_stats(list(reversed(spans)), steps=2)  # order of the profiler's events must not matter
    b = stats["buckets"]
    assert b["0-1us"] == {"count_per_step": 1.0, "us_per_step": 0.5}
    assert b["2-5us"] == {"count_per_step": 1.0, "us_per_step": 3.0}
    assert b["20-infus"] == {"count_per_step": 0.5, "us_per_step": 15.0}
    assert b["1-2us"]["count_per_step"] == b["5-20us"]["count_per_step"] == 0
    assert stats["largest"][0] == {"us": 30, "after": "c", "before": "a"}
    assert sum(v["us_per_step"] for v in b.values()) == pytest.approx((90 - 2 * 26.5) / 2)  # span - busy


def test_generate_benchmark_smoke(tmp_path):
    """The generate() benchmark's harness on tiny shapes (CPU): every mode runs through HF's own generate, mla
    rewrites every layer of the decode graph and its greedy tokens equal eager's (fp32)."""
    import generate

    out = tmp_path / "generate.json"
    torch._dynamo.reset()
    assert generate.main([str(out), "--smoke", "--modes", "eager", "hf", "mla", "mla_forward"]) == 0
    (case,) = json.loads(out.read_text())["cases"]
    modes = case["modes"]
    assert set(modes) == {"eager", "hf", "mla", "mla_forward"} and not any("error" in m for m in modes.values())
    assert modes["mla"]["rewritten"] == 2 and modes["mla"]["agree"] == 1.0 and modes["hf"]["agree"] == 1.0
    assert modes["mla_forward"]["agree"] == 1.0
    # which stop check each mode's timed calls took (on a CPU HF's per-step one: it defers on mps, ours on CUDA)
    assert all(m["stop_checks"] == {"StopCheck": 2} for m in modes.values()), {k: m["stop_checks"] for k, m in
                                                                                  modes.items()}
    env = json.loads(out.read_text())["env"]
    assert env["host_floor_us"] > 0
    # timings of a tiny CPU run: computed, not compared (their sign is noise there; a NaN ratio says so)
    assert "decode_speedup_mla_vs_hf" in case and math.isfinite(modes["mla"]["decode_ms_per_token"])


def test_generate_modes_set_up_their_compile_config():
    """Each mode of the generate() benchmark installs the compile config it names (no generate run: the smoke test
    runs the modes end to end): the default-mode ones without CUDA graphs, the C++-wrapper one with Inductor's
    cpp_wrapper among the backend's options."""
    import generate

    model = generate.build_model(4, 2, 64, 128, torch.float32, torch.device("cpu"), small=True)
    generate.set_up_mode(model, "mla_default")
    cfg = model.generation_config.compile_config
    assert cfg.backend == "mla_dcp" and cfg.mode == "default" and not cfg.options
    generate.set_up_mode(model, "mla_default_cpp")
    cfg = model.generation_config.compile_config
    assert cfg.backend == "mla_dcp" and cfg.options == {"mode": "default", "cpp_wrapper": True}
    assert generate.generate_kwargs("mla_default_cpp") == {}


def test_generate_summary_compares_every_mode_of_ours_with_hf():
    """The generate() table: each of our modes (not only "mla") gets its decode and end-to-end speedup over HF's
    compile; a mode HF's compile is missing from gets no ratio (NaN in the table, no key)."""
    import generate

    modes = {"hf": dict(decode_ms_per_token=3.0, e2e_s=0.6, first_call_s=10.0),
             "mla_default": dict(decode_ms_per_token=2.0, e2e_s=0.5, first_call_s=11.0),
             "mla": dict(decode_ms_per_token=1.0, e2e_s=0.3, first_call_s=12.0),
             "eager": dict(decode_ms_per_token=9.0, e2e_s=2.0, first_call_s=2.0)}
    ratios = generate.speedups_vs_hf(modes)
    assert ratios == pytest.approx({"decode_speedup_mla_default_vs_hf": 1.5, "e2e_speedup_mla_default_vs_hf": 1.2,
                                    "decode_speedup_mla_vs_hf": 3.0, "e2e_speedup_mla_vs_hf": 2.0,
                                    "compile_ratio_mla_vs_hf": (12.0 - 0.3) / (10.0 - 0.6)})
    assert generate.speedups_vs_hf({k: v for k, v in modes.items() if k != "hf"}) == {}
    case = dict(H=16, batch=4, prompt=4096, modes=modes, **ratios)
    header, row = generate.summary_lines([case], ["hf", "mla_default", "mla"])
    assert "e2e mla_default/hf" in header and "e2e mla/hf" in header
    assert row.split()[-4:] == ["1.50x", "1.20x", "3.00x", "2.00x"]


@pytest.mark.parametrize("step", ["model", "greedy"])
def test_hf_decode_smoke_both_step_kinds(tmp_path, step, capsys):
    """The HF benchmark's harness on tiny shapes (CPU): every mode runs, mla rewrites the layer and matches eager,
    with the greedy pick after the compiled model or inside a compiled step function."""
    import hf_decode

    out = tmp_path / "hf.json"
    torch._dynamo.reset()
    threads = torch.get_num_threads()
    assert hf_decode.main([str(out), "--smoke", "--mask", "static", "--step", step]) == 0
    assert torch.get_num_threads() == threads  # the smoke run's one thread is restored
    report = json.loads(out.read_text())
    assert report["env"]["cpu_threads"] == 1 and "not representative" in capsys.readouterr().out
    (case,) = report["cases"]
    assert case["step"] == step and case["mask"] == "static"
    modes = case["modes"]
    assert set(modes) == {"eager", "default", "mla"} and not any("error" in m for m in modes.values())
    assert modes["mla"]["rewrites"] == 1 and modes["mla"]["ok"] and modes["default"]["ok"]
    assert modes["mla"]["token_steps_agree"] == "2/2"


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_ue8m0"])
def test_hf_decode_smoke_fp8_cache(tmp_path, kv_cache_dtype):
    """`--kv-cache-dtype fp8_e4m3` (and fp8_ue8m0: power-of-two scales, promised to mla): the FP8 latent cache filled
    through the quantizing write; mla rewrites the layer over it and matches eager HF over the same cache."""
    import hf_decode

    out = tmp_path / "hf.json"
    torch._dynamo.reset()
    assert hf_decode.main([str(out), "--smoke", "--modes", "eager", "mla", "--kv-cache-dtype", kv_cache_dtype]) == 0
    (case,) = json.loads(out.read_text())["cases"]
    modes = case["modes"]
    assert case["kv_cache_dtype"] == kv_cache_dtype and not any("error" in m for m in modes.values())
    assert modes["mla"]["rewrites"] == 1 and modes["mla"]["ok"] and modes["mla"]["token_steps_agree"] == "2/2"


def test_hf_decode_smoke_kernel_modes(tmp_path):
    """`--modes mla:bogus mla:triton`: the step with a decode kernel asked for (`options={"decode_kernel": K}`); a
    kernel name the backend does not know is that mode's recorded error, the next mode still runs and rewrites."""
    import hf_decode

    out = tmp_path / "hf.json"
    torch._dynamo.reset()
    assert hf_decode.main([str(out), "--smoke", "--modes", "mla:bogus", "mla:triton", "--no-fp32-ref"]) == 0
    (case,) = json.loads(out.read_text())["cases"]
    modes = case["modes"]
    assert "decode_kernel" in modes["mla:bogus"]["error"]
    assert "error" not in modes["mla:triton"] and modes["mla:triton"]["rewrites"] == 1


def test_hf_decode_smoke_verification_step(tmp_path):
    """`--tokens 3`: every step verifies 3 tokens per request; mla rewrites it (multi-token) and matches eager on
    all 3 positions' logits."""
    import hf_decode

    out = tmp_path / "hf.json"
    torch._dynamo.reset()
    assert hf_decode.main([str(out), "--smoke", "--tokens", "3", "--modes", "eager", "mla", "--no-fp32-ref"]) == 0
    (case,) = json.loads(out.read_text())["cases"]
    mla = case["modes"]["mla"]
    assert case["tokens"] == 3 and "error" not in mla, mla
    assert mla["multi_token_rewrites"] == 1 and mla["ok"] and mla["token_steps_agree"] == "2/2"


def test_scaling_fit_recovers_fixed_cost_and_rate():
    import decode_sweep

    copy_bw = 4.0e12
    rows = [{"bytes": b, "stage1_us": 12.5 + b / 3.6e12 * 1e6} for b in (7.5e7, 1.5e8, 3.0e8, 6.0e8)]
    fit = decode_sweep.fit_fixed_and_rate(rows, "stage1", copy_bw)
    assert abs(fit["fixed_us"] - 12.5) < 1e-6 and abs(fit["rate_TBps"] - 3.6) < 1e-9
    assert abs(fit["rate_frac_of_copy"] - 0.9) < 1e-9



def test_profile_ab_compiles_each_variant_and_times_them_round_robin(tmp_path):
    """`hf_profile.py --ab`: every variant compiled (its own rewrite of the layer) on one model and cache, each
    timed once per round."""
    from torch._dynamo.utils import counters

    counters.clear()
    out = tmp_path / "ab.json"
    variants = ["static", "static+session6"]
    assert hf_profile.main([str(out), "--smoke", "--ab", "3", "--variants", *variants, "--step", "greedy"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["rounds"] == 3 and sorted(row["median_us_per_step"]) == sorted(variants)
    assert all(len(row["samples_us_per_step"][v]) == 3 and min(row["samples_us_per_step"][v]) > 0 for v in variants)
    assert counters["mla_compile"]["mla_attention_rewritten"] == len(variants)  # one layer, once per variant
    assert not torch._inductor.config.force_disable_caches  # the script's setting ends with it


def test_ops_report_shows_the_replaced_kernel_and_judges_goals_on_graph_time():
    # benchmarks/report.py on two hand-made rows: graph-time ratio, the TMA kernel's column only when timed,
    # and the H=128 TFLOP/s goal from the graph time (flops 2*B*H*L*(512+64+512))
    import report

    row = dict(H=128, B=8, L=32768, splits=8, triton_ms=0.30, triton_graph_ms=0.20, flashinfer_ms=0.16,
               triton_tma_graph_ms=0.27)
    h16 = {k: v for k, v in row.items() if k != "triton_tma_graph_ms"} | {"H": 16}
    d = {"copy_bw_TBps": 4.0, "decode": [row, h16]}
    text = "\n".join(report.ops_block(d))
    assert "TMA graph us" in text
    h128 = next(ln for ln in text.splitlines() if ln.startswith("| 128 |"))
    assert "| 200.0 | 270.0 | 300.0 | 160.0 | 1.25 |" in h128
    assert "TMA graph us" not in "\n".join(report.ops_block({"copy_bw_TBps": 4.0, "decode": [h16]}))
    goals = {g[1]: g for g in report.ops_goals(d)}
    tflops = 2 * 8 * 128 * 32768 * 1088 / 0.20e-3 / 1e12
    assert goals["H=128: >= 550 TFLOP/s"][2].startswith(f"max {tflops:.0f} ")
    assert goals["ratio Triton/FlashInfer <= 1.0 at kv_len >= 8K, H=128 (graph time)"][3] == "**not met**"


def test_dcp_report_shows_flashmla_on_the_local_shard_where_it_ran():
    # dcp_gpu.py's `local_flashmla` peer: a column per n where any row has it, its failed cross-check said in the cell
    import report

    def run(n, **extra):
        row = dict(H=16, B=8, L=32768, dcp_ms=0.1 / n, local_ms=0.09 / n, comm_merge_frac=0.05, **extra)
        return {"n": n, "device": "NVIDIA H100 80GB HBM3", "shapes": {"R": report.R}, "bench": [row]}

    plain = "\n".join(report.dcp_block({"runs": {"1": run(1), "2": run(2)}}))
    assert "local FlashMLA" not in plain
    text = "\n".join(report.dcp_block({"runs": {"1": run(1, local_flashmla_ms=0.08, local_flashmla_ok=True),
                                                "2": run(2, local_flashmla_ms=0.04, local_flashmla_ok=False)}}))
    assert "| n=1 local FlashMLA us | n=2 local FlashMLA us |" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| 16 |"))
    assert row.endswith("| 80.0 | 40.0 (check FAILED) |"), row


# ------------------------------------------------------------------- report: device results are not replaced
def _report_tree(tmp_path, monkeypatch):
    """A copy of RESULTS.md, benchmarks/data/hf.json (the committed H200 run) and an empty plots dir, with
    report.HERE pointed at it, so the defaults the report writes to are the copies."""
    import report

    here = tmp_path / "benchmarks"
    (here / "data").mkdir(parents=True)
    (here / "plots").mkdir()
    (here / "RESULTS.md").write_text((ROOT / "benchmarks/RESULTS.md").read_text())
    h200 = json.loads((ROOT / "benchmarks/data/hf.json").read_text())
    assert report.provenance("hf", h200) == (True, "device NVIDIA H200")
    (here / "data/hf.json").write_text(json.dumps(h200))
    monkeypatch.setattr(report, "HERE", here)
    return report, here, h200


def _smoke_run(tmp_path, h200, **env):
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    smoke = json.loads(json.dumps(h200))
    smoke["env"].update(env)
    smoke["args"]["smoke"] = True
    (run / "hf.json").write_text(json.dumps(smoke))
    return run


@pytest.mark.parametrize("env", [{"device": "cpu"}, {}], ids=["cpu", "gpu-smoke"])
@pytest.mark.parametrize("plots", [False, True], ids=["md", "plots-only"])
def test_report_refuses_to_replace_device_results_with_smoke_or_cpu_data(tmp_path, monkeypatch, capsys, env, plots):
    report, here, h200 = _report_tree(tmp_path, monkeypatch)
    run = _smoke_run(tmp_path, h200, **env)
    before = {p: p.read_bytes() for p in here.rglob("*") if p.is_file()}
    # md: RESULTS.md and data/ would be rewritten; plots-only: --md-out elsewhere, but PNGs into the default dir
    argv = [str(run), "--no-plots"] if not plots else [str(run), "--md-out", str(tmp_path / "out.md")]
    assert report.main(argv) == 1
    err = capsys.readouterr().err
    assert "refusing to replace device results: hf:" in err and "NVIDIA H200" in err and "--force" in err
    assert {p: p.read_bytes() for p in here.rglob("*") if p.is_file()} == before  # nothing written
    assert not (tmp_path / "out.md").exists()


def test_report_force_replaces_and_device_or_elsewhere_runs_pass(tmp_path, monkeypatch):
    report, here, h200 = _report_tree(tmp_path, monkeypatch)
    run = _smoke_run(tmp_path, h200, device="cpu")
    # rendering somewhere else (no PNGs into the committed plots) is not a replacement
    assert report.main([str(run), "--md-out", str(tmp_path / "out.md"), "--no-plots"]) == 0
    assert json.loads((here / "data/hf.json").read_text()) == h200
    # a device run replaces a device run
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    (gpu / "hf.json").write_text(json.dumps(h200 | {"note": "newer"}))
    assert report.main([str(gpu), "--no-plots"]) == 0
    assert json.loads((here / "data/hf.json").read_text())["note"] == "newer"
    # --force replaces device results with the smoke run
    assert report.main([str(run), "--no-plots", "--force"]) == 0
    assert json.loads((here / "data/hf.json").read_text())["env"]["device"] == "cpu"
    # and once the stored run is a smoke run, another smoke run needs no --force
    assert report.main([str(run), "--no-plots"]) == 0


@pytest.mark.parametrize("suite,d,device", [
    ("ops", {"device": "NVIDIA H200"}, True),
    ("dcp", {"runs": {"1": {"device": "NVIDIA H200"}, "2": {"device": "NVIDIA H200"}}}, True),
    ("dcp", {"runs": {"1": {"device": "cpu"}, "2": {"device": "cpu"}}}, False),
    ("hf", {"env": {"device": "cpu"}, "args": {"smoke": True}}, False),
    ("compile", {"device": "cuda", "device_name": "NVIDIA H200"}, True),
    ("compile", {"device": "cpu", "device_name": "cpu"}, False),
    ("dsa", [{"batch": 8}], True),  # dsa_gpu.py runs on CUDA only
    ("host", {"provenance": "cuda: NVIDIA H200"}, True),
    ("host", {"provenance": "cpu"}, False),
])
def test_report_provenance_reads_what_each_script_records(suite, d, device):
    import report

    assert report.provenance(suite, d)[0] is device


def run_script(script, argv, monkeypatch):
    """benchmarks/<script> as `python benchmarks/<script> argv...`, in this process (no torch import per
    script): returns its exit status."""
    import runpy

    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / script), *argv])
    monkeypatch.setattr(sys, "path", [str(ROOT / "benchmarks"), *sys.path])  # the scripts insert paths too
    try:
        runpy.run_path(str(ROOT / "benchmarks" / script), run_name="__main__")
    except SystemExit as e:
        return e.code
    return 0


@pytest.mark.parametrize("script", ["bench_ops.py", "decode_sweep.py", "dsa_gpu.py",
                                    "hf_decode.py", "hf_profile.py", "dcp_gpu.py", "linear_sweep.py",
                                    "compile_suite.py", "families.py", "host_overhead.py"])
def test_benchmark_scripts_print_help_without_cuda(script, monkeypatch, capsys):
    assert run_script(script, ["--help"], monkeypatch) == 0
    assert capsys.readouterr().out.startswith("usage:")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
@pytest.mark.parametrize("script", ["bench_ops.py", "decode_sweep.py", "dsa_gpu.py"])
def test_gpu_benchmark_scripts_say_they_need_cuda(script, tmp_path, monkeypatch, capsys):
    assert run_script(script, [str(tmp_path / "x.json")], monkeypatch) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_families_arguments_and_cases():
    import families

    a = families.parse_args(["x.json"])
    assert a.families == list(families.FAMILIES) and a.modes == list(families.MODES) and a.kv == 32768
    assert a.batch == 8 and a.layers == 4
    with pytest.raises(SystemExit):
        families.parse_args(["x.json", "--families", "llama"])
    # V3.2: its dense graph at the largest kv that stays <= top-k through every step, then the sparse one
    assert families.cases(a, "deepseek_v32", 2048) == [("dense", 2048 - (a.check_steps + a.steps + 1)),
                                                       ("sparse", 32768)]
    assert families.cases(a, "deepseek_v3", None) == [("", 32768)]


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32", "glm4_moe_lite", "kimi_linear", "mistral4"])
def test_families_configs_keep_the_real_attention(family):
    """Only the fields the benchmark says it scales differ from the family's defaults (the attention is real)."""
    import families
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg, scaled = families.family_config(family)
    real = CONFIG_MAPPING[family]().to_dict()
    got = cfg.to_dict()
    for k in ("num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
              "q_lora_rank", "hidden_size", "index_n_heads", "index_topk"):
        if k in real:
            assert got[k] == real[k] and k not in scaled, k
    assert got["num_hidden_layers"] == 4 and got["vocab_size"] == 32768
    assert {k for k in got if got[k] != real.get(k)} <= set(scaled) | {"pad_token_id", "bos_token_id", "eos_token_id",
                                                                          "_attn_implementation_internal"}
    if family == "kimi_linear":
        assert got["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]


def test_families_cache_state_round_trips():
    """The tiny DSA model's cache: filled, snapshot, advanced by a step, restored exactly (lengths included)."""
    import families

    model, _ = families.build("deepseek_v32", torch.float32, torch.device("cpu"), tiny=True)
    cache = families.new_cache(model, 16)
    families._init_cache(model, cache, 2, torch.device("cpu"))
    families.fill(cache, 8)
    snap = [t.clone() for t in families.state(cache)]
    assert cache.layers[0].keys[:, :, :8].abs().sum() > 0 and cache.layers[0].keys[:, :, 8:].abs().sum() == 0
    assert cache.layers[0].indexer_keys[:, :8].abs().sum() > 0 and cache.max_kv_len == 9
    mask = torch.ones(2, 16, dtype=torch.long)
    families.decode(model, cache, torch.ones(2, 1, dtype=torch.long), mask, 8, 1)
    assert int(cache.layers[0].cumulative_length) == 9 and cache.max_kv_len == 10
    for t, s in zip(families.state(cache), snap):
        t.copy_(s)
    families.rewind(cache, 8)
    assert all(torch.equal(t, s) for t, s in zip(families.state(cache), snap)) and cache.max_kv_len == 9


def test_host_overhead_runs_its_cpu_parts_and_the_report_judges_the_goals(tmp_path, monkeypatch):
    """benchmarks/host_overhead.py without a GPU: the registration and check timings (meta tensors), every op's
    check timed both ways; report.py's host block and goals from a CUDA-shaped file."""
    import report

    out = tmp_path / "host.json"
    assert run_script("host_overhead.py", [str(out), "--calls", "5"], monkeypatch) == 0
    d = json.loads(out.read_text())
    assert d["provenance"] == "cpu" and set(d["registration"]) == {"custom_op_us", "define_us", "body_alone_us"}
    assert len(d["glue"]) == 3 and all(v > 0 for v in d["glue"].values())
    assert "mla.decode" in d["checks"] and all(v["repeated_us"] > 0 and v["whole_us"] > 0
                                                 for v in d["checks"].values())
    d.update(provenance="cuda: NVIDIA H200", ops={"mla.decode": 38.0, "mla.merge_states": 31.0,
                                                  "peer: flashinfer run": 23.0})
    goals = {row[1].split(" host us")[0]: row[3] for row in report.host_goals(d)}
    assert goals == {"mla.decode": "met", "mla.merge_states": "not met"}
    assert "| peer: flashinfer run | 23.0 | 1.00 | - |" in "\n".join(report.host_block(d))
    # a host twice as slow (FlashInfer's run 46 us): the goals scale with it, so the verdicts stay
    d["ops"] = {k: 2 * v for k, v in d["ops"].items()}
    assert {row[1].split(" host us")[0]: row[3] for row in report.host_goals(d)} == goals
    assert "<= 1.74x its run (80.0 us in this loop)" in report.host_goals(d)[0][1]
    # without FlashInfer in the loop: the absolute goals
    d["ops"] = {"mla.decode": 38.0, "mla.merge_states": 29.0}
    assert [(row[1], row[3]) for row in report.host_goals(d)] == [
        ("mla.decode host us per eager call <= 40", "met"), ("mla.merge_states host us per eager call <= 30", "met")]


def test_host_rows_are_timed_round_robin(monkeypatch):
    """host_overhead's op table: every call timed once per round, in turn (a drifting host moves all rows alike),
    one warm call each first, and each row the median of its rounds."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import host_overhead as H

    order = []
    rows = H.host_us_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, H.REPEATS * 2)
    assert set(rows) == {"a", "b"} and all(v > 0 for v in rows.values())
    assert order[:2] == ["a", "b"] and order[2:] == (["a"] * 2 + ["b"] * 2) * H.REPEATS


def test_host_cpu_probe_times_every_op_through_its_cuda_impl(tmp_path):
    """benchmarks/lab/host_cpu.py (a subprocess: it rewires torch._C's CUDA getters and our ops' CPU impls): every op
    of host_overhead's table is timed, each through its CUDA impl's plan (so the probe times the GPU path's Python,
    not the CPU reference), also inside compiled graphs, and host_ab.py tables two such runs against each other."""
    import subprocess

    out = tmp_path / "hostab_new_1.json"
    proc = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "benchmarks/lab/host_cpu.py"), "--calls", "20",
                           "--json", str(out), "--plans", "--compiled"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(out.read_text())
    ops = {k: v for k, v in d["ops"].items() if not k.startswith("floor")}
    assert len(ops) == 16 and all(v > 0 for v in ops.values())
    assert set(d["plans"]) == set(ops) and all(n >= 20 for n in d["plans"].values()), d["plans"]
    assert d["kept_plans"] >= len(ops)
    # inside default-mode compiled graphs (host_overhead.bench_compiled, as the GPU host runs it): every op's row
    assert set(d["compiled"]) == {"mla.decode", "mla.sparse_decode", "mla.merge_states", "mla.cache_write",
                                  "dsa.indexer_topk"}
    assert all(r["graph_us"] > 0 and r["eager_us"] > 0 for r in d["compiled"].values())
    assert {k for k, r in d["compiled"].items() if r["method"] == "chain"} == {"mla.decode", "mla.sparse_decode"}
    d["ops"] = {k: 2 * v for k, v in d["ops"].items()}
    (tmp_path / "hostab_base_1.json").write_text(json.dumps(d))
    sys.path.insert(0, str(ROOT / "benchmarks/lab"))
    import host_ab

    rows = host_ab.table(tmp_path)
    assert len(rows) == 2 + len(d["ops"]) and all(r.split(" | ")[3] == "0.50" for r in rows[2:])
    # the base run twice as slow on every row: relative to the rows' median, no row changed
    assert all(r.split(" | ")[4] == "1.00" for r in rows[2:]), rows
    # a slower host on the new side (every row 2x) and one row slower still: only that row's relative ratio moves
    ops = json.loads(out.read_text())["ops"]
    (tmp_path / "hostab_base_1.json").write_text(json.dumps({"ops": ops}))
    (tmp_path / "hostab_new_1.json").write_text(json.dumps(
        {"ops": {k: v * (3 if k == "mla.decode" else 2) for k, v in ops.items()}}))
    rel = {r.split(" | ")[0].strip("| "): r.split(" | ")[4] for r in host_ab.table(tmp_path)[2:]}
    assert rel.pop("mla.decode") == "1.50" and set(rel.values()) == {"1.00"}, rel


def test_bench_ops_times_competing_columns_abba_and_judges_auto_on_the_one_buffer_cache(monkeypatch):
    import bench_ops

    order = []
    monkeypatch.setattr(bench_ops, "ms", lambda fn, graph=False: fn())
    clock = iter(range(1, 100))

    def timed(name):
        return lambda: (order.append(name), float(next(clock)))[1]

    got = bench_ops.graph_times_abba({"a": timed("a"), "b": timed("b"), "c": timed("c")})
    assert order == ["a", "b", "c", "c", "b", "a"]
    # a clock that rises by one a measurement gives every column the same mean: no column favoured by its slot
    assert got == {"a": 3.5, "b": 3.5, "c": 3.5}

    rows = [dict(H=128, B=8, L=8192, op_fused_graph_ms=0.060, op_fused_kernel="seesaw", op_graph_ms=0.062,
                 op_kernel="seesaw", flashinfer_graph_ms=0.047, flashmla_graph_ms=0.061),
            dict(H=128, B=8, L=32768, op_fused_graph_ms=0.150, op_fused_kernel="flashmla", op_graph_ms=0.182,
                 op_kernel="seesaw", flashinfer_graph_ms=0.152, flashmla_graph_ms=0.151,
                 flashmla_oneq_graph_ms=0.1505),
            dict(H=16, B=8, L=32768, op_graph_ms=0.110, op_kernel="swapab", flashinfer_graph_ms=0.112),
            dict(H=16, B=1, L=1024, op_graph_ms=0.007, op_kernel="swapab"),  # no peer ran: not judged
            # a peer that answered wrongly (FlashInfer past 2^31 pool elements) is no yardstick
            dict(H=16, B=128, L=131072, op_graph_ms=6.04, op_kernel="swapab", flashinfer_graph_ms=5.0,
                 flashinfer_err_out=0.21, flashmla_graph_ms=6.13, flashmla_err_out=0.002)]
    text = bench_ops.auto_vs_peers_table({"decode": rows})
    assert "| 128 | 8 | 8K | 60.0 (seesaw) | 62.0 (seesaw) | - | 47.0 (FlashInfer) | 1.277 |" in text
    assert "| 128 | 8 | 32K | 150.0 (flashmla) | 182.0 (seesaw) | 150.5 | 151.0 (FlashMLA) | 0.993 |" in text
    assert "| 16 | 8 | 32K | 110.0 (swapab) | 110.0 (swapab) | - | 112.0 (FlashInfer) | 0.982 |" in text
    assert "| 16 | 128 | 128K | 6040.0 (swapab) | 6040.0 (swapab) | - | 6130.0 (FlashMLA) | 0.985 |" in text
    assert text.endswith("auto <= 1.00x the faster peer on 3 of 4 shapes")
