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
    """Raised where a request is found wanting; what catches it answers with common.protocol.error_reply."""

    def __init__(self, code: str, message: str) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown protocol error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message


class BootError(Exception):
    """A worker cannot load its tokenizers: the broker refuses to start and shows this message."""
