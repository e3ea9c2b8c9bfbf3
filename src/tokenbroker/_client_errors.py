"""The client's exceptions: one base carrying the protocol's error code, one subclass per code.

A scheduler catches what it can act on (`Overloaded`: back off; `UnknownModel`: fix its config;
`Unavailable`: no broker answered in time) and lets the rest surface. Codes are the table of
docs/protocol.md, "Reply"; `unavailable` is the client's own (no reply reached it in time).
"""

from __future__ import annotations

from typing import Any

from tokenbroker.common.errors import ERROR_CODES


class TokenbrokerError(Exception):
    """A call failed; `code` is the protocol's error code (or `unavailable`), `message` says why."""

    code: str = "internal"

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class BadRequest(TokenbrokerError):
    """The request was malformed: a missing or mistyped field (the message names it)."""


class UnknownOp(TokenbrokerError):
    """The broker does not serve this op (an older broker, for ops of a later protocol version)."""


class UnknownModel(TokenbrokerError):
    """No tokenizer answers to the `model` given (or its source failed to load)."""


class TooLarge(TokenbrokerError):
    """The request is larger than the broker's `--max-request-bytes`."""


class TemplateError(TokenbrokerError):
    """The model has no chat template, or its template raised (the template's message is kept)."""


class InvalidInput(TokenbrokerError):
    """Understood but not processable: an id outside the vocabulary, malformed JSON with `strict`..."""


class Forbidden(TokenbrokerError):
    """An admin op from a client that may not use it."""


class Overloaded(TokenbrokerError):
    """Every broker tried was full until the call's deadline (the client retries before raising)."""


class Timeout(TokenbrokerError):
    """The broker's deadline passed before a worker answered."""


class WorkerFailed(TokenbrokerError):
    """A worker died twice while holding this request."""


class Internal(TokenbrokerError):
    """A bug in the broker or a worker; the broker logs it with the request id."""


class Unavailable(TokenbrokerError):
    """Client side: no broker answered before the call's deadline (down, unreachable, or too slow)."""


# One class per code of the protocol's list (common/errors.py), named after it (bad_request:
# BadRequest), and the client's own `unavailable`: a code without its class fails at import.
ERRORS: dict[str, type[TokenbrokerError]] = {
    code: globals()[code.title().replace("_", "")] for code in (*ERROR_CODES, "unavailable")
}


def error_from_reply(reply: dict[str, Any]) -> TokenbrokerError:
    """The exception for an error reply; a code this client does not know becomes the base class."""
    error = reply.get("error")
    if not isinstance(error, dict):
        return Internal("internal", f"error reply without an error map: {reply!r}")
    code, message = str(error.get("code")), str(error.get("message"))
    return ERRORS.get(code, TokenbrokerError)(code, message)
