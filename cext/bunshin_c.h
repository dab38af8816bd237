/*
 * bunshin_c.h: shared declarations of the bunshin_async._bunshin_c extension.
 *
 * The module is split by topic: module.c (init, constants, the one method
 * table), errors.c (exceptions and argument converters), clone.c (clone3),
 * ns.c (pidfd_*, setns, unshare), mount.c (mount, umount2, pivot_root) and
 * pagescan.c (the exact page scanner).
 */
#ifndef BUNSHIN_C_H
#define BUNSHIN_C_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <sched.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Flags older C library headers may lack (values from the kernel's uapi). */
#ifndef CLONE_NEWTIME
#define CLONE_NEWTIME 0x00000080
#endif
#ifndef CLONE_PIDFD
#define CLONE_PIDFD 0x00001000
#endif
#ifndef CLONE_CLEAR_SIGHAND
#define CLONE_CLEAR_SIGHAND 0x100000000ULL
#endif
#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif

/* Per-module state (multi-phase init: nothing is kept in C globals). */
typedef struct {
    PyTypeObject *PageScanType;
} bunshin_state;

static inline bunshin_state *
bunshin_get_state(PyObject *module)
{
    return (bunshin_state *)PyModule_GetState(module);
}

/* errors.c ------------------------------------------------------------ */

/*
 * Raise the OSError subclass that matches err (ESRCH -> ProcessLookupError,
 * EPERM -> PermissionError, ...), with strerror "<syscall>: <strerror(err)>"
 * and the optional file names, and return NULL.  The message reads
 * "[Errno 1] clone3: Operation not permitted" or, with file names,
 * "[Errno 2] mount: No such file or directory: '/a' -> '/b'".
 */
PyObject *bunshin_set_errno(int err, const char *syscall,
                            PyObject *filename, PyObject *filename2);

/* The same with a formatted detail appended to the strerror text. */
PyObject *bunshin_set_errno_detail(int err, const char *syscall,
                                   const char *detail, PyObject *filename);

/* O& converters. */
int bunshin_path_converter(PyObject *obj, void *out);          /* str/bytes/PathLike -> bytes */
int bunshin_optional_path_converter(PyObject *obj, void *out); /* the same, or None -> NULL */
int bunshin_u64_converter(PyObject *obj, void *out);           /* non-negative int -> uint64_t */
int bunshin_ulong_converter(PyObject *obj, void *out);         /* non-negative int -> unsigned long */

/* Decode a converted path (bytes or NULL) back to str for error messages. */
PyObject *bunshin_path_for_error(PyObject *bytes_path);

/* bunshin_set_errno with the converted path as the file name; returns NULL. */
PyObject *bunshin_set_errno_path(int err, const char *syscall, PyObject *bytes_path);

/* Methods (each file defines its functions and docstrings). ----------- */

#define BUNSHIN_DECLARE(name) \
    PyObject *bunshin_##name(PyObject *module, PyObject *args, PyObject *kwargs); \
    extern const char bunshin_##name##_doc[]

BUNSHIN_DECLARE(clone3);
BUNSHIN_DECLARE(pidfd_open);
BUNSHIN_DECLARE(pidfd_send_signal);
BUNSHIN_DECLARE(pidfd_getfd);
BUNSHIN_DECLARE(setns);
BUNSHIN_DECLARE(unshare);
BUNSHIN_DECLARE(mount);
BUNSHIN_DECLARE(umount2);
BUNSHIN_DECLARE(pivot_root);
BUNSHIN_DECLARE(scan_pages);

/* pagescan.c: create the PageScan type into the module state. */
int bunshin_pagescan_exec(PyObject *module);

/*
 * Retry a syscall expression with the GIL released while it fails with EINTR
 * and no signal handler raised.  Sets `result` and leaves `async_err` non-zero
 * if a handler raised (the exception is then set).
 */
#define BUNSHIN_SYSCALL(result, async_err, expr)                         \
    do {                                                                 \
        Py_BEGIN_ALLOW_THREADS                                           \
        (result) = (expr);                                               \
        Py_END_ALLOW_THREADS                                             \
    } while ((result) < 0 && errno == EINTR &&                           \
             !((async_err) = PyErr_CheckSignals()))

#endif /* BUNSHIN_C_H */
