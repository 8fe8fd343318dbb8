"""test_http.py"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import threading
import time

import pytest

import serving
from conftest import lab
from serving import api_server, http_server
from tests.support import (
    HTTP_TIMEOUT,
    api_engine,
    error_of,
    http_call,
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


def raw_exchange(server, request_bytes):
    """Everything the server sends back until it closes the connection (bounded)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT) as sock:
        sock.sendall(request_bytes)
        reply = b""
        for _ in range(1000):
            data = sock.recv(65536)
            if not data:
                return reply
            reply += data
    raise AssertionError("the server did not close the connection")


@pytest.mark.provided
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
    with serving.start_server(api_engine(engine_model)) as server, socket.create_connection(
            ("127.0.0.1", server.port), timeout=HTTP_TIMEOUT) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        start, reply = time.monotonic(), b""
        for _ in range(100):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
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
    srv = serving.start_server(engine)
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


ODD_JSON = [  # (body, the field it names or None for the body)
    (b'{"prompt": "\\ud800"}', "prompt"), (b'{"prompt": [1], "stop": "\\udc00"}', "stop"),
    (b'{"prompt": [1], "temperature": NaN}', None), (b'{"prompt": [1], "temperature": Infinity}', None),
    (b'{"prompt": [1], "temperature": -Infinity}', None),
    (b'{"prompt": [1], "temperature": 1' + b"0" * 400 + b"}", "temperature"),
    (b'{"prompt": [1], "max_tokens": 1' + b"0" * 400 + b"}", "max_tokens"),
    (b'{"prompt": [1], "n": 1' + b"0" * 400 + b"}", "n"),
    (b'{"prompt": [1], "seed": 1' + b"0" * 400 + b"}", "seed"),
    (b'{"prompt": [1], "repetition_penalty": 1e400}', "repetition_penalty"),
    (b'{"prompt": [1], "temperature": 1e400}', "temperature"),
    (b'{"prompt": [1], "top_p": 1' + b"0" * 400 + b"}", "top_p"),
    (b'{"prompt": [1' + b"0" * 400 + b"]}", "prompt"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
]


@pytest.mark.provided
@pytest.mark.parametrize("body, param", ODD_JSON, ids=[b[:48].decode() for b, _ in ODD_JSON])
def test_rule8_odd_json_is_a_400_never_a_500(server, body, param):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    status, error = error_of(server, path, body)
    assert status == 400, f"rule 8: {body[:60]!r} must be a 400, not a {status}: {error}"
    assert error["param"] == param, f"rule 8: the error must name {param}; got {error}"


@pytest.mark.provided
def test_rule8_a_long_stop_token_list_is_refused_before_it_is_scanned(server):
    status, error = error_of(server, "/v1/completions", {"prompt": [1], "stop_token_ids": [1] * 200_000})
    assert status == 400 and error["param"] == "stop_token_ids", (
        "rule 8: the engine checks stop tokens every step: 200,000 of them must not reach it")


@pytest.mark.provided
def test_rule8_a_large_body_is_parsed_off_the_event_loop(engine_model, monkeypatch, tmp_path):
    # The parse of a large body is made to wait until the test has been served a /health: on
    # the event loop it would hold every other client up until its deadline. The two files
    # signal across the front end's process.
    parsing, released, parse = tmp_path / "parsing", tmp_path / "released", api_server.parse_completion_request

    def held_while_large(*args):
        if len(args[1]) > api_server.INLINE_PARSE_BYTES:
            parsing.touch()
            deadline = time.monotonic() + 3 * HTTP_TIMEOUT
            while not released.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return parse(*args)

    monkeypatch.setattr(api_server, "parse_completion_request", held_while_large)  # before the fork
    body = json.dumps({"prompt": [1] * 100, "max_tokens": 0, "user": "x" * 200_000})  # valid, not run
    engine = lab.LLMEngine(engine_model, num_blocks=64, block_size=4, max_num_seqs=2)
    with serving.start_server(engine) as srv:
        big = []
        sender = threading.Thread(target=lambda: big.append(http_call(srv, "POST", "/v1/completions", body)))
        sender.start()
        try:
            for _ in range(int(HTTP_TIMEOUT / 0.01)):
                if parsing.exists():
                    break
                time.sleep(0.01)
            assert parsing.exists(), "the large body never reached the parser"
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=HTTP_TIMEOUT / 2)
            try:
                conn.request("GET", "/health")
                status = conn.getresponse().status
            except TimeoutError:
                status = None
            finally:
                conn.close()
            assert status == 200, (
                "rule 8: while a large body was being parsed, GET /health got no answer: a large body "
                "must be parsed on a worker thread, so that the event loop keeps serving the others")
        finally:
            released.touch()
            sender.join(3 * HTTP_TIMEOUT)
    assert big and big[0][0] == 400, f"the large request itself must still be answered (400 for max_tokens 0): {big}"


@pytest.mark.provided
def test_rule8_a_huge_prompt_is_refused_by_its_length(server):
    status, error = error_of(server, "/v1/completions", {"prompt": [1] * 300_000})
    assert status == 400 and error["param"] == "prompt" and "n_positions" in error["message"], error
    assert http_call(server, "GET", "/health")[0] == 200


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
    srv = serving.start_server(api_engine(engine_model))
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=HTTP_TIMEOUT) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n" + b'{"prompt": [1')
            time.sleep(0.1)  # the head is read; the body is still arriving
            closer = threading.Thread(target=srv.close)
            closer.start()
            reply = b""
            for _ in range(100):
                data = sock.recv(65536)
                if not data:
                    break
                reply += data
            closer.join(HTTP_TIMEOUT)
    finally:
        srv.close()
    assert reply.startswith(b"HTTP/1.1 503"), (
        f"rule 7: a request whose body was still arriving when the server shut down is owed an answer (503), "
        f"not a silent close: {reply[:80]!r}")


# --- chunked request bodies (RFC 9112 §7.1) ----------------------------------------------


ECHO_BODY = b'{"prompt": [1, 2, 3], "max_tokens": 0, "echo": true}'  # answered without the engine


@pytest.mark.provided
def test_rule7_a_chunked_body_from_http_client_is_read(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT)
    try:  # an iterable body and no Content-Length: http.client sends Transfer-Encoding: chunked
        conn.request("POST", "/v1/completions", iter([ECHO_BODY[:10], ECHO_BODY[10:30], ECHO_BODY[30:]]),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    assert resp.status == 200 and json.loads(data)["usage"]["prompt_tokens"] == 3, (
        f"rule 7: a chunked request body (RFC 9112: a recipient must parse it) is read whole: HTTP {resp.status} "
        f"{data[:200]!r}")


@pytest.mark.provided
@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_rule7_curl_uploading_from_stdin_sends_a_chunked_body_that_is_read(server):
    proc = subprocess.run(["curl", "-sS", "--max-time", str(HTTP_TIMEOUT), "-T", "-", "-X", "POST",
                           "-H", "Content-Type: application/json", "-w", "\\n%{http_code}",
                           f"http://127.0.0.1:{server.port}/v1/completions"],
                          input=ECHO_BODY, capture_output=True, timeout=2 * HTTP_TIMEOUT)
    body, _, code = proc.stdout.rpartition(b"\n")
    assert code == b"200" and json.loads(body)["usage"]["prompt_tokens"] == 3, (
        f"rule 7: curl -T - sends its body chunked (its size is unknown): it must be read; got {code!r} "
        f"{proc.stdout[:200]!r} {proc.stderr[:200]!r}")


@pytest.mark.provided
def test_rule8_a_chunked_body_over_the_limit_is_a_400_that_the_client_receives(server):
    piece = b" " * (http_server.MAX_BODY_BYTES // 2)  # JSON whitespace: three of them pass the limit
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT)
    try:
        conn.request("POST", "/v1/completions", iter([piece, piece, piece, ECHO_BODY]))
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    assert resp.status == 400 and b"limit" in data, (
        f"rule 8: a chunked body past MAX_BODY_BYTES is refused as a Content-Length past it is, and the client, "
        f"still sending, gets the 400 (no reset): HTTP {resp.status} {data[:200]!r}")


CHUNKED_FRAMING_ERRORS = [  # (what follows the head, the status)
    (b"zz\r\nab\r\n0\r\n\r\n", 400),  # a size that is not hex
    (b"%x\r\n%s \r\n0\r\n\r\n" % (len(ECHO_BODY), ECHO_BODY), 400),  # data past its size: no CRLF after it
    (b"%x\r\n" % (2 << 20), 400),  # one chunk over the limit, refused from its size line
]


@pytest.mark.provided
@pytest.mark.parametrize("rest, status", CHUNKED_FRAMING_ERRORS, ids=["size-not-hex", "no-crlf", "over-limit"])
def test_rule8_a_malformed_chunked_body_is_answered_at_once(server, rest, status):
    start = time.monotonic()
    reply = raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + rest)
    assert reply.startswith(b"HTTP/1.1 %d" % status) and time.monotonic() - start < HTTP_TIMEOUT / 2, (
        f"rule 8: a chunked body that cannot be read ({rest[:20]!r}) is a {status} at once, then the close: "
        f"{reply[:120]!r}")


@pytest.mark.provided
@pytest.mark.parametrize("headers, status", [(b"Transfer-Encoding: gzip, chunked\r\n", 501),
                                             (b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n", 400)],
                         ids=["gzip", "with-content-length"])
def test_rule8_a_transfer_coding_other_than_chunked_alone_is_refused(server, headers, status):
    reply = raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\n" + headers + b"\r\n5\r\nhello\r\n0\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 %d" % status), (
        f"rule 8: only a chunked body alone is read (RFC 9112 §6: another coding is a 501; with Content-Length "
        f"too, a 400, as a smuggling risk): {reply[:120]!r}")


# --- no silent closes ------------------------------------------------------------------------


def read_to_close(sock: socket.socket) -> bytes:
    """Everything until the server's end of stream (bounded by the socket's timeout and a count)."""
    reply = b""
    for _ in range(1000):
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return reply + b"<reset>"
        if not data:
            return reply
        reply += data
    raise AssertionError("the server did not close the connection")


@pytest.mark.provided
def test_rule7_a_connection_that_sends_only_blank_lines_gets_a_408_at_the_deadline(engine_model, monkeypatch):
    monkeypatch.setattr(http_server, "READ_TIMEOUT_S", 0.5)  # before the front end starts (and forks)
    with serving.start_server(api_engine(engine_model)) as srv, socket.create_connection(
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
    with serving.start_server(api_engine(engine_model)) as srv, socket.create_connection(
            ("127.0.0.1", srv.port), timeout=HTTP_TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n" + b'{"prompt": [1')
        reply = read_to_close(sock)
    assert reply.startswith(b"HTTP/1.1 408"), f"rule 7: a body cut short by silence gets a 408: {reply[:120]!r}"


@pytest.mark.provided
def test_rule8_megabytes_of_blank_lines_get_a_400_once_past_the_head_limit(engine_model, monkeypatch):
    monkeypatch.setattr(http_server, "READ_TIMEOUT_S", 3.0)  # without the bound, the deadline ends it
    with serving.start_server(api_engine(engine_model)) as srv, socket.create_connection(
            ("127.0.0.1", srv.port), timeout=HTTP_TIMEOUT) as sock:
        try:
            sock.sendall(b"\r\n" * (1 << 20))  # 2 MB
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server stopped reading: the reply (or its absence) tells
        start = time.monotonic()
        reply = read_to_close(sock)
    assert reply.startswith(b"HTTP/1.1 400") and b"blank lines" in reply and time.monotonic() - start < 2.0, (
        f"rule 8: blank lines count toward the head's limit: past it they get a 400 at once, and the client "
        f"still sending receives it (no reset): {reply[:160]!r}")


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
def test_rule7_a_request_sent_whole_before_a_half_close_is_answered_in_full(engine_model, stream):
    body = json.dumps({"prompt": [3, 4, 5], "max_tokens": 6, "temperature": 0, "stream": stream}).encode()
    with serving.start_server(slow_engine(engine_model)) as srv, socket.create_connection(
            ("127.0.0.1", srv.port), timeout=HTTP_TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        sock.shutdown(socket.SHUT_WR)  # as some load tools do once the request is out
        reply = read_to_close(sock)
    reraise_stub(reply.decode(errors="replace"))
    head, _, rest = reply.partition(b"\r\n\r\n")
    done = rest.rstrip().endswith(b"0") and b"data: [DONE]" in rest if stream else rest.endswith(b"}")
    assert head.startswith(b"HTTP/1.1 200") and done, (
        f"rule 7: an end of stream after a whole request is a half-close, not a disconnect: the client still "
        f"reads, and is owed the whole answer: {reply[:160]!r} ... {reply[-80:]!r}")


@pytest.mark.provided
def test_rule7_after_an_error_the_server_reads_what_the_client_still_sends_before_it_closes(server):
    # RFC 9112 §9.6: a server that closes at once resets a client still sending, and the reset can
    # destroy the response on its way. The server shuts its side for writing, then reads on.
    with socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (2 * http_server.MAX_BODY_BYTES))
        reply = read_to_close(sock)  # the 400, refused from the Content-Length, then the server's end of stream
        errors = []
        for _ in range(3):  # the rest of the body the client was sending
            try:
                sock.sendall(b"x" * 65536)
            except OSError as exc:
                errors.append(exc)
                break
            time.sleep(0.05)
    assert reply.startswith(b"HTTP/1.1 400") and not errors, (
        f"rule 7: after its error the server half-closes and reads on (a graceful close), so a client still "
        f"sending is not reset: {reply[:80]!r}, then {errors}")
