"""Draft-model GGUFs made from a target GGUF, for speculative decoding without downloads.

- `write_truncated_draft(src, dst, num_layers)`: the target's first num_layers layers, its
  embedding, final norm and head (layer-skip self-speculation: a cheaper model that agrees
  with the target often, sharing its tokenizer by construction).
- `write_random_draft(src, dst, ...)`: random weights of a tiny shape with the target's
  tokenizer and vocabulary (a draft that is almost never right: the worst case).

    python -m workers.spec.draft_gguf TARGET.gguf DRAFT.gguf --layers 8
Owns: those two file recipes. Does not own: loading (gguf_loader.py) or serving.
"""
from __future__ import annotations

import argparse
import re
import sys
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

_LAYER = re.compile(r"^blk\.(\d+)\.")
_SKIP_FIELD = ("general.architecture", "GGUF.")


def _field(reader: GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        raise ValueError(f"the GGUF has no {key!r} field")
    return field.contents()


def _arch(reader: GGUFReader) -> str:
    return str(_field(reader, "general.architecture"))


def _copy_fields(reader: GGUFReader, writer: GGUFWriter, replace: dict[str, int],
                 keep: tuple[str, ...] | None = None) -> None:
    """Every metadata field (or those starting with a `keep` prefix), with `replace` values."""
    for field in reader.fields.values():
        name = field.name
        if name.startswith(_SKIP_FIELD) or name in replace:
            continue
        if keep is not None and not name.startswith(keep):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    for name, value in replace.items():
        writer.add_key_value(name, value, GGUFValueType.UINT32)


def write_truncated_draft(src: str, dst: str, num_layers: int) -> None:
    reader = GGUFReader(src)
    arch = _arch(reader)
    total = int(_field(reader, f"{arch}.block_count"))
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in [1, {total}], got {num_layers}")
    writer = GGUFWriter(dst, arch)
    _copy_fields(reader, writer, {f"{arch}.block_count": num_layers})
    kept = [t for t in reader.tensors
            if not (m := _LAYER.match(t.name)) or int(m.group(1)) < num_layers]
    for tensor in kept:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype,
                               tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in kept:
        writer.write_tensor_data(tensor.data)
    writer.close()


def write_random_draft(src: str, dst: str, layers: int = 1, hidden: int = 64, heads: int = 4,
                       kv_heads: int = 2, ffn: int = 128, seed: int = 0) -> None:
    reader = GGUFReader(src)
    arch = _arch(reader)
    vocab = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1])
    context = int(_field(reader, f"{arch}.context_length"))
    writer = GGUFWriter(dst, arch)
    _copy_fields(reader, writer, {}, keep=("tokenizer.", "general.name"))
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.attn_q.weight": (hidden, hidden),
                       f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_output.weight": (hidden, hidden),
                       f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, ffn)})
    for name, shape in shapes.items():
        values = (np.ones(shape) if name.endswith("norm.weight")
                  else rng.normal(0.0, 1.0 / np.sqrt(shape[-1]), shape))
        writer.add_tensor(name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Write a draft GGUF from a target GGUF.")
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--layers", type=int, default=8, help="layers kept (truncated draft)")
    parser.add_argument("--random", action="store_true", help="random tiny weights instead")
    args = parser.parse_args(argv)
    if args.random:
        write_random_draft(args.target, args.draft, layers=args.layers)
    else:
        write_truncated_draft(args.target, args.draft, args.layers)
    print(args.draft)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
