"""The engine and the HTTP front end in two processes, joined by two pipes.

vLLM V1 splits a server the same way: the engine core busy-loops in a process of its own, and
the API server (HTTP, tokenizing, detokenizing, one JSON event per token) runs in another, so
that the two never take turns on one interpreter lock. A thread would not do: in CPython only
one thread runs Python at a time, and a small model's step is mostly Python, so an HTTP loop
in the engine's process adds its time to every step instead of overlapping it
(`tools/bench.py serving` measures both).

Here the engine stays where the caller made it (the caller keeps the object it passed in,
and can look at it afterwards), and the front end is the forked child:

- `EngineCore` (the caller's process): one thread steps the engine for as long as anything is
  in flight, taking the front end's commands between steps and never waiting for the front
  end, and sends on what each step reports (`StepOutput`: the new tokens only, with their
  logprobs where asked, and the prompt's logprobs once).
- `AsyncLLM` (the front end's process, vLLM's name for the client side): `submit` and `abort`
  send commands; the event loop reads the step outputs as they arrive and hands each to its
  request's queue, where the request's handler (`output.ChoiceState`) accumulates the text.

What crosses the boundary is the messages below, one small dataclass per kind: the front end
sends `Ready`, `StartupError`, `AddRequests`, `AbortRequest`, `Answered` and `Bye` through a
`command_pipe`; the engine sends `StepReport`, `EngineFailed` and `Shutdown` through a
multiprocessing Connection. Both sides pickle them.

`n` has one home, the engine: `AddRequests` carries each prompt once, with its `n`, and
`LLMEngine.add_request(request, n=n)` runs the prompt once and forks its block table for the
other samples, which the engine names `sample_ids` (docs/sampling.md says why here and not in
the front end, as vLLM V1 does it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
import select
import struct
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import NamedTuple

from . import sampling
from .metrics import ITERATION_TOKENS_BUCKETS, Histogram, StepCounts
from .protocol import APIError

READ_BATCH = 16  # engine messages handled per wakeup of the front end's loop
_LENGTH = struct.Struct("!Q")  # a command's frame: its pickle's length, then the pickle
GAUGES = {"running": 0, "waiting": 0, "kv_usage": 0.0, "preemptions": 0, "queries": 0, "hits": 0,
          "iteration_tokens": Histogram(ITERATION_TOKENS_BUCKETS)}


def sample_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's `n` samples, as the engine names them (`LLMEngine.add_request`): the
    request's own id for sample 0, then "ID.1" .. "ID.{n-1}", the forks. Choice j of a prompt is
    sample j."""
    return [request_id] + [f"{request_id}.{j}" for j in range(1, n)]


# --- what crosses the boundary: front end -> engine ----------------------------------------


@dataclasses.dataclass(slots=True)
class Ready:
    """The front end accepts connections."""


@dataclasses.dataclass(slots=True)
class StartupError:
    """The front end could not start: why."""

    message: str


@dataclasses.dataclass(slots=True)
class AddRequests:
    """Requests to queue, in one step: one response's prompts, a Request each. The engine runs each
    prompt once and forks it into `n` samples (`sample_ids`)."""

    requests: list
    n: int = 1


@dataclasses.dataclass(slots=True)
class AbortRequest:
    """Stop a sample now (its client went, a stop string ended it, or the front end failed it)."""

    request_id: str


@dataclasses.dataclass(slots=True)
class Answered:
    """After `EngineFailed`: the samples the front end failed; the engine drops or aborts them."""

    request_ids: list[str]


@dataclasses.dataclass(slots=True)
class Bye:
    """The front end is done: nothing after this."""


# --- what crosses the boundary: engine -> front end ----------------------------------------


@dataclasses.dataclass(slots=True)
class StepReport:
    """What one engine step did: the samples the engine's checks refused ({id: (field, message)}),
    each sample's output, and the gauges of /metrics after the step."""

    rejected: dict[str, tuple[str | None, str]]
    outputs: list[StepOutput]
    gauges: dict[str, float]


@dataclasses.dataclass(slots=True)
class EngineFailed:
    """A step raised: every request in flight fails with `message`; the engine waits for `Answered`."""

    message: str


@dataclasses.dataclass(slots=True)
class Shutdown:
    """The server is closing: the front end stops taking requests and ends those in flight."""


def command_pipe() -> tuple[CommandReader, CommandWriter]:
    """The front end -> engine direction: a plain pipe of length-prefixed pickles. Not a
    multiprocessing Connection, whose `send` blocks while the pipe is full: the front end's
    loop writes without ever blocking, and keeps what does not fit until the pipe drains."""
    read_fd, write_fd = os.pipe()
    return CommandReader(read_fd), CommandWriter(write_fd)


class _PipeEnd:
    """One end of a command pipe: its descriptor, closed once (-1 after)."""

    def __init__(self, fd: int):
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class CommandReader(_PipeEnd):
    """The engine's end: `poll` and `recv` as a Connection's (EOFError once the writer has gone)."""

    def __init__(self, fd: int):
        super().__init__(fd)
        # poll, not select: select refuses a descriptor numbered 1024 or more, and the engine
        # runs in the caller's process, which may hold that many files.
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)

    def poll(self) -> bool:
        """A command (or the end of the pipe) is there to read."""
        return bool(self._poller.poll(0))

    def recv(self) -> object:
        (length,) = _LENGTH.unpack(self._read(_LENGTH.size))
        return pickle.loads(self._read(length))

    def _read(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = os.read(self.fd, n - len(data))
            if not chunk:
                raise EOFError("the front end closed its end of the pipe")
            data += chunk
        return bytes(data)


class CommandWriter(_PipeEnd):
    """The front end's end. Until `attach`, `send` writes the whole frame and may block (the
    front end's start-up error, before its loop runs). Once attached to a loop, `send` writes
    what the pipe takes now and leaves the rest to the loop's writer callback, in order."""

    def __init__(self, fd: int):
        super().__init__(fd)
        self._unsent = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_gone = None
        self._waiting = False  # a writer callback is registered for what is unsent

    def attach(self, loop: asyncio.AbstractEventLoop, on_gone) -> None:
        """From now on never block; `on_gone()` (on the loop) once the engine's end has closed."""
        os.set_blocking(self.fd, False)
        self._loop, self._on_gone = loop, on_gone

    def detach(self) -> None:
        """Back to blocking writes: the loop has ended (what is unsent goes first)."""
        if self.fd >= 0:
            os.set_blocking(self.fd, True)
        self._loop = None

    def send(self, message: object) -> None:
        if self.fd < 0:  # the engine has gone: nobody reads commands any more
            return
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        self._unsent += _LENGTH.pack(len(data)) + data
        if self._loop is None:  # not attached: all of it, now
            while self._unsent:
                del self._unsent[:os.write(self.fd, self._unsent)]
        elif not self._waiting:
            self._write()

    def _write(self) -> None:
        try:
            del self._unsent[:os.write(self.fd, self._unsent)]
        except BlockingIOError:  # the pipe is full: the engine is busy, and reads between steps
            pass
        except OSError:  # the engine's process has gone
            self._unsent.clear()
            self._wait_writable(False)
            self.close()
            self._on_gone()
            return
        self._wait_writable(bool(self._unsent))

    def _wait_writable(self, wait: bool) -> None:
        if wait != self._waiting:
            (self._loop.add_writer(self.fd, self._write) if wait else self._loop.remove_writer(self.fd))
            self._waiting = wait

    def flush(self, timeout: float, outputs: Connection, on_output) -> None:
        """Write what is unsent, for at most `timeout` seconds, handing whatever arrives on
        `outputs` meanwhile to `on_output()` (an engine blocked writing its outputs to a front end
        that has stopped reading would never read this)."""
        deadline = time.monotonic() + timeout
        poller = select.poll()
        poller.register(outputs.fileno(), select.POLLIN)
        poller.register(self.fd, select.POLLOUT)
        while self._unsent and self.fd >= 0 and (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(left * 1000))
            if outputs.fileno() in ready:
                on_output()
            if self.fd in ready:
                self._write()


class StepOutput(NamedTuple):
    """One request's part of one engine step, as the front end receives it: the engine's output
    (only what is new) with the logprobs of its new tokens where asked, and the prompt's
    logprobs with the request's first output where asked."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    finish_reason: str | None = None
    finish_detail: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCore:
    """Owns the engine in the caller's process; talks to the front end through `commands`
    (received) and `outputs` (sent), from one thread.

    The thread reads whatever commands have arrived, steps, sends the step's outputs, and
    blocks on the pipe only when nothing is in flight. After a failed step it tells the front
    end, waits for its answer (the requests it failed), and steps again only for a new command,
    so an engine that stays broken costs nothing until somebody asks it for something. It ends
    when the front end says goodbye or its end of the pipe closes.
    """

    def __init__(self, engine, commands: CommandReader, outputs: Connection):
        self.engine, self.commands, self.outputs = engine, commands, outputs
        self.ready = threading.Event()  # the front end accepts connections (or has died)
        self.frontend_error: str | None = None
        self._inbox: list[AddRequests | AbortRequest] = []  # in order
        self._to_abort: set[str] = set()  # failed by the front end, still in the engine
        self._args: dict[str, dict] = {}  # extra_args of each sample in the engine
        self._prompt_logprobs: dict[str, list] = {}  # to go with a request's first output
        self._forks: dict[str, list[str]] = {}  # request id -> its samples' ids, until its first output
        self._logprobs = sampling.logprobs_of(engine)
        self._lab = sys.modules[type(engine).__module__]  # the module whose checks the engine runs
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
        inbox, pending = [], set()
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
        rejected, outputs = {}, []
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
            self._lab.check_request(dataclasses.replace(request, sampling=one), self.engine.model.config)
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


class AsyncLLM:
    """The front end's side: hands requests to the EngineCore and routes its outputs back,
    request by request.

    Contract: every method runs on the event loop; the engine's messages are read there too,
    as they arrive, and commands are written there, never blocking. `submit` returns the
    request's queue, which receives the request's StepOutputs in order, the last one finished,
    or one `APIError` (refused by the engine's checks: its `param` is the field at fault;
    rejected; engine failure; shutdown).
    """

    def __init__(self, commands: CommandWriter, outputs: Connection):
        self.commands, self.outputs = commands, outputs
        self.streams: dict[str, asyncio.Queue] = {}
        self.closing = False
        self.gauges = dict(GAUGES)  # as of the last step (an idle server reports an idle engine)
        self.on_close = None  # called on the loop when the engine asks the front end to stop

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the engine's messages on `loop` as they arrive, and write commands there."""
        self._loop = loop
        loop.add_reader(self.outputs.fileno(), self._read_outputs)
        # Never blocking matters: while the engine is busy writing a step's outputs to this
        # loop, a loop blocked on writing a command to the engine would wait for it forever.
        self.commands.attach(loop, lambda: self._fail_all(APIError("the engine has stopped", 503, "server_error"),
                                                          answer=False))

    def send(self, message: Ready | StartupError | AddRequests | AbortRequest | Answered | Bye) -> None:
        """A command for the engine, written now, or as soon as the pipe has room."""
        self.commands.send(message)

    def finish(self, timeout: float) -> None:
        """Say goodbye to the engine and wait until every command before it is written."""
        self.send(Bye())
        self.commands.flush(timeout, self.outputs, self._read_outputs)

    def submit(self, requests: list, queue: asyncio.Queue | None = None, n: int = 1) -> asyncio.Queue:
        """Queue `requests` for the engine in one command, so they reach the same step, each
        sampled `n` times; their samples' outputs go to `queue` (a new one by default; the
        choices of one response share one: outputs carry their sample's id, `sample_ids`)."""
        queue = asyncio.Queue() if queue is None else queue
        if self.closing:
            queue.put_nowait(APIError("the server is shutting down", 503, "server_error"))
            return queue
        for request in requests:
            self.streams |= dict.fromkeys(sample_ids(request.request_id, n), queue)
        self.send(AddRequests(list(requests), n))
        return queue

    def abort(self, request_id: str) -> bool:
        """Abort a sample in flight; whether it was (False: finished, failed, or never submitted).
        Aborting a request's sample 0 before its prompt ran drops the samples it would fork; after
        that each sample runs on its own, and aborting all of them is the caller's."""
        if self.streams.pop(request_id, None) is None:
            return False
        self.send(AbortRequest(request_id))
        return True

    def _read_outputs(self) -> None:
        """Handle the messages that have arrived, a few at a time (the loop has sockets to
        serve too); the end of the pipe (the engine's process has gone) stops the front end."""
        try:
            for _ in range(READ_BATCH):
                if not self.outputs.poll():
                    return
                self._on_message(self.outputs.recv())
        except (OSError, EOFError):
            self._loop.remove_reader(self.outputs.fileno())
            self._on_message(Shutdown())

    def _on_message(self, message: StepReport | EngineFailed | Shutdown) -> None:
        if isinstance(message, StepReport):
            self.gauges = message.gauges
            for request_id, (field, error) in message.rejected.items():  # the id is the engine's, not the client's
                self._finish(request_id, APIError(error.removeprefix(f"request {request_id!r}: "), param=field))
            for out in message.outputs:
                self._deliver(out)
        elif isinstance(message, EngineFailed):
            self._fail_all(APIError(message.message, 500, "server_error"))
        elif isinstance(message, Shutdown) and self.on_close is not None:
            self.on_close()

    def _deliver(self, out: StepOutput) -> None:
        queue = self.streams.get(out.request_id)
        if queue is None:  # aborted, or failed: nobody waits for it
            return
        if out.finish_reason == "rejected":
            self._finish(out.request_id, APIError(f"this server can never run the request: {out.finish_detail}"))
            return
        queue.put_nowait(out)
        if out.finished:
            del self.streams[out.request_id]

    def _finish(self, request_id: str, error: APIError) -> None:
        queue = self.streams.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(error)

    def _fail_all(self, error: APIError, answer: bool = True) -> list[str]:
        """Send `error` to every request in flight; with `answer`, tell the engine which they
        were (it drops or aborts them)."""
        request_ids = list(self.streams)
        for request_id in request_ids:
            self._finish(request_id, error)
        if answer:
            self.send(Answered(request_ids))
        return request_ids

    def close(self) -> None:
        """Stop taking requests and end every request in flight with a 503 (the engine aborts them)."""
        self.closing = True
        self._fail_all(APIError("the server is shutting down", 503, "server_error"))
