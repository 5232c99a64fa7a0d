"""The host side of the in-place paged attention kernel: one step's sequences as the int32
arrays the kernel reads (block tables, query tiles, token-tree bits), padded to a batch-size
bucket when the step replays a captured CUDA graph.

    rows:   | seq 0: n0 rows          | seq 1: n1 rows | ... | pad seqs (n rows, no keys) |
    tiles:  | (0, 0) (0, bq) (0, 2bq) | (1, 0)         | ... | (pad, 0)                   |

A tile is `block_q` consecutive rows of one sequence; the kernel computes it for every query
head of one KV head (block_q * group query rows). Padding rows have slot -1 (their K/V are not
stored) and padding sequences no keys (their rows attend to nothing and come out zero).
Owns: that layout and its padding. Does not own: the kernel (triton_attention.py), the device
copies (paged_backend.py, step_graphs.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from workers.model.attention import AttentionBatch

PREFILL_BLOCK_M = 64
"""Query rows (tokens x heads of a KV group) per tile when some chunk is long."""
DECODE_BLOCK_M = 16
"""...and when every chunk fits one 16-row tile (decode, short verification): the smallest
tile Triton's dot takes."""


@dataclass(frozen=True)
class PagedLayout:
    """One step, as the kernel reads it. Per row: [T]; per sequence: [S]; per tile: [NT]."""

    positions: np.ndarray  # int64 [T]: rotary position (tree rows: root + depth)
    slots: np.ndarray  # int64 [T]: KV slot the row's K/V go to; -1: a padding row
    first_rows: np.ndarray  # int32 [S]: the sequence's first row
    starts: np.ndarray  # int32 [S]: position of that row
    num_rows: np.ndarray  # int32 [S]
    num_keys: np.ndarray  # int32 [S]: start + num_rows; 0 for a padding sequence
    tables: np.ndarray  # int32 [S, W]: block ids up to the blocks the positions reach, 0-padded
    tile_seqs: np.ndarray  # int32 [NT]
    tile_rows: np.ndarray  # int32 [NT]: the tile's first row within its sequence's chunk
    tree_first_rows: np.ndarray  # int32 [S]: first restricted row of the chunk (see spec/tree.py)
    tree_bases: np.ndarray  # int32 [S]: slot position where the restriction starts
    tree_rows: np.ndarray  # int32 [S]: restricted rows; 0 without a tree
    tree_spans: np.ndarray  # int32 [S]
    tree_offsets: np.ndarray  # int32 [S]: where the sequence's bits start in tree_bits
    tree_bits: np.ndarray  # int8 [sum(tree_rows * tree_spans)]: 1 = key visible, row-major
    block_m: int  # query rows per tile (a power of two)
    block_q: int  # rows of one sequence per tile: block_m // group

    @property
    def num_seqs(self) -> int:
        return len(self.num_rows)

    @property
    def num_tiles(self) -> int:
        return len(self.tile_seqs)

    @property
    def has_tree(self) -> bool:
        return bool(self.tree_rows.any())


def block_m_for(max_rows: int, group: int) -> int:
    """Query rows per tile: one 16-row tile for short chunks, else PREFILL_BLOCK_M; always a
    power of two holding at least one token's heads."""
    base = DECODE_BLOCK_M if max_rows * group <= DECODE_BLOCK_M else PREFILL_BLOCK_M
    return max(base, 1 << (group - 1).bit_length())


def paged_layout(batch: AttentionBatch, group: int, block_m: int | None = None) -> PagedLayout:
    """The layout of `batch` for a model with `group` query heads per KV head."""
    rows = batch.num_tokens.astype(np.int64)
    block_m = block_m or block_m_for(int(rows.max(initial=1)), group)
    block_q = block_m // group
    positions = batch.positions()
    slots = batch.slots(positions)
    if batch.tree:
        positions = batch.tree.rotary_positions(batch.token_offsets(), positions)
    tiles_per_seq = -(-rows // block_q)
    tile_seqs = np.repeat(np.arange(batch.num_seqs), tiles_per_seq)
    tile_rows = (np.arange(len(tile_seqs)) - np.repeat(_offsets(tiles_per_seq)[:-1], tiles_per_seq)) * block_q
    tables = _tables(batch)
    tree = _tree_arrays(batch)
    i32 = np.int32
    return PagedLayout(
        positions=positions.astype(np.int64), slots=slots.astype(np.int64),
        first_rows=batch.token_offsets()[:-1].astype(i32), starts=batch.start_positions.astype(i32),
        num_rows=rows.astype(i32), num_keys=(batch.start_positions + rows).astype(i32),
        tables=tables.astype(i32), tile_seqs=tile_seqs.astype(i32), tile_rows=tile_rows.astype(i32),
        **tree, block_m=block_m, block_q=block_q)


def _tables(batch: AttentionBatch) -> np.ndarray:
    """[S, W] block tables cut to the blocks each sequence's positions reach, padded with 0
    (AttentionBatch.padded_tables without its loop over sequences: a GPU step has hundreds)."""
    used = -(-(batch.start_positions + batch.num_tokens) // batch.block_size)  # [S]
    cols = np.arange(max(1, int(used.max(initial=1))))
    if not len(batch.block_ids):
        return np.zeros((batch.num_seqs, len(cols)), np.int64)
    last = np.maximum(used - 1, 0)[:, None]
    index = np.minimum(batch.block_offsets()[:-1, None] + np.minimum(cols[None, :], last),
                       len(batch.block_ids) - 1)
    return np.where(cols[None, :] < used[:, None], batch.block_ids[index], 0)


def _offsets(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def _tree_arrays(batch: AttentionBatch) -> dict[str, np.ndarray]:
    """Every sequence's TreeMask packed: scalars per sequence, bits back to back."""
    num = batch.num_seqs
    fields = {name: np.zeros(num, np.int32) for name in
              ("tree_first_rows", "tree_bases", "tree_rows", "tree_spans", "tree_offsets")}
    bits: list[np.ndarray] = []
    offset = 0
    for seq, mask in sorted((batch.tree.masks if batch.tree else {}).items()):
        rows, span = mask.allowed.shape
        for name, value in (("tree_first_rows", mask.first_row), ("tree_bases", mask.base),
                            ("tree_rows", rows), ("tree_spans", span), ("tree_offsets", offset)):
            fields[name][seq] = value
        bits.append(mask.allowed.reshape(-1).astype(np.int8))
        offset += rows * span
    fields["tree_bits"] = np.concatenate(bits) if bits else np.zeros(1, np.int8)
    return fields


def pad_layout(layout: PagedLayout, num_seqs: int, rows_per_seq: int) -> PagedLayout:
    """`layout` (every sequence `rows_per_seq` rows) grown to `num_seqs` sequences with
    padding ones: rows_per_seq rows each, no keys, slots -1, tiles like a real sequence's.

        seqs:  | real 0 .. S-1 | pad S .. num_seqs-1 |    rows: S * q real, then pads
    """
    real = layout.num_seqs
    if num_seqs < real or np.any(layout.num_rows != rows_per_seq):
        raise ValueError(f"cannot pad {real} sequences of {layout.num_rows.tolist()} rows to "
                         f"{num_seqs} of {rows_per_seq}")
    extra_seqs, extra_rows = num_seqs - real, (num_seqs - real) * rows_per_seq
    tiles_per_seq = -(-rows_per_seq // layout.block_q)
    pad_seq_ids = np.repeat(np.arange(real, num_seqs), tiles_per_seq)
    pad_tile_rows = np.tile(np.arange(tiles_per_seq) * layout.block_q, extra_seqs)
    zeros = np.zeros(extra_seqs, np.int32)
    grow: dict[str, Any] = {name: np.concatenate([getattr(layout, name), zeros]) for name in
            ("starts", "num_keys", "tree_first_rows", "tree_bases", "tree_rows", "tree_spans",
             "tree_offsets")}
    return dataclasses.replace(
        layout, **grow,
        positions=np.concatenate([layout.positions, np.zeros(extra_rows, np.int64)]),
        slots=np.concatenate([layout.slots, np.full(extra_rows, -1, np.int64)]),
        first_rows=np.arange(num_seqs, dtype=np.int32) * rows_per_seq,
        num_rows=np.full(num_seqs, rows_per_seq, np.int32),
        tables=np.concatenate([layout.tables, np.zeros((extra_seqs, layout.tables.shape[1]), np.int32)]),
        tile_seqs=np.concatenate([layout.tile_seqs, pad_seq_ids]).astype(np.int32),
        tile_rows=np.concatenate([layout.tile_rows, pad_tile_rows]).astype(np.int32))


def pad_mixed_layout(layout: PagedLayout, num_seqs: int, num_rows: int, num_tiles: int) -> PagedLayout:
    """Any step's `layout` grown to a mixed graph's shape: `num_rows` rows, `num_seqs`
    sequences, `num_tiles` tiles. The rows past the real ones form one padding sequence (no
    keys, slots -1: they attend to nothing and write nothing); the other padding sequences have
    no rows; the tiles past those covering rows point past that sequence's rows (computing
    nothing).

        rows:  | real rows R        | padding sequence's rows (num_rows - R) |
        seqs:  | real 0 .. S-1      | pad S (the rows) | pad S+1 .. (empty)   |
        tiles: | real tiles         | pad S's tiles    | idle tiles (pad S)   |
    """
    real_seqs, real_rows = layout.num_seqs, len(layout.slots)
    extra_rows = num_rows - real_rows
    row_tiles = -(-extra_rows // layout.block_q)
    if num_seqs <= real_seqs or extra_rows < 0 or layout.num_tiles + row_tiles > num_tiles:
        raise ValueError(f"a step of {real_seqs} sequences, {real_rows} rows and {layout.num_tiles} "
                         f"tiles does not fit {num_seqs} sequences, {num_rows} rows, {num_tiles} tiles")
    extra_seqs = num_seqs - real_seqs
    rows = np.zeros(extra_seqs, np.int32)
    rows[0] = extra_rows
    zeros = np.zeros(extra_seqs, np.int32)
    grow: dict[str, Any] = {name: np.concatenate([getattr(layout, name), zeros]) for name in
                            ("starts", "num_keys", "tree_first_rows", "tree_bases", "tree_rows",
                             "tree_spans", "tree_offsets")}
    idle = num_tiles - layout.num_tiles - row_tiles
    pad_tile_rows = np.concatenate([np.arange(row_tiles) * layout.block_q,
                                    np.full(idle, row_tiles * layout.block_q)])
    return dataclasses.replace(
        layout, **grow,
        positions=np.concatenate([layout.positions, np.zeros(extra_rows, np.int64)]),
        slots=np.concatenate([layout.slots, np.full(extra_rows, -1, np.int64)]),
        first_rows=np.concatenate([layout.first_rows, np.full(extra_seqs, real_rows, np.int32)]),
        num_rows=np.concatenate([layout.num_rows, rows]),
        tables=np.concatenate([layout.tables, np.zeros((extra_seqs, layout.tables.shape[1]), np.int32)]),
        tile_seqs=np.concatenate([layout.tile_seqs, np.full(num_tiles - layout.num_tiles, real_seqs)]).astype(np.int32),
        tile_rows=np.concatenate([layout.tile_rows, pad_tile_rows]).astype(np.int32))
