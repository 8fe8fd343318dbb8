"""`n`: parallel samples of one prompt, forked in the engine (`LLMEngine.add_request(request, n)`,
the PagedAttention paper's copy-on-write): the prompt runs once, its n samples (seeds seed,
seed + 1, ...) share its blocks by reference count and copy the shared partial block at their
first write. Each sample equals its single request, checked against the plain reference
sampler (test_sampling); every field keeps its meaning per sample; one request's choices
(prompts x n) take at most half of the running seats; a client that goes aborts every sample."""

from __future__ import annotations

import threading
import time
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import serving
from checkpoints.tokenizer import ByteTokenizer
from conftest import lab
from serving.engine.messages import sample_ids
from serving.serving_engine import Release
from tests.serving.test_sampling import api_sampling, reference_run
from tests.support import (
    HTTP_TIMEOUT,
    MODEL_CONFIGS,
    EosTokenizer,
    api_engine,
    complete,
    error_of,
    http_call,
    log_softmax,
    read_labelled,
    stream_events_at,
    stream_then_hang_up,
)

PROMPT = list(range(5, 23))  # 18 tokens: 4 full blocks of 4 and a partial one


def choices_tokens(body):
    return [c["token_ids"] for c in sorted(body["choices"], key=lambda c: c["index"])]


@pytest.mark.needs(5)
@pytest.mark.parametrize("caching", [True, False])
def test_each_sample_is_the_single_request_seeded_seed_plus_its_index(engine_model, caching):
    with serving.start_server(api_engine(engine_model, enable_prefix_caching=caching), lab=lab) as srv:
        body = complete(srv, prompt=PROMPT, n=4, seed=30, temperature=1.0, max_tokens=6, return_token_ids=True)
    for j, tokens in enumerate(choices_tokens(body)):
        want, _ = reference_run(engine_model, PROMPT, api_sampling(temperature=1.0, seed=30 + j, max_tokens=6))
        assert tokens == want, f"sample {j} must be what the request alone draws with seed {30 + j} (vLLM's seeds)"


@pytest.mark.needs(5)
@pytest.mark.parametrize("caching", [False, True])
def test_n_4_runs_the_prompt_once_and_each_sample_copies_the_shared_block_at_its_first_write(engine_model, caching):
    events = []  # the engine's own report (LLMEngine's observer), from the engine's thread
    engine = api_engine(engine_model, enable_prefix_caching=caching, observer=events.append)
    with serving.start_server(engine, lab=lab) as srv:
        body = complete(srv, prompt=PROMPT, n=4, seed=1, temperature=1.0, max_tokens=6, return_token_ids=True)
    kinds = [e.type.value for e in events]
    scheduled = sum(e.num_tokens for e in events if e.type.value == "scheduled")
    decodes = sum(len(tokens) - 1 for tokens in choices_tokens(body))  # a sample's later tokens, one a step
    assert scheduled - decodes == len(PROMPT), (
        f"the steps computed {scheduled - decodes} prompt tokens for a prompt of {len(PROMPT)} with n = 4: the "
        "engine runs the prompt once and forks its samples from it (LLMEngine.add_request(request, n))")
    first_step = kinds[:kinds.index("scheduled")]
    assert first_step.count("allocated") == 5, (
        f"the prompt's step took {first_step.count('allocated')} blocks: the 18-token prompt needs 5 of 4, held once "
        "by all 4 samples (BlockTable.fork takes references, not blocks)")
    copies = [e.block_ids for e in events if e.type.value == "copied"]
    assert len(copies) == 3 and len({src for src, _ in copies}) == 1, (
        f"copy-on-write pairs {copies}: the 4 samples' first tokens go into the prompt's shared, half-full last "
        "block; 3 of them copy it first, the last writes in place")
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks, "the samples left blocks taken"


@pytest.mark.needs(5)
def test_samples_under_memory_pressure_or_static_batching_still_equal_their_single_requests(engine_model):
    # A static batch reserves a request's samples together: 13 blocks for the first prompt's 3, the whole cache.
    for options in (dict(num_blocks=20, max_num_seqs=8), dict(scheduling="static", max_num_seqs=6, num_blocks=13)):
        engine = api_engine(engine_model, **options)
        with serving.start_server(engine, lab=lab) as srv:
            prompts = [PROMPT, PROMPT[:9]]
            body = complete(srv, prompt=prompts, n=3, seed=7, temperature=1.0, max_tokens=10, return_token_ids=True)
        tokens = choices_tokens(body)
        for i, prompt in enumerate(prompts):
            for j in range(3):
                want, _ = reference_run(engine_model, prompt, api_sampling(temperature=1.0, seed=7 + j, max_tokens=10))
                assert tokens[3 * i + j] == want, f"{options}: prompt {i} sample {j} changed"
        assert engine.allocator.num_free_blocks == engine.allocator.num_blocks, f"{options}: blocks leaked"


@pytest.mark.needs(5)
def test_every_sample_inherits_the_end_of_text_rule_and_the_sampling_fields(engine_model):
    with serving.start_server(api_engine(engine_model), lab=lab, tokenizer=EosTokenizer(64, 9)) as srv:
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
    with serving.start_server(api_engine(engine_model, max_num_seqs=6), lab=lab) as srv:
        status, error = error_of(srv, "/v1/completions", {"prompt": [1], "n": 4, "temperature": 1})
        assert status == 400 and error["param"] == "n" and "3" in error["message"], (
            f"max_num_seqs 6: one request may hold at most 3 seats, so n = 4 is a 400 naming n and 3: {error}")
    with serving.start_server(api_engine(engine_model), lab=lab, max_n=2) as srv:
        status, error = error_of(srv, "/v1/completions", {"prompt": [1], "n": 3, "temperature": 1})
        assert status == 400 and error["param"] == "n" and "2" in error["message"], error
    with pytest.raises(ValueError, match="max_n"):
        serving.start_server(api_engine(engine_model), lab=lab, max_n=0)


@pytest.mark.provided
@settings(max_examples=60)
@given(num_prompts=st.integers(1, 4), n=st.integers(1, 4), extra=st.integers(0, 4), data=st.data())
def test_release_submits_each_prompt_once_and_never_more_than_the_cap_choices_at_once(num_prompts, n, extra, data):
    cap = n + extra  # the server's max_n is at least any request's n
    requests = [types.SimpleNamespace(request_id=f"r{i}") for i in range(num_prompts)]
    release = Release(requests, n, cap)
    submitted, running, outputs = [], [], {}  # outputs: how many each sample has had
    batch = release.next()
    for _ in range(3 * num_prompts * n + 1):  # each sample ends by its third output
        submitted += batch
        running += [sample for r in batch for sample in sample_ids(r.request_id, n)]
        assert len(running) <= cap, f"{running} run at once: at most {cap} of one response's choices may"
        assert len(submitted) == num_prompts or len(running) + n > cap, (
            f"{len(running)} choices run and a prompt of {n} samples waits: it goes in as soon as its samples fit "
            f"under {cap}")
        if not running:
            break
        sample = data.draw(st.sampled_from(running))
        outputs[sample] = outputs.get(sample, 0) + 1
        finished = outputs[sample] == 3 or data.draw(st.booleans())
        if finished:
            running.remove(sample)
        batch = release.next(sample, finished)
    assert sorted(r.request_id for r in submitted) == sorted(r.request_id for r in requests), (
        "every prompt is submitted exactly once (the engine forks its samples)")


MANY_CHOICES = {"the largest n": dict(prompt=PROMPT, n=4), "4 prompts x n = 2": dict(prompt=[PROMPT] * 4, n=2),
                "8 prompts": dict(prompt=[PROMPT] * 8)}


@pytest.mark.needs(5)
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("many", MANY_CHOICES)
def test_a_request_with_many_choices_leaves_seats_for_another_client(engine_model, many, caching):
    engine = api_engine(engine_model, enable_prefix_caching=caching)
    with serving.start_server(engine, lab=lab) as srv:  # 8 seats: one request may hold 4
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
    with serving.start_server(engine, lab=lab) as srv:  # 8 seats: max_n is 4
        errors = []
        peak = 0

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
def test_a_streamed_chats_samples_are_its_single_requests_seeded_seed_plus_their_index():
    model = lab.ToyTransformer(lab.ModelConfig(**MODEL_CONFIGS["bytes"]), seed=1)  # chat's template is ASCII text
    messages = [{"role": "user", "content": "Hi"}]
    with serving.start_server(api_engine(model), lab=lab) as srv:
        events = stream_events_at(srv, "/v1/chat/completions", messages=messages, n=3, seed=8, temperature=1.0,
                                  max_tokens=5, return_token_ids=True)
    tokens, prompts = {}, {}
    for event in events[:-1]:
        for choice in event["choices"]:
            tokens.setdefault(choice["index"], []).extend(choice.get("token_ids", []))
            if "prompt_token_ids" in choice:
                prompts[choice["index"]] = choice["prompt_token_ids"]
    assert sorted(tokens) == [0, 1, 2], f"a stream of n = 3 carries choices 0, 1, 2; got {sorted(tokens)}"
    for j in range(3):
        want, _ = reference_run(model, prompts[j], api_sampling(temperature=1.0, seed=8 + j, max_tokens=5))
        assert tokens[j] == want, f"streamed chat choice {j} must be what the request alone draws with seed {8 + j}"


@pytest.mark.needs(5)
def test_each_sample_gets_the_logprobs_of_its_own_tokens_after_the_echoed_prompt(engine_model):
    prompt = PROMPT[:9]
    with serving.start_server(api_engine(engine_model), lab=lab) as srv:
        body = complete(srv, prompt=prompt, n=3, seed=11, temperature=1.0, max_tokens=5, logprobs=2, echo=True,
                        return_token_ids=True)
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 15, "total_tokens": 24}, (
        f"usage {body['usage']}: the prompt counts once (9 tokens), each sample's 5 tokens count")
    for choice in sorted(body["choices"], key=lambda c: c["index"]):
        whole = prompt + choice["token_ids"]
        scores = choice["logprobs"]["token_logprobs"]
        assert len(scores) == len(whole) and scores[0] is None, (
            f"choice {choice['index']}: echo gives a logprob for every prompt token (the first None), then each of "
            "the sample's own tokens")
        for i in range(1, len(whole)):
            want = log_softmax(engine_model.forward_dense(whole[:i])[-1])[whole[i]]
            assert scores[i] == pytest.approx(want, abs=1e-4), (
                f"choice {choice['index']}, position {i}: the logprob of the sample's own token there (each fork "
                "keeps its own logits rows)")


def a_stop_only_one_sample_writes(model, n=3, max_tokens=8):
    """(seed, sample j, stop string, every sample's reference tokens): a one-token stop string that
    sample j writes after its first token and no other sample writes at all."""
    for seed in range(200):
        runs = [reference_run(model, PROMPT, api_sampling(temperature=1.0, seed=seed + j, max_tokens=max_tokens))[0]
                for j in range(n)]
        for j, tokens in enumerate(runs):
            for token in tokens[1:]:
                if all(token not in other for k, other in enumerate(runs) if k != j) and token not in tokens[:1]:
                    return seed, j, chr(token), runs
    raise AssertionError("no seed below 200 gives a token only one sample writes")


@pytest.mark.needs(5)
def test_a_stop_string_ends_only_the_sample_that_wrote_it(engine_model):
    seed, j, stop, runs = a_stop_only_one_sample_writes(engine_model)
    engine = api_engine(engine_model)
    with serving.start_server(engine, lab=lab) as srv:
        body = complete(srv, prompt=PROMPT, n=3, seed=seed, temperature=1.0, max_tokens=8, stop=[stop])
    tokenizer = ByteTokenizer(64)
    for choice in sorted(body["choices"], key=lambda c: c["index"]):
        tokens = runs[choice["index"]]
        if choice["index"] == j:
            cut = tokens.index(ord(stop))
            assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
                tokenizer.decode(tokens[:cut]), "stop", stop), f"sample {j} stops at {stop!r}, cut before it"
        else:
            assert (choice["text"], choice["finish_reason"]) == (tokenizer.decode(tokens), "length"), (
                f"sample {choice['index']} never wrote {stop!r}: another sample's stop string must not end it")
    assert not engine.requests and engine.allocator.num_free_blocks == engine.allocator.num_blocks


REFUSED = {"by the request's checks": (dict(prompt=[1, 99]), {}),  # a token outside the vocabulary of 64
           "by the scheduler (it can never fit)": (dict(prompt=PROMPT, max_tokens=20), dict(num_blocks=8)),
           "by a static batch (its samples can never fit together)": (
               dict(prompt=PROMPT, max_tokens=10), dict(scheduling="static", max_num_seqs=6, num_blocks=12))}


@pytest.mark.needs(5)
@pytest.mark.parametrize("how", REFUSED)
def test_a_request_the_engine_refuses_is_one_400_and_none_of_its_samples_counts_as_aborted(engine_model, how):
    fields, options = REFUSED[how]
    with serving.start_server(api_engine(engine_model, **options), lab=lab) as srv:
        status, error = error_of(srv, "/v1/completions", {"n": 3, "temperature": 1.0, "seed": 1, **fields})
        aborted = read_labelled(http_call(srv, "GET", "/metrics")[2].decode(), "vllm:request_success_total",
                                finished_reason="abort")
    assert status == 400, f"refused {how}: a 400, got {status} {error}"
    assert aborted == 0, (
        f"{aborted:g} samples counted as aborted for a request refused {how}: the refusal is every sample's, "
        "and none of them ran")


@pytest.mark.needs(5)
def test_a_client_that_goes_mid_stream_aborts_every_forked_sample(engine_model):
    engine = api_engine(engine_model, num_blocks=64)
    aborted = []
    step = engine.step
    abort = engine.abort_request

    def slow_step():  # a step of a real model's length: the hang-up reaches the engine mid-request
        time.sleep(0.01)
        return step()

    def recorded_abort(request_id):
        aborted.append(request_id)
        return abort(request_id)

    engine.step, engine.abort_request = slow_step, recorded_abort
    with serving.start_server(engine, lab=lab) as srv:
        reply = stream_then_hang_up(srv, 2, n=3, temperature=1.0, seed=5)
        assert b"data: " in reply, reply[:200]
        deadline = time.monotonic() + HTTP_TIMEOUT
        while time.monotonic() < deadline and engine.requests:
            time.sleep(0.01)
    parents = [r for r in aborted if "." not in r]
    assert parents and {parents[0], f"{parents[0]}.1", f"{parents[0]}.2"} <= set(aborted), (  # add_request's ids
        f"the engine was asked to abort {aborted}: a client that goes mid-stream aborts each of its request's 3 "
        "samples (after the prompt ran each fork runs on its own; aborting sample 0 stops only sample 0)")
    assert not engine.requests and engine.allocator.num_free_blocks == 64, "the samples' blocks are back"
