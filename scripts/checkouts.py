"""Running a benchmark's measurement against another checkout's code, in a child process, so a
before/after comparison is one command (`--baseline DIR` of scripts/bench_client and
scripts/bench_overhead).

A side is a checkout and the interpreter that imports `tokenbroker` from it:

- a checkout with its own venv (`DIR/.venv`, made by `bash scripts/test --co -q` there) runs on that
  interpreter: its editable install maps `tokenbroker` to DIR, with the compiled cores its own
  `pip install` built, so everything the child starts (`python -m tokenbroker serve`, the broker's
  forked workers) runs DIR's code;
- a checkout without one runs on this interpreter with a tree of links on PYTHONPATH that lays DIR
  out as pyproject's package-dir does (src/tokenbroker, with broker/, workers/ and common/ as its
  subpackages). Links cannot hold compiled modules, so a checkout with `.pyx` cores needs its venv.

The child is the same benchmark script (this checkout's measuring code, only the package differs);
it prints one JSON object as its last line of output, with `tokenbroker_from` (see `where_from`),
which `run_json` checks lies inside the checkout, so a wrong import never passes as a result.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def link_tree(checkout: Path) -> Path:
    """A directory whose `tokenbroker` package is `checkout`'s, made of links (see the module doc)."""
    checkout = checkout.resolve()
    top = Path(tempfile.gettempdir()) / f"tb-checkout-{hashlib.sha1(str(checkout).encode()).hexdigest()[:12]}"
    pkg = top / "tokenbroker"
    pkg.mkdir(parents=True, exist_ok=True)
    links = {e.name: e for e in (checkout / "src" / "tokenbroker").iterdir()}
    links.update({name: checkout / name for name in ("broker", "workers", "common")})
    for name, target in links.items():
        link = pkg / name
        if not link.is_symlink():
            link.symlink_to(target)
    return top


@dataclass
class Side:
    """One checkout and how to start a Python that imports `tokenbroker` from it."""

    checkout: Path
    label: str
    python: str
    env: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        head = subprocess.run(["git", "-C", str(self.checkout), "log", "-1", "--format=%h %s"],
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(self.checkout), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return f"{self.label}: {self.checkout} at {head[:70]}{' (+ uncommitted changes)' if dirty else ''}"


def side(checkout: Path, label: str) -> Side:
    checkout = checkout.resolve()
    if not (checkout / "broker").is_dir() or not (checkout / "src" / "tokenbroker").is_dir():
        raise SystemExit(f"{checkout} is not a tokenbroker checkout")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    venv_python = checkout / ".venv" / "bin" / "python"
    if venv_python.exists():
        return Side(checkout, label, str(venv_python), env)
    cores = [p for d in ("broker", "workers", "common") for p in (checkout / d).rglob("*.pyx")]
    if cores:
        raise SystemExit(f"{checkout} has compiled cores ({cores[0].relative_to(checkout)}) and no venv:"
                         f" run `bash scripts/test --co -q` there once, then again here")
    env["PYTHONPATH"] = str(link_tree(checkout))
    return Side(checkout, label, sys.executable, env)


def where_from() -> str:
    """For a child's JSON: the real path of the `tokenbroker` it imported."""
    import tokenbroker

    return str(Path(tokenbroker.__file__).resolve().parent)


def run_json(s: Side, script: Path, args: list[str], timeout: float = 900.0) -> dict:
    """`script args` on side `s`; its last line of output, parsed, after checking where its
    `tokenbroker` came from."""
    done = subprocess.run([s.python, str(script), *args], env=s.env, capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{script.name} on {s.label} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    got = json.loads(lines[-1])
    origin = Path(got.get("tokenbroker_from", "/"))
    if not origin.is_relative_to(s.checkout):
        raise SystemExit(f"{script.name} on {s.label} imported tokenbroker from {origin}, not from {s.checkout}")
    return got
