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

This module turns the searches into the fleet's table (cheapest first), the pick, the runner-up
and what binds each, in words; loadtest/fleet_search.py holds the search, ../pages/fleet_page.py the page.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np

from loadtest.costmodel import (
    ALLREDUCE_LATENCY_S,
    INTERCONNECT_BYTES_PER_S,
    has_profile,
    roofline_step_cost,
    step_cost,
)
from loadtest.fleet_search import (
    SLO,
    Candidate,
    FleetQuestion,
    Search,
    check_question,
    colocated_candidates,
    disaggregated_candidates,
    fleet_size,
    fleet_workload,
    search_all,
)


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


def usd_per_million_output_tokens(num_gpus: int, usd_per_gpu_hour: float, qps: float, mean_output_len: float) -> float:
    """The fleet's hourly price over the output tokens it makes in an hour at `qps`."""
    return num_gpus * usd_per_gpu_hour / (qps * mean_output_len * 3600) * 1e6


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
            replicas, row.gpus = fleet_size(question.qps, result.max_rate, candidate.tp)
            row.replicas = (replicas,)
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


def _count(count: int, one: str, many: str | None = None) -> str:
    return f"{count} {one if count == 1 else many or one + 's'}"


def _gpus(count: int) -> str:
    return _count(count, "GPU")


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


def _table(met: list[FleetRow], unmet: list[FleetRow]) -> list[str]:
    """The table's lines: the rows that met the SLO (cheapest first), then those that did not."""
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
                         + (f" | roofline: {_gpus(r.roofline.gpus)}, ${r.roofline.usd_per_million:.2f}"
                            if r.roofline is not None and r.roofline.gpus else ""))
    return lines


def _explanations(met: list[FleetRow], explain: Callable[[str, int, float, float], str]) -> list[str]:
    """Why measured and roofline differ, once for each GPU and tp of a row that met the SLO."""
    lines = ["", "Why measured and roofline differ, at each GPU and tp's decode step at its knee:"]
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
    return lines


def _pick(question: FleetQuestion, met: list[FleetRow], unmet: list[FleetRow], mean_output: float) -> list[str]:
    """The pick, what the roofline alone would pick, and what binds the pick and the runner-up."""
    pick = met[0]
    lines = ["", f"Pick: {pick.label}: {_gpus(pick.gpus)} for {question.qps:g} req/s, "
                 f"${pick.usd_per_million:.2f} per 1M output tokens (mean output {mean_output:.0f} tokens)."]
    # The roofline's searches find replicas, not rates (search_replicas): at one price, the floor of
    # the row the measured table ranks first.
    floors = sorted((r.roofline for r in met + unmet if r.roofline is not None and r.roofline.gpus),
                    key=lambda r: round(r.usd_per_million, 9))
    if not pick.measured:
        lines.append("  Its GPU has no published profile: its figures are the roofline's, a floor, and the measured "
                     "candidates' are not comparable with them.")
    if floors:
        lines.append(f"  The roofline alone would pick {floors[0].label}: {_gpus(floors[0].gpus)}, "
                     f"${floors[0].usd_per_million:.2f} per 1M output tokens: a floor, not a forecast.")
    limits = [("the pick", pick)] + [(f"the runner-up ({row.label}, {_gpus(row.gpus)})", row) for row in met[1:2]]
    for title, row in limits:
        for s in row.searches:
            pool = "" if s.candidate.role == "both" else f" [{s.candidate.role} pool]"
            lines.append(f"  What limits {title}{pool}: {binding_constraint(s, question.slo)}.")
    return lines


def format_fleet(question: FleetQuestion, rows: list[FleetRow], mean_output: float,
                 explain: Callable[[str, int, float, float], str] | None = None) -> tuple[str, FleetRow | None]:
    """The table (cheapest first) with each row's roofline GPUs and $ beside it, why the two differ
    (`explain(gpu, tp, batch, context)` at each GPU and tp's decode step at its knee), the pick,
    the runner-up and what binds for each."""
    # The cheapest first; at one price, the most headroom (capacity beyond the QPS) first.
    met = sorted((r for r in rows if r.gpus), key=lambda r: (round(r.usd_per_million, 9), -r.capacity))
    unmet = [r for r in rows if not r.gpus]
    lines = _table(met, unmet)
    if not met:
        return "\n".join(lines), None
    lines.append("(measured: Vidur's operator profiles, fitted; roofline: peak figures, a floor. p99s at the "
                 "replica's largest rate; replicas = ceil(QPS / that rate); $ = GPUs x price per hour / output "
                 "tokens per hour at the QPS)")
    if any(not r.measured for r in met + unmet if r.searches):
        lines.append("(* no published profile for this GPU: costed by the roofline alone, a floor)")
    if explain is not None:
        lines += _explanations(met, explain)
    return "\n".join(lines + _pick(question, met, unmet, mean_output)), met[0]


class NoCandidateMeets(ValueError):
    """No candidate meets the targets at any rate tried: the message names the nearest miss;
    `table` is the table of what was searched."""

    def __init__(self, table: str, message: str):
        super().__init__(message)
        self.table = table


@dataclasses.dataclass
class FleetAnswer:
    text: str
    rows: list[FleetRow]
    pick: FleetRow | None


def run_fleet(lab: ModuleType, question: FleetQuestion, jobs: int = 1, log: Callable[[str], None] = print,
              candidates: list[Candidate] | None = None) -> FleetAnswer:
    """`python solution.py fleet`: search every candidate (default: the grid of `colocated_candidates`
    and, with `question.disaggregation`, the prefill and decode pools), print a progress line per
    candidate, and return the table, the pick and what binds. Raises NoCandidateMeets (naming the
    nearest miss) when no candidate meets the targets at any rate."""
    check_question(lab, question)
    workload = fleet_workload(lab, question.workload, question.num_requests, question.seed, question.max_model_len)
    mean_output = float(np.mean(workload[2]))
    if candidates is None:
        candidates = colocated_candidates(lab, question)
        if question.disaggregation:
            candidates += disaggregated_candidates(question)
    slo = question.slo
    # Every candidate on the measured cost, and again on the roofline where that differs (a GPU with a profile).
    searched = candidates + [dataclasses.replace(c, cost="roofline") for c in candidates
                             if c.cost == "measured" and has_profile(c.gpu)]
    log(f"Fleet for {question.model} at {question.qps:g} req/s, p99 TTFT <= {slo.ttft_s * 1e3:g} ms and p99 TPOT "
        f"<= {slo.tpot_s * 1e3:g} ms, {question.workload} lengths (max_model_len {question.max_model_len}): "
        f"{_count(len(candidates), 'candidate')}, {_count(len(searched), 'search', 'searches')} (each candidate on "
        f"the measured step cost and on the roofline; the roofline alone for a GPU without a profile), "
        f"{question.num_requests} simulated requests per rate, the module's Scheduler; {jobs} at a time, a line as "
        f"each search ends")
    clock = time.perf_counter()
    results = search_all(lab, question, searched, workload, jobs, log)
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
