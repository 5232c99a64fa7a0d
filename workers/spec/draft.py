"""The draft model: a small llama run beside the target that proposes the next step's drafts.

Its KV lives in a second pool addressed by the target's block ids, and it computes every
token the target computes: after each step's verification it forwards, per sequence, the
chunk's known tokens and the accepted drafts (so its KV is valid exactly where the target's
is: cached prefix blocks are valid for both, and a recompute after preemption recomputes
both). A sequence asked for proposals (StepPlan.num_propose) also forwards its new bonus
token, then grows a token tree level by level (workers/spec/tree.py's level masks), writing
scratch KV at look-ahead slots the scheduler reserved:

    positions:  | computed ... | Q (bonus) | Q+1 .. Q+N: node i at slot Q+1+i, rope Q+depth |

Children of a node: greedy - its top-w tokens; seeded - the top-w of q / E with the noise E
the target's sampler uses at that position (so the first child is the token plain decoding
would sample when draft and target agree); otherwise w draws from q (kept, with q, for
verification's rejection sampling). Levels keep their best nodes by path probability, up to
the shape's level sizes (SpecConfig.level_sizes), in order, so any depth cut is a prefix.
Owns: the draft model, its pool, proposals until verified. Does not own: verification.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from justapi.config.spec import SpecConfig
from justapi.model.gguf_file import GGUFFile, resolve_model_path
from justapi.sampling import SamplingParams
from workers.kv.pool import KVPool, PoolShape
from workers.model.attention import AttentionBackend, AttentionBatch
from workers.model.backends import make_backend
from workers.model.forward import DecoderModel
from workers.sampler import Sampler, apply_logit_bias, filtered_probs, seeded_noise
from workers.spec.tree import TreeLayout, level_mask
from workers.spec.verify import NodeDraws
from workers.weights.paths import load_model
from workers.weights.synthetic import SPEC_PREFIX, materialize


@dataclass
class Proposal:
    """A proposed tree kept until the scheduler sends it back as drafts (or drops it)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    draws: dict[int, NodeDraws] = field(default_factory=dict)  # unseeded sampling only
    scores: list[float] = field(default_factory=list)  # path probability under the draft


@dataclass
class DraftSeq:
    """One sequence of the step, as the draft model sees it after verification."""

    request_id: str
    start: int
    tokens: list[int]  # forwarded at positions start, start + 1, ...
    table: np.ndarray  # block ids (covering look-ahead when proposing)
    params: SamplingParams
    num_propose: int = 0  # tokens to propose after tokens[-1] (the bonus token)


class DraftModel:
    def __init__(self, model: DecoderModel, pool: KVPool, backend: AttentionBackend,
                 config: SpecConfig, sampler: Sampler | None = None) -> None:
        if pool.shape.num_layers != model.params.num_layers:
            raise ValueError(f"draft KV pool has {pool.shape.num_layers} layers, the draft model "
                             f"{model.params.num_layers}")
        self.model = model
        self.pool = pool
        self.backend = backend
        self.config = config
        self.sampler = sampler or Sampler()
        self.proposals: dict[str, Proposal] = {}

    @property
    def block_size(self) -> int:
        return self.pool.shape.block_size

    def draws_for(self, request_id: str, tokens: list[int],
                  parents: list[int]) -> dict[int, NodeDraws] | None:
        """The draws behind drafts the scheduler sent back: they must be a prefix of what
        was proposed (the scheduler only cuts trees by depth or budget)."""
        proposal = self.proposals.pop(request_id, None)
        if not tokens:
            return None
        n = len(tokens)
        if proposal is None or proposal.tokens[:n] != tokens or proposal.parents[:n] != parents:
            raise ValueError(f"request {request_id!r}: drafts are not the draft model's proposal")
        # A node keeps its draws when the cut kept it (a draw whose child was cut can still be
        # accepted: verification then ends on it).
        return {node: d for node, d in proposal.draws.items() if node < n} or None

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.proposals.pop(request_id, None)

    # ------------------------------------------------------------------ one step
    def step(self, seqs: list[DraftSeq]) -> dict[str, Proposal]:
        """Forward every sequence's tokens; propose for those that ask. Returns proposals by
        request id (also kept for draws_for)."""
        if not seqs:
            return {}
        asking = [s for s in seqs if s.num_propose > 0]
        logits = self._forward([s.start for s in seqs], [s.tokens for s in seqs],
                               [s.table for s in seqs], None, _last_rows(seqs, asking))
        growing = [_Growing(s, Proposal(), s.start + len(s.tokens) - 1,
                            self.config.level_sizes(s.num_propose), [(-1, 1.0, logits[i])])
                   for i, s in enumerate(asking)]
        depth = 1
        while True:
            active = [g for g in growing if depth <= len(g.sizes) and g.frontier]
            if not active:
                break
            for g in active:
                self._grow(g, depth)
            expand = [g for g in active if depth < len(g.sizes) and g.level_count]
            if expand:
                self._expand(expand, depth)
            depth += 1
        out = {g.seq.request_id: g.tree for g in growing if g.tree.tokens}
        self.proposals.update(out)
        return out

    def _grow(self, g: _Growing, depth: int) -> None:
        """Children of the frontier nodes: the new level, best first, at most its size."""
        params = g.seq.params
        width, size = self.config.widths[depth - 1], g.sizes[depth - 1]
        candidates: list[tuple[float, int, int]] = []
        left = size
        for node, score, node_logits in g.frontier:
            if params.logit_bias:  # propose from what the target will sample from
                node_logits = apply_logit_bias(node_logits[None].float(), [params])[0]
            if params.is_greedy or params.seed is not None:
                candidates.extend(_top_children(params, node, score, node_logits, width,
                                                g.root + depth))
            elif left > 0:  # unseeded: every unique draw becomes a child (the draws are trials)
                drawn, draws = self._drawn_children(params, node, score, node_logits,
                                                    min(width, left))
                g.tree.draws[node] = draws
                candidates.extend(drawn)
                left -= len(drawn)
        candidates.sort(key=lambda c: -c[0])
        g.level_start = len(g.tree.tokens)
        for score, parent, token in candidates[:size]:
            g.tree.tokens.append(token)
            g.tree.parents.append(parent)
            g.tree.scores.append(score)
        g.frontier = []

    def _drawn_children(self, params: SamplingParams, node: int, score: float,
                        logits: torch.Tensor,
                        num_draws: int) -> tuple[list[tuple[float, int, int]], NodeDraws]:
        q = filtered_probs(logits.float()[None], [params])[0]
        draws = [self.sampler.categorical(q) for _ in range(num_draws)]
        unique = list(dict.fromkeys(draws))
        return [(score * float(q[t]), node, t) for t in unique], NodeDraws(q, draws)

    def _expand(self, expand: list[_Growing], depth: int) -> None:
        """Forward the newest level's best nodes (as many as the next level holds), a
        tree-masked chunk per sequence; their logits become the next frontier."""
        layout = TreeLayout()
        starts, chunks, tables = [], [], []
        for i, g in enumerate(expand):
            count = min(g.level_count, g.sizes[depth])
            starts.append(g.root + 1 + g.level_start)
            chunks.append(g.tree.tokens[g.level_start:g.level_start + count])
            tables.append(g.seq.table)
            layout.add(level_mask(i, g.tree.parents, g.level_start, count, g.root))
        counts = [len(c) for c in chunks]
        logits = self._forward(starts, chunks, tables, layout, np.arange(sum(counts)))
        row = 0
        for g, count in zip(expand, counts):
            g.frontier = [(g.level_start + j, g.tree.scores[g.level_start + j], logits[row + j])
                          for j in range(count)]
            row += count

    # ------------------------------------------------------------------ the forward
    def _forward(self, starts: list[int], chunks: list[list[int]], tables: list[np.ndarray],
                 tree: TreeLayout | None, rows: np.ndarray) -> torch.Tensor:
        """Forward chunks (sequence i: chunks[i] at slot positions starts[i]...) through the
        draft model, writing its KV; logits [len(rows), vocab] of the given flat rows."""
        counts = np.asarray([len(c) for c in chunks], dtype=np.int64)
        batch = AttentionBatch(np.asarray(starts, dtype=np.int64), counts,
                               np.asarray([len(t) for t in tables], dtype=np.int64),
                               np.concatenate(tables).astype(np.int64), self.block_size,
                               tree or None)
        meta = self.backend.prepare(batch)
        tokens = torch.tensor([t for c in chunks for t in c], dtype=torch.int64,
                              device=self.model.device)
        kv_layers = [self.pool.layer(i) for i in range(self.pool.shape.num_layers)]
        hidden = self.model.forward(tokens, kv_layers, self.backend, meta)
        if not len(rows):
            return torch.zeros(0, self.model.params.vocab_size)
        index = torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(hidden.device)
        return self.model.logits(hidden[index]).float().cpu()


@dataclass
class _Growing:
    """A proposal being grown: its sequence, tree, root position, level sizes, the nodes
    whose children come next (with their logits) and where the newest level starts."""

    seq: DraftSeq
    tree: Proposal
    root: int
    sizes: list[int]
    frontier: list[tuple[int, float, torch.Tensor]]
    level_start: int = 0

    @property
    def level_count(self) -> int:
        return len(self.tree.tokens) - self.level_start


def _last_rows(seqs: list[DraftSeq], asking: list[DraftSeq]) -> np.ndarray:
    """Flat row of each asking sequence's last token (its bonus token)."""
    wanted = {s.request_id for s in asking}
    ends = np.cumsum([len(s.tokens) for s in seqs])
    return np.asarray([ends[i] - 1 for i, s in enumerate(seqs) if s.request_id in wanted],
                      dtype=np.int64)


def _top_children(params: SamplingParams, node: int, score: float, logits: torch.Tensor,
                  width: int, position: int) -> list[tuple[float, int, int]]:
    """Greedy: the top-width tokens of the draft; seeded: the top-width of q / E, E the noise
    the target's sampler uses for the token at `position`."""
    if params.is_greedy:
        q = torch.softmax(logits.float(), dim=-1)
        race = q
    else:
        q = filtered_probs(logits.float()[None], [params])[0]
        assert params.seed is not None
        race = q / seeded_noise(params.seed, position, q.shape[0])
    top = torch.topk(race, min(width, q.shape[0])).indices.tolist()
    return [(score * float(q[t]), node, int(t)) for t in top if float(q[t]) > 0]


def load_draft(spec: SpecConfig, num_blocks: int, block_size: int, device: str,
               seed: int | None = None, weights: str = "fp32", progress: bool = False) -> DraftModel:
    """The draft model of `spec` with a local KV pool of the target's num_blocks (the same
    block ids address both pools)."""
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    path = spec.draft_model
    path = materialize(path) if path.startswith(SPEC_PREFIX) else resolve_model_path(path)
    model = load_model(GGUFFile(path), device, dtype, weights, progress)
    p = model.params
    pool = KVPool.create(PoolShape(p.num_layers, num_blocks, block_size, p.num_kv_heads, p.head_dim),
                         "local", dtype, device)
    backend = make_backend(device, block_size, (p.num_heads, p.num_kv_heads, p.head_dim))
    return DraftModel(model, pool, backend, spec,
                      Sampler(None if seed is None else seed + 1))
