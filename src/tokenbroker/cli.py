"""The `tokenbroker` command: serve, worker, and a client for people (tokenize, detokenize, models)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from tokenbroker.broker.config import add_serve_flags, broker_config_from_args
from tokenbroker.workers.config import add_worker_flags, worker_config_from_args


def _client_parser(sub: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help)
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5555", help="the broker's frontend")
    p.add_argument("--model", default=None)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the reply (sent as deadline_ms)")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenbroker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_flags(sub.add_parser("serve", help="run the broker and its local workers"))
    add_worker_flags(sub.add_parser("worker", help="run one worker that joins a broker's backend"))
    p = _client_parser(sub, "tokenize", "print the token ids of TEXT as JSON")
    p.add_argument("text")
    p.add_argument("--no-special-tokens", action="store_true", help="add_special_tokens=false")
    p = _client_parser(sub, "detokenize", "print the text of token IDs as JSON")
    p.add_argument("ids", nargs="+", type=int)
    p.add_argument("--keep-special-tokens", action="store_true", help="skip_special_tokens=false")
    _client_parser(sub, "models", "print the models the broker serves as JSON")
    from tokenbroker.top import add_top_parser

    add_top_parser(sub)
    from tokenbroker.keys import add_keys_parser

    add_keys_parser(sub)
    return parser


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _call(args: argparse.Namespace, op: str, **fields: Any) -> int:
    """One call through the public client; prints the reply map as it came (ok or not) as JSON."""
    from tokenbroker.client import Client, Unavailable

    fields = {k: v for k, v in {"model": args.model, **fields}.items() if v is not None}
    with Client(args.endpoint, timeout=args.timeout) as client:
        try:
            reply = client.request(op, fields)
        except Unavailable:
            print(f"tokenbroker: no reply within {args.timeout}s from {args.endpoint}", file=sys.stderr)
            return 2
    print(json.dumps(_jsonable(reply), ensure_ascii=False))
    return 0 if reply.get("ok") else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from tokenbroker.broker.main import serve

        return serve(broker_config_from_args(args))
    if args.command == "worker":
        from tokenbroker.workers.main import serve as serve_worker

        return serve_worker(worker_config_from_args(args))
    if args.command == "tokenize":
        return _call(args, "tokenize", text=args.text, add_special_tokens=not args.no_special_tokens)
    if args.command == "detokenize":
        return _call(args, "detokenize", tokens=args.ids, skip_special_tokens=not args.keep_special_tokens)
    if args.command == "models":
        return _call(args, "models")
    if args.command == "top":
        from tokenbroker.top import run_top

        return run_top(args)
    if args.command == "keys":
        from tokenbroker.keys import run_keys

        return run_keys(args)
    raise AssertionError(args.command)
