/* ns.c: pidfd_open, pidfd_send_signal, pidfd_getfd, setns, unshare. */
#include "bunshin_c.h"

#include <sched.h>
#include <signal.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

static inline int
sys_pidfd_open(pid_t pid, unsigned int flags)
{
    return (int)syscall(SYS_pidfd_open, pid, flags);
}

static inline int
sys_pidfd_send_signal(int pidfd, int sig, siginfo_t *info, unsigned int flags)
{
    return (int)syscall(SYS_pidfd_send_signal, pidfd, sig, info, flags);
}

static inline int
sys_pidfd_getfd(int pidfd, int targetfd, unsigned int flags)
{
    return (int)syscall(SYS_pidfd_getfd, pidfd, targetfd, flags);
}

const char bunshin_pidfd_open_doc[] =
    "pidfd_open(pid, flags=0)\n--\n\n"
    "Return a new pidfd (close-on-exec) referring to process pid.\n"
    "flags may be PIDFD_NONBLOCK.";

PyObject *
bunshin_pidfd_open(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"pid", "flags", NULL};
    int pid, async_err = 0, fd;
    unsigned int flags = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "i|I:pidfd_open", kwlist, &pid, &flags))
        goto error;
    BUNSHIN_SYSCALL(fd, async_err, sys_pidfd_open(pid, flags));
    if (async_err)
        goto error;
    if (fd < 0) {
        bunshin_set_errno(errno, "pidfd_open", NULL, NULL);
        goto error;
    }
    return PyLong_FromLong(fd);
error:
    return NULL;
}

const char bunshin_pidfd_send_signal_doc[] =
    "pidfd_send_signal(pidfd, sig, flags=0)\n--\n\n"
    "Send signal sig to the process that pidfd refers to (no siginfo).";

PyObject *
bunshin_pidfd_send_signal(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"pidfd", "sig", "flags", NULL};
    int pidfd, sig, r, async_err = 0;
    unsigned int flags = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "ii|I:pidfd_send_signal", kwlist,
                                     &pidfd, &sig, &flags))
        goto error;
    BUNSHIN_SYSCALL(r, async_err, sys_pidfd_send_signal(pidfd, sig, NULL, flags));
    if (async_err)
        goto error;
    if (r < 0) {
        bunshin_set_errno(errno, "pidfd_send_signal", NULL, NULL);
        goto error;
    }
    Py_RETURN_NONE;
error:
    return NULL;
}

const char bunshin_pidfd_getfd_doc[] =
    "pidfd_getfd(pidfd, targetfd, flags=0)\n--\n\n"
    "Duplicate file descriptor targetfd of the process that pidfd refers to\n"
    "into this process; return the new descriptor (close-on-exec).";

PyObject *
bunshin_pidfd_getfd(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"pidfd", "targetfd", "flags", NULL};
    int pidfd, targetfd, fd, async_err = 0;
    unsigned int flags = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "ii|I:pidfd_getfd", kwlist,
                                     &pidfd, &targetfd, &flags))
        goto error;
    BUNSHIN_SYSCALL(fd, async_err, sys_pidfd_getfd(pidfd, targetfd, flags));
    if (async_err)
        goto error;
    if (fd < 0) {
        bunshin_set_errno(errno, "pidfd_getfd", NULL, NULL);
        goto error;
    }
    return PyLong_FromLong(fd);
error:
    return NULL;
}

const char bunshin_setns_doc[] =
    "setns(fd, nstype=0)\n--\n\n"
    "Move the calling thread into the namespace that fd refers to (a\n"
    "/proc/PID/ns/* file), or into several namespaces of the process that a\n"
    "pidfd refers to (nstype is then a mask of CLONE_NEW* flags).";

PyObject *
bunshin_setns(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"fd", "nstype", NULL};
    int fd, nstype = 0, r, async_err = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "i|i:setns", kwlist, &fd, &nstype))
        goto error;
    BUNSHIN_SYSCALL(r, async_err, setns(fd, nstype));
    if (async_err)
        goto error;
    if (r < 0) {
        bunshin_set_errno(errno, "setns", NULL, NULL);
        goto error;
    }
    Py_RETURN_NONE;
error:
    return NULL;
}

const char bunshin_unshare_doc[] =
    "unshare(flags)\n--\n\n"
    "Disassociate parts of the calling process's execution context\n"
    "(CLONE_NEW* flags).";

PyObject *
bunshin_unshare(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"flags", NULL};
    int flags, r, async_err = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "i:unshare", kwlist, &flags))
        goto error;
    BUNSHIN_SYSCALL(r, async_err, unshare(flags));
    if (async_err)
        goto error;
    if (r < 0) {
        bunshin_set_errno(errno, "unshare", NULL, NULL);
        goto error;
    }
    Py_RETURN_NONE;
error:
    return NULL;
}
