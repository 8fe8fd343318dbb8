"""Quiz 8: capacity planning (Exercise 8), every answer computed by the module under quiz."""

from __future__ import annotations

import math
import os
from types import ModuleType

import numpy as np

from loadtest.costmodel import has_profile, measured_step_cost, roofline_step_cost

from .batching import run_steps
from .questions import Question, QuizError, ceil_div, fmt, question


def quiz_capacity(lab: ModuleType, rng: np.random.Generator) -> list[Question]:
    combos = [(m, g, length, block) for m in lab.MODELS for g in lab.GPUS
              for length in (2048, 4096, 8192) for block in (16, 32)]
    plan = None
    refusals = []
    for i in rng.permutation(len(combos)):
        name, gpu_name, max_model_len, block_size = combos[i]
        try:
            plan = lab.plan_deployment(name, gpu_name, max_model_len, block_size)
            break
        except ValueError as exc:  # does not fit: try another (NotImplementedError goes up: a stub)
            refusals.append(str(exc))
    if plan is None:
        raise QuizError(f"plan_deployment refused every preset combination, e.g.: {refusals[0]}")
    model, gpu = plan.model, plan.gpu
    element = model.kv_dtype_bytes or model.dtype_bytes
    kv = 2 * model.num_layers * model.num_kv_heads * model.head_dim * element
    q1 = question(
        f"{model.name}: {model.num_layers} layers, {model.num_kv_heads} KV heads of dimension {model.head_dim}, "
        f"{element}-byte elements. How many bytes of KV cache does one token take?", lab.kv_bytes_per_token(model),
        kv, f"A key AND a value vector (the 2) per KV head per layer: 2 x {model.num_layers} x "
            f"{model.num_kv_heads} x {model.head_dim} x {element} = {kv:,} bytes. Grouped-query attention "
            f"shrinks it through the KV heads; an 8-bit KV cache through the element size.")
    budget = plan.gpu_memory_utilization * gpu.memory_bytes
    free = budget - model.weight_bytes
    blocks = math.floor(free / (block_size * kv))
    q2 = question(
        f"It runs on one {gpu.name} with {gpu.memory_bytes:,} bytes, gpu_memory_utilization "
        f"{plan.gpu_memory_utilization:g}: a budget of {budget:,.0f} bytes, of which the weights take "
        f"{model.weight_bytes:,}. With blocks of {block_size} tokens, how many KV blocks fit?",
        plan.num_kv_blocks, blocks,
        f"floor(({budget:,.0f} - {model.weight_bytes:,}) / ({block_size} x {kv:,})) = {blocks:,} blocks, "
        f"{blocks * block_size:,} tokens of cache.")
    per_seq = ceil_div(max_model_len, block_size)
    q3 = question(
        f"{plan.num_kv_blocks:,} blocks of {block_size} tokens, and every sequence may grow to max_model_len = "
        f"{max_model_len} tokens. How many sequences are guaranteed to fit at once?", plan.max_concurrent_seqs,
        plan.num_kv_blocks // per_seq,
        f"A sequence owns whole blocks: blocks_needed({max_model_len}, {block_size}) = {per_seq} each, so "
        f"{plan.num_kv_blocks:,} // {per_seq} = {plan.num_kv_blocks // per_seq}. Paging admits far more when "
        f"requests are shorter than max_model_len; this is the guarantee.")
    seats, step, prefill = plan.max_concurrent_seqs, plan.decode_step_s, plan.prefill_s
    held = plan.mean_output_len * step + seats * prefill
    q4 = question(
        f"With {seats} seats, a request holds its seat for its {plan.mean_output_len:g} output tokens at "
        f"{step * 1e3:.3f} ms per decode step ({plan.decode_bound}-bound), plus {seats} prefills of "
        f"{prefill * 1e3:.3f} ms (one per seat turning over meanwhile). How many requests per second does "
        f"Little's law give?", plan.qps, seats / held,
        f"W = {plan.mean_output_len:g} x {step * 1e3:.3f} ms + {seats} x {prefill * 1e3:.3f} ms = "
        f"{held * 1e3:.1f} ms; QPS = L / W = {seats} / {held:.4f} s = {fmt(seats / held)}. TPOT is the decode "
        f"step; TTFT waits for a prefill.", tolerance=0.02, relative=True)
    return [q1, q2, q3, q4, _quiz_tp_cost(lab, plan), _quiz_tp8_vs_tp2(lab, plan), _quiz_token_budget(lab, rng, plan)]


def _quiz_tp_cost(lab: ModuleType, plan) -> Question:
    """Why tensor parallelism shortens the decode step but does not make a token cheaper."""
    batch, context = plan.max_concurrent_seqs, plan.mean_context_len
    one = roofline_step_cost(lab, plan.model, plan.gpu, 1).step_time(batch, int(batch * context))
    two = roofline_step_cost(lab, plan.model, plan.gpu, 2).parts(batch, int(batch * context))
    per_token_1, per_token_2 = one / batch, 2 * two.total / batch
    return question(
        f"Your plan's {batch} sequences, {context:.0f} tokens of context each, take a {one * 1e3:.3f} ms decode step "
        f"on one {plan.gpu.name}. On 2 GPUs (tensor parallelism) each reads half the weights and half the K/V, and "
        f"the layers' all-reduces add {two.allreduce * 1e3:.3f} ms: the step is {two.total * 1e3:.3f} ms. How many "
        f"GPU-milliseconds does one output token cost at tp 2 (GPUs x step / tokens per step)?",
        2 * two.total * 1e3 / batch, per_token_2 * 1e3,
        f"2 x {two.total * 1e3:.3f} ms / {batch} = {per_token_2 * 1e3:.4f} GPU-ms, against "
        f"{per_token_1 * 1e3:.4f} at tp 1: the step halves (TPOT falls) but the GPUs double, so the same batch "
        f"costs the same per token plus the all-reduces. What tp can buy is room: half the weights per GPU leaves "
        f"more memory for K/V, so more sequences fit; when the KV blocks bound the batch, that lowers the cost "
        f"(`python {os.path.basename(lab.__file__)} fleet` shows when).", tolerance=0.02, relative=True)


def _quiz_tp8_vs_tp2(lab: ModuleType, plan, batch: int = 64) -> Question:
    """Why tp 8 costs more per token than tp 2 on the same GPU, on the measured step cost."""
    gpu = plan.gpu.name if has_profile(plan.gpu.name) else "a100-80gb"
    context = round(batch * plan.mean_context_len)
    two, eight = (measured_step_cost(lab, plan.model, gpu, tp).parts(batch, context) for tp in (2, 8))

    def per_token(tp: int, seconds: float) -> str:  # GPU-milliseconds per output token
        return f"{tp * seconds * 1e3 / batch:.3f}"
    ratio = 8 * eight.total / (2 * two.total)
    layers = 2 * plan.model.num_layers
    return question(
        f"On {gpu}, a decode step of {batch} sequences of {plan.model.name} ({plan.mean_context_len:.0f} tokens of "
        f"context each) takes {two.total * 1e3:.2f} ms at tp 2 and {eight.total * 1e3:.2f} ms at tp 8 by the measured "
        f"step cost (Vidur's profiles, fitted). How many times the GPU-milliseconds per output token of tp 2 does "
        f"tp 8 cost?", 8 * eight.total / (2 * two.total), ratio,
        f"8 x {eight.total * 1e3:.2f} / (2 x {two.total * 1e3:.2f}) = {ratio:.2f}. Per output token, tp 2 -> tp 8: the "
        f"GEMMs with their norms {per_token(2, two.linear)} -> {per_token(8, eight.linear)} GPU-ms (a quarter of each "
        f"shard runs further from peak: a launch floor per kernel, fewer tiles than SMs, and the norms and residual "
        f"adds are not split at all); attention {per_token(2, two.attention)} -> {per_token(8, eight.attention)} (its "
        f"K/V reads split over tp, its kernel launches do not); the {layers} all-reduces "
        f"{per_token(2, two.allreduce)} -> {per_token(8, eight.allreduce)} ({two.allreduce / layers * 1e6:.0f} -> "
        f"{eight.allreduce / layers * 1e6:.0f} us each: latency, whatever the shard); the engine's CPU "
        f"{per_token(2, two.overhead)} -> {per_token(8, eight.overhead)} ({two.overhead * 1e3:.0f} ms a step, with 8 "
        f"GPUs waiting through it). tp buys a shorter step (TPOT) and room for K/V, not cheaper tokens.",
        tolerance=0.02, relative=True)


def _quiz_token_budget(lab: ModuleType, rng: np.random.Generator, plan) -> Question:
    """Why the knee moves with max_num_batched_tokens: prefill gets what the decodes leave of it."""
    decoders, prompt, budget = int(rng.choice([4, 8])), int(rng.choice([300, 400, 500])), int(rng.choice([64, 128]))
    bigger = 4 * budget
    requests = [(1, 40)] * decoders + [(prompt, 2)]
    run = run_steps(lab, requests, "continuous", decoders + 1, bigger)
    steps_small, steps_big = ceil_div(prompt, budget - decoders), ceil_div(prompt, bigger - decoders)
    step = roofline_step_cost(lab, plan.model, plan.gpu, 1)
    small_s, big_s = (step.step_time(m, int(decoders * plan.mean_context_len + prompt)) for m in (budget, bigger))
    return question(
        f"{decoders} sequences are decoding (one token each per step) when a {prompt}-token prompt arrives. With "
        f"chunked prefill and max_num_batched_tokens = {budget}, the prompt gets {budget} - {decoders} tokens a step "
        f"and its first token comes at step {steps_small}. At which step does it come with "
        f"max_num_batched_tokens = {bigger}? (Your scheduler runs it.)",
        run.first_token_step[str(decoders)], steps_big,
        f"ceil({prompt} / ({bigger} - {decoders})) = {steps_big}. Prefill gets what the decodes leave of the budget "
        f"each step, so the prompt tokens per second a replica can take, and the request rate where TTFT starts to "
        f"queue (the knee), grow with the budget: on {plan.model.name} / {plan.gpu.name} a step of {budget} tokens "
        f"takes {small_s * 1e3:.1f} ms and one of {bigger} {big_s * 1e3:.1f} ms (roofline), so prefill runs at "
        f"{(budget - decoders) / small_s:,.0f} vs {(bigger - decoders) / big_s:,.0f} tokens/s. The price: a longer "
        f"step is every decoding sequence's TPOT, so past the point where the step turns compute-bound a bigger "
        f"budget moves the knee against the TPOT target instead.")
