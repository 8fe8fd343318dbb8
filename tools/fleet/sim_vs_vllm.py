#!/usr/bin/env python3
"""The simulator against vLLM itself: fit its step cost to vLLM's own engine steps on this machine,
predict what the load generator will measure of vLLM's server at three rates below its knee,
measure it, and set the error beside the same procedure on the lab's own engine.

    python -m tools.fleet.sim_vs_vllm --vllm-python /tmp/vllmvenv/bin/python   # both engines (~20 minutes)
    python -m tools.fleet.sim_vs_vllm --quick                                  # fewer requests (~10 minutes)

For each engine, on the random-weight GPT-2 124M checkpoint of tools/server/vs_vllm.py, with
max_num_seqs 16 and max_num_batched_tokens 512, prefix caching off:

1. Calibrate in process, over controlled batches (tools/fleet/vllm_steps.py's plans: 1 to 16
   requests added at once, prompts of 16 and 128 tokens, 48 tokens out, each plan 3 times, each
   step's fastest time): vLLM's engine core in the vLLM venv's Python
   (VLLM_ENABLE_V1_MULTIPROCESSING=0, its OpenMP threads on every core), the lab's engine here
   (OpenBLAS threads as `serve` sets them). The fit is `loadtest.costmodel.fit_step_cost`:
   fixed + per scheduled token + per context token. In process rather than from a served run:
   the step is then the engine's alone, as Vidur profiles a model's operators offline, and what
   serving adds is measured apart (step 2), the same way for both engines.
2. Probe the served engine (tools/fleet/bench_simulator.py's `probe` and `burst`): 8 lone
   requests give the hop per request and the excess of each gap between tokens over the fitted
   decode step; 16 at once give the cost of each further token in a step.
3. Predict with `simulate_serving` (the lab's Scheduler, whose policy is vLLM's: preemption aside,
   nothing here differs) TTFT and TPOT p50 and p90 at each rate, with the engine fit alone and with
   the server's terms added; then measure with the lab's load client (the same requests and
   Poisson arrivals), and print predicted / measured - 1.

The machine is shared: the figures move with what else runs (the load average is printed).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from checkpoints.model_loader import load_gpt2
from course.commands import default_num_threads
from loadtest import benchmark_serving, costmodel, datasets
from loadtest.simulator import simulate_serving
from tools.bench_common import DEFAULT_MODULE, ROOT, description, with_one_blas_thread
from tools.fleet import bench_simulator, vllm_steps
from tools.server import vs_vllm

# Below each one's served saturation (~4.8 and ~2.7 req/s here).
RATES = {"vLLM": (1.0, 2.0, 4.0), "lab": (0.5, 1.0, 2.0)}
METRICS = (("p50_ttft", "TTFT p50"), ("p90_ttft", "TTFT p90"), ("p50_tpot", "TPOT p50"), ("p90_tpot", "TPOT p90"))


def best_steps(rows: list[dict]) -> list[tuple[int, int, float]]:
    """(tokens, context tokens, seconds) of each distinct step of the plans, its fastest time over
    the repeats (the engine is deterministic: each repeat plans the same steps)."""
    best: dict[tuple, float] = {}
    for r in rows:
        key = (r["batch"], r["prompt_len"], r["tokens"], r["context"])
        best[key] = min(best.get(key, np.inf), r["seconds"])
    return [(key[2], key[3], seconds) for key, seconds in best.items()]


def decode_steps(rows: list[dict]) -> dict[int, float]:
    """Seconds of a decode step (one token for each of `batch` sequences) by batch: the median over
    the plans' contexts of each step's fastest time."""
    best: dict[tuple, float] = {}
    for r in rows:
        if r["tokens"] == r["batch"]:
            key = (r["batch"], r["prompt_len"], r["context"])
            best[key] = min(best.get(key, np.inf), r["seconds"])
    return {b: float(np.median([v for k, v in best.items() if k[0] == b])) for b in sorted({k[0] for k in best})}


def vllm_calibration(python: str, checkpoint: str, work: Path, repeat: int) -> list[dict]:
    out = work / "vllm_steps.jsonl"
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                                   f"0-{os.cpu_count() - 1}"),
               VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    done = subprocess.run([python, "-m", "tools.fleet.vllm_steps", checkpoint, "--out", str(out), "--repeat",
                           str(repeat)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"vllm_steps.py failed: {done.stderr[-2000:]}")
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def lab_calibration(lab, checkpoint: str, repeat: int) -> list[dict]:
    """The same plans as vllm_steps.py, on the lab's engine built as `serve --model` builds it (its
    default threads)."""
    model, _ = load_gpt2(lab, checkpoint, default_num_threads())
    rows = []
    for round_ in range(repeat):
        engine = lab.LLMEngine(model, max_num_seqs=16, max_num_batched_tokens=512, block_size=16)
        for batch, prompt_len, max_tokens in vllm_steps.plans():
            for i in range(batch):
                prompt = [(97 * i + 31 * j + prompt_len) % 50000 + 1 for j in range(prompt_len)]
                engine.add_request(prompt, lab.SamplingParams(max_tokens=max_tokens))
            for tokens, context, seconds in bench_simulator.measure_steps(lab, engine, [], max_seconds=600.0):
                rows.append({"round": round_, "batch": batch, "prompt_len": prompt_len, "tokens": tokens,
                             "context": context, "seconds": seconds})
    return rows


def predict(lab, requests, rate: float, cost, hop: float) -> dict:
    arrivals = datasets.poisson_arrival_times(rate, len(requests), 0)
    workload = [(float(t), len(r.prompt_token_ids), r.max_tokens) for t, r in zip(arrivals, requests)]
    summary = simulate_serving(lab, workload, max_num_seqs=16, max_num_batched_tokens=512, block_size=16,
                               cost=cost, record_timeline=False).summary()
    for key in ("p50_ttft", "p90_ttft"):
        summary[key] += hop
    return summary


def served(lab, server, fit, requests, rates, log) -> tuple[dict, list[dict]]:
    """The server's terms (probe, burst), the predictions with and without them, and the measures."""
    hop, excess = bench_simulator.probe(lab, server.url, vs_vllm.MODEL_NAME, fit)
    per_token = bench_simulator.burst(lab, server.url, vs_vllm.MODEL_NAME, fit, excess)
    log(f"  server terms: {hop * 1e3:.1f} ms per request, {np.median(excess) * 1e3:.2f} ms per streamed token "
        f"(p99 {np.percentile(excess, 99) * 1e3:.1f}), {per_token * 1e6:.0f} us per further token in a step")
    predicted = {"engine fit": [predict(lab, requests, r, fit, 0.0) for r in rates],
                 "+ server terms": [predict(lab, requests, r, bench_simulator.ServedStepCost(
                     fit, excess, per_token, stalls=False), hop) for r in rates]}
    payloads = [benchmark_serving.completion_payload(r, vs_vllm.MODEL_NAME) for r in requests]
    measured = []
    for rate in rates:
        with vs_vllm.CpuMeter() as meter:
            results, duration = benchmark_serving.run_load(server.url, payloads, rate, 0, timeout=600.0)
        measured.append(benchmark_serving.summarize_load(lab, results, duration))
        log(f"  measured {rate:g} req/s: {measured[-1]['completed']}/{len(requests)} done (load average "
            f"{meter.load:.2f}, other jobs {meter.other_cores:.2f} cores)")
    return predicted, measured


def error_table(engine: str, rates, predicted: dict, measured: list[dict]) -> tuple[str, dict[str, float]]:
    """Predicted against measured, ms and error, per rate and metric; the median |error| of each prediction."""
    lines = [f"| {engine} | rate | measure | measured ms | " + " | ".join(f"{n} ms (error)" for n in predicted) + " |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in predicted) + " |"]
    errors = collections.defaultdict(list)
    for i, rate in enumerate(rates):
        for key, label in METRICS:
            m = measured[i][key] * 1e3
            cells = []
            for name, summaries in predicted.items():
                p = summaries[i][key] * 1e3
                errors[name].append(p / m - 1)
                cells.append(f"{p:.1f} ({100 * (p / m - 1):+.0f}%)")
            lines.append(f"| | {rate:g} req/s | {label} | {m:.1f} | " + " | ".join(cells) + " |")
    medians = {name: float(np.median(np.abs(e))) for name, e in errors.items()}
    lines.append("| | | median abs error | | " + " | ".join(f"{100 * v:.0f}%" for v in medians.values()) + " |")
    return "\n".join(lines), medians


def fit_line(engine: str, samples, fit) -> str:
    residual = np.array([fit.step_time(t, c) / s - 1 for t, c, s in samples])
    decode = {b: fit.step_time(b, b * 80) * 1e3 for b in (1, 16)}
    return (f"{engine}: {len(samples)} distinct steps, step = {fit.fixed * 1e3:.2f} ms + "
            f"{fit.per_token * 1e6:.1f} us/token + {fit.per_context_token * 1e9:.1f} ns/context token "
            f"(|error| per step median {100 * np.median(np.abs(residual)):.0f}%); a decode step at context 80: "
            f"batch 1 {decode[1]:.1f} ms, batch 16 {decode[16]:.1f} ms")


def run_engine(engine: str, args, lab, checkpoint: str, work: Path, log) -> tuple[str, dict[str, float]]:
    rows = (vllm_calibration(args.vllm_python, checkpoint, work, args.repeat) if engine == "vLLM"
            else lab_calibration(lab, checkpoint, args.repeat))
    samples = best_steps(rows)
    fit = costmodel.fit_step_cost(samples)
    log(fit_line(engine, samples, fit))
    log(f"  {engine}'s decode step, measured (median over contexts 17-176 of each step's best): " + ", ".join(
        f"batch {b} {t * 1e3:.1f} ms" for b, t in decode_steps(rows).items()))
    requests = datasets.make_workload(lab, "alpaca", args.num_prompts, 0, 1024, 256)
    start = (vs_vllm.vllm_server(args.vllm_python, checkpoint, dict(os.environ), work) if engine == "vLLM"
             else vs_vllm.lab_server(args.module, checkpoint, dict(os.environ), work))
    with start as server:
        predicted, measured = served(lab, server, fit, requests, RATES[engine], log)
    return error_table(engine, RATES[engine], predicted, measured)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.fleet.sim_vs_vllm", description=description(__doc__))
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "/tmp/vllmvenv/bin/python"))
    parser.add_argument("--module", default=DEFAULT_MODULE)
    parser.add_argument("--engines", default="vLLM,lab", help="vLLM, lab or both (default)")
    parser.add_argument("--num-prompts", type=int, help="requests per rate (default 64; --quick 24)")
    parser.add_argument("--repeat", type=int, help="runs of each calibration plan (default 3; --quick 1)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    args.num_prompts = args.num_prompts or (24 if args.quick else 64)
    args.repeat = args.repeat or (1 if args.quick else 3)
    engines = args.engines.split(",")
    if not set(engines) <= set(RATES):
        parser.error("--engines takes vLLM and/or lab")
    if "vLLM" in engines and vs_vllm.vllm_version(args.vllm_python)[0] is None:
        print(vs_vllm.INSTALL.format(python=args.vllm_python, why=vs_vllm.vllm_version(args.vllm_python)[1]),
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped: the server is stopped too
    lab = importlib.import_module(args.module)
    print(f"sim_vs_vllm: {time.strftime('%Y-%m-%d %H:%M %Z')}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}; alpaca, {args.num_prompts} requests per rate", flush=True)
    with tempfile.TemporaryDirectory(prefix="sim_vs_vllm-") as tmp:
        work = Path(tmp)
        vs_vllm.make_checkpoint(lab, work / "gpt2-124m")
        tables = {e: run_engine(e, args, lab, str(work / "gpt2-124m"), work, lambda t: print(t, flush=True))
                  for e in engines}
    for text, _ in tables.values():
        print("\n" + text)
    print("\nmedian |error| of TTFT and TPOT p50 and p90 at the three rates: " + "; ".join(
        f"{e} {', '.join(f'{name} {100 * v:.0f}%' for name, v in medians.items())}"
        for e, (_, medians) in tables.items()))
    return 0


if __name__ == "__main__":
    with_one_blas_thread()  # as `serve` runs the lab
    raise SystemExit(main())
