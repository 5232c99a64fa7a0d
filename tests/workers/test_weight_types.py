"""Files with quantized matrices no kernel keeps (IQ3_S, IQ2_XXS, ...): refused at start under the
keeping modes (auto, q4) on CPU in one line naming the type and --weights fp32, and loaded by
--weights fp32; the start-up check (justapi serve) and the loader (justapi generate) agree."""
from __future__ import annotations

import pytest
import torch

from justapi.model.gguf_file import GGUFError, GGUFFile
from justapi.model.weight_types import BLOCK_TYPE_NAMES, check_weight_types, expanded_types
from workers.weights.block_kernels import block_kernels
from workers.weights.block_matrix import BLOCK_TYPES
from workers.weights.paths import load_model

SHAPE = dict(hidden=256, heads=4, kv_heads=2, ffn=256, layers=1, vocab=320)


@pytest.mark.parametrize("type_name", ["IQ3_S", "IQ2_XXS"])
def test_a_type_without_a_kernel_is_refused_under_auto_and_loads_as_fp32(tiny_gguf, type_name):
    gguf = GGUFFile(tiny_gguf(type=type_name, embed_type="Q8_0", **SHAPE))
    assert expanded_types(gguf) == {type_name: 7}  # q, k, v, output, gate, up, down
    for weights in ("auto", "q4"):
        with pytest.raises(GGUFError, match=rf"{type_name} \(7 tensors\): --weights {weights} has no kernel "
                                            r"for this type .* load it with --weights fp32") as caught:
            check_weight_types(gguf, weights, "cpu")
        assert "\n" not in str(caught.value)
    check_weight_types(gguf, "fp32", "cpu")
    check_weight_types(gguf, "auto", "cuda")  # a GPU dequantizes every type by design
    if block_kernels() is not None:
        with pytest.raises(GGUFError, match=f"{type_name}.*--weights fp32"):
            load_model(gguf, weights="auto", progress=False)
    model = load_model(gguf, weights="fp32", progress=False)
    assert torch.isfinite(model.layers[0].qkv(torch.randn(2, 256))).all()


def test_the_kept_types_are_the_kernels_types(tiny_gguf):
    assert tuple(t.name for t in BLOCK_TYPES) == BLOCK_TYPE_NAMES
    gguf = GGUFFile(tiny_gguf(type="IQ4_XS", embed_type="IQ4_NL", **SHAPE))
    assert not expanded_types(gguf)
    check_weight_types(gguf, "auto", "cpu")
