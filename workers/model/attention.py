"""Attention over the paged KV cache, behind one interface a GPU kernel library can implement.

A step's batch is flat: sequence i owns rows [tok_off[i], tok_off[i+1]) of q/k/v, holds
positions [start_i, start_i + n_i), and its block table maps position p to
slot = block_ids[p // block_size] * block_size + p % block_size. Per step the runner calls
`prepare` once; per layer the model calls `write_kv` (new K/V into their slots) then `attend`.

    rows:    | seq 0 chunk (prefill) | seq 1 (1 token) | seq 2 (1 token) | seq 3 chunk |
    groups:  | long: one SDPA each   | short: one padded batch, SDPA per cache-sized group |

A sequence may carry a token-tree mask (speculative verification, workers/spec/tree.py): its
tree rows get rotary positions by depth and see only their ancestors among the chunk's rows.
A layer's AttentionParams add its scale, logit soft-cap and sliding window (keys older than the
window are masked: the pool keeps them, docs/models.md); a window's masks are built once a step.
Owns: slot arithmetic, the grouping, masks, CPU/CUDA attention kernels.
Does not own: the KV pool tensor (kv_pool.py) or block allocation (the scheduler).
"""
from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from justapi.wire.protocol import EXACT_CHUNK_TOKENS
from workers.model import cpu_kernels
from workers.model.layer_ops import layer_ops
from workers.spec.tree import TreeLayout

SHORT_CHUNK_TOKENS = EXACT_CHUNK_TOKENS
"""Chunks of at most this many tokens (decodes, speculative verification, tokens recomputed
after a restart or preemption) share one padded batch, on the CPU the decode kernel's."""
KERNEL_CHUNK_TOKENS = 256
"""On the CPU kernel's keys-in-lanes loop (a bf16 or f16 pool, AVX-512), longer chunks up to this many
tokens (prefill after a cached prefix, a budgeted prompt chunk) are a second padded batch for the
kernel instead of one gathered SDPA each: it reads K/V in place, where SDPA widens a gathered copy
first. One layer, 2 threads (`kernel/sdpa`), Zen 4: 32 tokens after 512 cached 0.41, 256 after 512
0.63, 256 alone 0.80, 512 alone 0.94, 1,024 alone 1.5 (before a lone chunk was sliced: every row
scored every key); Xeon with AMX, sliced (32 rows a task, each reading the keys it sees): 32
after 512 0.77, 256 after 512 0.69-0.96, 16 x 26 after 510 0.49, 256 alone 0.77-0.82, 512 alone
0.62."""
CPU_CHUNK_BYTES = 2 << 20
"""The padded batch is attended a few sequences at a time, ~2 MiB of gathered K/V each: at 64
sequences x 176 positions this cut attention CPU time from 10.3 to 4.4 ms per layer."""


@dataclass(frozen=True)
class AttentionParams:
    """How one layer attends (workers/weights/hparams.py reads these from the model file)."""

    scale: float | None = None
    """Of q . k; None: 1 / sqrt(head_dim)."""
    softcap: float = 0.0
    """Scores s become softcap * tanh(s / softcap) before the mask (Gemma 2); 0: off."""
    window: int = 0
    """A query at (rotary) position q sees keys at positions q - window < k <= q; 0: all."""


DEFAULT_PARAMS = AttentionParams()


@dataclass(frozen=True)
class AttentionBatch:
    """One step's sequences as host arrays (columnar, like justapi.wire.protocol.StepPlan)."""

    start_positions: np.ndarray  # int [S]
    num_tokens: np.ndarray  # int [S]
    num_blocks: np.ndarray  # int [S]
    block_ids: np.ndarray  # int [sum(num_blocks)]
    block_size: int
    tree: TreeLayout | None = None  # speculative token trees: masks and rotary positions

    def __post_init__(self) -> None:
        need = -(-(self.start_positions + self.num_tokens) // self.block_size)  # ceil
        if np.any(need > self.num_blocks):
            bad = int(np.argmax(need > self.num_blocks))
            raise ValueError(f"sequence {bad} needs {int(need[bad])} blocks for positions up to "
                             f"{int(self.start_positions[bad] + self.num_tokens[bad]) - 1}, "
                             f"its block table has {int(self.num_blocks[bad])}")

    @property
    def num_seqs(self) -> int:
        return len(self.num_tokens)

    def token_offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.num_tokens)]).astype(np.int64)

    def block_offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.num_blocks)]).astype(np.int64)

    def positions(self) -> np.ndarray:
        """[T] position of every row: start_i, start_i + 1, ... per sequence."""
        tok_off = self.token_offsets()
        seq_of_row = np.repeat(np.arange(self.num_seqs), self.num_tokens)
        return (np.arange(tok_off[-1]) - tok_off[seq_of_row] + self.start_positions[seq_of_row])

    def slots(self, positions: np.ndarray) -> np.ndarray:
        """[T] KV slot of every row (see the module docstring)."""
        seq_of_row = np.repeat(np.arange(self.num_seqs), self.num_tokens)
        table_index = self.block_offsets()[seq_of_row] + positions // self.block_size
        return self.block_ids[table_index].astype(np.int64) * self.block_size + positions % self.block_size

    def padded_tables(self, seqs: np.ndarray) -> np.ndarray:
        """[len(seqs), max blocks needed] block tables of `seqs`, cut to the blocks their
        positions reach and padded with block 0 (masked out)."""
        ends = self.start_positions[seqs] + self.num_tokens[seqs]
        used = -(-ends // self.block_size)
        out = np.zeros((len(seqs), int(used.max())), dtype=np.int64)
        blk_off = self.block_offsets()
        for row, (seq, n) in enumerate(zip(seqs, used)):
            out[row, :n] = self.block_ids[blk_off[seq]:blk_off[seq] + n]
        return out


@dataclass
class ShortGroup:
    """Sequences with short chunks, computed together as one padded batch."""

    rows: torch.Tensor  # int64 [A, Qmax]: q row of each (sequence, query index); pad repeats a row
    valid_rows: torch.Tensor  # int64 [num valid]: flat indices into [A * Qmax] that are real
    out_rows: torch.Tensor  # int64 [num valid]: where those go in the step's output
    tables: torch.Tensor  # int64 [A, Bmax]
    mask: torch.Tensor  # bool [A, 1, Qmax, Bmax * block_size]: key visible to query
    is_identity: bool  # one token per sequence, rows in order: no gather/scatter needed
    num_keys: torch.Tensor  # int64 [A]: start + num_tokens, the keys the sequence's rows reach
    num_rows: torch.Tensor  # int64 [A]: its real query rows (num_tokens)


@dataclass
class LongChunk:
    """One sequence with a long chunk (prefill), computed on its own."""

    first_row: int
    num_tokens: int
    num_keys: int  # start + num_tokens
    blocks: torch.Tensor  # int64 [ceil(num_keys / block_size)]
    mask: torch.Tensor | None
    """bool [num_tokens, num_keys], causal with the chunk's offset; None where that is plain
    causal attention over the chunk alone (a whole prompt, no tree rows, no window reaching in):
    SDPA's own causal path then skips the masked half (a 2048-token prompt's attention 1.7-2.8x
    faster than the same mask given explicitly, the same bits)."""


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # int64 [T]
    slots: torch.Tensor  # int64 [T]
    short: ShortGroup | None
    longs: list[LongChunk]
    batch: AttentionBatch | None = None  # what windowed masks are built from
    windowed: dict[int, AttentionMetadata] = field(default_factory=dict)  # by window, built once
    medium: ShortGroup | None = None
    """Chunks of SHORT_CHUNK_TOKENS < n <= KERNEL_CHUNK_TOKENS as a padded batch, where the
    backend has a kernel for them (TorchCpuBackend); `attend` takes it or medium_longs."""
    medium_longs: Callable[[], list[LongChunk]] = list
    """The same chunks one by one, for SDPA (a pool or head size the kernel's loop does not take):
    built on first call, as the kernel's pools never need them (their masks cost a 16 x 26-token
    step 0.7 of its 1.0 ms prepare)."""


class AttentionBackend(ABC):
    """Prepare once per step; then per layer write K/V into their slots and attend."""

    @abstractmethod
    def prepare(self, batch: AttentionBatch) -> AttentionMetadata: ...

    @abstractmethod
    def write_kv(self, kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """kv: this layer's [2, num_blocks, block_size, kv_heads, head_dim]; k, v: [T, kv_heads, head_dim]."""

    @abstractmethod
    def attend(self, kv: torch.Tensor, q: torch.Tensor, meta: AttentionMetadata,
               params: AttentionParams = DEFAULT_PARAMS) -> torch.Tensor:
        """q: [T, heads, head_dim] (rotary applied) -> [T, heads, head_dim]."""


class TorchPagedBackend(AttentionBackend):
    """Paged attention in plain torch: gather each sequence's blocks, then SDPA (GQA-aware); a
    pool in another dtype than q's is widened (or narrowed) in the gathered copy.

    Works on any device; TorchCpuBackend and CudaBackend below pick the device."""

    medium_chunk_tokens = 0
    """Above SHORT_CHUNK_TOKENS, chunks up to this many tokens also get a padded batch
    (AttentionMetadata.medium); 0: none (every longer chunk is a LongChunk)."""
    cuts_long_chunks = False
    """Longer chunks too join the medium batch, cut into pieces of medium_chunk_tokens
    (cut_chunks): every row then takes the kernel that decodes (`--batch-invariant`)."""

    def __init__(self, block_size: int, device: torch.device | str = "cpu",
                 chunk_bytes: int | None = CPU_CHUNK_BYTES) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        self.chunk_bytes = chunk_bytes

    def prepare(self, batch: AttentionBatch, window: int = 0) -> AttentionMetadata:
        assert batch.block_size == self.block_size, "batch built for another block size"
        positions = batch.positions()
        slots = batch.slots(positions)
        if batch.tree:  # token-tree rows: rotary position = root + depth, slots stay in order
            positions = batch.tree.rotary_positions(batch.token_offsets(), positions)
        short_seqs = np.flatnonzero(batch.num_tokens <= SHORT_CHUNK_TOKENS)
        is_medium = (batch.num_tokens > SHORT_CHUNK_TOKENS) & (batch.num_tokens <= self.medium_chunk_tokens)
        if self.cuts_long_chunks and not batch.tree:  # long chunks too, cut into medium pieces
            is_medium = batch.num_tokens > SHORT_CHUNK_TOKENS
        medium_seqs = np.flatnonzero(is_medium)
        long_seqs = np.flatnonzero((batch.num_tokens > SHORT_CHUNK_TOKENS) & ~is_medium)
        masks = _Masks(positions, window)
        return AttentionMetadata(
            positions=self._tensor(positions), slots=self._tensor(slots),
            short=self._short_group(batch, short_seqs, masks) if len(short_seqs) else None,
            longs=[self._long_chunk(batch, int(s), masks) for s in long_seqs], batch=batch,
            medium=self._short_group(*cut_chunks(batch, medium_seqs, self.medium_chunk_tokens), masks)
            if len(medium_seqs) else None,
            medium_longs=functools.cache(lambda: [self._long_chunk(batch, int(s), masks) for s in medium_seqs]))

    def with_window(self, meta: AttentionMetadata, window: int) -> AttentionMetadata:
        """`meta` with keys older than `window` masked (built on first use in a step)."""
        if window == 0 or meta.batch is None:
            return meta
        if window not in meta.windowed:
            meta.windowed[window] = self.prepare(meta.batch, window)
        return meta.windowed[window]

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device)

    def _short_group(self, batch: AttentionBatch, seqs: np.ndarray, masks: _Masks) -> ShortGroup:
        counts = batch.num_tokens[seqs]
        q_max = int(counts.max())
        first = batch.token_offsets()[seqs]
        q_index = np.arange(q_max)
        is_valid = q_index[None, :] < counts[:, None]  # [A, Qmax]
        rows = first[:, None] + np.where(is_valid, q_index[None, :], 0)  # [A, Qmax]
        tables = batch.padded_tables(seqs)
        keys = np.arange(tables.shape[1] * self.block_size)
        query_pos = batch.start_positions[seqs][:, None] + q_index[None, :]  # [A, Qmax]
        mask = keys[None, None, :] <= query_pos[:, :, None]  # [A, Qmax, Tk]: causal, within length
        if batch.tree:
            batch.tree.restrict_short(mask, seqs)
        masks.slide(mask, keys, rows)
        is_identity = q_max == 1 and np.array_equal(rows[:, 0], np.arange(batch.num_tokens.sum()))
        return ShortGroup(rows=self._tensor(rows), valid_rows=self._tensor(np.flatnonzero(is_valid)),
                          out_rows=self._tensor(rows[is_valid]), tables=self._tensor(tables),
                          mask=torch.from_numpy(mask[:, None]).to(self.device),
                          is_identity=bool(is_identity),
                          num_keys=self._tensor(batch.start_positions[seqs] + counts),
                          num_rows=self._tensor(counts))

    def _long_chunk(self, batch: AttentionBatch, seq: int, masks: _Masks) -> LongChunk:
        start, n = int(batch.start_positions[seq]), int(batch.num_tokens[seq])
        num_keys = start + n
        table = batch.padded_tables(np.array([seq]))[0]
        first_row = int(batch.token_offsets()[seq])
        chunk = LongChunk(first_row=first_row, num_tokens=n, num_keys=num_keys, blocks=self._tensor(table),
                          mask=None)
        if start == 0 and not batch.tree and not 0 < masks.window < n:
            return chunk
        mask = np.arange(num_keys)[None, :] <= start + np.arange(n)[:, None]  # [n, num_keys]
        if batch.tree:
            batch.tree.restrict_long(mask, seq)
        masks.slide(mask, np.arange(num_keys), np.arange(first_row, first_row + n))
        chunk.mask = torch.from_numpy(mask).to(self.device)
        return chunk

    def write_kv(self, kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        flat = kv.view(2, -1, kv.shape[-2], kv.shape[-1])  # [2, num_slots, kv_heads, head_dim]
        flat[0].index_copy_(0, meta.slots, k.to(kv.dtype))
        flat[1].index_copy_(0, meta.slots, v.to(kv.dtype))

    def attend(self, kv: torch.Tensor, q: torch.Tensor, meta: AttentionMetadata,
               params: AttentionParams = DEFAULT_PARAMS) -> torch.Tensor:
        meta = self.with_window(meta, params.window)
        if meta.short is not None and meta.short.is_identity and not meta.longs and meta.medium is None:
            return self._attend_short(kv, q, meta.short, params)  # pure decode step: no scatter
        out = torch.empty_like(q)
        if meta.short is not None:
            out[meta.short.out_rows] = self._attend_short(kv, q, meta.short, params)
        longs = meta.longs
        if meta.medium is not None and self._takes_medium(kv, q):
            out[meta.medium.out_rows] = self._attend_short(kv, q, meta.medium, params)
        else:
            longs = longs + meta.medium_longs()
        for chunk in longs:
            rows = slice(chunk.first_row, chunk.first_row + chunk.num_tokens)
            out[rows] = self._attend_long(kv, q[rows], chunk, params)
        return out

    def _takes_medium(self, kv: torch.Tensor, q: torch.Tensor) -> bool:
        """Whether a medium group is attended as one (else its chunks as long ones)."""
        return False

    def _attend_short(self, kv: torch.Tensor, q: torch.Tensor, group: ShortGroup,
                      params: AttentionParams = DEFAULT_PARAMS) -> torch.Tensor:
        num_seqs, q_max = group.rows.shape
        heads, head_dim = q.shape[1], q.shape[2]
        if group.is_identity:
            q_pad = q.view(num_seqs, 1, heads, head_dim)
        else:
            q_pad = q[group.rows]  # [A, Qmax, heads, head_dim]
        out = torch.empty_like(q_pad)
        for seqs in self._seq_chunks(kv, group.tables):
            keys = gather_blocks(kv, group.tables[seqs]).to(q.dtype)  # [2, c, Tk, kv_heads, head_dim]
            keys = keys.transpose(2, 3)  # [2, c, kv_heads, Tk, head_dim]
            q_c, k_c, v_c, mask_c = q_pad[seqs].transpose(1, 2), keys[0], keys[1], group.mask[seqs]
            num = q_c.shape[0]
            if num == 1 and q_c.device.type == "cpu":  # CPU SDPA takes another path for one
                # sequence (last bits off the same sequence's in any bigger batch): attend it twice
                q_c, k_c, v_c, mask_c = (t.expand(2, *t.shape[1:]) for t in (q_c, k_c, v_c, mask_c))
            out[seqs] = attention(q_c, k_c, v_c, mask_c, params)[:num].transpose(1, 2)  # [c, Qmax, heads, hd]
        out = out.view(num_seqs * q_max, heads, head_dim)
        return out if group.is_identity else out[group.valid_rows]

    def _seq_chunks(self, kv: torch.Tensor, tables: torch.Tensor) -> list[slice]:
        """Sequences in groups whose gathered K/V stay within chunk_bytes (cache-sized: SDPA
        reads each K/V once per query head of a group; from cache that is cheap)."""
        num_seqs = tables.shape[0]
        if self.chunk_bytes is None:
            return [slice(0, num_seqs)]
        per_seq = 2 * tables.shape[1] * kv[0, 0].numel() * kv.element_size()
        step = max(1, self.chunk_bytes // per_seq)
        return [slice(first, first + step) for first in range(0, num_seqs, step)]

    def _attend_long(self, kv: torch.Tensor, q: torch.Tensor, chunk: LongChunk,
                     params: AttentionParams = DEFAULT_PARAMS) -> torch.Tensor:
        keys = gather_blocks(kv, chunk.blocks[None])[:, 0, :chunk.num_keys].to(q.dtype)  # [2, num_keys, kvh, hd]
        keys = keys.transpose(1, 2)[:, None]  # [2, 1, kv_heads, num_keys, head_dim]
        # 4-d inputs: with 3-d ones torch's CPU SDPA took its unfused math path (20x slower)
        out = attention(q.transpose(0, 1)[None], keys[0], keys[1], chunk.mask, params)  # [1, heads, n, hd]
        return out[0].transpose(0, 1)


def cut_chunks(batch: AttentionBatch, seqs: np.ndarray, most: int) -> tuple[AttentionBatch, np.ndarray]:
    """`batch` with the chunks of `seqs` longer than `most` rows cut into consecutive pieces of
    at most `most` (each a sequence of its own over the same block table, so that rows keep
    their places), and the indices of `seqs`' chunks and pieces in it. The kernel computes a
    row alike in any piece, so a long prompt chunk's rows come out as decoding gives them."""
    if not len(seqs) or int(batch.num_tokens[seqs].max()) <= most:
        return batch, seqs
    counts = np.ones(batch.num_seqs, dtype=np.int64)
    counts[seqs] = -(-batch.num_tokens[seqs] // most)
    piece_seq = np.repeat(np.arange(batch.num_seqs), counts)  # the sequence of every piece
    first_piece = np.concatenate([[0], np.cumsum(counts)[:-1]])
    offset = (np.arange(len(piece_seq)) - first_piece[piece_seq]) * most  # rows before the piece
    whole = batch.num_tokens[piece_seq]
    num_tokens = np.where(counts[piece_seq] > 1, np.minimum(whole - offset, most), whole)
    blk_off = batch.block_offsets()
    block_ids = np.concatenate([batch.block_ids[blk_off[s]:blk_off[s + 1]] for s in piece_seq])
    cut = AttentionBatch(batch.start_positions[piece_seq] + offset, num_tokens,
                         batch.num_blocks[piece_seq], block_ids, batch.block_size)
    return cut, np.flatnonzero(np.isin(piece_seq, seqs))


class _Masks:
    """The sliding window of one prepare: masks keys at slot positions <= q - window, q being a
    row's rotary position (for token-tree rows, root + depth: exact while the window is wider
    than the tree is deep, as every real window is)."""

    def __init__(self, rotary_positions: np.ndarray, window: int) -> None:
        self.rotary_positions, self.window = rotary_positions, window

    def slide(self, mask: np.ndarray, keys: np.ndarray, rows: np.ndarray) -> None:
        """mask [..., Q, K] of query rows `rows` [..., Q] (step rows) over key positions `keys` [K]."""
        if self.window:
            mask &= keys > self.rotary_positions[rows][..., None] - self.window


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              params: AttentionParams) -> torch.Tensor:
    """SDPA over q [B, heads, Q, d], k/v [B, kv_heads, K, d], mask (True = visible, broadcast
    to [B, heads, Q, K]; None: causal, Q == K); with a soft-cap, the same written out (SDPA has
    no soft-cap)."""
    if not params.softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=True, scale=params.scale)
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = params.scale if params.scale is not None else q.shape[-1] ** -0.5
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, heads, Q, K]
    scores = torch.tanh(scores / params.softcap) * params.softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v


def gather_blocks(kv: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """K and V of the blocks in `tables` [A, B], one contiguous copy: [2, A, B * block_size,
    kv_heads, head_dim]. index_select on a [2, num_blocks, -1] view ran 5x faster than
    advanced indexing kv[:, tables] here."""
    two, num_blocks, block_size, kv_heads, head_dim = kv.shape
    rows = kv.view(two, num_blocks, -1).index_select(1, tables.reshape(-1))
    return rows.view(two, tables.shape[0], tables.shape[1] * block_size, kv_heads, head_dim)


class TorchCpuBackend(TorchPagedBackend):
    """The CPU backend: fp32 arithmetic over an fp32, bf16 or f16 pool (`--kv-cache-dtype`; K/V
    are rounded to the pool's type as they are stored and widened as they are read). Short
    chunks (decode, verification) go to the native paged-attention kernel
    (workers/model/csrc/paged_attention.c), which reads K/V in place and computes a row alike
    in any batch; over a 16-bit pool that its keys-in-lanes loop takes, so do chunks up to
    KERNEL_CHUNK_TOKENS (a second padded batch);
    longer chunks, and any where the kernel cannot be built, to torch's CPU SDPA over gathered
    blocks. SmolLM2 decoded 1.1-1.8x faster with the kernel (more at longer contexts:
    docs/runtime.md)."""

    def __init__(self, block_size: int, chunk_bytes: int | None = CPU_CHUNK_BYTES,
                 use_kernel: bool = True, batch_invariant: bool = False) -> None:
        """batch_invariant: every chunk to the kernel, long ones cut into pieces (a row's bits
        then depend on nothing but its sequence: 1.1-1.2x SDPA's prefill time for 1-4k-token
        prompts in 512-token chunks over an f16 pool, Zen 4; more over an fp32 pool)."""
        super().__init__(block_size, "cpu", chunk_bytes)
        self.kernel = cpu_kernels.paged_attention() if use_kernel else None
        self.batch_invariant = batch_invariant and self.kernel is not None
        if self.kernel is not None and (self.batch_invariant or self.kernel.lanes_loop(32)):
            self.medium_chunk_tokens = KERNEL_CHUNK_TOKENS
        self.cuts_long_chunks = self.batch_invariant

    def _takes_medium(self, kv: torch.Tensor, q: torch.Tensor) -> bool:
        """The keys-in-lanes loop's pools only (bf16, f16): over an fp32 pool (key by key) the
        kernel took 2-4x SDPA's time for such chunks. Batch-invariant: every pool it reads."""
        if self.kernel is None or q.dtype != torch.float32:
            return False
        if self.batch_invariant:
            return kv.dtype in self.kernel.SYMBOLS
        return kv.dtype in (torch.bfloat16, torch.float16) and self.kernel.lanes_loop(q.shape[-1])

    def write_kv(self, kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        ops = layer_ops()  # one C call (two index_copy_ took 53 us a layer at batch 1)
        if ops is None or not ops.store_kv(kv, k, v, meta.slots):
            super().write_kv(kv, k, v, meta)

    def _attend_short(self, kv: torch.Tensor, q: torch.Tensor, group: ShortGroup,
                      params: AttentionParams = DEFAULT_PARAMS) -> torch.Tensor:
        if self.kernel is None or kv.dtype not in self.kernel.SYMBOLS or q.dtype != torch.float32:
            return super()._attend_short(kv, q, group, params)
        num_seqs, q_max = group.rows.shape
        q_pad = q.view(num_seqs, 1, *q.shape[1:]) if group.is_identity else q[group.rows]
        out = self.kernel(q_pad, kv, group.tables, group.mask[:, 0], group.num_keys,
                          group.num_rows, params.scale, params.softcap)  # [A, Qmax, heads, head_dim]
        out = out.view(num_seqs * q_max, *q.shape[1:])
        return out if group.is_identity else out[group.valid_rows]


class CudaBackend(TorchPagedBackend):
    """The CUDA backend: the same gathered-block SDPA, run by torch's flash / memory-efficient
    CUDA kernels in bf16. A kernel library with native paged attention (flashinfer, vLLM's
    paged_attention) would replace `attend`'s gather; the metadata stays the same."""

    def __init__(self, block_size: int, device: str = "cuda") -> None:
        require_cuda(device)
        super().__init__(block_size, device, chunk_bytes=None)  # one launch for the whole batch


def require_cuda(device: str = "cuda") -> None:
    """Raise a clear error where `device` names a GPU this machine does not have."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} needs a CUDA GPU, but torch sees none "
                           f"(torch {torch.__version__}, built with CUDA: {torch.version.cuda or 'no'}); "
                           "run with device 'cpu'")
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        raise RuntimeError(f"device {device!r} does not exist: {torch.cuda.device_count()} GPU(s) visible")
