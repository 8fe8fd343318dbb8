"""What vLLM's API adds to the chapter's sampler (serving/sampling.py): the logits processors for
min_tokens, logit_bias, the penalties and min_p, checked against a plain reference sampler
written here; the fields' one table of rules; token and prompt logprobs; and the engine that
runs them (through the module's own scheduler, so the engine tests need Exercise 5)."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from conftest import lab
from serving import sampling
from test_lab import ROW, assert_drawn_from_the_kept_tokens, reference_draws  # the chapter sampler's row and reference
from tests.support import log_softmax, random_prompts

CORE = ("temperature", "max_tokens", "seed", "stop_token_ids", "top_k", "top_p")


def api_sampling(**fields):
    """SamplingParams as the server builds them: the chapter's fields, the rest in extra_args
    (checked against sampling.EXTRA_ARGS, as the server checks them)."""
    core = {k: v for k, v in fields.items() if k in CORE}
    extra = sampling.extra_args(lab, {k: v for k, v in fields.items() if k not in CORE}, 64,
                                core.get("max_tokens", 16))
    return lab.SamplingParams(**core, extra_args=extra)


def field(sp, name, default):
    return (sp.extra_args or {}).get(name, default)


def reference_probs(logits, sp, prompt=(), output=(), eos=None):
    """The distribution vLLM samples from (one-hot at temperature 0), in plain Python floats."""
    x, vocab = [float(v) for v in logits], len(logits)
    if len(output) < field(sp, "min_tokens", 0):
        for t in [*sp.stop_token_ids, *([] if eos is None else [eos])]:
            x[t] = -math.inf
    for t, bias in field(sp, "logit_bias", {}).items():
        x[t] += bias
    r = field(sp, "repetition_penalty", 1.0)
    for t in range(vocab):
        if t in prompt or t in output:
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
        x[t] -= field(sp, "frequency_penalty", 0.0) * list(output).count(t)
        x[t] -= field(sp, "presence_penalty", 0.0) * (t in output)
    if sp.temperature == 0:
        best = max(range(vocab), key=lambda t: (x[t], -t))
        return np.eye(vocab)[best]
    top = max(x)
    w = [math.exp((v - top) / sp.temperature) for v in x]  # w[t] = p[t] / p_max
    keep = [t for t in range(vocab) if w[t] > 0 and w[t] >= field(sp, "min_p", 0.0)]
    if 0 < sp.top_k < vocab:
        kth = sorted((x[t] for t in keep), reverse=True)[min(sp.top_k, len(keep)) - 1]
        keep = [t for t in keep if x[t] >= kth]
    if sp.top_p < 1:
        mass = 0.0
        kept = []
        total = sum(w[t] for t in keep)
        for t in sorted(keep, key=lambda t: -w[t]):
            if mass >= sp.top_p:
                break
            kept.append(t)
            mass += w[t] / total
        keep = kept
    p = np.zeros(vocab)
    p[keep] = [w[t] for t in keep]
    return p / p.sum()


def reference_run(model, prompt, sp, eos=None):
    """One request alone, without cache or batch: (tokens, finish_reason). EOS is a stop token,
    as the server makes it one."""
    rng = np.random.default_rng(sp.seed)
    out = []
    while True:
        p = reference_probs(model.forward_dense(list(prompt) + out)[-1], sp, prompt, out, eos)
        token = int(np.argmax(p)) if sp.temperature == 0 else int(rng.choice(len(p), p=p))
        out.append(token)
        if token in sp.stop_token_ids:
            return out, "stop"
        if len(out) >= sp.max_tokens:
            return out, "length"


def processed(logits, sp, prompt=(), output=(), eos=None):
    """The row the chapter's sampler gets after the processors, for a sequence with this history."""
    seq = types.SimpleNamespace(request_id="r", sampling=sp, prompt_token_ids=list(prompt),
                                output_token_ids=list(output))
    row = np.array(logits, dtype=np.float32)
    for process in sampling.logits_processors(eos):
        row = process(seq, row)
    return row


def draws(sp, logits=ROW, n=300, **history):
    rng = np.random.default_rng(sp.seed)
    return [lab.sample_token(processed(logits, sp, **history), sp, rng) for _ in range(n)]


# --- the processors, one row at a time ----------------------------------------------------


@pytest.mark.provided
@pytest.mark.parametrize("value, support", [(0.5, {4, 1}), (0.11, {4, 1, 3, 0})])  # p >= min_p * 0.40
def test_min_p_keeps_exactly_the_tokens_vllm_keeps_and_renormalises(value, support):
    sp = api_sampling(temperature=1.0, seed=5, min_p=value)
    assert_drawn_from_the_kept_tokens(draws(sp), support, 5, f"min_p={value}")


@pytest.mark.provided
def test_min_p_is_relative_to_the_top_probability_after_the_temperature():
    sp = api_sampling(temperature=0.5, min_p=0.3, seed=3)  # at T = 0.5: p ~ p_1**2
    p = reference_probs(ROW, sp)
    assert set(np.flatnonzero(p)) == {4, 1}, "the reference itself: 0.15**2 / 0.40**2 < 0.3"
    assert draws(sp) == reference_draws(p, 3)


@pytest.mark.provided
def test_min_p_top_k_and_top_p_compose_in_vllm_order_after_the_temperature():
    sp = api_sampling(temperature=1.5, min_p=0.08, top_k=4, top_p=0.8, seed=11)
    p = reference_probs(ROW, sp)
    assert draws(sp, n=400) == reference_draws(p, 11, n=400), (
        "temperature, then min_p, then top_k, then top_p on what is left (renormalised), then one draw")


@pytest.mark.provided
@pytest.mark.parametrize("params", [
    dict(repetition_penalty=2.0), dict(repetition_penalty=0.5), dict(presence_penalty=1.5),
    dict(presence_penalty=-1.0), dict(frequency_penalty=0.7), dict(frequency_penalty=-2.0),
    dict(logit_bias={2: 3.0, 4: -1.0}), dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
    dict(logit_bias={0: 2.0, 4: -4.0}, repetition_penalty=2.0),  # the bias comes first, then the penalty
])
def test_penalties_and_logit_bias_shift_the_logits_as_vllm_does(params):
    logits = np.array([1.5, -0.5, 0.2, -2.0, 3.0, 0.0, -1.0, 0.7], dtype=np.float32)
    prompt, output = [0, 1, 1], [4, 4, 3, 4, 6]  # 0 and 1 only in the prompt; 4 three times in the output
    got = processed(logits, api_sampling(**params), prompt, output)
    x = logits.astype(np.float64)
    for t in range(8):
        x[t] += (params.get("logit_bias") or {}).get(t, 0.0)
        if t in prompt + output:  # repetition: over prompt and output; positive / r, negative * r
            r = params.get("repetition_penalty", 1.0)
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
        x[t] -= params.get("frequency_penalty", 0.0) * output.count(t)
        x[t] -= params.get("presence_penalty", 0.0) * (t in output)
    np.testing.assert_allclose(got, x, rtol=1e-6, atol=1e-6, err_msg=(
        f"{params}: logit_bias is added; repetition_penalty divides a seen token's positive logit and multiplies "
        "a negative one (prompt and output); frequency_penalty counts output occurrences; presence_penalty once"))


@pytest.mark.provided
def test_min_tokens_masks_stop_tokens_and_eos_until_reached():
    logits = np.array([0.0, 5.0, 4.0, 0.0], dtype=np.float32)  # greedy wants 1, then 2
    sp = api_sampling(stop_token_ids=(1,), min_tokens=2)
    assert int(np.argmax(processed(logits, sp, [0], [3], eos=2))) == 0, (
        "with 1 of min_tokens=2 outputs, the stop token 1 and the EOS token 2 are at -inf")
    assert int(np.argmax(processed(logits, sp, [0], [3, 3], eos=2))) == 1, (
        "once min_tokens outputs exist, nothing is masked")


@pytest.mark.provided
def test_a_request_without_extra_args_leaves_the_row_as_the_model_gave_it():
    logits = np.array([0.3, -1.0, 2.0, 0.5], dtype=np.float32)
    np.testing.assert_array_equal(processed(logits, lab.SamplingParams(temperature=1.0), [0, 1], [2]), logits)


@pytest.mark.provided
def test_token_logprobs_are_the_raw_log_softmax_with_the_sampled_token_first():
    logits = np.array([[0.5, 2.0, -1.0, 1.0], [3.0, 3.0, 0.0, -5.0]], dtype=np.float32)
    got = sampling.token_logprobs(logits, [2, 3], 2)
    assert [list(d) for d in got] == [[2, 1, 3], [3, 0, 1]], "the sampled token, then the top 2 (ties: lower id)"
    for d, row in zip(got, logits):
        for token, value in d.items():
            assert value.logprob == pytest.approx(log_softmax(row)[token], abs=1e-5)
            assert value.rank == 1 + (log_softmax(row) > log_softmax(row)[token]).sum(), "rank 1 is the most likely"
    assert list(sampling.token_logprobs(logits[:1], [1], 2)[0]) == [1, 3], "a sampled token in the top k appears once"


@pytest.mark.provided
def test_the_logprobs_processor_keeps_the_raw_row_whatever_the_processors_after_it_do():
    logits = np.array([1.0, 2.0, 0.5, -1.0], dtype=np.float32)
    sp = api_sampling(temperature=1.0, logprobs=1, logit_bias={0: 50.0}, min_tokens=1, stop_token_ids=(1,))
    processors = sampling.logits_processors()
    seq = types.SimpleNamespace(request_id="r", sampling=sp, prompt_token_ids=[0], output_token_ids=[])
    row = logits.copy()
    for process in processors:
        row = process(seq, row)
    entry = processors[0].take("r", 0, 1)
    assert list(entry) == [0, 1] and entry[0].logprob == pytest.approx(log_softmax(logits)[0], abs=1e-6), (
        "logprobs are the model's raw log-softmax (vLLM's raw_logprobs), before bias, masks and penalties")


# --- the fields' one table -----------------------------------------------------------------


@pytest.mark.provided
@pytest.mark.parametrize("name, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("min_p", 1.5),
    ("min_p", -0.1), ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 2.0), ("logprobs", 21),
    ("logprobs", -1), ("prompt_logprobs", 21), ("logit_bias", {64: 1.0}), ("logit_bias", {3: 101}),
    ("logit_bias", {3: True}), ("presence_penalty", float("nan")), ("frequency_penalty", True),
])
def test_a_value_outside_its_rule_is_an_argument_error_naming_the_field(name, value):
    with pytest.raises(lab.ArgumentError) as error:
        sampling.extra_args(lab, {name: value}, 64, 16)
    assert error.value.argument == name and name in str(error.value), (
        f"{name}={value!r}: the error carries the field as data and names it")


@pytest.mark.provided
def test_neutral_values_ask_for_nothing_and_are_left_out():
    neutral = {name: rule[0] for name, rule in sampling.EXTRA_ARGS.items()}
    assert sampling.extra_args(lab, neutral, 64, 16) is None
    assert sampling.extra_args(lab, {"logprobs": 0}, 64, 16) == {"logprobs": 0}, (
        "logprobs 0 is not neutral: it asks for the chosen token's logprob")


# --- the engine with the processors: whole requests against the reference ---------------------


def engine_run(model, prompt, sp, eos=None, **engine_args):
    engine = lab.LLMEngine(model, block_size=4, logits_processors=sampling.logits_processors(eos), **engine_args)
    return engine.generate([prompt], sp)[0]


@pytest.mark.needs(5)
@pytest.mark.parametrize("params", [
    dict(temperature=0.8, min_p=0.15), dict(temperature=1.0, presence_penalty=1.5),
    dict(temperature=1.0, frequency_penalty=1.0), dict(temperature=1.0, repetition_penalty=1.8),
    dict(temperature=1.0, logit_bias={3: 2.5, 9: 1.5}), dict(repetition_penalty=2.0), dict(frequency_penalty=0.8),
    dict(presence_penalty=-2.0),
    dict(temperature=1.3, top_k=8, top_p=0.9, min_p=0.05, presence_penalty=0.5, repetition_penalty=1.2),
])
def test_the_engine_samples_each_field_as_the_plain_reference(engine_model, params):
    prompt = random_prompts(1, seed=31)[0]
    sp = api_sampling(max_tokens=14, seed=9, **params)
    want, _ = reference_run(engine_model, prompt, sp)
    plain, _ = reference_run(engine_model, prompt, api_sampling(max_tokens=14, seed=9,
                                                                temperature=params.get("temperature", 0.0)))
    assert want != plain, f"the test's own check: {params} must change this run"
    out = engine_run(engine_model, prompt, sp, max_num_batched_tokens=8)  # chunked prefill too
    assert out.output_token_ids == want, (
        f"{params}: the engine drew other tokens than vLLM's sampler on the sequence's own prompt and output")


@pytest.mark.needs(5)
@pytest.mark.parametrize("min_tokens", [2, 6])
def test_min_tokens_keeps_eos_and_stop_tokens_out_until_reached(engine_model, min_tokens):
    prompt = random_prompts(1, seed=32)[0]
    free_run = reference_run(engine_model, prompt, api_sampling(max_tokens=12))[0]
    eos, stop = free_run[0], free_run[2]
    sp = api_sampling(max_tokens=12, min_tokens=min_tokens, stop_token_ids=(stop, eos))  # the server's EOS rule
    want = reference_run(engine_model, prompt, sp, eos)
    assert want[1] == "stop" and len(want[0]) > min_tokens, "the test's own check: it stops after min_tokens"
    out = engine_run(engine_model, prompt, sp, eos)
    assert (out.output_token_ids, out.finish_reason) == want, (
        f"min_tokens={min_tokens}: EOS and stop tokens are masked (and end nothing) before min_tokens outputs")


@pytest.mark.provided
def test_a_stop_token_may_come_right_after_min_tokens_outputs():
    logits = np.zeros(8, dtype=np.float32)
    sp = api_sampling(stop_token_ids=(5,), min_tokens=3)
    history = [[1], [1, 2], [1, 2, 3]]
    masked = [bool(np.isneginf(processed(logits, sp, [0], out)[5])) for out in history]
    assert masked == [True, True, False], (
        f"stop token masked after 1, 2, 3 outputs: {masked}; min_tokens = 3 holds it back for the first 3 outputs "
        "only, so the 4th output may be it")

