"""The output processor (vLLM: `vllm/v1/engine/output_processor.py` and its detokenizer): one
choice's tokens turned into text, stop strings found, logprobs formatted.

The engine knows tokens; a client asked for text. Three things happen between them, here in
the serving layer as in vLLM V1:

- Text comes from the IncrementalDetokenizer, so a character split across tokens appears
  once whole (never as U+FFFD).
- Stop strings are matched on the TEXT, across token boundaries: after each token, the search
  starts `longest stop string - 1` characters before the new text, so each token costs the
  same however long the output. On a match the text is cut before the stop string (after
  it with include_stop_str_in_output), finish_reason is "stop", stop_reason the string, and
  the caller aborts the request in the engine.
- While streaming, the longest tail of the text that is the start of some stop string is
  held back: it may yet become a stop string, and text once sent cannot be taken back.

A stop TOKEN (stop_token_ids, end-of-text) is the engine's: it stays in `token_ids` and its
text is left out unless include_stop_str_in_output (vLLM does the same).
"""

from __future__ import annotations

import dataclasses

from .tokenizer import IncrementalDetokenizer


@dataclasses.dataclass
class Delta:
    """What one update released: new text, the tokens that arrived, and their logprobs."""

    text: str
    token_ids: list[int]
    logprobs: list  # the engine's entry per new token (None when it has none)
    offsets: list[int]  # each new token's character offset in the choice's text
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def then(self, later: Delta) -> Delta:
        """This update followed by `later`, as one (a stream that sends every few tokens)."""
        return Delta(self.text + later.text, self.token_ids + later.token_ids, self.logprobs + later.logprobs,
                     self.offsets + later.offsets, later.finish_reason, later.stop_reason)


class ChoiceState:
    """One choice (one engine request) from its first RequestOutput to its finished one.

    Invariant: `text[:sent]` has been released and contains no stop string, nor the start of one
    that the text after it could complete; once finished, all of `text` is released.
    """

    def __init__(self, index: int, request, tokenizer, stop: tuple[str, ...] = (),
                 stop_token_ids: frozenset[int] = frozenset(), include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True, prompt_only: bool = False):
        self.index, self.request, self.prompt_only = index, request, prompt_only
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop, self.max_stop = stop, max(map(len, stop), default=0)
        self.stop_token_ids, self.include_stop = stop_token_ids, include_stop_str_in_output
        self.text, self.sent = "", 0
        self.token_ids: list[int] = []
        self.offsets: list[int] = []
        self.logprobs: list = []
        self.prompt_logprobs = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.stopped_by_string = False  # the caller must abort the request in the engine

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out) -> Delta:
        """Take one RequestOutput of this choice's request (its tokens so far) and release what
        can be sent now."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = getattr(out, "prompt_logprobs", None)
        first = len(self.token_ids)
        if self.prompt_only:  # echo with max_tokens 0: the prompt's logprobs were all it was run for
            self.finish_reason = "length"
            return Delta("", [], [], [], "length")
        engine_logprobs = getattr(out, "logprobs", None)
        new = out.output_token_ids[first:]
        for k, token in enumerate(new):
            position = first + k
            self.token_ids.append(token)
            self.offsets.append(len(self.text))
            self.logprobs.append(engine_logprobs[position] if engine_logprobs and position < len(engine_logprobs)
                                 else None)
            is_stop_token = (out.finished and k == len(new) - 1 and out.finish_reason == "stop"
                             and token in self.stop_token_ids)
            if is_stop_token and not self.include_stop:
                continue
            before = len(self.text)
            self.text += self.detokenizer.add(token)
            if self.stop and self._cut_at_stop_string(before):
                break
        if out.finished and not self.finished:
            self.text += self.detokenizer.flush()
            self.finish_reason = out.finish_reason
            self.stop_reason = getattr(out, "stop_reason", None)
            if self.stop_reason is None and out.finish_reason == "stop" and self.token_ids:
                self.stop_reason = self.token_ids[-1]  # the stop token, as vLLM reports it
        release = len(self.text) if self.finished else len(self.text) - self._hold_back()
        text, self.sent = self.text[self.sent:release], max(self.sent, release)
        n = len(self.token_ids) - first
        return Delta(text, self.token_ids[first:], self.logprobs[first:first + n], self.offsets[first:],
                     self.finish_reason, self.stop_reason)

    def _cut_at_stop_string(self, before: int) -> bool:
        """Look for a stop string that ends in the text added since `before`; cut there."""
        start = max(0, before - self.max_stop + 1)
        found = [(at, s) for s in self.stop if (at := self.text.find(s, start)) >= 0]
        if not found:
            return False
        at, s = min(found)
        self.text = self.text[:at + len(s) if self.include_stop else at]
        self.finish_reason, self.stop_reason, self.stopped_by_string = "stop", s, True
        return True

    def _hold_back(self) -> int:
        """Characters at the end of the unreleased text that begin some stop string."""
        if not self.stop or self.sent == len(self.text):
            return 0
        tail, last, longest = self.text[self.sent:], self.text[-1], 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(tail)), longest, -1):
                if s[k - 1] == last and tail.endswith(s[:k]):
                    longest = k
                    break
        return longest


# --- logprobs, in OpenAI's two formats ----------------------------------------------------


def ranked(entry) -> list[tuple[int, float]]:
    """One position's logprobs from the engine as [(token id, logprob)], best first. The engine
    gives a mapping token id -> logprob (a float, or an object with `.logprob` as vLLM's)."""
    if entry is None:
        return []
    items = entry.items() if hasattr(entry, "items") else entry
    pairs = [(int(t), float(getattr(v, "logprob", v))) for t, v in items]
    return sorted(pairs, key=lambda p: -p[1])


class LogprobFormatter:
    """Token strings and OpenAI's logprobs objects for one tokenizer."""

    def __init__(self, tokenizer, as_token_ids: bool = False):
        self.tokenizer, self.as_token_ids = tokenizer, as_token_ids

    def token(self, token_id: int) -> str:
        if self.as_token_ids:  # vLLM's return_tokens_as_token_ids: "token_id:{id}"
            return f"token_id:{token_id}"
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    def completion(self, token_ids: list[int], entries: list, offsets: list[int], k: int) -> dict:
        """The completions API's `logprobs`: tokens, token_logprobs, top_logprobs, text_offset
        (an entry of None, the first prompt token's, gives nulls)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": list(offsets)}
        for token_id, entry in zip(token_ids, entries):
            pairs = ranked(entry)
            chosen = dict(pairs).get(token_id, -9999.0)  # vLLM's floor for a logprob it lacks
            out["tokens"].append(self.token(token_id))
            out["token_logprobs"].append(None if entry is None else chosen)
            # The chosen token first, then the k most likely (vLLM's order: up to k + 1 entries).
            top = [(token_id, chosen)] + [(t, lp) for t, lp in pairs[:k] if t != token_id]
            out["top_logprobs"].append(None if entry is None else {self.token(t): lp for t, lp in top})
        return out

    def chat(self, token_ids: list[int], entries: list, k: int) -> dict:
        """The chat API's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        content = []
        for token_id, entry in zip(token_ids, entries):
            pairs = ranked(entry)
            content.append(self._chat_item(token_id, dict(pairs).get(token_id, -9999.0)) | {
                "top_logprobs": [self._chat_item(t, lp) for t, lp in pairs[:k]]})
        return {"content": content}

    def _chat_item(self, token_id: int, logprob: float) -> dict:
        return {"token": self.token(token_id), "logprob": logprob,
                "bytes": list(self.tokenizer.token_bytes(token_id))}

    def prompt_logprobs(self, prompt: list[int], entries) -> list | None:
        """vLLM's `prompt_logprobs`: per prompt token {id: {logprob, rank, decoded_token}}, the first null."""
        if entries is None:
            return None
        return [None if entry is None else {
            str(t): {"logprob": lp, "rank": rank + 1, "decoded_token": self.token(t)}
            for rank, (t, lp) in enumerate(ranked(entry))} for entry in entries[:len(prompt)]]


def prompt_offsets(tokenizer, prompt: list[int]) -> list[int]:
    """Each prompt token's character offset in the prompt's text (for echo with logprobs)."""
    detokenizer, offsets, length = IncrementalDetokenizer(tokenizer), [], 0
    for token_id in prompt:
        offsets.append(length)
        length += len(detokenizer.add(token_id))
    return offsets
