"""Facts about this process that both sides report: the broker in its exporter, workers in heartbeats."""

from __future__ import annotations

import os


def resident_bytes() -> int:
    """This process's resident memory, what smg_allocator_allocated_bytes sums over the pool."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux: peak instead of current, the best available
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
