"""Speculative verification: which drafts of a token tree the target model accepts, and the
token that follows them - keeping the output exactly what plain decoding would produce.

Each sampled sequence brings the target's logits for its root (the last known token) and
every draft node, in node order (row 0 = root, row 1 + i = node i). The target distribution
at a row is plain decoding's: penalties over the path's history, then temperature, min_p,
top_k, top_p (workers/sampler.py).

- Greedy and seeded requests: the target's own token at each row is computed exactly as
  plain decoding would (argmax, or the seeded exponential race at that position), and the
  walk follows the child holding it; the first row whose token no child holds gives the
  bonus token. The output is token for token plain decoding's, whatever was proposed.
- Other requests: multi-step speculative sampling (SpecInfer; Leviathan/Chen's rejection
  sampling for a chain). At a node, its children's trials are tried in turn: a trial x
  drawn from the draft's distribution q is accepted with probability min(1, p(x) / q(x));
  on rejection p becomes norm(max(0, p - q)). A deterministic trial (n-gram, or a draft
  model's greedy pick) is the case q = one-hot(x): accepted with probability p(x), else x is
  removed from p. Nothing accepted: the bonus token is drawn from what is left of p. Each
  step of this keeps the emitted token distributed as p.
Owns: those rules. Does not own: the forward, KV moves, or proposing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from justapi.sampling import SamplingParams
from workers.sampler import Sampler, SamplingRow, adjusted_logits, filtered_probs

RESIDUAL_EPS = 1e-12


@dataclass
class NodeDraws:
    """How a draft model drew one node's children (unseeded sampling): from q, in this order,
    duplicates included (each draw is a trial; a repeat of a rejected one is rejected)."""

    q: torch.Tensor  # [vocab]
    draws: list[int]


@dataclass
class VerifyInput:
    """One sampled sequence of a step."""

    logits: torch.Tensor  # [1 + num drafts, vocab]: root row, then one row per node
    params: SamplingParams
    history: list[int]  # tokens at positions [0, root]; read only with penalties
    num_prompt_tokens: int
    root_position: int
    tokens: list[int] = field(default_factory=list)  # drafts
    parents: list[int] = field(default_factory=list)
    draws: dict[int, NodeDraws] | None = None  # by node (-1 = root): drawn from q


@dataclass
class Verified:
    tokens: list[int]  # accepted drafts, then the bonus token
    nodes: list[int]  # the accepted nodes, root's child first
    rows: list[int]  # the row each emitted token was sampled from


class Verifier:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def verify(self, items: list[VerifyInput]) -> list[Verified]:
        out: list[Verified | None] = [None] * len(items)
        exact = [i for i, it in enumerate(items)
                 if it.params.is_greedy or it.params.seed is not None]
        for i, verified in zip(exact, self._verify_exact([items[i] for i in exact])):
            out[i] = verified
        sampled = [i for i in range(len(items)) if out[i] is None]
        for i, probs in zip(sampled, _target_probs([items[i] for i in sampled])):
            out[i] = self._verify_sampled(items[i], probs)
        return [v for v in out if v is not None]

    # ------------------------------------------------------------------ greedy / seeded
    def _verify_exact(self, items: list[VerifyInput]) -> list[Verified]:
        if not items:
            return []
        rows = [row for item in items for row in _rows(item, wants_logprobs=False)]
        logits = torch.cat([item.logits for item in items])
        targets = self.sampler.sample(logits, rows).token_ids.tolist()
        out, first = [], 0
        for item in items:
            out.append(_walk_exact(item, targets[first:first + 1 + len(item.tokens)]))
            first += 1 + len(item.tokens)
        return out

    # ------------------------------------------------------------------ sampled
    def _verify_sampled(self, item: VerifyInput, probs: torch.Tensor) -> Verified:
        """probs [1 + drafts, vocab]: the target distribution at each row."""
        children = _children(item.parents)
        node = -1
        emitted: list[int] = []
        nodes: list[int] = []
        used_rows: list[int] = []
        while True:
            row = node + 1
            p = probs[row].clone()
            accepted = self._try_children(item, node, children.get(node, []), p)
            used_rows.append(row)
            if accepted is None:
                emitted.append(self.sampler.categorical(p))
                return Verified(emitted, nodes, used_rows)
            token, child = accepted
            emitted.append(token)
            if child is None:  # a drawn token whose node was cut from the tree: it ends here
                return Verified(emitted, nodes, used_rows)
            nodes.append(child)
            node = child

    def _try_children(self, item: VerifyInput, node: int, kids: list[int],
                      p: torch.Tensor) -> tuple[int, int | None] | None:
        """Trials at one node, in order; returns the accepted (token, child node) - the child
        is None for a draw the tree no longer holds - or None, p then holding the residual."""
        draws = item.draws.get(node) if item.draws else None
        if not kids and draws is None:
            return None
        by_token = {item.tokens[k]: k for k in kids}
        trials = draws.draws if draws is not None else [item.tokens[k] for k in kids]
        uniforms = self.sampler.uniforms(len(trials)).tolist()
        for token, u in zip(trials, uniforms):
            total = max(float(p.sum()), RESIDUAL_EPS)
            if draws is None:  # deterministic trial: q = one-hot(token)
                if u < float(p[token]) / total:
                    return token, by_token[token]
                p[token] = 0.0
            else:
                q_x = float(draws.q[token])
                if q_x > 0 and u < float(p[token]) / total / q_x:
                    return token, by_token.get(token)
                residual = torch.clamp(p / total - draws.q, min=0.0)
                if float(residual.sum()) > RESIDUAL_EPS:
                    p.copy_(residual)
            if float(p.sum()) <= RESIDUAL_EPS:  # numerically exhausted: nothing left to reject
                break
        return None


def _target_probs(items: list[VerifyInput]) -> list[torch.Tensor]:
    """Every row's target distribution, computed for all items at once (one softmax)."""
    if not items:
        return []
    rows = [row for item in items for row in _rows(item, wants_logprobs=False)]
    logits = torch.cat([item.logits for item in items]).float()
    probs = filtered_probs(adjusted_logits(logits, rows), [row.params for row in rows])
    probs = probs.cpu()  # the acceptance walk reads them a token at a time, on the host's generator
    return list(torch.split(probs, [1 + len(item.tokens) for item in items]))


def _children(parents: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        out.setdefault(parent, []).append(i)
    return out


def _walk_exact(item: VerifyInput, targets: list[int]) -> Verified:
    """Follow the children holding the target's token at each row."""
    by_parent = {(p, t): i for i, (p, t) in enumerate(zip(item.parents, item.tokens))}
    node = -1
    tokens: list[int] = []
    nodes: list[int] = []
    rows: list[int] = []
    while True:
        token = targets[node + 1]
        tokens.append(token)
        rows.append(node + 1)
        child = by_parent.get((node, token))
        if child is None:
            return Verified(tokens, nodes, rows)
        nodes.append(child)
        node = child


def _rows(item: VerifyInput, wants_logprobs: bool) -> list[SamplingRow]:
    """A SamplingRow per logit row: history = the path to the node (penalties), position =
    where the token sampled from it goes (seeds)."""
    params = item.params
    if not wants_logprobs and params.logprobs is not None:
        params = SamplingParams(**{**params.to_dict(), "logprobs": None})
    paths = _paths(item.parents, item.tokens)
    depth_of = [0] + [len(path) for path in paths]
    out = []
    for row, depth in enumerate(depth_of):
        history: list[int] = []
        if params.has_penalties:
            history = item.history + (paths[row - 1] if row else [])
        out.append(SamplingRow(params, np.asarray(history, dtype=np.int64), item.num_prompt_tokens,
                               item.root_position + depth + 1))
    return out


def _paths(parents: list[int], tokens: list[int]) -> list[list[int]]:
    """Tokens from the root's child down to each node."""
    out: list[list[int]] = []
    for i, parent in enumerate(parents):
        out.append((out[parent] if parent >= 0 else []) + [tokens[i]])
    return out
