"""BulkArrayReader == gguf's GGUFReader on every field and tensor (synthetic, SentencePiece and
the SmolLM2 file), and refuses arrays that run past the end of a truncated file."""
from __future__ import annotations

import os
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest

from justapi.model.gguf_file import GGUFError, GGUFFile, default_model_path
from justapi.model.gguf_reader import BulkArrayReader
from workers.weights.synthetic import SyntheticSpec, write_synthetic_gguf


def assert_same_as_gguf(path: str) -> None:
    ours, theirs = BulkArrayReader(path, "r"), gguf.GGUFReader(path, "r")
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
        assert ours.fields[key].types == field.types, key
    assert ours.data_offset == theirs.data_offset
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, other in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type, mine.n_elements, mine.n_bytes, mine.data_offset) == \
            (other.name, other.tensor_type, other.n_elements, other.n_bytes, other.data_offset)
        assert list(mine.shape) == list(other.shape)
        assert np.array_equal(mine.data, other.data) and mine.data.dtype == other.data.dtype


@pytest.fixture(scope="module")
def synthetic_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gguf") / "synthetic.gguf")
    write_synthetic_gguf(path, SyntheticSpec(layers=2, hidden=64, context=256))
    return path


def test_synthetic_file_reads_alike(synthetic_path: str) -> None:
    assert_same_as_gguf(synthetic_path)


def test_sentencepiece_file_reads_alike(tmp_path) -> None:
    spm = pytest.importorskip("sentencepiece")
    from tests.support.gguf_tokenizers import train_sentencepiece, write_spm_gguf

    processor = spm.SentencePieceProcessor(model_proto=train_sentencepiece())
    path = str(write_spm_gguf(tmp_path / "spm.gguf", processor, chat_template="{{ x }}"))
    assert_same_as_gguf(path)
    scores = GGUFFile(path).get("tokenizer.ggml.scores")
    assert isinstance(scores, list) and len(scores) == processor.get_piece_size()


@pytest.mark.slow
def test_default_model_reads_alike() -> None:
    assert_same_as_gguf(default_model_path())


@pytest.mark.parametrize("cut_into", ["tokenizer.ggml.tokens", "tokenizer.ggml.merges"])
def test_truncated_string_array_is_refused(synthetic_path: str, tmp_path, cut_into: str) -> None:
    data = open(synthetic_path, "rb").read()
    key = cut_into.encode()
    start = data.index(struct.pack("<Q", len(key)) + key)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:start + 200])  # the array header survives, its strings do not
    with pytest.raises(GGUFError, match="corrupt or truncated"):
        GGUFFile(str(cut))


def test_absurd_array_length_is_refused(synthetic_path: str, tmp_path) -> None:
    data = bytearray(open(synthetic_path, "rb").read())
    key = b"tokenizer.ggml.tokens"
    count_at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4 + 4
    struct.pack_into("<Q", data, count_at, 1 << 60)
    bad = tmp_path / "absurd.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="corrupt or truncated"):
        GGUFFile(str(bad))


OPEN_COST = r"""
import gc, sys
import justapi.model.gguf_reader
from justapi.model.gguf_file import GGUFFile
from tools.bench.quant import private_mib

gc.collect()
before, _ = private_mib()
gguf = GGUFFile(sys.argv[1])
gc.collect()
after, _ = private_mib()
print(after - before, len(gguf.get("tokenizer.ggml.tokens")))
"""


def test_open_file_holds_no_object_per_vocabulary_entry() -> None:
    """A worker keeps its GGUFFile open: SmolLM2's 49k tokens and 49k merges as one object each
    held ~22 MiB (the memory bound of `--weights auto` is 1.3x the file); offsets hold < 2."""
    out = subprocess.run([sys.executable, "-c", OPEN_COST, default_model_path()], check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    mib, tokens = out.stdout.split()
    assert int(tokens) == 49152
    assert float(mib) < 8, mib
