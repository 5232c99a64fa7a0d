"""What structured outputs did, counted: keywords approximated by best-effort schemas, and
finished constrained replies judged against the user's own schema.

    justapi:structured_approximated_keywords_total{keyword}       one per request and keyword
    justapi:structured_replies_total{kind, mode, result}          kind json_schema | tool_calls,
                                                                  mode strict | best_effort,
                                                                  result valid | invalid
A reply is judged when it finishes with "stop" (a tool reply: also "length", for the calls it
completed); an invalid one logs its first violation. Owns: those counters and the JSON reply's
watch. Does not own: the validators (justapi/structured/validation.py), tool replies' watch
(tools/watch.py).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter

from justapi.structured.validation import json_violation
from justapi.wire.protocol import FINISH_STOP

logger = logging.getLogger(__name__)

STRICT = "strict"
BEST_EFFORT = "best_effort"


class StructuredMetrics:
    """The counters, registered in the frontend's registry."""

    def __init__(self, registry: CollectorRegistry, model_name: str, prefix: str) -> None:
        self._model_name = model_name
        self._approximated = Counter(
            prefix + "structured_approximated_keywords",
            "Schema keywords compiled best effort as a closer enforceable form, per request "
            "(docs/structured-outputs.md lists the forms).", ["model_name", "keyword"],
            registry=registry)
        self._replies = Counter(
            prefix + "structured_replies",
            "Finished constrained replies judged against the request's own schema.",
            ["model_name", "kind", "mode", "result"], registry=registry)

    def count_approximated(self, keywords: Iterable[str]) -> None:
        for keyword in keywords:
            self._approximated.labels(self._model_name, keyword).inc()

    def count_reply(self, kind: str, is_strict: bool, violation: str, where: str) -> None:
        """One judged reply; `where` names it in the log (the request field)."""
        mode = STRICT if is_strict else BEST_EFFORT
        self._replies.labels(self._model_name, kind, mode,
                             "invalid" if violation else "valid").inc()
        if violation:
            logger.warning("a %s reply (%s, %s) does not validate against its schema: %s",
                           kind, where, mode, violation)


class JsonReplyCheck:
    """A Generation watch that keeps a JSON-schema reply's text and judges it at "stop"."""

    can_end = False

    def __init__(self, metrics: StructuredMetrics, schema_text: str, is_strict: bool,
                 where: str) -> None:
        self._metrics = metrics
        self._schema_text = schema_text
        self._is_strict = is_strict
        self._where = where
        self._parts: list[str] = []

    def feed(self, text: str) -> tuple[str, bool]:
        self._parts.append(text)
        return text, False

    def flush(self) -> str:
        return ""

    def finished(self, finish_reason: str) -> None:
        if finish_reason != FINISH_STOP:
            return  # cut off (length), aborted or failed: nothing whole to judge
        violation = json_violation(self._schema_text, "".join(self._parts))
        self._metrics.count_reply("json_schema", self._is_strict, violation, self._where)
