/* What the parts of tcpxd._native share: varints, and the lane's post (_native_post.c). */
#ifndef TCPXD_NATIVE_H
#define TCPXD_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

static inline size_t varint_len(size_t v) {
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static inline char *put_varint(char *p, size_t v) {
    while (v >= 0x80) {
        *p++ = (char)(v | 0x80);
        v >>= 7;
    }
    *p++ = (char)v;
    return p;
}

/* _native_post.c */
PyObject *tcpxd_lane_setup(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *tcpxd_post_lane(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
extern const char tcpxd_lane_setup_doc[];
extern const char tcpxd_post_lane_doc[];

#endif
