# The lab: generated from solution.py by tools/make_lab.py. Students: write each exercise here,
# in place of its `raise NotImplementedError`. Maintainers: edit solution.py and regenerate.
"""Inference-serving internals, small enough to read in an afternoon.

The three mechanisms behind vLLM, TensorRT-LLM and SGLang, on a NumPy GPT-2:

1. Paged KV-cache (PagedAttention): K/V live in fixed-size blocks addressed through a
   per-sequence block table, like pages through a page table.
2. The model and the paged attention path: a GPT-2 that reads its past through block tables.
3. Continuous batching: admit and retire requests at every step, so the batch stays full.
4. Speculative decoding: a cheap draft proposes, the target verifies in one pass, and the
   accept/resample rule keeps the target's distribution exactly.
5. Capacity planning: the same ideas as arithmetic for a real GPU.
6. The command line: the design-review scenarios (`python solution.py --help`).

`lab.py` is generated from this file by `tools/make_lab.py`: every region between
`# BEGIN SOLUTION: Exercise N` and `# END SOLUTION` becomes a stub for the student to write.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import inspect
import itertools
import math
import numbers
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# =====================================================================================
# 1. Paged KV-cache: blocks, the allocator, block tables, prefix caching
# =====================================================================================
#
# A sequence's KV-cache is not one contiguous slab of max_model_len slots. It is a list of
# fixed-size blocks taken from a shared pool on demand, so at most one block per sequence is
# partly empty (the paper's "near-zero fragmentation"). Blocks carry reference counts, so
# sequences can share them: a fork (parallel sampling) or the prefix cache.


class OutOfBlocksError(RuntimeError):
    """No free or evictable block is left in the pool."""


# --- argument checks (provided): the exercises below start from checked arguments -------


class NotAnIntError(TypeError, ValueError):
    """A bool, float or string where an int is meant. Both a TypeError and a ValueError, so
    that `except ValueError` (the lab's "bad input") catches it too."""


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    """`value` as a Python int. Python and NumPy integers are accepted; a bool, a float (even
    2.0) or a string is a NotAnIntError naming `name`; below `minimum` is a ValueError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise NotAnIntError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_token_ids(name: str, token_ids: object) -> list[int]:
    """A sequence of token ids as a list of Python ints (see `check_int`); a string is refused,
    not read as characters."""
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, (Sequence, np.ndarray)):
        raise NotAnIntError(f"{name} must be a list of token ids (ints), got {type(token_ids).__name__}")
    return [check_int(f"{name}[{i}]", t, minimum=0) for i, t in enumerate(token_ids)]


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens: 0 for 0, 1 for 1..block_size, 2 for block_size+1...

    This is THE boundary rule of the paged cache; every other place asks it instead of
    doing its own arithmetic. A new block is needed only when token `block_size` (0-based)
    arrives, never when the last block has just been filled. (Arguments are checked before
    your code runs: two ints, num_tokens >= 0, block_size >= 1.)
    """
    num_tokens, block_size = check_int("num_tokens", num_tokens, 0), check_int("block_size", block_size, 1)
    raise NotImplementedError("Exercise 1: blocks_needed")


def hash_block(parent_hash: int | None, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
    """Content hash of one FULL block, chained on the hash of the block before it.

    Chaining makes the hash name the whole prefix, not just this block's tokens: two
    blocks with the same tokens after different prefixes hold different K/V (attention
    saw different pasts), so they must never be confused. `cache_salt` (given for a
    sequence's first block only; the chain carries it on) keeps the prefixes of requests
    with different salts apart: tenants that must not share cached K/V never do.

    Required: the same int in every process (so not Python's `hash`, which is salted per
    process for str and, since 3.12, for None) and collision-resistant (a collision would
    hand one request another's K/V). SHA-256 over a canonical encoding of (parent_hash,
    cache_salt, token ids) has both.
    """
    raise NotImplementedError("Exercise 3: hash_block")


def chained_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """The chained hashes of every FULL block of `token_ids`, in order (the salt goes into
    the first block's hash)."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[start : start + block_size], None if hashes else cache_salt))
    return hashes


@dataclasses.dataclass
class PrefixCacheStats:
    """Counts of the prefix cache: `hits / queries` is the hit rate."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockAllocator:
    """The physical pool of KV blocks `0..num_blocks-1`, with reference counts.

    Invariants:
    - a block with reference count 0 is in exactly one of two queues: `_free` if it holds
      nothing findable, `_evictable` if the prefix cache still finds it by its hash;
    - both queues are in least-recently-freed order: `free` appends to the back. `allocate`
      takes the front of `_free`, and only when `_free` is empty the front of `_evictable`:
      a cached block is evicted at that moment, not earlier (lazy eviction, least recently
      used first), and never to make room that a plain free block could give;
    - only a block in use can be registered, so a hash always names K/V that was written;
    - every error leaves the allocator exactly as it was.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.num_blocks = check_int("num_blocks", num_blocks, 1)
        self.block_size = check_int("block_size", block_size, 1)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._ref_counts = [0] * self.num_blocks
        # Ordered dicts are queues with O(1) removal from the middle (prefix-cache revival).
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(self.num_blocks))
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._block_hash: dict[int, int] = {}  # block id -> its hash, while it is cached
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate()` can hand out now: never used, freed, or cached but unreferenced."""
        raise NotImplementedError("Exercise 1: BlockAllocator.num_free_blocks")

    def _checked_id(self, block_id: object, in_use: str | None = None) -> int:
        """A block id as an int (TypeError for a non-int, ValueError out of range). With
        `in_use`, a block whose reference count is 0 is a ValueError saying `in_use`."""
        block_id = check_int("block_id", block_id)
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is out of range 0..{self.num_blocks - 1}")
        if in_use and self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free: {in_use}")
        return block_id

    def allocate(self) -> int:
        """A block with reference count 1: the least recently freed plain block, or, only when
        none is left, the least recently used cached block, evicted now (`_evict`).

        Raises OutOfBlocksError (and changes nothing) when both queues are empty.
        """
        raise NotImplementedError("Exercise 1: BlockAllocator.allocate")

    def incref(self, block_id: int) -> None:
        """Share a block that is in use: one more table holds it. (Checked before your code:
        an id that is not an int in range, or a free block, raises and changes nothing.)"""
        block_id = self._checked_id(block_id, in_use="only a block in use can be shared")
        raise NotImplementedError("Exercise 1: BlockAllocator.incref")

    def free(self, block_id: int) -> None:
        """Drop one reference; at zero the block goes to the back of its queue: `_evictable`
        if the prefix cache holds its hash, else `_free`. (Checked before your code: an id
        that is not an int in range, or a block with no reference left, i.e. a double free,
        raises and changes nothing.)"""
        block_id = self._checked_id(block_id, in_use="it has no reference left (double free)")
        raise NotImplementedError("Exercise 1: BlockAllocator.free")

    def ref_count(self, block_id: int) -> int:
        """How many tables (or prefix-cache lookups) hold this block."""
        return self._ref_counts[self._checked_id(block_id)]

    # --- prefix caching (Exercise 3) ---------------------------------------------------

    def is_cached(self, block_id: int) -> bool:
        """Whether the prefix cache can hand this block to another sequence."""
        return block_id in self._block_hash

    def get_cached_block(self, block_hash: int) -> int | None:
        """The block cached under this hash, without taking a reference (a peek, for planning)."""
        return self._cached.get(block_hash) if self.enable_prefix_caching else None

    def cached_prefix(self, block_hashes: Sequence[int], num_tokens: int) -> list[int]:
        """The cached blocks a sequence of `num_tokens` tokens, whose full blocks have these
        chained hashes, can reuse (a peek: no reference is taken).

        That is the longest cached run of `block_hashes`, except when the run covers every
        token: then its last block is left out, to be recomputed into a private block. The
        last token must be computed anyway (its logits give the first output token), and
        its K/V must not be written into a block that other sequences read.
        """
        run = list(itertools.takewhile(lambda b: b is not None, map(self.get_cached_block, block_hashes)))
        return run[:-1] if run and len(run) * self.block_size >= num_tokens else run

    def lookup(self, block_hash: int) -> int | None:
        """A prefix-cache hit: take a reference on the cached block and return it.

        A hit on an evictable block (reference count 0) revives it: it leaves `_evictable`.
        Returns None on a miss, or when prefix caching is off. With caching on, every call is
        one query in `stats.queries`, hit or miss, and every hit one `stats.hits`.
        """
        raise NotImplementedError("Exercise 3: BlockAllocator.lookup")

    def register(self, block_id: int, block_hash: int) -> None:
        """Make a full block, in use and with its K/V written, findable under its chained hash
        (no-op when caching is off).

        If another block already holds the same prefix, the first one stays the cached copy,
        and a block registered once keeps its first hash. (Checked before your code: a free
        block is a ValueError, since nothing written can be in it.)
        """
        block_id = self._checked_id(block_id, in_use="only a block in use, with its K/V written, can be registered")
        raise NotImplementedError("Exercise 3: BlockAllocator.register")

    def _evict(self, block_id: int) -> None:
        """Forget a cached block's hash (and count the eviction): it is about to hold other tokens."""
        raise NotImplementedError("Exercise 3: BlockAllocator._evict")


class BlockTable:
    """One sequence's view of the cache: token `i` lives in `block_ids[i // block_size]`
    at offset `i % block_size`.

    Invariant: a block that another table or the prefix cache can see is never written.
    Before new tokens land in such a block, the table takes a private copy and reports the
    `(src, dst)` pair, so the caller can copy the K/V data (copy-on-write).

    With prefix caching the table also keeps `_block_hashes`, the chained hashes of the full
    blocks it has registered, in order. A block is registered only once its K/V is computed
    (`cache_full_blocks`, called after the forward pass that wrote it), never when it is
    allocated: until then another sequence that found it would read K/V that is not there.
    `cache_salt` goes into the first block's hash (see `hash_block`).
    """

    def __init__(self, allocator: BlockAllocator, cache_salt: str | None = None):
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.cache_salt = cache_salt
        self.block_ids: list[int] = []
        self.token_ids: list[int] = []
        self._block_hashes: list[int] = []  # chained hashes of the registered full blocks, in order

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def _is_shared(self, block_id: int) -> bool:
        return self.allocator.ref_count(block_id) > 1 or self.allocator.is_cached(block_id)

    def append_tokens(self, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Append tokens, allocating a block only when the last one is full.

        Returns the copy-on-write pairs `(src, dst)` whose K/V the caller must copy before
        writing: at most one, for a last block with room that another table or the prefix
        cache can see. Registers nothing (that is `cache_full_blocks`, once K/V is written).
        On OutOfBlocksError nothing changes (ask for every block needed, the copy included,
        before taking any). (`token_ids` arrives checked: a list of ints.)
        """
        token_ids = check_token_ids("token_ids", token_ids)
        raise NotImplementedError("Exercise 2: BlockTable.append_tokens")

    def allocate_prompt(self, token_ids: Sequence[int]) -> int:
        """Fill an empty table with a prompt (or the first chunk of one), reusing cached blocks.

        The reused blocks are `allocator.cached_prefix(hashes, len(token_ids))` for the chained
        hashes of the prompt's full blocks: the longest cached run, less its last block when it
        covers the whole prompt (so at least the last token is computed: it yields the logits
        of the first output token, and no cached block is ever written). Each reused block is
        taken with `allocator.lookup` (one query and one hit each); when the prompt has a full
        block after the reused run, exactly one more `lookup` asks for it (and misses, unless
        the run was cut short because it covered the whole prompt: then no more lookups). The
        rest of the prompt gets fresh blocks; nothing new is registered (`cache_full_blocks`
        does that once the K/V is computed).

        Returns how many leading tokens already have K/V (`num_computed_tokens`): the reused
        blocks' tokens. On OutOfBlocksError nothing changes: no lookup, no allocation.
        (Checked before your code: the table is empty and `token_ids` is a list of ints.)
        """
        if self.block_ids:
            raise ValueError("allocate_prompt needs an empty table; use append_tokens to extend one")
        token_ids = check_token_ids("token_ids", token_ids)
        raise NotImplementedError("Exercise 3: BlockTable.allocate_prompt")

    def cache_full_blocks(self, num_computed_tokens: int) -> None:
        """Register (prefix caching only) every full block among the first `num_computed_tokens`
        tokens that has no hash yet: their K/V is now written. Blocks are registered in order,
        under their chained hashes (`hash_block(parent, tokens, cache_salt for the first)`),
        and `_block_hashes` grows with them. Call it after the forward pass that computed them.
        (Checked before your code: an int in 0..num_tokens.)"""
        check_int("num_computed_tokens", num_computed_tokens, 0)
        if num_computed_tokens > self.num_tokens:
            raise ValueError(f"num_computed_tokens = {num_computed_tokens} but the table holds {self.num_tokens}")
        raise NotImplementedError("Exercise 3: BlockTable.cache_full_blocks")

    def fork(self) -> BlockTable:
        """A second sequence that shares every block of this one (parallel sampling)."""
        raise NotImplementedError("Exercise 2: BlockTable.fork")

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens; release the blocks no longer needed.

        This is how rejected speculative tokens are rolled back. A block that keeps some
        tokens stays; the next append copies it first if it is shared or cached. The hashes of
        blocks that are no longer full go too: a hash names a block's whole content, and the
        tokens appended next will be different ones. (Checked before your code: an int in
        0..num_tokens, else TypeError/ValueError.)
        """
        num_tokens = check_int("num_tokens", num_tokens, 0)
        if num_tokens > self.num_tokens:
            raise ValueError(f"cannot truncate to {num_tokens} tokens: the table holds {self.num_tokens}")
        raise NotImplementedError("Exercise 2: BlockTable.truncate")

    def slots(self, start: int, stop: int) -> np.ndarray:
        """Physical slot ids `block * block_size + offset` of positions `start..stop-1`, an int64
        array. (Checked before your code: ints with 0 <= start <= stop <= num_tokens.)"""
        start, stop = check_int("start", start), check_int("stop", stop)
        if not 0 <= start <= stop <= self.num_tokens:
            raise ValueError(f"positions {start}..{stop} are outside the table's 0..{self.num_tokens}")
        raise NotImplementedError("Exercise 2: BlockTable.slots")

    def free(self) -> None:
        """Release every block; the table is empty afterwards."""
        raise NotImplementedError("Exercise 2: BlockTable.free")


# =====================================================================================
# 2. The model and the paged attention path
# =====================================================================================
#
# A GPT-2 in NumPy, under the checkpoint's own tensor names, so real GPT-2 weights load with a
# dictionary. `forward_dense` is the reference (no cache). `forward` is the serving path: each
# new token's K/V is written into its slot, then attention reads the past through block tables.


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """GPT-2 hyper-parameters (the defaults make a toy model that runs in milliseconds)."""

    vocab_size: int = 256
    n_positions: int = 256
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self):
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} must be a multiple of n_head {self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def gpt2_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a GPT-2 checkpoint with its shape; linear weights are (in, out) (Conv1D)."""
    C, V = config.n_embd, config.vocab_size
    shapes = {"wte.weight": (V, C), "wpe.weight": (config.n_positions, C)}
    for i in range(config.n_layer):
        shapes |= {
            f"h.{i}.ln_1.weight": (C,), f"h.{i}.ln_1.bias": (C,),
            f"h.{i}.attn.c_attn.weight": (C, 3 * C), f"h.{i}.attn.c_attn.bias": (3 * C,),
            f"h.{i}.attn.c_proj.weight": (C, C), f"h.{i}.attn.c_proj.bias": (C,),
            f"h.{i}.ln_2.weight": (C,), f"h.{i}.ln_2.bias": (C,),
            f"h.{i}.mlp.c_fc.weight": (C, 4 * C), f"h.{i}.mlp.c_fc.bias": (4 * C,),
            f"h.{i}.mlp.c_proj.weight": (4 * C, C), f"h.{i}.mlp.c_proj.bias": (C,),
        }
    return shapes | {"ln_f.weight": (C,), "ln_f.bias": (C,)}


def init_gpt2_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under GPT-2 checkpoint names, in the checkpoint's (in, out) layout.

    Shaped like GPT-2's init (normal weights, zero biases, unit LayerNorm gains, residual
    projections scaled by 1/sqrt(2 * n_layer)) but 20x wider: at GPT-2's std 0.02 an untrained
    toy has nearly flat logits, and greedy outputs would hinge on float rounding. These give
    decisive logits (top-2 gaps ~0.7) and varied outputs.
    """
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in gpt2_weight_shapes(config).items():
        if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            w = np.ones(shape)
        elif name.endswith("bias"):
            w = np.zeros(shape)
        elif name in ("wte.weight", "wpe.weight"):
            w = rng.normal(0.0, 0.3, shape)
        else:
            std = 0.4 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.4
            w = rng.normal(0.0, std, shape)
        weights[name] = w.astype(np.float32)
    return weights


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def _gelu(x: np.ndarray) -> np.ndarray:
    # GPT-2's tanh approximation; Python-float constants keep float32 arrays float32.
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def _softmax(scores: np.ndarray) -> np.ndarray:
    # Subtract the row max: exp never overflows, and masked (-inf) entries become exact zeros.
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _check_tokens(config: ModelConfig, token_ids: np.ndarray, positions_end: int) -> None:
    """Token ids inside the vocabulary, positions (up to `positions_end`) inside n_positions."""
    if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= config.vocab_size):
        raise ValueError(f"token ids must be in 0..{config.vocab_size - 1}")
    if positions_end > config.n_positions:
        raise ValueError(f"position {positions_end - 1} is beyond n_positions={config.n_positions}")


class KVCache:
    """The physical KV-cache: `.k`, `.v` of shape (n_layer, num_blocks, block_size, n_head, head_dim).

    Slot `s` of a layer is `k[layer].reshape(-1, n_head, head_dim)[s]`, i.e. block `s // block_size`,
    offset `s % block_size`: exactly what `BlockTable.slots` returns.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        shape = (config.n_layer, num_blocks, block_size, config.n_head, config.head_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k = np.zeros(shape, dtype=np.float32)
        self.v = np.zeros(shape, dtype=np.float32)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Carry out copy-on-write: block `dst` gets `src`'s K/V in every layer."""
        if not pairs:
            return
        src, dst = (np.array(x, dtype=np.int64) for x in zip(*pairs))
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


# How many tokens one step of the kernel gathers: one 16-token block at the usual block size.
# Big enough that NumPy's per-call overhead is small, small enough that the gathered K/V
# (batch x 16 tokens x n_head x head_dim x 4 bytes, 1.5 MB at batch 32, 12 x 64) stays in the
# CPU's L2 cache between the gather and the two matmuls that read it.
PAGED_ATTENTION_CHUNK_TOKENS = 16


def _check_paged_attention_args(q, k_cache, v_cache, block_tables, context_lens):
    """Validate the kernel's inputs; return (block_tables, context_lens) as integer arrays.

    Also checks that every table entry a sequence really uses names a block of the cache: a
    -1 there would otherwise silently read the LAST block (NumPy's negative indexing).
    """
    if not (isinstance(q, np.ndarray) and q.ndim == 3 and q.dtype == np.float32):
        raise ValueError(f"q must be a float32 array (batch, n_head, head_dim), got "
                         f"{getattr(q, 'dtype', type(q).__name__)} {np.shape(q)}")
    batch, n_head, head_dim = q.shape
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not (isinstance(cache, np.ndarray) and cache.ndim == 4 and cache.dtype == np.float32
                and cache.shape[0] >= 1 and cache.shape[1] >= 1
                and cache.shape[2:] == (n_head, head_dim)):
            raise ValueError(f"{name} must be float32 (num_blocks, block_size, {n_head}, {head_dim}) "
                             f"to match q, got {getattr(cache, 'dtype', '?')} {np.shape(cache)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must have one shape")
    block_tables = np.asarray(block_tables)
    context_lens = np.asarray(context_lens)
    if not (block_tables.ndim == 2 and block_tables.shape[0] == batch
            and np.issubdtype(block_tables.dtype, np.integer)):
        raise ValueError(f"block_tables must be an integer array ({batch}, max_blocks), got "
                         f"{block_tables.dtype} {block_tables.shape}")
    if not (context_lens.shape == (batch,) and np.issubdtype(context_lens.dtype, np.integer)):
        raise ValueError(f"context_lens must be an integer array ({batch},), got "
                         f"{context_lens.dtype} {context_lens.shape}")
    num_blocks, block_size = k_cache.shape[:2]
    capacity = block_tables.shape[1] * block_size
    if batch and (context_lens.min() < 1 or context_lens.max() > capacity):
        raise ValueError(f"context_lens must be in 1..{capacity} (max_blocks {block_tables.shape[1]} "
                         f"x block_size {block_size}), got {context_lens.tolist()}")
    used = np.arange(block_tables.shape[1]) < -(-context_lens[:, None] // block_size)
    if np.any(used & ((block_tables < 0) | (block_tables >= num_blocks))):
        raise ValueError(f"a block table entry in use is not a block id in 0..{num_blocks - 1}")
    return block_tables, context_lens


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    block_tables: np.ndarray, context_lens: np.ndarray) -> np.ndarray:
    """Decode attention for a batch, one query per sequence, reading K/V through block tables.

    q (B, H, D) float32; k_cache, v_cache (num_blocks, block_size, H, D) float32, one layer;
    block_tables (B, max_blocks) int; context_lens (B,) int >= 1, counting the current token
    (its K/V is already in the cache). Token i of sequence b lives at
    k_cache[block_tables[b, i // block_size], i % block_size]. Returns (B, H, D) float32:
    softmax(q . k / sqrt(D)) @ v over the sequence's first context_lens[b] tokens.

    Invariant: nothing past a sequence's context is ever used as data: not the table's padding
    entries (they may be -1 or garbage), not the stale slots after the last token of its last
    block (they may hold NaN).

    The structure is the real kernel's: walk the block columns, gather one column of blocks for
    the whole batch, and fold it into an online softmax (running max, running sum, rescaled
    accumulator), so no copy of the whole K/V is ever made.
    """
    block_tables, context_lens = _check_paged_attention_args(q, k_cache, v_cache, block_tables,
                                                             context_lens)
    raise NotImplementedError("Exercise 4: paged_attention")


class ToyTransformer:
    """GPT-2: learned positions, pre-LayerNorm blocks, fused qkv, tanh-GELU MLP, tied LM head."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray] | None = None, seed: int = 0):
        self.config = config
        self.weights = self._validated(init_gpt2_weights(config, seed) if weights is None else weights)
        w = self.weights
        self.layers = [{name.split(".", 2)[2]: w[name] for name in w if name.startswith(f"h.{i}.")}
                       for i in range(config.n_layer)]

    def _validated(self, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Strip a `transformer.` prefix, drop GPT-2's mask buffers, check every name and shape."""
        expected = gpt2_weight_shapes(self.config)
        found: dict[str, np.ndarray] = {}
        lm_head = None
        for name, value in weights.items():
            key = name.removeprefix("transformer.")
            if key == "lm_head.weight":
                lm_head = np.asarray(value)
                continue
            if key.endswith((".attn.bias", ".attn.masked_bias")) and key.startswith("h."):
                continue  # causal-mask buffers, not parameters
            if key not in expected:
                raise ValueError(f"unknown weight {name!r}: not a GPT-2 tensor for this config")
            value = np.asarray(value)
            if value.shape != expected[key]:
                raise ValueError(f"weight {name!r} has shape {value.shape}, expected {expected[key]}")
            found[key] = np.ascontiguousarray(value, dtype=np.float32)
        missing = sorted(set(expected) - set(found))
        if missing:
            raise ValueError(f"missing weight(s) {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        if lm_head is not None and not np.array_equal(lm_head, found["wte.weight"]):
            raise ValueError("lm_head.weight differs from wte.weight: GPT-2's LM head is tied to the embeddings")
        return found

    # --- the building blocks ---------------------------------------------------------

    def _ln(self, x: np.ndarray, layer: dict, name: str) -> np.ndarray:
        return _layer_norm(x, layer[f"{name}.weight"], layer[f"{name}.bias"], self.config.layer_norm_epsilon)

    def _qkv(self, x: np.ndarray, layer: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(T, C) -> q, k, v each (T, H, D)."""
        qkv = self._ln(x, layer, "ln_1") @ layer["attn.c_attn.weight"] + layer["attn.c_attn.bias"]
        T, H, D = x.shape[0], self.config.n_head, self.config.head_dim
        return tuple(qkv.reshape(T, 3, H, D).transpose(1, 0, 2, 3))

    def _finish_block(self, x: np.ndarray, attn: np.ndarray, layer: dict) -> np.ndarray:
        """Residual adds around the attention output projection and the MLP."""
        x = x + attn.reshape(x.shape) @ layer["attn.c_proj.weight"] + layer["attn.c_proj.bias"]
        h = _gelu(self._ln(x, layer, "ln_2") @ layer["mlp.c_fc.weight"] + layer["mlp.c_fc.bias"])
        return x + h @ layer["mlp.c_proj.weight"] + layer["mlp.c_proj.bias"]

    def _embed(self, token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return self.weights["wte.weight"][token_ids] + self.weights["wpe.weight"][positions]

    def _logits(self, x: np.ndarray) -> np.ndarray:
        w = self.weights
        return _layer_norm(x, w["ln_f.weight"], w["ln_f.bias"], self.config.layer_norm_epsilon) @ w["wte.weight"].T

    # --- the reference path ----------------------------------------------------------

    def forward_dense(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits (T, vocab_size) for every position, with plain causal attention and no cache."""
        token_ids = np.asarray(token_ids, dtype=np.int64)
        T = len(token_ids)
        if T == 0:
            raise ValueError("forward_dense needs at least one token")
        _check_tokens(self.config, token_ids, T)
        x = self._embed(token_ids, np.arange(T))
        causal = np.tril(np.ones((T, T), dtype=bool))
        scale = np.float32(1.0 / math.sqrt(self.config.head_dim))
        for layer in self.layers:
            q, k, v = self._qkv(x, layer)
            scores = np.einsum("qhd,khd->hqk", q, k) * scale
            probs = _softmax(np.where(causal, scores, -np.inf))
            x = self._finish_block(x, np.einsum("hqk,khd->qhd", probs, v), layer)
        return self._logits(x)

    # --- the serving path ------------------------------------------------------------

    def forward(
        self,
        kv_cache: KVCache,
        block_tables: Sequence[BlockTable],
        start_positions: Sequence[int],
        num_tokens: Sequence[int],
    ) -> np.ndarray:
        """One engine step over a batch that mixes prefill chunks and decode tokens.

        Sequence i contributes `block_tables[i].token_ids[start_i : start_i + n_i]`; the K/V of its
        positions before `start_i` must already be in `kv_cache`. Each new token's K/V is written
        into its slot before attention reads it. Returns logits (sum(num_tokens), vocab_size) for
        every processed token, in batch order.
        """
        batch = _PagedBatch(self.config, block_tables, start_positions, num_tokens)
        x = self._embed(batch.token_ids, batch.positions)
        scale = np.float32(1.0 / math.sqrt(self.config.head_dim))
        H, D = self.config.n_head, self.config.head_dim
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer)
            k_flat = kv_cache.k[i].reshape(-1, H, D)  # views: slot-addressed
            v_flat = kv_cache.v[i].reshape(-1, H, D)
            k_flat[batch.slots] = k
            v_flat[batch.slots] = v
            attn = np.empty_like(q)
            if batch.decode_rows.size:
                attn[batch.decode_rows] = paged_attention(
                    q[batch.decode_rows], kv_cache.k[i], kv_cache.v[i], batch.decode_tables, batch.decode_lens)
            for rows, context_slots, mask in batch.prefills:
                scores = np.einsum("qhd,khd->hqk", q[rows], k_flat[context_slots]) * scale
                probs = _softmax(np.where(mask, scores, -np.inf))
                attn[rows] = np.einsum("hqk,khd->qhd", probs, v_flat[context_slots])
            x = self._finish_block(x, attn, layer)
        return self._logits(x)


class _PagedBatch:
    """The flat layout of one step, computed once and shared by every layer.

    Decode rows (one new token) go through `paged_attention` together; a prefill chunk of n
    tokens starting at position s attends over slots 0..s+n-1 with a causal mask in which
    query j (position s+j) sees keys 0..s+j.
    """

    def __init__(self, config: ModelConfig, block_tables, start_positions, num_tokens):
        if not (len(block_tables) == len(start_positions) == len(num_tokens)) or not block_tables:
            raise ValueError("forward needs one start position and one token count per block table")
        tokens, positions, slots, decode = [], [], [], []
        self.prefills = []
        row = 0
        for table, start, n in zip(block_tables, start_positions, num_tokens):
            stop = start + n
            if n < 1 or start < 0 or stop > table.num_tokens:
                raise ValueError(f"cannot process positions {start}..{stop - 1} "
                                 f"of a sequence of {table.num_tokens} tokens")
            _check_tokens(config, np.empty(0, np.int64), stop)
            tokens.append(table.token_ids[start:stop])
            positions.append(np.arange(start, stop))
            slots.append(table.slots(start, stop))
            if n == 1:
                decode.append((row, table, stop))
            else:
                mask = np.arange(stop)[None, :] <= np.arange(start, stop)[:, None]
                self.prefills.append((slice(row, row + n), table.slots(0, stop), mask))
            row += n
        self.token_ids = np.concatenate(tokens).astype(np.int64)
        _check_tokens(config, self.token_ids, 0)
        self.positions = np.concatenate(positions)
        self.slots = np.concatenate(slots)
        self.decode_rows = np.array([r for r, _, _ in decode], dtype=np.int64)
        width = max((len(t.block_ids) for _, t, _ in decode), default=0)
        self.decode_tables = np.zeros((len(decode), width), dtype=np.int64)
        for j, (_, table, _) in enumerate(decode):
            self.decode_tables[j, : len(table.block_ids)] = table.block_ids
        self.decode_lens = np.array([stop for _, _, stop in decode], dtype=np.int64)


# --- `python solution.py bench attention` -------------------------------------------------


def _best_side_by_side(fns: dict, repeats: int = 5) -> dict:
    """Best wall times of several functions measured in turns, so drift hits them all alike."""
    for fn in fns.values():
        fn()
    best = {name: math.inf for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
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
        f"block size {block_size}, shuffled physical blocks, K+V read {kv_bytes / 2**20:.0f} MiB per call")

    paged = lambda: paged_attention(q, k_cache, v_cache, block_tables, context_lens)
    dense = lambda: _contiguous_decode_attention(q, k_dense, v_dense)
    out_paged, out_dense = paged(), dense()
    say(f"  dtypes: q {q.dtype}, cache {k_cache.dtype}, paged out {out_paged.dtype}, "
        f"contiguous out {out_dense.dtype}; max |paged - contiguous| "
        f"{float(np.abs(out_paged - out_dense).max()):.1e}")

    t = _best_side_by_side({"paged": paged, "dense": dense}, repeats)
    say(f"  paged {t['paged'] * 1e3:.1f} ms, contiguous {t['dense'] * 1e3:.1f} ms: "
        f"paged / contiguous = {t['paged'] / t['dense']:.2f}x (goal <= 1.3x)")

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


# --- `python solution.py bench decode` ------------------------------------------------------


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
    config = ModelConfig(vocab_size=vocab_size, n_positions=context_len, n_embd=n_embd,
                         n_layer=n_layer, n_head=n_head)
    model = ToyTransformer(config, seed=0)
    weight_bytes = sum(w.nbytes for name, w in model.weights.items() if name != "wpe.weight")
    say(f"bench decode: n_embd {n_embd}, {n_layer} layers, {n_head} heads, vocab {vocab_size}: "
        f"{weight_bytes / 2**20:.0f} MiB of weights read per step (L3 cache: see lscpu), "
        f"context {context_len}, block size {block_size}, dtype {model.weights['wte.weight'].dtype}, "
        f"BLAS env {blas_env or 'default'}")
    rng = np.random.default_rng(0)
    model_time, gemm_time = {}, {}
    for batch in batch_sizes:
        allocator = BlockAllocator(batch * -(-context_len // block_size) + 1, block_size)
        kv_cache = KVCache(config, allocator.num_blocks, block_size)
        tables = [BlockTable(allocator) for _ in range(batch)]
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


# =====================================================================================
# 3. Continuous batching: scheduler, engine, serving metrics, the step simulator
# =====================================================================================
#
# A static batch runs until its LAST sequence finishes, so one long answer holds every other
# slot hostage. Iteration-level scheduling decides again at every step: finished sequences
# leave at once and waiting ones take their slots. The scheduler has no prefill phase and no
# decode phase (vLLM v1): every sequence has `num_computed_tokens`, and a step gives it
# `min(tokens still missing K/V, token budget left)` new tokens. A decode is the case
# "one token missing"; chunked prefill is the case "the budget ran out first".


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each output token. Temperature 0 is greedy (argmax).

    A run stops after `max_tokens` output tokens, or at the first token in `stop_token_ids`
    (that token is kept in the output, as vLLM does for its stop_token_ids). At temperature
    T > 0 the request owns `np.random.default_rng(seed)` and draws each output token once from
    it, as `rng.choice(vocab_size, p=softmax(logits / T))` of its last token's logits.
    """

    temperature: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass
class Request:
    """One generation request. `arrival_time` (seconds) places it on a workload's clock for
    the simulator; the engine stamps its own clock when the request is added. Requests with
    different `cache_salt`s never share prefix-cache blocks (see `hash_block`)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    arrival_time: float = 0.0
    cache_salt: str | None = None


@dataclasses.dataclass
class RequestMetrics:
    """Per-request latency, with vLLM's benchmark definitions (all in seconds, or in steps
    for the simulator's step clock).

    ttft: first token time - arrival. tpot: (e2e - ttft) / (output tokens - 1), NaN with
    fewer than 2 tokens. itl: the gaps between consecutive tokens. e2e_latency: finish - arrival.
    """

    ttft: float
    tpot: float
    itl: list[float]
    e2e_latency: float

    @classmethod
    def from_times(cls, arrival: float, token_times: list[float], finish: float) -> RequestMetrics:
        if not token_times:  # rejected: no token was ever produced
            return cls(math.nan, math.nan, [], finish - arrival)
        ttft, e2e = token_times[0] - arrival, finish - arrival
        tpot = (e2e - ttft) / (len(token_times) - 1) if len(token_times) > 1 else math.nan
        return cls(ttft, tpot, list(np.diff(token_times).tolist()), e2e)


@dataclasses.dataclass
class RequestOutput:
    """What a request produced. `finish_reason` is "stop" (a stop token), "length"
    (max_tokens), "abort" (`LLMEngine.abort_request`), "rejected: <why>" (it can never fit;
    no tokens), or None while running."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    metrics: RequestMetrics | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SequenceState:
    """The scheduler's record of one request: its tokens, its block table, its progress.

    Invariant between steps: `block_table` holds exactly the first `num_computed_tokens`
    tokens, whose K/V is in the cache; the tokens after them (the rest of a prompt being
    prefilled, or the last sampled token) are still to be processed. So a block is in the
    table, and in the prefix cache, only once its K/V is being computed.
    """

    WAITING, RUNNING, FINISHED = "waiting", "running", "finished"

    def __init__(self, request: Request, allocator: BlockAllocator):
        self.request = request
        self.request_id = request.request_id
        self.sampling = request.sampling
        self.prompt_token_ids = [int(t) for t in request.prompt_token_ids]
        self.output_token_ids: list[int] = []
        self.block_table = BlockTable(allocator, request.cache_salt)
        self.num_computed_tokens = 0
        self.status = SequenceState.WAITING
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        # Filled in by whoever runs the steps (engine or simulator): its clock, its sampler.
        self.arrival_time = request.arrival_time
        self.token_times: list[float] = []
        self.finish_time = math.nan
        self.rng: np.random.Generator | None = None

    def __repr__(self) -> str:
        return (f"SequenceState({self.request_id!r}, {self.status}, {self.num_computed_tokens} of "
                f"{self.num_tokens} tokens computed, {len(self.output_token_ids)} generated)")

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """all_token_ids[start:stop] without building the whole list (a step is O(new tokens))."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[start:stop] + self.output_token_ids[max(start - n, 0) : max(stop - n, 0)]

    def to_output(self) -> RequestOutput:
        metrics = RequestMetrics.from_times(self.arrival_time, self.token_times, self.finish_time)
        return RequestOutput(self.request_id, list(self.prompt_token_ids), list(self.output_token_ids),
                             metrics if self.finish_reason else None, self.finish_reason, self.num_preemptions)


@dataclasses.dataclass
class SchedulerOutput:
    """One step's plan: which sequences run, with how many new tokens each (in batch order),
    which were preempted, and the copy-on-write block copies to do before the forward pass."""

    scheduled: list[SequenceState] = dataclasses.field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    preempted: list[SequenceState] = dataclasses.field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def add(self, seq: SequenceState, num_new_tokens: int) -> None:
        self.scheduled.append(seq)
        self.num_scheduled_tokens[seq.request_id] = num_new_tokens

    def completes(self, seq: SequenceState) -> bool:
        """Whether this step processes the sequence's last pending token: then its logits
        give the next output token (a prefill chunk that stops short samples nothing)."""
        return seq.num_computed_tokens + self.num_scheduled_tokens[seq.request_id] == seq.num_tokens


class Scheduler:
    """Iteration-level (continuous) batching in the style of vLLM's v1 scheduler.

    Every step: running sequences first, oldest first, each gets its missing tokens (one for
    a decode, a chunk for a prefill) within the `max_num_batched_tokens` budget; then waiting
    ones, first come first served, while `max_num_seqs`, the budget and free blocks allow.
    When a running sequence cannot get a block, the most recently admitted running sequence is
    preempted by recompute: its blocks are freed and it goes back to the FRONT of the waiting
    queue with every token it produced; readmitted, it recomputes prompt + output.

    Liveness: the oldest running sequence is never preempted for a newer one, and a request
    whose worst case cannot fit in the whole cache is rejected on arrival, so every request
    finishes (no deadlock, no endless preemption loop).
    """

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 enable_chunked_prefill: bool = True):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"need max_num_seqs >= 1 and max_num_batched_tokens >= 1, "
                             f"got {max_num_seqs}, {max_num_batched_tokens}")
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: collections.deque[SequenceState] = collections.deque()
        self.running: list[SequenceState] = []  # in admission order: the newest is last
        self.num_preemptions = 0

    def add_request(self, request: Request) -> SequenceState:
        """Queue a request; one that can never run is finished at once as "rejected: ...".
        An empty prompt, or no max_tokens >= 1, is a ValueError: there would be nothing to run."""
        if len(request.prompt_token_ids) == 0 or check_int("max_tokens", request.sampling.max_tokens) < 1:
            raise ValueError(f"request {request.request_id!r} needs a non-empty prompt and max_tokens >= 1")
        seq = SequenceState(request, self.allocator)
        reason = self._rejection(seq)
        if reason:
            seq.status, seq.finish_reason = SequenceState.FINISHED, f"rejected: {reason}"
        else:
            self.waiting.append(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _rejection(self, seq: SequenceState) -> str | None:
        """Why this request can never finish here, or None. Judged on its worst case,
        prompt + max_tokens, so that running alone it always fits."""
        worst = len(seq.prompt_token_ids) + seq.sampling.max_tokens
        need = blocks_needed(worst, self.allocator.block_size)
        if need > self.allocator.num_blocks:
            return (f"prompt + max_tokens = {worst} tokens need {need} KV blocks of "
                    f"{self.allocator.block_size}, the whole cache has {self.allocator.num_blocks}")
        if not self.enable_chunked_prefill and worst > self.max_num_batched_tokens:
            # Recomputing after a preemption processes prompt + output in one step.
            return (f"prompt + max_tokens = {worst} tokens exceed max_num_batched_tokens = "
                    f"{self.max_num_batched_tokens} and chunked prefill is off")
        return None

    # --- helpers of schedule(): each asks before it acts, and changes nothing on failure ---

    def _num_cached_tokens(self, seq: SequenceState, token_ids: list[int]) -> int:
        """Leading tokens whose K/V allocate_prompt will reuse (a peek: no reference is taken)."""
        if not self.allocator.enable_prefix_caching:
            return 0
        bs = self.allocator.block_size
        hashes = chained_block_hashes(token_ids, bs, seq.request.cache_salt)
        return len(self.allocator.cached_prefix(hashes, len(token_ids))) * bs

    def _allocate_slots(self, seq: SequenceState, num_new_tokens: int, out: SchedulerOutput) -> bool:
        """Put the next `num_new_tokens` tokens into the block table; False if the blocks
        are not there (the table is unchanged)."""
        stop = seq.num_computed_tokens + num_new_tokens
        try:
            out.blocks_to_copy += seq.block_table.append_tokens(seq.token_ids_slice(seq.block_table.num_tokens, stop))
        except OutOfBlocksError:
            return False
        return True

    def _try_admit(self, seq: SequenceState, token_budget: int) -> int:
        """Give a waiting sequence its first blocks (prefix-cache hits included) and return
        how many tokens it runs this step; 0 if the budget or the free blocks say wait."""
        tokens = seq.all_token_ids  # prompt + output: a preempted sequence recomputes both
        num_cached = self._num_cached_tokens(seq, tokens)
        num_new = len(tokens) - num_cached
        if self.enable_chunked_prefill:
            num_new = min(num_new, token_budget)
        if num_new > token_budget:
            return 0
        try:
            seq.num_computed_tokens = seq.block_table.allocate_prompt(tokens[: num_cached + num_new])
        except OutOfBlocksError:
            return 0
        return num_new

    def _preempt(self, seq: SequenceState) -> None:
        """Preemption by recompute: drop the K/V, keep the tokens, wait at the FRONT."""
        raise NotImplementedError("Exercise 5: Scheduler._preempt")

    def schedule(self) -> SchedulerOutput:
        """Plan one step (see the class docstring). Never exceeds `max_num_seqs` running
        sequences or `max_num_batched_tokens` scheduled tokens."""
        raise NotImplementedError("Exercise 5: Scheduler.schedule")

    def _finish(self, seq: SequenceState, reason: str) -> None:
        seq.status, seq.finish_reason = SequenceState.FINISHED, reason
        seq.block_table.free()
        self.running.remove(seq)

    def abort(self, request_id: str) -> SequenceState | None:
        """Drop a waiting or running request now and free its blocks (its client went away).
        Returns its finished record ("abort"), or None when no unfinished request has this id."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.status, seq.finish_reason = SequenceState.FINISHED, "abort"
                seq.block_table.free()  # a preempted sequence holds none; a chunked one may
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self._finish(seq, "abort")
                return seq
        return None

    def update(self, out: SchedulerOutput, sampled_token_ids: dict[str, int]) -> list[SequenceState]:
        """After the step ran: advance every scheduled sequence by its tokens and register the
        blocks that are now computed (`block_table.cache_full_blocks(num_computed_tokens)`),
        append the token sampled for each sequence that `out.completes`, and retire the ones
        that are done NOW (their blocks go back to the pool before the next step is planned):
        "stop" if the token is in `stop_token_ids` (checked first: a stop token that is also
        the max_tokens-th token finishes as "stop"), else "length" at `max_tokens` outputs.
        Returns the retired sequences."""
        raise NotImplementedError("Exercise 5: Scheduler.update")


class StaticBatchScheduler(Scheduler):
    """The baseline: a batch of up to `batch_size` requests runs until ALL of them finished;
    only then does the next batch start. A finished sequence frees its blocks, but its slot
    stays empty until the whole batch is done (head-of-line blocking).

    Like the static servers it stands for, it reserves each request's worst case
    (prompt + max_tokens) at admission, so it never preempts; prompts run whole, unchunked.
    """

    def __init__(self, allocator: BlockAllocator, batch_size: int):
        super().__init__(allocator, max_num_seqs=batch_size, max_num_batched_tokens=sys.maxsize,
                         enable_chunked_prefill=False)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if not self.running:
            self._start_batch(out)
            return out
        for seq in self.running:
            num_new = seq.num_tokens - seq.num_computed_tokens
            if not self._allocate_slots(seq, num_new, out):
                raise RuntimeError("a static batch ran out of the blocks it reserved")
            out.add(seq, num_new)
        return out

    def _start_batch(self, out: SchedulerOutput) -> None:
        free, reserved = self.allocator.num_free_blocks, 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            worst = blocks_needed(len(seq.prompt_token_ids) + seq.sampling.max_tokens, self.allocator.block_size)
            if reserved + worst > free:
                break
            num_new = self._try_admit(seq, self.max_num_batched_tokens)
            reserved += worst
            self.waiting.popleft()
            seq.status = SequenceState.RUNNING
            self.running.append(seq)
            out.add(seq, num_new)


# --- the engine: the scheduler driving the toy model ---------------------------------


def token_probs(logits: np.ndarray, temperature: float) -> np.ndarray:
    """The distribution a sampler draws from: softmax(logits / T) in float64, one-hot at T = 0.

    Writing greedy decoding as a one-hot distribution lets one accept/resample rule serve both:
    with one-hot p and q, min(1, p/q) accepts exactly when the draft equals the target's argmax,
    and the residual is the target's argmax.
    """
    logits = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        probs = np.zeros(logits.shape)
        np.put_along_axis(probs, logits.argmax(axis=-1)[..., None], 1.0, axis=-1)
        return probs
    # Subtract the max BEFORE dividing: at a tiny temperature logits / T overflows to inf,
    # and inf - inf is NaN; (logits - max) / T is at most 0 and only underflows to -inf.
    return _softmax((logits - logits.max(axis=-1, keepdims=True)) / temperature)


def sample_token(logits: np.ndarray, sampling: SamplingParams, rng: np.random.Generator | None) -> int:
    """Greedy at temperature 0; else one draw `rng.choice(V, p=softmax(logits / T))`, computed in
    float64, where `rng` is the request's `np.random.default_rng(sampling.seed)`.

    Each request owns its generator and draws exactly once per output token, so what it
    samples does not depend on what it was batched with, nor on preemptions.
    """
    if sampling.temperature == 0:
        return int(np.argmax(logits))
    p = token_probs(logits, sampling.temperature)
    return int(rng.choice(p.size, p=p))


def _check_request(request: Request, config: ModelConfig) -> None:
    """A ValueError naming the request and what is wrong with it; nothing else is touched.
    Every field is checked here, so that nothing can fail later inside a step."""
    def bad(why: str) -> ValueError:
        return ValueError(f"request {request.request_id!r}: {why}")

    def ids_in_vocab(name: str, ids: object) -> list[int]:
        try:
            ids = check_token_ids(name, ids)
        except TypeError as e:
            raise bad(str(e)) from None
        except ValueError:  # a negative id
            ids = [-1]
        if any(not 0 <= t < config.vocab_size for t in ids):
            raise bad(f"{name} has a token id outside the vocabulary 0..{config.vocab_size - 1}")
        return ids

    s = request.sampling
    if not isinstance(request.request_id, str):
        raise bad(f"request_id must be a str, got {type(request.request_id).__name__}")
    if not isinstance(s, SamplingParams):
        raise bad(f"sampling must be a SamplingParams, got {type(s).__name__}")
    prompt = ids_in_vocab("prompt_token_ids", request.prompt_token_ids)
    if not prompt:
        raise bad("the prompt is empty; expected at least one token id")
    if isinstance(s.max_tokens, bool) or not isinstance(s.max_tokens, (int, np.integer)) or s.max_tokens < 1:
        raise bad(f"max_tokens must be an int >= 1, got {s.max_tokens!r}")
    if len(prompt) + s.max_tokens > config.n_positions:
        raise bad(f"prompt ({len(prompt)} tokens) + max_tokens ({s.max_tokens}) exceeds the model's "
                  f"n_positions = {config.n_positions}")
    t = s.temperature
    if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Real) or not 0 <= t < math.inf:
        raise bad(f"temperature must be a finite number >= 0, got {t!r}")
    if s.seed is not None and (isinstance(s.seed, (bool, np.bool_)) or not isinstance(s.seed, (int, np.integer))
                               or s.seed < 0):
        raise bad(f"seed must be None or an int >= 0, got {s.seed!r}")
    if not isinstance(s.stop_token_ids, (tuple, list)):
        raise bad(f"stop_token_ids must be a tuple or list of token ids, got {type(s.stop_token_ids).__name__}")
    ids_in_vocab("stop_token_ids", s.stop_token_ids)
    if request.cache_salt is not None and not isinstance(request.cache_salt, str):
        raise bad(f"cache_salt must be None or a str, got {type(request.cache_salt).__name__}")


class LLMEngine:
    """Serves generation requests on a ToyTransformer with a paged KV-cache.

    `num_blocks=None` sizes the cache so that `max_num_seqs` sequences of the model's full
    length fit at once (then nothing is ever preempted); pass fewer to study memory pressure.
    `scheduling` is "continuous" (Scheduler) or "static" (StaticBatchScheduler with
    batch_size = max_num_seqs). Metrics are wall-clock seconds from `time.perf_counter`.
    """

    def __init__(self, model: ToyTransformer, num_blocks: int | None = None, block_size: int = 16,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512, scheduling: str = "continuous",
                 enable_prefix_caching: bool = False, enable_chunked_prefill: bool = True):
        if num_blocks is None:
            num_blocks = max_num_seqs * blocks_needed(model.config.n_positions, block_size)
        self.model = model
        self.allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching)
        self.kv_cache = KVCache(model.config, num_blocks, block_size)
        self.scheduler = _make_scheduler(scheduling, self.allocator, max_num_seqs, max_num_batched_tokens,
                                         enable_chunked_prefill)
        self.num_steps = 0
        self._next_id = 0
        self._just_finished: list[SequenceState] = []  # finished outside a step, reported by the next one
        self._held: dict[str, RequestOutput] = {}  # other callers' outputs that generate() stepped past

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.allocator.stats.hit_rate

    def _in_flight(self) -> set[str]:
        """Ids of the requests added and not yet reported finished."""
        s = self.scheduler
        return {q.request_id for q in itertools.chain(s.waiting, s.running, self._just_finished)} | set(self._held)

    def _checked_requests(self, prompts: Sequence[Request | Sequence[int]],
                          sampling: Sequence[SamplingParams | None]) -> list[Request]:
        """Requests for these prompts, every field checked, ids fresh and unique: a ValueError
        for any bad one, and then nothing is queued (a batch is all or nothing)."""
        taken, requests = self._in_flight(), []
        for prompt, params in zip(prompts, sampling):
            if isinstance(prompt, Request):
                request = prompt
            else:
                while str(self._next_id) in taken:  # a caller's id may look like ours
                    self._next_id += 1
                request = Request(str(self._next_id), prompt, SamplingParams() if params is None else params)
            _check_request(request, self.model.config)
            if request.request_id in taken:
                raise ValueError(f"request id {request.request_id!r} is already in flight; ids must be unique")
            taken.add(request.request_id)
            requests.append(request)
        self._next_id += len(requests)
        return requests

    def add_request(self, prompt: Request | Sequence[int], sampling: SamplingParams | None = None) -> str:
        """Queue a Request (or a prompt with its SamplingParams); returns its request id.
        Its arrival is now on the engine's clock. A bad field or an id already in flight is a
        ValueError, and nothing is queued."""
        return self._add(self._checked_requests([prompt], [sampling])[0])

    def _add(self, request: Request) -> str:
        seq = self.scheduler.add_request(request)
        seq.arrival_time = time.perf_counter()
        seq.rng = np.random.default_rng(request.sampling.seed)
        if seq.finish_reason:
            seq.finish_time = seq.arrival_time
            self._just_finished.append(seq)
        return request.request_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._just_finished) or bool(self._held)

    def abort_request(self, request_id: str) -> bool:
        """Drop a waiting or running request now and free its blocks (its client went away).

        Its output, with `finish_reason="abort"` and the tokens it had, comes from the next
        `step()`. False for an id that is unknown or already finished."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        seq.finish_time = time.perf_counter()
        self._just_finished.append(seq)
        return True

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step on the model. Returns an output for every request that got a
        token or finished in this step (`.finished` tells which), and those that `generate`
        held for the caller of `step`.

        If the model or the sampler raises, every sequence of the step is finished as "error"
        (its blocks freed, its output reported by the next step) and the error propagates:
        no request is left behind half-computed."""
        held, self._held = list(self._held.values()), {}
        out = self.scheduler.schedule()
        done, self._just_finished = self._just_finished, []
        if not out.scheduled:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler planned an empty step while requests are waiting")
            return held + [seq.to_output() for seq in done]
        try:
            sampled = self._run_model(out)
        except Exception as exc:
            for seq in out.scheduled:
                self.scheduler.abort(seq.request_id)
                seq.finish_reason, seq.finish_time = f"error: {type(exc).__name__}", time.perf_counter()
            self._just_finished = done + out.scheduled
            raise
        finished = self.scheduler.update(out, sampled)
        self.num_steps += 1
        now = time.perf_counter()
        for seq in out.scheduled:
            if seq.request_id in sampled:
                seq.token_times.append(now)
        for seq in finished:
            seq.finish_time = now
        progressed = [s for s in out.scheduled if s.request_id in sampled]
        return held + [seq.to_output() for seq in done + progressed]

    def _run_model(self, out: SchedulerOutput) -> dict[str, int]:
        """The step's forward pass and sampling: request id -> sampled token, for every
        sequence whose last pending token this step processes."""
        self.kv_cache.copy_blocks(out.blocks_to_copy)  # before the forward writes into the copies
        num_new = [out.num_scheduled_tokens[s.request_id] for s in out.scheduled]
        logits = self.model.forward(self.kv_cache, [s.block_table for s in out.scheduled],
                                    [s.num_computed_tokens for s in out.scheduled], num_new)
        last_rows = np.cumsum(num_new) - 1
        return {s.request_id: sample_token(logits[row], s.sampling, s.rng)
                for s, row in zip(out.scheduled, last_rows) if out.completes(s)}

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order.

        `sampling` is one SamplingParams for all, or one per prompt. Every prompt is checked
        before any work starts, so a bad one raises ValueError and nothing runs. Requests
        added earlier with `add_request` run alongside; their outputs are kept for the next
        `step()` (the latest one per request), never dropped. If a step raises, this batch's
        unfinished requests are aborted before the error propagates."""
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling)} SamplingParams")
        requests = self._checked_requests(prompts, sampling)
        for request in requests:
            self._add(request)
        mine = {r.request_id for r in requests}
        results: dict[str, RequestOutput] = {}
        try:
            while len(results) < len(requests):
                for o in self.step():
                    if o.request_id in mine:
                        if o.finished:
                            results[o.request_id] = o
                    else:
                        self._held[o.request_id] = o
        except BaseException:
            for rid in mine - set(results):
                self.abort_request(rid)
            raise
        return [results[r.request_id] for r in requests]

    def summary(self, outputs: Sequence[RequestOutput], duration: float) -> dict[str, float]:
        """summarize_serving with this engine's preemption count and prefix-cache hit rate."""
        return summarize_serving(outputs, duration, self.num_preemptions, self.prefix_cache_hit_rate)


def _make_scheduler(scheduling: str, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                    enable_chunked_prefill: bool) -> Scheduler:
    if scheduling == "continuous":
        return Scheduler(allocator, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)
    if scheduling == "static":
        return StaticBatchScheduler(allocator, batch_size=max_num_seqs)
    raise ValueError(f"scheduling must be 'continuous' or 'static', got {scheduling!r}")


def summarize_serving(outputs: Sequence[RequestOutput], duration: float, num_preemptions: int = 0,
                      prefix_cache_hit_rate: float = 0.0) -> dict[str, float]:
    """The numbers of a serving benchmark, named as vLLM's benchmark prints them: mean, p50
    and p99 of TTFT, TPOT, ITL and E2E latency (in the unit of the metrics: seconds, or steps
    for the simulator's step clock), output-token throughput per unit of `duration`, and the
    counts. Rejected requests count as requests, not in the latencies."""
    served = [o for o in outputs if o.metrics is not None and o.output_token_ids]
    samples = {
        "ttft": [o.metrics.ttft for o in served],
        "tpot": [o.metrics.tpot for o in served if len(o.output_token_ids) > 1],
        "itl": [gap for o in served for gap in o.metrics.itl],
        "e2e": [o.metrics.e2e_latency for o in served],
    }
    num_out = sum(len(o.output_token_ids) for o in outputs)
    summary = {"num_requests": len(outputs), "num_rejected": len(outputs) - len(served),
               "num_output_tokens": num_out, "duration": duration,
               "output_throughput": num_out / duration if duration > 0 else math.nan,
               "num_preemptions": num_preemptions, "prefix_cache_hit_rate": prefix_cache_hit_rate}
    for name, values in samples.items():
        values = np.asarray(values, dtype=np.float64)
        for stat, f in (("mean", np.mean), ("p50", np.median), ("p99", lambda x: np.percentile(x, 99))):
            summary[f"{stat}_{name}"] = float(f(values)) if values.size else math.nan
    return summary


# --- the model-free step simulator: the same schedulers, a cost per step ------------------


@dataclasses.dataclass(frozen=True)
class StepCostModel:
    """Seconds per engine step, as a roofline: a step is bound by memory traffic or by compute,
    whichever is slower. The defaults are Llama-2-7B in fp16 on one A100-80GB:

    - weight_read_time: every step reads all weights once, whatever the batch
      (14 GB at ~2 TB/s = 7 ms). This fixed cost is what batching amortises.
    - kv_read_time_per_token: attention reads each sequence's whole context
      (0.5 MiB of K/V per token for Llama-2-7B, over ~2 TB/s).
    - compute_time_per_token: 2 * 7e9 FLOPs per processed token at ~50% of 312 TFLOP/s.

    A decode step (one token per sequence) is memory-bound; a step with a long prefill is
    compute-bound: that is why TTFT follows prefill and TPOT follows the decode batch.
    """

    weight_read_time: float = 7e-3
    kv_read_time_per_token: float = 2.6e-7
    compute_time_per_token: float = 9e-5

    def step_time(self, num_tokens: int, num_context_tokens: int) -> float:
        memory = self.weight_read_time + self.kv_read_time_per_token * num_context_tokens
        return max(memory, self.compute_time_per_token * num_tokens)


@dataclasses.dataclass
class ServingSimulation:
    """What simulate_serving measured. `timeline[t]` is step t's row of slots: a request index
    per busy slot, -1 for a slot idle while requests wait (wasted), -2 idle with nothing waiting.
    `outputs` carry metrics in simulated seconds, `outputs_in_steps` the same in steps."""

    scheduling: str
    num_slots: int
    num_steps: int
    duration: float
    num_output_tokens: int
    wasted_slot_steps: int
    num_preemptions: int
    outputs: list[RequestOutput]
    outputs_in_steps: list[RequestOutput]
    timeline: list[list[int]]
    output_lens: list[int]

    @property
    def throughput(self) -> float:
        """Output tokens per simulated second."""
        return self.num_output_tokens / self.duration

    @property
    def tokens_per_step(self) -> float:
        return self.num_output_tokens / self.num_steps

    def summary(self, in_steps: bool = False) -> dict[str, float]:
        if in_steps:
            return summarize_serving(self.outputs_in_steps, self.num_steps, self.num_preemptions)
        return summarize_serving(self.outputs, self.duration, self.num_preemptions)


def simulate_serving(workload: Sequence[tuple[float, int, int]], scheduling: str = "continuous", *,
                     max_num_seqs: int = 16, max_num_batched_tokens: int = 512, num_blocks: int | None = None,
                     block_size: int = 16, enable_chunked_prefill: bool = True,
                     cost: StepCostModel = StepCostModel(), record_timeline: bool = True) -> ServingSimulation:
    """Run a workload through the real Scheduler (or StaticBatchScheduler with batch_size =
    max_num_seqs) on a real BlockAllocator, with no model: each step costs
    `cost.step_time(scheduled tokens, context tokens read)` seconds of simulated time.

    workload: (arrival_time in seconds, prompt_len, output_len) per request; each request
    produces exactly output_len tokens. `num_blocks=None` gives every slot room for the
    longest request (no memory pressure). A slot-step is wasted when a slot is idle while an
    arrived request waits: the cost of head-of-line blocking (or of a full cache). A request
    that can never fit is reported rejected, as the engine does. `record_timeline=False`
    skips the slots x steps timeline (for long runs).
    """
    _check_workload(workload)
    if num_blocks is None:
        num_blocks = max_num_seqs * max(blocks_needed(p + o, block_size) for _, p, o in workload)
    scheduler = _make_scheduler(scheduling, BlockAllocator(num_blocks, block_size), max_num_seqs,
                                max_num_batched_tokens, enable_chunked_prefill)
    arrivals = collections.deque(sorted(range(len(workload)), key=lambda i: workload[i][0]))
    seqs: list[SequenceState | None] = [None] * len(workload)
    step_clock: dict[str, list[int]] = {}  # request id -> [arrival step, token steps...]
    slot_of: dict[str, int] = {}
    clock, timeline, wasted, num_steps = 0.0, [], 0, 0
    while arrivals or scheduler.has_unfinished():
        if not scheduler.has_unfinished() and workload[arrivals[0]][0] > clock:
            clock = workload[arrivals[0]][0]  # idle: jump to the next arrival
        while arrivals and workload[arrivals[0]][0] <= clock:
            i = arrivals.popleft()
            arrival, prompt_len, output_len = workload[i]
            seqs[i] = scheduler.add_request(Request(str(i), [0] * prompt_len, SamplingParams(max_tokens=output_len),
                                                    arrival))
            step_clock[str(i)] = [num_steps]
        if not scheduler.has_unfinished():
            continue  # every arrival so far was rejected
        out = scheduler.schedule()
        if not out.scheduled:
            raise RuntimeError("the scheduler planned an empty step while requests are waiting")
        context = sum(s.num_computed_tokens + out.num_scheduled_tokens[s.request_id] for s in out.scheduled)
        clock += cost.step_time(out.total_num_scheduled_tokens, context)
        row = _occupy_slots(slot_of, scheduler.running, max_num_seqs, waiting=len(scheduler.waiting))
        num_steps += 1
        if record_timeline:
            timeline.append(row)
        wasted += min(row.count(-1), len(scheduler.waiting))
        sampled = {s.request_id: 0 for s in out.scheduled if out.completes(s)}
        for seq in scheduler.update(out, sampled):
            seq.finish_time = clock
        for rid in sampled:
            seqs[int(rid)].token_times.append(clock)
            step_clock[rid].append(num_steps)
    outputs = [s.to_output() for s in seqs]
    in_steps = []
    for s in seqs:
        arrival_step, *token_steps = step_clock[s.request_id]
        metrics = RequestMetrics.from_times(arrival_step, token_steps, token_steps[-1] if token_steps else arrival_step)
        in_steps.append(dataclasses.replace(s.to_output(), metrics=metrics))
    return ServingSimulation(scheduling, max_num_seqs, num_steps, clock,
                             sum(len(o.output_token_ids) for o in outputs), wasted, scheduler.num_preemptions,
                             outputs, in_steps, timeline, [o for _, _, o in workload])


def _check_workload(workload: Sequence[tuple[float, int, int]]) -> None:
    """A ValueError naming the first bad request of a simulated workload."""
    if len(workload) == 0:
        raise ValueError("the workload is empty; expected (arrival_time, prompt_len, output_len) per request")
    for i, entry in enumerate(workload):
        if len(entry) != 3:
            raise ValueError(f"workload[{i}] = {entry!r}; expected (arrival_time, prompt_len, output_len)")
        arrival, prompt_len, output_len = entry
        if isinstance(arrival, (bool, np.bool_)) or not isinstance(arrival, numbers.Real) \
                or not 0 <= arrival < math.inf:
            raise ValueError(f"workload[{i}]: arrival_time must be a finite number >= 0, got {arrival!r}")
        check_int(f"workload[{i}] prompt_len", prompt_len, minimum=1)
        check_int(f"workload[{i}] output_len", output_len, minimum=1)


def _occupy_slots(slot_of: dict[str, int], running: list[SequenceState], num_slots: int, waiting: int) -> list[int]:
    """Give each running sequence a stable slot (the lowest free one when it enters) and
    return this step's row of the timeline."""
    ids = {s.request_id for s in running}
    for rid in [r for r in slot_of if r not in ids]:
        del slot_of[rid]  # finished or preempted: the slot is free
    for rid in (s.request_id for s in running):
        if rid not in slot_of:
            slot_of[rid] = min(set(range(num_slots)) - set(slot_of.values()))
    row = [-1 if waiting else -2] * num_slots
    for rid, slot in slot_of.items():
        row[slot] = int(rid)
    return row


def format_timeline(sim: ServingSimulation, width: int = 96) -> str:
    """The slots x steps picture: one line per slot, one column per `ceil(steps / width)` steps
    (the most frequent state in those steps). '#' a long request (output > 4x the median),
    letters the others (a new letter = a new request in the slot), '.' a slot idle while
    requests wait (wasted), ' ' idle with nothing to do."""
    per_col = max(1, math.ceil(sim.num_steps / width))
    long_cut = 4 * float(np.median(sim.output_lens))

    def glyph(cell: int) -> str:
        if cell < 0:
            return "." if cell == -1 else " "
        return "#" if sim.output_lens[cell] > long_cut else "abcdefghijklmnopqrstuvwxyz"[cell % 26]

    lines = [f"{sim.scheduling}: {sim.num_slots} slots x {sim.num_steps} steps, one column = {per_col} step(s)"]
    for slot in range(sim.num_slots):
        cols = []
        for c in range(0, sim.num_steps, per_col):
            cells = [row[slot] for row in sim.timeline[c : c + per_col]]
            cols.append(glyph(max(cells, key=cells.count)))
        lines.append(f"slot {slot:>2} |{''.join(cols)}|")
    return "\n".join(lines)


def format_batching_report(static: ServingSimulation, continuous: ServingSimulation, title: str = "",
                           timeline_width: int = 96) -> str:
    """The design-review slide: both timelines, then the numbers side by side."""
    rows = [("steps", "num_steps", "{:.0f}"), ("simulated time (s)", "duration", "{:.2f}"),
            ("throughput (tokens/s)", "throughput", "{:.0f}"), ("tokens per step", "tokens_per_step", "{:.2f}"),
            ("wasted slot-steps", "wasted_slot_steps", "{:.0f}"), ("preemptions", "num_preemptions", "{:.0f}")]
    lines = [title] if title else []
    lines += [format_timeline(static, timeline_width), "", format_timeline(continuous, timeline_width), ""]
    lines.append(f"{'':<28}{'static':>12}{'continuous':>12}")
    for label, attr, fmt in rows:
        a, b = getattr(static, attr), getattr(continuous, attr)
        lines.append(f"{label:<28}{fmt.format(a):>12}{fmt.format(b):>12}")
    for unit, in_steps, scale, fmt in (("s", False, 1.0, "{:.3f}"), ("steps", True, 1.0, "{:.1f}")):
        sa, sb = static.summary(in_steps), continuous.summary(in_steps)
        for key in ("mean_ttft", "p99_ttft", "mean_tpot", "p99_tpot"):
            label = f"{key} ({unit})"
            lines.append(f"{label:<28}{fmt.format(sa[key] * scale):>12}{fmt.format(sb[key] * scale):>12}")
    lines.append(f"continuous / static throughput: {continuous.throughput / static.throughput:.2f}x")
    return "\n".join(lines)


# --- the scenario: defend continuous batching in a design review ----------------------


def skewed_workload(num_short: int, long_len: int, short_len: int, prompt_len: int) -> list[tuple[float, int, int]]:
    """The design review's skewed workload: one long answer first, then many short ones, all queued at t=0."""
    return [(0.0, prompt_len, long_len)] + [(0.0, prompt_len, short_len)] * num_short


def recurring_workload(num_requests: int, long_len: int, short_len: int, prompt_len: int, rate: float,
                       long_every: int = 8, seed: int = 0) -> list[tuple[float, int, int]]:
    """A stream: Poisson arrivals at `rate` requests/s (rate 0: all at t=0), every
    `long_every`-th request a long answer."""
    gaps = np.random.default_rng(seed).exponential(1 / rate, num_requests) if rate else np.zeros(num_requests)
    return [(float(t), prompt_len, long_len if i % long_every == 0 else short_len)
            for i, t in enumerate(np.cumsum(gaps) - gaps[0])]


def _measure_engine(model: ToyTransformer, workload: list[tuple[float, int, int]], scheduling: str,
                    max_num_seqs: int) -> tuple[float, int]:
    """Wall-clock seconds and output tokens of one engine run (greedy, every request queued at once)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, p).tolist() for _, p, _ in workload]
    sampling = [SamplingParams(max_tokens=o) for _, _, o in workload]
    engine = LLMEngine(model, max_num_seqs=max_num_seqs, scheduling=scheduling)
    start = time.perf_counter()
    outputs = engine.generate(prompts, sampling)
    return time.perf_counter() - start, sum(len(o.output_token_ids) for o in outputs)


def _static_and_continuous(workload, slots: int) -> tuple[ServingSimulation, ServingSimulation]:
    return (simulate_serving(workload, "static", max_num_seqs=slots),
            simulate_serving(workload, "continuous", max_num_seqs=slots))


def scenario_batching(slots: int = 16, long_len: int = 2000, short_len: int = 50, num_short: int = 63,
                      timeline_width: int = 96) -> str:
    """The design review "defend continuous batching", in the simulator at real sizes (Llama-2-7B
    on an A100, StepCostModel): the skewed workload, then a stream where long answers recur."""
    out = []

    def both(workload):
        return _static_and_continuous(workload, slots)

    skewed = skewed_workload(num_short=num_short, long_len=long_len, short_len=short_len, prompt_len=128)
    s, c = both(skewed)
    out.append(format_batching_report(s, c, "== Skewed: 1 request answers 2000 tokens, 63 answer 50 "
                                            f"(prompts 128, {slots} slots) ==", timeline_width))
    stream = recurring_workload(256, long_len=long_len, short_len=short_len, prompt_len=128, rate=4.0)
    s2, c2 = both(stream)
    out.append(format_batching_report(s2, c2, "\n== Stream: 256 requests arriving at 4/s, one in eight "
                                              f"answers {long_len} tokens, the rest {short_len} ==", timeline_width))

    out.append(
        f"\nWhy they differ: with ONE long answer the makespan is that answer in both schedules "
        f"({s.num_steps} vs {c.num_steps} steps), so throughput moves only {c.throughput / s.throughput:.2f}x; "
        f"what static batching loses there is latency (mean TTFT {s.summary()['mean_ttft']:.1f} s vs "
        f"{c.summary()['mean_ttft']:.2f} s) and {s.wasted_slot_steps} slot-steps. When long answers recur, "
        f"nearly every static batch holds one, so every batch lasts ~{long_len} steps at "
        f"{s2.tokens_per_step:.1f} tokens/step, while continuous batching refills the slots: "
        f"{c2.tokens_per_step:.1f} tokens/step, {c2.throughput / s2.throughput:.2f}x the throughput. A step costs "
        f"about the same either way (the weights are read once per step), so tokens per step is throughput. "
        f"TTFT is queueing + prefill: continuous batching moves it. TPOT is the decode step: it grows a little "
        f"with the batch ({s2.summary()['mean_tpot'] * 1e3:.1f} -> {c2.summary()['mean_tpot'] * 1e3:.1f} ms).")
    return "\n".join(out)


def bench_batching(slots: int = 16) -> str:
    """`python solution.py bench batching`: the scenario in the simulator, then measured wall-clock
    on the toy model at sizes scaled by 1/10 to fit its n_positions = 256 (answers of 200 and 5
    tokens instead of 2000 and 50), beside the simulator's prediction for the same workloads."""
    out = [scenario_batching(slots)]
    model = ToyTransformer(ModelConfig())
    out.append(f"\n== Toy model ({model.config.n_layer} layers, n_embd {model.config.n_embd}), wall-clock, "
               f"{slots} slots, sizes / 10: answers of 200 and 5 tokens, prompts 13, all queued at t=0 ==")
    out.append(f"{'workload':<34}{'static tok/s':>14}{'continuous tok/s':>18}{'measured':>10}{'simulated':>11}")
    for name, workload in (("skewed (1 long + 63 short)", skewed_workload(63, 200, 5, 13)),
                           ("one in eight long (128 requests)", recurring_workload(128, 200, 5, 13, rate=0))):
        (ts, ns), (tc, nc) = (_measure_engine(model, workload, k, slots) for k in ("static", "continuous"))
        sim_s, sim_c = _static_and_continuous(workload, slots)
        out.append(f"{name:<34}{ns / ts:>14.0f}{nc / tc:>18.0f}{(nc / tc) / (ns / ts):>9.2f}x"
                   f"{sim_c.throughput / sim_s.throughput:>10.2f}x")
    out.append("On a CPU the toy model's step cost grows with the batch (its weights sit in cache; nothing\n"
               "like a GPU's fixed weight read), so the measured gain is smaller than the simulated one.")
    return "\n".join(out)


# =====================================================================================
# 4. Speculative decoding: accept/resample, its exact distribution, the speedup algebra, and
#    draft -> verify on the paged model
# =====================================================================================
#
# References: Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via Speculative
# Decoding" (ICML); Chen, Borgeaud, Irving, Lespiau, Sifre, Jumper 2023, "Accelerating Large
# Language Model Decoding with Speculative Sampling" (arXiv:2302.01318).

# A row is a probability distribution when it is finite, non-negative and sums to 1 within
# PROB_ATOL. 1e-5 admits float32 softmax rows over a large vocabulary (their sums drift by a few
# float32 ulps per term) and still rejects logits, counts or a forgotten normalisation. Accepted
# rows are renormalised in float64 before any arithmetic, because `Generator.choice` itself
# insists on a sum within ~1.5e-8.
PROB_ATOL = 1e-5


def _as_distributions(name: str, probs, ndim: int) -> np.ndarray:
    """`probs` as float64 rows that sum to exactly 1, or a ValueError naming the first bad row."""
    arr = np.asarray(probs, dtype=np.float64)
    if arr.ndim != ndim:
        expected = "a 1-D row (V,)" if ndim == 1 else "a 2-D array of rows (n, V)"
        raise ValueError(f"{name} must be {expected} of probabilities, got shape {arr.shape}")
    if arr.shape[-1] == 0:
        raise ValueError(f"{name} has an empty vocabulary axis, shape {arr.shape}")
    rows = arr.reshape(-1, arr.shape[-1])
    sums = rows.sum(axis=1)
    # One cheap test on the common path; the diagnosis below runs only for bad input. NaN fails
    # every comparison, so `not (... <= ...)` also catches it.
    if rows.size and not (rows.min() >= 0.0 and np.abs(sums - 1.0).max() <= PROB_ATOL):
        problems = [
            (~np.isfinite(rows).all(axis=1), "contains NaN or inf"),
            ((rows < 0).any(axis=1), "has a negative entry (did you pass logits?)"),
            (~(np.abs(sums - 1.0) <= PROB_ATOL),
             f"does not sum to 1 within {PROB_ATOL:g} (apply softmax / normalise first)"),
        ]
        for bad, why in problems:
            if bad.any():
                i = int(np.argmax(bad))
                where = name if ndim == 1 else f"{name}[{i}]"
                raise ValueError(f"{where} {why}; expected a probability distribution over "
                                 f"the vocabulary, got {np.array2string(rows[i], precision=4)}")
    return arr / sums.reshape(arr.shape[:-1] + (1,))


def _check_same_vocab(p: np.ndarray, q: np.ndarray) -> None:
    if p.shape != q.shape:
        raise ValueError(f"target p has shape {p.shape} but draft q has shape {q.shape}; "
                         "both must be rows over the same vocabulary")


def residual_distribution(p, q) -> np.ndarray:
    """The distribution a rejected draft token is replaced from: `max(0, p - q)` normalised.

    `p` is the target row, `q` the draft row (1-D, same vocabulary). The residual puts mass
    exactly where the draft under-proposes (p > q), which is the mass the accept test could not
    deliver. Where it has no mass (p == q), rejection never happens and the result is `p`.
    Returns a float64 row summing to 1; never divides by zero.
    """
    raise NotImplementedError("Exercise 6: residual_distribution")


def _checked_speculative_inputs(draft_token_ids, draft_probs, target_probs,
                                rng) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The draft tokens, q (k, V) and p (k+1, V) as float64 distributions, or a ValueError (see below)."""
    q = _as_distributions("draft_probs", draft_probs, ndim=2)
    p = _as_distributions("target_probs", target_probs, ndim=2)
    k, vocab_size = q.shape
    if p.shape != (k + 1, vocab_size):
        raise ValueError(f"target_probs must have shape (k+1, V) = {(k + 1, vocab_size)} for "
                         f"draft_probs of shape {q.shape}; got {p.shape}")
    draft = list(draft_token_ids)
    if len(draft) != k:
        raise ValueError(f"got {len(draft)} draft tokens but draft_probs has k = {k} rows")
    for i, x in enumerate(draft):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
            raise ValueError(f"draft token {i} is {x!r}; expected an int token id")
        if not 0 <= x < vocab_size:
            raise ValueError(f"draft token {i} is {x}; expected an id in [0, {vocab_size})")
        if q[i, x] == 0.0:
            raise ValueError(f"draft token {i} is {x} but draft_probs[{i}][{x}] == 0: the draft "
                             "could not have sampled it, so p/q is undefined")
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy Generator (np.random.default_rng(seed)), "
                         f"got {type(rng).__name__}")
    return [int(x) for x in draft], q, p


def accept_or_resample(draft_token_ids, draft_probs, target_probs,
                       rng: np.random.Generator) -> list[int]:
    """Verify `k` draft tokens against the target: the speculative-sampling accept/resample rule.

    `draft_token_ids` (k ints) were sampled from `draft_probs` (k, V): token i from row i, the
    draft's distribution at that position. `target_probs` (k+1, V) are the target's rows at the
    same positions plus one more, all from ONE target pass. Draft token x_i is accepted with
    probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection one token is drawn from
    `residual_distribution(p_i, q_i)` and the step ends; if all k are accepted a bonus token is
    drawn from `target_probs[k]`. Returns the 1 to k+1 emitted token ids (accepted drafts, then
    the resampled or bonus token).

    Invariant: whatever q is, each emitted token is distributed exactly as the target would have
    sampled it (see `speculative_output_distribution`).

    Random draws, in this order, so a seeded run is reproducible: one `rng.random()` per draft
    token considered (x_i is accepted iff that u < min(1, p_i/q_i)), up to and including the
    first rejection; then exactly one `rng.choice(V, p=...)` for the residual or bonus token.

    Raises ValueError, before drawing anything, for: shapes other than (k, V) and (k+1, V),
    `len(draft_token_ids) != k`, a token id outside [0, V), a row that is not a probability
    distribution (see PROB_ATOL), or a draft token with q_i(x_i) == 0 (it could not have been
    drawn, so the ratio p/q is meaningless).
    """
    raise NotImplementedError("Exercise 6: accept_or_resample")


def speculative_output_distribution(p, q) -> np.ndarray:
    """Exact distribution of the first token one accept/resample step emits, for a draft x ~ q.

    Computed in closed form, not sampled: draft x is proposed with probability q(x) and kept with
    probability min(1, p(x)/q(x)), which together contribute q(x)*min(1, p/q) = min(p(x), q(x));
    the rest, 1 - sum(min(p, q)), goes to the residual. Their sum is min(p, q) + max(0, p - q) = p:
    the output equals the target row whatever the draft.
    """
    p = _as_distributions("p", p, ndim=1)
    q = _as_distributions("q", q, ndim=1)
    _check_same_vocab(p, q)
    # q(x) == 0 means x is never proposed; keep those terms at 0 without dividing by 0.
    ratio = np.divide(p, q, out=np.ones_like(p), where=q > 0)
    kept = q * np.minimum(1.0, ratio)
    rejected = 1.0 - kept.sum()
    return kept + rejected * residual_distribution(p, q)


def acceptance_rate(p, q) -> float:
    """alpha = sum(min(p, q)): the probability one draft token from q is accepted (1 - TV(p, q))."""
    p = _as_distributions("p", p, ndim=1)
    q = _as_distributions("q", q, ndim=1)
    _check_same_vocab(p, q)
    return float(np.minimum(p, q).sum())


def _check_alpha_k(alpha: float, k: int) -> None:
    if isinstance(alpha, (bool, np.bool_)) or not isinstance(alpha, numbers.Real) \
            or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha is the acceptance rate, a probability in [0, 1]; got {alpha!r}")
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"k is the number of draft tokens per step, an int >= 1; got {k!r}")


def _check_cost(name: str, value: float, allow_zero: bool) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) \
        and np.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} is a cost relative to one target decode step, a finite number "
                         f"{bound}; got {value!r}")


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Expected tokens one draft+verify step emits: (1 - alpha**(k+1)) / (1 - alpha).

    Treating acceptances as independent with rate alpha, the step emits j+1 tokens when the first
    j drafts are kept, so the mean is 1 + alpha + ... + alpha**k: the geometric sum above, and
    k+1 at alpha = 1, where the closed form is 0/0. O(1) in k.
    """
    _check_alpha_k(alpha, k)
    alpha, k = float(alpha), int(k)
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speculative_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al.'s walltime improvement: (1 - alpha**(k+1)) / ((1 - alpha) * (k*c + 1)).

    c = cost of one draft step / cost of one target step. A step costs k draft steps plus ONE
    target pass, and that pass is assumed to cost one decode step although it scores k+1 tokens
    (true while decode is bandwidth-bound; see `predicted_speedup`).
    """
    _check_cost("c", c, allow_zero=True)
    return expected_tokens_per_step(alpha, k) / (k * c + 1.0)


def breakeven_draft_cost(alpha: float, k: int) -> float:
    """The draft cost c at which `speculative_speedup(alpha, k, c) == 1`; cheaper drafts win.

    Solves E/(k*c + 1) = 1 for c: c = (E - 1)/k = (alpha + ... + alpha**k)/k, the mean acceptance
    probability of the k positions; 0 at alpha = 0 (no draft, however cheap, pays off), 1 at
    alpha = 1 (a perfect draft pays while it is cheaper than the target).
    """
    return (expected_tokens_per_step(alpha, k) - 1.0) / k


def predicted_speedup(alpha: float, k: int, c: float, verify_cost: float) -> float:
    """Speedup when the target pass over k+1 tokens costs `verify_cost` one-token decode steps.

    E / (k*c + verify_cost). `speculative_speedup` is the case verify_cost = 1, which holds only
    while the pass is bandwidth-bound (reading the weights dominates); measure verify_cost on the
    real model. Compute-bound (prefill, large batch) it tends to k+1 and the speedup drops below 1.
    """
    _check_cost("verify_cost", verify_cost, allow_zero=False)
    _check_cost("c", c, allow_zero=True)
    return expected_tokens_per_step(alpha, k) / (k * c + verify_cost)


def format_speculation_table(c: float, alphas=(0.5, 0.6, 0.7, 0.8, 0.9),
                             ks=(1, 2, 3, 4, 5, 6, 8)) -> str:
    """The design-review table "should we add speculative decoding?" for a draft of cost c.

    Rows alpha, columns k: expected speedup (`speculative_speedup`), then the best k, its speedup
    and its breakeven draft cost. Followed by why it helps decode but not prefill or large batches.
    """
    _check_cost("c", c, allow_zero=True)
    if not alphas or not ks:
        raise ValueError("alphas and ks must be non-empty")
    for alpha in alphas:
        for k in ks:
            _check_alpha_k(alpha, k)
    head = f"{'alpha':>6} |" + "".join(f"{'k=' + str(k):>7}" for k in ks) \
        + f" | {'best k':>6} {'speedup':>8} {'breakeven c':>12}"
    lines = [f"Expected speedup of speculative decoding, draft cost c = {c:g} target steps "
             "(verify pass = 1 decode step)",
             head, "-" * len(head)]
    for alpha in alphas:
        speedups = [speculative_speedup(alpha, k, c) for k in ks]
        best = int(np.argmax(speedups))
        lines.append(f"{alpha:>6.2f} |" + "".join(f"{s:>7.2f}" for s in speedups)
                     + f" | {ks[best]:>6d} {speedups[best]:>8.2f}"
                     + f" {breakeven_draft_cost(alpha, ks[best]):>12.3f}")
    lines.append("(< 1 is a slowdown. Breakeven c = the dearest draft that still pays at that k;"
                 " it is largest, c = alpha, at k = 1)")

    alpha, k = max(alphas), max(ks)
    tokens = expected_tokens_per_step(alpha, k)
    compute_bound = predicted_speedup(alpha, k, c, verify_cost=k + 1)
    lines += [
        "",
        "Why it helps decode: a decode step reads every weight (and the KV-cache) to produce",
        "ONE token per sequence, so it is memory-bandwidth-bound and the arithmetic units mostly",
        "idle. Scoring k+1 tokens in that pass reads the same bytes and costs about one step, so",
        f"at alpha = {alpha:g}, k = {k} a target pass yields {tokens:.2f} tokens instead of 1, "
        "for the price of k draft steps.",
        "Why not prefill: the prompt's tokens are all known and already go through one parallel,",
        "compute-bound pass; there are no sequential steps to save and no idle FLOPs to spend.",
        "When a pass is compute-bound, k+1 tokens cost ~k+1 steps and the speedup",
        f"E/(k*c + k+1) = {compute_bound:.2f} < 1 here: speculation can only lose.",
        "Why less at large batch: B sequences per step already use the idle compute; a verify",
        "pass of B*(k+1) tokens turns compute-bound, verify_cost grows toward k+1 and",
        "`predicted_speedup` toward (then below) 1; rejected drafts waste FLOPs the batch needs.",
        "Sources: Leviathan et al. 2023, Fast Inference from Transformers via Speculative",
        "Decoding; Chen et al. 2023, Accelerating Large Language Model Decoding with",
        "Speculative Sampling.",
    ]
    return "\n".join(lines)


# --- draft -> verify on the paged model (Exercise 7) ----------------------------------


@dataclasses.dataclass
class SpeculativeOutput:
    """What `speculative_generate` produced and how the draft fared."""

    token_ids: list[int]
    num_target_passes: int  # verification passes (the prompt's prefill is not counted)
    num_draft_tokens: int
    num_accepted: int
    accepted_per_pass: list[int]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0


class PagedSequence:
    """One model's private paged cache for one sequence, with what it has computed so far."""

    def __init__(self, model: ToyTransformer, block_size: int = 16):
        num_blocks = blocks_needed(model.config.n_positions, block_size)
        self.model = model
        self.table = BlockTable(BlockAllocator(num_blocks, block_size))
        self.cache = KVCache(model.config, num_blocks, block_size)
        self.num_computed = 0

    def extend(self, token_ids: Sequence[int]) -> None:
        self.cache.copy_blocks(self.table.append_tokens(token_ids))

    def run(self, stop: int | None = None) -> np.ndarray:
        """Process the tokens not computed yet (up to position `stop`); logits for each of them."""
        start = self.num_computed
        stop = self.table.num_tokens if stop is None else stop
        if stop == start:
            return np.empty((0, self.model.config.vocab_size), np.float32)
        self.num_computed = stop
        return self.model.forward(self.cache, [self.table], [start], [stop - start])

    def rollback(self, num_tokens: int) -> None:
        """Forget tokens past `num_tokens`: their blocks go back, their K/V is never read again."""
        self.table.truncate(num_tokens)
        self.num_computed = min(self.num_computed, num_tokens)


def make_self_draft(target: ToyTransformer, num_layers: int) -> ToyTransformer:
    """A self-speculative draft: the target's first `num_layers` blocks with its embeddings and head.

    It costs about num_layers / n_layer of a target step and needs no training; how often it
    agrees with the target (alpha) is measured, not assumed.
    """
    if not 1 <= num_layers <= target.config.n_layer:
        raise ValueError(f"a self-draft keeps 1..{target.config.n_layer} layers, got {num_layers}")
    config = dataclasses.replace(target.config, n_layer=num_layers)
    keep = gpt2_weight_shapes(config)
    return ToyTransformer(config, {name: w for name, w in target.weights.items() if name in keep})


def speculative_generate(
    target: ToyTransformer,
    draft: ToyTransformer,
    prompt_token_ids: Sequence[int],
    sampling: SamplingParams,
    k: int = 4,
) -> SpeculativeOutput:
    """Generate with a draft that proposes `k` tokens and a target that verifies them in ONE pass.

    Invariant at the top of every round: both caches hold K/V for every committed token but the
    last one. A round: the draft proposes d_1..d_n autoregressively; the target runs over
    [last, d_1..d_n] in one paged forward pass, which yields its distributions p_0..p_n;
    accept/resample emits 1..n+1 tokens; both caches are truncated back to the accepted tokens.
    The output has the target's distribution (greedy: exactly the target's greedy tokens).

    Conventions the counters follow:
    - the prefill runs the prompt but its last token through both models and emits nothing; the
      first round scores the last prompt token. `num_target_passes` counts rounds (verification
      passes), not the prefill;
    - a round drafts n = min(k, tokens still wanted - 1, positions left in the context - 1)
      tokens: never a draft that could not be emitted, nor a token past `n_positions` (the
      round's bonus token needs one more position). `num_draft_tokens` counts the drafts made,
      `num_accepted` those accepted;
    - sampling uses one generator, seeded by `sampling.seed`, for the draft's draws and
      accept_or_resample's, in the order they happen; the draft samples at the same
      temperature as the target;
    - the output stops at the first stop token (kept) or at max_tokens, like the engine.
    """
    prompt = list(prompt_token_ids)
    _check_request(Request("speculative", prompt, sampling), target.config)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft vocabulary {draft.config.vocab_size} != target vocabulary {target.config.vocab_size}")
    k = check_int("k", k, minimum=1)
    raise NotImplementedError("Exercise 7: speculative_generate")


# --- the scenario, measured: should we add speculative decoding? --------------------------
#
# The bench model must make a decode step weight-read-bound: GPT-2-small's body (12 layers,
# n_embd 768) with a 4096-token vocabulary is ~350 MB of float32 weights, ten times this CPU's
# 32 MB L3, so every decode step streams all of them from DRAM.
SPEC_BENCH_CONFIG = ModelConfig(vocab_size=4096, n_positions=512, n_embd=768, n_layer=12, n_head=12)
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


def make_early_exit_target(config: ModelConfig, num_draft_layers: int, refinement_scale: float,
                           seed: int = 0) -> ToyTransformer:
    """A target whose layers from `num_draft_layers` on are small refinements of the residual stream.

    GPT-2 init, then `attn.c_proj` and `mlp.c_proj` weights of layers >= num_draft_layers are
    multiplied by `refinement_scale` (0 < scale <= 1; 1 is the plain init). The early layers and
    the head are untouched, so `make_self_draft(target, num_draft_layers)` shares them exactly.
    """
    if not 1 <= num_draft_layers <= config.n_layer:
        raise ValueError(f"num_draft_layers must be in 1..{config.n_layer}, got {num_draft_layers}")
    if not 0.0 < refinement_scale <= 1.0:
        raise ValueError(f"refinement_scale must be in (0, 1], got {refinement_scale}")
    weights = init_gpt2_weights(config, seed)
    for i in range(num_draft_layers, config.n_layer):
        for name in (f"h.{i}.attn.c_proj.weight", f"h.{i}.mlp.c_proj.weight"):
            weights[name] *= np.float32(refinement_scale)  # in place: stays float32
    return ToyTransformer(config, weights)


def paged_greedy_generate(model: ToyTransformer, prompt_token_ids: Sequence[int], max_tokens: int) -> list[int]:
    """The baseline: plain greedy decoding on the paged cache, one forward pass per output token."""
    seq = PagedSequence(model)
    seq.extend(list(prompt_token_ids))
    token = int(np.argmax(seq.run()[-1]))  # prefill the whole prompt
    out = [token]
    while len(out) < max_tokens:
        seq.extend([token])
        token = int(np.argmax(seq.run()[-1]))
        out.append(token)
    return out


def estimate_alpha(out: SpeculativeOutput, k: int) -> float:
    """Per-token acceptance probability alpha from a run's accept counts.

    Not `out.acceptance_rate` (accepted / drafted): drafts after the first rejection of a round
    are thrown away unjudged, so that ratio is (E - 1)/k, not alpha. Under the i.i.d. model behind
    `expected_tokens_per_step`, each round is a run of accepts ended by one rejection (or by
    reaching k), and the maximum-likelihood alpha is accepts / (accepts + rejections).
    """
    rejections = sum(1 for a in out.accepted_per_pass if a < k)
    judged = out.num_accepted + rejections
    return out.num_accepted / judged if judged else 0.0


def _progress(message: str) -> None:
    # Progress goes to stderr, so stdout stays the report that `bench_speculative` returns.
    print(f"  ... {message}", file=sys.stderr, flush=True)


def _forward_call(model: ToyTransformer, batch: int, context_len: int, num_new: int):
    """A callable running one paged forward in which each of `batch` sequences has `context_len`
    tokens cached and processes `num_new` more (1: a decode step; k+1: a verify pass; a prompt
    from position 0: prefill). Re-running overwrites the same slots, so every call does the same
    work."""
    block_size = 16
    per_seq = blocks_needed(context_len + num_new, block_size)
    allocator = BlockAllocator(batch * per_seq, block_size)
    cache = KVCache(model.config, batch * per_seq, block_size)
    rng = np.random.default_rng(0)
    tables = []
    for _ in range(batch):
        table = BlockTable(allocator)
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
    tables = [BlockTable(BlockAllocator(64, 16)) for _ in range(2)]
    for table in tables:
        table.append_tokens(list(range(100)))

    def one_round():
        drafts, q_rows = [], []
        for row in draft_logits:
            q = token_probs(row, 0.0)
            drafts.append(int(rng.choice(len(q), p=q)))
            q_rows.append(q)
        emitted = accept_or_resample(drafts, np.array(q_rows), token_probs(target_logits, 0.0), rng)
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
    """`python solution.py bench speculative`: should we add speculative decoding?

    Prints a progress line per measurement (stderr) and returns the report: the expected-speedup
    table for the measured draft cost, the measured point (alpha from greedy acceptance counts,
    draft cost c, verify cost, the paper's, extended and refined predictions, the measured
    wall-clock speedup of `speculative_generate` over `paged_greedy_generate` at batch 1), and
    the measurements behind "it helps decode, not prefill, and less at large batch".
    All timings are best-of-N of interleaved runs on the paged path, after a warm-up.
    """
    config, m = SPEC_BENCH_CONFIG, SPEC_BENCH_DRAFT_LAYERS
    _progress(f"building the target ({config.n_layer} layers, n_embd {config.n_embd}, vocab "
              f"{config.vocab_size}) and its {m}-layer self-draft")
    target = make_early_exit_target(config, m, SPEC_BENCH_REFINEMENT_SCALE)
    draft = make_self_draft(target, m)
    weight_bytes = sum(w.nbytes for w in target.weights.values())
    dtypes = "/".join(sorted({str(w.dtype) for w in target.weights.values()}))
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, 8).tolist()
    greedy = SamplingParams(max_tokens=num_tokens, temperature=0.0)
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
    spec_out: list[SpeculativeOutput] = []
    plain_out: list[list[int]] = []
    runs = {"plain": lambda: plain_out.append(paged_greedy_generate(target, prompt, num_tokens)),
            "spec": lambda: spec_out.append(speculative_generate(target, draft, prompt, greedy, k=k))}
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
    alpha = estimate_alpha(spec, k)
    extended = {kk: predicted_speedup(alpha, kk, c, verify[kk]) for kk in ks}
    E = expected_tokens_per_step(alpha, k)
    paper = speculative_speedup(alpha, k, c)
    ext = predicted_speedup(alpha, k, c, verify[k])
    # Refined with two measured per-round terms the formula leaves out: after a fully accepted
    # round (probability alpha**k) the draft's next pass covers 2 tokens (its own last draft, never
    # run, and the bonus token); and the sampler/accept/rollback work. Plain decoding pays t1
    # plus an argmax per token.
    refined = E / (k * c + alpha ** k * (c2 - c) + verify[k] + overhead / t1)
    sampled = speculative_generate(target, draft, prompt, SamplingParams(max_tokens=64, temperature=1.0, seed=0), k=k)
    alpha_sampled = estimate_alpha(sampled, k)
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
    pred_b = predicted_speedup(alpha, k, c_b, verify_b)
    _progress(f"batch {B}: decode step {big['t'] * 1e3:.0f} ms, verify pass {big['v'] * 1e3:.0f} ms "
              f"(cost {verify_b:.2f}), draft step {big['d'] * 1e3:.1f} ms")

    within = abs(measured / ext - 1) <= 0.2
    fast = measured > 1.5 and alpha >= 0.7
    head = f"{'k':>3} {'verify cost':>12} {'paper (v=1)':>12} {'extended':>9}"
    return "\n".join([
        format_speculation_table(round(c, 3)),
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
        f"breakeven c at alpha {alpha:.2f}, k = {k}: {breakeven_draft_cost(alpha, k):.3f} if verify cost 1; "
        f"{(E - verify[k]) / k:.3f} with the measured {verify[k]:.2f}",
        "",
        head, "-" * len(head),
        *(f"{kk:>3} {verify[kk]:>12.2f} {speculative_speedup(alpha, kk, c):>12.2f} {extended[kk]:>9.2f}"
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


# =====================================================================================
# 5. Capacity planning: KV blocks, concurrency and QPS for a real GPU; KV waste; the stack
# =====================================================================================
#
# Units. Sizes are bytes (int), bandwidth bytes/s, compute FLOP/s, times seconds.
# Printouts quote sizes in GB = 1e9 bytes (the unit vendors use for bandwidth and
# for the "80 GB" in a product name); device memory comes from what `nvidia-smi`
# reports for the device, in MiB = 2**20 bytes, because that, not the marketing
# figure, is the total an engine such as vLLM multiplies by gpu_memory_utilization.

GB = 10**9
MiB = 2**20


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What a decoder-only model costs to serve: parameters, and the shape of its KV cache.

    `num_kv_heads` is the number of key/value heads: it equals the number of query heads
    (`num_attention_heads`) for multi-head attention and is smaller under grouped-query
    attention (GQA), where each KV head serves `num_attention_heads // num_kv_heads` query
    heads. `max_position_embeddings` is the context the model was trained for (0: unknown).
    """

    name: str
    num_params: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    num_attention_heads: int | None = None
    max_position_embeddings: int = 0

    def __post_init__(self) -> None:
        for field in ("num_params", "num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            check_int(f"ModelSpec {self.name!r}: {field}", getattr(self, field), minimum=1)
        heads = self.num_attention_heads
        if heads is not None and (heads < self.num_kv_heads or heads % self.num_kv_heads):
            raise ValueError(
                f"ModelSpec {self.name!r}: num_attention_heads ({heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}): each KV head serves a whole group of query heads"
            )

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights: every parameter once, at `dtype_bytes` each."""
        return self.num_params * self.dtype_bytes


# Presets. Shapes from each model's Hugging Face config.json (num_hidden_layers,
# num_attention_heads, num_key_value_heads, hidden_size / num_attention_heads = head_dim,
# max_position_embeddings); parameter counts are the safetensors totals the model pages
# show, which equal the count the config implies (test_model_presets_match_their_configs
# recomputes them from vocab, hidden and intermediate sizes).
MODELS: dict[str, ModelSpec] = {
    # huggingface.co/meta-llama/Llama-2-7b-hf config.json: 32 layers, 32 heads, 32 KV heads,
    # hidden 4096 (head_dim 128), 4096 positions; 6,738,415,616 parameters.
    "llama-2-7b": ModelSpec("llama-2-7b", 6_738_415_616, 32, 32, 128,
                            num_attention_heads=32, max_position_embeddings=4096),
    # huggingface.co/meta-llama/Llama-2-13b-hf config.json: 40 layers, 40 heads, 40 KV heads,
    # hidden 5120 (head_dim 128), 4096 positions; 13,015,864,320 parameters.
    "llama-2-13b": ModelSpec("llama-2-13b", 13_015_864_320, 40, 40, 128,
                             num_attention_heads=40, max_position_embeddings=4096),
    # huggingface.co/meta-llama/Llama-2-70b-hf config.json: 80 layers, 64 heads, 8 KV heads
    # (GQA), hidden 8192 (head_dim 128), 4096 positions; 68,976,648,192 parameters.
    "llama-2-70b": ModelSpec("llama-2-70b", 68_976_648_192, 80, 8, 128,
                             num_attention_heads=64, max_position_embeddings=4096),
    # huggingface.co/meta-llama/Meta-Llama-3-8B config.json: 32 layers, 32 heads, 8 KV heads
    # (GQA), hidden 4096 (head_dim 128), 8192 positions; 8,030,261,248 parameters.
    "llama-3-8b": ModelSpec("llama-3-8b", 8_030_261_248, 32, 8, 128,
                            num_attention_heads=32, max_position_embeddings=8192),
    # huggingface.co/mistralai/Mistral-7B-v0.1 config.json: 32 layers, 32 heads, 8 KV heads
    # (GQA), hidden 4096 (head_dim 128), 32768 positions, sliding_window 4096 (ignored here:
    # the planner charges the full context, an upper bound); 7,241,732,096 parameters.
    "mistral-7b": ModelSpec("mistral-7b", 7_241_732_096, 32, 8, 128,
                            num_attention_heads=32, max_position_embeddings=32768),
}


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    """One accelerator: device memory (bytes), peak memory bandwidth (bytes/s), and peak
    dense BF16 tensor-core FLOP/s (no structured sparsity)."""

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    flops: float

    def __post_init__(self) -> None:
        for field in ("memory_bytes", "bandwidth_bytes_per_s", "flops"):
            if not getattr(self, field) > 0:
                raise ValueError(f"GPUSpec {self.name!r}: {field} must be positive, got {getattr(self, field)!r}")


# Presets, SXM parts where there is a choice. memory_bytes = nvidia-smi's memory.total
# (MiB) for the device (as collected in modal-labs/modal-client PR #2797 for A100/H100/L4,
# and nvidia-smi output for H200): e.g. the "80GB" A100 is 81920 MiB = 80 GiB = 85.9 GB.
# Bandwidth and FLOP/s from NVIDIA's datasheets; NVIDIA quotes Hopper and Ada BF16 "with
# sparsity", so the dense figure is half of it.
GPUS: dict[str, GPUSpec] = {
    # A100 datasheet (SXM4 40GB): 40 GB HBM2, 1,555 GB/s, BF16 312 TFLOPS (624 sparse).
    # nvidia-smi: 40960 MiB.
    "a100-40gb": GPUSpec("a100-40gb", 40_960 * MiB, 1_555e9, 312e12),
    # A100 datasheet (SXM4 80GB): 80 GB HBM2e, 2,039 GB/s, BF16 312 TFLOPS (624 sparse).
    # nvidia-smi: 81920 MiB.
    "a100-80gb": GPUSpec("a100-80gb", 81_920 * MiB, 2_039e9, 312e12),
    # H100 datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS with sparsity -> 989
    # dense. nvidia-smi ("NVIDIA H100 80GB HBM3"): 81559 MiB.
    "h100-80gb": GPUSpec("h100-80gb", 81_559 * MiB, 3.35e12, 989e12),
    # H200 datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with sparsity -> 989
    # dense. nvidia-smi ("NVIDIA H200"): 143771 MiB.
    "h200": GPUSpec("h200", 143_771 * MiB, 4.8e12, 989e12),
    # L4 datasheet: 24 GB GDDR6, 300 GB/s, BF16 242 TFLOPS with sparsity -> 121 dense.
    # nvidia-smi: 23034 MiB.
    "l4": GPUSpec("l4", 23_034 * MiB, 300e9, 121e12),
}


def _preset(value, presets: dict, what: str):
    """`value` itself if it is a spec, else the preset of that name; an unknown name lists the known ones."""
    if not isinstance(value, str):
        return value
    if value not in presets:
        raise ValueError(f"unknown {what} {value!r}; known {what}s: {', '.join(presets)}")
    return presets[value]


def get_model(model: ModelSpec | str) -> ModelSpec:
    return _preset(model, MODELS, "model")


def get_gpu(gpu: GPUSpec | str) -> GPUSpec:
    return _preset(gpu, GPUS, "GPU")


def kv_bytes_per_token(model: ModelSpec) -> int:
    """KV-cache bytes one token occupies: a key AND a value vector (the 2) of `head_dim`
    for every KV head in every layer. GQA shrinks it by using num_kv_heads, not query heads."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.dtype_bytes


@dataclasses.dataclass(frozen=True)
class DeploymentPlan:
    """One serving configuration, sized per GPU (a tensor-parallel group of
    `tensor_parallel_size` GPUs holds one copy of the model and one KV cache, each split
    evenly: every GPU holds 1/tp of the weights and 1/tp of the KV heads)."""

    model: ModelSpec
    gpu: GPUSpec
    max_model_len: int
    block_size: int
    gpu_memory_utilization: float
    activation_bytes: int
    tensor_parallel_size: int
    mean_prompt_len: float
    mean_output_len: float
    kv_bytes_per_token_per_gpu: int   # kv_bytes_per_token(model) / tp
    block_bytes_per_gpu: int          # block_size * kv_bytes_per_token_per_gpu
    weight_bytes_per_gpu: float       # num_params * dtype_bytes / tp
    memory_budget_bytes: float        # gpu_memory_utilization * memory_bytes
    num_kv_blocks: int                # physical KV blocks per GPU (same count on every GPU)
    kv_pool_bytes: int                # num_kv_blocks * block_bytes_per_gpu
    num_cache_tokens: int             # num_kv_blocks * block_size
    max_concurrent_seqs: int          # sequences that can all reach max_model_len at once
    ceiling: str                      # "kv-blocks" or "weights": see plan_deployment
    mean_context_len: float           # context charged per sequence in a decode step
    decode_step_s: float              # one decode step of max_concurrent_seqs sequences
    decode_bound: str                 # "memory-bandwidth" or "compute"
    prefill_s: float                  # prefill of one mean prompt
    request_latency_s: float          # mean time a request holds its slot (Little's W)
    qps: float                        # requests/s per tensor-parallel group (Little's law)
    output_tokens_per_s: float        # qps * mean_output_len
    notes: tuple[str, ...] = ()


# The PagedAttention paper's ShareGPT means (see SHAREGPT below), as default traffic.
_DEFAULT_PROMPT_LEN = 161.31
_DEFAULT_OUTPUT_LEN = 337.99


def _check_plan_inputs(model: ModelSpec, max_model_len: int, block_size: int,
                       gpu_memory_utilization: float, activation_bytes: int,
                       tensor_parallel_size: int, mean_prompt_len: float,
                       mean_output_len: float) -> None:
    """plan_deployment's argument checks: a ValueError that names the bad argument."""
    for name, value in (("max_model_len", max_model_len), ("block_size", block_size),
                        ("tensor_parallel_size", tensor_parallel_size)):
        check_int(name, value, minimum=1)
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    if activation_bytes < 0:
        raise ValueError(f"activation_bytes must be >= 0, got {activation_bytes!r}")
    if model.num_kv_heads % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} must divide {model.name}'s "
                         f"{model.num_kv_heads} KV heads: each GPU holds whole KV heads")
    if not (mean_prompt_len > 0 and mean_output_len > 0):
        raise ValueError(f"mean_prompt_len and mean_output_len must be > 0, "
                         f"got {mean_prompt_len!r} and {mean_output_len!r}")
    if mean_prompt_len + mean_output_len > max_model_len:
        raise ValueError(f"mean prompt + output ({mean_prompt_len + mean_output_len:g} tokens) "
                         f"exceeds max_model_len {max_model_len}: the mean request would not fit")


def plan_deployment(
    model: ModelSpec | str,
    gpu: GPUSpec | str,
    max_model_len: int,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    activation_bytes: int = 0,
    tensor_parallel_size: int = 1,
    mean_prompt_len: float = _DEFAULT_PROMPT_LEN,
    mean_output_len: float = _DEFAULT_OUTPUT_LEN,
) -> DeploymentPlan:
    """Size a vLLM-style deployment of `model` on GPUs of type `gpu`, per GPU of a
    tensor-parallel group of `tensor_parallel_size` (tp) GPUs.

    Memory (per GPU). The engine may use `gpu_memory_utilization * memory_bytes`; the weights
    (`num_params * dtype_bytes / tp`) and the activation peak (`activation_bytes`, already
    per GPU) come off first, and what is left is cut into KV blocks of
    `block_bytes_per_gpu = block_size * kv_bytes_per_token(model) / tp` bytes:

        num_kv_blocks = floor((util * memory - weight_bytes / tp - activation_bytes)
                              / (block_bytes / tp))

    The cache holds `num_kv_blocks * block_size` tokens. `max_concurrent_seqs` is how many
    sequences can ALL grow to `max_model_len` at once: a sequence owns whole blocks, so it is
    `num_kv_blocks // blocks_needed(max_model_len, block_size)` (not cache tokens //
    max_model_len, which forgets that a last block is only partly used).
    `ceiling` is "kv-blocks" when the KV pool gets more bytes than the weights: then deleting
    the weights altogether buys fewer blocks than halving the KV bytes per sequence (half the
    context, GQA, an 8-bit KV cache) does; otherwise "weights".

    Time (roofline, peak figures, so lower bounds). A decode step of B = max_concurrent_seqs
    sequences reads the weights once plus every sequence's KV at `mean_context_len =
    mean_prompt_len + mean_output_len / 2` (the context averaged over a request's decode
    steps); it takes max(bytes / bandwidth, 2 * num_params * B / (tp * flops)) and
    `decode_bound` says which term won. Prefilling one mean prompt takes
    `2 * num_params * mean_prompt_len / (tp * flops)` (attention's quadratic FLOPs ignored).
    While a request lives, its slot and the B - 1 others each turn over once on average, so
    the GPU runs B prefills between its decode steps: the request holds its slot for
    `request_latency_s = mean_output_len * decode_step_s + B * prefill_s`, and Little's law
    gives `qps = B / request_latency_s` per tensor-parallel group.

    Raises ValueError for a non-positive length or block size, a utilisation outside (0, 1],
    a negative activation reserve, tp < 1 or tp not dividing the KV heads, traffic whose mean
    prompt + output exceeds `max_model_len`, weights (plus activations) that do not fit the
    budget (saying by how many GB), and a cache too small for one `max_model_len` sequence.
    `model` and `gpu` may be presets' names.
    """
    raise NotImplementedError("Exercise 8: plan_deployment")


# The curriculum's sizing scenario: "a 13B model, 80 GB GPU, 8k context".
SEED_SIZING = {"model": "llama-2-13b", "gpu": "a100-80gb", "max_model_len": 8192}


def format_plan(plan: DeploymentPlan) -> str:
    """A design-review printout of `plan`: the memory split, the concurrency and the QPS, and
    the evidence for which consumer sets the concurrency ceiling (re-planned variants: zero
    weights, half the context, the mean request's length, an 8-KV-head GQA twin)."""
    m, g, tp = plan.model, plan.gpu, plan.tensor_parallel_size
    per_seq = blocks_needed(plan.max_model_len, plan.block_size)

    def variant(**changes) -> DeploymentPlan:
        args = dict(model=m, gpu=g, max_model_len=plan.max_model_len, block_size=plan.block_size,
                    gpu_memory_utilization=plan.gpu_memory_utilization,
                    activation_bytes=plan.activation_bytes, tensor_parallel_size=tp,
                    mean_prompt_len=plan.mean_prompt_len, mean_output_len=plan.mean_output_len)
        args.update(changes)
        return plan_deployment(**args)

    def pct(part: float) -> str:
        return f"{100 * part / plan.memory_budget_bytes:.0f}%"

    gpus = f"{tp} x {g.name}" if tp > 1 else g.name
    lines = [
        f"Sizing {m.name} on {gpus}, max_model_len {plan.max_model_len}, block_size "
        f"{plan.block_size}, gpu_memory_utilization {plan.gpu_memory_utilization:g}",
        f"  per GPU: memory {g.memory_bytes / GB:.2f} GB ({g.memory_bytes // MiB} MiB, nvidia-smi) "
        f"-> budget {plan.memory_budget_bytes / GB:.2f} GB",
        f"  weights      {plan.weight_bytes_per_gpu / GB:7.2f} GB  ({pct(plan.weight_bytes_per_gpu)} of budget)",
        f"  activations  {plan.activation_bytes / GB:7.2f} GB  (reserve; vLLM measures the peak "
        f"with a profiling run at start-up)",
        f"  KV pool      {plan.kv_pool_bytes / GB:7.2f} GB  ({pct(plan.kv_pool_bytes)}): "
        f"{plan.num_kv_blocks} blocks x {plan.block_bytes_per_gpu / 2**20:g} MiB "
        f"= {plan.num_cache_tokens} tokens",
        f"  KV per token {kv_bytes_per_token(m) / 2**10:g} KiB = 2 (K,V) x {m.num_layers} layers x "
        f"{m.num_kv_heads} KV heads x {m.head_dim} x {m.dtype_bytes} B"
        + (f", / tp {tp} = {plan.kv_bytes_per_token_per_gpu / 2**10:g} KiB per GPU" if tp > 1 else ""),
        f"  max concurrent sequences at {plan.max_model_len} tokens: {plan.num_kv_blocks} // "
        f"{per_seq} blocks = {plan.max_concurrent_seqs}",
        f"  decode step {plan.decode_step_s * 1e3:.1f} ms ({plan.decode_bound}-bound; context "
        f"charged {plan.mean_context_len:.0f} tokens), prefill {plan.prefill_s * 1e3:.1f} ms per "
        f"{plan.mean_prompt_len:g}-token prompt",
        f"  QPS (Little's law) = {plan.max_concurrent_seqs} / {plan.request_latency_s:.2f} s = "
        f"{plan.qps:.2f} requests/s, {plan.output_tokens_per_s:.0f} output tokens/s"
        + (f" per {tp}-GPU group" if tp > 1 else " per GPU"),
    ]
    lines += [f"  note: {note}" for note in plan.notes]

    no_weights = variant(model=dataclasses.replace(m, num_params=1))
    evidence = [f"deleting the weights altogether -> {no_weights.max_concurrent_seqs}"]
    if plan.max_model_len >= 2 * plan.block_size:
        half = variant(max_model_len=plan.max_model_len // 2,
                       mean_prompt_len=min(plan.mean_prompt_len, plan.max_model_len // 4),
                       mean_output_len=min(plan.mean_output_len, plan.max_model_len // 4))
        evidence.append(f"half the context ({plan.max_model_len // 2}) -> {half.max_concurrent_seqs}")
    if m.num_kv_heads > 8 and m.num_kv_heads % 8 == 0 and 8 % tp == 0:
        gqa = variant(model=dataclasses.replace(m, name=m.name + "-gqa8", num_kv_heads=8))
        evidence.append(f"a GQA twin with 8 KV heads -> {gqa.max_concurrent_seqs}")
    mean_len = math.ceil(plan.mean_prompt_len + plan.mean_output_len)
    typical = variant(max_model_len=mean_len)
    if plan.ceiling == "kv-blocks":
        lines.append(
            f"  The KV blocks, not the weights, set the ceiling: the weights take "
            f"{plan.weight_bytes_per_gpu / GB:.1f} GB and fit with {plan.kv_pool_bytes / GB:.1f} GB "
            f"to spare, yet each {plan.max_model_len}-token sequence needs {per_seq} blocks "
            f"({per_seq * plan.block_bytes_per_gpu / GB:.2f} GB), so only "
            f"{plan.max_concurrent_seqs} fit.")
    else:
        lines.append(
            f"  The weights set the ceiling here: they take {plan.weight_bytes_per_gpu / GB:.1f} GB "
            f"and leave the KV pool only {plan.kv_pool_bytes / GB:.1f} GB "
            f"({plan.max_concurrent_seqs} sequences); quantise the weights or raise tp.")
    lines.append(f"  Concurrency instead of {plan.max_concurrent_seqs}: " + "; ".join(evidence) + ".")
    lines.append(
        f"  Paging allocates blocks as tokens arrive: a mean request ({mean_len} tokens, "
        f"{blocks_needed(mean_len, plan.block_size)} blocks) leaves room for "
        f"{typical.max_concurrent_seqs} at once ({typical.qps:.1f} QPS); "
        f"{plan.max_concurrent_seqs} is the guarantee if every request grows to {plan.max_model_len}.")
    return "\n".join(lines)


# --- KV memory waste: a max_len slab per request vs paged blocks ------------------------


@dataclasses.dataclass(frozen=True)
class LengthStats:
    """Mean request lengths a paper reports for a trace, and where."""

    name: str
    mean_prompt_len: float
    mean_output_len: float
    source: str


# Kwon et al., "Efficient Memory Management for Large Language Model Serving with
# PagedAttention", SOSP 2023, Fig. 11 (input/output length distributions, means in its
# legends) and §6.1: "the ShareGPT dataset has 8.4x longer input prompts and 5.8x longer
# outputs than the Alpaca dataset" (161.31 / 19.31 = 8.4, 337.99 / 58.45 = 5.8).
SHAREGPT = LengthStats("ShareGPT", 161.31, 337.99, "Kwon et al. SOSP'23, Fig. 11a")
ALPACA = LengthStats("Alpaca", 19.31, 58.45, "Kwon et al. SOSP'23, Fig. 11b")
# The same paper, Fig. 2: existing systems keep 20.4%-38.2% of KV memory holding token
# states (Orca Max / Pow2 / Oracle); vLLM 96.3%.

# ASSUMPTION, not from the paper: lengths are lognormal with this shape (right-skewed with
# a long tail, like Fig. 11's histograms), its location set so the mean matches the paper.
LENGTH_SIGMA = 1.0


def sample_request_lengths(stats: LengthStats, num_requests: int, seed: int = 0,
                           max_model_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_lens, output_lens), int64 arrays of `num_requests` lengths >= 1, drawn
    independently from lognormals (sigma LENGTH_SIGMA) whose means are the reported ones.
    Deterministic for a seed. With `max_model_len`, a request longer than it is truncated
    (prompt first kept, output cut) as the paper truncates ShareGPT to the model's context."""
    check_int("num_requests", num_requests, minimum=1)
    rng = np.random.default_rng(seed)

    def draw(mean: float) -> np.ndarray:
        mu = math.log(mean) - LENGTH_SIGMA**2 / 2  # E[lognormal] = exp(mu + sigma^2 / 2)
        return np.maximum(1, np.rint(rng.lognormal(mu, LENGTH_SIGMA, num_requests))).astype(np.int64)

    prompts, outputs = draw(stats.mean_prompt_len), draw(stats.mean_output_len)
    if max_model_len is not None:
        check_int("max_model_len", max_model_len, minimum=1)
        if max_model_len < 2:
            raise ValueError(f"max_model_len must leave room for a prompt and an output token, got {max_model_len}")
        prompts = np.minimum(prompts, max_model_len - 1)
        outputs = np.minimum(outputs, max_model_len - prompts)
    return prompts, outputs


class KVUtilization(NamedTuple):
    """Fraction of reserved KV memory that holds real tokens, under each allocation policy."""

    slab: float
    paged: float


def kv_memory_utilization(lengths, max_model_len: int, block_size: int) -> KVUtilization:
    """Tokens held / token slots reserved, for sequences of `lengths` tokens each:
    (a) `slab`: the naive allocator reserves a contiguous `max_model_len` slab per request up
    front; (b) `paged`: PagedAttention reserves `blocks_needed(length, block_size)` whole
    blocks, so each sequence wastes fewer than `block_size` slots, all in its last block.
    Every length must be in 1..max_model_len (a slab cannot hold more)."""
    check_int("max_model_len", max_model_len, minimum=1)
    check_int("block_size", block_size, minimum=1)
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or lengths.size == 0 or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be a non-empty 1-D sequence of ints, got {lengths!r}")
    if lengths.min() < 1 or lengths.max() > max_model_len:
        raise ValueError(f"every length must be in 1..max_model_len={max_model_len}, "
                         f"got {lengths.min()}..{lengths.max()}")
    held = int(lengths.sum())
    paged_slots = int((-(-lengths // block_size)).sum()) * block_size  # ceil: whole blocks
    return KVUtilization(slab=held / (lengths.size * max_model_len), paged=held / paged_slots)


def format_waste(max_model_len: int = 2048, block_size: int = 16,
                 num_requests: int = 10_000, seed: int = 0) -> str:
    """KV memory utilisation for ShareGPT- and Alpaca-like traffic (sample_request_lengths),
    each request at its final length, under a max_len slab vs paged blocks."""
    lines = [f"KV memory holding real tokens, {num_requests} requests per trace, "
             f"max_model_len {max_model_len}, block_size {block_size}",
             f"  (lengths: lognormal, sigma {LENGTH_SIGMA:g}, matched to the means Kwon et al. "
             f"SOSP'23 report; each request at its final length)",
             f"  {'trace':<9} {'paper means (in/out)':>21} {'sample mean':>12} {'slab':>7} {'paged':>7}"]
    for stats in (SHAREGPT, ALPACA):
        prompts, outputs = sample_request_lengths(stats, num_requests, seed, max_model_len)
        total = prompts + outputs
        util = kv_memory_utilization(total, max_model_len, block_size)
        means = f"{stats.mean_prompt_len:g} / {stats.mean_output_len:g}"
        lines.append(f"  {stats.name:<9} {means:>21} {total.mean():12.1f} "
                     f"{100 * util.slab:6.1f}% {100 * util.paged:6.1f}%")
    lines.append("  A slab is sized for the longest request and a request is mostly far shorter; paging "
                 f"wastes under one block ({block_size} slots) per sequence, which short requests feel most.")
    lines.append("  The paper measured 20.4%-38.2% for Orca's slab variants and 96.3% for vLLM (its Fig. 2).")
    return "\n".join(lines)


# --- the stack choice: vLLM vs TensorRT-LLM vs SGLang, as data ---------------------------


@dataclasses.dataclass(frozen=True)
class ServingStack:
    """What a serving stack runs on and what it is built to be best at. All three do
    continuous batching, a paged KV cache, prefix caching and speculative decoding; what
    separates them is hardware reach and design centre."""

    name: str
    hardware: frozenset
    design_center: str
    prefix_reuse: str
    setup: str
    source: str


STACKS: dict[str, ServingStack] = {
    "vllm": ServingStack(
        name="vLLM",
        # docs.vllm.ai Installation: NVIDIA CUDA, AMD ROCm, Intel XPU, CPU (x86, ARM, Apple
        # silicon, IBM Z), Google TPU, Intel Gaudi, AWS Neuron; Ascend via the vllm-ascend plugin.
        hardware=frozenset({"nvidia", "amd", "intel", "tpu", "cpu", "aws-neuron", "ascend"}),
        design_center="throughput on open-weights models: PagedAttention, continuous batching, "
                      "the widest model and hardware coverage",
        prefix_reuse="automatic prefix caching (hash of each full block)",
        setup="pip install; loads a Hugging Face checkpoint directly",
        source="Kwon et al. SOSP'23; docs.vllm.ai getting_started/installation"),
    "tensorrt-llm": ServingStack(
        name="TensorRT-LLM",
        # NVIDIA/TensorRT-LLM README: "inference efficiently on NVIDIA GPUs".
        hardware=frozenset({"nvidia"}),
        design_center="lowest latency on NVIDIA GPUs: NVIDIA's own kernels and low-precision "
                      "(FP8/FP4) paths tuned per GPU generation",
        prefix_reuse="KV cache block reuse",
        # nvidia.github.io/TensorRT-LLM: the classic path builds a TensorRT engine per model,
        # GPU and max shapes (trtllm-build); the PyTorch backend (0.17+) loads HF checkpoints,
        # and the newest releases remove the engine backend.
        setup="NVIDIA containers; classic path compiles an engine per GPU and max shapes, "
              "newer releases load HF checkpoints via a PyTorch backend",
        source="nvidia.github.io/TensorRT-LLM (torch.html, legacy/tensorrt-backend-removal)"),
    "sglang": ServingStack(
        name="SGLang",
        # docs.sglang.io Hardware Platforms: NVIDIA GPUs, AMD GPUs, Ascend NPUs, CPU servers,
        # TPU, Intel XPU.
        hardware=frozenset({"nvidia", "amd", "ascend", "cpu", "tpu", "intel"}),
        design_center="prefix-heavy and structured workloads: RadixAttention keeps shared "
                      "prefixes' KV in a radix tree across requests; compressed-FSM constrained decoding",
        prefix_reuse="RadixAttention (radix tree over token prefixes, LRU eviction)",
        setup="pip install; loads a Hugging Face checkpoint directly",
        source="Zheng et al., SGLang (NeurIPS 2024); docs.sglang.io"),
}


class StackChoice(NamedTuple):
    stack: str                # a key of STACKS
    deciding_constraint: str  # the constraint that settled it, in a sentence


def choose_stack(hardware: str = "nvidia", priority: str = "throughput",
                 prefix_sharing: bool = False, structured_output: bool = False) -> StackChoice:
    """Pick a stack from STACKS for a workload. Rules, in order:
    1. hardware filters (TensorRT-LLM runs on NVIDIA only);
    2. heavy prefix sharing or constrained (JSON/regex) output -> SGLang, if it runs there;
    3. priority "latency" -> TensorRT-LLM, if the fleet is NVIDIA;
    4. otherwise vLLM. The deciding constraint is the rule that fired, or the hardware when
    it ruled out the stack the priority asked for."""
    if priority not in ("throughput", "latency"):
        raise ValueError(f"priority must be 'throughput' or 'latency', got {priority!r}")
    known = set().union(*(s.hardware for s in STACKS.values()))
    if hardware not in known:
        raise ValueError(f"unknown hardware {hardware!r}; known: {', '.join(sorted(known))}")
    runs = {key for key, stack in STACKS.items() if hardware in stack.hardware}
    if (prefix_sharing or structured_output) and "sglang" in runs:
        why = ("heavy prefix sharing: RadixAttention reuses the shared prefixes' KV across requests"
               if prefix_sharing else "constrained output: compressed-FSM decoding for JSON/regex")
        return StackChoice("sglang", why)
    if priority == "latency":
        if "tensorrt-llm" in runs:
            return StackChoice("tensorrt-llm", "lowest latency on an NVIDIA-only fleet")
        return StackChoice("vllm", f"hardware: {hardware} rules out TensorRT-LLM (NVIDIA-only)")
    return StackChoice("vllm", "throughput on open weights, with the broadest model and hardware support")


# Example workloads for the design review: (description, choose_stack keyword arguments).
STACK_WORKLOADS = (
    ("batch summarisation with an open-weights Llama on A100s, throughput first",
     {"hardware": "nvidia", "priority": "throughput"}),
    ("voice assistant on H100s, tight per-token latency SLO, short distinct prompts",
     {"hardware": "nvidia", "priority": "latency"}),
    ("agent with a 4k-token shared system prompt and tools, JSON replies, on H100s",
     {"hardware": "nvidia", "priority": "latency", "prefix_sharing": True, "structured_output": True}),
    ("chat endpoint on AMD MI300X, latency first",
     {"hardware": "amd", "priority": "latency"}),
)


def format_stack_choice(workloads=STACK_WORKLOADS) -> str:
    """The stacks as a table, then each workload with the chosen stack and deciding constraint."""
    lines = ["Serving stacks (all three do continuous batching - TensorRT-LLM calls it in-flight "
             "batching -, a paged KV cache, prefix caching and speculative decoding)"]
    for stack in STACKS.values():
        lines.append(f"  {stack.name:<13} runs on {', '.join(sorted(stack.hardware))}")
        lines.append(f"  {'':<13} best at: {stack.design_center}")
        lines.append(f"  {'':<13} prefix reuse: {stack.prefix_reuse}; setup: {stack.setup}")
    lines.append("Workloads:")
    for description, constraints in workloads:
        choice = choose_stack(**constraints)
        lines.append(f"  {description}\n    -> {STACKS[choice.stack].name}: {choice.deciding_constraint}")
    return "\n".join(lines)


# =====================================================================================
# 6. The command line
# =====================================================================================

EXERCISES = {
    1: "blocks and the allocator: blocks_needed, BlockAllocator",
    2: "the block table: BlockTable.append_tokens / fork / truncate / slots / free",
    3: "prefix caching: hash_block, lookup / register, allocate_prompt",
    4: "paged attention: paged_attention",
    5: "continuous batching: Scheduler.schedule",
    6: "speculative sampling: residual_distribution, accept_or_resample",
    7: "speculative generation: speculative_generate",
    8: "capacity planning: plan_deployment",
}


def unsolved_exercises(module_name: str | None = None) -> dict[int, list[str]]:
    """Exercise number -> the functions still stubbed in a module's source (empty when all are done)."""
    source = inspect.getsource(sys.modules[module_name or __name__])
    stubs: dict[int, list[str]] = {}
    for number, name in re.findall(r'raise NotImplementedError\("Exercise (\d+): ([\w.]+)"\)', source):
        stubs.setdefault(int(number), []).append(name)
    return stubs


def status_report() -> str:
    """Which exercises this file still stubs (`python lab.py status`)."""
    stubs = unsolved_exercises()
    lines = [f"{os.path.basename(sys.modules[__name__].__file__)}: the inference-serving lab"]
    for number, title in EXERCISES.items():
        state = "to do: " + ", ".join(stubs[number]) if number in stubs else "done"
        lines.append(f"  Exercise {number}  {title:<75} {state}")
    return "\n".join(lines)


def scenario_size(model: str = "llama-2-13b", gpu: str = "a100-80gb", max_model_len: int = 8192,
                  block_size: int = 16, gpu_memory_utilization: float = 0.9, activation_gb: float = 0.0,
                  tensor_parallel_size: int = 1, prompt_len: float | None = None,
                  output_len: float | None = None) -> str:
    """Size a vLLM deployment (by default the curriculum's: a 13B model on an 80 GB GPU at 8k context),
    then the KV waste a paged cache removes."""
    lengths = {k: v for k, v in (("mean_prompt_len", prompt_len), ("mean_output_len", output_len)) if v is not None}
    plan = plan_deployment(model, gpu, max_model_len, block_size=block_size,
                           gpu_memory_utilization=gpu_memory_utilization,
                           activation_bytes=int(activation_gb * GB), tensor_parallel_size=tensor_parallel_size,
                           **lengths)
    return format_plan(plan) + "\n\n" + format_waste(block_size=block_size)


def scenario_speculate(alpha: float | None = None, k: int | None = None, c: float = 0.05) -> str:
    """Decide whether to add speculative decoding: the speedup table for a draft of cost c, and
    the verdict for one (alpha, k) when given."""
    text = format_speculation_table(c)
    if alpha is not None:
        ks = [k] if k is not None else list(range(1, 9))
        best = max(ks, key=lambda kk: speculative_speedup(alpha, kk, c))
        speedup = speculative_speedup(alpha, best, c)
        text += (f"\n\nYour draft: alpha {alpha:g}, c {c:g}, k {best}: expected "
                 f"{expected_tokens_per_step(alpha, best):.2f} tokens per target pass, speedup {speedup:.2f}x "
                 f"({'worth adding' if speedup > 1 else 'not worth it'}); breakeven draft cost at this alpha and k: "
                 f"c = {breakeven_draft_cost(alpha, best):.3f}.")
    return text


def scenario_stack(hardware: str | None = None, priority: str = "throughput", prefix_sharing: bool = False,
                   structured_output: bool = False) -> str:
    """Pick a stack: the example workloads, and the answer for yours when a hardware is given."""
    text = format_stack_choice()
    if hardware is not None:
        choice = choose_stack(hardware=hardware, priority=priority, prefix_sharing=prefix_sharing,
                              structured_output=structured_output)
        text += f"\n\nYour workload: {choice.stack}, decided by: {choice.deciding_constraint}"
    return text


# Each benchmark prints its lines as it measures them (progress, on a slow machine).
BENCHMARKS = {
    "attention": lambda: bench_attention(log=print),
    "decode": lambda: bench_decode(log=print),
    "batching": lambda: print(bench_batching()),
    "speculative": lambda: print(bench_speculative()),
}


def run_all_scenarios() -> tuple[str, list[str]]:
    """The four design-review scenarios in order, and the stubs any of them hit (in lab.py a
    scenario whose exercise is not written yet says so and the others still run)."""
    sections = [
        ("1. Size a vLLM deployment", scenario_size),
        ("2. Defend continuous batching", scenario_batching),
        ("3. Decide whether to add speculative decoding", scenario_speculate),
        ("4. Pick a stack", scenario_stack),
    ]
    bar = "=" * 100
    texts, stubs = [], []
    for title, make in sections:
        try:
            body = make()
        except NotImplementedError as exc:
            stubs.append(str(exc))
            body = f"(not yet: {exc} is still a stub)"
        texts.append(f"{bar}\n{title}\n{bar}\n{body}")
    return "\n\n".join(texts), stubs


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `solution.py size: error: ...`, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(kind, allow_zero: bool = False):
    """An argparse type: a finite number > 0 (>= 0 with allow_zero); inf and nan are refused."""
    def parse(text: str):
        value = kind(text)
        if not (0 <= value if allow_zero else 0 < value) or not value < math.inf:
            raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if allow_zero else '>'} 0, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="The design-review scenarios of the inference-serving lab. "
                                            "With no command: all four scenarios in order.")
    commands = parser.add_subparsers(dest="command", parser_class=_Parser)
    size = commands.add_parser("size", help="size a deployment: KV blocks, concurrency, QPS, KV waste")
    # choices: an unknown name is a usage error that lists the known ones, before any exercise runs.
    size.add_argument("--model", default="llama-2-13b", choices=list(MODELS))
    size.add_argument("--gpu", default="a100-80gb", choices=list(GPUS))
    size.add_argument("--max-model-len", type=_positive(int), default=8192)
    size.add_argument("--block-size", type=_positive(int), default=16)
    size.add_argument("--gpu-memory-utilization", type=_positive(float), default=0.9)
    size.add_argument("--activation-gb", type=_positive(float, allow_zero=True), default=0.0,
                      help="per-GPU activation reserve, GB")
    size.add_argument("--tp", type=_positive(int), default=1, help="tensor-parallel GPUs")
    size.add_argument("--prompt-len", type=_positive(float), help="mean prompt tokens (default: ShareGPT)")
    size.add_argument("--output-len", type=_positive(float), help="mean output tokens (default: ShareGPT)")
    batching = commands.add_parser("batching", help="static vs continuous batching: a skewed workload, then a stream")
    batching.add_argument("--slots", type=_positive(int), default=16)
    batching.add_argument("--long", type=_positive(int), default=2000, help="tokens of the long answer")
    batching.add_argument("--short", type=_positive(int), default=50, help="tokens of each short answer")
    batching.add_argument("--num-short", type=_positive(int), default=63)
    speculate = commands.add_parser("speculate", help="expected speedup of speculative decoding")
    speculate.add_argument("--alpha", type=float, help="acceptance rate of your draft, 0..1")
    speculate.add_argument("--k", type=_positive(int), help="draft tokens per step (default: the best)")
    speculate.add_argument("--c", type=_positive(float, allow_zero=True), default=0.05,
                           help="draft step cost / target step cost")
    stack = commands.add_parser("stack", help="vLLM vs TensorRT-LLM vs SGLang")
    stack.add_argument("--hardware", help="the fleet, e.g. nvidia, amd")
    stack.add_argument("--priority", choices=("throughput", "latency"), default="throughput")
    stack.add_argument("--prefix-sharing", action="store_true", help="heavy shared prefixes")
    stack.add_argument("--structured-output", action="store_true", help="JSON / regex constrained output")
    bench = commands.add_parser("bench", help="measure on this machine, side by side")
    bench.add_argument("which", nargs="?", choices=(*BENCHMARKS, "all"), default="all")
    commands.add_parser("status", help="which exercises are done")
    return parser


def main(argv: list[str] | None = None) -> int:
    prog = os.path.basename(sys.modules[__name__].__file__)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        if args.command is None:
            text, stubs = run_all_scenarios()
            print(text)
            if stubs:
                raise NotImplementedError(stubs[0])
        elif args.command == "size":
            print(scenario_size(args.model, args.gpu, args.max_model_len, args.block_size,
                                args.gpu_memory_utilization, args.activation_gb, args.tp, args.prompt_len,
                                args.output_len))
        elif args.command == "batching":
            print(scenario_batching(args.slots, args.long, args.short, args.num_short))
        elif args.command == "speculate":
            print(scenario_speculate(args.alpha, args.k, args.c))
        elif args.command == "stack":
            print(scenario_stack(args.hardware, args.priority, args.prefix_sharing, args.structured_output))
        elif args.command == "bench":
            for name in BENCHMARKS if args.which == "all" else [args.which]:
                BENCHMARKS[name]()
        else:
            print(status_report())
    except ValueError as exc:
        parser.exit(2, f"{prog} {args.command or ''}: error: {exc}\n".replace("  ", " "))
    except NotImplementedError as exc:
        parser.exit(1, f"{prog}: {exc} is still a stub: write it (see `python {prog} status`)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
