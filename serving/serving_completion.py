"""The completions endpoint's choices (vLLM: `vllm/entrypoints/openai/serving_completion.py`):
the text (after the echoed prompt with `echo`), OpenAI's completions logprobs with the
characters' offsets, vLLM's `prompt_logprobs` and token ids."""

from __future__ import annotations

from .output import Delta, LogprobFormatter, prompt_offsets
from .protocol import GenerateRequest, ServedModel


class CompletionFormat:
    """A `text_completion` choice, whole or streamed."""

    whole, chunk = "text_completion", "text_completion"

    def __init__(self, served: ServedModel):
        self.tokenizer = served.tokenizer

    def opening(self, ordered: list) -> list[dict]:
        """The choices a stream starts with, before any token: none."""
        return []

    def prompt_of(self, gen: GenerateRequest, index: int) -> tuple[list[int], str]:
        """A choice's prompt: its token ids and its text (for a prompt of token ids, decoded the
        first time echo or logprobs ask for it, not for every request)."""
        i = index // gen.n
        if gen.prompt_texts[i] is None:
            gen.prompt_texts[i] = self.tokenizer.decode(gen.prompts[i])
        return gen.prompts[i], gen.prompt_texts[i]

    @staticmethod
    def prompt_logprobs(gen: GenerateRequest, ordered: list, index: int):
        """The prompt's logprobs, which the prompt's sample 0 brought (its siblings share the prompt)."""
        return ordered[index - index % gen.n].prompt_logprobs

    def choice(self, gen: GenerateRequest, ordered: list, state, delta: Delta | None, first: bool) -> dict:
        """One choice object: the whole answer (`delta` None) or one streamed piece; `first`: the
        choice's first piece (it carries the echo, the prompt's logprobs and token ids)."""
        tokens, entries = (state.token_ids, state.logprobs) if delta is None else (delta.token_ids, delta.logprobs)
        offsets = state.offsets if delta is None else delta.offsets
        text = state.text if delta is None else delta.text
        choice: dict = {"index": state.index, "text": (self.prompt_of(gen, state.index)[1] if gen.echo and first
                                                       else "") + text}
        choice["logprobs"] = self._logprobs(gen, ordered, state, tokens, entries, offsets, first)
        choice["finish_reason"] = state.finish_reason if delta is None else delta.finish_reason
        choice["stop_reason"] = state.stop_reason if delta is None else delta.stop_reason
        if gen.prompt_logprobs is not None and first:
            fmt = LogprobFormatter(self.tokenizer, gen.return_tokens_as_token_ids)
            choice["prompt_logprobs"] = fmt.prompt_logprobs(self.prompt_of(gen, state.index)[0],
                                                            self.prompt_logprobs(gen, ordered, state.index))
        if gen.return_token_ids:
            if first:
                choice["prompt_token_ids"] = list(self.prompt_of(gen, state.index)[0])
            choice["token_ids"] = list(tokens)
        return choice

    def _logprobs(self, gen: GenerateRequest, ordered: list, state, token_ids, entries, offsets,
                  first: bool) -> dict | None:
        if gen.logprobs is None:
            return None
        fmt = LogprobFormatter(self.tokenizer, gen.return_tokens_as_token_ids)
        if gen.echo:  # the choice's text starts with the prompt's: offsets move past it
            prompt, text = self.prompt_of(gen, state.index)
            offsets = [o + len(text) for o in offsets]
            if first:
                scores = self.prompt_logprobs(gen, ordered, state.index)
                entries = list(scores or [None] * len(prompt))[:len(prompt)] + list(entries)
                token_ids = list(prompt) + list(token_ids)
                offsets = prompt_offsets(self.tokenizer, prompt) + offsets
        return fmt.completion(token_ids, entries, offsets, gen.logprobs)
