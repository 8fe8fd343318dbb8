"""The OpenAI wire format (vLLM: `vllm/entrypoints/openai/protocol.py`): a completion or chat
request's body parsed into the handed module's `Request`s, and OpenAI's error body.

The rule is that nothing is silently ignored. Every field that OpenAI's completions or chat API
or vLLM's extensions define is either honoured or refused with a 400 whose `param` names it;
a field no spec defines is ignored, as vLLM ignores it. Three kinds of field:

- honoured here or in the output processor (`output.py`): prompt, messages, max_tokens, n,
  stop, stream, echo, seed, temperature, stop_token_ids, ignore_eos (the end-of-text token is
  added to the stop tokens unless it is set; the toy ByteTokenizer has none), ...
- sampling fields the ENGINE applies (`ENGINE_FIELDS`: top_p, top_k, min_p, the penalties,
  logit_bias, min_tokens, logprobs, prompt_logprobs): passed to the module's `SamplingParams` under
  vLLM's names when it has that field, refused while it does not (unless the value is the
  default, which asks for nothing). Support is read off `dataclasses.fields(SamplingParams)`.
- fields this server cannot honour (`UNSUPPORTED`): refused unless the value asks for nothing
  (`tools: []`, `use_beam_search: false`, ...).

Defaults are OpenAI's and vLLM's: temperature 1.0, top_p 1.0, max_tokens 16 (completions) or
the rest of the context (chat), n 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import uuid
from types import ModuleType

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_STRING_CHARS = 256  # bounds the per-token hold-back check (see output.py)
MAX_STOP_TOKEN_IDS = 1024  # the engine scans them per token: a long list would slow every request
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_CHOICES = 128  # prompts x n in one request (OpenAI's n is at most 128)


class APIError(Exception):
    """A request that ends in an error response: HTTP status and OpenAI's error body."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}}


def model_not_found(name: object) -> APIError:
    """vLLM's answer to a request for a model it does not serve."""
    return APIError(f"The model `{name}` does not exist.", 404, "NotFoundError", "model")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON (use a number or null)")


def load_json(body: bytes) -> dict:
    """The body as a JSON object; a 400 for bad UTF-8, bad JSON, NaN/Infinity, absurd ints or nesting."""
    try:
        payload = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise APIError(f"the body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise APIError("the body must be a JSON object")
    return payload


def check_text(value: str, param: str) -> str:
    """A string that is valid Unicode (JSON may spell a lone surrogate, "\\ud800", which is not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(f"{param} is not valid Unicode (a lone surrogate?)", param=param) from None
    return value


class Fields:
    """Typed reads of a JSON object's fields; every error is a 400 naming the field."""

    def __init__(self, payload: dict, prefix: str = ""):
        self.payload, self.prefix = payload, prefix

    def get(self, name: str, kinds: tuple, default, what: str):
        value = self.payload.get(name)
        if value is None:
            return default
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            self.fail(name, f"must be {what}, got {_show(value)}")
        return value

    def integer(self, name: str, default, low: int, high: float = math.inf, what: str = ""):
        value = self.get(name, (int,), default, what or f"an int >= {low}")
        if value is not None and not low <= value <= high:
            self.fail(name, f"must be {what or f'an int in {low}..{high}'}, got {_show(value)}")
        return value

    def number(self, name: str, default, low: float, high: float, what: str):
        value = self.get(name, (int, float), default, what)
        if value is None:
            return None
        try:
            value = float(value)  # a 400-digit int overflows here
        except OverflowError:
            self.fail(name, f"must be {what}, got a number too large")
        if not (math.isfinite(value) and low <= value <= high):  # JSON's 1e400 reads as inf
            self.fail(name, f"must be {what}, got {_show(value)}")
        return value

    def fail(self, name: str, why: str):
        raise APIError(f"{self.prefix}{name} {why}", param=f"{self.prefix}{name}")


def _show(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Sampling fields the engine applies: request field -> (SamplingParams field, its neutral value).
ENGINE_FIELDS = {
    "top_p": ("top_p", 1.0), "top_k": ("top_k", 0), "min_p": ("min_p", 0.0),
    "presence_penalty": ("presence_penalty", 0.0), "frequency_penalty": ("frequency_penalty", 0.0),
    "repetition_penalty": ("repetition_penalty", 1.0), "logit_bias": ("logit_bias", None),
    "min_tokens": ("min_tokens", 0),
    "logprobs": ("logprobs", None), "prompt_logprobs": ("prompt_logprobs", None),
}

# Fields this server cannot honour: accepted only with a value that asks for nothing.
UNSUPPORTED_COMMON = {
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0), "allowed_token_ids": (None,),
    "bad_words": (None, []), "response_format": (None, {"type": "text"}), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "structural_tag": (None,), "priority": (None, 0), "logits_processors": (None, []),
    "kv_transfer_params": (None,), "vllm_xargs": (None, {}), "spaces_between_special_tokens": (None, True),
    "mm_processor_kwargs": (None, {}),
}
UNSUPPORTED_COMPLETION = {"suffix": (None, ""), "prompt_embeds": (None,)}
UNSUPPORTED_CHAT = {
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "modalities": (None, ["text"]), "audio": (None,),
    "prediction": (None,), "reasoning_effort": (None,), "service_tier": (None, "auto", "default"),
    "store": (None, False), "web_search_options": (None,), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "documents": (None, []), "echo": (None, False),
}
# Fields accepted that change nothing here, and why (so that accepting them is not ignoring them):
#   user, metadata: labels for the caller's own records; add_special_tokens: the tokenizers add
#   none; parallel_tool_calls: there are no tools; guided_decoding_backend,
#   guided_whitespace_pattern: settings of guided decoding, which is refused on its own;
#   include_reasoning: the toy models write no reasoning to include or leave out.
NO_EFFECT = {"user": (str,), "metadata": (dict,), "add_special_tokens": (bool,), "parallel_tool_calls": (bool,),
             "guided_decoding_backend": (str,), "guided_whitespace_pattern": (str,), "include_reasoning": (bool,)}


def engine_supports(lab: ModuleType) -> set[str]:
    """The SamplingParams fields the module's engine has (so new ones light up by themselves)."""
    return {f.name for f in dataclasses.fields(lab.SamplingParams)}


@dataclasses.dataclass
class GenerateRequest:
    """What one completions or chat request asks for, ready for the engine and the output processor.

    `requests` holds the module's Requests, one per choice, prompt-major (choice index =
    prompt index * n + sample index), as vLLM numbers them. n > 1 is fanned out here, in the
    serving layer, into n requests of one prompt (seeds seed, seed + 1, ...), as vLLM V1's
    output processor does; the prefix cache lets them share the prompt's blocks.
    """

    kind: str  # "completion" or "chat"
    response_id: str
    prompts: list[list[int]]
    prompt_texts: list[str | None]  # None for a prompt of token ids until its text is needed
    requests: list
    n: int
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    prompt_only: bool = False  # echo with max_tokens 0: the prompt (and its logprobs) only

    @property
    def needs_engine(self) -> bool:
        return not self.prompt_only or self.prompt_logprobs is not None


def _same(value: object, allowed: object) -> bool:
    """JSON equality where true is not 1 and 1 is 1.0."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return type(value) is type(allowed) and value == allowed
    return value == allowed and (type(value) is type(allowed) or isinstance(value, (int, float)))


def refuse_unsupported(fields: Fields, table: dict) -> None:
    """A 400 for a field of `table` whose value is none of those allowed; absent is always
    allowed (every entry allows None), so only the fields the request has are looked at."""
    for name in [name for name in fields.payload if name in table]:
        value, allowed = fields.payload[name], table[name]
        if not any(_same(value, a) for a in allowed):
            fields.fail(name, f"is not supported by this server (got {_show(value)}); "
                              f"accepted: {', '.join(json.dumps(a) for a in allowed)}")
    for name in [name for name in fields.payload if name in NO_EFFECT]:
        fields.get(name, NO_EFFECT[name], None, f"a {NO_EFFECT[name][0].__name__}")


def truncation(fields: Fields) -> int | None:
    """vLLM's truncate_prompt_tokens: keep the last k prompt tokens (-1 or absent: all of them)."""
    k = fields.integer("truncate_prompt_tokens", None, -1, what="an int >= 1, or -1 (no truncation)")
    if k == 0:
        fields.fail("truncate_prompt_tokens", "must be >= 1, or -1")
    return None if k == -1 else k


def prompt_ids(prompt: object, tokenizer, max_len: int, param: str, truncate: int | None = None) -> list[int]:
    """One prompt as token ids: a string (encoded by the tokenizer) or a list of token ids, its
    last `truncate` tokens if given. The length is checked BEFORE each id is: a huge prompt is
    refused at the cost of len()."""
    if isinstance(prompt, str):
        try:
            ids = tokenizer.encode(check_text(prompt, param))
        except ValueError as exc:
            raise APIError(f"{param}: {exc}", param=param) from None
    elif isinstance(prompt, list):
        ids = prompt
    else:
        raise APIError(f"{param} must be a string or a list of token ids (ints)", param=param)
    if truncate is not None:
        ids = ids[-truncate:]
    if not ids:
        raise APIError(f"{param} is empty; expected at least one token", param=param)
    if len(ids) >= max_len:
        raise APIError(f"{param} has {len(ids)} tokens; the model's n_positions = {max_len} leaves no room for "
                       f"an output token", param=param)
    if not all(type(t) is int for t in ids):
        raise APIError(f"{param} must be a string or a list of token ids (ints)", param=param)
    if not all(0 <= t < tokenizer.vocab_size for t in ids):
        raise APIError(f"{param} has a token id outside the vocabulary 0..{tokenizer.vocab_size - 1}", param=param)
    return ids


def _completion_prompts(payload: dict, tokenizer, max_len: int, truncate: int | None) -> list[list[int]]:
    """`prompt`: a string, a list of token ids, or a list of either (one choice per prompt)."""
    if "prompt" not in payload or payload["prompt"] is None:
        raise APIError("prompt is required", param="prompt")
    prompt = payload["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_CHOICES:
            raise APIError(f"prompt: at most {MAX_CHOICES} prompts per request, got {len(prompt)}", param="prompt")
        return [prompt_ids(p, tokenizer, max_len, f"prompt[{i}]", truncate) for i, p in enumerate(prompt)]
    return [prompt_ids(prompt, tokenizer, max_len, "prompt", truncate)]


def parse_completion_request(lab: ModuleType, body: bytes | dict, config, tokenizer,
                             served_model: str) -> GenerateRequest:
    """A `/v1/completions` body as a GenerateRequest; an APIError otherwise (400 naming the
    field, 404 for another model). `config`: the served model's ModelConfig."""
    payload = load_json(body) if isinstance(body, bytes) else body
    fields = Fields(payload)
    check_model(fields, served_model)
    refuse_unsupported(fields, UNSUPPORTED_COMMON | UNSUPPORTED_COMPLETION)
    prompts = _completion_prompts(payload, tokenizer, config.n_positions, truncation(fields))
    echo = fields.get("echo", (bool,), False, "true or false")
    max_tokens = fields.integer("max_tokens", 16, 0 if echo else 1, what="an int >= 1 (>= 0 with echo)")
    logprobs = fields.integer("logprobs", None, 0, MAX_LOGPROBS)
    prompt_logprobs = fields.integer("prompt_logprobs", None, 0, MAX_LOGPROBS)
    if echo and logprobs is not None:
        prompt_logprobs = logprobs if prompt_logprobs is None else max(prompt_logprobs, logprobs)
    texts = [p if isinstance(p, str) else None for p in _as_list(payload["prompt"])]
    return build_request(lab, fields, "completion", f"cmpl-{base_id(fields)}", prompts, texts, max_tokens, config,
                  tokenizer, echo=echo, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                  logprob_params={"prompt_logprobs": "prompt_logprobs" if "prompt_logprobs" in payload else "echo"})


def _as_list(prompt: object) -> list:
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    return [prompt]


def check_model(fields: Fields, served_model: str) -> None:
    model = fields.get("model", (str,), None, "a string")
    if model and model != served_model:  # absent or "": the served model, as vLLM
        raise model_not_found(model)


def base_id(fields: Fields) -> str:
    request_id = fields.get("request_id", (str,), None, "a string")
    return check_text(request_id, "request_id") if request_id else uuid.uuid4().hex


def _stop_strings(fields: Fields) -> tuple[str, ...]:
    stop = fields.get("stop", (str, list), [], "a string or a list of up to 4 strings")
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        fields.fail("stop", f"must be a non-empty string or a list of up to {MAX_STOP_STRINGS}, got {_show(stop)}")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        fields.fail("stop", f"strings are at most {MAX_STOP_STRING_CHARS} characters each")
    return tuple(dict.fromkeys(check_text(s, "stop") for s in stop))


def _stop_token_ids(fields: Fields, vocab_size: int) -> list[int]:
    ids = fields.get("stop_token_ids", (list,), [], "a list of token ids")
    if len(ids) > MAX_STOP_TOKEN_IDS:  # before looking at each one
        fields.fail("stop_token_ids", f"holds at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
    if not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        fields.fail("stop_token_ids", f"must be a list of token ids (ints) in the vocabulary 0..{vocab_size - 1}")
    return list(dict.fromkeys(ids))


def _engine_fields(lab: ModuleType, fields: Fields, vocab_size: int, max_tokens: int) -> dict:
    """The engine-applied sampling fields as SamplingParams keywords: checked, then refused
    while the engine lacks the field (a neutral value asks for nothing and passes)."""
    f = fields
    top_k = f.integer("top_k", 0, -1, 2**31 - 1, what="an int >= -1 (-1 or 0: no limit)")
    values = {
        "top_p": f.number("top_p", 1.0, 1e-12, 1.0, "a number in (0, 1]"),
        "top_k": 0 if top_k == -1 else top_k,
        "min_p": f.number("min_p", 0.0, 0.0, 1.0, "a number in [0, 1]"),
        "presence_penalty": f.number("presence_penalty", 0.0, -2.0, 2.0, "a number in [-2, 2]"),
        "frequency_penalty": f.number("frequency_penalty", 0.0, -2.0, 2.0, "a number in [-2, 2]"),
        "repetition_penalty": f.number("repetition_penalty", 1.0, 1e-12, math.inf, "a finite number > 0"),
        "logit_bias": _logit_bias(f, vocab_size),
        "min_tokens": f.integer("min_tokens", 0, 0, max_tokens, what=f"an int in 0..max_tokens ({max_tokens})"),
    }
    return _supported(lab, values)


def _supported(lab: ModuleType, values: dict) -> dict:
    """The non-neutral `values` as SamplingParams keywords; a 400 naming the field for one the
    engine does not have."""
    have, kwargs = engine_supports(lab), {}
    for name, value in values.items():
        field, neutral = ENGINE_FIELDS[name]
        if value == neutral or (neutral is None and not value):
            continue
        if field not in have:
            raise APIError(f"{name} is not supported by this server's engine yet (its SamplingParams has no "
                           f"field {field}); leave it out or send its neutral value {json.dumps(neutral)}",
                           param=name)
        kwargs[field] = value
    return kwargs


def _logit_bias(fields: Fields, vocab_size: int) -> dict[int, float] | None:
    bias = fields.get("logit_bias", (dict,), None, "an object of token id -> bias")
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 9 and int(key) < vocab_size):
            fields.fail("logit_bias", f"keys must be token ids 0..{vocab_size - 1}, got {_show(key)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            fields.fail("logit_bias", f"values must be numbers in [-100, 100], got {_show(value)}")
        out[int(key)] = float(value)
    return out


def build_request(lab: ModuleType, fields: Fields, kind: str, response_id: str, prompts: list[list[int]],
                  texts: list[str | None], max_tokens: int | None, config, tokenizer, *, echo: bool = False,
                  logprobs: int | None = None, prompt_logprobs: int | None = None,
                  logprob_params: dict | None = None) -> GenerateRequest:
    """The fields both endpoints share, and the Requests: one per prompt and sample."""
    f = fields
    n = f.integer("n", 1, 1, MAX_CHOICES)
    best_of = f.integer("best_of", None, 1, MAX_CHOICES)
    if best_of is not None and best_of != n:
        f.fail("best_of", f"must equal n ({n}): this server returns every sample it draws (vLLM V1 does too)")
    if n * len(prompts) > MAX_CHOICES:
        f.fail("n", f"x the number of prompts must be at most {MAX_CHOICES}, got {n * len(prompts)}")
    stream = f.get("stream", (bool,), False, "true or false")
    options = f.get("stream_options", (dict,), None, "an object")
    if options is not None and not stream:
        f.fail("stream_options", "is only allowed with stream: true")
    opts = Fields(options or {}, "stream_options.")
    include_usage = opts.get("include_usage", (bool,), False, "true or false")
    continuous_usage = opts.get("continuous_usage_stats", (bool,), False, "true or false")
    temperature = f.number("temperature", 1.0, 0.0, math.inf, "a finite number >= 0")
    if n > 1 and temperature == 0:
        f.fail("n", f"must be 1 when using greedy sampling (temperature 0), got {n}: the samples would be "
                    "the same (vLLM refuses it too)")
    seed = f.integer("seed", None, 0, 2**63 - 1 - MAX_CHOICES, what="an int in 0..2**63 - 129")
    if truncation(f) is not None:
        texts = [None] * len(prompts)  # the prompts were cut: their text is the decoded tokens
    room = config.n_positions - max(len(p) for p in prompts)
    if max_tokens is None:  # chat without a limit: the rest of the context, as vLLM
        max_tokens = room
    if max_tokens > room:
        f.fail("max_completion_tokens" if kind == "chat" and "max_completion_tokens" in f.payload else "max_tokens",
               f"({max_tokens}) + the prompt ({config.n_positions - room} tokens) exceeds the model's "
               f"n_positions = {config.n_positions}")
    stop = _stop_strings(f)
    stop_ids = _stop_token_ids(f, config.vocab_size)
    extras = _engine_fields(lab, f, config.vocab_size, max(max_tokens, 1))
    ignore_eos = f.get("ignore_eos", (bool,), False, "true or false")
    eos = tokenizer.eos_token_id
    if eos is not None and not ignore_eos and eos not in stop_ids:
        stop_ids.append(eos)  # as vLLM: the end-of-text token stops unless ignore_eos
    if ignore_eos and "ignore_eos" in engine_supports(lab):
        extras["ignore_eos"] = True  # the serving layer already honours it; the engine may want to know
    for name, k in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if k is None:  # (0 is not neutral: it asks for the chosen token's logprob)
            continue
        if name not in engine_supports(lab):
            param = (logprob_params or {}).get(name, name)
            raise APIError(f"{param} is not supported by this server's engine yet (its SamplingParams has no "
                           f"field {name})", param=param)
        extras[name] = k
    cache_salt = f.get("cache_salt", (str,), None, "a non-empty string")
    if cache_salt is not None:
        if not cache_salt:
            f.fail("cache_salt", "must be a non-empty string")
        check_text(cache_salt, "cache_salt")
    requests = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            sampling = lab.SamplingParams(temperature, max(max_tokens, 1), None if seed is None else seed + j,
                                          tuple(stop_ids), **extras)
            requests.append(lab.Request(f"{response_id}-{i}-{j}-{uuid.uuid4().hex[:8]}", prompt, sampling,
                                        cache_salt=cache_salt))
    for request in requests[::n]:  # the engine's own checks, so that a bad request never reaches it
        try:
            lab.check_request(request, config)
        except ValueError as exc:  # the checks above should have caught it: name the field it mentions
            param = next((name for name in ("max_tokens", "temperature", "seed", "stop_token_ids", "cache_salt",
                                            *ENGINE_FIELDS) if name in str(exc)), "prompt" if kind == "completion"
                         else "messages")
            raise APIError(str(exc), param=param) from None
    return GenerateRequest(
        kind, response_id, prompts, list(texts),
        requests, n, stream, include_usage, continuous_usage, stop, frozenset(stop_ids),
        f.get("include_stop_str_in_output", (bool,), False, "true or false"),
        f.get("skip_special_tokens", (bool,), True, "true or false"), echo, logprobs, prompt_logprobs,
        f.get("return_token_ids", (bool,), False, "true or false"),
        f.get("return_tokens_as_token_ids", (bool,), False, "true or false"), max_tokens == 0)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
