#!/usr/bin/env python3
"""The simulator against the served engine: calibrate, predict what `loadtest` will measure, then
measure it, side by side in one run, and print the error table.

    python -m tools.fleet.bench_simulator                   # the toy model, then the GPT-2-124M-shaped one
    python -m tools.fleet.bench_simulator --model toy --qps 8,32,64,128,192 --num-prompts 200

For each model:
1. Calibrate (in this process): an engine built as `python solution.py serve` builds it runs a
   calibration workload step by step; each step's (scheduled tokens, context tokens, seconds)
   goes into `loadtest.costmodel.fit_step_cost` (a sum: fixed + per token + per context token).
2. Probe the server (`python <module>.py serve --port 0`, 127.0.0.1 only): a few requests one at
   a time. Their TTFT and TPOT minus what the fit predicts for the same shapes are the server's
   own terms: a fixed hop per request (the front end's process, HTTP, the pipes) and a cost per
   step (streaming each token out, the engine thread's wake-ups).
3. Predict with `loadtest.simulate_serving` (the module's Scheduler, the fitted cost; with and
   without the server's terms) what `loadtest` will measure at each rate: p50/p99 TTFT, p50/p99
   TPOT and output tokens/s, for the very requests and Poisson arrivals loadtest sends.
4. Measure with the load generator (`loadtest.benchmark_serving.run_load`), and print both and
   the error (predicted / measured - 1), and the knee (find_knee) of each.

Timings are wall-clock on whatever else the machine runs: on a shared 2-core VM other processes
take turns with the server, and the figures move with them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from course import commands
from course.pages import svg
from course.pages.report import latency
from loadtest import benchmark_serving, costmodel, datasets
from loadtest.simulator import simulate_serving
from serving.sampling import logits_processors
from tools.bench_common import DEFAULT_MODULE, with_one_blas_thread

# The two served models: `serve`'s default toy, and GPT-2 small's shape (random weights).
MODELS = {
    "toy": dict(commands.SERVE_MODEL),
    "gpt2-124m": dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12),
}
# Per model: the load-test workload, the rates (light load to past the knee), requests per rate.
PLANS = {
    "toy": ("alpaca", [16, 48, 96, 144, 192], 200),
    "gpt2-124m": ("tiny", [2, 4, 8, 12, 16], 60),
}
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 512
BLOCK_SIZE = 16


def build_engine(lab, config: dict):
    """The engine `python <module>.py serve` builds for this model shape (seed 0)."""
    model = lab.ToyTransformer(lab.ModelConfig(**config), seed=0)
    return lab.LLMEngine(model, max_num_seqs=MAX_NUM_SEQS, logits_processors=logits_processors(),
                         block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)


BURSTS = (1, 2, 4, 8, 16, 32)  # requests added at once, in turn: the batch sweeps its sizes


def measure_steps(lab, engine, requests, arrivals_every: int = 6, max_seconds: float = 60.0):
    """(scheduled tokens, context tokens, seconds) of each step of `engine` over `requests`,
    added in bursts of BURSTS in turn, `arrivals_every` steps apart (so the batch grows and
    shrinks through its sizes, as under load)."""
    plans = []
    original = engine.scheduler.plan_step

    def recording_plan_step():
        plan = original()
        plans.append((plan.total_num_scheduled_tokens,
                      sum(s.num_computed_tokens + plan.num_scheduled_tokens[s.request_id] for s in plan.scheduled)))
        return plan
    engine.scheduler.plan_step = recording_plan_step  # an instance attribute: the class is untouched
    samples = []
    pending = list(requests)
    deadline = time.perf_counter() + max_seconds
    step = 0
    try:
        while (pending or engine.has_unfinished()) and time.perf_counter() < deadline:
            if pending and step % arrivals_every == 0:
                for r in pending[:BURSTS[step // arrivals_every % len(BURSTS)]]:
                    engine.add_request(r.prompt_token_ids, lab.SamplingParams(max_tokens=r.max_tokens))
                del pending[:BURSTS[step // arrivals_every % len(BURSTS)]]
            if not engine.has_unfinished():
                step += 1
                continue
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            if plans:
                samples.append((*plans[-1], seconds))
                plans.clear()
            step += 1
    finally:
        del engine.scheduler.plan_step
    return samples


def start_server(module_file: str, config: dict) -> tuple[subprocess.Popen, str]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in config.items()]
    proc = subprocess.Popen([sys.executable, module_file, "serve", "--port", "0", "--host", "127.0.0.1",
                             "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens",
                             str(MAX_NUM_BATCHED_TOKENS), *flags], stdout=subprocess.PIPE, text=True)
    found = re.search(r"http://127\.0\.0\.1:\d+", proc.stdout.readline())
    if not found:
        proc.kill()
        raise RuntimeError("the server did not start")
    return proc, found.group(0)


def probe(lab, url: str, model: str, fit, count: int = 8, prompt_len: int = 16, max_tokens: int = 32):
    """The server's own terms, from `count` lone requests (one token per step): (hop, excess).
    hop: their median TTFT minus the fit's prefill step (the front end's process, HTTP, the pipes);
    excess: every gap between two tokens minus the fit's decode step, an empirical distribution
    (its median: streaming one token out; its tail: the OS's wake-ups on a busy machine)."""
    ttfts, excess = [], []
    for i in range(count):
        payload = {"model": model, "prompt": [(7 * i + j) % 200 + 1 for j in range(prompt_len)],
                   "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True}
        result = benchmark_serving.stream_completion(url, payload, 30.0)
        metrics = benchmark_serving.stream_metrics(lab, result)
        ttfts.append(metrics.ttft)
        excess += [gap - fit.step_time(1, prompt_len + t) for t, gap in enumerate(metrics.itl, 1)]
    hop = float(np.median(ttfts)) - fit.step_time(prompt_len, prompt_len)
    return max(hop, 0.0), np.maximum(np.array(excess), 0.0)


def predict(lab, requests, rate: float, seed: int, cost, hop: float) -> dict:
    """What the simulator says loadtest will measure: the same requests at the same arrivals."""
    arrivals = datasets.poisson_arrival_times(rate, len(requests), seed)
    workload = [(float(t), len(r.prompt_token_ids), r.max_tokens) for t, r in zip(arrivals, requests)]
    sim = simulate_serving(lab, workload, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                           block_size=BLOCK_SIZE, cost=cost, record_timeline=False)
    summary = sim.summary()
    for k in ("p50_ttft", "p99_ttft"):
        summary[k] += hop
    summary["output_throughput"] = sim.num_output_tokens / (sim.duration + hop)
    return summary


class ServedStepCost:
    """The engine's fitted step, plus what serving adds (from `probe` and `burst`): a cost per
    step (the median excess of a lone request's gaps: the engine thread hands its outputs to the
    front end's process), `per_token` more for each further sampled token (its event through the
    pipe, the SSE, the client's parse, all on the same 2 cores), and with `stalls` a draw, per
    step, of the excess above its median (the OS's wake-ups; seeded)."""

    charges_sampled_tokens = True

    def __init__(self, fit, excess: np.ndarray, per_token: float, stalls: bool = True, seed: int = 0):
        self.fit = fit
        self.per_step = float(np.median(excess))
        self.per_token = per_token
        self.tail = np.maximum(excess - self.per_step, 0.0) if stalls else np.zeros(1)
        self.rng = np.random.default_rng(seed)

    def step_time(self, num_tokens: int, num_context_tokens: int, num_sampled: int = 1) -> float:
        return (self.fit.step_time(num_tokens, num_context_tokens) + self.per_step
                + self.per_token * max(num_sampled - 1, 0) + float(self.rng.choice(self.tail)))


def burst(lab, url: str, model: str, fit, excess: np.ndarray, count: int = 16, prompt_len: int = 16,
          max_tokens: int = 32) -> float:
    """Seconds per further sampled token: `count` requests sent at once decode together; their
    median TPOT minus the fit's step for that batch and the lone request's per-step excess, over
    count - 1. (Not the load test's Poisson arrivals: a separate operating point.)"""
    payloads = [{"model": model, "prompt": [(11 * i + j) % 200 + 1 for j in range(prompt_len)],
                 "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True}
                for i in range(count)]
    results, _ = benchmark_serving.run_load(url, payloads, float("inf"), timeout=60.0)
    tpot = float(np.median([benchmark_serving.stream_metrics(lab, r).tpot for r in results if r.ok]))
    step = np.mean([fit.step_time(count, count * (prompt_len + t)) for t in range(1, max_tokens)])
    return max((tpot - step - float(np.median(excess))) / (count - 1), 0.0)


COLUMNS = (("p50_ttft", "TTFT p50", 1e3), ("p99_ttft", "TTFT p99", 1e3), ("p50_tpot", "TPOT p50", 1e3),
           ("p99_tpot", "TPOT p99", 1e3), ("output_throughput", "tok/s", 1.0))


def error_table(rates, measured, predicted: dict[str, list[dict]]) -> str:
    names = list(predicted)
    lines = [f"{'rate':>6} {'metric':<9} {'measured':>9} " + " ".join(f"{n:>18}" for n in names)]
    for i, rate in enumerate(rates):
        for key, label, scale in COLUMNS:
            m = measured[i][key] * scale
            cells = []
            for n in names:
                p = predicted[n][i][key] * scale
                cells.append(f"{p:9.1f} {100 * (p / m - 1):+7.0f}%")
            lines.append(f"{rate:>6g} {label:<9} {m:9.1f} " + " ".join(f"{c:>18}" for c in cells))
    return "\n".join(lines)


def bench_model(lab, name: str, rates=None, num_prompts=None, seed: int = 0) -> tuple[str, list[str]]:
    """The error table's text, and two figures: the latencies measured and those predicted with
    every term, against the offered rate (the same axes as `loadtest --html`)."""
    config = MODELS[name]
    workload_name, default_rates, default_prompts = PLANS[name]
    rates = sorted(rates or default_rates)
    num_prompts = num_prompts or default_prompts
    requests = datasets.make_workload(lab, workload_name, num_prompts, seed, config["n_positions"],
                                      config["vocab_size"])
    out = [f"== {name}: {config}, {workload_name} requests, {num_prompts} per rate, max_num_seqs {MAX_NUM_SEQS}, "
           f"max_num_batched_tokens {MAX_NUM_BATCHED_TOKENS} =="]
    clock = time.perf_counter()
    calibration = datasets.make_workload(lab, workload_name, 3 * MAX_NUM_SEQS, seed + 100, config["n_positions"],
                                         config["vocab_size"])
    # Best of 3: the engine is deterministic, so the three runs plan the same steps; each step's
    # fastest time is the one the other processes on the machine disturbed least.
    runs = [measure_steps(lab, build_engine(lab, config), calibration) for _ in range(3)]
    size = min(map(len, runs))
    samples = [(t, c, min(run[i][2] for run in runs)) for i, (t, c, _) in enumerate(runs[0][:size])]
    fit = costmodel.fit_step_cost(samples)
    residual = np.array([fit.step_time(t, c) / s - 1 for t, c, s in samples])
    out.append(f"calibration: {len(samples)} engine steps in process, best of 3 "
               f"({time.perf_counter() - clock:.0f} s): step = "
               f"{fit.fixed * 1e3:.3f} ms + {fit.per_token * 1e6:.2f} us/token + {fit.per_context_token * 1e9:.2f} "
               f"ns/context token; |error| per step median {100 * np.median(np.abs(residual)):.0f}%")
    proc, url = start_server(lab.__file__, config)
    try:
        card = benchmark_serving.server_model_card(url)
        hop, excess = probe(lab, url, card["id"], fit)
        out.append(f"server terms from 8 lone requests: {hop * 1e3:.2f} ms per request (front end, HTTP, pipes); "
                   f"per streamed token {np.median(excess) * 1e3:.3f} ms median, "
                   f"p99 {np.percentile(excess, 99) * 1e3:.2f} ms (the tail: the OS's wake-ups)")
        per_token = burst(lab, url, card["id"], fit, excess)
        out.append(f"  and {per_token * 1e6:.1f} us per further sampled token in a step (16 requests at once)")
        predicted = {"engine fit": [predict(lab, requests, r, seed, fit, 0.0) for r in rates],
                     "+ hop, streaming": [predict(lab, requests, r, seed,
                                                  ServedStepCost(fit, excess, per_token, False), hop) for r in rates],
                     "+ wake-ups": [predict(lab, requests, r, seed, ServedStepCost(fit, excess, per_token, True, seed),
                                            hop) for r in rates]}
        payloads = [benchmark_serving.completion_payload(r, card["id"]) for r in requests]
        measured = []
        for rate in rates:
            results, duration = benchmark_serving.run_load(url, payloads, rate, seed, timeout=120.0)
            measured.append(benchmark_serving.summarize_load(lab, results, duration))
            print(f"  {name}: measured {rate:g} req/s ({measured[-1]['completed']}/{num_prompts} done)", flush=True)
    finally:
        proc.terminate()
        proc.wait(20)
    out.append(error_table(rates, measured, predicted))
    knee = benchmark_serving.find_knee
    knees = [("measured", knee(rates, [m["p99_ttft"] for m in measured]))]
    knees += [(n, knee(rates, [p["p99_ttft"] for p in ps])) for n, ps in predicted.items()]
    out.append("knee (highest rate before p99 TTFT triples): " + ", ".join(f"{n} {k if k is not None else '-'}"
                                                                          for n, k in knees))
    figures = []
    for label, summaries in (("measured by the load generator", measured),
                             ("predicted by the simulator, every term", predicted["+ wake-ups"])):
        body, numbers = latency.latency_figure(rates, summaries, f"{name}, {label}.")
        figures.append(svg.figure(f"{name}-{label.split()[0]}", f"{name}: {label}", body, numbers["caption"]))
    return "\n".join(out), figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=[*MODELS, "both"], default="both")
    parser.add_argument("--qps", type=lambda text: [float(r) for r in text.split(",")], help="rates, req/s")
    parser.add_argument("--num-prompts", type=int)
    parser.add_argument("--module", default=DEFAULT_MODULE,
                        help="the module to measure (default: solution, or lab in the student's copy)")
    parser.add_argument("--html", metavar="FILE", help="also draw predicted against measured latencies as a page")
    args = parser.parse_args(argv)
    lab = importlib.import_module(args.module)
    names = list(MODELS) if args.model == "both" else [args.model]
    print(f"bench_simulator: {args.module}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} (other processes share them)", flush=True)
    figures = []
    for name in names:
        text, drawn = bench_model(lab, name, args.qps, args.num_prompts)
        print(text, flush=True)
        figures += drawn
    if args.html:
        Path(args.html).write_text(svg.page("The simulator against the served engine", figures,
                                            "latency against offered rate: measured, then predicted"))
        print(f"wrote {Path(args.html).resolve()}")
    return 0


if __name__ == "__main__":
    with_one_blas_thread()  # as `serve` runs
    raise SystemExit(main())
