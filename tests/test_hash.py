"""The route key's hash (broker/_hash.pxd), through the two ways the compiled cores expose it:
`_routekey.digest` (one call over a byte string) and a route key's blocks (the same stream fed in
pieces, digested at every boundary). Routing needs spread and prefix sharing: these check that a
split never changes a digest and that inputs that differ give digests that differ."""

from __future__ import annotations

import random

from tokenbroker.broker import _routekey
from tokenbroker.broker._routekey import BOUNDARIES, DIGEST_BYTES, route_key
from tokenbroker.broker.frontend import peek_request
from tokenbroker.common.protocol import pack

# lengths around the hash's 32-byte stripes and its 8-byte words, and a few larger ones
LENGTHS = [0, 1, 7, 8, 9, 15, 16, 31, 32, 33, 63, 64, 65, 95, 96, 97, 255, 256, 257, 1000, 4096]


def test_a_stream_split_anywhere_has_the_digest_of_one_call() -> None:
    """A batch's texts are fed one call each (and a 0xFF between): random text lengths put the
    splits anywhere in a stripe, and every block still equals the one-call digest of its prefix."""
    rng = random.Random(38)
    seed = _routekey.seed(b"text", b"m")
    for _ in range(60):
        texts = ["".join(rng.choices("abcdefgh", k=rng.choice([0, 1, 5, 31, 32, 33, rng.randrange(200)])))
                 for _ in range(rng.randrange(1, 40))]
        key = route_key(peek_request(pack({"op": "tokenize", "model": "m", "text": texts})))
        assert key is not None
        data = b"\xff".join(t.encode() for t in texts)
        ends = [end for end in BOUNDARIES if end <= len(data)]
        if not ends or ends[-1] != len(data):
            ends.append(len(data))
        assert list(key.blocks) == [_routekey.digest(seed + data[:end]) for end in ends]


def test_distinct_inputs_of_one_length_have_distinct_digests() -> None:
    """Random inputs, and the runs of zeros that a zero-padded last stripe could confuse: no two
    digests are equal, nor any two halves (each 8-byte half is mixed from all four lanes)."""
    rng = random.Random(1)
    inputs = {bytes(n) for n in range(300)}
    for n in LENGTHS:
        inputs.update(rng.randbytes(n) for _ in range(2000))
    digests = [_routekey.digest(x) for x in inputs]
    assert all(len(d) == DIGEST_BYTES for d in digests)
    assert len(set(digests)) == len(inputs)
    assert len({d[:8] for d in digests}) == len(inputs)
    assert len({d[8:] for d in digests}) == len(inputs)


def test_every_single_bit_flip_changes_the_digest_and_about_half_its_bits() -> None:
    """Each bit of each input flipped alone: all digests distinct, and on average a flip changes
    close to half of the 128 digest bits (a weak finalizer would leave most of them alone)."""
    rng = random.Random(2)
    changed = flips = 0
    for n in LENGTHS[1:]:
        for _ in range(3 if n <= 256 else 1):
            data = bytearray(rng.randbytes(n))
            base = _routekey.digest(bytes(data))
            seen = {base}
            for bit in range(8 * n):
                data[bit // 8] ^= 1 << (bit % 8)
                d = _routekey.digest(bytes(data))
                data[bit // 8] ^= 1 << (bit % 8)
                seen.add(d)
                changed += bin(int.from_bytes(d, "little") ^ int.from_bytes(base, "little")).count("1")
                flips += 1
            assert len(seen) == 8 * n + 1, n
    assert 62 < changed / flips < 66


def test_a_longer_input_differs_from_its_prefix() -> None:
    """Appending bytes, zeros included, always changes the digest: the length is in it."""
    rng = random.Random(3)
    for n in LENGTHS:
        data = rng.randbytes(n)
        grown = {_routekey.digest(data + bytes(k)) for k in range(70)}
        assert len(grown) == 70
