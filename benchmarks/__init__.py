"""Benchmark suite for mla_compile: `python -m benchmarks <suite>` (ops, dcp, hf, dsa, compile, all, report).

Each suite writes one JSON file into the results dir (default benchmarks/results/, git-ignored scratch);
`python -m benchmarks report DIR` turns a directory of them into the tables of benchmarks/RESULTS.md and the
PNG plots in benchmarks/plots/.
"""
