# The turn's replies (broker/_outbox.pyx): held per connection by the intake and the loop, sent by
# the compiled turns (broker/_plane.pyx) and the frontend's flush.

cdef inline int hold_reply(dict outbox, object envelope, object payload) except -1:
    """Hold `payload` (bytes, or a view of a worker's W_RESULTS frame) for `envelope`'s connection."""
    held = outbox.get(envelope)
    if held is None:
        outbox[envelope] = [payload]
    else:
        (<list>held).append(payload)
    return 0


cpdef send_replies(sock, dict outbox, set arrays, holding, Py_ssize_t frame_bytes)
