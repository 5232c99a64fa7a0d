"""GGUF loading: dequantizers equal gguf's, metadata and layout conventions, and clear errors
for missing, truncated, corrupt or unsupported files."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf import quants as gguf_quants

from justapi.model.gguf_file import GGUFError, GGUFFile
from workers.weights.dequant import dequantize, supported_type_names
from workers.weights.gguf_loader import load_weights, unpermute_rotary_rows
from workers.weights.hparams import read_hyper_params

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _spec_for(type_name: str) -> dict:
    # K-quants use 256-value blocks: every matrix's row length must be a multiple of 256
    if type_name.endswith("_K"):
        return dict(type=type_name, hidden=256, heads=4, kv_heads=2, ffn=256, layers=1)
    return dict(type=type_name, layers=1)


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_equals_gguf_reference(tiny_gguf, type_name):
    gguf = GGUFFile(tiny_gguf(**_spec_for(type_name)))
    seen = set()
    for t in gguf.reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        ours = dequantize(t.data, t.tensor_type, shape, t.name)
        ref = gguf_quants.dequantize(t.data, t.tensor_type).reshape(shape)
        assert ours.dtype == torch.float32 and tuple(ours.shape) == shape
        assert torch.equal(ours, torch.from_numpy(np.array(ref, dtype=np.float32))), t.name
        seen.add(t.tensor_type.name)
    assert type_name in seen


def test_supported_types_cover_the_common_quants():
    names = set(supported_type_names())
    assert set(TYPES) <= names
    assert "I32" not in names and "Q8_1" not in names


def test_hyper_params_from_metadata(tiny_gguf):
    p = read_hyper_params(GGUFFile(tiny_gguf(layers=3, hidden=96, heads=6, kv_heads=2, ffn=160,
                                             vocab=300, context=128, rope_theta=5e5)))
    assert (p.num_layers, p.hidden_size, p.num_heads, p.num_kv_heads) == (3, 96, 6, 2)
    assert (p.head_dim, p.ffn_size, p.vocab_size, p.max_context) == (16, 160, 300, 128)
    assert p.rope_theta == 5e5 and p.rms_eps == pytest.approx(1e-5)


def _llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf does to HF q/k rows (written out independently)."""
    out = torch.empty_like(w)
    d = w.shape[0] // heads
    for h in range(heads):
        for i in range(d // 2):
            out[h * d + 2 * i] = w[h * d + i]
            out[h * d + 2 * i + 1] = w[h * d + i + d // 2]
    return out


def test_unpermute_undoes_the_converter_permutation():
    hf = torch.randn(4 * 8, 5)
    assert torch.equal(unpermute_rotary_rows(_llama_cpp_permute(hf, 4), 4), hf)


def test_fused_and_tied_weights(tiny_gguf):
    path = tiny_gguf(layers=1, tied=True)
    w = load_weights(GGUFFile(path), progress=False)
    assert w.is_tied and w.output is w.token_embd
    reader = GGUFReader(path)
    raw = {t.name: t for t in reader.tensors}
    v = raw["blk.0.attn_v.weight"]
    v_ref = torch.from_numpy(gguf_quants.dequantize(v.data, v.tensor_type).reshape(-1, w.params.hidden_size))
    assert torch.equal(w.layers[0].qkv[-v_ref.shape[0]:], v_ref)  # V rows are last, unpermuted
    untied = load_weights(GGUFFile(tiny_gguf(layers=1, tied=False)), progress=False)
    assert not untied.is_tied and not torch.equal(untied.output, untied.token_embd)


# ------------------------------------------------------------------------------ bad files


def _rewrite(src: str, dst: str, arch: str | None = None, fields: dict | None = None,
             tensors: dict | None = None) -> str:
    """Copy a GGUF, changing the architecture, some metadata values or some tensors."""
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, arch or reader.fields["general.architecture"].contents())
    fields, tensors = fields or {}, tensors or {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = fields.get(name, field.contents())
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type)
    for t in reader.tensors:
        data = tensors.get(t.name, t.data)
        raw = None if t.name in tensors else t.tensor_type
        writer.add_tensor(t.name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _load_error(path: str) -> str:
    with pytest.raises(GGUFError) as info:
        load_weights(GGUFFile(path), progress=False)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="cannot read"):
        GGUFFile(str(tmp_path / "nope.gguf"))


@pytest.mark.parametrize("fraction", [0.001, 0.3, 0.97])
def test_truncated_file(tiny_gguf, tmp_path, fraction):
    src = tiny_gguf(layers=1, type="Q8_0")
    data = open(src, "rb").read()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[:int(len(data) * fraction)])
    with pytest.raises(GGUFError, match="truncated|not a GGUF|corrupt|data holds"):
        load_weights(GGUFFile(str(path)), progress=False)


def test_corrupt_metadata(tiny_gguf, tmp_path):
    data = bytearray(open(tiny_gguf(layers=1), "rb").read())
    data[24:64] = b"\xff" * 40  # the first key's length and name
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="corrupt or truncated"):
        GGUFFile(str(path))
    path.write_bytes(b"GGML" + bytes(data[4:]))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(str(path))


def test_unsupported_architecture(tiny_gguf, tmp_path):
    path = _rewrite(tiny_gguf(layers=1), str(tmp_path / "arch.gguf"), arch="mamba")
    assert "unsupported architecture 'mamba'" in _load_error(path)


def test_unsupported_tensor_type(tiny_gguf, tmp_path):
    src = tiny_gguf(layers=1, type="F32")
    q = GGUFFile(src).tensors["blk.0.attn_q.weight"]
    as_int = np.asarray(q.data).view(np.int32).copy()  # same bytes, typed I32
    path = _rewrite(src, str(tmp_path / "i32.gguf"), tensors={"blk.0.attn_q.weight": as_int})
    message = _load_error(path)
    assert "blk.0.attn_q.weight" in message and "unsupported type I32" in message


@pytest.mark.parametrize("key,value,needle", [
    ("llama.block_count", 10**6, "num_layers=1000000"),
    ("llama.context_length", 2**31, "max_context=2147483648"),
    ("llama.attention.head_count_kv", 3, "not a multiple of head_count_kv 3"),
])
def test_absurd_dimensions(tiny_gguf, tmp_path, key, value, needle):
    path = _rewrite(tiny_gguf(layers=1), str(tmp_path / "absurd.gguf"), fields={key: value})
    assert needle in _load_error(path)


def test_tensor_shape_disagreeing_with_metadata(tiny_gguf, tmp_path):
    path = _rewrite(tiny_gguf(layers=1, ffn=128), str(tmp_path / "ffn.gguf"),
                    fields={"llama.feed_forward_length": 96})
    assert "blk.0.ffn_gate.weight" in _load_error(path)


def test_missing_tensor(tiny_gguf, tmp_path):
    src = tiny_gguf(layers=2)
    path = _rewrite(src, str(tmp_path / "short.gguf"), fields={"llama.block_count": 3})
    assert "tensor 'blk.2.attn_q.weight' is missing" in _load_error(path)


@pytest.mark.slow
def test_smollm2_metadata_and_layout(smollm2_path):
    gguf = GGUFFile(smollm2_path)
    p = read_hyper_params(gguf)
    assert (p.num_layers, p.hidden_size, p.num_heads, p.num_kv_heads, p.head_dim) == (30, 576, 9, 3, 64)
    assert (p.ffn_size, p.vocab_size, p.max_context, p.rope_theta) == (1536, 49152, 8192, 100000.0)
    types = {t.tensor_type for t in gguf.reader.tensors}
    assert {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0} <= types
    assert "output.weight" not in gguf.tensors
