/* clone.c: clone3, fork-like (the child runs Python, like os.fork). */
#include "bunshin_c.h"

#include <sched.h>
#include <signal.h>
#include <string.h>

#ifndef SYS_clone3
#define SYS_clone3 435
#endif

/* The kernel's struct clone_args, version 2 (88 bytes, Linux >= 5.7). */
struct bunshin_clone_args {
    uint64_t flags;
    uint64_t pidfd;
    uint64_t child_tid;
    uint64_t parent_tid;
    uint64_t exit_signal;
    uint64_t stack;
    uint64_t stack_size;
    uint64_t tls;
    uint64_t set_tid;
    uint64_t set_tid_size;
    uint64_t cgroup;
};

/* MAX_PID_NS_LEVEL in the kernel: set_tid holds at most one pid per level. */
#define BUNSHIN_MAX_SET_TID 32

/* Flags that would make the child share memory, signal handlers or thread
 * identity with the caller: not fork-like, so the child could not run Python. */
#define BUNSHIN_CLONE_NOT_FORKLIKE                                          \
    ((uint64_t)(CLONE_VM | CLONE_THREAD | CLONE_SIGHAND | CLONE_VFORK |     \
                CLONE_SETTLS | CLONE_PARENT_SETTID | CLONE_CHILD_SETTID |   \
                CLONE_CHILD_CLEARTID))

static inline long
sys_clone3(struct bunshin_clone_args *cl_args, size_t size)
{
    return syscall(SYS_clone3, cl_args, size);
}

const char bunshin_clone3_doc[] =
    "clone3(flags, *, cgroup_fd=-1, set_tid=(), exit_signal=signal.SIGCHLD)\n--\n\n"
    "Fork-like clone3(2). The parent gets (child_pid, pidfd) (pidfd is -1\n"
    "unless CLONE_PIDFD is in flags); the child gets (0, -1) and may run\n"
    "Python (PyOS_BeforeFork/AfterFork_* run exactly as in os.fork).";

PyObject *
bunshin_clone3(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"flags", "cgroup_fd", "set_tid", "exit_signal", NULL};
    struct bunshin_clone_args cl_args;
    pid_t set_tid[BUNSHIN_MAX_SET_TID];
    uint64_t flags = 0;
    int cgroup_fd = -1, exit_signal = SIGCHLD, pidfd = -1, saved_errno;
    PyObject *set_tid_obj = NULL, *seq = NULL, *result = NULL;
    Py_ssize_t n_tid = 0, i;
    long pid;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O&|$iOi:clone3", kwlist,
                                     bunshin_u64_converter, &flags, &cgroup_fd,
                                     &set_tid_obj, &exit_signal))
        goto error;

    if (flags & BUNSHIN_CLONE_NOT_FORKLIKE) {
        PyErr_Format(PyExc_ValueError,
                     "clone3: flags 0x%llx are not fork-like (CLONE_VM, CLONE_THREAD, "
                     "CLONE_SIGHAND, CLONE_VFORK, CLONE_SETTLS and the *_SETTID/CLEARTID "
                     "flags are refused)",
                     (unsigned long long)(flags & BUNSHIN_CLONE_NOT_FORKLIKE));
        goto error;
    }
    if ((flags & CLONE_INTO_CGROUP) && cgroup_fd < 0) {
        PyErr_SetString(PyExc_ValueError, "clone3: CLONE_INTO_CGROUP needs cgroup_fd");
        goto error;
    }
    if (!(flags & CLONE_INTO_CGROUP) && cgroup_fd != -1) {
        PyErr_SetString(PyExc_ValueError,
                        "clone3: cgroup_fd is only used with CLONE_INTO_CGROUP");
        goto error;
    }
    if (exit_signal < 0 || exit_signal >= NSIG) {
        PyErr_Format(PyExc_ValueError, "clone3: exit_signal %d out of range [0, %d)",
                     exit_signal, NSIG);
        goto error;
    }
    if (set_tid_obj != NULL) {
        seq = PySequence_Fast(set_tid_obj, "clone3: set_tid must be a sequence of ints");
        if (seq == NULL)
            goto error;
        n_tid = PySequence_Fast_GET_SIZE(seq);
        if (n_tid > BUNSHIN_MAX_SET_TID) {
            PyErr_Format(PyExc_ValueError,
                         "clone3: set_tid has %zd pids; at most %d (one per pid namespace level)",
                         n_tid, BUNSHIN_MAX_SET_TID);
            goto error;
        }
        for (i = 0; i < n_tid; i++) {
            long tid = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
            if (tid == -1 && PyErr_Occurred())
                goto error;
            if (tid <= 0 || tid > INT32_MAX) {
                PyErr_Format(PyExc_ValueError, "clone3: set_tid[%zd] = %ld is not a valid pid",
                             i, tid);
                goto error;
            }
            set_tid[i] = (pid_t)tid;
        }
    }
    if (PyInterpreterState_Get() != PyInterpreterState_Main()) {
        PyErr_SetString(PyExc_RuntimeError, "clone3: not supported in subinterpreters");
        goto error;
    }
    if (PySys_Audit("bunshin_async._bunshin_c.clone3", "K", (unsigned long long)flags) < 0)
        goto error;

    memset(&cl_args, 0, sizeof(cl_args));
    cl_args.flags = flags;
    cl_args.exit_signal = (uint64_t)exit_signal;
    if (flags & CLONE_PIDFD)
        cl_args.pidfd = (uint64_t)(uintptr_t)&pidfd;
    if (flags & CLONE_INTO_CGROUP)
        cl_args.cgroup = (uint64_t)cgroup_fd;
    if (n_tid > 0) {
        cl_args.set_tid = (uint64_t)(uintptr_t)set_tid;
        cl_args.set_tid_size = (uint64_t)n_tid;
    }

    /* As os.fork: no GIL release (the child must own it), fork hooks around. */
    for (;;) {
        PyOS_BeforeFork();
        pid = sys_clone3(&cl_args, sizeof(cl_args));
        saved_errno = errno;
        if (pid == 0) {
            PyOS_AfterFork_Child();
            result = Py_BuildValue("(ii)", 0, -1);
            goto error;
        }
        PyOS_AfterFork_Parent();
        if (pid > 0 || saved_errno != EINTR)
            break;
        if (PyErr_CheckSignals() < 0)
            goto error;
    }
    if (pid < 0) {
        bunshin_set_errno(saved_errno, "clone3", NULL, NULL);
        goto error;
    }
    result = Py_BuildValue("(li)", pid, pidfd);
    if (result == NULL && pidfd >= 0)
        close(pidfd);
error:
    Py_XDECREF(seq);
    return result;
}
