"""Prints start-up and per-request costs of the text path: GGUF parse, Tokenizer.from_gguf,
encode/decode throughput, chat-template rendering, incremental detokenization, stop strings.

    python -m tools.bench tokenizer [--model FILE.gguf] [--repeat 5]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from justapi.frontend.text.chat_template import ChatTemplate
from justapi.frontend.text.detokenizer import IncrementalDetokenizer, StopStringMatcher
from justapi.frontend.text.tokenizer import Tokenizer
from justapi.model.gguf_file import GGUFFile, resolve_model_path

SAMPLE = ("The quick brown fox jumps over the lazy dog. 東京は日本の首都です。 "
          "def f(x):\n    return x ** 2  # 12345\n😀 naïve café, don't stop. ") * 200


def best_of(repeat: int, function: Callable[[], object]) -> float:
    """Seconds of the fastest of `repeat` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench tokenizer",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="GGUF file (default: embedded SmolLM2)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    path = resolve_model_path(args.model)

    parse_s = best_of(1, lambda: GGUFFile(path))
    gguf_file = GGUFFile(path)
    build_s = best_of(args.repeat, lambda: Tokenizer.from_gguf(gguf_file))
    tokenizer = Tokenizer.from_gguf(gguf_file)
    print(f"model: {path}")
    print(f"GGUF parse:            {parse_s * 1e3:8.1f} ms")
    print(f"Tokenizer.from_gguf:   {build_s * 1e3:8.1f} ms  (vocab {tokenizer.vocab_size})")

    ids = tokenizer.encode(SAMPLE)
    encode_s = best_of(args.repeat, lambda: tokenizer.encode(SAMPLE))
    decode_s = best_of(args.repeat, lambda: tokenizer.decode(ids))
    print(f"encode:                {len(SAMPLE) / encode_s / 1e6:8.2f} M chars/s "
          f"({len(ids) / encode_s / 1e3:.0f} k tokens/s)")
    print(f"decode:                {len(ids) / decode_s / 1e3:8.0f} k tokens/s")

    template = ChatTemplate.from_gguf(gguf_file, tokenizer.template_tokens)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Why?"}]
    render_s = statistics.median(best_of(1, lambda: template.render(messages)) for _ in range(200))
    print(f"chat template render:  {render_s * 1e6:8.1f} us  (4 messages, median)")

    def stream() -> None:
        detokenizer = IncrementalDetokenizer(tokenizer)
        matcher = StopStringMatcher(["\nUser:", "</answer>"])
        for token_id in ids:
            matcher.feed(detokenizer.add([token_id]))
        matcher.feed(detokenizer.flush())

    stream_s = best_of(args.repeat, stream)
    print(f"detokenize + stop:     {stream_s / len(ids) * 1e6:8.2f} us/token "
          f"(one token at a time, {len(ids)} tokens)")


if __name__ == "__main__":
    main()
