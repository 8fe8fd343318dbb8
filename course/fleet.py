"""Size a fleet for an SLO: the cheapest deployment that meets p99 TTFT and p99 TPOT at a
request rate, searched in the simulator with the module's own Scheduler (`python solution.py fleet`).

For each candidate (GPU, tensor-parallel degree, max_num_seqs, max_num_batched_tokens), binary
search finds the largest request rate one replica serves with at least 99% of requests inside both
targets (Vidur-Search does the same per configuration; DistServe calls the rate goodput). The fleet
then needs ceil(QPS / rate) replicas of tp GPUs each; the pick is the fewest GPUs. Prefill/decode
disaggregation (DistServe, OSDI'24) is one more candidate: a prefill pool sized for TTFT alone and a
decode pool for TPOT alone, the prompt's K/V shipped between them at a stated link bandwidth.

Each replica's steps are costed twice: by costmodel.measured_step_cost (Vidur's measured operators,
fitted: the answer) and by costmodel.roofline_step_cost (peak figures: a lower bound on latency, so
its GPU counts are a floor), shown side by side with what makes them differ. A GPU with no published
profile is costed by the roofline alone, and the table says so. KV blocks per replica come from the
module's plan_deployment (Exercise 8), the scheduling from its Scheduler (Exercise 5).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import multiprocessing
import textwrap
import time
from collections.abc import Callable, Sequence
from types import ModuleType

import numpy as np

from loadtest.costmodel import (
    ALLREDUCE_LATENCY_S,
    INTERCONNECT_BYTES_PER_S,
    MeasuredStepCost,
    RooflineStepCost,
    has_profile,
    roofline_step_cost,
    step_cost,
)
from loadtest.datasets import sample_request_lengths, workload_stats

# The grid searched besides the tensor-parallel degree (vLLM's defaults are 256 and 8192 on a
# large GPU; 2048 is its old chunked-prefill default).
TP_DEGREES = (1, 2, 4, 8)
MAX_NUM_SEQS = (64, 256)
MAX_NUM_BATCHED_TOKENS = (512, 2048, 8192)
# ASSUMED: the prompt's K/V travels from a prefill GPU to a decode GPU over one 200 Gb/s
# InfiniBand NIC per GPU (25 GB/s); within one NVLink node it would be ~10x faster.
KV_LINK_BYTES_PER_S = 25e9
SLO_QUANTILE = 0.99  # p99: at least 99% of requests meet each target
SEARCH_TOLERANCE = 0.08  # binary search stops when the bracket is within 8%


@dataclasses.dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One deployment of a replica: `role` "both" (colocated), "prefill" or "decode" (a pool of
    a disaggregated fleet)."""

    gpu: str
    tp: int
    max_num_seqs: int
    max_num_batched_tokens: int
    role: str = "both"
    cost: str = "measured"  # the step cost searched with: "measured" (roofline without a profile) or "roofline"

    @property
    def label(self) -> str:
        pool = "" if self.role == "both" else f"{self.role}: "
        return f"{pool}{self.gpu} tp{self.tp} seqs {self.max_num_seqs} tokens {self.max_num_batched_tokens}"


@dataclasses.dataclass
class LoadRun:
    """One simulated run at one rate: the p99s (nearest rank), whether both targets held, and
    the evidence for what binds (counted over steps where an arrived request waited)."""

    rate: float
    meets: bool
    p99_ttft: float
    p99_tpot: float
    finished: bool              # False: stopped early, the misses already exceeded 1%
    num_steps: int = 0
    waiting_steps: int = 0      # steps that ended with an arrived request still waiting
    seats_full: int = 0         # ... of those, with max_num_seqs sequences running
    budget_full: int = 0        # ... with the token budget spent
    blocks_short: int = 0       # ... with neither: the KV cache had no room
    num_preemptions: int = 0
    bound_time: dict = dataclasses.field(default_factory=dict)  # step seconds by what bound the step
    mean_step: float = 0.0
    mean_decode_step: float = 0.0  # steps that ran no prefill
    mean_decode_batch: float = 0.0    # ... their sequences
    mean_decode_context: float = 0.0  # ... and the context tokens each read
    attainment: float = math.nan   # the share of counted requests inside both targets (a finished run)


def nearest_rank(values: Sequence[float], q: float = SLO_QUANTILE) -> float:
    """The q-quantile by nearest rank (the ceil(q * n)-th smallest): p99 <= T exactly when at
    least 99% of the values are <= T. NaN when empty."""
    if len(values) == 0:
        return math.nan
    return float(sorted(values)[max(1, math.ceil(round(q * len(values), 9))) - 1])


def allowed_misses(n: int, q: float = SLO_QUANTILE) -> int:
    return n - max(1, math.ceil(round(q * n, 9)))


def fleet_workload(lab: ModuleType, name: str, num_requests: int, seed: int, max_model_len: int):
    """(unit arrival times, prompt lengths, output lengths): Poisson arrivals at 1 request/s,
    divided by the rate at each rate tried (the same requests at every rate, so a search compares
    like with like)."""
    prompts, outputs = sample_request_lengths(lab, workload_stats(lab, name), num_requests, seed, max_model_len)
    gaps = np.random.default_rng(seed + 7).exponential(1.0, num_requests)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]), prompts.tolist(), outputs.tolist()


def simulate_rate(lab: ModuleType, cost, workload, rate: float, slo: SLO, candidate: Candidate, num_blocks: int,
                  block_size: int = 16, stop_early: bool = True, kv_transfer_s_per_token: float = 0.0,
                  warmup: float = 0.0) -> LoadRun:
    """Run the workload at `rate` through the module's Scheduler on `num_blocks` KV blocks, each
    step costing `cost.step_time(scheduled tokens, context tokens)` (context as simulate_serving
    reads it). Role "prefill": each request runs its prompt only (TTFT); "decode": its K/V
    arrives already computed (no FLOPs charged for the imported prompt) and its TPOT counts the
    transfer, `kv_transfer_s_per_token` per prompt token, before its second token. The first
    `warmup` fraction of the requests fill the queues and are not counted. With `stop_early`, the
    run stops once more than 1% of the counted requests missed a target."""
    unit_arrivals, prompts, outputs = workload
    role = candidate.role
    if role == "prefill":
        outputs = [1] * len(prompts)
    if role == "decode":  # the first token came from the prefill pool; one with no second is not here
        keep = [i for i, o in enumerate(outputs) if o > 1]
        unit_arrivals = [unit_arrivals[i] for i in keep]
        prompts, outputs = [prompts[i] + 1 for i in keep], [outputs[i] - 1 for i in keep]
    n = len(prompts)
    first = int(warmup * n)  # the first request counted
    budget = allowed_misses(n - first)
    scheduler = lab.make_scheduler("continuous", lab.BlockAllocator(num_blocks, block_size), candidate.max_num_seqs,
                                   candidate.max_num_batched_tokens, True)
    arrivals = [t / rate for t in unit_arrivals]
    seqs, ttfts, tpots, misses = [], [], [], 0
    clock, nxt = 0.0, 0
    run = LoadRun(rate, False, math.nan, math.nan, False)
    bound_time: dict[str, float] = {}
    decode_time, decode_steps, decode_seqs, decode_context = 0.0, 0, 0, 0
    while nxt < n or scheduler.has_unfinished():
        if not scheduler.has_unfinished() and arrivals[nxt] > clock:
            clock = arrivals[nxt]
        while nxt < n and arrivals[nxt] <= clock:
            sampling = lab.SamplingParams(max_tokens=outputs[nxt])
            seq = scheduler.add_request(lab.Request(str(nxt), [0] * prompts[nxt], sampling, arrivals[nxt]))
            seqs.append(seq)
            if seq.finish_reason == "rejected" and nxt >= first:
                misses += 1
            nxt += 1
        if not scheduler.has_unfinished():
            continue
        plan = scheduler.plan_step()
        tokens = plan.total_num_scheduled_tokens
        context, pairs, prefill = 0, 0, False  # pairs: query-key pairs attention computes (causal)
        for s in plan.scheduled:
            new, done = plan.num_scheduled_tokens[s.request_id], s.num_computed_tokens
            context += done + new
            if new > 1:
                prefill = True
                if role == "decode" and done == 0 and s.num_preemptions == 0:
                    tokens -= new - 1  # the imported K/V: no FLOPs, only the last token's
                    done, new = done + new - 1, 1
            pairs += new * done + new * (new + 1) // 2
        if isinstance(cost, MeasuredStepCost):
            parts = cost.parts(tokens, context, pairs)
        else:
            parts = cost.parts(tokens, context) if isinstance(cost, RooflineStepCost) else None
        step = parts.total if parts is not None else cost.step_time(tokens, context)
        clock += step
        if parts is not None:
            bound_time[parts.bound] = bound_time.get(parts.bound, 0.0) + step
        if not prefill:
            decode_time, decode_steps = decode_time + step, decode_steps + 1
            decode_seqs, decode_context = decode_seqs + len(plan.scheduled), decode_context + context
        run.num_steps += 1
        sampled = {s.request_id: 0 for s in plan.scheduled if plan.completes(s)}
        for s in scheduler.finish_step(plan, sampled, clock):
            i = int(s.request_id)
            if i < first:
                continue
            ttft = s.token_times[0] - s.arrival_time
            ttfts.append(ttft)
            misses += role != "decode" and ttft > slo.ttft_s
            if len(s.token_times) > 1 or role == "decode":
                transfer = kv_transfer_s_per_token * (prompts[i] - 1) if role == "decode" else 0.0
                gaps = len(s.token_times) - 1 + (role == "decode")
                start = s.arrival_time - transfer if role == "decode" else s.token_times[0]
                tpot = (s.token_times[-1] - start) / gaps
                tpots.append(tpot)
                misses += role != "prefill" and tpot > slo.tpot_s
        if scheduler.waiting and nxt > 0:
            run.waiting_steps += 1
            head = scheduler.waiting[0]
            if len(scheduler.running) >= candidate.max_num_seqs:
                run.seats_full += 1
            elif plan.total_num_scheduled_tokens >= candidate.max_num_batched_tokens:
                run.budget_full += 1
            elif plan.preempted or scheduler.allocator.num_free_blocks < lab.blocks_needed(
                    min(head.num_tokens, candidate.max_num_batched_tokens), block_size):
                run.blocks_short += 1
        if stop_early and misses > budget:
            break
    run.finished = not (nxt < n or scheduler.has_unfinished())
    run.num_preemptions = scheduler.num_preemptions
    run.bound_time = bound_time
    run.mean_step = clock / max(run.num_steps, 1) if run.num_steps else math.nan
    run.mean_decode_step = decode_time / decode_steps if decode_steps else math.nan
    if decode_steps:
        run.mean_decode_batch, run.mean_decode_context = decode_seqs / decode_steps, decode_context / decode_seqs
    if run.finished:
        rejected = sum(s.finish_reason == "rejected" for s in seqs[first:])
        run.p99_ttft = nearest_rank(ttfts + [math.inf] * rejected)
        run.p99_tpot = nearest_rank(tpots)
    else:  # stopped early: the requests still waiting or running have missed or will miss
        run.p99_ttft = nearest_rank(ttfts + [math.inf] * (n - first - len(ttfts)))
        run.p99_tpot = nearest_rank(tpots + [math.inf] * (n - first - len(tpots)))
    run.meets = misses <= budget and run.finished
    if run.finished:
        run.attainment = 1 - misses / max(n - first, 1)
    return run


@dataclasses.dataclass
class Search:
    """A candidate's largest rate meeting both targets (0 when even the lowest rate tried
    misses), the run there, and the first run above it that missed (None: every rate up to
    2**16 times the start met)."""

    candidate: Candidate
    max_rate: float
    best: LoadRun | None
    miss: LoadRun | None
    num_runs: int


def search_max_rate(run_at: Callable[[float], LoadRun], start: float, tolerance: float = SEARCH_TOLERANCE,
                    lowest: float | None = None, candidate: Candidate | None = None) -> Search:
    """Binary search of the largest rate where `run_at(rate).meets`, assumed monotone (meets
    below some rate, misses above): from `start`, double until a miss (or halve until a meet,
    down to `lowest`, default start / 256), then bisect until the bracket is within
    `tolerance` (relative). The result meets; the bracket's top misses."""
    runs = 0

    def at(rate: float) -> LoadRun:
        nonlocal runs
        runs += 1
        return run_at(rate)

    lowest = start / 256 if lowest is None else lowest
    first = at(start)
    if first.meets:
        good, bad = first, None
        while bad is None:
            if good.rate >= start * 2**16:  # a workload too small to queue: every rate meets
                return Search(candidate, good.rate, good, None, runs)
            trial = at(good.rate * 2)
            good, bad = (trial, None) if trial.meets else (good, trial)
    else:
        good, bad = None, first
        while good is None and bad.rate / 2 >= lowest:
            trial = at(bad.rate / 2)
            good, bad = (trial, bad) if trial.meets else (None, trial)
        if good is None:
            return Search(candidate, 0.0, None, bad, runs)
    while bad.rate > good.rate * (1 + tolerance):
        trial = at(math.sqrt(good.rate * bad.rate))
        good, bad = (trial, bad) if trial.meets else (good, trial)
    return Search(candidate, good.rate, good, bad, runs)


# --- the fleet: every candidate searched, the cheapest that meets the SLO -------------------


@dataclasses.dataclass(frozen=True)
class FleetQuestion:
    """What `fleet` is asked. Rates in requests/s, targets in seconds."""

    model: str
    gpus: tuple[str, ...]
    qps: float
    slo: SLO
    workload: str = "sharegpt"
    usd_per_gpu_hour: tuple[float, ...] = (2.0,)  # one price, or one per GPU of `gpus`
    max_model_len: int = 2048
    num_requests: int = 600
    seed: int = 0
    kv_link_bytes_per_s: float = KV_LINK_BYTES_PER_S
    disaggregation: bool = True
    cpu_overhead_s: float | None = None  # the engine's CPU time per step; None: costmodel.CPU_OVERHEAD_S


@dataclasses.dataclass
class FleetRow:
    """One line of the table: a colocated candidate, or the disaggregated pair (prefill and
    decode searches). `gpus` is None when no rate met the SLO (or it did not fit)."""

    label: str
    searches: list[Search]
    replicas: tuple[int, ...] = ()
    gpus: int | None = None
    usd_per_million: float = math.nan
    note: str = ""
    key: tuple = ()                     # the configuration, whichever step cost searched it
    roofline: FleetRow | None = None    # the same configuration searched on the roofline (the floor)

    @property
    def measured(self) -> bool:
        """Searched with the measured step cost (False: its GPU has no published profile)."""
        return bool(self.searches) and self.searches[0].candidate.cost == "measured" and has_profile(
            self.searches[0].candidate.gpu)

    @property
    def max_rate(self) -> float:
        return min((s.max_rate for s in self.searches), default=0.0)

    @property
    def capacity(self) -> float:
        """Requests/s the fleet can take: its replicas times their rate (the smaller pool's)."""
        return min((n * s.max_rate for n, s in zip(self.replicas, self.searches)), default=0.0)


def fleet_size(qps: float, rate_per_replica: float, tp: int) -> tuple[int, int]:
    """(replicas, GPUs) to serve `qps` when one replica of `tp` GPUs serves `rate_per_replica`."""
    replicas = math.ceil(qps / rate_per_replica * (1 - 1e-12))  # 100 / 25 is 4, not 5, in floating point
    return replicas, replicas * tp


def usd_per_million_output_tokens(num_gpus: int, usd_per_gpu_hour: float, qps: float, mean_output_len: float) -> float:
    """The fleet's hourly price over the output tokens it makes in an hour at `qps`."""
    return num_gpus * usd_per_gpu_hour / (qps * mean_output_len * 3600) * 1e6


def _candidates(lab: ModuleType, question: FleetQuestion) -> list[Candidate]:
    """The colocated grid: every tp at (256 seats, 2048 tokens); at tp 1 and 2 also token
    budgets of 512 and 8192 (the knee's lever), and at tp 1 64 seats (the seats' lever)."""
    out = []
    for gpu in question.gpus:
        for tp in TP_DEGREES:
            out.append(Candidate(gpu, tp, 256, 2048))
            if tp <= 2:
                out += [Candidate(gpu, tp, 256, 512), Candidate(gpu, tp, 256, 8192)]
            if tp == 1:
                out.append(Candidate(gpu, tp, 64, 2048))
    return out


def _disaggregated(question: FleetQuestion) -> list[Candidate]:
    return [Candidate(gpu, tp, 256, 2048, role) for gpu in question.gpus for role in ("prefill", "decode")
            for tp in (1, 2)]


def _start_rate(cost, num_blocks: int, block_size: int, candidate: Candidate, mean_prompt: float,
                mean_output: float) -> float:
    """Where the search starts: Little's law at the concurrency the seats or the KV blocks allow
    (the running set is length-biased: charged at the mean prompt plus the mean output), each
    request living mean_output decode steps at that concurrency."""
    if candidate.role == "prefill":
        return 1.0 / max(cost.step_time(int(mean_prompt), int(mean_prompt)), 1e-9)
    context = mean_prompt + mean_output
    seqs = max(1.0, min(candidate.max_num_seqs, num_blocks * block_size / context))
    return seqs / (mean_output * cost.step_time(int(seqs), int(seqs * context)))


def candidate_step_cost(lab: ModuleType, question: FleetQuestion, candidate: Candidate):
    """The step cost a candidate is searched with: the measured one (the roofline where the GPU has no
    published profile), or the roofline."""
    if candidate.cost == "roofline":
        return roofline_step_cost(lab, question.model, candidate.gpu, candidate.tp)
    return step_cost(lab, question.model, candidate.gpu, candidate.tp, question.cpu_overhead_s)


def search_candidate(lab: ModuleType, question: FleetQuestion, candidate: Candidate, workload,
                     block_size: int = 16) -> Search | str:
    """The candidate's search, or why it cannot run (its weights do not fit, tp splits no KV head)."""
    try:
        plan = lab.plan_deployment(question.model, candidate.gpu, question.max_model_len,
                                   block_size=block_size, tensor_parallel_size=candidate.tp)
    except ValueError as exc:
        return str(exc)
    cost = candidate_step_cost(lab, question, candidate)
    # Each GPU of the decode replica receives its 1/tp of the K/V over its own link.
    transfer = lab.kv_bytes_per_token(lab.get_model(question.model)) / (candidate.tp * question.kv_link_bytes_per_s)
    _, prompts, outputs = workload
    start = _start_rate(cost, plan.num_kv_blocks, block_size, candidate, float(np.mean(prompts)),
                        float(np.mean(outputs)))

    def run_at(rate: float, stop_early: bool = True) -> LoadRun:
        return simulate_rate(lab, cost, workload, rate, question.slo, candidate, plan.num_kv_blocks, block_size,
                             stop_early, kv_transfer_s_per_token=transfer)
    search = search_max_rate(run_at, start, candidate=candidate)
    if search.max_rate == 0:  # by how much it misses, for "the nearest miss": the whole run
        search.miss = run_at(search.miss.rate, stop_early=False)
    return search


_JOB: dict = {}  # what forked workers inherit: (lab, question, candidates, workload)


def _search_job(index: int) -> Search | str:
    lab, question, candidates, workload = _JOB["args"]
    return search_candidate(lab, question, candidates[index], workload)


def _search_all(lab: ModuleType, question: FleetQuestion, candidates: list[Candidate], workload, jobs: int,
                log: Callable[[str], None]) -> list[Search | str]:
    """Every candidate's search, `jobs` at a time (forked processes), a progress line as each ends."""
    results: list = [None] * len(candidates)
    clock = time.perf_counter()

    def report(i: int, result) -> None:
        done = sum(r is not None for r in results)
        what = result if isinstance(result, str) else (
            f"{result.max_rate:.1f} req/s per replica ({result.num_runs} runs)" if result.max_rate
            else f"misses at every rate tried ({result.num_runs} runs)")
        on = "roofline" if candidates[i].cost == "roofline" else "measured" if has_profile(candidates[i].gpu) else \
            "roofline, no profile"
        elapsed = time.perf_counter() - clock
        log(f"  [{done:>2}/{len(candidates)} {elapsed:5.1f} s] {candidates[i].label} ({on}): {what}")

    if jobs > 1 and "fork" in multiprocessing.get_all_start_methods():
        _JOB["args"] = (lab, question, candidates, workload)
        try:
            with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
                futures = {pool.submit(_search_job, i): i for i in range(len(candidates))}
                for future in concurrent.futures.as_completed(futures):
                    i = futures[future]
                    results[i] = future.result()  # a stub's NotImplementedError comes back here
                    report(i, results[i])
        finally:
            _JOB.clear()
    else:
        for i, candidate in enumerate(candidates):
            results[i] = search_candidate(lab, question, candidate, workload)
            report(i, results[i])
    return results


def _price(question: FleetQuestion, gpu: str) -> float:
    prices = question.usd_per_gpu_hour
    return prices[0] if len(prices) == 1 else prices[question.gpus.index(gpu)]


def _rows(question: FleetQuestion, candidates: list[Candidate], results: list, mean_output: float) -> list[FleetRow]:
    rows = []
    for candidate, result in zip(candidates, results):
        if candidate.role != "both":
            continue
        key = (candidate.gpu, candidate.tp, candidate.max_num_seqs, candidate.max_num_batched_tokens)
        if isinstance(result, str):
            rows.append(FleetRow(candidate.label, [], note=f"does not fit: {result.split(':')[0]}", key=key))
            continue
        row = FleetRow(candidate.label, [result], key=key)
        if result.max_rate > 0:
            row.replicas, row.gpus = (fleet_size(question.qps, result.max_rate, candidate.tp)[0],), \
                fleet_size(question.qps, result.max_rate, candidate.tp)[1]
            row.usd_per_million = usd_per_million_output_tokens(row.gpus, _price(question, candidate.gpu),
                                                                question.qps, mean_output)
        rows.append(row)
    for gpu in question.gpus:  # disaggregated: the cheapest prefill pool with the cheapest decode pool
        pools = []
        for role in ("prefill", "decode"):
            found = [r for c, r in zip(candidates, results)
                     if c.gpu == gpu and c.role == role and not isinstance(r, str) and r.max_rate > 0]
            pools.append(min(found, key=lambda r: fleet_size(question.qps, r.max_rate, r.candidate.tp)[1],
                             default=None))
        if None in pools:
            continue
        sizes = [fleet_size(question.qps, r.max_rate, r.candidate.tp) for r in pools]
        label = (f"disaggregated {gpu}: prefill {sizes[0][0]} x tp{pools[0].candidate.tp} + decode "
                 f"{sizes[1][0]} x tp{pools[1].candidate.tp}")
        gpus = sizes[0][1] + sizes[1][1]
        rows.append(FleetRow(label, pools, (sizes[0][0], sizes[1][0]), gpus,
                             usd_per_million_output_tokens(gpus, _price(question, gpu), question.qps, mean_output),
                             key=("disaggregated", gpu)))
    return rows


_BOUND_WORDS = {"weights": "reading the weights", "kv": "reading the K/V cache", "compute": "the FLOPs of prefill "
                "chunks", "allreduce": "tensor parallelism's all-reduces", "linear": "the layers' matrix "
                "multiplications", "attention": "attention's K/V reads", "overhead": "the engine's CPU time"}


def binding_constraint(search: Search, slo: SLO) -> str:
    """In words, what stops the candidate one step above its largest rate: which target it
    missed there, and why (the step's slowest term, or what the waiting requests waited for)."""
    c, miss = search.candidate, search.miss
    if miss is None:
        return (f"meets the targets at every rate tried, up to {search.max_rate:.3g} req/s: the simulated requests "
                f"never queue (raise --num-requests)")
    if search.max_rate == 0:
        return f"misses even at {miss.rate:.2g} req/s: one request alone is too slow for the targets"
    ttft_missed = not miss.p99_ttft <= slo.ttft_s
    tpot_missed = not miss.p99_tpot <= slo.tpot_s
    words = []
    if tpot_missed and not ttft_missed or c.role == "decode":
        bound = max(miss.bound_time, key=miss.bound_time.get) if miss.bound_time else "weights"
        words.append(f"p99 TPOT binds: at {miss.rate:.1f} req/s the decode step averages "
                     f"{miss.mean_decode_step * 1e3:.1f} ms, most of it {_BOUND_WORDS[bound]}")
    else:
        reasons = {f"a seat (max_num_seqs = {c.max_num_seqs} sequences running)": miss.seats_full,
                   f"KV blocks (the cache was full; {miss.num_preemptions} preemptions)": miss.blocks_short,
                   f"the token budget (max_num_batched_tokens = {c.max_num_batched_tokens} spent)":
                       miss.budget_full}
        reason = max(reasons, key=reasons.get)
        share = reasons[reason] / max(miss.waiting_steps, 1)
        if miss.waiting_steps and reasons[reason]:
            words.append(f"p99 TTFT binds: at {miss.rate:.1f} req/s requests queue for prefill, waiting for "
                         f"{reason} in {100 * share:.0f}% of the steps that left one waiting")
        else:
            words.append(f"p99 TTFT binds: at {miss.rate:.1f} req/s prefill itself (steps of "
                         f"{miss.mean_step * 1e3:.1f} ms on average) is too slow for {slo.ttft_s * 1e3:g} ms")
    return "; ".join(words)


def _ms(value: float) -> str:
    return f"{value * 1e3:.0f}" if value < math.inf else "miss"


def _cell(row: FleetRow | None) -> str:
    """A row's GPUs and $ on the roofline, for the columns beside the measured ones."""
    if row is None or not row.gpus:
        return f"{'-':>5} {'-':>9}"
    return f"{row.gpus:>5} {row.usd_per_million:>9.2f}"


def explain_difference(lab: ModuleType, model, gpu: str, tp: int, batch: float, context: float,
                       cpu_overhead_s: float | None = None) -> str:
    """In words, why a decode step of `batch` sequences of `context` tokens each costs more measured
    than on the roofline on `tp` GPUs `gpu`: the GEMMs' efficiency at this shard size, attention,
    the all-reduces' latency at this tp, the CPU."""
    if not has_profile(gpu):
        return f"{gpu}: no published profile, so the roofline (a floor) answers for it"
    measured = step_cost(lab, model, gpu, tp, cpu_overhead_s)
    roofline = roofline_step_cost(lab, model, gpu, tp)
    seqs = max(1, round(batch))
    m, r = measured.parts(seqs, round(seqs * context)), roofline.parts(seqs, round(seqs * context))
    floor = max(r.weights, r.compute)
    n, k = max(measured.shape.gemms(tp).values(), key=lambda nk: nk[0] * nk[1])
    words = (f"{gpu} tp{tp}: a decode step of {seqs} sequences ({context:.0f} tokens of context each) takes "
             f"{m.total * 1e3:.1f} ms measured, {r.total * 1e3:.1f} ms on the roofline. The layers' GEMMs (the "
             f"largest {k:.0f} x {n:.0f} per GPU) with their norms and activations take {m.linear * 1e3:.1f} ms, "
             f"{floor / m.linear:.0%} of the roofline's speed ({floor * 1e3:.1f} ms); attention "
             f"{m.attention * 1e3:.1f} ms ({r.kv * 1e3:.1f})")
    if tp > 1:
        count = 2 * measured.num_layers
        link = INTERCONNECT_BYTES_PER_S.get(gpu, 0) / 1e9
        words += (f"; {count} all-reduces of {seqs * measured.shape.hidden * measured.shape.dtype_bytes / 1e6:.2f} MB "
                  f"{m.allreduce * 1e3:.1f} ms, {m.allreduce / count * 1e6:.0f} us each as a DGX measured them "
                  f"(the roofline assumes {ALLREDUCE_LATENCY_S * 1e6:.0f} us + {link:.0f} GB/s: "
                  f"{r.allreduce * 1e3:.1f} ms)")
    return words + f"; the engine's CPU {m.overhead * 1e3:.1f} ms a step (none on the roofline)."


def format_fleet(question: FleetQuestion, rows: list[FleetRow], mean_output: float,
                 explain: Callable[[str, int, float, float], str] | None = None) -> tuple[str, FleetRow | None]:
    """The table (cheapest first) with each row's roofline GPUs and $ beside it, why the two differ
    (`explain(gpu, tp, batch, context)` at each GPU and tp's decode step at its knee), the pick,
    the runner-up and what binds for each."""
    # The cheapest first; at one price, the most headroom (capacity beyond the QPS) first.
    met = sorted((r for r in rows if r.gpus), key=lambda r: (round(r.usd_per_million, 9), -r.capacity))
    unmet = [r for r in rows if not r.gpus]
    head = (f"{'candidate':<58} {'req/s/replica':>13} {'replicas':>9} {'GPUs':>5} {'$/1M out':>9} "
            f"{'p99 TTFT':>9} {'p99 TPOT':>9} | {'roofline: GPUs':>14} {'$':>5}")
    lines = [head, "-" * len(head)]
    for r in met + unmet:
        # A disaggregated row: TTFT is the prefill pool's, TPOT the decode pool's.
        best = {s.candidate.role: s.best for s in r.searches if s.best is not None}
        ttft = (best.get("both") or best.get("prefill")).p99_ttft if r.gpus else math.nan
        tpot = (best.get("both") or best.get("decode")).p99_tpot if r.gpus else math.nan
        mark = "" if r.measured or not r.searches else " *"
        if r.gpus:
            lines.append(f"{r.label + mark:<58} {r.max_rate:>13.1f} {'+'.join(map(str, r.replicas)):>9} {r.gpus:>5} "
                         f"{r.usd_per_million:>9.2f} {_ms(ttft):>6} ms {_ms(tpot):>6} ms | {_cell(r.roofline):>20}")
        else:
            lines.append(f"{r.label + mark:<58} {r.note or 'meets the targets at no rate tried'}"
                         + (f" | roofline: {r.roofline.gpus} GPUs, ${r.roofline.usd_per_million:.2f}"
                            if r.roofline is not None and r.roofline.gpus else ""))
    if not met:
        return "\n".join(lines), None
    lines.append("(measured: Vidur's operator profiles, fitted; roofline: peak figures, a floor. p99s at the "
                 "replica's largest rate; replicas = ceil(QPS / that rate); $ = GPUs x price per hour / output "
                 "tokens per hour at the QPS)")
    if any(not r.measured for r in met + unmet if r.searches):
        lines.append("(* no published profile for this GPU: costed by the roofline alone, a floor)")
    if explain is not None:
        lines += ["", "Why measured and roofline differ, at each GPU and tp's decode step at its knee:"]
        seen: set = set()
        for r in met:
            for s in r.searches:
                c, run = s.candidate, s.best
                key = (c.gpu, c.tp) if r.measured else c.gpu  # a GPU without a profile: one line says so
                if c.role == "prefill" or key in seen or run is None or not run.mean_decode_batch:
                    continue
                seen.add(key)
                lines.append(textwrap.fill(explain(c.gpu, c.tp, run.mean_decode_batch, run.mean_decode_context),
                                           width=118, initial_indent="  ", subsequent_indent="    "))
    pick = met[0]
    lines.append("")
    lines.append(f"Pick: {pick.label}: {pick.gpus} GPUs for {question.qps:g} req/s, "
                 f"${pick.usd_per_million:.2f} per 1M output tokens (mean output {mean_output:.0f} tokens).")
    floors = sorted((r.roofline for r in met + unmet if r.roofline is not None and r.roofline.gpus),
                    key=lambda r: (round(r.usd_per_million, 9), -r.capacity))
    if not pick.measured:
        lines.append("  Its GPU has no published profile: its figures are the roofline's, a floor, and the measured "
                     "candidates' are not comparable with them.")
    if floors:
        lines.append(f"  The roofline alone would pick {floors[0].label}: {floors[0].gpus} GPUs, "
                     f"${floors[0].usd_per_million:.2f} per 1M output tokens: a floor, not a forecast.")
    for title, row in (("Pick", pick), ("Runner-up", met[1] if len(met) > 1 else None)):
        if row is None:
            continue
        prefix = f"  {title} ({row.label}, {row.gpus} GPUs)" if title == "Runner-up" else f"  {title}"
        for s in row.searches:
            pool = "" if s.candidate.role == "both" else f" [{s.candidate.role} pool]"
            lines.append(f"{prefix}{pool}: {binding_constraint(s, question.slo)}.")
    return "\n".join(lines), pick


class NoCandidateMeets(ValueError):
    """No candidate meets the targets at any rate tried: the message names the nearest miss;
    `table` is the table of what was searched."""

    def __init__(self, table: str, message: str):
        super().__init__(message)
        self.table = table


def check_question(lab: ModuleType, question: FleetQuestion) -> None:
    """A ValueError naming the bad field (unknown presets, a rate or a target <= 0, ...)."""
    lab.get_model(question.model)
    for gpu in question.gpus:
        lab.get_gpu(gpu)
    for name in ("qps", "usd_per_gpu_hour", "kv_link_bytes_per_s"):
        values = getattr(question, name)
        for value in values if isinstance(values, tuple) else (values,):
            if not (lab.is_number(value) and 0 < value < math.inf):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    overhead = question.cpu_overhead_s
    if overhead is not None and not (lab.is_number(overhead) and 0 <= overhead < math.inf):
        raise ValueError(f"cpu_overhead_s must be a finite number of seconds >= 0, got {overhead!r}")
    for name, value in (("p99 TTFT target", question.slo.ttft_s), ("p99 TPOT target", question.slo.tpot_s)):
        if not (lab.is_number(value) and 0 < value < math.inf):
            raise ValueError(f"the {name} must be a finite number of seconds > 0, got {value!r}")
    if len(question.usd_per_gpu_hour) not in (1, len(question.gpus)):
        raise ValueError(f"give one GPU price, or one per GPU ({len(question.gpus)}), got "
                         f"{len(question.usd_per_gpu_hour)}")
    lab.check_int("num_requests", question.num_requests, minimum=20)
    workload_stats(lab, question.workload)


@dataclasses.dataclass
class FleetAnswer:
    text: str
    rows: list[FleetRow]
    pick: FleetRow | None


def run_fleet(lab: ModuleType, question: FleetQuestion, jobs: int = 1, log: Callable[[str], None] = print,
              candidates: list[Candidate] | None = None) -> FleetAnswer:
    """`python solution.py fleet`: search every candidate (default: the grid of `_candidates`
    and, with `question.disaggregation`, the prefill and decode pools), print a progress line per
    candidate, and return the table, the pick and what binds. Raises NoCandidateMeets (naming the
    nearest miss) when no candidate meets the targets at any rate."""
    check_question(lab, question)
    workload = fleet_workload(lab, question.workload, question.num_requests, question.seed, question.max_model_len)
    mean_output = float(np.mean(workload[2]))
    if candidates is None:
        candidates = _candidates(lab, question) + (_disaggregated(question) if question.disaggregation else [])
    slo = question.slo
    log(f"Fleet for {question.model} at {question.qps:g} req/s, p99 TTFT <= {slo.ttft_s * 1e3:g} ms and p99 TPOT "
        f"<= {slo.tpot_s * 1e3:g} ms, {question.workload} lengths (max_model_len {question.max_model_len}): "
        f"{len(candidates)} candidates, each on the measured step cost and the roofline (the roofline alone for a "
        f"GPU without a profile), "
        f"{question.num_requests} simulated requests per rate, the module's Scheduler")
    clock = time.perf_counter()
    # Every candidate on the measured cost, and again on the roofline where that differs (a GPU with a profile).
    searched = candidates + [dataclasses.replace(c, cost="roofline") for c in candidates
                             if c.cost == "measured" and has_profile(c.gpu)]
    results = _search_all(lab, question, searched, workload, jobs, log)
    log(f"searched in {time.perf_counter() - clock:.0f} s ({jobs} at a time)")
    found = dict(zip(searched, results))
    answers = [found[c] for c in candidates]
    floors = [found.get(dataclasses.replace(c, cost="roofline"), answer) for c, answer in zip(candidates, answers)]
    rows = _rows(question, candidates, answers, mean_output)
    roofline_rows = {r.key: r for r in _rows(question, candidates, floors, mean_output)}
    for row in rows:
        row.roofline = roofline_rows.get(row.key)

    def explain(gpu: str, tp: int, batch: float, context: float) -> str:
        return explain_difference(lab, question.model, gpu, tp, batch, context, question.cpu_overhead_s)
    text, pick = format_fleet(question, rows, mean_output, explain)
    if pick is None:
        searches = [r for r in answers if not isinstance(r, str) and r.max_rate == 0]
        if not searches:
            raise NoCandidateMeets(text, f"no candidate fits: {answers[0]}")

        def shortfall(s: Search) -> float:
            ratios = {"prefill": [s.miss.p99_ttft / slo.ttft_s], "decode": [s.miss.p99_tpot / slo.tpot_s]}
            return max(ratios.get(s.candidate.role, ratios["prefill"] + ratios["decode"]))
        nearest = min(searches, key=shortfall)
        c, run = nearest.candidate, nearest.miss
        raise NoCandidateMeets(text, (
            f"no candidate meets p99 TTFT <= {slo.ttft_s * 1e3:g} ms and p99 TPOT <= {slo.tpot_s * 1e3:g} ms "
            f"at any rate tried; nearest miss: {c.label} at {run.rate:.2g} req/s: "
            f"p99 TTFT {run.p99_ttft * 1e3:.0f} ms, "
            f"p99 TPOT {run.p99_tpot * 1e3:.1f} ms"))
    return FleetAnswer(text, rows, pick)
