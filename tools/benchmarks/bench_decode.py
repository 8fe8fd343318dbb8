"""`python -m tools.bench decode`: decode throughput of the paged model against its bare weight GEMMs."""

from __future__ import annotations

import math
import os
import time
from types import ModuleType

import numpy as np

from measure.timing import best_side_by_side
from tools.bench_common import Report


def _large_matvec(nbytes: int = 256 * 2**20):
    """A float32 (1, n) @ (n, n) product whose matrix is far larger than the caches, and its bytes.

    The roofline of a batch-1 decode step: every weight is read once for one row of activations.
    """
    n = math.isqrt(nbytes // 4)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, n), dtype=np.float32)
    x = rng.standard_normal((1, n), dtype=np.float32)
    return (lambda: x @ w), w.nbytes


def bench_decode(lab: ModuleType, n_embd: int = 1024, n_layer: int = 6, n_head: int = 16, vocab_size: int = 4096,
                 context_len: int = 32, batch_sizes=(1, 2, 4, 8, 16, 32), block_size: int = 16,
                 repeats: int = 5, log=print, clock=time.perf_counter) -> str:
    """Decode throughput of the module `lab`'s paged model vs the bare weight GEMMs, and batch-1
    bytes/s, timed by `clock`.

    One decode step = `forward` of one new token per sequence at position context_len - 1, with
    the earlier K/V already in the cache (the step is repeated in place: it rewrites the same K/V).
    The ceiling runs the same weight products on random activations of the same batch size:
    the best any implementation on this BLAS could do, with attention, LayerNorm and Python free.
    Returns the report; each line also goes to `log` (None: silent) as it is measured.
    """
    say = Report(log)
    blas_env = {k: os.environ[k] for k in ("OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
                if k in os.environ}
    config = lab.ModelConfig(vocab_size=vocab_size, n_positions=context_len, n_embd=n_embd,
                         n_layer=n_layer, n_head=n_head)
    model = lab.ToyTransformer(config, seed=0)
    weight_bytes = sum(w.nbytes for name, w in model.weights.items() if name != "wpe.weight")
    say(f"bench decode: n_embd {n_embd}, {n_layer} layers, {n_head} heads, vocab {vocab_size}: "
        f"{weight_bytes / 2**20:.0f} MiB of weights read per step (L3 cache: see lscpu), "
        f"context {context_len}, block size {block_size}, dtype {model.weights['wte.weight'].dtype}, "
        f"BLAS env {blas_env or 'default'}")
    rng = np.random.default_rng(0)
    model_time, gemm_time = {}, {}
    for batch in batch_sizes:
        t, logits = _decode_step_against_gemms(lab, model, batch, context_len, block_size, rng, repeats, clock)
        if batch == 1:
            matvec_bw = t["matvec bytes"] / t["matvec"]
        model_time[batch], gemm_time[batch] = t["model"], t["gemm"]
        say(f"  batch {batch:2d}: model {t['model'] * 1e3:6.1f} ms/step = {batch / t['model']:6.0f} tok/s, "
            f"weight GEMMs {t['gemm'] * 1e3:6.1f} ms = {batch / t['gemm']:6.0f} tok/s "
            f"(model/GEMMs {t['model'] / t['gemm']:.2f}x, logits {logits.dtype})")
    lo = batch_sizes[0]
    hi = batch_sizes[-1]
    model_gain = (hi / model_time[hi]) / (lo / model_time[lo])
    gemm_gain = (hi / gemm_time[hi]) / (lo / gemm_time[lo])
    say(f"  throughput batch {hi} / batch {lo}: model {model_gain:.1f}x, weight GEMMs (ceiling) "
        f"{gemm_gain:.1f}x: the model keeps {model_gain / gemm_gain:.0%} of the ceiling's gain (goal >= 85%)")
    if lo == 1:
        kv_bytes = 2 * n_layer * context_len * n_embd * 4
        achieved = (weight_bytes + kv_bytes) / model_time[1]
        roof = matvec_bw
        say(f"  batch-1 step reads {(weight_bytes + kv_bytes) / 2**20:.0f} MiB (weights + KV) at "
            f"{achieved / 1e9:.1f} GB/s; a large float32 matvec reads {roof / 1e9:.1f} GB/s: "
            f"{achieved / roof:.0%} of the roofline (goal >= 70%)")
    return say.text()


def _decode_step_against_gemms(lab: ModuleType, model, batch: int, context_len: int, block_size: int, rng,
                               repeats: int, clock) -> tuple[dict, np.ndarray]:
    """One decode step of `batch` prefilled sequences timed beside the bare weight products of
    the same batch (and, at batch 1, a large matvec: the roofline, in the same turns as the step
    it judges); (the best times, with "matvec bytes" at batch 1; the step's logits)."""
    config = model.config
    allocator = lab.BlockAllocator(batch * -(-context_len // block_size) + 1, block_size)
    kv_cache = lab.KVCache(config, allocator.num_blocks, block_size)
    tables = [lab.BlockTable(allocator) for _ in range(batch)]
    for table in tables:
        table.append_tokens(rng.integers(0, config.vocab_size, context_len).tolist())
    model.forward(kv_cache, tables, [0] * batch, [context_len] * batch)   # prefill
    x = rng.standard_normal((batch, config.n_embd), dtype=np.float32)
    h = rng.standard_normal((batch, 4 * config.n_embd), dtype=np.float32)

    def weight_gemms():
        for layer in model.layers:
            x @ layer["attn.c_attn.weight"], x @ layer["attn.c_proj.weight"]
            x @ layer["mlp.c_fc.weight"], h @ layer["mlp.c_proj.weight"]
        return x @ model.weights["wte.weight"].T

    step = lambda: model.forward(kv_cache, tables, [context_len - 1] * batch, [1] * batch)
    logits = step()
    fns = {"model": step, "gemm": weight_gemms}
    matvec_bytes = None
    if batch == 1:
        fns["matvec"], matvec_bytes = _large_matvec()
    t = best_side_by_side(fns, repeats, clock=clock)
    if matvec_bytes is not None:
        t["matvec bytes"] = matvec_bytes
    return t, logits
