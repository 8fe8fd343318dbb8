#!/usr/bin/env python3
"""A batch-1 decode step at GPT-2 124M's shape: the engine of solution.py (and, with --against, of
another revision's solution.py) against PyTorch's GPT2LMHeadModel, in turns, in one process.

    OPENBLAS_NUM_THREADS=1 python tools/benchmarks/bench_gpt2_step.py --against HEAD~3
    OPENBLAS_NUM_THREADS=1 /tmp/venv/bin/python tools/benchmarks/bench_gpt2_step.py --against HEAD~3   # with torch

The model is random (the weights' values do not change the time), vocab 50257, 1024 positions,
768 wide, 12 layers of 12 heads. Each engine holds one request whose prompt of `context` tokens
has been prefilled; a timed step is one `engine.step()` (schedule, forward, sample, emit). PyTorch
(eager, one thread) runs the same weights one token at a time with its KV cache
(`past_key_values`), under `inference_mode`. Rounds alternate the contestants so that a noisy
minute of the machine moves all of them; the median of each contestant's per-round best is shown.
torch is never a dependency of the lab: without it, only the engines are compared.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
from bench_common import solution_at  # noqa: E402

GPT2_124M = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)


def engine_step(lab, weights: dict, context: int, steps: int):
    """A function running one decode step of a fresh engine's single request, `steps` times at most."""
    model = lab.ToyTransformer(lab.ModelConfig(**GPT2_124M), weights)
    engine = lab.LLMEngine(model, num_blocks=blocks(context + steps + 8), block_size=16, max_num_seqs=1)
    prompt = np.random.default_rng(0).integers(0, GPT2_124M["vocab_size"], context).tolist()
    engine.add_request(prompt, lab.SamplingParams(max_tokens=steps + 4))
    engine.step()  # the prefill
    return engine.step


def blocks(tokens: int) -> int:
    return -(-tokens // 16)


def torch_step(weights: dict, context: int):
    import torch
    import transformers
    from bench_vs_transformers import _hf_gpt2

    torch.set_num_threads(1)

    class Config:  # what _hf_gpt2 reads of a lab model
        pass

    model = Config()
    model.config = type("C", (), dict(GPT2_124M, layer_norm_epsilon=1e-5))()
    model.weights = weights
    hf = _hf_gpt2(torch, transformers, model)
    ids = torch.tensor([np.random.default_rng(0).integers(0, GPT2_124M["vocab_size"], context).tolist()])
    with torch.inference_mode():
        out = hf(input_ids=ids, use_cache=True)
    state = {"past": out.past_key_values, "token": out.logits[:, -1].argmax(-1, keepdim=True)}

    def step():
        with torch.inference_mode():
            out = hf(input_ids=state["token"], past_key_values=state["past"], use_cache=True)
        state["past"], state["token"] = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REV", help="also time solution.py of this git revision")
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per contestant per round")
    args = parser.parse_args(argv)
    modules = {"solution": importlib.import_module("solution")}
    if args.against:
        modules = {args.against: solution_at(args.against), **modules}
    weights = modules["solution"].init_gpt2_weights(modules["solution"].ModelConfig(**GPT2_124M), seed=0)
    total = args.rounds * args.steps + 2
    steps = {name: engine_step(lab, weights, args.context, total) for name, lab in modules.items()}
    try:
        steps["pytorch"] = torch_step(weights, args.context)
    except ImportError:
        print("(no torch here: the engines only)")
    best: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            best[name].append(min(times))
    median = {name: statistics.median(times) for name, times in best.items()}
    print(f"batch-1 decode step at GPT-2 124M's shape, context {args.context}, median of {args.rounds} rounds' best "
          f"of {args.steps} (ms):")
    for name, t in median.items():
        vs = f"   {t / median['pytorch']:.2f}x PyTorch's" if "pytorch" in median and name != "pytorch" else ""
        print(f"  {name:<12}{t * 1e3:8.1f}{vs}")
    if args.against:
        print(f"  solution / {args.against}: {median['solution'] / median[args.against]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
