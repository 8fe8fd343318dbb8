"""HTTP/1.1 as clients expect it, on asyncio streams (vLLM leaves this to uvicorn): persistent
connections, request heads and bodies read under a deadline, and responses sized, chunked or
delimited by the close.

- An HTTP/1.1 connection persists: several requests each, until the client says
  `Connection: close` or stays idle for KEEP_ALIVE_TIMEOUT_S. An HTTP/1.0 client's connection
  persists only when it asks (`Connection: keep-alive`), and a streamed response to it is
  delimited by the close (it knows no chunked encoding). HEAD is GET without the body.
- No client can stall the others: a body over MAX_BODY_BYTES is refused from its
  Content-Length before it is read, every read has a deadline, and a head that cannot be read
  gets its 400 at once and the connection closes (its framing is lost). A head whose lines end
  in a bare LF is read as if they ended in CRLF (RFC 9112 allows a recipient to).
- A request still arriving when the server shuts down gets a 503, not a silent close.

`Connections` runs every connection and hands each request to a `route(request, conn, sink)`
coroutine, which answers through the `Sink` or raises an `APIError`.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .protocol import APIError

MAX_BODY_BYTES = 1 << 20  # a completion body is a prompt and a few fields; a larger one is refused unread
MAX_HEADER_BYTES = 16 << 10
READ_TIMEOUT_S = 10.0  # to receive a request's head and body; a silent client is dropped
KEEP_ALIVE_TIMEOUT_S = 5.0  # an idle persistent connection is closed after this long (uvicorn's default)

HEAD_END = re.compile(rb"\r?\n\r?\n")  # the blank line after the head, CRLF or bare LF
REASONS = {100: "Continue", 200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           500: "Internal Server Error", 503: "Service Unavailable"}
# One encoder for every event: json.dumps with any non-default argument builds a new one per call.
COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))


@dataclass
class HTTPRequest:
    method: str
    path: str
    version: str  # "HTTP/1.0" or "HTTP/1.1"
    headers: dict[str, str]
    keep_alive: bool
    body: bytes = b""


class Connection:
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
            while self.buffer.startswith((b"\r\n", b"\n")):  # blank lines between requests are allowed (RFC 9112)
                del self.buffer[:2 if self.buffer.startswith(b"\r\n") else 1]
            end = HEAD_END.search(self.buffer)
            if end:
                head = bytes(self.buffer[:end.start()])
                del self.buffer[:end.end()]
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


def parse_head(head: bytes) -> HTTPRequest:
    """Request line and headers; the connection must close after an error here (framing is lost)."""
    request_line, *header_lines = (line.removesuffix("\r") for line in head.decode("latin-1").split("\n"))
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
    return HTTPRequest(parts[0], urllib.parse.unquote(parts[1].split("?", 1)[0]), parts[2], headers, keep_alive)


def body_length(request: HTTPRequest) -> int:
    headers = request.headers
    if "transfer-encoding" in headers:
        raise APIError("chunked request bodies are not supported: send Content-Length")
    length = headers.get("content-length", "0")
    if not (length.isascii() and length.isdigit() and len(length) <= 12):
        raise APIError(f"Content-Length must be a number of bytes, got {length!r}")
    if int(length) > MAX_BODY_BYTES:
        raise APIError(f"the body is {length} bytes; the limit is {MAX_BODY_BYTES}")
    return int(length)


class Sink:
    """Where one response goes: its head once, then its body, sized, chunked (HTTP/1.1 stream)
    or delimited by closing the connection (an HTTP/1.0 stream)."""

    def __init__(self, conn: Connection, request: HTTPRequest):
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
        lines = [f"{self.request.version} {status} {REASONS[status]}", f"Content-Type: {content_type}",
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
        data = event if isinstance(event, str) else COMPACT_JSON.encode(event)
        return self.piece(f"data: {data}\n\n".encode())


def error_response(error: APIError) -> bytes:
    """A complete error response on a connection about to close (its request could not be read)."""
    data = json.dumps(error.body()).encode()
    head = (f"HTTP/1.1 {error.status} {REASONS[error.status]}\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\nContent-Length: {len(data)}\r\n\r\n")
    return head.encode("latin-1") + data


SHUTTING_DOWN = APIError("the server is shutting down", 503, "server_error")
Route = Callable[[HTTPRequest, Connection, Sink], Awaitable[None]]


class Connections:
    """Every client connection of one server: requests one after another on each, each handed to
    `route`; an APIError it raises becomes its error response, any other exception a 500 for
    that request only."""

    def __init__(self, route: Route):
        self.route = route
        self.tasks: dict[asyncio.Task, Connection] = {}
        self.stopping = False

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A persistent connection: requests one after another until either side closes it."""
        conn = Connection(reader, writer)
        self.tasks[asyncio.current_task()] = conn
        try:
            timeout = READ_TIMEOUT_S
            while not self.stopping:
                conn.idle = True
                try:
                    head = await asyncio.wait_for(conn.read_head(), timeout)
                except APIError as exc:  # a head we cannot read: answer, then close (framing is lost)
                    writer.write(error_response(exc))
                    break
                except asyncio.CancelledError:
                    if conn.buffer.strip():  # a request had begun to arrive: it is owed an answer
                        writer.write(error_response(SHUTTING_DOWN))
                    raise
                conn.idle, timeout = False, KEEP_ALIVE_TIMEOUT_S
                if not await self._one_request(conn, head):
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass  # the client went away, or said too little too slowly, or idled out
        except asyncio.CancelledError:
            pass  # shutdown dropped an idle connection: asyncio would log a cancelled handler as an error
        finally:
            writer.close()
            self.tasks.pop(asyncio.current_task(), None)

    async def _one_request(self, conn: Connection, head: bytes) -> bool:
        """Read, route and answer one request; whether the connection may carry another."""
        try:
            request = parse_head(head)
        except APIError as exc:
            conn.writer.write(error_response(exc))
            return False
        sink = Sink(conn, request)
        try:
            try:
                length = body_length(request)
            except APIError:
                sink.keep_alive = False  # the body is unread: the next bytes are not a request
                raise
            if length and request.headers.get("expect", "").lower() == "100-continue":
                conn.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits for this before a large body
            conn.idle = True  # until the body is in, there is nothing a shutdown should wait for
            try:
                request.body = await asyncio.wait_for(conn.read_exactly(length), READ_TIMEOUT_S)
            except asyncio.CancelledError:  # the server shut down while the body was arriving
                sink.keep_alive = False
                conn.writer.write(error_response(SHUTTING_DOWN))
                raise
            conn.idle = False
            await self.route(request, conn, sink)
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
        return sink.keep_alive and not self.stopping

    def stop(self) -> None:
        """Take no new request, and drop the idle connections at once (nothing to finish there)."""
        self.stopping = True
        for task, conn in list(self.tasks.items()):
            if conn.idle:
                task.cancel()

    async def wait(self, timeout: float) -> None:
        """Wait up to `timeout` for the busy connections (their requests are being ended), then
        cancel what is left."""
        pending = list(self.tasks)
        if pending:
            _, late = await asyncio.wait(pending, timeout=timeout)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
