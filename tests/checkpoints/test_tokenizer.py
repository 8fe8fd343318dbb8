"""GPT-2's byte-level BPE in the standard library, the byte tokenizer, and streaming text (checkpoints/tokenizer.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from checkpoints.model_loader import load_gpt2, save_gpt2
from checkpoints.tokenizer import (
    ByteTokenizer,
    GPT2Tokenizer,
    IncrementalDetokenizer,
    bytes_to_unicode,
    gpt2_pretokenize_pattern,
    prompt_token_ids,
)
from conftest import lab
from tests.support import CKPT_TINY, HAND_MERGES, HAND_VOCAB, write_tokenizer

# =====================================================================================
# Real checkpoints: a GPT-2 directory from disk, GPT-2's byte-level BPE, streaming text
# =====================================================================================
#
# Every checkpoint here is written by the test itself (a tiny config, random weights, a vocabulary
# and merges worked out by hand), with a writer of its own that shares no code with the loader.
# Nothing touches the network.



# --- GPT-2's byte-level BPE ---------------------------------------------------------------


@pytest.fixture
def hand_tokenizer(tmp_path):
    write_tokenizer(tmp_path)
    return GPT2Tokenizer.from_dir(tmp_path)


@pytest.mark.provided
def test_bytes_to_unicode_maps_every_byte_to_its_own_printable_character():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert table[ord("a")] == "a" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"
    assert all(ch.isprintable() and not ch.isspace() for ch in table.values())


@pytest.mark.provided
@pytest.mark.parametrize("text, words", [
    ("I'm here  now\n", ["I", "'m", " here", " ", " now", "\n"]),
    ("it'S", ["it", "'", "S"]),
    ("a1b 23", ["a", "1", "b", " 23"]),
    ("hello!!! ??", ["hello", "!!!", " ??"]),
    ("héllo мир 漢字", ["héllo", " мир", " 漢字"]),
    (" x² ½", [" x", "²", " ½"]),              # \p{N} beyond decimal digits, where [^\W\d_] would say "letter"
    ("a\x1cb", ["a", "\x1c", "b"]),            # an information separator is not White_Space (Python's \s says it is)
    ("e\u0301", ["e", "\u0301"]),              # a combining mark is neither a letter nor a number
])
def test_pretokenisation_splits_words_as_gpt2_does(text, words):
    assert gpt2_pretokenize_pattern().findall(text) == words


@pytest.mark.provided
@pytest.mark.parametrize("text, ids", [
    ("low", [9]),
    ("low lower lowest", [9, 11, 10, 11, 13]),
    (" ower", [7, 1, 2, 10]),                  # "e r" (rank 2) is merged before "w e" (rank 6)
    ("low<|endoftext|>low", [9, 15, 9]),
])
def test_encode_merges_by_rank_as_worked_out_by_hand(hand_tokenizer, text, ids):
    assert hand_tokenizer.encode(text) == ids
    assert hand_tokenizer.decode(ids) == text


@pytest.mark.provided
def test_a_lower_rank_changes_the_merge_order(tmp_path):
    merges = [m for m in HAND_MERGES if m != ("w", "e")]
    write_tokenizer(tmp_path, HAND_VOCAB, [("w", "e")] + merges)
    assert GPT2Tokenizer.from_dir(tmp_path).encode(" ower") == [7, 1, 14, 4]


@pytest.mark.provided
def test_end_of_text_is_the_eos_token_and_decode_can_skip_it(hand_tokenizer):
    assert hand_tokenizer.eos_token_id == 15
    assert hand_tokenizer.decode([9, 15, 9], skip_special_tokens=True) == "lowlow"


@pytest.mark.provided
def test_special_token_text_is_plain_text_when_not_allowed(tmp_path):
    vocab = {ch: b for b, ch in bytes_to_unicode().items()} | {"<|endoftext|>": 256}
    write_tokenizer(tmp_path, vocab, [])
    tokenizer = GPT2Tokenizer.from_dir(tmp_path)
    ids = tokenizer.encode("<|endoftext|>", allow_special=False)
    assert 256 not in ids and tokenizer.decode(ids) == "<|endoftext|>"


@pytest.mark.provided
def test_a_byte_without_a_token_is_a_value_error_naming_it(hand_tokenizer):
    with pytest.raises(ValueError, match="0x78"):
        hand_tokenizer.encode("lowx")


@pytest.fixture(scope="module")
def full_byte_tokenizer(tmp_path_factory):
    """Every byte plus a few merges of common English pairs: any text encodes."""
    path = tmp_path_factory.mktemp("bytes-bpe")
    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("Ã", "©")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    write_tokenizer(path, vocab, merges)
    return GPT2Tokenizer.from_dir(path)


@pytest.mark.provided
@given(st.text(max_size=60))
def test_decode_inverts_encode_for_any_text(full_byte_tokenizer, text):
    assert full_byte_tokenizer.decode(full_byte_tokenizer.encode(text)) == text


@pytest.mark.provided
def test_merges_make_fewer_tokens_for_common_text(full_byte_tokenizer):
    ids = full_byte_tokenizer.encode("the thin café")
    # "the": t+h+e, "h e" merges; " thin": "Ġ t" then "i n"; " café": only é's two bytes ("Ã ©") merge.
    assert [full_byte_tokenizer.token_bytes(t) for t in ids] == [b"t", b"he", b" t", b"h", b"in",
                                                                 b" ", b"c", b"a", b"f", "é".encode()]


@pytest.mark.provided
@pytest.mark.parametrize("vocab, merges, why", [
    ({"a": 0, "b": 0}, [], "id 0 belongs to both"),
    ({"a": 0, "b": -1}, [], "ids are ints"),
    ({"a": 0, "b": 1}, [("a", "b")], "'ab', which is not in the vocabulary"),
])
def test_an_inconsistent_vocabulary_or_merge_is_refused(tmp_path, vocab, merges, why):
    write_tokenizer(tmp_path, vocab, merges)
    with pytest.raises(ValueError, match=why):
        GPT2Tokenizer.from_dir(tmp_path)


@pytest.mark.provided
def test_a_malformed_merges_line_is_named_by_file_and_line(tmp_path):
    write_tokenizer(tmp_path)
    (tmp_path / "merges.txt").write_text("#version: 0.2\nl o\nlo  w\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"merges\.txt:3"):
        GPT2Tokenizer.from_dir(tmp_path)


# --- The byte tokenizer and streaming text ------------------------------------------------


@pytest.mark.provided
def test_byte_tokenizer_ids_are_the_utf8_bytes():
    tokenizer = ByteTokenizer(256)
    assert tokenizer.encode("aé") == [97, 0xC3, 0xA9] and tokenizer.decode([97, 0xC3, 0xA9]) == "aé"
    assert tokenizer.eos_token_id is None and tokenizer.token_bytes(0xC3) == b"\xc3"


@pytest.mark.provided
def test_byte_tokenizer_refuses_a_byte_outside_a_small_vocabulary():
    with pytest.raises(ValueError, match="byte 195"):
        ByteTokenizer(128).encode("aé")


@pytest.mark.provided
def test_byte_tokenizer_ids_past_255_have_no_bytes_and_ids_past_the_vocabulary_are_refused():
    tokenizer = ByteTokenizer(300)
    assert tokenizer.token_bytes(299) == b""
    with pytest.raises(ValueError, match="300"):
        tokenizer.decode([300])


@pytest.mark.provided
def test_a_character_split_over_tokens_appears_once_it_is_complete():
    detok = IncrementalDetokenizer(ByteTokenizer(256))
    assert [detok.add(b) for b in "a🙂".encode()] == ["a", "", "", "", "🙂"]
    assert detok.flush() == ""


@pytest.mark.provided
def test_a_byte_that_starts_no_character_is_replaced_at_once_and_an_unfinished_one_at_flush():
    detok = IncrementalDetokenizer(ByteTokenizer(256))
    assert detok.add(0xFF) == "\ufffd"
    assert detok.add(0xE2) == "" and detok.add(0x82) == ""
    assert detok.flush() == "\ufffd"


@pytest.mark.provided
@given(st.lists(st.integers(0, 255), max_size=40))
def test_streamed_text_joined_equals_decoding_all_tokens_at_once(token_ids):
    tokenizer = ByteTokenizer(256)
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add(t) for t in token_ids) + detok.flush() == tokenizer.decode(token_ids)


@pytest.mark.provided
def test_streaming_skips_the_end_of_text_token(hand_tokenizer):
    detok = IncrementalDetokenizer(hand_tokenizer)
    assert [detok.add(t) for t in [9, 15, 11]] == ["low", "", " low"]


@pytest.mark.provided
def test_the_synthetic_vocabulary_gives_every_id_text_and_round_trips(tmp_path):
    config = lab.ModelConfig(**(CKPT_TINY | {"vocab_size": 400}))
    save_gpt2(tmp_path / "m", config, lab.init_gpt2_weights(config))
    _, tokenizer = load_gpt2(lab, tmp_path / "m")
    assert all(len(tokenizer.token_bytes(t)) in (1, 2) for t in range(399)) and tokenizer.eos_token_id == 399
    assert tokenizer.decode(tokenizer.encode("a synthetic vocabulary")) == "a synthetic vocabulary"


@pytest.mark.provided
def test_a_prompt_is_text_for_the_tokenizer_or_ids_inside_its_vocabulary(hand_tokenizer):
    assert prompt_token_ids(hand_tokenizer, "low lower") == [9, 11, 10]
    assert prompt_token_ids(hand_tokenizer, [9, 15]) == [9, 15]


@pytest.mark.provided
@pytest.mark.parametrize("prompt, why", [
    ("", "prompt is empty"), ([], "prompt is empty"), ([16], "prompt: token id 16"), ("x", "prompt: .*0x78"),
    ([True], "prompt must be"), (["a"], "prompt must be"), (7, "prompt must be"),
])
def test_a_bad_prompt_is_a_value_error_that_starts_with_prompt(hand_tokenizer, prompt, why):
    with pytest.raises(ValueError, match=f"^{why}"):
        prompt_token_ids(hand_tokenizer, prompt)


@pytest.mark.provided
@given(st.lists(st.integers(0, 263), max_size=30))
def test_streaming_gpt2_tokens_joined_equals_decoding_them_without_special_tokens(full_byte_tokenizer, token_ids):
    detok = IncrementalDetokenizer(full_byte_tokenizer)
    streamed = "".join(detok.add(t) for t in token_ids) + detok.flush()
    assert streamed == full_byte_tokenizer.decode(token_ids, skip_special_tokens=True)


@pytest.mark.provided
@pytest.mark.parametrize("byte, char", [
    (0, "\u0100"), (10, "\u010a"), (32, "\u0120"), (33, "!"), (126, "~"), (127, "\u0121"), (160, "\u0142"),
    (161, "\u00a1"), (172, "\u00ac"), (173, "\u0143"), (174, "\u00ae"), (255, "\u00ff"),
])
def test_the_byte_table_is_gpt2s_at_the_edges_of_its_printable_ranges(byte, char):
    # GPT-2's encoder.py keeps the bytes of "!".."~", "¡".."¬" and "®".."ÿ" as themselves and maps the
    # other 68, in byte order, to U+0100 on: so the space is "Ġ", the newline "Ċ", DEL "ġ", NBSP "ł"
    # and the soft hyphen "Ń", as GPT-2's vocab.json spells them.
    assert bytes_to_unicode()[byte] == char, (
        f"byte {byte} must be {char!r} (U+{ord(char):04X}) in GPT-2's byte table, got {bytes_to_unicode()[byte]!r}")
