#!/usr/bin/env python3
"""Time vLLM's own engine steps in this process, over controlled batches: run by the Python of a
venv that has vLLM (never the lab's), it prints one JSON line per step.

    /tmp/vllmvenv/bin/python -m tools.fleet.vllm_steps CHECKPOINT_DIR --out steps.jsonl

It imports nothing of the lab, only vLLM and the standard library, so that the venv needs
nothing else. vLLM's engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): each
call of its step function (schedule, execute the model, sample, update) is timed, and the
scheduler's plan for it read: the tokens it scheduled and the context those sequences reach
(`num_computed_tokens` after scheduling: what came before plus what this step computes). Batches
of 1 to 16 requests are added at once, a prompt length each, and stepped to the end, so the
steps sweep the prefills (batch x prompt tokens) and the decodes (one token per sequence at
contexts from the prompt to prompt + max_tokens). The plans run once untimed first (a shape's
first step pays for compiling it: 1 s for a 16-token prefill here), then `--repeat` times; the
caller keeps each step's fastest time (tools/fleet/sim_vs_vllm.py).

The settings are those of the served comparison (tools/server/vs_vllm.py): float32,
max_num_seqs 16, max_num_batched_tokens 512, prefix caching off, greedy, no EOS; OpenMP threads
as VLLM_CPU_OMP_THREADS_BIND says (set it before starting: 0-1 on a 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: its steps are ours

BATCHES = (1, 2, 4, 8, 16)
PROMPT_LENS = (16, 128)
MAX_TOKENS = 48


def plans(batches=BATCHES, prompt_lens=PROMPT_LENS, max_tokens=MAX_TOKENS):
    """(batch, prompt_len, max_tokens) of each controlled batch, in the order they run."""
    return [(b, p, max_tokens) for p in prompt_lens for b in batches]


def warm_up(engine, params, planned, deadline: float) -> None:
    """Each plan once, untimed, a few tokens out: a shape's first step pays for compiling it."""
    for batch, prompt_len, _ in planned:
        for i in range(batch):
            engine.add_request(f"warm-{batch}-{prompt_len}-{i}", {"prompt_token_ids": [i + 1] * prompt_len}, params)
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            engine.step()


def run(checkpoint: str, out, repeat: int, max_seconds: float, batches, prompt_lens, max_tokens) -> int:
    from vllm import LLM, SamplingParams  # the venv's vLLM, imported only here

    llm = LLM(model=checkpoint, dtype="float32", max_num_seqs=16, max_num_batched_tokens=512,
              enable_prefix_caching=False, seed=0)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # the in-process EngineCore
    scheduler = core.scheduler
    planned = []

    original_schedule = scheduler.schedule

    def schedule(*args, **kwargs):
        plan = original_schedule(*args, **kwargs)
        ids = list(plan.num_scheduled_tokens)
        context = sum(scheduler.requests[r].num_computed_tokens for r in ids)  # already advanced by the plan
        planned.append((plan.total_num_scheduled_tokens, context, len(ids)))
        return plan

    scheduler.schedule = schedule  # an instance attribute: the class is untouched
    original_step = core.step_fn
    samples = []

    def step():
        start = time.perf_counter()
        result = original_step()
        seconds = time.perf_counter() - start
        if planned and planned[-1][0] > 0:
            samples.append((*planned[-1], seconds))
        planned.clear()
        return result

    core.step_fn = step
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    deadline = time.monotonic() + max_seconds
    count = 0
    warm_up(engine, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
            plans(batches, prompt_lens, max_tokens), deadline)
    for round_ in range(repeat):
        for batch, prompt_len, _ in plans(batches, prompt_lens, max_tokens):
            for i in range(batch):
                prompt = [(97 * i + 31 * j + prompt_len) % 50000 + 1 for j in range(prompt_len)]
                engine.add_request(f"r{round_}-{batch}-{prompt_len}-{i}", {"prompt_token_ids": prompt}, params)
            samples.clear()
            while engine.has_unfinished_requests():
                if time.monotonic() > deadline:
                    print(f"vllm_steps: stopped after {max_seconds:.0f} s", file=sys.stderr)
                    return 1
                engine.step()
            for num_tokens, context, num_seqs, seconds in samples:
                out.write(json.dumps({"round": round_, "batch": batch, "prompt_len": prompt_len,
                                      "num_seqs": num_seqs, "tokens": num_tokens, "context": context,
                                      "seconds": seconds}) + "\n")
                count += 1
            out.flush()
    print(f"vllm_steps: {count} steps timed", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a GPT-2 checkpoint directory (save_gpt2's)")
    parser.add_argument("--out", help="JSON lines, one per step (default: standard output)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of every plan (keep each step's fastest)")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=list(BATCHES))
    parser.add_argument("--prompt-lens", type=lambda s: [int(x) for x in s.split(",")], default=list(PROMPT_LENS))
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--max-seconds", type=float, default=900.0, help="a bound on the whole run")
    args = parser.parse_args(argv)
    if args.out:
        with open(args.out, "w") as out:
            return run(args.checkpoint, out, args.repeat, args.max_seconds, args.batches, args.prompt_lens,
                       args.max_tokens)
    return run(args.checkpoint, sys.stdout, args.repeat, args.max_seconds, args.batches, args.prompt_lens,
               args.max_tokens)


if __name__ == "__main__":
    raise SystemExit(main())
