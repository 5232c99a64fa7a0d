"""Keeping GGUF Q4_0 / Q4_1 / Q8_0 tensors quantized: the repack into 4-bit codes and (d, m)
group pairs (quant_blocks.py) from files written here with `gguf`, hand-made blocks with known
fields, and the loader's fused, un-permuted quantized matrices against its dense ones."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf import quants as gguf_quants

from justapi.model.gguf_file import GGUFError, GGUFFile
from workers.weights.gguf_loader import load_weights
from workers.weights.block_matrix import RowStack
from workers.weights.quant_blocks import QuantMatrix, cat_rows, quant_matrix

Q = GGMLQuantizationType


def _write_matrix(path: str, weights: np.ndarray, qtype: GGMLQuantizationType) -> None:
    writer = GGUFWriter(path, "llama")
    data = gguf_quants.quantize(weights, qtype)
    writer.add_tensor("w", data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _read_matrix(path: str):
    (tensor,) = GGUFReader(path).tensors
    return tensor


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_repack_of_a_gguf_file_equals_gguf_dequantize(tmp_path, qtype):
    rng = np.random.default_rng(1)
    weights = (rng.standard_normal((48, 96)) * np.exp(rng.standard_normal((48, 1)))).astype(np.float32)
    path = str(tmp_path / f"{qtype.name}.gguf")
    _write_matrix(path, weights, qtype)
    tensor = _read_matrix(path)
    matrix = quant_matrix(tensor.data, tensor.tensor_type, (48, 96), "w")
    reference = torch.from_numpy(gguf_quants.dequantize(tensor.data, tensor.tensor_type).reshape(48, 96))
    assert matrix.shape == (48, 96) and matrix.type_name == qtype.name
    assert matrix.num_planes == (2 if qtype == Q.Q8_0 else 1)
    assert matrix.packed.dtype == torch.uint8 and matrix.packed.shape == (48, 96 * matrix.num_planes // 2)
    assert torch.equal(matrix.dense(), reference)  # bit-identical, not merely close
    rows = torch.tensor([5, 0, 47, 5])
    assert torch.equal(matrix[rows], reference[rows])


def _block_q4_1(d: float, m: float, codes: list[int]) -> bytes:
    low, high = codes[:16], codes[16:]
    nibbles = bytes(lo | (hi << 4) for lo, hi in zip(low, high))
    return np.float16(d).tobytes() + np.float16(m).tobytes() + nibbles


def test_q4_1_fields_land_where_the_kernel_form_expects_them():
    codes = [(7 * i + 3) % 16 for i in range(32)]
    raw = np.frombuffer(_block_q4_1(0.5, -1.25, codes) + _block_q4_1(2.0, 0.75, codes[::-1]), np.uint8)
    matrix = quant_matrix(raw, Q.Q4_1, (1, 64))
    assert matrix.codes().tolist() == [codes + codes[::-1]]
    assert matrix.d.tolist() == [[0.5, 2.0]] and matrix.m.tolist() == [[-1.25, 0.75]]
    assert matrix.dense().tolist() == [[0.5 * c - 1.25 for c in codes] + [2.0 * c + 0.75 for c in codes[::-1]]]


def test_q4_0_has_minus_8d_as_its_minimum():
    codes = list(range(16)) * 2
    raw = np.frombuffer(np.float16(0.25).tobytes() + bytes(c | (c << 4) for c in range(16)), np.uint8)
    matrix = quant_matrix(raw, Q.Q4_0, (1, 32))
    assert matrix.codes().tolist() == [codes]
    assert matrix.m.tolist() == [[-2.0]]
    assert matrix.dense().tolist() == [[0.25 * (c - 8) for c in codes]]


def test_q8_0_splits_into_high_and_low_nibble_planes():
    q = np.array([-128, -127, -1, 0, 1, 15, 16, 17, 127, -16, -17, 100] + [0] * 20, np.int8)
    raw = np.frombuffer(np.float16(0.125).tobytes() + q.tobytes(), np.uint8)
    matrix = quant_matrix(raw, Q.Q8_0, (1, 32))
    codes = matrix.codes()[0].int()
    hi, lo = codes[:32], codes[32:]
    assert torch.equal(16 * (hi - 8) + lo, torch.from_numpy(q.astype(np.int32)))
    assert matrix.d.tolist() == [[2.0, 0.125]] and matrix.m.tolist() == [[-16.0, 0.0]]
    assert torch.equal(matrix.dense()[0], 0.125 * torch.from_numpy(q.astype(np.float32)))


def test_bad_inputs_raise_errors_that_name_them():
    with pytest.raises(GGUFError, match="F16 has no 4-bit form"):
        quant_matrix(np.zeros(64, np.uint8), Q.F16, (1, 32), "w")
    with pytest.raises(GGUFError, match=r"w: data holds 19 bytes"):
        quant_matrix(np.zeros(19, np.uint8), Q.Q4_1, (1, 32), "w")
    with pytest.raises(GGUFError, match="not a matrix of 32-value blocks"):
        quant_matrix(np.zeros(20, np.uint8), Q.Q4_1, (2, 16), "w")
    matrix = quant_matrix(np.zeros(20, np.uint8), Q.Q4_1, (1, 32))
    with pytest.raises(ValueError, match=r"1-d index tensor, got shape \(1, 1\)"):
        matrix[torch.zeros(1, 1, dtype=torch.long)]


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_loader_keeps_fused_unpermuted_matrices_quantized(tiny_gguf, type_name):
    gguf = GGUFFile(tiny_gguf(layers=2, type=type_name, tied=False))
    dense = load_weights(gguf, progress=False)
    kept = load_weights(gguf, progress=False, keep_quantized=True)
    for layer_dense, layer_kept in zip(dense.layers, kept.layers):
        for name in ("qkv", "attn_out", "gate_up", "down"):
            matrix = getattr(layer_kept, name)
            assert isinstance(matrix, QuantMatrix), name
            assert torch.equal(matrix.dense(), getattr(layer_dense, name)), name
        assert torch.equal(layer_kept.attn_norm, layer_dense.attn_norm)
    assert isinstance(kept.output, QuantMatrix) and torch.equal(kept.output.dense(), dense.output)
    ids = torch.arange(dense.params.vocab_size)
    assert torch.equal(kept.token_embd[ids], dense.token_embd)


def test_loader_mixed_types(tiny_gguf):
    """Q4_1 layers with a Q8_0 embedding (the default model's mix): one and two planes; a tied
    head stays the embedding object; float types stay dense."""
    kept = load_weights(GGUFFile(tiny_gguf(layers=1, type="Q4_1", embed_type="Q8_0")),
                        progress=False, keep_quantized=True)
    assert kept.layers[0].qkv.num_planes == 1 and kept.token_embd.num_planes == 2
    assert kept.is_tied
    floats = load_weights(GGUFFile(tiny_gguf(layers=1, type="F16", embed_type="Q8_0")),
                          progress=False, keep_quantized=True)
    assert isinstance(floats.layers[0].qkv, torch.Tensor)
    assert isinstance(floats.token_embd, QuantMatrix)


def test_cat_rows_keeps_equal_planes_and_stacks_a_mix():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((32, 64)).astype(np.float32)
    q4 = quant_matrix(gguf_quants.quantize(w, Q.Q4_1), Q.Q4_1, (32, 64))
    q4_0 = quant_matrix(gguf_quants.quantize(w, Q.Q4_0), Q.Q4_0, (32, 64))
    q8 = quant_matrix(gguf_quants.quantize(w, Q.Q8_0), Q.Q8_0, (32, 64))
    both = cat_rows([q4, q4_0])
    assert isinstance(both, QuantMatrix) and both.type_name == "Q4_0+Q4_1"
    assert torch.equal(both.dense(), torch.cat([q4.dense(), q4_0.dense()]))
    mixed = cat_rows([q4, q8, torch.zeros(3, 64)])
    assert isinstance(mixed, RowStack) and mixed.parts[1] is q8 and mixed.shape == (67, 64)
    assert torch.equal(mixed.dense(), torch.cat([q4.dense(), q8.dense(), torch.zeros(3, 64)]))
