"""Synthetic traffic: request lengths drawn to a trace's reported means, load-test workloads.

vLLM keeps the same job in `vllm/benchmarks/datasets.py`. The means themselves (`SHAREGPT`,
`ALPACA`) live in the chapter's section 5, beside the capacity planner that uses them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from types import ModuleType

import numpy as np

# ASSUMPTION, not from the paper: lengths are lognormal with this shape (right-skewed with
# a long tail, like Fig. 11's histograms), its location set so the mean matches the paper.
LENGTH_SIGMA = 1.0


def sample_request_lengths(lab: ModuleType, stats, num_requests: int, seed: int = 0,
                           max_model_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_lens, output_lens), int64 arrays of `num_requests` lengths >= 1, drawn
    independently from lognormals (sigma LENGTH_SIGMA) whose means are the reported ones.
    Deterministic for a seed. With `max_model_len`, a request longer than it is truncated
    (prompt first kept, output cut) as the paper truncates ShareGPT to the model's context."""
    lab.check_int("num_requests", num_requests, minimum=1)
    rng = np.random.default_rng(seed)

    def draw(mean: float) -> np.ndarray:
        mu = math.log(mean) - LENGTH_SIGMA**2 / 2  # E[lognormal] = exp(mu + sigma^2 / 2)
        return np.maximum(1, np.rint(rng.lognormal(mu, LENGTH_SIGMA, num_requests))).astype(np.int64)

    prompts, outputs = draw(stats.mean_prompt_len), draw(stats.mean_output_len)
    if max_model_len is not None:
        lab.check_int("max_model_len", max_model_len, minimum=1)
        if max_model_len < 2:
            raise ValueError(f"max_model_len must leave room for a prompt and an output token, got {max_model_len}")
        prompts = np.minimum(prompts, max_model_len - 1)
        outputs = np.minimum(outputs, max_model_len - prompts)
    return prompts, outputs


LOAD_WORKLOADS = ("sharegpt", "alpaca", "tiny")


def workload_stats(lab: ModuleType, name: str):
    """The `lab.LengthStats` of a load-test workload: the paper's ShareGPT or Alpaca means, or a tiny smoke test."""
    stats = {"sharegpt": lab.SHAREGPT, "alpaca": lab.ALPACA, "tiny": lab.LengthStats("tiny", 8.0, 8.0, "a smoke test")}
    if name not in stats:
        raise ValueError(f"workload must be one of {', '.join(LOAD_WORKLOADS)}, got {name!r}")
    return stats[name]


# In a text prompt every token is a one-letter word: one token each for the BPE tokenizers of
# GPT-2 or Llama ("▁q"), two bytes each for the lab's byte tokenizer.
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclasses.dataclass(frozen=True)
class WorkloadRequest:
    """One request of a synthetic workload: its prompt in both forms, and its output length."""

    prompt_token_ids: list[int]
    prompt_text: str
    max_tokens: int


def make_workload(lab: ModuleType, name: str, num_prompts: int, seed: int = 0, max_model_len: int = 2048,
                  vocab_size: int = 256) -> list[WorkloadRequest]:
    """`num_prompts` requests with lengths from `sample_request_lengths` of the workload's means
    (prompt + output within `max_model_len`); random token ids below `vocab_size`. Deterministic."""
    stats = workload_stats(lab, name)
    prompt_lens, output_lens = sample_request_lengths(lab, stats, num_prompts, seed, max_model_len)
    rng = np.random.default_rng(seed + 1)
    requests = []
    for n_in, n_out in zip(prompt_lens.tolist(), output_lens.tolist()):
        ids = rng.integers(0, min(vocab_size, 256), n_in).tolist()
        text = " ".join(_LETTERS[i % len(_LETTERS)] for i in ids)
        requests.append(WorkloadRequest(ids, text, n_out))
    return requests


def save_workload(requests: Sequence[WorkloadRequest], path: str) -> None:
    """JSONL that `vllm bench serve --dataset-name custom --custom-output-len -1` replays:
    one {"prompt": text, "output_tokens": n} per line."""
    with open(path, "w") as fh:
        for r in requests:
            fh.write(json.dumps({"prompt": r.prompt_text, "output_tokens": r.max_tokens}) + "\n")


def poisson_arrival_times(rate: float, num_requests: int, seed: int = 0) -> np.ndarray:
    """Send times (seconds from the start) of a Poisson process of `rate` requests per second:
    exponential gaps of mean 1/rate, the first request at 0. `rate=inf` sends everything at 0."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests per second (inf: all at once), got {rate}")
    if math.isinf(rate):
        return np.zeros(num_requests)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, num_requests)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])
