"""The broker's own configuration: `tokenbroker serve`'s flags and the BrokerConfig built from them.

Workers never read it: what both sides share (models, caches, limits) is common/config.py, whose
model and cache flags `serve` takes too and hands to local workers (`model_argv`).
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field

from tokenbroker.common.config import (
    DEFAULT_FRONTEND,
    EMBEDDED_DEFAULT,
    EMBEDDED_DEFAULT_NAME,
    MiB,
    ModelConfig,
    ModelSpec,
    add_model_flags,
    model_config_from_args,
    non_negative_int,
    positive_int,
)


@dataclass(frozen=True)
class CurveConfig:
    """The broker's CURVE flags (docs/security.md); all None: no CURVE."""

    secret_key: str | None = None
    clients: str | None = None
    workers: str | None = None
    admins: str | None = None
    insecure: bool = False


@dataclass(frozen=True)
class BrokerConfig:
    """Everything `tokenbroker serve` was told, built from argv once and passed down."""

    frontend: str = DEFAULT_FRONTEND
    backend: str | None = None  # None: an ipc:// path in a private runtime dir
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9464
    workers: int = field(default_factory=lambda: usable_cores())  # `--workers auto`
    request_timeout_ms: int = 30000
    max_request_bytes: int = 32 * MiB
    max_pending: int = 4096
    max_pending_bytes: int = 1024 * MiB  # payload bytes held at once (queued and in flight)
    max_client_pending: int = 1024  # requests one client connection may have held at once
    balance_factor: float = 1.25
    balance_margin: int = 2
    spill_wait_ms: int = 20  # a job waits this long for its full (but not overloaded) preferred worker
    worker_max_bytes: int = 1 * MiB  # payload bytes a worker holds before it gets more (past its first job)
    worker_capacity: int = 64  # jobs each local worker holds at once
    worker_start: str = "fork"  # or "exec": how local workers start (broker/supervisor.py)
    routing: str = "affinity"  # or "least-loaded": no affinity keys at all (for comparison and debugging)
    models: ModelConfig = field(default_factory=lambda: ModelConfig(models=(ModelSpec(EMBEDDED_DEFAULT_NAME, EMBEDDED_DEFAULT),)))
    curve: CurveConfig = field(default_factory=CurveConfig)  # broker/security.py reads it


# --- argv --------------------------------------------------------------------------------


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
        quota, period = (_read(os.path.join(root, sub, f"cpu.cfs_{k}_us")) for k in ("quota", "period"))
        if quota is not None and period is not None:
            return None if quota.startswith("-") else _ratio(quota, period)
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
    add_model_flags(p)
    d = BrokerConfig()
    p.add_argument("--workers", type=_workers, default="auto", metavar="N|auto",
                   help="local worker processes (default auto: one per core this process may use, from its "
                        "CPU affinity and cgroup CPU quota; 0: remote workers only)")
    p.add_argument("--frontend", default=d.frontend)
    p.add_argument("--backend", default=None, help="default: ipc:// in a private runtime dir; tcp://HOST:PORT lets remote workers join")
    p.add_argument("--metrics-host", default=d.metrics_host)
    p.add_argument("--metrics-port", type=non_negative_int, default=d.metrics_port, help="0 turns the exporter off")
    p.add_argument("--request-timeout-ms", type=positive_int, default=d.request_timeout_ms)
    p.add_argument("--max-request-bytes", type=positive_int, default=d.max_request_bytes)
    p.add_argument("--max-pending", type=positive_int, default=d.max_pending,
                   help="queued requests beyond this are answered overloaded")
    p.add_argument("--max-pending-bytes", type=positive_int, default=d.max_pending_bytes,
                   help="payload bytes held (queued and in flight) beyond this are answered overloaded")
    p.add_argument("--max-client-pending", type=positive_int, default=d.max_client_pending,
                   help="requests one client connection may have held at once; more are answered overloaded")
    p.add_argument("--balance-factor", type=_factor, default=d.balance_factor,
                   help="a worker above mean*factor and mean+margin in-flight jobs is passed over")
    p.add_argument("--balance-margin", type=non_negative_int, default=d.balance_margin)
    p.add_argument("--spill-wait-ms", type=non_negative_int, default=d.spill_wait_ms,
                   help="how long a job waits for its busy preferred worker before going to another (0: never waits)")
    p.add_argument("--worker-capacity", type=positive_int, default=d.worker_capacity,
                   help="jobs each local worker holds at once: deep enough that it never waits for the broker")
    p.add_argument("--worker-start", choices=("fork", "exec"), default=d.worker_start,
                   help="fork: local workers fork from one process that loaded the models, and share their memory; "
                        "exec: each worker loads its own copy")
    p.add_argument("--worker-max-bytes", type=positive_int, default=d.worker_max_bytes,
                   help="payload bytes a worker may hold before it is sent more (a huge request holds up its own worker only)")
    p.add_argument("--routing", choices=("affinity", "least-loaded"), default=d.routing,
                   help="affinity: keep a conversation's prefixes on one worker; least-loaded: ignore keys")
    s = p.add_argument_group("security (docs/security.md)")
    s.add_argument("--curve-secret-key", metavar="FILE", help="the broker's .key_secret: CURVE on the frontend and a tcp:// backend")
    s.add_argument("--curve-clients", metavar="DIR", help="admit only clients whose public .key is in DIR (default: any key)")
    s.add_argument("--curve-workers", metavar="DIR", help="admit only workers whose public .key is in DIR (required for a tcp:// backend)")
    s.add_argument("--curve-admins", metavar="DIR", help="public .key files of the clients allowed the admin ops")
    s.add_argument("--insecure", action="store_true", help="allow binding a non-loopback address without CURVE")


def broker_config_from_args(a: argparse.Namespace) -> BrokerConfig:
    return BrokerConfig(
        frontend=a.frontend,
        backend=a.backend,
        metrics_host=a.metrics_host,
        metrics_port=a.metrics_port,
        workers=a.workers,
        request_timeout_ms=a.request_timeout_ms,
        max_request_bytes=a.max_request_bytes,
        max_pending=a.max_pending,
        max_pending_bytes=a.max_pending_bytes,
        max_client_pending=a.max_client_pending,
        balance_factor=a.balance_factor,
        balance_margin=a.balance_margin,
        routing=a.routing,
        spill_wait_ms=a.spill_wait_ms,
        worker_max_bytes=a.worker_max_bytes,
        worker_capacity=a.worker_capacity,
        worker_start=a.worker_start,
        models=model_config_from_args(a),
        curve=CurveConfig(a.curve_secret_key, a.curve_clients, a.curve_workers, a.curve_admins, a.insecure),
    )
