"""HTTP/1.1 as clients expect it, on asyncio streams (vLLM leaves this to uvicorn): persistent
connections, request heads and bodies read under a deadline, and responses sized, chunked or
delimited by the close.

- An HTTP/1.1 connection persists: several requests each, until the client says
  `Connection: close` or stays idle for KEEP_ALIVE_TIMEOUT_S. An HTTP/1.0 client's connection
  persists only when it asks (`Connection: keep-alive`), and a streamed response to it is
  delimited by the close (it knows no chunked encoding). HEAD is GET without the body.
- A body comes with a Content-Length or in the chunked coding (RFC 9112 §7.1: a recipient must
  parse it; `curl -T -` and http.client with an iterable body send it), under the same limit.
- No client can stall the others, and a body costs the server a bounded amount of work per
  byte: a body over MAX_BODY_BYTES is refused (413) from its Content-Length, or from the chunk
  that would pass it, before it is read, and a chunked body of more than MAX_CHUNKS chunks is
  refused (400) at the chunk past the limit (a million 1-byte chunks would cost seconds of
  parsing). A head over MAX_HEADER_BYTES (blank lines before it included) is a 431, however it
  arrives. A head that cannot be read gets its error at once and the connection closes (its
  framing is lost). A head whose lines end in a bare LF is read as if they ended in CRLF
  (RFC 9112 allows a recipient to).
- Deadlines: a connection waits READ_TIMEOUT_S for its first request, KEEP_ALIVE_TIMEOUT_S for
  each next one; a head must then arrive whole within READ_TIMEOUT_S of its first byte, and its
  body within READ_TIMEOUT_S of the head.
- No connection that has sent a byte since its last response is closed without a word: a
  request still incomplete at its deadline gets a 408 (RFC 9110 §15.5.9), one cut short by the
  client's end of stream a 400, one still arriving when the server shuts down a 503. A
  connection that sent nothing is closed silently when it idles out: a 408 there would be read
  as the answer to the next request its client sends.
- An end of stream from the client while its request runs (a close, or a half-close: the same
  FIN on the wire) or a reset means the client has gone: `watch_disconnect` tells the request's
  handler, which aborts it (vLLM's behaviour, through uvicorn's http.disconnect) and writes the
  reason, for a client that half-closed and still reads. Bytes of a pipelined next request end
  the watch: that client is still there.
- When the server ends a connection it closes gracefully (RFC 9112 §9.6): it shuts its side for
  writing and drops what the client still sends for up to LINGER_S, so that a reset caused by
  unread bytes does not destroy the response just sent (an error about a body it never read).

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
MAX_HEADER_BYTES = 16 << 10  # a request's head, with the blank lines before it; a chunked body's trailers
MAX_CHUNK_LINE_BYTES = 1 << 10  # a chunk's size line, extensions included
MAX_CHUNKS = 4096  # of one chunked body: a full-size body in chunks of 256 bytes on average
READ_TIMEOUT_S = 10.0  # for a new connection's first byte; for a head from its first byte; for a body; then a 408
KEEP_ALIVE_TIMEOUT_S = 5.0  # an idle persistent connection is closed after this long (uvicorn's default)
LINGER_S = 2.0  # a closing connection's bytes are read and dropped this long (Apache's lingering close: 2 s)
LINGER_MAX_BYTES = 4 << 20

HEAD_END = re.compile(rb"\r?\n\r?\n")  # the blank line after the head, CRLF or bare LF
BLANK_LINES = re.compile(rb"(?:\r?\n)*")
CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
REASONS = {100: "Continue", 200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           405: "Method Not Allowed", 408: "Request Timeout", 413: "Content Too Large",
           431: "Request Header Fields Too Large", 500: "Internal Server Error", 501: "Not Implemented",
           503: "Service Unavailable"}
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
        self.heard = False  # bytes arrived since the last response: an end here is owed a word
        self.ended = False  # the client's end of stream has been read (it may still read, if it half-closed)

    async def fill(self) -> bool:
        """Read what has arrived into the buffer; False at end of stream."""
        data = await self.reader.read(65536)
        self.buffer += data
        if data:
            self.heard = True
        else:
            self.ended = True
        return bool(data)

    async def read_head(self) -> bytes:
        skipped = 0  # blank lines before the request (RFC 9112 allows them), counted toward the limit
        while True:
            blank = BLANK_LINES.match(self.buffer).end()
            del self.buffer[:blank]
            skipped += blank
            end = HEAD_END.search(self.buffer)
            # What counts: the blank lines before the head, and the head through the blank line that ends it.
            if skipped + (end.end() if end else len(self.buffer)) > MAX_HEADER_BYTES:
                raise APIError(f"the request head, with the blank lines before it, is over {MAX_HEADER_BYTES} bytes",
                               431)
            if end:
                head = bytes(self.buffer[:end.start()])
                del self.buffer[:end.end()]
                return head
            if not await self.fill():
                raise asyncio.IncompleteReadError(bytes(self.buffer), None)

    async def read_line(self, limit: int, status: int = 400) -> bytes:
        """One line, without its CRLF (or bare LF), of at most `limit` bytes (else an error of `status`)."""
        while (end := self.buffer.find(b"\n")) < 0:
            if len(self.buffer) > limit:
                raise APIError(f"a line of the chunked body is over {limit} bytes", status)
            if not await self.fill():
                raise asyncio.IncompleteReadError(bytes(self.buffer), None)
        line = bytes(self.buffer[:end]).removesuffix(b"\r")
        if len(line) > limit:
            raise APIError(f"a line of the chunked body is over {limit} bytes", status)
        del self.buffer[:end + 1]
        return line

    async def read_chunked(self, limit: int) -> bytes:
        """A body in the chunked coding (RFC 9112 §7.1): chunks of `size in hex [;extensions]`
        CRLF, data, CRLF; a chunk of size 0; trailer lines (read and dropped); a blank line. A
        chunk that would take the body over `limit` bytes (413), or past MAX_CHUNKS chunks (400),
        is refused before it is read."""
        body = bytearray()
        chunks = 0
        while True:
            size = self._chunk_size(await self.read_line(MAX_CHUNK_LINE_BYTES))
            if size == 0:
                break
            chunks += 1
            if chunks > MAX_CHUNKS:
                raise APIError(f"the chunked body has more than {MAX_CHUNKS} chunks, the limit per body: send it in "
                               f"larger chunks, or with a Content-Length")
            if len(body) + size > limit:
                raise APIError(f"the chunked body is over {limit} bytes; the limit is {limit}", 413)
            body += await self.read_exactly(size)
            await self._read_crlf_after(size)
        trailers = 0
        while line := await self.read_line(MAX_HEADER_BYTES, 431):
            trailers += len(line)
            if trailers > MAX_HEADER_BYTES:
                raise APIError(f"the chunked body's trailers are over {MAX_HEADER_BYTES} bytes", 431)
        return bytes(body)

    async def _read_crlf_after(self, size: int) -> None:
        """The CRLF (or bare LF) that must follow a chunk's `size` bytes of data."""
        while not self.buffer.startswith(b"\n") and len(self.buffer) < 2:
            if not await self.fill():
                raise asyncio.IncompleteReadError(bytes(self.buffer), 2)
        if not (self.buffer.startswith(b"\n") or self.buffer.startswith(b"\r\n")):
            raise APIError(f"a chunk's data must be followed by CRLF: after its {size} bytes came "
                           f"{bytes(self.buffer[:16])!r} (is its size line right?); the chunked body is malformed")
        del self.buffer[:self.buffer.index(b"\n") + 1]

    @staticmethod
    def _chunk_size(line: bytes) -> int:
        size = line.split(b";", 1)[0].strip(b" \t")
        if not CHUNK_SIZE.fullmatch(size):
            raise APIError(f"malformed chunk size line {line[:40]!r}: the chunked body is malformed")
        return int(size, 16)

    async def read_exactly(self, n: int) -> bytes:
        while len(self.buffer) < n:
            if not await self.fill():
                raise asyncio.IncompleteReadError(bytes(self.buffer), n)
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

    async def watch_disconnect(self) -> bool:
        """Wait while the client is silent; True when it has gone: its end of stream (a close or a
        half-close, the same FIN on the wire: vLLM takes either for a disconnect) or a reset.
        Bytes that arrive (a pipelined request) stay in the buffer and end the watch (False):
        that client is still there."""
        try:
            return self.ended or (not self.buffer and not await self.fill())
        except ConnectionError:
            return True

    async def linger(self) -> None:
        """Close gracefully (RFC 9112 §9.6): shut this side for writing (after what is buffered),
        then read and drop what the client still sends, until its end of stream, LINGER_S or
        LINGER_MAX_BYTES. A close with unread bytes would send a reset, which may destroy the
        response still on its way (an error about a body the server never read)."""
        self.idle = True  # nothing to finish: a shutdown drops it at once
        if not self.writer.can_write_eof():
            return
        self.writer.write_eof()
        loop = asyncio.get_running_loop()
        dropped = 0
        deadline = loop.time() + LINGER_S
        try:
            while dropped <= LINGER_MAX_BYTES and loop.time() < deadline:
                data = await asyncio.wait_for(self.reader.read(65536), deadline - loop.time())
                if not data:
                    return
                dropped += len(data)
        except asyncio.TimeoutError:
            pass


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


def body_length(request: HTTPRequest) -> int | None:
    """The body's length from Content-Length (0 without one), or None for a chunked body."""
    headers = request.headers
    if "transfer-encoding" in headers:
        codings = [coding.strip().lower() for coding in headers["transfer-encoding"].split(",")]
        if codings != ["chunked"]:
            raise APIError(f"Transfer-Encoding {headers['transfer-encoding'][:40]!r} is not supported: send the "
                           f"body chunked or with Content-Length", 501, "server_error")
        if "content-length" in headers or request.version == "HTTP/1.0":  # RFC 9112 §6.1, §6.3: a smuggling risk
            raise APIError("Transfer-Encoding: chunked goes with neither Content-Length nor HTTP/1.0")
        return None
    length = headers.get("content-length", "0")
    if not (length.isascii() and length.isdigit() and len(length) <= 12):
        raise APIError(f"Content-Length must be a number of bytes, got {length!r}")
    if int(length) > MAX_BODY_BYTES:
        raise APIError(f"the body is {length} bytes; the limit is {MAX_BODY_BYTES}", 413)
    return int(length)


class Sink:
    """Where one response goes: its head once, then its body, sized, chunked (HTTP/1.1 stream)
    or delimited by closing the connection (an HTTP/1.0 stream)."""

    def __init__(self, conn: Connection, request: HTTPRequest):
        self.conn = conn
        self.request = request
        self.keep_alive = request.keep_alive
        self.started = False
        self.chunked = False

    def head(self, status: int, content_type: str, length: int | None = None) -> bytes:
        """`length=None`: a stream (chunked for HTTP/1.1, to the close for HTTP/1.0)."""
        self.started = True
        if self.conn.ended:  # no next request can come
            self.keep_alive = False
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
INCOMPLETE = APIError("the connection's end of stream came within a request: it is incomplete")
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
            await self._requests(conn)
            if not (self.stopping or conn.ended):  # the server ends it: gracefully
                await conn.linger()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass  # the client went away
        except asyncio.CancelledError:
            pass  # shutdown dropped an idle connection: asyncio would log a cancelled handler as an error
        finally:
            writer.close()
            self.tasks.pop(asyncio.current_task(), None)

    async def _requests(self, conn: Connection) -> None:
        """Read and answer requests until the connection must end; every end after a byte of a
        request has its word (a response, or an error: 400, 408, 431, 503)."""
        idle_timeout = READ_TIMEOUT_S  # for the first request; KEEP_ALIVE_TIMEOUT_S for each next one
        while not self.stopping:
            conn.idle = True
            conn.heard = bool(conn.buffer)
            try:
                if not conn.buffer and not await asyncio.wait_for(conn.fill(), idle_timeout):
                    return  # the client ended a connection with no request begun
                head = await asyncio.wait_for(conn.read_head(), READ_TIMEOUT_S)  # from its first byte
            except APIError as exc:  # a head we cannot read: answer, then close (framing is lost)
                conn.writer.write(error_response(exc))
                return
            except asyncio.TimeoutError:
                if conn.heard:  # a request (or blank lines) had begun to arrive: RFC 9110's 408
                    conn.writer.write(error_response(APIError(
                        f"no whole request head arrived within {READ_TIMEOUT_S:g} s of its first byte", 408)))
                return  # else an idle connection: closed without a word (see the module's docstring)
            except asyncio.IncompleteReadError:
                if conn.heard:
                    conn.writer.write(error_response(INCOMPLETE))
                return
            except asyncio.CancelledError:
                if conn.buffer.strip():  # a request had begun to arrive: it is owed an answer
                    conn.writer.write(error_response(SHUTTING_DOWN))
                raise
            conn.idle = False
            idle_timeout = KEEP_ALIVE_TIMEOUT_S
            if not await self._one_request(conn, head):
                return

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
                request.body = await self._read_body(conn, request)
            except APIError:
                sink.keep_alive = False  # the body is unread or half read: the next bytes are not a request
                raise
            conn.idle = False
            await self.route(request, conn, sink)
        except APIError as exc:
            if sink.started:  # too late for an error response: end the connection
                return False
            sink.json(exc.status, exc.body())
        except (ConnectionError, asyncio.TimeoutError):
            raise
        except Exception as exc:  # noqa: BLE001 - a bug answers 500 for this request only
            if sink.started:
                return False
            error = APIError(f"internal error: {type(exc).__name__}: {exc}", 500, "server_error")
            sink.keep_alive = False
            sink.json(500, error.body())
        await conn.writer.drain()
        return sink.keep_alive and not self.stopping

    @staticmethod
    async def _read_body(conn: Connection, request: HTTPRequest) -> bytes:
        """The request's body, sized or chunked, within READ_TIMEOUT_S (a 408 after it)."""
        length = body_length(request)
        if length != 0 and request.headers.get("expect", "").lower() == "100-continue":
            conn.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits for this before a large body
        conn.idle = True  # until the body is in, there is nothing a shutdown should wait for
        try:
            body = conn.read_exactly(length) if length is not None else conn.read_chunked(MAX_BODY_BYTES)
            return await asyncio.wait_for(body, READ_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise APIError(f"the request's body did not arrive within {READ_TIMEOUT_S:g} s", 408) from None
        except asyncio.IncompleteReadError:
            raise APIError(str(INCOMPLETE)) from None  # a new one: a raised error keeps its frames
        except asyncio.CancelledError:  # the server shut down while the body was arriving
            conn.writer.write(error_response(SHUTTING_DOWN))
            raise

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
