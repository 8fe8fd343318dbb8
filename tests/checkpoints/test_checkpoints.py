"""Real checkpoints: a GPT-2 directory from disk (checkpoints/model_loader.py), and the commands that run
the engine on one (checkpoints/commands.py). Every checkpoint is written by the test itself."""

from __future__ import annotations

import json
import pickle
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import checkpoints.commands
import serving
from checkpoints.commands import generate_text, speculate_checkpoints
from checkpoints.model_loader import load_gpt2, read_safetensors, save_gpt2
from conftest import lab
from tests.support import (
    CKPT_TINY,
    HAND_MERGES,
    HAND_VOCAB,
    HTTP_TIMEOUT,
    ROOT,
    complete,
    greedy_reference,
    http_call,
    reraise_stub,
    write_tokenizer,
)

# =====================================================================================
# Real checkpoints: a GPT-2 directory from disk, GPT-2's byte-level BPE, streaming text
# =====================================================================================
#
# Every checkpoint here is written by the test itself (a tiny config, random weights, a vocabulary
# and merges worked out by hand), with a writer of its own that shares no code with the loader.
# Nothing touches the network.


# --- An independent writer: a safetensors file is 8 bytes of header length, a JSON header, the data




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
    header = {}
    blobs = []
    offset = 0
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


# --- The commands: generate and speculate on checkpoints (they run the engine's exercises)


def save_tiny_text_checkpoint(path):
    """A 300-token GPT-2 checkpoint whose greedy path never reaches <|endoftext|> (id 299)."""
    config = lab.ModelConfig(**(CKPT_TINY | {"vocab_size": 300}))
    weights = lab.init_gpt2_weights(config, seed=2)
    weights["wte.weight"][299] = -10.0
    save_gpt2(path, config, weights)
    return config


@pytest.mark.needs(5)
def test_a_served_checkpoint_speaks_text_through_its_own_tokenizer(tmp_path):
    config = save_tiny_text_checkpoint(tmp_path / "tiny-gpt2")
    engine, tokenizer = checkpoints.commands.checkpoint_engine(lab, tmp_path / "tiny-gpt2", max_num_seqs=2)
    model, _ = load_gpt2(lab, tmp_path / "tiny-gpt2")
    with serving.start_server(engine, lab=lab, tokenizer=tokenizer, model_name="tiny-gpt2") as server:
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


@pytest.mark.needs(5)
def test_serve_model_dir_answers_to_the_directorys_name_and_to_the_model_string(tmp_path):
    save_tiny_text_checkpoint(tmp_path / "tiny-gpt2")
    given = f"{tmp_path / 'tiny-gpt2'}/"  # as typed, trailing slash and all: vLLM's name for the model
    proc = subprocess.Popen([sys.executable, lab.__file__, "serve", "--model", given, "--port", "0",
                             "--duration", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # "serving NAMES at URL ...", or nothing if it failed (bounded by --duration)
        address = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        if address is None:
            proc.kill()
            reraise_stub(proc.stderr.read())
            raise AssertionError(f"serve --model did not start: {line!r}")
        srv = SimpleNamespace(port=int(address.group(1)))
        statuses = {name: http_call(srv, "POST", "/v1/completions", json.dumps(
            {"model": name, "prompt": "low", "max_tokens": 1, "temperature": 0}))[0] for name in ("tiny-gpt2", given)}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(HTTP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert statuses == {"tiny-gpt2": 200, given: 200}, (
        f"serve --model DIR answers to the directory's name and to the --model string as given (vLLM names "
        f"the model by it): {statuses}")


@pytest.mark.needs(5)
def test_generate_text_is_the_greedy_continuation_decoded(tmp_path):
    save_tiny_text_checkpoint(tmp_path / "m")
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


@pytest.mark.needs(7)
def test_speculate_on_checkpoints_keeps_the_targets_greedy_tokens(tmp_path):
    target, draft = early_exit_pair(tmp_path)
    report = speculate_checkpoints(lab, target, draft, prompt="low", max_tokens=20, repeats=1)
    assert "identical to the target's own greedy tokens" in report, report


@pytest.mark.needs(7)
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
    for name in ("tokenizer.py", "model_loader.py", "commands.py"):
        source = (ROOT / "checkpoints" / name).read_text()
        for module in ("solution", "lab"):
            imports = f"import {module}" in source or f"from {module} " in source
            assert not imports, f"checkpoints/{name} imports {module}: it must be handed the module instead"
