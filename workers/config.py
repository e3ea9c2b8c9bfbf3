"""A worker's own configuration: `tokenbroker worker`'s flags and the WorkerConfig built from them.

The model, cache and limit flags it shares with `serve` (the supervisor passes them on) are
common/config.py's; the broker never reads what is here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from tokenbroker.common.config import ModelConfig, add_model_flags, model_config_from_args, positive_int


@dataclass(frozen=True)
class WorkerConfig:
    """Everything `tokenbroker worker` was told, built from argv once and passed down."""

    connect: str
    models: ModelConfig
    capacity: int = 64  # jobs held at once: a pipeline deep enough that the worker never waits for the broker
    name: str | None = None
    curve_server_key: str | None = None  # the broker's public .key (common/curve.py)
    curve_secret_key: str | None = None  # this worker's own .key_secret
    zygote_fd: int | None = None  # set: be the template local workers fork from, reporting on this fd


# --- argv --------------------------------------------------------------------------------


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    p.add_argument("--connect", required=True, help="the broker's backend endpoint")
    p.add_argument("--capacity", type=positive_int, default=WorkerConfig.capacity,
                   help="jobs the worker holds at once")
    p.add_argument("--name", default=None, help="worker name shown in replies and metrics")
    p.add_argument("--curve-server-key", metavar="FILE", help="the broker's public .key: connect with CURVE")
    p.add_argument("--curve-secret-key", metavar="FILE", help="this worker's own .key_secret (its .key is in the broker's --curve-workers)")
    p.add_argument("--zygote-fd", type=int, default=None, help=argparse.SUPPRESS)  # the supervisor's, never a person's


def worker_config_from_args(a: argparse.Namespace) -> WorkerConfig:
    from tokenbroker.common.curve import CurveKeyError, load_client_keys

    try:  # a missing or malformed key file stops the worker here, before it loads a tokenizer
        if a.curve_server_key or a.curve_secret_key:
            load_client_keys(a.curve_server_key, a.curve_secret_key, own_key_required=True)
    except CurveKeyError as e:
        raise SystemExit(f"tokenbroker: {e}") from None
    return WorkerConfig(connect=a.connect, models=model_config_from_args(a), capacity=a.capacity, name=a.name,
                        curve_server_key=a.curve_server_key, curve_secret_key=a.curve_secret_key,
                        zygote_fd=a.zygote_fd)
