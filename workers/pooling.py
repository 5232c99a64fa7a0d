"""Embeddings in the worker: a step's hidden states of pooling requests -> one vector each.

Rows are the step's flattened chunks (runner.py's `hidden`, before the final norm). A pooling
request's rows go through the model's final norm and are pooled as its NewRequest asked:
`last` the prompt's last position, `mean` the average over every prompt position (summed
across chunks in float64, so chunking does not change it), `cls` the first position. The
vector is returned, unnormalized, in the step whose chunk ends the prompt; the frontend
normalizes (and truncates for Matryoshka `dimensions`).

    rows:  | gen chunk | pool req (mean) chunk ....... | pool req (last) chunk .. x |
                         all rows normed and summed      only row x normed
Owns: the pooling arithmetic and per-request partial state. Does not own: which chunk runs
when (the scheduler), the forward (model/forward.py).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from justapi.wire.protocol import StepPlan, offsets
from workers.request_state import RequestState

FinalNorm = Callable[[torch.Tensor], torch.Tensor]
"""hidden rows [n, hidden] -> final-normed fp32 rows [n, hidden]."""


def pool_step(plan: StepPlan, hidden: torch.Tensor, requests: dict[str, RequestState],
              final_norm: FinalNorm) -> tuple[list[str], np.ndarray]:
    """Pooling requests whose prompt ends in this step and their vectors float32 [n, hidden];
    ValueError for a mean/cls chunk that does not continue where the last one ended."""
    tok_off = offsets(plan.num_tokens)
    ids: list[str] = []
    vectors: list[np.ndarray] = []
    for i, request_id in enumerate(plan.request_ids):
        state = requests[request_id]
        if not state.pooling:
            continue
        start, end = int(plan.start_positions[i]), int(plan.start_positions[i] + plan.num_tokens[i])
        rows = hidden[int(tok_off[i]):int(tok_off[i + 1])]  # [num_tokens, hidden]
        vector = _pool_chunk(state, request_id, start, end, rows, final_norm)
        if vector is not None:
            ids.append(request_id)
            vectors.append(vector)
    if not ids:
        return [], np.zeros((0, hidden.shape[-1]), np.float32)
    return ids, np.stack(vectors).astype(np.float32, copy=False)


def _pool_chunk(state: RequestState, request_id: str, start: int, end: int,
                rows: torch.Tensor, final_norm: FinalNorm) -> np.ndarray | None:
    num_prompt = state.num_prompt_tokens
    if end > num_prompt:
        raise ValueError(f"pooling request {request_id!r}: chunk [{start}, {end}) runs past "
                         f"its prompt of {num_prompt} tokens")
    if state.pooling == "last":
        return final_norm(rows[-1:])[0].cpu().numpy() if end == num_prompt else None
    if state.pooling == "cls":
        if start == 0:
            state.pooled = final_norm(rows[:1])[0].cpu().numpy()
        elif state.pooled is None:
            raise ValueError(f"pooling request {request_id!r}: cls pooling without position 0")
        return state.pooled if end == num_prompt else None
    total, count = state.pooled if state.pooled is not None else (0.0, 0)
    if start != count:
        raise ValueError(f"pooling request {request_id!r}: mean pooling chunk starts at {start}, "
                         f"{count} positions were pooled")
    total = total + final_norm(rows).double().sum(dim=0).cpu().numpy()  # [hidden] float64
    state.pooled = (total, end)
    return (total / end).astype(np.float32) if end == num_prompt else None
