"""Which queued job goes to which worker, and when: the broker's dispatch policy. No socket, no clock.

The `Dispatcher` owns where each job is: the pending queue, and for each worker the jobs it holds
(its `Slots`). (Which worker holds which *model* is broker/placement.py's.) The router
(tokenbroker.broker.router) is its policy for one pick, and reads each worker's load from the
slots themselves (`Slots.held`, `Slots.blocked`): the one place that counts it.

A turn of `assign(now)`:

1. Affinity pass: the first `lookahead` queued jobs are offered to their preferred worker only
   (`Router.pick(overflow=False)`); a job whose preferred worker is full but within the load
   bound stays queued. Without it a saturated pool hands each freed slot to the queue's head,
   whatever worker it prefers, and affinity is lost exactly when it matters most.
2. In order: the queue's head goes to any worker with room once it has waited `spill_wait`
   (or at once if it has no key), so a job never waits long while another worker idles.

What one turn assigns to a worker goes in one backend message (the backend splits it by count and
bytes), so a busy pool pays the hop once per batch, not per job. A worker is full at `capacity`
jobs, or at `worker_bytes` payload bytes once it holds one job: a huge request blocks the queue of
its own worker only, and small ones go elsewhere meanwhile. A `tokenize` longer than `worker_bytes`
is the exception when caches are off (`long_off_loop`): a worker encodes it off its round loop
(workers/background.py; with caches on it encodes inline, its prefixes cached); so is a `count`
over LANE_COUNT_BYTES, in every cache mode (workers/count_lane.py). Such a job does not count against
the worker's bytes; instead a worker holds one such job at a time, and the small jobs keep flowing to
it (counted in bytes, four 300 KB provider bodies filled a worker, and a queue of them held the
small jobs behind it for up to a second).

A job that names a model goes only to the workers that serve it, as broker/placement.py's
`Placement.eligible` says (the one owner of that answer): a catalog model's holders (none yet: it
waits for a load, within its deadline), another name's by what workers said in READY. A job that finds them all full waits without holding up
the jobs behind it; `demand` counts the queued jobs of each catalog model, for placement.

Compiled (broker/_core.pyx `Dispatcher`, with its `Slots`, `Job` and the router): a turn touches
every queued job and every worker's counts, which in Python cost 3-16 us per job (1-16 workers).

`next_timer(now)` says when waiting could change something: only when a worker has room and the
head waits for its spill time. With no room anywhere the broker sleeps until a worker answers.
"""

from __future__ import annotations

from ._core import Dispatcher, Job, Slots, _unplaced

AFFINITY_LOOKAHEAD = 64  # queued jobs offered to their preferred worker before strict order (the default)
PASSED_OVER_MAX = 1024  # queued jobs a turn may step past because their model's workers are full (the default)

__all__ = ["AFFINITY_LOOKAHEAD", "PASSED_OVER_MAX", "Dispatcher", "Job", "Slots"]
