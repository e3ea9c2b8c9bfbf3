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
them: one hop fewer, and the control plane calls straight back in). Until the frontend's and the
backend's drains are compiled end to end, a turn calls the loop's own verbs for them; each verb
already does its per-message work in the compiled cores.
"""

from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from tokenbroker.broker._dispatch cimport Dispatcher
from tokenbroker.broker._frontend cimport Drain
from tokenbroker.broker._jobs cimport JobTable
from tokenbroker.common._zmq cimport EINTR, ZMQ_POLLIN, handle_of, load_libzmq, zmq_errno, zmq_error, zmq_poll

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

    def __init__(self, front, back, int wake_fd, broker, JobTable jobs, Dispatcher dispatcher, frontend, dict outbox,
                 Drain front_drain, Py_ssize_t front_messages, Py_ssize_t front_bytes):
        self.items[BACK].socket = handle_of(back)
        self.items[BACK].fd = 0
        self.items[BACK].events = ZMQ_POLLIN
        self.items[WAKE_FD].socket = NULL
        self.items[WAKE_FD].fd = wake_fd
        self.items[WAKE_FD].events = ZMQ_POLLIN
        self.items[FRONT].socket = handle_of(front)
        self.items[FRONT].fd = 0
        self.items[FRONT].events = ZMQ_POLLIN
        self.broker = broker
        self.front_drain = front_drain
        self.front_messages = front_messages
        self.front_bytes = front_bytes
        self.jobs = jobs
        self.dispatcher = dispatcher
        self.frontend = frontend
        self.outbox = outbox
        self.turns = 0
        self.returns = 0

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
        while True:
            now = _now()
            wake_at = python_at
            if jobs._deadlines:
                nearest = (<tuple>jobs._deadlines[0])[0]
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
            self.turns += 1
            if rc < 0:
                err = zmq_errno()
                if err == EINTR:  # a signal: Python runs its handler when we return
                    self.returns += 1
                    return WAKE
                raise OSError(err, f"zmq_poll: {zmq_error(err)}")
            now = _now()
            woken = self.items[WAKE_FD].revents != 0
            if self.items[BACK].revents:
                broker._on_backend(now)
            if self.items[FRONT].revents:
                self.front_drain.drain(now, self.front_messages, self.front_bytes)
            if jobs._deadlines and (<tuple>jobs._deadlines[0])[0] <= now:
                broker._expire(now)
            if dispatcher._free > 0 and dispatcher.waiting:
                broker._dispatch(now)
            if self.outbox:
                self.frontend.flush(jobs.per_client)
            if woken:
                self.returns += 1
                return WAKE
            if one_turn or now >= python_at or broker._replan or (dispatcher.demand and now >= plan_at):
                self.returns += 1
                return TIMER
