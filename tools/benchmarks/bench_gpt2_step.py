#!/usr/bin/env python3
"""A batch-1 decode step at GPT-2 124M's shape: the engine of solution.py at each git revision
named (or of this checkout) against PyTorch's GPT2LMHeadModel, in turns, in one process.

    OPENBLAS_NUM_THREADS=1 python -m tools.benchmarks.bench_gpt2_step 6521113 56cc7bd   # two revisions
    OPENBLAS_NUM_THREADS=1 python -m tools.benchmarks.bench_gpt2_step 6521113 56cc7bd --cpu-time
    OPENBLAS_NUM_THREADS=1 python -m tools.benchmarks.bench_gpt2_step 6521113 56cc7bd --model tiny --cpu-time
    OPENBLAS_NUM_THREADS=1 python -m tools.benchmarks.bench_gpt2_step --against HEAD~3  # it and this checkout
    OPENBLAS_NUM_THREADS=1 /tmp/venv/bin/python -m tools.benchmarks.bench_gpt2_step REV REV   # with torch

The model is random (the weights' values do not change the time), vocab 50257, 1024 positions,
768 wide, 12 layers of 12 heads (`--model tiny`: 16 wide, 1 layer, vocab 256, a step that is
nearly all the engine's Python). Each engine holds one request whose prompt of `context` tokens
has been prefilled; a timed step is one `engine.step()` (schedule, forward, sample, emit). PyTorch
(eager, one thread) runs the same weights one token at a time with its KV cache
(`past_key_values`), under `inference_mode`. Rounds alternate the contestants so that a noisy
minute of the machine moves all of them (`--cpu-time`: timed by this process's CPU seconds, which
time-slicing by other processes does not inflate); the median of each contestant's per-round
best is shown, and the last engine's time over the first's in each round (their range: what the
noise left).
torch is never a dependency of the lab: without it, only the engines are compared. Each
revision's solution.py is read from git (`git show REV:solution.py`): the chapter's engine
imports nothing beside it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
import warnings

import numpy as np

from tools.bench_common import solution_at

GPT2_124M = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
# `--model tiny`: a step that is nearly all Python (scheduling, checks, sampling, the output's
# bookkeeping), where a change to the engine's own code shows instead of drowning in BLAS.
SHAPES = {"gpt2-124m": GPT2_124M, "tiny": dict(vocab_size=256, n_positions=1024, n_embd=16, n_layer=1, n_head=2)}


def engine_step(lab, shape: dict, weights: dict, context: int, steps: int):
    """A function running one decode step of a fresh engine's single request, `steps` times at most."""
    model = lab.ToyTransformer(lab.ModelConfig(**shape), weights)
    engine = lab.LLMEngine(model, num_blocks=blocks(context + steps + 8), block_size=16, max_num_seqs=1)
    prompt = np.random.default_rng(0).integers(0, shape["vocab_size"], context).tolist()
    engine.add_request(prompt, lab.SamplingParams(max_tokens=steps + 4))
    engine.step()  # the prefill
    return engine.step


def blocks(tokens: int) -> int:
    return -(-tokens // 16)


def torch_step(shape: dict, weights: dict, context: int):
    import torch
    import transformers

    from tools.benchmarks.bench_vs_transformers import hf_gpt2

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers renaming past_key_values

    class Config:  # what hf_gpt2 reads of a lab model
        pass

    model = Config()
    model.config = type("C", (), dict(shape, layer_norm_epsilon=1e-5))()
    model.weights = weights
    hf = hf_gpt2(torch, transformers, model)
    ids = torch.tensor([np.random.default_rng(0).integers(0, shape["vocab_size"], context).tolist()])
    with torch.inference_mode():
        out = hf(input_ids=ids, use_cache=True)
    state = {"past": out.past_key_values, "token": out.logits[:, -1].argmax(-1, keepdim=True)}

    def step():
        with torch.inference_mode():
            out = hf(input_ids=state["token"], past_key_values=state["past"], use_cache=True)
        state["past"] = out.past_key_values
        state["token"] = out.logits[:, -1].argmax(-1, keepdim=True)

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revisions", nargs="*", metavar="REV",
                        help="time solution.py of each git revision (default: this checkout's)")
    parser.add_argument("--against", metavar="REV", help="also time solution.py of this git revision, first")
    parser.add_argument("--model", choices=SHAPES, default="gpt2-124m", help="the model's shape (random weights)")
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per contestant per round")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by this process's CPU seconds, not wall time (a shared machine; one thread)")
    args = parser.parse_args(argv)
    clock = time.process_time if args.cpu_time else time.perf_counter
    revisions = [args.against] * bool(args.against) + args.revisions
    modules = {rev: solution_at(rev, f"solution_at_{i}") for i, rev in enumerate(revisions)}
    if args.against or not args.revisions:
        modules["solution"] = importlib.import_module("solution")
    first = next(iter(modules.values()))
    shape = SHAPES[args.model]
    weights = first.init_gpt2_weights(first.ModelConfig(**shape), seed=0)
    total = args.rounds * args.steps + 2
    steps = {name: engine_step(lab, shape, weights, args.context, total) for name, lab in modules.items()}
    try:
        steps["pytorch"] = torch_step(shape, weights, args.context)
    except ImportError:
        print("(no torch here: the engines only)")
    best = _in_turns(steps, args.rounds, args.steps, clock)
    median = {name: statistics.median(times) for name, times in best.items()}
    print(f"batch-1 decode step, model {args.model}, context {args.context}, median of {args.rounds} rounds' best "
          f"of {args.steps} (ms, {clock.__name__}); "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}:")
    for name, t in median.items():
        vs = f"   {t / median['pytorch']:.2f}x PyTorch's" if "pytorch" in median and name != "pytorch" else ""
        print(f"  {name:<12}{t * 1e3:9.3f}{vs}")
    names = list(modules)
    if len(names) > 1:
        a = names[0]
        b = names[-1]
        ratios = [after / before for before, after in zip(best[a], best[b])]
        print(f"  {b} / {a}: {median[b] / median[a]:.3f} (medians); per round {min(ratios):.3f}-{max(ratios):.3f}")
    return 0


def _in_turns(steps: dict, rounds: int, per_round: int, clock=time.perf_counter) -> dict[str, list[float]]:
    """Each contestant's best of `per_round` steps by `clock`, per round, the contestants in turns,
    in the opposite order every other round (the second place ran 0.5-1% slower than the first,
    the same engine in both)."""
    best: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(rounds):
        for name, step in list(steps.items())[::-1 if i % 2 else 1]:
            times = []
            for _ in range(per_round):
                start = clock()
                step()
                times.append(clock() - start)
            best[name].append(min(times))
    return best


if __name__ == "__main__":
    sys.exit(main())
