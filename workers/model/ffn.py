"""The feed-forward block of a layer: a gated MLP, or a mixture of experts.

GatedFfn: down(act(gate(x)) * up(x)) with gate and up fused in one matrix. MoeFfn: a router
picks the top-k experts of each row (softmax, then top-k, renormalized where the architecture
says); rows are grouped by expert, so each expert used in the step runs one matmul over all
of its rows (no Python loop per token); a shared expert (Qwen2-MoE) is added, scaled by
sigmoid(x . w). On a GPU the experts run as grouped matmuls over all of them instead
(moe_grouped.py), with no host sync, so a step with MoE layers is captured in a graph.
Owns: that math. Does not own: the linears' kernels (forward.py, weights/).
"""
from __future__ import annotations

import importlib.util
from typing import Callable

import torch
import torch.nn.functional as F

from workers.model.layer_ops import ops_for
from workers.model.linear_like import LinearFactory, LinearLike
from workers.weights.gguf_loader import ExpertWeights

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedFfn:
    """down(act(g) * u) where [g | u] = gate_up(x); x [T, hidden] -> [T, hidden]."""

    def __init__(self, gate_up: LinearLike, down: LinearLike, activation: str = "silu") -> None:
        self.gate_up, self.down = gate_up, down
        self.ffn_size = gate_up.out_features // 2
        self.activation, self.act = activation, ACTIVATIONS[activation]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)  # [T, 2 * ffn]
        ops = ops_for(gate_up.device)
        hidden = ops.act_mul(gate_up, self.activation) if ops is not None else None
        if hidden is None:
            hidden = self.act(gate_up[:, :self.ffn_size]) * gate_up[:, self.ffn_size:]
        return self.down(hidden)

    def linears(self) -> list[LinearLike]:
        return [self.gate_up, self.down]


class MoeFfn:
    """Routed experts (and perhaps a shared one); x [T, hidden] -> [T, hidden]."""

    def __init__(self, weights: ExpertWeights, make_linear: LinearFactory, num_used: int,
                 renormalize: bool, activation: str = "silu", grouped: bool | None = None) -> None:
        """grouped: the experts as grouped matmuls (moe_grouped.py); None: on a GPU with Triton
        (True on a CPU runs them in Triton's interpreter: tests)."""
        self.router = weights.router  # [num_experts, hidden]
        gate_up, down = list(weights.gate_up), list(weights.down)
        if grouped is None:
            grouped = self.router.device.type == "cuda" and importlib.util.find_spec("triton") is not None
        self.stacks = None
        if grouped:
            from workers.model.moe_grouped import ExpertStack  # imports Triton

            self.stacks = (ExpertStack.of(gate_up, self.router.dtype), ExpertStack.of(down, self.router.dtype))
            gate_up = [self.stacks[0].expert(e) for e in range(len(gate_up))]  # views: no second copy
            down = [self.stacks[1].expert(e) for e in range(len(down))]
        self.experts = [GatedFfn(make_linear(gu), make_linear(d), activation) for gu, d in zip(gate_up, down)]
        self.activation = activation
        self.num_used, self.renormalize = num_used, renormalize
        self.shared: GatedFfn | None = None
        if weights.shared_gate_up is not None and weights.shared_down is not None:
            self.shared = GatedFfn(make_linear(weights.shared_gate_up), make_linear(weights.shared_down),
                                   activation)
        self.shared_gate = weights.shared_gate  # [hidden]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts and their weights: ([T, k] int64, [T, k] fp32)."""
        probs = torch.softmax((x @ self.router.T).float(), dim=-1)  # [T, num_experts]
        weights, experts = probs.topk(self.num_used, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        out = self._looped(x, experts, weights) if self.stacks is None else self._grouped(x, experts, weights)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(x @ self.shared_gate)[:, None]
            out = out + shared
        return out

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every entry (row, choice) through its expert in two grouped matmuls, then each row's
        k results weighted and added in choice order."""
        from workers.model.moe_grouped import grouped_layout

        assert self.stacks is not None
        gate_up_stack, down_stack = self.stacks
        layout = grouped_layout(experts, len(self.experts))
        gate_up = gate_up_stack.matmul(x, layout, row_div=self.num_used)  # [T * k, 2 * ffn]
        ops = ops_for(gate_up.device)
        hidden = ops.act_mul(gate_up, self.activation) if ops is not None else None
        if hidden is None:
            ffn_size = gate_up.shape[1] // 2
            hidden = ACTIVATIONS[self.activation](gate_up[:, :ffn_size]) * gate_up[:, ffn_size:]
        y = down_stack.matmul(hidden, layout, row_div=1)  # [T * k, hidden]
        y = y.view(x.shape[0], self.num_used, -1) * weights.to(y.dtype)[:, :, None]
        out = y[:, 0]
        for choice in range(1, self.num_used):
            out = out + y[:, choice]
        return out

    def _looped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each expert used in the step once, over its rows (their count read on the host)."""
        flat = experts.reshape(-1)  # [T * k]: entry j is row j // k's choice j % k
        order = torch.argsort(flat, stable=True)  # entries grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts))
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                entries = order[start:start + count]  # [count]
                rows = entries // self.num_used
                y = self.experts[expert](x[rows]) * weights.reshape(-1)[entries, None].to(x.dtype)
                out.index_add_(0, rows, y)  # [count, hidden] added to their rows
            start += count
        return out

    def linears(self, every_expert: bool = True) -> list[LinearLike]:
        experts = self.experts if every_expert else self.experts[:1]
        shared = self.shared.linears() if self.shared is not None else []
        return [linear for e in experts for linear in e.linears()] + shared
