"""test_trace.py: the trace's recording (course/pages/trace.py), checked against the engine itself.
The page, its workload files and the command line are test_trace_page.py's."""

from __future__ import annotations

import dataclasses
import functools
import html.parser
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import lab
from course.pages import trace, trace_workloads
from tests.support import ROOT, import_scratch_lab, needs_reference

# =====================================================================================
# The trace: `python solution.py trace`, one page that steps through a recorded engine run
# =====================================================================================
#
# The recording is checked against the engine itself: the test drives a second engine through
# the same workload WITHOUT the recorder and looks at it after every step through public
# attributes only (`Observer`); the page's recording is read back from the HTML with the
# standard library's html.parser. Where Chromium is installed, the rendered page is read back too.


class Observer:
    """The test's own look at an engine after each step (duck-typed as a recorder for
    `trace.drive`, which only tells it when requests arrived and what a step returned)."""

    def __init__(self, engine):
        self.engine = engine
        self.states = []
        self.seqs = {}

    def arrived(self, request_ids):
        if not self.states:  # frame 0: after the first arrivals, before the first step
            self.states.append(self.look([]))

    def stepped(self, outputs):
        self.states.append(self.look(outputs))

    def look(self, outputs):
        engine = self.engine
        scheduler, alloc = engine.scheduler, engine.allocator
        self.seqs.update(engine.requests)
        held = [*scheduler.running, *scheduler.waiting]
        tables = {s.request_id: s.block_table for s in held if s.block_table.block_ids}
        return {
            "waiting": [s.request_id for s in scheduler.waiting],
            "running": [s.request_id for s in scheduler.running],
            "ref": [alloc.ref_count(b) for b in range(alloc.num_blocks)],
            "cached": [alloc.is_cached(b) for b in range(alloc.num_blocks)],
            "tables": {rid: list(t.block_ids) for rid, t in tables.items()},
            "tokens": {rid: t.num_tokens for rid, t in tables.items()},
            "computed": {s.request_id: s.num_computed_tokens for s in held if s.block_table.block_ids},
            "slots": {rid: [int(x) for x in t.slots(0, t.num_tokens)] for rid, t in tables.items()},
            "preemptions": {rid: s.num_preemptions for rid, s in self.seqs.items()},
            "hits": alloc.stats.hits,
            "outputs": [(o.request_id, list(o.new_token_ids), o.finish_reason) for o in outputs],
        }


def observe(workload):
    engine = trace.build_engine(lab, workload)
    observer = Observer(engine)
    trace.drive(engine, lab, workload, observer)
    return observer.states


class PageData(html.parser.HTMLParser):
    """A page as html.parser reads it: its scripts (by id), and every outside reference."""

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.scripts = {}
        self.outside = []
        self._script = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.outside += [v for k, v in attrs if k in ("src", "href") and v and not v.startswith("#")]
        if tag == "script":
            self._script = dict(attrs).get("id", f"script-{len(self.scripts)}")
            self.scripts[self._script] = ""

    def handle_endtag(self, tag):
        if tag == "script":
            self._script = None

    def handle_data(self, data):
        if self._script is not None:
            self.scripts[self._script] += data


def recording_in(page_html):
    """The recording the page draws from, as the page carries it."""
    page = PageData(page_html)
    assert not page.outside, f"the page must fetch nothing, it refers to {page.outside}"
    assert "trace-data" in page.scripts, "the recording is the inline <script id=trace-data>"
    return json.loads(page.scripts["trace-data"])


@functools.cache
def recorded(name):
    """(trace, the recording read back from its page, the test's own observation) of a workload."""
    workload = trace_workloads.get_workload(name)
    recording = trace.record(lab, workload)
    return recording, recording_in(trace.render_page(recording)), observe(workload)


def slots_of(table, block_size):
    """A recorded table's positions -> slots (None: block * block_size + offset, as recorded)."""
    if table["slots"] is None:
        return [table["blocks"][i // block_size] * block_size + i % block_size for i in range(table["tokens"])]
    return [slot + i for pos, slot, n in table["slots"] for i in range(n)]


WORKLOAD_NAMES = list(trace_workloads.WORKLOADS)


@pytest.mark.needs(5)
@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_trace_page_shows_the_engines_state_after_every_step(name):
    rec, data, states = recorded(name)
    frames = data["frames"]
    assert data == json.loads(json.dumps(rec.data())), "the page embeds the recording, whole and unchanged"
    assert len(frames) == len(states), f"one frame per step and one before the first: {len(frames)} vs {len(states)}"
    bs = data["block_size"]
    for k, (f, s) in enumerate(zip(frames, states)):
        where = f"{name}, step {k}"
        assert f["step"] == k, where
        assert (f["waiting"], f["running"]) == (s["waiting"], s["running"]), f"{where}: the queues after the step"
        assert f["ref"] == s["ref"], f"{where}: each block's reference count after the step"
        assert {rid: t["blocks"] for rid, t in f["tables"].items()} == s["tables"], f"{where}: the block tables"
        assert {rid: t["tokens"] for rid, t in f["tables"].items()} == s["tokens"], f"{where}: tokens per table"
        assert {rid: t["computed"] for rid, t in f["tables"].items()} == s["computed"], where
        assert {rid: slots_of(t, bs) for rid, t in f["tables"].items()} == s["slots"], f"{where}: positions -> slots"
        for b, (code, ref, cached) in enumerate(zip(f["state"], s["ref"], s["cached"])):
            expected = ("H" if cached else "h") if ref else ("e" if cached else ".")
            assert code == expected, f"{where}: block {b} (reference count {ref}, cached {cached}) drawn as {code!r}"
        sampled = {rid: toks for rid, toks, _ in s["outputs"] if toks}
        assert f["sampled"] == sampled, f"{where}: the tokens the step returned"
        assert f["finished"] == {rid: why for rid, _, why in s["outputs"] if why}, f"{where}: who finished"


def pool_invariants(frame, where):
    """Each block is in exactly one state, free, cached (evictable) or held, and its reference
    count is the number of block tables that hold it."""
    holders = {}
    for rid, table in frame["tables"].items():
        for b in table["blocks"]:
            holders.setdefault(b, []).append(rid)
    assert not frame["problems"], f"{where}: the recorder found {frame['problems']}"
    assert len(frame["state"]) == len(frame["ref"])
    for b, (code, ref) in enumerate(zip(frame["state"], frame["ref"])):
        assert code in ".ehH", f"{where}: block {b} is in no state or in two ({code!r})"
        assert ref == len(holders.get(b, [])), (
            f"{where}: block {b} has reference count {ref} but is held by {holders.get(b, [])}")
        assert (ref > 0) == (code in "hH"), f"{where}: block {b} with reference count {ref} drawn as {code!r}"


@pytest.mark.needs(5)
@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_pool_invariants_hold_at_every_step(name):
    _, data, _ = recorded(name)
    for k, frame in enumerate(data["frames"]):
        pool_invariants(frame, f"{name}, step {k}")


def generated(workload):
    """What generate() returns for the same requests, all at once, on a fresh engine; a request of
    n forked samples as n requests of seeds seed, seed + 1, ... (a fork changes no token)."""
    requests = []
    for a in workload.arrivals:
        request = a.request(lab)
        for i, rid in enumerate(a.request_ids):
            seed = None if a.seed is None else a.seed + i
            requests.append(dataclasses.replace(request, request_id=rid,
                                                sampling=dataclasses.replace(request.sampling, seed=seed)))
    outputs = trace.build_engine(lab, workload).generate(requests)
    return {o.request_id: o.output_token_ids for o in outputs}


@pytest.mark.needs(5)
@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_recorded_tokens_are_what_generate_returns(name):
    rec, data, _ = recorded(name)
    tokens = {rid: [] for rid in data["requests"]}
    for frame in data["frames"]:
        for rid, new in frame["sampled"].items():
            tokens[rid] += new
    assert tokens == rec.outputs == generated(rec.workload)


def plain_run(workload):
    """Each step's outputs of an engine that nothing records."""
    engine = trace.build_engine(lab, workload)
    steps = trace.drive(engine, lab, workload)
    return [[(o.request_id, o.new_token_ids, o.finish_reason) for o in out] for out in steps], engine


def shadowed_methods(obj) -> set[str]:
    """Instance attributes that hide a method of the object's class: what wrapping at run time leaves."""
    return {name for name in vars(obj) if callable(getattr(type(obj), name, None))}


def traced_engine(workload):
    """(recorder, engine): an engine of the module with a recorder as its observer, as `trace.record` builds it."""
    recorder = trace.Recorder(lab)
    engine = trace.build_engine(lab, workload, observer=recorder)
    recorder.watch(engine)
    return recorder, engine


@pytest.mark.needs(5)
def test_recording_changes_nothing_the_engine_does():
    workload = trace_workloads.get_workload("memory-pressure")
    plain, engine = plain_run(workload)
    recorder, traced = traced_engine(workload)
    steps = [[(o.request_id, o.new_token_ids, o.finish_reason) for o in out]
             for out in trace.drive(traced, lab, workload, recorder)]
    assert steps == plain, "the same outputs, step by step, with and without the recorder"
    assert traced.num_preemptions == engine.num_preemptions > 0


@pytest.mark.provided
def test_the_recorder_only_listens_and_an_engine_without_it_sends_nothing():
    workload = trace_workloads.get_workload("shared-prefix")
    _, traced = traced_engine(workload)
    plain = trace.build_engine(lab, workload)
    assert type(plain.allocator) is lab.BlockAllocator and plain.scheduler.observer is None, (
        "an engine built without an observer runs the plain allocator and reports to no one")
    assert isinstance(traced.allocator, lab.ObservedBlockAllocator), "the traced engine's pool reports its events"
    for engine in (traced, plain):
        for part in (engine, engine.scheduler, engine.allocator):
            assert not shadowed_methods(part), f"{type(part).__name__}'s methods are replaced on the instance"


@pytest.mark.needs(5)
def test_preemptions_kinds_and_hits_are_the_engines():
    _, data, states = recorded("memory-pressure")
    frames, prompts = data["frames"], {rid: len(r["prompt"]) for rid, r in data["requests"].items()}
    made = {rid: 0 for rid in prompts}  # tokens each request has: prompt + outputs so far
    made.update(prompts)
    recomputing = set()
    assert any(f["preempted"] for f in frames), "the memory-pressure workload preempts"
    for k in range(1, len(frames)):
        f, before, after = frames[k], states[k - 1], states[k]
        victims = [rid for rid, n in after["preemptions"].items() if n > before["preemptions"].get(rid, 0)]
        assert sorted(p["id"] for p in f["preempted"]) == sorted(victims), f"step {k}: who was preempted"
        for p in f["preempted"]:
            assert "needed a new block" in p["reason"] and "free" in p["reason"], f"step {k}: {p['reason']}"
        recomputing |= set(victims)
        for r in f["ran"]:
            rid, n, start = r["id"], r["n"], r["start"]
            assert r["samples"] == (start + n == made[rid]), f"step {k}, {rid}: samples iff it reaches its last token"
            if n == 1 and start == made[rid] - 1 and start >= prompts[rid]:
                kind = "decode"
            else:
                kind = "recompute" if rid in recomputing else "prefill"
            assert r["kind"] == kind, f"step {k}, {rid}: {n} tokens from {start} of {made[rid]} are a {kind}"
            if rid in after["computed"]:
                assert after["computed"][rid] == start + n, f"step {k}, {rid}: computed after = start + tokens"
        for rid, new in f["sampled"].items():
            made[rid] += len(new)
    _, data, states = recorded("shared-prefix")
    bs = data["block_size"]
    for k in range(1, len(data["frames"])):
        hits = sum(data["frames"][k]["admitted"].values())
        assert hits == (states[k]["hits"] - states[k - 1]["hits"]) * bs, (
            f"shared-prefix, step {k}: the hits at admission are the allocator's prefix-cache hits, in tokens")
    admitted = {rid: hit for f in data["frames"] for rid, hit in f["admitted"].items()}
    system = trace_workloads.SYSTEM_PROMPT_LEN
    assert admitted["r1"] == 0 and admitted["r2"] == system and admitted["r3"] == 0, (
        "r1 comes in the same step as r0 (nothing registered yet), r2 after it, r3 with another salt")
    assert admitted["r4"] == system - bs, "a prompt that is all cached blocks recomputes its last block"


@st.composite
def workloads(draw):
    """Small random workloads: arrivals at random steps, a shared prefix or not, a small pool."""
    block_size = draw(st.sampled_from([2, 4]))
    engine = dict(num_blocks=draw(st.integers(4, 24)), block_size=block_size, max_num_seqs=draw(st.integers(1, 4)),
                  max_num_batched_tokens=draw(st.integers(2, 24)), enable_prefix_caching=draw(st.booleans()))
    shared = draw(st.lists(st.integers(1, 63), max_size=8))
    arrivals = []
    for i in range(draw(st.integers(1, 6))):
        prompt = shared + draw(st.lists(st.integers(1, 63), min_size=1, max_size=10))
        arrivals.append(trace_workloads.Arrival(draw(st.integers(0, 6)), f"q{i}", tuple(prompt),
                                                draw(st.integers(1, 10)), temperature=0.0))
    return trace_workloads.Workload("random", "random", "", engine, tuple(arrivals))


@pytest.mark.needs(5)
@settings(max_examples=12)
@given(workloads())
def test_random_workloads_keep_the_invariants_and_generates_tokens(workload):
    rec = trace.record(lab, workload)
    assert rec.error is None and not rec.truncated
    data = recording_in(trace.render_page(rec))
    for k, frame in enumerate(data["frames"]):
        pool_invariants(frame, f"step {k}")
    assert rec.outputs == generated(workload)
    plain, _ = plain_run(workload)
    outputs = {rid: [] for rid in rec.outputs}
    for out in plain:
        for rid, toks, _ in out:
            outputs[rid] += toks
    assert outputs == rec.outputs, "the recorder changes nothing"


@pytest.mark.needs(5)
def test_a_run_that_raises_or_does_not_finish_still_gets_the_steps_before(monkeypatch):
    workload = trace_workloads.get_workload("memory-pressure")
    build = trace.build_engine

    class ModelThatFailsAtTheFifthStep(lab.ToyTransformer):
        calls = 0

        def forward(self, *args, **kwargs):
            self.calls += 1
            if self.calls == 5:
                raise RuntimeError("a bug in step 5")
            return super().forward(*args, **kwargs)

    def failing_engine(lab_module, w, observer=None):
        model = ModelThatFailsAtTheFifthStep(lab_module.ModelConfig(**w.model), seed=trace.MODEL_SEED)
        return lab_module.LLMEngine(model, **w.engine, observer=observer)

    monkeypatch.setattr(trace, "build_engine", failing_engine)
    rec = trace.record(lab, workload)
    assert rec.error == "step 5 raised RuntimeError: a bug in step 5" and not rec.truncated
    assert [f["step"] for f in rec.frames] == [0, 1, 2, 3, 4], "the four steps that ran, and the state before"
    assert recording_in(trace.render_page(rec))["error"] == rec.error, "the page says where the run stopped"
    monkeypatch.setattr(trace, "build_engine", build)
    short = trace.record(lab, workload, max_steps=3)
    assert short.truncated and short.error is None and len(short.frames) == 4


@pytest.mark.provided
@needs_reference
def test_the_trace_of_a_scheduler_that_preempts_the_wrong_request_says_so(tmp_path, monkeypatch):
    """What the trace is for: a student's scheduler that preempts the request asking for a block
    instead of the newest one. The page names the victim that should have gone, and keeps every
    step up to the one where the run broke."""
    source = (ROOT / "solution.py").read_text()
    newest = "victim = self.running.pop()  #"
    assert source.count(newest) == 1
    path = tmp_path / "lab_wrong_victim.py"
    path.write_text(source.replace(newest, "victim = self.running.pop(self.running.index(seq))  #"))
    module = import_scratch_lab(path, monkeypatch)
    rec = trace.record(module, trace_workloads.get_workload("memory-pressure"))
    reasons = [p["reason"] for f in rec.frames for p in f["preempted"]]
    assert reasons[0] == ("r4 needed a new block for its next 1 token and 0 were free; r4, not the newest running "
                          "request (r5), gave up its own blocks (it will recompute)")
    assert rec.error and rec.error.startswith(f"step {len(rec.frames)} raised"), rec.error


@pytest.mark.provided
def test_the_recorder_reports_a_block_the_allocator_and_the_events_disagree_on():
    recorder, engine = traced_engine(trace_workloads.get_workload("skewed"))
    assert set(recorder.frames[0]["state"]) == {"."} and not recorder.frames[0]["problems"]
    recorder(lab.EngineEvent(lab.EngineEventType.ALLOCATED, block_ids=(3,)))  # an event the pool never sent
    recorder.stepped([])
    frame = recorder.frames[-1]
    assert frame["state"][3] == "!" and frame["state"].count("!") == 1 and frame["blocks"]["allocated"] == [3]
    assert frame["problems"] == ["block 3: the engine's events left it held, but the allocator says reference count 0"]


@pytest.mark.needs(1)
def test_the_recorder_reports_a_reference_no_table_holds():
    recorder, engine = traced_engine(trace_workloads.get_workload("skewed"))
    block = engine.allocator.allocate()  # taken from the pool, by no block table
    recorder.stepped([])
    frame = recorder.frames[-1]
    assert frame["state"][block] == "h" and frame["blocks"]["allocated"] == [block]
    assert frame["problems"] == [f"block {block} has reference count 1 but 0 block table(s) hold it"]
