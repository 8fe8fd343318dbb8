"""Size a deployment: the capacity plan as a design-review printout, and the KV memory a
max_model_len slab wastes against paged blocks (vLLM prints the same figures at start-up:
"# GPU blocks", "Maximum concurrency for N tokens per request").
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from types import ModuleType
from typing import NamedTuple

import numpy as np

from loadtest.costmodel import NoProfile, measured_step_cost
from loadtest.datasets import LENGTH_SIGMA, sample_request_lengths

from .fleet import explain_difference

# The curriculum's sizing scenario: "a 13B model, 80 GB GPU, 8k context".
SEED_SIZING = {"model": "llama-2-13b", "gpu": "a100-80gb", "max_model_len": 8192}  # every default below


class MeasuredPlan(NamedTuple):
    """A plan's decode step, prefill and QPS with the measured step cost in place of the roofline."""

    decode_step_s: float
    prefill_s: float
    qps: float


def measure_plan(lab: ModuleType, plan, cpu_overhead_s: float | None = None) -> MeasuredPlan | None:
    """`plan`'s Little's law on the measured step cost (costmodel.measured_step_cost): its seats'
    decode step at the plan's context, one mean prompt's prefill step. None without a profile."""
    try:
        cost = measured_step_cost(lab, plan.model, plan.gpu, plan.tensor_parallel_size, cpu_overhead_s)
    except NoProfile:
        return None
    seats, prompt = plan.max_concurrent_seqs, max(1, round(plan.mean_prompt_len))
    step = cost.step_time(seats, round(seats * plan.mean_context_len))
    prefill = cost.parts(prompt, prompt, prompt * (prompt + 1) // 2).total
    return MeasuredPlan(step, prefill, seats / (plan.mean_output_len * step + seats * prefill))


def format_plan(lab: ModuleType, plan, usd_per_gpu_hour: float | None = None,
                cpu_overhead_s: float | None = None) -> str:
    """A design-review printout of `plan`: the memory split, the concurrency and the QPS, and
    the evidence for which consumer sets the concurrency ceiling (re-planned variants: zero
    weights, half the context, the mean request's length, an 8-KV-head GQA twin). With a GPU
    price, the cost per million output tokens: the tp GPUs' price per hour over the output
    tokens the group makes in an hour; measured (costmodel.measured_step_cost, the engine's CPU time
    `cpu_overhead_s` per step) beside the roofline where the GPU has a published profile."""
    measured = measure_plan(lab, plan, cpu_overhead_s)
    lines = _memory_and_qps(lab, plan) + _measured(lab, plan, measured, cpu_overhead_s)
    lines += [f"  note: {note}" for note in plan.notes]
    mean_len = math.ceil(plan.mean_prompt_len + plan.mean_output_len)
    typical = plan.replan(max_model_len=mean_len)
    lines += _ceiling(lab, plan, typical, mean_len)
    if usd_per_gpu_hour is not None:
        lines.append(_cost(lab, plan, typical, measured, usd_per_gpu_hour, cpu_overhead_s))
    return "\n".join(lines)


def _kv_element_bytes(model) -> int:
    return model.dtype_bytes if model.kv_dtype_bytes is None else model.kv_dtype_bytes


def _memory_and_qps(lab: ModuleType, plan) -> list[str]:
    """The printout's head: where each GPU's memory goes, the KV pool, the concurrency, the QPS."""
    m, g, tp = plan.model, plan.gpu, plan.tensor_parallel_size
    per_seq = lab.blocks_needed(plan.max_model_len, plan.block_size)
    kv_element = _kv_element_bytes(m)

    def pct(part: float) -> str:
        return f"{100 * part / plan.memory_budget_bytes:.0f}%"

    gpus = f"{tp} x {g.name}" if tp > 1 else g.name
    return [
        f"Sizing {m.name} on {gpus}, max_model_len {plan.max_model_len}, block_size "
        f"{plan.block_size}, gpu_memory_utilization {plan.gpu_memory_utilization:g}",
        f"  per GPU: memory {g.memory_bytes / lab.GB:.2f} GB ({g.memory_bytes // lab.MiB} MiB, "
        "nvidia-smi) "
        f"-> budget {plan.memory_budget_bytes / lab.GB:.2f} GB",
        f"  weights      {plan.weight_bytes_per_gpu / lab.GB:7.2f} GB  ({pct(plan.weight_bytes_per_gpu)} of budget)",
        f"  activations  {plan.activation_bytes / lab.GB:7.2f} GB  (reserve; vLLM measures the peak "
        f"with a profiling run at start-up)",
        f"  KV pool      {plan.kv_pool_bytes / lab.GB:7.2f} GB  ({pct(plan.kv_pool_bytes)}): "
        f"{plan.num_kv_blocks} blocks x {plan.block_bytes_per_gpu / 2**20:g} MiB "
        f"= {plan.num_cache_tokens} tokens",
        f"  KV per token {lab.kv_bytes_per_token(m) / 2**10:g} KiB = 2 (K,V) x {m.num_layers} layers x "
        f"{m.num_kv_heads} KV heads x {m.head_dim} x {kv_element} B"
        + (" (8-bit KV cache)" if kv_element == 1 else "")
        + (f", / tp {tp} = {plan.kv_bytes_per_token_per_gpu / 2**10:g} KiB per GPU" if tp > 1 else ""),
        f"  max concurrent sequences at {plan.max_model_len} tokens: {plan.num_kv_blocks} // "
        f"{per_seq} blocks = {plan.max_concurrent_seqs}",
        f"  decode step {plan.decode_step_s * 1e3:.1f} ms ({plan.decode_bound}-bound; context "
        f"charged {plan.mean_context_len:.0f} tokens), prefill {plan.prefill_s * 1e3:.1f} ms per "
        f"{plan.mean_prompt_len:g}-token prompt",
        f"  QPS (Little's law) = {plan.max_concurrent_seqs} / {plan.request_latency_s:.2f} s = "
        f"{plan.qps:.2f} requests/s, {plan.output_tokens_per_s:.0f} output tokens/s"
        + (f" per {tp}-GPU group" if tp > 1 else " per GPU"),
    ]


def _measured(lab: ModuleType, plan, measured: MeasuredPlan | None, cpu_overhead_s: float | None) -> list[str]:
    """The measured step cost's decode step, prefill and QPS beside the roofline's, and why they differ."""
    if measured is None:
        return [f"  measured: no published profile for {plan.gpu.name}: the roofline above (a floor) is the only "
                "answer here"]
    return [textwrap.fill(
        f"measured (Vidur's operator profiles, fitted): decode step {measured.decode_step_s * 1e3:.1f} ms, "
        f"prefill {measured.prefill_s * 1e3:.1f} ms; QPS = {plan.max_concurrent_seqs} / "
        f"{plan.max_concurrent_seqs / measured.qps:.2f} s = {measured.qps:.2f} requests/s (the roofline's "
        f"{plan.qps:.2f} is a floor's)", width=118, initial_indent="  ", subsequent_indent="    "),
            textwrap.fill(explain_difference(lab, plan.model, plan.gpu.name, plan.tensor_parallel_size,
                                             plan.max_concurrent_seqs, plan.mean_context_len, cpu_overhead_s),
                          width=118, initial_indent="    why: ", subsequent_indent="      ")]


def _ceiling(lab: ModuleType, plan, typical, mean_len: int) -> list[str]:
    """What sets the concurrency ceiling, with the evidence of re-planned variants, and what
    paging leaves room for at the mean request's length (`typical`)."""
    m, tp = plan.model, plan.tensor_parallel_size
    per_seq = lab.blocks_needed(plan.max_model_len, plan.block_size)
    no_weights = plan.replan(model=dataclasses.replace(m, num_params=1))
    evidence = [f"deleting the weights altogether -> {no_weights.max_concurrent_seqs}"]
    if plan.max_model_len >= 2 * plan.block_size:
        half = plan.replan(max_model_len=plan.max_model_len // 2,
                           mean_prompt_len=min(plan.mean_prompt_len, plan.max_model_len // 4),
                           mean_output_len=min(plan.mean_output_len, plan.max_model_len // 4))
        evidence.append(f"half the context ({plan.max_model_len // 2}) -> {half.max_concurrent_seqs}")
    if m.num_kv_heads > 8 and m.num_kv_heads % 8 == 0 and 8 % tp == 0:
        gqa = plan.replan(model=dataclasses.replace(m, name=m.name + "-gqa8", num_kv_heads=8))
        evidence.append(f"a GQA twin with 8 KV heads -> {gqa.max_concurrent_seqs}")
    if _kv_element_bytes(m) > 1:
        int8 = plan.replan(model=lab.with_kv_cache_dtype(m, "int8"))
        evidence.append(f"an 8-bit KV cache (--kv-cache-dtype int8) -> {int8.max_concurrent_seqs} "
                        f"({int8.num_kv_blocks} blocks)")
    if plan.ceiling == "kv-blocks":
        ceiling = (
            f"  The KV blocks, not the weights, set the ceiling: the weights take "
            f"{plan.weight_bytes_per_gpu / lab.GB:.1f} GB and fit with {plan.kv_pool_bytes / lab.GB:.1f} GB "
            f"to spare, yet each {plan.max_model_len}-token sequence needs {per_seq} blocks "
            f"({per_seq * plan.block_bytes_per_gpu / lab.GB:.2f} GB), so only "
            f"{plan.max_concurrent_seqs} fit.")
    else:
        ceiling = (
            f"  The weights set the ceiling here: they take {plan.weight_bytes_per_gpu / lab.GB:.1f} GB "
            f"and leave the KV pool only {plan.kv_pool_bytes / lab.GB:.1f} GB "
            f"({plan.max_concurrent_seqs} sequences); quantise the weights or raise tp.")
    return [ceiling, f"  Concurrency instead of {plan.max_concurrent_seqs}: " + "; ".join(evidence) + ".",
            f"  Paging allocates blocks as tokens arrive: a mean request ({mean_len} tokens, "
            f"{lab.blocks_needed(mean_len, plan.block_size)} blocks) leaves room for "
            f"{typical.max_concurrent_seqs} at once ({typical.qps:.1f} QPS); "
            f"{plan.max_concurrent_seqs} is the guarantee if every request grows to {plan.max_model_len}."]


def _cost(lab: ModuleType, plan, typical, measured: MeasuredPlan | None, usd_per_gpu_hour: float,
          cpu_overhead_s: float | None) -> str:
    """The cost per 1M output tokens at the guaranteed concurrency and at the mean request's,
    measured beside the roofline where both plans have a measured step."""
    tp = plan.tensor_parallel_size

    def per_million(qps: float) -> float:
        return usd_per_gpu_hour * tp / (qps * plan.mean_output_len * 3600) * 1e6
    typical_measured = measure_plan(lab, typical, cpu_overhead_s)
    if measured is None or typical_measured is None:
        return (f"  Cost at ${usd_per_gpu_hour:.2f} per GPU-hour (roofline): ${per_million(plan.qps):.2f} per 1M "
                f"output tokens at the guaranteed {plan.max_concurrent_seqs} sequences, "
                f"${per_million(typical.qps):.2f} at the mean request's {typical.max_concurrent_seqs}: the KV "
                f"ceiling is also the price.")
    return (f"  Cost at ${usd_per_gpu_hour:.2f} per GPU-hour: ${per_million(measured.qps):.2f} per 1M output "
            f"tokens measured, ${per_million(plan.qps):.2f} on the roofline, at the guaranteed "
            f"{plan.max_concurrent_seqs} sequences; ${per_million(typical_measured.qps):.2f} and "
            f"${per_million(typical.qps):.2f} at the mean request's {typical.max_concurrent_seqs}: the KV "
            f"ceiling is also the price.")


class KVUtilization(NamedTuple):
    """Fraction of reserved KV memory that holds real tokens, under each allocation policy."""

    slab: float
    paged: float


def kv_memory_utilization(lab: ModuleType, lengths, max_model_len: int, block_size: int) -> KVUtilization:
    """Tokens held / token slots reserved, for sequences of `lengths` tokens each:
    (a) `slab`: the naive allocator reserves a contiguous `max_model_len` slab per request up
    front; (b) `paged`: PagedAttention reserves `lab.blocks_needed(length, block_size)` whole
    blocks, so each sequence wastes fewer than `block_size` slots, all in its last block.
    Every length must be in 1..max_model_len (a slab cannot hold more)."""
    lab.check_int("max_model_len", max_model_len, minimum=1)
    lab.check_int("block_size", block_size, minimum=1)
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or lengths.size == 0 or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be a non-empty 1-D sequence of ints, got {lengths!r}")
    if lengths.min() < 1 or lengths.max() > max_model_len:
        raise ValueError(f"every length must be in 1..max_model_len={max_model_len}, "
                         f"got {lengths.min()}..{lengths.max()}")
    held = int(lengths.sum())
    paged_slots = int((-(-lengths // block_size)).sum()) * block_size  # ceil: whole blocks
    return KVUtilization(slab=held / (lengths.size * max_model_len), paged=held / paged_slots)


def format_waste(lab: ModuleType, max_model_len: int = 2048, block_size: int = 16,
                 num_requests: int = 10_000, seed: int = 0) -> str:
    """KV memory utilisation for ShareGPT- and Alpaca-like traffic (sample_request_lengths),
    each request at its final length, under a max_len slab vs paged blocks."""
    lines = [f"KV memory holding real tokens, {num_requests} requests per trace, "
             f"max_model_len {max_model_len}, block_size {block_size}",
             f"  (lengths: lognormal, sigma {LENGTH_SIGMA:g}, matched to the means Kwon et al. "
             f"SOSP'23 report; each request at its final length)",
             f"  {'trace':<9} {'paper means (in/out)':>21} {'sample mean':>12} {'slab':>7} {'paged':>7}"]
    for stats in (lab.SHAREGPT, lab.ALPACA):
        prompts, outputs = sample_request_lengths(lab, stats, num_requests, seed, max_model_len)
        total = prompts + outputs
        util = kv_memory_utilization(lab, total, max_model_len, block_size)
        means = f"{stats.mean_prompt_len:g} / {stats.mean_output_len:g}"
        lines.append(f"  {stats.name:<9} {means:>21} {total.mean():12.1f} "
                     f"{100 * util.slab:6.1f}% {100 * util.paged:6.1f}%")
    lines.append("  A slab is sized for the longest request and a request is mostly far shorter; paging "
                 f"wastes under one block ({block_size} slots) per sequence, which short requests feel most.")
    lines.append("  The paper measured 20.4%-38.2% for Orca's slab variants and 96.3% for vLLM (its Fig. 2).")
    return "\n".join(lines)


def scenario_size(lab: ModuleType, model: str = SEED_SIZING["model"], gpu: str = SEED_SIZING["gpu"],
                  max_model_len: int = SEED_SIZING["max_model_len"],
                  block_size: int = 16, gpu_memory_utilization: float = 0.9, activation_gb: float = 0.0,
                  tensor_parallel_size: int = 1, prompt_len: float | None = None,
                  output_len: float | None = None, kv_cache_dtype: str = "auto",
                  usd_per_gpu_hour: float | None = None, cpu_overhead_s: float | None = None) -> str:
    """Size a vLLM deployment (by default the curriculum's: a 13B model on an 80 GB GPU at 8k context),
    then the KV waste a paged cache removes."""
    lengths = {k: v for k, v in (("mean_prompt_len", prompt_len), ("mean_output_len", output_len)) if v is not None}
    plan = lab.plan_deployment(model, gpu, max_model_len, block_size=block_size,
                               gpu_memory_utilization=gpu_memory_utilization,
                               activation_bytes=int(activation_gb * lab.GB),
                               tensor_parallel_size=tensor_parallel_size, kv_cache_dtype=kv_cache_dtype, **lengths)
    return format_plan(lab, plan, usd_per_gpu_hour, cpu_overhead_s) + "\n\n" + format_waste(lab, block_size=block_size)
