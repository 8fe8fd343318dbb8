"""test_tenants.py: API keys and tenants over real sockets (`start_server(..., api_keys={key: tenant})`,
`serve --api-key`, `serve --api-keys-file`), and `attack prefix-cache`.

Isolation is tested in pairs, as vLLM's PR 53347 asks: different tenants never share a block AND
one tenant's requests do, or the test would pass with caching off too. What is shared is read from
what the server publishes, `vllm:prefix_cache_hits_total` on /metrics (tokens, read as blocks), never from the
engine's state. A wrong key must change nothing: /metrics is the same text before and after.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import re
import select
import signal
import subprocess
import sys

import pytest

import course
import serving
from conftest import lab
from course.reviews import attack
from tests.support import (
    HTTP_TIMEOUT,
    MODEL_CONFIGS,
    ROOT,
    SharedServer,
    api_engine,
    import_scratch_lab,
    needs_reference,
    reraise_stub,
    run_cli,
    run_script,
)

KEYS = {"sk-acme-1": "acme", "sk-acme-2": "acme", "sk-globex": "globex"}
BLOCK = 4  # api_engine's block size
GUARDED = [("GET", "/v1/models", None), ("GET", "/v1/models/{model}", None),
           ("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1}),
           ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
           ("GET", "/no-such-route", None)]
# Open with keys too, as vLLM leaves every path outside its API open: they read no tenant's state
OPEN = [("GET", "/health", None), ("GET", "/metrics", None), ("GET", "/tokenizer_info", None),
        ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [104, 105]})]


def call(server, method, path, body=None, authorization=None, conn=None):
    """(status, body bytes) of one request; `authorization`: the header's whole value."""
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT)
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if authorization is not None:
        headers["Authorization"] = authorization
    try:
        conn.request(method, path, None if body is None else json.dumps(body), headers)
        resp = conn.getresponse()
        data = resp.read()
    finally:
        if own:
            conn.close()
    if resp.status == 500:
        reraise_stub(data.decode())
    return resp.status, data


def metrics(server) -> str:
    status, data = call(server, "GET", "/metrics")
    assert status == 200, f"/metrics must stay open without a key; got HTTP {status}"
    return data.decode()


def hits(server) -> int:
    """vllm:prefix_cache_hits_total, in blocks (the server counts tokens, as vLLM does: whole blocks here)."""
    tokens = int(float(re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", metrics(server), re.M).group(1)))
    return tokens // BLOCK


def complete(server, key, prompt, **fields) -> dict:
    status, data = call(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0}
                        | fields, f"Bearer {key}" if key else None)
    assert status == 200, f"a completion with key {key!r}: HTTP {status} {data[:300]!r}"
    return json.loads(data)


def hits_of(server, key, prompt, **fields) -> int:
    """The prefix-cache hits (blocks) that one request, sent alone, added."""
    before = hits(server)
    complete(server, key, prompt, **fields)
    return hits(server) - before


def fresh_prompt(seed: int, full_blocks: int = 5) -> list[int]:
    """full_blocks full blocks and 2 tokens more (a partial block is never cached, and the full ones
    never cover the whole prompt): a repeat of it reuses exactly full_blocks blocks."""
    return [(seed * 7 + 3 * i) % 61 + 1 for i in range(full_blocks * BLOCK + 2)]


@pytest.fixture(scope="module")
def byte_model():
    """A 256-token vocabulary: any ASCII text (a chat template, /tokenize's) is a prompt."""
    return lab.ToyTransformer(lab.ModelConfig(**MODEL_CONFIGS["bytes"]), seed=1)


@pytest.fixture(scope="module")
def shared_tenant_server(byte_model):
    shared = SharedServer(lambda: api_engine(byte_model, enable_prefix_caching=True), api_keys=KEYS)
    yield shared
    shared.close()


@pytest.fixture
def tenant_server(shared_tenant_server):
    yield from shared_tenant_server.serve()


@pytest.fixture(scope="module")
def shared_open_server(byte_model):
    shared = SharedServer(lambda: api_engine(byte_model, enable_prefix_caching=True))
    yield shared
    shared.close()


@pytest.fixture
def open_server(shared_open_server):
    yield from shared_open_server.serve()


# --- keys: who may call ----------------------------------------------------------------------


@pytest.mark.provided
def test_without_a_key_every_route_of_the_api_is_401_in_openais_error_shape(tenant_server):
    for method, path, body in GUARDED:
        path = path.format(model=tenant_server.model_name)
        status, data = call(tenant_server, method, path, body)
        assert status == 401, f"{method} {path} without a key: HTTP {status}, must be 401 (the API's routes need a " \
                              "key, and an unknown route too, so that the routes are not told)"
        error = json.loads(data)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error" and \
            error["code"] == "invalid_api_key" and error["param"] is None and "API key" in error["message"], (
                f"{method} {path}: a 401 carries OpenAI's error object (type invalid_request_error, code "
                f"invalid_api_key), got {error}")


@pytest.mark.provided
def test_health_metrics_and_the_tokenizers_routes_answer_without_a_key_as_in_vllm(tenant_server, open_server):
    for method, path, body in OPEN:
        keyed, unkeyed = call(tenant_server, method, path, body), call(open_server, method, path, body)
        assert keyed[0] == 200, (f"{method} {path} without a key: HTTP {keyed[0]}; vLLM's --api-key guards only "
                                 "its API's paths, and this route reads no tenant's state")
        if path != "/metrics":  # the counters are each server's own
            assert keyed == unkeyed, f"{method} {path} answers a keyed server as an open one: {keyed} vs {unkeyed}"


@pytest.mark.provided
def test_a_wrong_key_is_401_and_changes_nothing(tenant_server):
    before = metrics(tenant_server)
    wrong = ["Bearer sk-wrong", "Bearer sk-acme-", "Bearer sk-acme-1x", "Bearer SK-ACME-1", "Bearer sk-acme-1 extra",
             "Basic sk-acme-1", "sk-acme-1", "Bearer", "Bearer ", ""]
    conn = http.client.HTTPConnection("127.0.0.1", tenant_server.port, timeout=HTTP_TIMEOUT)
    try:
        for authorization in wrong:  # on one kept-alive connection: a 401 does not end it
            status, data = call(tenant_server, "POST", "/v1/completions", {"prompt": [1, 2, 3, 4, 5], "max_tokens": 4},
                                authorization, conn)
            assert status == 401, f"Authorization: {authorization!r} must be refused with 401, got HTTP {status}"
            assert json.loads(data)["error"]["code"] == "invalid_api_key"
    finally:
        conn.close()
    assert metrics(tenant_server) == before, (
        "a request with a wrong key must never reach the engine: /metrics changed (requests, tokens, prefix-cache "
        "queries) after nothing but 401s")


@pytest.mark.provided
@pytest.mark.parametrize("api_keys", [{}, {"sk a": "t"}, {"": "t"}, {"sk-\u00e9": "t"}, {"sk-a": ""}, {"sk-a": 3},
                                      ["sk-a"]], ids=["none", "space", "empty key", "non-ascii", "empty tenant",
                                                      "tenant not a name", "a list"])
def test_start_server_refuses_keys_it_cannot_check_before_it_listens(engine_model, api_keys):
    with pytest.raises(ValueError, match="api_keys"):
        serving.start_server(api_engine(engine_model), lab=lab, api_keys=api_keys)


@pytest.mark.needs(5)
def test_the_right_key_is_served_on_every_route_and_the_scheme_is_case_blind(tenant_server):
    for method, path, body in GUARDED[:-1] + OPEN:
        path = path.format(model=tenant_server.model_name)
        for authorization in ("Bearer sk-acme-1", "bearer sk-globex"):
            status, data = call(tenant_server, method, path, body, authorization)
            assert status == 200, f"{method} {path} with {authorization!r}: HTTP {status} {data[:200]!r}"
    assert call(tenant_server, "GET", "/no-such-route", None, "Bearer sk-acme-2")[0] == 404, (
        "with a key, an unknown route is a 404 (without one, a 401)")


def lm_eval_calls(server, key: str) -> list:
    """The requests lm_eval 0.4.13 sends with OPENAI_API_KEY=`key` and its local-completions model
    (`--model_args model=...,base_url=.../v1/completions`, tokenizer_backend left at "auto"), with
    its headers, and the answers (ids and times dropped). Its probe (lm_eval/utils.py,
    check_remote_tokenizer_support) and its RemoteTokenizer send Content-Type alone: Authorization
    only with an `auth_token` model argument, which its README does not name. Its completions carry
    `Authorization: Bearer $OPENAI_API_KEY` (TemplateAPI.header): a loglikelihood (echo, logprobs 1,
    max_tokens 1), a generation with a stop list, and, with tokenized_requests=False, the ids
    decoded first through /detokenize."""
    bare, keyed = {"Content-Type": "application/json"}, {"Authorization": f"Bearer {key}"}

    def send(method, path, body, headers):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT)
        try:
            conn.request(method, path, None if body is None else json.dumps(body),
                         headers | ({"Content-Type": "application/json"} if body is not None else {}))
            resp = conn.getresponse()
            answer = json.loads(resp.read() or b"null")
        finally:
            conn.close()
        if isinstance(answer, dict):
            answer = {k: v for k, v in answer.items() if k not in ("id", "created")}
        return resp.status, answer

    answers = [send("GET", "/tokenizer_info", None, bare),  # the probe that picks the remote tokenizer
               send("POST", "/tokenize", {"prompt": "test", "add_special_tokens": False}, bare),
               send("GET", "/tokenizer_info", None, bare)]  # RemoteTokenizer's own check
    context = send("POST", "/tokenize", {"prompt": "Question: 2+2?\nAnswer:", "add_special_tokens": False}, bare)
    continuation = send("POST", "/tokenize", {"prompt": " 4", "add_special_tokens": False}, bare)
    answers += [context, continuation]
    ids = context[1]["tokens"] + continuation[1]["tokens"]
    model = server.model_name
    answers.append(send("POST", "/v1/completions", {"model": model, "prompt": [ids], "temperature": 0,
                                                    "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True},
                        keyed))
    eos = answers[0][1]["eos_token"]  # the task's stop strings, and the end-of-text string when there is one
    answers.append(send("POST", "/v1/completions", {"prompt": [context[1]["tokens"]], "model": model,
                                                    "max_tokens": 8, "temperature": 0,
                                                    "stop": ["\n"] + ([eos] if eos is not None else []),
                                                    "seed": 1234}, keyed))
    text = send("POST", "/detokenize", {"tokens": ids}, bare)
    answers += [text, send("POST", "/v1/completions", {"model": model, "prompt": text[1]["prompt"], "temperature": 0,
                                                       "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True},
                           keyed)]
    return answers


@pytest.mark.needs(5)
def test_lm_eval_with_openai_api_key_runs_on_a_keyed_server_as_on_an_open_one(tenant_server, open_server):
    keyed, unkeyed = lm_eval_calls(tenant_server, "sk-acme-1"), lm_eval_calls(open_server, "sk-acme-1")
    statuses = [status for status, _ in keyed]
    assert statuses == [200] * len(keyed), (
        f"lm_eval's calls to a keyed server answered {statuses}: its tokenizer probe carries no key, and refused it "
        "would take a Hugging Face tokenizer named after the model instead of the server's")
    assert "eos_token" in keyed[0][1] and isinstance(keyed[1][1]["tokens"], list), (
        "lm_eval picks the remote tokenizer when /tokenizer_info has eos_token and /tokenize answers tokens")
    assert keyed == unkeyed, "lm_eval's calls answer a keyed server exactly as an open one"
    assert call(tenant_server, "POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 1})[0] == 401, (
        "the keyed server still refuses a completion without its key")


@pytest.fixture(scope="module")
def scraped_server(byte_model):
    """Tenants' keys, and the operators' key for /metrics."""
    with serving.start_server(api_engine(byte_model, enable_prefix_caching=True), lab=lab, api_keys=KEYS,
                              metrics_api_key="sk-scraper") as running:
        yield running


@pytest.mark.provided
def test_with_a_metrics_key_metrics_answers_that_key_alone_and_that_key_opens_nothing_else(scraped_server):
    for authorization in (None, "Bearer sk-acme-1", "Bearer sk-globex", "Bearer sk-scraper-2", "Basic sk-scraper"):
        status, data = call(scraped_server, "GET", "/metrics", None, authorization)
        assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key", (
            f"/metrics with Authorization {authorization!r}: HTTP {status}; with metrics_api_key only the operators' "
            "key reads the counters (a tenant's would read whether others' prompts were cached)")
    status, data = call(scraped_server, "GET", "/metrics", None, "Bearer sk-scraper")
    assert status == 200 and "vllm:prefix_cache_hits_total" in data.decode(), f"the scraper's key reads it: {status}"
    assert call(scraped_server, "GET", "/v1/models", None, "Bearer sk-scraper")[0] == 401, (
        "the metrics key is no tenant's key: it opens /metrics and nothing more")
    assert call(scraped_server, "GET", "/health")[0] == 200


@pytest.mark.provided
def test_a_metrics_key_no_header_can_carry_is_refused_before_the_server_listens(engine_model):
    with pytest.raises(ValueError, match="metrics_api_key"):
        serving.start_server(api_engine(engine_model), lab=lab, metrics_api_key="sk scraper")
    proc = run_cli("serve", "--port", "0", "--duration", "0.1", "--metrics-api-key", "sk scraper")
    assert proc.returncode == 2 and "--metrics-api-key" in proc.stderr and "serving " not in proc.stdout, proc.stderr


# --- tenants: who shares what, in pairs --------------------------------------------------------


@pytest.mark.needs(5)
def test_two_tenants_with_the_same_prompt_share_no_block_and_one_tenants_two_requests_do(tenant_server):
    prompt = fresh_prompt(1)
    first = hits_of(tenant_server, "sk-acme-1", prompt)
    other_tenant = hits_of(tenant_server, "sk-globex", prompt)
    same_tenant = hits_of(tenant_server, "sk-acme-2", prompt)  # another key of acme's
    assert first == 0, f"a prompt no one had sent hit {first} cached blocks"
    assert other_tenant == 0, (
        f"globex's request reused {other_tenant} of the blocks acme's request cached: each tenant's prefix-cache "
        "salt is derived on the server from its key, so no two tenants share a block")
    assert same_tenant == 5, (
        f"acme's second request (another of acme's keys) reused {same_tenant} blocks, not the 5 full blocks its "
        "first request cached: the keys of one tenant share its cache (a test of isolation alone would pass with "
        "caching off)")


@pytest.mark.needs(5)
def test_a_cache_salt_in_the_body_narrows_a_tenants_sharing_and_reaches_no_other_tenant(tenant_server):
    prompt = fresh_prompt(2)
    assert hits_of(tenant_server, "sk-acme-1", prompt, cache_salt="team-a") == 0
    forged = hits_of(tenant_server, "sk-globex", prompt, cache_salt="team-a")
    assert forged == 0, (f"globex sent acme's cache_salt in its body and reused {forged} of acme's blocks: a body's "
                         "salt may narrow its own tenant's sharing, never reach another tenant's")
    named = hits_of(tenant_server, "sk-globex", prompt, cache_salt="acme")
    assert named == 0, f"globex sent cache_salt 'acme' (the tenant's name) and reused {named} of acme's blocks"
    unsalted = hits_of(tenant_server, "sk-acme-2", prompt)
    assert unsalted == 0, (f"acme's request without a cache_salt reused {unsalted} blocks cached under acme's "
                           "cache_salt 'team-a': the body's salt narrows the tenant's sharing")
    same = hits_of(tenant_server, "sk-acme-2", prompt, cache_salt="team-a")
    assert same == 5, (f"acme's request with cache_salt 'team-a' again reused {same} blocks, not the 5 its first "
                       "one cached: one tenant's requests under one salt share")


@pytest.mark.needs(5)
def test_without_keys_the_bodys_cache_salt_alone_decides_what_is_shared(open_server):
    prompt = fresh_prompt(3)
    assert hits_of(open_server, None, prompt) == 0
    shared = hits_of(open_server, None, prompt)
    salted = hits_of(open_server, None, prompt, cache_salt="x")
    again = hits_of(open_server, None, prompt, cache_salt="x")
    assert (shared, salted, again) == (5, 0, 5), (
        f"without keys every client shares one cache and a body's cache_salt keeps its requests apart (vLLM's "
        f"behaviour): the repeats reused {shared}, {salted} (another salt) and {again} (that salt again) blocks, "
        "not 5, 0, 5")


# --- the command line: serve's keys ----------------------------------------------------------


@pytest.mark.provided
@pytest.mark.parametrize("content, says", [
    (None, "No such file"), ("{not json", "not JSON"), ('["sk-a"]', "JSON object"), ("{}", "JSON object"),
    ('{"sk secret": "t"}', "visible ASCII"), ('{"sk-a": ""}', "tenant must be a non-empty name")],
    ids=["missing", "not json", "a list", "empty", "a key with a space", "an empty tenant"])
def test_serve_refuses_a_keys_file_it_cannot_use_with_exit_status_2(tmp_path, content, says):
    path = tmp_path / "keys.json"
    if content is not None:
        path.write_text(content)
    proc = run_cli("serve", "--port", "0", "--duration", "0.1", "--api-keys-file", str(path))
    assert proc.returncode == 2 and f"--api-keys-file {path}" in proc.stderr and says in proc.stderr, proc.stderr
    assert "serving " not in proc.stdout, "a bad keys file is refused before the server starts"
    assert "secret" not in proc.stderr, "an error about a keys file never quotes a key"


@pytest.mark.provided
def test_serve_takes_api_key_or_a_keys_file_not_both(tmp_path):
    proc = run_cli("serve", "--api-key", "sk-a", "--api-keys-file", str(tmp_path / "k.json"))
    assert proc.returncode == 2 and "not allowed with" in proc.stderr, proc.stderr


@pytest.mark.needs(1)
def test_serve_warns_in_one_line_without_a_key_and_counts_its_keys_with_them():
    bare = run_cli("serve", "--port", "0", "--duration", "0.1")
    warning = [line for line in bare.stderr.splitlines() if "no API key" in line]
    assert bare.returncode == 0 and len(warning) == 1, f"serve without a key warns, in one line: {bare.stderr!r}"
    keyed = run_cli("serve", "--port", "0", "--duration", "0.1", "--api-key", "sk-a", "sk-b", "--api-key", "sk-c")
    assert keyed.returncode == 0 and "no API key" not in keyed.stderr, keyed.stderr
    assert "API keys: 3 key(s) of 3 tenant(s)" in keyed.stdout, (
        f"each --api-key key (repeated or listed) is a tenant of its own: {keyed.stdout!r}")


@pytest.mark.needs(1)
def test_serve_with_a_keys_file_answers_its_keys_and_refuses_the_rest(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    # Port 0: the server takes a free port and its banner names it (a port picked here first could
    # be taken by another process before the server binds it).
    proc = subprocess.Popen([sys.executable, lab.__file__, "serve", "--port", "0", "--api-keys-file", str(keys)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    banner = ""
    listening = None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)  # the banner, once it listens (bounded)
        banner = proc.stdout.readline() if ready else ""
        listening = re.search(r" at http://127\.0\.0\.1:(\d+) ", banner)
        if listening:
            server = type("Server", (), {"port": int(listening.group(1))})
            assert call(server, "GET", "/v1/models", None, "Bearer sk-globex")[0] == 200
            assert call(server, "GET", "/v1/models", None, "Bearer sk-acme-2")[0] == 200
            assert call(server, "GET", "/v1/models", None, "Bearer sk-initech")[0] == 401
            assert call(server, "GET", "/v1/models")[0] == 401
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # Ctrl-C
        proc.wait(timeout=30)
        out, err = banner + proc.stdout.read(), proc.stderr.read()
    reraise_stub(err)
    assert listening, f"serve --api-keys-file ended before its banner named the port it listens on: {out}{err}"
    assert proc.returncode == 0 and "API keys: 3 key(s) of 2 tenant(s)" in out, (proc.returncode, out, err)


# --- attack prefix-cache -------------------------------------------------------------------------


def expected_costs() -> dict[str, tuple[int, int, int]]:
    """The cost table's hits by hand, from the workloads' shape (a system prompt of 4 blocks, then a
    question that is new every time): every request after the first of its sharing group reuses the
    4 blocks. Groups per policy: the tenant (shared: all tenants, if they send one prompt)."""
    def hits(requests_per_group: list[int]) -> int:
        return sum(4 * (n - 1) for n in requests_per_group)
    return {
        # 4 tenants x 1 user x 4 requests, each tenant its own prompt: the tenant is the group everywhere
        "tenants share nothing": (hits([4] * 4), hits([4] * 4), hits([4] * 4)),
        # 2 tenants x 4 users x 2 requests: the tenant shares (8 requests), a key only its own 2
        "users of a tenant share a prompt": (hits([8] * 2), hits([8] * 2), hits([2] * 8)),
        # 4 tenants x 1 user x 2 requests of one public prompt: shared by all 8, or by each tenant's 2
        "tenants share a public prompt": (hits([8]), hits([2] * 4), hits([2] * 4)),
    }


@pytest.mark.needs(5)
def test_attack_prefix_cache_prints_both_caches_figures_and_the_exact_cost_of_salting():
    # A process of its own, as a user runs it: the command pins BLAS to one thread (in this process,
    # two BLAS threads on a busy 2-core machine made the run 8x slower).
    proc = run_script("attack", "prefix-cache", "--trials", "3", "--secrets", "1", "--candidates", "2", "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for figure in ("one shared cache", "per-tenant salts", "ROC AUC", "blocks recovered", "secrets recovered whole",
                   "first token, correct guess", "first token, wrong guess"):
        assert figure in out, f"the review prints {figure!r}:\n{out}"
    auc = re.search(r"ROC AUC.*?(\d\.\d\d) \((\d\.\d\d)-(\d\.\d\d)\)\s+(\d\.\d\d) \((\d\.\d\d)-(\d\.\d\d)\)", out)
    assert auc and all(0 <= float(x) <= 1 for x in auc.groups()), f"two AUCs with their intervals:\n{out}"
    # The counter channel needs no clock, so its figures are exact: a correct guess of the 4-block
    # prefix the victim cached adds 4 hits on one shared cache, a wrong one none; with salts, none.
    counted = {name: re.search(rf"^\s+{re.escape(name)}\s+(.+?)\s{{2,}}(.+)$", out, re.M)
               for name in ("/metrics: hits a correct guess added", "/metrics: hits a wrong guess added",
                            "ROC AUC, more hits = correct")}
    assert all(counted.values()), f"the review reads /metrics' hit counter beside the clock:\n{out}"
    got = {name: found.groups() for name, found in counted.items()}
    assert got == {"/metrics: hits a correct guess added": ("4 blocks", "0 blocks"),
                   "/metrics: hits a wrong guess added": ("0 blocks", "0 blocks"),
                   "ROC AUC, more hits = correct": ("1.00 (1.00-1.00)", "0.50 (0.00-1.00)")}, (
        f"on one shared cache /metrics tells every correct guess (AUC 1), with salts none (AUC 0.5): {got}")
    assert "OpenBLAS on 1 thread" in out or "not OpenBLAS" in out, f"the review says how BLAS ran:\n{out}"
    for workload, want in expected_costs().items():
        row = re.search(rf"^\s+{workload}\s+(\d+) / ([\d,]+)\s+(\d+) / ([\d,]+)\s+(\d+) / ([\d,]+)$", out, re.M)
        assert row, f"the cost table has a row for {workload!r}:\n{out}"
        got = tuple(int(row.group(i)) for i in (1, 3, 5))
        assert got == want, (f"{workload}: prefix-cache hits under one shared cache, a salt per tenant and a salt "
                             f"per key were {got}, by hand {want}")
        prompts = {"tenants share nothing": 16, "users of a tenant share a prompt": 16,
                   "tenants share a public prompt": 8}[workload] * (16 * 4 + 24)
        prefill = tuple(int(row.group(i).replace(",", "")) for i in (2, 4, 6))
        assert prefill == tuple(prompts - 16 * h for h in want), (
            f"{workload}: tokens prefilled {prefill}, by hand every prompt token ({prompts}) less 16 per hit")


@pytest.mark.needs(5)
def test_run_attack_from_python_runs_openblas_on_one_thread_and_puts_its_count_back(monkeypatch):
    from course import blas
    threads = blas.openblas_threads()
    if threads is None:
        pytest.skip("NumPy's BLAS here is not OpenBLAS: there is no thread count to pin")
    get, put = threads
    original = get()
    put(2)  # as NumPy starts on a 2-core machine, unless OPENBLAS_NUM_THREADS says otherwise
    seen = []

    class Seen(Exception):
        pass

    def start_server(*args, **kwargs):  # the review's first server: what BLAS runs the engine on
        seen.append(get())
        raise Seen
    monkeypatch.setattr(attack, "start_server", start_server)
    try:
        with pytest.raises(Seen):
            attack.run_attack(lab, attack.AttackQuestion(trials=2, secrets=1, candidates=2))
        assert seen == [1], (f"run_attack called from Python ran its servers with OpenBLAS on {seen} threads: a "
                             "second BLAS thread on two cores competes with the server's loop and the clients, and "
                             "the timings measure that")
        assert get() == 2, "the caller's thread count is put back after the review"
    finally:
        put(original)


@pytest.mark.provided
@pytest.mark.parametrize("args", [["attack"], ["attack", "timing"], ["attack", "prefix-cache", "--trials", "0"],
                                  ["attack", "prefix-cache", "--trials", "1"],
                                  ["attack", "prefix-cache", "--candidates", "1"],
                                  ["attack", "prefix-cache", "--seed", "-1"]],
                         ids=["no channel", "unknown channel", "0 trials", "1 trial", "1 candidate", "negative seed"])
def test_attack_refuses_bad_input_with_exit_status_2(args):
    proc = run_cli(*args)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (args, proc.stderr)


@pytest.mark.provided
@needs_reference
def test_attack_on_a_half_written_lab_names_the_stub_it_needs(tmp_path, monkeypatch):
    from tools.handout.make_lab import make_lab
    script = tmp_path / "lab_half.py"
    script.write_text(make_lab((ROOT / "solution.py").read_text(), only={"3", "6"}))
    half = import_scratch_lab(script, monkeypatch)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as end:
        course.main(half, ["attack", "prefix-cache"])
    assert end.value.code == 1 and "lab_half.py: Exercise 3: hash_block is still a stub" in err.getvalue(), (
        end.value.code, err.getvalue())


@pytest.mark.provided
def test_the_reviews_auc_is_the_chance_a_correct_guess_scores_above_a_wrong_one():
    assert attack.roc_auc([3, 4], [1, 2]) == 1.0 and attack.roc_auc([1, 2], [3, 4]) == 0.0
    assert attack.roc_auc([1, 3], [2, 2]) == 0.5 and attack.roc_auc([2], [2]) == 0.5, "a tie counts half"
    assert attack.roc_auc([1, 2, 3], [0, 2]) == (1 + 1.5 + 2) / 6  # 1 beats 0; 2 beats 0, ties 2; 3 beats both
    low, high = attack.auc_interval(0.8, 40, 40)
    assert 0.6 < low < 0.8 < high < 1.0, f"a 95% interval around 0.8 from 40 and 40 samples, got {low}-{high}"
    assert attack.auc_interval(1.0, 40, 40) == (1.0, 1.0) and attack.auc_interval(0.5, 2, 2)[0] == 0.0
