"""`python solution.py trace`: watch the module's own engine run, one step at a time.

The trace runs a small workload through the module's `LLMEngine` (so through the student's
scheduler, block tables and allocator), records every step, and writes ONE self-contained HTML
page: the recording as inline JSON, and inline the page's HTML, CSS and the script that draws a
step (trace_page/page.html, page.css, page.js: package data beside this module); nothing fetched,
so it works from `file://`. The workloads are in trace_workloads.py.

Recording wraps nothing and reads nothing private. The trace builds its own engine with a
`Recorder` as its observer (`LLMEngine(observer=...)`): the engine sends it an event for each
sequence a step runs, each preemption and the request that was short of a block, each
copy-on-write, and every block the pool allocates, finds in the prefix cache, caches, evicts and
frees. After each `engine.step()` it reads the queues, the block pool and the block tables through
public attributes and methods, and checks them against its own account of the pool, kept from the
events. An engine built without an observer sends nothing and runs the plain BlockAllocator:
tracing costs nothing when it is not asked for (`python solution.py bench trace` measures both).

The page's frame N is the state after step N (frame 0: before the first step), with what step N
did: the requests it ran (a prefill chunk, a decode step, or the recompute of a preempted one),
the prefix-cache hits of the ones it admitted, its preemptions and why, its copies, the pool's
events and the tokens it sampled. Every number the page draws at step N is read from frame N; the
script derives nothing but the slot ranges of a table's rows (from the recorded slot runs) and
each request's tokens so far.
"""

from __future__ import annotations

import collections
import dataclasses
import html
import json
import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import numpy as np

from .trace_workloads import Workload, get_workload

MODEL_SEED = 0  # the toy model's weights (its shape is the workload's)
MAX_STEPS = 1000  # a scheduler that never finishes still gets a page: the first MAX_STEPS steps

# =====================================================================================
# Running a workload, and recording it
# =====================================================================================


def build_engine(lab: ModuleType, workload: Workload, observer=None):
    """The workload's engine on the module's toy GPT-2; with `observer`, an engine that reports to it."""
    model = lab.ToyTransformer(lab.ModelConfig(**workload.model), seed=MODEL_SEED)
    if observer is None:
        return lab.LLMEngine(model, **workload.engine)
    return lab.LLMEngine(model, **workload.engine, observer=observer)


def drive(engine, lab: ModuleType, workload: Workload, recorder: Recorder | None = None,
          max_steps: int = MAX_STEPS) -> list[list]:
    """Run the workload on the engine: before each step add the requests whose step has come
    (an idle engine skips ahead to the next arrivals), then step, until every request is done or
    `max_steps` steps ran. Returns each step's outputs (`engine.step()`'s list)."""
    pending = collections.deque(sorted(workload.arrivals, key=lambda a: a.step))
    outputs: list[list] = []
    skipped = 0  # steps of the workload's clock that an idle engine skipped
    while (pending or engine.has_unfinished()) and len(outputs) < max_steps:
        if pending and not engine.has_unfinished():
            skipped = max(skipped, pending[0].step - len(outputs))
        arrived = []
        while pending and pending[0].step <= len(outputs) + skipped:
            arrival = pending.popleft()
            if arrival.n > 1:  # only then: a lab whose engine predates `n` still runs the other workloads
                arrived.append(engine.add_request(arrival.request(lab), n=arrival.n))
            else:
                arrived.append(engine.add_request(arrival.request(lab)))
        if recorder is not None:
            recorder.arrived(arrived)
        outputs.append(engine.step())
        if recorder is not None:
            recorder.stepped(outputs[-1])
    return outputs


def _slot_runs(slots: Sequence[int]) -> list[list[int]]:
    """Positions -> slots as runs `[first position, first slot, length]` of consecutive slots."""
    runs: list[list[int]] = []
    for pos, slot in enumerate(int(s) for s in slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            runs[-1][2] += 1
        else:
            runs.append([pos, slot, 1])
    return runs


STATES = {".": "free", "e": "cached", "h": "held", "H": "held+cached", "!": "inconsistent"}
POOL_EVENTS = ("allocated", "prefix_hit", "cached", "evicted", "freed")  # EngineEventType values, the pool's


class Recorder:
    """Records one engine's steps as frames (plain dicts, the page's JSON). It listens: it is the
    engine's observer (`build_engine(lab, workload, observer=recorder)`, then `watch(engine)`), and
    what a step did comes from the events the engine sent during it; the state after the step is
    read through public attributes and methods. It keeps its own account of the pool from the
    events (which blocks are out of the pool, which are cached) and reports every block where the
    allocator's own answers (`ref_count`, `is_cached`) disagree with it."""

    def __init__(self, lab: ModuleType):
        self.types = lab.EngineEventType
        self.engine = None
        self.frames: list[dict] = []
        self._held: set[int] = set()  # blocks the events took out of the pool and did not give back
        self._cached: set[int] = set()  # blocks the events made findable and did not evict
        self._arrived: list[str] = []
        self._begin_step()

    def watch(self, engine) -> None:
        """Start recording `engine`, built with this recorder as its observer: frame 0."""
        self.engine = engine
        self._begin_step()
        self.frames.append(self._frame(0, [], []))

    def _begin_step(self) -> None:
        """Forget the last step's events; the queues as the next step starts (public attributes)."""
        scheduler = self.engine.scheduler if self.engine is not None else None
        self._waiting_before = {seq.request_id for seq in scheduler.waiting} if scheduler else set()
        self._running_before = [seq.request_id for seq in scheduler.running] if scheduler else []
        self._ran: list[dict] = []
        self._admitted: dict[str, int] = {}
        self._preempted: list[dict] = []
        self._copies: list[list[int]] = []
        self._blocks: dict[str, list[int]] = {kind: [] for kind in POOL_EVENTS}
        self._short: tuple[str, int, int] | None = None  # the last sequence that found no free block

    def __call__(self, event) -> None:
        """One event from the engine, as it happens."""
        kind = event.type
        if kind is self.types.SCHEDULED:
            seq = self.engine.requests[event.request_id]
            self._ran.append(self._scheduled(seq, event.num_tokens))
            if seq.request_id in self._waiting_before:  # admitted now: what it starts from is its cache hit
                self._admitted[seq.request_id] = seq.num_computed_tokens
        elif kind is self.types.OUT_OF_BLOCKS:
            self._short = (event.request_id, event.num_tokens, self.engine.allocator.num_free_blocks)
        elif kind is self.types.PREEMPTED:
            self._preempted.append({"id": event.request_id, "reason": self._reason(event.request_id)})
        elif kind is self.types.COPIED:
            self._copies.append([int(b) for b in event.block_ids])
        else:
            self._account(kind.value, [int(b) for b in event.block_ids])

    def _account(self, kind: str, block_ids: list[int]) -> None:
        """A pool event, into this step's list and the recorder's own account of the pool."""
        self._blocks[kind] += block_ids
        for b in block_ids:
            if kind in ("allocated", "prefix_hit"):
                self._held.add(b)
            elif kind == "freed":
                self._held.discard(b)
            elif kind == "cached":
                self._cached.add(b)
            else:  # evicted
                self._cached.discard(b)

    def _reason(self, victim: str) -> str:
        """Why `victim` is being preempted, in words: who was short of a block, and whether the
        victim is the newest request still running (the one the chapter's scheduler picks)."""
        gone = {p["id"] for p in self._preempted}
        left = [rid for rid in self._running_before if rid not in gone]
        newest = left[-1] if left else None
        which = ("the newest running request" if victim == newest else
                 f"not the newest running request ({newest})" if newest else "a request that was not running")
        if self._short is None:
            return f"the pool had no free block for the running requests' next tokens; {victim} is {which}"
        who, n, free = self._short
        need = f"{who} needed a new block for its next {n} token{'s' if n != 1 else ''} and {free} were free"
        if who == victim:
            return f"{need}; {victim}, {which}, gave up its own blocks (it will recompute)"
        return f"{need}: {victim}, {which}, gave its blocks back (it will recompute)"

    @staticmethod
    def _scheduled(seq, n: int) -> dict:
        start, total, prompt = seq.num_computed_tokens, seq.num_tokens, len(seq.prompt_token_ids)
        if n == 1 and start == total - 1 and total > prompt:
            kind = "decode"
        else:
            kind = "recompute" if seq.num_preemptions else "prefill"
        return {"id": seq.request_id, "n": n, "kind": kind, "start": start, "samples": start + n == total}

    def arrived(self, request_ids: list[str]) -> None:
        """Requests added before the next step (frame 0 takes those added before the first)."""
        if len(self.frames) == 1:  # before the first step
            self.frames[0] = self._frame(0, request_ids, [])
        else:
            self._arrived = list(request_ids)
        self._begin_step()

    def stepped(self, outputs: list) -> None:
        """After `engine.step()` returned `outputs`: frame N, from the events of the step."""
        frame = self._frame(len(self.frames), self._arrived, outputs)
        self._arrived = []
        self.frames.append(frame)
        self._begin_step()

    def _pool(self) -> tuple[str, list[int], list[str]]:
        """Each block's state code (STATES) and reference count, as the allocator answers, and
        where those answers disagree with what the events said happened to the block."""
        alloc = self.engine.allocator
        codes, refs, problems = [], [], []
        for b in range(alloc.num_blocks):
            ref, cached = alloc.ref_count(b), alloc.is_cached(b)
            held = b in self._held
            if (ref > 0) != held or cached != (b in self._cached):
                codes.append("!")
                told = f"{'held' if held else 'free'}{', cached' if b in self._cached else ''}"
                problems.append(f"block {b}: the engine's events left it {told}, but the allocator says "
                                f"reference count {ref}{', cached' if cached else ''}")
            else:
                codes.append(("H" if cached else "h") if ref else ("e" if cached else "."))
            refs.append(ref)
        return "".join(codes), refs, problems

    def _tables(self) -> dict[str, dict]:
        """Every unfinished sequence's block table that holds blocks: its block ids, its tokens,
        its computed tokens and its positions -> slots as the table's own `slots()` gives them:
        None when they are `block * block_size + offset` for every position (the page then
        draws that), else their runs (`_slot_runs`), so a wrong mapping is drawn as it is."""
        scheduler = self.engine.scheduler
        tables = {}
        for seq in [*scheduler.running, *scheduler.waiting]:
            table = seq.block_table
            if not table.block_ids:
                continue
            blocks, n, size = [int(b) for b in table.block_ids], table.num_tokens, table.block_size
            slots = np.asarray(table.slots(0, n))
            positions = np.arange(n)
            usual = slots.shape == (n,) and bool(np.all(slots == np.asarray(blocks)[positions // size] * size
                                                        + positions % size))
            tables[seq.request_id] = {"blocks": blocks, "tokens": n, "computed": seq.num_computed_tokens,
                                      "slots": None if usual else _slot_runs(slots.ravel())}
        return tables

    def _frame(self, step: int, arrived: list[str], outputs: list) -> dict:
        scheduler, stats = self.engine.scheduler, self.engine.allocator.stats
        state, ref, problems = self._pool()
        tables = self._tables()
        before = self.frames[-1]["tables"] if self.frames else {}
        holders = collections.Counter(b for t in tables.values() for b in t["blocks"])
        problems += [f"block {b} has reference count {r} but {holders[b]} block table(s) hold it"
                     for b, r in enumerate(ref) if r != holders[b]]
        return {
            "step": step,
            "arrived": list(arrived),
            "ran": self._ran if step else [],
            "admitted": self._admitted if step else {},
            "preempted": self._preempted if step else [],
            "copies": self._copies if step else [],
            "blocks": self._blocks if step else {kind: [] for kind in POOL_EVENTS},
            "sampled": {out.request_id: [int(t) for t in out.new_token_ids] for out in outputs if out.new_token_ids},
            "finished": {out.request_id: out.finish_reason for out in outputs if out.finish_reason},
            "waiting": [seq.request_id for seq in scheduler.waiting],
            "running": [seq.request_id for seq in scheduler.running],
            "state": state,
            "ref": ref,
            "tables": tables,
            "grew": {rid: [b for b in t["blocks"] if b not in before.get(rid, {}).get("blocks", ())]
                     for rid, t in tables.items()},
            "cache": [stats.queries, stats.hits, stats.evictions],
            "problems": problems,
        }


@dataclasses.dataclass
class Trace:
    """A recorded run: the workload, the engine's settings, one frame per step, and how it ended."""

    workload: Workload
    prog: str
    frames: list[dict]
    error: str | None = None  # the step that raised (not a stub), in words
    truncated: bool = False  # stopped after MAX_STEPS with requests unfinished

    @property
    def outputs(self) -> dict[str, list[int]]:
        """Each request's output tokens, as the steps returned them."""
        tokens: dict[str, list[int]] = {rid: [] for a in self.workload.arrivals for rid in a.request_ids}
        for frame in self.frames:
            for rid, new in frame["sampled"].items():
                tokens[rid] += new
        return tokens

    def data(self) -> dict:
        """What the page embeds: the run's settings, the requests, the frames."""
        w = self.workload
        return {
            "prog": self.prog, "workload": w.name, "title": w.title, "look_for": w.look_for,
            "engine": w.engine, "model": w.model, "error": self.error, "truncated": self.truncated,
            "num_blocks": w.engine["num_blocks"], "block_size": w.engine["block_size"],
            "requests": {rid: {"prompt": list(a.prompt), "max_tokens": a.max_tokens, "salt": a.cache_salt}
                         for a in w.arrivals for rid in a.request_ids},
            "frames": self.frames, "open": opening_step(self.frames),
        }


def opening_step(frames: list[dict]) -> int:
    """The step the page opens on (without `#step=N`): the first where the mechanisms show, a
    preemption, a copy-on-write or a prefix-cache hit; else the first that retires a request;
    else the first step that ran anything. Step 0 is the empty state before the run."""
    def hit(i: int) -> bool:
        return frames[i]["cache"][1] > frames[i - 1]["cache"][1]

    for wanted in (lambda i: frames[i]["preempted"] or frames[i]["copies"] or hit(i),
                   lambda i: frames[i]["finished"], lambda i: frames[i]["ran"]):
        found = next((i for i in range(1, len(frames)) if wanted(i)), None)
        if found is not None:
            return found
    return 0


def record(lab: ModuleType, workload: Workload, max_steps: int = MAX_STEPS) -> Trace:
    """Run the workload on a fresh engine of the module, recording every step. A stub raises its
    NotImplementedError (there is nothing to draw); any other error of a step ends the recording
    there, and the trace keeps the steps before it and says what raised."""
    recorder = Recorder(lab)
    engine = build_engine(lab, workload, observer=recorder)
    recorder.watch(engine)
    trace = Trace(workload, os.path.basename(lab.__file__), recorder.frames)
    try:
        drive(engine, lab, workload, recorder, max_steps)
    except NotImplementedError:
        raise
    except Exception as exc:
        trace.error = f"step {len(recorder.frames)} raised {type(exc).__name__}: {exc}"
    trace.truncated = trace.error is None and engine.has_unfinished()
    return trace


# =====================================================================================
# The page
# =====================================================================================


def page_json(trace: Trace) -> str:
    """The recording as the page embeds it: compact JSON that cannot close its <script>."""
    text = json.dumps(trace.data(), separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


# The page's HTML, CSS and script, package data beside this module: the page inlines them.
PAGE_FILES = Path(__file__).resolve().parent / "trace_page"


def render_page(trace: Trace) -> str:
    """The page: trace_page/page.html with its title, the CSS and the script inlined, and the recording."""
    title = f"Trace of {trace.prog}: {trace.workload.title}"
    page, css, script = ((PAGE_FILES / name).read_text(encoding="utf-8") for name in ("page.html", "page.css",
                                                                                        "page.js"))
    return (page.replace("%TITLE%", html.escape(title))
                .replace("%CSS%", css)
                .replace("%SCRIPT%", script)
                .replace("%DATA%", page_json(trace)))


def write_trace(lab: ModuleType, workload: str, path: str) -> Trace:
    """Record the workload (a name or a `loadtest --save-workload` file) on the module's engine
    and write the page to `path`."""
    trace = record(lab, get_workload(workload))
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(render_page(trace))
    except OSError as exc:  # a ValueError: the command line says it in one line, exit 2
        raise ValueError(f"cannot write the page to {path}: {exc.strerror or exc}") from None
    return trace

