"""One worker thread owns the engine; the event loop hands it requests and routes its outputs.

vLLM's `AsyncLLM` (`vllm/v1/engine/async_llm.py`) does this job with the engine core in another
process; here it is a thread, because the NumPy engine releases the GIL in its matmuls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from .protocol import APIError


class AsyncLLM:
    """Hands requests to the engine and routes its outputs back, request by request.

    Contract: only `self.worker` (one thread) ever calls the engine; everything else here runs
    on the event loop. `submit` returns the request's queue, which receives a RequestOutput per
    step that gave it a token and ends with a finished one, or receives one `APIError`
    (rejected by the engine, engine failure, shutdown). An error in a step fails the requests
    then in flight (500) and the bridge goes on serving.
    """

    def __init__(self, engine):
        self.engine = engine
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.streams: dict[str, asyncio.Queue] = {}
        self.inbox: list[tuple[str, object]] = []  # ("add", Request) or ("abort", request_id), in order
        self.wakeup = asyncio.Event()
        self.closing = False
        # As of the last step (so an idle server reports an idle engine without touching it).
        self.gauges = {"running": 0, "waiting": 0, "kv_usage": 0.0, "preemptions": 0, "queries": 0, "hits": 0}

    def submit(self, request, queue: asyncio.Queue | None = None) -> asyncio.Queue:
        """Queue `request` for the engine; its outputs go to `queue` (a new one by default; several
        requests may share one, as the choices of one response do: outputs carry their request_id)."""
        queue = asyncio.Queue() if queue is None else queue
        if self.closing:  # the loop that would feed the queue has stopped
            queue.put_nowait(APIError("the server is shutting down", 503, "server_error"))
            return queue
        self.streams[request.request_id] = queue
        self._send(("add", request))
        return queue

    def abort(self, request_id: str) -> None:
        if self.streams.pop(request_id, None) is not None:
            self._send(("abort", request_id))

    def _send(self, command: tuple[str, object]) -> None:
        self.inbox.append(command)
        self.wakeup.set()

    async def run(self) -> None:
        """Step while anything is in flight; sleep on `wakeup` when idle."""
        loop, busy = asyncio.get_running_loop(), False
        while not self.closing:
            if not (busy or self.inbox):
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            commands, self.inbox = self.inbox, []
            try:
                rejected, outputs, busy = await loop.run_in_executor(self.worker, self._step, commands)
            except Exception as exc:  # the engine failed: fail what is in flight, keep serving
                busy = await self._fail_all(APIError(f"the engine failed: {type(exc).__name__}: {exc}",
                                                       500, "server_error"))
                continue
            for request_id, message in rejected.items():
                self._finish(request_id, APIError(message))
            for out in outputs:
                if out.finish_reason == "rejected":
                    message = f"request {out.request_id!r} rejected: {out.finish_detail}"
                    self._finish(out.request_id, APIError(message))
                elif out.request_id in self.streams:
                    self.streams[out.request_id].put_nowait(out)
                    if out.finished:
                        del self.streams[out.request_id]

    def _step(self, commands: list[tuple[str, object]]) -> tuple[dict[str, str], list, bool]:
        """In the worker: apply the commands, run one step, read the gauges."""
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
        return rejected, outputs, self.engine.has_unfinished()

    def _read_gauges(self) -> dict[str, float]:
        engine, allocator = self.engine, self.engine.allocator
        return {"running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
                "kv_usage": 1.0 - allocator.num_free_blocks / allocator.num_blocks,
                "preemptions": engine.num_preemptions, "queries": allocator.stats.queries,
                "hits": allocator.stats.hits}

    def _finish(self, request_id: str, error: APIError) -> None:
        queue = self.streams.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(error)

    async def _fail_all(self, error: APIError) -> bool:
        """Send `error` to every request in flight and abort them; whether the engine is still busy."""
        request_ids = list(self.streams)
        for request_id in request_ids:
            self._finish(request_id, error)
        # A request submitted while the failing step ran is failed too: its add must not follow.
        failed = set(request_ids)
        self.inbox = [(kind, arg) for kind, arg in self.inbox if not (kind == "add" and arg.request_id in failed)]
        return await asyncio.get_running_loop().run_in_executor(self.worker, self._abort_and_flush, request_ids)

    def _abort_and_flush(self, request_ids: list[str]) -> bool:
        """In the worker: abort, then let one step hand out the aborted outputs."""
        try:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            if self.engine.has_unfinished():
                self.engine.step()
            self.gauges = self._read_gauges()
        except Exception:  # noqa: BLE001 - a broken engine stays broken; each new request gets its 500
            pass
        return self.engine.has_unfinished()

    async def close(self) -> None:
        """Stop stepping, then end every request in flight with a 503 and abort it in the engine."""
        self.closing = True
        self.wakeup.set()
        await self._fail_all(APIError("the server is shutting down", 503, "server_error"))
