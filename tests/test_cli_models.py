"""`tokenbroker models`, `add-model` and `remove-model`: the real CLI in a subprocess against a real broker.

The table is checked against the same broker's raw `models` reply (what any client sees), field by
field; the admin commands are checked by what the broker does afterwards (the catalog lists the
model, requests by its alias get the ids its own tokenizer gives, it leaves the catalog), never by
the command's own word alone. The admin ops are served by the broker's catalog (protocol 1.1);
against a broker that passes them to a worker they are `unknown_op`, and those tests fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BERT_DIR, FIXTURES, QWEN_TIKTOKEN, Conn, serving, start_broker, wait_until

QWEN_TEMPLATE = FIXTURES / "chat_templates" / "qwen3.jinja"
CLI_TIMEOUT_S = 120


def cli(*args: str, endpoint: str | None = None, timeout: str = "60") -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "tokenbroker", *args, "--timeout", timeout]
    if endpoint is not None:
        argv += ["--endpoint", endpoint]
    return subprocess.run(argv, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)


def table_rows(stdout: str) -> tuple[list[str], dict[str, list[str]], dict[str, str]]:
    """The table's header, its rows by model name, and the error lines by the model they follow."""
    lines = stdout.rstrip("\n").split("\n")
    header = lines[0].split()
    rows: dict[str, list[str]] = {}
    errors: dict[str, str] = {}
    last = None
    for line in lines[1:]:
        if line.startswith("  error: "):
            assert last is not None, stdout
            errors[last] = line[len("  error: "):]
            continue
        cells = line.split()
        assert len(cells) == len(header), f"row {line!r} has not the header's {len(header)} cells"
        rows[cells[0]] = cells
        last = cells[0]
    return header, rows, errors


def expected_row(m: dict) -> list[str]:
    """What the table must show for one map of the raw reply ("-" for a field a version 1 broker omits)."""
    return [m["name"], m.get("state") or "-", "-" if m.get("workers") is None else str(m["workers"]),
            str(m["vocab_size"]), "yes" if m["chat_template"] else "no", (m.get("fingerprint") or "-")[:12]]


@pytest.fixture(scope="module")
def catalog():
    """Three real tokenizers of three kinds, one with a chat template, two workers."""
    with serving("--model-path", str(BERT_DIR), "--served-model-name", "bert",
                 "--model", f"qwen={QWEN_TIKTOKEN}", "--model-chat-template", f"qwen={QWEN_TEMPLATE}",
                 "--model", "o200k=o200k_base", workers=2) as (broker, conn):
        yield broker, conn


def test_models_prints_one_row_per_model_with_the_replys_fields(catalog):
    broker, conn = catalog
    raw = conn.call("models")
    assert raw["ok"], raw
    out = cli("models", endpoint=broker.endpoint)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    header, rows, errors = table_rows(out.stdout)
    assert header == ["NAME", "STATE", "WORKERS", "VOCAB", "TEMPLATE", "FINGERPRINT"]
    assert list(rows) == [m["name"] for m in raw["models"]]
    for m in raw["models"]:
        assert rows[m["name"]] == expected_row(m)
        assert len(m["fingerprint"]) == 64 and len(rows[m["name"]][5]) == 12
    assert rows["qwen"][4] == "yes" and rows["bert"][4] == "no"
    assert rows["o200k"][3] == "200019" and rows["bert"][3] == "30522"
    assert errors == {}


def test_models_never_prints_the_special_tokens(catalog):
    broker, conn = catalog
    specials = {t for m in conn.call("models")["models"] for t in m["special_tokens"]}
    assert {"[CLS]", "<|endoftext|>", "<|im_start|>"} <= specials
    out = cli("models", endpoint=broker.endpoint)
    assert out.returncode == 0
    assert not [t for t in specials if t in out.stdout]


def test_models_json_prints_the_reply_as_it_came(catalog):
    broker, conn = catalog
    out = cli("models", "--json", endpoint=broker.endpoint)
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    raw = conn.call("models")
    assert printed["ok"] is True
    assert printed["models"] == raw["models"]  # special tokens and whole fingerprints included
    assert set(printed) == set(raw)


def test_models_without_a_broker_exits_2_and_says_so():
    out = cli("models", endpoint="tcp://127.0.0.1:1", timeout="0.3")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == "tokenbroker: no reply within 0.3s from tcp://127.0.0.1:1"


def test_add_model_with_an_unreadable_template_file_says_which_flag(tmp_path):
    """Checked before anything is sent: no broker is needed, and exit 1 (not 2: retrying will not help)."""
    missing = tmp_path / "nope.jinja"
    out = cli("add-model", "m", str(BERT_DIR), "--chat-template", str(missing), endpoint="tcp://127.0.0.1:1",
              timeout="0.3")
    assert out.returncode == 1 and out.stdout == ""
    assert f"--chat-template {missing}" in out.stderr


# --- the admin ops end to end (the broker's catalog serves them) -----------------------------


@pytest.fixture(scope="module")
def broker():
    """The embedded default tokenizer only, one worker; each test adds its own models (names of its own)."""
    b = start_broker(workers=1)
    yield b
    b.stop()


def catalog_entry(endpoint: str, name: str) -> dict | None:
    conn = Conn(endpoint)
    try:
        reply = conn.call("models")
    finally:
        conn.close()
    assert reply["ok"], reply
    return next((m for m in reply["models"] if m["name"] == name), None)


def test_add_model_then_models_then_remove_model(broker, tmp_path):
    """add-model loads a real tokenizer (with an alias and a template's text); requests by the alias get
    what that tokenizer gives; remove-model takes it out; removing it again is unknown_model."""
    from tokenizers import Tokenizer

    template = tmp_path / "t.jinja"
    template.write_text(QWEN_TEMPLATE.read_text(encoding="utf-8"), encoding="utf-8")
    added = cli("add-model", "bert-extra", str(BERT_DIR), "--alias", "be", "--alias", "be2",
                "--chat-template", str(template), "--wait", endpoint=broker.endpoint)
    assert added.returncode == 0, added.stderr
    assert added.stdout == "bert-extra: ready\n"

    entry = catalog_entry(broker.endpoint, "bert-extra")
    assert entry is not None and entry["state"] == "ready" and entry["chat_template"] is True
    assert set(entry["aliases"]) >= {"be", "be2"}
    _, rows, _ = table_rows(cli("models", endpoint=broker.endpoint).stdout)
    assert rows["bert-extra"] == expected_row(entry)

    conn = Conn(broker.endpoint)
    try:
        reply = conn.call("tokenize", model="be2", text="hello catalog world")
        assert reply["ok"], reply
        reference = Tokenizer.from_file(str(BERT_DIR / "tokenizer.json"))
        reference.no_padding()  # as the contract's "Token ids" says: the file's own padding and truncation off
        reference.no_truncation()
        want = reference.encode("hello catalog world").ids
        assert reply["tokens"] == want
    finally:
        conn.close()

    removed = cli("remove-model", "bert-extra", endpoint=broker.endpoint)
    assert removed.returncode == 0 and removed.stdout == "bert-extra: removed\n", removed.stderr
    assert catalog_entry(broker.endpoint, "bert-extra") is None
    again = cli("remove-model", "bert-extra", endpoint=broker.endpoint)
    assert again.returncode == 1 and again.stdout == ""
    assert again.stderr.startswith("tokenbroker: remove-model: unknown_model: ")


def test_a_source_that_fails_to_load_shows_failed_with_its_error(broker, tmp_path):
    """--wait exits 1 naming the failure; the table shows the model failed with the loader's message
    on its own line; requests for it are unknown_model with that message."""
    empty = tmp_path / "empty-model"
    empty.mkdir()
    out = cli("add-model", "hollow", str(empty), "--wait", endpoint=broker.endpoint)
    assert out.returncode == 1, out.stdout
    assert out.stderr.startswith("tokenbroker: add-model: hollow failed to load: ")

    entry = wait_until(lambda: catalog_entry(broker.endpoint, "hollow"), what="the failed model's entry")
    assert entry["state"] == "failed" and entry["error"]
    _, rows, errors = table_rows(cli("models", endpoint=broker.endpoint).stdout)
    assert rows["hollow"][1] == "failed"
    assert errors["hollow"] == " ".join(entry["error"].split())
    assert "hollow" not in errors.get(next(iter(rows)), "")

    conn = Conn(broker.endpoint)
    try:
        reply = conn.call("tokenize", model="hollow", text="x")
    finally:
        conn.close()
    assert reply["ok"] is False and reply["error"]["code"] == "unknown_model"


def test_the_same_name_with_another_source_is_a_bad_request(broker):
    first = cli("add-model", "twice", "o200k_base", "--wait", endpoint=broker.endpoint)
    assert first.returncode == 0, first.stderr
    second = cli("add-model", "twice", str(QWEN_TIKTOKEN), endpoint=broker.endpoint)
    assert second.returncode == 1 and second.stdout == ""
    assert second.stderr.startswith("tokenbroker: add-model: bad_request: ")
    json_out = cli("add-model", "twice", str(QWEN_TIKTOKEN), "--json", endpoint=broker.endpoint)
    reply = json.loads(json_out.stdout)
    assert json_out.returncode == 1 and reply["ok"] is False and reply["error"]["code"] == "bad_request"


def _keys(folder: Path, name: str) -> Path:
    out = subprocess.run([sys.executable, "-m", "tokenbroker", "keys", str(folder), name],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return folder / f"{name}.key_secret"


def test_under_curve_only_an_admin_key_may_add_or_remove(tmp_path):
    """A client key that is admitted but not in --curve-admins gets `forbidden` (exit 1, code on
    stderr), and the catalog is unchanged; an admin key adds and removes."""
    broker_secret = _keys(tmp_path / "broker", "broker")
    client_secret = _keys(tmp_path / "clients", "c1")
    admin_secret = _keys(tmp_path / "admins", "a1")
    server_key = str(tmp_path / "broker" / "broker.key")
    b = start_broker("--curve-secret-key", str(broker_secret), "--curve-clients", str(tmp_path / "clients"),
                     "--curve-admins", str(tmp_path / "admins"), workers=1)
    try:
        def run(*args: str, secret: Path) -> subprocess.CompletedProcess:
            return cli(*args, "--curve-server-key", server_key, "--curve-secret-key", str(secret),
                       endpoint=b.endpoint)

        listed = run("models", secret=client_secret)
        assert listed.returncode == 0, listed.stderr  # a client may read the catalog
        refused = run("add-model", "o2", "o200k_base", secret=client_secret)
        assert refused.returncode == 1 and refused.stdout == ""
        assert refused.stderr.startswith("tokenbroker: add-model: forbidden: ")
        _, rows, _ = table_rows(run("models", secret=client_secret).stdout)
        assert "o2" not in rows

        added = run("add-model", "o2", "o200k_base", "--wait", secret=admin_secret)
        assert added.returncode == 0 and added.stdout == "o2: ready\n", added.stderr
        refused = run("remove-model", "o2", secret=client_secret)
        assert refused.returncode == 1 and refused.stderr.startswith("tokenbroker: remove-model: forbidden: ")
        removed = run("remove-model", "o2", secret=admin_secret)
        assert removed.returncode == 0, removed.stderr
        _, rows, _ = table_rows(run("models", secret=client_secret).stdout)
        assert "o2" not in rows
    finally:
        b.stop()


# --- the table alone (a pure function: what it does with fields a broker may or may not send) -----


def test_a_version_1_reply_shows_dashes_for_the_fields_it_lacks():
    from tokenbroker.cli import models_table
    from tokenbroker.client import ModelInfo

    table = models_table([ModelInfo("old", ("default",), "tiktoken", 100277, ("<|endoftext|>",), False, True)])
    assert table.split("\n")[1].split() == ["old", "-", "-", "100277", "no", "-"]


def test_a_multi_line_error_stays_on_one_line_under_its_model():
    from tokenbroker.cli import models_table
    from tokenbroker.client import ModelInfo

    models = [ModelInfo("a-rather-long-model-name", (), "", 0, (), False, False, None, "failed",
                        "Traceback:\n  no tokenizer.json\n\tin /models/x", 0),
              ModelInfo("ok", (), "huggingface", 30522, (), True, False, "ab" * 32, "ready", None, 1)]
    lines = models_table(models).split("\n")
    assert lines[2] == "  error: Traceback: no tokenizer.json in /models/x"
    assert lines[3].split() == ["ok", "ready", "1", "30522", "yes", "ab" * 6]
    assert lines[0].index("STATE") == lines[1].index("failed") == lines[3].index("ready")  # columns line up
