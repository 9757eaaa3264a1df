/* tcpxd._native.post_lane: the NIXL agent's transfer() of a request made on a lane with both
 * sides as outer sums, in one call.
 *
 * It is the Python fast path (nixl_agent._post_lane's outer-sum branch, Xfer.post_one and
 * _begin, Session._submit_joined) step for step, as CPython's _asyncio mirrors asyncio's
 * futures: the same attributes read and written in the same order, under the same locks. Each
 * Python line costs ~0.6 µs in vLLM's pull, whose caches the payload swept; here the ~45 lines
 * are a few dozen attribute reads. Where anything differs from the fast path's case (another
 * handle or plan type, a notification given to transfer(), no session or one that ended, lists
 * not bound to it, a handle released or still in progress) it returns None having changed
 * nothing, and the Python path serves (and raises what it raises). The tests run the agent
 * both ways (TCPXD_NATIVE=0).
 *
 * # State
 * The types it recognises (nixl_xfer_handle, _plan.Prepared, _xfer._Part) and time.perf_counter
 * are handed over once by `lane_setup` (tcpxd.nixl._agent at import); until then post_lane
 * returns None.
 */
#include "_native.h"
#include <string.h>

static PyTypeObject *handle_type, *prepared_type, *part_type;
static PyObject *perf_counter, *str_proc, *one, *no_args;

/* Interned attribute names, made once by lane_setup. */
enum {
    N_XFER, N_AGENT, N_RELEASED_H, N_PLAN, N_FIELDS, N_LANE, N_NOTE_HEAD, N_REMOTE, N_REMOTES, N_SESSION,
    N_ENDED, N_CLOSED, N_WHY, N_CONN, N_LOCAL, N_DAEMON, N_BOUND, N_NOTIF, N_LOCK, N_RELEASED, N_STATE, N_GEN,
    N_PARTS, N_ERROR, N_SESSION_X, N_FOLLOWUP, N_LEFT, N_TIMED, N_T0, N_START_US, N_POST_US, N_XFER_US, N_TAG,
    N_TAGS, N_PENDING, N_SEND_LOCK, N_SOCK, N_TMO, N_KEY, N_FINISHED, N_ANSWERED, N_GEN_P, N_XFER_P,
    N_ACQUIRE, N_RELEASE, N_SENDALL, N_SET_EXCEPTION, N_POSTED, N_COUNT
};
static const char *const names[N_COUNT] = {
    "_xfer", "_agent", "_released", "plan", "fields", "lane", "note_head", "remote", "_remotes", "_session",
    "_ended", "_closed", "_why", "_conn", "local", "daemon", "bound", "notif", "_lock", "released", "state", "_gen",
    "_parts", "error", "_session", "_followup", "_left", "timed", "_t0", "_start_us", "_post_us", "_xfer_us", "tag",
    "_tags", "_pending", "_send_lock", "sock", "tmo", "key", "finished", "answered", "gen", "xfer",
    "acquire", "release", "sendall", "set_exception", "_posted",
};
static PyObject *name[N_COUNT];

#define MAX_FRAME ((size_t)64 << 20) /* tcpxd._local.MAX_FRAME */

const char tcpxd_lane_setup_doc[] =
    "lane_setup(handle_type, prepared_type, part_type, perf_counter) -> None\n\n"
    "The types post_lane recognises (tcpxd.nixl's nixl_xfer_handle, _plan.Prepared, _xfer._Part)\n"
    "and the clock Xfer times posts with (time.perf_counter).";

PyObject *tcpxd_lane_setup(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4 || !PyType_Check(args[0]) || !PyType_Check(args[1]) || !PyType_Check(args[2]) || !PyCallable_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "lane_setup(handle_type, prepared_type, part_type, perf_counter)");
        return NULL;
    }
    for (int i = 0; i < N_COUNT; i++) {
        if (name[i] == NULL && (name[i] = PyUnicode_InternFromString(names[i])) == NULL)
            return NULL;
    }
    if ((str_proc == NULL && (str_proc = PyUnicode_InternFromString("PROC")) == NULL) ||
        (one == NULL && (one = PyLong_FromLong(1)) == NULL) || (no_args == NULL && (no_args = PyTuple_New(0)) == NULL))
        return NULL;
    Py_INCREF(args[0]);
    Py_INCREF(args[1]);
    Py_INCREF(args[2]);
    Py_INCREF(args[3]);
    Py_XSETREF(handle_type, (PyTypeObject *)args[0]);
    Py_XSETREF(prepared_type, (PyTypeObject *)args[1]);
    Py_XSETREF(part_type, (PyTypeObject *)args[2]);
    Py_XSETREF(perf_counter, args[3]);
    Py_RETURN_NONE;
}

/* obj.<name[i]>, a new reference, or NULL with an exception. */
#define GET(obj, i) PyObject_GetAttr((obj), name[i])
#define SET(obj, i, v) PyObject_SetAttr((obj), name[i], (v))

/* Whether obj.<name[i]> is `want` (by identity); -1 with an exception. */
static int attr_is(PyObject *obj, int i, PyObject *want) {
    PyObject *v = GET(obj, i);
    if (v == NULL)
        return -1;
    int same = v == want;
    Py_DECREF(v);
    return same;
}

/* Whether obj.<name[i]> is true; -1 with an exception. */
static int attr_true(PyObject *obj, int i) {
    PyObject *v = GET(obj, i);
    if (v == NULL)
        return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

static int call0(PyObject *obj, int i) {
    PyObject *r = PyObject_CallMethodNoArgs(obj, name[i]);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* The session `s` as the agent's fast path takes it (nixl_agent._session_now's first test):
 * 1 when live, 0 when not, -1 with an exception. */
static int session_live(PyObject *agent, PyObject *s) {
    int r;
    if (s == Py_None)
        return 0;
    if ((r = attr_is(s, N_ENDED, Py_None)) != 1 || (r = attr_true(s, N_CLOSED)) != 0 || (r = attr_is(s, N_WHY, Py_None)) != 1)
        return r < 0 ? -1 : 0;
    r = attr_true(agent, N_CLOSED);
    return r < 0 ? -1 : !r;
}

/* The frame of the request: SessionRequest{tag, <key>: ids, notification 5 (note_head + notif),
 * tmo, fields}; NULL with an exception (post_lane checked the size against MAX_FRAME first). */
static PyObject *lane_frame(unsigned long long tag, PyObject *key, PyObject *ids, PyObject *note_head, PyObject *notif,
                            PyObject *tmo, PyObject *fields) {
    size_t hl = (size_t)PyBytes_GET_SIZE(note_head), nl = (size_t)PyBytes_GET_SIZE(notif), framed = hl + nl;
    size_t note = nl ? 1 + varint_len(framed) + framed : 0;
    size_t body = (size_t)PyBytes_GET_SIZE(ids) + note + (size_t)PyBytes_GET_SIZE(tmo) + (size_t)PyBytes_GET_SIZE(fields);
    size_t kl = (size_t)PyBytes_GET_SIZE(key), inner = 1 + varint_len((size_t)tag) + kl + varint_len(body) + body;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 + inner));
    if (out == NULL)
        return NULL;
    unsigned char *u = (unsigned char *)PyBytes_AS_STRING(out);
    u[0] = (unsigned char)(inner >> 24);
    u[1] = (unsigned char)(inner >> 16);
    u[2] = (unsigned char)(inner >> 8);
    u[3] = (unsigned char)inner;
    char *p = (char *)u + 4;
    *p++ = 0x08;
    p = put_varint(p, (size_t)tag);
    memcpy(p, PyBytes_AS_STRING(key), kl);
    p = put_varint(p + kl, body);
    memcpy(p, PyBytes_AS_STRING(ids), (size_t)PyBytes_GET_SIZE(ids));
    p += PyBytes_GET_SIZE(ids);
    if (nl) {
        *p++ = 0x2a;
        p = put_varint(p, framed);
        memcpy(p, PyBytes_AS_STRING(note_head), hl);
        memcpy(p + hl, PyBytes_AS_STRING(notif), nl);
        p += framed;
    }
    memcpy(p, PyBytes_AS_STRING(tmo), (size_t)PyBytes_GET_SIZE(tmo));
    p += PyBytes_GET_SIZE(tmo);
    memcpy(p, PyBytes_AS_STRING(fields), (size_t)PyBytes_GET_SIZE(fields));
    return out;
}

/* µs since `t0` on perf_counter, as Xfer._posted writes them; NULL with an exception. */
static PyObject *micros_since(PyObject *t0) {
    PyObject *now = PyObject_CallNoArgs(perf_counter);
    if (now == NULL)
        return NULL;
    double d = (PyFloat_AsDouble(now) - PyFloat_AsDouble(t0)) * 1e6;
    Py_DECREF(now);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromDouble(d);
}

const char tcpxd_post_lane_doc[] =
    "post_lane(agent, handle, notif_msg) -> str or None\n\n"
    "nixl_agent.transfer(handle, notif_msg) of a request made on a lane with both sides as outer\n"
    "sums: its state after posting (\"PROC\", or \"DONE\"/\"ERR\" if it already ended); None, having\n"
    "changed nothing, where the Python path must serve it.";

PyObject *tcpxd_post_lane(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "post_lane(agent, handle, notif_msg)");
        return NULL;
    }
    PyObject *agent = args[0], *handle = args[1], *notif_msg = args[2];
    if (handle_type == NULL || Py_TYPE(handle) != handle_type || !PyBytes_CheckExact(notif_msg) || PyBytes_GET_SIZE(notif_msg))
        Py_RETURN_NONE;
    /* Everything read below is held here, released once at the end. */
    PyObject *xfer = NULL, *plan = NULL, *fields = NULL, *lane = NULL, *note_head = NULL, *remote = NULL, *remotes = NULL,
             *session = NULL, *conn = NULL, *sock = NULL, *lside = NULL, *rside = NULL, *ld = NULL, *rd = NULL, *bound = NULL,
             *notif = NULL, *xlock = NULL, *state = NULL, *gen_o = NULL, *gen = NULL, *part = NULL, *parts = NULL, *t0 = NULL,
             *slock = NULL, *tags = NULL, *tag = NULL, *ended = NULL, *pending = NULL, *tmo = NULL, *key = NULL, *frame = NULL,
             *send_lock = NULL, *us = NULL, *now_gen = NULL, *result = NULL;
    PyObject *zero = NULL;
    int r, timed = 0, locked = 0;

    /* nixl_agent.transfer's test, then _post_lane's */
    if ((r = attr_is(handle, N_AGENT, agent)) != 1 || (r = attr_true(handle, N_RELEASED_H)) != 0)
        goto check;
    if ((xfer = GET(handle, N_XFER)) == NULL || (plan = GET(xfer, N_PLAN)) == NULL)
        goto fail;
    if (Py_TYPE(plan) != prepared_type)
        goto done;
    if ((fields = GET(plan, N_FIELDS)) == NULL || (lane = GET(plan, N_LANE)) == NULL || (note_head = GET(lane, N_NOTE_HEAD)) == NULL)
        goto fail;
    if (!PyBytes_CheckExact(fields) || !PyBytes_CheckExact(note_head))
        goto done;
    if ((remote = GET(xfer, N_REMOTE)) == NULL || (remotes = GET(agent, N_REMOTES)) == NULL)
        goto fail;
    r = 0;
    if (!PyDict_CheckExact(remotes) || (r = PyDict_Contains(remotes, remote)) != 1)
        goto check;
    if ((session = GET(agent, N_SESSION)) == NULL)
        goto fail;
    if ((r = session_live(agent, session)) != 1)
        goto check;
    if ((conn = GET(session, N_CONN)) == NULL)
        goto fail;
    if (conn == Py_None)
        goto done; /* over gRPC: Session._submit_joined's general way */
    if ((lside = GET(lane, N_LOCAL)) == NULL || (rside = GET(lane, N_REMOTE)) == NULL || (ld = GET(lside, N_DAEMON)) == NULL ||
        (rd = GET(rside, N_DAEMON)) == NULL || (bound = GET(lane, N_BOUND)) == NULL)
        goto fail;
    if (!PyTuple_CheckExact(bound) || PyTuple_GET_SIZE(bound) != 3 || PyTuple_GET_ITEM(bound, 0) != ld ||
        PyTuple_GET_ITEM(bound, 1) != rd || !PyTuple_CheckExact(ld) || PyTuple_GET_SIZE(ld) < 1 || PyTuple_GET_ITEM(ld, 0) != session ||
        !PyBytes_CheckExact(PyTuple_GET_ITEM(bound, 2)))
        goto done; /* lists not bound to this session yet: _post_lane binds them */
    if ((notif = GET(xfer, N_NOTIF)) == NULL || (tmo = GET(lane, N_TMO)) == NULL || (key = GET(lane, N_KEY)) == NULL ||
        (sock = GET(conn, N_SOCK)) == NULL)
        goto fail;
    if (!PyBytes_CheckExact(notif) || !PyBytes_CheckExact(tmo) || !PyBytes_CheckExact(key))
        goto done;
    if ((size_t)(PyBytes_GET_SIZE(PyTuple_GET_ITEM(bound, 2)) + PyBytes_GET_SIZE(note_head) + PyBytes_GET_SIZE(notif) +
                 PyBytes_GET_SIZE(tmo) + PyBytes_GET_SIZE(fields) + PyBytes_GET_SIZE(key)) > MAX_FRAME - 64)
        goto done; /* over the frame limit: the Python path fails it with ResourceExhausted */

    /* Xfer.post_one and _begin, under the handle's lock */
    if ((xlock = GET(xfer, N_LOCK)) == NULL || call0(xlock, N_ACQUIRE) < 0)
        goto fail;
    locked = 1;
    if ((r = attr_true(xfer, N_RELEASED)) != 0)
        goto check; /* released: post_one raises */
    if ((state = GET(xfer, N_STATE)) == NULL)
        goto fail;
    if ((r = PyObject_RichCompareBool(state, str_proc, Py_EQ)) != 0)
        goto check; /* in progress: post_one raises */
    if ((gen_o = GET(xfer, N_GEN)) == NULL || (gen = PyNumber_Add(gen_o, one)) == NULL || SET(xfer, N_GEN, gen) < 0)
        goto fail;
    /* _Part(xfer, gen, None), its five slots as its __init__ sets them */
    if ((part = part_type->tp_new(part_type, no_args, NULL)) == NULL || (zero = PyLong_FromLong(0)) == NULL || SET(part, N_TAG, zero) < 0 ||
        SET(part, N_XFER_P, xfer) < 0 || SET(part, N_GEN_P, gen) < 0 || SET(part, N_FINISHED, Py_False) < 0 ||
        SET(part, N_ANSWERED, Py_None) < 0)
        goto fail;
    if ((parts = PyList_New(1)) == NULL)
        goto fail;
    Py_INCREF(part);
    PyList_SET_ITEM(parts, 0, part);
    if (SET(xfer, N_PARTS, parts) < 0 || SET(xfer, N_STATE, str_proc) < 0 || SET(xfer, N_ERROR, Py_None) < 0 ||
        SET(xfer, N_SESSION_X, session) < 0 || SET(xfer, N_FOLLOWUP, Py_None) < 0 || SET(xfer, N_LEFT, one) < 0)
        goto fail;
    if ((timed = attr_true(xfer, N_TIMED)) < 0)
        goto fail;
    if (timed) {
        if ((t0 = PyObject_CallNoArgs(perf_counter)) == NULL || SET(xfer, N_T0, t0) < 0 || SET(xfer, N_START_US, zero) < 0 ||
            SET(xfer, N_POST_US, zero) < 0 || SET(xfer, N_XFER_US, zero) < 0)
            goto fail;
    }
    locked = 0;
    if (call0(xlock, N_RELEASE) < 0)
        goto fail;

    /* Session._submit_joined: the tag and the pending entry under the session's lock */
    if ((slock = GET(session, N_LOCK)) == NULL || (tags = GET(session, N_TAGS)) == NULL || call0(slock, N_ACQUIRE) < 0)
        goto fail;
    tag = PyIter_Next(tags);
    if (tag == NULL || SET(part, N_TAG, tag) < 0 || (ended = GET(session, N_ENDED)) == NULL ||
        (ended == Py_None && ((pending = GET(session, N_PENDING)) == NULL || PyObject_SetItem(pending, tag, part) < 0))) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        if (et == NULL)
            PyErr_SetString(PyExc_RuntimeError, "post_lane: the session's tags ran out");
        else
            PyErr_Restore(et, ev, tb);
        PyErr_Fetch(&et, &ev, &tb);
        call0(slock, N_RELEASE);
        PyErr_Restore(et, ev, tb);
        goto fail;
    }
    if (call0(slock, N_RELEASE) < 0)
        goto fail;
    if (ended != Py_None) { /* the session ended: the part gets its end (as _submit_joined) */
        PyObject *x = PyObject_CallMethodOneArg(part, name[N_SET_EXCEPTION], ended);
        if (x == NULL)
            goto fail;
        Py_DECREF(x);
    } else {
        unsigned long long t = PyLong_AsUnsignedLongLong(tag);
        if (t == (unsigned long long)-1 && PyErr_Occurred())
            goto fail;
        if ((frame = lane_frame(t, key, PyTuple_GET_ITEM(bound, 2), note_head, notif, tmo, fields)) == NULL)
            goto fail;
        if ((send_lock = GET(session, N_SEND_LOCK)) == NULL || call0(send_lock, N_ACQUIRE) < 0)
            goto fail;
        PyObject *x = PyObject_CallMethodOneArg(sock, name[N_SENDALL], frame);
        Py_XDECREF(x);
        if (x == NULL && PyErr_ExceptionMatches(PyExc_OSError))
            PyErr_Clear(); /* the connection ended: the reader fails the pending requests */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        int rel = call0(send_lock, N_RELEASE);
        if (et != NULL) {
            PyErr_Restore(et, ev, tb);
            goto fail;
        }
        if (rel < 0)
            goto fail;
    }

    /* Xfer._posted: the post's duration; its part cancelled if released meanwhile */
    if (timed && ((us = micros_since(t0)) == NULL || SET(xfer, N_POST_US, us) < 0))
        goto fail;
    if ((now_gen = GET(xfer, N_GEN)) == NULL || (r = PyObject_RichCompareBool(now_gen, gen, Py_EQ)) < 0)
        goto fail;
    result = r ? GET(xfer, N_STATE) : PyObject_CallMethod(xfer, "_posted", "OO", session, gen);
    goto out;

check: /* r: 1 or 0 from a test that sent us back to Python, -1 for an exception */
    if (r < 0)
        goto fail;
done:
    if (locked && call0(xlock, N_RELEASE) < 0)
        goto fail;
    locked = 0;
    result = Py_None;
    Py_INCREF(result);
    goto out;
fail:
    if (locked) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        call0(xlock, N_RELEASE);
        PyErr_Restore(et, ev, tb);
    }
    result = NULL;
out:
    Py_XDECREF(xfer); Py_XDECREF(plan); Py_XDECREF(fields); Py_XDECREF(lane); Py_XDECREF(note_head); Py_XDECREF(remote);
    Py_XDECREF(remotes); Py_XDECREF(session); Py_XDECREF(conn); Py_XDECREF(sock); Py_XDECREF(lside); Py_XDECREF(rside);
    Py_XDECREF(ld); Py_XDECREF(rd); Py_XDECREF(bound); Py_XDECREF(notif); Py_XDECREF(xlock); Py_XDECREF(state);
    Py_XDECREF(gen_o); Py_XDECREF(gen); Py_XDECREF(part); Py_XDECREF(parts); Py_XDECREF(t0); Py_XDECREF(slock);
    Py_XDECREF(tags); Py_XDECREF(tag); Py_XDECREF(ended); Py_XDECREF(pending); Py_XDECREF(tmo); Py_XDECREF(key);
    Py_XDECREF(frame); Py_XDECREF(send_lock); Py_XDECREF(us); Py_XDECREF(now_gen); Py_XDECREF(zero);
    return result;
}
