"""What a call can fail with on purpose: :class:`RequestError`, a status code and a message the client can act on.

Only the servicer's own checks of a request raise it (and the engine's checks that the servicer runs on a request
before any work: :func:`request_checks`). Anything else that escapes a call is a fault of the server's, however it
is spelled: a ``ValueError`` from inside numpy or onnxruntime is ``INTERNAL`` with its traceback in the log, never
``INVALID_ARGUMENT`` (which tells the client the fault is theirs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc


class RequestError(Exception):
    """A call that fails with a status code and a message the client can act on."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def too_many(what: str, given: int, limit: int, advice: str = "split the request", key: str = "") -> RequestError:
    """RESOURCE_EXHAUSTED: ``what`` is over ``limit``; ``key`` names the config key that sets it (``limits.KEY``)."""
    setting = f" ({key})" if key else ""
    return RequestError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, f"{what}: {given} given, at most {limit}{setting}; {advice}"
    )


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


@contextlib.contextmanager
def request_checks() -> Iterator[None]:
    """Around the engine's checks of a request's content (feature definitions, list ids, references), run before any
    work: their ``ValueError`` names the field and what was expected, and is the client's to fix (INVALID_ARGUMENT).
    Never around work: there a ``ValueError`` is the server's bug."""
    try:
        yield
    except ValueError as e:
        raise invalid(str(e)) from None
