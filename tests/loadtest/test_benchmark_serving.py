"""test_benchmark_serving.py"""

from __future__ import annotations

import contextlib
import json
import math
import re
import socket
import threading
import time

import numpy as np
import pytest

import serving
from conftest import lab
from loadtest import benchmark_serving, datasets
from tests.support import (
    HTTP_TIMEOUT,
    MODEL_CONFIGS,
    reraise_stub,
    run_cli,
)

# --- the load generator: its client on canned responses, its statistics on hand-made ------
# --- streams, then end to end -------------------------------------------------------------


def canned_server(response: bytes, piece: int = 7, stall: bool = False):
    """A one-request server on 127.0.0.1 that reads the request, writes `response` in pieces of
    `piece` bytes (so that chunk and line boundaries fall anywhere), then closes; with `stall`
    it keeps the connection open, silent, instead of closing. Returns (url, thread)."""
    return scripted_server([[response]], piece, stall)


def scripted_server(connections: list[list[bytes | None]], piece: int = 7, stall: bool = False):
    """A server on 127.0.0.1 that accepts one connection after another, one per entry of
    `connections`, and on each reads a request and writes its next response (in pieces of
    `piece` bytes), or for None reads the request and closes without an answer; it closes a
    connection after its last response (with `stall`, the last connection stays open, silent).
    Returns (url, thread)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(HTTP_TIMEOUT)

    def read_request(conn, buffered: bytes) -> bytes | None:
        """The bytes after one request (each recv bounded by the timeout); None: the client went."""
        while b"\r\n\r\n" not in buffered:
            if not (data := conn.recv(65536)):
                return None
            buffered += data
        head, _, body = buffered.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
        while len(body) < length:
            if not (data := conn.recv(65536)):
                return None
            body += data
        return body[length:]

    def serve():
        with listener:
            for n, responses in enumerate(connections):
                with listener.accept()[0] as conn, contextlib.suppress(ConnectionError):  # a client may go early
                    conn.settimeout(HTTP_TIMEOUT)
                    buffered = b""
                    for response in responses:
                        if (buffered := read_request(conn, buffered)) is None or response is None:
                            break
                        for i in range(0, len(response), piece):
                            conn.sendall(response[i:i + piece])
                    if stall and n == len(connections) - 1:
                        conn.recv(1)  # until the client gives up and closes

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", thread


def sse_body(events):
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def chunked(body: bytes, size: int = 11) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
                    for i in range(0, len(body), size)) + b"0\r\n\r\n"


STREAM_EVENTS = [{"choices": [{"text": t, "index": 0}]} for t in "abc"] + [
    {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}, b"[DONE]"]


@pytest.mark.provided
@pytest.mark.parametrize("framing", ["chunked", "close-delimited"])
def test_the_load_generators_client_reads_a_stream_whatever_its_framing(framing):
    body = sse_body(STREAM_EVENTS)
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            if framing == "chunked" else b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
    url, thread = canned_server(head + (chunked(body) if framing == "chunked" else body))
    result = benchmark_serving.stream_completion(url, {"prompt": [1, 2], "max_tokens": 3}, HTTP_TIMEOUT)
    thread.join(HTTP_TIMEOUT)
    assert result.error is None, f"a {framing} stream read in 7-byte pieces: {result.error}"
    assert (len(result.chunk_times), result.num_output_tokens, result.num_prompt_tokens) == (3, 3, 2), (
        f"3 token events and the usage: got {len(result.chunk_times)} chunks, {result.num_output_tokens} "
        f"tokens, {result.num_prompt_tokens} prompt tokens")


@pytest.mark.provided
@pytest.mark.parametrize("response, says", [
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 27\r\n\r\n{\"error\": {\"message\": \"no\"}}", "HTTP 400"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(sse_body(STREAM_EVENTS[:2])),
     "without data: [DONE]"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(sse_body(STREAM_EVENTS[:2]))[:40],
     "mid-response"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP response"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffff\r\n", "over the limit"),
    (b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffff\r\n", "HTTP 503"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(sse_body([5] + STREAM_EVENTS)),
     "not a completion event"),
], ids=["an error status", "a stream without [DONE]", "a connection closed mid-chunk", "not HTTP", "a huge chunk",
        "an error with a huge chunk", "an event that is JSON but not an object"])
def test_the_load_generators_client_reports_a_failed_request_and_never_raises(response, says):
    url, thread = canned_server(response)
    result = benchmark_serving.stream_completion(url, {"prompt": [1, 2], "max_tokens": 3}, HTTP_TIMEOUT)
    thread.join(HTTP_TIMEOUT)
    assert result.error is not None and says in result.error, f"expected an error saying {says!r}, got {result.error!r}"


KEPT_ALIVE_STREAM = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + chunked(sse_body(STREAM_EVENTS)))


@pytest.mark.provided
def test_the_load_generators_client_reuses_a_kept_alive_connection():
    url, thread = scripted_server([[KEPT_ALIVE_STREAM, KEPT_ALIVE_STREAM]])  # one connection, two answers
    with benchmark_serving.LoadClient(url, 3.0) as client:  # a request on another connection waits unaccepted
        results = [client.run([{"prompt": [1, 2], "max_tokens": 3}])[0] for _ in range(2)]
    thread.join(HTTP_TIMEOUT)
    assert [r.error for r in results] == [None, None], (
        f"the second request must go on the first one's kept-alive connection (the server accepts no "
        f"other), as vLLM's benchmark reuses its connections: {[r.error for r in results]}")


@pytest.mark.provided
def test_the_load_generators_client_retries_once_on_a_connection_the_server_closed_unanswered():
    # The first connection answers one request and closes at the next without a word, as a server
    # whose idle timeout has just run out does: the request must go again, on a new connection.
    url, thread = scripted_server([[KEPT_ALIVE_STREAM, None], [KEPT_ALIVE_STREAM]])
    with benchmark_serving.LoadClient(url, 3.0) as client:  # a request on another connection waits unaccepted
        results = [client.run([{"prompt": [1, 2], "max_tokens": 3}])[0] for _ in range(2)]
    thread.join(HTTP_TIMEOUT)
    assert results[1].error is None and len(results[1].chunk_times) == 3, (
        f"a reused connection closed before any answer is not a failed request: {results[1].error!r}")


@pytest.mark.provided
def test_the_load_generators_client_keeps_a_finished_stream_whose_framing_never_ends():
    # [DONE] has come but not the last chunk, and the server says no more: the request is done
    # (its chunks are timed), and waiting for the framing's end is bounded by DRAIN_S.
    url, thread = canned_server(KEPT_ALIVE_STREAM[:-len(b"0\r\n\r\n")], stall=True)
    start = time.perf_counter()
    result = benchmark_serving.stream_completion(url, {"prompt": [1, 2], "max_tokens": 3}, HTTP_TIMEOUT)
    waited = time.perf_counter() - start
    thread.join(HTTP_TIMEOUT)
    assert result.error is None and len(result.chunk_times) == 3, (
        f"a stream that reached [DONE] is a finished request, whatever its framing does next: {result.error!r}")
    assert waited < benchmark_serving.DRAIN_S + 2.0, (
        f"the client waited {waited:.1f} s for the end of a finished response (DRAIN_S is {benchmark_serving.DRAIN_S})")


@pytest.mark.provided
def test_the_load_generators_client_sends_each_request_at_its_arrival_time_not_before():
    url, thread = scripted_server([[KEPT_ALIVE_STREAM], [KEPT_ALIVE_STREAM]])
    with benchmark_serving.LoadClient(url, 3.0) as client:
        results = client.run([{"prompt": [1, 2], "max_tokens": 3}] * 2, [0.0, 0.3])
    thread.join(HTTP_TIMEOUT)
    gap = results[1].send_time - results[0].send_time
    assert [r.error for r in results] == [None, None] and gap >= 0.3, (
        f"the second request arrives 0.3 s after the first (open loop): sent {gap:.3f} s after it, "
        f"errors {[r.error for r in results]}")


@pytest.mark.provided
def test_the_load_generators_client_keeps_a_finished_stream_whose_connection_closes_before_its_last_chunk():
    # [DONE] has come, then the server goes (killed, or a proxy cut) before the terminating
    # zero-size chunk: the request is complete, only the connection is not reusable.
    url, thread = canned_server(KEPT_ALIVE_STREAM[:-len(b"0\r\n\r\n")])
    result = benchmark_serving.stream_completion(url, {"prompt": [1, 2], "max_tokens": 3}, HTTP_TIMEOUT)
    thread.join(HTTP_TIMEOUT)
    assert result.error is None and len(result.chunk_times) == 3, (
        f"a stream that reached data: [DONE] is a success even if its framing never ends: {result.error!r}")


@pytest.mark.provided
def test_the_load_generators_client_gives_up_at_its_timeout():
    url, thread = canned_server(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", stall=True)
    start = time.perf_counter()
    result = benchmark_serving.stream_completion(url, {"prompt": [1, 2], "max_tokens": 3}, 0.3)
    waited = time.perf_counter() - start
    thread.join(HTTP_TIMEOUT)
    assert result.error is not None and "Timeout" in result.error, f"a silent server must time out: {result.error!r}"
    assert waited < 0.3 + 0.9, (f"the client waited {waited:.1f} s on a 0.3 s timeout: once the last request "
                                f"has timed out, nothing is left to wait for")


def hand_made(send, chunks, tokens=None, error=None):
    return benchmark_serving.StreamResult(send, list(chunks), len(chunks) if tokens is None else tokens, None, error)


@pytest.mark.provided
def test_stream_metrics_follow_vllms_benchmark_definitions():
    m = benchmark_serving.stream_metrics(lab, hand_made(10.0, [10.5, 10.7, 11.0, 11.6]))
    assert m.ttft == pytest.approx(0.5), "TTFT = first chunk - send"
    assert m.e2e_latency == pytest.approx(1.6), "E2E = last chunk - send"
    assert m.tpot == pytest.approx(1.1 / 3), "TPOT = (E2E - TTFT) / (output tokens - 1)"
    assert m.itl == pytest.approx([0.2, 0.3, 0.6]), "ITL = the gaps between consecutive chunks"
    several = benchmark_serving.stream_metrics(lab, hand_made(10.0, [10.5, 10.7, 11.0, 11.6], tokens=7))
    assert several.tpot == pytest.approx(1.1 / 6), "TPOT divides by tokens, not chunks (a chunk may hold several)"
    assert math.isnan(benchmark_serving.stream_metrics(lab, hand_made(0.0, [0.3])).tpot), "one token has no TPOT"


@pytest.mark.provided
def test_summarize_load_percentiles_throughput_and_goodput():
    ttfts = [0.1, 0.2, 0.3, 0.4, 2.0]
    results = [hand_made(0.0, [t, t + 0.05 * (i + 1), t + 0.1 * (i + 1)], tokens=3) for i, t in enumerate(ttfts)]
    results.append(hand_made(0.0, [], error="HTTP 500"))
    s = benchmark_serving.summarize_load(lab, results, duration=2.0, slo_ttft=0.35, slo_tpot=0.1)
    assert (s["completed"], s["failed"], s["output_tokens"]) == (5, 1, 15), "a failed request counts only as failed"
    for p in (50, 90, 99):
        assert s[f"p{p}_ttft"] == pytest.approx(np.percentile(ttfts, p))
    tpots = [0.05 * (i + 1) for i in range(5)]  # (e2e - ttft) / 2
    assert s["p90_tpot"] == pytest.approx(np.percentile(tpots, 90))
    assert s["p50_itl"] == pytest.approx(np.percentile([g for t in tpots for g in (t, t)], 50))
    assert s["request_throughput"] == pytest.approx(2.5) and s["output_throughput"] == pytest.approx(7.5)
    # Good: TTFT <= 0.35 s and TPOT <= 0.1 s -> requests 0 and 1 (request 2 misses TPOT, 3 and 4 TTFT).
    assert s["goodput"] == pytest.approx(2 / 2.0), "goodput: requests per second that met EVERY SLO"
    no_slo = benchmark_serving.summarize_load(lab, results, 2.0)
    assert no_slo["goodput"] == s["request_throughput"], "no SLO: every request is good"


@pytest.mark.provided
def test_poisson_arrivals_have_the_offered_rate_and_exponential_gaps():
    times = datasets.poisson_arrival_times(50.0, 4000, seed=3)
    gaps = np.diff(times)
    assert times[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.06), "the mean gap is 1 / rate"
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.08), "exponential gaps: std = mean (open loop)"
    assert np.array_equal(times, datasets.poisson_arrival_times(50.0, 4000, seed=3))
    assert not datasets.poisson_arrival_times(math.inf, 5).any(), "rate inf sends everything at once"


@pytest.mark.provided
def test_find_knee_is_the_last_rate_before_p99_ttft_explodes():
    rates = [1, 2, 4, 8, 16]
    assert benchmark_serving.find_knee(rates, [0.05, 0.04, 0.06, 0.5, 3.0]) == 4
    assert benchmark_serving.find_knee(rates, [0.05, 0.05, 0.05, 0.06, 0.1]) is None
    assert benchmark_serving.find_knee(rates, [0.05, 0.05, math.nan, 0.06, 0.1]) == 2, (
        "a rate where nothing completed is past it")
    chart = benchmark_serving.format_load_chart(rates[:4], [{"p99_ttft": t, "output_throughput": 100.0 * r}
                                              for r, t in zip(rates, [0.05, 0.04, 0.06, 0.5])])
    assert "<- queueing knee" in chart.splitlines()[3] and "queueing knee: 4 req/s" in chart
    assert "says nothing of a target" in chart and "SLO knee:" not in chart, (
        f"without an SLO, the chart says what its knee is and is not:\n{chart}")


def load_summary(rate: float, met: int, sent: int = 200, p99_ttft: float = 0.05) -> dict:
    """One rate's summary: `sent` requests over `sent / rate` seconds, all completed, `met` inside the SLOs."""
    duration = sent / rate
    return {"completed": sent, "failed": 0, "duration": duration, "goodput": met / duration,
            "p99_ttft": p99_ttft, "output_throughput": 100.0 * rate}


@pytest.mark.provided
def test_the_slo_knee_is_the_last_rate_before_goodput_leaves_throughput():
    rates = [16, 32, 64, 96, 128]
    # p99 TTFT triples from 32 to 64 req/s, but every request meets the SLO up to 64: the queue
    # grew, the target held. At 96 req/s 5 of 200 (2.5%) miss: goodput has left throughput.
    summaries = [load_summary(16, 200, p99_ttft=0.012), load_summary(32, 200, p99_ttft=0.014),
                 load_summary(64, 199, p99_ttft=0.042), load_summary(96, 195, p99_ttft=0.12),
                 load_summary(128, 198, p99_ttft=0.08)]
    assert benchmark_serving.find_slo_knee(rates, summaries) == 64, "99% of requests meet the SLOs up to 64 req/s"
    assert benchmark_serving.find_knee(rates, [s["p99_ttft"] for s in summaries]) == 32
    chart = benchmark_serving.format_load_chart(rates, summaries, slo="TTFT <= 100 ms")
    assert "<- SLO knee" in chart.splitlines()[3] and "<- queueing knee" in chart.splitlines()[2], chart
    assert "SLO knee: 64 req/s" in chart and "at 96 req/s, 97.5% of requests met TTFT <= 100 ms" in chart, chart
    assert "128 req/s kept up again" in chart, f"a rate above that keeps up again is said, not hidden:\n{chart}"
    assert benchmark_serving.find_slo_knee(rates, [load_summary(r, 200) for r in rates]) is None
    assert benchmark_serving.find_slo_knee(rates, [load_summary(r, 100) for r in rates]) == 0.0, (
        "a lowest rate that already misses: no rate keeps up")


@pytest.mark.provided
def test_workload_is_deterministic_and_saved_as_vllm_custom_jsonl(tmp_path):
    requests = datasets.make_workload(lab, "sharegpt", 30, seed=1, max_model_len=128, vocab_size=64)
    assert requests == datasets.make_workload(lab, "sharegpt", 30, seed=1, max_model_len=128, vocab_size=64)
    for r in requests:
        assert 1 <= len(r.prompt_token_ids) and len(r.prompt_token_ids) + r.max_tokens <= 128
        assert max(r.prompt_token_ids) < 64 and len(r.prompt_text.split()) == len(r.prompt_token_ids)
    path = tmp_path / "workload.jsonl"
    datasets.save_workload(requests, str(path))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"prompt": r.prompt_text, "output_tokens": r.max_tokens} for r in requests], (
        "vLLM's custom dataset: one JSON object per line, a text prompt and output_tokens")


@pytest.mark.needs(5)
def test_loadtest_cli_against_the_lab_server_reports_every_request(tmp_path):
    # Vocabulary 256, so that text prompts (one-letter words) are in it too.
    model = lab.ToyTransformer(lab.ModelConfig(**MODEL_CONFIGS["bytes"]))
    engine = lab.LLMEngine(model, num_blocks=256, block_size=4, max_num_seqs=8)
    with serving.start_server(engine, lab=lab) as srv:
        proc = run_cli("loadtest", "--url", srv.url, "--qps", "40,inf", "--num-prompts", "6", "--workload", "tiny",
                       "--prompt-format", "text", "--slo-ttft-ms", "5000", "--save-workload", str(tmp_path / "w.jsonl"))
        reraise_stub(proc.stdout)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.count("6/6 done") == 2, f"every request at every rate must complete:\n{proc.stdout}"
        assert "p99 TTFT" in proc.stdout and "SLO knee" in proc.stdout and "first error" not in proc.stdout
        assert len((tmp_path / "w.jsonl").read_text().splitlines()) == 6
        lines = []
        [summary] = benchmark_serving.loadtest(lab, srv.url, [math.inf], 4, "tiny", prompt_format="token-ids",
                                               log=lines.append)
        reraise_stub("\n".join(lines))
        assert summary["completed"] == 4 and summary["output_tokens"] > 0
