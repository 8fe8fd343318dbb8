"""The chat endpoint's choices (vLLM: `vllm/entrypoints/openai/serving_chat.py`): a `message`,
or a stream of `delta`s that opens with each choice's role, and the chat API's logprobs. The
messages and the template that makes them one prompt are `chat.py`'s."""

from __future__ import annotations

from .output import Delta, LogprobFormatter
from .protocol import GenerateRequest, ServedModel


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
