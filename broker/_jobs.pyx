# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The broker's job table, compiled: every request held, from receipt to reply. No socket, no clock.

One owner for what admission and deadlines read: the jobs by id, their payload bytes, how many
each client connection holds (`--max-pending-bytes`, `--max-client-pending`) and the deadline heap.
Compiled, as `Job` is: one of each is touched per request. The loop admits a job (through the
intake, broker/_intake.pyx) with `JobTable.admit` and releases it when it is answered or dropped;
where the job is (queued, at a worker) is the dispatcher's (broker/_dispatch.pyx).
"""

from libc.math cimport INFINITY

from tokenbroker.broker._peek cimport Peek

from heapq import heapify, heappop, heappush


cdef class Job:
    """One client request held by the broker, from receipt to reply (compiled: one is built per
    request, and the dispatcher and the loop read its fields many times)."""


    def __init__(self, long long job_id, envelope, bytes raw_id, raw, str op, route, double received,
                 double deadline, double queued, int attempts=0, worker=None, bint answered=False, model=None,
                 bint catalog=False, bint off_loop=False):
        self.job_id = job_id
        self.envelope = envelope
        self.raw_id = raw_id
        self.raw = raw
        self.op = op
        self.route = route
        self.received = received
        self.deadline = deadline
        self.queued = queued
        self.attempts = attempts
        self.worker = worker
        self.answered = answered
        self.model = model
        self.catalog = catalog
        self.off_loop = off_loop

    def __repr__(self) -> str:
        return f"Job({self.job_id}, op={self.op!r}, model={self.model!r}, worker={self.worker!r}, answered={self.answered})"


cdef class JobTable:
    """Every request held, from receipt to reply: the jobs by id, their payload bytes, how many each
    client connection holds (`--max-pending-bytes`, `--max-client-pending`) and the deadline heap.
    No socket, no clock. The loop admits a job with `admit` and releases it when it is answered or
    dropped; where the job is (queued, at a worker) is the dispatcher's (docs/routing.md, "The dispatcher")."""


    def __init__(self):
        self.jobs = {}
        self.held_bytes = 0
        self.per_client = {}
        self._deadlines = []
        self._next_id = 1

    def __len__(self) -> int:
        return len(self.jobs)

    def __bool__(self) -> bool:
        return len(self.jobs) > 0

    cpdef Job admit(self, envelope, Peek peek, route, double now, double timeout_s, model, bint catalog):
        """A new job for an admitted request, held from now on (one call per request)."""
        cdef Job job = Job.__new__(Job)
        job.job_id = self._next_id
        self._next_id += 1
        job.envelope = envelope
        job.raw_id = peek.raw_id
        job.raw = peek.body
        job.op = peek.op
        job.route = route
        job.received = now
        job.deadline = now + timeout_s
        job.queued = now
        job.model = model
        job.catalog = catalog
        self.add(job)
        return job

    cpdef add(self, Job job):
        self.jobs[job.job_id] = job
        self.held_bytes += len(job.raw)
        client = job.envelope[0]
        self.per_client[client] = self.per_client.get(client, 0) + 1
        heappush(self._deadlines, (job.deadline, job.job_id))

    cpdef release(self, Job job):
        """The job is no longer held (answered, or failed for good); a second release is a no-op."""
        if self.jobs.pop(job.job_id, None) is not None:
            self.held_bytes -= len(job.raw)
            client = job.envelope[0]
            left = self.per_client[client] - 1
            if left:
                self.per_client[client] = left
            else:
                del self.per_client[client]

    def held_by(self, client: bytes) -> int:
        return self.per_client.get(client, 0)

    cdef double nearest(self):
        """The earliest deadline in the heap (an answered job's included: `due` drops those), or
        infinity when it is empty."""
        return (<tuple>self._deadlines[0])[0] if self._deadlines else INFINITY

    def due(self, double now) -> list:
        """The unanswered jobs whose deadline has passed, each once, earliest first."""
        cdef list out = []
        cdef list deadlines = self._deadlines
        cdef Job job
        while deadlines and deadlines[0][0] <= now:
            _, job_id = heappop(deadlines)
            found = self.jobs.get(job_id)
            if found is not None and not (<Job>found).answered:
                out.append(found)
        if len(deadlines) > 2 * len(self.jobs) + 1024:  # entries of answered jobs: drop them
            self._deadlines = [(job.deadline, job.job_id) for job in self.jobs.values() if not job.answered]
            heapify(self._deadlines)
        return out

    def unanswered(self) -> list:
        return [job for job in self.jobs.values() if not (<Job>job).answered]

    def clear(self) -> None:
        self.jobs.clear()
        self.per_client.clear()
        self.held_bytes = 0
