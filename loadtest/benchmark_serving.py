"""An open-loop load generator for any OpenAI-compatible server (vLLM: `vllm/benchmarks/serve.py`,
formerly `benchmarks/benchmark_serving.py`).

Open loop: each request is sent at its arrival time whether or not earlier ones finished, as
users do. (A closed loop, "send the next when one returns", can never offer more than the
server handles, so it cannot show the knee.) Each request's latencies come from the arrival
times of its streamed chunks, as in vLLM's benchmark:
  TTFT = first chunk - send;  E2E = last chunk - send;
  TPOT = (E2E - TTFT) / (output tokens - 1);  ITL = the gaps between consecutive chunks.
The formulas' one home is the chapter's `RequestMetrics.from_times`; the module is handed in.
The client (`LoadClient`) is a plain HTTP/1.1 client on one thread, with kept-alive connections
reused as vLLM's benchmark reuses them, every request under a deadline, so the same command
measures this lab's server and a vLLM deployment.
"""

from __future__ import annotations

import dataclasses
import errno
import http.client
import json
import math
import os
import selectors
import socket
import time
import urllib.parse
from collections.abc import Sequence
from types import ModuleType

import numpy as np

from measure.latency import summarize_latencies

from .datasets import WorkloadRequest, make_workload, poisson_arrival_times, save_workload

MAX_RESPONSE_BYTES = 1 << 20  # one response line or body; a longer one is not a completion stream
KEEP_ALIVE_REUSE_S = 2.0  # an idle connection is reused for this long (servers close them after 5 s)
DRAIN_S = 0.5  # after [DONE], how long the end of the response may take before its connection is dropped


@dataclasses.dataclass
class StreamResult:
    """What the client saw of one streamed request (perf_counter seconds)."""

    send_time: float
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    num_output_tokens: int = 0
    num_prompt_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)


def stream_metrics(lab: ModuleType, result: StreamResult):
    """vLLM's benchmark definitions (see above) for one successful streamed request, as the
    module's RequestMetrics (a chunk may carry several tokens: TPOT divides by tokens)."""
    times = result.chunk_times
    return lab.RequestMetrics.from_times(result.send_time, times, times[-1], result.num_output_tokens)


def summarize_load(lab: ModuleType, results: Sequence[StreamResult], duration: float, slo_ttft: float | None = None,
                   slo_tpot: float | None = None) -> dict[str, float]:
    """A benchmark's numbers, vLLM-style: completed / failed counts; request and output-token
    throughput over `duration` (first send to last chunk); goodput, the requests per second that
    met every SLO given (TTFT <= slo_ttft and, with 2+ tokens, TPOT <= slo_tpot; seconds);
    mean, p50, p90, p99 of TTFT, TPOT (requests with 2+ tokens), ITL (all gaps) and E2E."""
    metrics = [(r, stream_metrics(lab, r)) for r in results if r.ok]
    good = [r for r, m in metrics if (slo_ttft is None or m.ttft <= slo_ttft)
            and (slo_tpot is None or r.num_output_tokens < 2 or m.tpot <= slo_tpot)]
    num_out = sum(r.num_output_tokens for r, _ in metrics)
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    summary = {"completed": len(metrics), "failed": len(results) - len(metrics), "duration": duration,
               "output_tokens": num_out, "request_throughput": per_second(len(metrics)),
               "output_throughput": per_second(num_out), "goodput": per_second(len(good))}
    return summary | summarize_latencies([(r.num_output_tokens, m) for r, m in metrics])


def find_knee(rates: Sequence[float], p99_ttfts: Sequence[float], factor: float = 3.0) -> float | None:
    """The highest offered rate before p99 TTFT first exceeds `factor` times its lowest value
    (there the queue starts to grow: past it TTFT is waiting, not work); None if it never does
    in the rates tried. `rates` ascending."""
    base = min((t for t in p99_ttfts if t == t), default=math.nan)  # t == t: not NaN
    for i in range(1, len(rates)):
        if not p99_ttfts[i] <= factor * base:  # NaN (nothing completed) counts as past the knee
            return rates[i - 1]
    return None


def slo_attainment(summary: dict) -> float:
    """The share of the requests sent at one rate that completed inside every SLO given (goodput's
    requests over all sent, failures included); NaN when nothing was sent."""
    sent = summary["completed"] + summary["failed"]
    return summary["goodput"] * summary["duration"] / sent if sent else math.nan


def find_slo_knee(rates: Sequence[float], summaries: Sequence[dict], share: float = 0.99) -> float | None:
    """The highest offered rate before goodput first leaves throughput: before the first rate where
    fewer than `share` of the requests sent meet every SLO. None if every rate tried keeps up, and
    0.0 if even the lowest does not. `rates` ascending."""
    for i, summary in enumerate(summaries):
        if not slo_attainment(summary) >= share:  # NaN: nothing sent counts as not keeping up
            return rates[i - 1] if i else 0.0
    return None


def _bar(value: float, top: float, width: int) -> str:
    filled = 0 if not (top > 0 and value > 0) else max(1, round(width * min(value, top) / top))
    return "#" * filled + " " * (width - filled)


def format_load_chart(rates: Sequence[float], summaries: Sequence[dict], width: int = 30, slo: str = "") -> str:
    """p99 TTFT and output throughput against the offered rate, as bars, and the knees in words:
    with an SLO (`slo`, its targets in words), where goodput leaves throughput; always, where
    requests start to queue, which says nothing of a target."""
    ttfts = [s["p99_ttft"] * 1e3 for s in summaries]
    tputs = [s["output_throughput"] for s in summaries]
    knee = find_knee(rates, ttfts)
    slo_knee = find_slo_knee(rates, summaries) if slo else None
    top_ttft = max((t for t in ttfts if t == t), default=0.0)
    top_tput = max((t for t in tputs if t == t), default=0.0)
    lines = [f"{'offered':>9} | {'p99 TTFT (ms)':<{width + 9}} | {'output tokens/s':<{width + 8}}"]
    for rate, ttft, tput in zip(rates, ttfts, tputs):
        marks = [name for name, at in (("SLO knee", slo_knee), ("queueing knee", knee)) if rate == at]
        lines.append(f"{rate:>5g} r/s | {_bar(ttft, top_ttft, width)} {ttft:8.1f} | "
                     f"{_bar(tput, top_tput, width)} {tput:7.0f}" + (f"  <- {', '.join(marks)}" if marks else ""))
    if slo:
        lines.append(_slo_knee_words(rates, summaries, slo_knee, slo))
    lines.append("queueing knee: not reached (p99 TTFT stays within 3x of its lowest): offer higher rates"
                 if knee is None else
                 f"queueing knee: {knee:g} req/s, the last rate before p99 TTFT more than tripled its lowest "
                 f"({min(t for t in ttfts if t == t):.1f} ms; {ttfts[rates.index(knee) + 1]:.1f} ms at the next "
                 "rate): past it requests wait for one another. It says nothing of a target: "
                 + ("the SLO knee does." if slo else "--slo-ttft-ms and --slo-tpot-ms give the SLO knee."))
    return "\n".join(lines)


def _slo_knee_words(rates: Sequence[float], summaries: Sequence[dict], slo_knee: float | None, slo: str) -> str:
    if slo_knee is None:
        return f"SLO knee: not reached: at every rate tried at least 99% of requests met {slo}; offer higher rates"
    missed = rates[0] if slo_knee == 0.0 else rates[rates.index(slo_knee) + 1]
    where = (f"not reached from below: at the lowest rate, {missed:g} req/s" if slo_knee == 0.0 else
             f"{slo_knee:g} req/s, the last rate at which goodput kept up with throughput; at {missed:g} req/s")
    again = [r for r, summary in zip(rates, summaries) if r > missed and slo_attainment(summary) >= 0.99]
    return (f"SLO knee: {where}, {slo_attainment(summaries[rates.index(missed)]):.1%} of requests met {slo} (the "
            "SLO asks 99%)" + (f"; {again[0]:g} req/s kept up again (a p99 over a few hundred requests moves from "
                               "run to run)" if again else ""))


def format_load_table(rates: Sequence[float], summaries: Sequence[dict]) -> str:
    """One row per offered rate: counts, throughput, goodput, and p50/p90/p99 of each latency (ms)."""
    head = (f"{'rate':>6} {'done':>5} {'fail':>4} {'req/s':>6} {'tok/s':>7} {'good/s':>6} | "
            + " | ".join(f"{name + ' p50/p90/p99 ms':^23}" for name in ("TTFT", "TPOT", "ITL", "E2E")))
    lines = [head]
    for rate, s in zip(rates, summaries):
        cells = " | ".join(" ".join(f"{s[f'{p}_{m}'] * 1e3:7.1f}" for p in ("p50", "p90", "p99"))
                           for m in ("ttft", "tpot", "itl", "e2e"))
        lines.append(f"{rate:>6g} {s['completed']:>5} {s['failed']:>4} {s['request_throughput']:>6.2f} "
                     f"{s['output_throughput']:>7.0f} {s['goodput']:>6.2f} | {cells}")
    return "\n".join(lines)


def _http_get_json(url: str, path: str, timeout: float) -> dict:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", parts.path.rstrip("/") + path)
        resp = conn.getresponse()
        body = resp.read(MAX_RESPONSE_BYTES)
        if resp.status != 200:
            raise ValueError(f"GET {path}: HTTP {resp.status}: {body[:200]!r}")
        return json.loads(body)
    finally:
        conn.close()


def server_model_card(url: str, timeout: float = 10.0) -> dict:
    """The first model the server lists at /v1/models (its "id", and "max_model_len" where given)."""
    data = _http_get_json(url, "/v1/models", timeout).get("data") or []
    if not data:
        raise ValueError(f"{url}/v1/models lists no model")
    return data[0]


class _ResponseParser:
    """One HTTP/1.1 response, parsed from the bytes fed to it as they arrive (`feed`): the status
    and headers, then the body with the chunked transfer encoding undone, cut into lines, each
    line a server-sent event for `result` (at most `max_lines` of them). The body ends where the
    headers say: the last chunk, Content-Length bytes, or (neither given) the server closing the
    connection. Raises ValueError for what is not a completion stream, ConnectionError for a
    connection closed mid-response."""

    def __init__(self, result: StreamResult, max_lines: int):
        self.result = result
        self.lines_left = max_lines
        self.buffer = bytearray()
        self.next = self._head  # what to parse next; returns False when it needs more bytes
        self.status = 0
        self.keep_alive = False
        self.left = 0
        self.ended = False  # the response's framing has ended: the connection may carry another
        self.decided = False  # `result` is final: [DONE] or an error (the framing may still end)
        self._line, self._error_text = b"", b""  # the line being read, and an error's body

    def feed(self, data: bytes) -> None:
        """Parse `data`; b"" is the server closing the connection."""
        if not data:
            if self.next != self._to_close:
                raise ConnectionError("the server closed the connection mid-response")
            self._body(b"\n" if self._line else b"")  # the last line may have no newline
            self._end()
            return
        self.buffer += data
        while not self.ended and self.next():
            pass

    def _head(self) -> bool:
        if (at := self.buffer.find(b"\r\n\r\n")) < 0:
            if len(self.buffer) > MAX_RESPONSE_BYTES:
                raise ValueError(f"a response head is over {MAX_RESPONSE_BYTES} bytes")
            return False
        status_line, *lines = self.buffer[:at].decode("latin-1").split("\r\n")
        del self.buffer[:at + 4]
        version, _, rest = status_line.partition(" ")
        if not version.startswith("HTTP/") or not rest[:3].isdigit():
            raise ValueError(f"not an HTTP response: {status_line[:80]!r}")
        headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
        self.status = int(rest[:3])
        self.keep_alive = version == "HTTP/1.1" and "close" not in headers.get("connection", "").lower()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            self.next = self._chunk_size
        elif "content-length" in headers:
            self.left = int(headers["content-length"])
            self.next = self._sized if self.left else self._end
        else:  # the body ends when the connection does
            self.next, self.keep_alive = self._to_close, False
        return True

    def _chunk_size(self) -> bool:
        if (at := self.buffer.find(b"\r\n")) < 0:
            if len(self.buffer) > 64:
                raise ValueError(f"a chunk size line is over 64 bytes: {bytes(self.buffer[:64])!r}")
            return False
        size = int(self.buffer[:at].split(b";")[0], 16)
        if size > MAX_RESPONSE_BYTES:  # a chunk this client would hold in memory whole
            if self.status != 200:  # an error's status says what matters; its text can go unread
                self._fail()
                return False
            raise ValueError(f"a response chunk of {size} bytes is over the limit of {MAX_RESPONSE_BYTES}")
        del self.buffer[:at + 2]
        self.left, self.next = size, (self._chunk if size else self._trailer)
        return True

    def _chunk(self) -> bool:
        if len(self.buffer) < self.left + 2:
            return False
        if self.buffer[self.left:self.left + 2] != b"\r\n":
            raise ValueError("a chunk does not end with CRLF where its size says")
        self._body(bytes(self.buffer[:self.left]))
        del self.buffer[:self.left + 2]
        self.next = self._chunk_size
        return True

    def _trailer(self) -> bool:
        """After the last chunk: trailer lines (ignored), then an empty line."""
        if (at := self.buffer.find(b"\r\n")) < 0:
            return False
        del self.buffer[:at + 2]
        if at == 0:
            self._end()
        return True

    def _sized(self) -> bool:
        piece = bytes(self.buffer[:self.left])
        del self.buffer[:self.left]
        self.left -= len(piece)
        self._body(piece)
        if not self.left:
            self._end()
        return False

    def _to_close(self) -> bool:
        self._body(bytes(self.buffer))
        self.buffer.clear()
        return False

    def _body(self, piece: bytes) -> None:
        if self.status != 200:  # an error: its status and the start of its text are enough
            self._error_text = (self._error_text + piece)[:4096]
            if len(self._error_text) == 4096:
                self._fail()
            return
        *lines, self._line = (self._line + piece).split(b"\n")
        if len(self._line) > MAX_RESPONSE_BYTES:
            raise ValueError(f"a response line is over {MAX_RESPONSE_BYTES} bytes")
        for line in lines:
            if self.decided:
                return
            if not self.lines_left:
                raise ValueError("more events than max_tokens allows, and no data: [DONE]")
            self.lines_left -= 1
            self.decided = _read_event(line.strip(), self.result)

    def _end(self) -> bool:
        self.ended = True
        if self.status != 200:
            self._fail()
        elif not self.decided:
            self.result.error = self.result.error or "the stream ended without data: [DONE]"
        self.decided = True
        return False

    def _fail(self) -> None:
        self.result.error = f"HTTP {self.status}: {self._error_text.decode(errors='replace')}"
        self.decided = True
        if not self.ended:  # the rest of the error is left unread: the connection cannot carry another
            self.keep_alive = False


class _Exchange:
    """One request on one connection: connect (unless the connection is reused), send, read."""

    def __init__(self, client: LoadClient, sock: socket.socket, reused: bool, request: bytes,
                 result: StreamResult, max_lines: int):
        self.client = client
        self.sock = sock
        self.reused = reused
        self.unsent = memoryview(request)
        self.result = result
        self.parser = _ResponseParser(result, max_lines)
        self.deadline = result.send_time + client.timeout
        self.connected = reused
        self.received = False

    def ready(self) -> None:
        """The socket is writable (connecting, sending) or readable (the response)."""
        try:
            if not self.connected:
                if error := self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    raise ConnectionError(f"connecting to the server: {os.strerror(error)}")
                self.connected = True
            if self.unsent:
                self.unsent = self.unsent[self.sock.send(self.unsent):]
                if not self.unsent:
                    self.client.selector.modify(self.sock, selectors.EVENT_READ, self)
                return
            data = self.sock.recv(65536)
            self.received = self.received or bool(data)
            self.parser.feed(data)
        except (BlockingIOError, InterruptedError):
            return
        except (ValueError, OSError) as exc:  # OSError covers ConnectionError and a failed connect
            if self.parser.decided:  # the result is in ([DONE] or an error): only the framing's end is lost
                self.client.finish(self, reuse=False)
            elif self.reused and not self.received and isinstance(exc, ConnectionError):
                self.client.retry(self)  # the server had closed the idle connection: a new one
            else:
                self.result.error = f"{type(exc).__name__}: {exc}"
                self.client.finish(self, reuse=False)
            return
        if self.parser.ended:
            self.client.finish(self, reuse=self.parser.keep_alive and not self.parser.buffer)
        elif self.parser.decided and not self.parser.keep_alive:
            self.client.finish(self, reuse=False)  # nothing more to learn, and nothing to keep
        elif self.parser.decided:  # the response's end is still to come: a little longer, for the connection
            self.deadline = min(self.deadline, time.perf_counter() + DRAIN_S)


class LoadClient:
    """The load generator's HTTP/1.1 client: one thread, non-blocking sockets on a selector, and
    kept-alive connections reused from request to request, as vLLM's benchmark does (one aiohttp
    session for every request). A request takes the most recently idle connection, or opens a
    new one when none is idle, so concurrency is never capped. A connection idle for more than
    KEEP_ALIVE_REUSE_S is not reused (servers close idle ones: uvicorn and this lab's after 5 s),
    and a reused one that the server closes before answering is retried once on a new connection.
    Every request ends within `timeout` seconds of its send. Not the standard library's
    http.client, nor a thread per request: on the project's VM http.client added 0.5-1 ms to
    each TTFT, and a thread per request took 1.1-1.9x this client's CPU per token at saturation,
    time and CPU that a server on the same machine would be charged for."""

    def __init__(self, url: str, timeout: float):
        parts = urllib.parse.urlsplit(url)
        self.host, self.port, self.path = parts.hostname, parts.port or 80, parts.path.rstrip("/")
        self.netloc = parts.netloc
        self.timeout = timeout
        self.address: tuple | None = None  # resolved at the first new connection
        self.selector = selectors.DefaultSelector()
        self.idle: list[tuple[socket.socket, float]] = []  # (connection, idle since), most recent last
        self.active: set[_Exchange] = set()  # sending or reading

    def __enter__(self) -> LoadClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        for exchange in list(self.active):
            if not exchange.parser.decided:
                exchange.result.error = "the client closed before the response ended"
            self.finish(exchange, reuse=False)
        for sock, _ in self.idle:
            sock.close()
        self.idle.clear()
        self.selector.close()

    def run(self, payloads: Sequence[dict], arrivals: Sequence[float] | None = None) -> list[StreamResult]:
        """POST each of `payloads` as a streaming completion at its arrival time (seconds from now;
        None: all at once) and time its chunks; returns the results in order. Never raises for a
        failed request: the error is in its `.error`."""
        arrivals = [0.0] * len(payloads) if arrivals is None else list(arrivals)
        order = sorted(range(len(payloads)), key=arrivals.__getitem__)[::-1]  # next to send last
        results: list[StreamResult] = [None] * len(payloads)  # type: ignore[list-item]
        start = time.perf_counter()
        while order or self.active:
            now = time.perf_counter()
            while order and start + arrivals[order[-1]] <= now:
                i = order.pop()
                results[i] = self._send(payloads[i])
                now = time.perf_counter()
            for exchange in [e for e in self.active if e.deadline <= now]:
                if not exchange.parser.decided:
                    exchange.result.error = "TimeoutError: the response took longer than the timeout"
                self.finish(exchange, reuse=False)
            if not (order or self.active):
                break  # the last request ended at its deadline: nothing is left to wait for
            wake = min((e.deadline for e in self.active), default=math.inf)
            if order:
                wake = min(wake, start + arrivals[order[-1]])
            for key, _ in self.selector.select(max(0.0, min(wake - now, 1.0))):
                key.data.ready()
        return results

    def _send(self, payload: dict) -> StreamResult:
        result = StreamResult(send_time=time.perf_counter())
        body = json.dumps(payload).encode()
        request = (f"POST {self.path}/v1/completions HTTP/1.1\r\nHost: {self.netloc}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode("latin-1") + body
        max_lines = 2 * (payload.get("max_tokens") or 16) + 32  # events and blank lines
        try:
            sock, reused = self._connection(result.send_time)
        except OSError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        self._start(_Exchange(self, sock, reused, request, result, max_lines))
        return result

    def _connection(self, now: float) -> tuple[socket.socket, bool]:
        """An idle kept-alive connection that is still open, else a new one, connecting."""
        while self.idle:
            sock, since = self.idle.pop()
            if now - since < KEEP_ALIVE_REUSE_S and self._still_open(sock):
                return sock, True
            sock.close()
        if self.address is None:
            self.address = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0]
        family, kind, proto, _, address = self.address
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if (error := sock.connect_ex(address)) not in (0, errno.EINPROGRESS, errno.EAGAIN):
            sock.close()
            raise ConnectionError(error, f"connecting to {self.host}:{self.port}: {os.strerror(error)}")
        return sock, False  # connecting: the outcome is known once the socket is writable

    @staticmethod
    def _still_open(sock: socket.socket) -> bool:
        try:
            sock.recv(1, socket.MSG_PEEK)  # b"": closed by the server; bytes: nothing asked for them
        except BlockingIOError:
            return True  # nothing to read: open and quiet
        except OSError:
            pass
        return False

    def _start(self, exchange: _Exchange) -> None:
        self.active.add(exchange)
        self.selector.register(exchange.sock, selectors.EVENT_WRITE, exchange)

    def retry(self, exchange: _Exchange) -> None:
        """Send `exchange`'s request again on a new connection (its send time stays)."""
        self.selector.unregister(exchange.sock)
        exchange.sock.close()
        self.active.discard(exchange)
        self.idle, stale = [], self.idle  # the server's idle timeout may have closed these too
        for sock, _ in stale:
            sock.close()
        try:
            sock, _ = self._connection(time.perf_counter())
        except OSError as exc:
            exchange.result.error = f"{type(exc).__name__}: {exc}"
            return
        self._start(_Exchange(self, sock, False, bytes(exchange.unsent.obj), exchange.result,
                              exchange.parser.lines_left))

    def finish(self, exchange: _Exchange, reuse: bool) -> None:
        self.active.discard(exchange)
        self.selector.unregister(exchange.sock)
        if reuse:
            self.idle.append((exchange.sock, time.perf_counter()))
        else:
            exchange.sock.close()


def stream_completion(url: str, payload: dict, timeout: float) -> StreamResult:
    """POST one streaming completion on a new connection and time its chunks. Never raises for a
    failed request: the error is in `.error`. Bounded: at most max_tokens + 16 events, `timeout`
    seconds in all."""
    with LoadClient(url, timeout) as client:
        return client.run([payload])[0]


def _read_event(line: bytes, result: StreamResult) -> bool:
    """Record one server-sent event line; True at `data: [DONE]`."""
    if not line.startswith(b"data:"):
        return False
    data = line[5:].strip()
    if data == b"[DONE]":
        return True
    event = json.loads(data)
    try:
        if "error" in event:
            result.error = json.dumps(event["error"])
        if event.get("choices"):
            result.chunk_times.append(time.perf_counter())
            result.num_output_tokens += len(event["choices"][0].get("token_ids") or [None])
        if event.get("usage"):  # the count the server reports wins (a chunk may hold several tokens)
            result.num_output_tokens = event["usage"].get("completion_tokens", result.num_output_tokens)
            result.num_prompt_tokens = event["usage"].get("prompt_tokens")
    except (TypeError, AttributeError, KeyError, IndexError) as exc:  # JSON, but not shaped as a completion event
        raise ValueError(f"not a completion event ({type(exc).__name__}: {exc}): {data[:80]!r}") from None
    return False


def completion_payload(request: WorkloadRequest, model: str, prompt_format: str = "token-ids") -> dict:
    """The body the load generator sends: greedy, streamed, usage at the end, and `ignore_eos` so
    that a real model produces exactly `max_tokens` tokens (vLLM's benchmark does the same)."""
    prompt = request.prompt_token_ids if prompt_format == "token-ids" else request.prompt_text
    return {"model": model, "prompt": prompt, "max_tokens": request.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


def run_load(url: str, payloads: Sequence[dict], rate: float, seed: int = 0, timeout: float = 300.0,
             client: LoadClient | None = None) -> tuple[list[StreamResult], float]:
    """Send `payloads` open-loop at Poisson `rate` (req/s) and wait for all, each request at most
    `timeout` seconds after its send (`client`: one whose kept-alive connections to use; None: a
    new one, closed after). Returns the results in order and the duration from the first send to
    the last chunk."""
    arrivals = poisson_arrival_times(rate, len(payloads), seed)
    own = client is None
    client = LoadClient(url, timeout) if client is None else client
    try:
        start = time.perf_counter()
        results = client.run(payloads, arrivals)
    finally:
        if own:
            client.close()
    end = max((r.chunk_times[-1] for r in results if r.chunk_times), default=start)
    return results, end - start


def loadtest(lab: ModuleType, url: str, rates: Sequence[float], num_prompts: int,
             workload: str = "sharegpt", seed: int = 0, prompt_format: str = "token-ids", model: str | None = None,
             max_model_len: int | None = None, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
             save_workload_path: str | None = None, timeout: float = 300.0, log=print) -> list[dict]:
    """`python solution.py loadtest`: the same workload at each offered rate (ascending); prints
    a table, the chart and the first error, and returns one summary per rate. Works against any
    OpenAI-compatible /v1/completions; the model name and max_model_len come from /v1/models."""
    if prompt_format not in ("token-ids", "text"):
        raise ValueError(f"prompt_format must be 'token-ids' or 'text', got {prompt_format!r}")
    card = server_model_card(url)
    model = model or card["id"]
    max_model_len = max_model_len or card.get("max_model_len") or 2048
    requests = make_workload(lab, workload, num_prompts, seed, max_model_len, card.get("vocab_size", 256))
    if save_workload_path:
        save_workload(requests, save_workload_path)
        log(f"wrote {len(requests)} requests to {save_workload_path} (vLLM: --dataset-name custom)")
    payloads = [completion_payload(r, model, prompt_format) for r in requests]
    mean_in = np.mean([len(r.prompt_token_ids) for r in requests])
    mean_out = np.mean([r.max_tokens for r in requests])
    log(f"{url} model {model}: {num_prompts} {workload} requests (mean {mean_in:.0f} in / {mean_out:.0f} out "
        f"tokens, {prompt_format} prompts) per rate")
    rates = sorted(rates)
    summaries = []
    first_error = None
    for rate in rates:
        results, duration = run_load(url, payloads, rate, seed, timeout)
        summaries.append(summarize_load(lab, results, duration, None if slo_ttft_ms is None else slo_ttft_ms / 1e3,
                                        None if slo_tpot_ms is None else slo_tpot_ms / 1e3))
        first_error = first_error or next((r.error for r in results if r.error), None)
        log(f"  rate {rate:g} req/s: {summaries[-1]['completed']}/{num_prompts} done in {duration:.1f} s")
    slo = ", ".join(f"{k} <= {v:g} ms" for k, v in (("TTFT", slo_ttft_ms), ("TPOT", slo_tpot_ms)) if v is not None)
    log(format_load_table(rates, summaries))
    log(f"goodput: requests per second meeting {slo or 'no SLO (give --slo-ttft-ms / --slo-tpot-ms)'}")
    log(format_load_chart(rates, summaries, slo=slo))
    if first_error:
        log(f"first error: {first_error}")
    return summaries
