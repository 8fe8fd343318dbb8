"""test_events.py: what an engine reports to its observer (`LLMEngine(observer=...)`): each step's
plan and preemptions from the scheduler, every change to the block pool from the
ObservedBlockAllocator. The events are sent by provided code around the exercises, so these tests
run your Exercises 1-5 and hold the events to the engine's public state before and after every
step: a listener (the trace) can take the events as the engine's own account of what happened."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import lab
from course.pages import trace
from course.pages.trace_workloads import WORKLOADS, Arrival, Workload, get_workload


class Listener:
    """An engine's observer that also takes `trace.drive`'s calls around each step: for every step,
    the engine's public state before it, the events it sent during it, and the state after it."""

    def __init__(self):
        self.engine = None
        self.events: list = []
        self.steps: list[tuple[dict, list, dict, list]] = []  # (before, events, after, outputs)

    def __call__(self, event) -> None:
        self.events.append(event)

    def arrived(self, request_ids) -> None:
        assert not self.events, f"events between steps: {self.events}"
        self.before = self.look()

    def stepped(self, outputs) -> None:
        self.steps.append((self.before, self.events, self.look(), outputs))
        self.events = []

    def look(self) -> dict:
        engine = self.engine
        alloc, scheduler = engine.allocator, engine.scheduler
        seqs = {seq.request_id: seq for seq in [*scheduler.running, *scheduler.waiting]}
        return {
            "held": {b for b in range(alloc.num_blocks) if alloc.ref_count(b) > 0},
            "cached": {b for b in range(alloc.num_blocks) if alloc.is_cached(b)},
            "blocks": {rid: list(seq.block_table.block_ids) for rid, seq in seqs.items()},
            "computed": {rid: seq.num_computed_tokens for rid, seq in seqs.items()},
            "preemptions": {rid: seq.num_preemptions for rid, seq in seqs.items()},
            "running": [seq.request_id for seq in scheduler.running],
            "hits": alloc.stats.hits,
            "evictions": alloc.stats.evictions,
        }


def listened(workload) -> tuple[Listener, list]:
    """Run a workload on an engine of the module with a Listener as its observer: (listener, outputs)."""
    listener = Listener()
    engine = trace.build_engine(lab, workload, observer=listener)
    listener.engine = engine
    return listener, trace.drive(engine, lab, workload, listener)


def of(events, kind: str) -> list:
    return [e for e in events if e.type is getattr(lab.EngineEventType, kind)]


def replay_pool(before: dict, events: list, where: str) -> tuple[set[int], set[int]]:
    """The pool after the step, from the state before it and the pool's events, each checked to be a
    move the block could make then: (blocks held, blocks cached)."""
    held, cached = set(before["held"]), set(before["cached"])
    for i, e in enumerate(events):
        kind = e.type.name
        if kind not in ("ALLOCATED", "PREFIX_HIT", "CACHED", "EVICTED", "FREED"):
            continue
        (b,) = e.block_ids
        at = f"{where}, event {i} ({kind} block {b})"
        if kind == "ALLOCATED":
            assert b not in held and b not in cached, f"{at}: only a free, uncached block is allocated"
            held.add(b)
        elif kind == "EVICTED":
            assert b in cached and b not in held, f"{at}: only a cached block that no table holds is evicted"
            assert events[i + 1].type.name == "ALLOCATED" and events[i + 1].block_ids == (b,), (
                f"{at}: an eviction hands the block out at once, in the same allocate")
            cached.discard(b)
        elif kind == "PREFIX_HIT":
            assert b in cached, f"{at}: a prefix hit takes a cached block"
            held.add(b)
        elif kind == "CACHED":
            assert b in held and b not in cached, f"{at}: only a block in use, not cached yet, becomes cached"
            cached.add(b)
        else:
            assert b in held, f"{at}: only a held block is freed"
            held.discard(b)
    return held, cached


WORKLOAD_NAMES = list(WORKLOADS)


def check_pool_events(listener: Listener, name: str) -> None:
    for k, (before, events, after, _) in enumerate(listener.steps, 1):
        where = f"{name}, step {k}"
        held, cached = replay_pool(before, events, where)
        assert held == after["held"], f"{where}: the blocks the events leave in use are those with a reference"
        assert cached == after["cached"], f"{where}: the blocks the events leave cached are those is_cached says"
        assert len(of(events, "PREFIX_HIT")) == after["hits"] - before["hits"], f"{where}: one event per prefix hit"
        assert len(of(events, "EVICTED")) == after["evictions"] - before["evictions"], f"{where}: one per eviction"


@pytest.mark.needs(5)
@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_the_pool_events_replayed_give_the_pool_after_every_step(name):
    listener, _ = listened(get_workload(name))
    check_pool_events(listener, name)


@pytest.mark.needs(5)
def test_every_kind_of_event_is_sent_by_some_workload():
    kinds = collections.Counter()
    for name in WORKLOAD_NAMES:
        listener, _ = listened(get_workload(name))
        kinds.update(e.type.name for _, events, _, _ in listener.steps for e in events)
    every = {t.name for t in lab.EngineEventType}
    assert set(kinds) == every, f"never sent by any workload: {every - set(kinds)}"


@pytest.mark.needs(5)
@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_scheduled_events_are_the_steps_plan_in_batch_order(name):
    workload = get_workload(name)
    listener, _ = listened(workload)
    budget = workload.engine["max_num_batched_tokens"]
    for k, (before, events, after, outputs) in enumerate(listener.steps, 1):
        where = f"{name}, step {k}"
        scheduled = [(e.request_id, e.num_tokens) for e in of(events, "SCHEDULED")]
        ids = [rid for rid, _ in scheduled]
        assert len(set(ids)) == len(ids) and 0 < sum(n for _, n in scheduled) <= budget, (
            f"{where}: each sequence once, within the token budget: {scheduled}")
        finished = {o.request_id for o in outputs if o.finish_reason}
        for rid, n in scheduled:
            if rid in finished:
                continue
            assert rid in after["running"], f"{where}: {rid} ran in the step, so it is running after it"
            start = after["computed"][rid] - n
            if rid in before["running"]:
                assert start == before["computed"][rid], f"{where}: {rid} ran {n} tokens from where it stood"
        sampled = {o.request_id for o in outputs if o.new_token_ids}
        forked = {rid for rid in sampled if rid.rpartition(".")[0] in ids}  # samples forked from a scheduled prompt
        assert sampled - forked <= set(ids), f"{where}: a request sampled a token without being scheduled"


@pytest.mark.needs(5)
def test_each_preemption_is_sent_once_after_the_request_short_of_a_block_and_frees_its_blocks():
    listener, _ = listened(get_workload("memory-pressure"))
    preempted_at_all = False
    for k, (before, events, after, _) in enumerate(listener.steps, 1):
        where = f"memory-pressure, step {k}"
        counted = sorted(rid for rid, n in after["preemptions"].items() if n > before["preemptions"].get(rid, 0))
        reported = [e.request_id for e in of(events, "PREEMPTED")]
        assert sorted(reported) == counted, f"{where}: one PREEMPTED event per preemption the sequences count"
        preempted_at_all |= bool(reported)
        for i, e in enumerate(events):
            if e.type.name != "PREEMPTED":
                continue
            short = [x for x in events[:i] if x.type.name == "OUT_OF_BLOCKS"]
            assert short and short[-1].request_id in before["running"], (
                f"{where}: {e.request_id}'s preemption follows a running request that found no free block")
            freed = {x.block_ids[0] for x in events[i + 1:] if x.type.name == "FREED"}
            assert set(before["blocks"][e.request_id]) <= freed, f"{where}: {e.request_id}'s blocks are freed"
    assert preempted_at_all, "test set-up: the memory-pressure workload preempts"


@pytest.mark.needs(5)
def test_copied_events_are_the_copy_on_write_of_the_forked_samples():
    listener, _ = listened(get_workload("parallel-sampling"))
    copies = [(k, e.block_ids) for k, (_, events, _, _) in enumerate(listener.steps, 1) for e in of(events, "COPIED")]
    assert [k for k, _ in copies] == [2, 2], f"two samples copy the shared last block in step 2, got {copies}"
    before, events, after, _ = listener.steps[1]
    allocated = [e.block_ids[0] for e in of(events, "ALLOCATED")]
    for _, (src, dst) in copies:
        assert dst in allocated, f"the copy's destination {dst} is a block allocated in the same step"
        assert src in before["held"] and src in after["held"], f"the source {src} stays with its last holder"
        holders = [rid for rid, blocks in after["blocks"].items() if dst in blocks]
        assert len(holders) == 1, f"block {dst}, a private copy, is held by {holders}"


@st.composite
def workloads(draw):
    """Small random workloads: arrivals at random steps, a shared prefix or not, a small pool."""
    engine = dict(num_blocks=draw(st.integers(4, 24)), block_size=draw(st.sampled_from([2, 4])),
                  max_num_seqs=draw(st.integers(1, 4)), max_num_batched_tokens=draw(st.integers(2, 24)),
                  enable_prefix_caching=draw(st.booleans()))
    shared = draw(st.lists(st.integers(1, 63), max_size=8))
    arrivals = []
    for i in range(draw(st.integers(1, 6))):
        prompt = shared + draw(st.lists(st.integers(1, 63), min_size=1, max_size=10))
        arrivals.append(Arrival(draw(st.integers(0, 6)), f"q{i}", tuple(prompt), draw(st.integers(1, 10)),
                                temperature=0.0, n=draw(st.sampled_from([1, 1, 2]))))
    return Workload("random", "random", "", engine, tuple(arrivals))


@pytest.mark.needs(5)
@settings(max_examples=15)
@given(workloads())
def test_random_workloads_send_events_that_replay_to_the_pool_and_change_no_output(workload):
    listener, steps = listened(workload)
    check_pool_events(listener, "random")
    plain = trace.drive(trace.build_engine(lab, workload), lab, workload)
    as_tokens = [[(o.request_id, o.new_token_ids, o.finish_reason) for o in out] for out in steps]
    assert as_tokens == [[(o.request_id, o.new_token_ids, o.finish_reason) for o in out] for out in plain], (
        "an engine that reports runs exactly as one that does not")
