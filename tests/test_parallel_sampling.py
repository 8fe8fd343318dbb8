"""`n`: parallel samples of one prompt, fanned out by the front end into n requests (seeds seed,
seed + 1, ...), as vLLM V1 does. With the prefix cache on, the samples hold the prompt's full
blocks once; one request's choices (prompts x n) take at most half of the running seats; a client that goes
aborts every sample. Each sample is checked against the plain reference sampler (test_sampling)."""

from __future__ import annotations

import threading
import time
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import serving
from checkpoints.tokenizer import ByteTokenizer
from serving.serving_engine import Release
from tests.support import (
    HTTP_TIMEOUT,
    api_engine,
    complete,
    error_of,
    stream_events_at,
    stream_then_hang_up,
)
from tests.test_sampling import api_sampling, reference_run

PROMPT = list(range(5, 23))  # 18 tokens: 4 full blocks of 4 and a partial one


def choices_tokens(body):
    return [c["token_ids"] for c in sorted(body["choices"], key=lambda c: c["index"])]


@pytest.mark.needs(5)
@pytest.mark.parametrize("caching", [True, False])
def test_each_sample_is_the_single_request_seeded_seed_plus_its_index(engine_model, caching):
    with serving.start_server(api_engine(engine_model, enable_prefix_caching=caching)) as srv:
        body = complete(srv, prompt=PROMPT, n=4, seed=30, temperature=1.0, max_tokens=6, return_token_ids=True)
    for j, tokens in enumerate(choices_tokens(body)):
        want, _ = reference_run(engine_model, PROMPT, api_sampling(temperature=1.0, seed=30 + j, max_tokens=6))
        assert tokens == want, f"sample {j} must be what the request alone draws with seed {30 + j} (vLLM's seeds)"


@pytest.mark.needs(5)
def test_the_samples_hold_the_prompts_full_blocks_once(engine_model):
    engine = api_engine(engine_model, enable_prefix_caching=True)
    with serving.start_server(engine) as srv:
        complete(srv, prompt=PROMPT, n=4, seed=1, temperature=1.0, max_tokens=3)
    stats = engine.allocator.stats
    assert stats.hits == 3 * 4, (
        f"{stats.hits} prefix-cache hits: samples 1..3 must each find the 4 full blocks of the prompt that sample 0 "
        "computed (the partial last block is each sample's own), instead of computing and holding them again")


@pytest.mark.needs(5)
def test_samples_under_memory_pressure_or_static_batching_still_equal_their_single_requests(engine_model):
    for options in (dict(num_blocks=20, max_num_seqs=8), dict(scheduling="static", max_num_seqs=6)):
        engine = api_engine(engine_model, **options)
        with serving.start_server(engine) as srv:
            prompts = [PROMPT, PROMPT[:9]]
            body = complete(srv, prompt=prompts, n=3, seed=7, temperature=1.0, max_tokens=10, return_token_ids=True)
        tokens = choices_tokens(body)
        for i, prompt in enumerate(prompts):
            for j in range(3):
                want, _ = reference_run(engine_model, prompt, api_sampling(temperature=1.0, seed=7 + j, max_tokens=10))
                assert tokens[3 * i + j] == want, f"{options}: prompt {i} sample {j} changed"
        assert engine.allocator.num_free_blocks == engine.allocator.num_blocks, f"{options}: blocks leaked"


class EosTokenizer(ByteTokenizer):
    """A byte tokenizer whose token 9 is the end of text."""

    eos_token_id = 9


@pytest.mark.needs(5)
def test_every_sample_inherits_the_end_of_text_rule_and_the_sampling_fields(engine_model):
    with serving.start_server(api_engine(engine_model), tokenizer=EosTokenizer(64)) as srv:
        body = complete(srv, prompt=PROMPT, n=4, seed=3, temperature=1.0, max_tokens=40, logit_bias={"9": 4},
                        return_token_ids=True)
        kept = complete(srv, prompt=PROMPT, n=4, seed=3, temperature=1.0, max_tokens=40, logit_bias={"9": 4},
                        ignore_eos=True, return_token_ids=True)
    for c in body["choices"]:
        assert 9 not in c["token_ids"][:-1] and c["finish_reason"] == "stop" and c["token_ids"][-1] == 9, (
            f"choice {c['index']}: every sample ends at its first end-of-text token, as sample 0 does: {c}")
    assert all(c["finish_reason"] == "length" and 9 in c["token_ids"] for c in kept["choices"]), (
        "with ignore_eos every sample runs through the end-of-text token to max_tokens")


@pytest.mark.provided
def test_an_n_over_the_servers_limit_is_a_400_naming_n_and_the_limit(engine_model):
    with serving.start_server(api_engine(engine_model, max_num_seqs=6)) as srv:
        status, error = error_of(srv, "/v1/completions", {"prompt": [1], "n": 4, "temperature": 1})
        assert status == 400 and error["param"] == "n" and "3" in error["message"], (
            f"max_num_seqs 6: one request may hold at most 3 seats, so n = 4 is a 400 naming n and 3: {error}")
    with serving.start_server(api_engine(engine_model), max_n=2) as srv:
        status, error = error_of(srv, "/v1/completions", {"prompt": [1], "n": 3, "temperature": 1})
        assert status == 400 and error["param"] == "n" and "2" in error["message"], error
    with pytest.raises(ValueError, match="max_n"):
        serving.start_server(api_engine(engine_model), max_n=0)


@pytest.mark.provided
@settings(max_examples=60)
@given(num_prompts=st.integers(1, 4), n=st.integers(1, 4), cap=st.integers(1, 6), share_prefix=st.booleans(),
       data=st.data())
def test_release_submits_each_choice_once_and_never_more_than_the_cap_at_once(num_prompts, n, cap, share_prefix,
                                                                               data):
    requests = [types.SimpleNamespace(request_id=f"r{i}") for i in range(num_prompts * n)]
    release = Release(requests, n, cap, share_prefix)
    submitted, running, outputs = [], [], {}  # outputs: how many each request has had
    batch = release.next()
    for _ in range(3 * len(requests) + 1):  # each request ends by its third output
        for r in batch:
            i = requests.index(r)
            assert not (share_prefix and n > 1 and i % n and requests[i - i % n].request_id not in outputs), (
                f"{r.request_id} went before sample 0 of its prompt had an output (its prompt was not cached yet)")
        submitted += batch
        running += [r.request_id for r in batch]
        assert len(running) <= cap, f"{running} run at once: at most {cap} of one response's choices may"
        if not running:
            break
        request_id = data.draw(st.sampled_from(running))
        outputs[request_id] = outputs.get(request_id, 0) + 1
        finished = outputs[request_id] == 3 or data.draw(st.booleans())
        if finished:
            running.remove(request_id)
        batch = release.next(request_id, finished)
    assert sorted(r.request_id for r in submitted) == sorted(r.request_id for r in requests), (
        "every choice is submitted exactly once")


MANY_CHOICES = {"the largest n": dict(prompt=PROMPT, n=4), "4 prompts x n = 2": dict(prompt=[PROMPT] * 4, n=2),
                "8 prompts": dict(prompt=[PROMPT] * 8)}


@pytest.mark.needs(5)
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("many", MANY_CHOICES)
def test_a_request_with_many_choices_leaves_seats_for_another_client(engine_model, many, caching):
    engine = api_engine(engine_model, enable_prefix_caching=caching)
    with serving.start_server(engine) as srv:  # 8 seats: one request may hold 4
        errors = []

        def long_request():
            try:
                stream_events_at(srv, "/v1/completions", **MANY_CHOICES[many], temperature=1.0, seed=5,
                                 max_tokens=100)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        thread = threading.Thread(target=long_request)
        thread.start()
        deadline = time.monotonic() + HTTP_TIMEOUT
        while not engine.has_unfinished() and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)  # until the long request is in the engine
        if errors:
            raise errors[0]
        start = time.monotonic()
        body = complete(srv, prompt=[1, 2, 3], max_tokens=1, temperature=0)
        waited = time.monotonic() - start
        long_still_running = engine.has_unfinished()
        thread.join(HTTP_TIMEOUT)
    if errors:
        raise errors[0]
    assert body["choices"][0]["finish_reason"] == "length"
    assert long_still_running, (
        f"the other client's one-token request waited {waited:.2f} s, until the request with {many} had ended: "
        "one request's choices (prompts x n) must leave running seats free for others")


@pytest.mark.needs(5)
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("many", MANY_CHOICES)
def test_a_request_never_has_more_than_max_n_choices_in_the_engine(engine_model, many, caching):
    engine = api_engine(engine_model, enable_prefix_caching=caching)
    with serving.start_server(engine) as srv:  # 8 seats: max_n is 4
        errors, peak = [], 0

        def long_request():
            try:
                complete(srv, **MANY_CHOICES[many], temperature=1.0, seed=5, max_tokens=30)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        thread = threading.Thread(target=long_request)
        thread.start()
        deadline = time.monotonic() + HTTP_TIMEOUT
        while thread.is_alive() and time.monotonic() < deadline:
            peak = max(peak, len(engine.requests))
            time.sleep(0.0005)
        thread.join(HTTP_TIMEOUT)
    if errors:
        raise errors[0]
    assert peak <= 4, f"{peak} of one request's choices ({many}) were in the engine at once: at most max_n = 4"


@pytest.mark.needs(5)
def test_a_client_that_goes_aborts_every_sample(engine_model):
    engine = api_engine(engine_model, num_blocks=64)
    with serving.start_server(engine) as srv:
        reply = stream_then_hang_up(srv, 2, n=3, temperature=1.0, seed=5)
        assert b"data: " in reply, reply[:200]
        deadline = time.monotonic() + HTTP_TIMEOUT
        while time.monotonic() < deadline and (engine.requests or engine.allocator.num_free_blocks < 64):
            time.sleep(0.01)
        assert not engine.requests and engine.allocator.num_free_blocks == 64, (
            "every sample of a request whose client went must be aborted and its blocks returned")

