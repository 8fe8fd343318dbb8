"""One thread owns the engine and steps it on its own; the event loop hands it requests and routes
its outputs.

vLLM's `AsyncLLM` (`vllm/v1/engine/async_llm.py`) does this job with the engine core busy-looping
in another process; here it is a thread, because the NumPy engine releases the GIL in its
matmuls. What matters is the same in both: the engine never waits for the HTTP side. It starts
the next step as soon as the last one is done, while the loop is still writing the last step's
tokens to the sockets, so the cost of HTTP overlaps the engine instead of adding to it.
"""

from __future__ import annotations

import asyncio
import threading

from .protocol import APIError


class AsyncLLM:
    """Hands requests to the engine and routes its outputs back, request by request.

    Contract: only the engine thread (started by `run`) ever calls the engine; everything else
    here runs on the event loop. `submit` returns the request's queue, which receives a
    RequestOutput per step that gave it a token and ends with a finished one, or receives one
    `APIError` (rejected by the engine, engine failure, shutdown). An error in a step fails the
    requests then in flight (500) and the bridge goes on serving.

    The two sides share only `_inbox` (commands, in order: ("add", Request) or ("abort",
    request_id), under `_inbox_lock`) and two events; outputs come back as callbacks on the loop
    (`call_soon_threadsafe`), so `streams` is the loop's alone.
    """

    def __init__(self, engine):
        self.engine = engine
        self.streams: dict[str, asyncio.Queue] = {}
        self._inbox: list[tuple[str, object]] = []
        self._inbox_lock = threading.Lock()
        self._wakeup = threading.Event()  # the inbox gained a command, or the bridge is closing
        self._answered = threading.Event()  # after a failed step: the loop has failed its requests
        self.closing = False
        # As of the last step (so an idle server reports an idle engine without touching it).
        self.gauges = {"running": 0, "waiting": 0, "kv_usage": 0.0, "preemptions": 0, "queries": 0, "hits": 0}

    def submit(self, request, queue: asyncio.Queue | None = None) -> asyncio.Queue:
        """Queue `request` for the engine; its outputs go to `queue` (a new one by default; several
        requests may share one, as the choices of one response do: outputs carry their request_id)."""
        queue = asyncio.Queue() if queue is None else queue
        if self.closing:  # the thread that would feed the queue has stopped
            queue.put_nowait(APIError("the server is shutting down", 503, "server_error"))
            return queue
        self.streams[request.request_id] = queue
        self._send(("add", request))
        return queue

    def abort(self, request_id: str) -> None:
        if self.streams.pop(request_id, None) is not None:
            self._send(("abort", request_id))

    def _send(self, command: tuple[str, object]) -> None:
        with self._inbox_lock:
            self._inbox.append(command)
        self._wakeup.set()

    def _take_commands(self) -> list[tuple[str, object]]:
        with self._inbox_lock:
            commands, self._inbox = self._inbox, []
        return commands

    async def run(self) -> None:
        """Run the engine thread until `close`; returns once it has ended."""
        loop = asyncio.get_running_loop()
        ended = loop.create_future()
        thread = threading.Thread(target=self._engine_thread, args=(loop, ended), name="engine", daemon=True)
        thread.start()
        await ended
        thread.join()

    # --- the engine thread ---

    def _engine_thread(self, loop: asyncio.AbstractEventLoop, ended: asyncio.Future) -> None:
        try:
            self._engine_loop(loop)
        finally:
            loop.call_soon_threadsafe(ended.set_result, None)

    def _engine_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Step while anything is in flight; sleep on `_wakeup` when idle; end once closing and
        idle. After a failed step the engine steps again only for a new command, so an engine
        that stays broken costs nothing until somebody asks it for something."""
        stalled = False
        while True:
            if not self._inbox and (stalled or not self.engine.has_unfinished()):
                if self.closing:
                    return
                self._wakeup.wait()
                self._wakeup.clear()  # a command sent after this is seen by the check above
                continue
            commands = self._take_commands()
            stalled = False
            try:
                rejected, outputs = self._step(commands)
            except Exception as exc:  # the engine failed: the loop fails what is in flight
                self._answered.clear()
                loop.call_soon_threadsafe(self._fail_all, APIError(
                    f"the engine failed: {type(exc).__name__}: {exc}", 500, "server_error"))
                self._answered.wait()
                stalled = not self._flush()
                continue
            loop.call_soon_threadsafe(self._deliver, rejected, outputs)

    def _step(self, commands: list[tuple[str, object]]) -> tuple[dict[str, str], list]:
        """Apply the commands, run one step, read the gauges."""
        rejected = {}
        for kind, arg in commands:
            if kind == "add":
                try:
                    self.engine.add_request(arg)
                except ValueError as exc:
                    rejected[arg.request_id] = str(exc)
            else:
                self.engine.abort_request(arg)
        outputs = self.engine.step() if self.engine.has_unfinished() else []
        self.gauges = self._read_gauges()
        return rejected, outputs

    def _flush(self) -> bool:
        """After a failure: apply the aborts the loop sent, and let one step hand out the aborted
        outputs (nobody waits for them any more); whether the engine survived it."""
        try:
            self._step(self._take_commands())
        except Exception:  # noqa: BLE001 - a broken engine stays broken; each new request gets its 500
            return False
        return True

    def _read_gauges(self) -> dict[str, float]:
        engine, allocator = self.engine, self.engine.allocator
        return {"running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
                "kv_usage": 1.0 - allocator.num_free_blocks / allocator.num_blocks,
                "preemptions": engine.num_preemptions, "queries": allocator.stats.queries,
                "hits": allocator.stats.hits}

    # --- on the event loop ---

    def _deliver(self, rejected: dict[str, str], outputs: list) -> None:
        for request_id, message in rejected.items():
            self._finish(request_id, APIError(message))
        for out in outputs:
            if out.finish_reason == "rejected":
                self._finish(out.request_id, APIError(f"request {out.request_id!r} rejected: {out.finish_detail}"))
            elif out.request_id in self.streams:
                self.streams[out.request_id].put_nowait(out)
                if out.finished:
                    del self.streams[out.request_id]

    def _finish(self, request_id: str, error: APIError) -> None:
        queue = self.streams.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(error)

    def _fail_all(self, error: APIError) -> None:
        """Send `error` to every request in flight and have the engine thread abort them. Runs
        while the engine thread waits (after a failure) or before it is told to close."""
        request_ids = list(self.streams)
        for request_id in request_ids:
            self._finish(request_id, error)
        # A request submitted while the failing step ran is failed too: its add must not follow.
        failed = set(request_ids)
        with self._inbox_lock:
            self._inbox = [(kind, arg) for kind, arg in self._inbox if not (kind == "add" and arg.request_id in failed)]
            self._inbox += [("abort", request_id) for request_id in request_ids]
        self._answered.set()
        self._wakeup.set()

    async def close(self) -> None:
        """Stop taking requests, end every request in flight with a 503 and abort it in the
        engine; the engine thread ends once it has applied the aborts (`run` returns)."""
        self.closing = True
        self._fail_all(APIError("the server is shutting down", 503, "server_error"))
