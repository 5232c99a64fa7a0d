"""Messages between processes, grouped by the channel that carries them.

Each message is a small frozen dataclass registered with the codec (orjson header + raw
numpy frames; never pickle). Batches are columnar: per-sequence scalars are int32 arrays
and per-sequence variable-length data (tokens, block tables) is one flat array plus counts.
Owns: message shapes and their cheap structural validation. Does not own: sockets.
"""
from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass, field, replace

import numpy as np

from justapi.sampling import SamplingParams
from justapi.wire.codec import ProtocolError, register

PLACEHOLDER_TOKEN = -1
"""In StepPlan.token_ids (overlap): the token the worker sampled at this position in the
request's previous step, which the scheduler has not seen yet."""
EXACT_CHUNK_TOKENS = 16
"""Chunks of at most this many tokens are computed with decode's arithmetic: every CPU backend
attends their rows with the kernel that decodes (a row alike in any batch), where a longer chunk
may take another order of sums (SDPA). The scheduler recomputes tokens a request already
sampled (a resubmission after a scheduler restart, a recompute after preemption) in chunks of
at most this many, so that they come out bit for bit as they did when they were decoded."""
MAX_DECODE_STEPS = 64
"""Most steps one multi-step plan may ask for (StepPlan.num_steps)."""
_EMPTY_I32 = np.zeros(0, dtype=np.int32)
_EMPTY_F32 = np.zeros(0, dtype=np.float32)
_EMPTY_MASK = np.zeros((0, 0), dtype=np.int32)
_EMPTY_STATES = np.zeros((0, 0), dtype=np.float32)
POOLINGS = ("last", "mean", "cls")
"""How a pooling (embedding) request's hidden states become one vector: the last prompt
position's, the mean over every position, or the first position's (GGUF pooling_type 3, 1,
2), each after the model's final norm."""


def check_pooling(pooling: str, name: str) -> None:
    if pooling and pooling not in POOLINGS:
        raise ProtocolError(f"{name}.pooling must be '' or one of {POOLINGS}, got {pooling!r}")


def _i32(values: object) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(values, dtype=np.int32).reshape(-1))


def offsets(counts: np.ndarray) -> np.ndarray:
    """Per-sequence counts -> start offsets into the flat array, length num_seqs + 1."""
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _check_parents(parents: np.ndarray, counts: np.ndarray, name: str) -> None:
    """Each sequence's draft parents index its own earlier drafts (or -1, the root)."""
    if len(parents) != int(np.sum(counts)):
        raise ProtocolError(f"{name} has {len(parents)} entries, expected {int(np.sum(counts))}")
    off = offsets(counts)
    index = np.arange(len(parents)) - np.repeat(off[:-1], counts)  # draft index within its sequence
    if np.any(parents < -1) or np.any(parents >= index):
        raise ProtocolError(f"{name}: a parent must be -1 or an earlier draft of the same sequence")


def _check_bitmask(rows: np.ndarray, bitmask: np.ndarray, sample_flags: np.ndarray,
                   draft_counts: np.ndarray) -> None:
    """One mask row per listed logits row, each listed row inside the step's logits rows."""
    if bitmask.ndim != 2 or bitmask.dtype != np.int32 or bitmask.shape[0] != len(rows):
        raise ProtocolError(f"StepPlan.token_bitmask must be int32 [{len(rows)}, words], got "
                            f"{bitmask.dtype} {list(bitmask.shape)}")
    num_rows = int(np.sum(1 + draft_counts[np.asarray(sample_flags, dtype=bool)]))
    if len(rows) and (int(np.min(rows)) < 0 or int(np.max(rows)) >= num_rows):
        raise ProtocolError(f"StepPlan.bitmask_rows must lie in [0, {num_rows})")


# --------------------------------------------------------------------------------------
# scheduler -> worker
# --------------------------------------------------------------------------------------


@register("NewRequest")
@dataclass(frozen=True)
class NewRequest:
    """A request the worker has not seen (or must forget and relearn after preemption).

    `token_ids` are all tokens known so far (prompt, then any output already generated),
    so that penalties and seeds see the whole history even when a prefix-cache hit means
    the first chunk does not start at position 0."""

    request_id: str
    sampling: SamplingParams
    num_prompt_tokens: int
    token_ids: np.ndarray  # int32 [num_known_tokens]
    pooling: str = ""
    """A pooling request (POOLINGS; "" generates): its chunks are never sampled; the chunk
    that ends its prompt returns the pooled hidden state in StepResult.pooled_states."""

    def __post_init__(self) -> None:
        check_pooling(self.pooling, "NewRequest")


@register("StepPlan")
@dataclass(frozen=True)
class StepPlan:
    """One forward step for one worker: a flattened batch of chunks of many sequences.

    Sequence i computes tokens at positions [start_positions[i], start_positions[i] +
    num_tokens[i]); its tokens are token_ids[tok_off[i]:tok_off[i+1]] and its block table is
    block_ids[blk_off[i]:blk_off[i+1]] (offsets from `offsets(num_tokens)` and
    `offsets(num_blocks)`). When sample_flags[i] is set the last position's logits are
    sampled; the last num_draft_tokens[i] tokens of the chunk are speculative drafts to verify.
    Drafts form a token tree: draft_parents (flat, offsets(num_draft_tokens)) gives each draft's
    parent as an index into its sequence's drafts, -1 for the last known token (the root);
    parents precede children; empty means every sequence's drafts are a chain. num_propose[i]
    asks the worker's draft model for up to that many tokens for the request's next step
    (empty: none); the block table then also covers those look-ahead positions.
    A token id PLACEHOLDER_TOKEN (-1) stands for the token the worker itself sampled at that
    position in the request's previous step (overlap: planned before that step's result).
    Structured outputs: token_bitmask row r allows the tokens whose bits are set (bit b of
    word w = token 32 w + b; tokens past the last word are disallowed) at logits row
    bitmask_rows[r], counted over the sampled sequences' 1 + num_draft_tokens[i] rows in plan
    order (justapi/structured/masks.py); rows not listed are free.
    num_steps > 1 (multi-step decoding): every sequence decodes one token at a time for
    num_steps steps without a round trip; step j computes position start + j from the token
    step j - 1 sampled (`sub_steps`), the block tables cover all of them, and the result
    holds num_steps tokens per sequence in order (`merge_step_results`).

        token_ids: | seq 0 chunk | seq 1 (decode: 1 token) | seq 2 chunk ... |
        block_ids: | seq 0 table ........ | seq 1 table | seq 2 table ...... |
    """

    step_id: int
    request_ids: list[str]
    start_positions: np.ndarray  # int32 [num_seqs]
    num_tokens: np.ndarray  # int32 [num_seqs]
    token_ids: np.ndarray  # int32 [sum(num_tokens)]
    num_blocks: np.ndarray  # int32 [num_seqs]
    block_ids: np.ndarray  # int32 [sum(num_blocks)]
    sample_flags: np.ndarray  # bool [num_seqs]
    num_draft_tokens: np.ndarray = field(default_factory=lambda: _EMPTY_I32)  # int32 [num_seqs] or []
    new_requests: list[NewRequest] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    draft_parents: np.ndarray = field(default_factory=lambda: _EMPTY_I32)  # int32 [sum(drafts)] or []
    num_propose: np.ndarray = field(default_factory=lambda: _EMPTY_I32)  # int32 [num_seqs] or []
    bitmask_rows: np.ndarray = field(default_factory=lambda: _EMPTY_I32)  # int32 [rows]
    token_bitmask: np.ndarray = field(default_factory=lambda: _EMPTY_MASK)  # int32 [rows, words]
    num_steps: int = 1

    def __post_init__(self) -> None:
        num_seqs = len(self.request_ids)
        for name in ("start_positions", "num_tokens", "num_blocks", "sample_flags"):
            if len(getattr(self, name)) != num_seqs:
                raise ProtocolError(f"StepPlan.{name} has {len(getattr(self, name))} entries, "
                                    f"expected {num_seqs}")
        if len(self.num_draft_tokens) not in (0, num_seqs):
            raise ProtocolError("StepPlan.num_draft_tokens must be empty or one per sequence")
        if int(np.sum(self.num_tokens)) != len(self.token_ids):
            raise ProtocolError("StepPlan.token_ids length disagrees with num_tokens")
        if int(np.sum(self.num_blocks)) != len(self.block_ids):
            raise ProtocolError("StepPlan.block_ids length disagrees with num_blocks")
        if num_seqs and (np.min(self.num_tokens) < 1 or np.min(self.start_positions) < 0):
            raise ProtocolError("StepPlan chunks need >= 1 token and a start position >= 0")
        if len(self.num_propose) not in (0, num_seqs):
            raise ProtocolError("StepPlan.num_propose must be empty or one per sequence")
        if len(self.draft_parents):
            _check_parents(self.draft_parents, self.draft_counts, "StepPlan.draft_parents")
        if len(self.bitmask_rows) or len(self.token_bitmask):
            _check_bitmask(self.bitmask_rows, self.token_bitmask, self.sample_flags,
                           self.draft_counts)
        if self.num_steps > 1 and (np.any(self.num_tokens != 1) or not np.all(self.sample_flags)
                                   or np.any(self.draft_counts) or np.any(self.propose_counts)
                                   or len(self.bitmask_rows)):
            raise ProtocolError("StepPlan.num_steps > 1 needs one sampled token per sequence, "
                                "no drafts, proposals or bitmasks")
        if not 1 <= self.num_steps <= MAX_DECODE_STEPS:
            raise ProtocolError(f"StepPlan.num_steps must be in [1, {MAX_DECODE_STEPS}], got "
                                f"{self.num_steps}")

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    def sub_steps(self) -> list[StepPlan]:
        """The plan as num_steps one-step plans: the first is this one's own step (its tokens,
        new and finished requests); step j computes each sequence's position start + j from
        a placeholder for the token step j - 1 sampled."""
        first = replace(self, num_steps=1)
        if self.num_steps == 1:
            return [first]
        holes = np.full(self.num_seqs, PLACEHOLDER_TOKEN, np.int32)
        return [first] + [replace(first, start_positions=self.start_positions + j, token_ids=holes,
                                  new_requests=[], finished_request_ids=[])
                          for j in range(1, self.num_steps)]

    @property
    def draft_counts(self) -> np.ndarray:
        """num_draft_tokens, with the empty default expanded to zeros."""
        if len(self.num_draft_tokens) == self.num_seqs:
            return self.num_draft_tokens
        return np.zeros(self.num_seqs, dtype=np.int32)

    @property
    def propose_counts(self) -> np.ndarray:
        """num_propose, with the empty default expanded to zeros."""
        if len(self.num_propose) == self.num_seqs:
            return self.num_propose
        return np.zeros(self.num_seqs, dtype=np.int32)

    def parents_of(self, seq: int) -> np.ndarray:
        """Draft parents of sequence `seq` (a chain [-1, 0, 1, ...] when none were sent)."""
        counts = self.draft_counts
        if not len(self.draft_parents):
            return np.arange(-1, int(counts[seq]) - 1, dtype=np.int32)
        off = offsets(counts)
        return self.draft_parents[off[seq]:off[seq + 1]]

    @staticmethod
    def build(step_id: int, chunks: list[tuple[str, int, list[int], list[int], bool]],
              new_requests: list[NewRequest] | None = None,
              finished_request_ids: list[str] | None = None) -> StepPlan:
        """Convenience constructor from (request_id, start, token_ids, block_ids, sample)."""
        return StepPlan(
            step_id=step_id,
            request_ids=[c[0] for c in chunks],
            start_positions=_i32([c[1] for c in chunks]),
            num_tokens=_i32([len(c[2]) for c in chunks]),
            token_ids=_i32([t for c in chunks for t in c[2]]),
            num_blocks=_i32([len(c[3]) for c in chunks]),
            block_ids=_i32([b for c in chunks for b in c[3]]),
            sample_flags=np.asarray([c[4] for c in chunks], dtype=np.bool_),
            new_requests=list(new_requests or []),
            finished_request_ids=list(finished_request_ids or []),
        )


@register("CopyBlocks")
@dataclass(frozen=True)
class CopyBlocks:
    """Copy KV data block by block: src_block_ids[i] of the pool `src_pool` -> dst_block_ids[i]
    of the receiving worker's pool (ids relative to each pool). `src` describes the source
    pool (PD hand-off: a prefill pool, which the decode worker maps once); the worker answers
    BlocksCopied when the data is in place."""

    copy_id: int
    src_pool: int
    src_block_ids: np.ndarray  # int32 [n]
    dst_block_ids: np.ndarray  # int32 [n]
    src: PoolInfo | None = None

    def __post_init__(self) -> None:
        if len(self.src_block_ids) != len(self.dst_block_ids):
            raise ProtocolError(f"CopyBlocks has {len(self.src_block_ids)} source and "
                                f"{len(self.dst_block_ids)} destination blocks")


@register("Shutdown")
@dataclass(frozen=True)
class Shutdown:
    reason: str = ""


@register("AttachWorker")
@dataclass(frozen=True)
class AttachWorker:
    """A restarted scheduler takes the worker over: the worker forgets every request it knew
    (the old scheduler's, recomputed from the frontend's resubmissions) and answers with its
    Ready. Sent once per worker, only by a scheduler that is not the pool's first."""

    scheduler_pid: int


# --------------------------------------------------------------------------------------
# worker -> scheduler
# --------------------------------------------------------------------------------------


@register("StepResult")
@dataclass(frozen=True)
class StepResult:
    """Tokens sampled in one step, echoing its step_id.

    Sequence i (the plan's sampled sequences, in plan order) produced
    sampled_token_ids[off[i]:off[i+1]] with off = offsets(num_sampled); one token normally,
    1..num_draft+1 when verifying drafts (the accepted path's drafts, root first, then the
    bonus/corrected token). A worker with a draft model returns its proposals for the next
    step as a token tree: proposed_token_ids[p[i]:p[i+1]] (p = offsets(num_proposed)) with
    proposed_parents in StepPlan.draft_parents' layout (empty: chains).
    When logprobs were asked, logprobs has one entry per sampled token and
    top_logprob_ids / top_logprobs are [num_sampled_total, max_top_n] padded with -1 / -inf."""

    step_id: int
    worker_id: int
    request_ids: list[str]
    num_sampled: np.ndarray  # int32 [num_seqs]
    sampled_token_ids: np.ndarray  # int32 [sum(num_sampled)]
    logprobs: np.ndarray = field(default_factory=lambda: _EMPTY_F32)  # float32 [sum] or []
    top_logprob_ids: np.ndarray = field(default_factory=lambda: _EMPTY_I32)  # int32 [sum, n]
    top_logprobs: np.ndarray = field(default_factory=lambda: _EMPTY_F32)  # float32 [sum, n]
    error: str | None = None
    num_proposed: np.ndarray = field(default_factory=lambda: _EMPTY_I32)  # int32 [num_seqs] or []
    proposed_token_ids: np.ndarray = field(default_factory=lambda: _EMPTY_I32)  # int32 [sum]
    proposed_parents: np.ndarray = field(default_factory=lambda: _EMPTY_I32)  # int32 [sum] or []
    step_time_s: float = 0.0  # the worker's time on the step (0: not measured): step costs
    pooled_request_ids: list[str] = field(default_factory=list)
    """Pooling requests whose prompt ended in this step, in plan order."""
    pooled_states: np.ndarray = field(default_factory=lambda: _EMPTY_STATES)
    """float32 [len(pooled_request_ids), hidden]: each one's pooled hidden state (after the
    final norm, not normalized), a raw frame."""

    def __post_init__(self) -> None:
        if len(self.pooled_request_ids) != len(self.pooled_states) or self.pooled_states.ndim != 2:
            raise ProtocolError("StepResult.pooled_states must be [pooled requests, hidden]")
        if len(self.num_sampled) != len(self.request_ids):
            raise ProtocolError("StepResult.num_sampled must have one entry per request")
        if int(np.sum(self.num_sampled)) != len(self.sampled_token_ids):
            raise ProtocolError("StepResult.sampled_token_ids length disagrees with num_sampled")
        if len(self.num_proposed) not in (0, len(self.request_ids)):
            raise ProtocolError("StepResult.num_proposed must be empty or one per request")
        if int(np.sum(self.num_proposed)) != len(self.proposed_token_ids):
            raise ProtocolError("StepResult.proposed_token_ids length disagrees with num_proposed")
        if len(self.proposed_parents):
            _check_parents(self.proposed_parents, self.num_proposed, "StepResult.proposed_parents")


def merge_step_results(results: list[StepResult]) -> StepResult:
    """One StepResult of a multi-step plan from its steps' results (one token per sequence
    each): sequence i's tokens (and logprobs) in step order, num_sampled = the number of
    steps."""
    first = results[0]
    num_seqs = len(first.request_ids)
    for result in results:
        if result.error:
            return result
        if list(result.request_ids) != list(first.request_ids) or np.any(result.num_sampled != 1):
            raise ProtocolError("multi-step results must sample one token per sequence each")

    def interleave(name: str) -> np.ndarray:
        columns = [getattr(r, name) for r in results]
        if not len(columns[0]):
            return columns[0]
        stacked = np.stack(columns, axis=1)  # [num_seqs, steps, ...]
        return stacked.reshape((num_seqs * len(results),) + stacked.shape[2:])

    return replace(first, num_sampled=np.full(num_seqs, len(results), np.int32),
                   sampled_token_ids=interleave("sampled_token_ids"),
                   logprobs=interleave("logprobs"), top_logprob_ids=interleave("top_logprob_ids"),
                   top_logprobs=interleave("top_logprobs"))


SHM_PREFIX = "justapi-kv-"
"""A CPU pool's shared-memory name is SHM_PREFIX{creator pid}-{random} (shm_name): the launcher's
segment (justapi/launch/shm_pool.py) and a worker-made one (workers/kv/pool.py) alike."""


def shm_name() -> str:
    """A fresh segment name for a pool this process creates."""
    return f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"


def shm_creator_pid(name: str) -> int | None:
    """The creator's pid in a segment name (shm_name), or None where it has none."""
    match = re.match(rf"/?{SHM_PREFIX}(\d+)-", name)
    return int(match.group(1)) if match else None


@register("PoolInfo")
@dataclass(frozen=True)
class PoolInfo:
    """Where a KV pool lives and its shape [layers, 2, num_blocks, block_size, kv_heads, head_dim]."""

    pool_id: int
    kind: str  # "shm" (POSIX shared memory name) | "cuda_ipc" | "local"
    handle: str  # shm name, or a base64 CUDA IPC handle; "" for local
    device: str
    dtype: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    host: str = ""  # the host whose memory holds it ("" = the launcher's host, local launcher)


@register("Ready")
@dataclass(frozen=True)
class Ready:
    worker_id: int
    pid: int
    model_name: str
    vocab_size: int
    max_context: int
    pool: PoolInfo


@register("BlocksCopied")
@dataclass(frozen=True)
class BlocksCopied:
    """A CopyBlocks order is done: its blocks are readable in the worker's pool (or `error`)."""

    copy_id: int
    worker_id: int
    num_blocks: int = 0
    error: str | None = None


@register("Heartbeat")
@dataclass(frozen=True)
class Heartbeat:
    """Sent by a worker's heartbeat thread every HEARTBEAT_INTERVAL_S (justapi/wire/ids.py):
    process figures, the worker's own GPU figures (torch allocator; {} on CPU, or
    {"fatal": why} for a condition the worker found fatal) and its KV pool's state
    (kind, handle, num_blocks, num_bytes, is_mapped; for shm also is_linked)."""

    worker_id: int
    time_s: float
    rss_bytes: int = 0
    cpu_time_s: float = 0.0
    gpu: dict = field(default_factory=dict)
    pool: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------
# scheduler <-> workers: KV blocks between hosts (docs/scale-out.md). A copy whose source
# pool the destination worker cannot map (another host) is relayed by the scheduler:
# ReadBlocks to a worker on the source pool's host, BlockData chunks back, each forwarded
# to the destination as WriteBlocks, which answers BlocksCopied after the last one.
# --------------------------------------------------------------------------------------


@register("ReadBlocks")
@dataclass(frozen=True)
class ReadBlocks:
    """Send the KV of these blocks of your pool (ids relative to it) as BlockData chunks of
    at most max_chunk_bytes each (at least one block per chunk)."""

    copy_id: int
    block_ids: np.ndarray  # int32 [n]
    max_chunk_bytes: int = 32 << 20


@register("BlockData")
@dataclass(frozen=True)
class BlockData:
    """Blocks [first, first + num_blocks) of a ReadBlocks order: raw bytes of the pool's
    layout [layers, 2, num_blocks, block_size, kv_heads, head_dim] in `dtype`."""

    copy_id: int
    worker_id: int
    first: int
    num_blocks: int
    dtype: str
    data: np.ndarray  # uint8 [num_bytes]
    is_last: bool
    error: str | None = None


@register("WriteBlocks")
@dataclass(frozen=True)
class WriteBlocks:
    """One chunk of a relayed copy into the receiving worker's pool (ids relative to it);
    the worker answers BlocksCopied after the chunk with is_last (with `error` if this or an
    earlier chunk failed, or the source was lost: then data is empty)."""

    copy_id: int
    dst_block_ids: np.ndarray  # int32 [num_blocks]
    dtype: str
    data: np.ndarray  # uint8 [num_bytes]
    is_last: bool
    error: str | None = None


# --------------------------------------------------------------------------------------
# client <-> frontend (justapi.client DEALER <-> the frontend's ROUTER, see docs/api.md)
# --------------------------------------------------------------------------------------


@register("SubmitGeneration")
@dataclass(frozen=True)
class SubmitGeneration:
    """A programmatic client's request: exactly one of `prompt` (text, tokenized by the
    frontend), `prompt_token_ids` or `messages` (chat, rendered with the model's template).

    `client_request_id` is the client's own name for it, unique per connection; every chunk
    echoes it. `stop` strings are matched by the frontend across token boundaries and never
    returned. Semantic checks happen in the frontend, which answers bad input with a
    GenerationChunk carrying `error` (so a client never waits on a dropped message)."""

    client_request_id: str
    sampling: SamplingParams
    prompt: str = ""
    prompt_token_ids: np.ndarray = field(default_factory=lambda: _EMPTY_I32)  # int32 [n]
    messages: list = field(default_factory=list)
    stop: list = field(default_factory=list)
    add_special_tokens: bool = True
    unset_sampling: list[str] = field(default_factory=list)
    """Sampling fields the client left out: the frontend gives them the server's defaults (as
    for an HTTP request that omits them); `sampling` carries the others as set. Empty (a client
    that sent a whole SamplingParams, or one older than this field): `sampling` as sent."""
    tool_options: str = ""
    """With `messages`: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` as one JSON
    object's text (JSON Schemas nest deeper than the codec allows a message to); "" for none.
    The chunks then carry the calls in `tool_calls`."""
    priority: int = 0
    """Scheduling priority (server started with --scheduling-policy priority): lower is
    served sooner and may preempt running requests of a higher value. vLLM's field."""


@register("AbortGeneration")
@dataclass(frozen=True)
class AbortGeneration:
    client_request_ids: list[str]


@register("QueryStats")
@dataclass(frozen=True)
class QueryStats:
    query_id: str


@register("GenerationChunk")
@dataclass(frozen=True)
class GenerationChunk:
    """New output of one generation since its last chunk: token ids and their text.

    The last chunk has a finish_reason (FINISH_*); `error` is set with FINISH_ERROR (bad
    input or an engine failure). Logprob arrays are only sent when the request asked for
    them (None otherwise, saving three frames per chunk): logprobs [len(token_ids)],
    top_logprob_ids / top_logprobs [len(token_ids), n] padded with -1 / -inf."""

    client_request_id: str
    token_ids: np.ndarray  # int32 [num_new_tokens]
    text: str
    finish_reason: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: np.ndarray | None = None  # float32 [num_new_tokens]
    top_logprob_ids: np.ndarray | None = None  # int32 [num_new_tokens, n]
    top_logprobs: np.ndarray | None = None  # float32 [num_new_tokens, n]
    error: str | None = None
    tool_calls: list = field(default_factory=list)
    """A request with tool_options: tool call deltas in OpenAI's streaming shape ({index, id,
    type, function: {name, arguments}} opens a call, {index, function: {arguments}} extends
    it); `text` is then the reply's content without the calls."""


@register("StatsReport")
@dataclass(frozen=True)
class StatsReport:
    """Answer to QueryStats: the latest scheduler snapshot as the frontend sees it."""

    query_id: str
    model_name: str
    max_context: int
    healthy: bool
    problems: list
    stats: dict
    workers: list
    num_in_flight: int


# --------------------------------------------------------------------------------------
# frontend <-> scheduler
# --------------------------------------------------------------------------------------

FINISH_STOP = "stop"  # EOS or a stop token id / stop string
FINISH_LENGTH = "length"  # max_tokens or the context length
FINISH_ABORT = "abort"  # client abort or disconnect
FINISH_ERROR = "error"  # could not be served (see TokenDeltas.errors)


@register("SubmitRequest")
@dataclass(frozen=True)
class SubmitRequest:
    """A tokenized request. `cache_salt` namespaces the prefix cache (model, adapter, tenant):
    requests with different salts never share cached blocks. `output_token_ids` are tokens
    already delivered to the client (a resubmission after a scheduler restart): they continue
    the output (max_tokens, penalties, seeds, a grammar count them), they are not prompt."""

    request_id: str
    prompt_token_ids: np.ndarray  # int32 [num_prompt_tokens]
    sampling: SamplingParams
    arrival_time_s: float = 0.0
    priority: int = 0
    cache_salt: str = ""
    pooling: str = ""
    """Embeddings: computes the prompt only and finishes ("stop") with its pooled hidden
    state in TokenDeltas.embeddings, keeping no KV but the prefix cache's; "" generates."""
    output_token_ids: np.ndarray = field(default_factory=lambda: _EMPTY_I32)  # int32 [delivered]

    def __post_init__(self) -> None:
        check_pooling(self.pooling, "SubmitRequest")


@register("AbortRequest")
@dataclass(frozen=True)
class AbortRequest:
    request_ids: list[str]


@register("TokenDeltas")
@dataclass(frozen=True)
class TokenDeltas:
    """New tokens of many requests after one step (coalesced: one message per step).

    Request i got token_ids[off[i]:off[i+1]] with off = offsets(num_new_tokens) (possibly
    zero tokens, e.g. a finish by abort). finish_reasons[i] is "" while running. Logprob
    arrays follow StepResult's layout when any request asked for them.
    num_cached_tokens[i] is the prompt tokens served from the prefix cache (reported with
    the request's first delta, 0 afterwards); errors maps request id -> message.
    scheduler_pid: the scheduler process that sent it (0: not said): the frontend drops what
    a dead scheduler had sent once its successor took the requests over (it recomputes it)."""

    step_id: int
    request_ids: list[str]
    num_new_tokens: np.ndarray  # int32 [n]
    token_ids: np.ndarray  # int32 [sum]
    finish_reasons: list[str]
    num_cached_tokens: np.ndarray = field(default_factory=lambda: _EMPTY_I32)  # int32 [n] or []
    logprobs: np.ndarray = field(default_factory=lambda: _EMPTY_F32)
    top_logprob_ids: np.ndarray = field(default_factory=lambda: _EMPTY_I32)
    top_logprobs: np.ndarray = field(default_factory=lambda: _EMPTY_F32)
    errors: dict = field(default_factory=dict)
    embedding_request_ids: list[str] = field(default_factory=list)
    """Pooling requests that finished in this step with their pooled hidden state..."""
    embeddings: np.ndarray = field(default_factory=lambda: _EMPTY_STATES)
    """...float32 [len(embedding_request_ids), hidden] (StepResult.pooled_states' rows)."""
    scheduler_pid: int = 0

    def __post_init__(self) -> None:
        if len(self.embedding_request_ids) != len(self.embeddings) or self.embeddings.ndim != 2:
            raise ProtocolError("TokenDeltas.embeddings must be [embedding requests, hidden]")
        n = len(self.request_ids)
        if len(self.num_new_tokens) != n or len(self.finish_reasons) != n:
            raise ProtocolError("TokenDeltas columns must have one entry per request")
        if int(np.sum(self.num_new_tokens)) != len(self.token_ids):
            raise ProtocolError("TokenDeltas.token_ids length disagrees with num_new_tokens")


@register("SchedulerStarted")
@dataclass(frozen=True)
class SchedulerStarted:
    """A scheduler process has its workers and takes requests. The frontend holds every open
    request while the scheduler is down; a SchedulerStarted with another pid than the one it
    knows is a restarted scheduler, to which it resubmits them (prompt + delivered tokens)."""

    pid: int
    num_restarts: int  # the pool's scheduler restarts before this one (0: the first)


@register("SchedulerStats")
@dataclass(frozen=True)
class SchedulerStats:
    """Periodic snapshot pushed to the frontend: scheduler counters and the health table.

    `stats` holds flat numeric figures (names as exported on /metrics); `workers` one dict per
    worker (id, pool, healthy, load, kv usage, ...); `healthy` is the scheduler's own verdict
    (progressing, and every pool has a healthy worker)."""

    time_s: float
    healthy: bool
    stats: dict
    workers: list
    problems: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    """Conditions that do not make the server unhealthy: an unhealthy worker whose pool still
    has a healthy one, a draining worker."""


# --------------------------------------------------------------------------------------
# every process -> launcher
# --------------------------------------------------------------------------------------


@register("ProcessReady")
@dataclass(frozen=True)
class ProcessReady:
    """A process finished starting; `info` carries what the launcher prints (pool, endpoints)."""

    role: str  # "frontend" | "scheduler" | "worker"
    index: int
    pid: int
    info: dict = field(default_factory=dict)


@register("ProcessFailed")
@dataclass(frozen=True)
class ProcessFailed:
    """A process could not start (or died on a fatal error); `error` is one readable line."""

    role: str
    index: int
    pid: int
    error: str


@register("FenceWorker")
@dataclass(frozen=True)
class FenceWorker:
    """Scheduler -> launcher: kill worker `worker_id`'s process `pid`, declared unhealthy, which
    the scheduler cannot signal itself (it runs on another host, e.g. as a Ray actor). A
    replacement process (another pid) is never hit."""

    worker_id: int
    pid: int
    reason: str


# --------------------------------------------------------------------------------------
# ops commands <-> scheduler (justapi/ops/ DEALER <-> the scheduler's admin ROUTER; see
# docs/operations.md). Every command gets exactly one reply: StatusReply or AdminReply.
# --------------------------------------------------------------------------------------


@register("QueryStatus")
@dataclass(frozen=True)
class QueryStatus:
    """Ask for the scheduler's state: workers, health table, queues, cache statistics."""


@register("DrainWorker")
@dataclass(frozen=True)
class DrainWorker:
    """Stop admitting new requests to a worker (running ones finish), or undrain it."""

    worker_id: int
    is_draining: bool = True


@register("FlushPrefixCache")
@dataclass(frozen=True)
class FlushPrefixCache:
    """Evict every prefix-cache block no request holds; pool_id -1 flushes every pool."""

    pool_id: int = -1


@register("CheckInvariants")
@dataclass(frozen=True)
class CheckInvariants:
    """Run the scheduler core's full consistency check (O(requests + blocks))."""


@register("StatusReply")
@dataclass(frozen=True)
class StatusReply:
    """The scheduler's state. `workers` is the health table (one dict per worker: pool, pid,
    device, healthy, reason, draining, heartbeat age, process and GPU figures); `gpus` the
    NVML readings by GPU; `nvml` says whether NVML is in use ("ok", "not needed (CPU
    workers)" or why it is unavailable); `stats` the core's flat figures (justapi/scheduler/
    stats.py names)."""

    time_s: float
    uptime_s: float
    healthy: bool
    problems: list
    warnings: list
    stats: dict
    workers: list
    gpus: list = field(default_factory=list)
    nvml: str = ""


@register("AdminReply")
@dataclass(frozen=True)
class AdminReply:
    """The outcome of an admin command: `ok`, one readable line, and its figures."""

    ok: bool
    message: str
    figures: dict = field(default_factory=dict)
