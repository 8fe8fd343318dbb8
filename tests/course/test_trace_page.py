"""test_trace_page.py: the trace's page (course/pages/trace.py, trace_page/), a workload replayed
from a file (course/pages/trace_workloads.py), `python solution.py trace`, and the page as headless
Chromium renders it. The recording itself is test_trace.py's."""

from __future__ import annotations

import html.parser
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import lab
from course.pages import trace, trace_workloads
from loadtest import datasets
from tests.course.browser import dump_dom, needs_browser
from tests.course.test_trace import PageData, generated, pool_invariants, recorded, recording_in, slots_of
from tests.support import ROOT, needs_reference, run_cli

# --- the page itself: no engine needed ---------------------------------------------------


def hand_made_trace(request_id="r0"):
    frame = dict(step=0, arrived=[request_id], ran=[], admitted={}, preempted=[], copies=[],
                 blocks={kind: [] for kind in trace.POOL_EVENTS}, sampled={}, finished={}, waiting=[request_id],
                 running=[], state="..", ref=[0, 0], tables={}, grew={}, cache=[0, 0, 0], problems=[])
    workload = trace_workloads.Workload("hand", "made by hand", "nothing", dict(num_blocks=2, block_size=4),
                                        (trace_workloads.Arrival(0, request_id, (1, 2, 3), 2),))
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
    workload = trace_workloads.get_workload(str(path))
    assert len(workload.arrivals) == trace_workloads.FILE_MAX_REQUESTS and "first 64 of 70" in workload.title
    for a, r in zip(workload.arrivals, requests):
        assert len(a.prompt) == min(len(r.prompt_token_ids), trace_workloads.FILE_MAX_PROMPT)
        assert a.max_tokens == min(r.max_tokens, trace_workloads.FILE_MAX_OUTPUT)
        assert all(0 <= t < trace_workloads.TRACE_MODEL["vocab_size"] for t in a.prompt)
        assert len(a.prompt) + a.max_tokens <= trace_workloads.TRACE_MODEL["n_positions"]


@pytest.mark.needs(5)
def test_a_saved_loadtest_workload_runs_and_its_tokens_are_generates(tmp_path):
    path = tmp_path / "w.jsonl"
    datasets.save_workload(datasets.make_workload(lab, "tiny", 12, seed=2), str(path))
    workload = trace_workloads.get_workload(str(path))
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
        trace_workloads.get_workload(str(path))
    assert str(path) in str(info.value)


@pytest.mark.provided
def test_an_unknown_workload_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="skewed, shared-prefix, memory-pressure, arrivals"):
        trace_workloads.get_workload(str(tmp_path / "nothing-here"))
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="binary.jsonl"):
        trace_workloads.get_workload(str(tmp_path / "binary.jsonl"))


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
@pytest.mark.parametrize("checkout", ["student's copy", "maintainers' checkout"])
def test_cli_trace_on_a_half_written_lab_names_the_missing_stub_and_where_its_run_is_seen(tmp_path, checkout):
    from tools.handout.make_lab import make_lab
    script = tmp_path / "lab_half.py"
    script.write_text(make_lab((ROOT / "solution.py").read_text(), only={"5"}))
    if checkout == "student's copy":  # it ships the reference's recorded pages, and no solution.py
        (tmp_path / "docs" / "reference-traces").mkdir(parents=True)
        (tmp_path / "docs" / "reference-traces" / "arrivals.html").write_text("<html></html>")
        pointed = "docs/reference-traces/arrivals.html is that run on a correct engine"
    else:  # it has no recorded pages, and the reference to record them from
        (tmp_path / "solution.py").write_text((ROOT / "solution.py").read_text())
        pointed = "`python solution.py trace --workload arrivals` records that run on the reference engine"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(script), "trace", "--workload", "arrivals", "--out",
                           str(tmp_path / "t.html")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "lab_half.py: Exercise 5: Scheduler.schedule is still a stub" in proc.stderr, proc.stderr
    assert pointed in proc.stderr, f"in the {checkout}, a stuck student is pointed to the reference run: {proc.stderr}"
    assert not (tmp_path / "t.html").exists(), "no page for a run that could not start"


# --- the rendered page, in a real browser ----------------------------------------------------
#
# Headless Chromium opens the page at `#step=N&request=ID` and dumps the DOM the script built
# (tests/course/browser.py); html.parser reads the data-* attributes back and the test compares
# them with the recording.

class RenderedPage(html.parser.HTMLParser):
    """What the script drew: the step, the queues, the plan, the pool, the tables, the detail."""

    VOID = {"input", "br", "meta", "img", "hr", "link"}

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.step = self.selected = None
        self.queues = {}
        self.ran = {}
        self.preempted = []
        self.blocks = {}
        self.tables = {}
        self.rows = []
        self.output = ""
        self._queue = []
        self._output_depth = 0
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


@pytest.mark.needs(5)
@needs_browser
def test_past_a_palettes_worth_of_requests_no_two_look_alike_by_hue_alone(tmp_path):
    workload_file = tmp_path / "w.jsonl"
    datasets.save_workload(datasets.make_workload(lab, "tiny", 30, seed=4), str(workload_file))
    rec = trace.record(lab, trace_workloads.get_workload(str(workload_file)))
    path = tmp_path / "trace.html"
    path.write_text(trace.render_page(rec))
    dom = dump_dom(path, f"step={len(rec.frames) - 1}")
    looks = {}
    for request, style in re.findall(r'<li class="chip[^"]*" data-request="([^"]+)" style="([^"]*)"', dom):
        looks.setdefault(request, set()).add(style)
    assert len(looks) == 30 and all(len(styles) == 1 for styles in looks.values()), (
        f"the last step lists all 30 requests, each in one look: {looks}")
    alike = [ids for ids in _grouped(looks) if len(ids) > 1]
    assert not alike, f"requests drawn alike (the same colour and pattern): {alike}"


def _grouped(looks: dict) -> list[list[str]]:
    by_look: dict = {}
    for request, styles in looks.items():
        by_look.setdefault(next(iter(styles)), []).append(request)
    return list(by_look.values())
