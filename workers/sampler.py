"""Batched sampling for a whole step: one call per step, rows = sequences to sample.

Order (vLLM's): raw logprobs -> logit_bias -> penalties (repetition over prompt+output,
presence and frequency over output only) -> greedy rows take the argmax -> temperature ->
min_p -> top_k -> top_p -> exponential race (argmax of p / q, q ~ Exp(1)). Logprobs are those
of the raw model distribution (log_softmax of the unprocessed logits), as vLLM reports by
default - after a structured output's token bitmask (apply_token_bitmask, run by the runner
before sampling), as in vLLM: tokens the grammar forbids have logprob -inf.
A seeded row draws its noise from a generator seeded by (seed, position of the sampled token),
so its tokens do not depend on the batch, the worker, or recompute after preemption.
Everything runs where the logits are: on a GPU only the token ids and the requested logprobs
come back to the host (a seeded row's noise goes the other way: it is drawn on the CPU, so it
is the same vector speculative verification and a draft model use).
Owns: the sampling math. Does not own: parameter validation (justapi.sampling), token history.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from justapi.sampling import SamplingParams
from workers.device_upload import upload

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingRow:
    """One sequence to sample: its parameters, known tokens and the position being sampled."""

    params: SamplingParams
    token_ids: np.ndarray  # int [num_known]: prompt then output so far (may be empty without penalties)
    num_prompt_tokens: int
    position: int  # position the sampled token will occupy


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: np.ndarray  # int32 [N]
    logprobs: np.ndarray | None = None  # float32 [N]: the sampled tokens' raw logprobs
    top_ids: np.ndarray | None = None  # int32 [N, max_top_n], -1 padded
    top_logprobs: np.ndarray | None = None  # float32 [N, max_top_n], -inf padded


def stream_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for (request seed, position): splitmix64 finalizer of both."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed if seed is not None else random.getrandbits(62)
        self._unseeded = torch.Generator().manual_seed(self._seed)
        self._device_generators: dict[torch.device, torch.Generator] = {}  # unseeded rows on a GPU

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits [N, vocab] (on the device that computed them) -> one token per row."""
        assert logits.shape[0] == len(rows)
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if _wants_logprobs(rows) else None
        logits = adjusted_logits(logits, rows)  # (a grammar's token mask would apply here)
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if sampled:
            index = _ints(sampled, logits.device)
            probs = filtered_probs(logits[index], [rows[i].params for i in sampled])
            noise = self._exponential_noise([rows[i] for i in sampled], probs.shape[1], logits.device)
            tokens[index] = (probs / noise).argmax(dim=-1)
        out = tokens.to(torch.int32).cpu().numpy()
        if raw_logprobs is None:
            return SamplerOutput(out)
        return SamplerOutput(out, *logprob_columns(raw_logprobs, tokens, rows))

    def _exponential_noise(self, rows: list[SamplingRow], vocab: int,
                           device: torch.device) -> torch.Tensor:
        noise = torch.empty(len(rows), vocab, device=device)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            noise[_ints(unseeded, device)] = torch.empty(len(unseeded), vocab, device=device).exponential_(
                generator=self._generator(device))
        seeded = [(i, r.params.seed, r.position) for i, r in enumerate(rows) if r.params.seed is not None]
        if seeded:  # drawn on the CPU (the same vectors verification uses), sent in one copy
            drawn = torch.stack([seeded_noise(seed, position, vocab) for _, seed, position in seeded])
            noise[_ints([i for i, _, _ in seeded], device)] = upload(drawn.numpy(), device)
        return noise

    def _generator(self, device: torch.device) -> torch.Generator:
        """The unseeded stream: the CPU generator, or one per GPU (seeded alike)."""
        if device.type == "cpu":
            return self._unseeded
        if device not in self._device_generators:
            self._device_generators[device] = torch.Generator(device=device).manual_seed(self._seed)
        return self._device_generators[device]

    def uniforms(self, num: int) -> torch.Tensor:
        """[num] U(0, 1) draws from the unseeded stream (speculative acceptance tests)."""
        return torch.rand(num, generator=self._unseeded)

    def categorical(self, probs: torch.Tensor) -> int:
        """One draw from probs [vocab] (need not be normalized) on the unseeded stream."""
        return int(torch.multinomial(probs, 1, generator=self._unseeded))


def seeded_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """[vocab] Exp(1) noise of a seeded request for the token at `position`: the same vector
    for the same (seed, position), whoever asks (the sampler, speculative verification, a
    draft model proposing in step with it)."""
    gen = torch.Generator().manual_seed(stream_seed(seed, position))
    return torch.empty(vocab).exponential_(generator=gen)


def apply_token_bitmask(logits: torch.Tensor, rows: np.ndarray, bitmask: np.ndarray) -> None:
    """Structured outputs, in place: logits[rows[r], t] = -inf unless bit t % 32 of word t // 32
    of bitmask[r] is set (tokens past the mask's words, padding rows of the vocabulary, never
    are). logits [num_rows, vocab]; rows int32 [R]; bitmask int32 [R, words]. On a GPU the
    packed words go up (1/32 of the bytes of a bool mask, queued) and are unpacked there."""
    if logits.device.type == "cuda":
        _apply_bitmask_on_device(logits, rows, bitmask)
        return
    vocab = logits.shape[1]
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1,
                         bitorder="little")  # [R, 32 * words], 1 = allowed
    blocked = np.ones((len(rows), vocab), dtype=np.bool_)
    width = min(vocab, bits.shape[1])
    np.equal(bits[:, :width], 0, out=blocked[:, :width])
    with torch.inference_mode():
        blocked_t = torch.from_numpy(blocked).to(logits.device)
        if len(rows) == logits.shape[0] and np.array_equal(rows, np.arange(len(rows))):
            logits.masked_fill_(blocked_t, float("-inf"))  # every row constrained
        else:
            index = torch.from_numpy(rows.astype(np.int64)).to(logits.device)
            logits[index] = logits[index].masked_fill(blocked_t, float("-inf"))


def _apply_bitmask_on_device(logits: torch.Tensor, rows: np.ndarray, bitmask: np.ndarray) -> None:
    vocab, device = logits.shape[1], logits.device
    words = upload(np.ascontiguousarray(bitmask, dtype=np.int32), device)  # [R, words]
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words[:, :, None] >> shifts) & 1).reshape(len(rows), -1)  # [R, 32 * words]
    blocked = torch.ones(len(rows), vocab, dtype=torch.bool, device=device)
    width = min(vocab, allowed.shape[1])
    blocked[:, :width] = allowed[:, :width] == 0
    with torch.inference_mode():
        if len(rows) == logits.shape[0] and np.array_equal(rows, np.arange(len(rows))):
            logits.masked_fill_(blocked, float("-inf"))
        else:
            index = upload(rows.astype(np.int64), device)
            logits[index] = logits[index].masked_fill(blocked, float("-inf"))


def _wants_logprobs(rows: list[SamplingRow]) -> bool:
    return any(r.params.logprobs is not None for r in rows)


def logprob_columns(raw: torch.Tensor, tokens: torch.Tensor,
                     rows: list[SamplingRow]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sampled tokens' logprobs and each row's top n, computed where `raw` is and
    brought to the host ([N] and [N, max n] only)."""
    chosen = raw.gather(1, tokens.to(raw.device)[:, None])[:, 0].cpu()
    top_n = max(r.params.logprobs or 0 for r in rows)
    top_ids = np.full((len(rows), top_n), -1, dtype=np.int32)
    top_values = np.full((len(rows), top_n), -np.inf, dtype=np.float32)
    if top_n:
        values, ids = (t.cpu() for t in raw.topk(top_n, dim=-1))
        for i, row in enumerate(rows):
            n = row.params.logprobs or 0
            top_ids[i, :n] = ids[i, :n].numpy()
            top_values[i, :n] = values[i, :n].numpy()
        top_ids[top_values == -np.inf] = -1  # a token a grammar forbids is no alternative
    return chosen.numpy().astype(np.float32), top_ids, top_values


def _ints(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 [n] on `device` (torch.tensor(values, device=...) waits for a GPU to get there)."""
    return upload(np.asarray(values, dtype=np.int64), device)


def _floats(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """float32 [n] on `device`, each value rounded as torch.tensor(values) rounds it."""
    return upload(np.asarray(values, dtype=np.float32), device)


def _padded(sequences: list[np.ndarray], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(s) for s in sequences), default=0)
    out = np.full((len(sequences), max(width, 1)), pad, dtype=np.int64)
    for i, s in enumerate(sequences):
        out[i, :len(s)] = s
    return upload(out, device)


def adjusted_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """What every sampling decision starts from (plain steps and speculative verification):
    the model's logits [N, vocab] with each row's logit_bias added, then its penalties."""
    return apply_penalties(apply_logit_bias(logits, [r.params for r in rows]), rows)


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logit[row, id] += bias for each row's (id, bias) pairs; ids past the vocabulary (the
    frontend refuses them; a direct caller may not) are skipped."""
    vocab = logits.shape[1]
    picks = [(i, token_id, bias) for i, p in enumerate(params)
             for token_id, bias in p.logit_bias if token_id < vocab]
    if not picks:
        return logits
    rows, ids, values = zip(*picks)
    row_index, token_ids, biases = _ints(rows, logits.device), _ints(ids, logits.device), _floats(values, logits.device)
    logits = logits.clone()
    logits.index_put_((row_index, token_ids), biases.to(logits.dtype), accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (CTRL: divide positive logits, multiply negative ones) for tokens in prompt or
    output; then logit -= frequency * count_in_output + presence * (count_in_output > 0)."""
    chosen = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not chosen:
        return logits
    logits = logits.clone()
    vocab, device = logits.shape[1], logits.device
    index = _ints(chosen, device)
    params = [rows[i].params for i in chosen]
    seen_ids = _padded([np.asarray(rows[i].token_ids) for i in chosen], vocab, device)
    output_ids = _padded([np.asarray(rows[i].token_ids[rows[i].num_prompt_tokens:]) for i in chosen],
                         vocab, device)
    seen = torch.zeros(len(chosen), vocab + 1, dtype=torch.bool, device=device).scatter_(
        1, seen_ids, True)[:, :vocab]
    counts = torch.zeros(len(chosen), vocab + 1, device=device).scatter_add_(
        1, output_ids, torch.ones(output_ids.shape, device=device))[:, :vocab]  # [n, vocab]
    rep = _floats([p.repetition_penalty for p in params], device)[:, None]
    freq = _floats([p.frequency_penalty for p in params], device)[:, None]
    presence = _floats([p.presence_penalty for p in params], device)[:, None]
    sub = logits[index]
    penalized = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalized, sub)
    sub = sub - freq * counts - presence * (counts > 0).float()
    logits[index] = sub
    return logits


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[n, vocab] logits of non-greedy rows -> probabilities after temperature, min_p, top_k and
    top_p (removed tokens get probability 0, the rest renormalized)."""
    device = logits.device  # per-row parameters go there; which steps apply is read on the host
    temperature = _floats([p.temperature for p in params], device)[:, None]
    logits = logits / temperature
    min_p = _floats([p.min_p for p in params], device)[:, None]
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(dim=-1)
        too_small = probs < min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(too_small, float("-inf"))
    top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
    if any(top_k):
        logits = _apply_top_k(logits, top_k)
    top_p = _floats([p.top_p for p in params], device)
    if any(p.top_p < 1.0 for p in params):
        logits = _apply_top_p(logits, top_p)
    return logits.softmax(dim=-1)


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep tokens whose logit is >= the row's k-th largest (ties at the boundary stay)."""
    vocab = logits.shape[1]
    per_row = [min(k, vocab) if k else vocab for k in top_k]
    k = _ints(per_row, logits.device)
    values = logits.topk(max(per_row), dim=-1).values  # [n, kmax], descending
    threshold = values.gather(1, (k - 1)[:, None])  # [n, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest prefix of tokens (by descending probability) whose mass reaches top_p:
    a token stays when the mass strictly before it is < top_p. Rows with top_p == 1 keep all."""
    probs = logits.softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
