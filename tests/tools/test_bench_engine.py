"""`python -m tools.bench engine`: `--weights` reaches the engine it measures and the header
line names it (the in-process engine's default, fp32, is not the server's)."""
from __future__ import annotations

from typing import Any

import pytest

from tools.bench import engine as bench_engine
from tools.harness import TINY_MODEL


@pytest.mark.parametrize("flags,weights", [([], "fp32"), (["--weights", "auto"], "auto")])
def test_the_weights_mode_is_the_engines_and_is_printed(flags: list[str], weights: str,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    built: list[str] = []
    real = bench_engine.LLMEngine

    def recording(*args: Any, **kwargs: Any) -> Any:
        built.append(kwargs["weights"])
        return real(*args, **kwargs)
    monkeypatch.setattr(bench_engine, "LLMEngine", recording)
    bench_engine.main(["--model", TINY_MODEL, "--batches", "1", "--decode-steps", "2", "--prompt-tokens", "8",
                       "--prefill-tokens", "16", *flags])
    assert built == [weights]
    assert f", weights {weights}: load" in capsys.readouterr().out.splitlines()[0]
