"""`python -m tools.bench attention`: paged decode attention against contiguous K/V, a loop over
tokens, and the memory floor. conftest.py's scoreboard times a student's kernel against
`contiguous_decode_attention` and `per_token_loop_attention`."""

from __future__ import annotations

import math
import time
from types import ModuleType

import numpy as np

from measure.timing import best_side_by_side, best_time
from tools.bench_common import Report


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5, *, clock=time.perf_counter) -> float:
    """Bytes copied per second by np.copyto of a buffer far larger than the CPU caches."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return nbytes / best_time(lambda: np.copyto(dst, src), repeats, clock=clock)


def contiguous_decode_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
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


def per_token_loop_attention(q, k_cache, v_cache, block_tables, context_lens, per_head=False):
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


def _chunk_columns(lab: ModuleType, q, k_cache) -> int:
    """Block columns per step of the kernel: as many as fit in PAGED_ATTENTION_CHUNK_BYTES."""
    batch, n_head, head_dim = q.shape
    return max(1, lab.PAGED_ATTENTION_CHUNK_BYTES // (batch * k_cache.shape[1] * n_head * head_dim * 4))


def _table_floors(lab: ModuleType, q, k_cache, v_cache, block_tables):
    """Two floors of a kernel that reads K/V through block tables, as functions to time.

    `gather`: only the gathers, the same block columns into the same reused buffers as the
    kernel (`BlockGather`, PAGED_ATTENTION_CHUNK_BYTES of K a step): what reading through a table
    costs in NumPy before any arithmetic. `gather_matmuls`: those gathers plus the two batched
    matmuls per chunk (scores, weighted values) on the gathered buffer, without the online
    softmax's max, exp and rescaling. Every context is full length (the bench's case).
    """
    batch, n_head, head_dim = q.shape
    step = _chunk_columns(lab, q, k_cache)
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


def _int8_gather(lab: ModuleType, q, k_int8, v_int8, k_scale, v_scale, block_tables):
    """The int8 kernel's gathers alone, as a function to time: the same block columns as the
    kernel, each taken as int8, cast into the reused float32 buffer and its scales taken
    (`BlockGather` on the int8 cache), with no arithmetic after them."""
    batch = q.shape[0]
    step = _chunk_columns(lab, q, k_int8)
    columns = lab.BlockGather(k_int8, v_int8, k_scale, v_scale, batch, step)

    def gather():
        for j in range(0, block_tables.shape[1], step):
            columns.gather(block_tables[:, j:j + step])
    return gather


def _cast_rates(clock, kib: tuple[int, ...] = (256, 3072), repeats: int = 20) -> dict:
    """Elements per second of np.copyto int8 -> float32 (the int8 gather's cast) and float32 ->
    float32 (a plain copy), into a destination of each size in KiB: one that stays in L2 and
    one that does not."""
    rates = {}
    for size in kib:
        n = size * 256                                   # float32 elements in `size` KiB
        dst = np.empty(n, np.float32)
        src8 = np.ones(n, np.int8)
        src32 = np.ones(n, np.float32)
        rates["int8", size] = n / best_time(lambda: np.copyto(dst, src8), repeats, clock=clock)
        rates["float32", size] = n / best_time(lambda: np.copyto(dst, src32), repeats, clock=clock)
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


def bench_attention(lab: ModuleType, batch: int = 32, context_len: int = 1000, n_head: int = 12, head_dim: int = 64,
                    block_size: int = 16, loop_seqs: int = 4, repeats: int = 9, seed: int = 0,
                    log=print, clock=time.perf_counter) -> str:
    """Paged decode attention of the module `lab` vs contiguous K/V, vs a per-token Python loop, vs
    memory bandwidth, timed by `clock`.

    The physical blocks are shuffled (a pool that has served many requests), with spare blocks
    in the pool. Returns the report; each line also goes to `log` (None: silent) as it is measured.
    """
    say = Report(log)
    case = _attention_case(batch, context_len, n_head, head_dim, block_size, seed)
    q, k_cache, v_cache, block_tables, context_lens, k_dense, v_dense = case
    kv_bytes = k_dense.nbytes + v_dense.nbytes
    say(f"bench attention: batch {batch}, context {context_len}, {n_head} heads x {head_dim}, "
        f"block size {block_size}, shuffled physical blocks, K+V read {kv_bytes / 2**20:.0f} MiB per call, "
        f"clock {clock.__name__}")
    t, out_paged = _against_contiguous(lab, say, case, repeats, clock)
    for per_head, seqs in ((False, min(loop_seqs, batch)), (True, 1)):
        sub = (q[:seqs], k_cache, v_cache, block_tables[:seqs], context_lens[:seqs])
        out_loop = per_token_loop_attention(*sub, per_head=per_head)
        assert np.allclose(out_loop, out_paged[:seqs], atol=1e-5), "the loop baseline disagrees"
        t_loop = best_time(lambda: per_token_loop_attention(*sub, per_head=per_head), 1, clock=clock) * batch / seqs
        say(f"  Python loop over tokens{' and heads' if per_head else ' (heads vectorised)'} "
            f"{t_loop * 1e3:.0f} ms (timed on {seqs} sequence{'s' * (seqs > 1)}, scaled x{batch / seqs:g}): "
            f"paged is {t_loop / t['paged']:.0f}x faster ({_goal(t_loop / t['paged'], '>=', 30, 'x')}); the loop "
            f"reads K/V at "
            f"{kv_bytes / t_loop / 1e9:.2f} GB/s")

    copy_bw = copy_bandwidth(clock=clock)
    paged_bw = kv_bytes / t["paged"]
    say(f"  np.copyto bandwidth {copy_bw / 1e9:.1f} GB/s copied ({2 * copy_bw / 1e9:.1f} GB/s "
        f"read + written); paged kernel reads K/V at {paged_bw / 1e9:.1f} GB/s = "
        f"{paged_bw / copy_bw:.0%} of the copy rate ({_goal(100 * paged_bw / copy_bw, '>=', 50, '%')}), contiguous at "
        f"{kv_bytes / t['dense'] / 1e9:.1f} GB/s")
    return say.text()


def _goal(value: float, sense: str, bound: float, unit: str) -> str:
    """A ratio's goal (docs/performance.md) and whether this run meets it."""
    met = value >= bound if sense == ">=" else value <= bound
    return f"goal {sense} {bound:g}{unit}: {'met' if met else 'NOT met'}"


def _attention_case(batch: int, context_len: int, n_head: int, head_dim: int, block_size: int, seed: int) -> tuple:
    """(q, k_cache, v_cache, block_tables, context_lens, k_dense, v_dense): a decode batch whose
    blocks are shuffled in a pool with spare blocks, and the same K/V laid out contiguously, as a
    slab-per-sequence cache would hold it."""
    rng = np.random.default_rng(seed)
    per_seq = -(-context_len // block_size)
    num_blocks = batch * per_seq + 64
    shape = (num_blocks, block_size, n_head, head_dim)
    k_cache = rng.standard_normal(shape, dtype=np.float32)
    v_cache = rng.standard_normal(shape, dtype=np.float32)
    block_tables = rng.permutation(num_blocks)[:batch * per_seq].reshape(batch, per_seq)
    context_lens = np.full(batch, context_len)
    q = rng.standard_normal((batch, n_head, head_dim), dtype=np.float32)
    k_dense = k_cache[block_tables].reshape(batch, -1, n_head, head_dim)[:, :context_len].copy()
    v_dense = v_cache[block_tables].reshape(batch, -1, n_head, head_dim)[:, :context_len].copy()
    return q, k_cache, v_cache, block_tables, context_lens, k_dense, v_dense


def _against_contiguous(lab: ModuleType, say: Report, case: tuple, repeats: int, clock) -> tuple[dict, np.ndarray]:
    """The paged kernel timed beside contiguous token-major and head-major attention, the
    table's floors and the int8 cache, outputs checked first; (the best times, paged's output)."""
    q, k_cache, v_cache, block_tables, context_lens, k_dense, v_dense = case
    kv_bytes = k_dense.nbytes + v_dense.nbytes
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
    dense = lambda: contiguous_decode_attention(q, k_dense, v_dense)
    heads = lambda: _head_major_decode_attention(q, k_heads, v_heads)
    int8 = lambda: lab.paged_attention(q, k_int8, v_int8, block_tables, context_lens, k_scale=k_scale, v_scale=v_scale)
    out_paged, out_dense = paged(), dense()
    say(f"  dtypes: q {q.dtype}, cache {k_cache.dtype}, paged out {out_paged.dtype}, "
        f"contiguous out {out_dense.dtype}; max |paged - contiguous| "
        f"{float(np.abs(out_paged - out_dense).max()):.1e}, max |paged - head-major| "
        f"{float(np.abs(out_paged - heads()).max()):.1e}, max |int8 - float32| "
        f"{float(np.abs(int8() - out_paged).max()):.1e}")

    gather, gather_matmuls = _table_floors(lab, q, k_cache, v_cache, block_tables)
    gather_int8 = _int8_gather(lab, q, k_int8, v_int8, k_scale, v_scale, block_tables)
    t = best_side_by_side({"paged": paged, "dense": dense, "heads": heads, "int8": int8, "gather": gather,
                           "floor": gather_matmuls, "gather int8": gather_int8}, repeats, clock=clock)
    say(f"  paged {t['paged'] * 1e3:.1f} ms, contiguous token-major (batch, token, head, dim) "
        f"{t['dense'] * 1e3:.1f} ms: paged / token-major = {t['paged'] / t['dense']:.2f}x (no goal: the goal is "
        "against head-major, the faster contiguous layout, next)")
    say(f"  head-major contiguous (batch, head, token, dim) {t['heads'] * 1e3:.1f} ms: "
        f"paged / head-major = {t['paged'] / t['heads']:.2f}x ({_goal(t['paged'] / t['heads'], '<=', 1.5, 'x')}; "
        f"where NumPy's floor below is above 1.5x, the goal is within 1.15x of that floor), token-major "
        f"contiguous / head-major = {t['dense'] / t['heads']:.2f}x")
    say(f"  the floor of any NumPy kernel that reads blocks through the table: gathering the same blocks "
        f"column by column into a reused buffer (BlockGather, {_chunk_columns(lab, q, k_cache)} columns a step) "
        f"{t['gather'] * 1e3:.1f} ms = {t['gather'] / t['heads']:.2f}x head-major on its own")
    to_floor = t["paged"] / (t["gather"] + t["heads"])
    say(f"    gather + head-major compute {(t['gather'] + t['heads']) * 1e3:.1f} ms: paged / that = "
        f"{to_floor:.2f}x ({_goal(to_floor, '<=', 1.15, 'x')}); tighter, gather + the two matmuls on "
        f"the gathered buffer {t['floor'] * 1e3:.1f} ms: paged / that = {t['paged'] / t['floor']:.2f}x "
        f"(the rest is the online softmax's bookkeeping)")
    _int8_lines(say, t, int8_bytes, kv_bytes, clock)
    return t, out_paged


def _int8_lines(say: Report, t: dict, int8_bytes: int, kv_bytes: int, clock) -> None:
    """What the int8 cache's kernel costs against the float32 one, and its floor."""
    say(f"  paged on int8 blocks {t['int8'] * 1e3:.1f} ms = {t['int8'] / t['paged']:.2f}x the float32 "
        f"kernel ({_goal(t['int8'] / t['paged'], '<=', 0.9, 'x')}): reads {int8_bytes / 2**20:.0f} MiB instead of "
        f"{kv_bytes / 2**20:.0f} MiB; "
        f"each column is cast to float32 inside the gather into the reused buffer, the scales multiply "
        f"the scores and probabilities")
    # What int8 can save is only the gather: everything after it is the same float32 work.
    after = t["paged"] - t["gather"]
    rates = _cast_rates(clock)
    say(f"    its floor: the int8 gathers alone (take int8, cast into the float32 buffer, take the scales) "
        f"{t['gather int8'] * 1e3:.1f} ms against {t['gather'] * 1e3:.1f} ms for float32; the float32 kernel's "
        f"work after its gathers ({after * 1e3:.1f} ms) is the same on the cast buffer, so int8 / float32 >= "
        f"(gather int8 + that) / paged = {(t['gather int8'] + after) / t['paged']:.2f}x")
    say("    the cast runs at copy speed whatever the destination's size: np.copyto int8 -> float32 " + ", ".join(
        f"{rates['int8', kib] / 1e9:.1f}" for kib in (256, 3072)) + " G elements/s into 256 KiB (L2) / 3 MiB, "
        "float32 -> float32 " + ", ".join(f"{rates['float32', kib] / 1e9:.1f}" for kib in (256, 3072)) +
        " G elements/s: every int8 element read is a float32 element written")
