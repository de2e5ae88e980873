"""Seconds on the device: CUDA's work is asynchronous, so a timing waits for it before reading the clock."""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int = 1) -> tuple[float, object]:
    """(seconds per call, the last result): ``fn`` run ``repeats`` times after one warm-up call."""
    result = fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        result = fn()
    synchronize(device)
    return (time.perf_counter() - start) / repeats, result
