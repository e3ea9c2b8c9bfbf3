"""One exception type that carries a protocol error code (docs/protocol.md, "Reply")."""

from __future__ import annotations

# The protocol's error codes (docs/protocol.md, "Reply"), the one list: the broker and workers raise
# them (ProtocolError), common/protocol.py numbers job outcomes by this order (a W_RESULTS byte,
# so only append), and the client has one exception class per code (tokenbroker._client_errors).
ERROR_CODES: tuple[str, ...] = (
    "bad_request",
    "unknown_op",
    "unknown_model",
    "too_large",
    "template_error",
    "invalid_input",
    "forbidden",
    "overloaded",
    "timeout",
    "worker_failed",
    "internal",
)


class ProtocolError(Exception):
    """Raised where a request is found wanting, and the one shape of a refusal on either side: the
    broker answers it through broker/frontend.py's `Frontend.fail`, a worker through workers/ops.py.

    `raw_id`: the request id's MessagePack bytes to echo, when the code that found the fault read
    them (the broker's frontend, peeking at a payload); None leaves the id to whoever answers.
    """

    def __init__(self, code: str, message: str, raw_id: bytes | None = None) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown protocol error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.raw_id = raw_id


class BootError(Exception):
    """A worker cannot load its tokenizers: the broker refuses to start and shows this message."""
