"""Every Triton kernel of the GPU forward at the shapes real models have: head_dim 64, 128 and
256 (SmolLM2/Llama-3.2-1B, Llama/Qwen/Mistral, Gemma), query groups 1 to 8, partial rotary,
soft-capping, sliding windows, qkv biases and GELU, each against a float64 or torch reference.
In Triton's CPU interpreter (tests/conftest.py sets it where no GPU is seen) a few cases each
keep CI short; on a GPU (compiled, bf16 and fp32) every combination runs. JUSTAPI_TEST_GPU_DEVICE
names the device as tests/workers/test_gpu.py does."""
from __future__ import annotations

import dataclasses
import itertools
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.workers.test_cpu_kernels import random_step
from workers.model.attention import AttentionParams as LayerParams
from workers.spec.tree import TreeLayout, verify_mask

pytest.importorskip("triton")
from tests.workers.test_triton_attention import reference  # noqa: E402
from workers.model.paged_backend import TritonPagedBackend  # noqa: E402
from workers.model.triton_attention import AttentionParams, is_interpreted  # noqa: E402
from workers.model.triton_layer_ops import TritonLayerOps  # noqa: E402

DEVICE = os.environ.get("JUSTAPI_TEST_GPU_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE != "cpu"
pytestmark = pytest.mark.skipif(not ON_GPU and not is_interpreted(),
                                reason="needs a GPU or Triton's interpreter (tests/conftest.py)")
HALF = torch.bfloat16 if ON_GPU else torch.float16  # the interpreter has no bf16 arithmetic
OPS = TritonLayerOps()
PLAIN, CAPPED = "plain", "window+softcap"


def cases(interpreted: list[tuple], everything: list[tuple]) -> list[tuple]:
    """The few cases the interpreter runs, or on a GPU every one."""
    return everything if ON_GPU else interpreted


ATTENTION = cases([(64, 1, PLAIN), (128, 4, CAPPED), (256, 8, PLAIN), (256, 2, CAPPED)],
                  list(itertools.product((64, 128, 256), (1, 4, 8), (PLAIN, CAPPED))))


@pytest.mark.parametrize("head_dim,group,kind", ATTENTION)
def test_attention_at_every_head_dim_and_group(head_dim, group, kind):
    """A mixed step (decodes at and past block edges, a prefill chunk, a verification tree)
    over scattered blocks: fp32 to float64 rounding, half precision to its own."""
    kv_heads = 2 if group < 8 else 1
    tree = TreeLayout()
    tree.add(verify_mask(seq=2, num_tokens=4, start=40, parents=[-1, 0, 0]))
    batch, kv, q = random_step([0, 15, 40, 9], [1, 1, 4, 20], group * kv_heads, kv_heads, head_dim, 16,
                               seed=head_dim + group, tree=tree)
    scale = head_dim ** -0.5
    params = AttentionParams(scale) if kind == PLAIN else AttentionParams(scale, window=12, softcap=4.0)
    for dtype in (torch.float32, HALF) if ON_GPU or head_dim == 64 else (torch.float32,):
        backend = TritonPagedBackend(16, DEVICE, group, params)
        got = backend.attend(kv.to(DEVICE, dtype), q.to(DEVICE, dtype), backend.prepare(batch)).double().cpu()
        want = reference(batch, kv.to(dtype).double(), q.to(dtype).double(), params)
        error = float((got - want).abs().max()) / max(1.0, float(want.abs().max()))
        assert error < (1e-5 if dtype == torch.float32 else 2e-2), (dtype, error)


@pytest.mark.parametrize("head_dim,heads", [(64, 9), (128, 32), (256, 8)])
@pytest.mark.parametrize("rotary_dims", ["whole", "partial"])
def test_rotary_at_every_head_dim(head_dim, heads, rotary_dims):
    half = head_dim // 2 if rotary_dims == "whole" else head_dim // 4
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(3, (heads + 2) * head_dim, generator=gen)
    x = qkv[:, :heads * head_dim].view(3, heads, head_dim)  # token rows apart, as in the fused qkv
    angles = torch.randn(3, half, generator=gen)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    want = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:]], dim=-1)
    for dtype in (torch.float32, HALF):
        device_x = qkv.to(DEVICE, dtype)[:, :heads * head_dim].view(3, heads, head_dim)
        got = OPS.rotary(device_x, cos.to(DEVICE, dtype), sin.to(DEVICE, dtype)).float().cpu()
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(got, want, rtol=tolerance, atol=tolerance), dtype
        assert torch.equal(got[..., 2 * half:], x.to(dtype).float()[..., 2 * half:])  # passed through


@pytest.mark.parametrize("hidden", [576, 2048, 3072])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_norm_and_activation_at_model_widths(hidden, activation):
    gen = torch.Generator().manual_seed(hidden)
    x, d, w = torch.randn(2, hidden, generator=gen) * 3, torch.randn(2, hidden, generator=gen), torch.randn(hidden, generator=gen)
    total, normed = OPS.add_rms_norm(x.to(DEVICE), d.to(DEVICE), w.to(DEVICE), 1e-6)
    s = (x + d).double()
    want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert torch.equal(total.cpu(), x + d)
    assert torch.allclose(normed.double().cpu(), want, rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(2, 2 * hidden, generator=gen) * 3
    act = F.silu if activation == "silu" else (lambda g: F.gelu(g, approximate="tanh"))
    want = act(gate_up[:, :hidden].double()) * gate_up[:, hidden:].double()
    got = OPS.act_mul(gate_up.to(DEVICE), activation).double().cpu()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@dataclasses.dataclass(frozen=True)
class Variant:
    """What a layer can add on top of a plain llama one."""

    heads: int
    kv_heads: int
    head_dim: int
    bias: bool = False
    gelu: bool = False
    partial_rotary: bool = False
    softcap: float = 0.0
    window: int = 0


FORWARDS = cases(
    [Variant(4, 1, 64, bias=True, gelu=True, partial_rotary=True, softcap=5.0, window=6),
     Variant(2, 1, 256, bias=True)],
    [Variant(4, 1, 64, bias=True, gelu=True, partial_rotary=True, softcap=5.0, window=6),
     Variant(8, 2, 128, bias=True), Variant(8, 1, 128, gelu=True, softcap=30.0),
     Variant(2, 1, 256, bias=True), Variant(4, 2, 256, gelu=True, softcap=50.0, window=8, partial_rotary=True)])


@pytest.mark.parametrize("variant", FORWARDS, ids=lambda v: f"hd{v.head_dim}-g{v.heads // v.kv_heads}")
def test_a_layer_through_the_kernels_equals_its_torch_forms(tiny_gguf, variant, monkeypatch):
    """A 2-layer model given the variant's qkv biases, activation, partial rotary, soft-cap and
    window, one prefill + decode step: Triton attention and layer ops on DEVICE against the
    torch forms and the gathered attention on the CPU in fp32 (tolerance: the device's dtype)."""
    from workers.kv.pool import KVPool, PoolShape
    from workers.model import ffn, forward
    from workers.model.attention import AttentionBatch, TorchPagedBackend
    from workers.model.forward import DecoderModel, Rotary
    from workers.weights.gguf_loader import load_weights
    from justapi.model.gguf_file import GGUFFile

    hidden = variant.heads * variant.head_dim
    path = tiny_gguf(layers=2, hidden=hidden, heads=variant.heads, kv_heads=variant.kv_heads, ffn=128, vocab=320)
    batch = AttentionBatch(np.array([0, 0]), np.array([13, 1]), np.array([4, 1]), np.array([5, 1, 7, 2, 3]), 4)
    tokens = torch.tensor([5, 17, 3, 250, 9, 1, 44, 8, 19, 300, 2, 61, 7, 11])
    outputs = {}
    for on_kernels, device, dtype in ((False, "cpu", torch.float32),
                                      (True, DEVICE, torch.bfloat16 if ON_GPU else torch.float32)):
        model = DecoderModel(load_weights(GGUFFile(path), device, dtype, progress=False))
        _apply(model, variant, Rotary, device)
        ops = OPS if on_kernels else None
        monkeypatch.setattr(forward, "ops_for", lambda _: ops)
        monkeypatch.setattr(ffn, "ops_for", lambda _: ops)
        p = model.params
        pool = KVPool.create(PoolShape(2, 8, 4, p.num_kv_heads, p.head_dim), "local", dtype, device)
        backend = (TritonPagedBackend(4, device, p.num_heads // p.num_kv_heads) if on_kernels
                   else TorchPagedBackend(4, chunk_bytes=None))
        with torch.inference_mode():
            hidden_states = model.forward(tokens.to(device), [pool.layer(i) for i in range(2)], backend,
                                          backend.prepare(batch))
            outputs[on_kernels] = model.logits(hidden_states).float().cpu()
    want, got = outputs[False], outputs[True]
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= (1e-4 if not ON_GPU else 5e-2) * scale
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1 * scale  # rows whose argmax bf16 cannot flip
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def _apply(model, variant: Variant, rotary_class, device: str) -> None:
    """The variant's features set on every layer of a loaded llama model (same values on every
    device: a seeded generator)."""
    gen = torch.Generator().manual_seed(7)
    p = model.params
    if variant.partial_rotary:
        model.rotaries = [rotary_class(p.head_dim // 2, 10000.0, device=device)]
    for layer in model.layers:
        if variant.bias:
            qkv_size = (p.num_heads + 2 * p.num_kv_heads) * p.head_dim
            layer.qkv_bias = (torch.randn(qkv_size, generator=gen) * 0.5).to(device, model.dtype)
        if variant.gelu:
            layer.ffn.activation, layer.ffn.act = "gelu_tanh", ffn_gelu
        layer.attention = LayerParams(p.head_dim ** -0.5, softcap=variant.softcap, window=variant.window)


def ffn_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")
