"""What a worker process and the broker that starts it agree on outside the wire, and facts about
this process that both sides report (the broker in its exporter, workers in heartbeats)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from types import MappingProxyType

# Set by the supervisor for local workers: the broker's pid, so a worker whose broker died leaves.
PARENT_PID_ENV = "TOKENBROKER_PARENT_PID"

# Worker process exit code when its tokenizers cannot be loaded: not a crash, never respawned.
EXIT_BOOT_ERROR = 3

# Worker process exit code when it left on purpose because its private memory passed its ceiling
# (--max-memory; workers/main.py): not a crash, replaced at once by a fresh one.
EXIT_RECYCLED = 4

# Worker process exit code when it gave up getting through to its broker (--give-up-after;
# workers/join.py): a remote worker's way to tell its own supervisor (systemd, Kubernetes).
EXIT_UNREACHABLE = 5

# One worker uses one core: the tokenizers library's thread pool must not fan out. Read when
# tokenizers is first imported, so set before that: by the supervisor in a local worker's
# environment, and by the worker itself (use_one_thread) when started some other way.
ONE_THREAD_ENV: Mapping[str, str] = MappingProxyType({
    "RAYON_NUM_THREADS": "1",
    "RAYON_RS_NUM_CPUS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "FASTOKENS_BPE_THREADS": "1",  # fastokens' own pool (it defaults to every core), read at its first use
})


def use_one_thread() -> None:
    """Keep this process's tokenizers to one thread, unless its environment already says otherwise."""
    for name, value in ONE_THREAD_ENV.items():
        os.environ.setdefault(name, value)


def resident_bytes() -> int:
    """This process's resident memory, what smg_allocator_allocated_bytes sums over the pool."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux: peak instead of current, the best available
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def proportional_bytes(pid: int | str = "self") -> int | None:
    """A process's proportional set size (PSS): its resident pages, each shared page divided among
    the processes that map it, from /proc/PID/smaps_rollup (~0.1-1 ms: the kernel walks the page
    tables). Forked workers share the template's pages, so RSS counts those once per worker and PSS
    sums to the pool's real memory. None where the file is not there (not Linux, a process gone)."""
    figures = memory_figures(pid)
    return None if figures is None else figures[0]


def memory_figures(pid: int | str = "self") -> tuple[int, int] | None:
    """(PSS, private) bytes of a process, from one read of /proc/PID/smaps_rollup. Private memory
    (Private_Clean + Private_Dirty: pages no other process maps) is what ending the process gives
    back: a forked worker's own growth, without the template's pages it shares, whose PSS share
    rises whenever a sibling leaves. None where the file is not there."""
    pss = private = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith(b"Private_"):  # Private_Clean, Private_Dirty, Private_Hugetlb
                    private += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return pss, private


# --- the template worker (workers/zygote.py) and the supervisor that drives it ---------------
#
# Local workers are forked from one template process that loaded the startup models, so they share
# its pages (docs/sizing.md, "Memory"). The supervisor writes commands to the template's stdin, one
# a line; the template writes reports to the pipe whose write end it was given (--zygote-fd), one a
# line. Names and pids never hold spaces.

ZYGOTE_FORK = "fork"  # supervisor -> template: "fork NAME": start a worker called NAME
ZYGOTE_FORKED = "forked"  # template -> supervisor: "forked NAME PID"
ZYGOTE_EXIT = "exit"  # template -> supervisor: "exit PID CODE" (CODE as Popen's returncode: -N for signal N)
ZYGOTE_LOADED = "loaded"  # template -> supervisor: "loaded SECONDS", once its models are in memory


def thread_count() -> int:
    """Threads of this process (1 where /proc is not there: the caller cannot tell)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def drain_pipe(fd: int) -> None:
    """Read a non-blocking wake-up pipe empty: its bytes only said "look", and the next write must
    wake the next poll (the loader's, the lanes' and the template's pipes)."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def release_memory() -> None:
    """Give the heap a model left behind back to the system (glibc keeps freed arenas otherwise: a
    DeepSeek tokenizer let go left ~50 MiB resident until trimmed). Elsewhere, a no-op. Workers call
    it when they let a tokenizer go (workers/loader.py, workers/registry.py) and before the
    template forks (workers/zygote.py)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def signal_process(pid: int, sig: int) -> None:
    """Send `sig` to `pid`, which may have left already: a child that exited between the caller's
    look and this call is no error (the supervisor's workers, the template's forks)."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
