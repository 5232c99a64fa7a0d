"""Collects one step's per-request news into a coalesced TokenDeltas message.

Emitted tokens are a prefix of what the worker sampled for the request (tokens after a stop
are cut), so their logprobs are gathered from the StepResult by flat index - then, for a
constrained request, the tokens its grammar forced (logprob 0: the only token allowed).
Owns: the delta columns. Does not own: finishing decisions (results.py).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from justapi.scheduler.request import Request
from justapi.wire.protocol import StepResult, TokenDeltas

FORCED = -1
"""source_index of a token a grammar forced (jump-forward): no StepResult entry."""


class DeltaBuilder:
    """Appends (request, tokens, finish reason) rows, then builds a TokenDeltas."""

    def __init__(self, step_id: int) -> None:
        self.step_id = step_id
        self.request_ids: list[str] = []
        self.num_new_tokens: list[int] = []
        self.token_ids: list[int] = []
        self.finish_reasons: list[str] = []
        self.num_cached_tokens: list[int] = []
        self.source_index: list[int] = []  # flat index into the StepResult per emitted token
        self.errors: dict[str, str] = {}
        self.embedding_request_ids: list[str] = []
        self.embeddings: list[np.ndarray] = []  # float32 [hidden] each (a pooled state)

    def add(self, req: Request, tokens: list[int], reason: str, first_index: int = 0,
            num_forced: int = 0) -> None:
        """The last num_forced tokens were forced by a grammar (no StepResult entry: logprob
        0, the token itself its only alternative)."""
        self._fill_ones()
        self.request_ids.append(req.request_id)
        self.num_new_tokens.append(len(tokens))
        self.token_ids.extend(tokens)
        self.finish_reasons.append(reason)
        num_sampled = len(tokens) - num_forced
        self.source_index.extend(range(first_index, first_index + num_sampled))
        self.source_index.extend([FORCED] * num_forced)
        self.num_cached_tokens.append(0 if req.has_reported else req.num_cached_tokens)
        req.has_reported = True

    def add_one(self, req: Request, token: int, reason: str, index: int) -> None:
        """add() for exactly one token (the common decode case), without list building."""
        self.request_ids.append(req.request_id)
        self.token_ids.append(token)
        self.finish_reasons.append(reason)
        self.source_index.append(index)
        self.num_cached_tokens.append(0 if req.has_reported else req.num_cached_tokens)
        req.has_reported = True

    def add_embedding(self, request_id: str, pooled_state: np.ndarray) -> None:
        """A pooling request's result (its row also needs add())."""
        self.embedding_request_ids.append(request_id)
        self.embeddings.append(pooled_state)

    def add_error(self, req: Request, reason: str, message: str) -> None:
        self.add(req, [], reason)
        self.errors[req.request_id] = message

    def __len__(self) -> int:
        return len(self.request_ids)

    def _fill_ones(self) -> None:
        """Rows added by add_one have one token each: fill in num_new_tokens lazily."""
        missing = len(self.request_ids) - len(self.num_new_tokens)
        if missing:
            self.num_new_tokens.extend([1] * missing)

    def build(self, result: StepResult | None = None) -> TokenDeltas:
        self._fill_ones()
        logprobs, top_ids, top_lps = _gather_logprobs(result, self.source_index, self.token_ids)
        deltas = TokenDeltas(
            step_id=self.step_id, request_ids=self.request_ids,
            num_new_tokens=np.asarray(self.num_new_tokens, dtype=np.int32),
            token_ids=np.asarray(self.token_ids, dtype=np.int32),
            finish_reasons=self.finish_reasons,
            num_cached_tokens=np.asarray(self.num_cached_tokens, dtype=np.int32),
            logprobs=logprobs, top_logprob_ids=top_ids, top_logprobs=top_lps,
            errors=self.errors)
        if not self.embeddings:
            return deltas
        return dataclasses.replace(deltas, embedding_request_ids=self.embedding_request_ids,
                                   embeddings=np.stack(self.embeddings).astype(np.float32))


def _gather_logprobs(result: StepResult | None, index: list[int],
                     token_ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    empty_f = np.zeros(0, dtype=np.float32)
    empty_i = np.zeros(0, dtype=np.int32)
    if result is None or not len(result.logprobs):
        return empty_f, empty_i, empty_f
    idx = np.asarray(index, dtype=np.int64)
    forced = idx == FORCED
    logprobs = np.where(forced, np.float32(0.0), result.logprobs[idx])
    if result.top_logprob_ids.ndim != 2:
        return logprobs, empty_i, empty_f
    top_ids, top_lps = result.top_logprob_ids[idx], result.top_logprobs[idx]
    if forced.any():  # a forced token is its own only alternative
        top_ids[forced], top_lps[forced] = -1, -np.inf
        if top_ids.shape[1]:
            top_ids[forced, 0] = np.asarray(token_ids, dtype=np.int32)[forced]
            top_lps[forced, 0] = 0.0
    return logprobs, top_ids, top_lps
