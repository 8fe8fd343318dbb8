"""The students' spec: run `pytest` (red), make it green exercise by exercise.

`pytest -m exercise2` runs one exercise. `LAB_MODULE=solution pytest` runs the reference.
Each test checks one idea against an independent reference written plainly here.
"""

from __future__ import annotations

import importlib
import inspect

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from conftest import lab


# =====================================================================================
# The workflow: lab and solution expose the same contract
# =====================================================================================


def public_api(module) -> dict[str, str]:
    """Public names defined in the module, with the signatures of functions, classes and methods."""
    api = {}
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", module.__name__) != module.__name__:
            continue
        if inspect.isfunction(obj) or inspect.isclass(obj):
            try:
                api[name] = str(inspect.signature(obj))
            except ValueError:  # classes whose signature is a builtin's, e.g. exceptions
                api[name] = "builtin"
        if inspect.isclass(obj):
            for member, value in vars(obj).items():
                if member.startswith("_") and member != "__init__":
                    continue
                if inspect.isfunction(value):
                    api[f"{name}.{member}"] = str(inspect.signature(value))
                elif isinstance(value, property):
                    api[f"{name}.{member}"] = "property"
        elif not inspect.ismodule(obj) and not callable(obj):
            api[name] = type(obj).__name__
    return api


@pytest.mark.provided
def test_lab_and_solution_expose_the_same_public_names_and_signatures():
    lab_api = public_api(importlib.import_module("lab"))
    solution_api = public_api(importlib.import_module("solution"))
    missing = sorted(set(solution_api) - set(lab_api))
    extra = sorted(set(lab_api) - set(solution_api))
    differ = sorted(n for n in set(lab_api) & set(solution_api) if lab_api[n] != solution_api[n])
    assert not (missing or extra or differ), (
        f"lab.py drifted from solution.py: missing {missing}, extra {extra}, different signatures {differ}; "
        "regenerate it with `python tools/make_lab.py`"
    )


# =====================================================================================
# Exercise 1: blocks and the allocator
# =====================================================================================


@pytest.mark.exercise1
@pytest.mark.parametrize(
    "num_tokens, expected",
    [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)],
)
def test_blocks_needed_at_the_block_boundary(num_tokens, expected):
    got = lab.blocks_needed(num_tokens, 16)
    assert got == expected, (
        f"{num_tokens} tokens in blocks of 16 need {expected} blocks, got {got}: "
        "a new block is needed only when token 16 (0-based) arrives"
    )


@pytest.mark.exercise1
@given(num_tokens=st.integers(0, 10_000), block_size=st.integers(1, 64))
def test_blocks_needed_is_the_smallest_count_that_holds_every_token(num_tokens, block_size):
    n = lab.blocks_needed(num_tokens, block_size)
    assert n * block_size >= num_tokens, f"{n} blocks of {block_size} cannot hold {num_tokens} tokens"
    assert n == 0 or (n - 1) * block_size < num_tokens, f"{n} blocks of {block_size} is one too many for {num_tokens}"


@pytest.mark.exercise1
def test_allocate_hands_out_distinct_blocks_with_one_reference():
    alloc = lab.BlockAllocator(num_blocks=4, block_size=16)
    blocks = [alloc.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3], f"expected every block id 0..3 exactly once, got {blocks}"
    assert all(alloc.ref_count(b) == 1 for b in blocks), "a freshly allocated block has reference count 1"
    assert alloc.num_free_blocks == 0


@pytest.mark.exercise1
def test_allocate_from_an_empty_pool_raises_out_of_blocks_and_changes_nothing():
    alloc = lab.BlockAllocator(num_blocks=2, block_size=16)
    a, b = alloc.allocate(), alloc.allocate()
    with pytest.raises(lab.OutOfBlocksError):
        alloc.allocate()
    assert alloc.num_free_blocks == 0 and alloc.ref_count(a) == 1 and alloc.ref_count(b) == 1, (
        "a failed allocate must leave the allocator exactly as it was"
    )


@pytest.mark.exercise1
def test_a_shared_block_returns_to_the_pool_only_after_the_last_free():
    alloc = lab.BlockAllocator(num_blocks=2, block_size=16)
    block = alloc.allocate()
    alloc.incref(block)
    alloc.free(block)
    assert alloc.ref_count(block) == 1, "free drops ONE reference"
    assert alloc.num_free_blocks == 1, "freed a block that another table still uses"
    alloc.free(block)
    assert alloc.ref_count(block) == 0 and alloc.num_free_blocks == 2, "the last free returns the block to the pool"


@pytest.mark.exercise1
def test_double_free_is_an_error_that_changes_nothing():
    alloc = lab.BlockAllocator(num_blocks=2, block_size=16)
    block = alloc.allocate()
    alloc.free(block)
    with pytest.raises(ValueError, match="(?i)free"):
        alloc.free(block)
    assert alloc.num_free_blocks == 2 and alloc.ref_count(block) == 0, "a rejected double free changed the pool"
    # The block is in the pool once, not twice: two allocations give two different blocks.
    assert alloc.allocate() != alloc.allocate(), "a double free put the same block into the pool twice"


@pytest.mark.exercise1
@pytest.mark.parametrize("bad_id", [-1, 4, 100])
def test_unknown_block_ids_are_rejected(bad_id):
    alloc = lab.BlockAllocator(num_blocks=4, block_size=16)
    alloc.allocate()
    for call in (alloc.free, alloc.incref, alloc.ref_count):
        with pytest.raises(ValueError, match="range"):
            call(bad_id)
    assert alloc.num_free_blocks == 3


@pytest.mark.exercise1
def test_incref_of_a_free_block_is_an_error():
    alloc = lab.BlockAllocator(num_blocks=2, block_size=16)
    with pytest.raises(ValueError):
        alloc.incref(0)
    assert alloc.ref_count(0) == 0 and alloc.num_free_blocks == 2


@pytest.mark.exercise1
def test_freed_blocks_are_reused_least_recently_freed_first():
    alloc = lab.BlockAllocator(num_blocks=3, block_size=4)
    a, b, c = (alloc.allocate() for _ in range(3))
    for block in (b, c, a):
        alloc.free(block)
    got = [alloc.allocate() for _ in range(3)]
    assert got == [b, c, a], f"the free pool is a queue: freed {[b, c, a]}, reallocated {got}"


# =====================================================================================
# Exercise 2: the block table
# =====================================================================================


def table_with(tokens, num_blocks=16, block_size=4, caching=False):
    alloc = lab.BlockAllocator(num_blocks, block_size, enable_prefix_caching=caching)
    table = lab.BlockTable(alloc)
    table.append_tokens(list(tokens))
    return alloc, table


@pytest.mark.exercise2
@pytest.mark.parametrize("num_tokens, blocks", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_append_allocates_at_the_boundary_and_not_before(num_tokens, blocks):
    alloc, table = table_with(range(num_tokens))
    assert len(table.block_ids) == blocks, (
        f"{num_tokens} tokens in blocks of 4 should hold {blocks} blocks, the table holds {len(table.block_ids)}"
    )
    assert alloc.num_free_blocks == 16 - blocks


@pytest.mark.exercise2
def test_append_one_token_at_a_time_allocates_only_when_the_last_block_is_full():
    alloc = lab.BlockAllocator(16, 4)
    table = lab.BlockTable(alloc)
    for n in range(1, 13):
        before = len(table.block_ids)
        table.append_tokens([n])
        grew = len(table.block_ids) - before
        if (n - 1) % 4 == 0:
            assert grew == 1, f"token {n - 1} starts a new block, but none was allocated"
        else:
            assert grew == 0, f"append allocated a block for token {n - 1} while the last one still had room"
    assert table.token_ids == list(range(1, 13)) and table.num_tokens == 12


@pytest.mark.exercise2
def test_slots_map_positions_through_the_block_table():
    alloc = lab.BlockAllocator(8, 4)
    for _ in range(3):
        alloc.allocate()  # make the table's blocks start at a non-zero id
    table = lab.BlockTable(alloc)
    table.append_tokens(range(10))
    expected = [table.block_ids[p // 4] * 4 + p % 4 for p in range(10)]
    got = list(table.slots(0, 10))
    assert got == expected, (
        f"slot = block_ids[pos // block_size] * block_size + pos % block_size; expected {expected}, got {got}"
    )
    assert list(table.slots(3, 7)) == expected[3:7], "slots(start, stop) covers positions start..stop-1"


@pytest.mark.exercise2
def test_slots_outside_the_table_are_rejected():
    _, table = table_with(range(5))
    with pytest.raises(ValueError):
        table.slots(0, 6)


@pytest.mark.exercise2
def test_append_that_runs_out_of_blocks_changes_nothing():
    alloc, table = table_with(range(6), num_blocks=3)
    blocks, tokens = list(table.block_ids), list(table.token_ids)
    with pytest.raises(lab.OutOfBlocksError):
        table.append_tokens(range(100, 107))  # needs 2 more blocks, 1 is free
    assert table.block_ids == blocks and table.token_ids == tokens, "a failed append changed the table"
    assert alloc.num_free_blocks == 1, "a failed append kept (leaked) the blocks it had taken"


@pytest.mark.exercise2
def test_fork_shares_every_block():
    alloc, parent = table_with(range(6))
    child = parent.fork()
    assert child.block_ids == parent.block_ids and child.token_ids == parent.token_ids
    assert all(alloc.ref_count(b) == 2 for b in parent.block_ids), "fork must take a reference on every block"
    assert alloc.num_free_blocks == 14, "fork must not allocate"


@pytest.mark.exercise2
def test_a_forked_table_copies_the_shared_last_block_before_writing():
    alloc, parent = table_with(range(6))  # the last block holds 2 of 4 tokens
    child = parent.fork()
    shared_last = parent.block_ids[-1]
    copies = child.append_tokens([99])
    assert child.block_ids[-1] != shared_last, "a forked table wrote into the shared last block without a copy"
    assert copies == [(shared_last, child.block_ids[-1])], f"expected the copy pair (src, dst), got {copies}"
    assert alloc.ref_count(shared_last) == 1, "after the copy the child no longer holds the old block"
    assert parent.block_ids[0] == child.block_ids[0] and alloc.ref_count(parent.block_ids[0]) == 2, (
        "full blocks stay shared: only the block being written is copied"
    )
    assert parent.token_ids == list(range(6)), "the parent's tokens changed"


@pytest.mark.exercise2
def test_a_forked_table_with_a_full_last_block_needs_no_copy():
    alloc, parent = table_with(range(8))
    child = parent.fork()
    copies = child.append_tokens([99])
    assert copies == [], "the shared last block is full: the new token goes to a new block, nothing to copy"
    assert child.block_ids[:2] == parent.block_ids


@pytest.mark.exercise2
def test_a_private_last_block_is_written_in_place():
    _, table = table_with(range(6))
    last = table.block_ids[-1]
    assert table.append_tokens([7]) == [] and table.block_ids[-1] == last, "copied a block nobody else can see"


@pytest.mark.exercise2
def test_truncate_releases_the_blocks_no_longer_needed():
    alloc, table = table_with(range(10))
    table.truncate(5)
    assert len(table.block_ids) == 2 and table.token_ids == list(range(5)), "5 tokens in blocks of 4 keep 2 blocks"
    assert alloc.num_free_blocks == 14, "truncate leaked the block it dropped"
    table.truncate(4)
    assert len(table.block_ids) == 1, "truncating to exactly one full block keeps one block"
    with pytest.raises(ValueError):
        table.truncate(5)


@pytest.mark.exercise2
def test_free_releases_every_block():
    alloc, table = table_with(range(10))
    child = table.fork()
    table.free()
    assert table.block_ids == [] and table.num_tokens == 0
    assert alloc.num_free_blocks == 13, "the child still holds its 3 blocks"
    child.free()
    assert alloc.num_free_blocks == 16, "freeing every table returns every block"


# =====================================================================================
# Exercise 3: prefix caching
# =====================================================================================


@pytest.mark.exercise3
def test_block_hash_is_chained_on_the_parent():
    a = lab.hash_block(None, [1, 2, 3, 4])
    assert a == lab.hash_block(None, [1, 2, 3, 4]), "the hash must be deterministic"
    assert lab.hash_block(a, [5, 6, 7, 8]) != lab.hash_block(None, [5, 6, 7, 8]), (
        "equal blocks after different prefixes must hash differently: chain the parent's hash in"
    )
    assert a != lab.hash_block(None, [1, 2, 3, 5])


@pytest.mark.exercise3
def test_a_cached_prefix_is_reused():
    alloc = lab.BlockAllocator(16, 4, enable_prefix_caching=True)
    first = lab.BlockTable(alloc)
    assert first.allocate_prompt(list(range(10))) == 0, "nothing is cached yet"
    second = lab.BlockTable(alloc)
    computed = second.allocate_prompt(list(range(10)) + [77])
    assert computed == 8, f"the two full blocks (8 tokens) are cached, reported {computed}"
    assert second.block_ids[:2] == first.block_ids[:2], "the cached blocks must be shared, not copied"
    assert second.block_ids[2] != first.block_ids[2], "a partial block is never shared through the cache"
    assert alloc.stats.hits == 2


@pytest.mark.exercise3
def test_a_block_that_matches_after_a_different_prefix_is_not_a_hit():
    alloc = lab.BlockAllocator(16, 4, enable_prefix_caching=True)
    lab.BlockTable(alloc).allocate_prompt([1, 2, 3, 4, 5, 6, 7, 8, 9])
    other = lab.BlockTable(alloc)
    computed = other.allocate_prompt([0, 0, 0, 0, 5, 6, 7, 8, 9])
    assert computed == 0, "block 2 matches, but its parent does not: the hash must name the whole prefix"


@pytest.mark.exercise3
def test_a_fully_cached_prompt_still_computes_its_last_token():
    alloc = lab.BlockAllocator(16, 4, enable_prefix_caching=True)
    lab.BlockTable(alloc).allocate_prompt(list(range(8)))
    again = lab.BlockTable(alloc)
    computed = again.allocate_prompt(list(range(8)))
    assert computed == 7, (
        f"the whole prompt is cached but the last token must still run to produce logits: expected 7, got {computed}"
    )


@pytest.mark.exercise3
def test_a_freed_cached_block_stays_findable_until_it_is_needed():
    alloc = lab.BlockAllocator(4, 4, enable_prefix_caching=True)
    table = lab.BlockTable(alloc)
    table.allocate_prompt(list(range(8)))
    cached = list(table.block_ids)
    table.free()
    assert alloc.num_free_blocks == 4, "a cached block with no reference counts as free (evictable)"
    again = lab.BlockTable(alloc)
    assert again.allocate_prompt(list(range(8)) + [9]) == 8, "freed blocks keep their hash until reused"
    assert again.block_ids[:2] == cached and all(alloc.ref_count(b) == 1 for b in cached), (
        "a hit on an evictable block revives it with one reference"
    )
    assert alloc.num_free_blocks == 1, "revived blocks leave the free pool: 2 hits + 1 new block of 4 leave 1 free"


@pytest.mark.exercise3
def test_eviction_takes_the_least_recently_used_cached_block():
    alloc = lab.BlockAllocator(3, 4, enable_prefix_caching=True)
    old, new = lab.BlockTable(alloc), lab.BlockTable(alloc)
    old.allocate_prompt([1, 1, 1, 1])
    new.allocate_prompt([2, 2, 2, 2])
    old.free()
    new.free()
    filler = lab.BlockTable(alloc)
    filler.append_tokens(range(8))  # needs 2 blocks: the never-used one, then the LRU cached one
    assert alloc.stats.evictions == 1
    filler.free()
    assert lab.BlockTable(alloc).allocate_prompt([2, 2, 2, 2, 5]) == 4, (
        "evicted the most recently used cached block; the least recently used must go first"
    )


@pytest.mark.exercise3
def test_a_referenced_cached_block_is_never_evicted():
    alloc = lab.BlockAllocator(2, 4, enable_prefix_caching=True)
    holder = lab.BlockTable(alloc)
    holder.allocate_prompt([1, 2, 3, 4])
    other = lab.BlockTable(alloc)
    other.append_tokens([9])
    with pytest.raises(lab.OutOfBlocksError):
        lab.BlockTable(alloc).append_tokens([5])
    assert alloc.ref_count(holder.block_ids[0]) == 1 and alloc.stats.evictions == 0, (
        "a cached block that a table still holds was evicted"
    )


@pytest.mark.exercise3
def test_stats_count_queries_hits_and_evictions():
    alloc = lab.BlockAllocator(8, 2, enable_prefix_caching=True)
    lab.BlockTable(alloc).allocate_prompt([1, 2, 3, 4, 5])
    lab.BlockTable(alloc).allocate_prompt([1, 2, 3, 9, 5])
    assert alloc.stats.hits == 1, f"one block was found: hits {alloc.stats.hits}"
    assert alloc.stats.queries >= 2, "every lookup is a query"
    assert alloc.stats.evictions == 0


@pytest.mark.exercise3
def test_a_cached_block_is_copied_before_it_is_written_after_truncate():
    alloc = lab.BlockAllocator(8, 4, enable_prefix_caching=True)
    table = lab.BlockTable(alloc)
    table.allocate_prompt(list(range(8)))
    cached = table.block_ids[1]
    table.truncate(6)
    copies = table.append_tokens([42])
    assert copies == [(cached, table.block_ids[1])] and table.block_ids[1] != cached, (
        "the block is still in the prefix cache under its old content: writing into it would corrupt the cache"
    )
    assert lab.BlockTable(alloc).allocate_prompt(list(range(8)) + [1]) == 8, "the cached prefix must stay intact"


@pytest.mark.exercise3
def test_allocate_prompt_that_does_not_fit_changes_nothing():
    alloc = lab.BlockAllocator(3, 4, enable_prefix_caching=True)
    cached = lab.BlockTable(alloc)
    cached.allocate_prompt([1, 2, 3, 4])
    cached.free()  # the block stays cached, evictable
    busy = lab.BlockTable(alloc)
    busy.append_tokens([7])
    refs = [alloc.ref_count(b) for b in range(3)]
    with pytest.raises(lab.OutOfBlocksError):
        lab.BlockTable(alloc).allocate_prompt([1, 2, 3, 4, 5, 6, 7, 8, 9])  # hit + 2 more, 1 left after revival
    assert [alloc.ref_count(b) for b in range(3)] == refs and alloc.num_free_blocks == 2, (
        "a failed allocate_prompt must give back the cache hits it took"
    )


# --- the allocator as a state machine ------------------------------------------------


class PagedCacheMachine(RuleBasedStateMachine):
    """Random allocate/append/fork/truncate/allocate_prompt/free across tables.

    Checked after every step: each block's reference count equals the number of tables
    holding it; no block is free and in a table; free + used = total; tables that share a
    block hold the same tokens in it; after every table is freed, every block is free.
    """

    tables = Bundle("tables")

    def __init__(self):
        super().__init__()
        self.alloc = lab.BlockAllocator(12, 3, enable_prefix_caching=True)
        self.live: list = []

    @rule(target=tables, prompt=st.lists(st.integers(0, 3), max_size=10))
    def new_table(self, prompt):
        table = lab.BlockTable(self.alloc)
        try:
            table.allocate_prompt(prompt)
        except lab.OutOfBlocksError:
            assert table.block_ids == [], "a failed allocate_prompt left blocks in the table"
        self.live.append(table)
        return table

    @rule(table=tables, tokens=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def append(self, table, tokens):
        assume(table in self.live)
        before = (list(table.block_ids), list(table.token_ids))
        try:
            table.append_tokens(tokens)
        except lab.OutOfBlocksError:
            assert (table.block_ids, table.token_ids) == before, "a failed append changed the table"

    @rule(target=tables, table=tables)
    def fork(self, table):
        assume(table in self.live)
        child = table.fork()
        self.live.append(child)
        return child

    @rule(table=tables, data=st.data())
    def truncate(self, table, data):
        assume(table in self.live)
        table.truncate(data.draw(st.integers(0, table.num_tokens)))

    @rule(table=tables)
    def free(self, table):
        assume(table in self.live)
        table.free()
        self.live.remove(table)

    @invariant()
    def reference_counts_match_the_tables(self):
        holders = [0] * self.alloc.num_blocks
        for table in self.live:
            assert len(table.block_ids) == lab.blocks_needed(table.num_tokens, 3), "table holds the wrong number of blocks"
            for b in table.block_ids:
                holders[b] += 1
        refs = [self.alloc.ref_count(b) for b in range(self.alloc.num_blocks)]
        assert refs == holders, f"reference counts {refs} differ from the tables holding each block {holders}"
        used = sum(h > 0 for h in holders)
        assert self.alloc.num_free_blocks + used == self.alloc.num_blocks, "free + used != total: a block leaked"

    @invariant()
    def shared_blocks_hold_the_same_tokens(self):
        content: dict[int, list] = {}
        for table in self.live:
            for i, b in enumerate(table.block_ids):
                tokens = table.token_ids[i * 3 : (i + 1) * 3]
                seen = content.setdefault(b, tokens)
                shorter = min(len(seen), len(tokens))
                assert seen[:shorter] == tokens[:shorter], f"two tables share block {b} but hold different tokens"

    def teardown(self):
        for table in self.live:
            table.free()
        assert self.alloc.num_free_blocks == self.alloc.num_blocks, "after every table is freed, every block is free"
        assert all(self.alloc.ref_count(b) == 0 for b in range(self.alloc.num_blocks))


TestPagedCacheMachine = pytest.mark.exercise3(PagedCacheMachine.TestCase)


# =====================================================================================
# The model: a GPT-2 in NumPy (provided) and the paged path (Exercise 4 and before)
# =====================================================================================

TINY = dict(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4)
# Paged and dense paths add the same numbers in different orders (different matmul shapes):
# float32 rounding, ~1e-6 relative on logits of size ~5. Anything structural is off by >0.1.
LOGITS_ATOL = 1e-3


@pytest.fixture(scope="module")
def tiny_model():
    return lab.ToyTransformer(lab.ModelConfig(**TINY), seed=3)


def reference_gpt2_logits(weights, config, token_ids):
    """GPT-2 written out position by position in float64: the independent reference."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    H, C = config.n_head, config.n_embd
    D = C // H

    def ln(x, name):
        return (x - x.mean()) / np.sqrt(x.var() + 1e-5) * w[name + ".weight"] + w[name + ".bias"]

    xs = [w["wte.weight"][t] + w["wpe.weight"][p] for p, t in enumerate(token_ids)]
    for i in range(config.n_layer):
        p = f"h.{i}."
        qkv = [ln(x, p + "ln_1") @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"] for x in xs]
        new = []
        for t, x in enumerate(xs):
            heads = []
            for h in range(H):
                q = qkv[t][h * D : (h + 1) * D]
                ks = [qkv[s][C + h * D : C + (h + 1) * D] for s in range(t + 1)]
                vs = [qkv[s][2 * C + h * D : 2 * C + (h + 1) * D] for s in range(t + 1)]
                a = np.array([q @ k / np.sqrt(D) for k in ks])
                a = np.exp(a - a.max()) / np.exp(a - a.max()).sum()
                heads.append(sum(ai * vi for ai, vi in zip(a, vs)))
            x = x + np.concatenate(heads) @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
            f = ln(x, p + "ln_2") @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"]
            f = 0.5 * f * (1 + np.tanh(np.sqrt(2 / np.pi) * (f + 0.044715 * f**3)))
            new.append(x + f @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"])
        xs = new
    return np.array([ln(x, "ln_f") @ w["wte.weight"].T for x in xs])


@pytest.mark.provided
def test_forward_dense_is_gpt2(tiny_model):
    tokens = [5, 17, 3, 3, 60, 1, 0, 42]
    got = tiny_model.forward_dense(tokens)
    want = reference_gpt2_logits(tiny_model.weights, tiny_model.config, tokens)
    assert got.dtype == np.float32, f"the model path is float32, got {got.dtype}"
    np.testing.assert_allclose(got, want, atol=LOGITS_ATOL, err_msg="forward_dense is not GPT-2")


@pytest.mark.provided
def test_weights_round_trip_through_checkpoint_names_with_and_without_prefix(tiny_model):
    config, weights = tiny_model.config, tiny_model.weights
    prefixed = {f"transformer.{k}": v for k, v in weights.items()}
    prefixed["lm_head.weight"] = weights["wte.weight"]
    for i in range(config.n_layer):  # GPT-2 checkpoints carry causal-mask buffers
        prefixed[f"transformer.h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 64, 64)))
        prefixed[f"transformer.h.{i}.attn.masked_bias"] = np.array(-1e4)
    tokens = [1, 2, 3, 4]
    expected = tiny_model.forward_dense(tokens)
    for loaded in (weights, prefixed):
        np.testing.assert_array_equal(lab.ToyTransformer(config, dict(loaded)).forward_dense(tokens), expected)


@pytest.mark.provided
def test_weight_shapes_follow_the_checkpoint_layout():
    config = lab.ModelConfig(**TINY)
    w = lab.init_gpt2_weights(config)
    assert w["h.0.attn.c_attn.weight"].shape == (32, 96), "linear weights are (in, out) as in GPT-2's Conv1D"
    assert w["h.1.mlp.c_fc.weight"].shape == (32, 128), "the MLP is 4 * n_embd wide"
    assert all(v.dtype == np.float32 for v in w.values()), "weights are float32"


@pytest.mark.provided
@pytest.mark.parametrize(
    "edit, name",
    [
        (lambda w: w.pop("h.1.mlp.c_fc.bias"), "h.1.mlp.c_fc.bias"),
        (lambda w: w.update({"h.0.attn.c_attn.weight": np.zeros((96, 32), np.float32)}), "h.0.attn.c_attn.weight"),
        (lambda w: w.update({"h.0.attn.rotary": np.zeros(3, np.float32)}), "h.0.attn.rotary"),
        (lambda w: w.update({"lm_head.weight": w["wte.weight"] + 1}), "lm_head.weight"),
    ],
    ids=["missing", "misshapen", "unknown", "untied-head"],
)
def test_bad_weights_are_a_value_error_naming_the_tensor(edit, name):
    config = lab.ModelConfig(**TINY)
    weights = lab.init_gpt2_weights(config)
    edit(weights)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        lab.ToyTransformer(config, weights)


def run_chunked(model, prompts, schedules, block_size, num_blocks=64):
    """Feed every sequence through `forward` in the given chunk sizes, all sequences in one batch
    per step. Returns each sequence's logits, concatenated in position order."""
    alloc = lab.BlockAllocator(num_blocks, block_size)
    cache = lab.KVCache(model.config, num_blocks, block_size)
    tables = [lab.BlockTable(alloc) for _ in prompts]
    done = [0] * len(prompts)
    out = [[] for _ in prompts]
    for step in range(max(len(s) for s in schedules)):
        batch = [i for i, s in enumerate(schedules) if step < len(s)]
        for i in batch:
            tables[i].append_tokens(prompts[i][done[i] : done[i] + schedules[i][step]])
        logits = model.forward(cache, [tables[i] for i in batch], [done[i] for i in batch],
                               [schedules[i][step] for i in batch])
        row = 0
        for i in batch:
            n = schedules[i][step]
            out[i].append(logits[row : row + n])
            row, done[i] = row + n, done[i] + n
    return [np.concatenate(o) for o in out]


@st.composite
def chunk_schedules(draw):
    """Several sequences, each: a prompt in random chunks, then decode steps of one token."""
    n_seq = draw(st.integers(1, 4))
    prompts, schedules = [], []
    for _ in range(n_seq):
        chunks = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))
        decode = draw(st.integers(0, 6))
        schedules.append(chunks + [1] * decode)
        prompts.append(draw(st.lists(st.integers(0, 63), min_size=sum(chunks) + decode, max_size=sum(chunks) + decode)))
    return prompts, schedules


@pytest.mark.exercise4
@given(case=chunk_schedules(), block_size=st.sampled_from([1, 2, 4, 8]))
def test_paged_model_equals_forward_dense_for_chunked_prefill_and_decode(tiny_model, case, block_size):
    prompts, schedules = case
    paged = run_chunked(tiny_model, prompts, schedules, block_size)
    for prompt, got in zip(prompts, paged):
        np.testing.assert_allclose(
            got, tiny_model.forward_dense(prompt), atol=LOGITS_ATOL,
            err_msg="the paged path differs from forward_dense: check slots, the write-before-read order, "
                    "and the causal mask inside a prefill chunk",
        )


@pytest.mark.exercise4
def test_decode_attends_to_the_token_it_just_wrote(tiny_model):
    prompt = [7, 8, 9, 10, 11]
    paged = run_chunked(tiny_model, [prompt], [[4, 1]], block_size=4)[0]
    np.testing.assert_allclose(paged[4], tiny_model.forward_dense(prompt)[4], atol=LOGITS_ATOL,
                               err_msg="the decode token must attend to every position up to and including itself")


@pytest.mark.exercise4
def test_forked_sequences_diverge_through_copy_on_write(tiny_model):
    block_size, num_blocks = 4, 16
    alloc = lab.BlockAllocator(num_blocks, block_size)
    cache = lab.KVCache(tiny_model.config, num_blocks, block_size)
    parent = lab.BlockTable(alloc)
    prefix = [3, 1, 4, 1, 5, 9]
    parent.append_tokens(prefix)
    tiny_model.forward(cache, [parent], [0], [6])
    child = parent.fork()
    tails = {id(parent): [2, 6, 5], id(child): [35, 8, 9]}
    for step in range(3):
        for table in (parent, child):
            cache.copy_blocks(table.append_tokens([tails[id(table)][step]]))
        tiny_model.forward(cache, [parent, child], [6 + step] * 2, [1, 1])
    for table in (parent, child):
        tokens = prefix + tails[id(table)]
        assert table.token_ids == tokens
        # One more decode step through the cache must see each sequence's own past only.
        cache.copy_blocks(table.append_tokens([0]))
        logits = tiny_model.forward(cache, [table], [9], [1])[0]
        np.testing.assert_allclose(logits, tiny_model.forward_dense(tokens + [0])[-1], atol=LOGITS_ATOL,
                                   err_msg="a forked sequence saw the other's tokens: copy-on-write failed")
    assert parent.block_ids[0] == child.block_ids[0], "the full first block stays shared"
