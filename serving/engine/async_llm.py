"""`AsyncLLM` (vLLM's name for the client side, `vllm/v1/engine/async_llm.py`): in the front end's
process, `submit` and `abort` send commands; the event loop reads the step outputs as they arrive
and hands each to its request's queue, where the request's handler (`output.ChoiceState`)
accumulates the text."""

from __future__ import annotations

import asyncio

from ..metrics import ITERATION_TOKENS_BUCKETS, Histogram
from ..protocol import APIError
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

READ_BATCH = 16  # engine messages handled per wakeup of the front end's loop
GAUGES = {"running": 0, "waiting": 0, "kv_usage": 0.0, "preemptions": 0, "queries": 0, "hits": 0,
          "iteration_tokens": Histogram(ITERATION_TOKENS_BUCKETS)}


class AsyncLLM:
    """The front end's side: hands requests to the EngineCore and routes its outputs back,
    request by request.

    Contract: every method runs on the event loop; the engine's messages are read there too,
    as they arrive, and commands are written there, never blocking. `submit` returns the
    request's queue, which receives the request's StepOutputs in order, the last one finished,
    or one `APIError` (refused by the engine's checks: its `param` is the field at fault;
    rejected; engine failure; shutdown).
    """

    def __init__(self, commands: PipeWriter, outputs: PipeReader):
        self.commands = commands
        self.outputs = outputs
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
