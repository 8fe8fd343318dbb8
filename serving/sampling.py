"""What vLLM's API adds to the chapter's sampler (vLLM: `vllm/v1/sample/`): logits processors for
`min_tokens`, `logit_bias`, the three penalties and `min_p`; token and prompt logprobs; and the
one table of these fields' rules.

The chapter samples with temperature, top-k and top-p. What else an OpenAI request asks for
travels in the request's `SamplingParams.extra_args`, under the names of `EXTRA_ARGS`, and is
applied through the engine's hook, `LLMEngine(logits_processors=logits_processors(eos))`, in
vLLM v1's order, on each sequence's raw logits row before the chapter's sampler sees it:

  1. min_tokens: before `min_tokens` outputs, the stop tokens and the end-of-text token are at
     -inf (the end-of-text token even with ignore_eos, as vLLM masks it), so that no stop token
     can be drawn early;
  2. logit_bias: each named token's bias is added to its logit;
  3. penalties: repetition_penalty r on every token seen in the prompt or the output (a positive
     logit divided by r, a negative one multiplied), then minus frequency_penalty x (times the
     token occurs in the output) and minus presence_penalty once for a token the output holds;
  4. min_p: at temperature T > 0, tokens whose probability is below min_p x the most likely
     one's (at that temperature) are at -inf. (At T = 0 the argmax survives any min_p.)

Logprobs are vLLM's default "raw_logprobs": computed from the model's logits before any
processor. `Logprobs` is the first processor: it keeps the raw row of each sequence that asks,
and `take` turns it into the entry of the token the sampler drew. Prompt logprobs are the
model's own `forward_dense` over the prompt (`prompt_logprobs`): the chapter's paged step
computes logits only for the rows it samples, so the prompt's rows come from the reference path,
equal to the paged one within float32 rounding, at the cost of a second pass over the prompt.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import NamedTuple

import numpy as np

MAX_LOGPROBS = 20  # vLLM's default max_logprobs


class Logprob(NamedTuple):
    """One token's log-probability at one position, and its rank there (1: the most likely; vLLM's)."""

    logprob: float
    rank: int


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _logit_bias(value: object, vocab_size: int, _max_tokens: int) -> bool:
    return isinstance(value, dict) and all(_int(t) and 0 <= t < vocab_size and _number(b) and -100 <= b <= 100
                                           for t, b in value.items())


# The one home of these fields' rules: name -> (its neutral value, the rule in words, the rule
# on (value, vocab_size, max_tokens)). A neutral value asks for nothing and is left out.
EXTRA_ARGS = {
    "min_tokens": (0, "an int in 0..max_tokens", lambda v, _, m: _int(v) and 0 <= v <= m),
    "logit_bias": (None, "an object of token id (in the vocabulary) -> a number in [-100, 100]", _logit_bias),
    "repetition_penalty": (1.0, "a number > 0", lambda v, *_: _number(v) and v > 0),
    "frequency_penalty": (0.0, "a number in [-2, 2]", lambda v, *_: _number(v) and -2 <= v <= 2),
    "presence_penalty": (0.0, "a number in [-2, 2]", lambda v, *_: _number(v) and -2 <= v <= 2),
    "min_p": (0.0, "a number in [0, 1]", lambda v, *_: _number(v) and 0 <= v <= 1),
    "logprobs": (None, f"an int in 0..{MAX_LOGPROBS}", lambda v, *_: _int(v) and 0 <= v <= MAX_LOGPROBS),
    "prompt_logprobs": (None, f"an int in 0..{MAX_LOGPROBS}", lambda v, *_: _int(v) and 0 <= v <= MAX_LOGPROBS),
}


def extra_args(lab: ModuleType, values: dict, vocab_size: int, max_tokens: int) -> dict | None:
    """`values` (field -> value) checked against EXTRA_ARGS, as `SamplingParams.extra_args`:
    neutral values left out, None when nothing is left. A field of no processor, or a value its
    rule refuses, is the module's ArgumentError naming the field."""
    out = {}
    for name, value in values.items():
        if name not in EXTRA_ARGS:
            raise lab.ArgumentError(name, f"{name} is not a sampling field of this server")
        neutral, rule, ok = EXTRA_ARGS[name]
        if value is None or (value == neutral and type(value) is not bool) or value == {}:
            continue
        if not ok(value, vocab_size, max_tokens):
            raise lab.ArgumentError(name, f"{name} must be {rule}, got {value!r}")
        out[name] = value
    return out or None


def _args(seq) -> dict:
    return seq.sampling.extra_args or {}


class Logprobs:
    """Keeps the raw logits row of each sequence that asks for logprobs (the first processor,
    so that the row is the model's own), until `take` turns it into the drawn token's entry."""

    fields = ("logprobs",)

    def __init__(self):
        self.rows: dict[str, np.ndarray] = {}

    def __call__(self, seq, logits: np.ndarray) -> np.ndarray:
        if _args(seq).get("logprobs") is not None:
            self.rows[seq.request_id] = np.array(logits, dtype=np.float32)  # later processors change the row
        return logits

    def take(self, request_id: str, token_id: int, num_top: int) -> dict[int, Logprob]:
        """The drawn token's log-probability, then the `num_top` most likely tokens' (see `token_logprobs`)."""
        return token_logprobs(self.rows.pop(request_id)[None], [token_id], num_top)[0]

    def forget(self, request_id: str) -> None:
        self.rows.pop(request_id, None)


class MinTokens:
    """Stop tokens and the end-of-text token at -inf until `min_tokens` outputs."""

    fields = ("min_tokens",)

    def __init__(self, eos_token_id: int | None):
        self.eos = () if eos_token_id is None else (eos_token_id,)

    def __call__(self, seq, logits: np.ndarray) -> np.ndarray:
        if len(seq.output_token_ids) < _args(seq).get("min_tokens", 0):
            logits[np.array([*seq.sampling.stop_token_ids, *self.eos], dtype=np.int64)] = -np.inf
        return logits


class LogitBias:
    fields = ("logit_bias",)

    def __call__(self, seq, logits: np.ndarray) -> np.ndarray:
        bias = _args(seq).get("logit_bias")
        if bias:
            logits[np.array(list(bias), dtype=np.int64)] += np.array(list(bias.values()), dtype=logits.dtype)
        return logits


class Penalties:
    fields = ("repetition_penalty", "frequency_penalty", "presence_penalty")

    def __call__(self, seq, logits: np.ndarray) -> np.ndarray:
        args = _args(seq)
        r = args.get("repetition_penalty", 1.0)
        f, p = args.get("frequency_penalty", 0.0), args.get("presence_penalty", 0.0)
        if r == 1.0 and f == 0.0 and p == 0.0:
            return logits
        logits = logits.astype(np.float64)
        counts = np.bincount(np.asarray(seq.output_token_ids, dtype=np.int64), minlength=logits.size)
        if r != 1.0:
            seen = counts > 0
            seen[np.asarray(seq.prompt_token_ids, dtype=np.int64)] = True
            logits = np.where(seen, np.where(logits > 0, logits / r, logits * r), logits)
        return logits - f * counts - p * (counts > 0)


class MinP:
    fields = ("min_p",)

    def __call__(self, seq, logits: np.ndarray) -> np.ndarray:
        min_p = _args(seq).get("min_p", 0.0)
        temperature = seq.sampling.temperature
        if min_p > 0 and temperature > 0:  # p_i / p_max = exp((x_i - x_max) / T)
            logits[np.exp((logits.astype(np.float64) - logits.max()) / temperature) < min_p] = -np.inf
        return logits


def logits_processors(eos_token_id: int | None = None) -> list:
    """The processors, in order, for `LLMEngine(logits_processors=...)`: what a served engine needs
    to answer every sampling field of the API. `eos_token_id`: what min_tokens holds back too."""
    return [Logprobs(), MinTokens(eos_token_id), LogitBias(), Penalties(), MinP()]


def with_api_processors(processors, eos_token_id: int | None = None) -> list:
    """An engine's `processors` completed with what the API needs: each of `logits_processors`
    that is missing is added, in that list's order (Logprobs first, so that it keeps the raw row),
    ahead of the engine's own others; a processor of those kinds that the engine already has is
    kept. Nothing missing: the list unchanged. `start_server` installs this in the engine it is
    handed, so that every engine serves the whole API."""
    processors = list(processors)
    kinds = {type(p) for p in logits_processors()}
    have = {type(p): p for p in processors if type(p) in kinds}
    if len(have) == len(kinds):
        return processors
    return [have.get(type(p), p) for p in logits_processors(eos_token_id)] + [p for p in processors
                                                                               if type(p) not in kinds]


def logprobs_of(engine) -> Logprobs | None:
    return next((p for p in engine.logits_processors if isinstance(p, Logprobs)), None)


def token_logprobs(logits: np.ndarray, token_ids, num_top: int) -> list[dict[int, Logprob]]:
    """Per row of `logits` (R, V): {token_ids[r]: its Logprob, then the `num_top` most likely
    tokens', most likely first (ties: lower id first)}, from log_softmax of the raw row in float32
    (k or k + 1 entries: the chosen token may be among the top k). A token's rank is 1 + the
    number of tokens strictly more likely."""
    x = np.asarray(logits, dtype=np.float32).reshape(-1, np.shape(logits)[-1])
    x = x - x.max(axis=-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    top = np.argsort(-logp, axis=-1, kind="stable")[:, :num_top]
    return [{int(t): Logprob(float(row[t]), 1 + int((row > row[t]).sum())) for t in (token, *best)}
            for row, token, best in zip(logp, token_ids, top)]


def prompt_logprobs(model, prompt_token_ids: list[int], num_top: int) -> list[dict[int, Logprob] | None]:
    """Per prompt token, its log-probability given the tokens before it and the `num_top` most
    likely there; None for the first (nothing predicts it)."""
    if len(prompt_token_ids) < 2:
        return [None] * len(prompt_token_ids)
    logits = model.forward_dense(prompt_token_ids)[:-1]
    return [None, *token_logprobs(logits, prompt_token_ids[1:], num_top)]
