"""test_openai_api.py"""

from __future__ import annotations

import json
import re
import socket
import time

import numpy as np
import pytest

import serving
from checkpoints.tokenizer import (
    ByteTokenizer,
    IncrementalDetokenizer,
)
from conftest import lab
from serving import api_server, chat, output, protocol
from serving.async_llm import StepOutput
from tests.support import (
    HTTP_TIMEOUT,
    MODEL_CONFIGS,
    answered,
    api_engine,
    at_once,
    complete,
    error_of,
    greedy_reference,
    http_call,
    random_prompts,
    served_model,
    stream_events_at,
    stream_texts,
)

# --- the OpenAI API as clients use it ----------------------------------------------------


UNHONOURED_FIELDS = [  # (endpoint, field, value): fields this server cannot honour
    ("/v1/completions", "suffix", "tail"), ("/v1/completions", "use_beam_search", True),
    ("/v1/completions", "best_of", 3), ("/v1/completions", "response_format", {"type": "json_object"}),
    ("/v1/completions", "guided_regex", "a+"), ("/v1/completions", "allowed_token_ids", [1, 2]),
    ("/v1/completions", "priority", 5), ("/v1/completions", "length_penalty", 0.5),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "chat_template", "{{ messages }}"), ("/v1/chat/completions", "echo", True),
    ("/v1/chat/completions", "store", True), ("/v1/chat/completions", "audio", {"voice": "x"}),
]


def minimal_body(path):
    return {"prompt": [1, 2]} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "!"}]}


@pytest.mark.provided
@pytest.mark.parametrize("path, field, value", UNHONOURED_FIELDS, ids=[f[1] for f in UNHONOURED_FIELDS])
def test_rule1_a_field_the_server_cannot_honour_is_a_400_naming_it(server, path, field, value):
    status, error = error_of(server, path, minimal_body(path) | {field: value})
    assert status == 400 and error["param"] == field, (
        f"rule 1: {field}={value!r} must not be silently ignored: a 400 whose param names it; got {error}")
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400


ENGINE_FIELDS = [("top_p", 0.5), ("top_k", 5), ("min_p", 0.1), ("presence_penalty", 0.5), ("frequency_penalty", 0.5),
                 ("repetition_penalty", 1.2), ("logit_bias", {"3": 5}), ("min_tokens", 2), ("logprobs", 2),
                 ("prompt_logprobs", 1)]


ENGINE_VALUES = {"logit_bias": {3: 5.0}}  # as the engine gets it: token ids as ints


@pytest.mark.provided
@pytest.mark.parametrize("field, value", ENGINE_FIELDS, ids=[f for f, _ in ENGINE_FIELDS])
def test_rule1_a_sampling_field_reaches_the_engine(engine_model, field, value):
    body = json.dumps({"prompt": [1, 2], "max_tokens": 4, field: value}).encode()
    gen = protocol.parse_completion_request(served_model(engine_model.config, ByteTokenizer(64)), body)
    sampling = gen.requests[0].sampling
    got = getattr(sampling, field) if field in ("top_p", "top_k") else (sampling.extra_args or {}).get(field)
    assert got == ENGINE_VALUES.get(field, value), f"rule 1: {field}={value!r} must reach the engine; got {got!r}"


OUT_OF_RANGE = [("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2), ("presence_penalty", 3),
                ("frequency_penalty", -3), ("repetition_penalty", 0), ("logit_bias", {"64": 1}),
                ("logit_bias", {"3": 101}), ("min_tokens", 99), ("logprobs", 21), ("n", 0), ("n", 1000),
                ("temperature", "hot"), ("stop", ["s"] * 65), ("stop", ""), ("seed", 2**70),
                ("stream_options", {"include_usage": True}), ("cache_salt", ""), ("user", 5),
                ("truncate_prompt_tokens", 0), ("return_token_ids", "yes")]


@pytest.mark.provided
@pytest.mark.parametrize("field, value", OUT_OF_RANGE, ids=[f"{f}={v!r}"[:30] for f, v in OUT_OF_RANGE])
def test_rule1_a_bad_value_is_a_400_naming_its_field(server, field, value):
    status, error = error_of(server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 4, field: value})
    assert status == 400 and error["param"] == field, f"rule 1: {field}={value!r} must be a 400 naming it; got {error}"


ENGINE_REFUSALS = {  # what only the engine's checks know: the model's context and vocabulary
    "prompt": lambda n_positions, vocab: {"prompt": [1] * n_positions},
    "max_tokens": lambda n_positions, vocab: {"prompt": [1, 2], "max_tokens": n_positions - 1},
    "prompt[1]": lambda n_positions, vocab: {"prompt": [1, vocab]},
}


@pytest.mark.provided
@pytest.mark.parametrize("case", ENGINE_REFUSALS)
def test_rule1_an_engine_refusal_is_a_400_in_the_requests_own_words(server, engine_model, case):
    config = engine_model.config
    field = case.split("[")[0]
    status, error = error_of(server, "/v1/completions", ENGINE_REFUSALS[case](config.n_positions, config.vocab_size))
    assert status == 400 and error["param"] == field, f"rule 1: {case} must be a 400 naming {field}; got {error}"
    assert error["message"].startswith(field) and "prompt_token_ids" not in error["message"], (
        f"rule 1: the message speaks of the request's field {field!r}, not the engine's name for it: {error}")
    assert "cmpl-" not in error["message"], f"rule 1: the engine's request id is not the client's: {error}"


@pytest.mark.provided
def test_rule1_defaults_are_openais_temperature_1_and_16_tokens(engine_model):
    config = engine_model.config
    gen = protocol.parse_completion_request(served_model(config, ByteTokenizer(64)), b'{"prompt": [1, 2]}')
    sampling = gen.requests[0].sampling
    assert sampling.temperature == 1.0, "rule 1: temperature defaults to 1.0 (OpenAI), not greedy"
    assert sampling.max_tokens == 16 and gen.n == 1 and not gen.stream
    chat = chat_request({"messages": [{"role": "user", "content": "!"}]})
    assert chat.requests[0].sampling.max_tokens == BYTES.n_positions - len(chat.prompts[0]), (
        "rule 1: a chat request without max_tokens may use the rest of the context (vLLM)")


BYTES = lab.ModelConfig(**MODEL_CONFIGS["bytes"])


def chat_request(payload):
    return chat.parse_chat_request(served_model(BYTES, ByteTokenizer(256)), json.dumps(payload).encode())


@pytest.mark.provided
def test_rule1_n_above_1_with_greedy_sampling_is_a_400_as_in_vllm(server):
    status, error = error_of(server, "/v1/completions", {"prompt": [1], "n": 2, "temperature": 0})
    assert status == 400 and error["param"] == "n", f"rule 1: greedy samples would all be equal; got {error}"


@pytest.mark.provided
def test_rule1_an_unsupported_field_with_a_value_that_asks_for_nothing_is_accepted():
    payload = {"messages": [{"role": "user", "content": "!"}], "tools": [], "tool_choice": "none",
               "use_beam_search": False, "response_format": {"type": "text"}, "user": "u1", "top_p": 1.0}
    assert chat_request(payload).n == 1, "rule 1: a neutral value asks for nothing"


@pytest.mark.needs(5)
def test_rule1_n_samples_each_prompt_with_seeds_seed_plus_j_prompt_major(server):
    body = complete(server, prompt=[[1, 2, 3], [4, 5]], n=2, seed=5, max_tokens=4, return_token_ids=True)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3], "rule 1: one choice per prompt and sample"
    for i, prompt in enumerate([[1, 2, 3], [4, 5]]):
        for j in range(2):
            alone = complete(server, prompt=prompt, seed=5 + j, max_tokens=4, return_token_ids=True)
            assert choices[2 * i + j]["token_ids"] == alone["choices"][0]["token_ids"], (
                f"rule 1: choice {2 * i + j} is sample {j} of prompt {i}, drawn with seed {5 + j}")
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}


@pytest.mark.needs(5)
def test_rule2_a_stop_string_across_tokens_cuts_the_text_there(byte_server):
    free = complete(byte_server, prompt="abc", max_tokens=24, temperature=0)["choices"][0]["text"]
    stop = free[4:7]  # three tokens' text: found only across token boundaries
    cut = free.index(stop)
    body = complete(byte_server, prompt="abc", max_tokens=24, temperature=0, stop=[stop, "\x00never"])
    choice = body["choices"][0]
    assert choice["text"] == free[:cut], f"rule 2: the text must end before the stop string {stop!r}"
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop, choice
    kept = complete(byte_server, prompt="abc", max_tokens=24, temperature=0, stop=stop,
                    include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == free[:cut + len(stop)], "rule 2: include_stop_str_in_output keeps the stop string"


@pytest.mark.provided
def test_rule2_the_output_processor_releases_only_text_no_stop_string_can_claim():
    state = output.ChoiceState(0, ByteTokenizer(256), stop=("abc", "xyz"))
    released = []
    for ch in "qabdxyabcz":  # "ab" then "d": held, then released; "xy" held; "abc" stops
        released.append(state.update(StepOutput("r", [ord(ch)])).text)
        if state.finished:
            break
    assert released == ["q", "", "", "abd", "", "", "xy", "", ""], (
        f"rule 2: text that may begin a stop string is held until it cannot; got {released}")
    assert state.finish_reason == "stop" and state.stop_reason == "abc" and state.text == "qabdxy"
    assert state.stopped_by_string and len(state.token_ids) == 9, "the tokens stop with the one that completed it"


@pytest.mark.needs(5)
def test_rule2_a_streamed_stop_string_is_held_back_until_it_cannot_match(byte_server):
    free = complete(byte_server, prompt="abc", max_tokens=24, temperature=0)["choices"][0]["text"]
    stop = free[4:7]
    chunks, _ = stream_texts(byte_server, prompt="abc", max_tokens=24, temperature=0, stop=stop)
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == free[:free.index(stop)], (
        f"rule 2: the stream sent {streamed!r}; text that may begin the stop string {stop!r} must be held back, "
        "since text once sent cannot be taken back")
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.needs(5)
def test_rule2_a_stop_string_aborts_the_request_in_the_engine(engine_model):
    engine = lab.LLMEngine(engine_model, num_blocks=64, block_size=4)
    outputs, step = [], engine.step

    def recorded_step():
        out = step()
        outputs.extend(out)
        return out

    engine.step = recorded_step
    with serving.start_server(engine) as srv:
        free = complete(srv, prompt=[5] * 6, max_tokens=60, temperature=0)["choices"][0]["text"]
        outputs.clear()
        complete(srv, prompt=[5] * 6, max_tokens=60, temperature=0, stop=free[1:3])
        deadline = time.monotonic() + HTTP_TIMEOUT
        while time.monotonic() < deadline and not any(o.finished for o in outputs):
            time.sleep(0.01)
    finished = [o for o in outputs if o.finished]
    assert [o.finish_reason for o in finished] == ["abort"] and sum(len(o.new_token_ids) for o in outputs) < 60, (
        "rule 2: a request stopped by a stop string must be aborted in the engine, not run on to max_tokens")


@pytest.mark.provided
def test_rule3_the_incremental_detokenizer_holds_a_split_character():
    tok = ByteTokenizer(256)
    pieces = [IncrementalDetokenizer(tok)]
    detok = pieces[0]
    got = [detok.add(b) for b in "é🙂".encode()]
    assert got == ["", "é", "", "", "", "🙂"], f"rule 3: a character shows up whole with its last byte; got {got}"
    assert detok.add(0xF0) == "" and detok.flush() == "\ufffd", "an incomplete character at the end is U+FFFD"
    assert tok.decode(list("é".encode())) == "é" and tok.encode("é") == [0xC3, 0xA9]


class HalfCharTokenizer:
    """Every token is the bytes A9 C3: the second half of "é" and the first half of the next."""

    vocab_size, eos_token_id, special_token_ids = 64, None, frozenset()

    def encode(self, text):
        raise ValueError("token ids only")

    def token_bytes(self, token_id):
        return b"\xa9\xc3"

    def decode(self, token_ids, skip_special_tokens=False):
        return b"".join(self.token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")


@pytest.mark.needs(5)
def test_rule3_a_character_split_across_tokens_streams_whole(engine_model):
    engine = lab.LLMEngine(engine_model, num_blocks=64, block_size=4)
    with serving.start_server(engine, tokenizer=HalfCharTokenizer(), model_name="half") as srv:
        chunks, _ = stream_texts(srv, prompt=[1, 2, 3], max_tokens=4, temperature=0)
    texts = [c["choices"][0]["text"] for c in chunks]
    assert texts == ["\ufffd", "é", "é", "é\ufffd"], (
        f"rule 3: streamed text must come from an incremental detokenizer (no U+FFFD for a split character); "
        f"got {texts}")


@pytest.mark.provided
def test_rule4_echo_with_max_tokens_0_returns_the_prompt_only(server):
    body = complete(server, prompt="!(*", max_tokens=0, echo=True, return_token_ids=True)
    choice = body["choices"][0]
    assert choice["text"] == "!(*" and body["usage"]["completion_tokens"] == 0, (
        "rule 4: echo with max_tokens 0 scores the prompt: its text, no new token")
    assert choice["prompt_token_ids"] == [33, 40, 42] and choice["token_ids"] == []


@pytest.mark.needs(5)
def test_rule4_echo_prepends_the_prompt_text(server):
    plain = complete(server, prompt="!(*", max_tokens=5, temperature=0)["choices"][0]["text"]
    echoed = complete(server, prompt="!(*", max_tokens=5, temperature=0, echo=True)["choices"][0]["text"]
    assert echoed == "!(*" + plain, "rule 4: echo puts the prompt's text before the completion"


@pytest.mark.needs(5)
def test_rule4_logprobs_are_served_in_openais_format(server):
    body = complete(server, prompt=[1, 2], max_tokens=3, temperature=0, logprobs=2)
    logprobs = body["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(logprobs["tokens"]) == 3 and all(lp <= 0 for lp in logprobs["token_logprobs"])
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"]), "rule 4: logprobs k gives the top k"


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]


@pytest.mark.provided
def test_rule5_the_chat_template_is_the_documented_plain_one():
    messages = chat.parse_messages(CHAT)
    assert chat.render_chat(messages) == "system: Be brief.\nuser: Hi\nassistant:", (
        "rule 5: each message is 'role: content' and a newline, then 'assistant:'")
    continued = chat.render_chat(messages + [{"role": "assistant", "content": "Hel"}], continue_final_message=True)
    assert continued.endswith("\nassistant: Hel"), "continue_final_message leaves the last message open"


@pytest.mark.needs(5)
def test_rule5_a_chat_completion_is_the_completion_of_its_rendered_prompt(byte_server):
    prompt = chat.render_chat(chat.parse_messages(CHAT))
    expected = complete(byte_server, prompt=prompt, max_tokens=6, temperature=0)["choices"][0]["text"]
    status, _, data = http_call(byte_server, "POST", "/v1/chat/completions",
                                json.dumps({"messages": CHAT, "max_completion_tokens": 6, "temperature": 0}))
    assert status == 200, data[:300]
    body = json.loads(data)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": expected}, (
        "rule 5: the chat answer is the completion of the template's prompt")
    assert body["usage"]["completion_tokens"] == 6


@pytest.mark.needs(5)
def test_rule5_a_streamed_chat_sends_the_role_first_then_content_deltas_and_usage(byte_server):
    prompt = chat.render_chat(chat.parse_messages(CHAT))
    expected = complete(byte_server, prompt=prompt, max_tokens=5, temperature=0)["choices"][0]["text"]
    events = stream_events_at(byte_server, "/v1/chat/completions", messages=CHAT, max_tokens=5, temperature=0,
                              stream_options={"include_usage": True})
    chunks = [e for e in events[:-1] if e["choices"]]
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant", "rule 5: the first delta carries the role"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 5


@pytest.mark.provided
@pytest.mark.parametrize("messages, param", [
    ([], "messages"), ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": 5}], "messages[0].content")])
def test_rule5_bad_messages_are_a_400_naming_the_message(server, messages, param):
    status, error = error_of(server, "/v1/chat/completions", {"messages": messages})
    assert status == 400 and error["param"] == param, f"rule 5: expected a 400 naming {param}; got {error}"


@pytest.mark.provided
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_rule6_another_model_is_a_404_as_vllm_says_it(server, path):
    status, error = error_of(server, path, minimal_body(path) | {"model": "gpt-4"})
    assert status == 404 and error["type"] == "NotFoundError", f"rule 6: a model not served is a 404; got {error}"
    assert error["message"] == "The model `gpt-4` does not exist."


@pytest.mark.provided
def test_rule6_model_objects_carry_created_owner_root_and_max_model_len(server):
    status, _, data = http_call(server, "GET", f"/v1/models/{server.model_name}")
    card = json.loads(data)
    assert status == 200 and card["id"] == server.model_name and card["object"] == "model"
    assert card["root"] == server.model_name and card["max_model_len"] == 128
    assert isinstance(card["created"], int) and card["owned_by"], "rule 6: created and owned_by, as OpenAI's"
    assert json.loads(http_call(server, "GET", "/v1/models")[2])["data"] == [card]
    assert http_call(server, "GET", "/v1/models/gpt-4")[0] == 404


@pytest.mark.needs(5)
def test_rule6_completion_ids_are_unique_and_token_ids_come_when_asked(server):
    bodies = [complete(server, prompt=[1, 2], max_tokens=2) for _ in range(3)]
    ids = [b["id"] for b in bodies]
    assert len(set(ids)) == 3 and all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids), (
        f"rule 6: ids are cmpl-<uuid hex>, unique; got {ids}")
    assert all(isinstance(b["created"], int) for b in bodies)
    assert "token_ids" not in bodies[0]["choices"][0], "token ids only with return_token_ids (vLLM)"
    asked = complete(server, prompt=[1, 2], max_tokens=2, return_token_ids=True)["choices"][0]
    assert asked["prompt_token_ids"] == [1, 2] and len(asked["token_ids"]) == 2


# --- logprobs, prompt logprobs and the end-of-text token, checked against the model itself ------


def log_softmax(row):
    row = np.asarray(row, dtype=np.float64)
    return row - row.max() - np.log(np.exp(row - row.max()).sum())


def ids_of(top: dict) -> dict[int, float]:
    """A top_logprobs entry keyed by "token_id:N" (return_tokens_as_token_ids) as {N: logprob}."""
    return {int(k.split(":")[1]): v for k, v in top.items()}


@pytest.mark.needs(5)
def test_rule4_logprobs_are_the_raw_log_softmax_of_each_sampled_position(server, engine_model):
    prompt = random_prompts(1, seed=33)[0]
    body = complete(server, prompt=prompt, max_tokens=8, temperature=1.5, top_k=6, seed=4, logprobs=3,
                    return_tokens_as_token_ids=True, return_token_ids=True)
    choice = body["choices"][0]
    tokens, logprobs = choice["token_ids"], choice["logprobs"]
    assert len(logprobs["top_logprobs"]) == len(tokens) == 8
    for i, (token, top) in enumerate(zip(tokens, logprobs["top_logprobs"])):
        want = log_softmax(engine_model.forward_dense(prompt + tokens[:i])[-1])
        got = ids_of(top)
        best = [int(t) for t in np.argsort(-want, kind="stable")[:3]]
        assert list(got) == list(dict.fromkeys([token, *best])), (
            f"position {i}: the sampled token first, then the 3 most likely; got {list(got)}")
        for t, value in got.items():
            assert value == pytest.approx(want[t], abs=1e-4), (
                f"position {i}, token {t}: logprobs are log_softmax of the model's RAW logits (vLLM's "
                "raw_logprobs), before temperature, top-k, penalties and bias")
        assert logprobs["token_logprobs"][i] == pytest.approx(want[token], abs=1e-4)


@pytest.mark.needs(5)
def test_rule4_prompt_logprobs_score_every_prompt_token_but_the_first(server, engine_model):
    prompts = random_prompts(3, seed=34, low=6, high=20)
    bodies = at_once(lambda prompt: complete(server, prompt=prompt, max_tokens=2, temperature=0, prompt_logprobs=2),
                     *[(p,) for p in prompts])  # at once: each one's rows are its own, whatever its batch
    for prompt, body in zip(prompts, bodies):
        scored = body["choices"][0]["prompt_logprobs"]
        dense = engine_model.forward_dense(prompt)
        assert len(scored) == len(prompt) and scored[0] is None, "one entry per prompt token, None for the first"
        for t in range(1, len(prompt)):
            want = log_softmax(dense[t - 1])
            entry = scored[t][str(prompt[t])]
            assert entry["logprob"] == pytest.approx(want[prompt[t]], abs=1e-4), (
                f"prompt token {t}: its logprob under the logits of position t - 1")
            assert entry["rank"] == 1 + int((want > want[prompt[t]]).sum()), "rank: 1 + the tokens more likely"


class EosTokenizer(ByteTokenizer):
    """A byte tokenizer whose token `eos_token_id` is the end of text."""

    def __init__(self, vocab_size, eos_token_id):
        super().__init__(vocab_size)
        self.eos_token_id = eos_token_id


@pytest.mark.needs(5)
def test_rule4_the_end_of_text_token_stops_with_no_stop_reason_unless_ignore_eos(engine_model):
    prompt = random_prompts(1, seed=32)[0]
    free_run = greedy_reference(engine_model, prompt, 12)
    eos = free_run[3]
    with serving.start_server(api_engine(engine_model), tokenizer=EosTokenizer(64, eos)) as srv:
        stopped = complete(srv, prompt=prompt, max_tokens=12, temperature=0, return_token_ids=True)["choices"][0]
        kept = complete(srv, prompt=prompt, max_tokens=12, temperature=0, ignore_eos=True,
                        return_token_ids=True)["choices"][0]
        own = complete(srv, prompt=prompt, max_tokens=12, temperature=0, stop_token_ids=[free_run[1]],
                       return_token_ids=True)["choices"][0]
    assert stopped["token_ids"] == free_run[:free_run.index(eos) + 1], "the end-of-text token ends the request"
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", None), (
        "vLLM reports an end-of-text stop as finish_reason 'stop' with stop_reason None")
    assert kept["token_ids"] == free_run and kept["finish_reason"] == "length", (
        "ignore_eos: the end-of-text token is an ordinary token and the request runs to max_tokens")
    assert own["stop_reason"] == free_run[1], "a stop token of the request's own is its stop_reason"


# --- every OpenAI field has a home; a made-up one is logged -------------------------------------


NEW_OPENAI_FIELDS = [  # (field, a value the server honours or ignores with reason, a value it must refuse)
    ("prompt_cache_key", "user-42", 5), ("safety_identifier", "hash-1", 5),
    ("prompt_cache_retention", "in_memory", "24h"), ("moderation", False, True),
]


@pytest.mark.provided
@pytest.mark.parametrize("field, accepted, refused", NEW_OPENAI_FIELDS, ids=[f for f, *_ in NEW_OPENAI_FIELDS])
def test_rule1_each_openai_field_is_honoured_documented_as_a_no_op_or_refused(engine_model, field, accepted, refused):
    served = served_model(engine_model.config, ByteTokenizer(64))
    gen = protocol.parse_completion_request(served, json.dumps({"prompt": [1], field: accepted}).encode())
    assert field not in gen.ignored, f"rule 1: {field} is in a table of the server's, not an unknown field"
    with pytest.raises(protocol.APIError) as error:
        protocol.parse_completion_request(served, json.dumps({"prompt": [1], field: refused}).encode())
    assert error.value.param == field, f"rule 1: {field}={refused!r} is refused with a 400 naming it"


@pytest.mark.provided
def test_rule1_chat_verbosity_other_than_medium_is_refused():
    assert chat_request({"messages": [{"role": "user", "content": "!"}], "verbosity": "medium"}).n == 1
    with pytest.raises(protocol.APIError) as error:
        chat_request({"messages": [{"role": "user", "content": "!"}], "verbosity": "low"})
    assert error.value.param == "verbosity", "rule 1: a verbosity the server cannot honour is a 400 naming it"


@pytest.mark.provided
def test_rule1_an_unknown_field_is_accepted_and_logged_once_by_name(engine_model, caplog):
    served = served_model(engine_model.config, ByteTokenizer(64))
    gen = protocol.parse_completion_request(served, json.dumps(
        {"prompt": [1], "frobnicate": 1, "stream": True, "stream_options": {"include_usage": True, "zap": 1}}).encode())
    assert gen.ignored == ("frobnicate", "stream_options.zap"), (
        f"rule 1: fields in no table are reported as ignored, and only they: {gen.ignored}")
    frontend = api_server._Frontend(served)
    with caplog.at_level("WARNING", logger="serving.api_server"):
        for _ in range(3):
            frontend._log_ignored(gen.ignored)
        frontend._log_ignored(("other",))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "frobnicate" in lines[0] and "other" in lines[1], (
        f"rule 1: each ignored field's name is logged once, the first time it comes: {lines}")


@pytest.mark.needs(5)
def test_rule1_stream_options_include_obfuscation_pads_each_chunk(server):
    events = stream_events_at(server, "/v1/completions", prompt=[1, 2], max_tokens=3, temperature=0,
                              stream_options={"include_obfuscation": True})
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks and all(isinstance(e.get("obfuscation"), str) and e["obfuscation"] for e in chunks), (
        "rule 1: include_obfuscation adds a random padding field to every chunk, as OpenAI does")
    plain = stream_events_at(server, "/v1/completions", prompt=[1, 2], max_tokens=3, temperature=0)
    assert not any("obfuscation" in e for e in plain[:-1]), "and nothing without it"


@pytest.mark.needs(5)
def test_rule1_a_stop_list_as_long_as_a_harness_sends_is_accepted(server):
    stops = [f"<stop{i}>" for i in range(10)] + ["\n\n"]
    body = complete(server, prompt=[1, 2], max_tokens=3, temperature=0, stop=stops)
    assert body["choices"][0]["finish_reason"] in ("length", "stop"), (
        "rule 1: 11 stop strings (an evaluation harness adds the end-of-text string to a task's own) are accepted")


@pytest.mark.needs(5)
def test_rule6_the_model_answers_to_each_of_its_served_names(engine_model):
    with serving.start_server(api_engine(engine_model), model_name=["gpt2", "openai-community/gpt2"]) as srv:
        listed = json.loads(http_call(srv, "GET", "/v1/models")[2])["data"]
        body = complete(srv, model="openai-community/gpt2", prompt=[1, 2], max_tokens=2, temperature=0)
        status, error = error_of(srv, "/v1/completions", {"model": "gpt3", "prompt": [1]})
    assert [m["id"] for m in listed] == ["gpt2", "openai-community/gpt2"], "rule 6: every served name is listed"
    assert body["model"] == "openai-community/gpt2", "rule 6: a response carries the name it was asked for (vLLM)"
    assert status == 404 and error["param"] == "model"


# --- vLLM's tokenizer endpoints ------------------------------------------------------------------


@pytest.mark.provided
def test_tokenize_and_detokenize_are_the_servers_tokenizer(server, byte_server):
    status, _, data = http_call(server, "POST", "/tokenize", json.dumps({"prompt": "!(*", "return_token_strs": True}))
    assert status == 200 and json.loads(data) == {"count": 3, "max_model_len": 128, "tokens": [33, 40, 42],
                                                  "token_strs": ["!", "(", "*"]}, data
    chat = json.loads(http_call(byte_server, "POST", "/tokenize", json.dumps({"messages": [{"role": "user",
                                                                                            "content": "!"}]}))[2])
    assert chat["tokens"] == list(b"user: !\nassistant:") and chat["token_strs"] is None, (
        "messages are tokenized as the chat template renders them")
    status, _, data = http_call(server, "POST", "/detokenize", json.dumps({"tokens": [33, 40, 42]}))
    assert status == 200 and json.loads(data) == {"prompt": "!(*"}
    status, error = error_of(server, "/detokenize", {"tokens": [1, 99]})
    assert status == 400 and error["param"] == "tokens", "a token id outside the vocabulary is a 400 naming tokens"
    status, error = error_of(server, "/tokenize", {"model": "other", "prompt": "!"})
    assert status == 404, "another model is a 404, as on every route"


@pytest.mark.provided
def test_tokenizer_info_describes_the_tokenizer_under_hugging_faces_names(server):
    status, _, data = http_call(server, "GET", "/tokenizer_info")
    info = json.loads(data)
    assert status == 200 and info["tokenizer_class"] == "ByteTokenizer" and info["model_max_length"] == 128
    assert info["eos_token"] is None and info["vocab_size"] == 64, info


@pytest.mark.needs(5)
def test_a_batch_of_256_prompts_is_served_as_lm_eval_sends_it(byte_server):
    # lm_eval --batch_size 256, loglikelihood: 256 prompts in one request, echo, max_tokens 1, logprobs 1
    prompts = [[65 + i % 26, 97 + i % 7, 32] for i in range(256)]
    body = complete(byte_server, prompt=prompts, max_tokens=1, temperature=0, echo=True, logprobs=1)
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(256)) and all(
        len(c["logprobs"]["token_logprobs"]) == 4 for c in choices), (
        "a request of 256 prompts (lm_eval --batch_size 256) gets one choice per prompt, each with its logprobs")


@pytest.mark.provided
def test_more_prompts_than_the_choice_cap_is_a_400_naming_prompt(server):
    status, error = error_of(server, "/v1/completions", {"prompt": [[1]] * (protocol.MAX_CHOICES + 1)})
    assert status == 400 and error["param"] == "prompt" and str(protocol.MAX_CHOICES) in error["message"], (
        f"one request's choices are capped (the front end's work for it holds up every other client): {error}")


# --- a stream whose engine step fails ------------------------------------------------------


def streamed_post_to_close(server, fields) -> tuple[bytes, list[bytes], bytes]:
    """One streamed POST /v1/completions with Connection: close, read on a raw socket until the
    server closes: (the response's head, its data: events with the chunked framing undone, the
    bytes that came after the chunked body's last chunk)."""
    body = json.dumps(fields | {"stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        reply = b""
        for _ in range(1000):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    head, _, rest = reply.partition(b"\r\n\r\n")
    text = b""
    while rest:  # the chunked coding: a size in hex, CRLF, the data, CRLF; size 0 ends the body
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            rest = rest.removeprefix(b"\r\n")
            break
        text, rest = text + rest[:size], rest[size + 2:]
    return head, [e for e in text.split(b"\n\n") if e], rest


@pytest.mark.needs(5)
def test_a_stream_whose_engine_step_fails_ends_at_its_error_event_and_is_no_success(engine_model, monkeypatch):
    engine = lab.LLMEngine(engine_model, num_blocks=64, block_size=4)
    with serving.start_server(engine) as srv:
        complete(srv, prompt=[3, 4], max_tokens=2, temperature=0)  # a stub is named here, not below
        successes = answered(http_call(srv, "GET", "/metrics")[2].decode())
        forward, calls = engine.model.forward, []

        def fails_on_the_third_pass(*args, **kwargs):  # the prefill and one decode step give 2 tokens first
            calls.append(1)
            if len(calls) == 3:
                raise FloatingPointError("planted fault")
            return forward(*args, **kwargs)

        monkeypatch.setattr(engine.model, "forward", fails_on_the_third_pass)  # the engine runs in this process
        head, events, after = streamed_post_to_close(srv, {"prompt": [3, 4], "max_tokens": 8, "temperature": 0,
                                                          "stream_options": {"include_usage": True}})
        monkeypatch.undo()
        assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower() and len(events) >= 2, (
            f"the stream must start (its first tokens come before the step that fails): {head[:80]!r}, {events[:2]}")
        last = json.loads(events[-1].removeprefix(b"data: ")) if events[-1] != b"data: [DONE]" else {}
        assert "planted fault" in last.get("error", {}).get("message", ""), (
            f"a step that fails mid-stream ends the stream with an error event naming the error, and nothing after "
            f"it: no usage chunk, no data: [DONE] (the stream did not complete); the last events were {events[-3:]}")
        assert after == b"", (
            f"the stream's body ended (its last chunk) at the error event, then {len(after)} more bytes came on the "
            f"connection: {after[:120]!r}; nothing is written past the end of a response")
        now = answered(http_call(srv, "GET", "/metrics")[2].decode())
    assert now == successes, (
        f"vllm:request_success_total went from {successes:g} to {now:g} for a stream that ended in an error event: "
        "a request counts as a success only when it completes")
