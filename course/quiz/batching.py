"""Quiz 5: continuous batching (Exercise 5), every answer computed by the module under quiz."""

from __future__ import annotations

import dataclasses
from types import ModuleType

import numpy as np

from .questions import Question, QuizError, ceil_div, question

MAX_STEPS = 1000


@dataclasses.dataclass
class StepRun:
    num_steps: int
    first_token_step: dict[str, int]  # request id -> the step (1-based) that sampled its first token


def run_steps(lab: ModuleType, requests: list[tuple[int, int]], scheduling: str, max_num_seqs: int,
              max_num_batched_tokens: int = 512) -> StepRun:
    """Drive the module's scheduler, with no model, over requests (prompt_len, output_len) that all
    arrive at step 0 (as loadtest/simulator.py does, without a clock), at most MAX_STEPS steps."""
    pool = lab.BlockAllocator(64, 16)
    scheduler = lab.make_scheduler(scheduling, pool, max_num_seqs, max_num_batched_tokens, True)
    for i, (prompt_len, output_len) in enumerate(requests):
        scheduler.add_request(lab.Request(str(i), [0] * prompt_len, lab.SamplingParams(max_tokens=output_len)))
    first: dict[str, int] = {}
    for step in range(1, MAX_STEPS + 1):
        if not scheduler.has_unfinished():
            return StepRun(step - 1, first)
        plan = scheduler.plan_step()
        sampled = {seq.request_id: 0 for seq in plan.scheduled if plan.completes(seq)}
        scheduler.update(plan, sampled)
        for request_id in sampled:
            first.setdefault(request_id, step)
    raise QuizError(f"the {scheduling} scheduler had not finished {len(requests)} short requests after "
                    f"{MAX_STEPS} steps")


def quiz_batching(lab: ModuleType, rng: np.random.Generator) -> list[Question]:
    P = int(rng.integers(2, 9))
    a, b, c = int(rng.integers(12, 41)), int(rng.integers(3, 10)), int(rng.integers(3, 13))  # a > b
    runs = {s: run_steps(lab, [(P, a), (P, b), (P, c)], s, max_num_seqs=2) for s in ("continuous", "static")}
    setting = (f"2 seats (max_num_seqs 2). Three requests arrive together, each with a {P}-token prompt; they "
               f"want {a}, {b} and {c} output tokens. A request's first step prefills its prompt and yields its "
               f"first token, then it gets one token per step.")
    q1 = question(
        f"{setting} Static batching (a batch runs until ALL its requests finish): how many steps until all "
        f"three are done?", runs["static"].num_steps, max(a, b) + c,
        f"Requests 1 and 2 form the first batch, which lasts max({a}, {b}) = {max(a, b)} steps: request 2's seat "
        f"idles for {max(a, b) - min(a, b)} steps while request 3 waits (head-of-line blocking). Then request 3 "
        f"alone: {c} steps. "
        f"{max(a, b)} + {c} = {max(a, b) + c}.")
    q2 = question(
        "The same three requests with continuous batching: how many steps?", runs["continuous"].num_steps,
        max(a, b + c),
        f"Request 2 finishes at step {b} and frees its seat in that very step; request 3 takes it at step "
        f"{b + 1} and finishes at step {b + c}, while request 1 runs to step {a}: max({a}, {b} + {c}) = "
        f"{max(a, b + c)}. Same tokens in fewer steps: a decode step reads all the weights whatever the batch, "
        f"so seats kept full are throughput.")
    static_ttft = runs["static"].first_token_step.get("2", 0)
    q3 = question(
        "Under static batching, what is request 3's TTFT in steps (from its arrival, step 0, to the step that "
        "yields its first token)?", static_ttft, max(a, b) + 1,
        f"It waits for the whole first batch ({max(a, b)} steps), then its prefill step yields its first token: "
        f"{max(a, b) + 1}. With continuous batching it is {runs['continuous'].first_token_step.get('2', '?')} "
        f"(its prefill runs at step {b + 1}): continuous batching moves TTFT most; the decode steps (TPOT) are "
        f"what the batch size and speculative decoding move.")
    T = int(rng.choice([16, 32, 64]))
    n = int(rng.integers(2 * T + 1, 5 * T))
    lone = run_steps(lab, [(n, 2)], "continuous", max_num_seqs=2, max_num_batched_tokens=T)
    q4 = question(
        f"A lone request with a {n}-token prompt; the token budget is {T} tokens per step "
        f"(max_num_batched_tokens), chunked prefill on. In which step does its first token come out (its TTFT "
        f"in steps)?", lone.first_token_step.get("0", 0), ceil_div(n, T),
        f"Each step gives it min(tokens still missing K/V, budget left) = at most {T}: ceil({n} / {T}) = "
        f"{ceil_div(n, T)} chunks, and only the chunk that reaches the prompt's last token samples. Chunking "
        f"bounds how long one long prompt holds up everyone else's decode steps.")
    return [q1, q2, q3, q4]
