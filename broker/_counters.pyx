# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The request counters the exporter reads, compiled (broker/metrics.py: plain dicts, copied per
scrape): one call per request answered, from the intake (C to C) or from the loop (Python).
"""


def count_request(dict requests, dict latency, tuple bounds, str op, str outcome, double seconds) -> None:
    """One request answered: its (op, outcome) count and its latency in the op's plain histogram
    (per-bucket counts, not cumulative, then the sum). Called once per request, so compiled."""
    tally(requests, latency, bounds, op, outcome, seconds)


cdef void tally(dict requests, dict latency, tuple bounds, str op, str outcome, double seconds) except *:
    cdef Py_ssize_t i = 0, n = len(bounds)
    cdef list counts
    key = (op, outcome)
    requests[key] = requests.get(key, 0) + 1
    found = latency.get(op)
    if found is None:
        counts = [0.0] * (n + 1)
        latency[op] = counts
    else:
        counts = <list>found
    if seconds < 0.0:
        seconds = 0.0
    while i < n and <double>bounds[i] < seconds:
        i += 1
    counts[i] = <double>counts[i] + 1.0
    counts[n] = <double>counts[n] + seconds
