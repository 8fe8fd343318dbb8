"""`EngineCore` (vLLM: `vllm/v1/engine/core.py`): the engine in the caller's process, stepped by one
thread for as long as anything is in flight, taking the front end's commands between steps and
never waiting for the front end, and sending on what each step reports (`StepOutput`: the new
tokens only, with their logprobs where asked, and the prompt's logprobs once)."""

from __future__ import annotations

import dataclasses
import threading
from types import ModuleType

from .. import sampling
from ..metrics import StepCounts
from .messages import (
    AbortRequest,
    AddRequests,
    Answered,
    Bye,
    EngineFailed,
    Ready,
    Shutdown,
    StartupError,
    StepOutput,
    StepReport,
    sample_ids,
)
from .transport import PipeReader, PipeWriter


class EngineCore:
    """Owns the engine in the caller's process; talks to the front end through `commands`
    (received) and `outputs` (sent), from one thread.

    The thread reads whatever commands have arrived, steps, sends the step's outputs, and
    blocks on the pipe only when nothing is in flight. After a failed step it tells the front
    end, waits for its answer (the requests it failed), and steps again only for a new command,
    so an engine that stays broken costs nothing until somebody asks it for something. It ends
    when the front end says goodbye or its end of the pipe closes.
    """

    def __init__(self, lab: ModuleType, engine, commands: PipeReader, outputs: PipeWriter):
        self.lab = lab  # the module whose checks the engine runs
        self.engine = engine
        self.commands = commands
        self.outputs = outputs
        self.ready = threading.Event()  # the front end accepts connections (or has died)
        self.frontend_error: str | None = None
        self._inbox: list[AddRequests | AbortRequest] = []  # in order
        self._to_abort: set[str] = set()  # failed by the front end, still in the engine
        self._args: dict[str, dict] = {}  # extra_args of each sample in the engine
        self._prompt_logprobs: dict[str, list] = {}  # to go with a request's first output
        self._forks: dict[str, list[str]] = {}  # request id -> its samples' ids, until its first output
        self._logprobs = sampling.logprobs_of(engine)
        self.counts = StepCounts.attached(engine)  # /metrics' per-step counters
        self._answered = self._gone = False
        self._send_lock = threading.Lock()  # `close` sends from the caller's thread
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None) -> bool:
        """Wait for the engine's thread to end (None: however long); whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def send(self, message: StepReport | EngineFailed | Shutdown) -> bool:
        """To the front end; False once it has gone."""
        try:
            with self._send_lock:
                self.outputs.send(message)
            return True
        except (OSError, EOFError):
            return False

    def _receive(self, block: bool) -> None:
        """Handle every message that has arrived; with `block`, wait for the first."""
        try:
            while not self._gone and (block or self.commands.poll()):
                block = False
                self._on_message(self.commands.recv())
        except (OSError, EOFError):  # the front end has gone
            self._gone = True

    def _on_message(self, message) -> None:
        if isinstance(message, (AddRequests, AbortRequest)):  # the engine's, in order, between steps
            self._inbox.append(message)
        elif isinstance(message, Ready):
            self.ready.set()
        elif isinstance(message, StartupError):
            self.frontend_error = message.message
            self.ready.set()
        elif isinstance(message, Answered):
            self._drop_failed(set(message.request_ids))
            self._answered = True
        elif isinstance(message, Bye):
            self._gone = True

    def _drop_failed(self, failed: set[str]) -> None:
        """A request the front end failed must not run: drop its add if it has not reached the
        engine yet, else abort it (by `_flush`, before any new command)."""
        inbox = []
        pending = set()
        for command in self._inbox:
            if isinstance(command, AbortRequest):
                if command.request_id not in failed:
                    inbox.append(command)
                continue
            kept = [r for r in command.requests if r.request_id not in failed]
            for request in command.requests:
                if request.request_id in failed:
                    pending.update(sample_ids(request.request_id, command.n))
            if kept:
                inbox.append(AddRequests(kept, command.n))
        self._inbox = inbox
        self._to_abort |= failed - pending

    def _take_commands(self, new: bool = True) -> list[AddRequests | AbortRequest]:
        """The aborts the front end's failures asked for, then (with `new`) the commands in order."""
        commands: list = [AbortRequest(request_id) for request_id in self._to_abort]
        self._to_abort = set()
        if new:
            commands, self._inbox = commands + self._inbox, []
        return commands

    # --- the engine thread ---

    def _run(self) -> None:
        try:
            self._engine_loop()
        finally:
            if not self.ready.is_set():
                self.frontend_error = self.frontend_error or "the front end ended before it accepted connections"
            self.ready.set()

    def _has_work(self, stalled: bool) -> bool:
        return bool(self._inbox or self._to_abort) or (not stalled and self.engine.has_unfinished())

    def _engine_loop(self) -> None:
        stalled = False
        while not self._gone:
            self._receive(block=not self._has_work(stalled))
            if self._gone or not self._has_work(stalled):
                continue
            stalled = False
            try:
                rejected, outputs = self._step(self._take_commands())
                gauges = self._gauges()  # the lab's num_free_blocks: if it raises, the engine failed too
            except Exception as exc:  # the engine failed: the front end fails what is in flight
                self._answered = False
                if self.send(EngineFailed(f"the engine failed: {type(exc).__name__}: {exc}")):
                    while not (self._answered or self._gone):
                        self._receive(block=True)
                stalled = not self._flush()
                continue
            if not self.send(StepReport(rejected, outputs, gauges)):
                self._gone = True
        self._to_abort |= set(self._args)  # the front end has gone: nobody waits for these
        self._flush()

    def _step(self, commands: list[AddRequests | AbortRequest]) -> tuple[dict[str, tuple], list[StepOutput]]:
        rejected = {}
        outputs = []
        for command in commands:
            if isinstance(command, AbortRequest):
                self.engine.abort_request(command.request_id)
                continue
            for request in command.requests:
                try:
                    outputs += self._add(request, command.n)
                except ValueError as exc:  # the engine's checks: the field at fault is the error's
                    for sample_id in sample_ids(request.request_id, command.n):
                        rejected[sample_id] = (getattr(exc, "argument", None), str(exc))
        if self.engine.has_unfinished():
            self.counts.before_step(self.engine.scheduler.waiting)
            step_outputs = self.engine.step()
            self.counts.after_step({out.request_id: len(out.new_token_ids) for out in step_outputs})
            for out in step_outputs:
                outputs += self._outputs(out)
        return rejected, outputs

    def _add(self, request, n: int) -> list[StepOutput]:
        """Queue `request` in the engine with its `n` samples, its prompt's logprobs computed first
        if it asks for them. A request for 0 tokens (echo with max_tokens 0) is checked as one for a
        single token, answered here with its prompt's logprobs, and never queued."""
        args = request.sampling.extra_args or {}
        samples = sample_ids(request.request_id, n)
        prompt_only = request.sampling.max_tokens == 0
        if prompt_only:
            one = dataclasses.replace(request.sampling, max_tokens=1)
            self.lab.check_request(dataclasses.replace(request, sampling=one), self.engine.model.config)
        else:
            self.engine.add_request(request, n=n)
            self._args |= dict.fromkeys(samples, args)
            if n > 1:
                self._forks[request.request_id] = samples[1:]
        scored = None
        if args.get("prompt_logprobs") is not None:
            scored = sampling.prompt_logprobs(self.engine.model, request.prompt_token_ids, args["prompt_logprobs"])
        if prompt_only:
            return [StepOutput(s, [], None, scored if s == request.request_id else None, "length") for s in samples]
        if scored is not None:
            self._prompt_logprobs[request.request_id] = scored
        return []

    def _flush(self) -> bool:
        """Abort what the front end failed, and let one step hand out the aborted outputs
        (nobody waits for them); whether the engine survived it. New commands wait."""
        try:
            self._step(self._take_commands(new=False))
        except Exception:  # noqa: BLE001 - a broken engine stays broken; each new request gets its 500
            return False
        return True

    def _outputs(self, out) -> list[StepOutput]:
        """The engine's output for one sample, with the logprobs of its new tokens where asked. A
        request that ended before its prompt ran never forked: a refusal ("rejected") is its
        samples' too, and nothing else of theirs will come."""
        request_id = out.request_id
        args = self._args.get(request_id, {})
        logprobs = None
        if args.get("logprobs") is not None and self._logprobs is not None:
            logprobs = [self._logprobs.take(request_id, t, args["logprobs"]) for t in out.new_token_ids]
        if out.finished:
            self._args.pop(request_id, None)
            if self._logprobs is not None:
                self._logprobs.forget(request_id)
        first = StepOutput(request_id, out.new_token_ids, logprobs, self._prompt_logprobs.pop(request_id, None),
                           out.finish_reason, out.finish_detail)
        forks = self._forks.pop(request_id, ())
        if not forks or out.new_token_ids:  # no samples, or they forked with this output's token
            return [first]
        for sample_id in forks:
            self._args.pop(sample_id, None)
        rejected = out.finish_reason == "rejected"
        return [first] + [StepOutput(s, [], None, None, "rejected", out.finish_detail) for s in forks if rejected]

    def _gauges(self) -> dict[str, float]:
        engine, allocator = self.engine, self.engine.allocator
        try:
            free = allocator.num_free_blocks
        except NotImplementedError:  # a lab whose Exercise 1 is a stub still answers what needs no engine
            free = allocator.num_blocks
        return {"running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
                "kv_usage": 1.0 - free / allocator.num_blocks, "preemptions": engine.num_preemptions,
                "queries": self.counts.queries, "hits": self.counts.hits,
                "iteration_tokens": self.counts.iteration_tokens}
