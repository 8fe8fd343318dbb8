"""What crosses the boundary between the engine and the front end: one small dataclass per kind,
pickled by the transport. The front end sends `Ready`, `StartupError`, `AddRequests`,
`AbortRequest`, `Answered` and `Bye`; the engine sends `StepReport` (each request's `StepOutput`),
`EngineFailed` and `Shutdown`."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple


def sample_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's `n` samples, as the engine names them (`LLMEngine.add_request`): the
    request's own id for sample 0, then "ID.1" .. "ID.{n-1}", the forks. Choice j of a prompt is
    sample j."""
    return [request_id] + [f"{request_id}.{j}" for j in range(1, n)]


# --- what crosses the boundary: front end -> engine ----------------------------------------


@dataclasses.dataclass(slots=True)
class Ready:
    """The front end accepts connections."""


@dataclasses.dataclass(slots=True)
class StartupError:
    """The front end could not start: why."""

    message: str


@dataclasses.dataclass(slots=True)
class AddRequests:
    """Requests to queue, in one step: one response's prompts, a Request each. The engine runs each
    prompt once and forks it into `n` samples (`sample_ids`)."""

    requests: list
    n: int = 1


@dataclasses.dataclass(slots=True)
class AbortRequest:
    """Stop a sample now (its client went, a stop string ended it, or the front end failed it)."""

    request_id: str


@dataclasses.dataclass(slots=True)
class Answered:
    """After `EngineFailed`: the samples the front end failed; the engine drops or aborts them."""

    request_ids: list[str]


@dataclasses.dataclass(slots=True)
class Bye:
    """The front end is done: nothing after this."""


# --- what crosses the boundary: engine -> front end ----------------------------------------


@dataclasses.dataclass(slots=True)
class StepReport:
    """What one engine step did: the samples the engine's checks refused ({id: (field, message)}),
    each sample's output, and the gauges of /metrics after the step."""

    rejected: dict[str, tuple[str | None, str]]
    outputs: list[StepOutput]
    gauges: dict[str, float]


@dataclasses.dataclass(slots=True)
class EngineFailed:
    """A step raised: every request in flight fails with `message`; the engine waits for `Answered`."""

    message: str


@dataclasses.dataclass(slots=True)
class Shutdown:
    """The server is closing: the front end stops taking requests and ends those in flight."""


class StepOutput(NamedTuple):
    """One request's part of one engine step, as the front end receives it: the engine's output
    (only what is new) with the logprobs of its new tokens where asked, and the prompt's
    logprobs with the request's first output where asked."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    finish_reason: str | None = None
    finish_detail: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
