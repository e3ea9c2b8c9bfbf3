"""Which worker gets a request: prefix affinity under a load bound. Pure: no socket, no clock.

Preference. A `RouteKey` (tokenbroker.broker.affinity) carries prefix-block hashes, shallow to
deep, and a rendezvous key. The router keeps a prefix index, block hash -> the worker that last
tokenized it, and prefers the worker of the deepest block found there (then of the key itself);
when the index knows none, rendezvous hashing of the key over the live workers chooses (highest
weight, SplitMix64 of a per-worker salt, SHA-256 of its id, xor the key's first 8 bytes), so a
worker that joins or leaves moves only the unindexed keys it wins or held. The index learns a key
and all its blocks at a worker when that worker has tokenized the input (`record`, called by the
dispatcher on an ok answer), because that worker now holds those prefixes in its L1: "last
tokenized" is the truth the index tracks; a pick alone records nothing.

Load. The router counts nothing: each worker's load is a `WorkerLoad` its owner keeps (the
dispatcher's slots, broker/dispatch.py), read here at every pick: the jobs it holds, its capacity,
and whether it is full by another measure (its payload bytes).

Bounded load. The preferred worker is passed over when, counting this job, its in-flight jobs
would exceed both `balance_factor` x mean and mean + `balance_margin` (the mean over live
workers, also counting this job); it is also passed over when it is at capacity. Then the job
spills to the least loaded worker with a free slot (ties broken by the key's rendezvous order,
so a key's spills are repeatable). With `balance_margin` >= 1 no pick ever takes a worker
over the bound. `pick` returns None only when every worker is full; the broker's pending queue
waits then. Wait or spill when the preferred worker is full but within the bound: `pick(key)`
spills (an "overflow"), so a job never waits while another worker idles, but that alone
loses locality under saturation, when every freed slot goes to the queue's head whatever it
prefers. `pick(key, overflow=False)` waits instead (None while the preferred worker is full),
so a broker can match first: offer the first few dozen pending jobs with `overflow=False`, then
the head with the default. scripts/bench_routing_sim measures it: at ~95% utilisation, L1 reuse
63% -> 79% and median latency 4.3 -> 1.7 ms; at light load the two are the same.

No flapping. A spill records the key's blocks at the new worker, so the conversation's later
turns follow it (they extend the prefix that worker now holds) instead of returning home when
the old worker drains. It moves again only if the new worker in turn goes over the bound, and
the new worker starts at or below the mean, at least `balance_margin` jobs below the bound:
that gap is the hysteresis. (Loads are raw job counts; capacity is only the hard limit.) A hot key whose own traffic exceeds one worker's share therefore
walks from worker to worker one spill at a time, never back and forth per request.

Compiled. The policy runs in broker/_core.pyx (`Router`, with the dispatcher's `Slots` whose
counts it reads as C fields): a pick walks every live worker twice (free slots, the mean for the
bound), which cost O(workers) Python attribute reads per job, 16 us per job at 16 workers.

Memory. The index is an OrderedDict, least recently used out, of at most `index_max_entries`
entries. An entry costs about 140 bytes while the index fills and 193 bytes once LRU churn has
grown the dict's table (tracemalloc on CPython 3.11, at 2^16 to 2^20 entries: a 16-byte bytes
key of 49 bytes, its dict slot and OrderedDict node; the values are shared worker records), so
the default 2^20 entries bound it near 200 MiB; 2^18 (50 MiB) covers ~15,000 prompts of 10 KB.
A request adds at most `affinity.MAX_BLOCKS` + 1 entries. Removing a worker is O(1): its record
is marked gone, so its entries stop counting as hits at once and are dropped when met or
evicted (`index_entries` may count such stale entries until then).
"""

from __future__ import annotations

from typing import Protocol

from ._core import Router, RouterWorker, mix, salt_of

DEFAULT_INDEX_MAX_ENTRIES = 1 << 20


class WorkerLoad(Protocol):
    """A worker's load as its owner counts it; the router only reads it."""

    capacity: int  # the most jobs it holds at once
    blocked: bool  # it takes nothing now, by another measure than its job count (its payload bytes)

    @property
    def held(self) -> int:  # the jobs it holds now
        ...


__all__ = ["DEFAULT_INDEX_MAX_ENTRIES", "Router", "RouterWorker", "WorkerLoad", "mix", "salt_of"]
