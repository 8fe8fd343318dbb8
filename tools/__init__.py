"""What measures the lab, run from the repository's root as `python -m tools.<module>` (`python -m
tools.bench attention`). Tools stand above every package beside the chapter and import them; none
of those imports a tool.

    bench.py, bench_common.py   the benchmarks' table, and what they share
    benchmarks/                 the mechanisms measured in process (attention, decode, speculative, ...)
    server/                     the server measured over HTTP, and vLLM beside it
    fleet/                      the simulator against the served engine, and the cost model's fit
"""
