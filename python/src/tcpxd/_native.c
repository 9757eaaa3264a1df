/* tcpxd._native: the one pass over a request's index array that numpy cannot do in one.
 *
 * vLLM's NIXL connector names a request's descriptors as region r's block c, r x K + block[c]
 * for every region r of a prepared list (docs/NIXL.md): an index array of R rows of B whose row
 * r is row 0 plus r x K. tcpxd.nixl sends such an array as that outer sum (R row bases and B
 * columns, a few KiB) instead of its 4 bytes an index, once it knows the array has that form,
 * every index in range. numpy needs a subtraction into a scratch array, a comparison and a scan
 * to know it (three passes, two of them writing); `outer` below reads the array once and writes
 * only the B columns, and `outer_pair` does both sides of a request in one call. The Python
 * fallback (tcpxd.nixl._indices.Outer) gives the same answers; the tests run both.
 *
 * Built as an optional extension (python/setup.py): where it cannot be compiled the package
 * works as before, and TCPXD_NATIVE=0 turns it off at run time.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The loops below vectorize; where the compiler can build clones for wider vectors and the
 * loader picks one at run time (GCC on glibc), it does. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__)
#define TCPXD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TCPXD_CLONES
#endif

/* Whether a[i] - a[i - b] == k (modulo 2^64) for every i in [b, m): stretches of 4096 ORed
 * together, stopping after the first stretch that differs. */
TCPXD_CLONES static int rows_step(const uint64_t *a, size_t m, size_t b, uint64_t k) {
    size_t i = b;
    while (i < m) {
        size_t end = m - i > 4096 ? i + 4096 : m;
        uint64_t bad = 0;
        for (; i < end; i++)
            bad |= (a[i] - a[i - b]) ^ k;
        if (bad)
            return 0;
    }
    return 1;
}

/* The largest and smallest of a[0..b), read unsigned. */
TCPXD_CLONES static void cols_span(const uint64_t *a, size_t b, uint64_t *top, uint64_t *low) {
    uint64_t hi = 0, lo = UINT64_MAX;
    for (size_t j = 0; j < b; j++) {
        hi = a[j] > hi ? a[j] : hi;
        lo = a[j] < lo ? a[j] : lo;
    }
    *top = hi;
    *low = lo;
}

/* a[0..b) + s as little-endian u32s (x86_64 and every target CPython's wheels cover are
 * little-endian; a big-endian build refuses in `outer`), at `out`, which need not be aligned
 * (the columns follow a message's varints): each stored by memcpy. */
TCPXD_CLONES static void cols_pack(const uint64_t *a, size_t b, uint64_t s, unsigned char *out) {
    for (size_t j = 0; j < b; j++) {
        uint32_t v = (uint32_t)(a[j] + s);
        memcpy(out + 4 * j, &v, 4);
    }
}

/* Whether a buffer's struct format is a native or little-endian 8-byte integer (numpy int64 /
 * uint64: "l", "q", "L", "Q", maybe after "=", "<" or "@"). */
static int is_int64(const char *f) {
    if (f == NULL)
        return 0;
    if (*f == '=' || *f == '<' || *f == '@')
        f++;
    return (f[0] == 'q' || f[0] == 'Q' || f[0] == 'l' || f[0] == 'L') && f[1] == '\0';
}

/* One side found: its step k and shift s, when `a` (m 8-byte integers) is `rows` rows of the
 * form with every index in [0, n). */
static int find(const uint64_t *a, size_t m, Py_ssize_t rows, unsigned long long n, int64_t *kp, int64_t *sp) {
    if (rows < 2 || m < 2 || m % (size_t)rows || n == 0 || n > (1ULL << 32))
        return 0;
    size_t b = m / (size_t)rows;
    /* Row 0 is in [0, n) (read unsigned: a negative index is above any n). */
    uint64_t top, low;
    cols_span(a, b, &top, &low);
    int64_t k = (int64_t)(a[b] - a[0]);
    uint64_t span = (uint64_t)(rows - 1);
    int in_range;
    if (top >= n || k <= -(int64_t)n || k >= (int64_t)n || (uint64_t)(a[m - 1] - a[m - 1 - b]) != (uint64_t)k)
        in_range = 0; /* (the look at the last row turns most other arrays away) */
    else if (k >= 0) /* the last row's largest index, top + (rows - 1) k, below n */
        in_range = k == 0 || (uint64_t)k <= (n - 1 - top) / span;
    else /* the last row's smallest, low + (rows - 1) k, at least 0 */
        in_range = (uint64_t)(-k) <= low / span;
    if (!in_range || !rows_step(a, m, b, (uint64_t)k))
        return 0;
    *kp = k;
    *sp = k < 0 ? (int64_t)span * k : 0;
    return 1;
}

static size_t varint_len(size_t v) {
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static char *put_varint(char *p, size_t v) {
    while (v >= 0x80) {
        *p++ = (char)(v | 0x80);
        v >>= 7;
    }
    *p++ = (char)v;
    return p;
}

/* The side's OuterIndices message: rows 1 (the row bases r k - s as u32s), cols 2 (row 0 + s). */
static PyObject *message(const uint64_t *a, size_t m, Py_ssize_t rows, int64_t k, int64_t s) {
    size_t b = m / (size_t)rows, rl = 4 * (size_t)rows, cl = 4 * b;
    size_t size = 1 + varint_len(rl) + rl + 1 + varint_len(cl) + cl;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (out == NULL)
        return NULL;
    char *p = PyBytes_AS_STRING(out);
    *p++ = 0x0a;
    p = put_varint(p, rl);
    for (Py_ssize_t r = 0; r < rows; r++) {
        uint32_t base = (uint32_t)((uint64_t)r * (uint64_t)k - (uint64_t)s);
        memcpy(p, &base, 4);
        p += 4;
    }
    *p++ = 0x12;
    p = put_varint(p, cl);
    cols_pack(a, b, (uint64_t)s, (unsigned char *)p);
    return out;
}

/* `obj` as C-contiguous 8-byte integers in `v` (released by the caller), or 0 (no exception). */
static int int64s(PyObject *obj, Py_buffer *v) {
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear(); /* not contiguous, or not a buffer: not of the form */
        return 0;
    }
    if (!is_int64(v->format) || v->itemsize != 8 || v->ndim != 1) {
        PyBuffer_Release(v);
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(outer_doc,
"outer(a, rows, n) -> bytes or None\n\n"
"`a`: a C-contiguous 1-D buffer of 8-byte integers (numpy int64 or uint64); anything else\n"
"(another type, strides, fewer than 2 rows) is None. When it is `rows` rows of\n"
"B = len(a) / rows whose row r is row 0 plus r * k, with every index in [0, n) (n at most\n"
"2**32): its tcpxd.v1.OuterIndices message, rows the row bases r * k - s and cols row 0 + s\n"
"as little-endian u32s, s = min(0, (rows - 1) * k) lifting the bases to 0. Else None.");

static PyObject *outer(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t rows;
    unsigned long long n;
    (void)self;
    if (!PyArg_ParseTuple(args, "OnK:outer", &obj, &rows, &n))
        return NULL;
    Py_buffer v;
    int64_t k, s;
    if (PY_BIG_ENDIAN || !int64s(obj, &v))
        Py_RETURN_NONE;
    const uint64_t *a = (const uint64_t *)v.buf;
    size_t m = (size_t)(v.len / 8);
    PyObject *result = find(a, m, rows, n, &k, &s) ? message(a, m, rows, k, s) : (Py_INCREF(Py_None), Py_None);
    PyBuffer_Release(&v);
    return result;
}

/* Both messages as a prepared request's fields local_outer 8 and remote_outer 9. */
static PyObject *request_fields(PyObject *lo, PyObject *ro) {
    size_t ll = (size_t)PyBytes_GET_SIZE(lo), rl = (size_t)PyBytes_GET_SIZE(ro);
    size_t size = 1 + varint_len(ll) + ll + 1 + varint_len(rl) + rl;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (out == NULL)
        return NULL;
    char *p = PyBytes_AS_STRING(out);
    *p++ = 0x42;
    p = put_varint(p, ll);
    memcpy(p, PyBytes_AS_STRING(lo), ll);
    p += ll;
    *p++ = 0x4a;
    p = put_varint(p, rl);
    memcpy(p, PyBytes_AS_STRING(ro), rl);
    return out;
}

PyDoc_STRVAR(outer_pair_doc,
"outer_pair(li, ri, lrows, ln, rrows, rn) -> (bytes, bytes, bytes) or None\n\n"
"`outer(li, lrows, ln)` and `outer(ri, rrows, rn)` when both are of the form and of one\n"
"length, and both as a Write/ReadPreparedRequest's fields local_outer 8 and remote_outer 9;\n"
"else None (the remote side is not looked at when the local one is not of it).");

static PyObject *outer_pair(PyObject *self, PyObject *args) {
    PyObject *lobj, *robj;
    Py_ssize_t lrows, rrows;
    unsigned long long ln, rn;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOnKnK:outer_pair", &lobj, &robj, &lrows, &ln, &rrows, &rn))
        return NULL;
    Py_buffer lv, rv;
    int64_t lk, ls, rk, rs;
    if (PY_BIG_ENDIAN || !int64s(lobj, &lv))
        Py_RETURN_NONE;
    if (!int64s(robj, &rv)) {
        PyBuffer_Release(&lv);
        Py_RETURN_NONE;
    }
    const uint64_t *la = (const uint64_t *)lv.buf, *ra = (const uint64_t *)rv.buf;
    size_t m = (size_t)(lv.len / 8);
    PyObject *result;
    if (lv.len != rv.len || !find(la, m, lrows, ln, &lk, &ls) || !find(ra, m, rrows, rn, &rk, &rs)) {
        result = Py_None;
        Py_INCREF(result);
    } else {
        PyObject *lo = message(la, m, lrows, lk, ls), *ro = lo == NULL ? NULL : message(ra, m, rrows, rk, rs);
        PyObject *fields = ro == NULL ? NULL : request_fields(lo, ro);
        result = fields == NULL ? NULL : PyTuple_Pack(3, lo, ro, fields);
        Py_XDECREF(lo);
        Py_XDECREF(ro);
        Py_XDECREF(fields);
    }
    PyBuffer_Release(&lv);
    PyBuffer_Release(&rv);
    return result;
}

static PyMethodDef methods[] = {
    {"outer", outer, METH_VARARGS, outer_doc},
    {"outer_pair", outer_pair, METH_VARARGS, outer_pair_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tcpxd._native", "The NIXL agent's index pass (see outer).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    return PyModule_Create(&module);
}
