# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The broker's turns, compiled: the data plane's loop, returning to Python only for control.

A turn is: wait in zmq_poll (the GIL released) on the backend, the signal wake-up descriptor and the
frontend; take what the workers sent; take what the clients sent; answer the jobs past their
deadline; hand the queue to free workers; send the turn's replies. `Plane.run` runs turns until
Python's control plane is needed, and says why:

- WAKE: the wake-up descriptor is readable (a signal: stop, SIGCHLD, SIGHUP), or the poll was
  interrupted by one (Python runs its handlers on return);
- TIMER: `python_at` has passed (the next reap, heartbeat or metrics publication the caller
  computed), placement has something to look at (the loop's `replan`), or requests wait for a
  placement decision (`plan_at`, while the dispatcher has demand).

How the planes meet: the loop calls `run` and gets an event code back (no inproc socket between
them: one hop fewer, and the control plane calls straight back in). Within a turn, the cores are
called C to C: the frontend's Drain (broker/_frontend.pyx) into the intake, the backend's drain
(broker/_batches.pyx) into `Intake.results`, the dispatcher and the B_JOBS writer, the outbox
(broker/_outbox.pyx). Python runs only for what they leave to it: a control message from a worker,
a request the intake cannot take alone (ping, the catalog ops, a model not resolved yet, a refusal),
a deadline passed, placement's recency when it caps models.
"""

from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from tokenbroker.broker._dispatch cimport Dispatcher
from tokenbroker.broker._batches cimport drain as drain_backend
from tokenbroker.broker._frontend cimport Drain
from tokenbroker.broker._intake cimport Intake
from tokenbroker.broker._jobs cimport JobTable
from tokenbroker.broker._outbox cimport send_replies
from tokenbroker.broker._batches import send_jobs
from tokenbroker.common._zmq cimport EINTR, ZMQ_POLLIN, handle_of, load_libzmq, zmq_errno, zmq_error, zmq_poll

from zmq import ZMQError

load_libzmq()

TIMER = 0
WAKE = 1

cdef enum:
    BACK = 0
    WAKE_FD = 1
    FRONT = 2


cdef inline double _now() noexcept nogil:
    """time.monotonic(), read the same way (CLOCK_MONOTONIC)."""
    cdef timespec t
    clock_gettime(CLOCK_MONOTONIC, &t)
    return t.tv_sec + t.tv_nsec * 1e-9


cdef class Plane:
    """The turns of one broker (broker/loop.py `Broker._serve`)."""

    def __init__(self, broker, *, Py_ssize_t front_messages, Py_ssize_t front_bytes, Py_ssize_t back_messages,
                 double liveness_s, Py_ssize_t batch_jobs, Py_ssize_t batch_bytes, Py_ssize_t reply_frame_bytes,
                 used=None):
        """The turns of `broker` (broker/loop.py Broker: its sockets, wake-up descriptor and cores);
        a turn reads at most `front_messages` / `front_bytes` of the clients' and `back_messages`
        of the workers'; a B_JOBS message holds at most `batch_jobs` / `batch_bytes`, a frame of
        coalesced replies `reply_frame_bytes` past its first; `used(wid,
        jobs, now)`: told each batch handed to a worker (placement's recency, when it caps models)."""
        frontend, backend = broker.frontend, broker.backend
        self.items[BACK].socket = handle_of(backend.sock)
        self.items[BACK].fd = 0
        self.items[BACK].events = ZMQ_POLLIN
        self.items[WAKE_FD].socket = NULL
        self.items[WAKE_FD].fd = broker.wakeup.fileno()
        self.items[WAKE_FD].events = ZMQ_POLLIN
        self.items[FRONT].socket = handle_of(frontend.sock)
        self.items[FRONT].fd = 0
        self.items[FRONT].events = ZMQ_POLLIN
        self.broker = broker
        self.jobs = broker.jobs
        self.dispatcher = broker.dispatcher
        self.front_sock = frontend.sock
        self.outbox = frontend.outbox
        self.arrays = frontend.arrays
        self.reply_frame_bytes = reply_frame_bytes
        self.front_drain = broker.drain
        self.front_messages = front_messages
        self.front_bytes = front_bytes
        self.back_sock = backend.sock
        self.workers = backend.workers
        self.intake = broker.intake
        self.liveness_s = liveness_s
        self.back_messages = back_messages
        self.batch_jobs = batch_jobs
        self.batch_bytes = batch_bytes
        self.used = used

    def run(self, double python_at, double plan_at, bint one_turn=False) -> int:
        """Turns until the control plane is needed (TIMER or WAKE, above). `one_turn`: return after
        a single turn (while stopping, the loop looks at what is held after each)."""
        cdef double now, wake_at, nearest
        cdef long timeout_ms
        cdef int rc, err
        cdef bint woken
        cdef JobTable jobs = self.jobs
        cdef Dispatcher dispatcher = self.dispatcher
        broker = self.broker
        if dispatcher._free > 0 and dispatcher.waiting:  # what the control plane freed or queued goes first
            self._dispatch(_now())
        while True:
            now = _now()
            wake_at = python_at
            nearest = jobs.nearest()
            if nearest < wake_at:
                wake_at = nearest
            if dispatcher._free > 0 and dispatcher.waiting:
                spill = dispatcher.next_timer(now)
                if spill is not None and <double>spill < wake_at:
                    wake_at = <double>spill
            if dispatcher.demand and plan_at < wake_at:
                wake_at = plan_at
            timeout_ms = <long>((wake_at - now) * 1000) + 1 if wake_at > now else 0
            if timeout_ms > 1000:
                timeout_ms = 1000
            with nogil:
                rc = zmq_poll(self.items, 3, timeout_ms)
            if rc < 0:
                err = zmq_errno()
                if err == EINTR:  # a signal: Python runs its handler when we return
                    return WAKE
                raise OSError(err, f"zmq_poll: {zmq_error(err)}")
            now = _now()
            woken = self.items[WAKE_FD].revents != 0
            if self.items[BACK].revents:
                try:
                    _, got = drain_backend(self.back_sock, self.workers, self.intake, now, now + self.liveness_s,
                                           self.back_messages)
                except ZMQError:
                    raise
                except Exception as e:  # a bug must cost this message, never the loop
                    broker._backend_fault(e)
                    got = None
                if got is not None:  # a control message (or a draining worker's last results): Python's
                    broker._on_backend(now, got)
            if self.items[FRONT].revents:
                self.front_drain.drain(now, self.front_messages, self.front_bytes)
            if jobs.nearest() <= now:
                broker._expire(now)
            if dispatcher._free > 0 and dispatcher.waiting:
                self._dispatch(now)
            if self.outbox:
                send_replies(self.front_sock, self.outbox, self.arrays, jobs.per_client, self.reply_frame_bytes)
            if woken:
                return WAKE
            if one_turn or now >= python_at or broker._replan or (dispatcher.demand and now >= plan_at):
                return TIMER

    cdef int _dispatch(self, double now) except -1:
        """Hand the queue to the free workers: each worker's new jobs in B_JOBS messages."""
        for wid, batch in self.dispatcher.assign(now):
            if self.used is not None:
                self.used(wid, batch, now)
            try:
                send_jobs(self.back_sock, wid, batch, now, self.batch_jobs, self.batch_bytes)
            except Exception as e:  # a bug must cost these requests, never the loop
                self.broker._unsent(wid, batch, now, e)
        return 0
