"""What vs_vllm.py reads, apart from how it runs: the outputs of the two load generators and the
two servers' /metrics, parsed; the CPU this command's processes and the others took during a run;
and the tables it prints. Pure functions of recorded text and numbers, tested without vLLM
(tools/server/test_vs_vllm.py, on recorded outputs in tools/server/recorded/)."""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path

import numpy as np

LOGPROB_TOLERANCE = 1e-4  # float32 GEMMs in another order: the issue saw 2e-6
# The two load generators agree on a server when these measures are within these fractions. Throughput
# is compared all at once only: at a Poisson rate each generator draws its own arrivals, and over 64
# requests the run's length, so its tokens/s, moves by about 1/sqrt(64) = 12% with the draw.
AGREE = {"output_throughput": 0.05, "p50_tpot_ms": 0.10}
AT_ONCE_ONLY = ("output_throughput",)


# --- what the tools print, parsed -------

LATENCIES = ("ttft", "tpot", "itl", "e2e")


def parse_loadtest(text: str) -> list[dict]:
    """The rows of `loadtest`'s table (benchmark_serving.format_load_table), one per rate:
    rate, completed, failed, request_throughput, output_throughput, and p50/p90/p99 of each
    latency in ms (`p50_ttft_ms`, ...). ValueError if the table is not there."""
    lines = text.splitlines()
    heads = [i for i, line in enumerate(lines) if re.match(r"\s*rate\s+done\s+fail\s+req/s\s+tok/s", line)]
    if not heads:
        raise ValueError("no loadtest table (a line 'rate done fail req/s tok/s ...') in the output")
    rows = []
    for line in lines[heads[-1] + 1:]:
        parts = line.split("|")
        if len(parts) != 1 + len(LATENCIES):
            break
        rate, done, fail, rps, tps, _good = parts[0].split()
        row = {"rate": float(rate), "completed": int(done), "failed": int(fail),
               "request_throughput": float(rps), "output_throughput": float(tps)}
        for name, cell in zip(LATENCIES, parts[1:]):
            row |= {f"{p}_{name}_ms": float(v) for p, v in zip(("p50", "p90", "p99"), cell.split())}
        rows.append(row)
    return rows


def parse_vllm_bench(result: dict) -> dict:
    """`vllm bench serve --save-result`'s JSON in loadtest's names (its e2el is loadtest's e2e;
    its median is p50)."""
    row = {"rate": float(result.get("request_rate", math.inf)), "completed": int(result["completed"]),
           "failed": int(result.get("failed", 0)), "request_throughput": float(result["request_throughput"]),
           "output_throughput": float(result["output_throughput"])}
    for name, theirs in zip(LATENCIES, ("ttft", "tpot", "itl", "e2el")):
        for p, key in (("p50", "median"), ("p90", "p90"), ("p99", "p99")):
            if f"{key}_{theirs}_ms" in result:
                row[f"{p}_{name}_ms"] = float(result[f"{key}_{theirs}_ms"])
    return row


SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)$")


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text as {(name, ((label, value), ...)): value}; comments skipped."""
    samples = {}
    for line in text.splitlines():
        match = SAMPLE.match(line.strip())
        if not match or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        pairs = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', labels or "")))
        samples[(name, pairs)] = float(value)
    return samples


COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total", "vllm:iteration_tokens_total_sum",
            "vllm:iteration_tokens_total_count")


def counters(text: str) -> dict[str, float]:
    """The counters the comparison reads, summed over labels other than finished_reason and le:
    COUNTERS, `vllm:request_success_total{finished_reason=R}` as "finished R", the buckets of
    vllm:iteration_tokens_total as "steps <= B" (cumulative; B as a float), and the gauge
    vllm:num_requests_running as "running now"."""
    found: dict[str, float] = {}
    for (name, labels), value in parse_metrics(text).items():
        tags = dict(labels)
        if name in COUNTERS:
            key = name
        elif name == "vllm:request_success_total":
            key = f"finished {tags.get('finished_reason')}"
        elif name == "vllm:iteration_tokens_total_bucket":
            key = f"steps <= {float(tags['le']):g}"
        elif name == "vllm:num_requests_running":
            key = "running now"
        else:
            continue
        found[key] = found.get(key, 0.0) + value
    return found


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


# --- this command's processes, and the CPU the others took -----------------------------------------

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def own_ticks(root: int | None = None) -> int:
    """CPU ticks of `root` (this process) and every descendant alive, each with the ticks of the
    children it reaped (a finished load generator's are this process's)."""
    root = os.getpid() if root is None else root
    stats = {int(p): f for p in os.listdir("/proc") if p.isdigit() and (f := stat_fields(int(p)))}
    children: dict[int, list[int]] = {}
    for pid, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(pid)  # after the name: state, ppid, ...
    total = 0
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += sum(int(x) for x in stats[pid][11:15])  # utime stime cutime cstime
        todo += children.get(pid, [])
    return total


def busy_ticks() -> int:
    """The machine's busy ticks, all cores: /proc/stat's cpu line less idle and iowait."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]


class CpuMeter:
    """Over one run: the load average, and the cores other jobs kept busy (busy time less ours)."""

    def __enter__(self) -> CpuMeter:
        self.start = time.monotonic()
        self.busy = busy_ticks()
        self.own = own_ticks()
        return self

    def __exit__(self, *exc) -> None:
        seconds = max(time.monotonic() - self.start, 1e-9)
        others = (busy_ticks() - self.busy) - (own_ticks() - self.own)
        self.other_cores = max(others, 0) / TICK / seconds
        self.load = os.getloadavg()[0]


def greedy_agreement(lab_side: list, vllm_side: list) -> tuple[bool, str]:
    """Whether every prompt's tokens are equal and its first logprobs within LOGPROB_TOLERANCE."""
    same = sum(a[0] == b[0] for a, b in zip(lab_side, vllm_side))
    gap = max(abs(a[1] - b[1]) for a, b in zip(lab_side, vllm_side))
    ok = same == len(lab_side) == len(vllm_side) and gap <= LOGPROB_TOLERANCE
    return ok, (f"greedy tokens identical on {same} of {len(lab_side)} prompts; first logprobs at most {gap:.1e} "
                f"apart (tolerance {LOGPROB_TOLERANCE:g})")


# --- the tables --------------------------------------------------------------------------------------

MEASURES = (("output_throughput", "output tokens/s", "{:.0f}"), ("p50_ttft_ms", "TTFT p50 ms", "{:.1f}"),
            ("p90_ttft_ms", "TTFT p90 ms", "{:.1f}"), ("p50_tpot_ms", "TPOT p50 ms", "{:.1f}"),
            ("p90_tpot_ms", "TPOT p90 ms", "{:.1f}"), ("p50_itl_ms", "ITL p50 ms", "{:.1f}"))


def mean_of(runs: list[dict], key: str, **match) -> float:
    values = [r["row"][key] for r in runs if all(r[k] == v for k, v in match.items()) and key in r["row"]]
    return float(np.mean(values)) if values else math.nan


def speed_table(runs: list[dict], loads: list[str]) -> str:
    """`| load | measure | lab | vLLM | lab / vLLM |`: the lab's loadtest on each server, the mean over rounds."""
    lines = ["| load | measure | lab | vLLM | lab / vLLM |", "| --- | --- | --- | --- | --- |"]
    for load in loads:
        for key, label, fmt in MEASURES:
            lab, vllm = (mean_of(runs, key, engine=e, generator="loadtest", load=load) for e in ("lab", "vLLM"))
            lines.append(f"| {load} | {label} | {fmt.format(lab)} | {fmt.format(vllm)} | {lab / vllm:.2f}x |")
    return "\n".join(lines)


def generators_table(runs: list[dict], loads: list[str]) -> tuple[str, bool]:
    """loadtest against vllm bench serve on each server (means over rounds), and whether every
    AGREE measure is within its margin (`loads[0]` is all at once)."""
    lines = ["| server | load | measure | loadtest | vllm bench | vllm bench / loadtest | within |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    every = True
    for engine in ("lab", "vLLM"):
        for load in loads:
            for key, margin in AGREE.items():
                if key in AT_ONCE_ONLY and load != loads[0]:
                    continue
                ours, theirs = (mean_of(runs, key, engine=engine, generator=g, load=load)
                                for g in ("loadtest", "vllm bench"))
                within = abs(theirs / ours - 1) <= margin
                every &= within
                lines.append(f"| {engine} | {load} | {key} | {ours:.1f} | {theirs:.1f} | {theirs / ours:.3f} | "
                             f"{'yes' if within else 'NO'} (±{margin:.0%}) |")
    return "\n".join(lines), every


def counters_table(counted: dict[str, dict[str, dict[str, float]]]) -> str:
    """What each server's /metrics counted in each behaviour workload, under vLLM's names."""
    lines = []
    for workload, by_engine in counted.items():
        lines += [f"\n{workload}:", "| counter | lab | vLLM |", "| --- | --- | --- |"]
        keys = sorted(set().union(*map(set, by_engine.values())), key=_counter_order)
        for key in keys:
            lab, vllm = (by_engine.get(e, {}).get(key, math.nan) for e in ("lab", "vLLM"))
            if key.startswith("steps <=") and lab == vllm == 0:
                continue
            lines.append(f"| {key} | {lab:.0f} | {vllm:.0f} |")
        for engine in ("lab", "vLLM"):
            got = by_engine.get(engine, {})
            steps = got.get("vllm:iteration_tokens_total_count", 0)
            if steps:
                lines.append(f"| tokens per step, mean ({engine}) | "
                             f"{got['vllm:iteration_tokens_total_sum'] / steps:.1f} | |")
    return "\n".join(lines)


def _counter_order(key: str) -> tuple:
    if key in COUNTERS:
        return (0, COUNTERS.index(key), 0.0)
    if key.startswith("steps <="):
        return (2, 0, float(key.split()[-1]))
    return (1 if key.startswith("finished") else 3, 0, key)
