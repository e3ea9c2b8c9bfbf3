"""The `tokenbroker` command: serve, worker, and a client for people (tokenize, detokenize, models,
add-model, remove-model).

The client commands share their exit codes, so a script can tell "the broker said no" from "no
broker answered": 0 ok, 1 an error reply (the code and message on standard error; with `--json`
the reply itself on standard output, as `tokenize` and `detokenize` always print it), 2 no reply
within `--timeout` (for `add-model --wait`, also: still loading when `--timeout` ran out). A local mistake (a `--chat-template` file that cannot be read, a CURVE key
file that is not one) is 1 too, with argparse's own 2 for a malformed command line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from tokenbroker.broker.config import add_serve_flags, broker_config_from_args
from tokenbroker.common.config import DEFAULT_FRONTEND
from tokenbroker.workers.config import add_worker_flags, worker_config_from_args

T = TypeVar("T")
FINGERPRINT_CHARS = 12  # enough to tell models apart in a table; `--json` has the whole digest
WAIT_POLL_S = 0.2  # `add-model --wait`: how often to ask `models` how the load is going


def _client_parser(sub: argparse._SubParsersAction, name: str, help: str, *,
                   model: bool = True) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help)
    p.add_argument("--endpoint", default=DEFAULT_FRONTEND, help="the broker's frontend")
    if model:
        p.add_argument("--model", default=None)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the reply (sent as deadline_ms)")
    p.add_argument("--curve-server-key", metavar="FILE", default=None,
                   help="the broker's public .key: speak CURVE to it (a fresh key pair unless --curve-secret-key)")
    p.add_argument("--curve-secret-key", metavar="FILE", default=None,
                   help="this client's .key_secret (one listed in the broker's --curve-clients or --curve-admins)")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenbroker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_flags(sub.add_parser("serve", help="run the broker and its local workers"))
    add_worker_flags(sub.add_parser("worker", help="run one worker that joins a broker's backend"))
    p = _client_parser(sub, "tokenize", "print the token ids of TEXT as JSON")
    p.add_argument("text")
    p.add_argument("--no-special-tokens", action="store_true", help="add_special_tokens=false")
    _add_token_in_flags(p)
    p = _client_parser(sub, "detokenize", "print the text of token IDs as JSON")
    p.add_argument("ids", nargs="+", type=int)
    p.add_argument("--keep-special-tokens", action="store_true", help="skip_special_tokens=false")
    p = _client_parser(sub, "models", "print the broker's model catalog as a table", model=False)
    p.add_argument("--json", action="store_true", help="print the reply map as it came, as JSON")
    p = _client_parser(sub, "add-model", "add a model to the broker's catalog (admin op)", model=False)
    p.add_argument("name", metavar="NAME", help="the name requests give as `model`")
    p.add_argument("source", metavar="SOURCE", help="any model form of --model: a folder, a tokenizer.json, a "
                   ".tiktoken file, a Hub id, a tiktoken encoding or an OpenAI model name")
    p.add_argument("--alias", action="append", default=[], metavar="A", help="another name it answers to (repeat)")
    p.add_argument("--chat-template", metavar="FILE", default=None, help="a chat template file; its text is sent")
    p.add_argument("--wait", action="store_true",
                   help="wait (within --timeout) until the load is done; exit 1 if it failed")
    p.add_argument("--json", action="store_true", help="print the reply map as it came, as JSON")
    p = _client_parser(sub, "remove-model", "remove a model from the broker's catalog (admin op)", model=False)
    p.add_argument("name", metavar="NAME")
    p.add_argument("--json", action="store_true", help="print the reply map as it came, as JSON")
    from tokenbroker.top import add_top_parser

    add_top_parser(sub)
    from tokenbroker.keys import add_keys_parser

    add_keys_parser(sub)
    return parser


def _add_token_in_flags(p: argparse.ArgumentParser) -> None:
    """tokenize's contract 1.2 options (docs/protocol.md "tokenize and chat options")."""
    g = p.add_argument_group("offsets, token strings, truncation, KV block hashes")
    g.add_argument("--offsets", action="store_true", help="return_offsets: [start, end) in code points per id")
    g.add_argument("--token-strs", action="store_true", help="return_token_strs: each id's vocabulary entry "
                   "(hex bytes for tiktoken encodings)")
    g.add_argument("--truncate", type=int, metavar="N", default=None, help="truncate_prompt_tokens: keep at most N ids")
    g.add_argument("--truncation-side", choices=("left", "right"), default=None,
                   help="left (default) keeps the last ids, right the first")
    g.add_argument("--block-size", type=int, metavar="B", default=None,
                   help="block_hashes: vLLM's prefix-cache block hashes with this block size (needs --seed); "
                   "printed as one hex digest per block and their 64-bit forms")
    g.add_argument("--seed", metavar="S", default=None, help="block_hashes: the engine's PYTHONHASHSEED")
    g.add_argument("--lora-name", default=None, help="block_hashes: the request's LoRA adapter name")
    g.add_argument("--cache-salt", default=None, help="block_hashes: the request's cache salt")


def _token_in_fields(args: argparse.Namespace, parser_error: Callable[[str], Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {"return_offsets": args.offsets or None, "return_token_strs": args.token_strs or None,
                              "truncate_prompt_tokens": args.truncate, "truncation_side": args.truncation_side}
    if (args.block_size is None) != (args.seed is None):
        parser_error("--block-size and --seed go together (vLLM's block size and its PYTHONHASHSEED)")
    if args.block_size is not None:
        spec = {"block_size": args.block_size, "seed": args.seed, "lora_name": args.lora_name,
                "cache_salt": args.cache_salt}
        fields["block_hashes"] = {k: v for k, v in spec.items() if v is not None}
    return fields


def _split_block_hashes(reply: dict) -> dict:
    """A reply's `block_hashes` bin as one hex digest per block, with `block_hashes_int64` beside it."""
    raw = reply.get("block_hashes")
    if isinstance(raw, bytes):
        from tokenbroker.client import BlockHashes

        hashes = BlockHashes(raw)
        reply = {**reply, "block_hashes": [d.hex() for d in hashes], "block_hashes_int64": hashes.ints()}
    return reply


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _client(args: argparse.Namespace):
    """The public client with the command's endpoint, timeout and CURVE keys (errors name the option)."""
    from tokenbroker.client import Client

    return Client(args.endpoint, timeout=args.timeout, curve_server_key=args.curve_server_key,
                  curve_secret_key=args.curve_secret_key)


def _no_reply(args: argparse.Namespace) -> int:
    print(f"tokenbroker: no reply within {args.timeout}s from {args.endpoint}", file=sys.stderr)
    return 2


def _call(args: argparse.Namespace, op: str, **fields: Any) -> int:
    """One call through the public client; prints the reply map as it came (ok or not) as JSON
    (block hashes split per block, see `_split_block_hashes`)."""
    from tokenbroker.client import Unavailable

    fields = {k: v for k, v in {"model": getattr(args, "model", None), **fields}.items() if v is not None}
    try:
        with _client(args) as client:
            reply = client.request(op, fields)
    except Unavailable:
        return _no_reply(args)
    except (ValueError, RuntimeError) as e:  # a CURVE key option that is not a usable key
        print(f"tokenbroker: {e}", file=sys.stderr)
        return 1
    print(json.dumps(_jsonable(_split_block_hashes(reply)), ensure_ascii=False))
    return 0 if reply.get("ok") else 1


def _typed(args: argparse.Namespace, call: Callable[[Any], T]) -> tuple[int, T | None]:
    """`call(client)` through a typed client method: (0, result), or the exit code with stderr said."""
    from tokenbroker.client import TokenbrokerError, Unavailable

    try:
        with _client(args) as client:
            return 0, call(client)
    except Unavailable:
        return _no_reply(args), None
    except TokenbrokerError as e:
        print(f"tokenbroker: {args.command}: {e.code}: {e.message}", file=sys.stderr)
        return 1, None
    except (ValueError, RuntimeError) as e:
        print(f"tokenbroker: {e}", file=sys.stderr)
        return 1, None


# --- models ----------------------------------------------------------------------------------


def _one_line(text: str) -> str:
    """A loader's message can span lines (a traceback's tail); the table keeps each model's rows together."""
    return " ".join(text.split())


def models_table(models: Sequence[Any]) -> str:
    """The catalog as a table for people: one row per model, a failed model's error on the next line.

    `models` are `ModelInfo`s. Fields a version 1 broker does not send (`state`, `workers`,
    `fingerprint`) show as "-". The special tokens are left out: hundreds of them for some models.

    >>> from tokenbroker.client import ModelInfo
    >>> print(models_table([ModelInfo("qwen", (), "tiktoken", 151851, ("<|im_start|>",), True, False,
    ...                               "2a0089303d23e00e3a9bc325", "ready", None, 2),
    ...                     ModelInfo("broken", (), "", 0, (), False, False, None, "failed", "no such file", 0)]))
    NAME    STATE   WORKERS   VOCAB  TEMPLATE  FINGERPRINT
    qwen    ready         2  151851  yes       2a0089303d23
    broken  failed        0       0  no        -
      error: no such file
    """
    header = ("NAME", "STATE", "WORKERS", "VOCAB", "TEMPLATE", "FINGERPRINT")
    rows = [(m.name, m.state or "-", "-" if m.workers is None else str(m.workers), str(m.vocab_size),
             "yes" if m.chat_template else "no", (m.fingerprint or "-")[:FINGERPRINT_CHARS]) for m in models]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    right = {2, 3}  # numbers (and their headings) line up on their last digit

    def line(row: Sequence[str]) -> str:
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    out = [line(header)]
    for m, row in zip(models, rows):
        out.append(line(row))
        if m.error:
            out.append(f"  error: {_one_line(m.error)}")
    return "\n".join(out)


def _models(args: argparse.Namespace) -> int:
    if args.json:
        return _call(args, "models")
    code, models = _typed(args, lambda c: c.models())
    if models is not None:  # code 0
        print(models_table(models))
    return code


# --- add-model, remove-model -----------------------------------------------------------------


def _state_of(client: Any, name: str) -> Any:
    """The catalog's entry for `name` (by name or alias), or None."""
    return next((m for m in client.models() if name == m.name or name in m.aliases), None)


def _wait_loaded(client: Any, name: str, deadline: float) -> Any:
    """Poll `models` until the model leaves "loading" (or the deadline passes): its last entry."""
    while True:
        entry = _state_of(client, name)
        if entry is None or entry.state != "loading" or time.monotonic() >= deadline:
            return entry
        time.sleep(WAIT_POLL_S)


def _add_model(args: argparse.Namespace) -> int:
    template = None
    if args.chat_template is not None:
        try:
            template = Path(args.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            print(f"tokenbroker: add-model: --chat-template {args.chat_template}: cannot read it: {e}", file=sys.stderr)
            return 1
    fields: dict[str, Any] = {"name": args.name, "source": args.source, "aliases": list(args.alias)}
    if template is not None:
        fields["chat_template"] = template
    if args.json:
        return _call(args, "add_model", **fields)
    deadline = time.monotonic() + args.timeout

    def add(client: Any) -> tuple[str, Any]:
        state = client.add_model(args.name, args.source, aliases=args.alias, chat_template=template).state
        if not args.wait or state != "loading":
            return state, None
        left = max(0.001, deadline - time.monotonic())
        return state, _wait_loaded(client, args.name, time.monotonic() + left)

    code, result = _typed(args, add)
    if code != 0:
        return code
    state, entry = result  # type: ignore[misc]
    if entry is None:
        print(f"{args.name}: {state}")
        return 0
    if entry.state == "failed":
        print(f"tokenbroker: add-model: {args.name} failed to load: {_one_line(entry.error or '')}", file=sys.stderr)
        return 1
    if entry.state == "loading":
        print(f"tokenbroker: add-model: {args.name} still loading after {args.timeout}s", file=sys.stderr)
        return 2
    print(f"{args.name}: {entry.state}")
    return 0


def _remove_model(args: argparse.Namespace) -> int:
    if args.json:
        return _call(args, "remove_model", name=args.name)
    code, _ = _typed(args, lambda c: c.remove_model(args.name))
    if code == 0:
        print(f"{args.name}: removed")
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        from tokenbroker.broker.main import serve

        return serve(broker_config_from_args(args))
    if args.command == "worker":
        from tokenbroker.workers.main import serve as serve_worker

        return serve_worker(worker_config_from_args(args))
    if args.command == "tokenize":
        return _call(args, "tokenize", text=args.text, add_special_tokens=not args.no_special_tokens,
                     **_token_in_fields(args, parser.error))
    if args.command == "detokenize":
        return _call(args, "detokenize", tokens=args.ids, skip_special_tokens=not args.keep_special_tokens)
    if args.command == "models":
        return _models(args)
    if args.command == "add-model":
        return _add_model(args)
    if args.command == "remove-model":
        return _remove_model(args)
    if args.command == "top":
        from tokenbroker.top import run_top

        return run_top(args)
    if args.command == "keys":
        from tokenbroker.keys import run_keys

        return run_keys(args)
    raise AssertionError(args.command)
