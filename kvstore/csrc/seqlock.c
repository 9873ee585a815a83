/* The shared-memory index's seqlock (kvstore/node/shared_index.py is the layout's spec).
 *
 * One writer (the daemon, under its store lock) changes a slot as
 *     version += 1 (odd); release fence; the slot's fields; version += 1 (even, a release store)
 * and readers in other processes copy a block out as
 *     v1 = version (acquire, even); the fields; bounds; memcpy out of the arena;
 *     acquire fence; v2 = version; v1 == v2: the bytes are the committed block's.
 * The daemon bumps a slot's version before the block's space can be reused or freed, so a
 * reader whose copy overlapped any reuse sees v2 != v1 and retries (or gives up: BUSY).
 * The arena bytes are read with a plain copy that may race with a reuse: that read's
 * result is thrown away whenever the version moved, which is what a seqlock is.
 *
 * The copy is a vector loop rather than memcpy: glibc copies blocks of a few hundred KiB with
 * `rep movsb`, which on AMD Zen runs ~7x slower when destination and source are 4 KiB
 * aliased (dst - src mod 4096 small: a 360 KiB copy took 135-200 us instead of 18-26 us).
 */
#ifdef KV_PYTHON_API  /* the second build (kvstore.native.seqlock.PY_LIBRARY): Python objects in */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "copy_bytes.h"

#define HDR_STATE 48        /* u64: 1 live, 0 closed */
#define SLOTS_AT 4096       /* the first slot's offset */
#define SLOT_BYTES 64
#define S_EMPTY 0
#define S_LIVE 1
#define S_TOMB 2

enum { KV_HIT = 0, KV_MISS = 1, KV_BUSY = 2, KV_SMALL = 3, KV_CLOSED = 4 };

typedef _Atomic uint64_t a64;

static inline a64 *field(uint8_t *slot, int off) { return (a64 *)(slot + off); }

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline uint64_t load_u64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* Look ``key`` (16 bytes) up and copy its block into ``dst`` (``dst_cap`` bytes).
 * KV_HIT: copied, *out_size = its size. KV_SMALL: *out_size = its size, nothing usable copied.
 * KV_MISS: not in the index. KV_BUSY: the slot kept changing for ``retries`` attempts.
 * KV_CLOSED: the daemon closed the index. */
int kv_seq_get(uint8_t *index, uint64_t mask, int max_probe, const uint8_t *key,
               const uint8_t *arena, uint64_t arena_size, uint8_t *dst, uint64_t dst_cap,
               uint64_t *out_size, int retries) {
    if (atomic_load_explicit(field(index, HDR_STATE), memory_order_acquire) != 1)
        return KV_CLOSED;
    uint64_t k0 = load_u64(key), k1 = load_u64(key + 8);
    uint64_t h = k0;
    for (int probe = 0; probe < max_probe; probe++) {
        uint8_t *slot = index + SLOTS_AT + ((h + (uint64_t)probe) & mask) * SLOT_BYTES;
        a64 *ver = field(slot, 0);
        int tries = 0;
        for (;;) {
            uint64_t v1 = atomic_load_explicit(ver, memory_order_acquire);
            if (v1 & 1) {
                if (++tries >= retries) return KV_BUSY;
                cpu_relax();
                continue;
            }
            uint64_t state = atomic_load_explicit(field(slot, 8), memory_order_relaxed);
            uint64_t s0 = atomic_load_explicit(field(slot, 16), memory_order_relaxed);
            uint64_t s1 = atomic_load_explicit(field(slot, 24), memory_order_relaxed);
            uint64_t off = atomic_load_explicit(field(slot, 32), memory_order_relaxed);
            uint64_t size = atomic_load_explicit(field(slot, 40), memory_order_relaxed);
            if (state != S_LIVE || s0 != k0 || s1 != k1) {
                atomic_thread_fence(memory_order_acquire);
                if (atomic_load_explicit(ver, memory_order_relaxed) != v1) {
                    if (++tries >= retries) return KV_BUSY;
                    continue;  /* read while it changed: look again */
                }
                if (state == S_EMPTY) return KV_MISS;  /* never used: the key is not further on */
                break;  /* another key's slot, or a tombstone: probe on */
            }
            int fits = size <= dst_cap && off <= arena_size && size <= arena_size - off;
            if (fits) copy_bytes(dst, arena + off, size);
            atomic_thread_fence(memory_order_acquire);
            if (atomic_load_explicit(ver, memory_order_relaxed) == v1) {
                *out_size = size;
                if (fits) return KV_HIT;
                return size <= dst_cap ? KV_BUSY : KV_SMALL;  /* out of bounds: never stable */
            }
            if (++tries >= retries) return KV_BUSY;
        }
    }
    return KV_MISS;
}

/* The writer's half: set one slot's fields under its seqlock (the daemon's one writer). */
void kv_seq_write(uint8_t *slot, uint64_t state, const uint8_t *key, uint64_t off, uint64_t size) {
    a64 *ver = field(slot, 0);
    uint64_t v = atomic_load_explicit(ver, memory_order_relaxed);
    atomic_store_explicit(ver, v + 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);  /* odd before any field changes */
    atomic_store_explicit(field(slot, 8), state, memory_order_relaxed);
    if (key != NULL) {
        atomic_store_explicit(field(slot, 16), load_u64(key), memory_order_relaxed);
        atomic_store_explicit(field(slot, 24), load_u64(key + 8), memory_order_relaxed);
        atomic_store_explicit(field(slot, 32), off, memory_order_relaxed);
        atomic_store_explicit(field(slot, 40), size, memory_order_relaxed);
    }
    atomic_store_explicit(ver, v + 2, memory_order_release);  /* even: fields complete */
}

/* The header's state word (1 live, 0 closed), a release store. */
void kv_seq_set_state(uint8_t *index, uint64_t state) {
    atomic_store_explicit(field(index, HDR_STATE), state, memory_order_release);
}

/* A reader's constants in one place, so a get passes a handle, a key and a buffer. */
typedef struct {
    uint8_t *index;
    uint64_t mask;
    int max_probe;
    const uint8_t *arena;
    uint64_t arena_size;
    int retries;
} kv_reader;

void *kv_reader_new(uint8_t *index, uint64_t mask, int max_probe, const uint8_t *arena,
                    uint64_t arena_size, int retries) {
    kv_reader *r = malloc(sizeof *r);
    if (r == NULL) return NULL;
    r->index = index; r->mask = mask; r->max_probe = max_probe;
    r->arena = arena; r->arena_size = arena_size; r->retries = retries;
    return r;
}

void kv_reader_free(void *r) { free(r); }

/* kv_seq_get through a handle, the answer folded into one integer: >= 0 a HIT of that many
 * bytes; -1 - status for MISS, BUSY, CLOSED (-2, -3, -5); SMALL as -16 - size. */
static int64_t fold(int rc, uint64_t size) {
    if (rc == KV_HIT) return (int64_t)size;
    if (rc == KV_SMALL) return -16 - (int64_t)size;
    return -1 - rc;
}

int64_t kv_read(void *h, const uint8_t *key, uint8_t *dst, uint64_t cap) {
    kv_reader *r = h;
    uint64_t size = 0;
    int rc = kv_seq_get(r->index, r->mask, r->max_probe, key, r->arena, r->arena_size, dst, cap,
                        &size, r->retries);
    return fold(rc, size);
}

#ifdef KV_PYTHON_API
#define KV_BADBUF (-6)  /* -1 - 5: not a writable C-contiguous buffer (the caller decides) */
#define GIL_FREE_BYTES (256 << 10)  /* copies from this size on run without the GIL */

/* kv_read into any writable, C-contiguous buffer object (bytearray, NumPy array,
 * memoryview), called with the GIL held (ctypes.PyDLL), which large copies release. */
int64_t kv_read_obj(void *h, const uint8_t *key, PyObject *dst) {
    Py_buffer view;
    if (PyObject_GetBuffer(dst, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        return KV_BADBUF;
    }
    int64_t out;
    if (view.len >= GIL_FREE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        out = kv_read(h, key, view.buf, (uint64_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        out = kv_read(h, key, view.buf, (uint64_t)view.len);
    }
    PyBuffer_Release(&view);
    return out;
}
#endif
