"""Unit tests of the security plumbing: the bind check, key files, key folders, admission gates.

The behaviours (who gets served, who is refused, SIGHUP) run a real broker in test_security_e2e.py.
"""

from __future__ import annotations

import logging
import stat

import pytest
import zmq

from tokenbroker.broker.security import (
    BrokerSecurity,
    SecurityError,
    _Gate,
    check_config,
    is_local_endpoint,
    load_key_folder,
)
from tokenbroker.cli import main as cli_main
from tokenbroker.broker.config import BrokerConfig, CurveConfig
from tokenbroker.common.curve import CurveKeyError, apply_client_curve, load_client_keys, load_key_pair, load_public_key
from tokenbroker.keys import create_key_pair

# --- is_local_endpoint ---------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", [
    "tcp://127.0.0.1:5555", "tcp://127.0.0.1:*", "tcp://127.1.2.3:80", "tcp://localhost:5555",
    "tcp://LOCALHOST:1", "tcp://[::1]:5555", "tcp://[::1]:*", "ipc:///tmp/x/backend", "ipc://@abstract",
    "inproc://backend", "ws://127.0.0.1:8080/zmq",
], ids=lambda e: e)
def test_loopback_and_local_transports_count_as_local(endpoint):
    assert is_local_endpoint(endpoint)


@pytest.mark.parametrize("endpoint", [
    "tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://[::]:5555", "tcp://10.0.0.5:5555", "tcp://eth0:5555",
    "tcp://lo:5555", "tcp://example.com:5555", "tcp://127.0.0.1.evil.com:1", "tcp://[2001:db8::1]:1",
    "ws://0.0.0.0:8080/zmq", "pgm://eth0;239.192.1.1:5555",
], ids=lambda e: e)
def test_anything_else_is_reachable_from_elsewhere(endpoint):
    assert not is_local_endpoint(endpoint)


def test_an_endpoint_without_a_transport_is_an_error():
    with pytest.raises(SecurityError, match="not a ZeroMQ endpoint"):
        is_local_endpoint("127.0.0.1:5555")


# --- check_config --------------------------------------------------------------------------------


def test_non_loopback_frontend_without_curve_is_refused_naming_the_flag():
    with pytest.raises(SecurityError, match=r"frontend tcp://0\.0\.0\.0:5555 is not a loopback.*--curve-secret-key.*--insecure"):
        check_config("tcp://0.0.0.0:5555", None, CurveConfig())


def test_non_loopback_backend_without_curve_is_refused():
    with pytest.raises(SecurityError, match=r"backend tcp://\*:6000"):
        check_config("tcp://127.0.0.1:5555", "tcp://*:6000", CurveConfig())


def test_insecure_allows_any_address_and_loopback_needs_nothing():
    check_config("tcp://0.0.0.0:5555", "tcp://0.0.0.0:6000", CurveConfig(insecure=True))
    check_config("tcp://127.0.0.1:5555", "tcp://127.0.0.1:6000", CurveConfig())
    check_config("tcp://127.0.0.1:5555", None, CurveConfig())


def test_curve_allows_any_address_but_a_tcp_backend_needs_worker_keys():
    check_config("tcp://0.0.0.0:5555", None, CurveConfig(secret_key="b.key_secret"))
    check_config("tcp://0.0.0.0:5555", "ipc:///tmp/x", CurveConfig(secret_key="b.key_secret"))
    check_config("tcp://0.0.0.0:5555", "tcp://0.0.0.0:6000", CurveConfig(secret_key="b.key_secret", workers="w"))
    with pytest.raises(SecurityError, match="needs --curve-workers DIR"):
        check_config("tcp://0.0.0.0:5555", "tcp://127.0.0.1:6000", CurveConfig(secret_key="b.key_secret"))


@pytest.mark.parametrize("field,flag", [("clients", "--curve-clients"), ("workers", "--curve-workers"),
                                        ("admins", "--curve-admins")])
def test_key_folders_without_a_broker_key_are_an_error(field, flag):
    with pytest.raises(SecurityError, match=f"{flag} needs --curve-secret-key"):
        check_config("tcp://127.0.0.1:5555", None, CurveConfig(**{field: "dir"}))


# --- tokenbroker keys ----------------------------------------------------------------------------


def test_keys_writes_a_loadable_pair_with_a_private_secret(tmp_path):
    assert cli_main(["keys", str(tmp_path / "k"), "broker"]) == 0
    public_file, secret_file = tmp_path / "k" / "broker.key", tmp_path / "k" / "broker.key_secret"
    public, secret = load_key_pair(secret_file, flag="--curve-secret-key")
    assert load_public_key(public_file, flag="--curve-server-key") == public
    assert zmq.curve_public(secret) == public
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o700
    assert b"secret-key" not in public_file.read_bytes()


def test_keys_never_overwrites_a_pair(tmp_path, capsys):
    create_key_pair(tmp_path, "w1")
    before = (tmp_path / "w1.key_secret").read_bytes()
    assert cli_main(["keys", str(tmp_path), "w1"]) == 2
    assert "exists" in capsys.readouterr().err
    assert (tmp_path / "w1.key_secret").read_bytes() == before


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "../up"])
def test_keys_takes_a_plain_name(tmp_path, name):
    with pytest.raises(ValueError, match="plain file name"):
        create_key_pair(tmp_path, name)


# --- key file errors -----------------------------------------------------------------------------


def test_a_missing_key_file_names_the_flag_and_file(tmp_path):
    with pytest.raises(CurveKeyError, match=r"--curve-server-key .*nope\.key: no such file"):
        load_public_key(tmp_path / "nope.key", flag="--curve-server-key")


def test_the_public_file_is_not_a_key_pair(tmp_path):
    public, _ = create_key_pair(tmp_path, "w")
    with pytest.raises(CurveKeyError, match=r"--curve-secret-key .*w\.key: no secret-key.*give the \.key_secret"):
        load_key_pair(public, flag="--curve-secret-key")


@pytest.mark.parametrize("text,what", [
    ("hello\n", "no public-key"),
    ('curve\n    public-key = "tooshort"\n', "not a 40-character Z85"),
    ('curve\n    public-key = "' + "~" * 40 + '"\n', "not a 40-character Z85"),
], ids=["not-a-certificate", "short-key", "bad-z85"])
def test_a_malformed_key_file_is_a_clear_error(tmp_path, text, what):
    bad = tmp_path / "bad.key"
    bad.write_text(text)
    with pytest.raises(CurveKeyError, match=f"--curve-server-key {bad}: .*{what}"):
        load_public_key(bad, flag="--curve-server-key")


def test_a_secret_that_does_not_match_its_public_key_is_refused(tmp_path):
    _, a = create_key_pair(tmp_path, "a")
    _, b = create_key_pair(tmp_path, "b")
    pub_a, _ = load_key_pair(a, flag="x")
    _, sec_b = load_key_pair(b, flag="x")
    mixed = tmp_path / "mixed.key_secret"
    mixed.write_text(f'curve\n    public-key = "{pub_a.decode()}"\n    secret-key = "{sec_b.decode()}"\n')
    with pytest.raises(CurveKeyError, match="does not belong"):
        load_key_pair(mixed, flag="--curve-secret-key")


def test_client_keys_need_the_server_key_and_a_worker_needs_its_own(tmp_path):
    public, secret = create_key_pair(tmp_path, "broker")
    with pytest.raises(CurveKeyError, match="--curve-secret-key needs --curve-server-key"):
        load_client_keys(None, secret)
    with pytest.raises(CurveKeyError, match="--curve-server-key needs --curve-secret-key"):
        load_client_keys(public, None, own_key_required=True)
    throwaway = load_client_keys(public, None)  # a client of a broker that admits any key
    assert zmq.curve_public(throwaway.secret) == throwaway.public


def test_apply_client_curve_sets_the_socket_options_and_is_a_no_op_without_keys(tmp_path):
    server_pub, _ = create_key_pair(tmp_path, "broker")
    _, own = create_key_pair(tmp_path, "w")
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as plain, ctx.socket(zmq.DEALER) as sock:
        assert apply_client_curve(plain, None, None) is None
        assert plain.getsockopt(zmq.MECHANISM) == zmq.NULL
        keys = apply_client_curve(sock, server_pub, own)
        assert sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
        assert keys.server_public == load_public_key(server_pub, flag="x")


def test_worker_flags_with_a_bad_key_stop_before_loading_anything(tmp_path):
    with pytest.raises(SystemExit, match=r"tokenbroker: --curve-server-key .*: no such file"):
        cli_main(["worker", "--connect", "tcp://127.0.0.1:1", "--curve-server-key", str(tmp_path / "x.key"),
                  "--curve-secret-key", str(tmp_path / "y.key_secret")])


# --- key folders and gates -----------------------------------------------------------------------


def test_a_key_folder_holds_the_public_keys_of_its_key_files(tmp_path):
    a, _ = create_key_pair(tmp_path, "a")
    b, _ = create_key_pair(tmp_path, "b")
    (tmp_path / "notes.txt").write_text("not a key")
    keys = load_key_folder(str(tmp_path), flag="--curve-clients", strict=True)
    assert keys == {load_public_key(a, flag="x"), load_public_key(b, flag="x")}


def test_a_malformed_file_stops_the_start_but_not_a_reload(tmp_path, caplog):
    a, _ = create_key_pair(tmp_path, "a")
    (tmp_path / "broken.key").write_text("garbage\n")
    with pytest.raises(SecurityError, match=r"--curve-workers .*broken\.key"):
        load_key_folder(str(tmp_path), flag="--curve-workers", strict=True)
    with caplog.at_level(logging.WARNING):
        keys = load_key_folder(str(tmp_path), flag="--curve-workers", strict=False)
    assert keys == {load_public_key(a, flag="x")}
    assert "broken.key" in caplog.text


def test_a_missing_folder_is_an_error_naming_the_flag(tmp_path):
    with pytest.raises(SecurityError, match=r"--curve-clients .*nowhere: no such folder"):
        load_key_folder(str(tmp_path / "nowhere"), flag="--curve-clients", strict=True)


def test_a_gate_counts_every_refusal_and_logs_them_rate_limited(tmp_path, caplog):
    a, _ = create_key_pair(tmp_path, "a")
    refused: list[str] = []
    gate = _Gate("backend", {"--curve-workers": str(tmp_path)}, allow_any=False, on_denied=refused.append)
    gate.load(strict=True)
    good = load_public_key(a, flag="x")
    stranger = zmq.curve_keypair()[0]
    with caplog.at_level(logging.WARNING):
        assert gate.callback("backend", good)
        assert not any([gate.callback("backend", stranger) for _ in range(5)])
    assert refused == ["backend"] * 5
    lines = [r for r in caplog.records if "refused a backend peer" in r.getMessage()]
    assert len(lines) == 1 and stranger.decode() in lines[0].getMessage()


def test_admins_are_admitted_as_clients_and_only_they_are_admins(tmp_path):
    clients, admins, keys = tmp_path / "clients", tmp_path / "admins", tmp_path / "keys"
    _, broker_secret = create_key_pair(keys, "broker")
    c, _ = create_key_pair(clients, "c")
    ad, _ = create_key_pair(admins, "ad")
    curve = CurveConfig(secret_key=str(broker_secret), clients=str(clients), admins=str(admins))
    ctx = zmq.Context()
    security = BrokerSecurity.start(ctx, BrokerConfig(curve=curve), on_denied=lambda s: None)
    try:
        c_key, ad_key = load_public_key(c, flag="x"), load_public_key(ad, flag="x")
        assert security.frontend.callback("frontend", c_key) and security.frontend.callback("frontend", ad_key)
        assert security.is_admin(ad_key.decode()) and security.is_admin(ad_key)
        assert not security.is_admin(c_key.decode()) and not security.is_admin(None)
        assert security.admits("frontend", c_key.decode()) and not security.admits("frontend", "x" * 40)
        assert not security.admits("backend", c_key)  # no --curve-workers folder: no worker key
        ad.unlink()
        security.reload()
        assert not security.is_admin(ad_key.decode()) and not security.admits("frontend", ad_key)
        assert not security.frontend.callback("frontend", ad_key)
    finally:
        security.stop()
        ctx.term()


def test_without_curve_sockets_stay_plain_and_nobody_is_an_admin():
    security = BrokerSecurity.start(zmq.Context.instance(), BrokerConfig(), on_denied=lambda s: None)
    with zmq.Context.instance().socket(zmq.ROUTER) as sock:
        assert not security.apply(sock, "frontend", "tcp://127.0.0.1:5555")
        assert sock.getsockopt(zmq.MECHANISM) == zmq.NULL
    assert not security.is_admin("x" * 40)
    security.reload()  # logs only
    security.stop()


# --- the client side learns why it was refused -----------------------------------------------------


def _curve_server(tmp_path, ctx, admitted: bool):
    """A real CURVE ROUTER behind this module's admission (BrokerSecurity), loopback only."""
    _, broker_secret = create_key_pair(tmp_path / "b", "broker")
    client_pub, client_secret = create_key_pair(tmp_path / "clients", "c")
    if not admitted:
        client_pub.unlink()
    curve = CurveConfig(secret_key=str(broker_secret), clients=str(tmp_path / "clients"))
    security = BrokerSecurity.start(ctx, BrokerConfig(curve=curve), on_denied=lambda s: None)
    server = ctx.socket(zmq.ROUTER)
    security.apply(server, "frontend", "tcp://127.0.0.1:*")
    server.bind("tcp://127.0.0.1:*")
    return security, server, tmp_path / "b" / "broker.key", client_secret


@pytest.mark.parametrize("how", ["key-not-admitted", "wrong-server-key", "admitted"])
def test_a_refused_client_learns_why_from_its_monitor(tmp_path, how):
    from tokenbroker.common.curve import handshake_refusal, watch_handshakes
    from helpers import wait_until

    ctx = zmq.Context()
    security, server, server_key, client_secret = _curve_server(tmp_path, ctx, admitted=how != "key-not-admitted")
    if how == "wrong-server-key":
        server_key, _ = create_key_pair(tmp_path / "other", "other")
    client = ctx.socket(zmq.DEALER)
    apply_client_curve(client, server_key, client_secret)
    monitor = watch_handshakes(client)
    try:
        client.connect(server.getsockopt_string(zmq.LAST_ENDPOINT))
        client.send_multipart([b"", b"hello"])
        if how == "admitted":
            assert server.poll(10_000) and server.recv_multipart()[-1] == b"hello"
            assert handshake_refusal(monitor) is None
        else:
            why = wait_until(lambda: handshake_refusal(monitor), timeout=10, what="the refusal on the client side")
            expected = "refused this key" if how == "key-not-admitted" else "is --curve-server-key the broker's public key"
            assert expected in why
            assert not server.poll(0)
    finally:
        client.disable_monitor()
        monitor.close(0)
        client.close(0)
        server.close(0)
        security.stop()
        ctx.term()
