"""`tokenbroker serve`: bind, start the workers, say ready, run the loop, stop cleanly."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile

import zmq

from tokenbroker.common.config import model_argv

from .backend import Backend
from .config import BrokerConfig
from .frontend import Frontend
from .loop import Broker, BootFailed, install_signal_wakeup
from .metrics import PoolMetrics
from .security import BACKEND, FRONTEND, BrokerSecurity, SecurityError, admin_gate
from .supervisor import Supervisor

log = logging.getLogger(__name__)

WORKER_STOP_GRACE_S = 5.0
FRONTEND_HWM = 1000  # messages queued per client connection, each way


def hard_frame_limit(max_request_bytes: int) -> int:
    """Frames up to this are read and answered too_large past --max-request-bytes (contract 1.2,
    "Limits that answer"); larger ones make ZeroMQ drop the connection before they are in memory."""
    return max(8 * max_request_bytes, 64 * 1024 * 1024)


def _bind(sock: zmq.Socket, endpoint: str, what: str) -> str:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise SystemExit(f"tokenbroker: cannot bind the {what} to {endpoint}: {e}") from e
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def serve(config: BrokerConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s broker %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    metrics = PoolMetrics()
    try:  # before any bind: a socket reachable from elsewhere without CURVE is refused here
        security = BrokerSecurity.start(ctx, config, on_denied=metrics.auth_failed)
    except SecurityError as e:
        ctx.term()
        raise SystemExit(f"tokenbroker: {e}") from None
    runtime_dir = None
    frontend_sock = ctx.socket(zmq.ROUTER)
    security.apply(frontend_sock, FRONTEND, config.frontend)
    frontend_sock.setsockopt(zmq.LINGER, 1000)
    # Small queues per client: one that sends without reading fills its own queues and then
    # loses its own replies (a ROUTER drops what it cannot queue), never the broker's memory.
    frontend_sock.setsockopt(zmq.SNDHWM, FRONTEND_HWM)
    frontend_sock.setsockopt(zmq.RCVHWM, FRONTEND_HWM)
    # A hard guard far above --max-request-bytes: larger frames drop the connection instead of filling memory;
    # frames under it are answered too_large from ZeroMQ's buffer and freed at once (frontend.py).
    frontend_sock.setsockopt(zmq.MAXMSGSIZE, hard_frame_limit(config.max_request_bytes))
    frontend_endpoint = _bind(frontend_sock, config.frontend, "frontend")
    backend_sock = ctx.socket(zmq.ROUTER)
    backend_sock.setsockopt(zmq.LINGER, 0)
    # No ROUTER_HANDOVER: a connection's identity is its own (workers let ZeroMQ pick one per
    # connection), so no peer can take over another's jobs by claiming its identity.
    security.apply(backend_sock, BACKEND, config.backend)
    backend_endpoint = config.backend
    if backend_endpoint is None:
        runtime_dir = tempfile.mkdtemp(prefix="tokenbroker-")
        os.chmod(runtime_dir, 0o700)
        backend_endpoint = f"ipc://{runtime_dir}/backend"
    backend_endpoint = _bind(backend_sock, backend_endpoint, "backend")
    wakeup, restore_signals = install_signal_wakeup()
    supervisor = Supervisor(count=config.workers, connect=backend_endpoint, name_prefix=f"local{os.getpid()}",
                            worker_argv=[*model_argv(config.models), "--capacity", str(config.worker_capacity),
                                         "--max-memory", str(config.worker_max_memory),
                                         *security.local_worker_argv(backend_endpoint)],
                            start_mode=config.worker_start)
    tell_peer, is_admin = admin_gate(security, config.frontend)
    broker = Broker(config, Frontend(frontend_sock, max_request_bytes=config.max_request_bytes, tell_peer=tell_peer),
                    Backend(backend_sock), supervisor, metrics, wakeup, on_hangup=security.reload, is_admin=is_admin)
    code = 0
    try:
        supervisor.start()
        broker.wait_for_workers(config.workers)
        metrics_url = "off"
        if config.metrics_port:
            metrics_url = metrics.serve(config.metrics_host, config.metrics_port)
        print(f"ready frontend={frontend_endpoint} metrics={metrics_url} workers={config.workers}", flush=True)
        log.info("backend at %s", backend_endpoint)
        broker.run()
    except BootFailed as e:
        print(f"tokenbroker: cannot start: {e}", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        code = 0
    finally:
        supervisor.terminate()
        broker.see_workers_off(WORKER_STOP_GRACE_S)
        supervisor.wait(WORKER_STOP_GRACE_S)
        restore_signals()
        frontend_sock.close()
        backend_sock.close()
        security.stop()
        ctx.term()
        if runtime_dir:
            shutil.rmtree(runtime_dir, ignore_errors=True)
    log.info("stopped")
    return code
