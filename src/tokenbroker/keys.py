"""`tokenbroker keys DIR NAME`: a CURVE key pair as pyzmq certificate files.

Writes DIR/NAME.key (the public key: copy it into the broker's --curve-clients or
--curve-workers folder, or give the broker's to clients as --curve-server-key) and
DIR/NAME.key_secret (both keys: stays on the host that owns it, mode 0600). The files are
pyzmq's `zmq.auth` format, so any ZeroMQ client can read them with `zmq.auth.load_certificate`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import zmq.auth

__all__ = ["add_keys_parser", "create_key_pair", "run_keys"]


def add_keys_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="write a CURVE key pair: DIR/NAME.key (public) and DIR/NAME.key_secret")
    p.add_argument("dir", metavar="DIR", help="folder to write into (created 0700 if missing)")
    p.add_argument("name", metavar="NAME", help="file name stem, e.g. broker, worker-gpu3, client-api")


def create_key_pair(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write NAME.key and NAME.key_secret in `directory`; never overwrites a key.

    The secret file is created under umask 077 (pyzmq opens it with the process umask), so it
    is never readable by others, not even for a moment.
    """
    if not name or name.startswith(".") or os.sep in name or (os.altsep and os.altsep in name):
        raise ValueError(f"NAME {name!r}: give a plain file name stem (no path, not starting with '.')")
    folder = Path(directory)
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise ValueError(f"{path} exists; remove it first to replace the key pair")
    old = os.umask(0o077)
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        written = zmq.auth.create_certificates(folder, name)
    finally:
        os.umask(old)
    os.chmod(written[0], 0o644)  # the public half is meant to be copied around
    return Path(written[0]), Path(written[1])


def run_keys(args: argparse.Namespace) -> int:
    try:
        public, secret = create_key_pair(args.dir, args.name)
    except (ValueError, OSError) as e:
        print(f"tokenbroker keys: {e}", file=sys.stderr)
        return 2
    print(f"public {public}\nsecret {secret}")
    return 0
