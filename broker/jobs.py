"""The broker's job table: every request held, from receipt to reply. No socket, no clock.

One owner for what admission and deadlines read: the jobs by id, their payload bytes, how many
each client connection holds (`--max-pending-bytes`, `--max-client-pending`) and the deadline
heap. The loop adds a job when it admits one and releases it when it is answered or dropped;
where the job is (queued, at a worker) is the dispatcher's (broker/dispatch.py).
"""

from __future__ import annotations

import heapq
from typing import Iterator

from .dispatch import Job


class JobTable:
    def __init__(self) -> None:
        self.jobs: dict[int, Job] = {}
        self.held_bytes = 0  # payload bytes of every job held
        self.per_client: dict[bytes, int] = {}  # jobs held per client connection (its identity)
        self._deadlines: list[tuple[float, int]] = []  # (deadline, job id), answered jobs' entries included
        self._next_id = 1

    def __len__(self) -> int:
        return len(self.jobs)

    def new_id(self) -> int:
        job_id = self._next_id
        self._next_id += 1
        return job_id

    def add(self, job: Job) -> None:
        self.jobs[job.job_id] = job
        self.held_bytes += len(job.raw)
        client = job.envelope.identity
        self.per_client[client] = self.per_client.get(client, 0) + 1
        heapq.heappush(self._deadlines, (job.deadline, job.job_id))

    def release(self, job: Job) -> None:
        """The job is no longer held (answered, or failed for good); a second release is a no-op."""
        if self.jobs.pop(job.job_id, None) is not None:
            self.held_bytes -= len(job.raw)
            client = job.envelope.identity
            left = self.per_client[client] - 1
            if left:
                self.per_client[client] = left
            else:
                del self.per_client[client]

    def held_by(self, client: bytes) -> int:
        return self.per_client.get(client, 0)

    def nearest_deadline(self) -> float | None:
        return self._deadlines[0][0] if self._deadlines else None

    def due(self, now: float) -> Iterator[Job]:
        """The unanswered jobs whose deadline has passed, each once, earliest first."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, job_id = heapq.heappop(deadlines)
            job = self.jobs.get(job_id)
            if job is not None and not job.answered:
                yield job
        if len(deadlines) > 2 * len(self.jobs) + 1024:  # entries of answered jobs: drop them
            self._deadlines = [(j.deadline, j.job_id) for j in self.jobs.values() if not j.answered]
            heapq.heapify(self._deadlines)

    def unanswered(self) -> list[Job]:
        return [job for job in self.jobs.values() if not job.answered]

    def clear(self) -> None:
        self.jobs.clear()
        self.per_client.clear()
        self.held_bytes = 0
