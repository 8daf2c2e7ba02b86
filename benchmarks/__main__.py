"""`python -m benchmarks <suite> [--results DIR] [--smoke] [-- extra args for the suite's script]`

Suites (each writes DIR/<file>; DIR defaults to benchmarks/results/, git-ignored scratch):
  ops      bench_ops.json  mla::decode Triton vs FlashInfer, merge_states, DSA indexer ops   (CUDA only)
  dcp      dcp.json (+dcp.md)  torchrun benchmarks/dcp_gpu.py for n in 1 2 4 that fit the GPUs, merged;
                           on CPU (or --smoke): n = 1 2 over gloo with tiny shapes (checks, not performance)
  hf       hf.json         HF DeepseekV3 decode tokens/s: eager vs torch.compile vs mla_dcp
                           (CPU: the script's --smoke shapes)
  generate generate.json   HF generate() end to end: eager vs HF's own static compile vs mla_dcp
                           (CPU: the script's --smoke shapes)
  dsa      dsa.json        DSA layer dense (k-only) vs sparse graph under CUDA-graph trees         (CUDA only)
  compile  compile.json    compile time, graphs, cudagraph recordings, FX-graph-cache hits in a second process
  all      every suite above in that order
  report   python -m benchmarks report DIR [--date D --kind K --command C]: RESULTS.md tables + plots

A CUDA-only suite on a machine without CUDA says so and exits 0 (skipped). The exit status is non-zero when a
suite that ran failed. Arguments after `--` go to the suite's script unchanged (e.g. `ops -- --quick`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_RESULTS = HERE / "results"
FILES = {"ops": "bench_ops.json", "dcp": "dcp.json", "hf": "hf.json", "generate": "generate.json", "dsa": "dsa.json",
         "compile": "compile.json"}
SUITES = tuple(FILES)
SKIPPED: set[str] = set()  # suites that did not run here (no CUDA, script missing)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _env() -> dict:
    """Child environment: the repo importable (mla_compile, benchmarks, examples via the scripts)."""
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1",
            "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}


def _tqdm(it, **kw):
    try:
        from tqdm import tqdm
    except ImportError:  # the `bench` extra is not installed: no bar
        return it
    return tqdm(it, **kw)


def _skip(suite: str, why: str) -> int:
    print(f"[benchmarks] {suite}: SKIPPED — {why}", flush=True)
    SKIPPED.add(suite)
    return 0


def _script(name: str, argv: list[str]) -> int:
    """Run benchmarks/<name> in a fresh interpreter (each script owns its own torch / Dynamo state)."""
    cmd = [sys.executable, str(HERE / name), *argv]
    print("[benchmarks] $ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=_env(), cwd=ROOT)


def suite_ops(out: Path, smoke: bool, extra: list[str]) -> int:
    if not _cuda():
        return _skip("ops", "needs a CUDA GPU (Triton / FlashInfer kernels, CUDA-graph timing); no CPU mode")
    return _script("bench_ops.py", [str(out), *(["--quick"] if smoke else []), *extra])


def suite_dcp(out: Path, smoke: bool, extra: list[str]) -> int:
    """torchrun per group size (like device.sh's stage_dcp), then one merged JSON (dcp_gpu.py --summarize)."""
    ngpu = _gpus()
    cpu = ngpu == 0
    smoke = smoke or cpu
    ns = [n for n in (1, 2, 4) if n <= ngpu] if not cpu else [1, 2]
    if cpu:
        print("[benchmarks] dcp: no CUDA GPU — CPU/gloo smoke run (tiny shapes; checks the script, not performance)")
    rc, runs = 0, []
    with tempfile.TemporaryDirectory(prefix="dcp_runs_") as tmp:
        for n in _tqdm(ns, desc="dcp group sizes", unit="run"):
            path = Path(tmp) / f"dcp_n{n}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                   str(HERE / "dcp_gpu.py"), str(path), *(["--smoke"] if smoke else []), *extra]
            print("[benchmarks] $ " + " ".join(cmd), flush=True)
            r = subprocess.call(cmd, env=_env(), cwd=ROOT)
            if r:
                print(f"[benchmarks] dcp n={n} FAILED (exit {r})", flush=True)
                rc = 1
            if path.exists():
                runs.append(str(path))
        if runs:
            rc |= _script("dcp_gpu.py", ["--summarize", str(out), *runs])
        else:
            rc = 1
    return rc


def suite_hf(out: Path, smoke: bool, extra: list[str]) -> int:
    if not (HERE / "hf_decode.py").exists():
        return _skip("hf", "benchmarks/hf_decode.py is not in this tree yet")
    if not _cuda() and not smoke:
        print("[benchmarks] hf: no CUDA GPU — running the script's --smoke shapes (fp32, CPU; not performance)")
        smoke = True
    return _script("hf_decode.py", [str(out), *(["--smoke"] if smoke else []), *extra])


def suite_generate(out: Path, smoke: bool, extra: list[str]) -> int:
    if not _cuda() and not smoke:
        print("[benchmarks] generate: no CUDA GPU — running the script's --smoke shapes (fp32, CPU; not performance)")
        smoke = True
    return _script("generate.py", [str(out), *(["--smoke"] if smoke else []), *extra])


def suite_dsa(out: Path, smoke: bool, extra: list[str]) -> int:
    if not _cuda():
        return _skip("dsa", "needs a CUDA GPU (dense vs sparse timing under CUDA-graph trees); "
                            "the CPU checks of the two graphs are tests/ops/test_dsa_graphs.py")
    return _script("dsa_gpu.py", [str(out), *extra])


def suite_compile(out: Path, smoke: bool, extra: list[str]) -> int:
    return _script("compile_suite.py", [str(out), *(["--targets", "dsa"] if smoke else []), *extra])


def _label(suite: str, rc: int) -> str:
    return "skipped" if suite in SKIPPED else "ok" if rc == 0 else f"FAILED (exit {rc})"


RUNNERS = {"ops": suite_ops, "dcp": suite_dcp, "hf": suite_hf, "generate": suite_generate, "dsa": suite_dsa,
           "compile": suite_compile}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    if argv and argv[0] == "report":
        from . import report

        return report.main(argv[1:] + extra)
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite", choices=SUITES + ("all",))
    ap.add_argument("--results", type=Path, default=Path(os.environ.get("BENCH_RESULTS", DEFAULT_RESULTS)),
                    help="directory for the JSON files (default benchmarks/results/ or $BENCH_RESULTS)")
    ap.add_argument("--smoke", action="store_true", help="small/quick shapes where the suite has them")
    a = ap.parse_args(argv)
    a.results.mkdir(parents=True, exist_ok=True)
    suites = SUITES if a.suite == "all" else (a.suite,)
    status = {}
    for s in suites:
        t0 = time.time()
        print(f"[benchmarks] === {s} -> {a.results / FILES[s]}", flush=True)
        status[s] = RUNNERS[s](a.results / FILES[s], a.smoke, extra)
        print(f"[benchmarks] === {s}: {_label(s, status[s])} ({time.time() - t0:.0f}s)", flush=True)
    if len(suites) > 1:
        print("[benchmarks] " + ", ".join(f"{s} {_label(s, r)}" for s, r in status.items()))
    return 0 if all(r == 0 for r in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
