"""tokenbroker: tokenization offloaded from the inference scheduler, over ZeroMQ."""

__version__ = "0.1.0"

# This is the public API: the client, its results and its errors (docs/client.md). Everything
# else in the package (the broker, the workers, the CLI, modules starting with `_`) is not.
from tokenbroker.client import (
    AsyncClient,
    AsyncDetokenizeStream,
    BadRequest,
    BlockHashes,
    BlockHashSpec,
    CacheInfo,
    ChatTokens,
    Client,
    Count,
    DetokenizeStream,
    EndpointStatus,
    Forbidden,
    Internal,
    InvalidInput,
    ModelInfo,
    ModelState,
    Offsets,
    Overloaded,
    Pong,
    RemovedModel,
    StreamDelta,
    TemplateError,
    Text,
    TextBatch,
    Timeout,
    TokenbrokerError,
    Tokens,
    TokensBatch,
    TooLarge,
    Unavailable,
    UnknownModel,
    UnknownOp,
    WorkerFailed,
    block_hash_int64,
)

__all__ = [
    "AsyncClient", "Client", "AsyncDetokenizeStream", "DetokenizeStream", "StreamDelta", "EndpointStatus",
    "Tokens", "TokensBatch", "Text", "TextBatch", "ChatTokens", "Count", "ModelInfo", "ModelState", "Pong",
    "RemovedModel", "CacheInfo", "Offsets", "BlockHashes", "BlockHashSpec", "block_hash_int64",
    "TokenbrokerError", "BadRequest", "UnknownOp", "UnknownModel", "TooLarge", "TemplateError", "InvalidInput",
    "Forbidden", "Overloaded", "Timeout", "WorkerFailed", "Internal", "Unavailable",
]
