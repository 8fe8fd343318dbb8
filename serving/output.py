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

from checkpoints.tokenizer import IncrementalDetokenizer


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
    """One choice (one engine request), fed the engine's step outputs in order.

    Invariant: `text[:sent]` has been released and contains no stop string, nor the start of one
    that the text after it could complete; once finished, all of `text` is released.

    `stop_token_ids`: the tokens that end the request in the engine (its own and, unless
    ignore_eos, `eos_token_id`): such a token stays in `token_ids` but not in the text, unless
    include_stop_str_in_output. Stop strings are matched only in text that tokens after the
    first `min_tokens` added (a stop string may begin before), as vLLM matches them.
    """

    def __init__(self, index: int, tokenizer, stop: tuple[str, ...] = (),
                 stop_token_ids: frozenset[int] = frozenset(), include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True, eos_token_id: int | None = None, min_tokens: int = 0):
        self.index = index
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop = stop
        self.stop_token_ids = stop_token_ids
        self.include_stop = include_stop_str_in_output
        self.eos_token_id = eos_token_id
        self.min_tokens = min_tokens
        self.text = ""
        self.sent = 0
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
        """Take one step output of this choice's request (its new tokens) and release what can be
        sent now."""
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        first = len(self.token_ids)
        new = out.new_token_ids
        for k, token in enumerate(new):
            self.token_ids.append(token)
            self.offsets.append(len(self.text))
            self.logprobs.append(out.logprobs[k] if out.logprobs else None)
            is_stop_token = out.finish_reason == "stop" and k == len(new) - 1 and token in self.stop_token_ids
            if is_stop_token and not self.include_stop:
                continue
            before = len(self.text)
            piece = self.detokenizer.add(token)
            self.offsets[-1] += own_text_start(self.detokenizer.tokenizer, token, piece)
            self.text += piece
            if self.stop and len(self.token_ids) > self.min_tokens and self._cut_at_stop_string(before):
                break
        if out.finished and not self.finished:
            self.text += self.detokenizer.flush()
            self.finish_reason = out.finish_reason
            if out.finish_reason == "stop" and self.token_ids and self.token_ids[-1] != self.eos_token_id:
                self.stop_reason = self.token_ids[-1]  # the stop token, as vLLM reports it (None for EOS)
        release = len(self.text) if self.finished else len(self.text) - self._hold_back()
        text, self.sent = self.text[self.sent:release], max(self.sent, release)
        return Delta(text, self.token_ids[first:], self.logprobs[first:], self.offsets[first:],
                     self.finish_reason, self.stop_reason)

    def _cut_at_stop_string(self, before: int) -> bool:
        """Look for a stop string that ends in the text added since `before`; cut at the one
        that is complete first, reading left to right (of two complete at the same character,
        the longer): the answer is the same however the text was split into tokens."""
        found = [(at + len(s), -len(s), at, s) for s in self.stop
                 if (at := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
        if not found:
            return False
        *_, at, s = min(found)
        self.text = self.text[:at + len(s) if self.include_stop else at]
        self.finish_reason, self.stop_reason, self.stopped_by_string = "stop", s, True
        return True

    def _hold_back(self) -> int:
        """Characters at the end of the unreleased text that begin some stop string."""
        if not self.stop or self.sent == len(self.text):
            return 0
        tail = self.text[self.sent:]
        last = self.text[-1]
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(tail)), longest, -1):
                if s[k - 1] == last and tail.endswith(s[:k]):
                    longest = k
                    break
        return longest


# --- logprobs, in OpenAI's two formats ----------------------------------------------------


def ranked(entry) -> list[tuple[int, float, int]]:
    """One position's logprobs from the engine ({token id: sampling.Logprob}) as
    [(token id, logprob, rank)], best first."""
    if entry is None:
        return []
    return sorted(((int(t), float(v.logprob), int(v.rank)) for t, v in entry.items()), key=lambda p: -p[1])


class LogprobFormatter:
    """Token strings and OpenAI's logprobs objects for one tokenizer."""

    def __init__(self, tokenizer, as_token_ids: bool = False):
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids

    def token(self, token_id: int) -> str:
        if self.as_token_ids:  # vLLM's return_tokens_as_token_ids: "token_id:{id}"
            return f"token_id:{token_id}"
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    def completion(self, token_ids: list[int], entries: list, offsets: list[int], k: int) -> dict:
        """The completions API's `logprobs`: tokens, token_logprobs, top_logprobs, text_offset
        (an entry of None, the first prompt token's, gives nulls)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": list(offsets)}
        for token_id, entry in zip(token_ids, entries):
            pairs = [(t, lp) for t, lp, _ in ranked(entry)]
            chosen = dict(pairs).get(token_id, -9999.0)  # vLLM's floor for a logprob it lacks
            out["tokens"].append(self.token(token_id))
            out["token_logprobs"].append(None if entry is None else chosen)
            # The chosen token first, then the k most likely (vLLM's order: up to k + 1 entries).
            top = [(token_id, chosen)] + [(t, lp) for t, lp in pairs[:k] if t != token_id]
            out["top_logprobs"].append(None if entry is None else self.spelled(top))
        return out

    def spelled(self, top: list[tuple[int, float]]) -> dict[str, float]:
        """`top_logprobs` keyed by text: of tokens that print alike (bytes of an unfinished
        character all print as U+FFFD), the likeliest one's value. Then the largest value is the
        position's most likely token's, and "the chosen token's logprob equals the largest value"
        (lm_eval's is_greedy) holds exactly when the chosen token was the most likely."""
        out: dict[str, float] = {}
        for token_id, logprob in top:
            text = self.token(token_id)
            out[text] = max(logprob, out.get(text, logprob))
        return out

    def chat(self, token_ids: list[int], entries: list, k: int) -> dict:
        """The chat API's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        content = []
        for token_id, entry in zip(token_ids, entries):
            pairs = [(t, lp) for t, lp, _ in ranked(entry)]
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
            str(t): {"logprob": lp, "rank": rank, "decoded_token": self.token(t)}
            for t, lp, rank in ranked(entry)} for entry in entries[:len(prompt)]]


def own_text_start(tokenizer, token_id: int, piece: str) -> int:
    """Where a token's own text starts in the `piece` its detokenizer step released: after the
    U+FFFD of earlier bytes that this token showed to be no character (0 otherwise)."""
    own = tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")
    return len(piece) - len(own) if own and len(piece) > len(own) and piece.endswith(own) else 0


def prompt_offsets(tokenizer, prompt: list[int]) -> list[int]:
    """Each prompt token's character offset in the prompt's text as echoed (for logprobs): the
    text as sent, special tokens included."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    offsets = []
    length = 0
    for token_id in prompt:
        piece = detokenizer.add(token_id)
        offsets.append(length + own_text_start(tokenizer, token_id, piece))
        length += len(piece)
    return offsets
