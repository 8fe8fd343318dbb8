"""An open-loop load generator for any OpenAI-compatible server (vLLM: `vllm/benchmarks/serve.py`,
formerly `benchmarks/benchmark_serving.py`).

Open loop: each request is sent at its arrival time whether or not earlier ones finished, as
users do. (A closed loop, "send the next when one returns", can never offer more than the
server handles, so it cannot show the knee.) Each request's latencies come from the arrival
times of its streamed chunks, as in vLLM's benchmark:
  TTFT = first chunk - send;  E2E = last chunk - send;
  TPOT = (E2E - TTFT) / (output tokens - 1);  ITL = the gaps between consecutive chunks.
The formulas' one home is the chapter's `RequestMetrics.from_times`; the module is handed in.
The client is a plain HTTP/1.1 client on a socket (`_Response`), one thread per request, every
read under a deadline, so the same command measures this lab's server and a vLLM deployment. Not
the standard library's http.client: on the project's VM it added 0.5-1 ms to each TTFT against a
bare socket (this client 0.3-0.4 ms), time a TTFT of a few milliseconds counts as the server's.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import math
import socket
import threading
import time
import urllib.parse
from collections.abc import Sequence
from types import ModuleType

import numpy as np

from .datasets import WorkloadRequest, make_workload, poisson_arrival_times, save_workload
from .metrics import latency_percentiles

MAX_RESPONSE_BYTES = 1 << 20  # one response line or body; a longer one is not a completion stream


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
    summary |= latency_percentiles([m.ttft for _, m in metrics], "ttft")
    summary |= latency_percentiles([m.tpot for r, m in metrics if r.num_output_tokens > 1], "tpot")
    summary |= latency_percentiles([gap for _, m in metrics for gap in m.itl], "itl")
    summary |= latency_percentiles([m.e2e_latency for _, m in metrics], "e2e")
    return summary


def find_knee(rates: Sequence[float], p99_ttfts: Sequence[float], factor: float = 3.0) -> float | None:
    """The highest offered rate before p99 TTFT first exceeds `factor` times its lowest value
    (there the queue starts to grow: past it TTFT is waiting, not work); None if it never does
    in the rates tried. `rates` ascending."""
    base = min((t for t in p99_ttfts if t == t), default=math.nan)  # t == t: not NaN
    for i in range(1, len(rates)):
        if not p99_ttfts[i] <= factor * base:  # NaN (nothing completed) counts as past the knee
            return rates[i - 1]
    return None


def _bar(value: float, top: float, width: int) -> str:
    filled = 0 if not (top > 0 and value > 0) else max(1, round(width * min(value, top) / top))
    return "#" * filled + " " * (width - filled)


def format_load_chart(rates: Sequence[float], summaries: Sequence[dict], width: int = 30) -> str:
    """p99 TTFT and output throughput against the offered rate, as bars, with the knee marked."""
    ttfts = [s["p99_ttft"] * 1e3 for s in summaries]
    tputs = [s["output_throughput"] for s in summaries]
    knee = find_knee(rates, ttfts)
    top_ttft = max((t for t in ttfts if t == t), default=0.0)
    top_tput = max((t for t in tputs if t == t), default=0.0)
    lines = [f"{'offered':>9} | {'p99 TTFT (ms)':<{width + 9}} | {'output tokens/s':<{width + 8}}"]
    for rate, ttft, tput in zip(rates, ttfts, tputs):
        mark = "  <- knee" if rate == knee else ""
        lines.append(f"{rate:>5g} r/s | {_bar(ttft, top_ttft, width)} {ttft:8.1f} | "
                     f"{_bar(tput, top_tput, width)} {tput:7.0f}{mark}")
    lines.append(f"knee: {knee:g} req/s (p99 TTFT more than triples past it)" if knee is not None else
                 "knee: not reached (p99 TTFT stays within 3x of its lowest): offer higher rates")
    return "\n".join(lines)


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


class _Response:
    """One HTTP/1.1 response read from `sock`, every read before `deadline` (perf_counter
    seconds): the status and headers, then the body as lines, with the chunked transfer
    encoding undone. The body ends where the headers say: the last chunk, Content-Length
    bytes, or (neither given) the server closing the connection."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline, self.buffer = sock, deadline, bytearray()

    def head(self) -> tuple[int, dict[str, str]]:
        status_line, *lines = self._through(b"\r\n\r\n").decode("latin-1").split("\r\n")
        version, _, rest = status_line.partition(" ")
        if not version.startswith("HTTP/") or not rest[:3].isdigit():
            raise ValueError(f"not an HTTP response: {status_line[:80]!r}")
        self.headers = {name.strip().lower(): value.strip()
                        for name, _, value in (line.partition(":") for line in lines)}
        return int(rest[:3]), self.headers

    def lines(self):
        """The body's lines, each with its b"\\n" (the last one may have none)."""
        pending = b""
        for piece in self._body():
            pending += piece
            *lines, pending = pending.split(b"\n")
            yield from (line + b"\n" for line in lines)
            if len(pending) > MAX_RESPONSE_BYTES:
                raise ValueError(f"a response line is over {MAX_RESPONSE_BYTES} bytes")
        if pending:
            yield pending

    def _body(self):
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int(self._through(b"\r\n").split(b";")[0], 16):  # the last chunk has size 0
                yield self._exactly(size)
                self._exactly(2)  # the chunk's CRLF
        elif "content-length" in self.headers:
            yield self._exactly(int(self.headers["content-length"]))
        else:
            while self.buffer or self._fill():
                yield bytes(self.buffer)
                self.buffer.clear()

    def _fill(self) -> bool:
        """Wait for more bytes; False at the end of the stream."""
        left = self.deadline - time.perf_counter()
        if left <= 0:
            raise TimeoutError("the response took longer than the timeout")
        self.sock.settimeout(left)
        data = self.sock.recv(65536)
        self.buffer += data
        return bool(data)

    def _through(self, end: bytes) -> bytes:
        """The bytes before `end`; `end` is consumed too."""
        while (at := self.buffer.find(end)) < 0:
            if len(self.buffer) > MAX_RESPONSE_BYTES:
                raise ValueError(f"a response line is over {MAX_RESPONSE_BYTES} bytes")
            if not self._fill():
                raise ConnectionError("the server closed the connection mid-response")
        data = bytes(self.buffer[:at])
        del self.buffer[:at + len(end)]
        return data

    def _exactly(self, n: int) -> bytes:
        if n > MAX_RESPONSE_BYTES:  # a chunk or body this client would hold in memory whole
            raise ValueError(f"a response chunk of {n} bytes is over the limit of {MAX_RESPONSE_BYTES}")
        while len(self.buffer) < n:
            if not self._fill():
                raise ConnectionError("the server closed the connection mid-response")
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data


def stream_completion(url: str, payload: dict, timeout: float) -> StreamResult:
    """POST one streaming completion and time its chunks. Never raises for a failed request:
    the error is in `.error`. Bounded: at most max_tokens + 16 events, `timeout` seconds in all."""
    parts = urllib.parse.urlsplit(url)
    result = StreamResult(send_time=time.perf_counter())
    deadline = result.send_time + timeout
    body = json.dumps(payload).encode()
    request = (f"POST {parts.path.rstrip('/')}/v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    try:
        with socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(request.encode("latin-1") + body)
            response = _Response(sock, deadline)
            status, _ = response.head()
            lines = response.lines()
            if status != 200:
                text = b"".join(line for _, line in zip(range(64), lines))[:4096]
                result.error = f"HTTP {status}: {text.decode(errors='replace')}"
                return result
            for _, line in zip(range(2 * (payload.get("max_tokens") or 16) + 32), lines):  # events and blank lines
                if _read_event(line.strip(), result):
                    return result
        result.error = result.error or "the stream ended without data: [DONE]"
    except (OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _read_event(line: bytes, result: StreamResult) -> bool:
    """Record one server-sent event line; True at `data: [DONE]`."""
    if not line.startswith(b"data:"):
        return False
    data = line[5:].strip()
    if data == b"[DONE]":
        return True
    event = json.loads(data)
    if "error" in event:
        result.error = json.dumps(event["error"])
    if event.get("choices"):
        result.chunk_times.append(time.perf_counter())
        result.num_output_tokens += len(event["choices"][0].get("token_ids") or [None])
    if event.get("usage"):  # the count the server reports wins (a chunk may hold several tokens)
        result.num_output_tokens = event["usage"].get("completion_tokens", result.num_output_tokens)
        result.num_prompt_tokens = event["usage"].get("prompt_tokens")
    return False


def completion_payload(request: WorkloadRequest, model: str, prompt_format: str = "token-ids") -> dict:
    """The body the load generator sends: greedy, streamed, usage at the end, and `ignore_eos` so
    that a real model produces exactly `max_tokens` tokens (vLLM's benchmark does the same)."""
    prompt = request.prompt_token_ids if prompt_format == "token-ids" else request.prompt_text
    return {"model": model, "prompt": prompt, "max_tokens": request.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


def run_load(url: str, payloads: Sequence[dict], rate: float, seed: int = 0,
             timeout: float = 300.0) -> tuple[list[StreamResult], float]:
    """Send `payloads` open-loop at Poisson `rate` (req/s), each on its own thread; wait for all
    (at most `timeout` after the last send). Returns the results in order and the duration from
    the first send to the last chunk."""
    arrivals = poisson_arrival_times(rate, len(payloads), seed)
    results: list[StreamResult | None] = [None] * len(payloads)

    def send(i: int) -> None:
        results[i] = stream_completion(url, payloads[i], timeout)

    threads, start = [], time.perf_counter()
    for i, at in enumerate(arrivals):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        threads.append(threading.Thread(target=send, args=(i,), daemon=True))
        threads[-1].start()
    deadline = time.perf_counter() + timeout + 5.0
    for thread in threads:
        thread.join(max(0.0, deadline - time.perf_counter()))
    # A new list: a thread still running past the deadline writes into `results`, not into this.
    done = [r or StreamResult(start, error="no answer within the timeout") for r in results]
    end = max((r.chunk_times[-1] for r in done if r.chunk_times), default=start)
    return done, end - start


def loadtest(lab: ModuleType, url: str, rates: Sequence[float], num_prompts: int,
             workload: str = "sharegpt", seed: int = 0, prompt_format: str = "token-ids", model: str | None = None,
             max_model_len: int | None = None,
             slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
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
    summaries, first_error = [], None
    for rate in rates:
        results, duration = run_load(url, payloads, rate, seed, timeout)
        summaries.append(summarize_load(lab, results, duration, None if slo_ttft_ms is None else slo_ttft_ms / 1e3,
                                        None if slo_tpot_ms is None else slo_tpot_ms / 1e3))
        first_error = first_error or next((r.error for r in results if r.error), None)
        log(f"  rate {rate:g} req/s: {summaries[-1]['completed']}/{num_prompts} done in {duration:.1f} s")
    slo = ", ".join(f"{k} <= {v:g} ms" for k, v in (("TTFT", slo_ttft_ms), ("TPOT", slo_tpot_ms)) if v is not None)
    log(format_load_table(rates, summaries))
    log(f"goodput: requests per second meeting {slo or 'no SLO (give --slo-ttft-ms / --slo-tpot-ms)'}")
    log(format_load_chart(rates, summaries))
    if first_error:
        log(f"first error: {first_error}")
    return summaries
