"""The model-free step simulator: the module's own schedulers, each step costed by a roofline.

A design review asks what continuous batching buys on a real GPU at real sizes, which the NumPy
model cannot show. The simulator runs a workload through the handed module's real `Scheduler`
(or `StaticBatchScheduler`) and `BlockAllocator`, and charges each step `StepCostModel.step_time`
seconds instead of running a model. vLLM has no such file: its benchmarks run the engine.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence
from types import ModuleType

import numpy as np

from measure.latency import summarize_serving


@dataclasses.dataclass(frozen=True)
class StepCostModel:
    """Seconds per engine step, as a roofline: a step is bound by memory traffic or by compute,
    whichever is slower. The defaults are Llama-2-7B in fp16 on one A100-80GB:

    - weight_read_time: every step reads all weights once, whatever the batch
      (14 GB at ~2 TB/s = 7 ms). This fixed cost is what batching amortises.
    - kv_read_time_per_token: attention reads each sequence's whole context
      (0.5 MiB of K/V per token for Llama-2-7B, over ~2 TB/s).
    - compute_time_per_token: 2 * 7e9 FLOPs per processed token at ~50% of 312 TFLOP/s.

    A decode step (one token per sequence) is memory-bound; a step with a long prefill is
    compute-bound: that is why TTFT follows prefill and TPOT follows the decode batch.
    """

    weight_read_time: float = 7e-3
    kv_read_time_per_token: float = 2.6e-7
    compute_time_per_token: float = 9e-5

    def step_time(self, num_tokens: int, num_context_tokens: int) -> float:
        memory = self.weight_read_time + self.kv_read_time_per_token * num_context_tokens
        return max(memory, self.compute_time_per_token * num_tokens)


@dataclasses.dataclass
class ServingSimulation:
    """What simulate_serving measured. `timeline[t]` is step t's row of slots: a request index
    per busy slot, -1 for a slot idle while requests wait (wasted), -2 idle with nothing waiting.
    `outputs` carry metrics in simulated seconds, `outputs_in_steps` the same in steps."""

    scheduling: str
    num_slots: int
    num_steps: int
    duration: float
    num_output_tokens: int
    wasted_slot_steps: int
    num_preemptions: int
    outputs: list  # the module's RequestOutputs, metrics in simulated seconds
    outputs_in_steps: list  # the same, metrics in steps
    timeline: list[list[int]]
    output_lens: list[int]

    @property
    def throughput(self) -> float:
        """Output tokens per simulated second."""
        return self.num_output_tokens / self.duration

    @property
    def tokens_per_step(self) -> float:
        return self.num_output_tokens / self.num_steps

    def summary(self, in_steps: bool = False) -> dict[str, float]:
        if in_steps:
            return summarize_serving(self.outputs_in_steps, self.num_steps, self.num_preemptions)
        return summarize_serving(self.outputs, self.duration, self.num_preemptions)


def _check_workload(lab: ModuleType, workload: Sequence[tuple[float, int, int]]) -> None:
    """A ValueError naming the first bad request of a simulated workload."""
    if len(workload) == 0:
        raise ValueError("the workload is empty; expected (arrival_time, prompt_len, output_len) per request")
    for i, entry in enumerate(workload):
        if len(entry) != 3:
            raise ValueError(f"workload[{i}] = {entry!r}; expected (arrival_time, prompt_len, output_len)")
        arrival, prompt_len, output_len = entry
        if not (lab.is_number(arrival) and 0 <= arrival < math.inf):
            raise ValueError(f"workload[{i}]: arrival_time must be a finite number >= 0, got {arrival!r}")
        lab.check_int(f"workload[{i}] prompt_len", prompt_len, minimum=1)
        lab.check_int(f"workload[{i}] output_len", output_len, minimum=1)


def simulate_serving(lab: ModuleType, workload: Sequence[tuple[float, int, int]], scheduling: str = "continuous", *,
                     max_num_seqs: int = 16, max_num_batched_tokens: int = 512, num_blocks: int | None = None,
                     block_size: int = 16, enable_chunked_prefill: bool = True,
                     cost: StepCostModel = StepCostModel(), record_timeline: bool = True) -> ServingSimulation:
    """Run a workload through the real Scheduler (or StaticBatchScheduler with batch_size =
    max_num_seqs) on a real BlockAllocator, with no model: each step costs
    `cost.step_time(scheduled tokens, context tokens read)` seconds of simulated time (a cost with
    `charges_sampled_tokens` true gets the step's sampled tokens too, a third argument), where a
    scheduled sequence's context read is its computed tokens plus this step's new ones (attention
    reads the new tokens' K/V too).

    workload: (arrival_time in seconds, prompt_len, output_len) per request; each request
    produces exactly output_len tokens. `num_blocks=None` gives every slot room for the
    longest request (no memory pressure). A slot-step is wasted when a slot is idle while an
    arrived request waits: the cost of head-of-line blocking (or of a full cache). A request
    that can never fit is reported rejected, as the engine does. `record_timeline=False`
    skips the slots x steps timeline (for long runs).
    """
    _check_workload(lab, workload)
    if num_blocks is None:
        num_blocks = max_num_seqs * max(lab.blocks_needed(p + o, block_size) for _, p, o in workload)
    scheduler = lab.make_scheduler(scheduling, lab.BlockAllocator(num_blocks, block_size), max_num_seqs,
                                   max_num_batched_tokens, enable_chunked_prefill)
    arrivals = collections.deque(sorted(range(len(workload)), key=lambda i: workload[i][0]))
    seqs: list = [None] * len(workload)  # the module's SequenceStates
    step_clock: dict[str, list[int]] = {}  # request id -> [arrival step, token steps...]
    slot_of: dict[str, int] = {}
    clock = 0.0
    timeline = []
    wasted = 0
    num_steps = 0
    while arrivals or scheduler.has_unfinished():
        if not scheduler.has_unfinished() and workload[arrivals[0]][0] > clock:
            clock = workload[arrivals[0]][0]  # idle: jump to the next arrival
        while arrivals and workload[arrivals[0]][0] <= clock:
            i = arrivals.popleft()
            arrival, prompt_len, output_len = workload[i]
            sampling = lab.SamplingParams(max_tokens=output_len)
            seqs[i] = scheduler.add_request(lab.Request(str(i), [0] * prompt_len, sampling, arrival))
            step_clock[str(i)] = [num_steps]
        if not scheduler.has_unfinished():
            continue  # every arrival so far was rejected
        plan = scheduler.plan_step()
        clock += _step_seconds(cost, plan)
        row = _occupy_slots(slot_of, scheduler.running, max_num_seqs, waiting=len(scheduler.waiting))
        num_steps += 1
        if record_timeline:
            timeline.append(row)
        wasted += min(row.count(-1), len(scheduler.waiting))
        sampled = {s.request_id: 0 for s in plan.scheduled if plan.completes(s)}
        scheduler.finish_step(plan, sampled, clock)
        for rid in sampled:
            step_clock[rid].append(num_steps)
    outputs = [s.to_output() for s in seqs]
    return ServingSimulation(scheduling, max_num_seqs, num_steps, clock,
                             sum(len(o.output_token_ids) for o in outputs), wasted, scheduler.num_preemptions,
                             outputs, _outputs_in_steps(lab, seqs, step_clock), timeline, [o for _, _, o in workload])


def _step_seconds(cost, plan) -> float:
    """A planned step's simulated seconds: its scheduled tokens, the context they read (computed
    tokens plus the new ones), and for a cost that charges them, the tokens it samples."""
    context = sum(s.num_computed_tokens + plan.num_scheduled_tokens[s.request_id] for s in plan.scheduled)
    if getattr(cost, "charges_sampled_tokens", False):  # a served engine streams each sampled token out
        num_sampled = sum(1 for s in plan.scheduled if plan.completes(s))
        return cost.step_time(plan.total_num_scheduled_tokens, context, num_sampled)
    return cost.step_time(plan.total_num_scheduled_tokens, context)


def _outputs_in_steps(lab: ModuleType, seqs: list, step_clock: dict[str, list[int]]) -> list:
    """Each request's output with its metrics counted in engine steps, not seconds."""
    in_steps = []
    for s in seqs:
        arrival_step, *token_steps = step_clock[s.request_id]
        finish_step = token_steps[-1] if token_steps else arrival_step
        metrics = lab.RequestMetrics.from_times(arrival_step, token_steps, finish_step)
        in_steps.append(dataclasses.replace(s.to_output(), metrics=metrics))
    return in_steps


def _occupy_slots(slot_of: dict[str, int], running: list, num_slots: int, waiting: int) -> list[int]:
    """Give each running sequence a stable slot (the lowest free one when it enters) and
    return this step's row of the timeline."""
    ids = {s.request_id for s in running}
    for rid in [r for r in slot_of if r not in ids]:
        del slot_of[rid]  # finished or preempted: the slot is free
    for rid in (s.request_id for s in running):
        if rid not in slot_of:
            slot_of[rid] = min(set(range(num_slots)) - set(slot_of.values()))
    row = [-1 if waiting else -2] * num_slots
    for rid, slot in slot_of.items():
        row[slot] = int(rid)
    return row


def skewed_workload(num_short: int, long_len: int, short_len: int, prompt_len: int) -> list[tuple[float, int, int]]:
    """The design review's skewed workload: one long answer first, then many short ones, all queued at t=0."""
    return [(0.0, prompt_len, long_len)] + [(0.0, prompt_len, short_len)] * num_short


def recurring_workload(num_requests: int, long_len: int, short_len: int, prompt_len: int, rate: float,
                       long_every: int = 8, seed: int = 0) -> list[tuple[float, int, int]]:
    """A stream: Poisson arrivals at `rate` requests/s (rate 0: all at t=0), every
    `long_every`-th request a long answer."""
    gaps = np.random.default_rng(seed).exponential(1 / rate, num_requests) if rate else np.zeros(num_requests)
    return [(float(t), prompt_len, long_len if i % long_every == 0 else short_len)
            for i, t in enumerate(np.cumsum(gaps) - gaps[0])]
