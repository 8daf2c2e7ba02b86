"""The host time per eager call of every op, one commit against another, from alternating runs on one host.

    python benchmarks/lab/host_ab.py DIR [--json OUT.json]    (OUT.json: the table's rows and every run)

DIR holds `hostab_base_<r>.json` and `hostab_new_<r>.json` (benchmarks/host_overhead.py --ops-only, or
benchmarks/lab/host_cpu.py --json: its "ops"); each row is the median over the runs, with new / base and, where the
loop timed FlashInfer's `run`, both as multiples of it (issue 29's goals: decode <= 1.74x, every other op <= 1.30x).
"new / base, rows" pairs the two sides' runs of each round: a row's new / base of that round over the median of
every row's new / base in it, the median over rounds. A host that slows down for one run (every row ~1.4x, floors
and FlashInfer's run included: RESULTS 2026-12-06, eleventh session) moves all rows alike, a change moves its own
rows: the column reads a focused change (most rows untouched) through such drift. The floors alone were no steadier
a reference than the ops (they moved 1.03-1.53x where the ops moved 1.22-1.43x).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

PEER = "peer: flashinfer run"


def medians(files) -> dict:
    rows: dict = {}
    for f in files:
        for name, us in json.loads(Path(f).read_text()).get("ops", {}).items():
            rows.setdefault(name, []).append(us)
    return {name: statistics.median(v) for name, v in rows.items()}


def relative_ratios(directory: Path) -> dict:
    """{row: median over rounds of its new / base over that round's median new / base}, runs paired by number."""
    ratios: dict = {}
    for nf in sorted(directory.glob("hostab_new_*.json")):
        bf = directory / nf.name.replace("hostab_new_", "hostab_base_")
        if not bf.exists():
            continue
        n, b = (json.loads(f.read_text()).get("ops", {}) for f in (nf, bf))
        r = {name: n[name] / b[name] for name in n.keys() & b.keys() if b[name] > 0}
        if r:
            drift = statistics.median(r.values())
            for name, v in r.items():
                ratios.setdefault(name, []).append(v / drift)
    return {name: statistics.median(v) for name, v in ratios.items()}


def table(directory: Path) -> list[str]:
    base = medians(sorted(directory.glob("hostab_base_*.json")))
    new = medians(sorted(directory.glob("hostab_new_*.json")))
    relative = relative_ratios(directory)
    lines = ["| call | base us | new us | new / base | new / base, rows | base / FlashInfer | new / FlashInfer |",
             "|---|---|---|---|---|---|---|"]
    for name in base:
        if name not in new:
            continue
        b, n = base[name], new[name]
        fi = (f"{b / base[PEER]:.2f} | {n / new[PEER]:.2f}" if PEER in base and PEER in new else "- | -")
        fl = f"{relative[name]:.2f}" if name in relative else "-"
        lines.append(f"| {name} | {b:.1f} | {n:.1f} | {n / b:.2f} | {fl} | {fi} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    lines = table(a.dir)
    print("\n".join(lines))
    if a.json:
        runs = {f.name: json.loads(f.read_text()) for f in sorted(a.dir.glob("hostab_*.json"))}
        a.json.write_text(json.dumps({"table": lines, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
