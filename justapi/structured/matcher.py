"""One request's grammar state: it waits for its compile, then matches the request's output.

The matcher consumes exactly the tokens the request emits, once each: never drafts (they are
checked with validate_tokens, which changes nothing), never a token twice (recompute after
preemption and PD hand-offs re-send known tokens to a worker, not to the matcher). So it
never needs a rollback, and its state survives preemption and hand-offs as the request's does.
llguidance's errors are sticky: a token it refuses leaves it in error, and the request fails.
Owns: the matcher and those rules. Does not own: when tokens arrive (the scheduler core).
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from concurrent.futures import Future

import llguidance as llg

from justapi.structured.compiler import Compiled
from justapi.structured.grammar import short_error


class RequestGrammar:
    __slots__ = ("future", "matcher")

    def __init__(self, future: Future[Compiled]) -> None:
        self.future = future
        self.matcher: llg.LLMatcher | None = None  # set by start()

    @property
    def is_compiled(self) -> bool:
        return self.future.done()

    def start(self) -> str:
        """Once compiled: take a private copy of the prototype. Returns why it cannot start
        ("" when it can)."""
        try:
            compiled = self.future.result(timeout=0)
        except Exception as exc:  # the pool was shut down, or a bug in the compile
            return f"grammar compile failed: {type(exc).__name__}: {exc}"
        if compiled.prototype is None:
            return compiled.error
        self.matcher = compiled.prototype.deep_copy()
        return ""

    @property
    def live(self) -> llg.LLMatcher:
        assert self.matcher is not None, "the request's grammar has not started"
        return self.matcher

    def consume(self, token_id: int) -> bool:
        """The request emitted token_id; False if the grammar refuses it (then in error)."""
        return bool(self.live.consume_token(token_id))

    def replay(self, token_ids: Sequence[int]) -> str:
        """Consume the tokens a resubmitted request already delivered (its scheduler was
        restarted), in order; why the grammar refuses one ("" when it takes them all)."""
        for token_id in token_ids:
            if not self.consume(int(token_id)):
                return f"the grammar refuses delivered token {int(token_id)}: {self.error}"
        return ""

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and allows nothing more (or EOS was consumed)."""
        return bool(self.live.is_stopped())

    @property
    def error(self) -> str:
        return short_error(self.live.get_error()) if self.live.is_error() else ""

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (its canonical tokenization of the
        forced bytes; a last piece a longer token could extend is held back)."""
        if limit <= 0:
            return []
        return list(self.live.compute_ff_tokens()[:limit])

    def num_valid_drafts(self, tokens: Sequence[int], parents: Sequence[int],
                         eos_token_ids: Collection[int]) -> int:
        """How many leading drafts (node order; parents [] = a chain) have grammar-valid paths
        from the request's last token, stopping at an end-of-generation draft (one that ends
        the grammar is never worth verifying: the target's own token at that row is sampled
        under the mask anyway)."""
        end = next((i for i, t in enumerate(tokens) if t in eos_token_ids), len(tokens))
        if not end:
            return 0
        matcher = self.live
        if not parents:
            return int(matcher.validate_tokens([int(t) for t in tokens[:end]]))
        paths: list[list[int]] = []
        for i in range(end):
            parent = parents[i]
            path = (paths[parent] if parent >= 0 else []) + [int(tokens[i])]
            if matcher.validate_tokens(path) < len(path):
                return i
            paths.append(path)
        return end
