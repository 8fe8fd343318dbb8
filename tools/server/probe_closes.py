#!/usr/bin/env python3
"""Count the connections `python <module>.py serve` ends without a word: raw-socket probes on
127.0.0.1, all at once, each a kind of odd client a server can be tempted to close on silently.

A probe that sent bytes and saw its connection end (end of stream or reset) with no byte of a
response is "silent"; one still waiting after 20 s "hang"; a probe that sent nothing and was closed
when it idled out is "idle-close" (the one silent close that is right: see serving/http_server.py).
The 20 requests and 10 streams that half-close after sending are aborted (an end of stream is a
disconnect, as in vLLM) and still answered: a 400 that names the end of stream.

    python -m tools.server.probe_closes                  # against solution.py
    python -m tools.server.probe_closes --module lab     # against your lab.py
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 20.0


def post(body: bytes, version: bytes = b"1.1", extra: bytes = b"") -> bytes:
    return b"POST /v1/completions HTTP/%s\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n%s" % (version, extra,
                                                                                         len(body), body)


def chunked(body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n"
            % (extra, len(body), body))


def probes() -> list[tuple[str, list[bytes], bool, float]]:
    """(name, the pieces it sends, whether it then shuts its write side, seconds between pieces)."""
    whole = json.dumps({"prompt": "Hello there", "max_tokens": 24, "temperature": 0}).encode()
    stream = json.dumps({"prompt": "Hello there", "max_tokens": 24, "temperature": 0, "stream": True}).encode()
    chunk_of = b"80000\r\n" + b" " * 0x80000 + b"\r\n"
    found = [
        ("blank lines only", [b"\r\n"] * 5, False, 0.0),
        ("2 MB of CRLF", [b"\r\n" * (1 << 20)], False, 0.0),
        ("half a head, then silence", [b"POST /v1/completions HTTP/1.1\r\nCont"], False, 0.0),
        ("half a body, then silence", [post(whole)[:-10]], False, 0.0),
        ("half a head, then SHUT_WR", [b"GET /hea"], True, 0.0),
        ("garbage request line", [b"\x16\x03\x01 hello\r\n\r\n"], False, 0.0),
        ("a head over 16 KiB", [b"GET / HTTP/1.1\r\nX: " + b"a" * 20000], False, 0.0),
        ("Content-Length 2 MiB, sent", [b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2097152\r\n\r\n",
                                        b"x" * 2097152], False, 0.0),
        ("chunked body", [chunked(whole)], True, 0.0),
        ("chunked, Expect: 100-continue", [chunked(whole, b"Expect: 100-continue\r\n")], True, 0.0),
        ("chunked past the limit, sent", [b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"]
         + [chunk_of] * 4, False, 0.0),
        ("malformed chunk size", [b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"],
         False, 0.0),
        ("Transfer-Encoding: gzip", [b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n"], False, 0.0),
        ("two pipelined, then SHUT_WR", [post(whole) + post(whole)], True, 0.0),
        ("HTTP/1.0 stream", [post(stream, b"1.0")], False, 0.0),
        ("bad JSON, Connection: close", [post(b"{", extra=b"Connection: close\r\n")], False, 0.0),
        ("a head byte by byte", [bytes([c]) for c in b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n"], False,
         0.01),
        ("connect, send nothing", [], False, 0.0),
    ]
    found += [(f"whole request, then SHUT_WR #{i}", [post(whole)], True, 0.0) for i in range(20)]
    found += [(f"stream, then SHUT_WR #{i}", [post(stream)], True, 0.0) for i in range(10)]
    return found


def probe(port: int, name: str, pieces: list[bytes], shut: bool, pause: float) -> tuple[str, str, str]:
    """(name, verdict, the reply's status line)."""
    sent = 0
    reply = b""
    ended = "eof"
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        try:
            for piece in pieces:
                try:
                    sock.sendall(piece)
                except OSError:  # the server stopped reading: what it said tells
                    break
                sent += len(piece)
                time.sleep(pause)
            if shut:
                sock.shutdown(socket.SHUT_WR)
            for _ in range(10_000):
                data = sock.recv(65536)
                if not data:
                    break
                reply += data
        except ConnectionResetError:
            ended = "reset"
        except TimeoutError:
            ended = "hang"
    verdict = "hang" if ended == "hang" else "answered" if reply else "silent" if sent else "idle-close"
    return name, verdict, reply.split(b"\r\n", 1)[0].decode(errors="replace")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", default="solution", help="the module whose server is probed (default: solution)")
    args = parser.parse_args(argv)
    server = subprocess.Popen([sys.executable, f"{args.module}.py", "serve", "--port", "0", "--duration", "120",
                               "--max-num-seqs", "8"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        address = re.search(r"127\.0\.0\.1:(\d+)", server.stdout.readline())
        if address is None:
            print("the server did not start", file=sys.stderr)
            return 1
        port = int(address.group(1))
        cases = probes()
        start = time.monotonic()
        with ThreadPoolExecutor(len(cases)) as pool:
            results = list(pool.map(lambda case: probe(port, *case), cases))
    finally:
        server.terminate()
        server.wait(TIMEOUT_S)
    counts: dict[str, int] = {}
    for name, verdict, status in results:
        print(f"{name:34} {verdict:11} {status}")
        counts[verdict] = counts.get(verdict, 0) + 1
    print(f"{len(results)} probes in {time.monotonic() - start:.1f} s: "
          + ", ".join(f"{v} {n}" for v, n in sorted(counts.items())))
    return 1 if counts.get("silent") or counts.get("hang") else 0


if __name__ == "__main__":
    sys.exit(main())
