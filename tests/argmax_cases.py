"""Rows that a split argmax can get wrong, shared by the CPU pass test and the GPU test."""

from __future__ import annotations

import torch


def hard_rows(rows: int, n: int, dtype, seed: int) -> torch.Tensor:
    """Random rows with the cases a split can get wrong: the maximum tied across chunks (first index must win),
    NaN (argmax's maximum: the first NaN wins), +-inf, an all -inf row, a row of equal values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g).to(dtype)
    pick = lambda k: torch.randint(0, n, (k,), generator=g)  # noqa: E731
    if rows > 1:
        x[1, pick(3)] = 7.0  # a tie in three places
    if rows > 2:
        x[2, pick(2)] = float("nan")
    if rows > 3:
        x[3, pick(2)] = float("inf")
        x[3, pick(2)] = float("-inf")
    if rows > 4:
        x[4] = float("-inf")
    if rows > 5:
        x[5] = 0.5
    return x
