"""The output processor (serving/output.py) and the choices built from it: stop strings against a
plain reference that reads the text character by character, whatever the tokens; min_tokens
holding stop strings back; echo (whole, streamed, several prompts) and its text offsets around
special tokens; the chat API's logprobs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import serving
from checkpoints.tokenizer import ByteTokenizer
from conftest import lab
from serving.engine.messages import StepOutput
from serving.output import ChoiceState
from tests.support import MODEL_CONFIGS, api_engine, complete, http_call, stream_events_at


class ChunkTokenizer:
    """Token i is the i-th of a fixed list of strings: text split into tokens of any length."""

    eos_token_id, special_token_ids = None, frozenset()

    def __init__(self, pieces):
        self.pieces = list(pieces)
        self.vocab_size = len(pieces)

    def token_bytes(self, token_id):
        return self.pieces[token_id].encode()

    def decode(self, token_ids, skip_special_tokens=False):
        return "".join(self.pieces[t] for t in token_ids)


def reference_cut(text: str, stops, min_chars: int = 0) -> tuple[str, str | None]:
    """The text a stream of `text` ends with: read it character by character and stop as soon as
    some stop string is complete (ending past `min_chars`); of two complete at one character, the
    longer (it began first). The text before that stop string, and the stop string."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if end > min_chars and text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[:end - len(stop)], stop
    return text, None


def run_choice(pieces, stops, min_tokens=0):
    """Feed a ChoiceState the tokens of `pieces` one step each; its text and stop reason."""
    state = ChoiceState(0, ChunkTokenizer(pieces), tuple(stops), min_tokens=min_tokens)
    for i in range(len(pieces)):
        state.update(StepOutput("r", [i], finish_reason="length" if i == len(pieces) - 1 else None))
        if state.finished:
            break
    return state.text, state.stop_reason


@pytest.mark.provided
@given(text=st.text("abc ", min_size=1, max_size=24), stops=st.lists(st.text("abc ", min_size=1, max_size=3),
                                                                      min_size=1, max_size=4, unique=True),
       cuts=st.lists(st.integers(1, 23), max_size=8))
@example(text="ab c", stops=["c", "ab"], cuts=[])  # in one token, the stop listed first completes last
def test_of_several_stop_strings_the_text_ends_before_the_first_one_complete(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    got = run_choice(pieces, stops)
    want = reference_cut(text, stops)
    assert got == want, (
        f"text {text!r} in tokens {pieces}, stop {stops}: the text ends before the stop string complete first "
        f"when read character by character, the same whatever the tokens; got {got}, want {want}")


@pytest.mark.provided
def test_min_tokens_holds_stop_strings_back_as_it_holds_stop_tokens():
    pieces = list("ab.cd.ef")  # one character a token
    assert run_choice(pieces, ["."]) == ("ab", "."), "the reference case: the first '.' stops"
    assert run_choice(pieces, ["."], min_tokens=3) == ("ab.cd", "."), (
        "min_tokens = 3: no stop string may end the text within the first 3 tokens (vLLM's rule), so the "
        "second '.' stops it")
    assert run_choice(pieces, ["."], min_tokens=8) == ("ab.cd.ef", None), "no stop string within min_tokens"
    assert run_choice(list("ab.c"), ["b.c"], min_tokens=2) == ("a", "b.c"), (
        "a stop string completed by a token past min_tokens counts, even if it began within them")


@pytest.mark.needs(5)
def test_min_tokens_holds_stop_strings_back_through_the_server(byte_server):
    free = complete(byte_server, prompt="abc", max_tokens=20, temperature=0)["choices"][0]["text"]
    stop = free[1]
    early = complete(byte_server, prompt="abc", max_tokens=20, temperature=0, stop=[stop])["choices"][0]
    held = complete(byte_server, prompt="abc", max_tokens=20, temperature=0, stop=[stop], min_tokens=20)["choices"][0]
    assert early["finish_reason"] == "stop" and len(early["text"]) <= 1, "the stop string cuts the text"
    assert held["text"] == free and held["finish_reason"] == "length", (
        "with min_tokens = max_tokens no stop string may end the request, as no stop token may")


class SpecialByteTokenizer(ByteTokenizer):
    """Bytes as tokens, but token 0 is `<|endoftext|>`, a special token with text of its own."""

    eos_token_id, special_token_ids = 0, frozenset({0})
    MARK = "<|endoftext|>"

    def encode(self, text):
        parts = text.split(self.MARK)
        ids = super().encode(parts[0])
        for part in parts[1:]:
            ids += [0, *super().encode(part)]
        return ids

    def token_bytes(self, token_id):
        return self.MARK.encode() if token_id == 0 else super().token_bytes(token_id)

    def decode(self, token_ids, skip_special_tokens=False):
        return "".join(self.token_bytes(t).decode("utf-8", "replace") for t in token_ids
                       if not (skip_special_tokens and t == 0))


@pytest.mark.reaches(1)  # the engine's answer carries its gauges, read by num_free_blocks
def test_echoed_text_offsets_count_a_special_tokens_text():
    prompt = "<|endoftext|>The river"
    model = lab.ToyTransformer(lab.ModelConfig(**(MODEL_CONFIGS["engine"] | {"vocab_size": 128})), seed=2)
    with serving.start_server(api_engine(model), lab=lab, tokenizer=SpecialByteTokenizer(128)) as srv:
        body = complete(srv, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    choice = body["choices"][0]
    assert choice["text"] == prompt, "echo gives the prompt as sent, its special token's text included"
    want = [0] + [13 + i for i in range(len("The river"))]
    assert choice["logprobs"]["text_offset"] == want, (
        f"text_offset of each prompt token in the echoed text: the special token spans 13 characters, so the "
        f"next token starts at 13; got {choice['logprobs']['text_offset']}")


@pytest.mark.needs(5)
def test_echo_gives_each_choice_its_own_prompt(byte_server):
    prompts = ["ab", "xyz"]
    body = complete(byte_server, prompt=prompts, max_tokens=3, temperature=0, echo=True, logprobs=1)
    for i, choice in enumerate(sorted(body["choices"], key=lambda c: c["index"])):
        alone = complete(byte_server, prompt=prompts[i], max_tokens=3, temperature=0)["choices"][0]["text"]
        assert choice["text"] == prompts[i] + alone, f"choice {i} echoes its own prompt, then its completion"
        assert len(choice["logprobs"]["tokens"]) == len(prompts[i]) + 3, (
            f"choice {i}: logprobs for its own prompt's tokens and its completion's")


@pytest.mark.needs(5)
def test_a_streamed_echo_comes_once_at_the_start_of_each_choice(byte_server):
    prompts = ["ab", "xyz"]
    events = stream_events_at(byte_server, "/v1/completions", prompt=prompts, max_tokens=4, temperature=0, echo=True)
    texts = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts.setdefault(choice["index"], []).append(choice["text"])
    for i, prompt in enumerate(prompts):
        whole = complete(byte_server, prompt=prompt, max_tokens=4, temperature=0, echo=True)["choices"][0]["text"]
        assert "".join(texts[i]) == whole and texts[i][0].startswith(prompt), (
            f"choice {i}: the echo comes once, in its first chunk, then the completion: {texts[i]}")


@pytest.mark.needs(5)
def test_chat_logprobs_without_top_logprobs_give_each_tokens_own(byte_server):
    messages = [{"role": "user", "content": "hi"}]
    status, _, data = http_call(byte_server, "POST", "/v1/chat/completions", json.dumps(
        {"messages": messages, "max_tokens": 4, "temperature": 0, "logprobs": True}))
    assert status == 200, data[:300]
    content = json.loads(data)["choices"][0]["logprobs"]["content"]
    assert len(content) == 4, "logprobs: true gives one entry per output token"
    for item in content:
        assert item["top_logprobs"] == [] and item["logprob"] <= 0 and item["logprob"] != -9999.0, (
            f"without top_logprobs each entry holds the token's own logprob and no alternatives: {item}")


@pytest.mark.needs(5)
def test_top_logprobs_keyed_by_text_keep_the_likeliest_of_tokens_spelled_alike(byte_server):
    # lm_eval's loglikelihood request (echo, max_tokens 1, logprobs 1, temperature 0) on a prompt of
    # bytes >= 0x80, which each print as U+FFFD; its is_greedy at a position is "the token's logprob
    # equals the largest value in top_logprobs". The same request with return_tokens_as_token_ids keys
    # each token by its id, which no two tokens share: the truth to compare with.
    prompt = [int(t) for t in np.random.default_rng(0).integers(0x80, 0x100, 24)]
    fields = dict(prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1)
    by_text = complete(byte_server, **fields)["choices"][0]["logprobs"]
    by_id = complete(byte_server, **fields, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    tokenizer = ByteTokenizer(256)
    alike_and_likelier = 0
    for i in range(1, len(prompt) + 1):  # the first prompt token has no logprobs
        top = {int(key.removeprefix("token_id:")): value for key, value in by_id["top_logprobs"][i].items()}
        spelled = {}
        for token_id, value in top.items():
            text = tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")
            spelled[text] = max(value, spelled.get(text, value))
        assert by_text["top_logprobs"][i] == spelled, (
            f"position {i}: of tokens that print alike, top_logprobs keeps the likeliest one's value: "
            f"{by_text['top_logprobs'][i]}, the tokens' own {top}")
        greedy = by_id["token_logprobs"][i] == max(top.values())
        assert (by_text["token_logprobs"][i] == max(by_text["top_logprobs"][i].values())) == greedy, (
            f"position {i}: lm_eval's is_greedy read from top_logprobs must be {greedy}, as the token ids say")
        alike_and_likelier += not greedy and len(spelled) < len(top)
    assert alike_and_likelier, "the prompt must hold a token that prints like a likelier one (else nothing is tested)"


@pytest.mark.provided
def test_a_tokens_text_offset_comes_after_earlier_bytes_it_showed_to_be_no_character():
    from serving.output import prompt_offsets
    tokenizer = ByteTokenizer(256)
    ids = [0xC3, ord("H"), 0xE2, 0x82, ord("F")]  # C3 starts a character H cannot finish; E2 82 F likewise
    text = tokenizer.decode(ids)
    offsets = prompt_offsets(tokenizer, ids)
    assert text == "\ufffdH\ufffdF" and offsets == [0, 1, 2, 2, 3], (
        f"each token's offset is where its own text starts in {text!r}: 'H' after the U+FFFD of the byte "
        f"before it, got {offsets}")


@pytest.mark.provided
def test_chat_checks_max_tokens_even_beside_max_completion_tokens(byte_server):
    status, _, data = http_call(byte_server, "POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2, "max_tokens": "abc"}))
    assert status == 400 and json.loads(data)["error"]["param"] == "max_tokens", (
        "a bad max_tokens is a 400 naming it, whether or not max_completion_tokens (which wins) is sent too")
