"""Type stub of broker/_outbox.pyx."""

from __future__ import annotations

from typing import Any, Container

from tokenbroker.common.protocol import Envelope

def add_reply(outbox: dict[Envelope, list[bytes | memoryview]], envelope: Envelope, payload: bytes | memoryview) -> None: ...
def send_replies(sock: Any, outbox: dict[Envelope, list[bytes | memoryview]], arrays: set[bytes], holding: Container[bytes],
                 frame_bytes: int) -> None: ...
