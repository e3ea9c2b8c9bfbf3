"""The shared compiled wire reader (common/_wire.pyx): its bounded skip agrees with msgpack on every
value msgpack writes, and refuses truncated, invalid, over-long and over-deep bytes without reading
past the end or recursing."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from tokenbroker.broker.oversized import id_in_place
from tokenbroker.common._wire import MAX_DEPTH, WireError, id_problem, skip_value
from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import parse_request

values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats()
    | st.text(max_size=40) | st.binary(max_size=300)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=20)),
    lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=8), inner, max_size=10),
    max_leaves=60,
)


@settings(max_examples=300, deadline=None)
@given(values, st.binary(max_size=8))
def test_skip_ends_where_msgpack_ends(value, tail):
    packed = msgpack.packb(value, use_bin_type=True)
    assert skip_value(packed + tail) == len(packed)


@settings(max_examples=300, deadline=None)
@given(values, st.data())
def test_every_truncation_is_refused(value, data):
    packed = msgpack.packb(value, use_bin_type=True)
    cut = data.draw(st.integers(0, len(packed) - 1))
    with pytest.raises(WireError) as e:
        skip_value(packed[:cut])
    assert e.value.fault in ("truncated", "too_long")


def test_nesting_past_the_bound_is_refused_without_recursion():
    deep = b"\x91" * 1_000_000 + b"\x01"
    with pytest.raises(WireError) as e:
        skip_value(deep, max_depth=64)
    assert e.value.fault == "too_deep"
    assert skip_value(b"\x91" * 64 + b"\x01", max_depth=64) == 65
    # a caller asking for more than the skipper's stack gets the stack's depth, not an overflow
    with pytest.raises(WireError):
        skip_value(b"\x91" * (MAX_DEPTH + 5) + b"\x01", max_depth=10**6)


@pytest.mark.parametrize("data, fault", [
    (b"\xc1", "invalid"),
    (b"\xdd\xff\xff\xff\xff", "too_long"),  # an array claiming 4G items in 5 bytes
    (b"\xdf\x00\x00\x00\x03\x01\x01", "too_long"),  # a map claiming 3 pairs in 2 bytes
    (b"\xdb\xff\xff\xff\xff", "truncated"),  # a str claiming 4 GiB
    (b"\xc7\x05\x01ab", "truncated"),  # ext 8 with 5 bytes claimed, 2 there
    (b"", "truncated"),
])
def test_hostile_headers(data, fault):
    with pytest.raises(WireError) as e:
        skip_value(data)
    assert e.value.fault == fault


@pytest.mark.parametrize("value, kind", [
    (None, None), (True, None), (-3, None), (2**64 - 1, None), (1.5, None), ("s", None), (b"b", None),
    ([1], "list"), ({"a": 1}, "map"), (msgpack.ExtType(1, b"x"), "ext"),
])
def test_one_rule_says_which_ids_are_echoed(value, kind):
    """common/_wire.pxd states it once; the broker's reader, its oversized path and the worker's
    general path (parse_request) all read it there."""
    problem = id_problem(msgpack.packb(value, use_bin_type=True))
    frame = msgpack.packb({"op": "ping", "id": value}, use_bin_type=True)
    if kind is None:
        assert problem is None and id_in_place(memoryview(frame)) == msgpack.packb(value, use_bin_type=True)
        assert parse_request(frame).op == "ping"
        return
    assert problem == f"field 'id' must be nil, bool, int, float, str or bin, got {kind}"
    assert id_in_place(memoryview(frame)) == b"\xc0"
    with pytest.raises(ProtocolError, match=f"got {kind}"):
        parse_request(frame)


def test_an_id_that_is_not_utf8_is_not_echoed():
    assert "not valid UTF-8" in (id_problem(b"\xa1\xff") or "")
