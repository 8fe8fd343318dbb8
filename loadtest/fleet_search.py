"""The fleet's search: for one candidate deployment (GPU, tensor-parallel degree, max_num_seqs,
max_num_batched_tokens, or a pool of a disaggregated fleet), the largest request rate one replica
serves with at least 99% of requests inside both p99 targets, found by binary search over runs of
the module's own Scheduler, each step costed as the simulator costs it (`simulate_rate`).
course/reviews/fleet.py turns the searches into the table, the pick and the words; the docstring
there says what `fleet` answers.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import multiprocessing
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np

from measure.latency import nearest_rank, nearest_rank_quantile

from .costmodel import (
    MeasuredStepCost,
    RooflineStepCost,
    has_profile,
    roofline_step_cost,
    step_cost,
)
from .datasets import sample_request_lengths, workload_stats

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


def allowed_misses(n: int, q: float = SLO_QUANTILE) -> int:
    """How many of `n` requests may miss a target while the q-quantile by nearest rank meets it."""
    return n - nearest_rank(n, q)


def fleet_workload(lab: ModuleType, name: str, num_requests: int, seed: int, max_model_len: int):
    """(unit arrival times, prompt lengths, output lengths): Poisson arrivals at 1 request/s,
    divided by the rate at each rate tried (the same requests at every rate, so a search compares
    like with like)."""
    prompts, outputs = sample_request_lengths(lab, workload_stats(lab, name), num_requests, seed, max_model_len)
    gaps = np.random.default_rng(seed + 7).exponential(1.0, num_requests)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]), prompts.tolist(), outputs.tolist()


def _role_workload(workload, role: str) -> tuple[list, list, list]:
    """(unit arrival times, prompt lengths, output lengths) a pool of `role` serves: "prefill" runs
    each prompt to its first token; "decode" each request from its second token, its prompt one
    longer (the first token came from the prefill pool; a request with no second is not here)."""
    unit_arrivals, prompts, outputs = workload
    if role == "prefill":
        outputs = [1] * len(prompts)
    if role == "decode":
        keep = [i for i, o in enumerate(outputs) if o > 1]
        unit_arrivals = [unit_arrivals[i] for i in keep]
        prompts, outputs = [prompts[i] + 1 for i in keep], [outputs[i] - 1 for i in keep]
    return unit_arrivals, prompts, outputs


def _step_shape(plan, role: str) -> tuple[int, int, int, bool, dict[str, int]]:
    """(tokens charged, context tokens read, query-key pairs attention computes (causal), whether a
    prefill runs, the token each sequence that completes samples) of a planned step, in one pass
    over its sequences. A decode pool's first step of a request imports its prompt's K/V: no FLOPs
    for it, only the last token's."""
    tokens = plan.total_num_scheduled_tokens
    context = 0
    pairs = 0
    prefill = False
    sampled = {}
    scheduled_tokens = plan.num_scheduled_tokens
    for s in plan.scheduled:
        new = scheduled_tokens[s.request_id]
        done = s.num_computed_tokens
        if plan.completes(s):
            sampled[s.request_id] = 0
        context += done + new
        if new > 1:
            prefill = True
            if role == "decode" and done == 0 and s.num_preemptions == 0:
                tokens -= new - 1  # the imported K/V: no FLOPs, only the last token's
                done, new = done + new - 1, 1
        pairs += new * done + new * (new + 1) // 2
    return tokens, context, pairs, prefill, sampled


def _step_seconds(cost, tokens: int, context: int, pairs: int):
    """(seconds, its parts by term or None) of one step on `cost`."""
    if isinstance(cost, MeasuredStepCost):
        parts = cost.parts(tokens, context, pairs)
    else:
        parts = cost.parts(tokens, context) if isinstance(cost, RooflineStepCost) else None
    step = parts.total if parts is not None else cost.step_time(tokens, context)
    return step, parts


@dataclasses.dataclass
class _Counted:
    """The counted requests' TTFTs and TPOTs so far, and how many of them missed a target."""

    ttfts: list = dataclasses.field(default_factory=list)
    tpots: list = dataclasses.field(default_factory=list)
    misses: int = 0

    def finished(self, s, prompt_len: int, role: str, slo: SLO, kv_transfer_s_per_token: float) -> None:
        """A request that finished: its TTFT, and its TPOT from its second token (a decode pool's
        counts the K/V transfer before it)."""
        ttft = s.token_times[0] - s.arrival_time
        self.ttfts.append(ttft)
        self.misses += role != "decode" and ttft > slo.ttft_s
        if len(s.token_times) > 1 or role == "decode":
            transfer = kv_transfer_s_per_token * (prompt_len - 1) if role == "decode" else 0.0
            gaps = len(s.token_times) - 1 + (role == "decode")
            start = s.arrival_time - transfer if role == "decode" else s.token_times[0]
            tpot = (s.token_times[-1] - start) / gaps
            self.tpots.append(tpot)
            self.misses += role != "prefill" and tpot > slo.tpot_s


def _count_waiting(run: LoadRun, lab: ModuleType, scheduler, plan, candidate: Candidate, block_size: int) -> None:
    """A step that ended with an arrived request still waiting: what it waited for."""
    run.waiting_steps += 1
    head = scheduler.waiting[0]
    if len(scheduler.running) >= candidate.max_num_seqs:
        run.seats_full += 1
    elif plan.total_num_scheduled_tokens >= candidate.max_num_batched_tokens:
        run.budget_full += 1
    elif plan.preempted or scheduler.allocator.num_free_blocks < lab.blocks_needed(
            min(head.num_tokens, candidate.max_num_batched_tokens), block_size):
        run.blocks_short += 1


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
    role = candidate.role
    unit_arrivals, prompts, outputs = _role_workload(workload, role)
    n = len(prompts)
    first = int(warmup * n)  # the first request counted
    budget = allowed_misses(n - first)
    scheduler = lab.make_scheduler("continuous", lab.BlockAllocator(num_blocks, block_size), candidate.max_num_seqs,
                                   candidate.max_num_batched_tokens, True)
    arrivals = [t / rate for t in unit_arrivals]
    seqs = []
    counted = _Counted()
    clock = 0.0
    nxt = 0
    run = LoadRun(rate, False, math.nan, math.nan, False)
    decode = dict(time=0.0, steps=0, seqs=0, context=0)  # the steps that ran no prefill
    while nxt < n or scheduler.has_unfinished():
        if not scheduler.has_unfinished() and arrivals[nxt] > clock:
            clock = arrivals[nxt]
        while nxt < n and arrivals[nxt] <= clock:
            sampling = lab.SamplingParams(max_tokens=outputs[nxt])
            seq = scheduler.add_request(lab.Request(str(nxt), [0] * prompts[nxt], sampling, arrivals[nxt]))
            seqs.append(seq)
            if seq.finish_reason == "rejected" and nxt >= first:
                counted.misses += 1
            nxt += 1
        if not scheduler.has_unfinished():
            continue
        plan = scheduler.plan_step()
        tokens, context, pairs, prefill, sampled = _step_shape(plan, role)
        step, parts = _step_seconds(cost, tokens, context, pairs)
        clock += step
        if parts is not None:
            run.bound_time[parts.bound] = run.bound_time.get(parts.bound, 0.0) + step
        if not prefill:
            decode["time"] += step
            decode["steps"] += 1
            decode["seqs"] += len(plan.scheduled)
            decode["context"] += context
        run.num_steps += 1
        for s in scheduler.finish_step(plan, sampled, clock):
            if int(s.request_id) >= first:
                counted.finished(s, prompts[int(s.request_id)], role, slo, kv_transfer_s_per_token)
        if scheduler.waiting and nxt > 0:
            _count_waiting(run, lab, scheduler, plan, candidate, block_size)
        if stop_early and counted.misses > budget:
            break
    run.finished = not (nxt < n or scheduler.has_unfinished())
    run.num_preemptions = scheduler.num_preemptions
    _conclude(run, clock, decode, seqs[first:], counted, n - first, budget)
    return run


def _conclude(run: LoadRun, clock: float, decode: dict, counted_seqs: list, counted: _Counted, num_counted: int,
              budget: int) -> None:
    """The run's means, its p99s by nearest rank (an SLO's: `nearest_rank_quantile` says why; a run
    stopped early counts the requests still waiting or running as misses) and whether it meets both
    targets."""
    run.mean_step = clock / max(run.num_steps, 1) if run.num_steps else math.nan
    run.mean_decode_step = decode["time"] / decode["steps"] if decode["steps"] else math.nan
    if decode["steps"]:
        run.mean_decode_batch = decode["seqs"] / decode["steps"]
        run.mean_decode_context = decode["context"] / decode["seqs"]
    ttfts, tpots = counted.ttfts, counted.tpots
    if run.finished:
        rejected = sum(s.finish_reason == "rejected" for s in counted_seqs)
        run.p99_ttft = nearest_rank_quantile(ttfts + [math.inf] * rejected, SLO_QUANTILE)
        run.p99_tpot = nearest_rank_quantile(tpots, SLO_QUANTILE)
    else:  # stopped early: the requests still waiting or running have missed or will miss
        run.p99_ttft = nearest_rank_quantile(ttfts + [math.inf] * (num_counted - len(ttfts)), SLO_QUANTILE)
        run.p99_tpot = nearest_rank_quantile(tpots + [math.inf] * (num_counted - len(tpots)), SLO_QUANTILE)
    run.meets = counted.misses <= budget and run.finished
    if run.finished:
        run.attainment = 1 - counted.misses / max(num_counted, 1)


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


def fleet_size(qps: float, rate_per_replica: float, tp: int) -> tuple[int, int]:
    """(replicas, GPUs) to serve `qps` when one replica of `tp` GPUs serves `rate_per_replica`."""
    replicas = math.ceil(qps / rate_per_replica * (1 - 1e-12))  # 100 / 25 is 4, not 5, in floating point
    return replicas, replicas * tp


def search_replicas(run_at: Callable[[float], LoadRun], qps: float, start: float, lowest: float | None = None,
                    candidate: Candidate | None = None) -> Search:
    """The fewest replicas that serve `qps`: the smallest k where `run_at(qps / k).meets` (the same
    monotonicity search_max_rate assumes), when only the replicas matter (the roofline's GPUs and $).
    It starts on the optimistic side, at twice `start`: a rate that misses is a run stopped early,
    one that meets runs every request, so it climbs by misses (k grows by a quarter, at least 1)
    to the first meet, then bisects the k's between. The result's rate is qps / k, its best run
    the one there, its miss the run at qps / (k - 1) (None when one replica serves); 0 when even
    `lowest` (default start / 256) misses."""
    runs: dict[int, LoadRun] = {}

    def at(k: int) -> LoadRun:
        runs[k] = run_at(qps / k)
        return runs[k]

    lowest = start / 256 if lowest is None else lowest
    bad, good = 0, math.ceil(qps / (2 * start))  # k = 0: no replica, which serves nothing
    while not at(good).meets:
        bad, good = good, good + max(1, good // 4)
        if qps / good < lowest:
            return Search(candidate, 0.0, None, runs[bad], len(runs))
    while bad == 0 and good > 1:  # the optimistic start met: fewer replicas, by halves, to a miss
        half = good // 2
        good, bad = (half, 0) if at(half).meets else (good, half)
    while good - bad > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if at(mid).meets else (good, mid)
    return Search(candidate, qps / good, runs[good], runs.get(bad), len(runs))


# --- the question, and every candidate searched ------------------------------------------


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


def colocated_candidates(lab: ModuleType, question: FleetQuestion) -> list[Candidate]:
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


def disaggregated_candidates(question: FleetQuestion) -> list[Candidate]:
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
    if candidate.cost == "roofline":  # its table column is GPUs and $ alone: the replicas give both
        search = search_replicas(run_at, question.qps, start, candidate=candidate)
    else:
        search = search_max_rate(run_at, start, candidate=candidate)
    if search.max_rate == 0:  # by how much it misses, for "the nearest miss": the whole run
        search.miss = run_at(search.miss.rate, stop_early=False)
    return search


def _found(search: Search, qps: float) -> str:
    """A search's result for its progress line: a roofline search looks for the replicas alone."""
    if not search.max_rate:
        return f"misses at every rate tried ({search.num_runs} runs)"
    if search.candidate.cost == "roofline":
        replicas = fleet_size(qps, search.max_rate, search.candidate.tp)[0]
        return f"{replicas} replica{'s' * (replicas != 1)} for {qps:g} req/s ({search.num_runs} runs)"
    return f"{search.max_rate:.1f} req/s per replica ({search.num_runs} runs)"


_JOB: dict = {}  # what forked workers inherit: (lab, question, candidates, workload)


def _search_job(index: int) -> Search | str:
    lab, question, candidates, workload = _JOB["args"]
    return search_candidate(lab, question, candidates[index], workload)


def search_all(lab: ModuleType, question: FleetQuestion, candidates: list[Candidate], workload, jobs: int,
                log: Callable[[str], None]) -> list[Search | str]:
    """Every candidate's search, `jobs` at a time (forked processes), a progress line as each ends.
    The prefill pools' go first: they decode nothing, so their lines come within the first second."""
    results: list = [None] * len(candidates)
    order = sorted(range(len(candidates)), key=lambda i: candidates[i].role != "prefill")
    clock = time.perf_counter()

    def report(i: int, result) -> None:
        done = sum(r is not None for r in results)
        what = result if isinstance(result, str) else _found(result, question.qps)
        on = "roofline" if candidates[i].cost == "roofline" else "measured" if has_profile(candidates[i].gpu) else \
            "roofline, no profile"
        elapsed = time.perf_counter() - clock
        log(f"  [{done:>2}/{len(candidates)} {elapsed:5.1f} s] {candidates[i].label} ({on}): {what}")

    if jobs > 1 and "fork" in multiprocessing.get_all_start_methods():
        _JOB["args"] = (lab, question, candidates, workload)
        try:
            with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
                futures = {pool.submit(_search_job, i): i for i in order}
                for future in concurrent.futures.as_completed(futures):
                    i = futures[future]
                    results[i] = future.result()  # a stub's NotImplementedError comes back here
                    report(i, results[i])
        finally:
            _JOB.clear()
    else:
        for i in order:
            results[i] = search_candidate(lab, question, candidates[i], workload)
            report(i, results[i])
    return results


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
