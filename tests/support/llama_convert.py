"""llama.cpp's own HF -> GGUF converter, for tests that read files as real users get them.

`converter_dir()` downloads the llama-cpp-python sdist (LLAMA_CPP_PYTHON) once with pip into a
cache (~/.cache/justapi/llama-cpp-python-<version>, under a file lock so that parallel test
processes download it once) and keeps only convert_hf_to_gguf.py, its `conversion` package and
gguf-py. `convert()` runs that converter as a subprocess (its own gguf-py first on the path) on
a saved HF model directory; `save_hf_model()` saves a tiny transformers model there with a
tokenizer the converter accepts, built offline (SentencePiece, or byte-level BPE for the
architectures whose converter reads only BPE vocabularies).
The converter's extra packages (torch, numpy, sentencepiece, safetensors, transformers, pyyaml,
requests, tqdm) come with the `[test]` extra. JUSTAPI_LLAMA_CPP_SDIST names a local sdist to use
instead of downloading (offline machines).
Owns: the cache, the conversion call and the tokenizer files. Does not own: the HF models
(hf_gguf.py) or any comparison.
"""
from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

LLAMA_CPP_PYTHON = "0.3.36"
SDIST_ENV = "JUSTAPI_LLAMA_CPP_SDIST"
CACHE_ENV = "JUSTAPI_LLAMA_CONVERT_CACHE"
KEPT = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
"""What is kept of the sdist's vendor/llama.cpp tree (~2 MB of the 77 MB archive)."""
OUTTYPES = ("f32", "f16", "q8_0")
BPE_PRE_TOKENIZER = "qwen2"
"""The converter identifies a BPE vocabulary's pre-tokenizer by hashing how it splits a fixed
text; a vocabulary trained here has no known hash, so the run names it (the split rules are
Qwen2's: the only BPE-only converters we use are the Qwen MoE ones)."""
_RUN_CONVERTER = """
import json, runpy, sys
root, pre, jobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path[:0] = [root + "/gguf-py", root]
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def named(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return pre
base.TextModel.get_vocab_base_pre = named
for model_dir, outfile, outtype in jobs:
    sys.argv = [root + "/convert_hf_to_gguf.py", model_dir, "--outfile", outfile, "--outtype", outtype]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""

class ConverterUnavailable(RuntimeError):
    """The sdist could not be fetched (no network, no index): tests that need it skip."""


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "justapi" / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def converter_dir() -> Path:
    """The directory holding convert_hf_to_gguf.py, conversion/ and gguf-py/ (made once)."""
    root = cache_root()
    done = root / "complete"
    if done.exists():
        return root
    with _locked(root.with_name(root.name + ".lock")):
        if done.exists():  # another process made it while this one waited
            return root
        with tempfile.TemporaryDirectory(dir=root.parent) as work:
            _extract(_sdist(Path(work)), Path(work) / "tree")
            shutil.rmtree(root, ignore_errors=True)
            os.replace(Path(work) / "tree", root)
        done.write_text(LLAMA_CPP_PYTHON + "\n")
    return root


def _sdist(work: Path) -> Path:
    local = os.environ.get(SDIST_ENV)
    if local:
        return Path(local)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "--disable-pip-version-check", "--quiet", "-d", str(work),
         f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], capture_output=True, text=True, check=False)
    found = sorted(work.glob("llama_cpp_python-*.tar.gz"))
    if result.returncode != 0 or not found:
        lines = (result.stderr or result.stdout).strip().splitlines()
        raise ConverterUnavailable(f"pip download llama-cpp-python=={LLAMA_CPP_PYTHON} failed: "
                                   f"{lines[-1] if lines else result.returncode}")
    return found[0]


def _extract(sdist: Path, into: Path) -> None:
    """vendor/llama.cpp/{KEPT} of the sdist -> into/{KEPT}."""
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            _, sep, rest = member.name.partition("/vendor/llama.cpp/")
            if sep and (rest in KEPT or rest.startswith(KEPT[1:])) and (member.isfile() or member.isdir()):
                member.name = rest
                members.append(member)
        if not any(m.name == KEPT[0] for m in members):
            raise ConverterUnavailable(f"{sdist} holds no vendor/llama.cpp/{KEPT[0]}")
        tar.extractall(into, members=members, filter="data")


def convert(model_dir: Path, out_path: Path, outtype: str = "f32") -> Path:
    """Run llama.cpp's convert_hf_to_gguf.py on a saved HF model directory -> out_path."""
    return convert_all([(model_dir, out_path, outtype)])[0]


def convert_all(jobs: list[tuple[Path, Path, str]]) -> list[Path]:
    """Several (model directory, output file, outtype) conversions in one converter process
    (its start, importing torch and transformers, is most of a tiny model's conversion)."""
    for _, _, outtype in jobs:
        if outtype not in OUTTYPES:
            raise ValueError(f"outtype {outtype!r} (expected one of {', '.join(OUTTYPES)})")
    root = converter_dir()
    env = {**os.environ, "NO_LOCAL_GGUF": "1", "PYTHONPATH": ""}  # its own gguf-py, not ours
    spec = json.dumps([[str(d), str(o), t] for d, o, t in jobs])
    result = subprocess.run([sys.executable, "-c", _RUN_CONVERTER, str(root), BPE_PRE_TOKENIZER, spec],
                            capture_output=True, text=True, check=False, env=env)
    missing = [str(o) for _, o, _ in jobs if not o.exists()]
    if result.returncode != 0 or missing:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({result.returncode}; not written: "
                           f"{', '.join(missing) or 'none'}):\n{tail}")
    return [o for _, o, _ in jobs]


def round_for(model: Any, outtype: str) -> None:
    """Round (in place) the weights the converter will store narrower, so that the HF model
    computes with exactly the file's values: F16 for every matrix under f16; Q8_0 (then the
    converter's re-quantization is exact) under q8_0. 1-d tensors and routers stay F32."""
    from tests.support.hf_gguf import round_weights

    if outtype == "q8_0":
        round_weights(model, "Q8_0")
    elif outtype == "f16":
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() >= 2 and not name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                    param.copy_(param.half().float())


def save_hf_model(model: Any, directory: Path, tokenizer: str = "spm") -> Path:
    """The model's weights and config (safetensors) plus a tokenizer the converter reads:
    "spm" a SentencePiece tokenizer.model, "bpe" a byte-level BPE tokenizer.json. The model's
    vocab_size must hold the tokenizer's pieces (the converter pads the rest)."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    if tokenizer == "spm":
        size = _save_sentencepiece(directory)
    elif tokenizer == "bpe":
        size = _save_bpe(directory, model.config.vocab_size)
    else:
        raise ValueError(f"tokenizer {tokenizer!r} (expected 'spm' or 'bpe')")
    if size > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {size} pieces, the model's vocab_size is {model.config.vocab_size}")
    return directory


@functools.cache
def _sentencepiece_model() -> bytes:
    from tests.support.gguf_tokenizers import train_sentencepiece

    return train_sentencepiece()


def _save_sentencepiece(directory: Path) -> int:
    import sentencepiece as spm

    blob = _sentencepiece_model()
    (directory / "tokenizer.model").write_bytes(blob)
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return int(spm.SentencePieceProcessor(model_proto=blob).get_piece_size())


def _save_bpe(directory: Path, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tests.support.gguf_tokenizers import corpus_lines

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus_lines(), trainer)
    backend.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
              "bos_token": None, "pad_token": "<|endoftext|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return int(backend.get_vocab_size())


def gguf_tensor_types(path: Path) -> dict[str, str]:
    """Tensor name -> GGML type name, as the file stores them."""
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def require_converter() -> Path:
    """converter_dir(), or skip the calling test where the sdist cannot be fetched."""
    import pytest

    try:
        return converter_dir()
    except ConverterUnavailable as exc:
        pytest.skip(str(exc))
