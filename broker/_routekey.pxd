# Routing keys (broker/_routekey.pyx): the RouteKey the router reads, and `route_key`, which the
# intake calls per request (C to C).

from tokenbroker.broker._peek cimport Peek


cdef class RouteKey:
    cdef readonly bytes key
    cdef readonly tuple blocks


cpdef object route_key(Peek peek)
