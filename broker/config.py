"""The broker's own configuration: `tokenbroker serve`'s flags and the BrokerConfig built from them.

Workers never read it: what both sides share (models, caches, limits) is common/config.py, whose
model and cache flags `serve` takes too and hands to local workers (`model_argv`).
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

from tokenbroker.common.config import (
    DEFAULT_FRONTEND,
    DEFAULT_WORKER_MAX_MEMORY,
    MiB,
    ModelConfig,
    ModelFlags,
    add_flags,
    flag,
    from_args,
    model_config_from_args,
    nested,
    non_negative_int,
    positive_int,
)


SECURITY = "security (docs/security.md)"


@dataclass(frozen=True)
class CurveConfig:
    """The broker's CURVE flags (docs/security.md); all None: no CURVE."""

    secret_key: str | None = flag("--curve-secret-key", None, metavar="FILE", group=SECURITY,
                                  help="the broker's .key_secret: CURVE on the frontend and a tcp:// backend")
    clients: str | None = flag("--curve-clients", None, metavar="DIR", group=SECURITY,
                               help="admit only clients whose public .key is in DIR (default: any key)")
    workers: str | None = flag("--curve-workers", None, metavar="DIR", group=SECURITY,
                               help="admit only workers whose public .key is in DIR (required for a tcp:// backend)")
    admins: str | None = flag("--curve-admins", None, metavar="DIR", group=SECURITY,
                              help="public .key files of the clients allowed the admin ops")
    insecure: bool = flag("--insecure", False, action="store_true", group=SECURITY,
                          help="allow binding a non-loopback address without CURVE")


def _factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value >= 1.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 1.0, got {text}")
    return value


def _workers(text: str) -> int:
    if text == "auto":
        return usable_cores()
    return non_negative_int(text)


@dataclass(frozen=True)
class BrokerConfig:
    """Everything `tokenbroker serve` was told, built from argv once and passed down.

    The fields are `serve`'s flags in the order of its --help (the model flags first).
    """

    models: ModelConfig = nested(ModelConfig, model_config_from_args,  # default: what `serve` loads given no model flag
                                 default_factory=lambda: ModelConfig(models=ModelFlags().specs()))
    workers: int = flag("--workers", default_factory=lambda: usable_cores(), type=_workers, metavar="N|auto",
                        parse_default="auto",
                        help="local worker processes (default auto: one per core this process may use, from its "
                             "CPU affinity and cgroup CPU quota; 0: remote workers only)")
    frontend: str = flag("--frontend", DEFAULT_FRONTEND)
    backend: str | None = flag("--backend", None,  # None: an ipc:// path in a private runtime dir
                               help="default: ipc:// in a private runtime dir; tcp://HOST:PORT lets remote workers join")
    metrics_host: str = flag("--metrics-host", "127.0.0.1")
    metrics_port: int = flag("--metrics-port", 9464, type=non_negative_int, help="0 turns the exporter off")
    request_timeout_ms: int = flag("--request-timeout-ms", 30000, type=positive_int)
    max_request_bytes: int = flag("--max-request-bytes", 32 * MiB, type=positive_int)
    max_pending: int = flag("--max-pending", 4096, type=positive_int,
                            help="queued requests beyond this are answered overloaded")
    max_pending_bytes: int = flag("--max-pending-bytes", 1024 * MiB, type=positive_int,
                                  help="payload bytes held (queued and in flight) beyond this are answered overloaded")
    max_client_pending: int = flag("--max-client-pending", 1024, type=positive_int,
                                   help="requests one client connection may have held at once; more are answered overloaded")
    balance_factor: float = flag("--balance-factor", 1.25, type=_factor,
                                 help="a worker above mean*factor and mean+margin in-flight jobs is passed over")
    balance_margin: int = flag("--balance-margin", 2, type=non_negative_int)
    spill_wait_ms: int = flag("--spill-wait-ms", 20, type=non_negative_int,
                              help="how long a job waits for its busy preferred worker before going to another (0: never waits)")
    worker_capacity: int = flag("--worker-capacity", 64, type=positive_int,
                                help="jobs each local worker holds at once: deep enough that it never waits for the broker")
    worker_start: str = flag("--worker-start", "fork", choices=("fork", "exec"),  # broker/supervisor.py
                             help="fork: local workers fork from one process that loaded the models, and share their memory; "
                                  "exec: each worker loads its own copy")
    worker_max_memory: int = flag("--worker-max-memory", DEFAULT_WORKER_MAX_MEMORY, type=non_negative_int, metavar="BYTES",
                                  help="a local worker whose private memory passes this (2 GiB unless told) finishes its "
                                       "round, stops taking jobs and is replaced by a fresh one (0: no ceiling)")
    worker_max_bytes: int = flag("--worker-max-bytes", 1 * MiB, type=positive_int,
                                 help="payload bytes a worker may hold before it is sent more (a huge request holds up its own worker only)")
    routing: str = flag("--routing", "affinity", choices=("affinity", "least-loaded"),
                        help="affinity: keep a conversation's prefixes on one worker; least-loaded: ignore keys")
    curve: CurveConfig = nested(CurveConfig, default_factory=CurveConfig)  # broker/security.py reads it


# --- cores ---------------------------------------------------------------------------------


def usable_cores(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The cores this process may use: its affinity mask, capped by its cgroup's CPU quota.

    A container limited to 2 CPUs (`--cpus 2`, a Kubernetes limit) sees every host core in its
    affinity mask; only the quota says 2. A fractional quota rounds up (1.5 CPUs: 2 workers).
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs this process's cgroup may use (quota / period), or None when unlimited or unknown.

    cgroup v2: the smallest `cpu.max` ("200000 100000", or "max 100000") of the process's own cgroup
    and its parents (inside a container's namespace its cgroup is the root); v1: cpu.cfs_quota_us /
    cpu.cfs_period_us (-1: no quota).
    """
    found = []
    for path in _cgroup_v2_dirs(root):
        quota, _, period = (_read(os.path.join(path, "cpu.max")) or "max").partition(" ")
        ratio = None if quota == "max" else _ratio(quota, period)
        if ratio is not None:
            found.append(ratio)
    if found:
        return min(found)
    for sub in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        v1_quota, v1_period = (_read(os.path.join(root, sub, f"cpu.cfs_{k}_us")) for k in ("quota", "period"))
        if v1_quota is not None and v1_period is not None:
            return None if v1_quota.startswith("-") else _ratio(v1_quota, v1_period)
    return None


def _cgroup_v2_dirs(root: str) -> list[str]:
    """This process's cgroup folder and its parents up to `root` (a quota on any of them applies)."""
    own = next((line[3:] for line in (_read("/proc/self/cgroup") or "").splitlines() if line.startswith("0::")), "")
    parts = [p for p in own.strip("/").split("/") if p and p != ".."]
    return [os.path.join(root, *parts[:n]) for n in range(len(parts), -1, -1)]


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period.split()[0] if period else "100000")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    add_flags(p, BrokerConfig)


def broker_config_from_args(a: argparse.Namespace) -> BrokerConfig:
    config: BrokerConfig = from_args(BrokerConfig, a)
    return config
