/* Chained block keys straight from a Python list of token ids (kvstore/keys.py's spec):
 * key[i] = XXH3-128(key[i-1] || block i's tokens as little-endian uint32), canonical bytes.
 *
 * Loaded with ctypes.PyDLL (the GIL is held): it reads the list's ints with the C API and
 * returns a new list of key objects of the given bytes subtype, with no intermediate bytes.
 * ``tokens`` may also be bytes of little-endian uint32 (what the Python path makes of any
 * other sequence). It answers None (no error set) whenever the Python path must decide
 * instead: any item that is not an exact int in [0, 2**32), tokens of another type, a block
 * of more than 1024 tokens, an interpreter whose bytes layout this file does not know.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct { uint64_t low64, high64; } xxh128_t;
typedef xxh128_t (*xxh128_fn)(const void *data, size_t len);

enum { KEY = 16, MAX_BLOCK = 1024 };

static void put_be64(unsigned char *out, uint64_t v)
{
    for (int i = 7; i >= 0; i--) { out[i] = (unsigned char)v; v >>= 8; }
}

/* A non-negative int below 2**30 read straight from its digits (most token ids); 0 when the
 * C API must read it. */
static inline int small_int(PyObject *item, unsigned long *v)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)item)) return 0;
    Py_ssize_t x = PyUnstable_Long_CompactValue((PyLongObject *)item);
    if (x < 0) return 0;
    *v = (unsigned long)x;
    return 1;
#else
    Py_ssize_t size = Py_SIZE(item);
    if (size == 1) { *v = ((PyLongObject *)item)->ob_digit[0]; return 1; }
    if (size == 0) { *v = 0; return 1; }
    return 0;
#endif
}

static PyObject *new_key(PyTypeObject *type, const unsigned char *digest)
{
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000
    if (type->tp_basicsize == PyBytes_Type.tp_basicsize && type->tp_itemsize == PyBytes_Type.tp_itemsize
        && type->tp_dictoffset == 0 && type->tp_weaklistoffset == 0
        && !PyType_HasFeature(type, Py_TPFLAGS_HAVE_GC)) {
        /* A subtype laid out exactly as bytes (BlockKey: __slots__ = ()): a plain 16-byte bytes
         * (never a shared singleton at this size) takes the subtype, which owns a reference to
         * its heap type, as an instance allocated by the subtype would. */
        PyObject *key = PyBytes_FromStringAndSize((const char *)digest, KEY);
        if (key == NULL) return NULL;
        Py_INCREF(type);
        Py_SET_TYPE(key, type);
        return key;
    }
    /* What bytes_subtype_new does: allocate the subtype with 16 items, copy, no cached hash. */
    PyObject *key = type->tp_alloc(type, KEY);
    if (key == NULL) return NULL;
    memcpy(PyBytes_AS_STRING(key), digest, KEY);
    PyBytes_AS_STRING(key)[KEY] = '\0';
#if PY_VERSION_HEX < 0x030D0000
_Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wdeprecated-declarations\"")
    ((PyBytesObject *)key)->ob_shash = -1;
_Pragma("GCC diagnostic pop")
#endif
    return key;
#else
    (void)type; (void)digest;
    return NULL;
#endif
}

/* parent: 16-byte bytes; tokens: list, tuple or uint32 bytes; skip: leading tokens already keyed (a whole
 * number of blocks); returns a list of the keys of the full blocks after them, or None. */
PyObject *kv_block_keys_py(PyObject *parent, PyObject *tokens, Py_ssize_t skip,
                           Py_ssize_t block_size, PyTypeObject *key_type, void *hash_ptr)
{
#if !(PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000)
    Py_RETURN_NONE;
#endif
    xxh128_fn hash = (xxh128_fn)hash_ptr;
    if (!PyBytes_Check(parent) || PyBytes_GET_SIZE(parent) != KEY || block_size <= 0
        || block_size > MAX_BLOCK || skip < 0)
        Py_RETURN_NONE;
    const unsigned char *raw = NULL;
    PyObject **items = NULL;
    Py_ssize_t n;
    if (PyBytes_CheckExact(tokens)) {
        raw = (const unsigned char *)PyBytes_AS_STRING(tokens);
        n = PyBytes_GET_SIZE(tokens) / 4;
    } else if (PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) {
        items = PySequence_Fast_ITEMS(tokens);
        n = PySequence_Fast_GET_SIZE(tokens);
    } else {
        Py_RETURN_NONE;
    }
    Py_ssize_t n_blocks = n / block_size - skip / block_size;
    if (n_blocks <= 0) return PyList_New(0);
    unsigned char buf[KEY + 4 * MAX_BLOCK];
    memcpy(buf, PyBytes_AS_STRING(parent), KEY);
    PyObject *out = PyList_New(n_blocks);
    if (out == NULL) return NULL;
    Py_ssize_t pos = skip;
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        unsigned char *t = buf + KEY;
        if (raw != NULL) {
            memcpy(t, raw + 4 * pos, (size_t)(4 * block_size));
            pos += block_size;
        } else for (Py_ssize_t j = 0; j < block_size; j++, pos++, t += 4) {
            PyObject *item = items[pos];
            if (!PyLong_CheckExact(item)) goto python_path;
            unsigned long v;
            if (!small_int(item, &v)) {
                v = PyLong_AsUnsignedLong(item);
                if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFul) {
                    PyErr_Clear();
                    goto python_path;
                }
            }
            t[0] = (unsigned char)v; t[1] = (unsigned char)(v >> 8);
            t[2] = (unsigned char)(v >> 16); t[3] = (unsigned char)(v >> 24);
        }
        xxh128_t h = hash(buf, (size_t)(KEY + 4 * block_size));
        put_be64(buf, h.high64);
        put_be64(buf + 8, h.low64);
        PyObject *key = new_key(key_type, buf);
        if (key == NULL) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, b, key);
    }
    return out;
python_path:
    Py_DECREF(out);
    Py_RETURN_NONE;
}
