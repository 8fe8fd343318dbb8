"""Measuring: best-of-N timing side by side, used by the checks, the commands and the benchmarks."""
