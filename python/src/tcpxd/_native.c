/* tcpxd._native: the one pass over a request's index array that numpy cannot do in one, and the
 * local session's frame built in one step.
 *
 * vLLM's NIXL connector names a request's descriptors as region r's block c, r x K + block[c]
 * for every region r of a prepared list (docs/NIXL.md): an index array of R rows of B whose row
 * r is row 0 plus r x K. tcpxd.nixl sends such an array as that outer sum (R row bases and B
 * columns, a few KiB) instead of its 4 bytes an index, once it knows the array has that form,
 * every index in range. numpy needs a subtraction into a scratch array, a comparison and a scan
 * to know it (three passes, two of them writing); `outer` below reads the array once and writes
 * only the B columns, and `outer_fields` does both sides of a request in one call, written as the
 * request's two fields. The Python fallback (tcpxd.nixl._indices.Outer) gives the same answers;
 * the tests run both.
 *
 * `frame` joins a local-session frame (length, tag, request field, pieces) into one bytes object:
 * the prepared path's request costs one call here instead of a dozen Python statements, which
 * matter because a serving loop meets them with cold caches (docs/NIXL.md, "Python per request").
 *
 * `ring_put` writes one request in the local session's request ring (tcpxd._ring) and reads the
 * ring's `spinning` word after a sequentially consistent fence, which Python cannot make.
 *
 * `desc_rows` reads a list of descriptor tuples into their rows (NIXL's get_xfer_descs and
 * get_reg_descs of tuples: millions of them for a vLLM prepared list), as NIXL's binding does
 * in C++: a type check and three integer conversions a tuple, no Python objects made.
 *
 * `vma_kinds` asks the kernel, address by address, which kind of mapping holds each (the
 * PROCMAP_QUERY ioctl on /proc/self/maps, Linux 6.11 and later): a registration of ordinary memory
 * (anonymous or private: registered by address) needs no read of all of /proc/self/maps, whose
 * text the kernel writes for every mapping (~450 us for a few hundred). `address_entries` writes
 * a register_batch's entries for memory registered by address from each region's address and the
 * serialized rest of its request (what is the same for every region of one size), as protobuf
 * would, without a message object per region (docs/API.md, "Client host memory").
 * `vma_row` reads a registration list of one region (its N×3 rows) and checks that region's range
 * the same way in one call (docs/NIXL.md, "Session 22, the lone region in C where it counts");
 * since session 23 tcpxd.nixl's `register_memory` and `deregister_memory` of one region are each
 * one call of `Lone` (_native_lone.c, the extension's second file), which checks the range here
 * (`tcpxd_range_kind`).
 *
 * `quiet_wait` is the session reader thread's wait while a caller polls (tcpxd._session): it sleeps
 * without the GIL until the caller has not polled for `quiet` seconds, reading the time of the
 * last poll from memory the caller writes, so a tight polling loop is never asked for the GIL
 * (a Python loop would wake every `quiet` and take it, forcing a switch: the loop's thread then
 * waits for two thread wake-ups, a structural tail of 1 poll in ~130 on the H200's tight loop).
 *
 * Built as an optional extension (python/setup.py): where it cannot be compiled the package
 * works as before, and TCPXD_NATIVE=0 turns it off at run time.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

/* The loops below vectorize; where the compiler can build clones for wider vectors and the
 * loader picks one at run time (GCC on glibc), it does. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__) && !defined(TCPXD_NO_CLONES)
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

/* The size of a side's OuterIndices message (`rows` row bases and m / rows columns, u32s). */
static size_t message_size(size_t m, Py_ssize_t rows) {
    size_t rl = 4 * (size_t)rows, cl = 4 * (m / (size_t)rows);
    return 1 + varint_len(rl) + rl + 1 + varint_len(cl) + cl;
}

/* The side's OuterIndices message at `p`: rows 1 (the row bases r k - s as u32s), cols 2 (row
 * 0 + s); returns its end. */
static char *write_message(char *p, const uint64_t *a, size_t m, Py_ssize_t rows, int64_t k, int64_t s) {
    size_t b = m / (size_t)rows, rl = 4 * (size_t)rows, cl = 4 * b;
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
    return p + cl;
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
    PyObject *result;
    if (find(a, m, rows, n, &k, &s)) {
        result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)message_size(m, rows));
        if (result != NULL)
            write_message(PyBytes_AS_STRING(result), a, m, rows, k, s);
    } else {
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&v);
    return result;
}

PyDoc_STRVAR(outer_fields_doc,
"outer_fields(li, ri, lrows, ln, rrows, rn) -> bytes or None\n\n"
"When `li` and `ri` are of one length and `outer(li, lrows, ln)` and `outer(ri, rrows, rn)` both\n"
"find the form: both messages as a Write/ReadPreparedRequest's fields local_outer 8 and\n"
"remote_outer 9 (one bytes object). Else None (the remote side is not looked at when the local\n"
"one is not of the form).");

static PyObject *outer_fields(PyObject *self, PyObject *args) {
    PyObject *lobj, *robj;
    Py_ssize_t lrows, rrows;
    unsigned long long ln, rn;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOnKnK:outer_fields", &lobj, &robj, &lrows, &ln, &rrows, &rn))
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
        size_t ll = message_size(m, lrows), rl = message_size(m, rrows);
        result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(1 + varint_len(ll) + ll + 1 + varint_len(rl) + rl));
        if (result != NULL) {
            char *p = PyBytes_AS_STRING(result);
            *p++ = 0x42;
            p = put_varint(p, ll);
            p = write_message(p, la, m, lrows, lk, ls);
            *p++ = 0x4a;
            p = put_varint(p, rl);
            write_message(p, ra, m, rrows, rk, rs);
        }
    }
    PyBuffer_Release(&lv);
    PyBuffer_Release(&rv);
    return result;
}

PyDoc_STRVAR(frame_doc,
"frame(tag, key, *pieces) -> bytes\n\n"
"A local session's frame of one request: the big-endian u32 length of what follows, then the\n"
"SessionRequest's tag (field 1, the varint `tag`), `key` (the key bytes of the request's\n"
"length-delimited field), the varint length of the pieces together and the pieces (bytes)\n"
"in order.");

static PyObject *frame(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 2 || !PyLong_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "frame(tag: int, key: bytes, *pieces: bytes)");
        return NULL;
    }
    unsigned long long tag = PyLong_AsUnsignedLongLong(args[0]);
    if (tag == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    size_t body = 0;
    for (Py_ssize_t i = 2; i < nargs; i++) {
        if (!PyBytes_Check(args[i])) {
            PyErr_Format(PyExc_TypeError, "frame: piece %zd is %.100s, not bytes", i - 2, Py_TYPE(args[i])->tp_name);
            return NULL;
        }
        body += (size_t)PyBytes_GET_SIZE(args[i]);
    }
    size_t kl = (size_t)PyBytes_GET_SIZE(args[1]);
    size_t inner = 1 + varint_len((size_t)tag) + kl + varint_len(body) + body;
    if (inner > 0xffffffffu) {
        PyErr_SetString(PyExc_OverflowError, "frame: over 4 GiB");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 + inner));
    if (out == NULL)
        return NULL;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    p[0] = (unsigned char)(inner >> 24);
    p[1] = (unsigned char)(inner >> 16);
    p[2] = (unsigned char)(inner >> 8);
    p[3] = (unsigned char)inner;
    char *q = (char *)p + 4;
    *q++ = 0x08;
    q = put_varint(q, (size_t)tag);
    memcpy(q, PyBytes_AS_STRING(args[1]), kl);
    q += kl;
    q = put_varint(q, body);
    for (Py_ssize_t i = 2; i < nargs; i++) {
        size_t n = (size_t)PyBytes_GET_SIZE(args[i]);
        memcpy(q, PyBytes_AS_STRING(args[i]), n);
        q += n;
    }
    return out;
}

static const char desc_rows_doc[] =
    "desc_rows(descs, width, /) -> Optional[bytearray]\n\n"
    "The rows (address, length, device id) of a list of `width`-tuples whose first three fields are\n"
    "ints in [0, 2**64), packed as native u64s; None if any element is not such a tuple (the caller\n"
    "then says which).";

static PyObject *desc_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *list;
    int width;
    if (!PyArg_ParseTuple(args, "O!i", &PyList_Type, &list, &width))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (width < 3 || n > PY_SSIZE_T_MAX / 24)
        Py_RETURN_NONE;
    PyObject *out = PyByteArray_FromStringAndSize(NULL, n * 24);
    if (out == NULL)
        return NULL;
    uint64_t *p = (uint64_t *)PyByteArray_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(list, i);
        if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != width)
            goto refuse;
        for (int k = 0; k < 3; k++) {
            PyObject *v = PyTuple_GET_ITEM(t, k);
            if (!PyLong_CheckExact(v))
                goto refuse;
            unsigned long long x = PyLong_AsUnsignedLongLong(v);
            if (x == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                goto refuse;
            }
            p[i * 3 + k] = (uint64_t)x;
        }
    }
    return out;
refuse:
    Py_DECREF(out);
    Py_RETURN_NONE;
}

/* The kernel's struct procmap_query (include/uapi/linux/fs.h, Linux 6.11), spelled out here so
 * that the extension builds against older headers; a kernel without the ioctl answers ENOTTY. */
struct tcpxd_procmap_query {
    uint64_t size;
    uint64_t query_flags;
    uint64_t query_addr;
    uint64_t vma_start;
    uint64_t vma_end;
    uint64_t vma_flags;
    uint64_t vma_page_size;
    uint64_t vma_offset;
    uint64_t inode;
    uint32_t dev_major;
    uint32_t dev_minor;
    uint32_t vma_name_size;
    uint32_t build_id_size;
    uint64_t vma_name_addr;
    uint64_t build_id_addr;
};
#define TCPXD_PROCMAP_QUERY _IOWR('f', 17, struct tcpxd_procmap_query)
#define TCPXD_PROCMAP_VMA_SHARED 0x08

static const char vma_kinds_doc[] =
    "vma_kinds(addrs, /) -> bytes\n\n"
    "Per address of `addrs` (a buffer of native u64s), the kind of mapping of this process that\n"
    "holds it: 0 anonymous or private (memory registered by address), 1 a shared mapping of a file\n"
    "(the caller looks it up in /proc/self/maps), 2 none. Raises OSError where the kernel has no\n"
    "PROCMAP_QUERY (before Linux 6.11: ENOTTY or EINVAL).";

/* /proc/self/maps opened once per process, asked without a check a query (each system call
 * costs ~0.3-0.9 us on a VM, more than the query): a query that fails on it checks then whether
 * the number is still that file (closed under us, its number reused: not ours) and opens it again.
 * A forked child forgets it (pthread_atfork: an inherited one names the parent's memory) and opens
 * its own; an inherited or stolen number is left alone: not this process's to close. Read and
 * replaced only with the GIL held (a forked child runs its handler before any Python code). */
static int maps_fd = -1;
static struct stat maps_st;
static int maps_atfork = 0;

static void maps_forget(void) {
    maps_fd = -1;
}

/* Whether maps_fd is still the file opened. */
static int maps_fd_ours(void) {
    struct stat st;
    return maps_fd >= 0 && fstat(maps_fd, &st) == 0 && st.st_dev == maps_st.st_dev && st.st_ino == maps_st.st_ino;
}

/* This process's descriptor of /proc/self/maps, opened (again): 0, or the errno. */
static int maps_fd_open(void) {
    if (!maps_atfork) {
        int e = pthread_atfork(NULL, NULL, maps_forget);
        if (e != 0)
            return e;
        maps_atfork = 1;
    }
    maps_fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    if (maps_fd < 0 || fstat(maps_fd, &maps_st) != 0) {
        int e = errno;
        maps_fd = -1;
        return e;
    }
    return 0;
}

/* One PROCMAP_QUERY of the mapping covering `a`: 0, ENOENT (none) or the ioctl's errno. */
static int vma_at(int fd, uint64_t a, struct tcpxd_procmap_query *q) {
    memset(q, 0, sizeof *q);
    q->size = sizeof *q;
    q->query_addr = a;
    return ioctl(fd, TCPXD_PROCMAP_QUERY, q) != 0 ? errno : 0;
}

/* vma_at on this process's /proc/self/maps, opened at the first query and again where a query
 * fails on a number that is no longer that file. */
static int vma_query(uint64_t a, struct tcpxd_procmap_query *q) {
    int e = maps_fd >= 0 ? vma_at(maps_fd, a, q) : EBADF;
    if (e == 0 || e == ENOENT || (maps_fd >= 0 && maps_fd_ours()))
        return e;
    e = maps_fd_open();
    return e ? e : vma_at(maps_fd, a, q);
}

static PyObject *vma_kinds(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer v;
    if (!PyArg_ParseTuple(args, "y*", &v))
        return NULL;
    if (v.len % 8) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "vma_kinds: addrs is not a buffer of u64s");
        return NULL;
    }
    size_t n = (size_t)v.len / 8;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n);
    if (out == NULL) {
        PyBuffer_Release(&v);
        return NULL;
    }
    unsigned char *k = (unsigned char *)PyBytes_AS_STRING(out);
    int err = 0;
    /* With the GIL held: the queries share one open file, whose state the kernel may keep
     * between them (its lock context), so two threads never query it at once. */
    for (size_t i = 0; err == 0 && i < n; i++) {
        uint64_t a;
        memcpy(&a, (const char *)v.buf + i * 8, 8);
        struct tcpxd_procmap_query q;
        int e = vma_query(a, &q);
        if (e == ENOENT) {
            k[i] = 2;
            continue;
        }
        if (e) {
            err = e;
            break;
        }
        k[i] = (q.inode != 0 && (q.vma_flags & TCPXD_PROCMAP_VMA_SHARED)) ? 1 : 0;
    }
    PyBuffer_Release(&v);
    if (err) {
        Py_DECREF(out);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return out;
}

static const char vma_ranges_doc[] =
    "vma_ranges(addrs, sizes, /) -> bytes\n\n"
    "Per region i of `addrs` and `sizes` (buffers of native u64s, one each a region), what the\n"
    "daemon would find of it registered by address: 0 every byte mapped and writable, the first\n"
    "in an anonymous or private mapping (registered by address); 1 the first byte in a shared\n"
    "mapping of a file (handed over by descriptor: not checked further); 2 the first byte not\n"
    "mapped; 3 a hole inside the range; 4 a mapping under it not writable. Raises OSError where\n"
    "the kernel has no PROCMAP_QUERY (before Linux 6.11: ENOTTY or EINVAL).";

#define TCPXD_PROCMAP_VMA_WRITABLE 0x02

/* What registering [a, a + len) by address would find (vma_ranges' kinds) into *kind: 0, or the
 * errno of a query that failed. */
static int range_kind(uint64_t a, uint64_t len, unsigned char *kind) {
    uint64_t end = a + len < a ? UINT64_MAX : a + len;
    struct tcpxd_procmap_query q;
    int e = vma_query(a, &q);
    if (e == ENOENT) {
        *kind = 2;
        return 0;
    }
    if (e)
        return e;
    if (q.inode != 0 && (q.vma_flags & TCPXD_PROCMAP_VMA_SHARED)) {
        *kind = 1;
        return 0;
    }
    for (;;) {
        if (!(q.vma_flags & TCPXD_PROCMAP_VMA_WRITABLE)) {
            *kind = 4;
            return 0;
        }
        if (q.vma_end >= end) {
            *kind = 0;
            return 0;
        }
        uint64_t next = q.vma_end;
        e = vma_query(next, &q);
        if (e == ENOENT || (e == 0 && q.vma_start != next)) {
            *kind = 3;
            return 0;
        }
        if (e)
            return e;
    }
}

/* range_kind for _native_lone.c (Lone.hold). */
int tcpxd_range_kind(uint64_t a, uint64_t len, unsigned char *kind) {
    return range_kind(a, len, kind);
}

static PyObject *vma_ranges(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer v, s;
    if (!PyArg_ParseTuple(args, "y*y*", &v, &s))
        return NULL;
    if (v.len % 8 || v.len != s.len) {
        PyBuffer_Release(&v);
        PyBuffer_Release(&s);
        PyErr_SetString(PyExc_ValueError, "vma_ranges: addrs and sizes are not two buffers of as many u64s");
        return NULL;
    }
    size_t n = (size_t)v.len / 8;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n);
    if (out == NULL) {
        PyBuffer_Release(&v);
        PyBuffer_Release(&s);
        return NULL;
    }
    unsigned char *k = (unsigned char *)PyBytes_AS_STRING(out);
    int err = 0;
    /* With the GIL held, as vma_kinds. */
    for (size_t i = 0; err == 0 && i < n; i++) {
        uint64_t a, len;
        memcpy(&a, (const char *)v.buf + i * 8, 8);
        memcpy(&len, (const char *)s.buf + i * 8, 8);
        err = range_kind(a, len, &k[i]);
    }
    PyBuffer_Release(&v);
    PyBuffer_Release(&s);
    if (err) {
        Py_DECREF(out);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return out;
}

static const char vma_row_doc[] =
    "vma_row(rows, /) -> Optional[tuple[int, int, int, int]]\n\n"
    "A registration list of one region in one call: (address, length, device id, kind) of `rows`\n"
    "(a C-contiguous buffer of three native u64s, the list's one row), `kind` as vma_ranges finds\n"
    "the range; None where `rows` is not that. Raises OSError where the kernel has no PROCMAP_QUERY.";

static PyObject *vma_row(PyObject *self, PyObject *rows) {
    (void)self;
    Py_buffer v;
    if (PyObject_GetBuffer(rows, &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    const char *f = v.format != NULL ? v.format : "B";
    size_t fl = strlen(f);
    if (v.len != 24 || v.itemsize != 8 || fl == 0 || (f[fl - 1] != 'Q' && f[fl - 1] != 'L') ||
        (fl > 1 && f[0] != '<' && f[0] != '=' && f[0] != '@')) {
        PyBuffer_Release(&v);
        Py_RETURN_NONE;
    }
    uint64_t r[3];
    memcpy(r, v.buf, 24);
    PyBuffer_Release(&v);
    unsigned char kind = 0;
    int err = range_kind(r[0], r[1], &kind);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("(KKKi)", (unsigned long long)r[0], (unsigned long long)r[1], (unsigned long long)r[2],
                         (int)kind);
}

static const char address_entries_doc[] =
    "address_entries(addrs, tails, entry_key, inner_key, /) -> bytes\n\n"
    "A RegisterBatchRequest's entries of memory registered by address: per region i, `entry_key`,\n"
    "the entry's length, `inner_key`, the request's length, its field 1 (the u64 addrs[i], a varint)\n"
    "and tails[i] (the rest of the serialized RegisterClientMemoryRequest: size, label, lists).";

static PyObject *address_entries(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer v;
    PyObject *tails;
    const char *ek, *ik;
    Py_ssize_t ekl, ikl;
    if (!PyArg_ParseTuple(args, "y*O!y#y#", &v, &PyList_Type, &tails, &ek, &ekl, &ik, &ikl))
        return NULL;
    size_t n = (size_t)v.len / 8;
    if (v.len % 8 || (size_t)PyList_GET_SIZE(tails) != n) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "address_entries: one tail per u64 address is needed");
        return NULL;
    }
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(tails, (Py_ssize_t)i);
        if (!PyBytes_Check(t)) {
            PyBuffer_Release(&v);
            PyErr_Format(PyExc_TypeError, "address_entries: tail %zu is not bytes", i);
            return NULL;
        }
        uint64_t a;
        memcpy(&a, (const char *)v.buf + i * 8, 8);
        size_t inner = 1 + varint_len((size_t)a) + (size_t)PyBytes_GET_SIZE(t);
        size_t entry = (size_t)ikl + varint_len(inner) + inner;
        total += (size_t)ekl + varint_len(entry) + entry;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (out == NULL) {
        PyBuffer_Release(&v);
        return NULL;
    }
    char *p = PyBytes_AS_STRING(out);
    for (size_t i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(tails, (Py_ssize_t)i);
        size_t tl = (size_t)PyBytes_GET_SIZE(t);
        uint64_t a;
        memcpy(&a, (const char *)v.buf + i * 8, 8);
        size_t inner = 1 + varint_len((size_t)a) + tl;
        size_t entry = (size_t)ikl + varint_len(inner) + inner;
        memcpy(p, ek, (size_t)ekl);
        p = put_varint(p + ekl, entry);
        memcpy(p, ik, (size_t)ikl);
        p = put_varint(p + ikl, inner);
        *p++ = 0x08;
        p = put_varint(p, (size_t)a);
        memcpy(p, PyBytes_AS_STRING(t), tl);
        p += tl;
    }
    PyBuffer_Release(&v);
    return out;
}

PyDoc_STRVAR(ring_put_doc,
"ring_put(mem, at, k, before, frame) -> int\n\n"
"Puts a local-session frame's request (`frame` without its 4-byte length) in the request ring's\n"
"slot at byte offset `at` of `mem` (a writable buffer: the ring's mapping) as entry `k`, saying\n"
"`before` socket frames came first: its length and `before`, the bytes, then `k` (a release\n"
"store); then, after a sequentially consistent fence, reads the ring's `spinning` word (byte 8)\n"
"and returns it (0: ring the doorbell). The caller has checked that the slot is free and the\n"
"request fits (tcpxd._ring; crates/tcpxd/src/api/local/ring.rs).");

static PyObject *ring_put(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5 || !PyBytes_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "ring_put(mem, at: int, k: int, before: int, frame: bytes)");
        return NULL;
    }
    Py_ssize_t at = PyLong_AsSsize_t(args[1]);
    unsigned long long k = PyLong_AsUnsignedLongLong(args[2]);
    unsigned long long before = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    Py_ssize_t n = PyBytes_GET_SIZE(args[4]) - 4;
    Py_buffer v;
    if (PyObject_GetBuffer(args[0], &v, PyBUF_WRITABLE) < 0)
        return NULL;
    if (n < 0 || at < 64 || (at & 7) != 0 || at + 32 + n > v.len) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "ring_put: the slot is outside the ring");
        return NULL;
    }
    char *slot = (char *)v.buf + at;
    uint64_t len = (uint64_t)n, b = (uint64_t)before;
    memcpy(slot + 8, &len, 8);
    memcpy(slot + 16, &b, 8);
    memcpy(slot + 32, PyBytes_AS_STRING(args[4]) + 4, (size_t)n);
    __atomic_store_n((uint64_t *)slot, (uint64_t)k, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint64_t spinning = __atomic_load_n((uint64_t *)((char *)v.buf + 8), __ATOMIC_RELAXED);
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLongLong(spinning);
}

PyDoc_STRVAR(notif_put_doc,
"notif_put(mem, at, limit, k, before, tag, head, msg, name, tail) -> int\n\n"
"tcpxd.nixl's send_notif in one call (session 33, rt3): writes the local-session request\n"
"`SessionRequest{tag: tag, write: WriteRequest}` whose WriteRequest is `head` (the mailbox\n"
"entry and the notification's field key), the notification's length (a varint of\n"
"len(name) + len(msg)), `name` (its frame's agent names), `msg` and `tail` (the timeout) -\n"
"the bytes tcpxd._ring's `put` would take from Python's concatenations - straight into the\n"
"request ring's slot at `at` as entry `k` (`before` socket frames first), as `ring_put` does,\n"
"and returns the ring's `spinning` word after the fence. Returns -1, writing nothing, when the\n"
"request is longer than `limit` bytes (the slot's room: the caller sends it another way).");

static PyObject *notif_put(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 10 || !PyBytes_Check(args[6]) || !PyBytes_Check(args[7]) || !PyBytes_Check(args[8]) ||
        !PyBytes_Check(args[9])) {
        PyErr_SetString(PyExc_TypeError,
                        "notif_put(mem, at: int, limit: int, k: int, before: int, tag: int, head: bytes, "
                        "msg: bytes, name: bytes, tail: bytes)");
        return NULL;
    }
    Py_ssize_t at = PyLong_AsSsize_t(args[1]);
    Py_ssize_t limit = PyLong_AsSsize_t(args[2]);
    unsigned long long k = PyLong_AsUnsignedLongLong(args[3]);
    unsigned long long before = PyLong_AsUnsignedLongLong(args[4]);
    unsigned long long tag = PyLong_AsUnsignedLongLong(args[5]);
    if (PyErr_Occurred())
        return NULL;
    size_t hl = (size_t)PyBytes_GET_SIZE(args[6]), ml = (size_t)PyBytes_GET_SIZE(args[7]);
    size_t nl = (size_t)PyBytes_GET_SIZE(args[8]), tl = (size_t)PyBytes_GET_SIZE(args[9]);
    size_t note = nl + ml;
    size_t body = hl + varint_len(note) + nl + ml + tl;
    size_t n = 1 + varint_len((size_t)tag) + 1 + varint_len(body) + body;
    if (limit < 0 || n > (size_t)limit)
        return PyLong_FromLong(-1);
    Py_buffer v;
    if (PyObject_GetBuffer(args[0], &v, PyBUF_WRITABLE) < 0)
        return NULL;
    if (at < 64 || (at & 7) != 0 || (size_t)at + 32 + n > (size_t)v.len) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "notif_put: the slot is outside the ring");
        return NULL;
    }
    char *slot = (char *)v.buf + at;
    char *p = slot + 32;
    *p++ = 0x08; /* SessionRequest.tag = 1 */
    p = put_varint(p, (size_t)tag);
    *p++ = 0x12; /* SessionRequest.write = 2 */
    p = put_varint(p, body);
    memcpy(p, PyBytes_AS_STRING(args[6]), hl);
    p += hl;
    p = put_varint(p, note);
    memcpy(p, PyBytes_AS_STRING(args[8]), nl);
    p += nl;
    memcpy(p, PyBytes_AS_STRING(args[7]), ml);
    p += ml;
    memcpy(p, PyBytes_AS_STRING(args[9]), tl);
    uint64_t len = (uint64_t)n, b = (uint64_t)before;
    memcpy(slot + 8, &len, 8);
    memcpy(slot + 16, &b, 8);
    __atomic_store_n((uint64_t *)slot, (uint64_t)k, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint64_t spinning = __atomic_load_n((uint64_t *)((char *)v.buf + 8), __ATOMIC_RELAXED);
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLongLong(spinning);
}


PyDoc_STRVAR(quiet_wait_doc,
"quiet_wait(polled, quiet) -> None\n\n"
"Sleeps, the GIL released, until CLOCK_MONOTONIC (time.monotonic()'s clock) has passed\n"
"`polled[0] + quiet`, where `polled` is a writable buffer of one double (an array('d')) that\n"
"other threads may move on meanwhile (read again after each sleep; an aligned 8-byte load).\n"
"Returns at once when that time has passed already.");

static PyObject *quiet_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "quiet_wait(polled: array('d'), quiet: float)");
        return NULL;
    }
    double quiet = PyFloat_AsDouble(args[1]);
    if (quiet == -1.0 && PyErr_Occurred())
        return NULL;
    Py_buffer v;
    if (PyObject_GetBuffer(args[0], &v, PyBUF_WRITABLE) < 0)
        return NULL;
    if (v.len < (Py_ssize_t)sizeof(double) || ((uintptr_t)v.buf & 7) != 0) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "quiet_wait: polled must hold one aligned double");
        return NULL;
    }
    volatile double *at = (volatile double *)v.buf;
    /* (the buffer stays exported until released below: the array cannot be resized meanwhile) */
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        double until = *at + quiet;
        double t = (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
        if (!(until > t))
            break;
        double d = until - t;
        if (d > 1.0)
            d = 1.0;
        struct timespec nap = {(time_t)d, (long)((d - (double)(time_t)d) * 1e9)};
        nanosleep(&nap, NULL);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"vma_kinds", vma_kinds, METH_VARARGS, vma_kinds_doc},
    {"vma_ranges", vma_ranges, METH_VARARGS, vma_ranges_doc},
    {"vma_row", vma_row, METH_O, vma_row_doc},
    {"address_entries", address_entries, METH_VARARGS, address_entries_doc},
    {"desc_rows", desc_rows, METH_VARARGS, desc_rows_doc},
    {"outer", outer, METH_VARARGS, outer_doc},
    {"outer_fields", outer_fields, METH_VARARGS, outer_fields_doc},
    {"frame", (PyCFunction)(void (*)(void))frame, METH_FASTCALL, frame_doc},
    {"ring_put", (PyCFunction)(void (*)(void))ring_put, METH_FASTCALL, ring_put_doc},
    {"notif_put", (PyCFunction)(void (*)(void))notif_put, METH_FASTCALL, notif_put_doc},
    {"quiet_wait", (PyCFunction)(void (*)(void))quiet_wait, METH_FASTCALL, quiet_wait_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tcpxd._native", "The NIXL agent's index pass (see outer), its descriptor rows (desc_rows), the local session's frame and the registration of memory by address (vma_kinds, vma_ranges, vma_row, address_entries, Lone).", -1, methods,
    NULL, NULL, NULL, NULL,
};

int tcpxd_lone_add(PyObject *module); /* _native_lone.c */

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && tcpxd_lone_add(m) < 0)
        Py_CLEAR(m);
    return m;
}
