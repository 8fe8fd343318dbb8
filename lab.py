# GENERATED from solution.py by tools/make_lab.py: do not edit, edit solution.py and regenerate.
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

import collections
import dataclasses
import itertools
import math
import sys
from collections.abc import Sequence

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
    arrives, never when the last block has just been filled.
    """
    raise NotImplementedError("Exercise 1: blocks_needed")


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Content hash of one FULL block, chained on the hash of the block before it.

    Chaining makes the hash name the whole prefix, not just this block's tokens: two
    blocks with the same tokens after different prefixes hold different K/V (attention
    saw different pasts), so they must never be confused.
    """
    raise NotImplementedError("Exercise 3: hash_block")


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
    - a block is in the free queue if and only if its reference count is 0;
    - the free queue is in least-recently-freed order: `allocate` takes from the front,
      `free` appends to the back. With prefix caching on, a freed block keeps its hash and
      stays findable until `allocate` reuses it (lazy eviction, least recently used first);
    - every error leaves the allocator exactly as it was.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        # An ordered dict is a queue with O(1) removal from the middle (prefix-cache revival).
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._block_hash: dict[int, int] = {}  # block id -> its hash, while it is cached
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate()` can hand out now: never used, freed, or cached but unreferenced."""
        raise NotImplementedError("Exercise 1: BlockAllocator.num_free_blocks")

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is out of range 0..{self.num_blocks - 1}")

    def allocate(self) -> int:
        """A block with reference count 1, the least recently freed one.

        Raises OutOfBlocksError when the pool is empty. A block taken from the front of the
        queue may still be in the prefix cache: it is evicted now, not earlier.
        """
        raise NotImplementedError("Exercise 1: BlockAllocator.allocate")

    def incref(self, block_id: int) -> None:
        """Share a block that is in use: one more table holds it."""
        raise NotImplementedError("Exercise 1: BlockAllocator.incref")

    def free(self, block_id: int) -> None:
        """Drop one reference; at zero the block goes to the back of the free queue."""
        raise NotImplementedError("Exercise 1: BlockAllocator.free")

    def ref_count(self, block_id: int) -> int:
        """How many tables (or prefix-cache lookups) hold this block."""
        raise NotImplementedError("Exercise 1: BlockAllocator.ref_count")

    # --- prefix caching (Exercise 3) ---------------------------------------------------

    def is_cached(self, block_id: int) -> bool:
        """Whether the prefix cache can hand this block to another sequence."""
        return block_id in self._block_hash

    def get_cached_block(self, block_hash: int) -> int | None:
        """The block cached under this hash, without taking a reference (a peek, for planning)."""
        return self._cached.get(block_hash) if self.enable_prefix_caching else None

    def lookup(self, block_hash: int) -> int | None:
        """A prefix-cache hit: take a reference on the cached block and return it.

        A hit on an evictable block (reference count 0) revives it: it leaves the free
        queue. Returns None on a miss, or when prefix caching is off.
        """
        raise NotImplementedError("Exercise 3: BlockAllocator.lookup")

    def register(self, block_id: int, block_hash: int) -> None:
        """Make a full block findable under its chained hash (no-op when caching is off).

        If another block already holds the same prefix, the first one stays the cached copy.
        """
        raise NotImplementedError("Exercise 3: BlockAllocator.register")

    def _evict(self, block_id: int) -> None:
        """Forget a cached block's hash: it is about to hold other tokens."""
        raise NotImplementedError("Exercise 3: BlockAllocator._evict")


class BlockTable:
    """One sequence's view of the cache: token `i` lives in `block_ids[i // block_size]`
    at offset `i % block_size`.

    Invariant: a block that another table or the prefix cache can see is never written.
    Before new tokens land in such a block, the table takes a private copy and reports the
    `(src, dst)` pair, so the caller can copy the K/V data (copy-on-write).
    """

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.block_ids: list[int] = []
        self.token_ids: list[int] = []
        self._block_hashes: list[int] = []  # chained hashes of the full blocks, in order

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def _is_shared(self, block_id: int) -> bool:
        return self.allocator.ref_count(block_id) > 1 or self.allocator.is_cached(block_id)

    def _register_full_blocks(self) -> None:
        """Register every full block that has no hash yet (prefix caching only)."""
        if not self.allocator.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(self._block_hashes), self.num_tokens // bs):
            parent = self._block_hashes[-1] if self._block_hashes else None
            block_hash = hash_block(parent, self.token_ids[i * bs : (i + 1) * bs])
            self._block_hashes.append(block_hash)
            self.allocator.register(self.block_ids[i], block_hash)

    def append_tokens(self, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Append tokens, allocating a block only when the last one is full.

        Returns the copy-on-write pairs `(src, dst)` whose K/V the caller must copy before
        writing. On OutOfBlocksError nothing changes (the table asks before it acts).
        """
        raise NotImplementedError("Exercise 2: BlockTable.append_tokens")

    def allocate_prompt(self, token_ids: Sequence[int]) -> int:
        """Fill an empty table with a prompt, reusing the longest cached run of full blocks.

        Returns how many leading tokens already have K/V (`num_computed_tokens`). When the
        whole prompt is cached, the last token is still reported as not computed, so the
        step that processes it produces the logits for the first output token. (Writing
        that token's K/V again into the cached block stores the value already there.)
        On OutOfBlocksError nothing changes: cache hits taken so far are given back.
        """
        raise NotImplementedError("Exercise 3: BlockTable.allocate_prompt")

    def fork(self) -> BlockTable:
        """A second sequence that shares every block of this one (parallel sampling)."""
        raise NotImplementedError("Exercise 2: BlockTable.fork")

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens; release the blocks no longer needed.

        This is how rejected speculative tokens are rolled back. A block that keeps some
        tokens stays; the next append copies it first if it is shared or cached.
        """
        raise NotImplementedError("Exercise 2: BlockTable.truncate")

    def slots(self, start: int, stop: int) -> np.ndarray:
        """Physical slot ids `block * block_size + offset` of positions `start..stop-1`."""
        raise NotImplementedError("Exercise 2: BlockTable.slots")

    def free(self) -> None:
        """Release every block; the table is empty afterwards."""
        raise NotImplementedError("Exercise 2: BlockTable.free")


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
    import inspect
    import re

    source = inspect.getsource(sys.modules[module_name or __name__])
    stubs: dict[int, list[str]] = {}
    for number, name in re.findall(r'raise NotImplementedError\("Exercise (\d+): ([\w.]+)"\)', source):
        stubs.setdefault(int(number), []).append(name)
    return stubs


def print_status() -> None:
    stubs = unsolved_exercises()
    import os

    print(f"{os.path.basename(sys.modules[__name__].__file__)}: the inference-serving lab")
    for number, title in EXERCISES.items():
        state = "to do: " + ", ".join(stubs[number]) if number in stubs else "done"
        print(f"  Exercise {number}  {title:<75} {state}")


def main(argv: list[str] | None = None) -> int:
    print_status()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
