/* The router's block index table: 16-byte block key -> 64-bit mask of the workers holding it.
 *
 * A CPython extension module (``_kv_index``), built on first use by router/native.py through
 * kvstore.native.build_library and imported from the built file. One type, ``Table``:
 *
 *   add(keys, bit)       OR ``bit`` into each key's mask (inserting it); keys: any iterable
 *   drop(keys, bit)      clear ``bit`` from each key's mask; a key whose mask empties leaves
 *   get(key) -> int      the key's mask (0: absent, or not a 16-byte bytes)
 *   match(keys, active, names, result)
 *                        walk ``keys`` (a list or tuple) from the first, AND-ing each key's
 *                        mask into ``active`` (the workers asked about) until none is left;
 *                        a worker whose bit drops out at key i gets ``result[names[slot]] = i``,
 *                        those still holding at the end get ``len(keys)``. Returns None.
 *   len(table)           distinct keys held
 *
 * Layout: open addressing with linear probing over entries {k0, k1, mask} (the key's two
 * little-endian halves; mask 0 marks an empty entry), a power-of-two capacity kept at most half
 * full, backward-shift deletion (no tombstones). The match prefetches the key objects and then
 * their table entries a few keys ahead, so the walk's memory misses overlap.
 *
 * add/drop raise ValueError at the first key that is not a 16-byte bytes object (the caller
 * then falls back to its Python dict); match and get treat such a key as held by nobody.
 * Not thread-safe: the caller holds the GIL and serializes calls.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint64_t k0, k1, mask;
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *slots;
    size_t cap;   /* a power of two, >= MIN_CAP */
    size_t used;
    int shift;    /* 64 - log2(cap) */
} Table;

#define MIN_CAP 64
#define PREFETCH 8

static inline uint64_t slot_hash(uint64_t k0, uint64_t k1) {
    uint64_t h = k0 ^ ((k1 << 32) | (k1 >> 32));
    return h * 0x9E3779B97F4A7C15ULL;   /* Fibonacci hashing: the top bits index the table */
}

static inline size_t home_of(const Table *t, uint64_t k0, uint64_t k1) {
    return (size_t)(slot_hash(k0, k1) >> t->shift);
}

/* The key's halves when ``o`` is a 16-byte bytes object (BlockKey included). */
static inline int key_of(PyObject *o, uint64_t *k0, uint64_t *k1) {
    if (!PyBytes_Check(o) || PyBytes_GET_SIZE(o) != 16)
        return 0;
    const char *s = PyBytes_AS_STRING(o);
    memcpy(k0, s, 8);
    memcpy(k1, s + 8, 8);
    return 1;
}

static inline Entry *find(const Table *t, uint64_t k0, uint64_t k1) {
    size_t m = t->cap - 1, i = home_of(t, k0, k1);
    for (;;) {
        Entry *e = &t->slots[i];
        if (!e->mask)
            return NULL;
        if (e->k0 == k0 && e->k1 == k1)
            return e;
        i = (i + 1) & m;
    }
}

static int resize(Table *t, size_t cap) {
    Entry *old = t->slots, *slots = PyMem_Calloc(cap, sizeof(Entry));
    if (!slots) {
        PyErr_NoMemory();
        return -1;
    }
    size_t old_cap = t->cap;
    int bits = 0;
    while (((size_t)1 << bits) < cap)
        bits++;
    t->slots = slots;
    t->cap = cap;
    t->shift = 64 - bits;
    size_t m = cap - 1;
    for (size_t j = 0; j < old_cap; j++) {
        Entry *e = &old[j];
        if (!e->mask)
            continue;
        size_t i = home_of(t, e->k0, e->k1);
        while (slots[i].mask)
            i = (i + 1) & m;
        slots[i] = *e;
    }
    PyMem_Free(old);
    return 0;
}

static int insert_or(Table *t, uint64_t k0, uint64_t k1, uint64_t bit) {
    size_t m = t->cap - 1, i = home_of(t, k0, k1);
    for (;;) {
        Entry *e = &t->slots[i];
        if (!e->mask)
            break;
        if (e->k0 == k0 && e->k1 == k1) {
            e->mask |= bit;
            return 0;
        }
        i = (i + 1) & m;
    }
    if (2 * (t->used + 1) > t->cap) {
        if (resize(t, t->cap * 2) < 0)
            return -1;
        return insert_or(t, k0, k1, bit);
    }
    Entry *e = &t->slots[i];
    e->k0 = k0;
    e->k1 = k1;
    e->mask = bit;
    t->used++;
    return 0;
}

/* Empty entry i, moving later entries of its probe run back (no tombstones). */
static void delete_at(Table *t, size_t i) {
    size_t m = t->cap - 1, j = i;
    for (;;) {
        j = (j + 1) & m;
        Entry *e = &t->slots[j];
        if (!e->mask)
            break;
        size_t home = home_of(t, e->k0, e->k1);
        /* e may move to i when i lies on its probe path: home .. j, cyclically */
        if (((j - home) & m) >= ((j - i) & m)) {
            t->slots[i] = *e;
            i = j;
        }
    }
    memset(&t->slots[i], 0, sizeof(Entry));
    t->used--;
}

static PyObject *bad_key(Py_ssize_t i) {
    PyErr_Format(PyExc_ValueError, "key %zd is not a 16-byte bytes object", i);
    return NULL;
}

static int parse_bit(PyObject *o, uint64_t *bit) {
    *bit = PyLong_AsUnsignedLongLong(o);
    if (*bit == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    return 0;
}

/* drop_bit: clear ``bit`` in ``key``'s mask, deleting the entry when no worker is left. */
static int drop_bit(Table *t, uint64_t k0, uint64_t k1, uint64_t bit) {
    Entry *e = find(t, k0, k1);
    if (e && !(e->mask &= ~bit))
        delete_at(t, (size_t)(e - t->slots));
    return 0;
}

/* Parse ``(keys, bit)`` and apply ``op`` to every key; NULL with an exception set on failure. */
static PyObject *each_key(Table *t, PyObject *const *args, Py_ssize_t nargs, const char *usage,
                          int (*op)(Table *, uint64_t, uint64_t, uint64_t)) {
    uint64_t bit, k0, k1;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    if (parse_bit(args[1], &bit) < 0)
        return NULL;
    if (!bit) {
        PyErr_SetString(PyExc_ValueError, "bit must be nonzero");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "keys must be iterable");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!key_of(items[i], &k0, &k1)) {
            Py_DECREF(seq);
            return bad_key(i);
        }
        if (op(t, k0, k1, bit) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *Table_add(Table *t, PyObject *const *args, Py_ssize_t nargs) {
    return each_key(t, args, nargs, "add(keys, bit)", insert_or);
}

static PyObject *Table_drop(Table *t, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *done = each_key(t, args, nargs, "drop(keys, bit)", drop_bit);
    if (!done)
        return NULL;
    Py_DECREF(done);
    if (t->cap > MIN_CAP && 8 * t->used < t->cap) {   /* under 1/8 full: back to 1/8-1/4 */
        size_t cap = t->cap;
        while (cap > MIN_CAP && 8 * t->used < cap)
            cap /= 2;
        if (resize(t, cap) < 0)
            PyErr_Clear();   /* keep the larger table */
    }
    Py_RETURN_NONE;
}

static PyObject *Table_get(Table *t, PyObject *key) {
    uint64_t k0, k1;
    if (!key_of(key, &k0, &k1))
        return PyLong_FromLong(0);
    Entry *e = find(t, k0, k1);
    return PyLong_FromUnsignedLongLong(e ? e->mask : 0);
}

static int record(PyObject *names, PyObject *result, uint64_t lost, Py_ssize_t depth) {
    PyObject *v = PyLong_FromSsize_t(depth);
    if (!v)
        return -1;
    while (lost) {
        int s = __builtin_ctzll(lost);
        lost &= lost - 1;
        if (s >= PyList_GET_SIZE(names)) {
            Py_DECREF(v);
            PyErr_SetString(PyExc_IndexError, "a bit without a name");
            return -1;
        }
        if (PyDict_SetItem(result, PyList_GET_ITEM(names, s), v) < 0) {
            Py_DECREF(v);
            return -1;
        }
    }
    Py_DECREF(v);
    return 0;
}

static inline void prefetch_key(PyObject *o) {
    __builtin_prefetch(o);
    __builtin_prefetch((const char *)o + 48);   /* the key's bytes may start the next line */
}

/* The mask of key object ``o`` (0 when absent or not a key). */
static inline uint64_t lookup(const Table *t, PyObject *o) {
    uint64_t k0, k1;
    if (!key_of(o, &k0, &k1))
        return 0;
    size_t m = t->cap - 1, s = home_of(t, k0, k1);
    for (;;) {
        const Entry *e = &t->slots[s];
        if (!e->mask)
            return 0;
        if (e->k0 == k0 && e->k1 == k1)
            return e->mask;
        s = (s + 1) & m;
    }
}

/* Pipeline of the walk: key objects PREFETCH ahead, their entries PREFETCH/2 ahead. */
static inline void prefetch_start(const Table *t, PyObject **items, Py_ssize_t n) {
    uint64_t k0, k1;
    for (Py_ssize_t j = 0; j < n && j < PREFETCH; j++)
        prefetch_key(items[j]);
    for (Py_ssize_t j = 0; j < n && j < PREFETCH / 2; j++)
        if (key_of(items[j], &k0, &k1))
            __builtin_prefetch(&t->slots[home_of(t, k0, k1)]);
}

static inline void prefetch_step(const Table *t, PyObject **items, Py_ssize_t n, Py_ssize_t i) {
    uint64_t k0, k1;
    if (i + PREFETCH < n)
        prefetch_key(items[i + PREFETCH]);
    if (i + PREFETCH / 2 < n && key_of(items[i + PREFETCH / 2], &k0, &k1))
        __builtin_prefetch(&t->slots[home_of(t, k0, k1)]);
}

static PyObject *Table_match(Table *t, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t active;
    if (nargs != 4 || !PyList_Check(args[2]) || !PyDict_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "match(keys, active, names: list, result: dict)");
        return NULL;
    }
    if (parse_bit(args[1], &active) < 0)
        return NULL;
    PyObject *names = args[2], *result = args[3];
    PyObject *seq = PySequence_Fast(args[0], "keys must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (active)
        prefetch_start(t, items, n);
    for (; active && i < n; i++) {
        prefetch_step(t, items, n, i);
        uint64_t held = lookup(t, items[i]) & active;
        if (held != active) {
            if (record(names, result, active & ~held, i) < 0) {
                Py_DECREF(seq);
                return NULL;
            }
            active = held;
        }
    }
    if (active && record(names, result, active, n) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static Py_ssize_t Table_len(Table *t) {
    return (Py_ssize_t)t->used;
}

static int Table_init(Table *t, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) || (kw && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "Table() takes no arguments");
        return -1;
    }
    if (t->slots)
        return 0;
    t->cap = 0;
    t->slots = NULL;
    t->used = 0;
    return resize(t, MIN_CAP);
}

static void Table_dealloc(Table *t) {
    PyMem_Free(t->slots);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef Table_methods[] = {
    {"add", (PyCFunction)(void (*)(void))Table_add, METH_FASTCALL, "add(keys, bit)"},
    {"drop", (PyCFunction)(void (*)(void))Table_drop, METH_FASTCALL, "drop(keys, bit)"},
    {"get", (PyCFunction)Table_get, METH_O, "get(key) -> mask"},
    {"match", (PyCFunction)(void (*)(void))Table_match, METH_FASTCALL,
     "match(keys, active, names, result)"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Table_as_sequence = {
    .sq_length = (lenfunc)Table_len,
};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_kv_index.Table",
    .tp_basicsize = sizeof(Table),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "16-byte block key -> 64-bit worker mask (see kv_index.c)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Table_init,
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_methods = Table_methods,
    .tp_as_sequence = &Table_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kv_index", "The router's native block index table.", -1, NULL,
};

PyMODINIT_FUNC PyInit__kv_index(void) {
    if (PyType_Ready(&TableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&TableType);
    if (PyModule_AddObject(m, "Table", (PyObject *)&TableType) < 0) {
        Py_DECREF(&TableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
