"""Quiz 2: the block table (Exercise 2), every answer computed by the module under quiz."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from .questions import Question, ceil_div, plural, question


def quiz_block_table(lab: ModuleType, rng: np.random.Generator) -> list[Question]:
    B = int(rng.choice([4, 8, 16]))
    return [_append_one(lab, rng, B), _slot_of(lab, rng, B), _fork_and_append(lab, rng, B), _truncate(lab, rng, B)]


def _append_one(lab: ModuleType, rng: np.random.Generator, B: int) -> Question:
    """One token appended to a table of n: how many new blocks."""
    n = B * int(rng.integers(1, 4))
    if rng.random() < 0.5:
        n -= int(rng.integers(1, B))
    pool = lab.BlockAllocator(64, B)
    table = lab.BlockTable(pool)
    table.append_tokens([7] * n)
    before = pool.num_free_blocks
    table.append_tokens([7])
    full = n % B == 0
    return question(
        f"A block table (block size {B}) holds {n} tokens. One more token is appended: how many new blocks "
        f"does the pool hand out?", before - pool.num_free_blocks, int(full),
        f"{n} tokens fill {plural(ceil_div(n, B), 'block')}, the last with {n - (ceil_div(n, B) - 1) * B} of {B} slots "
        + ("used: it is full, so token number " + str(n) + " opens a new block (1)." if full else
           "used: it has room, so the token goes there (0 new blocks).")
        + " A block taken one token early wastes a block per sequence; one taken late writes past the table's "
          "end, into another sequence's block.")


def _slot_of(lab: ModuleType, rng: np.random.Generator, B: int) -> Question:
    """Which physical slot holds token i of a table whose blocks are scattered."""
    pool = lab.BlockAllocator(16, B)
    taken = [pool.allocate() for _ in range(16)]
    for block in rng.permutation(taken)[: int(rng.integers(4, 9))]:  # the table gets these, in this order
        pool.free(int(block))
    m = int(rng.integers(2 * B + 1, 4 * B))
    table = lab.BlockTable(pool)
    table.append_tokens([7] * m)
    i = int(rng.integers(B, m))
    ids = [int(b) for b in table.block_ids]
    ours = ids[i // B] * B + i % B if i // B < len(ids) else None
    return question(
        f"A sequence of {m} tokens has the block table {ids} (block size {B}). Which physical slot "
        f"(block * block_size + offset) holds its token {i} (0-based)?",
        int(table.slots(i, i + 1)[0]), ours,
        f"Token {i} is in logical block {i} // {B} = {i // B}, at offset {i} % {B} = {i % B}; the table maps "
        f"logical block {i // B} to physical block {ids[i // B] if ours is not None else '?'}: slot "
        f"{ids[i // B] if ours is not None else '?'} * {B} + {i % B} = {ours}.")


def _fork_and_append(lab: ModuleType, rng: np.random.Generator, B: int) -> Question:
    """A forked table appends: how many distinct blocks (copy-on-write)."""
    pool = lab.BlockAllocator(32, B)
    n = B * int(rng.integers(1, 4)) + (int(rng.integers(1, B)) if rng.random() < 0.75 else 0)
    parent = lab.BlockTable(pool)
    parent.append_tokens([7] * n)
    child = parent.fork()
    extra = int(rng.integers(1, B + 2))
    child.append_tokens([8] * extra)
    p, copy = ceil_div(n, B), int(n % B != 0)
    grown = ceil_div(n + extra, B) - p
    return question(
        f"A table of {n} tokens (block size {B}) is forked (parallel sampling), and the fork appends "
        f"{plural(extra, 'token')}. How many distinct blocks are in use now, both tables together?",
        pool.num_blocks - pool.num_free_blocks, p + copy + grown,
        f"The fork shares {'its' if p == 1 else 'all'} {plural(p, 'block')} (reference count 2). "
        + ("Its last block has room but is shared, so before writing into it the fork takes a private copy "
           "(copy-on-write: 1 block), " if copy else "Its last block is full, so nothing is copied, ")
        + f"then blocks_needed({n + extra}, {B}) - {p} = {grown} new: {p} + {copy} + {grown} = "
          f"{p + copy + grown}.")


def _truncate(lab: ModuleType, rng: np.random.Generator, B: int) -> Question:
    """A table truncated (speculative tokens rolled back): how many blocks it keeps."""
    n = int(rng.integers(2 * B + 1, 5 * B))
    keep = int(rng.integers(1, n))
    table = lab.BlockTable(lab.BlockAllocator(16, B))
    table.append_tokens([7] * n)
    table.truncate(keep)
    return question(
        f"A table holds {n} tokens in blocks of {B} and is truncated to {keep} tokens (rejected speculative "
        f"tokens rolled back). How many blocks does it keep?", len(table.block_ids), ceil_div(keep, B),
        f"It keeps blocks_needed({keep}, {B}) = {ceil_div(keep, B)} of its {ceil_div(n, B)} and frees the "
        f"rest, the last first; a kept block that is now partly full loses its hash, and is copied before the "
        f"next write if it is shared.")
