"""Tokenizers the server uses for every model: text <-> token ids, and streaming text.

Two tokenizers share one interface (`Tokenizer`):

- `ByteTokenizer(vocab_size)`: the toy models' tokenizer. Token id = the value of one UTF-8
  byte, so any text encodes with no vocabulary file; a byte with no id below `vocab_size` is
  refused.
- `GPT2Tokenizer`: GPT-2's byte-level BPE, read from a checkpoint's `vocab.json` and
  `merges.txt` (`GPT2Tokenizer.from_dir(path)`).

Both map a token id to BYTES, not to text: a byte-level token may hold half of a character (an
emoji is four bytes, often two tokens). Decoding joins the bytes first and only then reads them
as UTF-8. `IncrementalDetokenizer` does the same one token at a time for streaming: it returns
only the text that is complete and holds back the first bytes of a character until the rest
arrive.

Standard library only: no `regex`, no `tokenizers`; see `GPT2Tokenizer` for what that costs.
"""

from __future__ import annotations

import codecs
import functools
import json
import math
import os
import re
import sys
import unicodedata
from collections.abc import Iterable, Sequence
from typing import Protocol

ENDOFTEXT = "<|endoftext|>"


class Tokenizer(Protocol):
    """What the server needs of a tokenizer."""

    vocab_size: int  # ids are 0..vocab_size-1 (not every id need have a token)
    eos_token_id: int | None  # the token that ends a document, or None
    special_token_ids: frozenset[int]  # ids whose text is a marker, not content

    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...


def _check_text(text: object) -> str:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return text


def _check_id(token_id: object, vocab_size: int, name: str = "token_id") -> int:
    # bool is an int to Python, never a token id here; NumPy integers are.
    if isinstance(token_id, bool) or not hasattr(token_id, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(token_id).__name__}")
    token_id = int(token_id)
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"{name} {token_id} is outside the vocabulary 0..{vocab_size - 1}")
    return token_id


def _decode_bytes(data: bytes) -> str:
    # A stray byte that starts no valid character becomes U+FFFD, as Hugging Face decodes.
    return data.decode("utf-8", errors="replace")


# --- the toy models' tokenizer -----------------------------------------------------------


class ByteTokenizer:
    """Token id = one byte of the UTF-8 text (the lab's toy models, vocab_size 256).

    `encode` refuses a byte >= vocab_size (a model with a smaller vocabulary cannot see it);
    ids 256.. of a larger vocabulary have no bytes, so they decode to nothing.
    """

    eos_token_id = None
    special_token_ids: frozenset[int] = frozenset()

    def __init__(self, vocab_size: int = 256):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        data = _check_text(text).encode("utf-8")
        for offset, byte in enumerate(data):
            if byte >= self.vocab_size:
                raise ValueError(f"text: byte {byte} (0x{byte:02x}) at byte offset {offset} of its UTF-8 has no "
                                 f"token in this model's vocabulary of {self.vocab_size} (token id = byte value)")
        return list(data)

    def token_bytes(self, token_id: int) -> bytes:
        token_id = _check_id(token_id, self.vocab_size)
        return bytes([token_id]) if token_id < 256 else b""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return _decode_bytes(b"".join(self.token_bytes(t) for t in token_ids))


# --- GPT-2's byte-level BPE --------------------------------------------------------------


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's alphabet: every byte value as one printable character.

    BPE works on strings, and a vocabulary file should hold no control characters or spaces, so
    each byte stands for a character: the 188 printable Latin-1 bytes for themselves, and the 68
    others (controls, space, NBSP, soft hyphen) for the characters from U+0100 on, in byte order.
    So a space is "Ġ" (U+0120) and a newline "Ċ" (U+010A), as seen throughout GPT-2's vocab.json.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    mapping = {b: chr(b) for b in printable}
    mapping.update({b: chr(256 + n) for n, b in enumerate(others)})
    return mapping


def _class_of(categories: str) -> str:
    """A regex character class body listing every code point whose Unicode general category
    starts with one of `categories` ("L": letters, "N": numbers), as ranges."""
    ranges: list[tuple[int, int]] = []
    for cp in range(sys.maxunicode + 1):
        if unicodedata.category(chr(cp))[0] in categories:
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1] = (ranges[-1][0], cp)
            else:
                ranges.append((cp, cp))
    return "".join(f"\\U{lo:08x}" if lo == hi else f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ranges)


# Unicode's White_Space property, which is what `\s` means in GPT-2's pattern. (Python's `\s`
# also matches U+001C..U+001F, the information separators, which are not White_Space.)
_WHITE_SPACE = "\\t\\n\\x0b\\x0c\\r \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000"


@functools.cache
def gpt2_pretokenize_pattern() -> re.Pattern:
    """GPT-2's pre-tokenisation regex, for Python's `re`.

    GPT-2 splits text into words before BPE with
        's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+
    (contractions; a word of letters, of digits, or of other symbols, each with at most one
    leading space; runs of white space, the last space of a run left to start the next word).
    Python's `re` has no `\\p{L}` (letters) or `\\p{N}` (numbers). The usual stand-in,
    `[^\\W\\d_]` for letters, also takes the numbers that are not decimal digits ("²", "½",
    "Ⅻ") as letters, so " x²" would be one word instead of " x", "²". Here both classes are
    spelled out instead, code point by code point, from `unicodedata` (built once, ~0.3 s), and
    `\\s` is Unicode's White_Space list. The result can still differ from GPT-2's own regex only
    for a character whose category changed between Unicode versions, or that is unassigned in
    this Python's Unicode (`unicodedata.unidata_version`) and assigned in the `regex` module's
    (new emoji, new scripts): such a character counts as "other" here. (Checked against the
    `regex` module with every code point between letters, digits and spaces: under Python
    3.11's Unicode 14.0, every one of the 14,049 differences was a code point unassigned here.)
    """
    letters, numbers = _class_of("L"), _class_of("N")
    return re.compile(
        rf"""'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{numbers}]+| ?[^{_WHITE_SPACE}{letters}{numbers}]+"""
        rf"""|[{_WHITE_SPACE}]+(?![^{_WHITE_SPACE}])|[{_WHITE_SPACE}]+"""
    )


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file; a GPT-2 directory holds {what}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot be read as UTF-8 text: {exc}") from None


class GPT2Tokenizer:
    """GPT-2's byte-level BPE (Radford et al. 2019, "Language Models are Unsupervised Multitask
    Learners", section 2.2), from the two files every GPT-2 checkpoint ships.

    `vocab` maps a token, written in the `bytes_to_unicode` alphabet, to its id; `merges` lists
    the merges in priority order (rank 0 first). Encoding: special tokens (`<|endoftext|>`) are
    cut out of the text first; the rest is split into words by `gpt2_pretokenize_pattern()`;
    each word's UTF-8 bytes become alphabet characters, and the adjacent pair of lowest rank is
    merged, everywhere in the word, until no pair of the word has a rank. Each piece is a token.

    Special tokens: the exact text `<|endoftext|>` in a prompt becomes the end-of-text token, as
    Hugging Face's GPT-2 tokenizer does (pass `allow_special=False` to `encode` to read it as
    plain text instead). `decode` writes a special token as its text unless
    `skip_special_tokens`; the server skips it (it ends the answer as a stop token anyway).

    Invariants: `decode(encode(text)) == text` for every text whose bytes all have tokens (every
    GPT-2 vocabulary has all 256); a byte without a token is a ValueError naming it. Checked
    when the files are read: every merge's result is in the vocabulary, ids are unique.
    """

    def __init__(self, vocab: dict[str, int], merges: Sequence[tuple[str, str]],
                 special_tokens: Iterable[str] = (ENDOFTEXT,), vocab_size: int | None = None):
        if not vocab:
            raise ValueError("vocab is empty")
        top = max(vocab.values())
        if vocab_size is not None and top >= vocab_size:
            raise ValueError(f"token {max(vocab, key=vocab.get)!r} has id {top}, but the model's vocab_size is "
                             f"{vocab_size}: the model has no row for it")
        self._vocab = dict(vocab)
        self._ranks: dict[tuple[str, str], int] = {}
        for rank, (a, b) in enumerate(merges):
            if a + b not in vocab:
                raise ValueError(f"merge {rank} ({a!r} + {b!r}) makes {a + b!r}, which is not in the vocabulary")
            self._ranks.setdefault((a, b), rank)
        self.vocab_size = top + 1 if vocab_size is None else vocab_size
        self.special_tokens = {text: vocab[text] for text in special_tokens if text in vocab}
        self.special_token_ids = frozenset(self.special_tokens.values())
        self.eos_token_id = self.special_tokens.get(ENDOFTEXT)
        self._byte_encoder = bytes_to_unicode()
        self._byte_decoder = byte_decoder = {char: byte for byte, char in self._byte_encoder.items()}
        self._bytes_of: dict[int, bytes] = {}
        for token, token_id in vocab.items():
            if token_id in self.special_token_ids:
                self._bytes_of[token_id] = token.encode("utf-8")
            elif all(ch in byte_decoder for ch in token):
                self._bytes_of[token_id] = bytes(byte_decoder[ch] for ch in token)
            else:  # not in the byte alphabet: some other added token; its text is itself
                self._bytes_of[token_id] = token.encode("utf-8")
        self._special_split = (re.compile("(" + "|".join(map(re.escape, sorted(self.special_tokens, key=len,
                                                                                  reverse=True))) + ")")
                               if self.special_tokens else None)
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_files(cls, vocab_path: str | os.PathLike, merges_path: str | os.PathLike,
                   vocab_size: int | None = None) -> GPT2Tokenizer:
        """Read `vocab.json` and `merges.txt`; a missing or malformed file is a ValueError naming it.
        `vocab_size`: the model's, when its embedding has more rows than vocab.json has ids."""
        vocab_path, merges_path = os.fspath(vocab_path), os.fspath(merges_path)
        try:
            vocab = json.loads(_read_text(vocab_path, "vocab.json"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{vocab_path}: not valid JSON: {exc}") from None
        if not isinstance(vocab, dict):
            raise ValueError(f"{vocab_path}: expected a JSON object of token -> id, got {type(vocab).__name__}")
        seen: dict[int, str] = {}
        for token, token_id in vocab.items():
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"{vocab_path}: token {token!r} has id {token_id!r}; ids are ints >= 0")
            if token_id in seen:
                raise ValueError(f"{vocab_path}: id {token_id} belongs to both {seen[token_id]!r} and {token!r}")
            seen[token_id] = token
        merges = []
        for number, line in enumerate(_read_text(merges_path, "merges.txt").splitlines(), start=1):
            if line.startswith("#version") or not line.strip():
                continue  # the header, and blank lines (a trailing newline)
            parts = line.split(" ")
            if len(parts) != 2 or not all(parts):
                raise ValueError(f"{merges_path}:{number}: expected two tokens separated by one space, got {line!r}")
            merges.append((parts[0], parts[1]))
        if vocab_size is not None and max(vocab.values(), default=-1) >= vocab_size:
            top = max(vocab, key=vocab.get)
            raise ValueError(f"{vocab_path}: token {top!r} has id {vocab[top]}, but the model's vocab_size is "
                             f"{vocab_size}: the model has no row for it")
        if not vocab:
            raise ValueError(f"{vocab_path}: the vocabulary is empty")
        try:
            return cls(vocab, merges, vocab_size=vocab_size)
        except ValueError as exc:
            raise ValueError(f"{merges_path}: {exc}") from None

    @classmethod
    def from_dir(cls, path: str | os.PathLike, vocab_size: int | None = None) -> GPT2Tokenizer:
        """The tokenizer of a Hugging Face GPT-2 directory (its vocab.json and merges.txt)."""
        return cls.from_files(os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt"), vocab_size)

    # --- encoding ----------------------------------------------------------------------

    def _bpe(self, word: str) -> list[str]:
        """Merge the word's lowest-ranked adjacent pair, at every place it occurs, until no
        adjacent pair has a rank."""
        parts = list(word)
        while len(parts) > 1:
            pair = min(zip(parts, parts[1:]), key=lambda p: self._ranks.get(p, math.inf))
            if pair not in self._ranks:
                break
            merged = []
            i = 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == pair:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def _encode_word(self, word: str) -> list[int]:
        ids = self._cache.get(word)
        if ids is None:
            data = word.encode("utf-8")
            ids = []
            for piece in self._bpe("".join(self._byte_encoder[b] for b in data)):
                if piece not in self._vocab:  # merges' results are checked: only a lone byte can miss
                    byte = self._byte_decoder[piece]
                    raise ValueError(f"text: byte 0x{byte:02x} (in {word!r}) has no token in this vocabulary")
                ids.append(self._vocab[piece])
            if len(self._cache) > 50_000:  # a bounded memo: prompts repeat words, not whole texts
                self._cache.clear()
            self._cache[word] = ids
        return list(ids)

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of `text`. With `allow_special`, `<|endoftext|>` in the text is its token."""
        text = _check_text(text)
        chunks = self._special_split.split(text) if allow_special and self._special_split else [text]
        ids: list[int] = []
        for i, chunk in enumerate(chunks):
            if i % 2:  # re.split puts the separators (the special tokens) at odd indices
                ids.append(self.special_tokens[chunk])
            else:
                for word in gpt2_pretokenize_pattern().findall(chunk):
                    ids += self._encode_word(word)
        return ids

    # --- decoding ----------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token: its text in UTF-8). An id with no
        token (a gap in vocab.json's ids, or a padding row of the model past its last id) has
        none: a model may sample it, and it must not break the stream."""
        return self._bytes_of.get(_check_id(token_id, self.vocab_size), b"")

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return _decode_bytes(b"".join(self.token_bytes(t) for t in token_ids
                                      if not (skip_special_tokens and t in self.special_token_ids)))

    def same_vocabulary(self, other: object) -> bool:
        """True when `other` encodes and decodes exactly as this tokenizer (a draft model must
        share its target's tokens)."""
        return (isinstance(other, GPT2Tokenizer) and self._vocab == other._vocab and self._ranks == other._ranks
                and self.special_tokens == other.special_tokens)


def prompt_token_ids(tokenizer: Tokenizer, prompt: object) -> list[int]:
    """A request's prompt as token ids: a string encoded by `tokenizer`, or a list of ids given
    as they are (each an int inside the vocabulary). Anything else, an empty prompt, or text the
    tokenizer cannot encode is a ValueError whose message starts with "prompt", for the server's
    HTTP 400."""
    if isinstance(prompt, str):
        try:
            token_ids = tokenizer.encode(prompt)
        except ValueError as exc:
            raise ValueError(f"prompt: {exc}") from None
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        outside = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
        if outside:
            raise ValueError(f"prompt: token id {outside[0]} is outside the vocabulary 0..{tokenizer.vocab_size - 1}")
        token_ids = list(prompt)
    else:
        raise ValueError("prompt must be a string or a list of token ids (ints)")
    if not token_ids:
        raise ValueError("prompt is empty; expected at least one token")
    return token_ids


# --- streaming text ----------------------------------------------------------------------


class IncrementalDetokenizer:
    """Text for a stream of tokens, one token at a time.

    `add(token_id)` returns the text that the new token completes, and nothing for the first
    bytes of a character still waiting for the rest (a 4-byte emoji split over two tokens shows
    up whole with the second). Bytes that can start no valid character are not held: they come
    out as U+FFFD at once. `flush()` ends the stream: an incomplete character left at the end
    becomes U+FFFD. Invariant: the texts of every `add` and the `flush`, joined, equal
    `tokenizer.decode(token_ids, skip_special_tokens)`. (A byte-level tokenizer needs no more: a
    token's bytes never change with its neighbours, unlike SentencePiece's leading-space rule
    that makes vLLM's detokenizer re-decode a window of previous tokens.)
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """The newly complete text after one more token."""
        if self.skip_special_tokens and token_id in self.tokenizer.special_token_ids:
            return ""
        return self._decoder.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """The rest at the end of the stream (U+FFFD for an incomplete character); the
        detokenizer is empty afterwards."""
        return self._decoder.decode(b"", final=True)
