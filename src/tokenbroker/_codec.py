"""The client's compiled per-call path, one module per concern (as the broker's core is split):

- `_packer`: a request's fields as MessagePack, byte for byte msgpack's (`pack`, `pack_entries`,
  `request`, `tokenize_head`, `heads`);
- `_calls`: the call registry (`Call`, `Batch`, `submit_one`, `submit_batch`, `configure`);
- `_frames`: a loop turn's requests cut into frames, each written in place into the message
  libzmq sends (`send`; `frames` gives them as bytes);
- `_replies`: every reply frame waiting read from the message it arrived in, each whole, then every
  call it answers settled (`drain`; `settle` for one frame's bytes, `unpack`, `build`).

This module names them together for the engine and the tests.
"""

from ._calls import (KIND_CHAT, KIND_CHAT_LIST, KIND_RAW, KIND_TEXT, KIND_TOKENS, KIND_TOKENS_LIST, Batch, Call,
                     configure, submit_batch, submit_one)
from ._frames import frames, send
from ._packer import heads, pack, pack_entries, request, tokenize_head
from ._replies import build, drain, settle, unpack

__all__ = ["KIND_CHAT", "KIND_CHAT_LIST", "KIND_RAW", "KIND_TEXT", "KIND_TOKENS", "KIND_TOKENS_LIST", "Batch", "Call",
           "build", "configure", "drain", "frames", "heads", "pack", "pack_entries", "request", "send", "settle", "submit_batch",
           "submit_one", "tokenize_head", "unpack"]
