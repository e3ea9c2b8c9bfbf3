# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The broker's outgoing message buffers: a libzmq message of a given size for a core to write
(a B_JOBS payload frame, an array of replies), its memory reused from one message to the next.

Why: a batch of 64 4 KB texts is a 256 KB message. malloc serves a block that large from fresh
pages (mmap, or the top of a heap it trims again once libzmq frees the block), so every byte
written into it faulted a page in: about a fifth of the broker's CPU at 4 KB. Here a block of
64 KiB or more is taken from a small free list instead, handed to libzmq with zmq_msg_init_data,
and given back by libzmq's free function once the message is sent (on libzmq's I/O thread, so the
list has a lock and no Python). The list keeps a few blocks per power-of-two size, at most
POOL_KEPT bytes in all; a block it does not keep is freed. A smaller message is libzmq's own
(zmq_msg_init_size: inside the message up to 33 bytes, else malloc's small-block heap).
"""

from tokenbroker.common._zmq cimport (load_libzmq, zmq_free_fn, zmq_msg_init, zmq_msg_init_data, zmq_msg_init_size,
                                      zmq_msg_t)

cdef extern from *:
    """
    #include <pthread.h>
    #include <stdlib.h>

    #define TB_POOL_MIN_SHIFT 16                  /* 64 KiB: the smallest block kept */
    #define TB_POOL_CLASSES 8                     /* 64 KiB .. 8 MiB, a power of two each */
    #define TB_POOL_PER_CLASS 4                   /* free blocks kept of one size */
    #define TB_POOL_KEPT (16u << 20)              /* free bytes kept in all */

    /* A block's header; its data follows (16 bytes in: aligned as malloc's). */
    typedef struct tb_block { struct tb_block *next; long cls; } tb_block;

    static pthread_mutex_t tb_pool_lock = PTHREAD_MUTEX_INITIALIZER;
    static tb_block *tb_pool_free[TB_POOL_CLASSES];
    static int tb_pool_count[TB_POOL_CLASSES];
    static size_t tb_pool_kept;

    /* The size class of a block of `size` bytes; -1 for one the pool does not serve. */
    static int tb_pool_class(size_t size) {
        int cls = 0;
        if (size < ((size_t)1 << TB_POOL_MIN_SHIFT)) return -1;
        while (cls < TB_POOL_CLASSES && ((size_t)1 << (TB_POOL_MIN_SHIFT + cls)) < size) cls++;
        return cls < TB_POOL_CLASSES ? cls : -1;
    }

    /* A block of class `cls` (a free one, else a new one); NULL when malloc fails. */
    static tb_block *tb_pool_take(int cls) {
        tb_block *b;
        pthread_mutex_lock(&tb_pool_lock);
        b = tb_pool_free[cls];
        if (b) {
            tb_pool_free[cls] = b->next;
            tb_pool_count[cls]--;
            tb_pool_kept -= (size_t)1 << (TB_POOL_MIN_SHIFT + cls);
        }
        pthread_mutex_unlock(&tb_pool_lock);
        if (!b) {
            b = (tb_block *)malloc(sizeof(tb_block) + ((size_t)1 << (TB_POOL_MIN_SHIFT + cls)));
            if (b) b->cls = cls;
        }
        return b;
    }

    /* libzmq's free function for a message made of a block (`hint`): kept, or freed. */
    static void tb_pool_give(void *data, void *hint) {
        tb_block *b = (tb_block *)hint;
        size_t size = (size_t)1 << (TB_POOL_MIN_SHIFT + b->cls);
        (void)data;
        pthread_mutex_lock(&tb_pool_lock);
        if (tb_pool_count[b->cls] < TB_POOL_PER_CLASS && tb_pool_kept + size <= TB_POOL_KEPT) {
            b->next = tb_pool_free[b->cls];
            tb_pool_free[b->cls] = b;
            tb_pool_count[b->cls]++;
            tb_pool_kept += size;
            b = NULL;
        }
        pthread_mutex_unlock(&tb_pool_lock);
        free(b);
    }

    #define tb_block_data(b) ((void *)((b) + 1))
    """
    ctypedef struct tb_block:
        pass
    int tb_pool_class(size_t size) noexcept nogil
    tb_block* tb_pool_take(int cls) noexcept nogil
    void tb_pool_give(void* data, void* hint) noexcept nogil
    void* tb_block_data(tb_block* b) noexcept nogil

load_libzmq()


cdef int sized_message(zmq_msg_t* msg, size_t size) except -1:
    """`msg` (uninitialized) made a message of `size` bytes for the caller to write, then send or
    close; MemoryError when it cannot be."""
    cdef int cls = tb_pool_class(size)
    cdef tb_block* b
    if cls < 0:
        if zmq_msg_init_size(msg, size) < 0:
            zmq_msg_init(msg)  # libzmq leaves a failed one unfit to close
            raise MemoryError()
        return 0
    b = tb_pool_take(cls)
    if b == NULL:
        zmq_msg_init(msg)
        raise MemoryError()
    if zmq_msg_init_data(msg, tb_block_data(b), size, <zmq_free_fn*>tb_pool_give, b) < 0:
        tb_pool_give(NULL, b)
        zmq_msg_init(msg)
        raise MemoryError()
    return 0
