"""One request's scheduling state; everything else about it is derived as a property.

The one rule (vLLM v1): a running request wants `num_tokens + num_draft_tokens -
num_computed_tokens` more tokens computed. Prefill, chunked prefill, decode, recompute after
preemption, prefix hits (which advance num_computed_tokens for free) and speculative
verification are all that rule.

    token_ids:  | prompt ............ | output ...... |  drafts (not yet accepted)
                0                num_prompt    num_tokens   num_tokens + num_draft_tokens
    computed:   [0, num_computed_tokens)  -- KV written at the slots of block_ids
    decoding:   num_computed_tokens >= num_tokens - 1 - num_jumped (the last sampled token
                and the tokens a grammar forced after it are computed in one chunk)

With overlap (overlap.py) a step may be planned while the request's previous step is still
in flight: num_computed_tokens then counts that step's tokens too, and when it samples the
request (num_computed_tokens == num_tokens) the next step's input is a placeholder the worker
fills with what it sampled. A request that finishes while a later step still computes it keeps
its blocks (is_finishing) until that step lands.

Owns: the per-request fields. Does not own: blocks (BlockPool/KvCacheManager), queues.
"""
from __future__ import annotations

import array
import enum
from typing import TYPE_CHECKING

from justapi.sampling import SamplingParams
from justapi.scheduler.kv.radix_node import RadixNode
from justapi.scheduler.spec.budget import Acceptance

if TYPE_CHECKING:
    from justapi.structured.matcher import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # in its pool's waiting queue; holds no blocks
    RUNNING = "running"  # admitted on a worker; holds blocks
    HANDOFF = "handoff"  # PD: prompt computed, between a prefill and a decode worker; holds blocks
    FINISHED = "finished"


class Request:
    """A request from SubmitRequest to finish."""

    __slots__ = ("request_id", "sampling", "token_ids", "num_prompt_tokens", "seq", "priority",
                 "sort_key", "arrival_time_s", "cache_salt", "max_len", "final_len", "stop_ids",
                 "status",
                 "pool_id", "worker_id", "num_computed_tokens", "draft_token_ids", "block_ids",
                 "cache_node", "num_cached_blocks", "num_cached_tokens", "has_reported",
                 "is_in_flight", "is_abort_pending", "finish_reason", "num_preemptions",
                 "queue_entry", "enqueued_step", "draft_parents", "spec_acceptance",
                 "spec_idle_steps", "spec_propose", "last_step_id", "waits_for_token",
                 "grammar", "num_jumped", "pooling", "uses_long_rope", "is_suspect", "retry_pending")

    def __init__(self, request_id: str, sampling: SamplingParams, prompt_token_ids: array.array,
                 seq: int, priority: int = 0) -> None:
        self.request_id = request_id
        self.sampling = sampling
        self.token_ids = prompt_token_ids  # int32 array: prompt, then output tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self.seq = seq  # global arrival order
        self.priority = priority  # lower value = served first (priority policy)
        self.sort_key = (0, seq)  # queue order and preemption order: larger = preempted first
        self.arrival_time_s = 0.0
        self.cache_salt = ""
        self.max_len = 0  # context cap: min(model context, pool capacity in tokens)
        self.final_len = 0  # finishes with "length" here: min(max_len, prompt + max_tokens)
        self.stop_ids: frozenset[int] = frozenset()  # stop ids, plus EOS unless ignore_eos
        self.status = RequestStatus.WAITING
        self.pool_id = -1
        self.worker_id = -1  # the worker it runs on while RUNNING
        self.num_computed_tokens = 0
        self.draft_token_ids: list[int] = []
        self.block_ids = array.array("i")  # global block ids covering computed (+scheduled) tokens
        self.cache_node: RadixNode | None = None  # deepest cached node of its prefix
        self.num_cached_blocks = 0  # block_ids[:num_cached_blocks] are in the prefix cache
        self.num_cached_tokens = 0  # prompt tokens served from the cache (first admission)
        self.has_reported = False  # a delta was sent (num_cached_tokens goes with the first)
        self.is_in_flight = False  # in a step whose result has not come back
        self.last_step_id = -1  # the latest step that computes it (overlap: a later one may land last)
        self.waits_for_token = False  # no step is planned for it before its last token is known
        self.is_abort_pending = False  # aborted while in flight: finish when the result returns
        self.finish_reason = ""
        self.num_preemptions = 0
        self.is_suspect = False  # retried after a failed step, no token sampled since (retries.py)
        self.retry_pending = False  # to be re-queued when the later step computing it lands
        self.queue_entry: list | None = None  # its live entry in a WaitingQueue heap
        self.enqueued_step = 0
        # Speculative decoding (justapi/scheduler/spec/speculation.py): the drafts' token tree
        # (parent per draft, [] = a chain), acceptance history, steps without drafts, and how
        # many tokens the worker's draft model proposes for the next step.
        self.draft_parents: list[int] = []
        self.spec_acceptance = Acceptance()
        self.spec_idle_steps = 0
        self.spec_propose = 0
        # Structured outputs (justapi/scheduler/structured.py): the output's matcher (None =
        # free), and how many tokens the grammar forced after the last sampled one (appended
        # without a model call, computed with the next chunk: jump-forward).
        self.grammar: RequestGrammar | None = None
        self.num_jumped = 0
        # Embeddings: a pooling request ("last", "mean", "cls"; "" generates) computes its
        # prompt only, in prefill chunks that are never sampled, and finishes when the chunk
        # ending the prompt lands with its pooled hidden state (results.py).
        self.pooling = ""
        # LongRoPE (justapi/scheduler/long_rope.py): its KV has the long table (its cache salt
        # says so); taken for good when it is queued with more tokens than the original context.
        self.uses_long_rope = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def num_tokens_wanted(self) -> int:
        """The rule: tokens still to compute, drafts included."""
        return len(self.token_ids) + len(self.draft_token_ids) - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """Only the last sampled token (then any tokens jumped after it, and drafts) is left
        to compute. Never for a pooling request (it has no sampled token)."""
        return (self.num_computed_tokens >= len(self.token_ids) - 1 - self.num_jumped
                and not self.pooling)

    @property
    def needs_every_position(self) -> bool:
        """A pooling request that reads every prompt position's hidden state (mean) or the
        first one's (cls): prefix-cache hits would skip them, so it takes none."""
        return self.pooling in ("mean", "cls")

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_finishing(self) -> bool:
        """Finished (and reported) while a later step still computes it: it keeps its blocks
        until that step lands, and that step's tokens are dropped."""
        return bool(self.finish_reason) and self.status is not RequestStatus.FINISHED

    def token_bytes(self) -> bytes:
        """int32 bytes of the known tokens (radix tree keys)."""
        return self.token_ids.tobytes()

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
