"""Load a Hugging Face GPT-2 checkpoint from disk into the lab's `ToyTransformer`.

A GPT-2 directory from the Hugging Face hub (gpt2, distilgpt2, gpt2-medium, ...) holds
`config.json` (the shape), `model.safetensors` (the weights), `vocab.json` and `merges.txt`
(the tokenizer). Only the standard library and NumPy read them:

- safetensors is an 8-byte little-endian header length N, N bytes of JSON naming every tensor's
  dtype, shape and byte range, then the raw little-endian tensors back to back. The file is
  memory-mapped: float32 tensors are used in place (the OS pages them in as they are read),
  float16 and bfloat16 become float32 copies. Every range is checked against the file before
  anything is mapped, so a truncated or corrupt file is a ValueError, never a read past its end.
- `pytorch_model.bin` is a Python pickle: unpickling runs code the file chooses, so it is never
  opened. The error says how to convert it, on a machine with torch and transformers.

Every entry point is handed the lab module (`lab`, solution or lab) whose `ModelConfig` and
`ToyTransformer` it builds; nothing here imports either by name.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from types import ModuleType

import numpy as np

from .tokenizer import ENDOFTEXT, GPT2Tokenizer, bytes_to_unicode

# safetensors dtype -> (little-endian storage dtype, converted to float32?)
_DTYPES = {
    "F64": (np.dtype("<f8"), True), "F32": (np.dtype("<f4"), True),
    "F16": (np.dtype("<f2"), True), "BF16": (np.dtype("<u2"), True),
    "I64": (np.dtype("<i8"), False), "I32": (np.dtype("<i4"), False), "I16": (np.dtype("<i2"), False),
    "I8": (np.dtype("i1"), False), "U8": (np.dtype("u1"), False), "BOOL": (np.dtype("?"), False),
}
_MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit

# How to turn a pickled checkpoint into safetensors, on a machine that has torch.
CONVERT_HINT = (
    "convert it on a machine with torch and transformers: python -c \"from transformers import "
    "GPT2LMHeadModel; GPT2LMHeadModel.from_pretrained('DIR').save_pretrained('DIR', safe_serialization=True)\" "
    "(this writes DIR/model.safetensors); or download the model.safetensors the hub page lists"
)


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        twice = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"the JSON names {twice[:3]} more than once")
    return dict(pairs)


def _header(path: str) -> tuple[dict, int, int]:
    """The parsed header, where the data starts and how many bytes of data the file holds."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ValueError(f"{path}: {size} bytes, too short for a safetensors file (an 8-byte header length "
                                 f"comes first)")
            n = int.from_bytes(prefix, "little")
            if n > _MAX_HEADER_BYTES:
                raise ValueError(f"{path}: the header claims {n} bytes, past the format's limit of "
                                 f"{_MAX_HEADER_BYTES}: not a safetensors file")
            if n > size - 8:
                raise ValueError(f"{path}: the header claims {n} bytes but the file has {size - 8} after the "
                                 f"length: truncated, or not a safetensors file")
            raw = f.read(n)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory, not a safetensors file") from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{path}: the header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header must be a JSON object of tensors, got {type(header).__name__}")
    return header, 8 + n, size - 8 - n


def _checked_entry(path: str, name: str, entry: object, data_len: int) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, each field checked against the file."""
    def bad(why: str) -> ValueError:
        return ValueError(f"{path}: tensor {name!r}: {why}")

    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise bad(f"expected an object with dtype, shape and data_offsets, got {json.dumps(entry)[:80]}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in _DTYPES:
        raise bad(f"dtype {dtype!r} is not supported (F32, F16, BF16, F64 and integer types are)")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"shape must be a list of ints >= 0, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
    begin, end = offsets
    if end > data_len:
        raise bad(f"its bytes {begin}..{end} run past the end of the data ({data_len} bytes): the file is "
                  f"truncated or its header is wrong")
    nbytes = math.prod(shape) * _DTYPES[dtype][0].itemsize
    if end - begin != nbytes:
        raise bad(f"shape {shape} of {dtype} needs {nbytes} bytes, data_offsets give {end - begin}")
    return dtype, tuple(shape), begin, end


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file: floating-point ones as float32, others in their dtype.

    The file is memory-mapped read-only: F32 tensors (and integer ones) are views of the file
    (aligned ones are never copied), F16, BF16 and F64 are converted to float32 copies. The header
    is checked whole before any tensor is touched: known dtypes, shapes that match their byte
    counts, ranges inside the file that tile the data exactly (no overlap, no gap, nothing left
    over, as the format requires). Any violation is a ValueError naming the file and the tensor.
    """
    path = os.fspath(path)
    header, data_start, data_len = _header(path)
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: __metadata__ must be an object of strings")
    entries = {name: _checked_entry(path, name, entry, data_len) for name, entry in header.items()}
    covered = 0
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda item: item[1][2:]):
        if begin != covered:
            what = "overlaps the tensor before it" if begin < covered else f"leaves bytes {covered}..{begin} unused"
            raise ValueError(f"{path}: tensor {name!r} at bytes {begin}..{end} {what}: a corrupt header")
        covered = end
    if covered != data_len:
        raise ValueError(f"{path}: the tensors end at byte {covered} of {data_len} bytes of data: a corrupt header")
    if data_len == 0:
        return {name: np.zeros(shape, np.float32 if _DTYPES[d][1] else _DTYPES[d][0])
                for name, (d, shape, _, _) in entries.items()}
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start, shape=(data_len,))
    tensors = {}
    for name, (dtype, shape, begin, end) in entries.items():
        storage, is_float = _DTYPES[dtype]
        array = data[begin:end].view(storage).reshape(shape)
        if dtype == "BF16":  # bfloat16 is the high half of a float32: shift it back into place
            array = (array.astype(np.uint32) << 16).view(np.float32)
        elif is_float and dtype != "F32":
            array = array.astype(np.float32)
        elif not array.flags.aligned:  # the format does not promise alignment; NumPy math wants it
            array = array.copy()
        tensors[name] = array
    return tensors


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], dtype: str = "F32") -> None:
    """Write float tensors as one safetensors file in `dtype` (F32, F16 or BF16, rounded to
    nearest even), in name order, with the header padded so the data starts 8-byte aligned."""
    if dtype not in ("F32", "F16", "BF16"):
        raise ValueError(f"dtype must be 'F32', 'F16' or 'BF16', got {dtype!r}")
    blobs = []
    header = {}
    offset = 0
    for name in sorted(tensors):
        x = np.ascontiguousarray(tensors[name], dtype=np.float32)
        if dtype == "F32":
            raw = x.astype("<f4").tobytes()
        elif dtype == "F16":
            raw = x.astype("<f2").tobytes()
        else:
            bits = x.view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")  # round half to even
            raw = rounded.tobytes()
        header[name] = {"dtype": dtype, "shape": list(x.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for raw in blobs:
            f.write(raw)


# --- config.json -------------------------------------------------------------------------


def _read_json(path: str, what: str) -> object:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file; a GPT-2 directory holds {what}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None


# Options of Hugging Face's GPT2Config that would change the computation: the value the lab's
# GPT-2 computes (a missing key takes GPT2Config's default, which is this value).
_FIXED_OPTIONS = {
    "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False,
    "tie_word_embeddings": True,
}


def gpt2_config(lab: ModuleType, path: str | os.PathLike) -> object:
    """`config.json` of a GPT-2 checkpoint as `lab.ModelConfig`.

    Reads n_positions, n_embd, n_layer, n_head, vocab_size and layer_norm_epsilon (default 1e-5).
    Refused with a ValueError naming the file: another architecture (`model_type` not "gpt2"), an
    activation other than GPT-2's tanh GELU, an MLP width other than 4 * n_embd, or any option
    of `_FIXED_OPTIONS` set the other way: the model would load and compute something else.
    """
    path = os.fspath(path)
    config = _read_json(path, "config.json")
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")

    def refuse(why: str) -> ValueError:
        return ValueError(f"{path}: {why}; the lab runs GPT-2's architecture only (gpt2, distilgpt2, gpt2-medium...)")

    model_type = config.get("model_type", "gpt2")
    if model_type != "gpt2":
        raise refuse(f"model_type is {model_type!r}, not 'gpt2'")
    if config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise refuse(f"activation_function {config['activation_function']!r} is not GPT-2's tanh GELU (gelu_new)")
    for key, value in _FIXED_OPTIONS.items():
        if config.get(key, value) != value:
            raise refuse(f"{key} is {config[key]!r}, the lab's GPT-2 computes {key} = {value}")
    fields = {}
    for key in ("n_positions", "n_embd", "n_layer", "n_head", "vocab_size"):
        value = config.get(key)
        if type(value) is not int or value < 1:
            raise ValueError(f"{path}: {key} must be an int >= 1, got {value!r}")
        fields[key] = value
    if config.get("n_inner") not in (None, 4 * fields["n_embd"]):
        raise refuse(f"n_inner is {config['n_inner']!r}, the lab's MLP is 4 * n_embd = {4 * fields['n_embd']} wide")
    eps = config.get("layer_norm_epsilon", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ValueError(f"{path}: layer_norm_epsilon must be a number in (0, 1), got {eps!r}")
    try:
        return lab.ModelConfig(**fields, layer_norm_epsilon=float(eps))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


# --- the whole directory -----------------------------------------------------------------


def _gpt2_weights(path: str) -> dict[str, np.ndarray]:
    """The tensors of a model.safetensors under the names `ToyTransformer` takes (a
    `transformer.` prefix is stripped here, so that a file holding one tensor under both names
    is refused instead of one silently winning)."""
    weights: dict[str, np.ndarray] = {}
    for name, tensor in read_safetensors(path).items():
        key = name.removeprefix("transformer.")
        if key.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # GPT-2's causal-mask buffers, not parameters
        if key in weights:
            raise ValueError(f"{path}: holds {key!r} twice (with and without the 'transformer.' prefix)")
        if tensor.dtype != np.float32:
            raise ValueError(f"{path}: tensor {name!r} is {tensor.dtype}, not a floating-point weight")
        weights[key] = tensor
    return weights


def load_gpt2(lab: ModuleType, path: str | os.PathLike, num_threads: int = 1) -> tuple[object, GPT2Tokenizer]:
    """A Hugging Face GPT-2 directory as `(lab.ToyTransformer, GPT2Tokenizer)`, the model's
    products split over `num_threads` threads.

    Reads `config.json` (`gpt2_config`), `model.safetensors` (`read_safetensors`: F32, F16 or
    BF16; names with or without the `transformer.` prefix; `lm_head.weight` may be present and
    must equal the tied `wte.weight`), `vocab.json` and `merges.txt` (`GPT2Tokenizer`). A
    `pytorch_model.bin` is refused, never unpickled. A missing, truncated or inconsistent file (a
    tensor missing, or a shape that disagrees with config.json) is a ValueError naming the file.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path}: not a directory; load_gpt2 reads a Hugging Face GPT-2 directory "
                         f"(config.json, model.safetensors, vocab.json, merges.txt)")
    weights_path = os.path.join(path, "model.safetensors")
    if not os.path.exists(weights_path):
        if os.path.exists(os.path.join(path, "model.safetensors.index.json")):
            raise ValueError(f"{path}: holds a sharded checkpoint (model.safetensors.index.json); load_gpt2 reads "
                             f"one model.safetensors (every GPT-2 size ships as one)")
        if os.path.exists(os.path.join(path, "pytorch_model.bin")):
            raise ValueError(f"{os.path.join(path, 'pytorch_model.bin')}: a pickle, which the lab never unpickles "
                             f"(loading a pickle runs code of the file's choosing); {CONVERT_HINT}")
        raise ValueError(f"{weights_path}: no such file; a GPT-2 directory holds its weights in model.safetensors")
    config = gpt2_config(lab, os.path.join(path, "config.json"))
    try:
        model = lab.ToyTransformer(config, _gpt2_weights(weights_path), num_threads=num_threads)
    except ValueError as exc:
        message = str(exc)
        if not message.startswith(weights_path):
            message = f"{weights_path}: {message} (shapes from config.json)"
        raise ValueError(message) from None
    return model, GPT2Tokenizer.from_dir(path, vocab_size=config.vocab_size)


def synthetic_bpe(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary that gives every id of a model text: the 256 bytes as ids
    0..255, then two-byte tokens, pairs of printable ASCII first, one merge each, and
    `<|endoftext|>` as the last id. Not trained on anything: for random-weight checkpoints."""
    if vocab_size < 257 or vocab_size > 256 + 256 * 256 + 1:
        raise ValueError(f"a synthetic byte-pair vocabulary has 257..{256 + 256 * 256 + 1} ids, got {vocab_size}")
    chars = bytes_to_unicode()
    order = [*range(0x20, 0x7F), *(b for b in range(256) if not 0x20 <= b < 0x7F)]
    vocab = {chars[b]: b for b in range(256)}
    merges = []
    for a, b in ((a, b) for a in order for b in order):
        if len(vocab) == vocab_size - 1:
            break
        merges.append((chars[a], chars[b]))
        vocab[chars[a] + chars[b]] = len(vocab)
    vocab[ENDOFTEXT] = vocab_size - 1
    return vocab, merges


def save_gpt2(path: str | os.PathLike, config: object, weights: Mapping[str, np.ndarray], dtype: str = "F32",
              tokenizer_files: tuple[dict[str, int], list[tuple[str, str]]] | None = None) -> None:
    """Write a GPT-2 directory that `load_gpt2` (and Hugging Face) reads: config.json,
    model.safetensors in `dtype`, vocab.json and merges.txt.

    `tokenizer_files` = (vocab, merges); by default `synthetic_bpe(config.vocab_size)`.
    For synthetic checkpoints (tests, benchmarks); the files of a real model come from its hub page.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    vocab, merges = synthetic_bpe(config.vocab_size) if tokenizer_files is None else tokenizer_files
    hf_config = {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "activation_function": "gelu_new",
        "n_positions": config.n_positions, "n_ctx": config.n_positions, "n_embd": config.n_embd,
        "n_layer": config.n_layer, "n_head": config.n_head, "vocab_size": config.vocab_size,
        "layer_norm_epsilon": config.layer_norm_epsilon, "n_inner": None,
    }
    if ENDOFTEXT in vocab:
        hf_config["bos_token_id"] = hf_config["eos_token_id"] = vocab[ENDOFTEXT]
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config, f, indent=2)
    write_safetensors(os.path.join(path, "model.safetensors"), weights, dtype)
    with open(os.path.join(path, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(path, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
