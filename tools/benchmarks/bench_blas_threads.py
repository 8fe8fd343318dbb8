"""`python tools/bench.py blas-threads`: an engine decode step with OpenBLAS on 1 and on 2 threads.

Run through tools/bench.py, which sets `lab` (the module measured) and `clock` here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
from bench_common import _blas_env  # noqa: E402
from bench_vs_transformers import VS_TRANSFORMERS_MODEL  # noqa: E402

from course import commands  # noqa: E402

lab = None  # the module under test (solution or lab): tools/bench.py sets it before any benchmark runs
clock = time.perf_counter  # or time.process_time with --cpu-time (tools/bench.py sets it)


_STEP_PROBE = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
lab = __import__(sys.argv[2])
result = {}
for name, config in json.loads(sys.argv[3]).items():
    model = lab.ToyTransformer(lab.ModelConfig(**config), seed=0)
    for batch in (1, 8, 32):
        engine = lab.LLMEngine(model, max_num_seqs=batch)
        rng = np.random.default_rng(0)
        for _ in range(batch):
            engine.add_request(rng.integers(0, config["vocab_size"], 64).tolist(), lab.SamplingParams(max_tokens=40))
        while engine.scheduler.waiting or engine.num_steps < 2:
            engine.step()
        best = float("inf")
        for _ in range(20):
            start = time.perf_counter()
            engine.step()
            best = min(best, time.perf_counter() - start)
        result[f"{name} batch {batch}"] = best
print(json.dumps(result))
"""


def bench_blas_threads(rounds: int = 3) -> str:
    """`python tools/bench.py blas-threads`: an engine decode step (best of 20, context ~64-100)
    in fresh child processes with OPENBLAS_NUM_THREADS=1 and =2, in alternating rounds, for the
    server's default model and the vs-transformers one: which thread count should `serve` use?"""
    models = {"serve model": dict(commands.SERVE_MODEL), "n_embd 512 x 6": VS_TRANSFORMERS_MODEL}
    best: dict[int, dict[str, float]] = {1: {}, 2: {}}
    for _ in range(rounds):
        for threads in (1, 2):
            out = subprocess.run([sys.executable, "-c", _STEP_PROBE, str(ROOT), lab.__name__, json.dumps(models)],
                                 env=_blas_env(threads), capture_output=True, text=True, check=True, timeout=600)
            for key, t in json.loads(out.stdout).items():
                best[threads][key] = min(best[threads].get(key, math.inf), t)
    lines = [f"bench blas-threads: engine decode step, best of 20 x {rounds} rounds, {os.cpu_count()} CPUs "
             f"(load average {os.getloadavg()[0]:.1f} at the end)"]
    for key in best[1]:
        t1, t2 = best[1][key], best[2][key]
        lines.append(f"  {key:24s} 1 thread {t1 * 1e3:7.2f} ms, 2 threads {t2 * 1e3:7.2f} ms: 2 / 1 = {t2 / t1:.2f}x")
    return "\n".join(lines)
