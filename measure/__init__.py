"""Measuring: best-of-N timing side by side (timing.py), and latency statistics: percentiles and the
summaries of a serving run (latency.py); used by the checks, the commands, the load generator, the
simulator and the benchmarks."""
