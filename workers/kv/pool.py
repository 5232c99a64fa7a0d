"""The KV pool: one tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim] per device.

Allocated locally (CPU: an anonymous mapping, zero pages on demand), in POSIX shared memory (a creator makes a named segment, attachers map it
by name; several CPU worker processes share one pool), or on CUDA with an exportable IPC
handle. `info()` describes the pool as a `justapi.wire.protocol.PoolInfo` (what travels in a
worker's Ready message) and `KVPool.attach(info)` maps it in another process. The creator
unlinks a shared segment on close; attachers only unmap.
Owns: the pool memory and its lifetime. Does not own: which block belongs to whom (scheduler).
"""
from __future__ import annotations

import base64
import json
import mmap
import os
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

from justapi.wire.protocol import PoolInfo, shm_creator_pid, shm_name
from workers.model.attention import require_cuda

KINDS = ("local", "shm", "cuda_ipc")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PoolShape:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KV pool {name} must be a positive integer, got {value!r}")

    @property
    def dims(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def num_bytes(self, dtype: torch.dtype) -> int:
        return int(np.prod(self.dims)) * torch.empty(0, dtype=dtype).element_size()

    @classmethod
    def of(cls, info: PoolInfo) -> PoolShape:
        return cls(info.num_layers, info.num_blocks, info.block_size, info.num_kv_heads, info.head_dim)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """A PoolInfo dtype name ("float32", "bfloat16", "float16") as a torch dtype."""
    if name not in _DTYPES:
        raise ValueError(f"unsupported KV pool dtype {name!r} (supported: {', '.join(_DTYPES)})")
    return _DTYPES[name]


class KVPool:
    """The pool tensor plus whatever keeps its memory alive (a shm segment, a CUDA storage)."""

    def __init__(self, tensor: torch.Tensor, shape: PoolShape, kind: str, handle: str = "",
                 segment: shared_memory.SharedMemory | None = None, is_owner: bool = True,
                 mapping: mmap.mmap | None = None, pool_id: int = 0) -> None:
        assert tuple(tensor.shape) == shape.dims
        self.tensor = tensor  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.shape = shape
        self.kind = kind
        self.handle = handle
        self.pool_id = pool_id
        self._segment = segment
        self._mapping = mapping
        self._is_owner = is_owner

    # ---------------------------------------------------------------- creation / attaching

    @classmethod
    def create(cls, shape: PoolShape, kind: str = "local", dtype: torch.dtype = torch.float32,
               device: str = "cpu", pool_id: int = 0) -> KVPool:
        if kind == "local" and torch.device(device).type == "cpu":
            # An anonymous mapping: zero pages materialize on first write, so a large pool
            # costs no time or memory until blocks are used (torch.zeros would touch all of it).
            mapping = mmap.mmap(-1, shape.num_bytes(dtype))
            tensor = _buffer_tensor(mapping, shape, dtype)
            return cls(tensor, shape, kind, mapping=mapping, pool_id=pool_id)
        if kind == "local":
            require_cuda(device)
            return cls(torch.zeros(shape.dims, dtype=dtype, device=device), shape, kind, pool_id=pool_id)
        if kind == "shm":  # a fresh segment reads as zeros
            segment = shared_memory.SharedMemory(shm_name(), create=True, size=shape.num_bytes(dtype))
            tensor = _buffer_tensor(segment.buf, shape, dtype)
            return cls(tensor, shape, kind, segment.name, segment, pool_id=pool_id)
        if kind == "cuda_ipc":
            require_cuda(device)
            tensor = torch.zeros(shape.dims, dtype=dtype, device=device)
            return cls(tensor, shape, kind, _export_cuda(tensor), pool_id=pool_id)
        raise ValueError(f"unknown KV pool kind {kind!r} (expected one of {KINDS})")

    @classmethod
    def attach(cls, info: PoolInfo) -> KVPool:
        """Map a pool another process created (shm or cuda_ipc)."""
        shape, dtype = PoolShape.of(info), dtype_of(info.dtype)
        if info.kind == "shm":
            try:
                segment = shared_memory.SharedMemory(name=info.handle, create=False)
            except FileNotFoundError:
                raise ValueError(f"KV pool shared-memory segment {info.handle!r} does not exist") from None
            if shm_creator_pid(info.handle) != os.getpid():
                # Python < 3.13 registers attached segments with this process's resource
                # tracker, which would unlink the pool when we exit: only the creator unlinks.
                resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
            if segment.size < shape.num_bytes(dtype):
                segment.close()
                raise ValueError(f"KV pool segment {info.handle!r} holds {segment.size} bytes, "
                                 f"shape needs {shape.num_bytes(dtype)}")
            tensor = _buffer_tensor(segment.buf, shape, dtype)
            return cls(tensor, shape, "shm", info.handle, segment, is_owner=False, pool_id=info.pool_id)
        if info.kind == "cuda_ipc":
            require_cuda(info.device)
            return cls(_import_cuda(info.handle, shape, dtype), shape, "cuda_ipc", info.handle,
                       is_owner=False, pool_id=info.pool_id)
        raise ValueError(f"KV pool kind {info.kind!r} cannot be attached (only shm and cuda_ipc)")

    def info(self) -> PoolInfo:
        s = self.shape
        return PoolInfo(pool_id=self.pool_id, kind=self.kind, handle=self.handle,
                        device=str(self.tensor.device), dtype=_dtype_name(self.tensor.dtype),
                        num_layers=s.num_layers, num_blocks=s.num_blocks, block_size=s.block_size,
                        num_kv_heads=s.num_kv_heads, head_dim=s.head_dim)

    def close(self) -> None:
        """Drop the mapping; the creator of a shm segment also unlinks it (no leaked segment).
        Tensors that view the pool must not be used afterwards."""
        self.tensor = torch.empty(0)
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None
        if self._segment is not None:
            segment, self._segment = self._segment, None
            segment.close()
            if self._is_owner:
                segment.unlink()

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- data

    def layer(self, index: int) -> torch.Tensor:
        """[2, num_blocks, block_size, kv_heads, head_dim] view of one layer."""
        return self.tensor[index]

    def move_slots(self, src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
        """Copy every layer's K and V of slot src_slots[i] to dst_slots[i] within the pool
        (speculative decoding: a token tree's accepted nodes to their positions). Sources are
        read before any destination is written."""
        layers, two, num_blocks, block_size, kv_heads, head_dim = self.tensor.shape
        flat = self.tensor.view(layers, two, num_blocks * block_size, kv_heads, head_dim)
        src = torch.as_tensor(np.asarray(src_slots, dtype=np.int64), device=self.tensor.device)
        dst = torch.as_tensor(np.asarray(dst_slots, dtype=np.int64), device=self.tensor.device)
        flat[:, :, dst] = flat[:, :, src]

    def copy_blocks(self, src_pool: KVPool, src_block_ids: np.ndarray | list[int],
                    dst_block_ids: np.ndarray | list[int]) -> None:
        """Copy every layer's K and V of src_pool's src_block_ids[i] into our dst_block_ids[i]."""
        src_ids = self._ids(src_block_ids, src_pool.shape.num_blocks, "source")
        dst_ids = self._ids(dst_block_ids, self.shape.num_blocks, "destination")
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"copy_blocks got {len(src_ids)} source and {len(dst_ids)} destination ids")
        if src_pool.shape.dims[3:] != self.shape.dims[3:] or src_pool.shape.num_layers != self.shape.num_layers:
            raise ValueError("copy_blocks between pools of different layer/block shapes")
        data = src_pool.tensor.index_select(2, src_ids.to(src_pool.tensor.device))
        self.tensor.index_copy_(2, dst_ids.to(self.tensor.device), data.to(self.tensor))

    @staticmethod
    def _ids(ids: np.ndarray | list[int], num_blocks: int, what: str) -> torch.Tensor:
        array = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(array) and (array.min() < 0 or array.max() >= num_blocks):
            raise ValueError(f"copy_blocks {what} block id out of range [0, {num_blocks}): "
                             f"{array[(array < 0) | (array >= num_blocks)][:4].tolist()}")
        return torch.from_numpy(array)


def _buffer_tensor(buffer: object, shape: PoolShape, dtype: torch.dtype) -> torch.Tensor:
    count = int(np.prod(shape.dims))
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape.dims)  # type: ignore[call-overload]


def _export_cuda(tensor: torch.Tensor) -> str:
    """A CUDA IPC handle for the pool's storage as base64 JSON (never pickle): the fields
    torch.UntypedStorage._new_shared_cuda needs to map the same memory in another process."""
    (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset,
     event_handle, event_sync) = tensor.untyped_storage()._share_cuda_()
    fields = {"device": device, "handle": base64.b64encode(handle).decode(),
              "size_bytes": size_bytes, "offset_bytes": offset_bytes,
              "ref_handle": base64.b64encode(ref_handle).decode(), "ref_offset": ref_offset,
              "event_handle": base64.b64encode(event_handle).decode(), "event_sync": event_sync}
    return base64.b64encode(json.dumps(fields).encode()).decode()


def _import_cuda(handle: str, shape: PoolShape, dtype: torch.dtype) -> torch.Tensor:
    torch.cuda._lazy_init()
    try:
        f = json.loads(base64.b64decode(handle))
        storage = torch.UntypedStorage._new_shared_cuda(
            f["device"], base64.b64decode(f["handle"]), f["size_bytes"], f["offset_bytes"],
            base64.b64decode(f["ref_handle"]), f["ref_offset"],
            base64.b64decode(f["event_handle"]), f["event_sync"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"malformed CUDA IPC pool handle ({exc})") from None
    strides = [int(np.prod(shape.dims[i + 1:])) for i in range(len(shape.dims))]  # contiguous
    tensor = torch.empty(0, dtype=dtype, device=f"cuda:{f['device']}")
    tensor.set_(storage, 0, shape.dims, strides)
    return tensor
