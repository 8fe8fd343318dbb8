"""vLLM's tokenizer endpoints (vLLM: `vllm/entrypoints/openai/serving_tokenization.py`):
`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`, so that a client without a
tokenizer of its own (an evaluation harness in its remote-tokenizer mode) uses the server's.
Bodies and answers have vLLM's shapes; bad input is a 400 naming the field, as everywhere."""

from __future__ import annotations

from .protocol import APIError, Fields, ServedModel, check_model, load_json, prompt_ids
from .serving_chat import parse_messages, render_chat


def tokenize(served: ServedModel, body: bytes) -> dict:
    """`{"prompt": text}` or `{"messages": [...]}` (rendered by the chat template) as
    `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` with `return_token_strs`)."""
    payload = load_json(body)
    f = Fields(payload)
    check_model(f, served)
    f.get("add_special_tokens", (bool,), True, "true or false")  # the tokenizers add none
    if "messages" in payload:
        add_generation_prompt = f.get("add_generation_prompt", (bool,), True, "true or false")
        continue_final = f.get("continue_final_message", (bool,), False, "true or false")
        text = render_chat(parse_messages(payload["messages"]), add_generation_prompt and not continue_final,
                           continue_final)
    else:
        text = f.get("prompt", (str,), None, "a string")
        if text is None:
            raise APIError("prompt (or messages) is required", param="prompt")
    tokens = prompt_ids(text, served.tokenizer, "prompt") if text else []
    strs = None
    if f.get("return_token_strs", (bool,), False, "true or false"):
        strs = [served.tokenizer.token_bytes(t).decode("utf-8", errors="replace") for t in tokens]
    return {"count": len(tokens), "max_model_len": served.config.n_positions, "tokens": tokens, "token_strs": strs}


def detokenize(served: ServedModel, body: bytes) -> dict:
    """`{"tokens": [ids]}` as `{"prompt": text}` (special tokens' text included, as vLLM)."""
    f = Fields(load_json(body))
    check_model(f, served)
    tokens = f.get("tokens", (list,), None, "a list of token ids")
    vocab_size = served.tokenizer.vocab_size
    if tokens is None or not all(type(t) is int and 0 <= t < vocab_size for t in tokens):
        f.fail("tokens", f"must be a list of token ids (ints) in the vocabulary 0..{vocab_size - 1}")
    return {"prompt": served.tokenizer.decode(tokens)}


def tokenizer_info(served: ServedModel) -> dict:
    """The tokenizer's configuration, under Hugging Face's tokenizer_config.json names."""
    tokenizer = served.tokenizer
    eos = tokenizer.eos_token_id
    eos_text = None if eos is None else tokenizer.token_bytes(eos).decode("utf-8", errors="replace")
    return {"tokenizer_class": type(tokenizer).__name__, "model_max_length": served.config.n_positions,
            "vocab_size": tokenizer.vocab_size, "eos_token": eos_text, "bos_token": eos_text, "pad_token": None,
            "add_bos_token": False, "add_eos_token": False, "chat_template": None}
