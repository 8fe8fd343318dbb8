"""Latency statistics: percentiles two ways, and the summaries of a serving run, read by the
simulator, the load generator and the fleet's search.

A percentile is computed two ways here, for two questions:

- `interpolated_percentile` describes a distribution: it interpolates between the two values
  nearest the rank, as NumPy does by default and as vLLM's benchmark prints its p50, p90 and p99.
- `nearest_rank_quantile` checks a promise about requests: it is one of the values themselves,
  and "p99 <= T" by nearest rank holds exactly when at least 99% of the requests are within T.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def interpolated_percentile(values: Sequence[float], p: float) -> float:
    """The `p`-th percentile (0..100) of `values`, interpolated linearly between the two nearest
    ranks (NumPy's default, and vLLM's benchmark's); NaN when empty."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), p))


def nearest_rank(n: int, q: float) -> int:
    """The rank (1-based, at least 1) of the `q`-quantile of `n` values by nearest rank: ceil(q * n),
    rounded first so that 0.99 * 200 is 198, not 198.00000000000003."""
    return max(1, math.ceil(round(q * n, 9)))


def nearest_rank_quantile(values: Sequence[float], q: float) -> float:
    """The `q`-quantile (0..1) of `values` by nearest rank: the ceil(q * n)-th smallest value; NaN
    when empty. A service-level objective is a promise about requests ("99% of requests get their
    first token within T"), and it holds exactly when this p99 is <= T. The interpolated percentile
    can sit at or below T while fewer than 99% are within it: of 50 values, its p99 lies between
    the 49th and the 50th (0.51 of the way), so with the 50th just past T it still reads <= T,
    though only 49 of 50 (98%) are within T."""
    if len(values) == 0:
        return math.nan
    return float(sorted(values)[nearest_rank(len(values), q) - 1])


def latency_percentiles(values: Sequence[float], name: str) -> dict[str, float]:
    """mean, p50, p90 and p99 (interpolated) of `values` as {"mean_<name>": ..., "p50_<name>": ...};
    NaN when empty."""
    values = np.asarray(values, dtype=np.float64)
    stats = {"mean": np.mean, "p50": np.median, "p90": lambda x: interpolated_percentile(x, 90),
             "p99": lambda x: interpolated_percentile(x, 99)}
    return {f"{stat}_{name}": float(f(values)) if values.size else math.nan for stat, f in stats.items()}


def summarize_latencies(requests: Sequence[tuple[int, object]]) -> dict[str, float]:
    """mean, p50, p90 and p99 of TTFT, TPOT, ITL and E2E latency, named as vLLM's benchmark prints
    them, over `requests`: (output tokens, metrics) of each request served, where the metrics have
    RequestMetrics' `ttft`, `tpot`, `itl` and `e2e_latency`. TPOT counts the requests of two tokens
    or more (one token has no time per output token); ITL every gap of every request."""
    summary = latency_percentiles([m.ttft for _, m in requests], "ttft")
    summary |= latency_percentiles([m.tpot for n, m in requests if n > 1], "tpot")
    summary |= latency_percentiles([gap for _, m in requests for gap in m.itl], "itl")
    summary |= latency_percentiles([m.e2e_latency for _, m in requests], "e2e")
    return summary


def summarize_serving(outputs: Sequence, duration: float, num_preemptions: int = 0,
                      prefix_cache_hit_rate: float = 0.0) -> dict[str, float]:
    """The numbers of a serving run of the module's RequestOutputs, named as vLLM's benchmark prints
    them: the counts, output-token throughput per unit of `duration`, and `summarize_latencies` (in
    the unit of the metrics: seconds, or steps for the simulator's step clock). Rejected requests
    count as requests, not in the latencies."""
    served = [o for o in outputs if o.metrics is not None and o.output_token_ids]
    num_out = sum(len(o.output_token_ids) for o in outputs)
    summary = {"num_requests": len(outputs), "num_rejected": len(outputs) - len(served),
               "num_output_tokens": num_out, "duration": duration,
               "output_throughput": num_out / duration if duration > 0 else math.nan,
               "num_preemptions": num_preemptions, "prefix_cache_hit_rate": prefix_cache_hit_rate}
    return summary | summarize_latencies([(len(o.output_token_ids), o.metrics) for o in served])
