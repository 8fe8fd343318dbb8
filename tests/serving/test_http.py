"""HTTP/1.1 on real sockets: one connection for several requests, pipelining, HTTP/1.0, closes,
deadlines and shutdown; a client that ends its stream is aborted and told why; no connection
closed without a word (docs/serving.md, rule 7)."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time

import pytest

import serving
from conftest import lab
from serving import http_server, protocol
from tests.support import (
    HTTP_TIMEOUT,
    api_engine,
    http_call,
    raw_exchange,
    read_to_close,
    reraise_stub,
)


@pytest.mark.provided
def test_rule7_one_connection_carries_several_requests(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT)
    try:
        for method, path, body, status in [("GET", "/health", None, 200), ("POST", "/v1/completions", "{", 400),
                                           ("HEAD", "/v1/models", None, 200), ("GET", "/v1/models", None, 200)]:
            conn.request(method, path, body)
            resp = conn.getresponse()
            data = resp.read()
            assert resp.status == status, f"{method} {path}: HTTP {resp.status}"
            assert resp.getheader("Connection") == "keep-alive", (
                "rule 7: an HTTP/1.1 connection persists (keep-alive) across requests")
            if method == "HEAD":
                assert data == b"" and int(resp.getheader("Content-Length")) > 0, "HEAD: the head of GET, no body"
        assert conn.sock is not None, "rule 7: the server must not close a keep-alive connection"
    finally:
        conn.close()


@pytest.mark.reaches(1)  # the engine's answer carries its gauges, read by num_free_blocks
def test_rule7_pipelined_requests_are_answered_in_order(server):
    body = b'{"prompt": [1], "max_tokens": 0, "echo": true}'  # answered without the engine
    post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    reply = raw_exchange(server, post + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert reply.count(b"HTTP/1.1 200 OK") == 2 and reply.index(b"text_completion") < reply.rindex(b"HTTP/1.1 200"), (
        "rule 7: two requests sent back to back on one connection get two responses, in order")


@pytest.mark.provided
def test_rule7_connection_close_is_honoured(server):
    reply = raw_exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200") and b"Connection: close" in reply, (
        "rule 7: after Connection: close the server answers and closes")


@pytest.mark.provided
def test_rule7_head_is_get_without_the_body(server):
    reply = raw_exchange(server, b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: " in head and body == b"", (
        f"rule 7: HEAD answers GET's head (its Content-Length) and no body; got {body[:80]!r} after the head")


@pytest.mark.provided
def test_rule7_an_idle_connection_is_closed_after_the_keep_alive_timeout(engine_model, monkeypatch):
    monkeypatch.setattr(http_server, "KEEP_ALIVE_TIMEOUT_S", 0.2)  # before the front end starts (and forks)
    with serving.start_server(api_engine(engine_model), lab=lab) as server, socket.create_connection(
            ("127.0.0.1", server.port), timeout=HTTP_TIMEOUT) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        start = time.monotonic()
        reply = read_to_close(sock, allow_reset=False)
    assert reply.startswith(b"HTTP/1.1 200") and time.monotonic() - start < 5, (
        "rule 7: an idle persistent connection is closed after KEEP_ALIVE_TIMEOUT_S")


@pytest.mark.needs(5)
def test_rule7_an_http_1_0_client_gets_a_stream_delimited_by_close(server):
    body = json.dumps({"prompt": [1, 2], "max_tokens": 3, "stream": True}).encode()
    reply = raw_exchange(server, b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    reraise_stub(reply.decode(errors="replace"))
    head, _, rest = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head.lower(), (
        "rule 7: HTTP/1.0 has no chunked encoding: the body ends when the connection closes")
    assert rest.startswith(b"data: ") and rest.endswith(b"data: [DONE]\n\n"), rest[-80:]


@pytest.mark.needs(5)
def test_rule7_an_http_1_0_stream_ends_with_the_close_even_when_the_client_asks_for_keep_alive(server):
    body = json.dumps({"prompt": [1, 2], "max_tokens": 3, "stream": True}).encode()
    post = b"POST /v1/completions HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    reply = raw_exchange(server, post)  # returns only once the server closes
    reraise_stub(reply.decode(errors="replace"))
    head, _, rest = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"connection: close" in head.lower(), (
        f"rule 7: an HTTP/1.0 stream has no chunked coding, so only the close can end its body: it is answered "
        f"Connection: close, and closed, even when the client asked for keep-alive; got {head!r}")
    assert rest.endswith(b"data: [DONE]\n\n"), f"the whole stream comes before the close: {rest[-80:]!r}"


@pytest.mark.provided
def test_rule7_close_returns_promptly_with_idle_client_connections_open(engine_model):
    engine = lab.LLMEngine(engine_model, num_blocks=64, block_size=4)
    srv = serving.start_server(engine, lab=lab)
    conns = [http.client.HTTPConnection("127.0.0.1", srv.port, timeout=HTTP_TIMEOUT) for _ in range(3)]
    try:
        for conn in conns:
            conn.request("GET", "/health")
            conn.getresponse().read()  # the connection stays open, idle
        start = time.monotonic()
        srv.close()
        assert time.monotonic() - start < 2.0, "rule 7: close() must not wait for idle keep-alive connections"
    finally:
        srv.close()
        for conn in conns:
            conn.close()


@pytest.mark.provided
def test_rule7_an_http_1_0_connection_closes_after_one_response_unless_it_asks_to_persist(server):
    reply = raw_exchange(server, b"GET /health HTTP/1.0\r\n\r\n")  # returns only once the server closes
    assert reply.startswith(b"HTTP/1.0 200") and b"connection: close" in reply.lower(), (
        "rule 7: an HTTP/1.0 connection does not persist by default (RFC 9112): one response, then close")
    with socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT) as sock:
        replies = b""
        for _ in range(2):
            sock.sendall(b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            replies += sock.recv(65536)
    assert replies.count(b"HTTP/1.0 200") == 2 and b"connection: keep-alive" in replies.lower(), (
        "rule 7: an HTTP/1.0 client that says Connection: keep-alive keeps its connection for the next request")


@pytest.mark.provided
def test_rule7_a_head_whose_lines_end_in_a_bare_lf_is_answered_at_once(server):
    start = time.monotonic()
    reply = raw_exchange(server, b"GET /health HTTP/1.1\nHost: x\nConnection: close\n\n")
    assert reply.startswith(b"HTTP/1.1 200") and time.monotonic() - start < HTTP_TIMEOUT / 2, (
        f"rule 7: a request whose lines end in a bare LF (RFC 9112 lets a server accept it) is answered, not left "
        f"to time out: {reply[:80]!r}")


@pytest.mark.provided
def test_rule7_a_request_cut_off_by_shutdown_gets_a_503(engine_model):
    srv = serving.start_server(api_engine(engine_model), lab=lab)
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=HTTP_TIMEOUT) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n" + b'{"prompt": [1')
            time.sleep(0.1)  # the head is read; the body is still arriving
            closer = threading.Thread(target=srv.close)
            closer.start()
            reply = read_to_close(sock, allow_reset=False)
            closer.join(HTTP_TIMEOUT)
    finally:
        srv.close()
    assert reply.startswith(b"HTTP/1.1 503"), (
        f"rule 7: a request whose body was still arriving when the server shut down is owed an answer (503), "
        f"not a silent close: {reply[:80]!r}")


# --- no silent closes ------------------------------------------------------------------------


@pytest.mark.provided
def test_rule7_a_connection_that_sends_only_blank_lines_gets_a_408_at_the_deadline(engine_model, monkeypatch):
    monkeypatch.setattr(http_server, "READ_TIMEOUT_S", 0.5)  # before the front end starts (and forks)
    with serving.start_server(api_engine(engine_model), lab=lab) as srv, socket.create_connection(
            ("127.0.0.1", srv.port), timeout=HTTP_TIMEOUT) as sock:
        sock.sendall(b"\r\n\r\n\r\n")
        start = time.monotonic()
        reply = read_to_close(sock)
    assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - start < HTTP_TIMEOUT / 2, (
        f"rule 7: a connection that sent bytes (blank lines) and no whole request by the deadline gets a 408 "
        f"(RFC 9110 §15.5.9), not a silent close: {reply[:120]!r}")


@pytest.mark.provided
def test_rule7_a_body_that_stops_arriving_gets_a_408_at_the_deadline(engine_model, monkeypatch):
    monkeypatch.setattr(http_server, "READ_TIMEOUT_S", 0.5)
    with serving.start_server(api_engine(engine_model), lab=lab) as srv, socket.create_connection(
            ("127.0.0.1", srv.port), timeout=HTTP_TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n" + b'{"prompt": [1')
        reply = read_to_close(sock)
    assert reply.startswith(b"HTTP/1.1 408"), f"rule 7: a body cut short by silence gets a 408: {reply[:120]!r}"


@pytest.mark.provided
def test_rule8_megabytes_of_blank_lines_get_a_431_once_past_the_head_limit(engine_model, monkeypatch):
    monkeypatch.setattr(http_server, "READ_TIMEOUT_S", 3.0)  # without the bound, the deadline ends it
    with serving.start_server(api_engine(engine_model), lab=lab) as srv, socket.create_connection(
            ("127.0.0.1", srv.port), timeout=HTTP_TIMEOUT) as sock:
        try:
            sock.sendall(b"\r\n" * (1 << 20))  # 2 MB
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server stopped reading: the reply (or its absence) tells
        start = time.monotonic()
        reply = read_to_close(sock)
    assert reply.startswith(b"HTTP/1.1 431") and b"blank lines" in reply and time.monotonic() - start < 2.0, (
        f"rule 8: blank lines count toward the head's limit: past it they get a 431 at once, and the client "
        f"still sending receives it (no reset): {reply[:160]!r}")


@pytest.mark.provided
def test_rule7_each_body_cut_short_raises_an_error_of_its_own_that_holds_no_earlier_requests_frames():
    # One error object raised again and again grows its traceback by every raise, keeping each
    # earlier request's frames (its connection, its buffered body) alive: a leak per request.
    async def cut_short():
        reader = asyncio.StreamReader()
        reader.feed_data(b'{"prompt": [1')
        reader.feed_eof()
        request = http_server.HTTPRequest("POST", "/v1/completions", "HTTP/1.1", {"content-length": "100"}, True)
        try:
            await http_server.Connections._read_body(http_server.Connection(reader, None), request)
        except protocol.APIError as exc:
            return exc
        raise AssertionError("a body cut short by the end of stream must raise an APIError")

    def depth(tb):
        return 0 if tb is None else 1 + depth(tb.tb_next)

    first, second = asyncio.run(cut_short()), asyncio.run(cut_short())
    assert first is not second and depth(second.__traceback__) == depth(first.__traceback__), (
        "rule 7: the error of a body cut short is made anew for each request: one object raised twice carries "
        "the first request's frames in its traceback")


@pytest.mark.provided
def test_rule7_a_head_cut_short_by_the_clients_end_of_stream_gets_a_400(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Le")
        sock.shutdown(socket.SHUT_WR)
        reply = read_to_close(sock)
    assert reply.startswith(b"HTTP/1.1 400"), (
        f"rule 7: a request cut short by the client's end of stream is answered (a 400), not dropped: {reply[:120]!r}")


def slow_engine(model, delay: float = 0.02):
    """An API engine whose every step takes `delay` more seconds (the client's moves come first)."""
    engine = api_engine(model)
    step = engine.step

    def slow_step():
        time.sleep(delay)
        return step()

    engine.step = slow_step
    return engine


@pytest.mark.needs(5)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_rule7_a_half_close_after_a_whole_request_aborts_it_and_the_client_reads_why(engine_model, stream):
    body = json.dumps({"prompt": [3, 4, 5], "max_tokens": 100, "temperature": 0, "stream": stream}).encode()
    with serving.start_server(slow_engine(engine_model), lab=lab) as srv, socket.create_connection(
            ("127.0.0.1", srv.port), timeout=HTTP_TIMEOUT) as sock:
        assert http_call(srv, "POST", "/v1/completions", json.dumps({"prompt": [1], "max_tokens": 1}))[0] == 200
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        sock.shutdown(socket.SHUT_WR)  # the same FIN as a client that has gone
        start = time.monotonic()
        reply = read_to_close(sock)
    reraise_stub(reply.decode(errors="replace"))
    head, _, rest = reply.partition(b"\r\n\r\n")
    status_ok = head.startswith(b"HTTP/1.1 400") or (stream and head.startswith(b"HTTP/1.1 200"))  # an error event
    assert status_ok and b"end of stream" in rest and b"data: [DONE]" not in rest, (
        f"rule 7: an end of stream from the client aborts its request (vLLM's behaviour: a half-close and a client "
        f"that has gone are the same FIN); a client still reading is told why, never given an answer: {reply[:200]!r}")
    assert time.monotonic() - start < 100 * 0.02 / 2, "the abort comes at once, not after the request ran its course"


@pytest.mark.provided
def test_rule7_after_an_error_the_server_reads_what_the_client_still_sends_before_it_closes(server):
    # RFC 9112 §9.6: a server that closes at once resets a client still sending, and the reset can
    # destroy the response on its way. The server shuts its side for writing, then reads on.
    with socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (2 * http_server.MAX_BODY_BYTES))
        reply = read_to_close(sock)  # the 413, refused from the Content-Length, then the server's end of stream
        errors = []
        for _ in range(3):  # the rest of the body the client was sending
            try:
                sock.sendall(b"x" * 65536)
            except OSError as exc:
                errors.append(exc)
                break
            time.sleep(0.05)
    assert reply.startswith(b"HTTP/1.1 413") and not errors, (
        f"rule 7: after its error the server half-closes and reads on (a graceful close), so a client still "
        f"sending is not reset: {reply[:80]!r}, then {errors}")
