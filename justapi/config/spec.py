"""Speculative decoding settings of `justapi serve`: the proposer, how many tokens it proposes,
the token tree's shape, the verification budget and the adaptive rule's cost model.

Keys are flat like every serve key (`spec`, `draft-model`, `gamma`, `branch`, `spec-tree`,
`spec-budget`, ...); docs/speculative.md says what each one changes.
Owns: those fields, their validation and the tree-shape arithmetic both planes share
(`level_sizes`). Does not own: proposing (justapi/scheduler/spec/, workers/spec/draft.py) or verifying.
"""
from __future__ import annotations

from dataclasses import dataclass

from justapi.config.fields import check_bool, check_choice, check_number, option, require

PROPOSERS = ("", "ngram", "draft")
MAX_GAMMA = 32
NGRAM_GAMMA = 7
"""The n-gram proposer's default depth: 8 rows (one int8 panel) verify up to 8 tokens, and the
adaptive rule trims levels where drafts are rarely accepted (docs/speculative.md)."""
DRAFT_GAMMA = 4
"""A draft model's default depth: each level costs one of its forwards."""
MAX_BRANCH = 16
MAX_NODES = 128


def parse_tree(text: str) -> tuple[int, ...]:
    """'3,2,1' -> (3, 2, 1): children per node at depth 0 (the root), 1, 2; ValueError naming it."""
    try:
        widths = tuple(int(part) for part in text.split(","))
    except ValueError:
        widths = ()
    require(0 < len(widths) <= MAX_GAMMA and all(1 <= w <= MAX_BRANCH for w in widths),
            f"spec-tree must be 1..{MAX_GAMMA} comma-separated widths in [1, {MAX_BRANCH}] "
            f"(children per node at each depth), got {text!r}")
    return widths


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (off unless `spec` or `draft_model` is set)."""

    spec: str = option("", "Speculative decoding proposer: ngram (prompt lookup, no extra "
                           "model) or draft (draft-model); none: off.", choices=PROPOSERS)
    draft_model: str = option("", "GGUF of a draft model with the target's vocabulary, proposing "
                                  "tokens the model verifies; implies spec = draft.")
    gamma: int = option(0, "Tokens proposed along one path per step: the depth of the token "
                           "tree (0: 7 with ngram, 4 with a draft model).")
    branch: int = option(1, "Children per node of the token tree (1: a chain of gamma tokens).")
    spec_tree: str = option("", "Explicit tree shape, children per node at each depth, e.g. "
                                "3,2,1,1 (overrides gamma and branch).")
    spec_budget: int = option(0, "Most draft tokens (tree nodes) verified per request per step; "
                                 "0: gamma x the widest level.")
    spec_adaptive: bool = option(True, "Propose fewer (or no) tokens when acceptance is poor or "
                                       "the batch is large (the cost rule in "
                                       "justapi/scheduler/spec/budget.py); off: always the full "
                                       "tree.")
    spec_fixed_cost_tokens: float = option(16.0, "The adaptive rule's cost model: a step of T "
                                                 "rows costs (this + T) row-units (about 16 on a "
                                                 "2-core CPU for SmolLM2; hundreds on a GPU).")
    spec_ngram_max: int = option(4, "n-gram proposer: longest suffix (in tokens) looked up in "
                                    "the request's own tokens.")
    spec_ngram_min: int = option(1, "n-gram proposer: shortest suffix that may match.")

    def __post_init__(self) -> None:
        check_choice(self.spec, "spec", PROPOSERS)
        require(isinstance(self.draft_model, str),
                f"draft-model must be a path, got {self.draft_model!r}")
        if self.draft_model and not self.spec:
            object.__setattr__(self, "spec", "draft")
        require(self.spec != "draft" or bool(self.draft_model),
                "spec = 'draft' needs draft-model (a GGUF file)")
        require(self.spec != "ngram" or not self.draft_model,
                "give either spec = 'ngram' or draft-model, not both (draft-model "
                f"{self.draft_model!r})")
        check_number(self.gamma, "gamma", low=0, high=MAX_GAMMA, integer=True)
        if self.gamma == 0 and self.spec:  # n-gram drafts cost nothing to propose; a draft's do
            object.__setattr__(self, "gamma", NGRAM_GAMMA if self.spec == "ngram" else DRAFT_GAMMA)
        check_number(self.branch, "branch", low=1, high=MAX_BRANCH, integer=True)
        require(isinstance(self.spec_tree, str),
                f"spec-tree must be a string, got {self.spec_tree!r}")
        if self.spec_tree:
            parse_tree(self.spec_tree)
        check_number(self.spec_budget, "spec-budget", low=0, high=MAX_NODES, integer=True)
        check_bool(self.spec_adaptive, "spec-adaptive")
        check_number(self.spec_fixed_cost_tokens, "spec-fixed-cost-tokens", low=0.0, high=1e6)
        check_number(self.spec_ngram_max, "spec-ngram-max", low=1, high=64, integer=True)
        check_number(self.spec_ngram_min, "spec-ngram-min", low=1, high=self.spec_ngram_max,
                     integer=True)

    @property
    def is_enabled(self) -> bool:
        return bool(self.spec)

    @property
    def widths(self) -> tuple[int, ...]:
        """Children per node at each depth (root = depth 0); its length is the tree's depth."""
        return parse_tree(self.spec_tree) if self.spec_tree else (self.branch,) * self.gamma

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def is_chain(self) -> bool:
        return all(w == 1 for w in self.widths)

    @property
    def max_nodes(self) -> int:
        """The verification budget per request per step (tree nodes)."""
        if self.spec_budget:
            return self.spec_budget
        return min(MAX_NODES, self.depth * max(self.widths))

    def level_sizes(self, num_nodes: int | None = None, max_depth: int | None = None) -> list[int]:
        """Nodes per depth (1, 2, ...) of a tree of at most num_nodes nodes (default
        max_nodes) and max_depth levels: a beam as wide as ceil(nodes / depth), each node with
        at most its depth's width of children. A chain gives [1] * num_nodes (up to gamma).

            widths (2, 2, 2, 2), 8 nodes -> beam 2 -> [2, 2, 2, 2]
            widths (2, 2, 2, 2), 4 nodes, depth 2 -> [2, 2]
            widths (3, 2, 1),    9 nodes -> beam 3 -> [3, 3, 3]
        """
        budget = self.max_nodes if num_nodes is None else min(num_nodes, self.max_nodes)
        widths = self.widths
        depth = min(len(widths), budget, len(widths) if max_depth is None else max_depth)
        if depth <= 0:
            return []
        beam = -(-budget // depth)
        sizes: list[int] = []
        prev = 1
        for width in widths[:depth]:
            size = min(prev * width, beam, budget - sum(sizes))
            if size <= 0:
                break
            sizes.append(size)
            prev = size
        return sizes
