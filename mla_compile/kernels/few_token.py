"""The few-token linear kernels' range (kernels/linear.py), without importing Triton: the ops (their CUDA impls
route on it) and the passes (which route projections to those ops) read it from here."""

from __future__ import annotations

import torch

K_ALIGN = 128  # linear_partials: every split's K range is a whole number of these (the kernel's K step)
FEW_TOKEN_ROWS = 16  # the few-token kernels' row limit (the MMA's N side); more rows belong to a normal GEMM


def few_token_rows(rows, dtype: torch.dtype) -> bool:
    """Inside the few-token Triton kernels' range (the CUDA impls of the linear ops; the passes that route
    projections to them): at most FEW_TOKEN_ROWS rows (a static int) of fp16 / bf16."""
    return isinstance(rows, int) and rows <= FEW_TOKEN_ROWS and dtype in (torch.float16, torch.bfloat16)


def split_width(K: int, splits: int, align: int = K_ALIGN) -> int:
    """K per split: ceil(K / splits) rounded up to whole `align`-wide steps, so only the last non-empty split
    can be short."""
    return -(-(-(-K // splits)) // align) * align
