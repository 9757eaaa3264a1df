/* tcpxd._native: the one pass over a request's index array that numpy cannot do in one.
 *
 * vLLM's NIXL connector names a request's descriptors as region r's block c, r x K + block[c]
 * for every region r of a prepared list (docs/NIXL.md): an index array of R rows of B whose row
 * r is row 0 plus r x K. tcpxd.nixl sends such an array as that outer sum (R row bases and B
 * columns, a few KiB) instead of its 4 bytes an index, once it knows the array has that form,
 * every index in range. numpy needs a subtraction into a scratch array, a comparison and a scan
 * to know it (three passes, two of them writing); `outer` below reads the array once and writes
 * only the B columns. The Python fallback (tcpxd.nixl._plan.Outer) gives the same answers; the
 * tests run both.
 *
 * Built as an optional extension (python/setup.py): where it cannot be compiled the package
 * works as before, and TCPXD_NATIVE=0 turns it off at run time.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

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
 * little-endian; a big-endian build refuses in `outer`). */
TCPXD_CLONES static void cols_pack(const uint64_t *a, size_t b, uint64_t s, uint32_t *out) {
    for (size_t j = 0; j < b; j++)
        out[j] = (uint32_t)(a[j] + s);
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

PyDoc_STRVAR(outer_doc,
"outer(a, rows, n) -> (k, s, cols) or None\n\n"
"`a`: a C-contiguous 1-D buffer of 8-byte integers (numpy int64 or uint64); anything else\n"
"(another type, strides, fewer than 2 rows) is None.\n"
"When it is `rows` rows of B = len(a) / rows whose row r is row 0 plus r * k, with every\n"
"index in [0, n): k, the shift s = min(0, (rows - 1) * k) that lifts the row bases to 0, and\n"
"the B columns a[:B] + s as little-endian u32 bytes (so index r * B + c is\n"
"(r * k - s) + cols[c]). Else None. n must be at most 2**32.");

static PyObject *outer(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t rows;
    unsigned long long n;
    (void)self;
    if (!PyArg_ParseTuple(args, "OnK:outer", &obj, &rows, &n))
        return NULL;
#if PY_BIG_ENDIAN
    Py_RETURN_NONE;
#endif
    Py_buffer v;
    if (PyObject_GetBuffer(obj, &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear(); /* not contiguous, or not a buffer: not of the form */
        Py_RETURN_NONE;
    }
    PyObject *result = NULL;
    size_t m = (size_t)(v.len / 8);
    if (!is_int64(v.format) || v.itemsize != 8 || v.ndim != 1 || rows < 2 || m < 2 || m % (size_t)rows || n == 0 || n > (1ULL << 32)) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    const uint64_t *a = (const uint64_t *)v.buf;
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
    if (!in_range || !rows_step(a, m, b, (uint64_t)k)) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    int64_t s = k < 0 ? (int64_t)span * k : 0;
    PyObject *cols = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 * b));
    if (cols == NULL)
        goto done;
    cols_pack(a, b, (uint64_t)s, (uint32_t *)PyBytes_AS_STRING(cols));
    result = Py_BuildValue("(LLN)", (long long)k, (long long)s, cols);
done:
    PyBuffer_Release(&v);
    return result;
}

static PyMethodDef methods[] = {
    {"outer", outer, METH_VARARGS, outer_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tcpxd._native", "The NIXL agent's index pass (see outer).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    return PyModule_Create(&module);
}
