"""Chat templates render in a child process: a hard bound on memory (RLIMIT_AS) and wall time (a kill timer).

This is jinja2's side (chat/__init__.py): templates MiniJinja serves render in the worker's own
process, bounded by fuel (chat/mini.py), and a worker starts this child only when jinja2 first renders.

Templates are hostile code (clients may send them with `add_model`; messages and chat_template_kwargs
are client data). The sandbox in chat/sandbox.py checks every value a template builds, but a single
C-level call (sorting 16 million strings, one huge `str.join`) cannot be interrupted from inside the
process, and any check we forget lets a value grow without bound. So the render itself runs in a child
process that the worker starts once and reuses:

- while it renders, its address space is capped with RLIMIT_AS (what it holds with the request read
  + `max_memory_bytes`), so an allocation past the budget fails with MemoryError inside the child,
  whatever code path made it; a child whose memory stays grown after a render is replaced;
- the worker waits for the answer at most `max_seconds` (+ a short grace for the child's own, cleaner
  deadline error) and then kills the child, so a render is bounded in wall time even inside one call;
- a child that was killed, died, or hit its memory limit is replaced on the next render.

Cost, measured with scripts/bench_chat_sandbox on the 13 real templates (8-turn chats, a loaded
2-core machine): the bounded render itself takes 50-1300 us; the child adds ~150 us of CPU per render
(a MessagePack frame each way over a pipe, two address-space reads, two setrlimit calls, two wakeups)
and holds ~25 MiB resident per worker. On an idle machine a round trip with a small chat took ~25 us.
We pay it because the alternative, bounds kept entirely in process (input caps on the slow filters
and deadline checks in the call hooks, which this sandbox has too), stops nothing inside one long
C call and bounds memory only as far as every check is right: the child bounds both by construction.

Frames are a 4-byte little-endian length and a MessagePack map. Request: `t` (template number), `src`
and `name` (the first time this child sees template `t`), `vars`, `s` (max seconds), `b` (max output
bytes). Reply: `prompt`, or `error` (a template_error message) and `recycle` (the child exits after it).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from tokenbroker.common.errors import ProtocolError

log = logging.getLogger(__name__)

DEFAULT_MAX_MEMORY_BYTES = 512 * 2**20
RENDER_NICE = 5  # the child's CPU priority below its worker's: its budget is wall time, so this costs only contended renders
_GRACE_SECONDS = 0.5  # the child's own deadline check answers first, with the same message, and survives
_HEADER = struct.Struct("<I")
_MAX_MESSAGE_CHARS = 64 * 1024  # error messages a template builds are cut here


def _pack(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True, unicode_errors="surrogatepass")
    return _HEADER.pack(len(body)) + body


def _unpack(body: bytes) -> Any:
    return msgpack.unpackb(body, raw=False, unicode_errors="surrogatepass", strict_map_key=False)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class _FrameReader:
    """Reads length-prefixed frames from a pipe: usually one poll and one read per frame.

    `max_size` refuses a frame before reading it (FrameTooLarge); `deadline` (monotonic) bounds the
    wait (TimeoutError); None at EOF.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        self._buffer = bytearray()

    def read(self, *, deadline: float | None = None, max_size: int | None = None) -> bytes | None:
        size = None
        while True:
            if size is None and len(self._buffer) >= _HEADER.size:
                size = _HEADER.unpack_from(self._buffer)[0]
                if max_size is not None and size > max_size:
                    raise FrameTooLarge(size)
            if size is not None and len(self._buffer) >= _HEADER.size + size:
                frame = bytes(self._buffer[_HEADER.size:_HEADER.size + size])
                del self._buffer[:_HEADER.size + size]
                return frame
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not self._poller.poll(max(1, int(left * 1000))):
                    if time.monotonic() >= deadline:
                        raise TimeoutError
                    continue
            want = 1 << 16 if size is None else max(1 << 16, min(_HEADER.size + size - len(self._buffer), 1 << 22))
            chunk = os.read(self._fd, want)
            if not chunk:
                return None
            self._buffer += chunk


class FrameTooLarge(Exception):
    """A frame longer than the reader accepts."""


def _memory_message(max_memory_bytes: int) -> str:
    return f"chat template rendering ran past its memory budget of {max_memory_bytes // 2**20} MiB"


def _time_message(max_seconds: float) -> str:
    return f"chat template rendering took longer than {max_seconds:g} s (its time budget)"


# --- the worker's side ------------------------------------------------------------------------------


@dataclass
class _Child:
    proc: subprocess.Popen
    reader: _FrameReader
    stdin_fd: int
    known: set[int] = field(default_factory=set)  # template numbers this child has compiled


class RenderProcess:
    """One render child, started on first use and replaced when it is killed or dies; thread-safe.

    >>> p = RenderProcess(max_memory_bytes=DEFAULT_MAX_MEMORY_BYTES)
    >>> p.render("{{ messages[0].content * 2 }}", "doc", {"messages": [{"content": "ab"}]}, max_seconds=5, max_bytes=16)
    'abab'
    >>> p.close()
    """

    def __init__(self, *, max_memory_bytes: int) -> None:
        self.max_memory_bytes = max_memory_bytes
        self._lock = threading.Lock()
        self._child: _Child | None = None
        self._numbers: dict[str, int] = {}  # template source -> its number, stable across children

    def pid(self) -> int | None:
        """The live child's pid (tests read its resident size), or None."""
        child = self._child
        return child.proc.pid if child is not None and child.proc.poll() is None else None

    def start(self) -> None:
        """Start the child now rather than on the first render (it takes ~0.1 s to import Jinja)."""
        with self._lock:
            self._ensure()

    def render(self, source: str, name: str, variables: dict, *, max_seconds: float, max_bytes: int) -> str:
        """The prompt `source` renders from `variables`; ProtocolError("template_error") naming the budget."""
        with self._lock:
            number = self._numbers.setdefault(source, len(self._numbers))
            request = {"t": number, "vars": variables, "s": max_seconds, "b": max_bytes}
            child: _Child | None = None
            for attempt in range(2):  # a child that died while idle is replaced once
                child = None
                try:
                    child = self._ensure()
                    if number not in child.known:
                        request.update(src=source, name=name)
                    _write_all(child.stdin_fd, _pack(request))
                    break
                except OSError as e:
                    if child is not None:
                        self._discard(child)
                    if attempt:
                        log.error("chat template sandbox could not be started: %s", e)
                        raise ProtocolError(
                            "template_error", "the chat template sandbox could not be started") from None
            assert child is not None  # the loop breaks with a child or raises
            child.known.add(number)
            reply = self._await(child, time.monotonic() + max_seconds + _GRACE_SECONDS, max_seconds, max_bytes)
        if "error" in reply:
            raise ProtocolError("template_error", reply["error"])
        return reply["prompt"]

    def close(self) -> None:
        with self._lock:
            if self._child is not None:
                self._discard(self._child)

    def cancel(self) -> None:
        """Kill the child now, from any thread (the lane's watchdog, past a job's deadline): a render
        waiting on it returns at once with a template_error, and the next render starts a new child."""
        child = self._child
        if child is not None and child.proc.poll() is None:
            child.proc.kill()

    def _await(self, child: _Child, deadline: float, max_seconds: float, max_bytes: int) -> dict:
        try:
            body = child.reader.read(deadline=deadline, max_size=max_bytes + 4 * _MAX_MESSAGE_CHARS + 4096)
        except TimeoutError:
            self._discard(child)
            raise ProtocolError("template_error", _time_message(max_seconds)) from None
        except FrameTooLarge:
            self._discard(child)
            raise ProtocolError("template_error", "the chat template sandbox sent an oversized reply") from None
        if body is None:
            status = self._discard(child)
            raise ProtocolError(
                "template_error",
                f"the chat template sandbox died while rendering ({status}); "
                f"{_memory_message(self.max_memory_bytes)} or crashed",
            )
        reply = _unpack(body)
        if reply.get("recycle"):
            self._discard(child)
        return reply

    def _ensure(self) -> _Child:
        if self._child is None or self._child.proc.poll() is not None:
            if self._child is not None:
                self._discard(self._child)
            # -c rather than -m: `-m` would import this module twice (its package's facade imports it first)
            argv = [sys.executable, "-c", f"import sys; from {__name__} import main; main(sys.argv[1:])", str(self.max_memory_bytes)]
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, close_fds=True)
            assert proc.stdin is not None and proc.stdout is not None  # both are pipes
            self._child = _Child(proc, _FrameReader(proc.stdout.fileno()), proc.stdin.fileno())
        return self._child

    def _discard(self, child: _Child) -> str:
        """Kill (if alive) and reap `child`; its exit status as text."""
        if self._child is child:
            self._child = None
        proc = child.proc
        if proc.poll() is None:
            proc.kill()
        for f in (proc.stdin, proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        code = proc.wait()
        return f"signal {-code}" if code < 0 else f"exit {code}"


_shared: dict[int, RenderProcess] = {}
_shared_lock = threading.Lock()


def shared_render_process(max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES) -> RenderProcess:
    """The process-wide render child for a memory budget: every model's renderer in a worker shares one."""
    with _shared_lock:
        p = _shared.get(max_memory_bytes)
        if p is None:
            p = _shared[max_memory_bytes] = RenderProcess(max_memory_bytes=max_memory_bytes)
        return p


# --- the child's side -------------------------------------------------------------------------------


class _AddressSpace:
    """This process's address space (from /proc/self/statm, kept open: a read costs ~5 us) and its limit."""

    def __init__(self, budget: int) -> None:
        import resource

        self._resource = resource
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.budget = budget
        self.baseline = self.now()

    def now(self) -> int:
        return int(os.pread(self._fd, 64, 0).split()[0]) * self._page

    def limit(self) -> None:
        """From here on, allocations past the budget fail (MemoryError): the request's input is already in."""
        limit = self.now() + self.budget
        self._resource.setrlimit(self._resource.RLIMIT_AS, (limit, self._resource.RLIM_INFINITY))

    def unlimit(self) -> None:
        """Reading the next request (trusted, bounded by the broker's request size limit) is not charged."""
        self._resource.setrlimit(self._resource.RLIMIT_AS, (self._resource.RLIM_INFINITY, self._resource.RLIM_INFINITY))

    def grew(self) -> bool:
        """Whether memory a render freed stayed mapped (fragmentation): then the child is replaced."""
        return self.now() > self.baseline + self.budget // 2


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL us when the worker dies (EOF on stdin covers the rest)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def _serve_one(env: Any, compiled: dict, names: dict, request: dict, max_memory_bytes: int) -> dict:
    """Compile (once per template) and render one request; every failure becomes an error reply."""
    import jinja2

    from .sandbox import BudgetExceeded, generate_bounded

    number = request["t"]
    if "src" in request:
        names[number] = request["name"]
        try:
            compiled[number] = env.compile_template(request["src"])
        except jinja2.TemplateSyntaxError as e:
            return {"error": f"chat template ({request['name']}) does not compile: line {e.lineno}: {e.message}"}
        except MemoryError:
            return {"error": _memory_message(max_memory_bytes), "recycle": True}
    template = compiled.get(number)
    if template is None:  # the template did not compile in an earlier request: compile errors again
        return {"error": f"chat template ({names.get(number, '?')}) does not compile"}
    try:
        chunks = generate_bounded(template, request["vars"], max_seconds=request["s"], max_bytes=request["b"])
        return {"prompt": "".join(chunks)}
    except MemoryError:
        return {"error": _memory_message(max_memory_bytes), "recycle": True}
    except BudgetExceeded as e:
        return {"error": str(e)}
    except jinja2.TemplateError as e:
        return {"error": (str(e) or type(e).__name__)[:_MAX_MESSAGE_CHARS]}
    except RecursionError:
        return {"error": "chat template recursed too deeply"}
    except Exception as e:  # noqa: BLE001 - a template's own bug (TypeError, KeyError, ...) is the template's error
        return {"error": f"chat template failed: {type(e).__name__}: {e}"[:_MAX_MESSAGE_CHARS]}


def main(argv: list[str]) -> None:
    """The child: answer render requests on stdin until EOF, each render's address space capped."""
    from .sandbox import ChatEnvironment

    max_memory_bytes = int(argv[0])
    _die_with_parent()
    os.nice(RENDER_NICE)  # a render that burns its budget yields the CPU to the worker's small jobs
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker decides when we stop (Ctrl-C reaches the group)
    out_fd = os.dup(1)
    os.dup2(2, 1)  # nothing but frames on the pipe, whatever prints
    env = ChatEnvironment()
    space = _AddressSpace(max_memory_bytes)
    compiled: dict[int, Any] = {}
    names: dict[int, str] = {}
    reader = _FrameReader(0)
    while True:
        body = reader.read()
        if body is None:
            return
        request = _unpack(body)
        del body
        space.limit()
        try:
            reply = _serve_one(env, compiled, names, request, max_memory_bytes)
        except MemoryError:
            reply = {"error": _memory_message(max_memory_bytes), "recycle": True}
        finally:
            space.unlimit()
        del request
        if space.grew():
            reply["recycle"] = True
        _write_all(out_fd, _pack(reply))
        if reply.get("recycle"):
            return


if __name__ == "__main__":
    main(sys.argv[1:])
