# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The MessagePack wire reader both sides share (compiled): read one value's header, or skip one
value whole, over raw bytes and without building a Python object.

Why it exists: a request's routing fields are a handful of small values in a map whose other values
(texts, message lists, unknown keys) may be megabytes or hostile. msgpack and msgspec build every
value they read; this reader jumps over what nobody needs by the length in its header. Hostile bytes
meet it first, so every read is bounded: it never reads past `end`, a container may not claim more
items than bytes remain (each item takes at least one), and nesting deeper than `max_depth` is a
fault, not a recursion (the skipper keeps its own counter stack).

The C API (`_wire.pxd`, inline: a header) is what the cores cimport, as this module does; the Python functions below serve tests, the fuzz
target and Python callers that need a bounded skip.
"""

from tokenbroker.common._wire cimport (WIRE_MAX_DEPTH, W_TRUNCATED, W_INVALID, W_TOO_DEEP, W_TOO_LONG,
                           skip, id_fault, JOB_ID_AT, JOB_BUDGET_AT, JOB_SIZE_AT, JOB_BYTES, RESULT_ID_AT,
                           RESULT_OUTCOME_AT, RESULT_SIZE_AT, RESULT_BYTES)

MAX_DEPTH = WIRE_MAX_DEPTH  # no caller may ask for a deeper bound than this

# The batch records' layout (_wire.pxd holds it): (offset, bytes) of each field, in order.
JOB_FIELDS = ((JOB_ID_AT, 8), (JOB_BUDGET_AT, 4), (JOB_SIZE_AT, 4))
RESULT_FIELDS = ((RESULT_ID_AT, 8), (RESULT_OUTCOME_AT, 1), (RESULT_SIZE_AT, 4))
JOB_RECORD_BYTES = JOB_BYTES
RESULT_RECORD_BYTES = RESULT_BYTES


class WireError(ValueError):
    """Bytes that are not one bounded MessagePack value: `fault` says which way."""

    def __init__(self, fault: str, at: int) -> None:
        super().__init__(f"{fault} at byte {at}")
        self.fault = fault
        self.at = at


FAULTS = {W_TRUNCATED: "truncated", W_INVALID: "invalid", W_TOO_DEEP: "too_deep", W_TOO_LONG: "too_long"}


def skip_value(const unsigned char[::1] data, Py_ssize_t pos=0, int max_depth=64) -> int:
    """Where the value starting at `pos` ends; WireError if it is broken, too deep or truncated."""
    cdef Py_ssize_t end = data.shape[0]
    cdef Py_ssize_t at
    if pos < 0 or pos > end:
        raise WireError("truncated", pos)
    if end == 0:
        raise WireError("truncated", 0)
    with nogil:
        at = skip(&data[0], end, pos, max_depth)
    if at < 0:
        raise WireError(FAULTS[at], pos)
    return at


def id_problem(const unsigned char[::1] raw_id) -> str | None:
    """Why an `id` value (its MessagePack bytes, one whole value) may not be echoed, or None: the
    rule _wire.pxd `id_fault` states, for Python callers."""
    if raw_id.shape[0] == 0:
        return "field 'id' has no value"
    return id_fault(&raw_id[0], raw_id.shape[0])
