"""`python -m tools.bench serving` (and `serving-threads`): the HTTP server under load, in a child process."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from types import ModuleType

import numpy as np

from checkpoints.tokenizer import ByteTokenizer
from course import commands
from loadtest import benchmark_serving, datasets
from serving import api_server, protocol
from tools.bench_common import ROOT, blas_env

# A server in a child process, as `python solution.py serve` runs one, with the front end in a
# process of its own (what `serve` does) or in a thread of the engine's process (the simpler design
# it is measured against: the two then take turns on one interpreter lock). Run with the checkout
# as its working directory, where `python -c` imports from.
_SERVE_PROBE = """
import json, sys
lab = __import__(sys.argv[1])
from serving import api_server
api_server.FRONTEND_PROCESS = sys.argv[2] == "process"
api_server.serve(lab.LLMEngine(lab.ToyTransformer(lab.ModelConfig(**json.loads(sys.argv[3])))), port=0,
                 stream_interval=int(sys.argv[4]))
"""


def _serve_in_subprocess(lab: ModuleType, config: dict, frontend: str = "process", blas_threads: int | None = 1,
                         stream_interval: int = 1) -> tuple[subprocess.Popen, str]:
    """A server of the module `lab` for a model of `config` in a child process, and its URL."""
    proc = subprocess.Popen([sys.executable, "-c", _SERVE_PROBE, lab.__name__, frontend,
                             json.dumps(config), str(stream_interval)], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env=blas_env(blas_threads))
    found = re.search(r"http://\S+", proc.stdout.readline())  # its first line, or "" if it died
    if not found:
        proc.kill()
        raise RuntimeError("the server process did not start")
    return proc, found.group(0)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(api_server.SHUTDOWN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()


def _health_round_trip(url: str) -> float:
    """Seconds from sending a `GET /health` on a kept-alive connection (its second request) to
    the end of the answer: what any request pays for the HTTP layer before it reaches the engine."""
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10.0) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(2):
            start = time.perf_counter()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            while not reply.endswith(b"\r\n\r\n"):  # a head with Content-Length: 0, nothing after it
                data = sock.recv(4096)
                if not data:
                    raise RuntimeError(f"/health: the connection closed after {reply!r}")
                reply += data
            if not reply.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"/health answered {reply[:60]!r}")
    return time.perf_counter() - start


def _parse_time(lab: ModuleType, config: dict, payloads: list[dict]) -> float:
    """Median seconds the front end spends parsing and checking one of `payloads` (in this process)."""
    served = protocol.ServedModel(lab, lab.ModelConfig(**config), ByteTokenizer(config["vocab_size"]), ("bench",),
                                  max_n=1)
    bodies = [json.dumps(p).encode() for p in payloads]
    times = []
    for body in bodies * 4:
        start = time.perf_counter()
        protocol.parse_completion_request(served, body)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


STREAM_INTERVAL = 8  # `serve --stream-interval`: tokens per streamed chunk, for the third server


SERVING_MODELS = {"the server's default": {}, "n_embd 256 x 4 layers": {"n_embd": 256, "n_layer": 4}}


def bench_serving(lab: ModuleType, num_prompts: int = 64, workload: str = "alpaca", num_alone: int = 16,
                  repeats: int = 5, blas_threads: int | None = 1, log=print) -> None:
    """`python -m tools.bench serving`: for each model of the module `lab`, the same requests (a) offline through
    `generate`, (b) through a server whose front end has a process of its own (what `serve`
    runs), (c) through one whose front end is a thread of the engine's process and (d) through
    (b) streaming STREAM_INTERVAL tokens to a chunk, all sent at once (saturation) from this
    process's load generator, in turns, best of `repeats` each; then, for each model, requests
    one at a time on a kept-alive connection (and on new ones), for the TTFT the server (b) adds
    (medians), against one decode step."""
    log(f"== Serving over HTTP: {num_prompts} {workload} requests, all sent at once; servers in child processes "
        f"with OPENBLAS_NUM_THREADS={blas_env(blas_threads).get('OPENBLAS_NUM_THREADS', 'unset')}, this process "
        f"{os.environ.get('OPENBLAS_NUM_THREADS', 'unset')} ==")
    log(f"{'model':24s} {'offline tok/s':>14s} {'own process':>18s} {'thread':>18s} "
        f"{f'own, interval {STREAM_INTERVAL}':>18s}")
    lone = {}  # model name -> (engine TTFT, served TTFT, decode step, /health round trip, parse), medians
    for name, changes in SERVING_MODELS.items():
        config = dict(commands.SERVE_MODEL, **changes)
        model = lab.ToyTransformer(lab.ModelConfig(**config))
        requests = datasets.make_workload(lab, workload, num_prompts, 0, model.config.n_positions,
                                          model.config.vocab_size)
        servers = {frontend: _serve_in_subprocess(lab, config, frontend, blas_threads)
                   for frontend in ("process", "thread")}
        servers["interval"] = _serve_in_subprocess(lab, config, "process", blas_threads, STREAM_INTERVAL)
        try:
            offline, served = _saturation(lab, model, requests, {f: url for f, (_, url) in servers.items()}, repeats)
            lone[name] = _lone_requests(lab, model, config, requests, servers["process"][1], num_alone)
        finally:
            for proc, _ in servers.values():
                _stop(proc)
        log(f"{name:24s} {offline:14.0f} " + " ".join(
            f"{served[f]:8.0f} = {served[f] / offline:4.0%}  " for f in ("process", "thread", "interval")))
    for name, (ttft_offline, ttft_served, ttft_fresh, step, health, parse) in lone.items():
        added = ttft_served - ttft_offline
        log(f"TTFT of a lone request, {name} (own-process front end): engine {ttft_offline * 1e3:.2f} ms, "
            f"through the server {ttft_served * 1e3:.2f} ms on a kept-alive connection (on a new one "
            f"{ttft_fresh * 1e3:.2f} ms): the server adds {added * 1e3:.2f} ms, {added / step:.1f} decode steps "
            f"(one: {step * 1e3:.2f} ms); of which the HTTP layer (a GET /health) {health * 1e3:.2f} ms, parsing "
            f"and checking {parse * 1e3:.2f} ms, the rest (two hops between the processes, the first chunk, the "
            f"client reading it) {(added - health - parse) * 1e3:.2f} ms")


def _saturation(lab: ModuleType, model, requests: list, urls: dict[str, str],
                repeats: int) -> tuple[float, dict[str, float]]:
    """The same requests offline through `generate` and sent all at once to each server, in
    turns so that a noisy moment of the machine hits all of them; the best output tokens/s of
    each (offline, {server: tokens/s}), every request checked completed first."""
    sampling = [lab.SamplingParams(max_tokens=r.max_tokens) for r in requests]
    num_tokens = sum(r.max_tokens for r in requests)
    payloads = [benchmark_serving.completion_payload(r, "") for r in requests]
    offline = 0.0
    served = {frontend: 0.0 for frontend in urls}
    for _ in range(repeats):
        start = time.perf_counter()
        lab.LLMEngine(model).generate([r.prompt_token_ids for r in requests], sampling)
        offline = max(offline, num_tokens / (time.perf_counter() - start))
        for frontend, url in urls.items():
            load = benchmark_serving.run_load(url, payloads, math.inf)
            summary = benchmark_serving.summarize_load(lab, *load)
            if summary["completed"] != len(requests):
                raise RuntimeError(f"{frontend}: {summary['completed']}/{len(requests)} requests completed")
            served[frontend] = max(served[frontend], summary["output_throughput"])
    return offline, served


def _lone_requests(lab: ModuleType, model, config: dict, requests: list, url: str, num_alone: int) -> tuple[float, ...]:
    """Requests one at a time, through a warm engine and through the server at `url` (on a
    kept-alive connection and on new ones): the medians of (engine TTFT, served TTFT, served TTFT
    on a new connection, decode step, /health round trip, parsing a request)."""
    sampling = [lab.SamplingParams(max_tokens=r.max_tokens) for r in requests]
    payloads = [benchmark_serving.completion_payload(r, "") for r in requests]
    # A warm engine, as the server's is after the loads: a fresh engine's first request
    # took 0.5-1.5 ms longer to its first token than its second on this VM.
    engine = lab.LLMEngine(model)
    engine.generate([r.prompt_token_ids for r in requests], sampling)
    alone = [engine.generate([r.prompt_token_ids], [s])[0].metrics
             for r, s in zip(requests[:num_alone], sampling)]
    with benchmark_serving.LoadClient(url, 60.0) as client:  # kept alive, as vLLM's benchmark
        client.run(payloads[:1])  # which also sends a test request first
        kept = [client.run([p])[0] for p in payloads[:num_alone]]
    fresh = [benchmark_serving.stream_completion(url, p, 60.0) for p in payloads[:num_alone]]
    if failed := [r.error for r in kept + fresh if not r.ok]:  # check the outputs before timing them
        raise RuntimeError(f"{len(failed)} lone requests failed, the first: {failed[0]}")
    health = [_health_round_trip(url) for _ in range(num_alone)]
    return tuple(float(np.median(x)) for x in (
        [m.ttft for m in alone], [benchmark_serving.stream_metrics(lab, r).ttft for r in kept],
        [benchmark_serving.stream_metrics(lab, r).ttft for r in fresh], [g for m in alone for g in m.itl],
        health)) + (_parse_time(lab, config, payloads[:num_alone]),)
