"""Random-weight llama GGUF files: a fully servable model of any shape, for tests and demos.

`write_synthetic_gguf(path, spec)` writes weights (any tensor type gguf can quantize, IQ4_NL and
IQ4_XS by iq4_pack.py, the K-quants Q2_K..Q6_K, IQ3_S and IQ2_XXS as random blocks) and a small byte-level `gpt2` tokenizer: the 256 bytes in
GPT-2's byte-to-unicode alphabet, a few merges, specials `<|endoftext|>`, `<|im_start|>`,
`<|im_end|>` and a ChatML chat template. `materialize("synthetic:layers=2,hidden=64,...")`
writes the file once into a cache directory, named by a hash of the spec (deterministic).
Owns: the synthetic file format choices. Does not own: loading (gguf_loader.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType
from gguf import quants as gguf_quants

from workers.weights.iq4_pack import pack_iq4

SPEC_PREFIX = "synthetic:"
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n"),
          ("o", "n"), ("Ġ", "a"), ("r", "e"), ("Ġ", "s"))
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")
MIXES = ("Q4_K_M",)
"""Per-tensor type mixes, as llama-quantize chooses them (llama.cpp's llama-quant.cpp): Q4_K_M
keeps Q4_K everywhere but the output head (Q6_K) and, in the layers where more bits pay
(the first and last eighth, and every third layer between), attn_v and ffn_down (Q6_K)."""
# Byte offsets of the float16 scale fields (d, dmin) inside one block of the types written as
# random blocks (gguf-py cannot quantize them; IQ3_S and IQ2_XXS: files no kernel keeps).
_K_QUANT_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
                          "IQ3_S": (0,), "IQ2_XXS": (0,)}


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape and tensor types of a random llama model."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    vocab: int = 384
    context: int = 512
    type: str = "F32"
    """Type of every weight matrix (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K,
    IQ4_NL, IQ4_XS; IQ3_S, IQ2_XXS as random blocks), or the mix of llama.cpp's Q4_K_M (MIXES)."""
    embed_type: str = ""
    """Type of token_embd; "" = same as `type`."""
    v_type: str = ""
    """Type of attn_v and ffn_down; "" = same as `type` (Q6_K with Q4_K: a Q4_K_M file's mix)."""
    tied: bool = True
    """No output.weight: the head reuses token_embd."""
    rope_theta: float = 10000.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "context"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"synthetic model {name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"synthetic model: hidden {self.hidden}, heads {self.heads}, kv_heads "
                             f"{self.kv_heads} need hidden % heads == 0, heads % kv_heads == 0, even head_dim")
        if self.vocab < min_vocab():
            raise ValueError(f"synthetic model vocab must be >= {min_vocab()}, got {self.vocab}")
        for name in ("type", "embed_type", "v_type"):
            value = getattr(self, name)
            if name == "type" and value.upper() in MIXES:
                continue
            if value and value.upper() not in GGMLQuantizationType.__members__:
                raise ValueError(f"synthetic model {name} {value!r} is not a GGML tensor type")


def min_vocab() -> int:
    return 256 + len(MERGES) + len(SPECIALS)


def parse_spec(text: str) -> SyntheticSpec:
    """'synthetic:layers=2,hidden=64,type=q8_0' -> SyntheticSpec (unlisted fields default)."""
    if not text.startswith(SPEC_PREFIX):
        raise ValueError(f"synthetic model spec must start with {SPEC_PREFIX!r}, got {text!r}")
    fields = {f.name: f for f in dataclasses.fields(SyntheticSpec)}
    values: dict[str, object] = {}
    for item in filter(None, text[len(SPEC_PREFIX):].split(",")):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise ValueError(f"bad synthetic spec item {item!r} (keys: {', '.join(fields)})")
        values[key] = _parse_value(key, raw.strip(), fields[key].type)
    return SyntheticSpec(**values)  # type: ignore[arg-type]


def _parse_value(key: str, raw: str, kind: object) -> object:
    try:
        if kind in ("int", int):
            return int(raw)
        if kind in ("float", float):
            return float(raw)
        if kind in ("bool", bool):
            if raw.lower() not in ("1", "0", "true", "false"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true")
    except ValueError:
        raise ValueError(f"synthetic spec {key}={raw!r} is not a valid {kind}") from None
    return raw.upper() if key.endswith("type") else raw


def materialize(text: str, cache_dir: str | None = None) -> str:
    """Path of the GGUF for a spec string, written on first use (atomically: temp + rename)."""
    spec = parse_spec(text)
    key = hashlib.sha256(repr(dataclasses.astuple(spec)).encode()).hexdigest()[:16]
    directory = Path(cache_dir or os.environ.get("JUSTAPI_CACHE_DIR")
                     or Path(tempfile.gettempdir()) / "justapi-synthetic")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"synthetic-{key}.gguf"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".partial")
        os.close(fd)
        try:
            write_synthetic_gguf(tmp, spec)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return str(path)


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table: byte b -> a printable character (index b)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def vocabulary(vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens and token types: bytes, merged tokens, specials, then unused fillers."""
    tokens = byte_alphabet() + [a + b for a, b in MERGES]
    types = [TokenType.NORMAL] * len(tokens)
    tokens += list(SPECIALS)
    types += [TokenType.CONTROL] * len(SPECIALS)
    fillers = vocab_size - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(fillers)]
    types += [TokenType.UNUSED] * fillers
    return tokens, [int(t) for t in types]


def special_token_id(name: str) -> int:
    return 256 + len(MERGES) + SPECIALS.index(name)


def write_synthetic_gguf(path: str, spec: SyntheticSpec) -> None:
    rng = np.random.default_rng(spec.seed)
    writer = GGUFWriter(path, "llama")
    _write_metadata(writer, spec)
    head_dim = spec.hidden // spec.heads
    values = _spread if spec.type.upper() in MIXES else _dense
    embed_type = spec.embed_type or tensor_type(spec, "token_embd")
    _add_matrix(writer, "token_embd.weight", values(rng, spec.vocab, spec.hidden), embed_type, rng)
    if not spec.tied:
        _add_matrix(writer, "output.weight", values(rng, spec.vocab, spec.hidden),
                    tensor_type(spec, "output"), rng)
    _add_norm(writer, "output_norm.weight", rng, spec.hidden)
    shapes = {"attn_q": (spec.heads * head_dim, spec.hidden), "attn_k": (spec.kv_heads * head_dim, spec.hidden),
              "attn_v": (spec.kv_heads * head_dim, spec.hidden), "attn_output": (spec.hidden, spec.heads * head_dim),
              "ffn_gate": (spec.ffn, spec.hidden), "ffn_up": (spec.ffn, spec.hidden),
              "ffn_down": (spec.hidden, spec.ffn)}
    for i in range(spec.layers):
        _add_norm(writer, f"blk.{i}.attn_norm.weight", rng, spec.hidden)
        _add_norm(writer, f"blk.{i}.ffn_norm.weight", rng, spec.hidden)
        for name, (rows, cols) in shapes.items():
            _add_matrix(writer, f"blk.{i}.{name}.weight", values(rng, rows, cols),
                        tensor_type(spec, name, i), rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tensor_type(spec: SyntheticSpec, name: str, layer: int = 0) -> str:
    """The type of tensor `name` (token_embd, output, attn_q, ffn_down, ...) of `layer`."""
    if spec.type.upper() != "Q4_K_M":
        return spec.v_type if spec.v_type and name in ("attn_v", "ffn_down") else spec.type
    n = spec.layers
    more_bits = layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2
    if name == "output" or (name in ("attn_v", "ffn_down") and more_bits):
        return "Q6_K"
    return "Q4_K"


def _write_metadata(writer: GGUFWriter, spec: SyntheticSpec) -> None:
    writer.add_name(f"synthetic-llama-{spec.layers}x{spec.hidden}-{spec.type.lower()}")
    writer.add_block_count(spec.layers)
    writer.add_context_length(spec.context)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.ffn)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_rope_dimension_count(spec.hidden // spec.heads)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(spec.vocab)
    tokens, types = vocabulary(spec.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_bos_token_id(special_token_id("<|endoftext|>"))
    writer.add_eos_token_id(special_token_id("<|im_end|>"))
    writer.add_pad_token_id(special_token_id("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _dense(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    return rng.normal(0.0, 1.0 / np.sqrt(cols), (rows, cols))


@dataclass(frozen=True)
class _Spread:
    """What random K-quant blocks take of a matrix: its shape and std (a mix's matrices are
    all K-quants: a ~1B model's normal draws would take longer than its blocks)."""

    shape: tuple[int, int]

    def std(self) -> float:
        return float(1.0 / np.sqrt(self.shape[1]))


def _spread(rng: np.random.Generator, rows: int, cols: int) -> _Spread:
    return _Spread((rows, cols))


def _add_norm(writer: GGUFWriter, name: str, rng: np.random.Generator, size: int) -> None:
    writer.add_tensor(name, rng.uniform(0.8, 1.2, size).astype(np.float32))


def _add_matrix(writer: GGUFWriter, name: str, values: np.ndarray | _Spread, type_name: str,
                rng: np.random.Generator) -> None:
    qtype = GGMLQuantizationType[type_name.upper()]
    block_size = GGML_QUANT_SIZES[qtype][0]
    if values.shape[1] % block_size:
        raise ValueError(f"{name}: rows of {values.shape[1]} values do not split into "
                         f"{qtype.name} blocks of {block_size}")
    if qtype.name in _K_QUANT_SCALE_OFFSETS:
        writer.add_tensor(name, _random_k_quant(qtype, values, rng), raw_dtype=qtype)
        return
    if isinstance(values, _Spread):  # a mix's matrix of another type (an embed_type): drawn now
        values = _dense(rng, *values.shape)
    if qtype in (GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS):
        writer.add_tensor(name, pack_iq4(values.astype(np.float32), qtype), raw_dtype=qtype)
    elif qtype == GGMLQuantizationType.F32:
        writer.add_tensor(name, values.astype(np.float32))
    elif qtype == GGMLQuantizationType.F16:
        writer.add_tensor(name, values.astype(np.float16))
    else:
        data = gguf_quants.quantize(values.astype(np.float32), qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)


def _random_k_quant(qtype: GGMLQuantizationType, values: np.ndarray | _Spread,
                    rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (gguf has no K-quant quantizer) whose values have the std of
    `values`: random bytes, scale fields set to 1, then rescaled (values are linear in them)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    offsets = _K_QUANT_SCALE_OFFSETS[qtype.name]
    sample = blocks[::-(-len(blocks) // 4096)]  # every block up to 4,096 (a 1B model's: a few s)
    for scale in (1.0, None):
        if scale is None:
            std = float(gguf_quants.dequantize(sample, qtype).std())
            scale = float(values.std()) / max(std, 1e-12)
        for off in offsets:
            blocks[:, off:off + 2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
    return blocks.reshape(rows, cols // block_size * type_size)


def main(argv: list[str]) -> int:
    """`python -m workers.weights.synthetic SPEC`: materialize SPEC, print the file's path."""
    if len(argv) != 1:
        print("usage: python -m workers.weights.synthetic synthetic:layers=2,hidden=64,...", file=sys.stderr)
        return 2
    try:
        print(materialize(argv[0]))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
