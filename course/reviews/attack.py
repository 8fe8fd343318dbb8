"""`python solution.py attack prefix-cache`: the prefix cache's timing side channel, measured as a
design review on the module's own engine behind its own server (127.0.0.1).

A prefix-cache hit skips the prefill of the cached blocks, so the first token of a request whose
prefix someone else sent comes sooner. An attacker who can time its own requests can therefore
test a guess at another client's prompt: send the guess, and a quick first token says "someone
sent this" (CVE-2025-46570, arXiv 2411.18191). vLLM's fix is a `cache_salt` in the first block's
hash; this server derives each tenant's salt from its API key (`serving.api_server.APIKeys`), so
a guess of another tenant's prompt never finds its blocks.

The review runs two servers of the same engine side by side, one with one shared cache (no keys:
every client shares) and one with per-tenant salts (a victim's key and an attacker's), and asks
each the same questions, alternating between them so that the machine's noise falls on both:

1. Can the attacker tell a correct guess from a wrong one? A victim sends a secret system prompt;
   the attacker sends the secret (a correct guess) and a random prompt of the same length (a wrong
   one), each followed by one fresh token, and times the first streamed token of each. Over many
   such pairs, the ROC AUC of "the quicker one is the correct guess" (0.5: chance; 1: always
   right), with its 95% interval (Hanley and McNeil's). The same guesses are read a second way,
   with no clock: `vllm:prefix_cache_hits_total` on /metrics before and after each one, and the
   AUC of "the one that added more hits is the correct guess". vLLM publishes the counter the same
   way; `serve --metrics-api-key` keeps it from clients.
2. Can it recover the secret block by block? For each block it knows candidates (the true block
   among random decoys: a template's blanks), sends what it has recovered so far plus one
   candidate plus one fresh token, and keeps the candidate with the quickest first token. Chance
   is one in the number of candidates.
3. What does salting cost? Three workloads sent one request at a time, the prefix-cache hits
   (`vllm:prefix_cache_hits_total` of each server's /metrics) and the tokens prefilled, under one
   shared cache, a salt per tenant (a keys file: the keys of one tenant share), and a salt per key
   (`serve --api-key K1 K2 ...`: each key a tenant of its own).

What it measures, honestly: time on this machine's CPU, over loopback, for a toy GPT-2 with random
weights, so the signal is the prefill of the cached blocks against the noise of a shared machine.
A probe can be sent only once: sending a guess caches it, so its second send would hit its own
blocks. Each figure is therefore one timing per guess, over many guesses; every guess ends in a
fresh token, so no prompt is ever fully cached (a fully cached prompt recomputes its last block).
The model is larger than `serve`'s default so that one block's prefill (16 tokens) stands out of
the per-request overhead; question 1 guesses a prefix of `AttackQuestion.prefix_blocks` blocks.
The review runs OpenBLAS on one thread, as `serve` does (`course.blas`), and times nothing else.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import math
import re
import socket
import time
from types import ModuleType

import numpy as np

from serving.api_server import start_server

from ..blas import one_blas_thread
from ..status import unsolved_exercises

# The engine the attacker times: large enough that a 16-token block's prefill (several ms here)
# stands out of a request's few milliseconds of overhead, small enough to run in seconds. The cost
# question counts blocks, which no model size changes: it runs on `serve`'s default model.
ATTACK_MODEL = dict(vocab_size=256, n_positions=512, n_embd=384, n_layer=4, n_head=4)
COUNT_MODEL = dict(vocab_size=256, n_positions=512, n_embd=64, n_layer=2, n_head=4)
BLOCK_SIZE = 16
NUM_BLOCKS = 512  # 8,192 tokens: every trial's blocks fit; older trials' are evicted (LRU) first
NEEDS = (1, 2, 3, 5)  # the allocator, the block table, the prefix cache, the scheduler (prefill only)
VICTIM_KEY, ATTACKER_KEY = "sk-victim", "sk-attacker"
TIMEOUT_S = 30.0  # one request, from connect to the end of its answer
MAX_READS = 10_000  # recv() calls for one answer (its bytes are a few hundred)


class AttackError(Exception):
    """The server did not answer as the review needs (not a stub: NotImplementedError says that)."""


@dataclasses.dataclass(frozen=True)
class AttackQuestion:
    """What one review measures: `trials` correct/wrong guess pairs of a `prefix_blocks`-block
    prefix for the AUC; `secrets` secret prompts of `secret_blocks` blocks recovered from
    `candidates` candidates a block; `seed` draws every prompt."""

    trials: int = 40
    prefix_blocks: int = 4
    secrets: int = 6
    secret_blocks: int = 4
    candidates: int = 8
    seed: int = 0

    def __post_init__(self):
        for name, low, high in (("trials", 2, 2000), ("prefix_blocks", 1, 24), ("secrets", 1, 200),
                                ("secret_blocks", 1, 24), ("candidates", 2, 64), ("seed", 0, 2**32 - 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an int in {low}..{high}, got {value!r}")


# --- the client: one timed request -----------------------------------------------------------


def first_token_seconds(port: int, prompt: list[int], key: str | None = None) -> float:
    """POST one streamed completion (max_tokens 1, greedy) and return the seconds from its send to
    the first `data:` event; the whole answer is read before returning. The connection is opened
    before the clock starts and closed by the server after the answer."""
    body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"{auth}Connection: close\r\nContent-Length: {len(body)}\r\n\r\n").encode("latin-1")
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        sock.sendall(head + body)
        reply = b""
        first = None
        for _ in range(MAX_READS):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
            if first is None and b"data: " in reply:
                first = time.perf_counter() - start
    text = reply.decode("utf-8", "replace")
    stub = re.search(r"NotImplementedError: (Exercise \d+: [\w.]+)", text)
    if stub:  # the engine hit a stub: the command line names it
        raise NotImplementedError(stub.group(1))
    if first is None or not text.startswith("HTTP/1.1 200") or '"error"' in text or "data: [DONE]" not in text:
        raise AttackError(f"the server did not stream a first token: {text[:300]!r}")
    return first


def prefix_cache_hits(port: int) -> int:
    """`vllm:prefix_cache_hits_total` of the server's /metrics, in blocks (it counts tokens, as vLLM does)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    found = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    if found is None:
        raise AttackError("the server's /metrics has no vllm:prefix_cache_hits_total")
    return int(float(found.group(1))) // BLOCK_SIZE


# --- the figures -----------------------------------------------------------------------------


def roc_auc(positives, negatives) -> float:
    """P(a positive scores above a negative), ties counting half (the Mann-Whitney U over n1 n2)."""
    pos, neg = np.asarray(positives, dtype=np.float64)[:, None], np.asarray(negatives, dtype=np.float64)[None, :]
    return float(np.mean(pos > neg) + 0.5 * np.mean(pos == neg))


def auc_interval(auc: float, n_pos: int, n_neg: int) -> tuple[float, float]:
    """A 95% interval for an AUC from its standard error (Hanley and McNeil, Radiology 1982)."""
    q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
    variance = (auc * (1 - auc) + (n_pos - 1) * (q1 - auc * auc) + (n_neg - 1) * (q2 - auc * auc)) / (n_pos * n_neg)
    half = 1.96 * math.sqrt(max(variance, 0.0))
    return max(0.0, auc - half), min(1.0, auc + half)


@dataclasses.dataclass
class CacheResult:
    """What the attacker got out of one server."""

    correct_s: list[float] = dataclasses.field(default_factory=list)  # first-token times of correct guesses
    wrong_s: list[float] = dataclasses.field(default_factory=list)
    correct_hits: list[int] = dataclasses.field(default_factory=list)  # prefix-cache hits (blocks) each added
    wrong_hits: list[int] = dataclasses.field(default_factory=list)
    blocks_right: int = 0
    secrets_whole: int = 0

    @property
    def auc(self) -> float:  # the quicker, the likelier a correct guess: score = -time
        return roc_auc([-t for t in self.correct_s], [-t for t in self.wrong_s])

    @property
    def counter_auc(self) -> float:  # the more hits /metrics counts, the likelier a correct guess
        return roc_auc(self.correct_hits, self.wrong_hits)


@dataclasses.dataclass
class SaltCost:
    """One workload under one salting policy: prefix-cache hits (blocks) and prefilled tokens."""

    hits: int
    prompt_tokens: int
    block_size: int

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.hits * self.block_size


@dataclasses.dataclass
class AttackReview:
    question: AttackQuestion
    shared: CacheResult
    salted: CacheResult
    costs: dict[str, dict[str, SaltCost]]  # workload -> policy -> cost
    seconds: float
    model: dict
    blas_threads: int | None = None  # OpenBLAS's threads before the review pinned it to one (None: not OpenBLAS)
    text: str = ""


# --- the workloads of the cost question ---------------------------------------------------------

POLICIES = ("one shared cache", "a salt per tenant", "a salt per key")


def salt_workloads(rng: np.random.Generator, block_size: int) -> dict[str, list[tuple[str, str, list[int]]]]:
    """Three workloads as (tenant, user, prompt) in the order sent: a system prompt of 4 blocks,
    then a question of 24 fresh tokens. "tenants share nothing": 4 tenants of one user each, 4
    requests each, every tenant its own system prompt; "users of a tenant share a prompt": 2 tenants
    of 4 users, 2 requests per user, one system prompt per tenant; "tenants share a public prompt":
    4 tenants of one user, 2 requests each, the same system prompt for all (a common template)."""
    def tokens(n: int) -> list[int]:
        return rng.integers(0, ATTACK_MODEL["vocab_size"], n).tolist()

    system_len, question_len = 4 * block_size, 24
    out = {}
    for name, tenants, users, requests, public in (("tenants share nothing", 4, 1, 4, False),
                                                   ("users of a tenant share a prompt", 2, 4, 2, False),
                                                   ("tenants share a public prompt", 4, 1, 2, True)):
        common = tokens(system_len)
        systems = {t: common if public else tokens(system_len) for t in range(tenants)}
        out[name] = [(f"t{t}", f"t{t}-u{u}", systems[t] + tokens(question_len))
                     for _ in range(requests) for t in range(tenants) for u in range(users)]
    return out


def _policy_keys(workloads: dict) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """Each user's key, and the two keys files: key -> tenant, and key -> itself (a tenant per key)."""
    users = sorted({(tenant, user) for sent in workloads.values() for tenant, user, _ in sent})
    key_of = {user: f"sk-{user}" for _, user in users}
    return key_of, {key_of[user]: tenant for tenant, user in users}, {key_of[user]: user for _, user in users}


# --- the review --------------------------------------------------------------------------------


def _check_stubs(lab: ModuleType) -> None:
    """The first exercise the review runs that is still a stub, as the NotImplementedError it would raise."""
    stubs = unsolved_exercises(lab)
    for number in NEEDS:
        if number in stubs:
            raise NotImplementedError(f"Exercise {number}: {stubs[number][0]}")


def _engine(lab: ModuleType, shape: dict = ATTACK_MODEL):
    model = lab.ToyTransformer(lab.ModelConfig(**shape), seed=0)
    return lab.LLMEngine(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=8,
                         max_num_batched_tokens=512, enable_prefix_caching=True)


def _salt_costs(lab: ModuleType, workloads: dict, key_of: dict[str, str],
                keys_by_policy: tuple) -> dict[str, dict[str, SaltCost]]:
    """Question 3: each workload sent to a fresh server under each policy (POLICIES, whose API keys
    are `keys_by_policy`): the prefix-cache hits it got, and the prompt tokens it sent."""
    costs: dict[str, dict[str, SaltCost]] = {name: {} for name in workloads}
    for policy, api_keys in zip(POLICIES, keys_by_policy):
        with start_server(_engine(lab, COUNT_MODEL), lab=lab, api_keys=api_keys) as server:
            for name, sent in workloads.items():  # their prompts share nothing: the servers' hits add up
                before = prefix_cache_hits(server.port)
                for _, user, prompt in sent:
                    first_token_seconds(server.port, prompt, key_of[user] if api_keys else None)
                costs[name][policy] = SaltCost(prefix_cache_hits(server.port) - before,
                                               sum(len(p) for *_, p in sent), BLOCK_SIZE)
    return costs


def run_attack(lab: ModuleType, question: AttackQuestion = AttackQuestion(), log=None) -> AttackReview:
    """The three questions of the module docstring, on two (then three) servers of the module's engine,
    with OpenBLAS on one thread while they run (its count put back after)."""
    _check_stubs(lab)
    with one_blas_thread() as blas_threads:
        review = _run_attack(lab, question, log or (lambda line: None))
    review.blas_threads = blas_threads
    review.text = format_review(lab, review)
    return review


def _run_attack(lab: ModuleType, q: AttackQuestion, log) -> AttackReview:
    rng = np.random.default_rng(q.seed)
    start = time.perf_counter()
    workloads = salt_workloads(np.random.default_rng([q.seed, 1]), BLOCK_SIZE)
    key_of, per_tenant, per_key = _policy_keys(workloads)
    tenants = {VICTIM_KEY: "victim", ATTACKER_KEY: "attacker"}
    shared, salted = CacheResult(), CacheResult()
    with (start_server(_engine(lab), lab=lab) as open_server,
          start_server(_engine(lab), lab=lab, api_keys=tenants) as keyed):
        sides = ((open_server.port, None, None, shared), (keyed.port, VICTIM_KEY, ATTACKER_KEY, salted))

        def both(rounds_of) -> None:
            """Ask both servers, in a random order each time (drift on the machine falls on both)."""
            for i in rng.permutation(2):
                rounds_of(*sides[i])

        def tokens(n: int) -> list[int]:
            return rng.integers(0, ATTACK_MODEL["vocab_size"], n).tolist()

        log(f"question 1: {q.trials} correct and {q.trials} wrong guesses of a {q.prefix_blocks}-block prefix, "
            f"timed and counted on /metrics ...")
        for _ in range(q.trials):
            secret, wrong = tokens(q.prefix_blocks * BLOCK_SIZE), tokens(q.prefix_blocks * BLOCK_SIZE)

            def guess(port, victim, attacker, result):
                first_token_seconds(port, secret + tokens(BLOCK_SIZE // 2), victim)  # the victim's request
                for correct in rng.permutation(2):
                    before = prefix_cache_hits(port)
                    seconds = first_token_seconds(port, (secret if correct else wrong) + tokens(1), attacker)
                    added = prefix_cache_hits(port) - before
                    (result.correct_s if correct else result.wrong_s).append(seconds)
                    (result.correct_hits if correct else result.wrong_hits).append(added)
            both(guess)

        log(f"question 2: {_n(q.secrets, 'secret')} of {_n(q.secret_blocks, 'block')}, {q.candidates} candidates a "
            f"block ...")
        for _ in range(q.secrets):
            secret = tokens(q.secret_blocks * BLOCK_SIZE)
            truth = [secret[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE] for i in range(q.secret_blocks)]
            recovered: dict[int, list[list[int]]] = {open_server.port: [], keyed.port: []}  # by server
            both(lambda port, victim, attacker, result: first_token_seconds(port, secret + tokens(BLOCK_SIZE // 2),
                                                                            victim))
            for i in range(q.secret_blocks):
                candidates = [truth[i]] + [tokens(BLOCK_SIZE) for _ in range(q.candidates - 1)]
                order = rng.permutation(q.candidates)

                def recover(port, victim, attacker, result, i=i, candidates=candidates, order=order):
                    known = recovered[port]
                    times = {int(c): first_token_seconds(port, sum(known, []) + candidates[c] + tokens(1), attacker)
                             for c in order}
                    best = min(times, key=times.__getitem__)
                    known.append(candidates[best])
                    result.blocks_right += best == 0
                both(recover)
            for port, _, _, result in sides:
                result.secrets_whole += recovered[port] == truth

    log("question 3: what salting costs, three workloads under three policies ...")
    costs = _salt_costs(lab, workloads, key_of, (None, per_tenant, per_key))
    return AttackReview(q, shared, salted, costs, time.perf_counter() - start, dict(ATTACK_MODEL))


def _ms(seconds: list[float]) -> str:
    return f"{np.median(seconds) * 1e3:.1f} ms"


def format_review(lab: ModuleType, review: AttackReview) -> str:
    """The review's printout: what was measured, the three answers side by side, what it means."""
    q, shared, salted, m = review.question, review.shared, review.salted, review.model
    name = lab.__name__ if lab.__name__ != "__main__" else "this module"
    n_blocks = q.secrets * q.secret_blocks
    chance = 1 / q.candidates
    lines = [
        f"The prefix cache's side channels, timing and /metrics: a design review on {name}'s engine, served on "
        f"127.0.0.1",
        f"Model: a toy GPT-2 of {m['n_layer']} layers x {m['n_embd']} (random weights), blocks of {BLOCK_SIZE} "
        f"tokens, prefix caching on. Two servers of it side by side: one shared cache (no keys), and per-tenant "
        f"salts (a victim's key and an attacker's). The attacker times the first streamed token of its own "
        f"max_tokens=1 requests, one at a time, over loopback; each guess is timed once (a second send would "
        f"hit its own blocks), and /metrics is read before and after it. Seed {q.seed}; {review.seconds:.1f} s; "
        f"{_blas(review.blas_threads)}.",
        "",
        f"1. A correct guess against a wrong one: {q.trials} of each, a {q.prefix_blocks}-block "
        f"({q.prefix_blocks * BLOCK_SIZE}-token) prefix the victim sent, then one fresh token",
        f"   {'':<40}{'one shared cache':>20}{'per-tenant salts':>20}",
        f"   {'first token, correct guess (median)':<40}{_ms(shared.correct_s):>20}{_ms(salted.correct_s):>20}",
        f"   {'first token, wrong guess (median)':<40}{_ms(shared.wrong_s):>20}{_ms(salted.wrong_s):>20}",
    ]
    lines.append(f"   {'ROC AUC, quicker = correct (95% interval)':<40}{_auc(shared, shared.auc):>20}"
                 f"{_auc(salted, salted.auc):>20}")
    lines += [
        f"   {'/metrics: hits a correct guess added':<40}{_hits(shared.correct_hits):>20}"
        f"{_hits(salted.correct_hits):>20}",
        f"   {'/metrics: hits a wrong guess added':<40}{_hits(shared.wrong_hits):>20}{_hits(salted.wrong_hits):>20}",
        f"   {'ROC AUC, more hits = correct':<40}{_auc(shared, shared.counter_auc):>20}"
        f"{_auc(salted, salted.counter_auc):>20}",
    ]
    lines += [
        "",
        f"2. Recovering a secret system prompt block by block: {_n(q.secrets, 'secret')} of "
        f"{_n(q.secret_blocks, 'block')}, {q.candidates} candidates a block (chance {chance:.1%})",
        f"   {'blocks recovered':<40}{_frac(shared.blocks_right, n_blocks):>20}"
        f"{_frac(salted.blocks_right, n_blocks):>20}",
        f"   {'secrets recovered whole':<40}{f'{shared.secrets_whole}/{q.secrets}':>20}"
        f"{f'{salted.secrets_whole}/{q.secrets}':>20}",
        "",
        "3. What salting costs: prefix-cache hits (blocks) / tokens prefilled, one request at a time",
        f"   {'workload':<34}" + "".join(f"{p:>22}" for p in POLICIES),
    ]
    for workload, by_policy in review.costs.items():
        lines.append(f"   {workload:<34}" + "".join(f"{f'{c.hits} / {c.prefill_tokens:,}':>22}"
                                                     for c in by_policy.values()))
    lines += ["", _verdict(review)]
    return "\n".join(lines)


def _auc(result: CacheResult, auc: float) -> str:
    """An AUC with its 95% interval."""
    low, high = auc_interval(auc, len(result.correct_s), len(result.wrong_s))
    return f"{auc:.2f} ({low:.2f}-{high:.2f})"


def _hits(added: list[int]) -> str:
    """The prefix-cache hits guesses added: the range, in blocks."""
    return f"{min(added)}-{max(added)} blocks" if min(added) != max(added) else f"{added[0]} blocks"


def _blas(threads: int | None) -> str:
    if threads is None:
        return "NumPy's BLAS is not OpenBLAS: its threads are its own"
    return f"OpenBLAS on 1 thread for the review (it had {threads})"


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _frac(k: int, n: int) -> str:
    return f"{k}/{n} ({k / n:.0%})"


def _verdict(review: AttackReview) -> str:
    shared, salted, costs = review.shared, review.salted, review.costs
    nothing, users, public = (costs[w] for w in costs)
    per_block = (np.median(shared.wrong_s) - np.median(shared.correct_s)) / review.question.prefix_blocks
    return (
        f"What it says: with one shared cache a hit skips the prefill of the cached blocks (about "
        f"{per_block * 1e3:.1f} ms a block here), and the attacker's first-token clock sees it: AUC "
        f"{shared.auc:.2f}, and {shared.blocks_right} of the secrets' blocks recovered against "
        f"{salted.blocks_right} with salts. A per-tenant salt is in the first block's hash (and, chained, in every "
        f"later one's), so a guess sent under the attacker's key hashes to other blocks than the victim's: it can "
        f"only find blocks the "
        f"attacker sent itself, and its timing says nothing about anyone else (AUC {salted.auc:.2f}). /metrics "
        f"needs no clock: its hit counter rose by {_hits(shared.correct_hits)} after each correct guess and "
        f"{_hits(shared.wrong_hits)} after each wrong one (AUC {shared.counter_auc:.2f}); with salts "
        f"{_hits(salted.correct_hits)} and {_hits(salted.wrong_hits)} (AUC {salted.counter_auc:.2f}). Whoever reads "
        f"/metrics on a shared cache reads which prompts were sent: give it to operators (serve --metrics-api-key), "
        f"not to clients. The salt "
        f"must come from the key (the server's idea of who is calling), never from the body, or the attacker "
        f"sends the victim's. It costs nothing where tenants share nothing ({nothing[POLICIES[0]].hits} hits "
        f"either way) and nothing for the users of one tenant ({users[POLICIES[0]].hits} vs "
        f"{users[POLICIES[1]].hits}; a salt per key would cost {users[POLICIES[0]].hits - users[POLICIES[2]].hits} "
        f"of them). It costs exactly the hits across tenants: a public prompt every tenant sends is prefilled "
        f"once per tenant ({public[POLICIES[0]].hits} -> {public[POLICIES[1]].hits} hits, "
        f"{public[POLICIES[1]].prefill_tokens - public[POLICIES[0]].prefill_tokens:,} more tokens prefilled).")
