"""test_server.py"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import socket
import struct
import threading
import time

import pytest

import serving
from conftest import lab
from serving import api_server, protocol, sampling
from tests.support import (
    HTTP_TIMEOUT,
    answered,
    api_engine,
    at_once,
    complete,
    greedy_reference,
    http_call,
    random_prompts,
    read_labelled,
    read_metric,
    read_to_close,
    reraise_stub,
    stream_events,
    stream_then_hang_up,
)

# =====================================================================================
# Serving over HTTP: the engine behind an OpenAI-compatible endpoint, and the load generator
# =====================================================================================
#
# Real sockets on 127.0.0.1 only, a timeout on every socket and a bound on every loop. The server
# is provided code; the tests that need tokens run the engine, whose scheduler is Exercise 5: a
# stub it hits comes back as a 500, which these helpers re-raise as the stub's NotImplementedError.


@pytest.mark.needs(5)
def test_concurrent_streaming_clients_get_the_tokens_of_greedy_decoding_alone(server, engine_model):
    prompts = random_prompts(6, seed=40)
    max_tokens = [3, 9, 1, 14, 6, 11]
    events = at_once(lambda i: stream_events(server, prompt=prompts[i], max_tokens=max_tokens[i], temperature=0,
                                             return_token_ids=True), *[(i,) for i in range(6)])
    for i, got in enumerate(events):
        chunks, done = got[:-1], got[-1]
        assert done == "[DONE]"
        assert all(len(c["choices"][0]["token_ids"]) == 1 for c in chunks), "one event per token"
        tokens = [c["choices"][0]["token_ids"][0] for c in chunks]
        assert tokens == greedy_reference(engine_model, prompts[i], max_tokens[i]), (
            f"client {i}: the streamed tokens differ from greedy decoding of its prompt alone; "
            "serving concurrently must change nothing but timing")
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == bytes(tokens).decode()


@pytest.mark.needs(5)
def test_a_completion_has_its_tokens_text_and_usage(server, engine_model):
    prompt = "!(*/+"  # bytes 33..47: inside the 64-token vocabulary
    expected = greedy_reference(engine_model, list(prompt.encode()), 7)
    body = complete(server, prompt=prompt, max_tokens=7, temperature=0, return_token_ids=True)
    assert body["object"] == "text_completion" and body["model"] == server.model_name
    choice = body["choices"][0]
    assert choice["token_ids"] == expected, "a string prompt is its UTF-8 bytes as token ids"
    assert choice["text"] == bytes(expected).decode() and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}


@pytest.mark.needs(5)
def test_a_stop_token_ends_the_stream_and_usage_comes_last(server, engine_model):
    prompt = random_prompts(1, seed=41)[0]
    free_run = greedy_reference(engine_model, prompt, 10)
    events = stream_events(server, prompt=prompt, max_tokens=10, stop_token_ids=[free_run[3]], temperature=0,
                           return_token_ids=True, stream_options={"include_usage": True})
    chunks, usage, done = events[:-2], events[-2], events[-1]
    stop_at = free_run.index(free_run[3]) + 1
    assert [c["choices"][0]["token_ids"][0] for c in chunks] == free_run[:stop_at]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and done == "[DONE]"
    assert chunks[-1]["choices"][0]["stop_reason"] == free_run[3], "vLLM's stop_reason: the stop token's id"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == stop_at, (
        "with stream_options.include_usage the last event before [DONE] carries the usage")


@pytest.mark.needs(5)
def test_a_stop_token_at_the_last_place_max_tokens_allows_is_a_stop_without_its_text(server, engine_model):
    prompt = random_prompts(1, seed=41)[0]
    free_run = greedy_reference(engine_model, prompt, 10)
    stop = free_run[3]
    last = free_run.index(stop) + 1
    choice = complete(server, prompt=prompt, max_tokens=last, stop_token_ids=[stop], temperature=0,
                      return_token_ids=True)["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop), (
        f"the stop token {stop} came as output {last} of max_tokens={last}: vLLM checks the stop tokens before the "
        f"length cap, so finish_reason is 'stop' and stop_reason the token's id; got {choice['finish_reason']!r}, "
        f"{choice['stop_reason']!r}")
    assert choice["token_ids"] == free_run[:last] and choice["text"] == bytes(free_run[:last - 1]).decode(), (
        "a stop token is kept among the token ids, but its text is not in the reply")


BAD_REQUESTS = [
    (b"{", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"max_tokens": 3}', "prompt is required"),
    (b'{"prompt": 5}', "prompt must be"),
    (b'{"prompt": [1, "2"]}', "prompt must be"),
    (b'{"prompt": [1, true]}', "prompt must be"),
    (b'{"prompt": []}', "empty"),
    (b'{"prompt": ""}', "empty"),
    (b'{"prompt": [64]}', "vocabulary"),
    (b'{"prompt": [-1]}', "vocabulary"),
    (b'{"prompt": "hello"}', "vocabulary"),  # byte 104 has no token in a vocabulary of 64
    (b'{"prompt": [1], "max_tokens": 128}', "n_positions"),
    (json.dumps({"prompt": [1] * 129}).encode(), "n_positions"),
    (b'{"prompt": [1], "max_tokens": "3"}', "max_tokens"),
    (b'{"prompt": [1], "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": [1], "max_tokens": true}', "max_tokens"),
    (b'{"prompt": [1], "temperature": -1}', "temperature"),
    (b'{"prompt": [1], "stream": "yes"}', "stream"),
    (b'{"prompt": [1], "seed": -3}', "seed"),
    (b'{"prompt": [1], "stop_token_ids": [1.5]}', "stop_token_ids"),
    (b"[" * 100_000 + b"]" * 100_000, "JSON"),           # nesting past Python's recursion limit
    (b'{"prompt": [1], "seed": ' + b"9" * 5000 + b"}", "JSON"),  # an int too long to convert
]


@pytest.mark.reaches(1)  # the engine's answer carries its gauges, read by num_free_blocks
@pytest.mark.parametrize("body, says", BAD_REQUESTS, ids=[says for _, says in BAD_REQUESTS])
def test_a_bad_request_is_a_400_with_an_openai_error_and_the_server_keeps_serving(server, body, says):
    status, headers, data = http_call(server, "POST", "/v1/completions", body)
    assert status == 400, f"{body!r}: expected HTTP 400, got {status}"
    error = json.loads(data)["error"]
    assert error["type"] == "invalid_request_error" and says in error["message"], (
        f"{body!r}: the error must say what was wrong ({says!r}); got {error}")
    assert http_call(server, "GET", "/health")[0] == 200, "after a bad request the server must keep serving"


@pytest.mark.provided
def test_a_lab_whose_gauges_raise_fails_the_request_at_once_with_a_500_naming_the_error(engine_model, monkeypatch):
    def broken(allocator):  # a slip in the lab's num_free_blocks, which the engine's gauges read after each command
        raise AttributeError("'BlockAllocator' object has no attribute 'evictable'")

    monkeypatch.setattr(lab.BlockAllocator, "num_free_blocks", property(broken))
    with serving.start_server(api_engine(engine_model), lab=lab) as srv:
        start = time.monotonic()
        status, _, data = http_call(srv, "POST", "/v1/completions", json.dumps({"prompt": [1], "max_tokens": 128}))
        waited = time.monotonic() - start
    assert status == 500 and "AttributeError" in data.decode() and "evictable" in data.decode(), (
        f"the engine failed (its gauges raised): the request gets a 500 naming the error; got {status} {data[:200]}")
    assert waited < HTTP_TIMEOUT / 2, f"the request waited {waited:.1f} s: an engine that fails answers at once"


@pytest.mark.provided
def test_a_content_length_that_is_not_ascii_digits_is_a_400(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT) as sock:
        sock.sendall("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ²\r\n\r\n".encode())
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:100]
    assert http_call(server, "GET", "/health")[0] == 200


@pytest.mark.provided
def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n" + b"{" * 1000)
        reply = b""
        for _ in range(100):  # the server answers without waiting for the gigabyte
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    assert reply.startswith(b"HTTP/1.1 413"), f"a body over the limit is a 413 (RFC 9110 §15.5.14): {reply[:100]!r}"
    assert b"limit" in reply and b"invalid_request_error" in reply
    assert http_call(server, "GET", "/health")[0] == 200


@pytest.mark.provided
def test_models_health_and_unknown_routes(server):
    status, _, data = http_call(server, "GET", "/v1/models")
    models = json.loads(data)
    assert status == 200 and models["object"] == "list" and models["data"][0]["id"] == server.model_name
    assert http_call(server, "GET", "/health")[0] == 200
    status, _, data = http_call(server, "GET", "/v2/nothing")
    assert status == 404 and "error" in json.loads(data)
    assert http_call(server, "GET", "/v1/completions")[0] == 405


VLLM_METRICS = [("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:num_preemptions_total", "counter"),
                ("vllm:prefix_cache_queries_total", "counter"), ("vllm:prefix_cache_hits_total", "counter"),
                ("vllm:time_to_first_token_seconds", "histogram"), ("vllm:iteration_tokens_total", "histogram")]


@pytest.mark.provided
def test_metrics_are_prometheus_text_with_vllms_names(server):
    status, headers, data = http_call(server, "GET", "/metrics")
    text = data.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    for name, kind in VLLM_METRICS:
        assert f"# TYPE {name} {kind}\n" in text, f"/metrics must declare {name} as a {kind} (vLLM's name)"
    ttft = "vllm:time_to_first_token_seconds"
    assert re.search(rf'^{ttft}_bucket{{[^}}]*le="\+Inf"}} \d+$', text, re.M), "a histogram ends with le=+Inf"
    assert read_metric(text, f"{ttft}_count") >= 0 and read_metric(text, "vllm:kv_cache_usage_perc") >= 0


@pytest.mark.provided
def test_a_histogram_bucket_counts_every_value_less_than_or_equal_to_its_bound():
    ttft = serving.metrics.Histogram([0.1, 1.0])
    for value in (0.1, 0.5, 1.0, 2.0):
        ttft.observe(value)
    gauges = dict.fromkeys(("running", "waiting", "kv_usage", "preemptions", "queries", "hits"), 0)
    gauges["iteration_tokens"] = serving.metrics.Histogram(serving.metrics.ITERATION_TOKENS_BUCKETS)
    text = serving.metrics.prometheus_text("m", gauges, dict.fromkeys(
        ("prompt_tokens", "generation_tokens"), 0), ttft, dict.fromkeys(serving.metrics.FINISHED_REASONS, 0))
    name = "vllm:time_to_first_token_seconds"
    buckets = re.findall(rf'^{name}_bucket{{model_name="m",le="([^"]+)"}} (\d+)$', text, re.M)
    assert buckets == [("0.1", "1"), ("1.0", "3"), ("+Inf", "4")], (
        f"buckets {buckets}: a Prometheus bucket le=x counts every observation <= x (cumulative), so 0.1 falls "
        "in le=0.1 and 1.0 in le=1.0")
    assert read_metric(text, f"{name}_count") == 4 and read_metric(text, f"{name}_sum") == pytest.approx(3.6)


@pytest.mark.needs(5)
def test_metrics_count_a_served_request(server):
    before = http_call(server, "GET", "/metrics")[2].decode()
    complete(server, prompt=[1, 2, 3], max_tokens=4)
    after = http_call(server, "GET", "/metrics")[2].decode()
    ttft = "vllm:time_to_first_token_seconds_count"
    assert read_metric(after, ttft) == read_metric(before, ttft) + 1, "one request, one TTFT observation"
    assert read_metric(after, "vllm:num_requests_running") == 0
    assert read_metric(after, "vllm:kv_cache_usage_perc") == 0, "a finished request holds no KV block"


@pytest.mark.needs(5)
def test_metrics_count_every_token_of_a_streamed_request(server):
    before = http_call(server, "GET", "/metrics")[2].decode()
    events = stream_events(server, prompt=[1, 2, 3], max_tokens=5)
    after = http_call(server, "GET", "/metrics")[2].decode()
    assert len(events) == 6, "5 token events and [DONE]"
    counts = {name: read_metric(after, name) - read_metric(before, name) for name in (
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total")}
    counts["vllm:request_success_total"] = answered(after) - answered(before)
    assert counts == {"vllm:request_success_total": 1, "vllm:prompt_tokens_total": 3,
                      "vllm:generation_tokens_total": 5}, (
        f"one streamed request of 3 prompt and 5 generated tokens moved the counters by {counts}: a stream "
        "counts every token it sent, not its last chunk's")


def _counters(srv, *names) -> dict[str, float]:
    text = http_call(srv, "GET", "/metrics")[2].decode()
    return {name: read_metric(text, name) for name in names}


PREFIX = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
ITERATION = ("vllm:iteration_tokens_total_sum", "vllm:iteration_tokens_total_count")


@pytest.mark.needs(5)
def test_prefix_cache_counters_count_prompt_tokens_looked_up_and_found_as_vllm_does(engine_model):
    prompt = [(5 * i) % 61 + 1 for i in range(5 * 4 + 2)]  # 5 full blocks of 4, and 2 tokens
    with serving.start_server(api_engine(engine_model, enable_prefix_caching=True), lab=lab) as srv:
        first, second = [], []
        for seen in (first, second):
            complete(srv, prompt=prompt, max_tokens=2)
            seen.append(_counters(srv, *PREFIX))
    got = (first[0][PREFIX[0]], first[0][PREFIX[1]], second[0][PREFIX[0]], second[0][PREFIX[1]])
    assert got == (22, 0, 44, 20), (
        f"a 22-token prompt sent twice moved (queries, hits) to {got[:2]} then {got[2:]}: vLLM counts the "
        "prefix cache in tokens, at a request's admission: its prompt's tokens looked up, and the tokens found "
        "cached (the second time its 5 full blocks of 4)")


@pytest.mark.needs(5)
def test_prefix_cache_counters_stay_at_zero_while_caching_is_off(server):
    before = _counters(server, *PREFIX)
    complete(server, prompt=[1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=2)
    complete(server, prompt=[1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=2)
    assert _counters(server, *PREFIX) == before, "with prefix caching off, vLLM looks nothing up and counts nothing"


@pytest.mark.needs(5)
def test_tokens_per_step_count_a_chunked_prefill_whole_in_the_step_that_completes_it(engine_model):
    # max_num_batched_tokens 64: the 100-token prompt runs in two steps, the second samples the first token.
    with serving.start_server(api_engine(engine_model), lab=lab) as srv:
        before = _counters(srv, *ITERATION)
        complete(srv, prompt=[i % 60 + 1 for i in range(100)], max_tokens=4)
        after = _counters(srv, *ITERATION)
        text = http_call(srv, "GET", "/metrics")[2].decode()
    got = {name: after[name] - before[name] for name in ITERATION}
    assert got == {ITERATION[0]: 104, ITERATION[1]: 4}, (
        f"a 100-token prompt prefilled in 2 chunks, then 3 decode steps, gave tokens per step (sum, count) "
        f"{tuple(got.values())}: vLLM observes vllm:iteration_tokens_total once per step that produced a token, "
        "counting the generated tokens and the prompt tokens of each prefill the step completed (100 + 1, "
        "then 1, 1, 1)")
    buckets = {le: read_labelled(text, "vllm:iteration_tokens_total_bucket", le=le) for le in ("1", "64", "128")}
    assert buckets == {"1": 3, "64": 3, "128": 4}, f"cumulative buckets of 1, 1, 1 and 101 tokens: {buckets}"


@pytest.mark.needs(5)
def test_metrics_count_the_tokens_of_a_stream_its_client_abandoned(engine_model):
    engine = lab.LLMEngine(engine_model, num_blocks=64, block_size=4)
    step = engine.step

    def slow_step():  # 5 ms a step: 100 tokens outlast the client by far
        time.sleep(0.005)
        return step()

    engine.step = slow_step
    with serving.start_server(engine, lab=lab) as srv:
        reply = stream_then_hang_up(srv, 3)
        assert reply.count(b"data: ") >= 3, f"expected three token events, got {reply[:300]!r}"
        deadline = time.monotonic() + HTTP_TIMEOUT
        while time.monotonic() < deadline and engine.has_unfinished():
            time.sleep(0.01)
        text = http_call(srv, "GET", "/metrics")[2].decode()
    generated = read_metric(text, "vllm:generation_tokens_total")
    completed = answered(text)
    prompt = read_metric(text, "vllm:prompt_tokens_total")
    assert prompt == 20, (f"the abandoned stream's 20 prompt tokens were counted as {prompt:g}: vLLM counts a "
                          "prompt's tokens once its prefill is done, whether or not the request completes")
    assert completed == 0 and 3 <= generated < 100, (
        f"a stream cut off after 3+ tokens left generation_tokens_total = {generated:g} and request_success_total "
        f"(stop, length) = {completed:g}: generated tokens are counted as they are produced (as vLLM counts them), "
        "a request as answered only when it completes")


@pytest.mark.needs(5)
def test_a_stream_is_server_sent_events_each_ended_by_a_blank_line(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT)
    try:
        conn.request("POST", "/v1/completions", json.dumps({"prompt": [4, 5], "max_tokens": 3, "stream": True}))
        resp = conn.getresponse()
        body = resp.read()  # http.client undoes the chunked transfer encoding
    finally:
        conn.close()
    reraise_stub(body.decode(errors="replace"))  # a 500, or an error event mid-stream
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    events = body.split(b"\n\n")
    assert events[-1] == b"" and len(events) == 5, (
        f"an SSE event is a data: line followed by a blank line (\\n\\n); 3 tokens and [DONE] are 4 events, "
        f"got {body[:200]!r}")
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events[:-1]) and events[-2] == b"data: [DONE]"


@pytest.mark.needs(5)
def test_a_client_that_disconnects_mid_stream_is_aborted_and_its_blocks_return(engine_model):
    engine = lab.LLMEngine(engine_model, num_blocks=64, block_size=4)
    outputs = []
    stubs = []
    step = engine.step

    def slow_recorded_step():  # 5 ms a step: 100 tokens outlast the client by far
        time.sleep(0.005)
        try:
            out = step()
        except NotImplementedError as exc:  # after the client has gone, nobody else would see it
            stubs.append(exc)
            raise
        outputs.extend(out)
        return out

    engine.step = slow_recorded_step
    with serving.start_server(engine, lab=lab) as srv:
        reply = stream_then_hang_up(srv, 1)
        assert b"data: " in reply, f"expected the first token as a data: event, got {reply[:200]!r}"
        deadline = time.monotonic() + HTTP_TIMEOUT
        while time.monotonic() < deadline and engine.allocator.num_free_blocks < 64:
            time.sleep(0.01)
        if stubs:
            raise stubs[0]
        assert engine.allocator.num_free_blocks == 64, "the aborted request's blocks must return to the pool"
    reasons = [o.finish_reason for o in outputs if o.finished]
    assert reasons == ["abort"], f"the engine must abort the request when its client goes; it finished as {reasons}"
    assert sum(len(o.new_token_ids) for o in outputs) < 50, "the abort must come at once, not after the request ran on"


def end_stream(sock: socket.socket, how: str) -> None:
    """End a client's side of the connection: a half-close (FIN, still reading), a close (FIN),
    or a reset (RST: SO_LINGER with a zero timeout)."""
    if how == "half-close":
        sock.shutdown(socket.SHUT_WR)
    else:
        if how == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


@pytest.mark.needs(5)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_clients_that_end_their_stream_are_aborted_within_a_step_and_never_count_as_successes(engine_model, stream):
    # 8 clients, each ending its side one of three ways (half-close, close, reset) once all 8 run.
    max_tokens, clients, ways = 100, 8, ["half-close", "close", "reset"]
    engine = lab.LLMEngine(engine_model, num_blocks=256, block_size=4, max_num_seqs=clients)
    step = engine.step
    produced = []

    def slow_step():  # 30 ms a step: a whole answer is 3 s, far longer than the clients stay
        time.sleep(0.03)
        out = step()
        produced.extend(out)
        return out

    engine.step = slow_step
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": max_tokens, "stream": stream}).encode()
    socks = []
    with serving.start_server(engine, lab=lab) as srv:
        complete(srv, prompt=[1], max_tokens=1)  # a stub is named here, not below
        produced.clear()
        before = http_call(srv, "GET", "/metrics")[2].decode()
        try:
            for _ in range(clients):
                socks.append(socket.create_connection(("127.0.0.1", srv.port), timeout=HTTP_TIMEOUT))
                socks[-1].sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + HTTP_TIMEOUT
            running = 0
            while time.monotonic() < deadline and running < clients and not any(o.finished for o in produced):
                running = read_metric(http_call(srv, "GET", "/metrics")[2].decode(), "vllm:num_requests_running")
            assert running == clients, f"the {clients} requests never ran together (running {running})"
            for i, sock in enumerate(socks):
                end_stream(sock, ways[i % 3])
            half_closed = [read_to_close(sock) for i, sock in enumerate(socks) if ways[i % 3] == "half-close"]
            while time.monotonic() < deadline and engine.has_unfinished():
                time.sleep(0.01)
            text = http_call(srv, "GET", "/metrics")[2].decode()
        finally:
            for sock in socks:
                sock.close()
    reraise_stub(b"".join(half_closed).decode(errors="replace"))
    reasons = [o.finish_reason for o in produced if o.finished]
    tokens = sum(len(o.new_token_ids) for o in produced)
    assert reasons == ["abort"] * clients and tokens < clients * max_tokens // 4, (
        f"{clients} clients that ended their stream (half-close, close, reset) finished as {reasons} after "
        f"{tokens} of their {clients * max_tokens} tokens: an end of stream aborts the request within a step")
    successes = {reason: read_labelled(text, "vllm:request_success_total", finished_reason=reason)
                 - read_labelled(before, "vllm:request_success_total", finished_reason=reason)
                 for reason in ("stop", "length", "abort")}
    assert successes == {"stop": 0, "length": 0, "abort": clients}, (
        f"request_success_total by finished_reason {successes}: a request whose client left counts as "
        f"finished_reason=\"abort\" (vLLM's label), never as a success (stop, length)")
    assert read_metric(text, "vllm:num_requests_running") == 0, "the running gauge drops once they are aborted"
    for reply in half_closed:
        assert b"end of stream" in reply and (b"data: [DONE]" not in reply if stream else
                                              reply.startswith(b"HTTP/1.1 400")), (
            f"a client that half-closed still reads: it is told why its request was aborted, never given a "
            f"success: {reply[:200]!r} ... {reply[-120:]!r}")


@pytest.mark.needs(5)
def test_a_failing_engine_step_is_a_500_for_its_requests_and_the_server_keeps_serving(engine_model, monkeypatch):
    engine = lab.LLMEngine(engine_model, num_blocks=64, block_size=4)
    with serving.start_server(engine, lab=lab) as srv:
        complete(srv, prompt=[3, 4], max_tokens=2, temperature=0)  # a stub is named here, not below

        def broken(*args, **kwargs):
            raise FloatingPointError("planted fault")

        monkeypatch.setattr(engine.model, "forward", broken)  # the engine runs in this process
        status, _, data = http_call(srv, "POST", "/v1/completions", json.dumps({"prompt": [3, 4], "max_tokens": 3}))
        assert status == 500 and b"planted fault" in data, (
            f"a step that raises must answer its requests with a 500 naming the error; got HTTP {status} "
            f"{data[:200]!r}")
        monkeypatch.undo()
        got = complete(srv, prompt=[5, 6], max_tokens=3, temperature=0)
        assert got["usage"]["completion_tokens"] == 3, "after a failed step the server must go on serving"
        deadline = time.monotonic() + HTTP_TIMEOUT
        while time.monotonic() < deadline and engine.has_unfinished():
            time.sleep(0.01)
        assert not engine.has_unfinished(), "the failed request must not be left in the engine"


@pytest.mark.needs(5)
def test_a_stream_interval_sends_the_same_tokens_k_to_a_chunk(engine_model):
    streams = {}
    for k in (1, 4):
        engine = lab.LLMEngine(engine_model, num_blocks=64, block_size=4)
        with serving.start_server(engine, lab=lab, stream_interval=k) as srv:
            streams[k] = stream_events(srv, prompt=[3, 9, 4], max_tokens=10, temperature=0, return_token_ids=True)
    sizes = {k: [len(e["choices"][0]["token_ids"]) for e in events[:-1]] for k, events in streams.items()}
    tokens = {k: [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] for k, events in streams.items()}
    assert sizes[4] == [4, 4, 2] and tokens[4] == tokens[1], (
        f"stream_interval=4 must send the 10 tokens of stream_interval=1 ({tokens[1]}) 4 to a chunk, the last "
        f"with the rest: got chunks of {sizes[4]} carrying {tokens[4]}")


@pytest.mark.provided
@pytest.mark.parametrize("value, error", [(0, ValueError), (2.0, TypeError), (True, TypeError)])
def test_a_stream_interval_that_is_not_a_positive_int_is_refused(engine_model, value, error):
    with pytest.raises(error, match="stream_interval"):
        serving.start_server(lab.LLMEngine(engine_model, num_blocks=64, block_size=4), lab=lab, stream_interval=value)


@pytest.mark.needs(5)
def test_the_front_end_in_a_thread_answers_as_the_one_in_its_own_process(engine_model, monkeypatch):
    # Where there is no fork the front end runs in a thread of the engine's process, on the
    # same pipes: same answers, only slower (serving/engine/'s docstring says why).
    answers = []
    for in_process in (True, False):
        monkeypatch.setattr(api_server, "FRONTEND_PROCESS", in_process)
        with serving.start_server(lab.LLMEngine(engine_model, num_blocks=64, block_size=4), lab=lab) as srv:
            answers.append([stream_events(srv, prompt=[2 + i, 7], max_tokens=4 + i, temperature=0) for i in range(3)])
    texts = [[[e["choices"][0]["text"] for e in events[:-1] if e["choices"]] for events in run] for run in answers]
    assert texts[0] == texts[1], f"the front end in a thread streamed {texts[1]}, in its own process {texts[0]}"




@pytest.mark.provided
@pytest.mark.skipif(not api_server.FRONTEND_PROCESS, reason="no fork here: the front end is a thread")
def test_a_server_whose_front_end_is_killed_stops_instead_of_running_on_unreachable(engine_model):
    with serving.start_server(lab.LLMEngine(engine_model, num_blocks=64, block_size=4), lab=lab) as srv:
        assert not srv.wait(0.05), "a healthy server stopped of itself"
        os.kill(srv._frontend.pid, signal.SIGKILL)  # the forked HTTP process, as an OOM killer would
        assert srv.wait(HTTP_TIMEOUT), (
            "the front end was killed, so nobody can reach the engine: the server must stop (and `serve` "
            "return) instead of running on")


@pytest.mark.provided
def test_every_unsupported_field_may_be_absent_or_null():
    # refuse_unsupported looks only at the fields a request has: that is right only while each
    # table allows None (absent) for every field.
    for table in (protocol.UNSUPPORTED_COMMON, protocol.UNSUPPORTED_COMPLETION, protocol.UNSUPPORTED_CHAT):
        assert all(None in allowed for allowed in table.values()), (
            f"a field whose absence is refused: {[n for n, a in table.items() if None not in a]}")


@pytest.mark.provided
def test_the_front_ends_commands_never_block_its_loop_and_arrive_in_order():
    # While the engine writes a step's outputs to the front end, it reads no commands; a loop
    # that blocked on a full command pipe would then never read those outputs: both would wait.
    from serving.engine.transport import message_pipe

    reader, writer = message_pipe()
    loop = asyncio.new_event_loop()
    try:
        writer.attach(loop, on_gone=lambda: None)
        # 64 commands (one larger than a whole pipe, read in pieces): several pipes full
        messages = [("add", i, bytes(300_000 if i == 10 else 4096)) for i in range(64)]
        # In a thread only to bound a send that blocks; the loop does not run until it is done.
        sender = threading.Thread(target=lambda: [writer.send(m) for m in messages], daemon=True)
        sender.start()
        sender.join(HTTP_TIMEOUT)
        assert not sender.is_alive(), "send blocked on a full pipe: the front end's loop would stall"
        received = []
        drain = threading.Thread(target=lambda: received.extend(reader.recv() for _ in messages), daemon=True)
        drain.start()
        deadline = time.monotonic() + HTTP_TIMEOUT
        while drain.is_alive() and time.monotonic() < deadline:  # the loop writes what waits
            loop.run_until_complete(asyncio.sleep(0.01))
        assert [m[1] for m in received] == list(range(64)), (
            f"{len(received)} of 64 commands arrived ({[m[1] for m in received][:12]}...): all must, in the order "
            "they were sent, once the engine reads again (the loop writes what the pipe could not take)")
    finally:
        loop.close()
        reader.close()
        writer.close()


class Doubler:
    """A logits processor of the caller's own: it must stay, after the API's."""

    def __call__(self, seq, logits):
        return logits * 2


@pytest.mark.needs(5)
@pytest.mark.parametrize("own", [[], [sampling.LogitBias()], [Doubler()]], ids=["none", "logit-bias-only", "own"])
def test_an_engine_built_without_the_apis_processors_serves_the_whole_api(engine_model, own):
    # Each field moves the greedy path or the answer; doubling the logits moves neither (at T = 0, and
    # logprobs are the raw row's), so every engine must answer exactly as one built with all of them.
    fields = dict(prompt=[3, 4], max_tokens=8, temperature=0, logprobs=2, min_tokens=6, presence_penalty=2,
                  frequency_penalty=2, repetition_penalty=3, min_p=0.5, logit_bias={"7": 3}, return_token_ids=True)
    answers = {}
    for name, processors in (("reference", sampling.logits_processors()), ("engine", own)):
        engine = lab.LLMEngine(engine_model, num_blocks=64, block_size=4, logits_processors=processors)
        with serving.start_server(engine, lab=lab) as srv:
            status, _, data = http_call(srv, "POST", "/v1/completions", json.dumps(fields))
            assert status == 200, (
                f"start_server serves the whole API whatever the engine was built with (it installs the logits "
                f"processors the engine lacks); got HTTP {status} {data[:200]!r}")
            if name == "reference":
                plain = complete(srv, **{k: fields[k] for k in ("prompt", "max_tokens", "temperature",
                                                                  "return_token_ids")})["choices"][0]
        answers[name] = {k: json.loads(data)["choices"][0][k] for k in ("token_ids", "logprobs")}
    assert answers["reference"]["token_ids"] != plain["token_ids"], "the fields must change the greedy path here"
    assert answers["engine"] == answers["reference"], (
        f"an engine handed over without the API's processors answers as one built with them: {answers}")
    assert engine.logits_processors == own, "close() gives the engine its own processors back"
