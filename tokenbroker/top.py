"""`tokenbroker top`: a live terminal view of a broker's exporter (being written; see issue 7)."""

from __future__ import annotations

import argparse


def add_top_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("top", help="tail a broker's metrics exporter")
    p.add_argument("--url", default="http://127.0.0.1:9464/metrics")
    p.add_argument("--once", action="store_true", help="print one frame and exit")


def run_top(args: argparse.Namespace) -> int:
    raise SystemExit("tokenbroker top: not available yet")
