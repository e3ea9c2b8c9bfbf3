# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The backend's batches, compiled: a B_JOBS body built from the jobs one turn hands a worker, and a
W_RESULTS body checked before the intake walks it (common/protocol.py: B_JOBS = [J, JOB * n,
payloads]; W_RESULTS = [D, RESULT * n, replies]; the records' layout is common/_wire.pxd's).
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE

from tokenbroker.broker._jobs cimport Job
from tokenbroker.common._pack cimport put_le
from tokenbroker.common._wire cimport (get_le, JOB_ID_AT, JOB_BUDGET_AT, JOB_SIZE_AT, JOB_BYTES, RESULT_BYTES,
                           RESULT_SIZE_AT)

ctypedef unsigned char uchar
ctypedef unsigned long long u64


def job_batch(list jobs, double now, Py_ssize_t start, Py_ssize_t max_jobs, Py_ssize_t max_bytes) -> tuple:
    """The B_JOBS body for jobs[start:end], at most `max_jobs` jobs and `max_bytes` payload bytes past
    its first: (end, header of JOB records, the payloads). Each job's budget is the time left of its
    deadline in ms (at least 1, at most 2**31-1). A lone payload is its own frame (never copied)."""
    cdef Py_ssize_t end = start, size = 0, n, i, length
    cdef Job job
    cdef double left
    cdef long long budget
    cdef bytearray header
    cdef uchar* h
    while end < len(jobs) and end - start < max_jobs:
        length = len((<Job>jobs[end]).raw)
        if end > start and size + length > max_bytes:
            break
        size += length
        end += 1
    n = end - start
    header = bytearray(JOB_BYTES * n)
    h = <uchar*>(<char*>header)
    for i in range(n):
        job = <Job>jobs[start + i]
        left = (job.deadline - now) * 1000
        budget = <long long>left if left < 2147483647.0 else 2147483647
        if budget < 1:
            budget = 1
        put_le(h + JOB_BYTES * i + JOB_ID_AT, <u64>job.job_id, 8)
        put_le(h + JOB_BYTES * i + JOB_BUDGET_AT, <u64>budget, 4)
        put_le(h + JOB_BYTES * i + JOB_SIZE_AT, <u64>len(job.raw), 4)
    if n == 1:
        return end, bytes(header), (<Job>jobs[start]).raw
    return end, bytes(header), b"".join([(<Job>jobs[i]).raw for i in range(start, end)])


def check_results(list body) -> tuple:
    """The (header, replies) of a W_RESULTS body once its records and its payload frame agree
    (`Intake.results` walks them); ValueError otherwise, and the backend drops the message."""
    cdef Py_buffer hb
    cdef Py_ssize_t n, i, total = 0
    if len(body) != 2:
        raise ValueError(f"a result batch must be a header and one payload frame, got {len(body)} frames")
    header, blob = body
    if not header or len(header) % RESULT_BYTES:
        raise ValueError(f"a result batch header of {len(header)} bytes is not a whole number of "
                         f"{RESULT_BYTES}-byte records")
    PyObject_GetBuffer(header, &hb, PyBUF_SIMPLE)
    try:
        n = hb.len // RESULT_BYTES
        for i in range(n):
            total += <Py_ssize_t>get_le(<const uchar*>hb.buf + RESULT_BYTES * i + RESULT_SIZE_AT, 4)
    finally:
        PyBuffer_Release(&hb)
    if total != len(blob):
        raise ValueError(f"a result batch's records count {total} payload bytes, its frame has {len(blob)}")
    return header, blob
