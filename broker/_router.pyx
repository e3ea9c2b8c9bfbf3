# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The router's policy for one pick, compiled: prefix affinity with rendezvous fallback, under a
bounded-load rule (docs/routing.md, "The router", holds its design). It reads each worker's load
from the dispatcher's `Slots` as C fields: a pick walks every live worker twice (free slots, the
mean for the bound), which in Python cost 16 us per job at 16 workers.
"""

from tokenbroker.broker._hash cimport mix64, u64, uchar
from tokenbroker.broker._routekey cimport RouteKey
from tokenbroker.common._wire cimport get_le


cdef class Slots:
    """What one worker holds: its load, as the router reads it. The dispatcher owns it; compiled
    so the router reads the counts as C fields."""


    def __init__(self, int capacity, dict jobs=None, long long bytes=0, int long_jobs=0, bint draining=False,
                 bint blocked=False):
        self.capacity = capacity
        self.jobs = {} if jobs is None else jobs
        self.bytes = bytes
        self.long_jobs = long_jobs
        self.draining = draining
        self.blocked = blocked

    @property
    def held(self) -> int:
        return len(self.jobs)


cdef inline Py_ssize_t _load_held(Slots load):
    return len(load.jobs)


cdef inline bint _load_free(Slots load):
    """Room for one more job: under capacity and not blocked."""
    return len(load.jobs) < load.capacity and not load.blocked


cdef class RouterWorker:
    """One incarnation of a worker: a re-added id gets a new record, so old index entries stay dead."""


    def __init__(self, bytes wid, Slots load, u64 salt, bint alive=True):
        self.wid = wid
        self.load = load
        self.salt = salt
        self.alive = alive


cdef u64 _key_int(bytes key):
    cdef const uchar* p = <const uchar*><const char*>key
    if len(key) < 8:
        from hashlib import sha256
        return <u64>int.from_bytes(sha256(key).digest()[:8], "little")
    return get_le(p, 8)


def salt_of(bytes wid) -> int:
    """A worker id's rendezvous salt: the first 8 bytes (little end first) of SHA-256 of a tag and the id."""
    from hashlib import sha256
    return int.from_bytes(sha256(b"tb-rendezvous\x00" + wid).digest()[:8], "little")


cdef class Router:
    """Prefix affinity with rendezvous fallback, under a bounded-load rule (docs/routing.md)."""


    def __init__(self, *, double balance_factor=1.25, int balance_margin=2, Py_ssize_t index_max_entries=1 << 20):
        from collections import OrderedDict
        if balance_factor < 1.0:
            raise ValueError(f"balance_factor must be >= 1.0, got {balance_factor}")
        if balance_margin < 0:
            raise ValueError(f"balance_margin must be >= 0, got {balance_margin}")
        if index_max_entries < 1:
            raise ValueError(f"index_max_entries must be >= 1, got {index_max_entries}")
        self.balance_factor = balance_factor
        self.balance_margin = balance_margin
        self.index_max_entries = index_max_entries
        self._workers = {}
        self._index = OrderedDict()

    # --- worker events

    def add_worker(self, bytes wid, Slots load) -> None:
        """A worker is ready; `load` is where its owner counts what it holds. A known id takes the new load."""
        if load.capacity < 1:
            raise ValueError(f"worker capacity must be >= 1, got {load.capacity}")
        known = self._workers.get(wid)
        if known is not None:
            (<RouterWorker>known).load = load
            return
        self._workers[wid] = RouterWorker(wid, load, salt_of(wid))

    def remove_worker(self, bytes wid) -> None:
        """The worker is gone (or takes nothing new): its load stops counting, its index entries too."""
        w = self._workers.pop(wid, None)
        if w is not None:
            (<RouterWorker>w).alive = False

    # --- the policy

    def pick(self, key, *, bint overflow=True, allowed=None):
        """A worker with a free slot for this request; None when all are full (docs/routing.md)."""
        cdef list free = []
        cdef RouterWorker w, chosen = None
        cdef Py_ssize_t best = -1, h
        for v in self._workers.values():
            w = <RouterWorker>v
            if _load_free(w.load) and (allowed is None or w.wid in allowed):
                free.append(w)
        if not free:
            self.n_full += 1
            return None
        if key is None:
            for v in free:
                w = <RouterWorker>v
                h = _load_held(w.load)
                if chosen is None or h < best or (h == best and w.wid < chosen.wid):
                    chosen, best = w, h
            self.n_unkeyed += 1
        else:
            chosen = self._choose(<RouteKey>key, free, overflow, allowed)
            if chosen is None:
                return None
        self.n_picks += 1
        return chosen.wid

    def record(self, RouteKey key, bytes wid) -> None:
        """`wid` has tokenized `key`'s input: its prefixes are in that worker's L1 now."""
        w = self._workers.get(wid)
        if w is not None:
            self._record(key, <RouterWorker>w)

    cdef Py_ssize_t _held_sum(self):
        cdef Py_ssize_t total = 0
        for v in self._workers.values():
            total += _load_held((<RouterWorker>v).load)
        return total

    cpdef double bound(self, int extra=1):
        """The most in-flight jobs a worker may reach when `extra` more jobs are placed."""
        cdef Py_ssize_t n = len(self._workers)
        cdef double mean, a, b
        if n == 0:
            return 0.0
        mean = (self._held_sum() + extra) / <double>n
        a = self.balance_factor * mean
        b = mean + self.balance_margin
        return a if a > b else b

    def stats(self) -> dict:
        """Counters since start and gauges, for metrics (broker/metrics.py)."""
        return {"picks": self.n_picks, "affinity_hits": self.n_hits, "rendezvous": self.n_rendezvous,
                "spills": self.n_spills, "overflows": self.n_overflows, "unkeyed": self.n_unkeyed, "full": self.n_full,
                "workers": len(self._workers), "in_flight": self._held_sum(), "index_entries": len(self._index)}

    cdef RouterWorker _choose(self, RouteKey key, list free, bint overflow, allowed):
        found = self._lookup(key) if len(self._index) else None
        cdef RouterWorker hit = <RouterWorker>found if found is not None else None
        cdef RouterWorker home, w, best = None
        cdef bint within
        cdef Py_ssize_t h, bh = 0
        cdef u64 k, wt, bw = 0
        if allowed is not None and hit is not None and hit.wid not in allowed:
            hit = None
        if hit is not None:
            home = hit
        else:
            home = <RouterWorker>self._rendezvous(key.key, self._workers.values() if allowed is None
                                    else [v for v in self._workers.values() if (<RouterWorker>v).wid in allowed])
        h = _load_held(home.load)
        within = h + 1 <= self.bound(1)
        if within and _load_free(home.load):
            if hit is not None:
                self.n_hits += 1
            else:
                self.n_rendezvous += 1
            return home
        if within and not overflow:
            return None
        # Spilled: over the bound, or merely full (an overflow). Least loaded, ties by rendezvous.
        if not within:
            self.n_spills += 1
        else:
            self.n_overflows += 1
        k = _key_int(key.key)
        for v in free:
            w = <RouterWorker>v
            h = _load_held(w.load)
            wt = mix64(w.salt ^ k)
            if best is None or h < bh or (h == bh and wt > bw):
                best, bh, bw = w, h, wt
        return best

    cpdef object _lookup(self, RouteKey key):
        """The live worker of the deepest indexed block, else of the key; drops stale entries met."""
        cdef Py_ssize_t i
        index = self._index
        blocks = key.blocks
        for i in range(len(blocks) - 1, -2, -1):
            h = blocks[i] if i >= 0 else key.key
            w = index.get(h)
            if w is None:
                continue
            if (<RouterWorker>w).alive:
                return w
            del index[h]
        return None

    cdef _record(self, RouteKey key, RouterWorker w):
        index = self._index
        blocks = key.blocks
        if not blocks or key.key != blocks[0]:
            index[key.key] = w
            index.move_to_end(key.key)
        for h in blocks:
            index[h] = w
            index.move_to_end(h)
        while len(index) > self.index_max_entries:
            index.popitem(last=False)

    cpdef object _rendezvous(self, bytes key, workers):
        """Highest weight wins; weights are per (worker, key), so a leaving worker moves only its keys."""
        cdef u64 k = _key_int(key), wt, bw = 0
        cdef RouterWorker w, best = None
        for v in workers:
            w = <RouterWorker>v
            wt = mix64(w.salt ^ k)
            if best is None or wt > bw or (wt == bw and w.wid > best.wid):
                best, bw = w, wt
        return best
