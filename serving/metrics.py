"""Serving metrics (vLLM: `vllm/v1/metrics/`): a Prometheus histogram, the engine's per-step
counters, and the text exposition of the server's gauges and counters under vLLM's names. The
percentiles of a serving run are `measure/latency.py`'s."""

from __future__ import annotations

from collections.abc import Sequence

# vLLM's TTFT histogram uses buckets of this shape (ms to tens of seconds); these are the lab's own.
TTFT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# vLLM's buckets of vllm:iteration_tokens_total (tokens a step works on): 1, 8, then powers of two to 16384.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM's finished_reason labels of vllm:request_success_total: an answer ("stop", "length"), or an abort.
FINISHED_REASONS = ("stop", "length", "abort")


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            self.counts[i] += value <= bound
        self.sum += value
        self.count += 1


class StepCounts:
    """The engine's counters that vLLM keeps per step, with vLLM's meanings (its scheduler's prefix-cache
    stats and its IterationStats), counted from what the engine shows between steps and from its
    scheduler's SCHEDULED events (`observe`), so any correct scheduler is counted alike:

    - prefix-cache queries and hits, in tokens: a request's prompt length and the tokens its admission
      found cached, once, when it is first scheduled; a preempted request's readmission is not counted
      again (vLLM keeps those apart), nor anything while prefix caching is off;
    - tokens per step (vllm:iteration_tokens_total), for each step that produced a token: the tokens
      it generated, plus the prompt tokens computed (not cached) of each request whose prefill it
      completed, counted whole in that step however many chunks the prefill took."""

    def __init__(self, enable_prefix_caching: bool):
        self.enable_prefix_caching = enable_prefix_caching
        self.queries = self.hits = 0
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)
        self._new: dict = {}  # request id -> sequence: waiting, never scheduled, before this step
        self._scheduled: dict[str, int] = {}  # request id -> tokens scheduled in this step
        self._computed_prompt: dict[str, int] = {}  # request id -> its prompt tokens not cached, until its first token

    @classmethod
    def attached(cls, engine) -> StepCounts:
        """Counts for `engine`, told of its scheduler's events after any observer it already had."""
        counts = cls(engine.allocator.enable_prefix_caching)
        previous = engine.scheduler.observer

        def observe(event) -> None:
            if previous is not None:
                previous(event)
            counts.observe(event)
        engine.scheduler.observer = observe
        return counts

    def before_step(self, waiting) -> None:
        """Before a step: `waiting`, the scheduler's queue."""
        self._new = {s.request_id: s for s in waiting if not s.num_preemptions and not s.output_token_ids}
        self._scheduled = {}

    def observe(self, event) -> None:
        """One of the scheduler's events during the step (its SCHEDULED ones count)."""
        if event.type.value == "scheduled":
            self._scheduled[event.request_id] = event.num_tokens

    def after_step(self, new_token_ids: dict[str, int]) -> None:
        """After the step: how many tokens each request got in it. A sequence's computed tokens
        after its first step are the cached ones plus those the step ran (SequenceState's invariant)."""
        for request_id, seq in self._new.items():
            if request_id not in self._scheduled:
                continue
            prompt = len(seq.prompt_token_ids)
            cached = min(max(seq.num_computed_tokens - self._scheduled[request_id], 0), prompt)
            self._computed_prompt[request_id] = prompt - cached
            if self.enable_prefix_caching:
                self.queries += prompt
                self.hits += cached
        tokens = sum(new_token_ids.values())
        tokens += sum(self._computed_prompt.pop(r, 0) for r, n in new_token_ids.items() if n)
        if tokens:
            self.iteration_tokens.observe(tokens)
        self._new = {}


def prometheus_text(model_name: str, gauges: dict, counters: dict[str, int], ttft: Histogram,
                    finished: dict[str, int]) -> str:
    """Prometheus text under vLLM's names; `gauges` (the engine's, after its last step) includes
    "iteration_tokens", a Histogram. `finished`: requests by finish reason, vllm:request_success_total's
    finished_reason label ("abort" counts the requests whose client left before they finished; vLLM
    0.32 counts those nowhere: only stop and length are answers in both)."""
    label = f'model_name="{model_name}"'
    lines = []

    def metric(name: str, kind: str, text: str, value: float) -> None:
        lines.extend([f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name}{{{label}}} {value}"])

    def histogram(name: str, text: str, values: Histogram) -> None:
        lines.extend([f"# HELP {name} {text}", f"# TYPE {name} histogram"])
        lines.extend(f'{name}_bucket{{{label},le="{bound}"}} {count}' for bound, count in zip(values.bounds,
                                                                                             values.counts))
        lines.extend([f'{name}_bucket{{{label},le="+Inf"}} {values.count}', f"{name}_sum{{{label}}} {values.sum}",
                      f"{name}_count{{{label}}} {values.count}"])

    metric("vllm:num_requests_running", "gauge", "Requests in the running batch.", gauges["running"])
    metric("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.", gauges["waiting"])
    metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage, 1 means 100 percent.", gauges["kv_usage"])
    metric("vllm:num_preemptions_total", "counter", "Preemptions by the scheduler.", gauges["preemptions"])
    metric("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
           gauges["queries"])
    metric("vllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", gauges["hits"])
    metric("vllm:prompt_tokens_total", "counter", "Prompt tokens, counted once a prompt's prefill is done.",
           counters["prompt_tokens"])
    metric("vllm:generation_tokens_total", "counter", "Generated tokens, counted as they are produced.",
           counters["generation_tokens"])
    name = "vllm:request_success_total"
    lines += [f"# HELP {name} Finished requests (choices), by finish reason: abort is a request aborted before it "
              f"finished (its client left).", f"# TYPE {name} counter"]
    lines += [f'{name}{{{label},finished_reason="{reason}"}} {count}' for reason, count in finished.items()]
    histogram("vllm:time_to_first_token_seconds", "Time to first token, from request received to token sent.", ttft)
    histogram("vllm:iteration_tokens_total", "Tokens per engine step: generated, plus the prompt tokens computed "
              "of each prefill the step completed.", gauges["iteration_tokens"])
    return "\n".join(lines) + "\n"

