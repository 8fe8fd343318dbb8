"""An OpenAI-compatible HTTP server for one engine (vLLM: `vllm/entrypoints/openai/api_server.py`).

`generate()` answers "how many tokens per second can this engine make?". A deployment is
asked a different question: requests arrive when they like, each one waits for its first
token (TTFT) and then for every next one (TPOT/ITL), and past some arrival rate the queue
grows without bound. This server puts the engine on a socket with the wire format of OpenAI
and vLLM (`/v1/completions`, server-sent events, `/metrics` under vLLM's metric names), so
the load generator (`benchmark_serving.py`) measures it, and a vLLM deployment, the same way.

One thread owns the engine (`async_llm.AsyncLLM`). The asyncio loop parses HTTP and hands each
request over; the worker thread adds it, steps the engine and returns the step's outputs; the
loop routes every new token to the request's own queue, whose handler writes it to the socket.
The server is handed the engine, never the module by name: `sys.modules` gives the module the
engine's class lives in, so `python lab.py serve` serves the student's own code.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import threading
import time

from .async_llm import AsyncLLM
from .metrics import TTFT_BUCKETS_S, Histogram, prometheus_text
from .protocol import APIError, completion_choice, parse_completion_request, usage

MAX_BODY_BYTES = 1 << 20  # a completion body is a prompt and a few fields; a larger one is refused unread


MAX_HEADER_BYTES = 16 << 10


READ_TIMEOUT_S = 10.0  # to receive a request's head and body; a silent client is dropped


SHUTDOWN_TIMEOUT_S = 10.0


_REASONS = {100: "Continue", 200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            500: "Internal Server Error", 503: "Service Unavailable"}


class _ClientGone(Exception):
    """The client closed its connection: abort its request."""


_CLIENT_GONE = object()  # put in a request's queue when its client disconnects


def _http_head(status: int, content_type: str, length: int | None = None) -> bytes:
    """Response head; `length=None` means a chunked body (a stream). One response per connection."""
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}", f"Content-Type: {content_type}", "Connection: close"]
    lines += ["Cache-Control: no-cache", "Transfer-Encoding: chunked"] if length is None else [
        f"Content-Length: {length}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _http_chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode("ascii") + data + b"\r\n"


def _sse(event: dict | str) -> bytes:
    """One server-sent event, as one HTTP chunk: `data: {json}` and a blank line."""
    data = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
    return _http_chunk(f"data: {data}\n\n".encode())


async def _read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[str, str, bytes]:
    """(method, path, body) of one HTTP/1.1 request. A head over MAX_HEADER_BYTES or a body over
    MAX_BODY_BYTES is a 400 raised before the body is read."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise APIError(f"the request head is over {MAX_HEADER_BYTES} bytes") from None
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    parts = request_line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise APIError(f"malformed request line {request_line[:80]!r}")
    headers = {}
    for line in filter(None, header_lines):
        name, sep, value = line.partition(":")
        if not sep:
            raise APIError(f"malformed header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    if "transfer-encoding" in headers:
        raise APIError("chunked request bodies are not supported: send Content-Length")
    length = headers.get("content-length", "0")
    if not (length.isascii() and length.isdigit() and len(length) <= 12):
        raise APIError(f"Content-Length must be a number of bytes, got {length!r}")
    if int(length) > MAX_BODY_BYTES:
        raise APIError(f"the body is {length} bytes; the limit is {MAX_BODY_BYTES}")
    if headers.get("expect", "").lower() == "100-continue":  # curl waits for this before a large body
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    return parts[0], parts[1].split("?", 1)[0], await reader.readexactly(int(length))


async def _watch_disconnect(reader: asyncio.StreamReader) -> None:
    """Return when the client closes its side (nothing else is expected after the request)."""
    try:
        while await reader.read(4096):
            pass
    except ConnectionError:
        pass


class CompletionServer:
    """An OpenAI-compatible server for one LLMEngine, on a background thread (see start_server).

    `.url`, `.port`, `.model_name`; `.close()` stops accepting, ends every request in flight
    (503) and aborts it in the engine, and joins the thread; it is idempotent. A context manager.
    Not to be closed from inside one of its own handlers.
    """

    def __init__(self, engine, host: str = "127.0.0.1", port: int = 0):
        self.engine, self.host = engine, host
        self.lab = sys.modules[type(engine).__module__]  # the module whose engine this is
        config = engine.model.config
        self.model_name = f"toy-gpt2-{config.n_layer}x{config.n_embd}-v{config.vocab_size}"
        self.port = port
        self._ids = itertools.count()
        self._ttft = Histogram(TTFT_BUCKETS_S)
        self._counters = {"prompt_tokens": 0, "generation_tokens": 0, "requests": 0}
        self._connections: set[asyncio.Task] = set()
        self._closed, self._close_lock = False, threading.Lock()
        self._started, self._startup_error = threading.Event(), None
        self._thread = threading.Thread(target=self._run, args=(port,), name="lab-server", daemon=True)
        self._thread.start()
        if not self._started.wait(SHUTDOWN_TIMEOUT_S):
            raise RuntimeError("the server thread did not start")
        if self._startup_error is not None:
            raise self._startup_error

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(SHUTDOWN_TIMEOUT_S * 3)

    def __enter__(self) -> CompletionServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- the server thread ---

    def _run(self, port: int) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve(port))
        except BaseException as exc:  # noqa: BLE001 - reported to the thread that called start_server
            self._startup_error = exc
        finally:
            self._started.set()
            loop.close()

    async def _serve(self, port: int) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._bridge = AsyncLLM(self.engine)
        server = await asyncio.start_server(self._connection, self.host, port, limit=MAX_HEADER_BYTES)
        self.port = server.sockets[0].getsockname()[1]
        engine_task = asyncio.create_task(self._bridge.run())
        self._started.set()
        await self._stop.wait()
        server.close()  # stop accepting
        await self._bridge.close()  # in-flight handlers get their 503 and finish
        pending = list(self._connections)
        if pending:
            _, late = await asyncio.wait(pending, timeout=SHUTDOWN_TIMEOUT_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await engine_task
        await server.wait_closed()
        self._bridge.worker.shutdown(wait=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request per connection: read it, route it, answer, close."""
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            try:
                method, path, body = await asyncio.wait_for(_read_request(reader, writer), READ_TIMEOUT_S)
                await self._route(method, path, body, reader, writer)
            except APIError as exc:
                self._respond_json(writer, exc.status, exc.body())
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass  # the client went away, or said too little too slowly
        except Exception as exc:  # noqa: BLE001 - a bug answers 500 for this request only
            error = APIError(f"internal error: {type(exc).__name__}: {exc}", 500, "server_error")
            self._respond_json(writer, 500, error.body())
        finally:
            writer.close()
            self._connections.discard(task)

    async def _route(self, method: str, path: str, body: bytes, reader, writer) -> None:
        routes = {"/health": "GET", "/v1/models": "GET", "/metrics": "GET", "/v1/completions": "POST"}
        if path not in routes:
            raise APIError(f"no route {path}; try /v1/completions, /v1/models, /health, /metrics",
                             404, "not_found_error")
        if method != routes[path]:
            raise APIError(f"{path} takes {routes[path]}, not {method}", 405)
        if path == "/health":
            writer.write(_http_head(200, "text/plain", 0))
        elif path == "/v1/models":
            self._respond_json(writer, 200, self._models())
        elif path == "/metrics":
            text = self._metrics().encode()
            writer.write(_http_head(200, "text/plain; version=0.0.4", len(text)) + text)
        else:
            await self._complete(body, reader, writer)

    def _respond_json(self, writer: asyncio.StreamWriter, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        writer.write(_http_head(status, "application/json", len(data)) + data)

    def _models(self) -> dict:
        config = self.engine.model.config
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "lab",
                                            "max_model_len": config.n_positions,
                                            "vocab_size": config.vocab_size}]}

    async def _complete(self, body: bytes, reader, writer) -> None:
        """POST /v1/completions. The status line waits for the engine's first word (a token or a
        rejection), so a request the engine refuses is still a clean 400; a disconnect aborts."""
        request, stream, include_usage = parse_completion_request(
            self.lab, body, self.engine.model.config, f"cmpl-{next(self._ids)}")
        received = time.perf_counter()
        queue = self._bridge.submit(request)
        watcher = asyncio.create_task(_watch_disconnect(reader))
        watcher.add_done_callback(lambda _: queue.put_nowait(_CLIENT_GONE))
        try:
            respond = self._stream if stream else self._respond_whole
            await respond(request, queue, writer, received, include_usage)
        except (_ClientGone, ConnectionError):
            self._bridge.abort(request.request_id)
        except BaseException:  # a bug or a cancellation: the request must not run on unattended
            self._bridge.abort(request.request_id)
            raise
        finally:
            watcher.cancel()

    async def _outputs(self, queue: asyncio.Queue, received: float):
        """The request's RequestOutputs up to the finished one (first token: into the TTFT histogram)."""
        first = True
        while True:
            item = await queue.get()
            if item is _CLIENT_GONE:
                raise _ClientGone
            if isinstance(item, APIError):
                raise item
            if first and item.output_token_ids:
                self._ttft.observe(time.perf_counter() - received)
                first = False
            yield item
            if item.finished:
                return

    def _completion(self, request, kind: str) -> dict:
        return {"id": request.request_id, "object": kind, "created": int(time.time()), "model": self.model_name}

    def _count(self, request, num_output_tokens: int) -> None:
        self._counters["requests"] += 1
        self._counters["prompt_tokens"] += len(request.prompt_token_ids)
        self._counters["generation_tokens"] += num_output_tokens

    async def _respond_whole(self, request, queue, writer, received: float, include_usage: bool) -> None:
        async for out in self._outputs(queue, received):
            last = out
        tokens = last.output_token_ids
        self._count(request, len(tokens))
        self._respond_json(writer, 200, self._completion(request, "text_completion") | {
            "choices": [completion_choice(tokens, last.finish_reason)], "usage": usage(request, len(tokens))})

    async def _stream(self, request, queue, writer, received: float, include_usage: bool) -> None:
        """Server-sent events: one chunk per token, the last with its finish_reason, then [DONE]."""
        header, sent = self._completion(request, "text_completion"), 0
        try:
            async for out in self._outputs(queue, received):
                new = out.output_token_ids[sent:]
                finish = [None] * (len(new) - 1) + [out.finish_reason]
                events = [_sse(header | {"choices": [completion_choice([t], f)]}) for t, f in zip(new, finish)]
                writer.write(b"".join(([_http_head(200, "text/event-stream")] if sent == 0 else []) + events))
                sent += len(new)
                await writer.drain()
        except APIError as exc:
            if sent == 0:
                raise  # nothing sent yet: a plain error response
            writer.write(_sse(exc.body()) + _http_chunk(b""))  # ends the stream; not counted a success
            return
        self._count(request, sent)
        if include_usage:
            writer.write(_sse(header | {"choices": [], "usage": usage(request, sent)}))
        writer.write(_sse("[DONE]") + _http_chunk(b""))

    def _metrics(self) -> str:
        return prometheus_text(self.model_name, self._bridge.gauges, self._counters, self._ttft)



def start_server(engine, host: str = "127.0.0.1", port: int = 0) -> CompletionServer:
    """Serve `engine` over HTTP from a background thread (port 0: any free port) and return the
    handle once it accepts connections. The server owns the engine until `close()`."""
    return CompletionServer(engine, host, port)




def serve(engine, host: str = "127.0.0.1", port: int = 8000, duration: float | None = None) -> None:
    """`python solution.py serve`: run the server until Ctrl-C (or for `duration` seconds)."""
    with start_server(engine, host, port) as server:
        print(f"serving {server.model_name} at {server.url}  (POST /v1/completions, GET /v1/models /health "
              f"/metrics; Ctrl-C stops)", flush=True)
        try:
            threading.Event().wait(duration)
        except KeyboardInterrupt:
            print("stopping", flush=True)
