"""The compiled cores, built by setuptools at `pip install` (Cython from the build requirements).

Everything else about the package is in pyproject.toml; this file only lists the extension modules,
each beside the Python policy it serves. The build needs a C compiler and the Python headers.

Cores cimport each other by their installed names (`from tokenbroker.common._zmq cimport ...`,
`from tokenbroker.broker._jobs cimport JobTable`). Cython finds a `.pxd` by its dotted name under an
include path, and a cimported cdef class or function is imported at run time by that same name; the
package-dir mapping (pyproject.toml: broker/ is installed as tokenbroker.broker) means no source
directory has that shape. So the build gives Cython one: build/cython/tokenbroker/, whose
`broker`, `common` and `workers` are links to the source folders, and whose own `.pxd` files are
links to src/tokenbroker's.
"""

import os
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent

# (module, source): the package-dir mapping of pyproject.toml, applied by hand (Extension needs paths).
CORES = [
    ("tokenbroker.common._wire", "common/_wire.pyx"),
    ("tokenbroker.common._message", "common/_message.pyx"),
    # the broker's cores, one per concern (their .pxd files say what each shares)
    ("tokenbroker.broker._peek", "broker/_peek.pyx"),
    ("tokenbroker.broker._routekey", "broker/_routekey.pyx"),
    ("tokenbroker.broker._jobs", "broker/_jobs.pyx"),
    ("tokenbroker.broker._batches", "broker/_batches.pyx"),
    ("tokenbroker.broker._router", "broker/_router.pyx"),
    ("tokenbroker.broker._dispatch", "broker/_dispatch.pyx"),
    ("tokenbroker.broker._counters", "broker/_counters.pyx"),
    ("tokenbroker.broker._buffers", "broker/_buffers.pyx"),
    ("tokenbroker.broker._outbox", "broker/_outbox.pyx"),
    ("tokenbroker.broker._intake", "broker/_intake.pyx"),
    ("tokenbroker.broker._frontend", "broker/_frontend.pyx"),
    ("tokenbroker.broker._plane", "broker/_plane.pyx"),
    ("tokenbroker.workers._core", "workers/_core.pyx"),
    ("tokenbroker.workers._round", "workers/_round.pyx"),
    ("tokenbroker.workers.cache._cache", "workers/cache/_cache.pyx"),
    ("tokenbroker._packer", "src/tokenbroker/_packer.pyx"),
    ("tokenbroker._calls", "src/tokenbroker/_calls.pyx"),
    ("tokenbroker._frames", "src/tokenbroker/_frames.pyx"),
    ("tokenbroker._replies", "src/tokenbroker/_replies.pyx"),
]

# Where each installed package's sources are (pyproject.toml's [tool.setuptools.package-dir]).
PACKAGE_DIRS = {"broker": ROOT / "broker", "common": ROOT / "common", "workers": ROOT / "workers"}


def include_tree() -> str:
    """build/cython/tokenbroker/: the source folders under their installed names, for cimport."""
    top = ROOT / "build" / "cython" / "tokenbroker"
    top.mkdir(parents=True, exist_ok=True)
    (top / "__init__.pxd").touch()
    links = dict(PACKAGE_DIRS)
    links.update({pxd.name: pxd for pxd in (ROOT / "src" / "tokenbroker").glob("*.pxd")})
    for name, target in links.items():
        link = top / name
        if link.is_symlink() and os.readlink(link) == str(target):
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target, target_is_directory=target.is_dir())
    return str(top.parent)


setup(
    ext_modules=cythonize(
        [Extension(name, [source], extra_compile_args=["-O2"]) for name, source in CORES],
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False},
        include_path=[include_tree()],
    ),
)
