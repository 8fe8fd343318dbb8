"""An OpenAI-compatible HTTP server for one engine (vLLM: `vllm/entrypoints/openai/api_server.py`):
the processes, the routes and the model card.

`generate()` answers "how many tokens per second can this engine make?". A deployment is
asked a different question: requests arrive when they like, each one waits for its first
token (TTFT) and then for every next one (TPOT/ITL), and past some arrival rate the queue
grows without bound. This server puts the engine on a socket with the wire format of OpenAI
and vLLM (`/v1/completions`, `/v1/chat/completions`, server-sent events, `/metrics` under
vLLM's metric names), so the load generator (`benchmark_serving.py`) and OpenAI's own client
library talk to it as to a vLLM deployment.

Where each job lives: the engine stays in the caller's process, stepped by a thread of its own
(`engine/core.py`'s EngineCore); the HTTP front end runs in a forked process (`engine/` says why):
its connections and framing are `http_server.py`'s, a request's fields `protocol.py`'s (a chat's
messages `serving_chat.py`'s), running it and answering `serving_engine.py`'s (with the choices of
`serving_completion.py` and `serving_chat.py`), and tokens to text `output.py`'s. The server is
handed the engine and its module (`lab`: whose Request, SamplingParams and checks the engine
runs), never the module by name, so `python lab.py serve` serves the student's own code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import hashlib
import hmac
import inspect
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from types import ModuleType

from checkpoints.tokenizer import ByteTokenizer

from . import sampling, serving_tokenization
from .engine.async_llm import AsyncLLM
from .engine.core import EngineCore
from .engine.messages import Ready, Shutdown, StartupError
from .engine.transport import PipeReader, PipeWriter, message_pipe
from .http_server import Connection as ClientConnection
from .http_server import Connections, HTTPRequest, Sink
from .metrics import prometheus_text
from .protocol import APIError, ServedModel, model_not_found, parse_completion_request
from .serving_chat import parse_chat_request
from .serving_engine import FrontendStats, OpenAIServing

SHUTDOWN_TIMEOUT_S = 10.0
INLINE_PARSE_BYTES = 64 << 10  # bodies up to this are parsed on the event loop; larger ones on the pool
FRONTEND_PROCESS = hasattr(os, "fork")  # the front end in a process of its own (False: a thread)
logger = logging.getLogger(__name__)


# Answered without a tenant's key, as vLLM's --api-key guards only its API's paths (/v1 and the
# like): the health check, the metrics (which metrics_api_key keys for operators alone) and the
# tokenizer's routes. Those read nothing but the served tokenizer, the same for every tenant, and an
# evaluation harness asks them for it without the key it sends its completions: lm_eval's
# local-completions probes /tokenizer_info with no Authorization, and takes a tokenizer named after
# the model from elsewhere when refused (docs/serving.md#keys-and-tenants).
OPEN_PATHS = ("/health", "/metrics", "/tokenize", "/detokenize", "/tokenizer_info")


class APIKeys:
    """Who is calling (vLLM: `AuthenticationMiddleware`, with tenants): each API key's tenant, and
    each tenant's prefix-cache salt.

    A request names its key in `Authorization: Bearer <key>`. The key is checked in constant
    time: its SHA-256 is compared with every known key's by `hmac.compare_digest`, all of them,
    with no early exit, so neither how long a check takes nor where it stops says how much of a
    guess was right, or which key it was near. A tenant's salt is the HMAC-SHA256 of its name
    under a secret drawn when the server starts: it is derived on the server, the same for every
    key of one tenant, unknown to every client, and neither a key nor a tenant's name reaches the
    engine. `protocol.request_cache_salt` mixes it with a body's own `cache_salt`.
    """

    def __init__(self, api_keys: Mapping[str, str], name: str = "api_keys"):
        if not isinstance(api_keys, Mapping) or not api_keys:
            raise ValueError(f"{name} must map at least one key to its tenant, got {api_keys!r}")
        for key, tenant in api_keys.items():
            # A key travels in a header: visible ASCII, no spaces (RFC 6750's b64token is narrower).
            if not (isinstance(key, str) and key and all("!" <= c <= "~" for c in key)):
                raise ValueError(f"{name}: a key must be a non-empty string of visible ASCII characters "
                                 "(no spaces), got one that is not")  # the key itself stays out of logs
            if not (isinstance(tenant, str) and tenant):
                raise ValueError(f"{name}: a tenant must be a non-empty name, got {tenant!r}")
        secret = secrets.token_bytes(32)
        salts = {tenant: hmac.new(secret, tenant.encode(), hashlib.sha256).hexdigest()
                 for tenant in api_keys.values()}
        self._keys = [(hashlib.sha256(key.encode()).digest(), salts[tenant]) for key, tenant in api_keys.items()]
        self.num_keys, self.num_tenants = len(api_keys), len(salts)

    def tenant_salt(self, authorization: str | None) -> str:
        """The salt of the tenant whose key `authorization` (the header's value) bears; a 401
        APIError in OpenAI's shape when it bears none of them."""
        scheme, _, key = (authorization or "").partition(" ")
        digest = hashlib.sha256(key.strip().encode("latin-1")).digest()  # the head was read as latin-1
        found = None
        for known, salt in self._keys:  # every key, no early exit
            if hmac.compare_digest(digest, known):
                found = salt
        if found is None or scheme.lower() != "bearer":
            # OpenAI's answers (and its SDK raises AuthenticationError on the 401).
            message = ("You didn't provide an API key. You need to provide your API key in an Authorization "
                       "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)." if not authorization else
                       "Incorrect API key provided.")
            raise APIError(message, 401, "invalid_request_error", code="invalid_api_key")
        return found


def read_api_keys_file(path: str) -> dict[str, str]:
    """`serve --api-keys-file FILE`: a JSON object mapping each API key to its tenant's name, as
    `start_server`'s `api_keys` takes it, e.g. `{"sk-acme-1": "acme", "sk-acme-2": "acme",
    "sk-globex": "globex"}`. A ValueError naming the file for one that cannot be read or is not
    such an object (the message never quotes a key)."""
    try:
        with open(path, encoding="utf-8") as fh:
            mapping = json.load(fh)
    except OSError as exc:
        raise ValueError(f"--api-keys-file {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # bad JSON, bad UTF-8
        raise ValueError(f"--api-keys-file {path}: not JSON ({exc})") from None
    if not (isinstance(mapping, dict) and mapping):
        raise ValueError(f'--api-keys-file {path}: must hold a JSON object of "key": "tenant" pairs, at least one')
    try:
        APIKeys(mapping)
    except ValueError as exc:
        raise ValueError(f"--api-keys-file {path}: {exc}") from None
    return mapping


class APIServer:
    """An OpenAI-compatible server for one LLMEngine of the module `lab` (see start_server): the
    engine stays in this process, stepped by a thread of its own, and the HTTP front end runs in a
    forked child process (`engine/` says why), or in a thread where there is no fork.

    `.url`, `.port`, `.model_name` (the first served name), `.tokenizer`; `.close()` stops
    accepting, drops idle connections, ends every request in flight (503) and aborts it in the
    engine, and waits for both sides to end; it is idempotent. A context manager.
    """

    def __init__(self, engine, host: str = "127.0.0.1", port: int = 0, *, lab: ModuleType, tokenizer=None,
                 model_name: str | Sequence[str] | None = None, stream_interval: int = 1, max_n: int | None = None,
                 api_keys: Mapping[str, str] | None = None, metrics_api_key: str | None = None):
        self.keys = None if api_keys is None else APIKeys(api_keys)
        self.metrics_keys = None if metrics_api_key is None else APIKeys({metrics_api_key: "operator"},
                                                                         "metrics_api_key")
        for name, value in (("stream_interval", stream_interval), ("max_n", max_n)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.engine = engine
        self.host = host
        config = engine.model.config
        self.tokenizer = ByteTokenizer(config.vocab_size) if tokenizer is None else tokenizer
        names = [model_name] if isinstance(model_name, str) else list(model_name or [])
        if not all(isinstance(name, str) and name for name in names):
            raise ValueError(f"model_name must be a non-empty name or a list of them, got {model_name!r}")
        names = names or [f"toy-gpt2-{config.n_layer}x{config.n_embd}-v{config.vocab_size}"]
        self.model_name = names[0]
        # One request's n takes at most half of the running seats (each sample is a sequence).
        max_n = max(1, engine.scheduler.max_num_seqs // 2) if max_n is None else max_n
        self.served = ServedModel(lab, config, self.tokenizer, tuple(names), max_n)
        self._closed = False
        self._close_lock = threading.Lock()
        sock = socket.create_server((host, port))  # a port in use fails here, in the caller
        self.port = sock.getsockname()[1]
        commands_r, commands_w = message_pipe()  # front end -> engine
        outputs_r, outputs_w = message_pipe()  # engine -> front end
        self._pipes = [commands_r, outputs_w]  # this process's ends, closed by close()
        # The whole API whatever the engine was built with: the processors it lacks are installed
        # until close() (an engine handed over without them would refuse logprobs, penalties...).
        self._own_processors = engine.logits_processors
        engine.logits_processors = sampling.with_api_processors(engine.logits_processors,
                                                                getattr(self.tokenizer, "eos_token_id", None))
        try:
            self._start(engine, sock, commands_r, commands_w, outputs_r, outputs_w, stream_interval)
        except BaseException:  # e.g. fork refused: nothing of this server may stay open
            for end in (sock, commands_r, commands_w, outputs_r, outputs_w):
                end.close()
            engine.logits_processors = self._own_processors
            raise
        if not self._core.ready.wait(SHUTDOWN_TIMEOUT_S) or self._core.frontend_error:
            error = self._core.frontend_error or "the server's front end did not start"
            self.close()
            raise RuntimeError(error)

    def _start(self, engine, sock, commands_r, commands_w, outputs_r, outputs_w, stream_interval) -> None:
        """Start the front end (forked, or a thread) on its ends, then the engine's thread on ours."""
        frontend = _Frontend(self.served, stream_interval, self.keys, self.metrics_keys)
        args = (sock, commands_w, outputs_r)
        if FRONTEND_PROCESS:
            self._frontend = _ForkedFrontend(frontend.main, args)
            for end in args:  # the child's now
                end.close()
        else:
            self._frontend = threading.Thread(target=frontend.main, args=(*args, False), name="lab-frontend",
                                              daemon=True)
            self._frontend.start()
            self._pipes += args[1:]  # the front end's too (it closes the socket itself)
        self._core = EngineCore(self.served.lab, engine, commands_r, outputs_w)
        self._core.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server has stopped, or `timeout` seconds (None: no limit); whether it has.
        Before `close()` it stops only if its front end ends of itself (killed, or failed): the
        engine's thread sees the command pipe close, and nobody could reach the engine any more."""
        return self._core.join(timeout)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        # From a thread: a front end that has stopped reading (stuck, or stopped by a signal)
        # would block the write; killing it after the timeout below ends the write too.
        threading.Thread(target=self._core.send, args=(Shutdown(),), name="lab-close", daemon=True).start()
        self._frontend.join(SHUTDOWN_TIMEOUT_S * 3)
        if self._core.join(SHUTDOWN_TIMEOUT_S):  # the engine's thread has ended: the engine is the caller's again
            self.engine.logits_processors = self._own_processors
        for end in self._pipes:
            end.close()

    def __enter__(self) -> APIServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class _ForkedFrontend:
    """`main(*args, True)` in a forked child process; `join` waits for it (and kills it after
    `timeout`). os.fork rather than multiprocessing: the child closes every descriptor it does
    not need, multiprocessing's own pipes included."""

    def __init__(self, main, args: tuple):
        with warnings.catch_warnings():
            # Python 3.12+ warns that forking a threaded process may copy a lock another thread
            # holds. The child runs only the front end's own code (asyncio, json, the tokenizer),
            # which takes no lock of this process's other threads.
            warnings.filterwarnings("ignore", ".*fork", DeprecationWarning)
            self.pid = os.fork()
        if self.pid == 0:  # the child
            # The caller's objects came along (a test's clients, another server's pipes). The
            # collector must never finalize one: it would close a descriptor number that
            # `_close_fds_except` has freed and this process has since reused.
            gc.freeze()
            code = 1
            try:
                main(*args, True)
                code = 0
            finally:
                os._exit(code)  # never back into the caller's code (a test runner, a command line)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                return
            time.sleep(0.005)


class _Frontend:
    """The HTTP side: every connection, request and token, on one asyncio loop; talks to the
    engine only through `engine/async_llm.py`'s AsyncLLM. Built in the caller's process, run by `main` in
    the front end's process (or thread)."""

    def __init__(self, served: ServedModel, stream_interval: int = 1, keys: APIKeys | None = None,
                 metrics_keys: APIKeys | None = None):
        self.served = served
        self.stream_interval = stream_interval
        self.keys = keys
        self.metrics_keys = metrics_keys
        self.created = int(time.time())
        self.stats = FrontendStats()
        self.connections = Connections(self._route)
        self._logged: set[str] = set()  # ignored field names already logged

    def main(self, sock: socket.socket, commands: PipeWriter, outputs: PipeReader, own_process: bool) -> None:
        if own_process:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's; it closes the server
            _close_fds_except(sock, commands, outputs)
            # The caller's log handlers may write to descriptors just closed (pytest's do): this
            # process logs to its standard error, and nowhere else.
            logging.root.handlers = [logging.StreamHandler(open(2, "w", closefd=False))]
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve(sock, commands, outputs))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller of start_server
            try:
                commands.detach()
                commands.send(StartupError(f"{type(exc).__name__}: {exc}"))
            except (OSError, EOFError):
                pass
        finally:
            loop.close()
            sock.close()

    async def _serve(self, sock: socket.socket, commands: PipeWriter, outputs: PipeReader) -> None:
        self._stop = asyncio.Event()
        self._parser = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="parse")
        self.bridge = AsyncLLM(commands, outputs)
        self.bridge.on_close = self._stop.set
        self.bridge.start(asyncio.get_running_loop())
        self.openai = OpenAIServing(self.served, self.bridge, self.stats, self.stream_interval)
        server = await asyncio.start_server(self.connections.serve, sock=sock)
        self.bridge.send(Ready())
        await self._stop.wait()
        server.close()  # stop accepting
        self.connections.stop()
        self.bridge.close()  # in-flight handlers get their 503 and finish
        await self.connections.wait(SHUTDOWN_TIMEOUT_S)
        await server.wait_closed()
        self._parser.shutdown(wait=False)
        self.bridge.finish(SHUTDOWN_TIMEOUT_S)

    async def _route(self, request: HTTPRequest, conn: ClientConnection, sink: Sink) -> None:
        path, method = request.path, request.method
        # Before anything else, an unknown path included: without a key, the routes are not told.
        salt = None
        if self.keys is not None and path not in OPEN_PATHS:
            salt = self.keys.tenant_salt(request.headers.get("authorization"))
        if path == "/metrics" and self.metrics_keys is not None:  # the operators' key: a tenant's does not open it
            self.metrics_keys.tenant_salt(request.headers.get("authorization"))
        gets = {"/health", "/v1/models", "/metrics", "/tokenizer_info"}
        posts = {"/v1/completions": parse_completion_request, "/v1/chat/completions": parse_chat_request,
                 "/tokenize": serving_tokenization.tokenize, "/detokenize": serving_tokenization.detokenize}
        model_path = path.startswith("/v1/models/")
        if path not in gets and path not in posts and not model_path:
            raise APIError(f"no route {path}; try /v1/completions, /v1/chat/completions, /v1/models, /health, "
                           f"/metrics, /tokenize, /detokenize, /tokenizer_info", 404, "NotFoundError")
        allowed = ("POST",) if path in posts else ("GET", "HEAD")
        if method not in allowed:
            raise APIError(f"{path} takes {' or '.join(allowed)}, not {method}", 405)
        if path == "/health":
            sink.whole(200, "text/plain", b"")
        elif path == "/v1/models":
            sink.json(200, {"object": "list", "data": [self._model_card(name) for name in self.served.names]})
        elif model_path:
            name = path[len("/v1/models/"):]
            if name not in self.served.names:
                raise model_not_found(name)
            sink.json(200, self._model_card(name))
        elif path == "/metrics":
            sink.whole(200, "text/plain; version=0.0.4", self._metrics().encode())
        elif path == "/tokenizer_info":
            sink.json(200, serving_tokenization.tokenizer_info(self.served))
        elif path in ("/tokenize", "/detokenize"):
            sink.json(200, await self._parse(request.body, posts[path], self.served, request.body))
        else:
            gen = await self._parse(request.body, posts[path], self.served, request.body, salt)
            self._log_ignored(gen.ignored)
            await self.openai.generate(gen, conn, sink)

    async def _parse(self, body: bytes, parse, *args):
        """`parse(*args)`: on the loop for a small body; a large one off it, so that other clients'
        tokens keep flowing while its text is encoded (a tokenizer's route is open to anyone)."""
        if len(body) <= INLINE_PARSE_BYTES:
            return parse(*args)
        return await asyncio.get_running_loop().run_in_executor(self._parser, parse, *args)

    def _log_ignored(self, names: tuple[str, ...]) -> None:
        """Fields no table knows are accepted, as vLLM accepts them; each name is logged once."""
        new = [name for name in names if name not in self._logged]
        if new:
            self._logged.update(new)
            logger.warning("fields present in a request and ignored (no spec this server knows has them): %s",
                           ", ".join(new))

    def _model_card(self, name: str) -> dict:
        config = self.served.config
        return {"id": name, "object": "model", "created": self.created, "owned_by": "lab", "root": self.served.name,
                "parent": None, "max_model_len": config.n_positions, "vocab_size": config.vocab_size,
                "permission": []}

    def _metrics(self) -> str:
        return prometheus_text(self.served.name, self.bridge.gauges, self.stats.counters, self.stats.ttft,
                               self.stats.finished)


def _close_fds_except(*kept) -> None:
    """In the forked front end: close every descriptor it inherited but these and stdio, so that
    a connection or pipe of the caller's (another server's, a test client's) is not held open
    by this process after the caller closes it. The descriptors `sys.stdout` and `sys.stderr`
    write to stay too: a caller may have pointed them elsewhere (pytest does), and a closed one
    would be reused by a client's socket, into which the front end's log lines would then go."""
    streams = {stream.fileno() for stream in (sys.stdout, sys.stderr) if _has_fileno(stream)}
    keep = sorted({0, 1, 2} | streams | {k.fileno() for k in kept})
    for low, high in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024]):
        os.closerange(low + 1, high)


def _has_fileno(stream) -> bool:
    try:
        return stream.fileno() >= 0
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return False


def start_server(engine, host: str = "127.0.0.1", port: int = 0, *, lab: ModuleType | None = None, tokenizer=None,
                 model_name: str | Sequence[str] | None = None, stream_interval: int = 1,
                 max_n: int | None = None, api_keys: Mapping[str, str] | None = None,
                 metrics_api_key: str | None = None) -> APIServer:
    """Serve `engine`, an LLMEngine of the module `lab` (whose Request, SamplingParams and checks it
    runs), over HTTP from a background thread (port 0: any free port) and return the handle once it
    accepts connections. The server owns the engine until `close()`. `lab` None: the module that
    defines the engine's class, so that `start_server(engine)` serves an engine of either module;
    the project's commands hand it over.
    `tokenizer`: encodes string prompts and decodes outputs (None: a ByteTokenizer of the model's
    vocabulary); `model_name`: the id clients name, or several (vLLM's --served-model-name; the
    first is the one responses carry; None: one made of the model's shape); `stream_interval`:
    tokens per streamed chunk (1: every token as it comes); `max_n`: the largest `n` of one
    request, and how many of one response's choices (prompts x n) are in the engine at once
    (None: half of the engine's max_num_seqs). Every field of the API is served whatever the
    engine was built with: the logits processors of `serving.sampling.logits_processors()` that
    it lacks (logprobs, min_tokens, logit_bias, penalties, min_p) are installed in it, ahead of
    its own, until `close()` puts its own list back.

    `api_keys`: {key: tenant} (None: no keys, anyone may call, and one prefix cache is shared by
    all). With it the API's routes (/v1/...) need `Authorization: Bearer <key>`, else 401 in
    OpenAI's error shape, and so does an unknown path; /health, /metrics and the tokenizer's
    routes do not (OPEN_PATHS, as vLLM). Each tenant's prefix-cache salt is derived on the server
    from the key that called (`APIKeys`), so no two tenants share a block, and a body's `cache_salt`
    narrows its tenant's sharing, never reaches another's (`protocol.request_cache_salt`). Keys of
    one tenant share its cache.

    `metrics_api_key`: the key /metrics asks for (None: open, as vLLM leaves it). Its prefix-cache
    counters tell a caller whether a prompt it sent was cached, so without per-tenant salts whether
    anyone sent it before: a scraper's key, given to operators, which no tenant's key replaces."""
    lab = inspect.getmodule(type(engine)) if lab is None else lab
    return APIServer(engine, host, port, lab=lab, tokenizer=tokenizer, model_name=model_name,
                     stream_interval=stream_interval, max_n=max_n, api_keys=api_keys, metrics_api_key=metrics_api_key)


def serve(engine, host: str = "127.0.0.1", port: int = 8000, duration: float | None = None, note: str | None = None,
          *, lab: ModuleType | None = None, **options) -> bool:
    """`python solution.py serve`: run the server (`lab` and `options` as start_server's) until Ctrl-C,
    or for `duration` seconds; `note`, a line for the banner. False if its front end ended of itself
    first (killed, or failed): a server nobody can reach must not run on."""
    with start_server(engine, host, port, lab=lab, **options) as server:
        print(f"serving {', '.join(server.served.names)} at {server.url}  (POST /v1/completions "
              f"/v1/chat/completions /tokenize /detokenize, GET /v1/models /health /metrics /tokenizer_info; "
              f"Ctrl-C stops)", flush=True)
        if server.keys is None:
            print("warning: no API key (--api-key, --api-keys-file): any client may call this server, and every "
                  "client shares one prefix cache, readable by timing and by /metrics' counters "
                  "(docs/serving.md#keys-and-tenants)", file=sys.stderr, flush=True)
        else:
            print(f"API keys: {server.keys.num_keys} key(s) of {server.keys.num_tenants} tenant(s); each tenant's "
                  "prefix cache is its own; /health and the tokenizer's routes need no key", flush=True)
        if server.metrics_keys is not None:
            print("/metrics needs the metrics key (--metrics-api-key)", flush=True)
        if note:
            print(f"note: {note}", flush=True)
        if threading.current_thread() is threading.main_thread():
            # Stop on SIGINT even when it came in ignored (a shell's `serve &`), and on SIGTERM as on it.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            if server.wait(duration):
                return False
        except KeyboardInterrupt:
            print("stopping", flush=True)
    return True
