"""`python -m tools.bench step-parts`: every part of a SmolLM2 decode step is timed where it
runs (the calls per step are the model's: 4 matmuls, one attention, one KV write, two norms,
one rotary and one activation per layer), and the parts add up to the step."""
from __future__ import annotations

import torch

from justapi.model.gguf_file import default_model_path
from tools.bench.step_parts import PARTS, Timers, instrument, measure
from workers.engine import LLMEngine


def test_the_parts_are_the_models_and_add_up_to_the_step() -> None:
    engine = LLMEngine(default_model_path(), num_blocks=32, max_seqs=2, progress=False, weights="fp32")
    try:
        timers = Timers()
        instrument(engine, timers)
        with torch.inference_mode():
            medians, calls = measure(engine, timers, batch=2, steps=5, prompt_tokens=20)
    finally:
        engine.close()
    layers = 30
    assert calls == {"matmuls (layers)": 4 * layers, "head (norm + matmul)": 1, "attention": layers,
                     "KV write": layers, "norms": 2 * layers, "rotary": layers, "activation": layers}
    assert all(medians[part] >= 0 for part in PARTS[:7]) and medians["matmuls (layers)"] > 0
    assert medians["runner and sampler"] > 0 and medians["rest of the forward"] > 0
    assert abs(sum(medians[part] for part in PARTS) - medians["step"]) < 0.25 * medians["step"]
