"""One request of either endpoint, run on the engine and answered (vLLM: `OpenAIServing` in
`vllm/entrypoints/openai/serving_engine.py`): its choices submitted, their step outputs turned
into text by `output.ChoiceState`, and the response written whole or as server-sent events.
What differs between the two endpoints, the shape of a choice, is theirs:
`serving_completion.py` and `serving_chat.py`.

`n` has one home, the engine: each prompt goes to it once, and `LLMEngine.add_request(request,
n=n)` runs the prompt once and forks its block table into the n samples (copy-on-write, the
PagedAttention paper's parallel sampling), whose ids `engine.messages.sample_ids` gives. Here a choice
is a sample. At most `max_n` of one response's choices (prompts x n) are in the engine at a time,
the next prompt going in once its n samples fit, so that no response holds more of the engine's
seats than one request's largest n: another client's request finds the rest.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
import time

from .engine.async_llm import AsyncLLM
from .engine.messages import sample_ids
from .http_server import Connection, Sink
from .metrics import FINISHED_REASONS, TTFT_BUCKETS_S, Histogram
from .output import ChoiceState, Delta
from .protocol import APIError, GenerateRequest, ServedModel, field_error, usage
from .serving_chat import ChatFormat
from .serving_completion import CompletionFormat

_CLIENT_GONE = object()  # put in a request's queue when its client disconnects


def client_gone() -> APIError:
    """The answer to a client whose end of stream came before its answer (one that half-closed
    still reads it; one that has gone never will)."""
    return APIError("the client's end of stream (a close, a half-close or a reset) came before the answer: the "
                    "request is aborted, as vLLM aborts a request whose client disconnects. Keep the connection "
                    "open until the answer is read.")


class Release:
    """When each of a response's prompts goes to the engine, with its `n` samples: while at most
    `cap` (>= n) of the response's choices run at once, the next prompt as soon as its n fit."""

    def __init__(self, requests: list, n: int, cap: int):
        if not 1 <= n <= cap:  # else no prompt ever fits, and the response would wait forever
            raise ValueError(f"n must be 1..cap ({cap}), got {n}")
        self.ready = collections.deque(requests)
        self.running: set[str] = set()  # the samples in the engine
        self.n = n
        self.cap = cap

    def next(self, sample_id: str | None = None, finished: bool = False) -> list:
        """The requests to submit now, after an output of `sample_id` (None: at the start);
        `finished`: that output ended its choice."""
        if finished:
            self.running.discard(sample_id)
        batch = []
        while self.ready and len(self.running) + self.n <= self.cap:
            batch.append(self.ready.popleft())
            self.running.update(sample_ids(batch[-1].request_id, self.n))
        return batch


class FrontendStats:
    """What /metrics reports of the front end: the TTFT histogram, the token counters (a prompt's
    tokens once its first token comes out, generated tokens as they come, as vLLM counts both), and the
    requests (choices: each is one request in the engine) that finished, by finish reason:
    "stop" and "length" for answers written, "abort" for those aborted before they finished."""

    def __init__(self):
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0}
        self.finished = dict.fromkeys(FINISHED_REASONS, 0)


class OpenAIServing:
    def __init__(self, served: ServedModel, bridge: AsyncLLM, stats: FrontendStats, stream_interval: int = 1):
        self.served = served
        self.bridge = bridge
        self.stats = stats
        self.stream_interval = stream_interval
        self.formats = {"completion": CompletionFormat(served), "chat": ChatFormat(served)}

    async def generate(self, gen: GenerateRequest, conn: Connection, sink: Sink) -> None:
        """Run every choice of `gen` and answer. The status line waits for the engine's first
        word (a token or a refusal), so a request the engine refuses is still a clean 400; a
        disconnect (`client_gone`) or a failure aborts every sample still running, a stop string
        its own, and each that was running counts as finished by "abort"."""
        received = time.perf_counter()
        choices = [sample for r in gen.requests for sample in sample_ids(r.request_id, gen.n)]  # prompt-major
        states = {sample: ChoiceState(i, self.served.tokenizer, gen.stop, gen.stop_token_ids,
                                      gen.include_stop_str_in_output, gen.skip_special_tokens,
                                      gen.eos_token_id, gen.min_tokens)
                  for i, sample in enumerate(choices)}
        queue: asyncio.Queue = asyncio.Queue()
        release = Release(gen.requests, gen.n, self.served.max_n)
        self.bridge.submit(release.next(), queue, gen.n)
        watcher = asyncio.create_task(conn.watch_disconnect())
        watcher.add_done_callback(lambda t: t.cancelled() or not t.result() or queue.put_nowait(_CLIENT_GONE))
        try:
            updates = self._updates(gen, states, queue, release, received)
            respond = self._stream if gen.stream else self._respond_whole
            await respond(gen, states, updates, sink)
        except ConnectionError:
            sink.keep_alive = False
        finally:
            watcher.cancel()
            for request_id, state in states.items():
                if not state.finished:  # the client went, or a choice failed: the rest must not run on
                    self.stats.finished["abort"] += self.bridge.abort(request_id)

    async def _updates(self, gen: GenerateRequest, states: dict, queue: asyncio.Queue, release: Release,
                       received: float):
        """(state, Delta, more) per step output, until every choice is finished; `more`: another
        output is already waiting (a stream writes once for all of them, see _stream). A late
        output of an ended choice gives (None, None, False) when nothing follows it."""
        unfinished = set(states)
        first = True
        prefilled = set()
        while unfinished:
            item = await queue.get()
            if item is _CLIENT_GONE:
                raise client_gone()
            if isinstance(item, APIError):  # a refused field (a 400), or the engine's failure (a 500)
                raise field_error(str(item), item.param, gen.param(item.param)) if item.param else item
            state = states.get(item.request_id)
            if state is None or state.finished:  # a late output of a choice that has ended
                if queue.empty():
                    yield None, None, False  # nothing to add: what is held must go out now
                continue
            if first and item.new_token_ids:
                self.stats.ttft.observe(time.perf_counter() - received)
                first = False
            prompt = state.index // gen.n  # choices are prompt-major
            if item.new_token_ids and prompt not in prefilled:  # vLLM counts a prompt once its prefill is done
                prefilled.add(prompt)
                self.stats.counters["prompt_tokens"] += len(gen.prompts[prompt])
            delta = state.update(item)
            self.stats.counters["generation_tokens"] += len(delta.token_ids)  # as produced, as vLLM counts them
            if state.finished:
                unfinished.discard(item.request_id)
                if not item.finished:  # a stop string: the engine must stop too
                    self.bridge.abort(item.request_id)
            if more := release.next(item.request_id, state.finished):
                self.bridge.submit(more, queue, gen.n)
            yield state, delta, not queue.empty()

    def _header(self, gen: GenerateRequest, kind: str) -> dict:
        return {"id": gen.response_id, "object": kind, "created": int(time.time()), "model": gen.model}

    def _usage(self, gen: GenerateRequest, states: dict) -> dict:
        return usage(sum(map(len, gen.prompts)), sum(len(s.token_ids) for s in states.values()))

    def _count(self, gen: GenerateRequest, states: dict) -> None:
        for state in states.values():
            self.stats.finished[state.finish_reason] = self.stats.finished.get(state.finish_reason, 0) + 1

    async def _respond_whole(self, gen: GenerateRequest, states: dict, updates, sink: Sink) -> None:
        async for _ in updates:
            pass
        self._count(gen, states)
        form = self.formats[gen.kind]
        ordered = sorted(states.values(), key=lambda s: s.index)
        choices = [form.choice(gen, ordered, s, None, True) for s in ordered]
        sink.json(200, self._header(gen, form.whole) | {"choices": choices, "usage": self._usage(gen, states)})

    async def _stream(self, gen: GenerateRequest, states: dict, updates, sink: Sink) -> None:
        """Server-sent events: a chunk per choice per step that moved it (the chat API's first
        chunk of each choice carries its role), the usage if asked, then [DONE].

        Every chunk goes out as soon as nothing else is waiting: when the engine is ahead of the
        loop (several steps' outputs queued), their chunks leave in one write, not one each. A
        write is a system call, and at saturation those calls are what the server spends its
        time on; the chunks themselves are the same either way. With `stream_interval` k > 1 a
        choice's chunk carries k tokens (its last one fewer), as SGLang's `--stream-interval`:
        fewer events and writes for a coarser stream."""
        form = self.formats[gen.kind]
        ordered = sorted(states.values(), key=lambda s: s.index)
        header = self._header(gen, form.chunk)
        writer = sink.conn.writer
        started = set()
        out = []
        held: dict[int, Delta] = {}  # per choice, what waits for `stream_interval` tokens
        try:
            async for state, delta, more in updates:
                if state is not None:
                    if state.index in held:
                        delta = held.pop(state.index).then(delta)
                    if len(delta.token_ids) < self.stream_interval and not delta.finish_reason:
                        held[state.index] = delta
                    else:
                        out += self._chunks(gen, ordered, header, state, delta, sink, started)
                if not more and out:
                    writer.write(b"".join(out))
                    out = []
                    await writer.drain()
        except APIError as exc:
            if not sink.started:
                raise  # nothing sent yet: a plain error response
            writer.write(b"".join(out) + sink.sse(exc.body()) + sink.end())  # ends the stream; not a success
            return
        self._count(gen, states)
        if not sink.started:
            out.append(sink.head(200, "text/event-stream"))
        if gen.include_usage:
            out.append(sink.sse(header | {"choices": [], "usage": self._usage(gen, states)}))
        writer.write(b"".join(out) + sink.sse("[DONE]") + sink.end())

    def _chunks(self, gen: GenerateRequest, ordered: list, header: dict, state: ChoiceState, delta: Delta,
                sink: Sink, started: set) -> list[bytes]:
        """What one update adds to the stream: the head first, the chat API's role chunks before
        anything else, then the choice's chunk if the update moved it."""
        form = self.formats[gen.kind]
        out = [] if sink.started else [sink.head(200, "text/event-stream")]
        if not started:
            out += [sink.sse(header | {"choices": [choice]}) for choice in form.opening(ordered)]
            started.add("opened")
        first = state.index not in started
        if delta.text or delta.token_ids or delta.finish_reason or (first and gen.echo):
            started.add(state.index)
            event = header | {"choices": [form.choice(gen, ordered, state, delta, first)]}
            if gen.continuous_usage:
                event["usage"] = self._usage(gen, {s.index: s for s in ordered})
            if gen.include_obfuscation:  # OpenAI's padding against reading lengths off the wire
                event["obfuscation"] = secrets.token_urlsafe(secrets.randbelow(16) + 1)
            out.append(sink.sse(event))
        return out
