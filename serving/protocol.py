"""The OpenAI wire format (vLLM: `vllm/entrypoints/openai/protocol.py`): a completion or chat
request's body read into the handed module's `Request`s, and OpenAI's error body.

Nothing is silently ignored, and each rule is stated once:

- here: the JSON SHAPE of every field (a number, an int, a list of ints, ...), and the whole rule
  of each field that only the front end reads (n, stop, echo, stream, best_of, ...);
- the engine's own checks: `check_request` of the handed module (temperature >= 0, top_p in
  (0, 1], top_k >= 0, a prompt that fits the context with max_tokens, token ids in the
  vocabulary, ...) runs when the engine adds the request, and `sampling.EXTRA_ARGS` holds the
  ranges of the fields its logits processors apply (penalties, logit_bias, min_p, min_tokens,
  logprobs). Their errors carry the field at fault as data, and the server's 400 names it;
- `UNSUPPORTED_*`: fields this server cannot honour, refused unless their value asks for nothing
  (`tools: []`, `use_beam_search: false`, ...);
- `NO_EFFECT`: fields accepted that change nothing here, each with the reason.

A field in no table (nor read here) is in no spec this server knows: it is accepted and ignored,
as vLLM does, and the server logs its name once (`GenerateRequest.ignored`).

Defaults are OpenAI's and vLLM's: temperature 1.0, top_p 1.0, max_tokens 16 (completions) or
the rest of the context (chat), n 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import uuid
from types import ModuleType

from . import sampling

MAX_STOP_STRINGS = 64  # vLLM sets no limit; this one keeps the per-token stop-string check cheap
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024  # each is a set member in the engine; the bound keeps a request's size sane
# Prompts x n in one request. The engine needs no cap (a request's choices enter it --max-n at
# a time); this one bounds the front end's work for one request, which every other client's
# stream waits on (one process and one GIL, even when a large body is parsed on a worker
# thread): 10-15 us and 1.1 KB a choice to parse and track, so 2048 choices cost ~25 ms and 2 MB,
# where a 1 MiB body of 200,000 one-token prompts took 2-3 s and 214 MB (docs/serving.md,
# "Batch clients"). lm_eval --batch_size 256 sends 256 prompts.
MAX_CHOICES = 2048


class APIError(Exception):
    """A request that ends in an error response: HTTP status and OpenAI's error body."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = param
        self.code = status if code is None else code  # vLLM's code is the status; OpenAI names some ("invalid_api_key")

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def field_error(message: str, field: str | None, param: str | None) -> APIError:
    """An engine's refusal of its `field`, as a 400 about the request's own name for it, `param`
    ("prompt_token_ids" -> "prompt"), in the message too."""
    if field and param:
        message = message.replace(field.split("[", 1)[0], param, 1)
    return APIError(message, param=param)


def model_not_found(name: object) -> APIError:
    """vLLM's answer to a request for a model it does not serve."""
    return APIError(f"The model `{name}` does not exist.", 404, "NotFoundError", "model")


@dataclasses.dataclass
class ServedModel:
    """What the front end knows of what it serves: the module (whose Request and checks the engine
    uses), the model's config, the tokenizer, the names clients may use (the first is the one
    answered with) and the largest `n` of one request. The engine applies every field of
    `sampling.EXTRA_ARGS`: the server installs the processors it lacks."""

    lab: ModuleType
    config: object
    tokenizer: object
    names: tuple[str, ...]
    max_n: int

    @property
    def name(self) -> str:
        return self.names[0]


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
    """Typed reads of a JSON object's fields; every error is a 400 naming the field. Every name
    read is remembered, so that what no one read can be reported as ignored."""

    def __init__(self, payload: dict, prefix: str = ""):
        self.payload = payload
        self.prefix = prefix
        self.read: set[str] = set()

    def get(self, name: str, kinds: tuple, default, what: str):
        self.read.add(name)
        value = self.payload.get(name)
        if value is None:
            return default
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            self.fail(name, f"must be {what}, got {_show(value)}")
        return value

    def integer(self, name: str, default, low: int = -math.inf, high: float = math.inf, what: str = "an int"):
        value = self.get(name, (int,), default, what)
        if value is not None and not low <= value <= high:
            self.fail(name, f"must be {what}, got {_show(value)}")
        return value

    def number(self, name: str, default, what: str = "a number"):
        value = self.get(name, (int, float), default, what)
        if value is None:
            return None
        try:
            return float(value)  # a 400-digit int overflows here; JSON's 1e400 reads as inf (the engine says no)
        except OverflowError:
            self.fail(name, f"must be {what}, got a number too large")

    def fail(self, name: str, why: str):
        raise APIError(f"{self.prefix}{name} {why}", param=f"{self.prefix}{name}")


def _show(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Fields this server cannot honour: accepted only with a value that asks for nothing.
UNSUPPORTED_COMMON = {
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0), "allowed_token_ids": (None,),
    "bad_words": (None, []), "response_format": (None, {"type": "text"}), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "structural_tag": (None,), "priority": (None, 0), "logits_processors": (None, []),
    "kv_transfer_params": (None,), "vllm_xargs": (None, {}), "spaces_between_special_tokens": (None, True),
    "mm_processor_kwargs": (None, {}), "prompt_cache_retention": (None, "in_memory"), "moderation": (None, False),
}
UNSUPPORTED_COMPLETION = {"suffix": (None, ""), "prompt_embeds": (None,)}
UNSUPPORTED_CHAT = {
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "modalities": (None, ["text"]), "audio": (None,),
    "prediction": (None,), "reasoning_effort": (None,), "service_tier": (None, "auto", "default"),
    "store": (None, False), "web_search_options": (None,), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "documents": (None, []), "echo": (None, False), "verbosity": (None, "medium"),
}
# Fields accepted that change nothing here, and why (so that accepting them is not ignoring them):
#   user, metadata, safety_identifier: labels for the caller's own records or abuse reports;
#   prompt_cache_key: a hint for routing to a warm cache, and this server's one prefix cache is
#   always the one used; add_special_tokens: the tokenizers add none; parallel_tool_calls: there
#   are no tools; guided_decoding_backend, guided_whitespace_pattern: settings of guided decoding,
#   which is refused on its own; include_reasoning: the toy models write no reasoning.
NO_EFFECT = {"user": (str,), "metadata": (dict,), "safety_identifier": (str,), "prompt_cache_key": (str,),
             "add_special_tokens": (bool,), "parallel_tool_calls": (bool,), "guided_decoding_backend": (str,),
             "guided_whitespace_pattern": (str,), "include_reasoning": (bool,)}


def request_cache_salt(tenant_salt: str | None, cache_salt: str | None) -> str | None:
    """The engine's `cache_salt` for a request (the chapter's `hash_block` chains it into every
    block's hash, so requests of different salts never share a block).

    With API keys, `tenant_salt` is the caller's tenant's salt, derived by the server from the key
    that authenticated the request (`api_server.APIKeys`), never read from the body. The body's
    own `cache_salt` can only narrow it: it is appended to the tenant's salt, a fixed-length hex
    string, so a body can split its tenant's cache into parts but never spell another tenant's
    salt (vLLM PR 53347: a salt taken from the body lets an attacker send the victim's). Without
    keys (`tenant_salt` None) the body's salt is used as it is, as vLLM does."""
    if tenant_salt is None:
        return cache_salt
    return tenant_salt if cache_salt is None else f"{tenant_salt}/{cache_salt}"


@dataclasses.dataclass
class GenerateRequest:
    """What one completions or chat request asks for, ready for the engine and the output processor.

    `requests` holds the module's Requests, one per prompt. `n` has one home, the engine:
    `LLMEngine.add_request(request, n=n)` runs the prompt once and forks it into n samples,
    seeded seed, seed + 1, ... (`engine.messages.sample_ids` names them). Choices are prompt-major
    (choice index = prompt index * n + sample index), as vLLM numbers them. `params` maps an
    engine field to the request's own name for it (the 400's `param`).
    """

    kind: str  # "completion" or "chat"
    model: str  # the served name it asked for: its responses carry it, as vLLM's do
    response_id: str
    prompts: list[list[int]]
    prompt_texts: list[str | None]  # None for a prompt of token ids until its text is needed
    requests: list
    n: int
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    include_obfuscation: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()  # what ends a request in the engine, EOS included
    eos_token_id: int | None = None  # None when ignore_eos (or the tokenizer has none)
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    params: dict[str, str] = dataclasses.field(default_factory=dict)
    ignored: tuple[str, ...] = ()  # fields no table knows: accepted, and logged once by the server

    def param(self, field: str | None) -> str | None:
        """The request's name for an engine field ("prompt_token_ids[3]" -> "prompt")."""
        if field is None:
            return None
        field = field.split("[", 1)[0]
        return self.params.get(field, field)


def _same(value: object, allowed: object) -> bool:
    """JSON equality where true is not 1 and 1 is 1.0."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return type(value) is type(allowed) and value == allowed
    return value == allowed and (type(value) is type(allowed) or isinstance(value, (int, float)))


def refuse_unsupported(fields: Fields, table: dict) -> None:
    """A 400 for a field of `table` whose value is none of those allowed; absent is always
    allowed (every entry allows None), so only the fields the request has are looked at."""
    for name in [name for name in fields.payload if name in table]:
        fields.read.add(name)
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


def prompt_ids(prompt: object, tokenizer, param: str, truncate: int | None = None) -> list[int]:
    """One prompt as token ids: a string (encoded by the tokenizer) or a list of token ids (ints),
    its last `truncate` tokens if given. (Its length and ids are the engine's to check.)"""
    if isinstance(prompt, str):
        try:
            ids = tokenizer.encode(check_text(prompt, param))
        except ValueError as exc:
            raise APIError(f"{param}: {exc}", param=param) from None
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        ids = prompt
    else:
        raise APIError(f"{param} must be a string or a list of token ids (ints)", param=param)
    return ids if truncate is None else ids[-truncate:]


def _completion_prompts(payload: dict, tokenizer, truncate: int | None) -> list[list[int]]:
    """`prompt`: a string, a list of token ids, or a list of either (one choice per prompt)."""
    if "prompt" not in payload or payload["prompt"] is None:
        raise APIError("prompt is required", param="prompt")
    prompt = payload["prompt"]
    if _is_prompt_list(prompt):
        if len(prompt) > MAX_CHOICES:
            raise APIError(f"prompt: at most {MAX_CHOICES} prompts per request, got {len(prompt)}", param="prompt")
        return [prompt_ids(p, tokenizer, f"prompt[{i}]", truncate) for i, p in enumerate(prompt)]
    return [prompt_ids(prompt, tokenizer, "prompt", truncate)]


def _is_prompt_list(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)


def parse_completion_request(served: ServedModel, body: bytes | dict,
                             tenant_salt: str | None = None) -> GenerateRequest:
    """A `/v1/completions` body as a GenerateRequest; an APIError otherwise (400 naming the
    field, 404 for another model). `tenant_salt`: the caller's, as `request_cache_salt` takes it."""
    payload = load_json(body) if isinstance(body, bytes) else body
    fields = Fields(payload)
    model = check_model(fields, served)
    refuse_unsupported(fields, UNSUPPORTED_COMMON | UNSUPPORTED_COMPLETION)
    fields.read.add("prompt")
    prompts = _completion_prompts(payload, served.tokenizer, truncation(fields))
    echo = fields.get("echo", (bool,), False, "true or false")
    max_tokens = fields.integer("max_tokens", 16, 0 if echo else 1, what="an int >= 1 (>= 0 with echo)")
    logprobs = fields.integer("logprobs", None, what="an int")
    prompt_logprobs = fields.integer("prompt_logprobs", None, what="an int")
    params = {"prompt_token_ids": "prompt"}
    if echo and logprobs is not None:  # the echoed prompt's tokens get logprobs too
        prompt_logprobs = logprobs if prompt_logprobs is None else max(prompt_logprobs, logprobs)
        params["prompt_logprobs"] = "prompt_logprobs" if "prompt_logprobs" in payload else "logprobs"
    texts = [p if isinstance(p, str) else None for p in (payload["prompt"] if _is_prompt_list(payload["prompt"])
                                                         else [payload["prompt"]])]
    return build_request(served, fields, "completion", model, f"cmpl-{base_id(fields)}", prompts, texts, max_tokens,
                         echo=echo, logprobs=logprobs, prompt_logprobs=prompt_logprobs, params=params,
                         tenant_salt=tenant_salt)


def check_model(fields: Fields, served: ServedModel) -> str:
    """The served name the request asked for (absent or "": the first, as vLLM); 404 for another."""
    model = fields.get("model", (str,), None, "a string")
    if model and model not in served.names:
        raise model_not_found(model)
    return model or served.name


def base_id(fields: Fields) -> str:
    request_id = fields.get("request_id", (str,), None, "a string")
    return check_text(request_id, "request_id") if request_id else uuid.uuid4().hex


def _stop_strings(fields: Fields) -> tuple[str, ...]:
    stop = fields.get("stop", (str, list), [], f"a string or a list of up to {MAX_STOP_STRINGS} strings")
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        fields.fail("stop", f"must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them, "
                            f"got {_show(stop)}")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        fields.fail("stop", f"strings are at most {MAX_STOP_STRING_CHARS} characters each")
    return tuple(dict.fromkeys(check_text(s, "stop") for s in stop))


def _stop_token_ids(fields: Fields) -> list[int]:
    ids = fields.get("stop_token_ids", (list,), [], "a list of token ids")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        fields.fail("stop_token_ids", f"holds at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
    if not all(type(t) is int for t in ids):
        fields.fail("stop_token_ids", "must be a list of token ids (ints)")
    return list(dict.fromkeys(ids))


def _extra_args(served: ServedModel, fields: Fields, max_tokens: int, logprobs: int | None,
                prompt_logprobs: int | None, params: dict) -> dict | None:
    """The fields the engine's logits processors apply, in their JSON shapes, as the request's
    `SamplingParams.extra_args`; their ranges are `sampling.EXTRA_ARGS`'s."""
    f = fields
    values = {name: f.number(name, None) for name in ("presence_penalty", "frequency_penalty",
                                                      "repetition_penalty", "min_p")}
    values["min_tokens"] = f.integer("min_tokens", None)
    bias = f.get("logit_bias", (dict,), None, "an object of token id -> bias")
    if bias:
        if not all(k.isascii() and k.isdigit() and len(k) <= 9 for k in bias):
            f.fail("logit_bias", f"keys must be token ids, got {_show(list(bias))}")
        values["logit_bias"] = {int(k): v for k, v in bias.items()}
    values |= {"logprobs": logprobs, "prompt_logprobs": prompt_logprobs}
    try:
        args = sampling.extra_args(served.lab, values, served.config.vocab_size, max(max_tokens, 1))
    except ValueError as exc:
        raise field_error(str(exc), exc.argument, params.get(exc.argument, exc.argument)) from None
    return args


def _samples(served: ServedModel, f: Fields, num_prompts: int) -> int:
    """`n`, the samples of each prompt, checked with `best_of` and against the server's limits."""
    n = f.integer("n", 1, 1, what="an int >= 1")
    if n > served.max_n:
        f.fail("n", f"is at most {served.max_n} on this server (half of its running seats: one request may not "
                    f"hold them all), got {n}")
    best_of = f.integer("best_of", None, 1, what="an int >= 1")
    if best_of is not None and best_of != n:
        f.fail("best_of", f"must equal n ({n}): this server returns every sample it draws (vLLM V1 does too)")
    if n * num_prompts > MAX_CHOICES:
        f.fail("n", f"x the number of prompts must be at most {MAX_CHOICES}, got {n * num_prompts}")
    return n


def _body_cache_salt(f: Fields) -> str | None:
    """The body's own `cache_salt`, if it sent one: a non-empty string of text."""
    cache_salt = f.get("cache_salt", (str,), None, "a non-empty string")
    if cache_salt is not None:
        if not cache_salt:
            f.fail("cache_salt", "must be a non-empty string")
        check_text(cache_salt, "cache_salt")
    return cache_salt


def build_request(served: ServedModel, fields: Fields, kind: str, model: str, response_id: str,
                  prompts: list[list[int]], texts: list[str | None], max_tokens: int | None, *, echo: bool = False,
                  logprobs: int | None = None, prompt_logprobs: int | None = None,
                  params: dict | None = None, tenant_salt: str | None = None) -> GenerateRequest:
    """The fields both endpoints share, and the Requests: one per prompt (the engine forks its n
    samples), each with the prefix-cache salt of `request_cache_salt(tenant_salt, <the body's
    cache_salt>)`."""
    f = fields
    lab = served.lab
    config = served.config
    params = dict(params or {})
    n = _samples(served, f, len(prompts))
    stream = f.get("stream", (bool,), False, "true or false")
    options = f.get("stream_options", (dict,), None, "an object")
    if options is not None and not stream:
        f.fail("stream_options", "is only allowed with stream: true")
    opts = Fields(options or {}, "stream_options.")
    include_usage = opts.get("include_usage", (bool,), False, "true or false")
    continuous_usage = opts.get("continuous_usage_stats", (bool,), False, "true or false")
    obfuscation = opts.get("include_obfuscation", (bool,), False, "true or false")
    temperature = f.number("temperature", 1.0)
    if n > 1 and temperature == 0:
        f.fail("n", f"must be 1 when using greedy sampling (temperature 0), got {n}: the samples would be "
                    "the same (vLLM refuses it too)")
    seed = f.integer("seed", None, what="an int")
    if seed is not None and seed > 2**63 - 1 - MAX_CHOICES:
        f.fail("seed", f"must be at most 2**63 - 1 - {MAX_CHOICES} (the samples of n take seed + i), got {seed}")
    top_k = f.integer("top_k", 0, what="an int (-1 or 0: no limit)")
    top_p = f.number("top_p", 1.0)
    if truncation(f) is not None:
        texts = [None] * len(prompts)  # the prompts were cut: their text is the decoded tokens
    if max_tokens is None:  # chat without a limit: the rest of the context, as vLLM
        max_tokens = max(1, config.n_positions - max(len(p) for p in prompts))
    stop = _stop_strings(f)
    stop_ids = _stop_token_ids(f)
    ignore_eos = f.get("ignore_eos", (bool,), False, "true or false")
    eos = None if ignore_eos else served.tokenizer.eos_token_id
    args = _extra_args(served, f, max_tokens, logprobs, prompt_logprobs, params)
    cache_salt = request_cache_salt(tenant_salt, _body_cache_salt(f))
    flags = {name: f.get(name, (bool,), default, "true or false") for name, default in (
        ("include_stop_str_in_output", False), ("skip_special_tokens", True), ("return_token_ids", False),
        ("return_tokens_as_token_ids", False))}
    engine_stops = tuple(stop_ids) + ((eos,) if eos is not None and eos not in stop_ids else ())
    sampling_params = lab.SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                                         stop_token_ids=engine_stops, top_k=0 if top_k == -1 else top_k, top_p=top_p,
                                         extra_args=args)
    requests = [lab.Request(f"{response_id}-{i}-{uuid.uuid4().hex[:8]}", prompt, sampling_params,
                            cache_salt=cache_salt) for i, prompt in enumerate(prompts)]
    # Every field is read by now: what no one read is in no table.
    ignored = sorted(set(f.payload) - f.read) + sorted(f"stream_options.{k}" for k in set(opts.payload) - opts.read)
    return GenerateRequest(
        kind=kind, model=model, response_id=response_id, prompts=prompts, prompt_texts=list(texts),
        requests=requests, n=n, stream=stream, include_usage=include_usage, continuous_usage=continuous_usage,
        include_obfuscation=obfuscation, stop=stop, stop_token_ids=frozenset(engine_stops), eos_token_id=eos,
        min_tokens=(args or {}).get("min_tokens", 0), echo=echo, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, params=params, ignored=tuple(ignored), **flags)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
