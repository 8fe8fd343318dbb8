"""`/v1/chat/completions` (vLLM: `vllm/entrypoints/openai/serving_chat.py`, `chat_utils.py`): messages
rendered to one prompt by a plain chat template, and the endpoint's choices.

The toy models were never trained on a conversation format, so there is no "right" template:
this one is plain, documented and the same for every model (a real checkpoint's own template,
Jinja in its tokenizer_config.json, is not read; `chat_template` in a request is refused):

    system: You are terse.
    user: Hi!
    assistant: Hello.
    user: And now?
    assistant:

Each message is `{role}: {content}` and a newline; with `add_generation_prompt` (the default)
the prompt ends with `assistant:` so that the model writes the assistant's turn. With
`continue_final_message` the last message must be the assistant's, and it is left open (no
newline, no generation prompt) for the model to continue. Content is a string or a list of
parts `{"type": "text", "text": ...}`, joined with newlines (vLLM's default for text parts).
A message's `name`, `tool_calls`, `audio` or `refusal` has no place in this template: a 400.

A choice is a `message`, or a stream of `delta`s that opens with each choice's role, with the
chat API's logprobs (`ChatFormat`).
"""

from __future__ import annotations

from . import protocol
from .output import Delta, LogprobFormatter
from .protocol import APIError, Fields, GenerateRequest, ServedModel, check_text

ROLES = ("system", "developer", "user", "assistant")  # "developer" is OpenAI's newer name for system
GENERATION_PROMPT = "assistant:"


def render_chat(messages: list[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> str:
    """The prompt text for `messages` (already checked by `parse_messages`), as documented above."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    if continue_final_message:
        return "\n".join(lines)
    return "".join(line + "\n" for line in lines) + (GENERATION_PROMPT if add_generation_prompt else "")


def parse_messages(value: object) -> list[dict]:
    """`messages` as [{"role", "content": str}]; a 400 naming the message and field otherwise."""
    if not isinstance(value, list) or not value:
        raise APIError("messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(f"{where} must be an object with role and content", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise APIError(f"{where}.role must be one of {', '.join(ROLES)} (tool and function messages need "
                           f"tools, which this server does not support), got {role!r}", param=f"{where}.role")
        for name in ("name", "tool_calls", "function_call", "audio", "refusal"):  # the template has no place for them
            if message.get(name) not in (None, []):
                raise APIError(f"{where}.{name} is not supported by this server", param=f"{where}.{name}")
        out.append({"role": role, "content": _content(message.get("content"), where)})
    return out


def _content(content: object, where: str) -> str:
    if isinstance(content, str):
        return check_text(content, f"{where}.content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise APIError(f"{where}.content[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}} "
                               f"(images and audio are not supported)", param=f"{where}.content[{j}]")
            texts.append(check_text(part["text"], f"{where}.content[{j}].text"))
        return "\n".join(texts)
    raise APIError(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")


def parse_chat_request(served: protocol.ServedModel, body: bytes | dict,
                       tenant_salt: str | None = None) -> GenerateRequest:
    """A `/v1/chat/completions` body as a GenerateRequest (one prompt: the rendered messages);
    an APIError otherwise (400 naming the field, 404 for another model). `tenant_salt`: as
    `protocol.request_cache_salt` takes it."""
    payload = protocol.load_json(body) if isinstance(body, bytes) else body
    f = Fields(payload)
    model = protocol.check_model(f, served)
    protocol.refuse_unsupported(f, protocol.UNSUPPORTED_COMMON | protocol.UNSUPPORTED_CHAT)
    f.read.add("messages")
    messages = parse_messages(payload.get("messages"))
    add_generation_prompt = f.get("add_generation_prompt", (bool,), True, "true or false")
    continue_final = f.get("continue_final_message", (bool,), False, "true or false")
    if continue_final and (add_generation_prompt and "add_generation_prompt" in payload):
        f.fail("continue_final_message", "and add_generation_prompt cannot both be true")
    if continue_final and messages[-1]["role"] != "assistant":
        f.fail("continue_final_message", "needs the last message to be the assistant's")
    text = render_chat(messages, add_generation_prompt and not continue_final, continue_final)
    prompt = protocol.prompt_ids(text, served.tokenizer, "messages", protocol.truncation(f))
    # max_completion_tokens is OpenAI's newer name, max_tokens the deprecated one: both are checked.
    params = {"prompt_token_ids": "messages", "max_tokens": "max_tokens"}
    max_tokens = f.integer("max_tokens", None, 1, what="an int >= 1")
    newer = f.integer("max_completion_tokens", None, 1, what="an int >= 1")
    if newer is not None:  # the newer name wins when both are sent
        max_tokens, params["max_tokens"] = newer, "max_completion_tokens"
    want_logprobs = f.get("logprobs", (bool,), False, "true or false")
    top = f.integer("top_logprobs", None, what="an int")
    if top and not want_logprobs:  # top_logprobs 0 asks for nothing (vLLM's default)
        f.fail("top_logprobs", "needs logprobs: true")
    params["logprobs"] = "top_logprobs" if top else "logprobs"
    prompt_logprobs = f.integer("prompt_logprobs", None, what="an int")
    return protocol.build_request(served, f, "chat", model, f"chatcmpl-{protocol.base_id(f)}", [prompt], [text],
                                  max_tokens, logprobs=(top or 0) if want_logprobs else None,
                                  prompt_logprobs=prompt_logprobs, params=params, tenant_salt=tenant_salt)


class ChatFormat:
    """A `chat.completion` choice, or a `chat.completion.chunk`'s."""

    whole, chunk = "chat.completion", "chat.completion.chunk"

    def __init__(self, served: ServedModel):
        self.tokenizer = served.tokenizer

    def opening(self, ordered: list) -> list[dict]:
        """Every choice's role first, before any content, as vLLM streams them."""
        return [{"index": s.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for s in ordered]

    def choice(self, gen: GenerateRequest, ordered: list, state, delta: Delta | None, first: bool) -> dict:
        """One choice object: the whole answer (`delta` None) or one streamed piece."""
        tokens, entries = (state.token_ids, state.logprobs) if delta is None else (delta.token_ids, delta.logprobs)
        text = state.text if delta is None else delta.text
        fmt = LogprobFormatter(self.tokenizer, gen.return_tokens_as_token_ids)
        choice: dict = {"index": state.index}
        if delta is None:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["delta"] = {"content": text}
        choice["logprobs"] = None if gen.logprobs is None else fmt.chat(tokens, entries, gen.logprobs)
        choice["finish_reason"] = state.finish_reason if delta is None else delta.finish_reason
        choice["stop_reason"] = state.stop_reason if delta is None else delta.stop_reason
        if gen.prompt_logprobs is not None and first:
            choice["prompt_logprobs"] = fmt.prompt_logprobs(gen.prompts[0], ordered[0].prompt_logprobs)
        if gen.return_token_ids:
            if first:
                choice["prompt_token_ids"] = list(gen.prompts[0])
            choice["token_ids"] = list(tokens)
        return choice
