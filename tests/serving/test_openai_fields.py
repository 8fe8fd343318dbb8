"""What the fields give: logprobs and prompt logprobs checked against the model itself, the
end-of-text token, every OpenAI field with a home (a made-up one logged), vLLM's tokenizer
endpoints, and a stream whose engine step fails (docs/openai-fields.md)."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest

import serving
from checkpoints.tokenizer import (
    ByteTokenizer,
)
from conftest import lab
from serving import api_server, protocol
from tests.support import (
    HTTP_TIMEOUT,
    EosTokenizer,
    answered,
    api_engine,
    at_once,
    chat_request,
    complete,
    error_of,
    greedy_reference,
    http_call,
    log_softmax,
    random_prompts,
    read_to_close,
    served_model,
    stream_events_at,
)

# --- logprobs, prompt logprobs and the end-of-text token, checked against the model itself ------


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


@pytest.mark.needs(5)
def test_rule4_the_end_of_text_token_stops_with_no_stop_reason_unless_ignore_eos(engine_model):
    prompt = random_prompts(1, seed=32)[0]
    free_run = greedy_reference(engine_model, prompt, 12)
    eos = free_run[3]
    with serving.start_server(api_engine(engine_model), lab=lab, tokenizer=EosTokenizer(64, eos)) as srv:
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
    with serving.start_server(api_engine(engine_model), lab=lab, model_name=["gpt2", "openai-community/gpt2"]) as srv:
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
        reply = read_to_close(sock, allow_reset=False)
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
    with serving.start_server(engine, lab=lab) as srv:
        complete(srv, prompt=[3, 4], max_tokens=2, temperature=0)  # a stub is named here, not below
        successes = answered(http_call(srv, "GET", "/metrics")[2].decode())
        forward = engine.model.forward
        calls = []

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
