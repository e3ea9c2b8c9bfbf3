"""A worker's own configuration: `tokenbroker worker`'s flags and the WorkerConfig built from them.

The model, cache and limit flags it shares with `serve` (the supervisor passes them on) are
common/config.py's; the broker never reads what is here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from tokenbroker.common.config import (DEFAULT_WORKER_MAX_MEMORY, ModelConfig, add_flags, flag, from_args,
                                       model_config_from_args, nested, non_negative_float, non_negative_int,
                                       positive_int)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything `tokenbroker worker` was told, built from argv once and passed down.

    The fields are `worker`'s flags in the order of its --help (the model flags first).
    """

    models: ModelConfig = nested(ModelConfig, model_config_from_args)
    connect: str = flag("--connect", required=True, help="the broker's backend endpoint")
    capacity: int = flag("--capacity", 64, type=positive_int,  # a pipeline deep enough that the worker never waits for the broker
                         help="jobs the worker holds at once")
    name: str | None = flag("--name", None, help="worker name shown in replies and metrics")
    max_memory: int = flag("--max-memory", DEFAULT_WORKER_MAX_MEMORY, type=non_negative_int, metavar="BYTES",
                           help="a worker whose private memory (not shared with the template it forked from) passes "
                                "this finishes its round, stops taking jobs and leaves; a fresh one takes its place "
                                "(0: no ceiling)")
    give_up_after: float = flag("--give-up-after", 0.0, type=non_negative_float, metavar="SECONDS",
                                help="a worker that cannot get through to the broker (refused, not up yet, network "
                                     "down) keeps trying, saying why in its log; after this long without getting "
                                     "through it exits with status 5 (0, the default: it tries until SIGTERM)")
    curve_server_key: str | None = flag("--curve-server-key", None, metavar="FILE",  # common/curve.py
                                        help="the broker's public .key: connect with CURVE")
    curve_secret_key: str | None = flag("--curve-secret-key", None, metavar="FILE",
                                        help="this worker's own .key_secret (its .key is in the broker's --curve-workers)")
    # set: be the template local workers fork from, reporting on this fd (the supervisor's flag, never a person's)
    zygote_fd: int | None = flag("--zygote-fd", None, type=int, help=argparse.SUPPRESS)


# --- argv --------------------------------------------------------------------------------


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    add_flags(p, WorkerConfig)


def worker_config_from_args(a: argparse.Namespace) -> WorkerConfig:
    from tokenbroker.common.curve import CurveKeyError, load_client_keys

    try:  # a missing or malformed key file stops the worker here, before it loads a tokenizer
        if a.curve_server_key or a.curve_secret_key:
            load_client_keys(a.curve_server_key, a.curve_secret_key, own_key_required=True)
    except CurveKeyError as e:
        raise SystemExit(f"tokenbroker: {e}") from None
    config: WorkerConfig = from_args(WorkerConfig, a)
    return config
