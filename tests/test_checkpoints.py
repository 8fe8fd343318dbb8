"""test_checkpoints.py"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import serving
from conftest import lab
from serving.checkpoint_commands import generate_text, speculate_checkpoints
from serving.model_loader import load_gpt2, read_safetensors, save_gpt2
from serving.tokenizer import (
    ByteTokenizer,
    GPT2Tokenizer,
    IncrementalDetokenizer,
    bytes_to_unicode,
    gpt2_pretokenize_pattern,
    prompt_token_ids,
)
from tests.support import (
    complete,
    greedy_reference,
    http_call,
)

# =====================================================================================
# Real checkpoints: a GPT-2 directory from disk, GPT-2's byte-level BPE, streaming text
# =====================================================================================
#
# Every checkpoint here is written by the test itself (a tiny config, random weights, a vocabulary
# and merges worked out by hand), with a writer of its own that shares no code with the loader.
# Nothing touches the network.


# --- An independent writer: a safetensors file is 8 bytes of header length, a JSON header, the data


CKPT_TINY = dict(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest, ties to even."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """What a float32 tensor is after a round trip through `dtype`."""
    if dtype == "F16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "BF16":
        return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)
    return x


def safetensors_bytes(tensors: dict[str, np.ndarray], dtype: str = "F32", align: bool = True) -> bytes:
    raw = {"F32": lambda x: x.astype("<f4").tobytes(), "F16": lambda x: x.astype("<f2").tobytes(),
           "BF16": lambda x: bf16_bits(x).astype("<u2").tobytes()}[dtype]
    header, blobs, offset = {}, [], 0
    for name, x in tensors.items():
        data = raw(np.asarray(x, dtype=np.float32))
        header[name] = {"dtype": dtype, "shape": list(np.shape(x)), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    if align:
        text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(blobs)


def raw_safetensors(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


# A vocabulary worked out by hand. Byte-level characters: "Ġ" is the space byte.
HAND_VOCAB = {"l": 0, "o": 1, "w": 2, "e": 3, "r": 4, "s": 5, "t": 6, "Ġ": 7,
              "lo": 8, "low": 9, "er": 10, "Ġlow": 11, "es": 12, "est": 13, "we": 14, "<|endoftext|>": 15}


HAND_MERGES = [("l", "o"), ("lo", "w"), ("e", "r"), ("Ġ", "low"), ("e", "s"), ("es", "t"), ("w", "e")]


def write_tokenizer(path: Path, vocab=HAND_VOCAB, merges=HAND_MERGES) -> None:
    (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")


def hf_config(**overrides) -> dict:
    c = CKPT_TINY | overrides
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "activation_function": "gelu_new",
            "n_ctx": c["n_positions"], "layer_norm_epsilon": 1e-5, "n_inner": None, "eos_token_id": 15,
            **c}


def write_checkpoint(path: Path, weights: dict[str, np.ndarray], dtype: str = "F32", config: dict | None = None,
                     prefix: str = "", lm_head: bool = False, align: bool = True) -> Path:
    """A Hugging Face-style GPT-2 directory: config.json, model.safetensors, vocab.json, merges.txt."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or hf_config()))
    tensors = {prefix + name: w for name, w in weights.items()}
    if lm_head:
        tensors["lm_head.weight"] = weights["wte.weight"]
    (path / "model.safetensors").write_bytes(safetensors_bytes(tensors, dtype, align))
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tiny_weights():
    return lab.init_gpt2_weights(lab.ModelConfig(**CKPT_TINY), seed=5)


@pytest.fixture
def checkpoint(tmp_path, tiny_weights):
    return write_checkpoint(tmp_path / "gpt2-tiny", tiny_weights)


PROMPT = list(range(1, 21))


# --- Loading weights: every dtype and name style gives the model that was written ---------


@pytest.mark.provided
def test_f32_checkpoint_gives_exactly_the_logits_of_the_weights_written(tmp_path, tiny_weights):
    model, _ = load_gpt2(lab, write_checkpoint(tmp_path / "m", tiny_weights, "F32"))
    reference = lab.ToyTransformer(lab.ModelConfig(**CKPT_TINY), tiny_weights)
    assert np.array_equal(model.forward_dense(PROMPT), reference.forward_dense(PROMPT)), \
        "an F32 checkpoint must load bit for bit"


@pytest.mark.provided
@pytest.mark.parametrize("dtype, unit_roundoff", [("F16", 2.0**-11), ("BF16", 2.0**-8)])
def test_half_precision_checkpoint_loads_the_rounded_weights_as_float32(tmp_path, tiny_weights, dtype, unit_roundoff):
    model, _ = load_gpt2(lab, write_checkpoint(tmp_path / "m", tiny_weights, dtype))
    for name, w in tiny_weights.items():
        loaded = model.weights[name]
        assert loaded.dtype == np.float32, f"{name} must become float32, got {loaded.dtype}"
        assert np.array_equal(loaded, rounded(w, dtype)), f"{name}: {dtype} must be widened exactly (bits, not values)"
    exact = lab.ToyTransformer(lab.ModelConfig(**CKPT_TINY), tiny_weights).forward_dense(PROMPT)
    diff = float(np.abs(model.forward_dense(PROMPT) - exact).max())
    # Rounding every weight by <= u moves a 2-layer model's logits by a few dozen u at most.
    assert diff <= 50 * unit_roundoff * float(np.abs(exact).max()), f"{dtype} logits drifted by {diff}"


@pytest.mark.provided
def test_names_with_the_transformer_prefix_and_a_tied_lm_head_load_the_same_model(tmp_path, tiny_weights):
    plain, _ = load_gpt2(lab, write_checkpoint(tmp_path / "plain", tiny_weights))
    prefixed, _ = load_gpt2(lab, write_checkpoint(tmp_path / "hf", tiny_weights, prefix="transformer.", lm_head=True))
    assert np.array_equal(plain.forward_dense(PROMPT), prefixed.forward_dense(PROMPT))


@pytest.mark.provided
def test_causal_mask_buffers_in_the_file_are_skipped(tmp_path, tiny_weights):
    n = CKPT_TINY["n_positions"]
    mask = {f"h.{i}.attn.bias": np.tril(np.ones((1, 1, n, n))) for i in range(CKPT_TINY["n_layer"])}
    model, _ = load_gpt2(lab, write_checkpoint(tmp_path / "m", tiny_weights | mask))
    assert np.array_equal(model.weights["wte.weight"], tiny_weights["wte.weight"])


@pytest.mark.provided
def test_an_unaligned_data_section_still_loads_exactly(tmp_path, tiny_weights):
    model, _ = load_gpt2(lab, write_checkpoint(tmp_path / "m", tiny_weights, align=False))
    reference = lab.ToyTransformer(lab.ModelConfig(**CKPT_TINY), tiny_weights)
    assert np.array_equal(model.forward_dense(PROMPT), reference.forward_dense(PROMPT))


@pytest.mark.provided
def test_f32_tensors_are_read_only_views_of_the_mapped_file(checkpoint):
    wte = read_safetensors(checkpoint / "model.safetensors")["wte.weight"]
    assert not wte.flags.writeable and not wte.flags.owndata, "F32 tensors must be memory-mapped, not copied"


@pytest.mark.provided
def test_config_json_gives_the_model_config(checkpoint):
    model, _ = load_gpt2(lab, checkpoint)
    assert model.config == lab.ModelConfig(**CKPT_TINY, layer_norm_epsilon=1e-5)


@pytest.mark.provided
@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_save_gpt2_writes_what_load_gpt2_and_the_independent_reader_agree_on(tmp_path, tiny_weights, dtype):
    config = lab.ModelConfig(**(CKPT_TINY | {"vocab_size": 300}))
    weights = lab.init_gpt2_weights(config, seed=1)
    save_gpt2(tmp_path / "m", config, weights, dtype)
    model, tokenizer = load_gpt2(lab, tmp_path / "m")
    assert all(np.array_equal(model.weights[n], rounded(w, dtype)) for n, w in weights.items())
    assert tokenizer.eos_token_id == 299 and tokenizer.decode(tokenizer.encode("héllo")) == "héllo"


# --- Refused files: each one a ValueError that names the file -----------------------------


def rewrite_weights(checkpoint: Path, data: bytes) -> Path:
    (checkpoint / "model.safetensors").write_bytes(data)
    return checkpoint


@pytest.mark.provided
def test_a_path_that_is_not_a_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_gpt2(lab, tmp_path / "nowhere")


@pytest.mark.provided
@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "vocab.json", "merges.txt"])
def test_a_missing_file_is_named(checkpoint, missing):
    (checkpoint / missing).unlink()
    with pytest.raises(ValueError, match=missing.replace(".", r"\.")):
        load_gpt2(lab, checkpoint)


class _Trap:
    """Unpickling this object creates a file: the proof that a loader unpickled it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.mark.provided
def test_pytorch_model_bin_is_refused_with_how_to_convert_and_never_unpickled(checkpoint, tmp_path):
    marker = tmp_path / "unpickled"
    (checkpoint / "model.safetensors").unlink()
    (checkpoint / "pytorch_model.bin").write_bytes(pickle.dumps(_Trap(str(marker))))
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*pickle.*safe_serialization"):
        load_gpt2(lab, checkpoint)
    assert not marker.exists(), "pytorch_model.bin was unpickled"


@pytest.mark.provided
def test_a_truncated_file_is_refused_before_any_tensor_is_read(checkpoint):
    data = (checkpoint / "model.safetensors").read_bytes()
    rewrite_weights(checkpoint, data[:-10])
    with pytest.raises(ValueError, match=r"model\.safetensors.*run past the end.*truncated"):
        load_gpt2(lab, checkpoint)


@pytest.mark.provided
@pytest.mark.parametrize("data, why", [
    (b"\x01\x02", "too short"),
    ((10**6).to_bytes(8, "little") + b"{}", "header claims"),
    ((4).to_bytes(8, "little") + b"{no}", "not valid JSON"),
    ((2).to_bytes(8, "little") + b"[]", "JSON object"),
    ((14).to_bytes(8, "little") + b'{"a":1, "a":2}', "more than once"),
])
def test_a_corrupt_header_is_refused(checkpoint, data, why):
    with pytest.raises(ValueError, match=rf"model\.safetensors.*{why}"):
        load_gpt2(lab, rewrite_weights(checkpoint, data))


@pytest.mark.provided
@pytest.mark.parametrize("header, why", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, "overlaps"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "needs 12 bytes"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, "unused"),
    ({"a": {"dtype": "F8_E4M3", "shape": [8], "data_offsets": [0, 8]}}, "not supported"),
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, "shape must be"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, "data_offsets must be"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, "run past the end"),
])
def test_inconsistent_offsets_shapes_and_dtypes_are_refused(checkpoint, header, why):
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor '.*{why}"):
        load_gpt2(lab, rewrite_weights(checkpoint, raw_safetensors(header, bytes(12))))


@pytest.mark.provided
def test_a_shape_that_disagrees_with_config_json_names_the_file_and_the_tensor(tmp_path, tiny_weights):
    checkpoint = write_checkpoint(tmp_path / "m", tiny_weights, config=hf_config(n_positions=16, n_ctx=16))
    with pytest.raises(ValueError, match=r"model\.safetensors.*wpe\.weight.*shape"):
        load_gpt2(lab, checkpoint)


@pytest.mark.provided
def test_a_missing_tensor_is_named(tmp_path, tiny_weights):
    weights = {n: w for n, w in tiny_weights.items() if n != "ln_f.bias"}
    with pytest.raises(ValueError, match=r"model\.safetensors.*ln_f\.bias"):
        load_gpt2(lab, write_checkpoint(tmp_path / "m", weights))


@pytest.mark.provided
def test_one_tensor_under_both_names_is_refused(tmp_path, tiny_weights):
    weights = tiny_weights | {"transformer.wte.weight": tiny_weights["wte.weight"]}
    with pytest.raises(ValueError, match="twice"):
        load_gpt2(lab, write_checkpoint(tmp_path / "m", weights))


@pytest.mark.provided
@pytest.mark.parametrize("override, why", [
    ({"model_type": "llama"}, "model_type"),
    ({"activation_function": "relu"}, "activation_function"),
    ({"n_inner": 7}, "n_inner"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings"),
    ({"n_embd": "16"}, "n_embd must be an int"),
    ({"n_head": 3}, "multiple of n_head"),
])
def test_a_config_that_is_not_gpt2_architecture_is_refused(tmp_path, tiny_weights, override, why):
    checkpoint = write_checkpoint(tmp_path / "m", tiny_weights, config=hf_config() | override)
    with pytest.raises(ValueError, match=rf"config\.json.*{why}"):
        load_gpt2(lab, checkpoint)


@pytest.mark.provided
def test_a_vocabulary_larger_than_the_model_is_refused(tmp_path, tiny_weights):
    checkpoint = write_checkpoint(tmp_path / "m", tiny_weights)
    write_tokenizer(checkpoint, HAND_VOCAB | {"Ġl": 64}, HAND_MERGES)
    with pytest.raises(ValueError, match=r"vocab\.json.*64.*vocab_size is 64"):
        load_gpt2(lab, checkpoint)


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


# --- The commands: generate and speculate on checkpoints (they run the engine's exercises)


@pytest.mark.exercise5
def test_a_served_checkpoint_speaks_text_through_its_own_tokenizer(tmp_path):
    config = lab.ModelConfig(**(CKPT_TINY | {"vocab_size": 300}))
    weights = lab.init_gpt2_weights(config, seed=2)
    weights["wte.weight"][299] = -10.0  # keep <|endoftext|> (id 299) out of the greedy path
    save_gpt2(tmp_path / "tiny-gpt2", config, weights)
    engine, tokenizer = serving.checkpoint_commands.checkpoint_engine(lab, tmp_path / "tiny-gpt2", max_num_seqs=2)
    model, _ = load_gpt2(lab, tmp_path / "tiny-gpt2")
    with serving.start_server(engine, tokenizer=tokenizer, model_name="tiny-gpt2") as server:
        card = json.loads(http_call(server, "GET", "/v1/models")[2])["data"][0]
        body = complete(server, model="tiny-gpt2", prompt="low lower", max_tokens=6, temperature=0,
                        return_token_ids=True)
    assert card["id"] == "tiny-gpt2" and card["max_model_len"] == config.n_positions, (
        f"a served checkpoint is listed under its name with max_model_len = n_positions: {card}")
    prompt = tokenizer.encode("low lower")
    assert body["usage"]["prompt_tokens"] == len(prompt), "a text prompt is encoded by the checkpoint's BPE"
    [choice] = body["choices"]
    assert choice["token_ids"] == greedy_reference(model, prompt, 6), "the served tokens are greedy decoding"
    assert choice["text"] == tokenizer.decode(choice["token_ids"]), "the text is the tokens decoded by the BPE"


@pytest.mark.exercise5
def test_generate_text_is_the_greedy_continuation_decoded(tmp_path):
    config = lab.ModelConfig(**(CKPT_TINY | {"vocab_size": 300}))
    weights = lab.init_gpt2_weights(config, seed=2)
    weights["wte.weight"][299] = -10.0  # keep <|endoftext|> (id 299) out of the greedy path
    save_gpt2(tmp_path / "m", config, weights)
    model, tokenizer = load_gpt2(lab, tmp_path / "m")
    expected = greedy_reference(model, tokenizer.encode("low"), 8)
    assert 299 not in expected
    assert generate_text(lab, tmp_path / "m", "low", max_tokens=8) == tokenizer.decode(expected)


def early_exit_pair(tmp_path: Path) -> tuple[Path, Path]:
    """A 4-layer target whose layers past the first only refine, and its 1-layer self-draft."""
    config = lab.ModelConfig(**(CKPT_TINY | {"vocab_size": 300, "n_positions": 64, "n_layer": 4}))
    weights = lab.init_gpt2_weights(config, seed=0)
    for i in range(1, 4):
        for name in (f"h.{i}.attn.c_proj.weight", f"h.{i}.mlp.c_proj.weight"):
            weights[name] *= np.float32(0.2)
    save_gpt2(tmp_path / "target", config, weights)
    draft_config = lab.ModelConfig(**(CKPT_TINY | {"vocab_size": 300, "n_positions": 64, "n_layer": 1}))
    save_gpt2(tmp_path / "draft", draft_config, {n: w for n, w in weights.items()
                                                 if not n.startswith(("h.1.", "h.2.", "h.3."))})
    return tmp_path / "target", tmp_path / "draft"


@pytest.mark.exercise7
def test_speculate_on_checkpoints_keeps_the_targets_greedy_tokens(tmp_path):
    target, draft = early_exit_pair(tmp_path)
    report = speculate_checkpoints(lab, target, draft, prompt="low", max_tokens=20, repeats=1)
    assert "identical to the target's own greedy tokens" in report, report


@pytest.mark.exercise7
def test_a_draft_identical_to_its_target_is_always_accepted(tmp_path):
    target, _ = early_exit_pair(tmp_path)
    report = speculate_checkpoints(lab, target, target, prompt="low", max_tokens=20, repeats=1)
    assert "alpha: measured 1.000" in report, report


@pytest.mark.provided
def test_speculate_refuses_a_draft_with_another_tokenizer(tmp_path):
    target, draft = early_exit_pair(tmp_path)
    write_tokenizer(draft, {"a": 0, "b": 1}, [])
    with pytest.raises(ValueError, match="tokenizer"):
        speculate_checkpoints(lab, target, draft, repeats=1)


@pytest.mark.provided
def test_nothing_here_imports_the_lab_modules_by_name():
    for name in ("tokenizer.py", "model_loader.py", "checkpoint_commands.py"):
        source = (Path(__file__).parent.parent / "serving" / name).read_text()
        for module in ("solution", "lab"):
            imports = f"import {module}" in source or f"from {module} " in source
            assert not imports, f"serving/{name} imports {module}: it must be handed the module instead"


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
