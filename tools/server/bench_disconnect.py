#!/usr/bin/env python3
"""What clients that give up cost the server: clients that behave as the OpenAI SDK does by
default (a timeout, 2 retries with its backoff), each asking for more tokens than it waits for.

    python -m tools.server.bench_disconnect                    # this checkout's server
    python -m tools.server.bench_disconnect --against main     # and that revision's, side by side

Each of 8 clients sends a non-streamed `POST /v1/completions` (max_tokens 480) and waits 0.3 s
for the answer; at the timeout it closes its connection (the SDK's HTTP client drops a timed-out
connection), sleeps the SDK's backoff (0.5 s, then 1 s, each less up to 25% of jitter, seeded here)
and tries again: 3 attempts each, 24 in all, none of which can finish in time. The server is
`python solution.py serve`'s (its toy GPT-2 and engine), started in-process by a worker in a child
process, one per revision measured, so that the engine's own outputs are counted:

- tokens run: the tokens the engine generated for the 24 attempts (480 each if nothing aborts);
- in the engine at give-up: requests running or waiting when the last client gave up;
- answers read: responses the clients received (0: every attempt times out);
- vllm:request_success_total after the engine has drained: its answers (finished_reason stop or
  length, or the unlabelled counter of a server that has no label) and its aborts.

A revision is measured from `git archive REV` in a temporary folder (its solution.py and serving/),
by this file's worker. The counts are what to compare; the tokens run depend on the machine's step
time (a slower step runs fewer tokens in 0.3 s).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tools.bench_common import ROOT, blas_env, tree_at

CLIENTS = 8
ATTEMPTS = 3
TIMEOUT_S = 0.3
MAX_TOKENS = 480
# the OpenAI SDK's backoff: 0.5 s, doubling, jittered, up to 8 s
INITIAL_RETRY_DELAY_S = 0.5
MAX_RETRY_DELAY_S = 8.0
DRAIN_TIMEOUT_S = 120.0


def backoff(retry: int, rng: random.Random) -> float:
    """The SDK's sleep before retry `retry` (0, 1, ...): 0.5 s doubling, up to 8 s, less up to 25%."""
    return min(INITIAL_RETRY_DELAY_S * 2.0 ** retry, MAX_RETRY_DELAY_S) * (1 - 0.25 * rng.random())


def client(port: int, body: bytes, seed: int, gave_up: list, answers: list, engine) -> None:
    """One SDK-like client: ATTEMPTS attempts of TIMEOUT_S each; records what the engine holds when it gives up."""
    rng = random.Random(seed)
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    request += b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    for attempt in range(ATTEMPTS):
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
            sock.sendall(request)
            try:
                reply = sock.recv(65536)
                answers.append(reply.split(b"\r\n", 1)[0].decode(errors="replace"))
                return
            except TimeoutError:
                pass  # the connection closes here, as the SDK's does: a FIN with nothing unread
        if attempt + 1 < ATTEMPTS:
            time.sleep(backoff(attempt, rng))
    scheduler = engine.scheduler
    gave_up.append((time.monotonic(), len(scheduler.running) + len(scheduler.waiting)))


def success_counts(metrics: str) -> tuple[float, float]:
    """(answers, aborts) from vllm:request_success_total: the samples labelled stop or length (or
    one without a finished_reason label: a server that counts only completions), and abort."""
    answers = aborts = 0.0
    for labels, value in re.findall(r"^vllm:request_success_total\{([^}]*)\} (\S+)$", metrics, re.M):
        reason = re.search(r'finished_reason="([^"]*)"', labels)
        if reason and reason.group(1) == "abort":
            aborts += float(value)
        elif reason is None or reason.group(1) in ("stop", "length"):
            answers += float(value)
    return answers, aborts


def worker(seed: int, serve_model: dict) -> dict:
    """In a child process started in the tree measured, whose `solution` and `serving` it imports
    (`python -m` imports from the working directory first): serve `serve_model` (this checkout's
    `serve` model, the same for every tree), run the clients, count."""
    import http.client

    import serving
    import solution as lab

    model = lab.ToyTransformer(lab.ModelConfig(**serve_model), seed=0)
    engine = lab.LLMEngine(model, max_num_seqs=64, block_size=16, max_num_batched_tokens=512)
    step = engine.step
    run = {"tokens": 0, "finished": {}}

    def counted_step():
        outputs = step()
        for out in outputs:
            run["tokens"] += len(out.new_token_ids)
            if out.finished:
                run["finished"][out.finish_reason] = run["finished"].get(out.finish_reason, 0) + 1
        return outputs

    engine.step = counted_step
    body = json.dumps({"prompt": "Hello there", "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    gave_up, answers = [], []
    with serving.start_server(engine) as server:
        start = time.monotonic()
        threads = [threading.Thread(target=client, args=(server.port, body, seed + i, gave_up, answers, engine))
                   for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        last = max(gave_up, default=(time.monotonic(), 0))
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.02)
        drained = time.monotonic() - start
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/metrics")
        metrics = conn.getresponse().read().decode()
        conn.close()
    successes, aborts = success_counts(metrics)
    return {"attempts": CLIENTS * ATTEMPTS, "tokens": run["tokens"], "finished": run["finished"],
            "in_engine_at_give_up": last[1], "gave_up_s": round(last[0] - start, 2), "drained_s": round(drained, 2),
            "answers_read": len(answers), "success_total": successes, "abort_total": aborts,
            "still_running": engine.has_unfinished()}


def measure(root: Path, seed: int) -> dict:
    """One run of the worker on the tree at `root`, in a child process (one OpenBLAS thread, as `serve`)."""
    from course.commands import SERVE_MODEL

    # This file's package comes from the checkout (PYTHONPATH) where the tree's tools/ is no package.
    env = blas_env(1) | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tools.server.bench_disconnect", "--worker", "--seed", str(seed),
                           "--serve-model", json.dumps(SERVE_MODEL)],
                          cwd=root, capture_output=True, text=True, env=env, timeout=DRAIN_TIMEOUT_S + 60)
    if proc.returncode != 0:
        raise RuntimeError(f"the worker on {root} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REV", help="also measure the server of this git revision")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each, in turns (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="of the clients' jitter")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-model", type=json.loads, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.seed, args.serve_model)))
        return 0
    trees = {"this checkout": ROOT}
    if args.against:
        trees = {args.against: tree_at(args.against), **trees}
    print(f"{CLIENTS} clients, non-streamed, max_tokens {MAX_TOKENS}, as the OpenAI SDK: {TIMEOUT_S} s timeout, "
          f"{ATTEMPTS - 1} retries ({INITIAL_RETRY_DELAY_S:g} s backoff doubling, jittered): "
          f"{CLIENTS * ATTEMPTS} attempts")
    print(f"{'server':<16}{'tokens run':>12}{'of asked':>10}{'in engine at give-up':>22}{'answers read':>14}"
          f"{'success (stop+length)':>23}{'abort':>7}{'drained':>9}")
    failed = False
    for _ in range(args.repeats):
        for name, root in trees.items():
            got = measure(root, args.seed)
            asked = got["attempts"] * MAX_TOKENS
            print(f"{name:<16}{got['tokens']:>12,}{got['tokens'] / asked:>10.0%}{got['in_engine_at_give_up']:>22}"
                  f"{got['answers_read']:>14}{got['success_total']:>23g}{got['abort_total']:>7g}"
                  f"{got['drained_s']:>8.1f}s", flush=True)
            # The outputs checked first: every attempt timed out, and the engine drained.
            if got["answers_read"] or got["still_running"]:
                print(f"  not a valid run: {got['answers_read']} attempts answered within {TIMEOUT_S} s, "
                      f"engine still running: {got['still_running']}")
                failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
