"""`python -m tools.bench blas-threads`: an engine decode step with OpenBLAS on 1 and on 2 threads."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from types import ModuleType

from course import commands
from tools.bench_common import ROOT, blas_env
from tools.benchmarks.bench_vs_transformers import VS_TRANSFORMERS_MODEL

# Run with the checkout as its working directory, where `python -c` imports from.
_STEP_PROBE = """
import json, sys, time
import numpy as np
lab = __import__(sys.argv[1])
result = {}
for name, config in json.loads(sys.argv[2]).items():
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


def bench_blas_threads(lab: ModuleType, rounds: int = 3) -> str:
    """`python -m tools.bench blas-threads`: an engine decode step of the module `lab` (best of 20, context ~64-100)
    in fresh child processes with OPENBLAS_NUM_THREADS=1 and =2, in alternating rounds, for the
    server's default model and the vs-transformers one: which thread count should `serve` use?"""
    models = {"serve model": dict(commands.SERVE_MODEL), "n_embd 512 x 6": VS_TRANSFORMERS_MODEL}
    best: dict[int, dict[str, float]] = {1: {}, 2: {}}
    for _ in range(rounds):
        for threads in (1, 2):
            out = subprocess.run([sys.executable, "-c", _STEP_PROBE, lab.__name__, json.dumps(models)], cwd=ROOT,
                                 env=blas_env(threads), capture_output=True, text=True, check=True, timeout=600)
            for key, t in json.loads(out.stdout).items():
                best[threads][key] = min(best[threads].get(key, math.inf), t)
    lines = [f"bench blas-threads: engine decode step, best of 20 x {rounds} rounds, {os.cpu_count()} CPUs "
             f"(load average {os.getloadavg()[0]:.1f} at the end)"]
    for key in best[1]:
        t1, t2 = best[1][key], best[2][key]
        lines.append(f"  {key:24s} 1 thread {t1 * 1e3:7.2f} ms, 2 threads {t2 * 1e3:7.2f} ms: 2 / 1 = {t2 / t1:.2f}x")
    return "\n".join(lines)
