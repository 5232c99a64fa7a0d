"""Each family's end-of-generation ids, derived as llama.cpp does: EOS, the file's EOT/EOM ids,
and every token spelled as a known end-of-turn marker, so a chat stops where the model ends it."""
from __future__ import annotations

import pytest

from justapi.frontend.text.tokenizer import TOKEN_CONTROL, Tokenizer, read_special_tokens
from justapi.model.gguf_file import GGUFFile
from tests.support.gguf_tokenizers import OverriddenGGUF, train_sentencepiece, write_spm_gguf

FIRST_ID = 3  # ids 0-2 are <unk>, <s>, </s> in the synthetic vocabulary
# family: (special tokens placed at ids 3.., eos, eot, expected end-of-generation tokens)
FAMILIES = {
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"],
               "<|end_of_text|>", None, {"<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"}),
    "llama3-instruct-eos": (["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
                            "<|eot_id|>", None, {"<|end_of_text|>", "<|eot_id|>"}),
    "qwen2.5-instruct": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>"],
                         "<|im_end|>", None, {"<|endoftext|>", "<|im_end|>"}),
    "qwen2.5-base": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                     "<|endoftext|>", None, {"<|endoftext|>", "<|im_end|>"}),
    "gemma": (["<start_of_turn>", "<end_of_turn>"], "</s>", None, {"</s>", "<end_of_turn>"}),
    "phi3": (["<|endoftext|>", "<|assistant|>", "<|user|>", "<|end|>"],
             "<|endoftext|>", None, {"<|endoftext|>", "<|end|>"}),
    "mistral": (["[INST]", "[/INST]", "[TOOL_CALLS]"], "</s>", None, {"</s>"}),
    "eot-by-id": (["<|turn_end|>"], "</s>", "<|turn_end|>", {"</s>", "<|turn_end|>"}),
}


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory) -> GGUFFile:
    spm = pytest.importorskip("sentencepiece")
    processor = spm.SentencePieceProcessor(model_proto=train_sentencepiece())
    return GGUFFile(str(write_spm_gguf(tmp_path_factory.mktemp("stop") / "t.gguf", processor)))


def _family_gguf(spm_gguf: GGUFFile, specials: list[str], eos: str,
                 eot: str | None) -> GGUFFile:
    tokens = list(spm_gguf.get("tokenizer.ggml.tokens"))
    types = list(spm_gguf.get("tokenizer.ggml.token_type"))
    for offset, special in enumerate(specials):
        tokens[FIRST_ID + offset], types[FIRST_ID + offset] = special, TOKEN_CONTROL
    return OverriddenGGUF(spm_gguf, {
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.eos_token_id": tokens.index(eos),
        "tokenizer.ggml.eot_token_id": tokens.index(eot) if eot else None})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_end_of_generation_ids_per_family(family: str, spm_gguf: GGUFFile) -> None:
    specials, eos, eot, expected = FAMILIES[family]
    family_gguf = _family_gguf(spm_gguf, specials, eos, eot)
    tokenizer = Tokenizer.from_gguf(family_gguf)
    assert {tokenizer.id_to_token(i) for i in tokenizer.eog_token_ids} == expected
    # what the scheduler reads, without building a tokenizer
    assert read_special_tokens(family_gguf) == tokenizer.special
    assert tokenizer.id_to_token(tokenizer.eos_token_id) == eos
    turn_end = sorted(expected - {eos})
    if turn_end:  # the end-of-turn marker in text becomes its one id, which ends generation
        ids = tokenizer.encode(f"hi{turn_end[0]}", add_special_tokens=False)
        assert ids[-1] in tokenizer.eog_token_ids
