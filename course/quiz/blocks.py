"""Quiz 1: blocks and the allocator (Exercise 1), every answer computed by the module under quiz."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from .questions import Question, ceil_div, question


def quiz_blocks(lab: ModuleType, rng: np.random.Generator) -> list[Question]:
    B = int(rng.choice([4, 8, 16, 32]))
    n = B * int(rng.integers(1, 6)) + int(rng.choice([-1, 0, 1]))
    blocks = lab.blocks_needed(n, B)
    ours = ceil_div(n, B)
    q1 = question(
        f"A prompt of {n} tokens, block size {B}: how many KV blocks does it occupy?", blocks, ours,
        f"blocks_needed({n}, {B}) = ceil({n} / {B}) = {ours}: block j holds tokens {B}j to {B}j + {B - 1} "
        f"(0-based), so the last token, number {n - 1}, is in block {(n - 1) // B}. A new block opens when "
        f"token {B}j arrives, not when the block before it has just filled.")
    empty = blocks * B - n
    q2 = question(
        "...and how many of those blocks' slots stand empty?", empty, ours * B - n,
        f"{ours} blocks hold {ours * B} slots and {n} are used: {ours * B - n} empty, all in the last block. "
        f"Paging wastes less than one block per sequence; a slab reserved for max_model_len tokens wastes "
        f"everything the request never uses.")
    N = int(rng.integers(6, 13))
    a = int(rng.integers(3, N))
    s = int(rng.integers(1, a))
    pool = lab.BlockAllocator(N, B)
    ids = [pool.allocate() for _ in range(a)]
    for block in ids[:s]:
        pool.incref(block)
    for block in ids:
        pool.free(block)
    q3 = question(
        f"A pool of {N} blocks. One table allocates {a} blocks and shares {s} of them with a second table "
        f"(incref); then the first table frees all {a}. How many blocks does num_free_blocks report now?",
        pool.num_free_blocks, N - s,
        f"A block goes back to the pool only when its reference count falls to 0: of the {a}, the {s} shared "
        f"still hold one reference each (the second table's), the rest ({a - s}) went back: {N} - {s} = "
        f"{N - s} free.")
    return [q1, q2, q3]
