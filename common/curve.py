"""CURVE key files (pyzmq's `zmq.auth` certificate format) and the client side of a CURVE socket.

Shared by the worker (its DEALER on the broker's backend), the Python client and the broker,
which all read the same certificate files that `tokenbroker keys` writes: a public `NAME.key`
and a `NAME.key_secret` holding both keys. A key is 40 Z85 characters; pyzmq's loader accepts
any text after `public-key =`, so a truncated or hand-edited file is checked here, where the
error can name the flag and the file, rather than inside libzmq as an opaque EINVAL.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.utils import z85

__all__ = ["CurveKeyError", "ClientKeys", "load_public_key", "load_key_pair", "load_client_keys", "apply_client_curve",
           "watch_handshakes", "handshake_refusal"]

Z85_KEY_LEN = 40  # a 32-byte Curve25519 key in Z85


class CurveKeyError(ValueError):
    """A key file is missing or malformed; the message names the flag and the file."""


@dataclass(frozen=True)
class ClientKeys:
    """What a CURVE client socket needs: the server's public key and its own pair (all Z85 bytes)."""

    server_public: bytes
    public: bytes
    secret: bytes


def _check_z85(key: bytes | None, what: str, flag: str, path: str) -> bytes:
    if not key:
        raise CurveKeyError(f"{flag} {path}: no {what} in the file (is it a `tokenbroker keys` certificate?)")
    try:
        ok = len(key) == Z85_KEY_LEN and len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CurveKeyError(f"{flag} {path}: the {what} is not a 40-character Z85 CURVE key")
    return key


def _load(path: str | os.PathLike, flag: str) -> tuple[bytes | None, bytes | None]:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CurveKeyError(f"{flag} {path}: no such file")
    try:
        return zmq.auth.load_certificate(path)
    except ValueError:
        raise CurveKeyError(f"{flag} {path}: no public-key in the file (is it a `tokenbroker keys` certificate?)") from None
    except OSError as e:
        raise CurveKeyError(f"{flag} {path}: cannot read it: {e.strerror or e}") from None


def load_public_key(path: str | os.PathLike, *, flag: str) -> bytes:
    """The public key (Z85) in a `.key` file, or in a `.key_secret` file, which holds it too."""
    public, _ = _load(path, flag)
    return _check_z85(public, "public-key", flag, os.fspath(path))


def load_key_pair(path: str | os.PathLike, *, flag: str) -> tuple[bytes, bytes]:
    """(public, secret) from a `.key_secret` file; the `.key` file alone is a clear error."""
    public, secret = _load(path, flag)
    path = os.fspath(path)
    public = _check_z85(public, "public-key", flag, path)
    if not secret:
        raise CurveKeyError(f"{flag} {path}: no secret-key in the file (give the .key_secret file, not the public .key)")
    secret = _check_z85(secret, "secret-key", flag, path)
    if zmq.curve_public(secret) != public:
        raise CurveKeyError(f"{flag} {path}: its public-key does not belong to its secret-key")
    return public, secret


def load_client_keys(server_key: str | os.PathLike | None, secret_key: str | os.PathLike | None,
                     *, own_key_required: bool = False) -> ClientKeys:
    """Both key files of a client or worker; without `secret_key`, a throwaway pair.

    A throwaway pair is enough where the broker admits any client key (no --curve-clients):
    the traffic is still encrypted and the broker still proves it holds its secret key. A
    worker passes `own_key_required`: a CURVE backend admits workers by key only.
    """
    if server_key is None:
        raise CurveKeyError("--curve-secret-key needs --curve-server-key (the broker's public .key)")
    server = load_public_key(server_key, flag="--curve-server-key")
    if secret_key is None and own_key_required:
        raise CurveKeyError("--curve-server-key needs --curve-secret-key (this worker's own .key_secret; "
                            "the broker admits workers by their public key)")
    if secret_key is None:
        public, secret = zmq.curve_keypair()
    else:
        public, secret = load_key_pair(secret_key, flag="--curve-secret-key")
    return ClientKeys(server, public, secret)


def apply_client_curve(sock: zmq.Socket, server_key: str | os.PathLike | None,
                       secret_key: str | os.PathLike | None = None) -> ClientKeys | None:
    """Make `sock` a CURVE client of the server whose public key is in `server_key`; call before connect.

    Nothing happens without `server_key` (a plain connection, as before). Reads the files on
    every call, so a worker that reconnects picks up a replaced key pair.
    """
    if server_key is None and secret_key is None:
        return None
    keys = load_client_keys(server_key, secret_key)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    return keys


HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


def watch_handshakes(sock: zmq.Socket) -> zmq.Socket:
    """A monitor socket for `sock`'s failed handshakes; read it with `handshake_refusal`.

    A refused CURVE client is otherwise silent: ZeroMQ drops the connection, retries, and a
    DEALER left without a connection blocks its next send. Watching lets a worker or client say
    why (and give up) instead of waiting forever. Close the monitor before the socket's context.
    """
    return sock.get_monitor_socket(HANDSHAKE_EVENTS)


def handshake_refusal(monitor: zmq.Socket) -> str | None:
    """Drain `monitor` without blocking: why the server refused the handshake, or None."""
    from zmq.utils.monitor import recv_monitor_message

    why = None
    while monitor.poll(0):
        event = recv_monitor_message(monitor)
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = (f"the broker refused this key (ZAP status {event['value']}): "
                   f"is its public .key in the broker's --curve-workers (or --curve-clients) folder?")
        elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            why = (f"the CURVE handshake failed (ZMTP error {event['value']:#x}): does the broker run "
                   f"with --curve-secret-key, and is --curve-server-key its public key?")
        elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # what a wrong server key looks like here
            why = "the broker hung up during the CURVE handshake: is --curve-server-key the broker's public key?"
    return why
