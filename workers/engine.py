"""LLMEngine: the paged runtime in one process — load a GGUF, then `generate` many prompts at once.

The real scheduler core drives the runtime (ModelRunner: model + KV pool + attention backend +
sampler, and a draft model beside the target with speculative decoding) through the server's
step, schedule -> execute -> update (workers/engine_loop.py), one fresh core per generate call.
Text: the model's own tokenizer and chat template (justapi.frontend.text.tokenizer, justapi.frontend.text.chat_template).
Owns: wiring the runtime together, checking prompts. Does not own: the scheduling or the runtime.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from justapi.config.sections import CacheConfig
from justapi.config.spec import SpecConfig
from justapi.frontend.text.chat_template import ChatTemplate
from justapi.frontend.text.tokenizer import Tokenizer
from justapi.model.gguf_file import GGUFFile, resolve_model_path
from justapi.model.info import long_rope_context
from justapi.sampling import SamplingParams
from workers.cpu_memory import keep_freed_memory
from workers.engine_loop import LoopLimits, SchedulerLoop

if TYPE_CHECKING:
    from justapi.scheduler.structured import StructuredOutputs
from workers.kv.pool import KVPool, PoolShape, dtype_of
from workers.model.attention import AttentionBackend, require_cuda
from workers.model.backends import make_backend
from workers.runner import ModelRunner
from workers.sampler import Sampler
from workers.spec.draft import load_draft
from workers.weights.paths import load_model
from workers.weights.synthetic import SPEC_PREFIX, materialize

if TYPE_CHECKING:
    from workers.model.step_graphs import StepGraphs

DEFAULT_KV_BYTES = 2 << 30
"""KV pool size when num_blocks is 0 (an anonymous mapping: pages cost nothing until used)."""


def _step_graphs(engine: LLMEngine, backend: AttentionBackend, max_seqs: int,
                 use_cuda_graphs: bool, max_tokens: int) -> StepGraphs | None:
    """GPU: steps replayed from graphs captured now (every step of up to max_tokens rows)."""
    if engine.pool.tensor.device.type != "cuda":
        return None
    from workers.model.cuda_graphs import build_step_graphs  # Triton: GPU engines only
    return build_step_graphs(engine.model, engine.pool, backend, max_seqs, engine.max_context,
                             engine.speculative, use_cuda_graphs, max_tokens)


@dataclass(frozen=True)
class Output:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str


def resolve_model(model: str) -> str:
    """'' -> the default GGUF; 'synthetic:...' -> a generated file; else the path, checked."""
    if model.startswith(SPEC_PREFIX):
        return materialize(model)
    return resolve_model_path(model)


class LLMEngine:
    def __init__(self, model: str = "", device: str = "cpu", block_size: int = 16,
                 num_blocks: int = 0, max_seqs: int = 32, chunk_size: int = 512,
                 max_batched_tokens: int = 2048, max_context: int = 0,
                 seed: int | None = None, progress: bool = True, weights: str = "fp32",
                 speculative: SpecConfig | None = None, cuda_graphs: bool = True,
                 kv_cache_dtype: str | None = None, allow_unused_tensors: bool = False,
                 batch_invariant: bool = False) -> None:
        """kv_cache_dtype: as `justapi serve --kv-cache-dtype` (auto = bfloat16, float32,
        bfloat16). None: the compute dtype (fp32 on CPU, bf16 on GPUs). Like `weights`, the
        default is not serve's: the model tests compare this engine's logits with independent
        implementations, and fp32 is the exact reference there. batch_invariant: as `justapi
        serve --batch-invariant` (CPU)."""
        kind = torch.device(device).type
        if kv_cache_dtype is None:
            kv_cache_dtype = "float32" if kind == "cpu" else "bfloat16"
        # an unknown name, or float32 on a GPU: ConfigError (a ValueError)
        kv_dtype = dtype_of(CacheConfig(kv_cache_dtype=kv_cache_dtype).pool_dtype(kind))
        if kind == "cuda":
            require_cuda(device)  # fail before the slow parts
        else:
            keep_freed_memory()  # steps reuse their temporaries' pages (workers/cpu_memory.py)
        self.path = resolve_model(model)
        self.gguf = GGUFFile(self.path)
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        self.model = load_model(self.gguf, device, dtype, weights, progress,  # weights: fp32|q4|auto
                                allow_unused_tensors=allow_unused_tensors, batch_invariant=batch_invariant)
        p = self.model.params
        self.max_context = min(max_context or p.max_context, p.max_context)
        if num_blocks <= 0:
            per_block = PoolShape(p.num_layers, 1, block_size, p.num_kv_heads, p.head_dim).num_bytes(kv_dtype)
            num_blocks = max(1, min(DEFAULT_KV_BYTES // per_block,
                                    max_seqs * -(-self.max_context // block_size)))
        shape = PoolShape(p.num_layers, num_blocks, block_size, p.num_kv_heads, p.head_dim)
        self.pool = KVPool.create(shape, "local", kv_dtype, device)
        self.speculative = speculative or SpecConfig()
        draft = (load_draft(self.speculative, num_blocks, block_size, device, seed, weights, progress)
                 if self.speculative.spec == "draft" else None)
        if draft is not None:
            self.max_context = min(self.max_context, draft.model.params.max_context)
        backend = make_backend(device, block_size, (p.num_heads, p.num_kv_heads, p.head_dim),
                               batch_invariant=batch_invariant)
        self.graphs = _step_graphs(self, backend, max_seqs, cuda_graphs, max_batched_tokens)
        self.runner = ModelRunner(self.model, self.pool, backend, Sampler(seed), draft=draft,
                                  graphs=self.graphs)
        self.tokenizer = Tokenizer.from_gguf(self.gguf)
        self.eos_token_ids = self.tokenizer.eog_token_ids  # ignore_eos turns these off
        self.limits = LoopLimits(num_blocks, block_size, max_seqs, chunk_size, max_batched_tokens,
                                 self.max_context, long_rope_context=long_rope_context(self.gguf))
        self.loop: SchedulerLoop | None = None  # the last generate call's (its core's stats)
        self.num_preemptions = 0  # over all generate calls: the core preempted to free blocks
        self._structured: StructuredOutputs | None = None  # structured outputs, on first use

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The model's chat template applied to `messages`, with the generation prompt."""
        template = ChatTemplate.from_gguf(self.gguf, self.tokenizer.template_tokens)
        return template.render(messages, add_generation_prompt=True)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids))

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Output]:
        """Run every prompt to completion, batched; outputs in prompt order."""
        params = self._per_prompt(sampling, len(prompts))
        token_ids = [self._prompt_ids(prompt, p) for prompt, p in zip(prompts, params)]
        structured = self.structured_outputs() if any(p.structured for p in params) else None
        self.loop = SchedulerLoop(self.runner, self.loop_limits(), self.speculative, structured)
        outs = self.loop.generate(token_ids, params)
        self.num_preemptions += int(self.loop.stats()["num_preemptions"])
        for out in outs:
            if out.error:
                raise RuntimeError(f"generation failed: {out.error}")
        return [Output(self.decode(o.token_ids), o.token_ids, prompt, o.finish_reason)
                for prompt, o in zip(token_ids, outs)]

    def structured_outputs(self) -> StructuredOutputs:
        """Grammars against this model's vocabulary (built on first use, kept: the compile
        cache then serves every later generate call)."""
        if self._structured is None:
            from justapi.scheduler.structured import StructuredOutputs
            from justapi.structured.compiler import GrammarCompiler
            from justapi.structured.tokenizer import from_tokenizer

            vocab = self.model.params.vocab_size
            compiler = GrammarCompiler(lambda: from_tokenizer(self.tokenizer, vocab))
            self._structured = StructuredOutputs(compiler, self.eos_token_ids)
        return self._structured

    def loop_limits(self) -> LoopLimits:
        """The core's budgets and limits, with the end-of-generation ids now in force."""
        return dataclasses.replace(self.limits, max_context=self.max_context,
                                   eos_token_ids=tuple(sorted(self.eos_token_ids)))

    def _per_prompt(self, sampling: SamplingParams | Sequence[SamplingParams] | None,
                    count: int) -> list[SamplingParams]:
        if sampling is None or isinstance(sampling, SamplingParams):
            return [sampling or SamplingParams()] * count
        if len(sampling) != count:
            raise ValueError(f"got {len(sampling)} sampling params for {count} prompts")
        return list(sampling)

    def _prompt_ids(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        token_ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        vocab = self.model.params.vocab_size
        if not token_ids:
            raise ValueError("empty prompt: at least one token is needed")
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token id out of range [0, {vocab})")
        if len(token_ids) > self.max_context:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than the context length "
                             f"{self.max_context}")
        longest = min(len(token_ids) + params.max_tokens, self.max_context)
        num_blocks = -(-longest // self.limits.block_size)
        if num_blocks > self.limits.num_blocks:  # the core would cut it short at the pool's size
            raise ValueError(f"a request of {longest} tokens may need {num_blocks} KV blocks, "
                             f"the pool has {self.limits.num_blocks}")
        return token_ids

    def close(self) -> None:
        self.pool.close()
        if self.runner.draft is not None:
            self.runner.draft.pool.close()

