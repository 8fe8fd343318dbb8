"""Inference-serving internals: the three mechanisms behind vLLM, TensorRT-LLM and SGLang,
on a NumPy GPT-2.

Reading map of solution.py (its line numbers; lab.py's differ). Sections 1-5 are the chapter:
2000 lines, a day's reading at 300-400 lines an hour (the exercises' own code, an afternoon).
Stop at section 6; the rest stands beside it.

   section                                     lines        what it holds
   1. Paged KV-cache (PagedAttention)          53-459       blocks, allocator, block tables, prefix cache (Ex. 1-3)
   2. The model and the paged attention path   460-887      a GPT-2 that reads its past through block tables (Ex. 4)
   3. Continuous batching                      888-1469     requests, the scheduler, the engine (Ex. 5)
   4. Speculative decoding                     1470-1755    accept/resample, draft -> verify (Ex. 6-7)
   5. Capacity planning                        1756-2000    KV blocks, concurrency, QPS on a real GPU (Ex. 8)
   ---- the reading path ends here ----
   6. Argument checks                          2001-2288    provided: the exercises start from checked arguments
   7. Beside the path                          2289-2790    int8 K/V arithmetic, static baseline, simulator, presets
   8. Serving over HTTP                        2791-3676    an OpenAI-compatible endpoint and a load generator
   9. The design-review scenarios              3677-4246    what `python solution.py` prints
  10. The command line                         4247-4424    `python solution.py --help`

The benchmarks live in tools/bench.py (`python solution.py bench` runs it). `lab.py` is
generated from this file by `tools/make_lab.py`: every region between
`# BEGIN SOLUTION: Exercise N` and `# END SOLUTION` becomes a stub for the student to write.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import dataclasses
import enum
import hashlib
import http.client
import inspect
import itertools
import json
import math
import numbers
import os
import re
import subprocess
import sys
import threading
import time
import urllib.parse
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


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens: 0 for 0, 1 for 1..block_size, 2 for block_size+1...

    This is THE boundary rule of the paged cache; every other place asks it instead of
    doing its own arithmetic. A new block is needed only when token `block_size` (0-based)
    arrives, never when the last block has just been filled. (Arguments are checked before
    your code runs: two ints, num_tokens >= 0, block_size >= 1.)
    """
    num_tokens, block_size = check_int("num_tokens", num_tokens, 0), check_int("block_size", block_size, 1)
    # BEGIN SOLUTION: Exercise 1
    return (num_tokens + block_size - 1) // block_size
    # END SOLUTION


def hash_block(parent_hash: int | None, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
    """Content hash of one FULL block, chained on the hash of the block before it.

    Chaining makes the hash name the whole prefix, not just this block's tokens: two
    blocks with the same tokens after different prefixes hold different K/V (attention
    saw different pasts), so they must never be confused. `cache_salt` (a table passes its
    own with every block) keeps the prefixes of requests with different salts apart:
    tenants that must not share cached K/V never do.

    Required: the same int in every process (so not Python's `hash`, which is salted per
    process for str and bytes, and before Python 3.12 depends on the address of None) and
    collision-resistant (a collision would hand one request another's K/V). SHA-256 over a
    canonical encoding of (parent_hash, cache_salt, token ids) has both.
    """
    # BEGIN SOLUTION: Exercise 3
    # repr of a tuple of ints, None and str is canonical: one text per value, in every process.
    key = repr((parent_hash, cache_salt, tuple(int(t) for t in token_ids))).encode()
    return int.from_bytes(hashlib.sha256(key).digest(), "big")
    # END SOLUTION


def chained_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """The chained hashes of every FULL block of `token_ids`, in order."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[start : start + block_size], cache_salt))
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
        # BEGIN SOLUTION: Exercise 1
        return len(self._free) + len(self._evictable)
        # END SOLUTION

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
        # BEGIN SOLUTION: Exercise 1
        if self._free:
            block_id, _ = self._free.popitem(last=False)
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._evict(block_id)
        else:
            raise OutOfBlocksError(f"all {self.num_blocks} KV blocks are in use")
        self._ref_counts[block_id] = 1
        return block_id
        # END SOLUTION

    def incref(self, block_id: int) -> None:
        """Share a block that is in use: one more table holds it. (Checked before your code:
        an id that is not an int in range, or a free block, raises and changes nothing.)"""
        block_id = self._checked_id(block_id, in_use="only a block in use can be shared")
        # BEGIN SOLUTION: Exercise 1
        self._ref_counts[block_id] += 1
        # END SOLUTION

    def free(self, block_id: int) -> None:
        """Drop one reference; at zero the block goes to the back of its queue: `_evictable`
        if the prefix cache holds its hash, else `_free`. (Checked before your code: an id
        that is not an int in range, or a block with no reference left, i.e. a double free,
        raises and changes nothing.)"""
        block_id = self._checked_id(block_id, in_use="it has no reference left (double free)")
        # BEGIN SOLUTION: Exercise 1
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            queue = self._evictable if block_id in self._block_hash else self._free
            queue[block_id] = None
        # END SOLUTION

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
        # BEGIN SOLUTION: Exercise 3
        if not self.enable_prefix_caching:
            return None
        self.stats.queries += 1
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        self.stats.hits += 1
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1
        return block_id
        # END SOLUTION

    def register(self, block_id: int, block_hash: int) -> None:
        """Make a full block, in use and with its K/V written, findable under its chained hash
        (no-op when caching is off).

        If another block already holds the same prefix, the first one stays the cached copy,
        and a block registered once keeps its first hash. (Checked before your code: a free
        block is a ValueError, since nothing written can be in it.)
        """
        block_id = self._checked_id(block_id, in_use="only a block in use, with its K/V written, can be registered")
        # BEGIN SOLUTION: Exercise 3
        if not self.enable_prefix_caching or block_hash in self._cached or block_id in self._block_hash:
            return
        self._cached[block_hash] = block_id
        self._block_hash[block_id] = block_hash
        # END SOLUTION

    def _evict(self, block_id: int) -> None:
        """Forget a cached block's hash (and count the eviction): it is about to hold other tokens."""
        # BEGIN SOLUTION: Exercise 3
        del self._cached[self._block_hash.pop(block_id)]
        self.stats.evictions += 1
        # END SOLUTION


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
    `cache_salt` goes into every block's hash (see `hash_block`).
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
        # BEGIN SOLUTION: Exercise 2
        if not token_ids:
            return []
        block_size = self.block_size
        # The last block receives new tokens only if it has room (num_tokens % block_size != 0).
        cow = self.num_tokens % block_size != 0 and self._is_shared(self.block_ids[-1])
        new_blocks = blocks_needed(self.num_tokens + len(token_ids), block_size) - len(self.block_ids)
        if cow + new_blocks > self.allocator.num_free_blocks:
            raise OutOfBlocksError(
                f"appending {len(token_ids)} tokens needs {cow + new_blocks} free blocks, "
                f"{self.allocator.num_free_blocks} left"
            )
        copies = []
        if cow:
            src = self.block_ids[-1]
            dst = self.allocator.allocate()
            self.allocator.free(src)
            self.block_ids[-1] = dst
            copies.append((src, dst))
        self.block_ids.extend(self.allocator.allocate() for _ in range(new_blocks))
        self.token_ids.extend(token_ids)
        return copies
        # END SOLUTION

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
        # BEGIN SOLUTION: Exercise 3
        block_size = self.block_size
        hashes = chained_block_hashes(token_ids, block_size, self.cache_salt)
        # Ask first: which cached blocks can be reused, and can the rest be allocated? A hit
        # on an evictable block takes it out of the free pool too.
        run = self.allocator.cached_prefix(hashes, len(token_ids))
        missing = blocks_needed(len(token_ids), block_size) - len(run)
        revived = sum(self.allocator.ref_count(b) == 0 for b in run)
        if missing + revived > self.allocator.num_free_blocks:
            raise OutOfBlocksError(f"a prompt of {len(token_ids)} tokens needs {missing + revived} free blocks, "
                                   f"{self.allocator.num_free_blocks} left")
        # Then act. The lookup of the first full block after the run is a miss, and counted as a
        # query; when the run was cut because it covered the prompt, that block is not asked for.
        hits = [self.allocator.lookup(h) for h in hashes[: len(run)]]
        if len(run) < len(hashes) and self.allocator.get_cached_block(hashes[len(run)]) is None:
            self.allocator.lookup(hashes[len(run)])
        self.block_ids = hits + [self.allocator.allocate() for _ in range(missing)]
        self.token_ids = token_ids
        self._block_hashes = hashes[: len(run)]
        return len(run) * block_size
        # END SOLUTION

    def cache_full_blocks(self, num_computed_tokens: int) -> None:
        """Register (prefix caching only) every full block among the first `num_computed_tokens`
        tokens that has no hash yet: their K/V is now written. Blocks are registered in order,
        under their chained hashes (`hash_block(parent, tokens, self.cache_salt)`),
        and `_block_hashes` grows with them. Call it after the forward pass that computed them.
        (Checked before your code: an int in 0..num_tokens.)"""
        check_int("num_computed_tokens", num_computed_tokens, 0)
        if num_computed_tokens > self.num_tokens:
            raise ValueError(f"num_computed_tokens = {num_computed_tokens} but the table holds {self.num_tokens}")
        # BEGIN SOLUTION: Exercise 3
        if not self.allocator.enable_prefix_caching:
            return
        block_size = self.block_size
        for i in range(len(self._block_hashes), num_computed_tokens // block_size):
            parent = self._block_hashes[-1] if self._block_hashes else None
            block_hash = hash_block(parent, self.token_ids[i * block_size : (i + 1) * block_size], self.cache_salt)
            self._block_hashes.append(block_hash)
            self.allocator.register(self.block_ids[i], block_hash)
        # END SOLUTION

    def fork(self) -> BlockTable:
        """A second sequence that shares every block of this one (parallel sampling)."""
        # BEGIN SOLUTION: Exercise 2
        child = BlockTable(self.allocator, self.cache_salt)
        for block_id in self.block_ids:
            self.allocator.incref(block_id)
        child.block_ids = list(self.block_ids)
        child.token_ids = list(self.token_ids)
        child._block_hashes = list(self._block_hashes)
        return child
        # END SOLUTION

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens; release the blocks no longer needed.

        This is how rejected speculative tokens are rolled back. A block that keeps some
        tokens stays; the next append copies it first if it is shared or cached. The hashes of
        blocks that are no longer full go too: a hash names a block's whole content, and the
        tokens appended next will be different ones. Release the dropped blocks from the last
        to the first: the allocator evicts in the order blocks were freed, so a cached prefix then
        loses its deepest block first and keeps the first ones, which every prompt with the same
        start can reuse. (Checked before your code: an int in 0..num_tokens, else
        TypeError/ValueError.)
        """
        num_tokens = check_int("num_tokens", num_tokens, 0)
        if num_tokens > self.num_tokens:
            raise ValueError(f"cannot truncate to {num_tokens} tokens: the table holds {self.num_tokens}")
        # BEGIN SOLUTION: Exercise 2
        keep = blocks_needed(num_tokens, self.block_size)
        # Free the tail first, so the deepest blocks of a prefix are the first evicted.
        for block_id in reversed(self.block_ids[keep:]):
            self.allocator.free(block_id)
        del self.block_ids[keep:]
        del self.token_ids[num_tokens:]
        del self._block_hashes[num_tokens // self.block_size :]
        # END SOLUTION

    def slots(self, start: int, stop: int) -> np.ndarray:
        """Physical slot ids `block * block_size + offset` of positions `start..stop-1`, an int64
        array. (Checked before your code: ints with 0 <= start <= stop <= num_tokens.)"""
        start, stop = check_int("start", start), check_int("stop", stop)
        if not 0 <= start <= stop <= self.num_tokens:
            raise ValueError(f"positions {start}..{stop} are outside the table's 0..{self.num_tokens}")
        # BEGIN SOLUTION: Exercise 2
        positions = np.arange(start, stop)
        blocks = np.asarray(self.block_ids, dtype=np.int64)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size
        # END SOLUTION

    def free(self) -> None:
        """Release every block, from the last to the first (as `truncate` does); the table is
        empty afterwards."""
        # BEGIN SOLUTION: Exercise 2
        self.truncate(0)
        # END SOLUTION


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


# --- the KV-cache, in float32 or int8 (its arithmetic is in section 7) -------------------


class KVCache:
    """The physical KV-cache: `.k`, `.v` of shape (n_layer, num_blocks, block_size, n_head, head_dim).

    Slot `s` of a layer is `k[layer].reshape(-1, n_head, head_dim)[s]`, i.e. block `s // block_size`,
    offset `s % block_size`: exactly what `BlockTable.slots` returns.

    `dtype="int8"` stores `.k`, `.v` as int8 with float32 `.k_scale`, `.v_scale` of shape
    (n_layer, num_blocks, block_size, n_head), one scale per token and head (`quantize_int8`).
    Writers and readers go through `write`, `read` and `attention_args`, which quantise on the
    way in and dequantise on the way out, so the model path sees float32 either way.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: str = "float32"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        if not (isinstance(dtype, str) and dtype in KV_CACHE_DTYPES):
            raise ValueError(f"dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got {dtype!r}")
        shape = (config.n_layer, num_blocks, block_size, config.n_head, config.head_dim)
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        element = np.int8 if dtype == "int8" else np.float32
        self.k = np.zeros(shape, dtype=element)
        self.v = np.zeros(shape, dtype=element)
        self.k_scale = self.v_scale = None
        if dtype == "int8":
            self.k_scale = np.zeros(shape[:-1], dtype=np.float32)
            self.v_scale = np.zeros(shape[:-1], dtype=np.float32)

    @property
    def nbytes(self) -> int:
        """Bytes the cache really holds: K and V, and their scales for int8."""
        return sum(a.nbytes for a in (self.k, self.v, self.k_scale, self.v_scale) if a is not None)

    def _flat(self, layer: int) -> tuple:
        """Slot-addressed views (num_slots, H, D) of one layer's K, V (and (num_slots, H) scales)."""
        H, D = self.k.shape[3:]
        views = [self.k[layer].reshape(-1, H, D), self.v[layer].reshape(-1, H, D)]
        if self.dtype == "int8":
            views += [self.k_scale[layer].reshape(-1, H), self.v_scale[layer].reshape(-1, H)]
        return tuple(views)

    def write(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store float32 K/V (T, H, D) of T tokens into `slots` of `layer` (quantised for int8)."""
        if k.dtype != np.float32 or v.dtype != np.float32:
            raise ValueError(f"the KV-cache takes float32 K/V, got {k.dtype} and {v.dtype}")
        views = self._flat(layer)
        if self.dtype == "float32":
            views[0][slots], views[1][slots] = k, v
            return
        (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
        views[0][slots], views[1][slots], views[2][slots], views[3][slots] = kq, vq, ks, vs

    def read(self, layer: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Float32 K/V (T, H, D) of `slots` in `layer`: a gathered copy, dequantised for int8."""
        views = self._flat(layer)
        if self.dtype == "float32":
            return views[0][slots], views[1][slots]
        return dequantize_int8(views[0][slots], views[2][slots]), dequantize_int8(views[1][slots], views[3][slots])

    def attention_args(self, layer: int) -> tuple[tuple[np.ndarray, np.ndarray], dict]:
        """`(k_cache, v_cache), scales` of one layer, as `paged_attention(q, *caches, tables, lens, **scales)`
        takes them: scales is {} for float32, {"k_scale", "v_scale"} for int8."""
        caches = (self.k[layer], self.v[layer])
        if self.dtype == "float32":
            return caches, {}
        return caches, {"k_scale": self.k_scale[layer], "v_scale": self.v_scale[layer]}

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Carry out copy-on-write: block `dst` gets `src`'s K/V (and scales) in every layer."""
        if not pairs:
            return
        src, dst = (np.array(x, dtype=np.int64) for x in zip(*pairs))
        for array in (self.k, self.v, self.k_scale, self.v_scale):
            if array is not None:
                array[:, dst] = array[:, src]


# --- paged attention: the kernel that reads K/V through block tables ---------------------


# Bytes of K (and as many of V) one step of the kernel gathers, as whole block columns (2 at
# batch 32, 12 heads x 64, block size 16; a short context at batch 1): NumPy's per-call overhead
# is paid rarely, and the gathered K and V stay in the CPU's caches for the matmuls that read them.
PAGED_ATTENTION_CHUNK_BYTES = 3 * 2**20


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    block_tables: np.ndarray, context_lens: np.ndarray, *,
                    k_scale: np.ndarray | None = None, v_scale: np.ndarray | None = None) -> np.ndarray:
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
    the whole batch (a few columns at a time: PAGED_ATTENTION_CHUNK_BYTES), and fold it into an
    online softmax (running max, running sum, rescaled accumulator), so no copy of the whole
    K/V is ever made. The gather is provided (section 7): `BlockGather(k_cache, v_cache, k_scale,
    v_scale, batch, max_blocks).gather(ids)`, ids (n, c) valid block ids, returns k, v (n, c *
    block_size, H, D) float32 (token t of row i: block ids[i, t // block_size], slot t % block_size),
    views of buffers the next gather overwrites, and k_scales, v_scales: None for float32.

    An int8 cache (`KVCache(..., dtype="int8")`) comes as int8 k_cache, v_cache with `k_scale`,
    `v_scale` (num_blocks, block_size, H) float32: token i's K is k_cache[...] * k_scale[...]. The
    gather casts the values to float32 and returns the scales (n, c * block_size, H) beside them;
    they multiply the scores (K) and the probabilities (V), as BlockGather's docstring shows.
    """
    block_tables, context_lens = _check_paged_attention_args(q, k_cache, v_cache, block_tables,
                                                             context_lens, k_scale, v_scale)
    # BEGIN SOLUTION: Exercise 4
    batch, n_head, head_dim = q.shape
    block_size = k_cache.shape[1]
    # Longest context first: the sequences that still have a block in column j are then a
    # prefix [:n] of the batch, so finished sequences cost nothing (plain slices, no masks).
    order = np.argsort(-context_lens, kind="stable")
    lens = context_lens[order]
    num_used = -(-lens // block_size)
    # Padding entries become block 0 so that they can be indexed at all (masked by position
    # below, like a last block's stale tail); columns past the longest context are dropped.
    width = int(num_used[0]) if batch else 0
    tables = np.where(np.arange(width) < num_used[:, None], block_tables[order, :width], 0)
    # A float32 scale keeps float32: np.sqrt(head_dim) would be a float64 scalar (NumPy 2 promotes).
    qv = (q[order] * np.float32(1.0 / math.sqrt(head_dim)))[..., None]   # (B, H, D, 1)
    run_max = np.full((batch, n_head, 1), -np.inf, np.float32)
    run_sum = np.zeros((batch, n_head, 1), np.float32)
    acc = np.zeros((batch, n_head, 1, head_dim), np.float32)
    column_bytes = batch * block_size * n_head * head_dim * 4   # one block per sequence, float32
    step = max(1, PAGED_ATTENTION_CHUNK_BYTES // column_bytes)    # block columns per chunk
    # Gather buffers reused by every chunk (and every call): fresh arrays each chunk would
    # cost page faults (the allocator hands big buffers back to the OS) at every step.
    columns = BlockGather(k_cache, v_cache, k_scale, v_scale, batch, step)
    for j in range(0, width, step):
        n = int(np.count_nonzero(num_used > j))
        ids = tables[:n, j:j + step]
        k, v, k_s, v_s = columns.gather(ids)                       # (n, tokens, H, D), scales or None
        # Sorted longest first, so the chunk holds a slot past some context iff it does for
        # the last of the n sequences: one comparison, no mask, for every chunk but the last.
        stale = lens[n - 1] < (j + ids.shape[1]) * block_size
        if stale:
            past_end = j * block_size + np.arange(k.shape[1]) >= lens[:n, None]   # (n, tokens)
            # Slots after a sequence's last token hold stale data, even NaN or inf, and a zero
            # weight does not cancel it (0 * NaN = NaN): clear them in our gathered copy (the
            # cache is untouched) before any arithmetic sees them.
            for gathered in (k, v, k_s, v_s):
                if gathered is not None:
                    gathered[past_end] = 0.0
        # One matrix-vector product per (sequence, head), batched by matmul: (n, H, tokens).
        scores = np.matmul(k.transpose(0, 2, 1, 3), qv[:n])[..., 0]
        if k_s is not None:
            scores *= k_s.transpose(0, 2, 1)          # int8: q . (s k) = s (q . k)
        if stale:
            scores[np.broadcast_to(past_end[:, None, :], scores.shape)] = -np.inf   # mask by position
        m, total, a = run_max[:n], run_sum[:n], acc[:n]   # views: updated in place
        new_max = np.maximum(m, scores.max(axis=-1, keepdims=True))
        # What was summed under the old max is rescaled to the new one (exp(-inf) = 0 at j = 0;
        # column 0 always holds token 0, so the max is finite from then on).
        rescale = np.exp(m - new_max)
        p = np.exp(np.subtract(scores, new_max, out=scores), out=scores)   # in place: no new array
        total *= rescale
        total += p.sum(axis=-1, keepdims=True)
        if v_s is not None:
            p *= v_s.transpose(0, 2, 1)               # int8: sum p (s v) = sum (p s) v
        a *= rescale[..., None]
        a += np.matmul(p[:, :, None, :], v.transpose(0, 2, 1, 3))
        m[...] = new_max
    out = np.empty_like(q)
    out[order] = acc[:, :, 0, :] / run_sum
    return out
    # END SOLUTION


# --- the model: a reference path and the serving path ------------------------------------


class ToyTransformer:
    """GPT-2: learned positions, pre-LayerNorm blocks, fused qkv, tanh-GELU MLP, tied LM head."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray] | None = None, seed: int = 0):
        self.config = config
        self.weights = _checked_gpt2_weights(config, init_gpt2_weights(config, seed) if weights is None else weights)
        w = self.weights
        self.layers = [{name.split(".", 2)[2]: w[name] for name in w if name.startswith(f"h.{i}.")}
                       for i in range(config.n_layer)]

    # --- the building blocks ---------------------------------------------------------

    def _ln(self, x: np.ndarray, layer: dict, name: str) -> np.ndarray:
        return _layer_norm(x, layer[f"{name}.weight"], layer[f"{name}.bias"], self.config.layer_norm_epsilon)

    def _qkv(self, x: np.ndarray, layer: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(T, C) -> q, k, v each (T, H, D)."""
        qkv = self._ln(x, layer, "ln_1") @ layer["attn.c_attn.weight"] + layer["attn.c_attn.bias"]
        T, H, D = x.shape[0], self.config.n_head, self.config.head_dim
        return tuple(qkv.reshape(T, 3, H, D).transpose(1, 0, 2, 3))

    def _finish_layer(self, x: np.ndarray, attn: np.ndarray, layer: dict) -> np.ndarray:
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
            x = self._finish_layer(x, np.einsum("hqk,khd->qhd", probs, v), layer)
        return self._logits(x)

    # --- the serving path ------------------------------------------------------------

    def forward(
        self,
        kv_cache: KVCache,
        block_tables: Sequence[BlockTable],
        start_positions: Sequence[int],
        num_tokens: Sequence[int],
        logits_indices: Sequence[int] | np.ndarray | None = None,
    ) -> np.ndarray:
        """One engine step over a batch that mixes prefill chunks and decode tokens.

        Sequence i contributes `block_tables[i].token_ids[start_i : start_i + n_i]`; the K/V of its
        positions before `start_i` must already be in `kv_cache`. Each new token's K/V is written
        into its slot before attention reads it. Returns logits (sum(num_tokens), vocab_size) for
        every processed token, in batch order; with `logits_indices` (vLLM's name), only for
        those rows of that order: the engine samples one row per sequence, and the LM head over
        every other row of a prefill chunk would be wasted work. Speculative verification, which
        scores every row, passes None.
        """
        self._check_cache(kv_cache, block_tables)
        batch = _PagedBatch(self.config, block_tables, start_positions, num_tokens)
        rows = _check_logits_indices(logits_indices, len(batch.token_ids))
        x = self._embed(batch.token_ids, batch.positions)
        scale = np.float32(1.0 / math.sqrt(self.config.head_dim))
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer)
            kv_cache.write(i, batch.slots, k, v)
            attn = np.empty_like(q)
            if batch.decode_rows.size:
                caches, scales = kv_cache.attention_args(i)
                attn[batch.decode_rows] = paged_attention(
                    q[batch.decode_rows], *caches, batch.decode_tables, batch.decode_lens, **scales)
            for prefill_rows, context_slots, mask in batch.prefills:
                k_ctx, v_ctx = kv_cache.read(i, context_slots)
                # Per head (q, D) @ (D, k), then (q, k) @ (k, D): BLAS, ~10x einsum's own loops.
                scores = np.matmul(q[prefill_rows].transpose(1, 0, 2), k_ctx.transpose(1, 2, 0)) * scale
                probs = _softmax(np.where(mask, scores, -np.inf))
                attn[prefill_rows] = np.matmul(probs, v_ctx.transpose(1, 0, 2)).transpose(1, 0, 2)
            x = self._finish_layer(x, attn, layer)
        return self._logits(x if rows is None else x[rows])

    def _check_cache(self, kv_cache: KVCache, block_tables: Sequence[BlockTable]) -> None:
        """A cache of another model or block size would be read at the wrong slots: refuse it."""
        if not isinstance(kv_cache, KVCache):
            raise ValueError(f"kv_cache must be a KVCache, got {type(kv_cache).__name__}")
        c = self.config
        n_layer, num_blocks, block_size, n_head, head_dim = kv_cache.k.shape
        if (n_layer, n_head, head_dim) != (c.n_layer, c.n_head, c.head_dim):
            raise ValueError(f"kv_cache has {n_layer} layers x {n_head} heads x {head_dim}, the model "
                             f"{c.n_layer} layers x {c.n_head} heads x {c.head_dim}: a cache of another model")
        for table in block_tables:
            if getattr(table, "block_size", None) != block_size:
                raise ValueError(f"a block table has block_size {getattr(table, 'block_size', None)}, "
                                 f"the kv_cache {block_size}: its slots would name other tokens")
            if table.block_ids and max(table.block_ids) >= num_blocks:
                raise ValueError(f"a block table uses block {max(table.block_ids)}, the kv_cache has "
                                 f"only {num_blocks} blocks: the allocator and the cache must match")


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
            start, n = check_int("start position", start, 0), check_int("num_tokens", n, 1)
            stop = start + n
            if stop > table.num_tokens:
                raise ValueError(f"cannot process positions {start}..{stop - 1} "
                                 f"of a sequence of {table.num_tokens} tokens")
            tokens.append(table.token_ids[start:stop])
            positions.append(np.arange(start, stop))
            if n == 1:  # a decode reads its past through the block table, in paged_attention
                slots.append(table.slots(start, stop))
                decode.append((row, table, stop))
            else:  # a prefill chunk gathers its whole context: its own slots are the tail of it
                context_slots = table.slots(0, stop)
                slots.append(context_slots[start:])
                mask = np.arange(stop)[None, :] <= np.arange(start, stop)[:, None]
                self.prefills.append((slice(row, row + n), context_slots, mask))
            row += n
        self.token_ids = np.concatenate(tokens).astype(np.int64)
        _check_tokens(config, self.token_ids, max(p[-1] for p in positions) + 1)
        self.positions = np.concatenate(positions)
        self.slots = np.concatenate(slots)
        self.decode_rows = np.array([r for r, _, _ in decode], dtype=np.int64)
        width = max((len(t.block_ids) for _, t, _ in decode), default=0)
        self.decode_tables = np.zeros((len(decode), width), dtype=np.int64)
        for j, (_, table, _) in enumerate(decode):
            self.decode_tables[j, : len(table.block_ids)] = table.block_ids
        self.decode_lens = np.array([stop for _, _, stop in decode], dtype=np.int64)


# =====================================================================================
# 3. Continuous batching: requests, the scheduler, the engine
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
    (max_tokens), "abort" (`LLMEngine.abort_request`), "rejected" (it can never fit; no
    tokens), "error" (the step it ran in raised), or None while running. `finish_detail` says
    why, in words, for "rejected" and "error"."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    metrics: RequestMetrics | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    finish_detail: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SequenceStatus(enum.Enum):
    """Where a sequence is: in the waiting queue, in the running batch, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class SequenceState:
    """The scheduler's record of one request: its tokens, its block table, its progress.

    Invariant between steps: `block_table` holds exactly the first `num_computed_tokens`
    tokens, whose K/V is in the cache; the tokens after them (the rest of a prompt being
    prefilled, or the last sampled token) are still to be processed. A step appends its
    tokens to the table as it is planned, and the full blocks it computed enter the prefix
    cache in `update` (`cache_full_blocks`), after the forward pass.
    """

    def __init__(self, request: Request, allocator: BlockAllocator):
        self.request = request
        self.request_id = request.request_id
        self.sampling = request.sampling
        self.prompt_token_ids = [int(t) for t in request.prompt_token_ids]
        self.output_token_ids: list[int] = []
        self.block_table = BlockTable(allocator, request.cache_salt)
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.finish_detail: str | None = None
        self.num_preemptions = 0
        # Filled in by whoever runs the steps (engine or simulator): its clock, its sampler.
        self.arrival_time = request.arrival_time
        self.token_times: list[float] = []
        self.finish_time = math.nan
        self.rng: np.random.Generator | None = None

    def __repr__(self) -> str:
        return (f"SequenceState({self.request_id!r}, {self.status.value}, {self.num_computed_tokens} of "
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
                             metrics if self.finish_reason else None, self.finish_reason, self.num_preemptions,
                             self.finish_detail)


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
        """Queue a request; one that can never run is finished at once as "rejected", with the
        reason in `finish_detail`.
        An empty prompt, or no max_tokens >= 1, is a ValueError: there would be nothing to run."""
        if len(request.prompt_token_ids) == 0 or check_int("max_tokens", request.sampling.max_tokens) < 1:
            raise ValueError(f"request {request.request_id!r} needs a non-empty prompt and max_tokens >= 1")
        seq = SequenceState(request, self.allocator)
        reason = self._rejection(seq)
        if reason:
            seq.status, seq.finish_reason, seq.finish_detail = SequenceStatus.FINISHED, "rejected", reason
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
        block_size = self.allocator.block_size
        hashes = chained_block_hashes(token_ids, block_size, seq.request.cache_salt)
        return len(self.allocator.cached_prefix(hashes, len(token_ids))) * block_size

    def _allocate_slots(self, seq: SequenceState, num_new_tokens: int, plan: SchedulerOutput) -> bool:
        """Put the next `num_new_tokens` tokens into the block table; False if the blocks
        are not there (the table is unchanged)."""
        stop = seq.num_computed_tokens + num_new_tokens
        try:
            plan.blocks_to_copy += seq.block_table.append_tokens(seq.token_ids_slice(seq.block_table.num_tokens, stop))
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
        # BEGIN SOLUTION: Exercise 5
        seq.block_table.free()
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        # END SOLUTION

    def schedule(self) -> SchedulerOutput:
        """Plan one step (see the class docstring). Never exceeds `max_num_seqs` running
        sequences or `max_num_batched_tokens` scheduled tokens."""
        # BEGIN SOLUTION: Exercise 5
        plan = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # Running sequences, oldest first: a decode token or their next prefill chunk.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self._allocate_slots(seq, num_new, plan):
                victim = self.running.pop()  # the newest; never one already scheduled
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break
            plan.add(seq, num_new)
            budget -= num_new
            i += 1
        # Waiting sequences, first come first served. Not after a preemption: memory is short.
        while self.waiting and not plan.preempted and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            num_new = self._try_admit(seq, budget)
            if num_new == 0:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan.add(seq, num_new)
            budget -= num_new
        return plan
        # END SOLUTION

    # --- one step, for whoever drives the scheduler (the engine, the simulator) -----------

    def plan_step(self) -> SchedulerOutput:
        """`schedule()`, checked: a step that runs nothing while requests wait would repeat forever."""
        plan = self.schedule()
        if not plan.scheduled and self.has_unfinished():
            raise RuntimeError("the scheduler planned an empty step while requests are waiting")
        return plan

    def finish_step(self, plan: SchedulerOutput, sampled_token_ids: dict[str, int], now: float) -> list[SequenceState]:
        """`update()`, then the driver's clock: `now` is the time of every token sampled in the
        step and the finish time of every sequence it retired. Returns the retired ones."""
        finished = self.update(plan, sampled_token_ids)
        for seq in plan.scheduled:
            if seq.request_id in sampled_token_ids:
                seq.token_times.append(now)
        for seq in finished:
            seq.finish_time = now
        return finished

    def _finish(self, seq: SequenceState, reason: str) -> None:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        seq.block_table.free()
        self.running.remove(seq)

    def abort(self, request_id: str) -> SequenceState | None:
        """Drop a waiting or running request now and free its blocks (its client went away).
        Returns its finished record ("abort"), or None when no unfinished request has this id."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                seq.block_table.free()  # a preempted sequence holds none; a chunked one may
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self._finish(seq, "abort")
                return seq
        return None

    def update(self, plan: SchedulerOutput, sampled_token_ids: dict[str, int]) -> list[SequenceState]:
        """After the step ran: advance every scheduled sequence by its tokens and register the
        blocks that are now computed (`block_table.cache_full_blocks(num_computed_tokens)`),
        append the token sampled for each sequence that `plan.completes`, and retire the ones
        that are done NOW (their blocks go back to the pool before the next step is planned):
        "stop" if the token is in `stop_token_ids` (checked first: a stop token that is also
        the max_tokens-th token finishes as "stop"), else "length" at `max_tokens` outputs.
        Returns the retired sequences."""
        # BEGIN SOLUTION: Exercise 5
        finished = []
        for seq in plan.scheduled:
            seq.num_computed_tokens += plan.num_scheduled_tokens[seq.request_id]
            seq.block_table.cache_full_blocks(seq.num_computed_tokens)  # their K/V is written now
            token = sampled_token_ids.get(seq.request_id)
            if token is None:
                continue
            seq.output_token_ids.append(token)
            if token in seq.sampling.stop_token_ids:
                self._finish(seq, "stop")
            elif len(seq.output_token_ids) >= seq.sampling.max_tokens:
                self._finish(seq, "length")
            else:
                continue
            finished.append(seq)
        return finished
        # END SOLUTION


# --- the engine: the scheduler driving the toy model -------------------------------------


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


class LLMEngine:
    """Serves generation requests on a ToyTransformer with a paged KV-cache.

    `num_blocks=None` sizes the cache so that `max_num_seqs` sequences of the model's full
    length fit at once (then nothing is ever preempted); pass fewer to study memory pressure.
    `scheduling` is "continuous" (Scheduler) or "static" (StaticBatchScheduler with
    batch_size = max_num_seqs). Metrics are wall-clock seconds from `time.perf_counter`.
    `kv_cache_dtype="int8"` keeps K/V as int8 with per-token scales (`KVCache`): each block
    takes 3.2-3.8x fewer bytes than float32 (the scales cost the rest of 4x), at a small cost
    in logit accuracy; the engine keeps `num_blocks` blocks either way.
    """

    def __init__(self, model: ToyTransformer, num_blocks: int | None = None, block_size: int = 16,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512, scheduling: str = "continuous",
                 enable_prefix_caching: bool = False, enable_chunked_prefill: bool = True,
                 kv_cache_dtype: str = "float32"):
        if not (isinstance(kv_cache_dtype, str) and kv_cache_dtype in KV_CACHE_DTYPES):
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                             f"got {kv_cache_dtype!r}")
        if num_blocks is None:
            num_blocks = max_num_seqs * blocks_needed(model.config.n_positions, block_size)
        self.model = model
        self.allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching)
        self.kv_cache = KVCache(model.config, num_blocks, block_size, dtype=kv_cache_dtype)
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
        taken, requests, next_id = self._in_flight(), [], self._next_id
        for prompt, params in zip(prompts, sampling):
            if isinstance(prompt, Request):
                request = prompt
            else:
                while str(next_id) in taken:  # a caller's id may look like ours
                    next_id += 1
                request = Request(str(next_id), prompt, SamplingParams() if params is None else params)
                next_id += 1
            _check_request(request, self.model.config)
            if request.request_id in taken:
                raise ValueError(f"request id {request.request_id!r} is already in flight; ids must be unique")
            taken.add(request.request_id)
            requests.append(request)
        self._next_id = next_id  # only once the whole batch is accepted
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
        plan = self.scheduler.plan_step()
        done, self._just_finished = self._just_finished, []
        progressed = []
        if plan.scheduled:
            try:
                sampled = self._run_model(plan)
            except Exception as exc:
                for seq in plan.scheduled:
                    self.scheduler.abort(seq.request_id)
                    seq.finish_reason, seq.finish_time = "error", time.perf_counter()
                    seq.finish_detail = f"{type(exc).__name__}: {exc}"
                self._just_finished = done + plan.scheduled
                raise
            self.scheduler.finish_step(plan, sampled, time.perf_counter())
            self.num_steps += 1
            progressed = [s for s in plan.scheduled if s.request_id in sampled]
        held, self._held = list(self._held.values()), {}
        return held + [seq.to_output() for seq in done + progressed]

    def _run_model(self, plan: SchedulerOutput) -> dict[str, int]:
        """The step's forward pass and sampling: request id -> sampled token, for every
        sequence whose last pending token this step processes."""
        self.kv_cache.copy_blocks(plan.blocks_to_copy)  # before the forward writes into the copies
        num_new = [plan.num_scheduled_tokens[s.request_id] for s in plan.scheduled]
        # Logits only for each sequence's last row: the only one a sequence can sample from.
        logits = self.model.forward(self.kv_cache, [s.block_table for s in plan.scheduled],
                                    [s.num_computed_tokens for s in plan.scheduled], num_new,
                                    logits_indices=np.cumsum(num_new) - 1)
        return {s.request_id: sample_token(logits[j], s.sampling, s.rng)
                for j, s in enumerate(plan.scheduled) if plan.completes(s)}

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


def residual_distribution(p, q) -> np.ndarray:
    """The distribution a rejected draft token is replaced from: `max(0, p - q)` normalised.

    `p` is the target row, `q` the draft row (1-D, same vocabulary). The residual puts mass
    exactly where the draft under-proposes (p > q), which is the mass the accept test could not
    deliver. Where it has no mass (p == q), rejection never happens and the result is `p`.
    Returns a float64 row summing to 1; never divides by zero. (Checked before your code:
    p and q arrive as float64 rows that sum to 1, of one vocabulary; a row that is not a
    distribution is a ValueError naming it.)
    """
    p = _as_distributions("p", p, ndim=1)
    q = _as_distributions("q", q, ndim=1)
    _check_same_vocab(p, q)
    # BEGIN SOLUTION: Exercise 6
    residual = np.maximum(p - q, 0.0)
    mass = residual.sum()
    if mass <= 0.0:
        return p
    return residual / mass
    # END SOLUTION


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
    draft, q, p = _checked_speculative_inputs(draft_token_ids, draft_probs, target_probs, rng)
    # BEGIN SOLUTION: Exercise 6
    vocab_size = p.shape[1]
    emitted: list[int] = []
    for i, x in enumerate(draft):
        if rng.random() < min(1.0, p[i, x] / q[i, x]):
            emitted.append(x)
            continue
        # The residual supplies exactly the mass p_i has beyond q_i, which the accept test
        # (capped at 1) could not; tokens after a rejected one were drafted from a wrong context.
        emitted.append(int(rng.choice(vocab_size, p=residual_distribution(p[i], q[i]))))
        return emitted
    # All k survived, and the target pass already produced the next row: a free extra token.
    emitted.append(int(rng.choice(vocab_size, p=p[-1])))
    return emitted
    # END SOLUTION


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


# --- draft -> verify on the paged model (Exercise 7) -------------------------------------


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
    # BEGIN SOLUTION: Exercise 7
    rng = np.random.default_rng(sampling.seed)
    target_seq, draft_seq = PagedSequence(target), PagedSequence(draft)
    for seq in (target_seq, draft_seq):
        seq.extend(prompt)
        seq.run(stop=len(prompt) - 1)  # prefill; each round starts by scoring the last token
    out: list[int] = []
    accepted_per_pass: list[int] = []
    num_drafted = 0
    n_positions = min(target.config.n_positions, draft.config.n_positions)
    limit = min(sampling.max_tokens, n_positions - len(prompt))
    stop_ids = set(sampling.stop_token_ids)
    while len(out) < limit and not stop_ids.intersection(out):
        committed = target_seq.table.num_tokens
        # A round emits up to n_draft + 1 tokens; `limit` already stops them at n_positions.
        n_draft = min(k, limit - len(out) - 1)
        num_drafted += n_draft
        drafts, q_rows = [], []
        for _ in range(n_draft):
            q = token_probs(draft_seq.run()[-1], sampling.temperature)
            drafts.append(int(rng.choice(len(q), p=q)))
            q_rows.append(q)
            draft_seq.extend(drafts[-1:])
        target_seq.extend(drafts)
        p_rows = token_probs(target_seq.run(), sampling.temperature)  # ONE pass: last + n_draft tokens
        q_rows = np.array(q_rows).reshape(n_draft, p_rows.shape[1])
        emitted = accept_or_resample(drafts, q_rows, p_rows, rng)
        accepted_per_pass.append(len(emitted) - 1)
        for seq in (target_seq, draft_seq):
            seq.rollback(committed + len(emitted) - 1)
            seq.extend(emitted[-1:])
        out.extend(emitted)
    # The last round may run past a stop token: cut there.
    first_stop = next((i for i, t in enumerate(out) if t in stop_ids), len(out) - 1)
    return SpeculativeOutput(out[: first_stop + 1], len(accepted_per_pass), num_drafted,
                             sum(accepted_per_pass), accepted_per_pass)
    # END SOLUTION


# =====================================================================================
# 5. Capacity planning: KV blocks, concurrency and QPS for a real GPU
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
    kv_dtype_bytes: int | None = None  # bytes per KV-cache element; None: dtype_bytes

    def __post_init__(self) -> None:
        for field in ("num_params", "num_layers", "num_kv_heads", "head_dim", "dtype_bytes", "kv_dtype_bytes"):
            if field != "kv_dtype_bytes" or self.kv_dtype_bytes is not None:
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


def kv_bytes_per_token(model: ModelSpec) -> int:
    """KV-cache bytes one token occupies: a key AND a value vector (the 2) of `head_dim`
    for every KV head in every layer. GQA shrinks it by using num_kv_heads, not query heads;
    an 8-bit KV cache by storing 1 byte per element (`kv_dtype_bytes`) instead of the model's
    `dtype_bytes`."""
    element = model.dtype_bytes if model.kv_dtype_bytes is None else model.kv_dtype_bytes
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * element


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


# --- the plan ----------------------------------------------------------------------------


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


# The default traffic: the PagedAttention paper's ShareGPT means.
_DEFAULT_PROMPT_LEN, _DEFAULT_OUTPUT_LEN = SHAREGPT.mean_prompt_len, SHAREGPT.mean_output_len


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
    kv_cache_dtype: str = "auto",
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
    `model` and `gpu` may be presets' names. `kv_cache_dtype` "fp8" or "int8" stores the KV
    cache at 1 byte per element (`with_kv_cache_dtype`): `kv_bytes_per_token(model)` is then
    half of fp16's, and the same pool holds twice the blocks.
    """
    model = with_kv_cache_dtype(model, kv_cache_dtype)  # kv_bytes_per_token(model) follows it
    model, gpu = get_model(model), get_gpu(gpu)
    _check_plan_inputs(model, max_model_len, block_size, gpu_memory_utilization,
                       activation_bytes, tensor_parallel_size, mean_prompt_len, mean_output_len)
    # BEGIN SOLUTION: Exercise 8
    tp = tensor_parallel_size
    kv_token = kv_bytes_per_token(model) // tp
    block_bytes = block_size * kv_token
    weight_bytes = model.weight_bytes / tp
    budget = gpu_memory_utilization * gpu.memory_bytes
    free = budget - weight_bytes - activation_bytes
    if free < 0:
        raise ValueError(
            f"{model.name} does not fit on {gpu.name} with tp={tp}: weights need "
            f"{weight_bytes / GB:.2f} GB and activations {activation_bytes / GB:.2f} GB per GPU, "
            f"but the budget is {budget / GB:.2f} GB ({gpu_memory_utilization:g} x "
            f"{gpu.memory_bytes / GB:.2f} GB): short by {-free / GB:.2f} GB"
        )
    num_kv_blocks = math.floor(free / block_bytes)
    per_seq_blocks = blocks_needed(max_model_len, block_size)
    max_seqs = num_kv_blocks // per_seq_blocks
    if max_seqs == 0:
        raise ValueError(
            f"one {max_model_len}-token sequence needs {per_seq_blocks} KV blocks but only "
            f"{num_kv_blocks} fit ({num_kv_blocks * block_size} tokens): lower max_model_len "
            f"or raise tensor_parallel_size")
    kv_pool = num_kv_blocks * block_bytes

    context = mean_prompt_len + mean_output_len / 2
    step_bytes = weight_bytes + max_seqs * context * kv_token
    memory_s = step_bytes / gpu.bandwidth_bytes_per_s
    compute_s = 2 * model.num_params * max_seqs / (tp * gpu.flops)
    decode_s = max(memory_s, compute_s)
    prefill_s = 2 * model.num_params * mean_prompt_len / (tp * gpu.flops)
    latency = mean_output_len * decode_s + max_seqs * prefill_s
    qps = max_seqs / latency

    notes = []
    if model.max_position_embeddings and max_model_len > model.max_position_embeddings:
        notes.append(f"{model.name} was trained for {model.max_position_embeddings} positions; "
                     f"{max_model_len} needs a long-context variant (the memory arithmetic is the same)")
    return DeploymentPlan(
        model=model, gpu=gpu, max_model_len=max_model_len, block_size=block_size,
        gpu_memory_utilization=gpu_memory_utilization, activation_bytes=activation_bytes,
        tensor_parallel_size=tp, mean_prompt_len=mean_prompt_len, mean_output_len=mean_output_len,
        kv_bytes_per_token_per_gpu=kv_token, block_bytes_per_gpu=block_bytes,
        weight_bytes_per_gpu=weight_bytes, memory_budget_bytes=budget,
        num_kv_blocks=num_kv_blocks, kv_pool_bytes=kv_pool,
        num_cache_tokens=num_kv_blocks * block_size, max_concurrent_seqs=max_seqs,
        ceiling="kv-blocks" if kv_pool > weight_bytes else "weights",
        mean_context_len=context, decode_step_s=decode_s,
        decode_bound="memory-bandwidth" if memory_s >= compute_s else "compute",
        prefill_s=prefill_s, request_latency_s=latency, qps=qps,
        output_tokens_per_s=qps * mean_output_len, notes=tuple(notes),
    )
    # END SOLUTION


# =====================================================================================
# 6. Argument checks: provided code, so that the exercises start from checked arguments
# =====================================================================================
#
# Every bad input is a ValueError (or TypeError) that names the argument and says what was
# wrong, raised before anything changes. Python and NumPy ints are ints; bools, floats and
# strings are not.


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


def _checked_gpt2_weights(config: ModelConfig, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Strip a `transformer.` prefix, drop GPT-2's mask buffers, check every name and shape."""
    expected = gpt2_weight_shapes(config)
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


def _check_tokens(config: ModelConfig, token_ids: np.ndarray, positions_end: int) -> None:
    """Token ids inside the vocabulary, positions (up to `positions_end`) inside n_positions."""
    if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= config.vocab_size):
        raise ValueError(f"token ids must be in 0..{config.vocab_size - 1}")
    if positions_end > config.n_positions:
        raise ValueError(f"position {positions_end - 1} is beyond n_positions={config.n_positions}")


def _check_paged_attention_args(q, k_cache, v_cache, block_tables, context_lens, k_scale=None, v_scale=None):
    """Validate the kernel's inputs; return (block_tables, context_lens) as int64 arrays.

    Also checks that every table entry a sequence really uses names a block of the cache: a
    -1 there would otherwise silently read the LAST block (NumPy's negative indexing). Unsigned
    integers are accepted and converted once checked: `-x` of an unsigned x wraps around, so the
    kernel's `-(-lens // block_size)` would be garbage on them.
    """
    if not (isinstance(q, np.ndarray) and q.ndim == 3 and q.dtype == np.float32):
        raise ValueError(f"q must be a float32 array (batch, n_head, head_dim), got "
                         f"{getattr(q, 'dtype', type(q).__name__)} {np.shape(q)}")
    batch, n_head, head_dim = q.shape
    quantized = k_scale is not None or v_scale is not None
    element = np.int8 if quantized else np.float32
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not (isinstance(cache, np.ndarray) and cache.ndim == 4 and cache.dtype == element
                and cache.shape[0] >= 1 and cache.shape[1] >= 1
                and cache.shape[2:] == (n_head, head_dim)):
            raise ValueError(f"{name} must be {np.dtype(element).name} (num_blocks, block_size, {n_head}, "
                             f"{head_dim}) to match q{' and the scales' if quantized else ''}, got "
                             f"{getattr(cache, 'dtype', '?')} {np.shape(cache)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must have one shape")
    if quantized:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (isinstance(scale, np.ndarray) and scale.dtype == np.float32
                    and scale.shape == k_cache.shape[:3]):
                raise ValueError(f"{name} must be float32 {k_cache.shape[:3]} (one scale per slot and "
                                 f"head of the int8 cache), got {getattr(scale, 'dtype', '?')} {np.shape(scale)}")
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
    # Compared in their own dtype (exact for unsigned too), then converted: 1..capacity fits int64.
    if batch and (context_lens.min() < 1 or context_lens.max() > capacity):
        raise ValueError(f"context_lens must be in 1..{capacity} (max_blocks {block_tables.shape[1]} "
                         f"x block_size {block_size}), got {context_lens.tolist()}")
    context_lens = context_lens.astype(np.int64)
    used = np.arange(block_tables.shape[1]) < -(-context_lens[:, None] // block_size)
    if np.any(used & ((block_tables < 0) | (block_tables >= num_blocks))):
        raise ValueError(f"a block table entry in use is not a block id in 0..{num_blocks - 1}")
    # Entries in use are now known to be < num_blocks; padding may wrap, and is never read.
    return block_tables.astype(np.int64), context_lens


def _check_logits_indices(logits_indices, num_rows: int) -> np.ndarray | None:
    """None, or the rows to keep as an int64 array of indices in 0..num_rows-1."""
    if logits_indices is None:
        return None
    rows = np.asarray(logits_indices)
    if not (rows.ndim == 1 and (np.issubdtype(rows.dtype, np.integer) or rows.size == 0)):
        raise ValueError(f"logits_indices must be a 1-D sequence of ints, got {rows.dtype} {rows.shape}")
    if rows.size and (rows.min() < 0 or rows.max() >= num_rows):
        raise ValueError(f"logits_indices must be rows in 0..{num_rows - 1} of this batch, got {rows.tolist()}")
    return rows.astype(np.int64)


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


# =====================================================================================
# 7. Beside the path: int8 K/V arithmetic, the static baseline, the simulator, presets, traffic
# =====================================================================================
#
# Beside the reading path: the tools the design reviews and the server use to put numbers on
# sections 1-5.


# --- the KV-cache, in float32 or int8 ------------------------------------------------------
#
# Decode reads every cached K/V byte once per step, so the cache's element size is both how
# many tokens fit and how long a step takes. An int8 cache stores each K (and V) vector of one
# token and one head as 127 levels of a float32 scale: 1 byte per element plus 4 bytes per
# head_dim elements, about 3.8x smaller than float32 at head_dim 64 (vLLM's fp8 KV cache and
# KIVI-style int8 caches are the same lever; per-token scales because a new token's K/V is
# quantised when it is written, before any later token exists).


KV_CACHE_DTYPES = ("float32", "int8")


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per vector: x (..., D) float32 -> (values int8 (..., D), scale float32 (...)).

    scale = max|x| / 127 over the last axis, values = round(x / scale), so values * scale is x
    to within scale / 2 = max|x| / 254 per element. An all-zero vector gets scale 0 (and
    dequantises to exact zeros). Non-finite input is refused: one inf would make its scale inf.
    """
    x = np.asarray(x)
    if x.dtype != np.float32 or x.ndim < 1:
        raise ValueError(f"quantize_int8 takes a float32 array (..., D), got {x.dtype} {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("quantize_int8: x holds NaN or inf; a scale cannot represent it")
    scale = np.abs(x).max(axis=-1) * np.float32(1.0 / 127.0)
    # Divide by 1 where the scale is 0: those vectors are all zeros and stay zeros.
    safe = np.where(scale > 0, scale, np.float32(1.0))
    values = np.rint(x / safe[..., None]).astype(np.int8)  # |x / scale| <= 127: no overflow
    return values, scale


def dequantize_int8(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float32 vectors `values * scale[..., None]` (the inverse of `quantize_int8`)."""
    # One pass: int8 * float32 is computed and stored as float32, no float32 copy of `values`.
    return np.multiply(values, scale[..., None], dtype=np.float32)


# --- reading blocks for paged_attention: a column at a time, dequantised on the way ---------


# Gather buffers kept between kernel calls, one set per thread: a fresh multi-MiB array every
# call costs page faults on every page of it (the allocator returns big arrays to the OS on
# free), as much as the gather itself on a short context.
_GATHER_BUFFERS = threading.local()


def _reused_buffer(key: tuple, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A C-contiguous `shape` array of `dtype` carved from this thread's buffer `key`, which is
    grown when too small and otherwise reused. Its content is garbage; the next caller with the
    same key overwrites it."""
    size = math.prod(shape)
    buffer = getattr(_GATHER_BUFFERS, "arrays", None)
    if buffer is None:
        buffer = _GATHER_BUFFERS.arrays = {}
    array = buffer.get(key)
    if array is None or array.size < size:
        array = buffer[key] = np.empty(size, dtype)
    return array[:size].reshape(shape)


class BlockGather:
    """Gathers columns of blocks of one layer's K and V caches into reused float32 buffers.

    `BlockGather(k_cache, v_cache, k_scale, v_scale, batch, max_blocks)` holds buffers for
    `max_blocks` blocks of each of `batch` sequences (scales None for a float32 cache).
    `gather(ids)` with `ids` (n, c) int block ids (n <= batch, c <= max_blocks, valid ids only)
    returns `(k, v, k_scales, v_scales)`:

      k, v (n, c * block_size, H, D) float32: token t of row i is slot t % block_size of block
           ids[i, t // block_size]; views of the buffers, overwritten by the next gather;
      k_scales, v_scales None for a float32 cache; for an int8 cache (n, c * block_size, H)
           float32, the per-token-and-head scales, and k, v are the int8 values cast to float32.

    So the K a kernel reads is `k` for float32 and `k * k_scales[..., None]` for int8 (V alike).
    The int8 multiply is left to the kernel because a scale per token and head factors out of
    every dot product over D: q . (s k) = s (q . k), and sum_t p_t (s_t v_t) = sum_t (p_t s_t) v_t,
    so it costs one multiply per score instead of one per element (64x fewer at head_dim 64).
    The cast happens inside the gather, into the reused buffer (a GPU kernel does it in
    registers): no float32 copy of all the blocks read is ever made. The caches are never
    written. The buffers are per thread and shared by every BlockGather of that thread: one
    kernel call at a time per thread, as the engine runs.
    """

    def __init__(self, k_cache: np.ndarray, v_cache: np.ndarray, k_scale: np.ndarray | None,
                 v_scale: np.ndarray | None, batch: int, max_blocks: int):
        self.caches, self.scales = (k_cache, v_cache), (k_scale, v_scale)
        self.batch, self.max_blocks = batch, max_blocks
        _, block_size, n_head, head_dim = k_cache.shape
        shape = (batch, max_blocks, block_size, n_head, head_dim)
        self.values = [_reused_buffer((kv, "values"), shape, np.float32) for kv in "kv"]
        self.quantized = k_scale is not None
        if self.quantized:
            # The int8 bytes land in a staging buffer (a quarter of the float32 one), then one
            # cast writes them into `values`: a cast runs at copy speed, a broadcast multiply
            # of every element by its scale would not.
            self.staging = [_reused_buffer((kv, "staging"), shape, np.int8) for kv in "kv"]
            self.scale_buffers = [_reused_buffer((kv, "scales"), shape[:-1], np.float32) for kv in "kv"]

    def gather(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        n, c = ids.shape
        if n > self.batch or c > self.max_blocks:
            raise ValueError(f"ids {ids.shape} exceed the buffers for {self.batch} sequences x "
                             f"{self.max_blocks} blocks this BlockGather was made with")
        values, scales = [], [None, None]
        for i, cache in enumerate(self.caches):
            shape = (n, c, *cache.shape[1:])
            # A contiguous front part of the buffer, whatever n and c: np.take then writes
            # straight into it. mode="clip" only because the default "raise" copies `out` once
            # more; the caller's ids are valid block ids already.
            out = _front(self.values[i], shape)
            if not self.quantized:
                np.take(cache, ids, axis=0, out=out, mode="clip")
            else:
                raw = np.take(cache, ids, axis=0, out=_front(self.staging[i], shape), mode="clip")
                np.copyto(out, raw)  # int8 -> float32, exact: the dequantisation's cast
                s = np.take(self.scales[i], ids, axis=0, out=_front(self.scale_buffers[i], shape[:-1]), mode="clip")
                scales[i] = s.reshape(n, -1, s.shape[-1])
            values.append(out.reshape(n, -1, *shape[3:]))
        return values[0], values[1], scales[0], scales[1]


def _front(buffer: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The first prod(shape) elements of a C-contiguous buffer, as a contiguous `shape` array."""
    return buffer.reshape(-1)[:math.prod(shape)].reshape(shape)


# --- the static-batching baseline, and serving metrics -----------------------------------


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
        plan = SchedulerOutput()
        if not self.running:
            self._start_batch(plan)
            return plan
        for seq in self.running:
            num_new = seq.num_tokens - seq.num_computed_tokens
            if not self._allocate_slots(seq, num_new, plan):
                raise RuntimeError("a static batch ran out of the blocks it reserved")
            plan.add(seq, num_new)
        return plan

    def _start_batch(self, plan: SchedulerOutput) -> None:
        free, reserved = self.allocator.num_free_blocks, 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            worst = blocks_needed(len(seq.prompt_token_ids) + seq.sampling.max_tokens, self.allocator.block_size)
            if reserved + worst > free:
                break
            num_new = self._try_admit(seq, self.max_num_batched_tokens)
            reserved += worst
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan.add(seq, num_new)


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


# --- the model-free step simulator: the same schedulers, a cost per step -----------------


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
        plan = scheduler.plan_step()
        context = sum(s.num_computed_tokens + plan.num_scheduled_tokens[s.request_id] for s in plan.scheduled)
        clock += cost.step_time(plan.total_num_scheduled_tokens, context)
        row = _occupy_slots(slot_of, scheduler.running, max_num_seqs, waiting=len(scheduler.waiting))
        num_steps += 1
        if record_timeline:
            timeline.append(row)
        wasted += min(row.count(-1), len(scheduler.waiting))
        sampled = {s.request_id: 0 for s in plan.scheduled if plan.completes(s)}
        scheduler.finish_step(plan, sampled, clock)
        for rid in sampled:
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


# --- presets: real models and GPUs, and the KV cache's dtype -----------------------------


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


# vLLM's `kv_cache_dtype`: "auto" stores K/V in the model's dtype; fp8 (on GPUs) and int8 store
# 1 byte per element. The few bytes of scales per block are left out, as vLLM's sizing does for
# fp8 with per-tensor scales.
PLAN_KV_CACHE_DTYPES = {"auto": None, "fp8": 1, "int8": 1}


def with_kv_cache_dtype(model: ModelSpec | str, kv_cache_dtype: str) -> ModelSpec:
    """`model` with its KV-cache elements stored as `kv_cache_dtype`: "fp8" or "int8" (1 byte),
    or "auto" (the spec unchanged: its `kv_dtype_bytes`, by default the model's own dtype)."""
    if not (isinstance(kv_cache_dtype, str) and kv_cache_dtype in PLAN_KV_CACHE_DTYPES):
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, PLAN_KV_CACHE_DTYPES))}, "
                         f"got {kv_cache_dtype!r}")
    model = get_model(model)
    if kv_cache_dtype == "auto":
        return model
    return dataclasses.replace(model, kv_dtype_bytes=PLAN_KV_CACHE_DTYPES[kv_cache_dtype])


# --- traffic: request lengths, and the KV a max_len slab wastes --------------------------


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


# =====================================================================================
# 8. Serving over HTTP: the engine behind an OpenAI-compatible endpoint, and a load generator
# =====================================================================================
#
# `generate()` answers "how many tokens per second can this engine make?". A deployment is
# asked a different question: requests arrive when they like, each one waits for its first
# token (TTFT) and then for every next one (TPOT/ITL), and past some arrival rate the queue
# grows without bound. The server below puts the engine on a socket with the wire format of
# OpenAI and vLLM (`/v1/completions`, server-sent events, `/metrics` under vLLM's metric
# names); the load generator after it offers Poisson traffic at several rates and measures the
# latencies with vLLM's benchmark definitions. It speaks only the public API, so the same
# command measures a vLLM deployment on a GPU.
#
# One thread owns the engine. The asyncio loop parses HTTP and hands each request over; a
# single worker thread adds it, steps the engine and returns the step's outputs; the loop
# routes every new token to the request's own queue, whose handler writes it to the socket.


MAX_BODY_BYTES = 1 << 20  # a completion body is a prompt and a few fields; a larger one is refused unread


MAX_HEADER_BYTES = 16 << 10


READ_TIMEOUT_S = 10.0  # to receive a request's head and body; a silent client is dropped


SHUTDOWN_TIMEOUT_S = 10.0


# vLLM's TTFT histogram uses buckets of this shape (ms to tens of seconds); these are the lab's own.
TTFT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


_REASONS = {100: "Continue", 200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            500: "Internal Server Error", 503: "Service Unavailable"}


class _HTTPError(Exception):
    """A request that ends in an error response: HTTP status and OpenAI's error body."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": None, "code": self.status}}


class _ClientGone(Exception):
    """The client closed its connection: abort its request."""


_CLIENT_GONE = object()  # put in a request's queue when its client disconnects


# --- the wire format: prompts, fields, chunks --------------------------------------------


def token_text(token_id: int) -> str:
    """The lab's byte tokenizer: token id = byte value, so a token's text is that byte decoded
    (a lone byte >= 128 is not UTF-8 on its own and shows as U+FFFD; `token_ids` carry the truth)."""
    return bytes([token_id]).decode("utf-8", errors="replace") if 0 <= token_id < 256 else ""


def _prompt_token_ids(prompt: object, vocab_size: int) -> list[int]:
    """A prompt as token ids: a list of ints as given, or a string encoded byte by byte (UTF-8)."""
    if isinstance(prompt, str):
        token_ids = list(prompt.encode("utf-8"))
        outside = [t for t in token_ids if t >= vocab_size]
        if outside:
            raise _HTTPError(f"prompt: byte {outside[0]} of the UTF-8 text has no token in this model's "
                             f"vocabulary of {vocab_size} (token id = byte value)")
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        token_ids = prompt
    else:
        raise _HTTPError("prompt must be a string or a list of token ids (ints); one prompt per request")
    if not token_ids:
        raise _HTTPError("prompt is empty; expected at least one token")
    return token_ids


def _optional(body: dict, name: str, kinds: tuple, default, what: str):
    """body[name] if it is present, not null and of one of `kinds` (bool is never an int here)."""
    value = body.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise _HTTPError(f"{name} must be {what}, got {json.dumps(value)}")
    return value


def parse_completion_request(body: bytes, config: ModelConfig, request_id: str) -> tuple[Request, bool, bool]:
    """A `/v1/completions` body as (Request, stream, include_usage); `_HTTPError` (400) naming the
    field otherwise. Fields: prompt, max_tokens (16), temperature (0: greedy, the lab's default),
    seed, stop_token_ids, stream, stream_options.include_usage, n (only 1); others are ignored."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, an absurd int, absurd nesting
        raise _HTTPError(f"the body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise _HTTPError("the body must be a JSON object")
    if "prompt" not in payload:
        raise _HTTPError("prompt is required")
    prompt = _prompt_token_ids(payload["prompt"], config.vocab_size)
    max_tokens = _optional(payload, "max_tokens", (int,), 16, "an int >= 1")
    temperature = _optional(payload, "temperature", (int, float), 0.0, "a number >= 0")
    seed = _optional(payload, "seed", (int,), None, "an int >= 0")
    stop = _optional(payload, "stop_token_ids", (list,), [], "a list of token ids")
    stream = _optional(payload, "stream", (bool,), False, "true or false")
    options = _optional(payload, "stream_options", (dict,), {}, "an object")
    include_usage = _optional(options, "include_usage", (bool,), False, "true or false")
    _optional(payload, "ignore_eos", (bool,), False, "true or false")  # vLLM's; the toy model has no EOS
    if _optional(payload, "n", (int,), 1, "1") != 1:
        raise _HTTPError("n must be 1: this server returns one choice per request")
    if seed is not None and seed < 0:
        raise _HTTPError(f"seed must be an int >= 0, got {seed}")
    if not all(type(t) is int for t in stop):
        raise _HTTPError(f"stop_token_ids must be a list of token ids (ints), got {json.dumps(stop)}")
    request = Request(request_id, prompt, SamplingParams(float(temperature), max_tokens, seed, tuple(stop)))
    try:
        _check_request(request, config)
    except ValueError as exc:
        raise _HTTPError(str(exc)) from None
    return request, stream, include_usage


def _choice(token_ids: list[int], finish_reason: str | None) -> dict:
    return {"index": 0, "text": "".join(token_text(t) for t in token_ids), "token_ids": token_ids,
            "logprobs": None, "finish_reason": finish_reason}


def _usage(request: Request, num_output_tokens: int) -> dict:
    n_prompt = len(request.prompt_token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": num_output_tokens,
            "total_tokens": n_prompt + num_output_tokens}


def _http_head(status: int, content_type: str, length: int | None = None) -> bytes:
    """Response head; `length=None` means a chunked body (a stream). One response per connection."""
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}", f"Content-Type: {content_type}", "Connection: close"]
    lines += ["Cache-Control: no-cache", "Transfer-Encoding: chunked"] if length is None else [
        f"Content-Length: {length}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _http_chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode("ascii") + data + b"\r\n"


def _sse(event: dict | str) -> bytes:
    """One server-sent event, as one HTTP chunk: `data: {json}` and a blank line."""
    data = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
    return _http_chunk(f"data: {data}\n\n".encode())


async def _read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[str, str, bytes]:
    """(method, path, body) of one HTTP/1.1 request. A head over MAX_HEADER_BYTES or a body over
    MAX_BODY_BYTES is a 400 raised before the body is read."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise _HTTPError(f"the request head is over {MAX_HEADER_BYTES} bytes") from None
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    parts = request_line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _HTTPError(f"malformed request line {request_line[:80]!r}")
    headers = {}
    for line in filter(None, header_lines):
        name, sep, value = line.partition(":")
        if not sep:
            raise _HTTPError(f"malformed header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    if "transfer-encoding" in headers:
        raise _HTTPError("chunked request bodies are not supported: send Content-Length")
    length = headers.get("content-length", "0")
    if not (length.isascii() and length.isdigit() and len(length) <= 12):
        raise _HTTPError(f"Content-Length must be a number of bytes, got {length!r}")
    if int(length) > MAX_BODY_BYTES:
        raise _HTTPError(f"the body is {length} bytes; the limit is {MAX_BODY_BYTES}")
    if headers.get("expect", "").lower() == "100-continue":  # curl waits for this before a large body
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    return parts[0], parts[1].split("?", 1)[0], await reader.readexactly(int(length))


async def _watch_disconnect(reader: asyncio.StreamReader) -> None:
    """Return when the client closes its side (nothing else is expected after the request)."""
    try:
        while await reader.read(4096):
            pass
    except ConnectionError:
        pass


# --- the engine side: one worker thread owns the engine ----------------------------------


class _Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds, self.counts, self.sum, self.count = tuple(bounds), [0] * len(bounds), 0.0, 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            self.counts[i] += value <= bound
        self.sum += value
        self.count += 1


class _EngineBridge:
    """Hands requests to the engine and routes its outputs back, request by request.

    Contract: only `self.worker` (one thread) ever calls the engine; everything else here runs
    on the event loop. `submit` returns the request's queue, which receives a RequestOutput per
    step that gave it a token and ends with a finished one, or receives one `_HTTPError`
    (rejected by the engine, engine failure, shutdown). An error in a step fails the requests
    then in flight (500) and the bridge goes on serving.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.streams: dict[str, asyncio.Queue] = {}
        self.inbox: list[tuple[str, object]] = []  # ("add", Request) or ("abort", request_id), in order
        self.wakeup = asyncio.Event()
        self.closing = False
        # As of the last step (so an idle server reports an idle engine without touching it).
        self.gauges = {"running": 0, "waiting": 0, "kv_usage": 0.0, "preemptions": 0, "queries": 0, "hits": 0}

    def submit(self, request: Request) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        if self.closing:  # the loop that would feed the queue has stopped
            queue.put_nowait(_HTTPError("the server is shutting down", 503, "server_error"))
            return queue
        self.streams[request.request_id] = queue
        self._send(("add", request))
        return queue

    def abort(self, request_id: str) -> None:
        if self.streams.pop(request_id, None) is not None:
            self._send(("abort", request_id))

    def _send(self, command: tuple[str, object]) -> None:
        self.inbox.append(command)
        self.wakeup.set()

    async def run(self) -> None:
        """Step while anything is in flight; sleep on `wakeup` when idle."""
        loop, busy = asyncio.get_running_loop(), False
        while not self.closing:
            if not (busy or self.inbox):
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            commands, self.inbox = self.inbox, []
            try:
                rejected, outputs, busy = await loop.run_in_executor(self.worker, self._step, commands)
            except Exception as exc:  # the engine failed: fail what is in flight, keep serving
                busy = await self._fail_all(_HTTPError(f"the engine failed: {type(exc).__name__}: {exc}",
                                                       500, "server_error"))
                continue
            for request_id, message in rejected.items():
                self._finish(request_id, _HTTPError(message))
            for out in outputs:
                if out.finish_reason == "rejected":
                    message = f"request {out.request_id!r} rejected: {out.finish_detail}"
                    self._finish(out.request_id, _HTTPError(message))
                elif out.request_id in self.streams:
                    self.streams[out.request_id].put_nowait(out)
                    if out.finished:
                        del self.streams[out.request_id]

    def _step(self, commands: list[tuple[str, object]]) -> tuple[dict[str, str], list[RequestOutput], bool]:
        """In the worker: apply the commands, run one step, read the gauges."""
        rejected = {}
        for kind, arg in commands:
            if kind == "add":
                try:
                    self.engine.add_request(arg)
                except ValueError as exc:
                    rejected[arg.request_id] = str(exc)
            else:
                self.engine.abort_request(arg)
        outputs = self.engine.step() if self.engine.has_unfinished() else []
        self.gauges = self._read_gauges()
        return rejected, outputs, self.engine.has_unfinished()

    def _read_gauges(self) -> dict[str, float]:
        engine, allocator = self.engine, self.engine.allocator
        return {"running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
                "kv_usage": 1.0 - allocator.num_free_blocks / allocator.num_blocks,
                "preemptions": engine.num_preemptions, "queries": allocator.stats.queries,
                "hits": allocator.stats.hits}

    def _finish(self, request_id: str, error: _HTTPError) -> None:
        queue = self.streams.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(error)

    async def _fail_all(self, error: _HTTPError) -> bool:
        """Send `error` to every request in flight and abort them; whether the engine is still busy."""
        request_ids = list(self.streams)
        for request_id in request_ids:
            self._finish(request_id, error)
        # A request submitted while the failing step ran is failed too: its add must not follow.
        failed = set(request_ids)
        self.inbox = [(kind, arg) for kind, arg in self.inbox if not (kind == "add" and arg.request_id in failed)]
        return await asyncio.get_running_loop().run_in_executor(self.worker, self._abort_and_flush, request_ids)

    def _abort_and_flush(self, request_ids: list[str]) -> bool:
        """In the worker: abort, then let one step hand out the aborted outputs."""
        try:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            if self.engine.has_unfinished():
                self.engine.step()
            self.gauges = self._read_gauges()
        except Exception:  # noqa: BLE001 - a broken engine stays broken; each new request gets its 500
            pass
        return self.engine.has_unfinished()

    async def close(self) -> None:
        """Stop stepping, then end every request in flight with a 503 and abort it in the engine."""
        self.closing = True
        self.wakeup.set()
        await self._fail_all(_HTTPError("the server is shutting down", 503, "server_error"))


# --- the HTTP side: routes and the completion handler ------------------------------------


class CompletionServer:
    """An OpenAI-compatible server for one LLMEngine, on a background thread (see start_server).

    `.url`, `.port`, `.model_name`; `.close()` stops accepting, ends every request in flight
    (503) and aborts it in the engine, and joins the thread; it is idempotent. A context manager.
    Not to be closed from inside one of its own handlers.
    """

    def __init__(self, engine: LLMEngine, host: str = "127.0.0.1", port: int = 0):
        self.engine, self.host = engine, host
        config = engine.model.config
        self.model_name = f"toy-gpt2-{config.n_layer}x{config.n_embd}-v{config.vocab_size}"
        self.port = port
        self._ids = itertools.count()
        self._ttft = _Histogram(TTFT_BUCKETS_S)
        self._counters = {"prompt_tokens": 0, "generation_tokens": 0, "requests": 0}
        self._connections: set[asyncio.Task] = set()
        self._closed, self._close_lock = False, threading.Lock()
        self._started, self._startup_error = threading.Event(), None
        self._thread = threading.Thread(target=self._run, args=(port,), name="lab-server", daemon=True)
        self._thread.start()
        if not self._started.wait(SHUTDOWN_TIMEOUT_S):
            raise RuntimeError("the server thread did not start")
        if self._startup_error is not None:
            raise self._startup_error

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(SHUTDOWN_TIMEOUT_S * 3)

    def __enter__(self) -> CompletionServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- the server thread ---

    def _run(self, port: int) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve(port))
        except BaseException as exc:  # noqa: BLE001 - reported to the thread that called start_server
            self._startup_error = exc
        finally:
            self._started.set()
            loop.close()

    async def _serve(self, port: int) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._bridge = _EngineBridge(self.engine)
        server = await asyncio.start_server(self._connection, self.host, port, limit=MAX_HEADER_BYTES)
        self.port = server.sockets[0].getsockname()[1]
        engine_task = asyncio.create_task(self._bridge.run())
        self._started.set()
        await self._stop.wait()
        server.close()  # stop accepting
        await self._bridge.close()  # in-flight handlers get their 503 and finish
        pending = list(self._connections)
        if pending:
            _, late = await asyncio.wait(pending, timeout=SHUTDOWN_TIMEOUT_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await engine_task
        await server.wait_closed()
        self._bridge.worker.shutdown(wait=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request per connection: read it, route it, answer, close."""
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            try:
                method, path, body = await asyncio.wait_for(_read_request(reader, writer), READ_TIMEOUT_S)
                await self._route(method, path, body, reader, writer)
            except _HTTPError as exc:
                self._respond_json(writer, exc.status, exc.body())
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass  # the client went away, or said too little too slowly
        except Exception as exc:  # noqa: BLE001 - a bug answers 500 for this request only
            error = _HTTPError(f"internal error: {type(exc).__name__}: {exc}", 500, "server_error")
            self._respond_json(writer, 500, error.body())
        finally:
            writer.close()
            self._connections.discard(task)

    async def _route(self, method: str, path: str, body: bytes, reader, writer) -> None:
        routes = {"/health": "GET", "/v1/models": "GET", "/metrics": "GET", "/v1/completions": "POST"}
        if path not in routes:
            raise _HTTPError(f"no route {path}; try /v1/completions, /v1/models, /health, /metrics",
                             404, "not_found_error")
        if method != routes[path]:
            raise _HTTPError(f"{path} takes {routes[path]}, not {method}", 405)
        if path == "/health":
            writer.write(_http_head(200, "text/plain", 0))
        elif path == "/v1/models":
            self._respond_json(writer, 200, self._models())
        elif path == "/metrics":
            text = self._metrics().encode()
            writer.write(_http_head(200, "text/plain; version=0.0.4", len(text)) + text)
        else:
            await self._complete(body, reader, writer)

    def _respond_json(self, writer: asyncio.StreamWriter, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        writer.write(_http_head(status, "application/json", len(data)) + data)

    def _models(self) -> dict:
        config = self.engine.model.config
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "lab",
                                            "max_model_len": config.n_positions,
                                            "vocab_size": config.vocab_size}]}

    async def _complete(self, body: bytes, reader, writer) -> None:
        """POST /v1/completions. The status line waits for the engine's first word (a token or a
        rejection), so a request the engine refuses is still a clean 400; a disconnect aborts."""
        request, stream, include_usage = parse_completion_request(
            body, self.engine.model.config, f"cmpl-{next(self._ids)}")
        received = time.perf_counter()
        queue = self._bridge.submit(request)
        watcher = asyncio.create_task(_watch_disconnect(reader))
        watcher.add_done_callback(lambda _: queue.put_nowait(_CLIENT_GONE))
        try:
            respond = self._stream if stream else self._respond_whole
            await respond(request, queue, writer, received, include_usage)
        except (_ClientGone, ConnectionError):
            self._bridge.abort(request.request_id)
        except BaseException:  # a bug or a cancellation: the request must not run on unattended
            self._bridge.abort(request.request_id)
            raise
        finally:
            watcher.cancel()

    async def _outputs(self, queue: asyncio.Queue, received: float):
        """The request's RequestOutputs up to the finished one (first token: into the TTFT histogram)."""
        first = True
        while True:
            item = await queue.get()
            if item is _CLIENT_GONE:
                raise _ClientGone
            if isinstance(item, _HTTPError):
                raise item
            if first and item.output_token_ids:
                self._ttft.observe(time.perf_counter() - received)
                first = False
            yield item
            if item.finished:
                return

    def _completion(self, request: Request, kind: str) -> dict:
        return {"id": request.request_id, "object": kind, "created": int(time.time()), "model": self.model_name}

    def _count(self, request: Request, num_output_tokens: int) -> None:
        self._counters["requests"] += 1
        self._counters["prompt_tokens"] += len(request.prompt_token_ids)
        self._counters["generation_tokens"] += num_output_tokens

    async def _respond_whole(self, request: Request, queue, writer, received: float, include_usage: bool) -> None:
        async for out in self._outputs(queue, received):
            last = out
        tokens = last.output_token_ids
        self._count(request, len(tokens))
        self._respond_json(writer, 200, self._completion(request, "text_completion") | {
            "choices": [_choice(tokens, last.finish_reason)], "usage": _usage(request, len(tokens))})

    async def _stream(self, request: Request, queue, writer, received: float, include_usage: bool) -> None:
        """Server-sent events: one chunk per token, the last with its finish_reason, then [DONE]."""
        header, sent = self._completion(request, "text_completion"), 0
        try:
            async for out in self._outputs(queue, received):
                new = out.output_token_ids[sent:]
                finish = [None] * (len(new) - 1) + [out.finish_reason]
                events = [_sse(header | {"choices": [_choice([t], f)]}) for t, f in zip(new, finish)]
                writer.write(b"".join(([_http_head(200, "text/event-stream")] if sent == 0 else []) + events))
                sent += len(new)
                await writer.drain()
        except _HTTPError as exc:
            if sent == 0:
                raise  # nothing sent yet: a plain error response
            writer.write(_sse(exc.body()) + _http_chunk(b""))  # ends the stream; not counted a success
            return
        self._count(request, sent)
        if include_usage:
            writer.write(_sse(header | {"choices": [], "usage": _usage(request, sent)}))
        writer.write(_sse("[DONE]") + _http_chunk(b""))

    def _metrics(self) -> str:
        """Prometheus text under vLLM's names (prefix-cache counts are in blocks here, tokens in vLLM)."""
        gauges, label = self._bridge.gauges, f'model_name="{self.model_name}"'
        lines = []

        def metric(name: str, kind: str, text: str, value: float) -> None:
            lines.extend([f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name}{{{label}}} {value}"])

        metric("vllm:num_requests_running", "gauge", "Requests in the running batch.", gauges["running"])
        metric("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.", gauges["waiting"])
        metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage, 1 means 100 percent.", gauges["kv_usage"])
        metric("vllm:num_preemptions_total", "counter", "Preemptions by the scheduler.", gauges["preemptions"])
        metric("vllm:prefix_cache_queries_total", "counter", "Prefix-cache lookups (blocks).", gauges["queries"])
        metric("vllm:prefix_cache_hits_total", "counter", "Prefix-cache hits (blocks).", gauges["hits"])
        metric("vllm:prompt_tokens_total", "counter", "Prompt tokens of completed requests.",
               self._counters["prompt_tokens"])
        metric("vllm:generation_tokens_total", "counter", "Generated tokens of completed requests.",
               self._counters["generation_tokens"])
        metric("vllm:request_success_total", "counter", "Completed requests.", self._counters["requests"])
        name, hist = "vllm:time_to_first_token_seconds", self._ttft
        lines += [f"# HELP {name} Time to first token, from request received to token sent.",
                  f"# TYPE {name} histogram"]
        for bound, count in zip(hist.bounds, hist.counts):
            lines.append(f'{name}_bucket{{{label},le="{bound}"}} {count}')
        lines += [f'{name}_bucket{{{label},le="+Inf"}} {hist.count}',
                  f"{name}_sum{{{label}}} {hist.sum}", f"{name}_count{{{label}}} {hist.count}"]
        return "\n".join(lines) + "\n"


def start_server(engine: LLMEngine, host: str = "127.0.0.1", port: int = 0) -> CompletionServer:
    """Serve `engine` over HTTP from a background thread (port 0: any free port) and return the
    handle once it accepts connections. The server owns the engine until `close()`."""
    return CompletionServer(engine, host, port)


# The model `python solution.py serve` runs by default: the lab's GPT-2 with room for ShareGPT-
# like requests (prompt + output <= 512 tokens).
SERVE_MODEL = dict(vocab_size=256, n_positions=512, n_embd=64, n_layer=2, n_head=4)


def serve(engine: LLMEngine, host: str = "127.0.0.1", port: int = 8000, duration: float | None = None) -> None:
    """`python solution.py serve`: run the server until Ctrl-C (or for `duration` seconds)."""
    with start_server(engine, host, port) as server:
        print(f"serving {server.model_name} at {server.url}  (POST /v1/completions, GET /v1/models /health "
              f"/metrics; Ctrl-C stops)", flush=True)
        try:
            threading.Event().wait(duration)
        except KeyboardInterrupt:
            print("stopping", flush=True)


# --- the load generator: open-loop Poisson traffic, vLLM's latency definitions -------------
#
# Open loop: each request is sent at its arrival time whether or not earlier ones finished,
# as users do. (A closed loop, "send the next when one returns", can never offer more than
# the server handles, so it cannot show the knee.) Each request's latencies come from the
# arrival times of its streamed chunks, as in vLLM's benchmark_serving:
#   TTFT = first chunk - send;  E2E = last chunk - send;
#   TPOT = (E2E - TTFT) / (output tokens - 1);  ITL = the gaps between consecutive chunks.


LOAD_WORKLOADS = {
    "sharegpt": SHAREGPT,
    "alpaca": ALPACA,
    "tiny": LengthStats("tiny", 8.0, 8.0, "a smoke test, not a trace"),
}


# In a text prompt every token is a one-letter word: one token each for the BPE tokenizers of
# GPT-2 or Llama ("▁q"), two bytes each for the lab's byte tokenizer.
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclasses.dataclass(frozen=True)
class WorkloadRequest:
    """One request of a synthetic workload: its prompt in both forms, and its output length."""

    prompt_token_ids: list[int]
    prompt_text: str
    max_tokens: int


def make_workload(name: str, num_prompts: int, seed: int = 0, max_model_len: int = 2048,
                  vocab_size: int = 256) -> list[WorkloadRequest]:
    """`num_prompts` requests with lengths from `sample_request_lengths(LOAD_WORKLOADS[name])`
    (prompt + output within `max_model_len`); random token ids below `vocab_size`. Deterministic."""
    if name not in LOAD_WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(LOAD_WORKLOADS)}, got {name!r}")
    prompt_lens, output_lens = sample_request_lengths(LOAD_WORKLOADS[name], num_prompts, seed, max_model_len)
    rng = np.random.default_rng(seed + 1)
    requests = []
    for n_in, n_out in zip(prompt_lens.tolist(), output_lens.tolist()):
        ids = rng.integers(0, min(vocab_size, 256), n_in).tolist()
        text = " ".join(_LETTERS[i % len(_LETTERS)] for i in ids)
        requests.append(WorkloadRequest(ids, text, n_out))
    return requests


def save_workload(requests: Sequence[WorkloadRequest], path: str) -> None:
    """JSONL that `vllm bench serve --dataset-name custom --custom-output-len -1` replays:
    one {"prompt": text, "output_tokens": n} per line."""
    with open(path, "w") as fh:
        for r in requests:
            fh.write(json.dumps({"prompt": r.prompt_text, "output_tokens": r.max_tokens}) + "\n")


def poisson_arrival_times(rate: float, num_requests: int, seed: int = 0) -> np.ndarray:
    """Send times (seconds from the start) of a Poisson process of `rate` requests per second:
    exponential gaps of mean 1/rate, the first request at 0. `rate=inf` sends everything at 0."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests per second (inf: all at once), got {rate}")
    if math.isinf(rate):
        return np.zeros(num_requests)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, num_requests)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


@dataclasses.dataclass
class StreamResult:
    """What the client saw of one streamed request (perf_counter seconds)."""

    send_time: float
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    num_output_tokens: int = 0
    num_prompt_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)


def stream_metrics(result: StreamResult) -> RequestMetrics:
    """vLLM's benchmark definitions (see above) for one successful streamed request."""
    times = result.chunk_times
    ttft, e2e = times[0] - result.send_time, times[-1] - result.send_time
    n = result.num_output_tokens
    tpot = (e2e - ttft) / (n - 1) if n > 1 else math.nan
    return RequestMetrics(ttft, tpot, np.diff(times).tolist(), e2e)


def _percentiles(values: Sequence[float], prefix: str) -> dict[str, float]:
    values = np.asarray(values, dtype=np.float64)
    stats = {"mean": np.mean, "p50": lambda x: np.percentile(x, 50), "p90": lambda x: np.percentile(x, 90),
             "p99": lambda x: np.percentile(x, 99)}
    return {f"{stat}_{prefix}": float(f(values)) if values.size else math.nan for stat, f in stats.items()}


def summarize_load(results: Sequence[StreamResult], duration: float, slo_ttft: float | None = None,
                   slo_tpot: float | None = None) -> dict[str, float]:
    """A benchmark's numbers, vLLM-style: completed / failed counts; request and output-token
    throughput over `duration` (first send to last chunk); goodput, the requests per second that
    met every SLO given (TTFT <= slo_ttft and, with 2+ tokens, TPOT <= slo_tpot; seconds);
    mean, p50, p90, p99 of TTFT, TPOT (requests with 2+ tokens), ITL (all gaps) and E2E."""
    metrics = [(r, stream_metrics(r)) for r in results if r.ok]
    good = [r for r, m in metrics if (slo_ttft is None or m.ttft <= slo_ttft)
            and (slo_tpot is None or r.num_output_tokens < 2 or m.tpot <= slo_tpot)]
    num_out = sum(r.num_output_tokens for r, _ in metrics)
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    summary = {"completed": len(metrics), "failed": len(results) - len(metrics), "duration": duration,
               "output_tokens": num_out, "request_throughput": per_second(len(metrics)),
               "output_throughput": per_second(num_out), "goodput": per_second(len(good))}
    summary |= _percentiles([m.ttft for _, m in metrics], "ttft")
    summary |= _percentiles([m.tpot for r, m in metrics if r.num_output_tokens > 1], "tpot")
    summary |= _percentiles([gap for _, m in metrics for gap in m.itl], "itl")
    summary |= _percentiles([m.e2e_latency for _, m in metrics], "e2e")
    return summary


def find_knee(rates: Sequence[float], p99_ttfts: Sequence[float], factor: float = 3.0) -> float | None:
    """The highest offered rate before p99 TTFT first exceeds `factor` times its lowest value
    (there the queue starts to grow: past it TTFT is waiting, not work); None if it never does
    in the rates tried. `rates` ascending."""
    base = min((t for t in p99_ttfts if t == t), default=math.nan)  # t == t: not NaN
    for i in range(1, len(rates)):
        if not p99_ttfts[i] <= factor * base:  # NaN (nothing completed) counts as past the knee
            return rates[i - 1]
    return None


def _bar(value: float, top: float, width: int) -> str:
    filled = 0 if not (top > 0 and value > 0) else max(1, round(width * min(value, top) / top))
    return "#" * filled + " " * (width - filled)


def format_load_chart(rates: Sequence[float], summaries: Sequence[dict], width: int = 30) -> str:
    """p99 TTFT and output throughput against the offered rate, as bars, with the knee marked."""
    ttfts = [s["p99_ttft"] * 1e3 for s in summaries]
    tputs = [s["output_throughput"] for s in summaries]
    knee = find_knee(rates, ttfts)
    top_ttft = max((t for t in ttfts if t == t), default=0.0)
    top_tput = max((t for t in tputs if t == t), default=0.0)
    lines = [f"{'offered':>9} | {'p99 TTFT (ms)':<{width + 9}} | {'output tokens/s':<{width + 8}}"]
    for rate, ttft, tput in zip(rates, ttfts, tputs):
        mark = "  <- knee" if rate == knee else ""
        lines.append(f"{rate:>5g} r/s | {_bar(ttft, top_ttft, width)} {ttft:8.1f} | "
                     f"{_bar(tput, top_tput, width)} {tput:7.0f}{mark}")
    lines.append(f"knee: {knee:g} req/s (p99 TTFT more than triples past it)" if knee is not None else
                 "knee: not reached (p99 TTFT stays within 3x of its lowest): offer higher rates")
    return "\n".join(lines)


def format_load_table(rates: Sequence[float], summaries: Sequence[dict]) -> str:
    """One row per offered rate: counts, throughput, goodput, and p50/p90/p99 of each latency (ms)."""
    head = (f"{'rate':>6} {'done':>5} {'fail':>4} {'req/s':>6} {'tok/s':>7} {'good/s':>6} | "
            + " | ".join(f"{name + ' p50/p90/p99 ms':^23}" for name in ("TTFT", "TPOT", "ITL", "E2E")))
    lines = [head]
    for rate, s in zip(rates, summaries):
        cells = " | ".join(" ".join(f"{s[f'{p}_{m}'] * 1e3:7.1f}" for p in ("p50", "p90", "p99"))
                           for m in ("ttft", "tpot", "itl", "e2e"))
        lines.append(f"{rate:>6g} {s['completed']:>5} {s['failed']:>4} {s['request_throughput']:>6.2f} "
                     f"{s['output_throughput']:>7.0f} {s['goodput']:>6.2f} | {cells}")
    return "\n".join(lines)


# --- the client: one thread per request, stdlib http.client, every read under a timeout ---


def _http_get_json(url: str, path: str, timeout: float) -> dict:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", parts.path.rstrip("/") + path)
        resp = conn.getresponse()
        body = resp.read(MAX_BODY_BYTES)
        if resp.status != 200:
            raise ValueError(f"GET {path}: HTTP {resp.status}: {body[:200]!r}")
        return json.loads(body)
    finally:
        conn.close()


def server_model_card(url: str, timeout: float = 10.0) -> dict:
    """The first model the server lists at /v1/models (its "id", and "max_model_len" where given)."""
    data = _http_get_json(url, "/v1/models", timeout).get("data") or []
    if not data:
        raise ValueError(f"{url}/v1/models lists no model")
    return data[0]


def stream_completion(url: str, payload: dict, timeout: float) -> StreamResult:
    """POST one streaming completion and time its chunks. Never raises for a failed request:
    the error is in `.error`. Bounded: at most max_tokens + 16 events, `timeout` seconds in all."""
    parts = urllib.parse.urlsplit(url)
    result = StreamResult(send_time=time.perf_counter())
    deadline = result.send_time + timeout
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("POST", parts.path.rstrip("/") + "/v1/completions", json.dumps(payload),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            result.error = f"HTTP {resp.status}: {resp.read(4096).decode(errors='replace')}"
            return result
        for _ in range(2 * (payload.get("max_tokens") or 16) + 32):  # event lines and blank lines
            line = resp.readline(MAX_BODY_BYTES)
            if not line or time.perf_counter() > deadline:
                break
            if _read_event(line.strip(), result):
                return result
        result.error = result.error or "the stream ended without data: [DONE]"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return result


def _read_event(line: bytes, result: StreamResult) -> bool:
    """Record one server-sent event line; True at `data: [DONE]`."""
    if not line.startswith(b"data:"):
        return False
    data = line[5:].strip()
    if data == b"[DONE]":
        return True
    event = json.loads(data)
    if "error" in event:
        result.error = json.dumps(event["error"])
    if event.get("choices"):
        result.chunk_times.append(time.perf_counter())
        result.num_output_tokens += len(event["choices"][0].get("token_ids") or [None])
    if event.get("usage"):  # the count the server reports wins (a chunk may hold several tokens)
        result.num_output_tokens = event["usage"].get("completion_tokens", result.num_output_tokens)
        result.num_prompt_tokens = event["usage"].get("prompt_tokens")
    return False


def completion_payload(request: WorkloadRequest, model: str, prompt_format: str = "token-ids") -> dict:
    """The body the load generator sends: greedy, streamed, usage at the end, and `ignore_eos` so
    that a real model produces exactly `max_tokens` tokens (vLLM's benchmark does the same)."""
    prompt = request.prompt_token_ids if prompt_format == "token-ids" else request.prompt_text
    return {"model": model, "prompt": prompt, "max_tokens": request.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


def run_load(url: str, payloads: Sequence[dict], rate: float, seed: int = 0,
             timeout: float = 300.0) -> tuple[list[StreamResult], float]:
    """Send `payloads` open-loop at Poisson `rate` (req/s), each on its own thread; wait for all
    (at most `timeout` after the last send). Returns the results in order and the duration from
    the first send to the last chunk."""
    arrivals = poisson_arrival_times(rate, len(payloads), seed)
    results: list[StreamResult | None] = [None] * len(payloads)

    def send(i: int) -> None:
        results[i] = stream_completion(url, payloads[i], timeout)

    threads, start = [], time.perf_counter()
    for i, at in enumerate(arrivals):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        threads.append(threading.Thread(target=send, args=(i,), daemon=True))
        threads[-1].start()
    deadline = time.perf_counter() + timeout + 5.0
    for thread in threads:
        thread.join(max(0.0, deadline - time.perf_counter()))
    # A new list: a thread still running past the deadline writes into `results`, not into this.
    done = [r or StreamResult(start, error="no answer within the timeout") for r in results]
    end = max((r.chunk_times[-1] for r in done if r.chunk_times), default=start)
    return done, end - start


def loadtest(url: str, rates: Sequence[float], num_prompts: int, workload: str = "sharegpt", seed: int = 0,
             prompt_format: str = "token-ids", model: str | None = None, max_model_len: int | None = None,
             slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
             save_workload_path: str | None = None, timeout: float = 300.0, log=print) -> list[dict]:
    """`python solution.py loadtest`: the same workload at each offered rate (ascending); prints
    a table, the chart and the first error, and returns one summary per rate. Works against any
    OpenAI-compatible /v1/completions; the model name and max_model_len come from /v1/models."""
    if prompt_format not in ("token-ids", "text"):
        raise ValueError(f"prompt_format must be 'token-ids' or 'text', got {prompt_format!r}")
    card = server_model_card(url)
    model = model or card["id"]
    max_model_len = max_model_len or card.get("max_model_len") or 2048
    requests = make_workload(workload, num_prompts, seed, max_model_len, card.get("vocab_size", 256))
    if save_workload_path:
        save_workload(requests, save_workload_path)
        log(f"wrote {len(requests)} requests to {save_workload_path} (vLLM: --dataset-name custom)")
    payloads = [completion_payload(r, model, prompt_format) for r in requests]
    mean_in, mean_out = np.mean([len(r.prompt_token_ids) for r in requests]), np.mean([r.max_tokens for r in requests])
    log(f"{url} model {model}: {num_prompts} {workload} requests (mean {mean_in:.0f} in / {mean_out:.0f} out "
        f"tokens, {prompt_format} prompts) per rate")
    rates = sorted(rates)
    summaries, first_error = [], None
    for rate in rates:
        results, duration = run_load(url, payloads, rate, seed, timeout)
        summaries.append(summarize_load(results, duration, None if slo_ttft_ms is None else slo_ttft_ms / 1e3,
                                        None if slo_tpot_ms is None else slo_tpot_ms / 1e3))
        first_error = first_error or next((r.error for r in results if r.error), None)
        log(f"  rate {rate:g} req/s: {summaries[-1]['completed']}/{num_prompts} done in {duration:.1f} s")
    slo = ", ".join(f"{k} <= {v:g} ms" for k, v in (("TTFT", slo_ttft_ms), ("TPOT", slo_tpot_ms)) if v is not None)
    log(format_load_table(rates, summaries))
    log(f"goodput: requests per second meeting {slo or 'no SLO (give --slo-ttft-ms / --slo-tpot-ms)'}")
    log(format_load_chart(rates, summaries))
    if first_error:
        log(f"first error: {first_error}")
    return summaries


# =====================================================================================
# 9. The design-review scenarios: what `python solution.py` prints
# =====================================================================================


# --- defend continuous batching ----------------------------------------------------------


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


# --- should we add speculative decoding? -------------------------------------------------


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


# The toy pair `python solution.py speculate` runs: a 4-layer target whose later layers refine
# (scale 0.2: alpha ~0.7, the middle of the table) and its 1-layer self-draft; ~0.3 s.
_SPEC_DEMO_CONFIG = ModelConfig(vocab_size=256, n_positions=256, n_embd=64, n_layer=4, n_head=4)


def _measured_speculation(k: int = 4, num_tokens: int = 100) -> str:
    """Run `speculative_generate` (Exercises 6 and 7) on the toy models, sampled at T = 1, and set
    the measured alpha and tokens per target pass beside the formulas' predictions: alpha =
    sum(min(p, q)) averaged over the positions of the output (p, q from forward_dense)."""
    target = make_early_exit_target(_SPEC_DEMO_CONFIG, 1, 0.2)
    draft = make_self_draft(target, 1)
    prompt = list(range(1, 9))
    out = speculative_generate(target, draft, prompt, SamplingParams(max_tokens=num_tokens, temperature=1.0,
                                                                     seed=0), k=k)
    text = prompt + out.token_ids
    p = token_probs(target.forward_dense(text)[len(prompt) - 1:-1], 1.0)
    q = token_probs(draft.forward_dense(text)[len(prompt) - 1:-1], 1.0)
    predicted = float(np.minimum(p, q).sum(axis=1).mean())  # acceptance_rate, row by row
    measured = estimate_alpha(out, k)
    # The proof, as arithmetic on these very rows: one accept/resample emits exactly p.
    exact = max(float(np.abs(speculative_output_distribution(pi, qi) - pi).max()) for pi, qi in zip(p, q))
    return "\n".join([
        f"Measured: your speculative_generate on the toy models, sampled at T = 1, k = {k}: a "
        f"{_SPEC_DEMO_CONFIG.n_layer}-layer target (later layers x 0.2) and its 1-layer self-draft",
        f"  {len(out.token_ids)} tokens in {out.num_target_passes} target passes",
        f"  alpha: measured {measured:.3f} (accepts / judged drafts), formula {predicted:.3f} "
        f"(sum(min(p, q)) averaged over the output's positions)",
        f"  tokens per target pass: measured {len(out.token_ids) / max(out.num_target_passes, 1):.2f}, "
        f"formula E(alpha, k) = {expected_tokens_per_step(predicted, k):.2f}",
        f"  the output keeps the target's distribution: over these {len(p)} positions, "
        f"max |P(emitted) - p| = {exact:.1e} (speculative_output_distribution, exact arithmetic)",
    ])


def scenario_speculate(alpha: float | None = None, k: int | None = None, c: float = 0.05) -> str:
    """Decide whether to add speculative decoding: the speedup table for a draft of cost c, a
    measured run of the lab's own speculative decoding on the toy models (or which stub it still
    needs), and the verdict for one (alpha, k) when given."""
    text = format_speculation_table(c)
    verdict = ""
    if alpha is not None:
        ks = [k] if k is not None else list(range(1, 9))
        best = max(ks, key=lambda kk: speculative_speedup(alpha, kk, c))
        speedup = speculative_speedup(alpha, best, c)
        verdict = (f"\n\nYour draft: alpha {alpha:g}, c {c:g}, k {best}: expected "
                   f"{expected_tokens_per_step(alpha, best):.2f} tokens per target pass, speedup {speedup:.2f}x "
                   f"({'worth adding' if speedup > 1 else 'not worth it'}); breakeven draft cost at this alpha and k: "
                   f"c = {breakeven_draft_cost(alpha, best):.3f}.")
    try:
        measured = _measured_speculation()
    except NotImplementedError as exc:  # the formulas above are provided; the run needs the exercises
        measured = f"Measured: not yet: {exc} is still a stub (write it to see your speculative decoding run here)"
    return f"{text}\n\n{measured}{verdict}"


# --- size a deployment -------------------------------------------------------------------


# The curriculum's sizing scenario: "a 13B model, 80 GB GPU, 8k context".
SEED_SIZING = {"model": "llama-2-13b", "gpu": "a100-80gb", "max_model_len": 8192}  # every default below


def format_plan(plan: DeploymentPlan, usd_per_gpu_hour: float | None = None) -> str:
    """A design-review printout of `plan`: the memory split, the concurrency and the QPS, and
    the evidence for which consumer sets the concurrency ceiling (re-planned variants: zero
    weights, half the context, the mean request's length, an 8-KV-head GQA twin). With a GPU
    price, the cost per million output tokens: the tp GPUs' price per hour over the output
    tokens the group makes in an hour."""
    m, g, tp = plan.model, plan.gpu, plan.tensor_parallel_size
    per_seq = blocks_needed(plan.max_model_len, plan.block_size)
    kv_element = m.dtype_bytes if m.kv_dtype_bytes is None else m.kv_dtype_bytes

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
        f"{m.num_kv_heads} KV heads x {m.head_dim} x {kv_element} B"
        + (" (8-bit KV cache)" if kv_element == 1 else "")
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
    if kv_element > 1:
        int8 = variant(model=with_kv_cache_dtype(m, "int8"))
        evidence.append(f"an 8-bit KV cache (--kv-cache-dtype int8) -> {int8.max_concurrent_seqs} "
                        f"({int8.num_kv_blocks} blocks)")
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
    if usd_per_gpu_hour is not None:
        def per_million(p: DeploymentPlan) -> float:
            return usd_per_gpu_hour * tp / (p.output_tokens_per_s * 3600) * 1e6
        lines.append(
            f"  Cost at ${usd_per_gpu_hour:.2f} per GPU-hour: ${per_million(plan):.2f} per 1M output tokens at the "
            f"guaranteed {plan.max_concurrent_seqs} sequences, ${per_million(typical):.2f} at the mean request's "
            f"{typical.max_concurrent_seqs}: the KV ceiling is also the price.")
    return "\n".join(lines)


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


def scenario_size(model: str = SEED_SIZING["model"], gpu: str = SEED_SIZING["gpu"],
                  max_model_len: int = SEED_SIZING["max_model_len"],
                  block_size: int = 16, gpu_memory_utilization: float = 0.9, activation_gb: float = 0.0,
                  tensor_parallel_size: int = 1, prompt_len: float | None = None,
                  output_len: float | None = None, kv_cache_dtype: str = "auto",
                  usd_per_gpu_hour: float | None = None) -> str:
    """Size a vLLM deployment (by default the curriculum's: a 13B model on an 80 GB GPU at 8k context),
    then the KV waste a paged cache removes."""
    lengths = {k: v for k, v in (("mean_prompt_len", prompt_len), ("mean_output_len", output_len)) if v is not None}
    plan = plan_deployment(model, gpu, max_model_len, block_size=block_size,
                           gpu_memory_utilization=gpu_memory_utilization,
                           activation_bytes=int(activation_gb * GB), tensor_parallel_size=tensor_parallel_size,
                           kv_cache_dtype=kv_cache_dtype, **lengths)
    return format_plan(plan, usd_per_gpu_hour) + "\n\n" + format_waste(block_size=block_size)


# --- pick a stack: vLLM vs TensorRT-LLM vs SGLang, as data -------------------------------


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


def _measured_prefix_sharing(num_requests: int = 16, system_len: int = 96, user_len: int = 16) -> str:
    """What "complex prefix sharing" is worth, on the toy engine: requests that share a system
    prompt, with prefix caching off and on. One request warms the cache first (a block becomes
    findable once its K/V is computed, so requests admitted in the same step cannot share yet)."""
    model = ToyTransformer(ModelConfig(), seed=0)
    rng = np.random.default_rng(0)
    system = rng.integers(0, model.config.vocab_size, system_len).tolist()
    prompts = [system + rng.integers(0, model.config.vocab_size, user_len).tolist() for _ in range(num_requests)]
    sampling = SamplingParams(max_tokens=8)
    runs = {}
    for caching in (False, True):
        engine = LLMEngine(model, block_size=16, enable_prefix_caching=caching)
        outs = engine.generate(prompts[:1], sampling) + engine.generate(prompts[1:], sampling)
        reused = engine.allocator.stats.hits * engine.allocator.block_size
        runs[caching] = ([o.output_token_ids for o in outs], reused, engine.prefix_cache_hit_rate)
    (plain, _, _), (cached, reused, hit_rate) = runs[False], runs[True]
    total = sum(len(p) for p in prompts)
    return (f"Measured: prefix caching on the toy engine, {num_requests} requests sharing a {system_len}-token system "
            f"prompt (+{user_len} tokens each):\n  prefill tokens computed {total} -> {total - reused} "
            f"({reused / total:.0%} served from the cache, block hit rate {hit_rate:.0%}); outputs identical: "
            f"{plain == cached}")


def scenario_stack(hardware: str | None = None, priority: str = "throughput", prefix_sharing: bool = False,
                   structured_output: bool = False) -> str:
    """Pick a stack: the example workloads, what prefix sharing saves (measured on the lab's own
    engine, or which stub it still needs), and the answer for yours when a hardware is given."""
    text = format_stack_choice()
    try:
        text += "\n\n" + _measured_prefix_sharing()
    except NotImplementedError as exc:  # the table above is provided; the run needs the exercises
        text += f"\n\nMeasured prefix sharing: not yet: {exc} is still a stub"
    if hardware is not None:
        choice = choose_stack(hardware=hardware, priority=priority, prefix_sharing=prefix_sharing,
                              structured_output=structured_output)
        text += f"\n\nYour workload: {choice.stack}, decided by: {choice.deciding_constraint}"
    return text


# An example price for the main job's cost line, not a quote: pass --usd-per-gpu-hour for yours.
EXAMPLE_USD_PER_GPU_HOUR = 2.0


def run_all_scenarios() -> tuple[str, list[str]]:
    """The four design-review scenarios in order, and the stubs any of them hit (in lab.py a
    scenario whose exercise is not written yet says so and the others still run)."""
    sections = [
        ("1. Size a vLLM deployment", lambda: scenario_size(usd_per_gpu_hour=EXAMPLE_USD_PER_GPU_HOUR)),
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


# =====================================================================================
# 10. The command line
# =====================================================================================


EXERCISES = {
    1: "blocks and the allocator: blocks_needed, BlockAllocator",
    2: "the block table: BlockTable.append_tokens / fork / truncate / slots / free",
    3: "prefix caching: hash_block, lookup / register / _evict, allocate_prompt, cache_full_blocks",
    4: "paged attention: paged_attention",
    5: "continuous batching: Scheduler.schedule / update / _preempt",
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
        lines.append(f"  Exercise {number}  {title}")
        lines.append("      to do: " + ", ".join(stubs[number]) if number in stubs else "      done")
    return "\n".join(lines)


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


def _rates(text: str) -> list[float]:
    """`--qps 1,2,4` (inf: all at once)."""
    rates = [float(r) for r in text.split(",")]
    if not all(r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"every rate must be > 0, got {text}")
    return rates


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="The design-review scenarios of the inference-serving lab. "
                                            "With no command: all four scenarios in order.")
    commands = parser.add_subparsers(dest="command", parser_class=_Parser)
    size = commands.add_parser("size", help="size a deployment: KV blocks, concurrency, QPS, KV waste")
    # choices: an unknown name is a usage error that lists the known ones, before any exercise runs.
    size.add_argument("--model", default=SEED_SIZING["model"], choices=list(MODELS))
    size.add_argument("--gpu", default=SEED_SIZING["gpu"], choices=list(GPUS))
    size.add_argument("--max-model-len", type=_positive(int), default=SEED_SIZING["max_model_len"])
    size.add_argument("--block-size", type=_positive(int), default=16)
    size.add_argument("--gpu-memory-utilization", type=_positive(float), default=0.9)
    size.add_argument("--activation-gb", type=_positive(float, allow_zero=True), default=0.0,
                      help="per-GPU activation reserve, GB")
    size.add_argument("--tp", type=_positive(int), default=1, help="tensor-parallel GPUs")
    size.add_argument("--prompt-len", type=_positive(float), help="mean prompt tokens (default: ShareGPT)")
    size.add_argument("--output-len", type=_positive(float), help="mean output tokens (default: ShareGPT)")
    size.add_argument("--kv-cache-dtype", choices=list(PLAN_KV_CACHE_DTYPES), default="auto",
                      help="KV-cache element type: auto (the model's), fp8 or int8 (1 byte)")
    size.add_argument("--usd-per-gpu-hour", type=_positive(float), help="GPU price: prints the cost per 1M tokens")
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
    # Listed for --help only: main() hands `bench ...` to tools/bench.py before parsing.
    commands.add_parser("bench", help="measure on this machine, side by side (tools/bench.py; bench --help)")
    commands.add_parser("status", help="which exercises are done")
    serve = commands.add_parser("serve", help="serve a toy model over HTTP, OpenAI-compatible, until Ctrl-C")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0: any free port")
    serve.add_argument("--duration", type=_positive(float), help="stop after this many seconds")
    for name, value in SERVE_MODEL.items():
        serve.add_argument(f"--{name.replace('_', '-')}", type=_positive(int), default=value, help="model")
    serve.add_argument("--seed", type=int, default=0, help="of the model's random weights")
    serve.add_argument("--block-size", type=_positive(int), default=16)
    serve.add_argument("--num-blocks", type=_positive(int), help="KV blocks (default: max-num-seqs full sequences)")
    serve.add_argument("--max-num-seqs", type=_positive(int), default=64)
    serve.add_argument("--max-num-batched-tokens", type=_positive(int), default=512)
    serve.add_argument("--no-chunked-prefill", action="store_true")
    serve.add_argument("--enable-prefix-caching", action="store_true")
    load = commands.add_parser("loadtest", help="open-loop load test of any OpenAI-compatible server")
    load.add_argument("--url", required=True, help="e.g. http://127.0.0.1:8000")
    load.add_argument("--qps", type=_rates, default=[1.0, 2.0, 4.0], help="offered req/s: 1,2,4 (inf: all at once)")
    load.add_argument("--num-prompts", type=_positive(int), default=50, help="requests per rate")
    load.add_argument("--workload", choices=list(LOAD_WORKLOADS), default="sharegpt")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--prompt-format", choices=("token-ids", "text"), default="token-ids",
                      help="text for servers with a real tokenizer (vLLM)")
    load.add_argument("--model", help="default: the first model of /v1/models")
    load.add_argument("--max-model-len", type=_positive(int), help="default: from /v1/models, else 2048")
    load.add_argument("--slo-ttft-ms", type=_positive(float))
    load.add_argument("--slo-tpot-ms", type=_positive(float))
    load.add_argument("--save-workload", metavar="FILE", help="write the requests as JSONL for vllm bench serve")
    load.add_argument("--timeout", type=_positive(float), default=300.0, help="seconds per request")
    return parser


def run_benchmarks(prog: str, argv: list[str]) -> int:
    """`python solution.py bench ...` is `python tools/bench.py ... --module solution`: the
    benchmarks import the module they measure, never the other way round."""
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools", "bench.py")
    return subprocess.call([sys.executable, bench, *argv, "--module", os.path.splitext(prog)[0]])


def main(argv: list[str] | None = None) -> int:
    prog = os.path.basename(sys.modules[__name__].__file__)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return run_benchmarks(prog, argv[1:])
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        if args.command is None:
            text, stubs = run_all_scenarios()
            print(text)
            if stubs:  # name the first exercise to write, not the first scenario that needed one
                raise NotImplementedError(min(stubs, key=lambda stub: int(re.search(r"\d+", stub).group())))
        elif args.command == "size":
            print(scenario_size(args.model, args.gpu, args.max_model_len, args.block_size,
                                args.gpu_memory_utilization, args.activation_gb, args.tp, args.prompt_len,
                                args.output_len, args.kv_cache_dtype, args.usd_per_gpu_hour))
        elif args.command == "batching":
            print(scenario_batching(args.slots, args.long, args.short, args.num_short))
        elif args.command == "speculate":
            print(scenario_speculate(args.alpha, args.k, args.c))
        elif args.command == "stack":
            print(scenario_stack(args.hardware, args.priority, args.prefix_sharing, args.structured_output))
        elif args.command == "serve":
            model = ToyTransformer(ModelConfig(**{k: getattr(args, k) for k in SERVE_MODEL}), seed=args.seed)
            serve(LLMEngine(model, args.num_blocks, args.block_size, args.max_num_seqs, args.max_num_batched_tokens,
                            enable_prefix_caching=args.enable_prefix_caching,
                            enable_chunked_prefill=not args.no_chunked_prefill), args.host, args.port, args.duration)
        elif args.command == "loadtest":
            loadtest(args.url, args.qps, args.num_prompts, args.workload, args.seed, args.prompt_format, args.model,
                     args.max_model_len, args.slo_ttft_ms, args.slo_tpot_ms, args.save_workload, args.timeout)
        else:
            print(status_report())
    except ValueError as exc:
        parser.exit(2, f"{prog} {args.command or ''}: error: {exc}\n".replace("  ", " "))
    except NotImplementedError as exc:
        parser.exit(1, f"{prog}: {exc} is still a stub: write it (see `python {prog} status`)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
