"""test_http.py"""

from __future__ import annotations

import http.client
import json
import socket
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
