"""Structured outputs in the scheduler core: requests waiting for their grammar, drafts fitted
to it, the token bitmasks of a step, and the matcher's verdict on each emitted token.

    add_request -> hold (compile on the pool) -> ready: queued as usual | failed: "error"
    before a step: drafts cut at the first grammar-invalid one; forced tokens as free drafts
    the step:      one mask row per constrained logits row (root + drafts), in the plan
    the result:    each emitted token is consumed once; a complete grammar finishes "stop"

Forced tokens (llguidance's compute_ff_tokens: bytes only one continuation allows, e.g. a
schema's fixed keys and closing braces) are proposed as drafts and verified like any other,
so output is token for token what plain constrained decoding gives, in fewer steps. With a
draft model the worker's proposals are only cut (its draws must stay a prefix of them).
Owns: the waiting table, the mask executor and the counters. Does not own: compiling
(justapi/structured/compiler.py), requests' lifecycle (state.py) or applying masks (worker).
"""
from __future__ import annotations

import time
from collections.abc import Collection
from concurrent.futures import FIRST_COMPLETED, wait

import llguidance as llg
import numpy as np

from justapi.scheduler.batch import StepBatch
from justapi.scheduler.request import Request
from justapi.scheduler.spec.tree import is_chain
from justapi.structured.compiler import GrammarCompiler
from justapi.structured.masks import MaskItem, fill_masks
from justapi.structured.matcher import RequestGrammar
from justapi.structured.tokenizer import mask_words

MAX_FORCED_DRAFTS = 16
"""Most forced tokens proposed for one step (each costs a position of the forward)."""


class StructuredOutputs:
    """The core's structured-output state (None on the core when the model has no tokenizer)."""

    def __init__(self, compiler: GrammarCompiler, eos_token_ids: Collection[int],
                 max_forced_drafts: int = MAX_FORCED_DRAFTS, num_threads: int = 1) -> None:
        self.compiler = compiler
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_forced_drafts = max_forced_drafts
        self.executor = llg.LLExecutor(num_threads=num_threads)
        self.pending: dict[str, Request] = {}  # waiting for their compile, in arrival order
        self.num_requests = 0
        self.num_failed = 0
        self.num_forced_drafts = 0
        self.num_accepted_forced = 0
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
                error = grammar.start()
                self.num_failed += bool(error)
                out.append((self.pending.pop(rid), error))
        return out

    def drop(self, request_id: str) -> Request | None:
        """Forget a request still waiting for its compile (aborted)."""
        return self.pending.pop(request_id, None)

    # ------------------------------------------------------------------ before a step
    def fit_drafts(self, req: Request, may_force: bool) -> None:
        """Cut the request's drafts at the first grammar-invalid node; with none left (and
        may_force), propose the tokens the grammar forces."""
        grammar = req.grammar
        assert grammar is not None and grammar.matcher is not None
        tokens, parents = req.draft_token_ids, req.draft_parents
        grammar.num_forced_drafts = 0
        if tokens:
            keep = grammar.num_valid_drafts(tokens, parents, self.eos_token_ids)
            if keep < len(tokens):
                tokens, parents = tokens[:keep], parents[:keep]
                req.draft_token_ids = tokens
                req.draft_parents = [] if is_chain(parents) else parents
        if tokens or not may_force:
            return
        forced = grammar.forced_tokens(min(self.max_forced_drafts, req.final_len - req.num_tokens))
        if forced:
            req.draft_token_ids, req.draft_parents = forced, []
            grammar.num_forced_drafts = len(forced)
            self.num_forced_drafts += len(forced)

    def accepted(self, req: Request, num_accepted: int) -> None:
        """A step verified the request's drafts and accepted num_accepted of them."""
        grammar = req.grammar
        if grammar is not None and grammar.num_forced_drafts:
            self.num_accepted_forced += min(num_accepted, grammar.num_forced_drafts)
            grammar.num_forced_drafts = 0

    # ------------------------------------------------------------------ the step
    def masks(self, batch: StepBatch) -> tuple[np.ndarray, np.ndarray] | None:
        """(bitmask_rows, token_bitmask) for the batch's constrained sampled sequences, or
        None when it has none (StepPlan's layout, justapi/structured/masks.py)."""
        items: list[MaskItem] = []
        rows: list[int] = []
        logits_row = mask_row = 0
        for req, num_drafts, is_sampled in zip(batch.reqs, batch.num_drafts, batch.is_sampled):
            if not is_sampled:
                continue
            if req.grammar is not None:
                drafts = req.draft_token_ids[:num_drafts]
                parents = req.draft_parents[:num_drafts] if req.draft_parents else []
                items.append(MaskItem(req.grammar, mask_row, drafts, parents))
                rows.extend(range(logits_row, logits_row + 1 + num_drafts))
                mask_row += 1 + num_drafts
            logits_row += 1 + num_drafts
        if not items:
            return None
        started = time.perf_counter()
        bitmask = fill_masks(self.executor, items, mask_words(self.compiler.tokenizer.vocab_size))
        self.mask_seconds += time.perf_counter() - started
        self.num_mask_rows += len(rows)
        return np.asarray(rows, dtype=np.int32), bitmask

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, float]:
        out = self.compiler.stats()
        out.update({
            "structured_requests": self.num_requests,
            "structured_compile_failures": self.num_failed,
            "structured_waiting": len(self.pending),
            "structured_forced_draft_tokens": self.num_forced_drafts,
            "structured_forced_accepted_tokens": self.num_accepted_forced,
            "structured_mask_rows": self.num_mask_rows,
            "structured_mask_seconds": self.mask_seconds,
        })
        return out


def _grammar_of(req: Request) -> RequestGrammar:
    assert req.grammar is not None, f"{req.request_id} has no grammar"
    return req.grammar
