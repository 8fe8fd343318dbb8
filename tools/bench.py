#!/usr/bin/env python3
"""Benchmarks of the lab's mechanisms, measured side by side on this machine: one file each, in
tools/benchmarks/ (bench_attention.py, bench_decode.py, ...) and tools/server/ (bench_serving.py,
bench_request_trip.py), run from this table.

    python tools/bench.py                      # all of them, on solution.py
    python tools/bench.py attention            # one: attention, decode, kv-int8, batching, speculative, serving,
                                               #   trace, events, shortcuts, request-trip, vs-transformers
                                               #   (needs torch + transformers, never a dependency)
    python tools/bench.py blas-threads         # not in "all": 1 vs 2 OpenBLAS threads; serving-threads likewise
    python tools/bench.py step-profile         # not in "all": GPT-2 124M's decode step by part, beside the floors
    python tools/bench.py vs-vllm              # not in "all": vLLM itself beside the lab (tools/server/vs_vllm.py;
                                               #   needs vLLM in a venv of its own, $VLLM_PYTHON, ~40 minutes)
    python tools/bench.py attention --module lab   # time YOUR kernel (lab.py) instead

`python solution.py bench [which]` runs this file. It imports the module it measures (never the
other way round), so the mechanisms' file holds no timing code: like nanoGPT's bench.py beside
model.py. Timings are best-of-N, measured in turns so that drift hits every contestant alike;
ratios measured in one run are what to compare, not absolute times from another machine.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "tools" / "benchmarks"), str(ROOT / "tools" / "server")]
import bench_attention  # noqa: E402
import bench_batching  # noqa: E402
import bench_blas_threads  # noqa: E402
import bench_common  # noqa: E402
import bench_decode  # noqa: E402
import bench_kv_int8  # noqa: E402
import bench_request_trip  # noqa: E402
import bench_serving  # noqa: E402
import bench_shortcuts  # noqa: E402
import bench_speculative  # noqa: E402
import bench_step_profile  # noqa: E402
import bench_trace  # noqa: E402
import bench_vs_transformers  # noqa: E402
import vs_vllm  # noqa: E402

MODULES = (bench_common, bench_attention, bench_decode, bench_kv_int8, bench_batching, bench_speculative,
           bench_serving, bench_blas_threads, bench_vs_transformers, bench_trace, bench_shortcuts,
           bench_step_profile)


def use_module(name: str, clock=time.perf_counter) -> None:
    """Measure the module `name` (imported from the repository's root), timed by `clock`."""
    lab = importlib.import_module(name)
    for module in MODULES:
        module.lab, module.clock = lab, clock


def exit_if_failed(status: int) -> None:
    """A command's exit status passed on (vs-vllm without vLLM: 2)."""
    if status:
        raise SystemExit(status)


# Each benchmark prints its lines as it measures them (progress, on a slow machine).
BENCHMARKS = {
    "attention": lambda args: bench_attention.bench_attention(log=print),
    "decode": lambda args: bench_decode.bench_decode(log=print),
    "kv-int8": lambda args: bench_kv_int8.bench_kv_int8(log=print),
    "batching": lambda args: print(bench_batching.bench_batching()),
    "speculative": lambda args: print(bench_speculative.bench_speculative()),
    "serving": lambda args: bench_serving.bench_serving(log=print),
    "trace": lambda args: bench_trace.bench_trace(log=print),
    "events": lambda args: bench_trace.bench_events(log=print),
    "shortcuts": lambda args: bench_shortcuts.bench_shortcuts(log=print),
    "request-trip": lambda args: bench_request_trip.main(["--module", args.module]),
    "vs-transformers": lambda args: bench_vs_transformers.bench_vs_transformers(log=print),
    "blas-threads": lambda args: print(bench_blas_threads.bench_blas_threads()),
    "step-profile": lambda args: bench_step_profile.bench_step_profile(log=print),
    "serving-threads": lambda args: [bench_serving.bench_serving(blas_threads=n, log=print) for n in (1, 2)],
    "vs-vllm": lambda args: exit_if_failed(vs_vllm.main(["--module", args.module])),
}

NOT_IN_ALL = ("blas-threads", "serving-threads", "step-profile", "vs-vllm")  # what-ifs and peers, each minutes long


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", nargs="?", choices=(*BENCHMARKS, "all"), default="all")
    parser.add_argument("--module", default=bench_common.DEFAULT_MODULE,
                        help="the module to measure: solution or lab (default: solution, or lab in the student's copy)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time in-process benchmarks by this process's CPU seconds, not wall time "
                             "(a shared machine; single-threaded work only)")
    args = parser.parse_args(argv)
    use_module(args.module, time.process_time if args.cpu_time else time.perf_counter)
    try:
        for name in [n for n in BENCHMARKS if n not in NOT_IN_ALL] if args.which == "all" else [args.which]:
            BENCHMARKS[name](args)
    except NotImplementedError as exc:
        parser.exit(1, f"bench: {exc} is still a stub in {args.module}.py: write it first\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
