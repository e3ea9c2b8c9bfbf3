"""The shared MessagePack writer (common/_pack.pxd) against msgpack, at every format boundary, through
each core that writes with it: the client codec (`pack`, `request`, `frames`: every put_*/buf_*), the
worker's `pack_tokens` (put_uint, put_bin_head, put_array_head and the sizes it measures with), and
the broker's batch records (put_le, get_le) against common/protocol.py's struct layouts.

Every boundary is where msgpack switches to a wider format: 15/16 items (fixarray, fixmap),
31/32 bytes (fixstr), 127/128 and 255/256 (fixint, 8-bit), 65535/65536 (16-bit), 2**32 - 1/2**32
(32-bit), and the negative ints at -32/-33, -128/-129, -32768/-32769, -2**31/-2**31 - 1."""

from __future__ import annotations

from array import array

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbroker import _codec
from tokenbroker.broker._batches import results_problem, send_jobs
from tokenbroker.broker._jobs import Job
from tokenbroker.common.protocol import JOB, OUTCOMES, RESULT, unpack_jobs
from tokenbroker.workers._core import pack_tokens


def ref(value: object) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _around(*edges: int) -> list[int]:
    return sorted({v for e in edges for v in (e - 1, e, e + 1) if v >= 0})


UINT_EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
INT_EDGES = [-1, -31, -32, -33, -127, -128, -129, -32767, -32768, -32769, -(2**31) + 1, -(2**31), -(2**31) - 1,
             -(2**63) + 1, -(2**63)]
LENGTHS = _around(16, 32, 256, 65536)  # 15/16/17, 31/32/33, 255/256/257, 65535/65536/65537
INTS = st.integers(min_value=-(2**63), max_value=2**64 - 1)


# --- the client codec: every put_* through its buf_* ---------------------------------------------------


@pytest.mark.parametrize("value", UINT_EDGES + INT_EDGES)
def test_an_int_at_each_width_boundary_is_msgpacks(value: int) -> None:
    assert _codec.pack(value) == ref(value)


@given(INTS)
def test_any_64_bit_int_is_msgpacks(value: int) -> None:
    assert _codec.pack(value) == ref(value)


@pytest.mark.parametrize("n", LENGTHS)
def test_str_bin_array_and_map_heads_at_each_length_boundary_are_msgpacks(n: int) -> None:
    for value in ("s" * n, "é" * (n // 2), b"\x00" * n, bytearray(b"\x01" * n), [None] * n, tuple([True] * n),
                  {i: False for i in range(n)}):
        assert _codec.pack(value) == ref(value), (type(value).__name__, n)


@given(st.recursive(st.none() | st.booleans() | INTS | st.floats(allow_nan=False) | st.text() | st.binary(),
                    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=40))
@settings(max_examples=300, deadline=None)
def test_any_plain_value_is_msgpacks(value: object) -> None:
    assert _codec.pack(value) == ref(value)


@given(INTS, st.integers(min_value=-(2**63), max_value=2**63 - 1), st.sampled_from(LENGTHS[:9]))
@settings(max_examples=200, deadline=None)
def test_a_request_with_any_id_and_deadline_is_msgpacks(rid: int, deadline_ms: int, nkeys: int) -> None:
    fields = {f"k{i}": i for i in range(nkeys)}
    head = _codec.pack_entries(fields)
    assert _codec.request(head, nkeys, rid, deadline_ms) == ref({**fields, "id": rid, "deadline_ms": deadline_ms})


@pytest.mark.parametrize("n", [2, 15, 16, 17, 65535, 65536])
def test_a_frame_of_n_payloads_is_msgpacks_array_of_them(n: int) -> None:
    payloads = [ref({"id": i}) for i in range(n)]
    (frame,) = _codec.frames([None] * n, payloads, {}, n, 1 << 30, 0.0)
    assert frame == ref([{"id": i} for i in range(n)])


# --- the worker's replies ----------------------------------------------------------------------


TAIL = ref({"cache": {"l0": "off", "l1_reused_tokens": 0}, "worker": "w"})[1:]
ID_EDGES = [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1]


def _reply(tokens: object, count: int) -> bytes:
    return ref({"id": 7, "ok": True, "tokens": tokens, "count": count,
                "cache": {"l0": "off", "l1_reused_tokens": 0}, "worker": "w"})


def _pack(texts: list[list[int]], batch: bool, u32: bool) -> bytes:
    flat = array("I", [i for ids in texts for i in ids]).tobytes()
    ends = array("Q", [0])
    for ids in texts:
        ends.append(ends[-1] + len(ids))
    out = pack_tokens(flat, ends.tobytes(), 0, len(texts), batch, u32, b"\x07", TAIL, 1 << 30)
    assert out is not None
    return out


def _want(texts: list[list[int]], batch: bool, u32: bool) -> bytes:
    values = [array("I", ids).tobytes() if u32 else ids for ids in texts]
    return _reply(values if batch else values[0], sum(len(ids) for ids in texts))


@pytest.mark.parametrize("u32", [False, True], ids=["list", "u32"])
@pytest.mark.parametrize("n", _around(16, 64, 16384, 65536))  # list heads 15/16, 65535/65536; bin 252/256, 65532/65536
def test_a_reply_of_n_ids_is_msgpacks(n: int, u32: bool) -> None:
    ids = [ID_EDGES[i % len(ID_EDGES)] for i in range(n)]
    for batch in (False, True):
        assert _pack([ids], batch, u32) == _want([ids], batch, u32)


@pytest.mark.parametrize("u32", [False, True], ids=["list", "u32"])
@pytest.mark.parametrize("texts", [15, 16, 17])
def test_a_batch_of_n_texts_is_msgpacks(texts: int, u32: bool) -> None:
    values = [ID_EDGES[: i % 9] for i in range(texts)]
    assert _pack(values, True, u32) == _want(values, True, u32)


@given(st.lists(st.lists(st.sampled_from(ID_EDGES) | st.integers(0, 2**32 - 1), max_size=80), min_size=1, max_size=20),
       st.booleans())
@settings(max_examples=200, deadline=None)
def test_any_batch_reply_is_msgpacks(texts: list[list[int]], u32: bool) -> None:
    assert _pack(texts, True, u32) == _want(texts, True, u32)
    assert _pack(texts[:1], False, u32) == _want(texts[:1], False, u32)


@pytest.mark.parametrize("count", [127, 128, 255, 256, 65535, 65536])
def test_the_count_at_each_width_boundary_is_msgpacks(count: int) -> None:
    ids = [1] * count
    assert _pack([ids], False, True) == _want([ids], False, True)


# --- the broker's batch records -------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend_pair():
    """A ROUTER (the broker's backend) and a DEALER (a worker) over inproc: what send_jobs sends,
    as the worker receives it."""
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind("inproc://test-pack-batches")
    dealer.setsockopt(zmq.IDENTITY, b"w1")
    dealer.connect("inproc://test-pack-batches")
    yield router, dealer
    router.close(0)
    dealer.close(0)
    ctx.term()


@given(st.lists(st.tuples(st.integers(0, 2**63 - 1), st.binary(max_size=40), st.floats(-10.0, 3e6)), min_size=1,
                max_size=8))
@settings(max_examples=100, deadline=None)
def test_a_job_batch_header_is_the_protocols_records(backend_pair, jobs: list[tuple[int, bytes, float]]) -> None:
    router, dealer = backend_pair
    made = [Job(job_id, [b"c"], b"\xc0", raw, "tokenize", None, 0.0, deadline, 0.0) for job_id, raw, deadline in jobs]
    send_jobs(router, b"w1", made, 0.0, len(made), 1 << 30)
    kind, header, blob = dealer.recv_multipart()
    want = b"".join(JOB.pack(job_id, min(max(int(deadline * 1000), 1), 2**31 - 1), len(raw))
                    for job_id, raw, deadline in jobs)
    assert kind == b"J" and header == want and blob == b"".join(raw for _, raw, _ in jobs)


def test_jobs_past_a_batchs_bounds_go_in_the_next_message(backend_pair) -> None:
    """At most max_jobs jobs a message, and max_bytes payload bytes past its first job (a job larger
    than the bound still goes, alone); each payload any buffer (bytes, a view of an array's frame)."""
    router, dealer = backend_pair
    raws: list[bytes | memoryview] = [b"a" * 10, memoryview(b"xxbbbbbbbbbbyy")[2:12], b"c" * 30, b"d", b"e", b"f"]
    made = [Job(i, [b"c"], b"\xc0", raw, "tokenize", None, 0.0, 1.0, 0.0) for i, raw in enumerate(raws)]
    send_jobs(router, b"w1", made, 0.0, 2, 20)
    got = []
    while dealer.poll(200):
        kind, header, blob = dealer.recv_multipart()
        got.append([(job_id, bytes(payload)) for job_id, _, payload in unpack_jobs([header, blob])])
    assert got == [[(0, b"a" * 10), (1, b"b" * 10)], [(2, b"c" * 30)], [(3, b"d"), (4, b"e")], [(5, b"f")]]


@given(st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, len(OUTCOMES) - 1), st.binary(max_size=40)),
                min_size=1, max_size=8))
def test_a_result_batch_reads_as_the_protocols_records(results: list[tuple[int, int, bytes]]) -> None:
    """results_problem reads each record's size as the protocol packs it (get_le): the batch passes
    whole, and one byte more or less in the payload frame is refused."""
    header = b"".join(RESULT.pack(job_id, code, len(reply)) for job_id, code, reply in results)
    blob = b"".join(reply for _, _, reply in results)
    assert results_problem([header, blob]) is None
    for wrong in (blob + b"x", blob[:-1]) if blob else (b"x",):
        assert "payload bytes" in (results_problem([header, wrong]) or "")
