"""The OpenAI wire format (vLLM: `vllm/entrypoints/openai/protocol.py`): a completion request's
body parsed into the handed module's `Request`, and the response objects.
"""

from __future__ import annotations

import json
from types import ModuleType


class APIError(Exception):
    """A request that ends in an error response: HTTP status and OpenAI's error body."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": None, "code": self.status}}


def token_text(token_id: int) -> str:
    """The lab's byte tokenizer: token id = byte value, so a token's text is that byte decoded
    (a lone byte >= 128 is not UTF-8 on its own and shows as U+FFFD; `token_ids` carry the truth)."""
    return bytes([token_id]).decode("utf-8", errors="replace") if 0 <= token_id < 256 else ""


def _prompt_token_ids(prompt: object, vocab_size: int) -> list[int]:
    """A prompt as token ids: a list of ints as given, or a string encoded byte by byte (UTF-8)."""
    if isinstance(prompt, str):
        token_ids = list(prompt.encode("utf-8"))
        outside = [t for t in token_ids if t >= vocab_size]
        if outside:
            raise APIError(f"prompt: byte {outside[0]} of the UTF-8 text has no token in this model's "
                             f"vocabulary of {vocab_size} (token id = byte value)")
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        token_ids = prompt
    else:
        raise APIError("prompt must be a string or a list of token ids (ints); one prompt per request")
    if not token_ids:
        raise APIError("prompt is empty; expected at least one token")
    return token_ids


def _optional(body: dict, name: str, kinds: tuple, default, what: str):
    """body[name] if it is present, not null and of one of `kinds` (bool is never an int here)."""
    value = body.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise APIError(f"{name} must be {what}, got {json.dumps(value)}")
    return value


def parse_completion_request(lab: ModuleType, body: bytes, config, request_id: str) -> tuple[object, bool, bool]:
    """A `/v1/completions` body as (the module's Request, stream, include_usage); `APIError` (400)
    naming the field otherwise (`config`: the served model's ModelConfig). Fields: prompt,
    max_tokens (16), temperature (0: greedy, the lab's default), seed, stop_token_ids, stream,
    stream_options.include_usage, n (only 1); others are ignored."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, an absurd int, absurd nesting
        raise APIError(f"the body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise APIError("the body must be a JSON object")
    if "prompt" not in payload:
        raise APIError("prompt is required")
    prompt = _prompt_token_ids(payload["prompt"], config.vocab_size)
    max_tokens = _optional(payload, "max_tokens", (int,), 16, "an int >= 1")
    temperature = _optional(payload, "temperature", (int, float), 0.0, "a number >= 0")
    seed = _optional(payload, "seed", (int,), None, "an int >= 0")
    stop = _optional(payload, "stop_token_ids", (list,), [], "a list of token ids")
    stream = _optional(payload, "stream", (bool,), False, "true or false")
    options = _optional(payload, "stream_options", (dict,), {}, "an object")
    include_usage = _optional(options, "include_usage", (bool,), False, "true or false")
    _optional(payload, "ignore_eos", (bool,), False, "true or false")  # vLLM's; the toy model has no EOS
    if _optional(payload, "n", (int,), 1, "1") != 1:
        raise APIError("n must be 1: this server returns one choice per request")
    if seed is not None and seed < 0:
        raise APIError(f"seed must be an int >= 0, got {seed}")
    if not all(type(t) is int for t in stop):
        raise APIError(f"stop_token_ids must be a list of token ids (ints), got {json.dumps(stop)}")
    request = lab.Request(request_id, prompt, lab.SamplingParams(float(temperature), max_tokens, seed, tuple(stop)))
    try:  # the engine's own checks, here on the event loop, so that a bad request never reaches the engine
        lab.check_request(request, config)
    except ValueError as exc:
        raise APIError(str(exc)) from None
    return request, stream, include_usage


def completion_choice(token_ids: list[int], finish_reason: str | None) -> dict:
    return {"index": 0, "text": "".join(token_text(t) for t in token_ids), "token_ids": token_ids,
            "logprobs": None, "finish_reason": finish_reason}


def usage(request, num_output_tokens: int) -> dict:
    n_prompt = len(request.prompt_token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": num_output_tokens,
            "total_tokens": n_prompt + num_output_tokens}
