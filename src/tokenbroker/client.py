"""The Python client of tokenbroker: `Client` (threads) and `AsyncClient` (asyncio), typed per op.

Both pipeline any number of calls over one DEALER per broker, match replies by id, send each
call's deadline as `deadline_ms`, leave a broker that stops answering for another and retry
`overloaded` within the deadline. docs/client.md shows both feeding a scheduler loop. The pieces
live in private modules (`_client_*`); what is public is listed here and in `tokenbroker`.
"""

from ._client_async import AsyncClient
from ._client_core import DEFAULT_ENDPOINT, EndpointStatus
from ._client_errors import (
    BadRequest,
    Forbidden,
    Internal,
    InvalidInput,
    Overloaded,
    TemplateError,
    Timeout,
    TokenbrokerError,
    TooLarge,
    Unavailable,
    UnknownModel,
    UnknownOp,
    WorkerFailed,
)
from ._client_results import (
    BlockHashes,
    BlockHashSpec,
    CacheInfo,
    ChatTokens,
    Count,
    ModelInfo,
    ModelState,
    Offsets,
    Pong,
    RemovedModel,
    Text,
    TextBatch,
    Tokens,
    TokensBatch,
    block_hash_int64,
)
from ._client_stream import AsyncDetokenizeStream, DetokenizeStream, StreamDelta
from ._client_sync import Client

__all__ = [
    "AsyncClient", "Client", "DEFAULT_ENDPOINT", "EndpointStatus",
    "AsyncDetokenizeStream", "DetokenizeStream", "StreamDelta",
    "CacheInfo", "ChatTokens", "Count", "ModelInfo", "ModelState", "Pong", "RemovedModel", "Text", "TextBatch",
    "Tokens", "TokensBatch", "Offsets", "BlockHashes", "BlockHashSpec", "block_hash_int64",
    "TokenbrokerError", "BadRequest", "UnknownOp", "UnknownModel", "TooLarge", "TemplateError", "InvalidInput",
    "Forbidden", "Overloaded", "Timeout", "WorkerFailed", "Internal", "Unavailable",
]
