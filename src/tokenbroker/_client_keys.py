"""CURVE keys as client options: the broker's public key and the client's own key pair.

Key files are pyzmq's `zmq.auth` certificate format (what `tokenbroker keys` writes). Errors name
the option and the file, because a wrong key never shows up as an error on the wire: ZeroMQ drops
the handshake and the calls time out as `Unavailable`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import zmq
import zmq.auth
from zmq.utils import z85

ServerKey = Union[str, "os.PathLike[str]", bytes]
SecretKey = Union[str, "os.PathLike[str]", tuple[bytes, bytes]]


@dataclass(frozen=True)
class CurveKeys:
    """Z85 keys to set on every socket: the broker's public key and this client's pair."""

    server_public: bytes
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.Socket) -> None:
        """Set before connect: the socket then speaks CURVE as a client of that broker."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def _z85_key(value: bytes, option: str) -> bytes:
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError(f"{option}: a z85 key must be bytes, got {type(value).__name__}")
    value = bytes(value)
    try:
        ok = len(value) == 40 and len(z85.decode(value)) == 32
    except Exception:  # z85.decode raises ValueError or KeyError on characters outside its alphabet
        ok = False
    if not ok:
        raise ValueError(f"{option}: not a z85-encoded 32-byte CURVE key (40 characters), got {len(value)} bytes")
    return value


def _load(path: str | os.PathLike[str], option: str) -> tuple[bytes, bytes | None]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{option}: no key file at {p}")
    try:
        public, secret = zmq.auth.load_certificate(p)
    except Exception as e:
        raise ValueError(f"{option}: {p} is not a zmq.auth certificate file ({e})") from e
    if public is None:
        raise ValueError(f"{option}: {p} holds no public key")
    return _z85_key(public, f"{option} ({p})"), secret


def curve_keys(server_key: ServerKey | None, secret_key: SecretKey | None) -> CurveKeys | None:
    """The keys to use, or None for a plain connection; a key pair is made up when only the broker's is given."""
    if server_key is None:
        if secret_key is not None:
            raise ValueError("curve_secret_key is given without curve_server_key: CURVE needs the broker's public key")
        return None
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support; curve_server_key cannot be used")
    if isinstance(server_key, (bytes, bytearray)):
        server_public = _z85_key(server_key, "curve_server_key")
    else:
        server_public, _ = _load(server_key, "curve_server_key")
    if secret_key is None:
        public, secret = zmq.curve_keypair()  # any client that knows the broker's key, unless it lists clients
        return CurveKeys(server_public, public, secret)
    if isinstance(secret_key, tuple):
        if len(secret_key) != 2:
            raise ValueError("curve_secret_key: give a (public, secret) pair of z85 keys or a .key_secret file")
        public = _z85_key(secret_key[0], "curve_secret_key[0] (public)")
        secret = _z85_key(secret_key[1], "curve_secret_key[1] (secret)")
    else:
        public, maybe_secret = _load(secret_key, "curve_secret_key")
        if maybe_secret is None:
            raise ValueError(f"curve_secret_key: {secret_key} holds no secret key: "
                             "give the .key_secret file, not the .key")
        secret = _z85_key(maybe_secret, f"curve_secret_key ({secret_key})")
    if zmq.curve_public(secret) != public:
        raise ValueError("curve_secret_key: the public key does not belong to the secret key")
    return CurveKeys(server_public, public, secret)
