"""The broker's job table: every request held, from receipt to reply. No socket, no clock.

One owner for what admission and deadlines read: the jobs by id, their payload bytes, how many
each client connection holds (`--max-pending-bytes`, `--max-client-pending`) and the deadline
heap. Compiled (broker/_core.pyx), as `Job` is: one of each is touched per request. The loop
admits a job with `JobTable.admit` and releases it when it is answered or dropped;
where the job is (queued, at a worker) is the dispatcher's (broker/dispatch.py).
"""

from ._core import Job, JobTable

__all__ = ["Job", "JobTable"]
