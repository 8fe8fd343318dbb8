"""The OpenAI API as its clients use it: every endpoint's shape, fields the server cannot honour
refused by name, the engine's own refusals, chat, streams, ids (docs/serving.md, docs/openai-fields.md)."""

from __future__ import annotations

import json
import re
import time

import pytest

import serving
from checkpoints.tokenizer import (
    ByteTokenizer,
    IncrementalDetokenizer,
)
from conftest import lab
from serving import output, protocol, serving_chat
from serving.engine.messages import StepOutput
from tests.support import (
    BYTES,
    HTTP_TIMEOUT,
    chat_request,
    complete,
    error_of,
    http_call,
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


@pytest.mark.reaches(1)  # the engine's answer carries its gauges, read by num_free_blocks
@pytest.mark.parametrize("field, value", OUT_OF_RANGE, ids=[f"{f}={v!r}"[:30] for f, v in OUT_OF_RANGE])
def test_rule1_a_bad_value_is_a_400_naming_its_field(server, field, value):
    status, error = error_of(server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 4, field: value})
    assert status == 400 and error["param"] == field, f"rule 1: {field}={value!r} must be a 400 naming it; got {error}"


ENGINE_REFUSALS = {  # what only the engine's checks know: the model's context and vocabulary
    "prompt": lambda n_positions, vocab: {"prompt": [1] * n_positions},
    "max_tokens": lambda n_positions, vocab: {"prompt": [1, 2], "max_tokens": n_positions - 1},
    "prompt[1]": lambda n_positions, vocab: {"prompt": [1, vocab]},
}


@pytest.mark.reaches(1)  # the engine's answer carries its gauges, read by num_free_blocks
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
def test_start_server_handed_only_the_engine_serves_it_with_the_module_that_defines_it(engine_model):
    with serving.start_server(lab.LLMEngine(engine_model, num_blocks=64, block_size=4)) as srv:
        body = complete(srv, prompt=[5] * 6, max_tokens=3, temperature=0)
    assert body["usage"]["completion_tokens"] == 3, (
        f"start_server(engine), with no module handed over, must serve the engine's requests: {body}")


@pytest.mark.needs(5)
def test_rule2_a_stop_string_aborts_the_request_in_the_engine(engine_model):
    engine = lab.LLMEngine(engine_model, num_blocks=64, block_size=4)
    outputs = []
    step = engine.step

    def recorded_step():
        out = step()
        outputs.extend(out)
        return out

    engine.step = recorded_step
    with serving.start_server(engine, lab=lab) as srv:
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
    with serving.start_server(engine, lab=lab, tokenizer=HalfCharTokenizer(), model_name="half") as srv:
        chunks, _ = stream_texts(srv, prompt=[1, 2, 3], max_tokens=4, temperature=0)
    texts = [c["choices"][0]["text"] for c in chunks]
    assert texts == ["\ufffd", "é", "é", "é\ufffd"], (
        f"rule 3: streamed text must come from an incremental detokenizer (no U+FFFD for a split character); "
        f"got {texts}")


@pytest.mark.reaches(1)  # the engine's answer carries its gauges, read by num_free_blocks
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
    messages = serving_chat.parse_messages(CHAT)
    assert serving_chat.render_chat(messages) == "system: Be brief.\nuser: Hi\nassistant:", (
        "rule 5: each message is 'role: content' and a newline, then 'assistant:'")
    continued = serving_chat.render_chat(messages + [{"role": "assistant", "content": "Hel"}],
                                         continue_final_message=True)
    assert continued.endswith("\nassistant: Hel"), "continue_final_message leaves the last message open"


@pytest.mark.needs(5)
def test_rule5_a_chat_completion_is_the_completion_of_its_rendered_prompt(byte_server):
    prompt = serving_chat.render_chat(serving_chat.parse_messages(CHAT))
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
    prompt = serving_chat.render_chat(serving_chat.parse_messages(CHAT))
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
