"""Build the scheduler core from what the process shell knows: the serve config and the
workers' Ready messages (pools, block sizes, context lengths).

End-of-generation ids come from `extra["eos_token_ids"]` when the launcher passes them,
else from the GGUF tokenizer at `extra["model_path"]` (or the configured model), which then
also gives the core its structured outputs (grammars against the model's vocabulary). A
LongRoPE model's original context comes from that GGUF's metadata too.
With workers on several hosts (launcher = "ray", colocated) the Scheduler gets a HostMap:
its router then weighs copy costs between pools and imports cached prefixes.
Owns: that translation and its validation. Does not own: the shell (process.py).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from justapi.config.serve import ServeConfig
from justapi.model.gguf_file import GGUFFile, resolve_model_path
from justapi.model.info import model_long_rope_context
from justapi.scheduler.cluster.hosts import HostMap
from justapi.scheduler.pd.scheduler import PdScheduler
from justapi.scheduler.scheduler import Scheduler
from justapi.scheduler.topology import (
    ROLE_MIXED,
    ModelLimits,
    PoolSpec,
    Topology,
    WorkerSpec,
)
from justapi.wire.protocol import Ready

if TYPE_CHECKING:
    from justapi.frontend.text.tokenizer import Tokenizer
    from justapi.scheduler.structured import StructuredOutputs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedModel:
    """What a scheduler's start-up reads from the model file, loaded ahead by a standby
    scheduler (justapi/scheduler/standby.py): its tokenizer and that tokenizer as JSON."""

    tokenizer: Tokenizer | None
    document: str = ""


def prepare_model(model: str) -> PreparedModel:
    """Load the model's tokenizer, its JSON and the structured-output modules now."""
    import justapi.scheduler.structured  # noqa: F401 (imported late by structured_outputs)
    import justapi.structured.compiler  # noqa: F401

    tokenizer = load_tokenizer(model)
    return PreparedModel(tokenizer, tokenizer.to_json() if tokenizer is not None else "")


def build_scheduler(config: ServeConfig, readies: Sequence[Ready], extra: dict[str, Any],
                    on_grammar: Callable[[], None] | None = None,
                    prepared: PreparedModel | None = None) -> Scheduler:
    """Scheduler, or PdScheduler with `pd` set (roles by worker index, pool handles from Ready);
    for workers on several hosts (launcher = "ray", pools per host) a Scheduler with hosts.
    With the model's tokenizer at hand it serves structured outputs; on_grammar is called (in
    a compile thread) whenever a grammar compile finishes. prepared: the tokenizer loaded
    ahead (a standby scheduler); else it is loaded here."""
    tokenizer = prepared.tokenizer if prepared is not None else None
    if extra.get("eos_token_ids") is None and readies:
        model = str(extra.get("model_path") or config.model.model)
        if prepared is None:
            tokenizer = load_tokenizer(model)
        extra = {**extra, "eos_token_ids": _eos_of(tokenizer, model)}
    core = _build_core(config, readies, extra)
    if tokenizer is not None:
        vocab_size = min(r.vocab_size for r in readies)  # the logits' width
        document = prepared.document if prepared is not None else ""
        core.state.structured = structured_outputs(tokenizer, vocab_size, on_grammar, document)
    return core


def _build_core(config: ServeConfig, readies: Sequence[Ready], extra: dict[str, Any]) -> Scheduler:
    if not readies:
        raise ValueError("cannot build a scheduler without a ready worker")
    pd = config.pd
    role_of = pd.role_of if pd.is_enabled else None
    topology = topology_of(readies, config.cache.block_size, role_of)
    limits = limits_of(config, readies, extra)
    if config.scheduler.overlap and not config.overlaps_steps(os.cpu_count() or 1):
        logger.info("overlap off: the CPU workers' threads take every core (--threads to leave one)")
        config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, overlap=False))
    config = dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, decode_steps=config.decode_steps_for(os.cpu_count() or 1)))
    if not pd.is_enabled and config.server.launcher == "ray":
        hosts = HostMap((r.pool for r in readies), config.cluster.cross_host_copy_cost)
        return Scheduler(config.scheduler, config.cache, topology, limits, config.speculative,
                         hosts=hosts)
    if not pd.is_enabled:
        return Scheduler(config.scheduler, config.cache, topology, limits, config.speculative)
    core = PdScheduler(config.scheduler, config.cache, topology, limits, pd.pd_lease_s)
    for ready in readies:
        core.set_pool_info(ready.pool)
    return core


def topology_of(readies: Sequence[Ready], block_size: int,
                role_of: Callable[[int], str] | None = None) -> Topology:
    pools: dict[int, int] = {}
    for ready in readies:
        info = ready.pool
        if info.block_size != block_size:
            raise ValueError(f"worker {ready.worker_id} reports block size {info.block_size}, "
                             f"the config says {block_size}")
        if pools.setdefault(info.pool_id, info.num_blocks) != info.num_blocks:
            raise ValueError(f"workers disagree on the size of pool {info.pool_id}: "
                             f"{pools[info.pool_id]} vs {info.num_blocks} blocks")
    return Topology(tuple(PoolSpec(p, n) for p, n in sorted(pools.items())),
                    tuple(WorkerSpec(r.worker_id, r.pool.pool_id,
                                     role_of(r.worker_id) if role_of else ROLE_MIXED)
                          for r in sorted(readies, key=lambda r: r.worker_id)))


def limits_of(config: ServeConfig, readies: Sequence[Ready], extra: dict[str, Any]) -> ModelLimits:
    max_context = min(r.max_context for r in readies)
    if config.model.max_context:
        max_context = min(max_context, config.model.max_context)
    eos = extra.get("eos_token_ids")
    if eos is None:
        eos = eos_token_ids(str(extra.get("model_path") or config.model.model))
    return ModelLimits(max_context, tuple(int(t) for t in eos), _long_rope_context(extra))


def _long_rope_context(extra: dict[str, Any]) -> int:
    """LongRoPE's original context: `extra["long_rope_context"]`, else the GGUF's metadata at
    `extra["model_path"]` (ModelInfo's reading); 0 when neither is given."""
    value = extra.get("long_rope_context")
    if value is None:
        path = extra.get("model_path")
        value = model_long_rope_context(str(path)) if path else 0
    return int(value)


def eos_token_ids(model: str) -> tuple[int, ...]:
    """End-of-generation ids of a GGUF model (EOS, EOT, EOM and llama.cpp's end-of-turn list),
    read from its special tokens without building the tokenizer."""
    from justapi.frontend.text.tokenizer import read_special_tokens

    if model.startswith("synthetic:"):
        logger.warning("model %r: no tokenizer path given, EOS is not enforced", model)
        return ()
    return tuple(sorted(read_special_tokens(GGUFFile(resolve_model_path(model))).eog_token_ids))


def _eos_of(tokenizer: Tokenizer | None, model: str) -> tuple[int, ...]:
    if tokenizer is None:
        logger.warning("model %r: no tokenizer path given, EOS is not enforced", model)
        return ()
    return tuple(sorted(tokenizer.eog_token_ids))


def load_tokenizer(model: str) -> Tokenizer | None:
    """The GGUF's tokenizer; None for an unmaterialized synthetic model name."""
    from justapi.frontend.text.tokenizer import (
        Tokenizer,  # tokenizers is heavy: only when needed
    )

    if model.startswith("synthetic:"):
        return None
    return Tokenizer.from_gguf(GGUFFile(resolve_model_path(model)))


def structured_outputs(tokenizer: Tokenizer, vocab_size: int,
                       on_grammar: Callable[[], None] | None,
                       document: str = "") -> StructuredOutputs:
    """Grammars against the model's vocabulary, vocab_size (the logits' width) wide; its
    llguidance tokenizer is built on the first compile (keeping only the tokenizer's JSON,
    `document` when it was made ahead)."""
    from justapi.scheduler.structured import StructuredOutputs
    from justapi.structured.compiler import GrammarCompiler
    from justapi.structured.tokenizer import from_json

    document, eos = document or tokenizer.to_json(), sorted(tokenizer.eog_token_ids)
    compiler = GrammarCompiler(lambda: from_json(document, vocab_size, eos), on_done=on_grammar)
    return StructuredOutputs(compiler, eos)
