/* tcpxd._native.Lone: tcpxd.nixl's `register_memory` and `deregister_memory` of a list of one
 * DRAM region, each in one C call (docs/NIXL.md, "Session 23, the lone region in one call").
 *
 * A lone region costs NIXL one call into C++ (~1.3-2.7 us). Here it was ~50 lines of Python a
 * region besides the kernel's check, cold in a real program as in the benchmark: the row read,
 * the check, the key, the call's record (`_memory._Sent`, 14 slots), the registrar's queue and
 * the agent's tables, each under its lock. `Lone.hold` does exactly those steps of
 * `LocalMemory`'s former `_one` in that order, and `Lone.withdraw` those of `_withdraw_one`:
 *
 * - hold(dl): `dl`'s one row (a C-contiguous 1x3 u64 array) read; its range checked by one
 *   PROCMAP_QUERY (tcpxd_range_kind, _native.c); the key ("DRAM", address, length, device).
 *   Memory by address: the size's request tail (made by `tail_for`, Python, for a size's first
 *   region, before any lock is taken); True at once where the agent has the region registered or
 *   held already (NIXL accepts it again); else a record made as `_Sent.__init__` makes it (its
 *   slots written in place: the class's member descriptors give their offsets, checked at
 *   construction), held by the registrar (`Registrar.hold`: its lock, `_closed`, `_held`), then
 *   appended to the agent's `_sent` and `_sent_keys` under the agent's lock. Memory a file
 *   backs: the record of its file (handed over at the first use), appended likewise. Anything
 *   else (more than one row, 0 bytes, a size past the 64 whose tails are kept, a range the daemon
 *   would refuse, a kernel without PROCMAP_QUERY, a closed registrar, an allocation failing)
 *   returns False with nothing changed: the caller takes the general path, which says why.
 * - withdraw(dl): the record held alone for `dl`'s one row, not sent yet, taken back from the
 *   registrar's queue and the agent's tables under `_settling` (True); False with nothing
 *   changed where it is not that (sent already, part of a larger call, a list taken whole).
 *
 * The record's class, the agent's locks and tables and the registrar are given once, at
 * construction (`LocalMemory.__init__`); the registrar's `_held` and `_closed` are read under its
 * lock at each hold (close replaces the queue). Locks are taken by calling their acquire and
 * release, as `with` does (a contended acquire lets the GIL go).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>

int tcpxd_range_kind(uint64_t a, uint64_t len, unsigned char *kind);

#if PY_VERSION_HEX < 0x030A0000 /* (Py_NewRef is 3.10's; the package supports 3.9) */
static inline PyObject *tcpxd_new_ref(PyObject *o) {
    Py_INCREF(o);
    return o;
}
#define Py_NewRef(o) tcpxd_new_ref((PyObject *)(o))
#endif

/* The record's slots, as `_memory._Sent` (and `_registrar.Pending`) name them. */
enum { F_ADDRS, F_TAILS, F_GOT, F_FRAMES, F_LOST, F_HELD, F_KEYS, F_TODO, F_BY_ADDRESS, F_SIZES, F_PENDING, F_FILES,
       F_ROWS, F_LIST_ID, NFIELDS };
static const char *const field_names[NFIELDS] = {"addrs", "tails",      "got",   "frames",  "lost",
                                                 "held",  "keys",       "todo",  "by_address", "sizes",
                                                 "pending", "files",    "rows",  "list_id"};

/* Objects the constructor takes, in its argument order. */
enum { A_CLS, A_LOCK, A_SETTLING, A_SENT, A_SENT_KEYS, A_REGIONS, A_TAILS, A_TAIL_FOR, A_REGISTRAR, A_NO_KEYS,
       A_NO_ADDRESSES, A_NO_SIZES, NARGS };
static const char *const arg_names[NARGS] = {"cls", "lock", "settling", "sent", "sent_keys", "regions", "tails",
                                             "tail_for", "registrar", "no_keys", "no_addresses", "no_sizes"};

typedef struct {
    PyObject_HEAD PyObject *a[NARGS];
    Py_ssize_t off[NFIELDS];
    /* Bound acquire / release of the agent's lock, of `_settling` and of the registrar's lock. */
    PyObject *lock_in, *lock_out, *settle_in, *settle_out, *reg_in, *reg_out;
    /* An array.array("Q") of one element (sliced for each record's `addrs`), the empty tuple. */
    PyObject *one_addr, *no_tails;
    /* Whether the kernel turned out to have no PROCMAP_QUERY (the general path from then on). */
    int no_query;
} Lone;

static PyObject *s_dram, *s_mem, *s_rows, *s_objs, *s_held_q, *s_closed, *s_append, *s_remove;

static int lone_traverse(Lone *self, visitproc visit, void *arg) {
    for (int i = 0; i < NARGS; i++)
        Py_VISIT(self->a[i]);
    Py_VISIT(self->lock_in);
    Py_VISIT(self->lock_out);
    Py_VISIT(self->settle_in);
    Py_VISIT(self->settle_out);
    Py_VISIT(self->reg_in);
    Py_VISIT(self->reg_out);
    Py_VISIT(self->one_addr);
    return 0;
}

static int lone_clear(Lone *self) {
    for (int i = 0; i < NARGS; i++)
        Py_CLEAR(self->a[i]);
    Py_CLEAR(self->lock_in);
    Py_CLEAR(self->lock_out);
    Py_CLEAR(self->settle_in);
    Py_CLEAR(self->settle_out);
    Py_CLEAR(self->reg_in);
    Py_CLEAR(self->reg_out);
    Py_CLEAR(self->one_addr);
    Py_CLEAR(self->no_tails);
    return 0;
}

static void lone_dealloc(Lone *self) {
    PyObject_GC_UnTrack(self);
    lone_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The offset of `cls`'s writable object slot `name`: 0 (an exception set) where it has none. */
static Py_ssize_t slot_offset(PyTypeObject *cls, const char *name) {
    PyObject *d = PyObject_GetAttrString((PyObject *)cls, name);
    PyErr_Clear();
    Py_ssize_t off = 0;
    if (d != NULL && Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type == T_OBJECT_EX && !(m->flags & READONLY) && m->offset > 0)
            off = m->offset;
    }
    Py_XDECREF(d);
    if (!off)
        PyErr_Format(PyExc_TypeError, "Lone: %s.%s is not a writable __slots__ slot", cls->tp_name, name);
    return off;
}

static int bound(PyObject *lock, PyObject **in, PyObject **out) {
    *in = PyObject_GetAttrString(lock, "acquire");
    *out = *in ? PyObject_GetAttrString(lock, "release") : NULL;
    return *out ? 0 : -1;
}

static PyObject *lone_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (kw != NULL && PyDict_GET_SIZE(kw)) {
        PyErr_SetString(PyExc_TypeError, "Lone takes positional arguments only");
        return NULL;
    }
    if (PyTuple_GET_SIZE(args) != NARGS) {
        PyErr_Format(PyExc_TypeError, "Lone takes %d arguments (%s, ...)", NARGS, arg_names[0]);
        return NULL;
    }
    PyObject *cls = PyTuple_GET_ITEM(args, A_CLS);
    if (!PyType_Check(cls) || !PyList_Check(PyTuple_GET_ITEM(args, A_SENT)) ||
        !PyDict_Check(PyTuple_GET_ITEM(args, A_SENT_KEYS)) || !PyDict_Check(PyTuple_GET_ITEM(args, A_REGIONS)) ||
        !PyDict_Check(PyTuple_GET_ITEM(args, A_TAILS)) || !PyCallable_Check(PyTuple_GET_ITEM(args, A_TAIL_FOR))) {
        PyErr_SetString(PyExc_TypeError, "Lone: cls a type; sent a list; sent_keys, regions, tails dicts; tail_for callable");
        return NULL;
    }
    Lone *self = (Lone *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    for (int i = 0; i < NARGS; i++)
        self->a[i] = Py_NewRef(PyTuple_GET_ITEM(args, i));
    for (int i = 0; i < NFIELDS; i++)
        if (!(self->off[i] = slot_offset((PyTypeObject *)cls, field_names[i])))
            goto fail;
    if (bound(self->a[A_LOCK], &self->lock_in, &self->lock_out) ||
        bound(self->a[A_SETTLING], &self->settle_in, &self->settle_out))
        goto fail;
    PyObject *rlock = PyObject_GetAttrString(self->a[A_REGISTRAR], "_lock");
    if (rlock == NULL)
        goto fail;
    int e = bound(rlock, &self->reg_in, &self->reg_out);
    Py_DECREF(rlock);
    if (e)
        goto fail;
    PyObject *array = PyImport_ImportModule("array");
    if (array == NULL)
        goto fail;
    self->one_addr = PyObject_CallMethod(array, "array", "s[i]", "Q", 0);
    Py_DECREF(array);
    self->no_tails = PyTuple_New(0);
    if (self->one_addr == NULL || self->no_tails == NULL)
        goto fail;
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

/* Slot i of the record `r` (fresh from tp_alloc: empty), given a new reference `v`. */
#define PUT(r, i, v) (*(PyObject **)((char *)(r) + self->off[i]) = (v))
#define GET(r, i) (*(PyObject **)((char *)(r) + self->off[i]))

/* `dl`'s one row (address, length, device) from its `rows`: 0, or -1 where `rows` is not one
 * C-contiguous row of native u64s (no exception set). */
static int one_row(PyObject *dl, uint64_t r[3]) {
    PyObject *rows = PyObject_GetAttr(dl, s_rows);
    if (rows == NULL) {
        PyErr_Clear();
        return -1;
    }
    Py_buffer v;
    int got = PyObject_GetBuffer(rows, &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT);
    Py_DECREF(rows);
    if (got != 0) {
        PyErr_Clear();
        return -1;
    }
    const char *f = v.format != NULL ? v.format : "B";
    size_t fl = strlen(f);
    int ok = v.len == 24 && v.itemsize == 8 && fl > 0 && (f[fl - 1] == 'Q' || f[fl - 1] == 'L') &&
             (fl == 1 || f[0] == '<' || f[0] == '=' || f[0] == '@');
    if (ok)
        memcpy(r, v.buf, 24);
    PyBuffer_Release(&v);
    return ok ? 0 : -1;
}

/* A call of a bound acquire or release: 0, or -1 with its exception set. */
static int call0(PyObject *f) {
    PyObject *r = PyObject_CallNoArgs(f);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* The key ("DRAM", address, length, device) of row r: a new reference, or NULL. */
static PyObject *key_of(const uint64_t r[3]) {
    PyObject *k = PyTuple_New(4);
    if (k == NULL)
        return NULL;
    PyTuple_SET_ITEM(k, 0, Py_NewRef(s_dram));
    for (int i = 0; i < 3; i++) {
        PyObject *n = PyLong_FromUnsignedLongLong(r[i]);
        if (n == NULL) {
            Py_DECREF(k);
            return NULL;
        }
        PyTuple_SET_ITEM(k, i + 1, n);
    }
    return k;
}

/* False with nothing changed, an allocation's exception dropped (the general path meets it again). */
static PyObject *not_here(void) {
    PyErr_Clear();
    Py_RETURN_FALSE;
}

static const char hold_doc[] =
    "hold(dl, /) -> bool\n\n"
    "register_memory of `dl` where it is a DRAM registration list of one region, held back as LocalMemory's\n"
    "general path holds it (by address, or by its file at the first use); True where registered\n"
    "or held already. False, nothing changed, where it is not that: the general path then.";

/* Whether `dl.mem` is "DRAM" (no exception left set). */
static int is_dram(PyObject *dl) {
    PyObject *mem = PyObject_GetAttr(dl, s_mem);
    if (mem == NULL) {
        PyErr_Clear();
        return 0;
    }
    int dram = mem == s_dram || (PyUnicode_Check(mem) && PyUnicode_Compare(mem, s_dram) == 0);
    Py_DECREF(mem);
    return dram;
}

static PyObject *lone_hold(Lone *self, PyObject *dl) {
    uint64_t r[3];
    if (self->no_query || !is_dram(dl) || one_row(dl, r) || r[1] == 0) /* (0 bytes: refused there) */
        Py_RETURN_FALSE;
    unsigned char kind = 0;
    int err = tcpxd_range_kind(r[0], r[1], &kind);
    if (err) {
        if (err == ENOTTY || err == EINVAL || err == ENOSYS)
            self->no_query = 1;
        Py_RETURN_FALSE;
    }
    if (kind > 1) /* (what the daemon would refuse: the general path says why) */
        Py_RETURN_FALSE;
    PyObject *key = key_of(r);
    if (key == NULL)
        return not_here();
    PyObject *tail = NULL, *objs = NULL, *rec = NULL, *keys = NULL, *todo = NULL, *entry = NULL, *addrs = NULL,
             *got = NULL;
    if (kind == 0) { /* by address: the size's tail, made by `tail_for` the first time (before any lock) */
        PyObject *n = PyTuple_GET_ITEM(key, 2);
        PyObject *t = PyDict_GetItemWithError(self->a[A_TAILS], n);
        if (t == NULL && !PyErr_Occurred()) {
            PyObject *made = PyObject_CallOneArg(self->a[A_TAIL_FOR], n);
            if (made == NULL)
                goto not_here;
            Py_DECREF(made);
            t = PyDict_GetItemWithError(self->a[A_TAILS], n); /* (none: not kept, over its limit) */
        }
        if (t == NULL || !PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 3)
            goto not_here;
        tail = Py_NewRef(PyTuple_GET_ITEM(t, 2));
    }
    int have = PyDict_Contains(self->a[A_REGIONS], key);
    if (have == 0)
        have = PyDict_Contains(self->a[A_SENT_KEYS], key);
    if (have) { /* (registered or held already: NIXL accepts it again) */
        Py_XDECREF(tail);
        Py_DECREF(key);
        if (have < 0)
            return not_here();
        Py_RETURN_TRUE;
    }
    objs = PyObject_GetAttr(dl, s_objs);
    if (objs == NULL || !PyList_Check(objs) || PyList_GET_SIZE(objs) != 1)
        goto not_here;
    keys = PyList_New(1);
    todo = PyDict_New();
    entry = Py_BuildValue("(iO)", 0, PyList_GET_ITEM(objs, 0));
    if (kind == 0) {
        addrs = PySequence_GetSlice(self->one_addr, 0, 1);
        got = PyList_New(1);
    } else {
        got = PyList_New(0);
    }
    rec = ((PyTypeObject *)self->a[A_CLS])->tp_alloc((PyTypeObject *)self->a[A_CLS], 0);
    if (keys == NULL || todo == NULL || entry == NULL || got == NULL || rec == NULL || (kind == 0 && addrs == NULL))
        goto not_here;
    PyList_SET_ITEM(keys, 0, Py_NewRef(key));
    if (PyDict_SetItem(todo, key, entry) < 0)
        goto not_here;

    if (kind == 0) {
        PyObject *a = PyLong_FromUnsignedLongLong(r[0]);
        if (a == NULL || PySequence_SetItem(addrs, 0, a) < 0) {
            Py_XDECREF(a);
            goto not_here;
        }
        Py_DECREF(a);
        PyList_SET_ITEM(got, 0, Py_NewRef(Py_None));
        PUT(rec, F_ADDRS, addrs);
        PUT(rec, F_TAILS, tail);
        PUT(rec, F_BY_ADDRESS, Py_NewRef(keys));
        PUT(rec, F_SIZES, Py_NewRef(self->a[A_TAILS]));
        PUT(rec, F_FILES, Py_NewRef(self->a[A_NO_KEYS]));
        PUT(rec, F_HELD, Py_NewRef(Py_True)); /* (visible to no one before the registrar holds it) */
        PUT(rec, F_PENDING, Py_NewRef(rec));
    } else {
        PUT(rec, F_ADDRS, Py_NewRef(self->a[A_NO_ADDRESSES]));
        PUT(rec, F_TAILS, Py_NewRef(self->no_tails));
        PUT(rec, F_BY_ADDRESS, Py_NewRef(self->a[A_NO_KEYS]));
        PUT(rec, F_SIZES, Py_NewRef(self->a[A_NO_SIZES]));
        PUT(rec, F_FILES, Py_NewRef(keys));
        PUT(rec, F_HELD, Py_NewRef(Py_False));
        PUT(rec, F_PENDING, Py_NewRef(Py_None));
    }
    addrs = tail = NULL;
    PUT(rec, F_GOT, got);
    got = NULL;
    PUT(rec, F_FRAMES, PyLong_FromLong(0));
    PUT(rec, F_LOST, Py_NewRef(Py_None));
    PUT(rec, F_KEYS, keys);
    keys = NULL;
    PUT(rec, F_TODO, todo);
    todo = NULL;
    PUT(rec, F_ROWS, PyBytes_FromStringAndSize(NULL, 0));
    PUT(rec, F_LIST_ID, PyLong_FromLong(0));
    if (GET(rec, F_ROWS) == NULL || GET(rec, F_FRAMES) == NULL || GET(rec, F_LIST_ID) == NULL)
        goto not_here;
    if (kind == 0) { /* Registrar.hold */
        if (call0(self->reg_in))
            goto not_here;
        PyObject *closed = PyObject_GetAttr(self->a[A_REGISTRAR], s_closed);
        int shut = closed == NULL ? -1 : PyObject_IsTrue(closed);
        Py_XDECREF(closed);
        PyObject *q = shut == 0 ? PyObject_GetAttr(self->a[A_REGISTRAR], s_held_q) : NULL;
        PyObject *done = q != NULL ? PyObject_CallMethodOneArg(q, s_append, rec) : NULL;
        Py_XDECREF(q);
        Py_XDECREF(done);
        if (call0(self->reg_out))
            goto held_already;
        if (done == NULL)
            goto not_here; /* (closed: nothing held; the general path registers it now) */
    }
    if (call0(self->lock_in))
        goto held_already;
    int bad = PyList_Append(self->a[A_SENT], rec) < 0 || PyDict_SetItem(self->a[A_SENT_KEYS], key, rec) < 0;
    if (call0(self->lock_out) || bad)
        goto held_already;
    Py_DECREF(rec);
    Py_DECREF(key);
    Py_DECREF(objs);
    Py_DECREF(entry);
    Py_RETURN_TRUE;
held_already:
    /* (the registrar holds it and the agent's tables could not take it: an allocation failed
     * with both locks free; raised, as the Python it replaces would) */
    Py_DECREF(rec);
    Py_DECREF(key);
    Py_DECREF(objs);
    Py_DECREF(entry);
    return NULL;
not_here:
    Py_XDECREF(tail);
    Py_XDECREF(objs);
    Py_XDECREF(keys);
    Py_XDECREF(todo);
    Py_XDECREF(entry);
    Py_XDECREF(addrs);
    Py_XDECREF(got);
    Py_XDECREF(rec);
    Py_DECREF(key);
    return not_here();
}

static const char withdraw_doc[] =
    "withdraw(dl, /) -> bool\n\n"
    "deregister_memory of `dl` where it is a DRAM list of one region held alone and not sent yet: taken back\n"
    "from the registrar and the agent's tables (the daemon never hears of it). False, nothing\n"
    "changed, where it is not that.";

/* The index of `x` in the list `l`, looked for from its end (a withdrawal is usually of the
 * last registration): -1 where it is not there. */
static Py_ssize_t last_index(PyObject *l, PyObject *x) {
    for (Py_ssize_t i = PyList_GET_SIZE(l) - 1; i >= 0; i--)
        if (PyList_GET_ITEM(l, i) == x)
            return i;
    return -1;
}

static PyObject *lone_withdraw(Lone *self, PyObject *dl) {
    uint64_t r[3];
    if (!is_dram(dl) || one_row(dl, r))
        Py_RETURN_FALSE;
    PyObject *key = key_of(r);
    if (key == NULL)
        return not_here();
    PyObject *sent = PyDict_GetItemWithError(self->a[A_SENT_KEYS], key); /* (borrowed) */
    if (sent == NULL || !PyObject_TypeCheck(sent, (PyTypeObject *)self->a[A_CLS])) {
        Py_DECREF(key);
        return not_here();
    }
    Py_INCREF(sent);
    PyObject *keys = GET(sent, F_KEYS), *list_id = GET(sent, F_LIST_ID), *pending = GET(sent, F_PENDING);
    int alone = keys != NULL && PyList_Check(keys) && PyList_GET_SIZE(keys) == 1 && list_id != NULL &&
                PyLong_Check(list_id) && PyLong_AsLong(list_id) == 0 && pending != NULL;
    PyObject *out = Py_False;
    if (!alone || call0(self->settle_in))
        goto done;
    if (PyDict_GetItemWithError(self->a[A_SENT_KEYS], key) != sent) /* (folded meanwhile) */
        goto settled;
    if (pending != Py_None) { /* Registrar.withdraw */
        if (!PyObject_TypeCheck(pending, (PyTypeObject *)self->a[A_CLS]) || call0(self->reg_in))
            goto settled;
        PyObject *held = GET(pending, F_HELD);
        int taken = 0;
        if (held == Py_True) {
            PyObject *q = PyObject_GetAttr(self->a[A_REGISTRAR], s_held_q);
            PyObject *res = q != NULL ? PyObject_CallMethodOneArg(q, s_remove, pending) : NULL;
            Py_XDECREF(q);
            if (res != NULL) {
                Py_DECREF(res);
                Py_SETREF(GET(pending, F_HELD), Py_NewRef(Py_False));
                taken = 1;
            }
        }
        if (call0(self->reg_out) || !taken)
            goto settled;
    }
    if (call0(self->lock_in))
        goto settled;
    Py_ssize_t i = last_index(self->a[A_SENT], sent);
    int bad = (i >= 0 && PySequence_DelItem(self->a[A_SENT], i) < 0) || PyDict_DelItem(self->a[A_SENT_KEYS], key) < 0;
    if (call0(self->lock_out) || bad)
        goto settled;
    /* (its `pending` is itself: the cycle broken, so the record goes now, not at a collection) */
    Py_SETREF(GET(sent, F_PENDING), Py_NewRef(Py_None));
    out = Py_True;
settled:
    if (call0(self->settle_out) && out == Py_True) {
        Py_DECREF(sent);
        Py_DECREF(key);
        return NULL;
    }
done:
    Py_DECREF(sent);
    Py_DECREF(key);
    PyErr_Clear();
    return Py_NewRef(out);
}

static PyMethodDef lone_methods[] = {
    {"hold", (PyCFunction)lone_hold, METH_O, hold_doc},
    {"withdraw", (PyCFunction)lone_withdraw, METH_O, withdraw_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LoneType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tcpxd._native.Lone",
    .tp_basicsize = sizeof(Lone),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Lone(cls, lock, settling, sent, sent_keys, regions, tails, tail_for, registrar, no_keys, "
              "no_addresses, no_sizes)\n\ntcpxd.nixl's register_memory / deregister_memory of one DRAM region in one call "
              "each (hold, withdraw): LocalMemory's record class, locks and tables, its registrar.",
    .tp_new = lone_new,
    .tp_dealloc = (destructor)lone_dealloc,
    .tp_traverse = (traverseproc)lone_traverse,
    .tp_clear = (inquiry)lone_clear,
    .tp_methods = lone_methods,
};

/* Adds Lone to the module: 0, or -1 with an exception set. */
int tcpxd_lone_add(PyObject *module) {
    s_dram = PyUnicode_InternFromString("DRAM");
    s_mem = PyUnicode_InternFromString("mem");
    s_rows = PyUnicode_InternFromString("rows");
    s_objs = PyUnicode_InternFromString("objs");
    s_held_q = PyUnicode_InternFromString("_held");
    s_closed = PyUnicode_InternFromString("_closed");
    s_append = PyUnicode_InternFromString("append");
    s_remove = PyUnicode_InternFromString("remove");
    if (!s_dram || !s_mem || !s_rows || !s_objs || !s_held_q || !s_closed || !s_append || !s_remove ||
        PyType_Ready(&LoneType) < 0)
        return -1;
    Py_INCREF(&LoneType);
    if (PyModule_AddObject(module, "Lone", (PyObject *)&LoneType) < 0) {
        Py_DECREF(&LoneType);
        return -1;
    }
    return 0;
}
