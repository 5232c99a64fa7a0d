"""`justapi inspect [MODEL]`: what a GGUF model file holds: architecture and shapes, tensor
types, tokenizer, chat template, and the memory it needs at each compute dtype (weights
dequantized or kept quantized, KV cache per token and for full-context sequences). Works
without a server. MODEL is a .gguf path, `synthetic:SPEC`, or nothing for the embedded default.
Owns: this report. Does not own: GGUF parsing (justapi/model/gguf_file.py, the gguf package).
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter
from typing import Any

import click

from justapi.model.gguf_file import GGUFError, GGUFFile
from justapi.model.info import ModelInfo, resolve_model
from justapi.ops.admin_cli import human_bytes, table

PROG = "justapi inspect"
COMPUTE_DTYPES = (("fp32", 4), ("bf16", 2), ("fp16", 2))
TOKEN_TYPES = {1: "normal", 2: "unknown", 3: "control", 4: "user-defined", 5: "unused", 6: "byte"}


def describe(gguf: GGUFFile, context: int | None, num_seqs: int) -> dict[str, Any]:
    """Everything the report shows, as plain data (the --json output)."""
    info = ModelInfo.from_gguf(gguf)
    context = context or info.context_length
    tensors = gguf.reader.tensors
    return {
        "file": {"path": gguf.path, "bytes": os.path.getsize(gguf.path),
                 "gguf_version": _scalar(gguf.get("GGUF.version")), "num_tensors": len(tensors),
                 "num_metadata_keys": len(gguf.reader.fields)},
        "model": {"name": gguf.name, "architecture": info.architecture,
                  "file_type": _file_type(gguf.get("general.file_type")),
                  "num_parameters": int(sum(int(t.n_elements) for t in tensors))},
        "shapes": _shapes(gguf, info),
        "tensor_types": _tensor_types(tensors),
        "tokenizer": _tokenizer(gguf),
        "chat_template": gguf.get("tokenizer.chat_template") or "",
        "builtin_chat_template": _builtin_template_name(gguf),
        "memory": _memory(gguf, info, context, num_seqs),
        "tensors": [{"name": t.name, "type": _type_name(t.tensor_type),
                     "shape": [int(d) for d in reversed(t.shape)], "bytes": int(t.n_bytes)}
                    for t in tensors],
    }


def _shapes(gguf: GGUFFile, info: ModelInfo) -> dict[str, Any]:
    return {"num_layers": info.num_layers, "hidden_size": info.hidden_size,
            "num_heads": info.num_heads, "num_kv_heads": info.num_kv_heads,
            "head_dim": info.head_dim, "ffn_size": _scalar(gguf.arch_get("feed_forward_length")),
            "context_length": info.context_length, "vocab_size": info.vocab_size,
            "rope_freq_base": _scalar(gguf.arch_get("rope.freq_base")),
            "rms_norm_eps": _scalar(gguf.arch_get("attention.layer_norm_rms_epsilon"))}


def _tensor_types(tensors: list) -> list[dict[str, Any]]:
    by_type: dict[str, list] = {}
    for tensor in tensors:
        by_type.setdefault(_type_name(tensor.tensor_type), []).append(tensor)
    rows = [{"type": name, "num_tensors": len(group),
             "num_parameters": int(sum(int(t.n_elements) for t in group)),
             "bytes": int(sum(int(t.n_bytes) for t in group))} for name, group in by_type.items()]
    return sorted(rows, key=lambda r: -r["bytes"])


def _tokenizer(gguf: GGUFFile) -> dict[str, Any]:
    tokens = gguf.get("tokenizer.ggml.tokens") or []
    type_ids = gguf.get("tokenizer.ggml.token_type") or []
    types = Counter(TOKEN_TYPES.get(int(t), str(t)) for t in type_ids)
    special = {}
    for role in ("bos", "eos", "eot", "eom", "unknown", "padding"):
        token_id = gguf.get(f"tokenizer.ggml.{role}_token_id")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            special[role] = {"id": int(token_id), "text": str(tokens[int(token_id)])}
    return {"model": str(gguf.get("tokenizer.ggml.model", "")),
            "pre": str(gguf.get("tokenizer.ggml.pre", "")), "num_tokens": len(tokens),
            "num_merges": len(gguf.get("tokenizer.ggml.merges") or []),
            "token_types": dict(types), "special_tokens": special,
            "add_bos_token": gguf.get("tokenizer.ggml.add_bos_token")}


def _memory(gguf: GGUFFile, info: ModelInfo, context: int, num_seqs: int) -> dict[str, Any]:
    """Per compute dtype: weights dequantized to it, weights kept as stored (quantized tensors
    stay, only the float ones convert), KV bytes per token and for num_seqs x context."""
    tensors = gguf.reader.tensors
    quantized = sum(int(t.n_bytes) for t in tensors if _type_name(t.tensor_type) not in
                    ("F32", "F16", "BF16"))
    float_params = sum(int(t.n_elements) for t in tensors if _type_name(t.tensor_type) in
                       ("F32", "F16", "BF16"))
    num_params = sum(int(t.n_elements) for t in tensors)
    rows = []
    for dtype, size in COMPUTE_DTYPES:
        kv_token = info.kv_bytes_per_token(size)
        kv_total = kv_token * context * num_seqs
        weights = num_params * size
        rows.append({"dtype": dtype, "weights_bytes": weights,
                     "weights_quantized_bytes": quantized + float_params * size,
                     "kv_bytes_per_token": kv_token, "kv_bytes": kv_total,
                     "total_bytes": weights + kv_total,
                     "total_quantized_bytes": quantized + float_params * size + kv_total})
    return {"context": context, "num_seqs": num_seqs, "rows": rows}


def render(report: dict[str, Any], show_tensors: bool, show_template: bool) -> str:
    f, m, s, tok = report["file"], report["model"], report["shapes"], report["tokenizer"]
    lines = [f"file   {f['path']} ({human_bytes(f['bytes'])}, GGUF v{f['gguf_version']}, "
             f"{f['num_tensors']} tensors, {f['num_metadata_keys']} metadata keys)",
             f"model  {m['name']} ({m['architecture']}, {m['file_type']}, "
             f"{m['num_parameters'] / 1e6:.1f} M parameters)", "", "shapes",
             f"  layers {s['num_layers']}, hidden {s['hidden_size']}, heads {s['num_heads']} "
             f"(kv {s['num_kv_heads']}, head dim {s['head_dim']}), ffn {s['ffn_size']}, context "
             f"{s['context_length']}, vocab {s['vocab_size']}, rope base "
             f"{_num(s['rope_freq_base'])}, rms eps {_num(s['rms_norm_eps'])}", "", "tensor types"]
    lines.append(_indent(table(["type", "tensors", "parameters", "size"],
                               [[r["type"], r["num_tensors"], r["num_parameters"],
                                 human_bytes(r["bytes"])] for r in report["tensor_types"]])))
    special = ", ".join(f"{role} {v['id']} {v['text']!r}"
                        for role, v in tok["special_tokens"].items())
    lines += ["", "tokenizer",
              f"  {tok['model'] or '?'} (pre-tokenizer {tok['pre'] or '-'}), {tok['num_tokens']} "
              f"tokens, {tok['num_merges']} merges, add BOS {tok['add_bos_token']}",
              f"  special: {special or '-'}",
              "  token types: " + ", ".join(f"{k} {v}" for k, v in tok["token_types"].items())]
    lines += ["", "chat template", _template_text(report["chat_template"], show_template,
                                                   report["builtin_chat_template"])]
    mem = report["memory"]
    lines += ["", f"memory (KV cache for {mem['num_seqs']} sequence(s) of {mem['context']} tokens)",
              _indent(table(["compute dtype", "weights", "weights kept quantized", "KV per token",
                             "KV cache", "total", "total (quantized)"],
                            [[r["dtype"], human_bytes(r["weights_bytes"]),
                              human_bytes(r["weights_quantized_bytes"]),
                              human_bytes(r["kv_bytes_per_token"]), human_bytes(r["kv_bytes"]),
                              human_bytes(r["total_bytes"]),
                              human_bytes(r["total_quantized_bytes"])]
                             for r in mem["rows"]]))]
    if show_tensors:
        lines += ["", "tensors", _indent(table(
            ["name", "type", "shape", "size"],
            [[t["name"], t["type"], "x".join(map(str, t["shape"])), human_bytes(t["bytes"])]
             for t in report["tensors"]]))]
    return "\n".join(lines)


def _builtin_template_name(gguf: GGUFFile) -> str:
    """The built-in template the server uses when the file has none ('' when it has one)."""
    from justapi.frontend.text.builtin_templates import builtin_template

    if gguf.get("tokenizer.chat_template"):
        return ""
    return builtin_template(gguf.architecture,
                            frozenset(gguf.get("tokenizer.ggml.tokens") or ())).name


def _template_text(template: str, show_whole: bool, builtin: str) -> str:
    if not template:
        return f"  none (the server uses its built-in {builtin} template)"
    if show_whole:
        return template
    first = template.strip().splitlines()[0]
    return f"  {len(template)} characters (jinja); starts: {first[:70]!r} (--template prints it)"


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def _type_name(tensor_type: Any) -> str:
    return getattr(tensor_type, "name", str(tensor_type))


def _file_type(value: Any) -> str:
    if value is None:
        return "file type unknown"
    import gguf  # the package's enum names llama.cpp's file types (MOSTLY_Q4_1, ...)

    try:
        return gguf.LlamaFileType(int(value)).name
    except ValueError:
        return f"file type {value}"


def _num(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def _scalar(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


@click.command("inspect")
@click.argument("model", default="", metavar="[MODEL]")
@click.option("--context", type=click.IntRange(min=0), default=0, metavar="N",
              help="Tokens per sequence for the KV figures (default: the model's context).")
@click.option("--seqs", "num_seqs", type=click.IntRange(min=1), default=1, metavar="N",
              show_default=True, help="Full-context sequences for the KV figures.")
@click.option("--tensors", "show_tensors", is_flag=True, help="List every tensor.")
@click.option("--template", "show_template", is_flag=True, help="Print the whole chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def inspect(model: str, context: int, num_seqs: int, show_tensors: bool, show_template: bool,
            as_json: bool) -> None:
    """Show what a GGUF file holds and the memory it needs.

    MODEL is a .gguf file, synthetic:SPEC, or nothing for the embedded SmolLM2; no server is
    needed. Exit status 1 for a file that cannot be read as a model.
    """
    try:
        report = describe(GGUFFile(resolve_model(model)), context, num_seqs)
    except (GGUFError, ValueError, OSError) as exc:
        click.echo(f"{PROG}: error: {exc}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        click.echo(render(report, show_tensors, show_template))
