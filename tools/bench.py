"""Benchmarks of the lab's mechanisms, measured side by side on this machine: one file each, in
tools/benchmarks/ (bench_attention.py, bench_decode.py, ...) and tools/server/ (bench_serving.py,
bench_request_trip.py), run from this table.

    python -m tools.bench                      # all of them, on solution.py
    python -m tools.bench attention            # one: attention, decode, kv-int8, batching, speculative, serving,
                                               #   trace, events, shortcuts, request-trip, vs-transformers
                                               #   (needs torch + transformers, never a dependency)
    python -m tools.bench blas-threads         # not in "all": 1 vs 2 OpenBLAS threads; serving-threads likewise
    python -m tools.bench step-profile         # not in "all": GPT-2 124M's decode step by part, beside the floors
    python -m tools.bench vs-vllm              # not in "all": vLLM itself beside the lab (tools/server/vs_vllm.py;
                                               #   needs vLLM in a venv of its own, $VLLM_PYTHON, ~40 minutes)
    python -m tools.bench attention --module lab   # time YOUR kernel (lab.py) instead

`python solution.py bench [which]` runs this command. It imports the module it measures (never the
other way round) and hands it, with the clock, to each benchmark, so the mechanisms' file holds no
timing code: like nanoGPT's bench.py beside model.py. Timings are best-of-N, measured in turns so
that drift hits every contestant alike (measure/timing.py); ratios measured in one run are what to
compare, not absolute times from another machine.
"""

from __future__ import annotations

import argparse
import importlib
import time

from tools.bench_common import DEFAULT_MODULE, description, with_one_blas_thread
from tools.benchmarks import (
    bench_attention,
    bench_batching,
    bench_blas_threads,
    bench_decode,
    bench_kv_int8,
    bench_shortcuts,
    bench_speculative,
    bench_step_profile,
    bench_trace,
    bench_vs_transformers,
)
from tools.server import bench_request_trip, bench_serving, vs_vllm


def exit_if_failed(status: int) -> None:
    """A command's exit status passed on (vs-vllm without vLLM: 2)."""
    if status:
        raise SystemExit(status)


# Each benchmark, handed the module measured (`lab`) and the clock, prints its lines as it measures
# them (progress, on a slow machine).
BENCHMARKS = {
    "attention": lambda lab, clock, args: bench_attention.bench_attention(lab, log=print, clock=clock),
    "decode": lambda lab, clock, args: bench_decode.bench_decode(lab, log=print, clock=clock),
    "kv-int8": lambda lab, clock, args: bench_kv_int8.bench_kv_int8(lab, log=print),
    "batching": lambda lab, clock, args: print(bench_batching.bench_batching(lab)),
    "speculative": lambda lab, clock, args: print(bench_speculative.bench_speculative(lab, clock=clock)),
    "serving": lambda lab, clock, args: bench_serving.bench_serving(lab, log=print),
    "trace": lambda lab, clock, args: bench_trace.bench_trace(lab, log=print, clock=clock),
    "events": lambda lab, clock, args: bench_trace.bench_events(lab, log=print, clock=clock),
    "shortcuts": lambda lab, clock, args: bench_shortcuts.bench_shortcuts(lab, log=print, clock=clock),
    "request-trip": lambda lab, clock, args: bench_request_trip.main(["--module", args.module]),
    "vs-transformers": lambda lab, clock, args: bench_vs_transformers.bench_vs_transformers(lab, log=print,
                                                                                             clock=clock),
    "blas-threads": lambda lab, clock, args: print(bench_blas_threads.bench_blas_threads(lab)),
    "step-profile": lambda lab, clock, args: bench_step_profile.bench_step_profile(lab, log=print, clock=clock),
    "serving-threads": lambda lab, clock, args: [bench_serving.bench_serving(lab, blas_threads=n, log=print)
                                                 for n in (1, 2)],
    "vs-vllm": lambda lab, clock, args: exit_if_failed(vs_vllm.main(["--module", args.module])),
}

NOT_IN_ALL = ("blas-threads", "serving-threads", "step-profile", "vs-vllm")  # what-ifs and peers, each minutes long


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench", description=description(__doc__))
    parser.add_argument("which", nargs="?", choices=(*BENCHMARKS, "all"), default="all")
    parser.add_argument("--module", default=DEFAULT_MODULE,
                        help="the module to measure: solution or lab (default: solution, or lab in the student's copy)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time in-process benchmarks by this process's CPU seconds, not wall time "
                             "(a shared machine; single-threaded work only)")
    args = parser.parse_args(argv)
    if args.which == "step-profile":
        with_one_blas_thread()  # the step as `serve` runs it: OpenBLAS on one thread, the model's own beside it
    lab = importlib.import_module(args.module)
    clock = time.process_time if args.cpu_time else time.perf_counter
    try:
        for name in [n for n in BENCHMARKS if n not in NOT_IN_ALL] if args.which == "all" else [args.which]:
            BENCHMARKS[name](lab, clock, args)
    except NotImplementedError as exc:
        parser.exit(1, f"bench: {exc} is still a stub in {args.module}.py: write it first\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
