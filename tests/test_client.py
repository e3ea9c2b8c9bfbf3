"""The client's pure parts: errors per protocol code, ids on the wire, the stream helper's requests and
state carrying (against docs/protocol.md, "Streaming detokenization"), and the CURVE key options.

Behaviour against real brokers is in test_client_e2e.py.
"""

from __future__ import annotations

import re
from array import array
from pathlib import Path

import pytest
import zmq
import zmq.auth
from hypothesis import given
from hypothesis import strategies as st

import tokenbroker
from tokenbroker._client_errors import ERRORS, error_from_reply
from tokenbroker._client_keys import curve_keys
from tokenbroker._client_results import ids_from_wire, ids_to_wire
from tokenbroker._client_stream import StreamBook

PROTOCOL = Path(__file__).parent.parent / "docs" / "protocol.md"


def contract_error_codes() -> list[str]:
    """The codes of the contract's error table (the rows after `| code | when |`)."""
    text = PROTOCOL.read_text()
    table = text[text.index("| code | when |"):]
    return re.findall(r"^\| `([a-z_]+)`(?: \(\d\.\d\))? \|", table.split("\n\n")[0], flags=re.M)


# --- errors --------------------------------------------------------------------------------


def test_every_error_code_of_the_contract_has_its_own_exception_carrying_the_code():
    codes = contract_error_codes()
    assert "bad_request" in codes and "forbidden" in codes and len(codes) == 11
    for code in codes:
        exc = error_from_reply({"id": 1, "ok": False, "error": {"code": code, "message": f"what {code}"}})
        assert type(exc) is ERRORS[code] and type(exc) is not tokenbroker.TokenbrokerError
        assert isinstance(exc, tokenbroker.TokenbrokerError)
        assert (exc.code, exc.message) == (code, f"what {code}")
        assert getattr(tokenbroker, type(exc).__name__) is type(exc)  # public
    assert {type(e).__name__ for e in (tokenbroker.Overloaded("overloaded", ""),)} == {"Overloaded"}


def test_an_error_code_the_client_does_not_know_becomes_the_base_class():
    exc = error_from_reply({"ok": False, "error": {"code": "from_the_future", "message": "m"}})
    assert type(exc) is tokenbroker.TokenbrokerError and exc.code == "from_the_future"


def test_the_client_side_unavailable_error_is_a_tokenbroker_error():
    assert issubclass(tokenbroker.Unavailable, tokenbroker.TokenbrokerError)
    assert tokenbroker.Unavailable not in [ERRORS[c] for c in contract_error_codes()]


# --- ids -----------------------------------------------------------------------------------


@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200))
def test_ids_round_trip_through_u32_as_array_or_list(ids):
    wire = ids_to_wire(array("I", ids))
    assert isinstance(wire, bytes) and len(wire) == 4 * len(ids)
    assert wire == b"".join(i.to_bytes(4, "little") for i in ids)  # little-endian, whatever the host
    assert ids_from_wire(wire, "array") == array("I", ids)
    assert ids_from_wire(wire, "list") == ids
    assert ids_from_wire(ids, "list") == ids and ids_from_wire(ids, "array") == array("I", ids)
    assert ids_to_wire(ids) == ids and ids_to_wire(tuple(ids)) == ids


# --- the stream helper ---------------------------------------------------------------------


def test_first_step_carries_the_options_and_later_steps_only_the_state():
    book: StreamBook[str] = StreamBook()
    book.open("a", prompt_tokens=[1, 2, 3], stop=["\n\n"], stop_token_ids=[7], skip_special_tokens=False,
              include_stop_str_in_output=True)
    book.open("b")
    keys, seqs = book.build({"a": [10, 11], "b": array("I", [12])})
    assert keys == ["a", "b"]
    assert seqs[0] == {"tokens": [10, 11], "prompt_tokens": [1, 2, 3], "stop": ["\n\n"], "stop_token_ids": [7],
                       "skip_special_tokens": False, "include_stop_str_in_output": True}
    assert seqs[1] == {"tokens": (12).to_bytes(4, "little")}  # defaults are left to the service
    deltas = book.absorb(keys, [{"text": "He", "state": b"sa1", "finished": None, "stop": None},
                                {"text": "", "state": b"sb1", "finished": None, "stop": None}])
    assert deltas["a"] == tokenbroker.StreamDelta("He", None, None) and deltas["b"].text == ""
    keys, seqs = book.build({"a": [13], "b": []})
    assert seqs == [{"tokens": [13], "state": b"sa1"}, {"tokens": [], "state": b"sb1"}]


def test_one_request_holds_only_the_sequences_stepped_and_the_final_ones():
    book: StreamBook[int] = StreamBook()
    for k in range(4):
        book.open(k)
    keys, seqs = book.build({2: [5], 0: [6]}, final=[3, 0])
    assert keys == [2, 0, 3]  # the stepped ones in the caller's order, then finals without ids
    assert [s.get("final", False) for s in seqs] == [False, True, True]
    assert seqs[2]["tokens"] == []
    assert book.build({}) == ([], [])


def test_finished_sequences_are_dropped_and_others_keep_their_new_state():
    book: StreamBook[str] = StreamBook()
    for k in "abc":
        book.open(k, stop=["."])
    keys, _ = book.build({"a": [1], "b": [2], "c": [3]}, final=["c"])
    deltas = book.absorb(keys, [
        {"text": "x", "state": None, "finished": "stop", "stop": "."},
        {"text": "y", "state": b"sb", "finished": None, "stop": None},
        {"text": "z", "state": None, "finished": "final", "stop": None},
    ])
    assert (deltas["a"].finished, deltas["a"].stop) == ("stop", ".")
    assert deltas["c"].finished == "final"
    assert book.keys() == ["b"] and len(book) == 1 and "a" not in book
    with pytest.raises(KeyError, match="'a' is not open"):
        book.build({"a": [1]})
    assert book.build({"b": [4]})[1] == [{"tokens": [4], "state": b"sb"}]


def test_a_failed_step_leaves_every_state_so_the_same_step_can_be_sent_again():
    book: StreamBook[str] = StreamBook()
    book.open("a", stop=["!"])
    first = book.build({"a": [1]})
    again = book.build({"a": [1]})  # nothing absorbed: the first step failed
    assert first == again and again[1][0]["stop"] == ["!"]
    book.absorb(*first[:1], [{"text": "t", "state": b"s1", "finished": None, "stop": None}])
    assert book.build({"a": [2]}) == book.build({"a": [2]}) == (["a"], [{"tokens": [2], "state": b"s1"}])


def test_stream_misuse_is_refused_with_the_sequence_named():
    book: StreamBook[str] = StreamBook()
    book.open("a")
    with pytest.raises(ValueError, match="'a' is already open"):
        book.open("a")
    with pytest.raises(TypeError, match="list of str"):
        book.open("b", stop="\n")
    keys, _ = book.build({"a": [1]})
    with pytest.raises(tokenbroker.Internal, match="1 sent"):
        book.absorb(keys, [])
    with pytest.raises(tokenbroker.Internal, match="without a state"):
        book.absorb(keys, [{"text": "", "state": None, "finished": None, "stop": None}])
    book.close("a")
    assert len(book) == 0


# --- CURVE options ---------------------------------------------------------------------------


@pytest.fixture
def certs(tmp_path):
    server_pub, server_sec = zmq.auth.create_certificates(tmp_path, "broker")
    client_pub, client_sec = zmq.auth.create_certificates(tmp_path, "client")
    return {"server": Path(server_pub), "server_secret": Path(server_sec),
            "client": Path(client_pub), "client_secret": Path(client_sec)}


def test_curve_key_files_set_the_socket_options(certs):
    keys = curve_keys(certs["server"], certs["client_secret"])
    server_public, _ = zmq.auth.load_certificate(certs["server"])
    public, secret = zmq.auth.load_certificate(certs["client_secret"])
    assert (keys.server_public, keys.public, keys.secret) == (server_public, public, secret)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        keys.apply(sock)
        assert sock.mechanism == zmq.CURVE and not sock.curve_server  # the keys are write-only in pyzmq:
        # test_client_e2e.py shows they are the right ones by a real CURVE handshake
    finally:
        sock.close(linger=0)


def test_curve_z85_keys_and_a_made_up_pair_without_a_secret(certs):
    server_public, _ = zmq.auth.load_certificate(certs["server"])
    public, secret = zmq.curve_keypair()
    keys = curve_keys(server_public, (public, secret))
    assert (keys.server_public, keys.public, keys.secret) == (server_public, public, secret)
    fresh = curve_keys(server_public, None)
    assert fresh.server_public == server_public and zmq.curve_public(fresh.secret) == fresh.public
    assert curve_keys(None, None) is None


@pytest.mark.parametrize("make, message", [
    (lambda c, tmp: dict(curve_server_key=tmp / "missing.key"), r"curve_server_key: no key file at .*missing\.key"),
    (lambda c, tmp: dict(curve_server_key=c["server"], curve_secret_key=c["client"]),
     r"curve_secret_key: .*client\.key holds no secret key: give the \.key_secret file"),
    (lambda c, tmp: dict(curve_server_key=b"short"), r"curve_server_key: not a z85-encoded 32-byte CURVE key"),
    (lambda c, tmp: dict(curve_secret_key=c["client_secret"]), r"curve_secret_key is given without curve_server_key"),
    (lambda c, tmp: dict(curve_server_key=c["server"],
                         curve_secret_key=(zmq.curve_keypair()[0], zmq.curve_keypair()[1])),
     r"the public key does not belong to the secret key"),
    (lambda c, tmp: dict(curve_server_key=tmp / "garbage.key"), r"curve_server_key: .*garbage\.key"),
], ids=["missing-file", "public-file-as-secret", "bad-z85", "secret-without-server", "mismatched-pair", "garbage-file"])
@pytest.mark.parametrize("cls", [tokenbroker.Client, tokenbroker.AsyncClient], ids=["sync", "async"])
def test_a_bad_curve_key_is_a_clear_error_when_the_client_is_built(cls, make, message, certs, tmp_path):
    (tmp_path / "garbage.key").write_text("this is not a certificate\n")
    with pytest.raises(ValueError, match=message):
        cls("tcp://127.0.0.1:1", **make(certs, tmp_path))


def test_client_options_are_checked_when_built():
    with pytest.raises(ValueError, match="timeout must be > 0"):
        tokenbroker.AsyncClient(timeout=0)
    with pytest.raises(ValueError, match="ids must be 'array' or 'list'"):
        tokenbroker.AsyncClient(ids="numpy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one broker endpoint"):
        tokenbroker.AsyncClient([])
    with pytest.raises(TypeError):
        tokenbroker.AsyncClient("tcp://127.0.0.1:1", 5.0)  # type: ignore[misc]  # options are keyword-only


def test_the_public_api_is_what_the_package_lists():
    assert set(tokenbroker.__all__) == set(tokenbroker.client.__all__) - {"DEFAULT_ENDPOINT"}
    for name in tokenbroker.__all__:
        assert not name.startswith("_") and getattr(tokenbroker, name) is getattr(tokenbroker.client, name)
