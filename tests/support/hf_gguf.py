"""Tiny random HF transformers models and a GGUF writer that lays them out as llama.cpp's
convert_hf_to_gguf.py does, so tests can compare our forward with transformers' on the same
weights, for every architecture we serve.

The writer's conventions (llama.cpp's): metadata keys per architecture; Q/K rows (and biases)
permuted into interleaved rotary pairs for `llama` only; Gemma norms stored as 1 + w; fused
MoE expert tensors split into gate / up / down; norms, biases and routers F32. A quantized
`qtype` rounds the HF model's own weights through that type first (in place), so both sides
compute with the values the file holds (checked bit for bit when writing). The quantizer per
type is a parameter (QUANTIZERS: gguf's, or packers for types gguf cannot quantize).
Verified against transformers' own GGUF reader (/work/notes: max |logit diff| 0).
"""
from __future__ import annotations

from typing import Any, Callable

import gguf
import numpy as np
import torch

ARCH_OF = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2",
           "qwen2_moe": "qwen2moe", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "gemma2": "gemma2",
           "gemma3_text": "gemma3", "phi3": "phi3"}
"""HF model_type -> GGUF general.architecture (Mistral and Mixtral are `llama` files)."""
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-6)

Quantizer = Callable[[np.ndarray], np.ndarray]
"""float32 [..., cols] -> the raw blocks of one GGUF type, uint8 [..., bytes]."""


def _quantizer(qtype: gguf.GGMLQuantizationType) -> Quantizer:
    return lambda array: gguf.quants.quantize(array, qtype)


QUANTIZERS: dict[str, Quantizer] = {
    name: _quantizer(gguf.GGMLQuantizationType[name]) for name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")}


def tiny_hf_model(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    """A random fp32 HF causal LM of `model_type` (COMMON shape unless overridden), weights
    drawn so every part matters: norms around 1, projections ~0.1, eager attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**COMMON, **overrides})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma computes x * (1 + w): keep 1 + w near 1
                base = 0.0 if model_type.startswith("gemma") else 1.0
                param.copy_(base + 0.3 * torch.randn_like(param))
            else:
                param.copy_(0.1 * torch.randn_like(param))
    return model.eval()


def is_quantized(name: str, tensor: torch.Tensor, qtype: str) -> bool:
    """Which tensors (by HF or GGUF name) the file stores as `qtype`: matrices (expert stacks
    too) whose rows are whole blocks; never norms, biases or routers (llama.cpp keeps those F32)."""
    if qtype == "F32" or tensor.dim() < 2:
        return False
    if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight",  # HF names, GGUF names
                      "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):
        return False
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    return tensor.shape[-1] % block == 0


def round_weights(model: Any, qtype: str) -> None:
    """Replace each parameter the file will quantize by its dequantized `qtype` value."""
    if qtype == "F32":
        return
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_quantized(name, param, qtype):
                raw = QUANTIZERS[qtype](param.detach().numpy())
                deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
                param.copy_(torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32)))


def permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: HF rotate-halves rows -> interleaved pairs."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: Any, path: str, qtype: str = "F32", sliding_window: int | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None,
               pooling_type: int | None = None) -> str:
    """Round `model` through `qtype` (in place) and write it to `path` in llama.cpp's layout.
    `sliding_window` writes `llama.attention.sliding_window` (Mistral; llama.cpp omits it);
    `extra_tensors` are written too (F32), as a variant the loader may not know would;
    `pooling_type` `{arch}.pooling_type` (an embedding model: 1 mean, 2 cls, 3 last)."""
    cfg = model.config
    arch = ARCH_OF[cfg.model_type]
    round_weights(model, qtype)
    writer = gguf.GGUFWriter(path, arch)
    _write_metadata(writer, cfg, arch, sliding_window)
    if pooling_type is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling_type))
    _write_tokenizer(writer, cfg.vocab_size)
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    for name, tensor in _gguf_tensors(model, arch, names):
        _add_tensor(writer, name, tensor, qtype if is_quantized(name, tensor, qtype) else "F32")
    if getattr(cfg, "rope_parameters", {}).get("rope_type") == "llama3":
        _add_tensor(writer, "rope_freqs.weight", _llama3_freq_factors(model), "F32")
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_metadata(w: gguf.GGUFWriter, cfg: Any, arch: str, sliding_window: int | None) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    if arch != "phi3":  # the phi3 converter writes no key/value length (head_dim = hidden / heads)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch != "gemma2":  # nor does the gemma2 one write a rope base (llama.cpp: 10000)
        w.add_rope_freq_base(rope["rope_theta"])
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(cfg.vocab_size)
        if sliding_window:
            w.add_sliding_window(sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
        if cfg.final_logit_softcapping:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings or cfg.max_position_embeddings)
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size)
                                   // cfg.num_attention_heads)
        w.add_sliding_window(0)
    _write_experts(w, cfg)


def _write_experts(w: gguf.GGUFWriter, cfg: Any) -> None:
    num_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if not num_experts:
        return
    w.add_expert_count(num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if hasattr(cfg, "moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if hasattr(cfg, "shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _write_tokenizer(w: gguf.GGUFWriter, vocab_size: int) -> None:
    """A placeholder SentencePiece vocabulary (the tests feed token ids)."""
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(vocab_size)])
    w.add_token_scores([0.0] * vocab_size)
    w.add_token_types([1] * vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def _gguf_tensors(model: Any, arch: str, names: Any) -> list[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor in GGUF layout) for every tensor of the model."""
    cfg, out = model.config, []
    for name, t in model.state_dict().items():
        t = t.detach().float()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            t = t + 1  # GemmaRMSNorm's x * (1 + w), pre-added as the converter does
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = permute(t, cfg.num_attention_heads)
        if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = permute(t, cfg.num_key_value_heads)
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        if name.endswith("mlp.experts.gate_up_proj"):  # [experts, 2 * ffn, hidden]: gate first
            ffn = t.shape[1] // 2
            out += [(f"blk.{layer}.ffn_gate_exps.weight", t[:, :ffn]), (f"blk.{layer}.ffn_up_exps.weight", t[:, ffn:])]
            continue
        if name.endswith("mlp.experts.down_proj"):
            out.append((f"blk.{layer}.ffn_down_exps.weight", t))
            continue
        if name.endswith("shared_expert_gate.weight"):
            t = t.reshape(-1)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"no GGUF name for {name}"
        out.append((gguf_name, t))
    return out


def _add_tensor(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, qtype: str) -> None:
    array = np.ascontiguousarray(tensor.numpy(), dtype=np.float32)
    if qtype == "F32":
        writer.add_tensor(name, array)
        return
    kind = gguf.GGMLQuantizationType[qtype]
    raw = QUANTIZERS[qtype](array)
    again = gguf.quants.dequantize(raw, kind).reshape(array.shape)
    assert np.array_equal(again, array), f"{name}: {qtype} does not hold the rounded weights exactly"
    writer.add_tensor(name, raw, raw_dtype=kind)


def _llama3_freq_factors(model: Any) -> torch.Tensor:
    """llama.cpp's `rope_freqs` for Llama-3 rope scaling: default inv_freq / scaled inv_freq."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    theta = cfg.rope_parameters["rope_theta"]
    default = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return default / model.model.rotary_emb.inv_freq.float()


def hf_logits(model: Any, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits of every position of one sequence: [T, vocab] fp32."""
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()


def hf_greedy(model: Any, token_ids: list[int], num_new: int) -> list[int]:
    """transformers' greedy continuation, each step a full forward (no cache to trust)."""
    ids = list(token_ids)
    for _ in range(num_new):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[len(token_ids):]
