# libzmq's C API for the cores, with no header and no link step: the functions are looked up with
# dlsym in the libzmq that pyzmq has already loaded, and called on pyzmq's own sockets
# (`Socket.underlying`, the void* libzmq handed pyzmq). One library instance, one context: a
# message sent here is received by pyzmq's `recv` on the other end, and the reverse.
#
# Why not link: the pyzmq wheel bundles libzmq under a mangled name (pyzmq.libs/libzmq-<hash>.so)
# and ships no zmq.h, and a second libzmq in the process would be a second set of globals. The
# lookup goes through pyzmq's own extension module (`dlopen(its file, RTLD_NOLOAD)`): dlsym on that
# handle searches the module and then its dependencies, which is where libzmq is, whatever its
# file is called (bundled, a system libzmq, or linked in statically).
#
# libzmq's C ABI has been stable across 4.x: the few functions below, the 64-byte opaque
# zmq_msg_t, zmq_pollitem_t and the constants are declared here as zmq.h declares them. The
# C part is inline (a header, in effect), so each core that cimports this file has its own copy of
# the function table and fills it once at import with `load_libzmq()`, as common/_wire.pxd is
# inline.
#
# In a core:
#     from tokenbroker.common._zmq cimport zmq_msg_t, zmq_msg_init, zmq_msg_recv, ..., load_libzmq, handle_of
#     load_libzmq()    # at module level, once
#
# Every function is callable without the GIL. Errors are libzmq's: a call returns -1 and
# `zmq_errno()` says why (EAGAIN: nothing to read / no room; EINTR: a signal; ETERM: the context is
# closing; EHOSTUNREACH: a ROUTER_MANDATORY peer is gone).

from libc.stdint cimport uintptr_t

cdef extern from *:
    """
    #include <dlfcn.h>
    #include <errno.h>
    #include <stddef.h>

    /* zmq.h: a message is 64 opaque bytes, aligned as a pointer. */
    typedef union { unsigned char _[64]; void *p; } tb_zmq_msg_t;
    typedef struct { void *socket; int fd; short events; short revents; } tb_zmq_pollitem_t;
    typedef void (tb_zmq_free_fn)(void *data, void *hint);

    static struct {
        int (*msg_init)(tb_zmq_msg_t *);
        int (*msg_init_size)(tb_zmq_msg_t *, size_t);
        int (*msg_init_data)(tb_zmq_msg_t *, void *, size_t, tb_zmq_free_fn *, void *);
        int (*msg_close)(tb_zmq_msg_t *);
        int (*msg_copy)(tb_zmq_msg_t *, tb_zmq_msg_t *);
        int (*msg_move)(tb_zmq_msg_t *, tb_zmq_msg_t *);
        void *(*msg_data)(tb_zmq_msg_t *);
        size_t (*msg_size)(const tb_zmq_msg_t *);
        int (*msg_more)(const tb_zmq_msg_t *);
        const char *(*msg_gets)(const tb_zmq_msg_t *, const char *);
        int (*msg_send)(tb_zmq_msg_t *, void *, int);
        int (*msg_recv)(tb_zmq_msg_t *, void *, int);
        int (*send)(void *, const void *, size_t, int);
        int (*poll)(tb_zmq_pollitem_t *, int, long);
        int (*getsockopt)(void *, int, void *, size_t *);
        int (*setsockopt)(void *, int, const void *, size_t);
        int (*errno_)(void);
        const char *(*strerror)(int);
        void (*version)(int *, int *, int *);
    } tb_zmq;

    #define TB_ZMQ_SYM(field, name) \
        if (!(*(void **)&tb_zmq.field = dlsym(h, name))) return name;

    /* NULL when every symbol resolved, else the name of the first one missing. `module` is the
       file of a loaded extension linked against libzmq (pyzmq's backend). */
    static const char *tb_zmq_load(const char *module) {
        void *h = dlopen(module, RTLD_NOW | RTLD_NOLOAD);
        if (!h) return "dlopen";
        TB_ZMQ_SYM(msg_init, "zmq_msg_init")
        TB_ZMQ_SYM(msg_init_size, "zmq_msg_init_size")
        TB_ZMQ_SYM(msg_init_data, "zmq_msg_init_data")
        TB_ZMQ_SYM(msg_close, "zmq_msg_close")
        TB_ZMQ_SYM(msg_copy, "zmq_msg_copy")
        TB_ZMQ_SYM(msg_move, "zmq_msg_move")
        TB_ZMQ_SYM(msg_data, "zmq_msg_data")
        TB_ZMQ_SYM(msg_size, "zmq_msg_size")
        TB_ZMQ_SYM(msg_more, "zmq_msg_more")
        TB_ZMQ_SYM(msg_gets, "zmq_msg_gets")
        TB_ZMQ_SYM(msg_send, "zmq_msg_send")
        TB_ZMQ_SYM(msg_recv, "zmq_msg_recv")
        TB_ZMQ_SYM(send, "zmq_send")
        TB_ZMQ_SYM(poll, "zmq_poll")
        TB_ZMQ_SYM(getsockopt, "zmq_getsockopt")
        TB_ZMQ_SYM(setsockopt, "zmq_setsockopt")
        TB_ZMQ_SYM(errno_, "zmq_errno")
        TB_ZMQ_SYM(strerror, "zmq_strerror")
        TB_ZMQ_SYM(version, "zmq_version")
        /* The handle is not closed: RTLD_NOLOAD took a reference to a library pyzmq keeps loaded
           for the life of the process, and the table points into it. */
        return NULL;
    }

    #define zmq_msg_init(m) (tb_zmq.msg_init(m))
    #define zmq_msg_init_size(m, n) (tb_zmq.msg_init_size((m), (n)))
    #define zmq_msg_init_data(m, d, n, f, h) (tb_zmq.msg_init_data((m), (d), (n), (f), (h)))
    #define zmq_msg_close(m) (tb_zmq.msg_close(m))
    #define zmq_msg_copy(d, s) (tb_zmq.msg_copy((d), (s)))
    #define zmq_msg_move(d, s) (tb_zmq.msg_move((d), (s)))
    #define zmq_msg_data(m) (tb_zmq.msg_data(m))
    #define zmq_msg_size(m) (tb_zmq.msg_size(m))
    #define zmq_msg_more(m) (tb_zmq.msg_more(m))
    #define zmq_msg_gets(m, p) (tb_zmq.msg_gets((m), (p)))
    #define zmq_msg_send(m, s, f) (tb_zmq.msg_send((m), (s), (f)))
    #define zmq_msg_recv(m, s, f) (tb_zmq.msg_recv((m), (s), (f)))
    #define zmq_send(s, b, n, f) (tb_zmq.send((s), (b), (n), (f)))
    #define zmq_poll(i, n, t) (tb_zmq.poll((i), (n), (t)))
    #define zmq_getsockopt(s, o, v, n) (tb_zmq.getsockopt((s), (o), (v), (n)))
    #define zmq_setsockopt(s, o, v, n) (tb_zmq.setsockopt((s), (o), (v), (n)))
    #define zmq_errno() (tb_zmq.errno_())
    #define zmq_strerror(e) (tb_zmq.strerror(e))
    #define zmq_version(a, b, c) (tb_zmq.version((a), (b), (c)))

    /* zmq.h's constants (part of the ABI). */
    #define TB_ZMQ_DONTWAIT 1
    #define TB_ZMQ_SNDMORE 2
    #define TB_ZMQ_POLLIN 1
    #define TB_ZMQ_POLLOUT 2
    #define TB_ZMQ_RCVMORE 13
    #define TB_ZMQ_FD 14
    #define TB_ZMQ_EVENTS 15
    #define TB_ZMQ_SNDHWM 23
    #define TB_ZMQ_RCVHWM 24
    #define TB_ZMQ_ROUTER_MANDATORY 33
    #define TB_ZMQ_ETERM (156384712 + 53)
    """
    ctypedef struct zmq_msg_t "tb_zmq_msg_t":
        pass
    ctypedef struct zmq_pollitem_t "tb_zmq_pollitem_t":
        void* socket
        int fd
        short events
        short revents
    ctypedef void zmq_free_fn "tb_zmq_free_fn"(void* data, void* hint) noexcept nogil

    const char* tb_zmq_load(const char* module) nogil

    int zmq_msg_init(zmq_msg_t* msg) nogil
    int zmq_msg_init_size(zmq_msg_t* msg, size_t size) nogil
    int zmq_msg_init_data(zmq_msg_t* msg, void* data, size_t size, zmq_free_fn* ffn, void* hint) nogil
    int zmq_msg_close(zmq_msg_t* msg) nogil
    int zmq_msg_copy(zmq_msg_t* dest, zmq_msg_t* src) nogil
    int zmq_msg_move(zmq_msg_t* dest, zmq_msg_t* src) nogil
    void* zmq_msg_data(zmq_msg_t* msg) nogil
    size_t zmq_msg_size(const zmq_msg_t* msg) nogil
    int zmq_msg_more(const zmq_msg_t* msg) nogil
    const char* zmq_msg_gets(const zmq_msg_t* msg, const char* prop) nogil
    int zmq_msg_send(zmq_msg_t* msg, void* socket, int flags) nogil
    int zmq_msg_recv(zmq_msg_t* msg, void* socket, int flags) nogil
    int zmq_send(void* socket, const void* buf, size_t n, int flags) nogil
    int zmq_poll(zmq_pollitem_t* items, int nitems, long timeout) nogil
    int zmq_getsockopt(void* socket, int option, void* value, size_t* size) nogil
    int zmq_setsockopt(void* socket, int option, const void* value, size_t size) nogil
    int zmq_errno() nogil
    const char* zmq_strerror(int errnum) nogil
    void zmq_version(int* major, int* minor, int* patch) nogil

    enum:
        ZMQ_DONTWAIT "TB_ZMQ_DONTWAIT"
        ZMQ_SNDMORE "TB_ZMQ_SNDMORE"
        ZMQ_POLLIN "TB_ZMQ_POLLIN"
        ZMQ_POLLOUT "TB_ZMQ_POLLOUT"
        ZMQ_RCVMORE "TB_ZMQ_RCVMORE"
        ZMQ_FD "TB_ZMQ_FD"
        ZMQ_EVENTS "TB_ZMQ_EVENTS"
        ZMQ_SNDHWM "TB_ZMQ_SNDHWM"
        ZMQ_RCVHWM "TB_ZMQ_RCVHWM"
        ZMQ_ROUTER_MANDATORY "TB_ZMQ_ROUTER_MANDATORY"
        ZMQ_ETERM "TB_ZMQ_ETERM"
        EAGAIN
        EINTR
        EHOSTUNREACH


cdef inline int load_libzmq() except -1:
    """Fill this module's table from the libzmq pyzmq loaded (importing pyzmq's backend first, so it
    is loaded); ImportError naming the symbol when it cannot, and for a libzmq older than 4."""
    from zmq.backend.cython import _zmq
    cdef bytes module = _zmq.__file__.encode()
    cdef const char* missing = tb_zmq_load(module)
    cdef int major = 0, minor = 0, patch = 0
    if missing is not NULL:
        raise ImportError(f"cannot use pyzmq's libzmq from compiled code ({missing.decode()} not found via {_zmq.__file__})")
    zmq_version(&major, &minor, &patch)
    if major < 4:
        raise ImportError(f"libzmq {major}.{minor}.{patch} is too old: the cores need 4.x")
    return 0


cdef inline void* handle_of(object sock) except NULL:
    """The libzmq socket under a pyzmq Socket (its `underlying` address); ValueError once closed."""
    cdef uintptr_t address = sock.underlying
    if address == 0:
        raise ValueError("the socket is closed")
    return <void*>address


cdef inline str zmq_error(int err):
    """libzmq's message for an errno, for the exceptions a core raises."""
    return zmq_strerror(err).decode("utf-8", "replace")
