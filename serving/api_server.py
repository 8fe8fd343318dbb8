"""An OpenAI-compatible HTTP server for one engine (vLLM: `vllm/entrypoints/openai/api_server.py`).

`generate()` answers "how many tokens per second can this engine make?". A deployment is
asked a different question: requests arrive when they like, each one waits for its first
token (TTFT) and then for every next one (TPOT/ITL), and past some arrival rate the queue
grows without bound. This server puts the engine on a socket with the wire format of OpenAI
and vLLM (`/v1/completions`, `/v1/chat/completions`, server-sent events, `/metrics` under
vLLM's metric names), so the load generator (`benchmark_serving.py`) and OpenAI's own client
library talk to it as to a vLLM deployment.

One thread owns the engine (`async_llm.AsyncLLM`). The asyncio loop speaks HTTP and hands each
request over; the engine thread adds it and steps the engine for as long as anything is in
flight, handing each step's outputs back without waiting for the loop; the loop routes every
new token to the request's queue, whose handler turns tokens into text
(`output.ChoiceState`: detokenizing, stop strings) and writes it to the socket. The server is
handed the engine, never the module by name: `sys.modules` gives the module the engine's class
lives in, so `python lab.py serve` serves the student's own code.

HTTP, as clients expect it: HTTP/1.1 connections persist (several requests each, until the
client says `Connection: close` or stays idle for KEEP_ALIVE_TIMEOUT_S); an HTTP/1.0 client
gets one response and, for a stream, a body that ends when the connection closes (it knows no
chunked encoding); HEAD is GET without the body. No client can stall the others: a body over
MAX_BODY_BYTES is refused from its Content-Length before it is read, a large body is parsed on
a small thread pool instead of the event loop, and every per-token check is O(1).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import urllib.parse
import warnings
from dataclasses import dataclass
from multiprocessing.connection import Connection

from .async_llm import AsyncLLM, CommandWriter, EngineCore, command_pipe
from .chat import parse_chat_request
from .metrics import TTFT_BUCKETS_S, Histogram, prometheus_text
from .output import ChoiceState, Delta, LogprobFormatter, prompt_offsets
from .protocol import APIError, GenerateRequest, model_not_found, parse_completion_request, usage
from .tokenizer import ByteTokenizer

MAX_BODY_BYTES = 1 << 20  # a completion body is a prompt and a few fields; a larger one is refused unread
MAX_HEADER_BYTES = 16 << 10
READ_TIMEOUT_S = 10.0  # to receive a request's head and body; a silent client is dropped
KEEP_ALIVE_TIMEOUT_S = 5.0  # an idle persistent connection is closed after this long (uvicorn's default)
SHUTDOWN_TIMEOUT_S = 10.0
INLINE_PARSE_BYTES = 64 << 10  # bodies up to this are parsed on the event loop; larger ones on the pool
FRONTEND_PROCESS = hasattr(os, "fork")  # the front end in a process of its own (False: a thread)

_REASONS = {100: "Continue", 200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            500: "Internal Server Error", 503: "Service Unavailable"}


class _ClientGone(Exception):
    """The client closed its connection: abort its request."""


_CLIENT_GONE = object()  # put in a request's queue when its client disconnects
# One encoder for every event: json.dumps with any non-default argument builds a new one per call.
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))


@dataclass
class _HTTPRequest:
    method: str
    path: str
    version: str  # "HTTP/1.0" or "HTTP/1.1"
    headers: dict[str, str]
    keep_alive: bool
    body: bytes = b""


class _Connection:
    """One client connection: a byte buffer over the stream, so that bytes a watcher reads
    while a response is written (a pipelined next request) are kept, not lost."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.buffer = bytearray()
        self.idle = True  # waiting for a request or its body (a shutdown may drop it at once)

    async def fill(self) -> bool:
        """Read what has arrived into the buffer; False at end of stream."""
        data = await self.reader.read(65536)
        self.buffer += data
        return bool(data)

    async def read_head(self) -> bytes:
        while True:
            while self.buffer[:2] == b"\r\n":  # blank lines between requests are allowed (RFC 9112)
                del self.buffer[:2]
            end = self.buffer.find(b"\r\n\r\n")
            if end >= 0:
                head = bytes(self.buffer[:end])
                del self.buffer[:end + 4]
                return head
            if len(self.buffer) > MAX_HEADER_BYTES:
                raise APIError(f"the request head is over {MAX_HEADER_BYTES} bytes")
            if not await self.fill():
                raise asyncio.IncompleteReadError(bytes(self.buffer), None)

    async def read_exactly(self, n: int) -> bytes:
        while len(self.buffer) < n:
            if not await self.fill():
                raise asyncio.IncompleteReadError(bytes(self.buffer), n)
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

    async def watch_disconnect(self) -> bool:
        """True when the client closes its side. Bytes that arrive instead (a pipelined
        request) stay in the buffer and end the watch (False): from then on a failed write tells."""
        try:
            return not self.buffer and not await self.fill()
        except ConnectionError:
            return True


def _parse_head(head: bytes) -> _HTTPRequest:
    """Request line and headers; the connection must close after an error here (framing is lost)."""
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    parts = request_line.split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
        raise APIError(f"malformed request line {request_line[:80]!r}")
    headers = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if not sep:
            raise APIError(f"malformed header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep_alive = "close" not in tokens if parts[2] == "HTTP/1.1" else "keep-alive" in tokens
    return _HTTPRequest(parts[0], urllib.parse.unquote(parts[1].split("?", 1)[0]), parts[2], headers, keep_alive)


def _body_length(request: _HTTPRequest) -> int:
    headers = request.headers
    if "transfer-encoding" in headers:
        raise APIError("chunked request bodies are not supported: send Content-Length")
    length = headers.get("content-length", "0")
    if not (length.isascii() and length.isdigit() and len(length) <= 12):
        raise APIError(f"Content-Length must be a number of bytes, got {length!r}")
    if int(length) > MAX_BODY_BYTES:
        raise APIError(f"the body is {length} bytes; the limit is {MAX_BODY_BYTES}")
    return int(length)


class _Sink:
    """Where one response goes: its head once, then its body, sized, chunked (HTTP/1.1 stream)
    or delimited by closing the connection (an HTTP/1.0 stream)."""

    def __init__(self, conn: _Connection, request: _HTTPRequest):
        self.conn, self.request = conn, request
        self.keep_alive = request.keep_alive
        self.started = False
        self.chunked = False

    def head(self, status: int, content_type: str, length: int | None = None) -> bytes:
        """`length=None`: a stream (chunked for HTTP/1.1, to the close for HTTP/1.0)."""
        self.started = True
        if length is None and self.request.version == "HTTP/1.0":
            self.keep_alive = False
        self.chunked = length is None and self.request.version == "HTTP/1.1"
        lines = [f"{self.request.version} {status} {_REASONS[status]}", f"Content-Type: {content_type}",
                 f"Connection: {'keep-alive' if self.keep_alive else 'close'}"]
        if self.keep_alive:
            lines.append(f"Keep-Alive: timeout={int(KEEP_ALIVE_TIMEOUT_S)}")
        if length is None:
            lines += ["Cache-Control: no-cache"] + (["Transfer-Encoding: chunked"] if self.chunked else [])
        else:
            lines.append(f"Content-Length: {length}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def whole(self, status: int, content_type: str, data: bytes) -> None:
        body = b"" if self.request.method == "HEAD" else data
        self.conn.writer.write(self.head(status, content_type, len(data)) + body)

    def json(self, status: int, payload: dict) -> None:
        self.whole(status, "application/json", json.dumps(payload).encode())

    def piece(self, data: bytes) -> bytes:
        """Part of a streamed body, framed."""
        return f"{len(data):x}\r\n".encode("ascii") + data + b"\r\n" if self.chunked else data

    def end(self) -> bytes:
        return b"0\r\n\r\n" if self.chunked else b""

    def sse(self, event: dict | str) -> bytes:
        """One server-sent event: `data: {json}` and a blank line."""
        data = event if isinstance(event, str) else _COMPACT_JSON.encode(event)
        return self.piece(f"data: {data}\n\n".encode())


class CompletionServer:
    """An OpenAI-compatible server for one LLMEngine (see start_server): the engine stays in
    this process, stepped by a thread of its own, and the HTTP front end runs in a forked child
    process (`async_llm` says why), or in a thread where there is no fork.

    `.url`, `.port`, `.model_name`, `.tokenizer`; `.close()` stops accepting, drops idle
    connections, ends every request in flight (503) and aborts it in the engine, and waits for
    both sides to end; it is idempotent. A context manager.
    """

    def __init__(self, engine, host: str = "127.0.0.1", port: int = 0, *, tokenizer=None,
                 model_name: str | None = None, stream_interval: int = 1):
        if isinstance(stream_interval, bool) or not isinstance(stream_interval, int):
            raise TypeError(f"stream_interval must be an int (tokens per streamed chunk), got {stream_interval!r}")
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1 (tokens per streamed chunk), got {stream_interval}")
        self.engine, self.host = engine, host
        config = engine.model.config
        self.tokenizer = ByteTokenizer(config.vocab_size) if tokenizer is None else tokenizer
        self.model_name = model_name or f"toy-gpt2-{config.n_layer}x{config.n_embd}-v{config.vocab_size}"
        self._closed, self._close_lock = False, threading.Lock()
        sock = socket.create_server((host, port))  # a port in use fails here, in the caller
        self.port = sock.getsockname()[1]
        commands_r, commands_w = command_pipe()
        outputs_r, outputs_w = multiprocessing.Pipe(duplex=False)
        self._pipes = [commands_r, outputs_w]  # this process's ends, closed by close()
        try:
            self._start(engine, config, sock, commands_r, commands_w, outputs_r, outputs_w, stream_interval)
        except BaseException:  # e.g. fork refused: nothing of this server may stay open
            for end in (sock, commands_r, commands_w, outputs_r, outputs_w):
                end.close()
            raise
        if not self._core.ready.wait(SHUTDOWN_TIMEOUT_S) or self._core.frontend_error:
            error = self._core.frontend_error or "the server's front end did not start"
            self.close()
            raise RuntimeError(error)

    def _start(self, engine, config, sock, commands_r, commands_w, outputs_r, outputs_w, stream_interval) -> None:
        """Start the front end (forked, or a thread) on its ends, then the engine's thread on ours."""
        # The module whose engine this is, so that `python lab.py serve` checks requests with
        # the student's own code.
        frontend = _Frontend(sys.modules[type(engine).__module__], config, self.tokenizer, self.model_name,
                             stream_interval)
        args = (sock, commands_w, outputs_r)
        if FRONTEND_PROCESS:
            self._frontend = _ForkedFrontend(frontend.main, args)
            for end in args:  # the child's now
                end.close()
        else:
            self._frontend = threading.Thread(target=frontend.main, args=(*args, False), name="lab-frontend",
                                              daemon=True)
            self._frontend.start()
            self._pipes += args[1:]  # the front end's too (it closes the socket itself)
        self._core = EngineCore(engine, commands_r, outputs_w)
        self._core.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server has stopped, or `timeout` seconds (None: no limit); whether it has.
        Before `close()` it stops only if its front end ends of itself (killed, or failed): the
        engine's thread sees the command pipe close, and nobody could reach the engine any more."""
        return self._core.join(timeout)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        # From a thread: a front end that has stopped reading (stuck, or stopped by a signal)
        # would block the write; killing it after the timeout below ends the write too.
        threading.Thread(target=self._core.send, args=(("close",),), name="lab-close", daemon=True).start()
        self._frontend.join(SHUTDOWN_TIMEOUT_S * 3)
        self._core.join(SHUTDOWN_TIMEOUT_S)
        for end in self._pipes:
            end.close()

    def __enter__(self) -> CompletionServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class _ForkedFrontend:
    """`main(*args, True)` in a forked child process; `join` waits for it (and kills it after
    `timeout`). os.fork rather than multiprocessing: the child closes every descriptor it does
    not need, multiprocessing's own pipes included."""

    def __init__(self, main, args: tuple):
        with warnings.catch_warnings():
            # Python 3.12+ warns that forking a threaded process may copy a lock another thread
            # holds. The child runs only the front end's own code (asyncio, json, the tokenizer),
            # which takes no lock of this process's other threads.
            warnings.filterwarnings("ignore", ".*fork", DeprecationWarning)
            self.pid = os.fork()
        if self.pid == 0:  # the child
            # The caller's objects came along (a test's clients, another server's pipes). The
            # collector must never finalize one: it would close a descriptor number that
            # `_close_fds_except` has freed and this process has since reused.
            gc.freeze()
            code = 1
            try:
                main(*args, True)
                code = 0
            finally:
                os._exit(code)  # never back into the caller's code (a test runner, a command line)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                return
            time.sleep(0.005)


class _Frontend:
    """The HTTP side: every connection, request and token, on one asyncio loop; talks to the
    engine only through `async_llm.AsyncLLM`. Built in the caller's process, run by `main` in
    the front end's process (or thread)."""

    def __init__(self, lab, config, tokenizer, model_name: str, stream_interval: int = 1):
        self.lab, self.config, self.tokenizer, self.model_name = lab, config, tokenizer, model_name
        self.stream_interval = stream_interval
        self.created = int(time.time())
        self._ttft = Histogram(TTFT_BUCKETS_S)
        self._counters = {"prompt_tokens": 0, "generation_tokens": 0, "requests": 0}
        self._connections: dict[asyncio.Task, _Connection] = {}
        self._stopping = False

    def main(self, sock: socket.socket, commands: CommandWriter, outputs: Connection, own_process: bool) -> None:
        if own_process:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's; it closes the server
            _close_fds_except(sock, commands, outputs)
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve(sock, commands, outputs))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller of start_server
            try:
                commands.detach()
                commands.send(("startup_error", f"{type(exc).__name__}: {exc}"))
            except (OSError, EOFError):
                pass
        finally:
            loop.close()
            sock.close()

    async def _serve(self, sock: socket.socket, commands: CommandWriter, outputs: Connection) -> None:
        self._stop = asyncio.Event()
        self._parser = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="parse")
        self._bridge = AsyncLLM(commands, outputs)
        self._bridge.on_close = self._stop.set
        self._bridge.start(asyncio.get_running_loop())
        server = await asyncio.start_server(self._connection, sock=sock)
        self._bridge.send(("ready",))
        await self._stop.wait()
        self._stopping = True
        server.close()  # stop accepting
        for task, conn in list(self._connections.items()):
            if conn.idle:  # between requests: nothing to finish, so no reason to wait for it
                task.cancel()
        self._bridge.close()  # in-flight handlers get their 503 and finish
        pending = list(self._connections)
        if pending:
            _, late = await asyncio.wait(pending, timeout=SHUTDOWN_TIMEOUT_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await server.wait_closed()
        self._parser.shutdown(wait=False)
        self._bridge.finish(SHUTDOWN_TIMEOUT_S)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A persistent connection: requests one after another until either side closes it."""
        conn = _Connection(reader, writer)
        self._connections[asyncio.current_task()] = conn
        try:
            timeout = READ_TIMEOUT_S
            while not self._stopping:
                conn.idle = True
                try:
                    head = await asyncio.wait_for(conn.read_head(), timeout)
                except APIError as exc:  # a head we cannot read: answer, then close (framing is lost)
                    writer.write(_error_response(exc))
                    break
                conn.idle, timeout = False, KEEP_ALIVE_TIMEOUT_S
                if not await self._one_request(conn, head):
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass  # the client went away, or said too little too slowly, or idled out
        except asyncio.CancelledError:
            pass  # shutdown dropped an idle connection: asyncio would log a cancelled handler as an error
        finally:
            writer.close()
            self._connections.pop(asyncio.current_task(), None)

    async def _one_request(self, conn: _Connection, head: bytes) -> bool:
        """Read, route and answer one request; whether the connection may carry another."""
        try:
            request = _parse_head(head)
        except APIError as exc:
            conn.writer.write(_error_response(exc))
            return False
        sink = _Sink(conn, request)
        try:
            try:
                length = _body_length(request)
            except APIError:
                sink.keep_alive = False  # the body is unread: the next bytes are not a request
                raise
            if length and request.headers.get("expect", "").lower() == "100-continue":
                conn.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits for this before a large body
            conn.idle = True  # until the body is in, there is nothing a shutdown should wait for
            request.body = await asyncio.wait_for(conn.read_exactly(length), READ_TIMEOUT_S)
            conn.idle = False
            await self._route(request, conn, sink)
        except APIError as exc:
            if sink.started:  # too late for an error response: end the connection
                return False
            sink.json(exc.status, exc.body())
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            raise
        except Exception as exc:  # noqa: BLE001 - a bug answers 500 for this request only
            if sink.started:
                return False
            error = APIError(f"internal error: {type(exc).__name__}: {exc}", 500, "server_error")
            sink.keep_alive = False
            sink.json(500, error.body())
        await conn.writer.drain()
        return sink.keep_alive and not self._stopping

    async def _route(self, request: _HTTPRequest, conn: _Connection, sink: _Sink) -> None:
        path, method = request.path, request.method
        gets = {"/health", "/v1/models", "/metrics"}
        posts = {"/v1/completions": parse_completion_request, "/v1/chat/completions": parse_chat_request}
        model_path = path.startswith("/v1/models/")
        if path not in gets and path not in posts and not model_path:
            raise APIError(f"no route {path}; try /v1/completions, /v1/chat/completions, /v1/models, /health, "
                           f"/metrics", 404, "NotFoundError")
        allowed = ("POST",) if path in posts else ("GET", "HEAD")
        if method not in allowed:
            raise APIError(f"{path} takes {' or '.join(allowed)}, not {method}", 405)
        if path == "/health":
            sink.whole(200, "text/plain", b"")
        elif path == "/v1/models":
            sink.json(200, {"object": "list", "data": [self._model_card()]})
        elif model_path:
            if path[len("/v1/models/"):] != self.model_name:
                raise model_not_found(path[len("/v1/models/"):])
            sink.json(200, self._model_card())
        elif path == "/metrics":
            sink.whole(200, "text/plain; version=0.0.4", self._metrics().encode())
        else:
            args = (self.lab, request.body, self.config, self.tokenizer, self.model_name)
            if len(request.body) <= INLINE_PARSE_BYTES:
                gen = posts[path](*args)
            else:  # a large body is parsed off the loop, so that other clients' tokens keep flowing
                gen = await asyncio.get_running_loop().run_in_executor(self._parser, posts[path], *args)
            await self._generate(gen, conn, sink)

    def _model_card(self) -> dict:
        config = self.config
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "lab",
                "root": self.model_name, "parent": None, "max_model_len": config.n_positions,
                "vocab_size": config.vocab_size, "permission": []}

    # --- generation ---

    async def _generate(self, gen: GenerateRequest, conn: _Connection, sink: _Sink) -> None:
        """Run every choice of `gen` and answer. The status line waits for the engine's first
        word (a token or a rejection), so a request the engine refuses is still a clean 400;
        a disconnect, a stop string or a failure aborts the requests still running."""
        received = time.perf_counter()
        states = {r.request_id: ChoiceState(i, r, self.tokenizer, gen.stop, gen.stop_token_ids,
                                            gen.include_stop_str_in_output, gen.skip_special_tokens, gen.prompt_only)
                  for i, r in enumerate(gen.requests)}
        queue: asyncio.Queue = asyncio.Queue()
        watcher = None
        if gen.needs_engine:
            for request in gen.requests:
                self._bridge.submit(request, queue)
            watcher = asyncio.create_task(conn.watch_disconnect())
            watcher.add_done_callback(lambda t: t.cancelled() or not t.result() or queue.put_nowait(_CLIENT_GONE))
        try:
            updates = self._updates(gen, states, queue, received)
            respond = self._stream if gen.stream else self._respond_whole
            await respond(gen, states, updates, sink)
        except (_ClientGone, ConnectionError):
            sink.keep_alive = False
        finally:
            if watcher is not None:
                watcher.cancel()
            for request_id, state in states.items():
                if not state.finished:  # the client went, or a choice failed: the rest must not run on
                    self._bridge.abort(request_id)

    async def _updates(self, gen: GenerateRequest, states: dict, queue: asyncio.Queue, received: float):
        """(state, Delta, more) per RequestOutput, until every choice is finished; `more`: another
        output is already waiting (a stream writes once for all of them, see _stream). A late
        output of an ended choice gives (None, None, False) when nothing follows it."""
        if not gen.needs_engine:  # echo with max_tokens 0: the prompt is the answer
            for state in states.values():
                state.finish_reason = "length"
                yield state, Delta("", [], [], [], "length"), False
            return
        unfinished, first = set(states), True
        while unfinished:
            item = await queue.get()
            if item is _CLIENT_GONE:
                raise _ClientGone
            if isinstance(item, APIError):
                raise item
            state = states.get(item.request_id)
            if state is None or state.finished:  # a late output of a choice that has ended
                if queue.empty():
                    yield None, None, False  # nothing to add: what is held must go out now
                continue
            if first and item.output_token_ids:
                self._ttft.observe(time.perf_counter() - received)
                first = False
            delta = state.update(item)
            self._counters["generation_tokens"] += len(delta.token_ids)  # as produced, as vLLM counts them
            if state.finished:
                unfinished.discard(item.request_id)
                if not item.finished:  # a stop string, or a prompt-only run: the engine must stop too
                    self._bridge.abort(item.request_id)
            yield state, delta, not queue.empty()

    def _header(self, gen: GenerateRequest, kind: str) -> dict:
        return {"id": gen.response_id, "object": kind, "created": int(time.time()), "model": self.model_name}

    def _usage(self, gen: GenerateRequest, states: dict) -> dict:
        return usage(sum(map(len, gen.prompts)), sum(len(s.token_ids) for s in states.values()))

    def _count(self, gen: GenerateRequest, states: dict) -> None:
        self._counters["requests"] += 1
        self._counters["prompt_tokens"] += sum(map(len, gen.prompts))

    def _prompt_of(self, gen: GenerateRequest, state: ChoiceState) -> tuple[list[int], str]:
        """The choice's prompt: its token ids and its text (for a prompt of token ids, decoded the
        first time echo or logprobs ask for it, not for every request)."""
        i = state.index // gen.n
        if gen.prompt_texts[i] is None:
            gen.prompt_texts[i] = self.tokenizer.decode(gen.prompts[i])
        return gen.prompts[i], gen.prompt_texts[i]

    def _completion_logprobs(self, gen: GenerateRequest, state: ChoiceState, token_ids, entries, offsets,
                             with_prompt: bool) -> dict | None:
        if gen.logprobs is None:
            return None
        fmt = LogprobFormatter(self.tokenizer, gen.return_tokens_as_token_ids)
        if gen.echo:  # the choice's text starts with the prompt's: offsets move past it
            prompt, text = self._prompt_of(gen, state)
            offsets = [o + len(text) for o in offsets]
            if with_prompt:
                entries = list(state.prompt_logprobs or [None] * len(prompt))[:len(prompt)] + list(entries)
                token_ids = list(prompt) + list(token_ids)
                offsets = prompt_offsets(self.tokenizer, prompt) + offsets
        return fmt.completion(token_ids, entries, offsets, gen.logprobs)

    def _choice(self, gen: GenerateRequest, state: ChoiceState, delta: Delta | None, first: bool) -> dict:
        """One choice object: the whole answer (`delta` None) or one streamed piece."""
        tokens, entries = (state.token_ids, state.logprobs) if delta is None else (delta.token_ids, delta.logprobs)
        offsets = state.offsets if delta is None else delta.offsets
        text = state.text if delta is None else delta.text
        fmt = LogprobFormatter(self.tokenizer, gen.return_tokens_as_token_ids)
        choice: dict = {"index": state.index}
        if gen.kind == "completion":
            choice["text"] = (self._prompt_of(gen, state)[1] if gen.echo and first else "") + text
            choice["logprobs"] = self._completion_logprobs(gen, state, tokens, entries, offsets, first)
        else:
            message = {"role": "assistant", "content": text} if delta is None else {"content": text}
            choice["message" if delta is None else "delta"] = message
            choice["logprobs"] = None if gen.logprobs is None else fmt.chat(tokens, entries, gen.logprobs)
        choice["finish_reason"] = state.finish_reason if delta is None else delta.finish_reason
        choice["stop_reason"] = state.stop_reason if delta is None else delta.stop_reason
        if gen.prompt_logprobs is not None and first:
            choice["prompt_logprobs"] = fmt.prompt_logprobs(self._prompt_of(gen, state)[0], state.prompt_logprobs)
        if gen.return_token_ids:
            if first:
                choice["prompt_token_ids"] = list(self._prompt_of(gen, state)[0])
            choice["token_ids"] = list(tokens)
        return choice

    async def _respond_whole(self, gen: GenerateRequest, states: dict, updates, sink: _Sink) -> None:
        async for _ in updates:
            pass
        self._count(gen, states)
        choices = [self._choice(gen, s, None, True) for s in sorted(states.values(), key=lambda s: s.index)]
        kind = "text_completion" if gen.kind == "completion" else "chat.completion"
        sink.json(200, self._header(gen, kind) | {"choices": choices, "usage": self._usage(gen, states)})

    async def _stream(self, gen: GenerateRequest, states: dict, updates, sink: _Sink) -> None:
        """Server-sent events: a chunk per choice per step that moved it (the chat API's first
        chunk of each choice carries its role), the usage if asked, then [DONE].

        Every chunk goes out as soon as nothing else is waiting: when the engine is ahead of the
        loop (several steps' outputs queued), their chunks leave in one write, not one each. A
        write is a system call, and at saturation those calls are what the server spends its
        time on; the chunks themselves are the same either way. With `stream_interval` k > 1 a
        choice's chunk carries k tokens (its last one fewer), as SGLang's `--stream-interval`:
        fewer events and writes for a coarser stream."""
        kind = "text_completion" if gen.kind == "completion" else "chat.completion.chunk"
        header, writer, started, out = self._header(gen, kind), sink.conn.writer, set(), []
        held: dict[int, Delta] = {}  # per choice, what waits for `stream_interval` tokens
        try:
            async for state, delta, more in updates:
                if state is not None:
                    if state.index in held:
                        delta = held.pop(state.index).then(delta)
                    if len(delta.token_ids) < self.stream_interval and not delta.finish_reason:
                        held[state.index] = delta
                    else:
                        out += self._chunks(gen, states, header, state, delta, sink, started)
                if not more and out:
                    writer.write(b"".join(out))
                    out = []
                    await writer.drain()
        except APIError as exc:
            if not sink.started:
                raise  # nothing sent yet: a plain error response
            writer.write(b"".join(out) + sink.sse(exc.body()) + sink.end())  # ends the stream; not a success
            return
        self._count(gen, states)
        if not sink.started:
            out.append(sink.head(200, "text/event-stream"))
        if gen.include_usage:
            out.append(sink.sse(header | {"choices": [], "usage": self._usage(gen, states)}))
        writer.write(b"".join(out) + sink.sse("[DONE]") + sink.end())

    def _chunks(self, gen: GenerateRequest, states: dict, header: dict, state: ChoiceState, delta: Delta,
                sink: _Sink, started: set) -> list[bytes]:
        """What one update adds to the stream: the head first, the chat API's role chunks before
        anything else, then the choice's chunk if the update moved it."""
        out = [] if sink.started else [sink.head(200, "text/event-stream")]
        if gen.kind == "chat" and not started:  # every choice's role first, as vLLM sends them
            out += [sink.sse(header | {"choices": [{"index": s.index, "delta": {"role": "assistant",
                    "content": ""}, "logprobs": None, "finish_reason": None}]}) for s in
                    sorted(states.values(), key=lambda s: s.index)]
            started.add("role")
        first = state.index not in started
        if delta.text or delta.token_ids or delta.finish_reason or (first and gen.echo):
            started.add(state.index)
            event = header | {"choices": [self._choice(gen, state, delta, first)]}
            if gen.continuous_usage:
                event["usage"] = self._usage(gen, states)
            out.append(sink.sse(event))
        return out

    def _metrics(self) -> str:
        return prometheus_text(self.model_name, self._bridge.gauges, self._counters, self._ttft)


def _close_fds_except(*kept) -> None:
    """In the forked front end: close every descriptor it inherited but these and stdio, so that
    a connection or pipe of the caller's (another server's, a test client's) is not held open
    by this process after the caller closes it."""
    keep = sorted({0, 1, 2} | {k.fileno() for k in kept})
    for low, high in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024]):
        os.closerange(low + 1, high)


def _error_response(error: APIError) -> bytes:
    """A complete error response on a connection about to close (its request could not be read)."""
    data = json.dumps(error.body()).encode()
    head = (f"HTTP/1.1 {error.status} {_REASONS[error.status]}\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\nContent-Length: {len(data)}\r\n\r\n")
    return head.encode("latin-1") + data


def start_server(engine, host: str = "127.0.0.1", port: int = 0, *, tokenizer=None,
                 model_name: str | None = None, stream_interval: int = 1) -> CompletionServer:
    """Serve `engine` over HTTP from a background thread (port 0: any free port) and return the
    handle once it accepts connections. The server owns the engine until `close()`.
    `tokenizer`: encodes string prompts and decodes outputs (None: a ByteTokenizer of the model's
    vocabulary); `model_name`: the id clients must name (None: one made of the model's shape);
    `stream_interval`: tokens per streamed chunk (1: every token as it comes)."""
    return CompletionServer(engine, host, port, tokenizer=tokenizer, model_name=model_name,
                            stream_interval=stream_interval)


def serve(engine, host: str = "127.0.0.1", port: int = 8000, duration: float | None = None, *,
          tokenizer=None, model_name: str | None = None, stream_interval: int = 1) -> bool:
    """`python solution.py serve`: run the server until Ctrl-C (or for `duration` seconds). False
    if its front end ended of itself first (killed, or failed): a server nobody can reach must
    not run on."""
    with start_server(engine, host, port, tokenizer=tokenizer, model_name=model_name,
                      stream_interval=stream_interval) as server:
        print(f"serving {server.model_name} at {server.url}  (POST /v1/completions /v1/chat/completions, "
              f"GET /v1/models /health /metrics; Ctrl-C stops)", flush=True)
        try:
            if server.wait(duration):
                return False
        except KeyboardInterrupt:
            print("stopping", flush=True)
    return True
