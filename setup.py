"""The compiled cores, built by setuptools at `pip install` (Cython from the build requirements).

Everything else about the package is in pyproject.toml; this file only lists the extension modules,
each beside the Python policy it serves. The build needs a C compiler and the Python headers.
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

# (module, source): the package-dir mapping of pyproject.toml, applied by hand (Extension needs paths).
CORES = [
    ("tokenbroker.common._wire", "common/_wire.pyx"),
    ("tokenbroker.broker._core", "broker/_core.pyx"),
    ("tokenbroker.workers._core", "workers/_core.pyx"),
    ("tokenbroker.workers.cache._cache", "workers/cache/_cache.pyx"),
    ("tokenbroker._codec", "src/tokenbroker/_codec.pyx"),
]

setup(
    ext_modules=cythonize(
        [Extension(name, [source], extra_compile_args=["-O2"]) for name, source in CORES],
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False},
        include_path=["."],
    ),
)
