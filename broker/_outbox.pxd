# The turn's replies (broker/_outbox.pyx): held per connection by the intake and the loop, sent by
# the frontend's flush.

cdef inline int hold_reply(dict outbox, object envelope, object payload) except -1:
    """Hold `payload` (bytes, or a view of a worker's W_RESULTS frame) for `envelope`'s connection."""
    held = outbox.get(envelope)
    if held is None:
        outbox[envelope] = [payload]
    else:
        (<list>held).append(payload)
    return 0
