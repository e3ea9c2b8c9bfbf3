# The backend's batches (broker/_batches.pyx): the drain of the backend socket, callable C to C by
# the compiled turns (broker/_plane.pyx) as by Python (broker/backend.py `Backend.receive`).

from tokenbroker.broker._intake cimport Intake

cpdef tuple drain(sock, dict workers, Intake intake, double now, double expiry, Py_ssize_t limit)
