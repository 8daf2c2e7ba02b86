"""A pytest plugin for the seesaw_n32 probe: the GPU tests with decode_seesaw built at another tiling.

    KERNELS_ENV="PYTHONPATH=benchmarks/lab SEESAW_TILING=32:2" KERNELS_ARGS="-p seesaw_tiling_plugin" \
        bash benchmarks/device.sh kernels

SEESAW_TILING "BN:NSETS" sets decode_seesaw.TILE_N / SLOT_SETS before any test runs (plans read them when made), so
every test that reaches the seesaw kernel runs that build. Lab only: nothing in mla_compile or tests imports it.
"""

from __future__ import annotations

import os


def pytest_configure(config):
    spec = os.environ.get("SEESAW_TILING")
    if not spec:
        return
    from mla_compile.kernels import decode_seesaw as S

    S.TILE_N, S.SLOT_SETS = map(int, spec.split(":"))
    print(f"seesaw_tiling_plugin: decode_seesaw built at TILE_N={S.TILE_N} SLOT_SETS={S.SLOT_SETS}")
