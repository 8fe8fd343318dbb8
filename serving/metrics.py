"""Serving metrics (vLLM: `vllm/v1/metrics/`, and its benchmark's summaries): the percentile
tables of a serving run, a Prometheus histogram, and the text exposition of the server's gauges
and counters under vLLM's names."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# vLLM's TTFT histogram uses buckets of this shape (ms to tens of seconds); these are the lab's own.
TTFT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# vLLM's finished_reason labels of vllm:request_success_total: an answer ("stop", "length"), or an abort.
FINISHED_REASONS = ("stop", "length", "abort")


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds, self.counts, self.sum, self.count = tuple(bounds), [0] * len(bounds), 0.0, 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            self.counts[i] += value <= bound
        self.sum += value
        self.count += 1


def prometheus_text(model_name: str, gauges: dict[str, float], counters: dict[str, int], ttft: Histogram,
                    finished: dict[str, int]) -> str:
    """Prometheus text under vLLM's names (prefix-cache counts are in blocks here, tokens in vLLM);
    `finished`: requests by finish reason, vllm:request_success_total's finished_reason label (as
    in vLLM, an aborted request is counted there under "abort": only stop and length are answers)."""
    label = f'model_name="{model_name}"'
    lines = []

    def metric(name: str, kind: str, text: str, value: float) -> None:
        lines.extend([f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name}{{{label}}} {value}"])

    metric("vllm:num_requests_running", "gauge", "Requests in the running batch.", gauges["running"])
    metric("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.", gauges["waiting"])
    metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage, 1 means 100 percent.", gauges["kv_usage"])
    metric("vllm:num_preemptions_total", "counter", "Preemptions by the scheduler.", gauges["preemptions"])
    metric("vllm:prefix_cache_queries_total", "counter", "Prefix-cache lookups (blocks).", gauges["queries"])
    metric("vllm:prefix_cache_hits_total", "counter", "Prefix-cache hits (blocks).", gauges["hits"])
    metric("vllm:prompt_tokens_total", "counter", "Prompt tokens of completed requests.", counters["prompt_tokens"])
    metric("vllm:generation_tokens_total", "counter", "Generated tokens, counted as they are produced.",
           counters["generation_tokens"])
    name = "vllm:request_success_total"
    lines += [f"# HELP {name} Finished requests (choices), by finish reason: abort is a request aborted before it "
              f"finished (its client left).", f"# TYPE {name} counter"]
    lines += [f'{name}{{{label},finished_reason="{reason}"}} {count}' for reason, count in finished.items()]
    name = "vllm:time_to_first_token_seconds"
    lines += [f"# HELP {name} Time to first token, from request received to token sent.", f"# TYPE {name} histogram"]
    for bound, count in zip(ttft.bounds, ttft.counts):
        lines.append(f'{name}_bucket{{{label},le="{bound}"}} {count}')
    lines += [f'{name}_bucket{{{label},le="+Inf"}} {ttft.count}',
              f"{name}_sum{{{label}}} {ttft.sum}", f"{name}_count{{{label}}} {ttft.count}"]
    return "\n".join(lines) + "\n"


def latency_percentiles(values: Sequence[float], name: str) -> dict[str, float]:
    """mean, p50, p90 and p99 of `values` as {"mean_<name>": ..., "p50_<name>": ...}; NaN when empty."""
    values = np.asarray(values, dtype=np.float64)
    stats = {"mean": np.mean, "p50": np.median, "p90": lambda x: np.percentile(x, 90),
             "p99": lambda x: np.percentile(x, 99)}
    return {f"{stat}_{name}": float(f(values)) if values.size else math.nan for stat, f in stats.items()}


def summarize_serving(outputs: Sequence, duration: float, num_preemptions: int = 0,
                      prefix_cache_hit_rate: float = 0.0) -> dict[str, float]:
    """The numbers of a serving benchmark, named as vLLM's benchmark prints them: mean, p50,
    p90 and p99 of TTFT, TPOT, ITL and E2E latency (in the unit of the metrics: seconds, or steps
    for the simulator's step clock), output-token throughput per unit of `duration`, and the
    counts. Rejected requests count as requests, not in the latencies."""
    served = [o for o in outputs if o.metrics is not None and o.output_token_ids]
    samples = {
        "ttft": [o.metrics.ttft for o in served],
        "tpot": [o.metrics.tpot for o in served if len(o.output_token_ids) > 1],
        "itl": [gap for o in served for gap in o.metrics.itl],
        "e2e": [o.metrics.e2e_latency for o in served],
    }
    num_out = sum(len(o.output_token_ids) for o in outputs)
    summary = {"num_requests": len(outputs), "num_rejected": len(outputs) - len(served),
               "num_output_tokens": num_out, "duration": duration,
               "output_throughput": num_out / duration if duration > 0 else math.nan,
               "num_preemptions": num_preemptions, "prefix_cache_hit_rate": prefix_cache_hit_rate}
    for name, values in samples.items():
        summary |= latency_percentiles(values, name)
    return summary
