"""Host arrays to the device without stalling it: a copy from pageable memory waits for the
device to reach it (every kernel queued before), a copy from pinned memory is queued like a
kernel and the host goes on. Each upload takes a pinned block from torch's caching host
allocator, which keeps that block from reuse until its copy has run, so a step's staging may
be refilled while an earlier step's copy is still queued. On a CPU the array is used as it is
(no copy, as before). Owns: that staging. Does not own: what is uploaded.
"""
from __future__ import annotations

import numpy as np
import torch


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as a tensor on `device` (on a GPU: queued, the host does not wait)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host.to(device)
    staging = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    staging.copy_(host)
    return staging.to(device, non_blocking=True)


def upload_into(target: torch.Tensor, array: np.ndarray) -> None:
    """Copy `array` into the device tensor `target` (same number of elements), queued on a GPU."""
    host = torch.from_numpy(np.ascontiguousarray(array)).view(target.shape)
    if target.device.type != "cuda":
        target.copy_(host)
        return
    staging = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    staging.copy_(host)
    target.copy_(staging, non_blocking=True)
