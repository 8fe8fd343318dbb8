#!/usr/bin/env python3
"""What a real GPT-2 checkpoint costs on this machine: load time and decode tokens per second
through the engine, and speculative decoding on a synthetic target/draft pair of checkpoints.

    python -m tools.benchmarks.bench_checkpoint                    # decode at batch 1 and 8, then speculate
    python -m tools.benchmarks.bench_checkpoint decode --batch 1,4,16
    python -m tools.benchmarks.bench_checkpoint speculate --target-layers 4 --draft-layers 1
    python -m tools.benchmarks.bench_checkpoint --module lab       # YOUR lab.py instead of solution.py

The weights are random, GPT-2 124M's shape (n_embd 768, 12 layers, 12 heads, vocab 50257,
n_positions 1024), written as a Hugging Face directory with `save_gpt2` and read back with
`load_gpt2`, so the numbers are those of a real gpt2 download: speed depends on the shape, not
on the values. The loaded model's logits are checked against the in-memory one before timing.
"""

from __future__ import annotations

import argparse
import importlib
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from checkpoints.commands import DEFAULT_PROMPT, speculate_checkpoints
from checkpoints.model_loader import load_gpt2, save_gpt2
from tools.bench_common import DEFAULT_MODULE

GPT2_124M = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)


def _positive_ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints separated by commas, got {text!r}")
    return values


def bench_decode(lab, workdir: Path, batch_sizes: list[int], prompt_len: int = 32, max_tokens: int = 64) -> str:
    """Decode tokens/s of a GPT-2 124M-shaped checkpoint through `lab.LLMEngine`, greedy, at
    each batch size: every sequence gets a `prompt_len`-token prompt and makes `max_tokens`."""
    config = lab.ModelConfig(**GPT2_124M)
    start = time.perf_counter()
    weights = lab.init_gpt2_weights(config, seed=0)
    save_gpt2(workdir / "gpt2-124m-random", config, weights)
    written = time.perf_counter() - start
    start = time.perf_counter()
    model, tokenizer = load_gpt2(lab, workdir / "gpt2-124m-random")
    loaded = time.perf_counter() - start
    probe = tokenizer.encode(DEFAULT_PROMPT)[:prompt_len]
    if not np.array_equal(model.forward_dense(probe), lab.ToyTransformer(config, weights).forward_dense(probe)):
        raise SystemExit("the loaded checkpoint's logits differ from the weights written: not timing it")
    del weights
    lines = [f"GPT-2 124M shape ({sum(w.size for w in model.weights.values()) / 1e6:.1f}M parameters, float32, "
             f"random weights): written in {written:.1f} s (init + save_gpt2), load_gpt2 {loaded:.2f} s "
             f"(memory-mapped); logits checked against the weights written",
             f"decode through LLMEngine, greedy, {len(probe)}-token prompts, {max_tokens} output tokens each:",
             f"{'batch':>7} {'TPOT ms':>9} {'tokens/s/seq':>13} {'tokens/s total':>15} {'wall s':>8}"]
    for batch in batch_sizes:
        blocks = batch * lab.blocks_needed(len(probe) + max_tokens, 16)
        engine = lab.LLMEngine(model, num_blocks=blocks, max_num_seqs=batch)
        sampling = lab.SamplingParams(temperature=0.0, max_tokens=max_tokens)
        engine.generate([probe], lab.SamplingParams(max_tokens=2))  # warm-up
        start = time.perf_counter()
        outputs = engine.generate([probe] * batch, sampling)
        wall = time.perf_counter() - start
        tpot = float(np.mean([o.metrics.tpot for o in outputs]))
        lines.append(f"{batch:>7} {1e3 * tpot:>9.1f} {1 / tpot:>13.1f} {batch / tpot:>15.1f} {wall:>8.1f}")
    lines.append("(TPOT = the time between one output token and the next, vLLM's definition; total = batch / TPOT)")
    lines.append(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end (other processes share "
                 f"the cores), OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}")
    return "\n".join(lines)


def bench_speculate(lab, workdir: Path, target_layers: int, draft_layers: int, refinement_scale: float = 0.2,
                    k: int = 4, max_tokens: int = 64, temperature: float = 0.0) -> str:
    """Speculation on two checkpoints: a GPT-2 124M-wide target of `target_layers` layers whose
    layers from `draft_layers` on are scaled-down refinements (as `make_early_exit_target` in
    solution.py), and the draft = its first `draft_layers` layers, each saved as a directory."""
    config = lab.ModelConfig(**(GPT2_124M | {"n_layer": target_layers}))
    weights = lab.init_gpt2_weights(config, seed=0)
    for i in range(draft_layers, target_layers):
        for name in (f"h.{i}.attn.c_proj.weight", f"h.{i}.mlp.c_proj.weight"):
            weights[name] *= np.float32(refinement_scale)
    draft_config = lab.ModelConfig(**(GPT2_124M | {"n_layer": draft_layers}))
    later = tuple(f"h.{i}." for i in range(draft_layers, target_layers))
    save_gpt2(workdir / "target", config, weights)
    save_gpt2(workdir / "draft", draft_config, {n: w for n, w in weights.items() if not n.startswith(later)})
    del weights
    header = (f"Synthetic pair, GPT-2 124M width: target {target_layers} layers (layers {draft_layers}.. x "
              f"{refinement_scale:g}), draft = its first {draft_layers}")
    return header + "\n" + speculate_checkpoints(lab, workdir / "target", workdir / "draft", k=k,
                                                 max_tokens=max_tokens, temperature=temperature)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", nargs="?", choices=["all", "decode", "speculate"], default="all")
    parser.add_argument("--module", default=DEFAULT_MODULE,
                        help="the module to measure (default: solution, or lab in the student's copy)")
    parser.add_argument("--batch", type=_positive_ints, default=[1, 8], help="batch sizes for decode, e.g. 1,8")
    parser.add_argument("--target-layers", type=int, default=4)
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)
    lab = importlib.import_module(args.module)
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as tmp:
        if args.which in ("all", "decode"):
            print(bench_decode(lab, Path(tmp) / "decode", args.batch), flush=True)
        if args.which in ("all", "speculate"):
            print(bench_speculate(lab, Path(tmp) / "speculate", args.target_layers, args.draft_layers,
                                  temperature=args.temperature), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
