"""Structured outputs in the scheduler core: requests waiting for their grammar, drafts fitted
to it, the token bitmasks of a step, and forced tokens.

    add_request -> hold (compile on the pool) -> ready: queued as usual | failed: "error"
                   (a resubmitted request's delivered tokens are replayed into it first)
    before a step: drafts cut at the first node the grammar refuses
    the step:      one mask row per constrained logits row (root + drafts), in the plan
    the result:    each emitted token is consumed once; a complete grammar finishes "stop";
                   then the tokens the grammar forces are appended at once (jump-forward)

Forced tokens (llguidance's compute_ff_tokens: the canonical tokens of the bytes that are the
only continuation, e.g. a schema's fixed keys and closing braces) need no model call: at a
forced position the mask allows exactly that token (llguidance masks forced bytes to their
canonical tokenization), so plain constrained decoding would pick it whatever the logits,
greedy or sampled. They are emitted with the step's tokens (logprob 0) and their KV is
computed with the request's next chunk, like a prompt's tail: no logits, no sampling.
Owns: the waiting table, the mask executor and the counters. Does not own: compiling
(justapi/structured/compiler.py), requests' lifecycle (state.py) or applying masks (worker).
"""
from __future__ import annotations

import os
import time
from collections.abc import Collection
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import replace

import llguidance as llg
import numpy as np

from justapi.scheduler.batch import StepBatch
from justapi.scheduler.faults import RequestFailures
from justapi.scheduler.request import Request
from justapi.scheduler.spec.tree import is_chain
from justapi.structured.compiler import GrammarCompiler
from justapi.structured.masks import MaskItem, fill_masks
from justapi.structured.matcher import RequestGrammar
from justapi.structured.tokenizer import mask_words

MAX_FORCED_TOKENS = 32
"""Most forced tokens appended at once (each is a position of the next chunk)."""


class StructuredOutputs:
    """The core's structured-output state (None on the core when the model has no tokenizer)."""

    def __init__(self, compiler: GrammarCompiler, eos_token_ids: Collection[int],
                 max_forced_tokens: int = MAX_FORCED_TOKENS, num_threads: int = 0) -> None:
        """num_threads: mask threads for big batches (0: half the CPUs, 1 to 8)."""
        self.compiler = compiler
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_forced_tokens = max_forced_tokens
        num_threads = num_threads or min(8, max(1, (os.cpu_count() or 2) // 2))
        self.executor = llg.LLExecutor(num_threads=num_threads)
        self.pending: dict[str, Request] = {}  # waiting for their compile, in arrival order
        self.num_requests = 0
        self.num_failed = 0
        self.num_forced_tokens = 0
        self.num_cut_drafts = 0
        self.num_mask_rows = 0
        self.mask_seconds = 0.0

    # ------------------------------------------------------------------ admission
    def hold(self, req: Request) -> None:
        """Start the request's compile; it waits here until take_compiled() hands it over."""
        assert req.sampling.structured is not None
        req.grammar = RequestGrammar(self.compiler.submit(req.sampling.structured))
        req.waits_for_token = True  # overlap: its bitmask needs its previous token
        self.pending[req.request_id] = req
        self.num_requests += 1

    def take_compiled(self, timeout_s: float = 0.0) -> list[tuple[Request, str]]:
        """Requests whose compile finished (waiting up to timeout_s for one), each with why it
        cannot run ("" when its matcher is ready)."""
        grammars = {rid: _grammar_of(req) for rid, req in self.pending.items()}
        if timeout_s > 0 and grammars and not any(g.is_compiled for g in grammars.values()):
            wait([g.future for g in grammars.values()], timeout=timeout_s,
                 return_when=FIRST_COMPLETED)
        out = []
        for rid, grammar in grammars.items():
            if grammar.is_compiled:
                req = self.pending[rid]
                try:
                    error = grammar.start() or grammar.replay(req.token_ids[req.num_prompt_tokens:])
                except Exception as exc:  # a bug in the matcher's copy: this request fails
                    error = f"grammar start failed: {type(exc).__name__}: {exc}"
                self.num_failed += bool(error)
                out.append((self.pending.pop(rid), error))
        return out

    def drop(self, request_id: str) -> Request | None:
        """Forget a request still waiting for its compile (aborted)."""
        return self.pending.pop(request_id, None)

    # ------------------------------------------------------------------ before a step
    def fit_drafts(self, req: Request) -> None:
        """Cut the request's drafts at the first node the grammar refuses."""
        grammar = _grammar_of(req)
        tokens, parents = req.draft_token_ids, req.draft_parents
        keep = grammar.num_valid_drafts(tokens, parents, self.eos_token_ids)
        if keep < len(tokens):
            req.draft_token_ids = tokens[:keep]
            parents = parents[:keep]
            req.draft_parents = [] if is_chain(parents) else parents
            self.num_cut_drafts += len(tokens) - keep

    # ------------------------------------------------------------------ after a step
    def forced_tokens(self, req: Request) -> list[int]:
        """The tokens the grammar forces after the request's output (jump-forward), at most
        max_forced_tokens and never past its finish; the caller appends them."""
        limit = min(self.max_forced_tokens, req.final_len - req.num_tokens)
        forced = _grammar_of(req).forced_tokens(limit)
        self.num_forced_tokens += len(forced)
        return forced

    # ------------------------------------------------------------------ the step
    def masks(self, batch: StepBatch) -> tuple[np.ndarray, np.ndarray] | None:
        """(bitmask_rows, token_bitmask) for the batch's constrained sampled sequences, or
        None when it has none (StepPlan's layout, justapi/structured/masks.py)."""
        items: list[MaskItem] = []
        owners: list[Request] = []
        rows: list[int] = []
        logits_row = mask_row = 0
        for req, num_drafts, is_sampled in zip(batch.reqs, batch.num_drafts, batch.is_sampled):
            if not is_sampled:
                continue
            if req.grammar is not None:
                drafts = req.draft_token_ids[:num_drafts]
                parents = req.draft_parents[:num_drafts] if req.draft_parents else []
                items.append(MaskItem(req.grammar, mask_row, drafts, parents))
                owners.append(req)
                rows.extend(range(logits_row, logits_row + 1 + num_drafts))
                mask_row += 1 + num_drafts
            logits_row += 1 + num_drafts
        if not items:
            return None
        started = time.perf_counter()
        bitmask = self._fill(items, owners)
        self.mask_seconds += time.perf_counter() - started
        self.num_mask_rows += len(rows)
        return np.asarray(rows, dtype=np.int32), bitmask

    def _fill(self, items: list[MaskItem], owners: list[Request]) -> np.ndarray:
        """fill_masks; where it raises, each item again alone (here, in order): those that
        raise are the step's RequestFailures (each fails alone, faults.py), the rest's rows
        stand."""
        num_words = mask_words(self.compiler.tokenizer.vocab_size)
        try:
            return fill_masks(self.executor, items, num_words)
        except Exception:
            pass
        out = np.zeros((sum(1 + len(item.drafts) for item in items), num_words), dtype=np.int32)
        failures: list[tuple[Request, Exception]] = []
        for item, req in zip(items, owners):
            end = item.first_row + 1 + len(item.drafts)
            try:
                out[item.first_row:end] = fill_masks(None, [replace(item, first_row=0)], num_words)
            except Exception as exc:
                failures.append((req, exc))
        if failures:
            raise RequestFailures("mask", failures)
        return out

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, float]:
        out = self.compiler.stats()
        out.update({
            "structured_requests": self.num_requests,
            "structured_compile_failures": self.num_failed,
            "structured_waiting": len(self.pending),
            "structured_forced_tokens": self.num_forced_tokens,
            "structured_cut_draft_tokens": self.num_cut_drafts,
            "structured_mask_rows": self.num_mask_rows,
            "structured_mask_seconds": self.mask_seconds,
        })
        return out


def _grammar_of(req: Request) -> RequestGrammar:
    assert req.grammar is not None, f"{req.request_id} has no grammar"
    return req.grammar
