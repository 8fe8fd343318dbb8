"""`python -m tools.bench step-profile`: where a GPT-2 124M decode step's time goes, at batch 1
and 16, with one thread and with `serve`'s threads, beside the machine's floors measured with NumPy."""

from __future__ import annotations

import cProfile
import math
import os
import pstats
import time
from types import ModuleType

import numpy as np

from course.commands import default_num_threads
from tools.bench_common import Report

GPT2_124M = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)

# The parts of a step, each the profiled time of one function of the module (with what it calls);
# "other NumPy" is the rest of the forward (LayerNorm, GELU, the residual adds, the embedding, the
# K/V writes), "Python" the rest of the step (scheduling, the batch's layout, the outputs).
PARTS = {"GEMMs": lambda lab: lab.ThreadedMatmul.__call__, "attention": lambda lab: lab.paged_attention,
         "sampler": lambda lab: lab.sample_token}


def _engine(lab: ModuleType, model, batch: int, context: int):
    """An engine holding `batch` prefilled requests of `context` prompt tokens, decoding."""
    engine = lab.LLMEngine(model, num_blocks=batch * -(-(context + 400) // 16), block_size=16,
                           max_num_seqs=batch, max_num_batched_tokens=max(512, batch * context))
    rng = np.random.default_rng(0)
    for _ in range(batch):
        engine.add_request(rng.integers(0, model.config.vocab_size, context).tolist(),
                           lab.SamplingParams(max_tokens=400))
    engine.step()  # every prefill at once
    engine.step()
    return engine


def _profiled_split(lab: ModuleType, engine, steps: int) -> dict[str, float]:
    """Seconds per step by part, from a profile of `steps` decode steps of `engine`."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, ..., tottime, cumtime, callers)

    def per_step(function) -> float:
        code = function.__code__
        return stats.get((code.co_filename, code.co_firstlineno, code.co_name), (0, 0, 0, 0.0))[3] / steps

    parts = {name: per_step(function(lab)) for name, function in PARTS.items()}
    forward = per_step(lab.ToyTransformer.forward)
    parts["other NumPy"] = forward - parts["GEMMs"] - parts["attention"]
    parts["Python"] = per_step(lab.LLMEngine.step) - forward - parts["sampler"]
    return {"profiled step": sum(parts.values())} | parts


def _step_time(engine, steps: int, clock) -> float:
    """The median wall time of `steps` decode steps, unprofiled."""
    times = []
    for _ in range(steps):
        start = clock()
        engine.step()
        times.append(clock() - start)
    return float(np.median(times))


def _floors(lab: ModuleType, num_threads: int, repeats: int = 5) -> dict[str, float]:
    """Memory bandwidth (bytes/s) of a 1-row product with a 256 MiB matrix, and the sgemm rate
    (FLOP/s) of a cache-resident 1024 x 1024 product, each with one thread and with `num_threads`."""
    rng = np.random.default_rng(0)
    n = math.isqrt(256 * 2**20 // 4)
    big = rng.standard_normal((n, n), dtype=np.float32)
    row = rng.standard_normal((1, n), dtype=np.float32)
    square = rng.standard_normal((1024, 1024), dtype=np.float32)
    result = {}
    for threads in dict.fromkeys((1, num_threads)):
        matmul = lab.ThreadedMatmul(threads)
        for name, fn, amount in (("bandwidth", lambda: matmul(row, big), big.nbytes),
                                 ("sgemm", lambda: matmul(square, square), 2 * 1024**3)):
            fn()
            best = min(_timed(fn) for _ in range(repeats))
            result[f"{name} {threads}"] = amount / best
    return result


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_step_profile(lab: ModuleType, batches=(1, 16), context: int = 100, steps: int = 8,
                       num_threads: int | None = None, log=print, clock=time.perf_counter) -> str:
    """The decode step of the module `lab`'s GPT-2 124M (random weights) at each batch size, split into its parts,
    with one thread and with `num_threads` (default: `serve`'s), beside the floors: the weights'
    bytes over the bandwidth NumPy reaches (batch 1) and the step's FLOPs over the sgemm rate it
    reaches (the larger batches). Returns the report; each line also goes to `log` as measured."""
    say = Report(log)
    num_threads = num_threads or default_num_threads()
    config = lab.ModelConfig(**GPT2_124M)
    weights = lab.init_gpt2_weights(config, seed=0)
    models = {threads: lab.ToyTransformer(config, weights, num_threads=threads)
              for threads in dict.fromkeys((1, num_threads))}
    weight_bytes = sum(w.nbytes for name, w in weights.items() if name != "wpe.weight")
    params = weight_bytes // 4
    blas = {k: os.environ[k] for k in ("OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
            if k in os.environ}
    say(f"bench step-profile: GPT-2 124M (random weights, float32), context {context}, {steps} steps per "
        f"figure, BLAS env {blas or 'default'}, load average {os.getloadavg()[0]:.2f}")
    floors = _floors(lab, num_threads)
    for threads in models:
        say(f"  the machine's floors with {threads} thread(s): reads {floors[f'bandwidth {threads}'] / 1e9:.1f} GB/s, "
            f"sgemm {floors[f'sgemm {threads}'] / 1e9:.0f} GFLOP/s")
    for batch in batches:
        for threads, model in models.items():
            engine = _engine(lab, model, batch, context)
            step = _step_time(engine, steps, clock)
            parts = _profiled_split(lab, engine, steps)
            split = ", ".join(f"{name} {t * 1e3:.1f}" for name, t in parts.items())
            if batch == 1:
                floor = weight_bytes / floors[f"bandwidth {threads}"]
                why = f"{weight_bytes / 2**20:.0f} MiB of weights at the bandwidth"
            else:
                floor = 2 * params * batch / floors[f"sgemm {threads}"]
                why = f"{2 * params * batch / 1e9:.2f} GFLOP at the sgemm rate"
            say(f"  batch {batch:2d}, {threads} thread(s): step {step * 1e3:.1f} ms ({split}, ms); "
                f"floor {floor * 1e3:.1f} ms ({why})")
    return say.text()
