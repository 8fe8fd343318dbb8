"""The server's tokenizer: text <-> token ids, and text for a stream of tokens.

Minimal on purpose: the toy models' `ByteTokenizer` and the `IncrementalDetokenizer` the
server streams with. (A GPT-2 byte-level BPE with the same interface may sit beside them; the
server needs only `vocab_size`, `eos_token_id`, `special_token_ids`, `encode`, `decode` and
`token_bytes`.)

A token stands for BYTES, not text: one UTF-8 character may span several tokens. So text is
read from the joined bytes, never token by token, and a stream holds back the first bytes of a
character until the rest arrive (no U+FFFD for a character split across tokens).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class ByteTokenizer:
    """Token id = one byte of the UTF-8 text (the lab's toy models). `encode` refuses a byte
    that has no id below `vocab_size`; ids >= 256 of a larger vocabulary stand for no bytes."""

    eos_token_id: int | None = None  # the toy models have no end-of-text token
    special_token_ids: frozenset[int] = frozenset()

    def __init__(self, vocab_size: int = 256):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        data = text.encode("utf-8")  # a lone surrogate raises UnicodeEncodeError, a ValueError
        if data and max(data) >= self.vocab_size:
            byte = next(b for b in data if b >= self.vocab_size)
            raise ValueError(f"text: byte {byte} of its UTF-8 has no token in this model's vocabulary "
                             f"of {self.vocab_size} (token id = byte value)")
        return list(data)

    def token_bytes(self, token_id: int) -> bytes:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token_id {token_id!r} is outside the vocabulary 0..{self.vocab_size - 1}")
        return bytes([token_id]) if token_id < 256 else b""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return b"".join(self.token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")


class IncrementalDetokenizer:
    """Text for a stream of tokens, one token at a time.

    `add(token_id)` returns the text this token completes ("" for the first bytes of a
    character still waiting for the rest); `flush()` ends the stream (an incomplete character
    left over becomes U+FFFD). Invariant: the joined texts of every `add` and the `flush` equal
    `tokenizer.decode(token_ids, skip_special_tokens)`.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        if self.skip_special_tokens and token_id in self.tokenizer.special_token_ids:
            return ""
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
