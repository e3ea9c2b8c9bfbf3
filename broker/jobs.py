"""The broker's job table: every request held, from receipt to reply. No socket, no clock.

One owner for what admission and deadlines read: the jobs by id, their payload bytes, how many
each client connection holds (`--max-pending-bytes`, `--max-client-pending`) and the deadline
heap. Compiled (broker/_core.pyx), as `Job` is: one of each is touched per request. The loop
admits a job with `JobTable.admit` and releases it when it is answered or dropped;
where the job is (queued, at a worker) is the dispatcher's (broker/dispatch.py).

`Intake` is the loop's compiled hand on this table per message and per result batch: it admits
a frame's requests (the refusal checks, the route key, `admit`, the queue) and finishes a
worker's results (the dispatcher's `finish`, `release`, the reply, the request counters), so
the loop runs Python per request only for what is not the common case.
"""

from ._core import Intake, Job, JobTable

__all__ = ["Intake", "Job", "JobTable"]
