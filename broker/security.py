"""CURVE on the broker's sockets: who may bind where, whose keys are admitted, and the ZAP thread.

docs/protocol.md, "Security": with --curve-secret-key the frontend and a tcp:// backend are
CURVE servers. Admission is pyzmq's ZAP authenticator thread (`zmq.auth.thread`), one ZAP
domain per socket, each with its own key set: pyzmq's `CURVE_ALLOW_ANY` is a single flag for
every domain (it would open the backend too when only the frontend should admit any key), so
each domain gets a credentials callback over a key set this module loads, holds and swaps on
SIGHUP (`reload`).

Key refusals are counted where the decision is made, in that callback: ZAP sees each CURVE
handshake once, synchronously, with its domain and key, so the count is exact and the log can
name the key. A socket monitor's HANDSHAKE_FAILED_AUTH events would say the same thing later,
without the key, through a queue that drops events when it fills, so they are not used. Peers
that never reach ZAP (a plain-text client, a wrong server key) fail libzmq's handshake first;
only a socket monitor sees those (HANDSHAKE_FAILED_PROTOCOL), so one thread per CURVE socket
counts them too, best effort: a wrong server key is always seen (the broker cannot read the
HELLO), a plain-text peer only when the broker reads its greeting before that peer, which sees
the mismatch too, hangs up (otherwise libzmq reports a bare disconnect). A connection that closes without a word (a port scan, a health
check) is not a refusal and is not counted. Each count is one refused handshake: a refused peer
that keeps reconnecting (ZeroMQ retries every 100 ms by default) counts every time.

An ipc:// backend (local workers, a 0700 runtime dir) is not a CURVE server: the folder's
permissions are its access control. Local workers of a tcp:// backend under CURVE get a
throwaway key pair in a private 0700 folder, admitted next to the --curve-workers keys.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from tokenbroker.common.curve import CurveKeyError, load_key_pair, load_public_key

from .config import BrokerConfig, CurveConfig

__all__ = ["SecurityError", "BrokerSecurity", "is_local_endpoint", "check_config", "load_key_folder",
           "FRONTEND", "BACKEND"]

log = logging.getLogger(__name__)

FRONTEND = "frontend"  # also the ZAP domain and the metric label
BACKEND = "backend"
LOCAL_TRANSPORTS = ("ipc", "inproc")
DENIAL_LOG_EVERY_S = 10.0  # at most one refusal line per socket this often; the counter has every one


class SecurityError(ValueError):
    """A security flag is missing or wrong: one line, naming the flag; the broker must not start."""


# --- where the broker may bind without CURVE ----------------------------------------------------


def _host(endpoint: str) -> tuple[str, str]:
    """(transport, host) of a bind endpoint; host is '' for ipc/inproc."""
    transport, sep, rest = endpoint.partition("://")
    if not sep:
        raise SecurityError(f"{endpoint!r} is not a ZeroMQ endpoint (transport://address)")
    transport = transport.lower()
    if transport in LOCAL_TRANSPORTS:
        return transport, ""
    rest = rest.split("/", 1)[0]  # ws://host:port/path
    if rest.startswith("["):  # [::1]:5555
        return transport, rest[1:].split("]", 1)[0]
    host, _, _ = rest.rpartition(":")
    return transport, host or rest


def is_local_endpoint(endpoint: str) -> bool:
    """True when only this host can reach `endpoint`: ipc://, inproc://, or a loopback address.

    `*`, an interface name and any other host count as reachable from elsewhere; a name other
    than `localhost` is not resolved (what it resolves to can change after the check).

    >>> [is_local_endpoint(e) for e in ("tcp://127.0.0.1:*", "tcp://[::1]:5", "ipc:///run/x", "tcp://*:5")]
    [True, True, True, False]
    """
    transport, host = _host(endpoint)
    if transport in LOCAL_TRANSPORTS:
        return True
    host = host.lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def check_config(frontend: str, backend: str | None, curve: CurveConfig) -> None:
    """Refuse a start that would expose a socket or half-configure CURVE; raises SecurityError.

    Runs before anything binds. `backend` None is the private ipc:// default.
    """
    flags = {"--curve-clients": curve.clients, "--curve-workers": curve.workers, "--curve-admins": curve.admins}
    if curve.secret_key is None:
        for flag, value in flags.items():
            if value is not None:
                raise SecurityError(f"{flag} needs --curve-secret-key FILE (the broker's .key_secret)")
        if curve.insecure:
            return
        for what, endpoint in ((FRONTEND, frontend), (BACKEND, backend)):
            if endpoint is not None and not is_local_endpoint(endpoint):
                raise SecurityError(f"the {what} {endpoint} is not a loopback address: give --curve-secret-key FILE "
                                    f"(see `tokenbroker keys`) or, on a network you trust, --insecure")
        return
    if backend is not None and _host(backend)[0] not in LOCAL_TRANSPORTS and curve.workers is None:
        raise SecurityError(f"the backend {backend} under --curve-secret-key needs --curve-workers DIR "
                            f"(the public .key files of the workers it admits)")


# --- key folders ---------------------------------------------------------------------------------


def load_key_folder(folder: str, *, flag: str, strict: bool) -> frozenset[bytes]:
    """The Z85 public keys of the `*.key` files in `folder`.

    strict (at start): a missing folder or a malformed file is a SecurityError naming it.
    Not strict (SIGHUP): a malformed file is skipped with a warning, so one bad copy does not
    lock every peer out; an unreadable folder still raises and the caller keeps the old set.
    """
    path = Path(folder)
    if not path.is_dir():
        raise SecurityError(f"{flag} {folder}: no such folder")
    keys = set()
    try:
        files = sorted(p for p in path.iterdir() if p.suffix == ".key")
    except OSError as e:
        raise SecurityError(f"{flag} {folder}: cannot list it: {e.strerror or e}") from None
    for file in files:
        try:
            keys.add(load_public_key(file, flag=flag))
        except CurveKeyError as e:
            if strict:
                raise SecurityError(str(e)) from None
            log.warning("skipping a key file: %s", e)
    return frozenset(keys)


@dataclass
class _Gate:
    """One ZAP domain's admission: a key set swapped whole on reload (read by the ZAP thread)."""

    socket: str
    folders: dict[str, str]  # flag -> folder whose keys this gate admits
    allow_any: bool
    on_denied: Callable[[str], None]
    extra: frozenset[bytes] = frozenset()  # keys admitted besides the folders' (the local workers')
    keys: frozenset[bytes] = frozenset()
    _denied_unlogged: int = 0
    _next_log: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def load(self, *, strict: bool) -> None:
        keys = set(self.extra)
        for flag, folder in self.folders.items():
            keys |= load_key_folder(folder, flag=flag, strict=strict)
        self.keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: runs on the ZAP thread for each CURVE handshake."""
        if self.allow_any or key in self.keys:
            return True
        where = " or ".join(f"{flag} {folder}" for flag, folder in self.folders.items())
        self.refuse(f"its CURVE key {key.decode('ascii', 'replace')} is not in {where}")
        return False

    def refuse(self, why: str) -> None:
        """Count one refused handshake; log it unless a line went out in the last DENIAL_LOG_EVERY_S.

        Called from the ZAP thread and this socket's monitor thread, hence the lock.
        """
        self.on_denied(self.socket)
        now = time.monotonic()
        with self._lock:
            if now < self._next_log:
                self._denied_unlogged += 1
                return
            more, self._denied_unlogged, self._next_log = self._denied_unlogged, 0, now + DENIAL_LOG_EVERY_S
        log.warning("refused a %s peer: %s (%d more refused since the last such line)", self.socket, why, more)


def _watch_handshakes(monitor: zmq.Socket, gate: _Gate, stopping: threading.Event) -> None:
    """A monitor thread: handshakes that fail before ZAP (no CURVE, or not this broker's key)."""
    try:
        while not stopping.is_set():
            if not monitor.poll(200):
                continue
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                gate.refuse(f"it does not speak CURVE to this broker's public key (ZMTP error {event['value']:#x}, "
                            f"from {event['endpoint'].decode(errors='replace')})")
    except zmq.ZMQError:  # the context is going away
        return
    finally:
        monitor.close(linger=0)


class BrokerSecurity:
    """The broker's CURVE setup, built once by `start` and torn down by `stop`.

    Without --curve-secret-key it does nothing but the bind check: `apply` leaves sockets plain,
    `reload` only logs, and `is_admin` is False (the loopback rule for admin ops is the loop's).
    """

    def __init__(self, curve: CurveConfig, on_denied: Callable[[str], None]) -> None:
        self.curve = curve
        self.enabled = curve.secret_key is not None
        self.public = self.secret = b""
        self.authenticator: ThreadAuthenticator | None = None
        self.private_dir: str | None = None
        self.local_keys: tuple[str, str] | None = None  # (broker .key, local worker .key_secret)
        self.frontend = _Gate(FRONTEND, {}, allow_any=curve.clients is None, on_denied=on_denied)
        if curve.clients is not None:
            self.frontend.folders["--curve-clients"] = curve.clients
        if curve.admins is not None:  # admins are clients too
            self.frontend.folders["--curve-admins"] = curve.admins
        self.backend = _Gate(BACKEND, {}, allow_any=False, on_denied=on_denied)
        if curve.workers is not None:
            self.backend.folders["--curve-workers"] = curve.workers
        self.admins: frozenset[bytes] = frozenset()
        self.watchers: list[threading.Thread] = []
        self.stopping = threading.Event()

    @classmethod
    def start(cls, ctx: zmq.Context, config: BrokerConfig, *, on_denied: Callable[[str], None]) -> "BrokerSecurity":
        """Check the flags, load every key, start the ZAP thread; SecurityError names what is wrong."""
        check_config(config.frontend, config.backend, config.curve)
        self = cls(config.curve, on_denied)
        if config.curve.secret_key is None:  # enabled is exactly this
            return self
        try:
            self.public, self.secret = load_key_pair(config.curve.secret_key, flag="--curve-secret-key")
        except CurveKeyError as e:
            raise SecurityError(str(e)) from None
        self._load(strict=True)
        self.authenticator = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
        self.authenticator.start()
        for gate in (self.frontend, self.backend):
            self.authenticator.configure_curve_callback(gate.socket, credentials_provider=gate)
        log.info("CURVE on: frontend admits %s; backend admits %d worker keys",
                 "any key" if self.frontend.allow_any else f"{len(self.frontend.keys)} keys", len(self.backend.keys))
        return self

    def _load(self, *, strict: bool) -> None:
        self.frontend.load(strict=strict)
        self.backend.load(strict=strict)
        if self.curve.admins is not None:
            self.admins = load_key_folder(self.curve.admins, flag="--curve-admins", strict=strict)

    def apply(self, sock: zmq.Socket, which: str, endpoint: str | None) -> bool:
        """Make `sock` a CURVE server in ZAP domain `which` (call before bind); False: left plain.

        The backend stays plain on ipc:// (or inproc://): only this host's user can reach it.
        """
        if not self.enabled or which == BACKEND and (endpoint is None or _host(endpoint)[0] in LOCAL_TRANSPORTS):
            return False
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, which.encode())
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        gate = self.frontend if which == FRONTEND else self.backend
        watcher = threading.Thread(target=_watch_handshakes, args=(monitor, gate, self.stopping),
                                   name=f"curve-watch-{which}", daemon=True)
        watcher.start()
        self.watchers.append(watcher)
        return True

    def local_worker_argv(self, backend_endpoint: str) -> list[str]:
        """Flags for the broker's own workers: a throwaway key pair when the backend is CURVE.

        Its public key is admitted on the backend until the broker stops, whatever the folder says.
        """
        if not self.enabled or _host(backend_endpoint)[0] in LOCAL_TRANSPORTS:
            return []
        if self.local_keys is None:
            self.private_dir = tempfile.mkdtemp(prefix="tokenbroker-keys-")  # 0700
            server_key = Path(self.private_dir) / "broker.key"
            server_key.write_text(f'curve\n    public-key = "{self.public.decode()}"\n')
            public_file, secret_file = zmq.auth.create_certificates(self.private_dir, "local-worker")
            os.chmod(secret_file, 0o600)
            self.backend.extra = frozenset({load_public_key(public_file, flag="local worker key")})
            self.backend.keys = self.backend.keys | self.backend.extra
            self.local_keys = (str(server_key), secret_file)
        return ["--curve-server-key", self.local_keys[0], "--curve-secret-key", self.local_keys[1]]

    def reload(self) -> None:
        """SIGHUP: read the key folders again; new handshakes see the new sets at once.

        Connections already made stay up (CURVE admits at the handshake). A folder that cannot be
        read keeps its previous keys, with an error in the log.
        """
        if not self.enabled:
            log.info("SIGHUP: CURVE is off, no key folders to re-read")
            return
        try:
            self._load(strict=False)
        except SecurityError as e:
            log.error("SIGHUP: kept the previous keys: %s", e)
            return
        log.info("SIGHUP: re-read the key folders: frontend %s, backend %d worker keys, %d admin keys",
                 "admits any key" if self.frontend.allow_any else f"{len(self.frontend.keys)} keys",
                 len(self.backend.keys) - len(self.backend.extra), len(self.admins))

    def admits(self, which: str, public_key_z85: str | bytes | None) -> bool:
        """Whether a peer with this key would be admitted on `which` now (after the last reload).

        CURVE admits at the handshake only, so a connection made before a key was removed stays
        up; the loop can call this with a message's "User-Id" to stop serving such a peer.
        Without CURVE every peer is admitted.
        """
        if not self.enabled:
            return True
        gate = self.frontend if which == FRONTEND else self.backend
        if gate.allow_any:
            return True
        key = public_key_z85.encode("ascii", "replace") if isinstance(public_key_z85, str) else public_key_z85
        return bool(key) and key in gate.keys

    def is_admin(self, public_key_z85: str | bytes | None) -> bool:
        """Whether a frontend peer may use the admin ops under CURVE: its key is in --curve-admins.

        The loop learns the peer's key from the message itself: receive with
        `sock.recv_multipart(copy=False)` and read `frames[-1].get("User-Id")` (libzmq's ZAP
        user id, which pyzmq's authenticator sets to the client's Z85 public key). Without CURVE
        there is no key and this is False; the contract's loopback rule applies there instead.
        """
        if not self.enabled or not public_key_z85:
            return False
        key = public_key_z85.encode("ascii", "replace") if isinstance(public_key_z85, str) else public_key_z85
        return key in self.admins

    def stop(self) -> None:
        """Stop the ZAP and monitor threads (before the context terminates); remove the throwaway keys."""
        self.stopping.set()
        for watcher in self.watchers:
            watcher.join()
        self.watchers.clear()
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None
        if self.private_dir is not None:
            shutil.rmtree(self.private_dir, ignore_errors=True)
            self.private_dir = None


def admin_gate(security: "BrokerSecurity", frontend_endpoint: str) -> tuple[bool, Callable[[str | None, str | None], bool]]:
    """(whether the frontend must tell each message's peer, who may use the admin ops).

    docs/protocol.md "The model catalog": under CURVE only keys in --curve-admins; without it, a
    client on a loopback connection. A frontend bound to loopback or ipc has only such clients, so
    it need not look at each message's address.
    """
    if security.enabled:
        return True, lambda user_id, address: security.is_admin(user_id)
    if is_local_endpoint(frontend_endpoint):
        return False, lambda user_id, address: True
    return True, lambda user_id, address: _is_loopback(address)


def _is_loopback(address: str | None) -> bool:
    """
    >>> _is_loopback("127.0.0.1"), _is_loopback("::1"), _is_loopback("10.0.0.2"), _is_loopback(None)
    (True, True, False, False)
    """
    if not address:
        return False
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False
