#!/usr/bin/env python3
"""Benchmarks of the lab's mechanisms, measured side by side on this machine.

    python tools/bench.py                      # all of them, on solution.py
    python tools/bench.py attention            # one: attention, decode, kv-int8, batching, speculative, serving,
                                               #   trace, vs-transformers (needs torch + transformers, never a
                                               #   dependency)
    python tools/bench.py blas-threads         # not in "all": 1 vs 2 OpenBLAS threads; serving-threads likewise
    python tools/bench.py attention --module lab   # time YOUR kernel (lab.py) instead

`python solution.py bench [which]` runs this file. It imports the module it measures (never the
other way round), so the mechanisms' file holds no timing code: like nanoGPT's bench.py beside
model.py. Timings are best-of-N, measured in turns so that drift hits every contestant alike;
ratios measured in one run are what to compare, not absolute times from another machine.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


sys.path.insert(0, str(ROOT))
from checkpoints.tokenizer import ByteTokenizer  # noqa: E402
from course import cli, scenarios, trace  # noqa: E402
from loadtest import benchmark_serving, datasets, simulator  # noqa: E402
from serving import api_server, protocol  # noqa: E402

lab = None  # the module under test (solution or lab): `use_module` sets it before any benchmark runs

# The clock the in-process benchmarks read: wall time, or with --cpu-time this process's CPU
# seconds, which a machine shared with other work does not inflate by time-slicing (right only
# for single-threaded work: pin OPENBLAS_NUM_THREADS=1 and torch to one thread).
clock = time.perf_counter


def use_module(name: str) -> None:
    """Measure the module `name` (imported from the repository's root)."""
    global lab
    lab = importlib.import_module(name)


def _best_side_by_side(fns: dict, repeats: int = 5) -> dict:
    """Best wall times of several functions measured in turns, so drift hits them all alike."""
    for fn in fns.values():
        fn()
    best = {name: math.inf for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            best[name] = min(best[name], clock() - start)
    return best


def _timeit(fn, repeats: int = 5) -> float:
    """Best wall time of `fn()` over `repeats` runs, after a warm-up run."""
    return _best_side_by_side({"fn": fn}, repeats)["fn"]


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes copied per second by np.copyto of a buffer far larger than the CPU caches."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return nbytes / _timeit(lambda: np.copyto(dst, src), repeats)


def _contiguous_decode_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The same attention on contiguous per-sequence K/V (B, T, H, D), all of length T."""
    scale = np.float32(1.0 / math.sqrt(q.shape[-1]))
    scores = np.matmul(k.transpose(0, 2, 1, 3), (q * scale)[..., None])[..., 0]   # (B, H, T)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.matmul(p[:, :, None, :], v.transpose(0, 2, 1, 3))[:, :, 0, :]


def _head_major_decode_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The same attention on head-major contiguous K/V (B, H, T, D): Hugging Face's cache layout."""
    scale = np.float32(1.0 / math.sqrt(q.shape[-1]))
    scores = np.matmul(k, (q * scale)[..., None])[..., 0]                           # (B, H, T)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.matmul(p[:, :, None, :], v)[:, :, 0, :]


def _per_token_loop_attention(q, k_cache, v_cache, block_tables, context_lens, per_head=False):
    """The kernel as Python loops over every token (and, with per_head, every head too).

    The baselines vectorisation is measured against: what the formula looks like when each
    token is looked up through the block table one at a time.
    """
    batch, n_head, head_dim = q.shape
    block_size = k_cache.shape[1]
    scale = 1.0 / math.sqrt(head_dim)
    out = np.zeros_like(q)
    heads = [[h] for h in range(n_head)] if per_head else [slice(None)]
    for b in range(batch):
        for h in heads:
            scores = np.empty((context_lens[b], n_head), np.float32)[:, h]
            for i in range(context_lens[b]):
                k = k_cache[block_tables[b, i // block_size], i % block_size, h]      # (heads, D)
                scores[i] = (k * q[b, h]).sum(axis=-1) * scale
            p = np.exp(scores - scores.max(axis=0))
            p /= p.sum(axis=0)
            for i in range(context_lens[b]):
                out[b, h] += p[i][:, None] * v_cache[block_tables[b, i // block_size], i % block_size, h]
    return out


def _chunk_columns(q, k_cache) -> int:
    """Block columns per step of the kernel: as many as fit in PAGED_ATTENTION_CHUNK_BYTES."""
    batch, n_head, head_dim = q.shape
    return max(1, lab.PAGED_ATTENTION_CHUNK_BYTES // (batch * k_cache.shape[1] * n_head * head_dim * 4))


def _table_floors(q, k_cache, v_cache, block_tables):
    """Two floors of a kernel that reads K/V through block tables, as functions to time.

    `gather`: only the gathers, the same block columns into the same reused buffers as the
    kernel (`BlockGather`, PAGED_ATTENTION_CHUNK_BYTES of K a step): what reading through a table
    costs in NumPy before any arithmetic. `gather_matmuls`: those gathers plus the two batched
    matmuls per chunk (scores, weighted values) on the gathered buffer, without the online
    softmax's max, exp and rescaling. Every context is full length (the bench's case).
    """
    batch, n_head, head_dim = q.shape
    step = _chunk_columns(q, k_cache)
    columns = lab.BlockGather(k_cache, v_cache, None, None, batch, step)
    qv = q[..., None]

    def gather():
        for j in range(0, block_tables.shape[1], step):
            columns.gather(block_tables[:, j:j + step])

    def gather_matmuls():
        acc = np.zeros((batch, n_head, 1, head_dim), np.float32)
        for j in range(0, block_tables.shape[1], step):
            k, v, _, _ = columns.gather(block_tables[:, j:j + step])
            scores = np.matmul(k.transpose(0, 2, 1, 3), qv)
            acc += np.matmul(scores.transpose(0, 1, 3, 2), v.transpose(0, 2, 1, 3))
        return acc
    return gather, gather_matmuls


def _int8_gather(q, k_int8, v_int8, k_scale, v_scale, block_tables):
    """The int8 kernel's gathers alone, as a function to time: the same block columns as the
    kernel, each taken as int8, cast into the reused float32 buffer and its scales taken
    (`BlockGather` on the int8 cache), with no arithmetic after them."""
    batch = q.shape[0]
    step = _chunk_columns(q, k_int8)
    columns = lab.BlockGather(k_int8, v_int8, k_scale, v_scale, batch, step)

    def gather():
        for j in range(0, block_tables.shape[1], step):
            columns.gather(block_tables[:, j:j + step])
    return gather


def _cast_rates(kib: tuple[int, ...] = (256, 3072), repeats: int = 20) -> dict:
    """Elements per second of np.copyto int8 -> float32 (the int8 gather's cast) and float32 ->
    float32 (a plain copy), into a destination of each size in KiB: one that stays in L2 and
    one that does not."""
    rates = {}
    for size in kib:
        n = size * 256                                   # float32 elements in `size` KiB
        dst, src8, src32 = np.empty(n, np.float32), np.ones(n, np.int8), np.ones(n, np.float32)
        rates["int8", size] = n / _timeit(lambda: np.copyto(dst, src8), repeats)
        rates["float32", size] = n / _timeit(lambda: np.copyto(dst, src32), repeats)
    return rates


def _on_fresh_pages(array: np.ndarray) -> np.ndarray:
    """A copy of `array` in memory that no earlier array of this process used, as a server's
    cache allocated once at start-up is.

    Why: glibc serves a request below its mmap threshold (which grows to up to 32 MiB as large
    arrays are freed) from heap memory that earlier temporaries already faulted in as 4 KiB
    pages, and a random-block gather from 4 KiB pages misses the TLB on every block. Measured
    on this VM: the int8 cache straight out of quantize_int8 (whose temporaries are its size)
    gathered in 22-39 ms, the same bytes in fresh memory in 13-19 ms, beside 15-17 ms for the
    float32 cache. A buffer of at least 64 MiB is always a fresh mmap, which NumPy asks the
    kernel to back with 2 MiB pages.
    """
    buffer = np.empty(max(array.nbytes, 64 * 2**20), np.uint8)
    fresh = buffer[:array.nbytes].view(array.dtype).reshape(array.shape)
    fresh[...] = array
    return fresh


def bench_attention(batch: int = 32, context_len: int = 1000, n_head: int = 12, head_dim: int = 64,
                    block_size: int = 16, loop_seqs: int = 4, repeats: int = 9, seed: int = 0,
                    log=print) -> str:
    """Paged decode attention vs contiguous K/V, vs a per-token Python loop, vs memory bandwidth.

    The physical blocks are shuffled (a pool that has served many requests), with spare blocks
    in the pool. Returns the report; each line also goes to `log` (None: silent) as it is measured.
    """
    rng = np.random.default_rng(seed)
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        if log is not None:
            log(line)

    per_seq = -(-context_len // block_size)
    num_blocks = batch * per_seq + 64
    shape = (num_blocks, block_size, n_head, head_dim)
    k_cache = rng.standard_normal(shape, dtype=np.float32)
    v_cache = rng.standard_normal(shape, dtype=np.float32)
    block_tables = rng.permutation(num_blocks)[:batch * per_seq].reshape(batch, per_seq)
    context_lens = np.full(batch, context_len)
    q = rng.standard_normal((batch, n_head, head_dim), dtype=np.float32)
    # The contiguous layout of the same K/V: what a slab-per-sequence cache would hold.
    k_dense = k_cache[block_tables].reshape(batch, -1, n_head, head_dim)[:, :context_len].copy()
    v_dense = v_cache[block_tables].reshape(batch, -1, n_head, head_dim)[:, :context_len].copy()
    kv_bytes = k_dense.nbytes + v_dense.nbytes
    say(f"bench attention: batch {batch}, context {context_len}, {n_head} heads x {head_dim}, "
        f"block size {block_size}, shuffled physical blocks, K+V read {kv_bytes / 2**20:.0f} MiB per call, "
        f"clock {clock.__name__}")

    # Head-major (batch, head, token, dim), what Hugging Face's cache holds: each (sequence,
    # head) is one contiguous (T, D) matrix, the best layout for a per-head matrix-vector product.
    k_heads = np.ascontiguousarray(k_dense.transpose(0, 2, 1, 3))
    v_heads = np.ascontiguousarray(v_dense.transpose(0, 2, 1, 3))
    # The same K/V as an int8 cache with per-token-and-head scales (KVCache(dtype="int8")).
    (k_int8, k_scale), (v_int8, v_scale) = lab.quantize_int8(k_cache), lab.quantize_int8(v_cache)
    # Both caches in fresh memory, as a server allocates its cache: see _on_fresh_pages.
    k_cache, v_cache, k_int8, v_int8, k_scale, v_scale = map(
        _on_fresh_pages, (k_cache, v_cache, k_int8, v_int8, k_scale, v_scale))
    int8_bytes = (k_int8.nbytes + v_int8.nbytes + k_scale.nbytes + v_scale.nbytes) * kv_bytes // (
        k_cache.nbytes + v_cache.nbytes)   # the share of the pool this batch reads

    paged = lambda: lab.paged_attention(q, k_cache, v_cache, block_tables, context_lens)
    dense = lambda: _contiguous_decode_attention(q, k_dense, v_dense)
    heads = lambda: _head_major_decode_attention(q, k_heads, v_heads)
    int8 = lambda: lab.paged_attention(q, k_int8, v_int8, block_tables, context_lens, k_scale=k_scale, v_scale=v_scale)
    out_paged, out_dense = paged(), dense()
    say(f"  dtypes: q {q.dtype}, cache {k_cache.dtype}, paged out {out_paged.dtype}, "
        f"contiguous out {out_dense.dtype}; max |paged - contiguous| "
        f"{float(np.abs(out_paged - out_dense).max()):.1e}, max |paged - head-major| "
        f"{float(np.abs(out_paged - heads()).max()):.1e}, max |int8 - float32| "
        f"{float(np.abs(int8() - out_paged).max()):.1e}")

    gather, gather_matmuls = _table_floors(q, k_cache, v_cache, block_tables)
    gather_int8 = _int8_gather(q, k_int8, v_int8, k_scale, v_scale, block_tables)
    t = _best_side_by_side({"paged": paged, "dense": dense, "heads": heads, "int8": int8, "gather": gather,
                            "floor": gather_matmuls, "gather int8": gather_int8}, repeats)
    say(f"  paged {t['paged'] * 1e3:.1f} ms, contiguous {t['dense'] * 1e3:.1f} ms: "
        f"paged / contiguous = {t['paged'] / t['dense']:.2f}x (goal <= 1.3x)")
    say(f"  head-major contiguous (batch, head, token, dim) {t['heads'] * 1e3:.1f} ms: "
        f"paged / head-major = {t['paged'] / t['heads']:.2f}x (goal <= 1.5x), token-major "
        f"contiguous / head-major = {t['dense'] / t['heads']:.2f}x")
    say(f"  the floor of any NumPy kernel that reads blocks through the table: gathering the same blocks "
        f"column by column into a reused buffer (BlockGather, {_chunk_columns(q, k_cache)} columns a step) "
        f"{t['gather'] * 1e3:.1f} ms = {t['gather'] / t['heads']:.2f}x head-major on its own")
    say(f"    gather + head-major compute {(t['gather'] + t['heads']) * 1e3:.1f} ms: paged / that = "
        f"{t['paged'] / (t['gather'] + t['heads']):.2f}x (goal <= 1.15x); tighter, gather + the two matmuls on "
        f"the gathered buffer {t['floor'] * 1e3:.1f} ms: paged / that = {t['paged'] / t['floor']:.2f}x "
        f"(the rest is the online softmax's bookkeeping)")
    say(f"  paged on int8 blocks {t['int8'] * 1e3:.1f} ms = {t['int8'] / t['paged']:.2f}x the float32 "
        f"kernel (goal <= 0.9x): reads {int8_bytes / 2**20:.0f} MiB instead of {kv_bytes / 2**20:.0f} MiB; "
        f"each column is cast to float32 inside the gather into the reused buffer, the scales multiply "
        f"the scores and probabilities")
    # What int8 can save is only the gather: everything after it is the same float32 work.
    after = t["paged"] - t["gather"]
    rates = _cast_rates()
    say(f"    its floor: the int8 gathers alone (take int8, cast into the float32 buffer, take the scales) "
        f"{t['gather int8'] * 1e3:.1f} ms against {t['gather'] * 1e3:.1f} ms for float32; the float32 kernel's "
        f"work after its gathers ({after * 1e3:.1f} ms) is the same on the cast buffer, so int8 / float32 >= "
        f"(gather int8 + that) / paged = {(t['gather int8'] + after) / t['paged']:.2f}x")
    say("    the cast runs at copy speed whatever the destination's size: np.copyto int8 -> float32 " + ", ".join(
        f"{rates['int8', kib] / 1e9:.1f}" for kib in (256, 3072)) + " G elements/s into 256 KiB (L2) / 3 MiB, "
        "float32 -> float32 " + ", ".join(f"{rates['float32', kib] / 1e9:.1f}" for kib in (256, 3072)) +
        " G elements/s: every int8 element read is a float32 element written")

    for per_head, seqs in ((False, min(loop_seqs, batch)), (True, 1)):
        sub = (q[:seqs], k_cache, v_cache, block_tables[:seqs], context_lens[:seqs])
        out_loop = _per_token_loop_attention(*sub, per_head=per_head)
        assert np.allclose(out_loop, out_paged[:seqs], atol=1e-5), "the loop baseline disagrees"
        t_loop = _timeit(lambda: _per_token_loop_attention(*sub, per_head=per_head), 1) * batch / seqs
        say(f"  Python loop over tokens{' and heads' if per_head else ' (heads vectorised)'} "
            f"{t_loop * 1e3:.0f} ms (timed on {seqs} sequence{'s' * (seqs > 1)}, scaled x{batch / seqs:g}): "
            f"paged is {t_loop / t['paged']:.0f}x faster (goal >= 30x); the loop reads K/V at "
            f"{kv_bytes / t_loop / 1e9:.2f} GB/s")

    copy_bw = copy_bandwidth()
    paged_bw = kv_bytes / t["paged"]
    say(f"  np.copyto bandwidth {copy_bw / 1e9:.1f} GB/s copied ({2 * copy_bw / 1e9:.1f} GB/s "
        f"read + written); paged kernel reads K/V at {paged_bw / 1e9:.1f} GB/s = "
        f"{paged_bw / copy_bw:.0%} of the copy rate (goal >= 50%), contiguous at "
        f"{kv_bytes / t['dense'] / 1e9:.1f} GB/s")
    return "\n".join(lines)


def bench_kv_int8(num_prompts: int = 32, max_tokens: int = 32, seed: int = 0, log=print) -> str:
    """What an int8 KV cache costs in accuracy: the same greedy requests on a float32 and an
    int8 engine, for the default ModelConfig and a wider one.

    Reports the cache bytes, how many whole greedy outputs and first tokens agree, and, teacher
    forced along the float32 engine's outputs (so both caches see the same tokens), the share of
    positions whose argmax agrees and the max |logit difference|.
    """
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        if log is not None:
            log(line)

    for config in (lab.ModelConfig(), lab.ModelConfig(vocab_size=1024, n_embd=256, n_layer=4, n_head=4)):
        model = lab.ToyTransformer(config, seed=seed)
        rng = np.random.default_rng(seed)
        prompts = [rng.integers(0, config.vocab_size, int(rng.integers(4, 64))).tolist() for _ in range(num_prompts)]
        sampling = lab.SamplingParams(max_tokens=max_tokens)
        engines = {dtype: lab.LLMEngine(model, max_num_seqs=8, kv_cache_dtype=dtype) for dtype in lab.KV_CACHE_DTYPES}
        outs = {dtype: engine.generate(prompts, sampling) for dtype, engine in engines.items()}
        whole = sum(a.output_token_ids == b.output_token_ids for a, b in zip(outs["float32"], outs["int8"]))
        first = sum(a.output_token_ids[0] == b.output_token_ids[0] for a, b in zip(outs["float32"], outs["int8"]))
        agree = total = 0
        max_err = max_logit = 0.0
        for prompt, out in zip(prompts, outs["float32"]):
            tokens = prompt + out.output_token_ids[:-1]
            logits = {}
            for dtype in lab.KV_CACHE_DTYPES:
                seq = lab.PagedSequence(model)
                seq.cache = lab.KVCache(config, seq.cache.num_blocks, seq.cache.block_size, dtype=dtype)
                seq.extend(tokens)
                logits[dtype] = seq.run()[len(prompt) - 1:]   # the positions that chose an output
            agree += int((logits["float32"].argmax(-1) == logits["int8"].argmax(-1)).sum())
            total += len(out.output_token_ids)
            max_err = max(max_err, float(np.abs(logits["float32"] - logits["int8"]).max()))
            max_logit = max(max_logit, float(np.abs(logits["float32"]).max()))
        f32, i8 = engines["float32"].kv_cache.nbytes, engines["int8"].kv_cache.nbytes
        say(f"bench kv-int8: n_embd {config.n_embd}, {config.n_layer} layers, {config.n_head} heads x "
            f"{config.head_dim}, vocab {config.vocab_size}, {num_prompts} prompts x {max_tokens} greedy tokens")
        say(f"  cache {f32 / 2**20:.1f} MiB float32 -> {i8 / 2**20:.1f} MiB int8 ({f32 / i8:.2f}x smaller, "
            f"scales included)")
        say(f"  greedy outputs identical {whole}/{num_prompts}, first tokens {first}/{num_prompts}; teacher-"
            f"forced argmax agreement {agree}/{total} = {agree / total:.1%}; max |logit diff| {max_err:.3f} "
            f"(logits up to {max_logit:.1f})")
    return "\n".join(lines)


def _large_matvec(nbytes: int = 256 * 2**20):
    """A float32 (1, n) @ (n, n) product whose matrix is far larger than the caches, and its bytes.

    The roofline of a batch-1 decode step: every weight is read once for one row of activations.
    """
    n = math.isqrt(nbytes // 4)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, n), dtype=np.float32)
    x = rng.standard_normal((1, n), dtype=np.float32)
    return (lambda: x @ w), w.nbytes


def bench_decode(n_embd: int = 1024, n_layer: int = 6, n_head: int = 16, vocab_size: int = 4096,
                 context_len: int = 32, batch_sizes=(1, 2, 4, 8, 16, 32), block_size: int = 16,
                 repeats: int = 5, log=print) -> str:
    """Decode throughput of the paged model vs the bare weight GEMMs, and batch-1 bytes/s.

    One decode step = `forward` of one new token per sequence at position context_len - 1, with
    the earlier K/V already in the cache (the step is repeated in place: it rewrites the same K/V).
    The ceiling runs the same weight products on random activations of the same batch size:
    the best any implementation on this BLAS could do, with attention, LayerNorm and Python free.
    Returns the report; each line also goes to `log` (None: silent) as it is measured.
    """
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        if log is not None:
            log(line)

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
        allocator = lab.BlockAllocator(batch * -(-context_len // block_size) + 1, block_size)
        kv_cache = lab.KVCache(config, allocator.num_blocks, block_size)
        tables = [lab.BlockTable(allocator) for _ in range(batch)]
        for table in tables:
            table.append_tokens(rng.integers(0, vocab_size, context_len).tolist())
        model.forward(kv_cache, tables, [0] * batch, [context_len] * batch)   # prefill
        x = rng.standard_normal((batch, n_embd), dtype=np.float32)
        h = rng.standard_normal((batch, 4 * n_embd), dtype=np.float32)

        def weight_gemms():
            for layer in model.layers:
                x @ layer["attn.c_attn.weight"], x @ layer["attn.c_proj.weight"]
                x @ layer["mlp.c_fc.weight"], h @ layer["mlp.c_proj.weight"]
            return x @ model.weights["wte.weight"].T

        step = lambda: model.forward(kv_cache, tables, [context_len - 1] * batch, [1] * batch)
        logits = step()
        fns = {"model": step, "gemm": weight_gemms}
        if batch == 1:  # the roofline is measured in the same turns as the step it judges
            fns["matvec"], matvec_bytes = _large_matvec()
        t = _best_side_by_side(fns, repeats)
        if batch == 1:
            matvec_bw = matvec_bytes / t["matvec"]
        model_time[batch], gemm_time[batch] = t["model"], t["gemm"]
        say(f"  batch {batch:2d}: model {t['model'] * 1e3:6.1f} ms/step = {batch / t['model']:6.0f} tok/s, "
            f"weight GEMMs {t['gemm'] * 1e3:6.1f} ms = {batch / t['gemm']:6.0f} tok/s "
            f"(model/GEMMs {t['model'] / t['gemm']:.2f}x, logits {logits.dtype})")
    lo, hi = batch_sizes[0], batch_sizes[-1]
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
    return "\n".join(lines)


def _measure_engine(model: lab.ToyTransformer, workload: list[tuple[float, int, int]], scheduling: str,
                    max_num_seqs: int) -> tuple[float, int]:
    """Wall-clock seconds and output tokens of one engine run (greedy, every request queued at once)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, p).tolist() for _, p, _ in workload]
    sampling = [lab.SamplingParams(max_tokens=o) for _, _, o in workload]
    engine = lab.LLMEngine(model, max_num_seqs=max_num_seqs, scheduling=scheduling)
    start = time.perf_counter()
    outputs = engine.generate(prompts, sampling)
    return time.perf_counter() - start, sum(len(o.output_token_ids) for o in outputs)


def _best_runs(model, workload, slots: int, repeats: int = 3) -> dict:
    """(seconds, tokens) of the fastest of `repeats` runs per scheduling, static and continuous in
    turns after a warm-up, so that load on the machine hits both alike."""
    _measure_engine(model, workload[:8], "continuous", slots)
    runs = {"static": [], "continuous": []}
    for _ in range(repeats):
        for scheduling, times in runs.items():
            times.append(_measure_engine(model, workload, scheduling, slots))
    return {scheduling: min(times) for scheduling, times in runs.items()}


def bench_batching(slots: int = 16) -> str:
    """`python tools/bench.py batching`: the scenario in the simulator, then measured wall-clock
    on the toy model at sizes scaled by 1/10 to fit its n_positions = 256 (answers of 200 and 5
    tokens instead of 2000 and 50), beside the simulator's prediction for the same workloads."""
    out = [scenarios.scenario_batching(lab, slots)]
    model = lab.ToyTransformer(lab.ModelConfig())
    out.append(f"\n== Toy model ({model.config.n_layer} layers, n_embd {model.config.n_embd}), wall-clock, "
               f"{slots} slots, sizes / 10: answers of 200 and 5 tokens, prompts 13, all queued at t=0; best of 3 ==")
    out.append(f"{'workload':<34}{'static tok/s':>14}{'continuous tok/s':>18}{'measured':>10}{'simulated':>11}")
    for name, workload in (("skewed (1 long + 63 short)", simulator.skewed_workload(63, 200, 5, 13)),
                           ("one in eight long (128 requests)", simulator.recurring_workload(128, 200, 5, 13, rate=0))):
        best = _best_runs(model, workload, slots)
        (ts, ns), (tc, nc) = best["static"], best["continuous"]
        sim_s, sim_c = scenarios._static_and_continuous(lab, workload, slots)
        out.append(f"{name:<34}{ns / ts:>14.0f}{nc / tc:>18.0f}{(nc / tc) / (ns / ts):>9.2f}x"
                   f"{sim_c.throughput / sim_s.throughput:>10.2f}x")
    out.append("On a CPU the toy model's step cost grows with the batch (its weights sit in cache; nothing\n"
               "like a GPU's fixed weight read), so the measured gain is smaller than the simulated one.")
    return "\n".join(out)


# The bench model must make a decode step weight-read-bound: GPT-2-small's body (12 layers,
# n_embd 768) with a 4096-token vocabulary is ~350 MB of float32 weights, ten times this CPU's
# 32 MB L3, so every decode step streams all of them from DRAM.
SPEC_BENCH_CONFIG = dict(vocab_size=4096, n_positions=512, n_embd=768, n_layer=12, n_head=12)


SPEC_BENCH_DRAFT_LAYERS = 1


# Layers past the draft's get their residual-branch output projections scaled by this. With the
# default init a 1-of-12-layer self-draft almost never agrees with the target (alpha ~0), because
# random layers each rotate the residual stream as much as the first. Trained LLMs are not like
# that: the final token is usually decided layers before the end, which is what early exit and
# self-speculation exploit (Elhoushi et al. 2024, "LayerSkip", arXiv:2404.16710; Zhang et al.
# 2023, "Draft & Verify", arXiv:2309.08168). Shrinking the later layers' updates mimics such a
# model; the value only sets how often the draft agrees, and alpha is measured, not assumed.
SPEC_BENCH_REFINEMENT_SCALE = 0.02


# Draft tokens per round. Fixed, so that runs compare: with alpha ~0.9 the extended prediction
# peaks at k = 6..8 on a 2-core CPU (the table the bench prints shows the others).
SPEC_BENCH_K = 8


def _progress(message: str) -> None:
    # Progress goes to stderr, so stdout stays the report that `bench_speculative` returns.
    print(f"  ... {message}", file=sys.stderr, flush=True)


def _forward_call(model: lab.ToyTransformer, batch: int, context_len: int, num_new: int):
    """A callable running one paged forward in which each of `batch` sequences has `context_len`
    tokens cached and processes `num_new` more (1: a decode step; k+1: a verify pass; a prompt
    from position 0: prefill). Re-running overwrites the same slots, so every call does the same
    work."""
    block_size = 16
    per_seq = lab.blocks_needed(context_len + num_new, block_size)
    allocator = lab.BlockAllocator(batch * per_seq, block_size)
    cache = lab.KVCache(model.config, batch * per_seq, block_size)
    rng = np.random.default_rng(0)
    tables = []
    for _ in range(batch):
        table = lab.BlockTable(allocator)
        table.append_tokens(rng.integers(0, model.config.vocab_size, context_len + num_new).tolist())
        tables.append(table)
    starts, counts = [context_len] * batch, [num_new] * batch
    if model.forward(cache, tables, starts, counts).dtype != np.float32:
        raise TypeError("the model path promoted its activations to float64: keep it float32")
    return lambda: model.forward(cache, tables, starts, counts)


def _round_overhead_seconds(vocab_size: int, k: int, repeats: int) -> float:
    """The Python/NumPy work of one greedy speculative round besides the forward passes: k draft
    `token_probs` + draws, the target's (k+1)-row `token_probs`, `accept_or_resample`, and the
    truncate + append on both block tables."""
    rng = np.random.default_rng(0)
    draft_logits = rng.standard_normal((k, vocab_size)).astype(np.float32)
    target_logits = rng.standard_normal((k + 1, vocab_size)).astype(np.float32)
    tables = [lab.BlockTable(lab.BlockAllocator(64, 16)) for _ in range(2)]
    for table in tables:
        table.append_tokens(list(range(100)))

    def one_round():
        drafts, q_rows = [], []
        for row in draft_logits:
            q = lab.token_probs(row, 0.0)
            drafts.append(int(rng.choice(len(q), p=q)))
            q_rows.append(q)
        emitted = lab.accept_or_resample(drafts, np.array(q_rows), lab.token_probs(target_logits, 0.0), rng)
        for table in tables:
            table.truncate(100 - k)
            table.append_tokens(list(range(k - len(emitted) + 1)) + emitted[-1:])
            table.truncate(100)
    return _best_side_by_side({"round": one_round}, repeats)["round"]


def _read_bandwidth() -> float:
    """Bytes/s of the plainest DRAM stream NumPy has, a sum over 256 MB: the yardstick for a
    decode step's weight reads."""
    a = np.ones(2**26, dtype=np.float32)
    return a.nbytes / _best_side_by_side({"sum": a.sum}, 3)["sum"]


def bench_speculative(num_tokens: int = 96, repeats: int = 5) -> str:
    """`python tools/bench.py speculative`: should we add speculative decoding?

    Prints a progress line per measurement (stderr) and returns the report: the expected-speedup
    table for the measured draft cost, the measured point (alpha from greedy acceptance counts,
    draft cost c, verify cost, the paper's, extended and refined predictions, the measured
    wall-clock speedup of `speculative_generate` over `paged_greedy_generate` at batch 1), and
    the measurements behind "it helps decode, not prefill, and less at large batch".
    All timings are best-of-N of interleaved runs on the paged path, after a warm-up.
    """
    config, m = lab.ModelConfig(**SPEC_BENCH_CONFIG), SPEC_BENCH_DRAFT_LAYERS
    _progress(f"building the target ({config.n_layer} layers, n_embd {config.n_embd}, vocab "
              f"{config.vocab_size}) and its {m}-layer self-draft")
    target = scenarios.make_early_exit_target(lab, config, m, SPEC_BENCH_REFINEMENT_SCALE)
    draft = lab.make_self_draft(target, m)
    weight_bytes = sum(w.nbytes for w in target.weights.values())
    dtypes = "/".join(sorted({str(w.dtype) for w in target.weights.values()}))
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, 8).tolist()
    greedy = lab.SamplingParams(max_tokens=num_tokens, temperature=0.0)
    ctx = len(prompt) + num_tokens // 2  # a mid-generation context for the per-step costs
    ks = (1, 2, 3, 4, 6, 8)
    _progress(f"built: {weight_bytes / 1e6:.0f} MB of {dtypes} weights; measuring per-step costs")

    # 1. Per-step costs at batch 1, relative to one target decode step t1: a draft step (1 and 2
    #    tokens) and a target pass over k+1 tokens for each k, measured with the runs below.
    read_bw = _read_bandwidth()
    steps = {"t1": _forward_call(target, 1, ctx, 1), "d1": _forward_call(draft, 1, ctx, 1),
             "d2": _forward_call(draft, 1, ctx, 2)}
    steps |= {f"v{k}": _forward_call(target, 1, ctx, k + 1) for k in ks}
    k = SPEC_BENCH_K

    # 2. Wall clock at batch 1 (same model, prompt, number of output tokens), interleaved with
    #    the per-step costs so that a neighbour's load hits the prediction and the measurement alike.
    overhead = _round_overhead_seconds(config.vocab_size, k, 20)
    spec_out: list[lab.SpeculativeOutput] = []
    plain_out: list[list[int]] = []
    runs = {"plain": lambda: plain_out.append(scenarios.paged_greedy_generate(lab, target, prompt, num_tokens)),
            "spec": lambda: spec_out.append(lab.speculative_generate(target, draft, prompt, greedy, k=k))}
    best = _best_side_by_side(runs | steps, repeats)
    t1 = best["t1"]
    c, c2 = best["d1"] / t1, best["d2"] / t1
    verify = {kk: best[f"v{kk}"] / t1 for kk in ks}
    wall = best
    spec = spec_out[-1]
    if spec.token_ids != plain_out[-1]:
        raise AssertionError("greedy speculative decoding emitted other tokens than plain greedy decoding")
    measured = wall["plain"] / wall["spec"]
    _progress(f"plain {wall['plain']:.2f} s, speculative (k={k}) {wall['spec']:.2f} s: {measured:.2f}x; "
              f"t1 {t1 * 1e3:.1f} ms ({weight_bytes / t1 / 1e9:.1f} GB/s of weights, a 256 MB sum "
              f"{read_bw / 1e9:.1f} GB/s), c = {c:.3f}, verify cost {verify[k]:.2f}")
    alpha = lab.estimate_alpha(spec, k)
    extended = {kk: lab.predicted_speedup(alpha, kk, c, verify[kk]) for kk in ks}
    E = lab.expected_tokens_per_step(alpha, k)
    paper = lab.speculative_speedup(alpha, k, c)
    ext = lab.predicted_speedup(alpha, k, c, verify[k])
    # Refined with two measured per-round terms the formula leaves out: after a fully accepted
    # round (probability alpha**k) the draft's next pass covers 2 tokens (its own last draft, never
    # run, and the bonus token); and the sampler/accept/rollback work. Plain decoding pays t1
    # plus an argmax per token.
    refined = E / (k * c + alpha ** k * (c2 - c) + verify[k] + overhead / t1)
    params = lab.SamplingParams(max_tokens=64, temperature=1.0, seed=0)
    sampled = lab.speculative_generate(target, draft, prompt, params, k=k)
    alpha_sampled = lab.estimate_alpha(sampled, k)
    _progress(f"sampled (T=1) run: alpha = {alpha_sampled:.3f}")

    # 3. Prefill: P prompt tokens in one pass, and P/2, against P decode steps.
    P = 256
    pre = _best_side_by_side({"P": _forward_call(target, 1, 0, P), "P/2": _forward_call(target, 1, 0, P // 2)}, 3)
    _progress(f"prefill {P} tokens {pre['P'] * 1e3:.0f} ms, {P // 2} tokens {pre['P/2'] * 1e3:.0f} ms")

    # 4. Batch 32: a decode step vs a verify pass of k+1 tokens per sequence; the draft's step.
    B = 32
    big = _best_side_by_side({"t": _forward_call(target, B, ctx, 1), "v": _forward_call(target, B, ctx, k + 1),
                         "d": _forward_call(draft, B, ctx, 1)}, 3)
    verify_b, c_b = big["v"] / big["t"], big["d"] / big["t"]
    pred_b = lab.predicted_speedup(alpha, k, c_b, verify_b)
    _progress(f"batch {B}: decode step {big['t'] * 1e3:.0f} ms, verify pass {big['v'] * 1e3:.0f} ms "
              f"(cost {verify_b:.2f}), draft step {big['d'] * 1e3:.1f} ms")

    within = abs(measured / ext - 1) <= 0.2
    fast = measured > 1.5 and alpha >= 0.7
    head = f"{'k':>3} {'verify cost':>12} {'paper (v=1)':>12} {'extended':>9}"
    return "\n".join([
        scenarios.format_speculation_table(lab, round(c, 3)),
        "",
        f"== Measured point, batch 1: target {config.n_layer} layers x n_embd {config.n_embd}, vocab "
        f"{config.vocab_size} ({weight_bytes / 1e6:.0f} MB of {dtypes}); draft = its first {m} layer(s) + "
        f"embeddings + head; layers >= {m} have c_proj x {SPEC_BENCH_REFINEMENT_SCALE} ==",
        f"decode step t1 = {t1 * 1e3:.1f} ms: the weights stream at {weight_bytes / t1 / 1e9:.1f} GB/s, "
        f"a plain 256 MB sum at {read_bw / 1e9:.1f} GB/s -> bandwidth-bound",
        f"draft step {best['d1'] * 1e3:.2f} ms -> c = {c:.3f}",
        f"alpha = {alpha:.3f}, greedy (a draft is accepted iff it is the target's argmax), = accepts / "
        f"(accepts + rejections) over the run; accepted/drafted = {spec.acceptance_rate:.3f} undercounts "
        f"it (drafts after a rejection are never judged). Sampled at T=1: alpha = {alpha_sampled:.3f}",
        f"breakeven c at alpha {alpha:.2f}, k = {k}: {lab.breakeven_draft_cost(alpha, k):.3f} if verify cost 1; "
        f"{(E - verify[k]) / k:.3f} with the measured {verify[k]:.2f}",
        "",
        head, "-" * len(head),
        *(f"{kk:>3} {verify[kk]:>12.2f} {lab.speculative_speedup(alpha, kk, c):>12.2f} {extended[kk]:>9.2f}"
          + ("   <- used" if kk == k else "") for kk in ks),
        "",
        f"k = {k}: {len(spec.token_ids) / spec.num_target_passes:.2f} tokens per target pass "
        f"(E(alpha, k) = {E:.2f})",
        f"predicted: paper {paper:.2f}x | extended, verify cost {verify[k]:.2f}: {ext:.2f}x | refined "
        f"{refined:.2f}x (+ the draft's 2-token catch-up pass, {c2:.3f} steps, after each fully "
        f"accepted round, + {overhead * 1e3:.2f} ms of sampling and rollback per round)",
        f"MEASURED: {num_tokens} tokens, best of {repeats}: plain paged greedy {wall['plain']:.2f} s, "
        f"speculative {wall['spec']:.2f} s -> {measured:.2f}x, identical tokens",
        f"verdict: measured / extended = {measured / ext:.2f} ({'within' if within else 'OUTSIDE'} +-20%); "
        f"{'' if fast else 'NOT '}> 1.5x at alpha >= 0.7. "
        + ("Worth adding for batch-1 decode with a draft this good." if measured > 1.2
           else "Not worth it here."),
        "",
        "Why decode: a decode step streams every weight to make ONE token and leaves the arithmetic",
        f"idle; a pass over {k + 1} tokens reads the same weights, so it costs {verify[k]:.2f} steps, "
        f"not {k + 1}. Not 1",
        "either: CPU BLAS runs a few-row matrix product well below the bandwidth of its matrix-vector",
        "product (a GPU stays near 1 up to dozens of rows). Hence the extended prediction, not the paper's.",
        f"Why not prefill: {P} prompt tokens take {pre['P'] * 1e3:.0f} ms in one pass, "
        f"{pre['P'] / P * 1e3:.2f} ms a token against {t1 * 1e3:.1f} ms a decode step, and twice the "
        f"tokens cost {pre['P'] / pre['P/2']:.2f}x:",
        "the pass is already parallel and compute-bound; no sequential steps to save, no idle FLOPs.",
        f"Why less at batch {B}: the step already carries {B} tokens; {B}x{k + 1} cost {verify_b:.2f} steps "
        f"(vs {verify[k]:.2f} at batch 1) and c = {c_b:.3f}, so the extended prediction is "
        f"{pred_b:.2f}x: the batch has used up the idle compute speculation spends.",
    ])


def _blas_env(blas_threads: int | None) -> dict[str, str]:
    """This process's environment, with OPENBLAS_NUM_THREADS set for a child (None: as it is).
    OpenBLAS reads it once, when NumPy is imported: it must be set before the child starts."""
    env = dict(os.environ)
    if blas_threads is not None:
        env["OPENBLAS_NUM_THREADS"] = str(blas_threads)
    return env


# A server in a child process, as `python solution.py serve` runs one, with the front end in a
# process of its own (what `serve` does) or in a thread of the engine's process (what it did
# before: the two then take turns on one interpreter lock).
_SERVE_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
lab = __import__(sys.argv[2])
from serving import api_server
api_server.FRONTEND_PROCESS = sys.argv[3] == "process"
api_server.serve(lab.LLMEngine(lab.ToyTransformer(lab.ModelConfig(**json.loads(sys.argv[4])))), port=0,
                 stream_interval=int(sys.argv[5]))
"""


def _serve_in_subprocess(config: dict, frontend: str = "process", blas_threads: int | None = 1,
                         stream_interval: int = 1) -> tuple[subprocess.Popen, str]:
    """A server for a model of `config` in a child process, and its URL."""
    proc = subprocess.Popen([sys.executable, "-c", _SERVE_PROBE, str(ROOT), lab.__name__, frontend,
                             json.dumps(config), str(stream_interval)], stdout=subprocess.PIPE, text=True,
                            env=_blas_env(blas_threads))
    found = re.search(r"http://\S+", proc.stdout.readline())  # its first line, or "" if it died
    if not found:
        proc.kill()
        raise RuntimeError("the server process did not start")
    return proc, found.group(0)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(api_server.SHUTDOWN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()


def _health_round_trip(url: str) -> float:
    """Seconds from sending a `GET /health` on a kept-alive connection (its second request) to
    the end of the answer: what any request pays for the HTTP layer before it reaches the engine."""
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10.0) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(2):
            start = time.perf_counter()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            while not reply.endswith(b"\r\n\r\n"):  # a head with Content-Length: 0, nothing after it
                data = sock.recv(4096)
                if not data:
                    raise RuntimeError(f"/health: the connection closed after {reply!r}")
                reply += data
            if not reply.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"/health answered {reply[:60]!r}")
    return time.perf_counter() - start


def _parse_time(config: dict, payloads: list[dict]) -> float:
    """Median seconds the front end spends parsing and checking one of `payloads` (in this process)."""
    model_config, tokenizer = lab.ModelConfig(**config), ByteTokenizer(config["vocab_size"])
    bodies = [json.dumps(p).encode() for p in payloads]
    times = []
    for body in bodies * 4:
        start = time.perf_counter()
        protocol.parse_completion_request(lab, body, model_config, tokenizer, "")
        times.append(time.perf_counter() - start)
    return float(np.median(times))


STREAM_INTERVAL = 8  # `serve --stream-interval`: tokens per streamed chunk, for the third server
SERVING_MODELS = {"the server's default": {}, "n_embd 256 x 4 layers": {"n_embd": 256, "n_layer": 4}}


def bench_serving(num_prompts: int = 64, workload: str = "alpaca", num_alone: int = 16, repeats: int = 5,
                  blas_threads: int | None = 1, log=print) -> None:
    """`python tools/bench.py serving`: for each model, the same requests (a) offline through
    `generate`, (b) through a server whose front end has a process of its own (what `serve`
    runs), (c) through one whose front end is a thread of the engine's process and (d) through
    (b) streaming STREAM_INTERVAL tokens to a chunk, all sent at once (saturation) from this
    process's load generator, in turns, best of `repeats` each; then, for each model, requests
    one at a time on a kept-alive connection (and on new ones), for the TTFT the server (b) adds
    (medians), against one decode step."""
    log(f"== Serving over HTTP: {num_prompts} {workload} requests, all sent at once; servers in child processes "
        f"with OPENBLAS_NUM_THREADS={_blas_env(blas_threads).get('OPENBLAS_NUM_THREADS', 'unset')}, this process "
        f"{os.environ.get('OPENBLAS_NUM_THREADS', 'unset')} ==")
    log(f"{'model':24s} {'offline tok/s':>14s} {'own process':>18s} {'thread':>18s} "
        f"{f'own, interval {STREAM_INTERVAL}':>18s}")
    lone = {}  # model name -> (engine TTFT, served TTFT, decode step, /health round trip, parse), medians
    for name, changes in SERVING_MODELS.items():
        config = dict(cli.SERVE_MODEL, **changes)
        model = lab.ToyTransformer(lab.ModelConfig(**config))
        requests = datasets.make_workload(lab, workload, num_prompts, 0, model.config.n_positions,
                                          model.config.vocab_size)
        sampling = [lab.SamplingParams(max_tokens=r.max_tokens) for r in requests]
        num_tokens = sum(r.max_tokens for r in requests)
        payloads = [benchmark_serving.completion_payload(r, "") for r in requests]
        servers = {frontend: _serve_in_subprocess(config, frontend, blas_threads) for frontend in ("process", "thread")}
        servers["interval"] = _serve_in_subprocess(config, "process", blas_threads, STREAM_INTERVAL)
        offline, served = 0.0, {frontend: 0.0 for frontend in servers}
        try:
            for _ in range(repeats):  # in turns, so that a noisy moment of the machine hits all three
                start = time.perf_counter()
                lab.LLMEngine(model).generate([r.prompt_token_ids for r in requests], sampling)
                offline = max(offline, num_tokens / (time.perf_counter() - start))
                for frontend, (_, url) in servers.items():
                    load = benchmark_serving.run_load(url, payloads, math.inf)
                    summary = benchmark_serving.summarize_load(lab, *load)
                    if summary["completed"] != num_prompts:
                        raise RuntimeError(f"{frontend}: {summary['completed']}/{num_prompts} requests completed")
                    served[frontend] = max(served[frontend], summary["output_throughput"])
            # A warm engine, as the server's is after the loads: a fresh engine's first request
            # took 0.5-1.5 ms longer to its first token than its second on this VM.
            engine = lab.LLMEngine(model)
            engine.generate([r.prompt_token_ids for r in requests], sampling)
            alone = [engine.generate([r.prompt_token_ids], [s])[0].metrics
                     for r, s in zip(requests[:num_alone], sampling)]
            url = servers["process"][1]
            with benchmark_serving.LoadClient(url, 60.0) as client:  # kept alive, as vLLM's benchmark
                client.run(payloads[:1])  # which also sends a test request first
                kept = [client.run([p])[0] for p in payloads[:num_alone]]
            fresh = [benchmark_serving.stream_completion(url, p, 60.0) for p in payloads[:num_alone]]
            if failed := [r.error for r in kept + fresh if not r.ok]:  # check the outputs before timing them
                raise RuntimeError(f"{len(failed)} lone requests failed, the first: {failed[0]}")
            health = [_health_round_trip(url) for _ in range(num_alone)]
            lone[name] = tuple(float(np.median(x)) for x in (
                [m.ttft for m in alone], [benchmark_serving.stream_metrics(lab, r).ttft for r in kept],
                [benchmark_serving.stream_metrics(lab, r).ttft for r in fresh], [g for m in alone for g in m.itl],
                health)) + (_parse_time(config, payloads[:num_alone]),)
        finally:
            for proc, _ in servers.values():
                _stop(proc)
        log(f"{name:24s} {offline:14.0f} " + " ".join(
            f"{served[f]:8.0f} = {served[f] / offline:4.0%}  " for f in ("process", "thread", "interval")))
    for name, (ttft_offline, ttft_served, ttft_fresh, step, health, parse) in lone.items():
        added = ttft_served - ttft_offline
        log(f"TTFT of a lone request, {name} (own-process front end): engine {ttft_offline * 1e3:.2f} ms, "
            f"through the server {ttft_served * 1e3:.2f} ms on a kept-alive connection (on a new one "
            f"{ttft_fresh * 1e3:.2f} ms): the server adds {added * 1e3:.2f} ms, {added / step:.1f} decode steps "
            f"(one: {step * 1e3:.2f} ms); of which the HTTP layer (a GET /health) {health * 1e3:.2f} ms, parsing "
            f"and checking {parse * 1e3:.2f} ms, the rest (two hops between the processes, the first chunk, the "
            f"client reading it) {(added - health - parse) * 1e3:.2f} ms")


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
    models = {"serve model": dict(cli.SERVE_MODEL), "n_embd 512 x 6": VS_TRANSFORMERS_MODEL}
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



# --- the engine against Hugging Face transformers' generate (PyTorch eager, CPU) ----------

VS_TRANSFORMERS_MODEL = dict(vocab_size=4096, n_positions=512, n_embd=512, n_layer=6, n_head=8)
VS_TRANSFORMERS_INSTALL = (
    "bench vs-transformers needs torch and transformers, which are never dependencies of the lab: "
    "install them beside it, e.g. `python -m venv /tmp/torch && /tmp/torch/bin/pip install numpy torch "
    "transformers` (a CPU wheel is enough), then run `/tmp/torch/bin/python tools/bench.py vs-transformers`")


def _vs_transformers_workload(num_requests: int = 64, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs: prompts of 32-96 tokens; one request in eight asks for 192-256
    output tokens, the others for 8-32 (a chat mix: most answers short, a few long)."""
    rng = np.random.default_rng(seed)
    vocab = VS_TRANSFORMERS_MODEL["vocab_size"]
    requests = []
    for i in range(num_requests):
        prompt = rng.integers(0, vocab, int(rng.integers(32, 97))).tolist()
        max_tokens = int(rng.integers(192, 257)) if i % 8 == 0 else int(rng.integers(8, 33))
        requests.append((prompt, max_tokens))
    return requests


def _hf_gpt2(torch, transformers, model):
    """A transformers GPT2LMHeadModel holding exactly the lab model's weights (both use GPT-2's
    Conv1D (in, out) layout and checkpoint names), in eval mode, never stopping at an EOS."""
    c = model.config
    config = transformers.GPT2Config(vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.n_embd,
                                     n_layer=c.n_layer, n_head=c.n_head, layer_norm_epsilon=c.layer_norm_epsilon,
                                     activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=None,
                                     eos_token_id=None, pad_token_id=0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    state = {f"transformer.{name}": torch.from_numpy(w.copy()) for name, w in model.weights.items()}
    state["lm_head.weight"] = state["transformer.wte.weight"]
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.endswith("attn.bias") and not m.endswith("masked_bias")]:
        raise RuntimeError(f"the GPT-2 weights did not map onto transformers: missing {missing}, "
                           f"unexpected {unexpected}")
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def _hf_generate(torch, hf, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy `generate` of a static batch: left-padded prompts, every row runs max_new_tokens."""
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                          min_new_tokens=max_new_tokens, do_sample=False, num_beams=1)
    return [row[width:].tolist() for row in out]


def _engine_breakdown(model, batch: int, prompt_len: int = 64, steps: int = 16) -> dict[str, float]:
    """Seconds per decode step of the engine at `batch` running sequences, split by where the
    time goes: weight GEMMs (the same products on random rows, measured apart), attention
    (`paged_attention`), the rest of the forward (LayerNorm, GELU, embedding, K/V writes, the
    batch layout: NumPy calls and Python), sampling, and the engine's own scheduling and
    bookkeeping (everything of `step()` outside the model call)."""
    timers = collections.Counter()

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[name] += clock() - start
        return wrapper

    rng = np.random.default_rng(batch)
    engine = lab.LLMEngine(model, max_num_seqs=batch)
    for _ in range(batch):
        engine.add_request(rng.integers(0, model.config.vocab_size, prompt_len).tolist(),
                           lab.SamplingParams(max_tokens=steps + 8))
    while engine.scheduler.waiting or engine.num_steps < 2:  # every prompt prefilled, then decode only
        engine.step()
    engine.step()
    saved = lab.paged_attention, lab.sample_token
    lab.paged_attention, lab.sample_token = timed("attention", lab.paged_attention), timed("sampling", lab.sample_token)
    engine.model = model_wrapper = _TimedForward(model, timed)
    engine._run_model = timed("model call", engine._run_model)
    try:
        start = clock()
        for _ in range(steps):
            engine.step()
        total = clock() - start
    finally:
        lab.paged_attention, lab.sample_token = saved
    del model_wrapper
    x = rng.standard_normal((batch, model.config.n_embd), dtype=np.float32)
    h = rng.standard_normal((batch, 4 * model.config.n_embd), dtype=np.float32)

    def weight_gemms():
        for layer in model.layers:
            x @ layer["attn.c_attn.weight"], x @ layer["attn.c_proj.weight"]
            x @ layer["mlp.c_fc.weight"], h @ layer["mlp.c_proj.weight"]
        return x @ model.weights["wte.weight"].T

    weights = _timeit(weight_gemms, 5)
    per = {name: t / steps for name, t in timers.items()}
    forward_rest = per["forward"] - per["attention"] - weights
    return {"step": total / steps, "weights": weights, "attention": per["attention"],
            "rest of forward": max(0.0, forward_rest), "sampling": per["sampling"],
            "scheduling": total / steps - per["model call"],
            "model call rest": per["model call"] - per["forward"] - per["sampling"]}


class _TimedForward:
    """The model with its `forward` timed (everything else passed through)."""

    def __init__(self, model, timed):
        self._model, self.forward = model, timed("forward", model.forward)

    def __getattr__(self, name):
        return getattr(self._model, name)


def _greedy_divergence(torch, hf, model, prompt, ours, theirs) -> tuple[int, float, float]:
    """Where two greedy outputs of the same weights first differ: (position, how far apart the
    two chosen tokens' logits are there, the max |logit difference| of the two implementations
    on that row). Float32 rounding flips a greedy choice only where the gap is within the error."""
    i = next(j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    context = prompt + ours[:i]
    lab_row = model.forward_dense(context)[-1]
    with torch.inference_mode():
        hf_row = hf(torch.tensor([context])).logits[0, -1].numpy()
    gap = abs(float(lab_row[ours[i]] - lab_row[theirs[i]]))
    return i, gap, float(np.abs(lab_row - hf_row).max())


def bench_vs_transformers(num_requests: int = 64, static_batch: int = 8, decode_tokens: int = 128,
                          rounds: int = 2, log=print) -> str:
    """`python tools/bench.py vs-transformers`: the engine against what users run instead.

    The same GPT-2 weights (VS_TRANSFORMERS_MODEL, random) in the lab's engine and in
    transformers' GPT2LMHeadModel (PyTorch eager, CPU, one intra-op thread like OpenBLAS here).
    The workload (`_vs_transformers_workload`) runs greedy through (a) `LLMEngine.generate`,
    all requests at once, (b) `generate` one request at a time, (c) `generate` in static
    batches of `static_batch` (arrival order, left-padded, each batch runs to its longest
    request); (a) and (b) `rounds` times each, in turns, best of each (a noisy minute of the machine
    moves both sides). Outputs are compared token by token before any time is reported. Useful
    tokens/s counts each request's own max_tokens (what a static batch computes beyond them is
    waste). Then the batch-1 decode step of both, and where the engine's step time goes.
    """
    try:
        import torch
        import transformers
    except ImportError:
        if log is not None:
            log(VS_TRANSFORMERS_INSTALL)
        return VS_TRANSFORMERS_INSTALL
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        if log is not None:
            log(line)

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    model = lab.ToyTransformer(lab.ModelConfig(**VS_TRANSFORMERS_MODEL), seed=0)
    hf = _hf_gpt2(torch, transformers, model)
    requests = _vs_transformers_workload(num_requests)
    useful = sum(m for _, m in requests)
    c = model.config
    say(f"bench vs-transformers: GPT-2 n_embd {c.n_embd}, {c.n_layer} layers, {c.n_head} heads, vocab "
        f"{c.vocab_size}, the same float32 weights in both; {num_requests} requests, prompts 32-96 tokens, "
        f"1 in 8 asking 192-256 output tokens, the rest 8-32 ({useful} useful tokens), greedy; torch "
        f"{torch.__version__} ({torch.get_num_threads()} thread), transformers {transformers.__version__}, "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, clock {clock.__name__}")

    # Correctness first: the logits of one prompt agree, then every greedy output, token by token.
    prompt = requests[0][0]
    with torch.inference_mode():
        hf_logits = hf(torch.tensor([prompt])).logits[0].numpy()
    logit_err = float(np.abs(hf_logits - model.forward_dense(prompt)).max())

    t_engine = t_single = math.inf
    for _ in range(rounds):
        start = clock()
        ours = lab.LLMEngine(model).generate([p for p, _ in requests],
                                             [lab.SamplingParams(max_tokens=m) for _, m in requests])
        t_engine = min(t_engine, clock() - start)
        start = clock()
        one_by_one = [_hf_generate(torch, hf, [p], m)[0] for p, m in requests]
        t_single = min(t_single, clock() - start)
    say(f"  engine (continuous batching, all {num_requests} at once), best of {rounds} in turns with the next: "
        f"{t_engine:.1f} s = {useful / t_engine:.0f} useful tokens/s; max |logit difference| to transformers on "
        f"one prompt {logit_err:.1e}")
    say(f"  transformers generate, one request at a time, best of {rounds}: {t_single:.1f} s = "
        f"{useful / t_single:.0f} useful tokens/s")

    start = clock()
    static, computed = [], 0
    for i in range(0, num_requests, static_batch):
        group = requests[i:i + static_batch]
        longest = max(m for _, m in group)
        outs = _hf_generate(torch, hf, [p for p, _ in group], longest)
        static += [out[:m] for out, (_, m) in zip(outs, group)]
        computed += longest * len(group)
    t_static = clock() - start
    say(f"  transformers generate, static batches of {static_batch}: {t_static:.1f} s = {useful / t_static:.0f} "
        f"useful tokens/s ({computed} tokens computed, {useful / computed:.0%} of them useful)")

    same_single = sum(o.output_token_ids == h for o, h in zip(ours, one_by_one))
    same_static = sum(o.output_token_ids == h for o, h in zip(ours, static))
    ties = [_greedy_divergence(torch, hf, model, p, o.output_token_ids, h)
            for (p, _), o, h in zip(requests, ours, one_by_one) if o.output_token_ids != h]
    say(f"  identical greedy outputs: engine vs one at a time {same_single}/{num_requests}, vs static batches "
        f"{same_static}/{num_requests}")
    for position, gap, err in ties:
        say(f"    a request diverges at output token {position}: there the two tokens' logits are {gap:.3f} apart, "
            f"and the two float32 implementations' logits differ by up to {err:.3f} (a near tie, not a bug)")
    if any(gap > 2 * err for _, gap, err in ties):
        raise AssertionError("the engine's greedy outputs differ from transformers' generate on the same "
                             "weights where the logits are no near tie")
    say(f"  engine / generate one at a time = {t_single / t_engine:.2f}x (goal >= 4x), engine / static "
        f"batches of {static_batch} = {t_static / t_engine:.2f}x (goal >= 5x)")

    # Batch 1: a decode step = (time of 1 + n tokens - time of 1 token) / n, sampling included.
    prompt = requests[1][0]
    one = lab.SamplingParams(max_tokens=1)
    many = lab.SamplingParams(max_tokens=1 + decode_tokens)
    fns = {"engine 1": lambda: lab.LLMEngine(model).generate([prompt], one),
           "engine n": lambda: lab.LLMEngine(model).generate([prompt], many),
           "hf 1": lambda: _hf_generate(torch, hf, [prompt], 1),
           "hf n": lambda: _hf_generate(torch, hf, [prompt], 1 + decode_tokens)}
    t = _best_side_by_side(fns, 3)
    step_engine = (t["engine n"] - t["engine 1"]) / decode_tokens
    step_hf = (t["hf n"] - t["hf 1"]) / decode_tokens
    weight_bytes = sum(w.nbytes for name, w in model.weights.items() if name != "wpe.weight")
    say(f"  batch-1 decode step: engine {step_engine * 1e3:.2f} ms, transformers {step_hf * 1e3:.2f} ms: "
        f"engine / transformers = {step_engine / step_hf:.2f}x (goal <= 0.8x); the weights are "
        f"{weight_bytes / 2**20:.0f} MiB, {weight_bytes / step_engine / 1e9:.1f} GB/s for the engine")

    say("  where an engine decode step goes (ms per step; weights = the step's GEMMs timed on their own):")
    keys = ("weights", "attention", "rest of forward", "sampling", "model call rest", "scheduling")
    say("    batch " + "".join(f"{k:>17}" for k in ("step",) + keys))
    for batch in (1, 8, 32, 64):
        b = _engine_breakdown(model, batch)
        say(f"    {batch:5d} " + "".join(f"{b[k] * 1e3:17.2f}" for k in ("step",) + keys))
    return "\n".join(lines)


def bench_trace(repeats: int = 7, log=print) -> str:
    """`python tools/bench.py trace`: what recording costs. Each workload of `python solution.py
    trace` runs on a fresh engine of the module, untraced (the chapter's code, nothing wrapped:
    what every engine that is not traced runs) and traced (`trace.record`: the same run with the
    recorder reading the queues, the pool and the tables after every step), in turns, best of
    `repeats`; then the size of the page of a 200-step trace (a 64-request ShareGPT-like
    `loadtest --save-workload` file replayed, cut at 200 steps)."""
    lines = []

    def say(text: str) -> None:
        lines.append(text)
        log(text)

    say(f"== The trace's recorder: one engine run of each workload, untraced and traced, best of {repeats} ==")
    say(f"{'workload':<17}{'steps':>6}{'untraced ms':>13}{'traced ms':>11}{'traced/untraced':>17}{'page KB':>9}")
    for name in trace.WORKLOADS:
        workload = trace.get_workload(name)
        best = _best_side_by_side({
            "untraced": lambda: trace.drive(trace.build_engine(lab, workload), lab, workload),
            "traced": lambda: trace.record(lab, workload),
        }, repeats)
        recorded = trace.record(lab, workload)
        kb = len(trace.render_page(recorded).encode()) / 1024
        say(f"{name:<17}{len(recorded.frames) - 1:>6}{best['untraced'] * 1e3:>13.1f}{best['traced'] * 1e3:>11.1f}"
            f"{best['traced'] / best['untraced']:>16.2f}x{kb:>9.0f}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "sharegpt-64.jsonl")
        datasets.save_workload(datasets.make_workload(lab, "sharegpt", 64, seed=0), path)
        long = trace.record(lab, trace.get_workload(path), max_steps=200)
    page = trace.render_page(long).encode()
    say(f"a {len(long.frames) - 1}-step trace ({len(long.workload.arrivals)} requests of a ShareGPT-like workload, "
        f"{long.workload.engine['num_blocks']} blocks): the page is {len(page) / 1024:.0f} KB, "
        f"{len(page) / 1024 / (len(long.frames) - 1):.1f} KB a step")
    say("An engine that is not traced runs the chapter's code unchanged: the recorder wraps methods of the traced "
        "engine's own scheduler instance, never a class.")
    return "\n".join(lines)


# Each benchmark prints its lines as it measures them (progress, on a slow machine).
BENCHMARKS = {
    "attention": lambda: bench_attention(log=print),
    "decode": lambda: bench_decode(log=print),
    "kv-int8": lambda: bench_kv_int8(log=print),
    "batching": lambda: print(bench_batching()),
    "speculative": lambda: print(bench_speculative()),
    "serving": lambda: bench_serving(log=print),
    "trace": lambda: bench_trace(log=print),
    "vs-transformers": lambda: bench_vs_transformers(log=print),
    "blas-threads": lambda: print(bench_blas_threads()),
    "serving-threads": lambda: [bench_serving(blas_threads=n, log=print) for n in (1, 2)],
}

NOT_IN_ALL = ("blas-threads", "serving-threads")  # what-if measurements, each minutes long


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", nargs="?", choices=(*BENCHMARKS, "all"), default="all")
    parser.add_argument("--module", default="solution", help="the module to measure: solution or lab")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time in-process benchmarks by this process's CPU seconds, not wall time "
                             "(a shared machine; single-threaded work only)")
    args = parser.parse_args(argv)
    global clock
    clock = time.process_time if args.cpu_time else time.perf_counter
    use_module(args.module)
    try:
        for name in [n for n in BENCHMARKS if n not in NOT_IN_ALL] if args.which == "all" else [args.which]:
            BENCHMARKS[name]()
    except NotImplementedError as exc:
        parser.exit(1, f"bench: {exc} is still a stub in {lab.__name__}.py: write it first\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
