"""Routing keys: which cached prefix a request is likely to extend, derived without tokenizing.

A worker's L1 cache holds prefixes of texts it has tokenized, so a request is cheapest on the
worker that last tokenized its longest prefix. The broker never tokenizes or renders; it hashes.

`route_key()` returns a `RouteKey`:

- `blocks`: prefix hashes, shallow to deep. Block i is the 16-byte hash of a seed (op kind and
  model) followed by the input's first `BOUNDARIES[i]` bytes. One running hash (a 128-bit
  streaming hash of the compiled core, broker/_core.pyx) is fed each byte once and digested at
  every boundary, so a request costs one pass over at most `MAX_HASHED_BYTES` bytes; no Python
  code touches the input. Because boundaries sit at fixed offsets, a text that extends
  another (turn k+1 of a conversation extends turn k) shares every full block of the shorter one.
  The last block is the whole input when it ends between boundaries (so identical repeats share
  their deepest block: the L0 case); input beyond `MAX_HASHED_BYTES` is not hashed, and texts
  that agree that far share a worker, which is what their long common prefix wants anyway.
- `key`: the rendezvous key used when the router's prefix index knows none of the blocks. It is
  the first block (model + first `BOUNDARIES[0]` bytes, or the first message), which every turn of a
  conversation shares, or a hash of the `affinity` field when the client gave one (then
  `blocks` is empty: the client said what belongs together).

Block sizes grow with depth: 256 bytes up to 2 KiB, then an eighth of the offset, capped at
4 KiB. Fine blocks near the start find where a conversation leaves a shared system prompt; coarse
blocks deep in a long text keep the block count (and the router's index entries per request) at
`MAX_BLOCKS`. An input shorter than 256 bytes is one block; its next, longer turn shares no block
with it and may land elsewhere, which costs re-tokenizing under 256 bytes.

Per op:

- `tokenize`: the UTF-8 bytes of `text`. A batch is hashed as one stream, its texts joined by
  0xFF (a byte UTF-8 never holds, so ["ab", "c"] and ["a", "bc"] differ); a batch of one is the
  same stream as its text, and a batch that starts with a conversation's text shares its blocks.
- `chat`: the broker does not render the template, so each message is one block: the running hash
  takes each message's MessagePack bytes as the client sent them, a map's entries sorted by key
  (so a client's key order does not matter), length-prefixed. Nothing is decoded: the bytes are
  found by skipping values in C, and at most `MAX_HASHED_BYTES` of them are hashed. Turn k+1 shares
  its first k messages' blocks with turn k; users of one system prompt share the first block.
  `tools` and `chat_template_kwargs` go into the seed, since templates render them up front.
- `count`: a map body is treated like chat, taking its message list (`messages`, `contents` or
  `input`) with the body's system/instructions/tools fields in the seed; a str/bin body is hashed
  as text.
- `detokenize`, `models`, `ping`: no key (None); any worker serves them equally well.

Routing reads the request's raw MessagePack (`Peek`, from the frontend), never a decoded payload,
and hashes at most `MAX_HASHED_BYTES` of it, so its cost is bounded whatever the request's size.
A malformed op field never raises here: the key falls back to the model alone and the worker
answers the request with its `bad_request`.

The hash is not SHA-256 (it was, through hashlib: a Python call per block, 367 us of broker CPU
per 12-message chat): keys need spread and prefix sharing, and are never compared across
processes, so the core's own streaming hash does, at about a byte per cycle. The work lives in
broker/_core.pyx (`route_key`); this module names the design and its constants.
"""

from __future__ import annotations

from ._core import (BOUNDARIES, DIGEST_BYTES, GROWTH_DIVISOR, KEYLESS_OPS, MAX_BLOCK, MAX_BLOCKS, MAX_HASHED_BYTES,
                    MIN_BLOCK, RouteKey, route_key, seed, text_blocks)

BATCH_SEPARATOR = b"\xff"

__all__ = ["BATCH_SEPARATOR", "BOUNDARIES", "DIGEST_BYTES", "GROWTH_DIVISOR", "KEYLESS_OPS", "MAX_BLOCK", "MAX_BLOCKS",
           "MAX_HASHED_BYTES", "MIN_BLOCK", "RouteKey", "route_key", "seed", "text_blocks"]
