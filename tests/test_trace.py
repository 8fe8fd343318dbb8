"""test_trace.py"""

from __future__ import annotations

import dataclasses
import functools
import html.parser
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import lab
from course import trace
from loadtest import datasets
from tests.support import needs_reference, run_cli

ROOT = Path(__file__).resolve().parent.parent

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
        self.engine, self.states, self.seqs = engine, [], {}

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
        self.scripts, self.outside, self._script = {}, [], None
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
    workload = trace.get_workload(name)
    recording = trace.record(lab, workload)
    return recording, recording_in(trace.render_page(recording)), observe(workload)


def slots_of(table, block_size):
    """A recorded table's positions -> slots (None: block * block_size + offset, as recorded)."""
    if table["slots"] is None:
        return [table["blocks"][i // block_size] * block_size + i % block_size for i in range(table["tokens"])]
    return [slot + i for pos, slot, n in table["slots"] for i in range(n)]


WORKLOAD_NAMES = list(trace.WORKLOADS)


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
    workload = trace.get_workload("memory-pressure")
    plain, engine = plain_run(workload)
    recorder, traced = traced_engine(workload)
    steps = [[(o.request_id, o.new_token_ids, o.finish_reason) for o in out]
             for out in trace.drive(traced, lab, workload, recorder)]
    assert steps == plain, "the same outputs, step by step, with and without the recorder"
    assert traced.num_preemptions == engine.num_preemptions > 0


@pytest.mark.provided
def test_the_recorder_only_listens_and_an_engine_without_it_sends_nothing():
    workload = trace.get_workload("shared-prefix")
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
    system = trace.SYSTEM_PROMPT_LEN
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
        arrivals.append(trace.Arrival(draw(st.integers(0, 6)), f"q{i}", tuple(prompt), draw(st.integers(1, 10)),
                                      temperature=0.0))
    return trace.Workload("random", "random", "", engine, tuple(arrivals))


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
    workload = trace.get_workload("memory-pressure")
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
    spec = importlib.util.spec_from_file_location("lab_wrong_victim", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "lab_wrong_victim", module)  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    rec = trace.record(module, trace.get_workload("memory-pressure"))
    reasons = [p["reason"] for f in rec.frames for p in f["preempted"]]
    assert reasons[0] == ("r4 needed a new block for its next 1 token and 0 were free; r4, not the newest running "
                          "request (r5), gave up its own blocks (it will recompute)")
    assert rec.error and rec.error.startswith(f"step {len(rec.frames)} raised"), rec.error


@pytest.mark.provided
def test_the_recorder_reports_a_block_the_allocator_and_the_events_disagree_on():
    recorder, engine = traced_engine(trace.get_workload("skewed"))
    assert set(recorder.frames[0]["state"]) == {"."} and not recorder.frames[0]["problems"]
    recorder(lab.EngineEvent(lab.EngineEventType.ALLOCATED, block_ids=(3,)))  # an event the pool never sent
    recorder.stepped([])
    frame = recorder.frames[-1]
    assert frame["state"][3] == "!" and frame["state"].count("!") == 1 and frame["blocks"]["allocated"] == [3]
    assert frame["problems"] == ["block 3: the engine's events left it held, but the allocator says reference count 0"]


@pytest.mark.needs(1)
def test_the_recorder_reports_a_reference_no_table_holds():
    recorder, engine = traced_engine(trace.get_workload("skewed"))
    block = engine.allocator.allocate()  # taken from the pool, by no block table
    recorder.stepped([])
    frame = recorder.frames[-1]
    assert frame["state"][block] == "h" and frame["blocks"]["allocated"] == [block]
    assert frame["problems"] == [f"block {block} has reference count 1 but 0 block table(s) hold it"]


# --- the page itself: no engine needed ---------------------------------------------------


def hand_made_trace(request_id="r0"):
    frame = dict(step=0, arrived=[request_id], ran=[], admitted={}, preempted=[], copies=[],
                 blocks={kind: [] for kind in trace.POOL_EVENTS}, sampled={}, finished={}, waiting=[request_id],
                 running=[], state="..", ref=[0, 0], tables={}, grew={}, cache=[0, 0, 0], problems=[])
    workload = trace.Workload("hand", "made by hand", "nothing", dict(num_blocks=2, block_size=4),
                              (trace.Arrival(0, request_id, (1, 2, 3), 2),))
    return trace.Trace(workload, "lab.py", [frame])


@pytest.mark.provided
def test_page_is_one_self_contained_file_that_carries_its_recording():
    hostile = "</script><script>alert(1)</script>&"
    rec = hand_made_trace(hostile)
    text = trace.render_page(rec)
    page = PageData(text)
    assert set(page.scripts) == {"trace-data", "script-1"}, "the recording and the script that draws it, inline"
    assert not page.outside and "http" not in text.replace("http-equiv", ""), "nothing is fetched"
    assert recording_in(text) == json.loads(json.dumps(rec.data())), "a request id cannot close the data script"
    assert "<title>Trace of lab.py: made by hand</title>" in text


# --- workloads from a file, bad input ---------------------------------------------------


@pytest.mark.provided
def test_a_saved_loadtest_workload_is_replayed_cut_to_the_toy_model(tmp_path):
    path = tmp_path / "w.jsonl"
    requests = datasets.make_workload(lab, "sharegpt", 70, seed=1)
    datasets.save_workload(requests, str(path))
    workload = trace.get_workload(str(path))
    assert len(workload.arrivals) == trace.FILE_MAX_REQUESTS and "first 64 of 70" in workload.title
    for a, r in zip(workload.arrivals, requests):
        assert len(a.prompt) == min(len(r.prompt_token_ids), trace.FILE_MAX_PROMPT)
        assert a.max_tokens == min(r.max_tokens, trace.FILE_MAX_OUTPUT)
        assert all(0 <= t < trace.TRACE_MODEL["vocab_size"] for t in a.prompt)
        assert len(a.prompt) + a.max_tokens <= trace.TRACE_MODEL["n_positions"]


@pytest.mark.needs(5)
def test_a_saved_loadtest_workload_runs_and_its_tokens_are_generates(tmp_path):
    path = tmp_path / "w.jsonl"
    datasets.save_workload(datasets.make_workload(lab, "tiny", 12, seed=2), str(path))
    workload = trace.get_workload(str(path))
    rec = trace.record(lab, workload)
    for k, frame in enumerate(rec.frames):
        pool_invariants(frame, f"step {k}")
    assert rec.outputs == generated(workload)


BAD_FILES = {
    "empty.jsonl": ("", "no requests"),
    "text.jsonl": ("hello\n", "line 1: not JSON"),
    "no-prompt.jsonl": ('{"output_tokens": 3}\n', 'line 1: "prompt"'),
    "zero.jsonl": ('{"prompt": "a b", "output_tokens": 4}\n{"prompt": "a", "output_tokens": 0}\n',
                   'line 2: "output_tokens"'),
    "list.jsonl": ("[1, 2]\n", 'line 1: "prompt"'),
}


@pytest.mark.provided
@pytest.mark.parametrize("name", BAD_FILES)
def test_a_bad_workload_file_is_a_value_error_that_names_it(tmp_path, name):
    text, message = BAD_FILES[name]
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        trace.get_workload(str(path))
    assert str(path) in str(info.value)


@pytest.mark.provided
def test_an_unknown_workload_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="skewed, shared-prefix, memory-pressure, arrivals"):
        trace.get_workload(str(tmp_path / "nothing-here"))
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="binary.jsonl"):
        trace.get_workload(str(tmp_path / "binary.jsonl"))


# --- the command line ----------------------------------------------------------------------


@pytest.mark.needs(5)
def test_cli_trace_writes_the_page(tmp_path):
    out = tmp_path / "t.html"
    proc = run_cli("trace", "--workload", "shared-prefix", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout and "steps" in proc.stdout and "what to look for" in proc.stdout
    frames = recording_in(out.read_text())["frames"]
    assert len(frames) == len(recorded("shared-prefix")[1]["frames"])


@pytest.mark.provided
def test_cli_trace_refuses_a_bad_workload_in_one_line(tmp_path):
    proc = run_cli("trace", "--workload", "no-such-workload", "--out", str(tmp_path / "t.html"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "trace: error: --workload 'no-such-workload'" in proc.stderr and "memory-pressure" in proc.stderr
    assert not (tmp_path / "t.html").exists()


@pytest.mark.needs(5)
def test_cli_trace_says_in_one_line_that_it_cannot_write_the_page(tmp_path):
    out = tmp_path / "no-such-folder" / "t.html"
    proc = run_cli("trace", "--workload", "shared-prefix", "--out", str(out))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"trace: error: cannot write the page to {out}: No such file or directory" in proc.stderr


@pytest.mark.provided
@needs_reference
def test_cli_trace_on_a_half_written_lab_names_the_missing_stub(tmp_path):
    sys.path.insert(0, str(ROOT / "tools" / "handout"))
    try:
        from make_lab import make_lab
    finally:
        sys.path.remove(str(ROOT / "tools" / "handout"))
    script = tmp_path / "lab_half.py"
    script.write_text(make_lab((ROOT / "solution.py").read_text(), only={"5"}))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(script), "trace", "--out", str(tmp_path / "t.html")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "lab_half.py: Exercise 5: Scheduler.schedule is still a stub" in proc.stderr, proc.stderr
    assert "docs/reference-traces/skewed.html" in proc.stderr, "a stuck student is pointed to the reference run"
    assert not (tmp_path / "t.html").exists(), "no page for a run that could not start"


# --- the rendered page, in a real browser ----------------------------------------------------
#
# Headless Chromium opens the page at `#step=N&request=ID` and dumps the DOM the script built;
# html.parser reads the data-* attributes back and the test compares them with the recording.

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
BROWSER_TIMEOUT = 60
needs_browser = pytest.mark.skipif(BROWSER is None, reason="needs Chromium to render the page: apt-get install "
                                   "chromium (or any chromium / chromium-browser on PATH)")


def dump_dom(path: Path, fragment: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--window-size=1280,900", "--dump-dom",
             f"{path.as_uri()}#{fragment}"],
            capture_output=True, text=True, timeout=BROWSER_TIMEOUT)
    if proc.returncode != 0 or "<main" not in proc.stdout:  # not an AssertionError: the page was not checked
        raise RuntimeError(f"chromium --dump-dom exited {proc.returncode}: {proc.stderr[-500:]}")
    return proc.stdout


class RenderedPage(html.parser.HTMLParser):
    """What the script drew: the step, the queues, the plan, the pool, the tables, the detail."""

    VOID = {"input", "br", "meta", "img", "hr", "link"}

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.step = self.selected = None
        self.queues, self.ran, self.preempted, self.blocks = {}, {}, [], {}
        self.tables, self.rows, self.output = {}, [], ""
        self._queue, self._output_depth = [], 0
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if self._output_depth and tag not in self.VOID:
            self._output_depth += 1
        if tag == "main" and "data-step" in a:
            self.step, self.selected = int(a["data-step"]), a.get("data-selected")
        elif tag == "ol":
            self._queue.append(a.get("data-queue"))
            if a.get("data-queue"):
                self.queues[a["data-queue"]] = []
        elif tag == "li" and "data-request" in a and self._queue and self._queue[-1]:
            self.queues[self._queue[-1]].append(a["data-request"])
        elif tag == "tr" and "data-scheduled" in a:
            self.ran[a["data-scheduled"]] = (int(a["data-tokens"]), a["data-kind"], int(a["data-start"]),
                                             [int(t) for t in a["data-sampled"].split()])
        elif tag == "li" and "data-preempted" in a:
            self.preempted.append(a["data-preempted"])
        elif tag == "div" and "data-block" in a:
            self.blocks[int(a["data-block"])] = (a["data-state"], int(a["data-refcount"]), "hl" in a["class"].split())
        elif tag == "div" and "data-table" in a:
            self.tables[a["data-table"]] = ([int(b) for b in a["data-blocks"].split()], int(a["data-tokens"]))
        elif tag == "tr" and "data-row" in a:
            self.rows.append((int(a["data-block"]), a["data-positions"], a["data-slots"]))
        elif tag == "span" and "data-output" in a:
            self._output_depth = 1

    def handle_endtag(self, tag):
        if tag == "ol" and self._queue:
            self._queue.pop()
        if self._output_depth:
            self._output_depth -= 1

    def handle_data(self, data):
        if self._output_depth:
            self.output += data


STATE_NAMES = {".": "free", "e": "cached", "h": "held", "H": "held-cached"}


def check_rendered(page: RenderedPage, data: dict, step: int, request: str) -> None:
    """The rendered page at `step` with `request` selected shows frame `step` of the recording."""
    f, bs = data["frames"][step], data["block_size"]
    assert page.step == step and page.selected == request, "the fragment opens that step and request"
    assert page.queues["waiting"] == f["waiting"] and page.queues["running"] == f["running"], f"step {step}: queues"
    assert page.ran == {r["id"]: (r["n"], r["kind"], r["start"], f["sampled"].get(r["id"], [])) for r in f["ran"]}, (
        f"step {step}: what ran")
    assert page.preempted == [p["id"] for p in f["preempted"]], f"step {step}: the preemptions"
    mine = set(f["tables"].get(request, {}).get("blocks", []))
    assert page.blocks == {b: (STATE_NAMES[c], r, b in mine) for b, (c, r) in enumerate(zip(f["state"], f["ref"]))}, (
        f"step {step}: each block's state, reference count, and the selected request's blocks lit")
    assert page.tables == {rid: (t["blocks"], t["tokens"]) for rid, t in f["tables"].items()}, f"step {step}: tables"
    table = f["tables"][request]
    slots = slots_of(table, bs)
    expected_rows = []
    for j, b in enumerate(table["blocks"]):
        lo, hi = j * bs, min((j + 1) * bs, table["tokens"]) - 1
        expected_rows.append((b, f"{lo}-{hi}", f"{slots[lo]}-{slots[hi]}"))
    assert page.rows == expected_rows, f"step {step}: {request}'s table, positions to blocks and slots"
    made = [t for k in range(step + 1) for t in data["frames"][k]["sampled"].get(request, [])]
    assert page.output.split() == [str(t) for t in made], f"step {step}: {request}'s tokens so far"


def busiest_step(data, request):
    """A step where `request` holds blocks and the most requests ran (preemptions first)."""
    candidates = [k for k, f in enumerate(data["frames"]) if request in f["tables"] and f["ran"]]
    return max(candidates, key=lambda k: (bool(data["frames"][k]["preempted"]), len(data["frames"][k]["ran"]), -k))


def page_of(workload: str, where: Path):
    """(trace, its recording, the page's file) of a workload recorded on the module's engine."""
    rec, data, _ = recorded(workload)
    path = where / "trace.html"
    path.write_text(trace.render_page(rec))
    return rec, data, path


@pytest.mark.needs(5)
@needs_browser
def test_the_page_rendered_in_chromium_shows_the_recorded_step(tmp_path):
    rec, data, path = page_of("memory-pressure", tmp_path)
    step = busiest_step(data, "r3")
    check_rendered(RenderedPage(dump_dom(path, f"step={step}&request=r3")), data, step, "r3")
    # The check itself catches a page that draws the step before: the same script, one step late.
    late = trace.render_page(rec).replace("const f = F[cur];", "const f = F[Math.max(cur - 1, 0)];")
    assert late != trace.render_page(rec)
    path.write_text(late)
    with pytest.raises(AssertionError, match=f"step {step}"):
        check_rendered(RenderedPage(dump_dom(path, f"step={step}&request=r3")), data, step, "r3")


@pytest.mark.needs(5)
def test_the_page_opens_on_the_first_step_where_a_mechanism_shows():
    """Without `#step=N` the page opens where something happens, not on the empty step 0: on the
    memory-pressure run that is its first preemption, and no earlier step preempts, copies or hits."""
    _, data, _ = recorded("memory-pressure")
    frames, first = data["frames"], data["open"]
    assert frames[first]["preempted"], f"the page opens on step {first}, which preempts nothing"
    for k in range(1, first):
        hit = frames[k]["cache"][1] > frames[k - 1]["cache"][1]
        assert not (frames[k]["preempted"] or frames[k]["copies"] or hit), (
            f"step {k} already shows a mechanism, before the opening step {first}")


@pytest.mark.needs(5)
@needs_browser
def test_the_page_without_a_step_in_its_address_opens_on_the_opening_step(tmp_path):
    _, data, path = page_of("memory-pressure", tmp_path)
    assert RenderedPage(dump_dom(path, "")).step == data["open"] > 0, "the page opens on the recording's opening step"
