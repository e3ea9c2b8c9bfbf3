# The request counters (broker/_counters.pyx), counted by the intake per reply.

cdef void tally(dict requests, dict latency, tuple bounds, str op, str outcome, double seconds) except *
