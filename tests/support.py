"""What the tests of serving/ share: the test models and references of the spec (test_lab.py),
servers on 127.0.0.1 and the clients that talk to them.

Real sockets on 127.0.0.1 only, a timeout on every socket and a bound on every loop. The server
is provided code; the tests that need tokens run the engine, whose scheduler is Exercise 5: a
stub it hits comes back as a 500, which these helpers re-raise as the stub's NotImplementedError.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import io
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import course
import serving
import test_lab
from checkpoints.tokenizer import ByteTokenizer
from conftest import lab
from serving import protocol, serving_chat
from serving.sampling import logits_processors
from test_lab import (  # noqa: F401 - the spec's models, references and fixtures, shared
    ENGINE_TINY,
    MODEL_CONFIGS,
    fold,
    greedy_reference,
    random_prompts,
)

engine_model = test_lab.engine_model  # the spec's fixture, for these tests too

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "solution.py"
# The student's copy has no solution.py: the few tests that build half-written labs from the
# reference's source run in the maintainers' checkout and skip there, saying why. They are marked
# `reference` too: CI runs the rest of the suite on the reference's bodies in the copy, these here.
_skip_without_reference = pytest.mark.skipif(not REFERENCE.exists(), reason="needs solution.py, which the student's "
                                              "copy does not ship: runs in the maintainers' checkout")


def import_scratch_lab(path: Path, monkeypatch) -> object:
    """The lab written at `path` (a scratch copy with a slip, or half written), imported under its
    file's name: registered in sys.modules for the test alone, where its dataclasses look their
    module up while their classes are made."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, path.stem, module)
    spec.loader.exec_module(module)
    return module


def needs_reference(test):
    return pytest.mark.reference(_skip_without_reference(test))


def served_model(config, tokenizer, **options):
    """What a server's front end knows, for the parsers: the module, the model, the names..."""
    return protocol.ServedModel(lab, config, tokenizer, ("m",), **{"max_n": 4} | options)


def api_engine(model, **options):
    """An engine that answers every sampling field of the API (as `serve` builds it): the test
    servers' usual 8 sequences of 128 tokens in blocks of 4. num_blocks is given: the default
    would call blocks_needed, and the provided tests must pass before Exercise 1 is written."""
    options = dict(num_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=64) | options
    return lab.LLMEngine(model, logits_processors=logits_processors(), **options)


HTTP_TIMEOUT = 10.0


def reraise_stub(text: str) -> None:
    """The NotImplementedError of a stub that `text` names (a server's error, the command line's
    words), raised here, so the scoreboard names the exercise to write."""
    stub = re.search(r"NotImplementedError: (Exercise \d+: [\w.]+)|(Exercise \d+: \S+) is still a stub", text)
    if stub:
        raise NotImplementedError(stub.group(1) or stub.group(2))


def http_call(server, method, path, body=None):
    """(status, headers, body bytes) of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json"} if body is not None else {})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    if resp.status == 500:
        reraise_stub(data.decode())
    return resp.status, dict(resp.getheaders()), data


def read_metric(text, name):
    """The value of one unlabelled-by-le sample `name{...} value` in Prometheus text."""
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    assert match, f"/metrics has no sample {name}"
    return float(match.group(1))


def read_labelled(text, name, **labels):
    """The value of the sample `name{...}` whose labels include `labels` (0 when it has none)."""
    want = [f'{key}="{value}"' for key, value in labels.items()]
    for match in re.finditer(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M):
        if all(label in match.group(1).split(",") for label in want):
            return float(match.group(2))
    raise AssertionError(f"/metrics has no sample {name} with the labels {labels}")


def answered(text):
    """vllm:request_success_total's answers: the requests finished by "stop" or "length" (not "abort")."""
    return sum(read_labelled(text, "vllm:request_success_total", finished_reason=r) for r in ("stop", "length"))


def complete(server, **fields):
    status, _, data = http_call(server, "POST", "/v1/completions", json.dumps(fields))
    assert status == 200, f"POST /v1/completions {fields}: HTTP {status} {data[:300]!r}"
    return json.loads(data)


def stream_events(server, **fields):
    """The parsed `data:` events of one streamed completion, up to and including [DONE]."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT)
    try:
        conn.request("POST", "/v1/completions", json.dumps(fields | {"stream": True}))
        resp = conn.getresponse()
        if resp.status != 200:
            text = resp.read().decode()
            reraise_stub(text)
            raise AssertionError(f"streamed completion: HTTP {resp.status} {text[:300]}")
        events = []
        for _ in range(2 * fields.get("max_tokens", 16) + 8):
            line = resp.readline().strip()
            if line.startswith(b"data: "):
                events.append("[DONE]" if line == b"data: [DONE]" else json.loads(line[6:]))
                if events[-1] == "[DONE]":
                    return events
                if "error" in events[-1]:  # a step failed mid-stream (a stub, say)
                    reraise_stub(events[-1]["error"]["message"])
                    raise AssertionError(f"the stream ended with an error event: {events[-1]['error']}")
        raise AssertionError(f"the stream did not end with data: [DONE]; got {events[-2:]}")
    finally:
        conn.close()


class SharedServer:
    """One server that a module's tests share (a server per test would cost each its start and
    close), checked after every test that ran its engine: the engine idle, no step of it failed,
    every block back in the pool. A test that leaves the engine broken fails, saying so, and the
    next test gets a new server: one broken engine breaks one test, not the tests after it."""

    IDLE_S = 5.0  # how long a test's requests may take to end after the test did

    def __init__(self, make_engine, **options):
        self.make_engine = make_engine
        self.options = options
        self.running = None
        self.steps = 0
        self.failure = None

    def _start(self):
        engine = self.make_engine()
        step = engine.step

        def counted_step():  # provided code; the count says whether a test ran the engine
            self.steps += 1
            try:
                return step()
            except Exception as exc:
                self.failure = self.failure or exc
                raise

        engine.step = counted_step
        self.running = serving.start_server(engine, lab=lab, **self.options)

    def lease(self):
        """The server for one test: its module's, or a new one if the last test left it broken."""
        if self.running is None:
            self._start()
        self.steps_before = self.steps
        self.failure = None
        return self.running

    def broken(self) -> str | None:
        """Why the engine is unfit for the next test, once the requests of this one have ended; None if fit."""
        engine = self.running.engine
        deadline = time.monotonic() + self.IDLE_S
        while engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.005)
        if self.failure is not None:
            return f"a step of its engine raised {type(self.failure).__name__}: {self.failure}"
        if engine.has_unfinished():
            return f"its engine still had requests in flight {self.IDLE_S:g} s after the test ended"
        if self.steps == self.steps_before:  # the engine did not run: nothing of it changed
            return None
        allocator = engine.allocator
        try:
            lost = allocator.num_blocks - allocator.num_free_blocks
        except Exception as exc:  # noqa: BLE001 - a lab's num_free_blocks that raises leaves the engine unfit
            return f"its allocator's num_free_blocks raised {type(exc).__name__}: {exc}"
        return f"{lost} block(s) of its engine were not back in the pool once every request had ended" if lost else None

    def serve(self):
        """A fixture's body: the server, then the check; a broken engine fails the test that broke it."""
        yield self.lease()
        why = self.broken()
        if why:
            self.close()
            pytest.fail(f"this test left the server its module's tests share broken ({why}); the next test gets a "
                        "new server", pytrace=False)

    def close(self):
        if self.running is not None:
            self.running.close()
            self.running = None


@pytest.fixture(scope="module")
def shared_server(engine_model):
    shared = SharedServer(lambda: api_engine(engine_model))
    yield shared
    shared.close()


@pytest.fixture
def server(shared_server):
    yield from shared_server.serve()


def run_cli(*args) -> subprocess.CompletedProcess:
    """The command line on the module under test, run in this process as `python lab.py ARGS` runs
    it (`course.main(lab, ARGS)`): its exit status, stdout and stderr. A stub it names is
    re-raised here as the same NotImplementedError, so the scoreboard names the exercise to write."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = course.main(lab, list(args))
        except SystemExit as exc:  # argparse and the command line exit with a status
            code = exc.code if isinstance(exc.code, int) else 1
    proc = subprocess.CompletedProcess(["lab", *args], code, out.getvalue(), err.getvalue())
    if proc.returncode == 1:
        reraise_stub(proc.stderr)
    return proc


def run_script(*args) -> subprocess.CompletedProcess:
    """`python <the module's file> ARGS`, a process of its own: what a user types."""
    proc = subprocess.run([sys.executable, lab.__file__, *args], capture_output=True, text=True, timeout=120)
    if proc.returncode == 1:
        reraise_stub(proc.stderr)
    return proc


def at_once(call, *argument_lists) -> list:
    """`call(*arguments)` for every argument list, each in a thread of its own, all at once; their
    results in order. A failure is raised here, a stub's first (the scoreboard names it)."""
    results = [None] * len(argument_lists)
    errors = []

    def run(i, arguments):
        try:
            results[i] = call(*arguments)
        except Exception as exc:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(argument_lists)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HTTP_TIMEOUT)
    if errors:
        raise next((e for e in errors if isinstance(e, NotImplementedError)), errors[0])
    return results


def error_of(server, path, body):
    """(status, error object) of a request that must fail."""
    status, _, data = http_call(server, "POST", path, body if isinstance(body, bytes) else json.dumps(body))
    assert status != 200, f"{body!r} must be refused; got HTTP 200 {data[:200]!r}"
    return status, json.loads(data)["error"]


@pytest.fixture(scope="module")
def shared_byte_server():
    model = lab.ToyTransformer(lab.ModelConfig(**MODEL_CONFIGS["bytes"]), seed=1)
    shared = SharedServer(lambda: api_engine(model))
    yield shared
    shared.close()


@pytest.fixture
def byte_server(shared_byte_server):
    """A server for a 256-token vocabulary: any ASCII text (the chat template's too) is a prompt."""
    yield from shared_byte_server.serve()


def stream_texts(server, path="/v1/completions", **fields):
    events = stream_events_at(server, path, **fields)
    key = "text" if path == "/v1/completions" else "delta"
    return [e for e in events if e != "[DONE]" and e["choices"]], key


def stream_events_at(server, path, **fields):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT)
    try:
        conn.request("POST", path, json.dumps(fields | {"stream": True}))
        resp = conn.getresponse()
        data = resp.read()  # bounded by the server's max_tokens and the timeout
    finally:
        conn.close()
    text = data.decode()
    if resp.status != 200:
        reraise_stub(text)
        raise AssertionError(f"streamed {path}: HTTP {resp.status} {text[:300]}")
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    reraise_stub(text)
    assert events and events[-1] == "[DONE]", f"the stream must end with data: [DONE]; got {events[-2:]}"
    return [json.loads(e) for e in events[:-1]] + ["[DONE]"]


def read_to_close(sock: socket.socket, done=None, allow_reset: bool = True) -> bytes:
    """Everything until the server's end of stream, or until `done(reply)` holds (bounded by the
    socket's timeout and a count). A reset ends the reply with "<reset>", or, unless `allow_reset`,
    fails the test: the server must close, not reset."""
    reply = b""
    for _ in range(1000):
        if done is not None and done(reply):
            return reply
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            if not allow_reset:
                raise AssertionError(
                    f"the server reset the connection instead of closing it, after {reply[:120]!r}") from None
            return reply + b"<reset>"
        if not data:
            return reply
        reply += data
    raise AssertionError("the server did not close the connection" if done is None else "the response did not end")


def stream_then_hang_up(srv, count: int, **fields) -> bytes:
    """Start a 100-token stream on a raw socket, read until `count` data: events have come (or
    the server stopped early), then close the connection, as a client that gives up does."""
    body = json.dumps({"prompt": [5] * 20, "max_tokens": 100, "stream": True} | fields).encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=HTTP_TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        reply = b""
        for _ in range(100):
            data = sock.recv(4096)
            reply += data
            if not data or reply.count(b"data: ") >= count or not reply.startswith(b"HTTP/1.1 200"[:len(reply)]):
                break
    reraise_stub(reply.decode(errors="replace"))
    return reply


CKPT_TINY = dict(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2)  # the checkpoints' model


# A vocabulary worked out by hand, and its files: byte-level characters ("Ġ" is the space byte).
HAND_VOCAB = {"l": 0, "o": 1, "w": 2, "e": 3, "r": 4, "s": 5, "t": 6, "Ġ": 7,
              "lo": 8, "low": 9, "er": 10, "Ġlow": 11, "es": 12, "est": 13, "we": 14, "<|endoftext|>": 15}


HAND_MERGES = [("l", "o"), ("lo", "w"), ("e", "r"), ("Ġ", "low"), ("e", "s"), ("es", "t"), ("w", "e")]


def write_tokenizer(path: Path, vocab=HAND_VOCAB, merges=HAND_MERGES) -> None:
    (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")


def raw_exchange(server, request_bytes):
    """Everything the server sends back until it closes the connection (bounded)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT) as sock:
        sock.sendall(request_bytes)
        return read_to_close(sock, allow_reset=False)


BYTES = lab.ModelConfig(**MODEL_CONFIGS["bytes"])  # a byte-level model's shape: the server's request tests


def chat_request(payload: dict):
    """A chat body parsed as the server parses it, for the byte-level model."""
    return serving_chat.parse_chat_request(served_model(BYTES, ByteTokenizer(256)), json.dumps(payload).encode())


def log_softmax(row) -> np.ndarray:
    """log p of a logits row, in float64: the reference the server's logprobs are held to."""
    row = np.asarray(row, dtype=np.float64)
    return row - row.max() - np.log(np.exp(row - row.max()).sum())


class EosTokenizer(ByteTokenizer):
    """A byte tokenizer whose token `eos_token_id` is the end of text."""

    def __init__(self, vocab_size, eos_token_id):
        super().__init__(vocab_size)
        self.eos_token_id = eos_token_id
