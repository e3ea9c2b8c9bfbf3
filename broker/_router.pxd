# The router (broker/_router.pyx): each worker's Slots, its record, and the Router the dispatcher asks.

from tokenbroker.broker._hash cimport u64
from tokenbroker.broker._routekey cimport RouteKey


cdef class Slots:
    cdef public int capacity
    cdef public dict jobs
    cdef public long long bytes          # payload bytes of the jobs held (not counting off-loop ones)
    cdef public int long_jobs            # long tokenize jobs held: encoded off the worker's loop, one at a time
    cdef public bint draining            # said BYE: finishes what it holds, gets nothing new
    cdef public bint blocked             # no room by payload bytes (or count): set when that changes


cdef class RouterWorker:
    cdef public bytes wid
    cdef public Slots load
    cdef public u64 salt       # this id's rendezvous salt, hashed once
    cdef public bint alive


cdef class Router:
    cdef public double balance_factor
    cdef public int balance_margin
    cdef public Py_ssize_t index_max_entries
    cdef public dict _workers
    cdef public object _index
    cdef long long n_picks, n_hits, n_rendezvous, n_spills, n_overflows, n_unkeyed, n_full
    cdef Py_ssize_t _held_sum(self)
    cpdef double bound(self, int extra=*)
    cdef RouterWorker _choose(self, RouteKey key, list free, bint overflow, allowed)
    cpdef object _lookup(self, RouteKey key)
    cdef _record(self, RouteKey key, RouterWorker w)
    cpdef object _rendezvous(self, bytes key, workers)
