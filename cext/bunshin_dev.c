/* bunshin_dev.c: the ioctls of /dev/bunshin (kmod/): bunshin_version and
 * bunshin_fork, and the BUNSHIN_FORK_* flags. The structures come from the module's uapi header, the one
 * contract between the two. */
#include "bunshin_c.h"

#include <string.h>
#include <sys/ioctl.h>

#include <linux/bunshin.h>

#define BUNSHIN_VERSION_TYPE "BunshinVersion"

static PyStructSequence_Field bunshin_version_fields[] = {
    {"abi_version", "BUNSHIN_ABI_VERSION of the running module."},
    {"features", "BUNSHIN_FEATURE_* bits: what the module can do."},
    {"kernel_version", "LINUX_VERSION_CODE the module was built for."},
    {NULL, NULL},
};

static PyStructSequence_Desc bunshin_version_desc = {
    .name = "bunshin_async._bunshin_c.BunshinVersion",
    .doc = "Result of bunshin_version(): what the /dev/bunshin module is.",
    .fields = bunshin_version_fields,
    .n_in_sequence = 3,
};

int
bunshin_dev_exec(PyObject *module)
{
    PyTypeObject *type = PyStructSequence_NewType(&bunshin_version_desc);

    if (type == NULL)
        return -1;
    if (PyModule_AddObject(module, BUNSHIN_VERSION_TYPE, (PyObject *)type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    if (PyModule_AddIntConstant(module, "BUNSHIN_FORK_CGROUP", BUNSHIN_FORK_CGROUP) < 0 ||
        PyModule_AddIntConstant(module, "BUNSHIN_FORK_SETSID", BUNSHIN_FORK_SETSID) < 0 ||
        PyModule_AddIntConstant(module, "BUNSHIN_FORK_JOIN_GROUP", BUNSHIN_FORK_JOIN_GROUP) < 0 ||
        PyModule_AddIntConstant(module, "BUNSHIN_FORK_REOPEN_FILES",
                                BUNSHIN_FORK_REOPEN_FILES) < 0)
        return -1;
    return 0;
}

/* ioctl(2) on /dev/bunshin, GIL released, retried on EINTR; raises naming
 * the command. Returns 0, or -1 with an exception set. */
static int
bunshin_dev_ioctl(int fd, unsigned long cmd, void *arg, const char *name)
{
    int r, async_err = 0;

    BUNSHIN_SYSCALL(r, async_err, ioctl(fd, cmd, arg));
    if (async_err)
        return -1;
    if (r < 0) {
        bunshin_set_errno(errno, name, NULL, NULL);
        return -1;
    }
    return 0;
}

const char bunshin_bunshin_version_doc[] =
    "bunshin_version(fd)\n--\n\n"
    "BUNSHIN_IOC_VERSION on fd (an open /dev/bunshin): the module's ABI\n"
    "version, features and kernel version, as a BunshinVersion.";

PyObject *
bunshin_bunshin_version(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"fd", NULL};
    struct bunshin_version ver;
    PyObject *type = NULL, *result = NULL, *item;
    int fd;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "i:bunshin_version", kwlist, &fd))
        goto error;
    memset(&ver, 0, sizeof(ver));
    if (bunshin_dev_ioctl(fd, BUNSHIN_IOC_VERSION, &ver, "ioctl BUNSHIN_IOC_VERSION") < 0)
        goto error;
    type = PyObject_GetAttrString(module, BUNSHIN_VERSION_TYPE);
    if (type == NULL)
        goto error;
    result = PyStructSequence_New((PyTypeObject *)type);
    if (result == NULL)
        goto error;
    item = PyLong_FromUnsignedLong(ver.abi_version);
    if (item == NULL)
        goto error;
    PyStructSequence_SET_ITEM(result, 0, item);
    item = PyLong_FromUnsignedLongLong(ver.features);
    if (item == NULL)
        goto error;
    PyStructSequence_SET_ITEM(result, 1, item);
    item = PyLong_FromUnsignedLong(ver.kernel_version);
    if (item == NULL)
        goto error;
    PyStructSequence_SET_ITEM(result, 2, item);
    Py_DECREF(type);
    return result;
error:
    Py_XDECREF(result);
    Py_XDECREF(type);
    return NULL;
}

const char bunshin_bunshin_fork_doc[] =
    "bunshin_fork(fd, source_pid, target_pidfd, *, cgroup_fd=-1, flags=0, group_pidfd=-1)\n--\n\n"
    "BUNSHIN_IOC_FORK on fd (an open /dev/bunshin): fork the frozen,\n"
    "single-threaded process source_pid into the namespaces, root and cwd of\n"
    "the process target_pidfd refers to, under the init of its pid namespace.\n"
    "cgroup_fd (a cgroup v2 directory) sets BUNSHIN_FORK_CGROUP, group_pidfd\n"
    "BUNSHIN_FORK_JOIN_GROUP; flags adds BUNSHIN_FORK_SETSID and\n"
    "BUNSHIN_FORK_REOPEN_FILES. Return the child's pid (in the caller's pid\n"
    "namespace).";

PyObject *
bunshin_bunshin_fork(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"fd", "source_pid", "target_pidfd", "cgroup_fd", "flags",
                             "group_pidfd", NULL};
    struct bunshin_fork_req req;
    int fd, source_pid, target_pidfd, cgroup_fd = -1, group_pidfd = -1;
    unsigned int flags = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iii|$iIi:bunshin_fork", kwlist, &fd,
                                     &source_pid, &target_pidfd, &cgroup_fd, &flags,
                                     &group_pidfd))
        goto error;
    memset(&req, 0, sizeof(req));
    req.source_pid = source_pid;
    req.target_pidfd = target_pidfd;
    req.flags = flags;
    /* A field is used only with its flag (and must be 0 otherwise). */
    if (cgroup_fd >= 0) {
        req.flags |= BUNSHIN_FORK_CGROUP;
        req.cgroup_fd = cgroup_fd;
    }
    if (group_pidfd >= 0) {
        req.flags |= BUNSHIN_FORK_JOIN_GROUP;
        req.group_pidfd = group_pidfd;
    }
    /* The module fails with EINTR only on a fatal signal, after it
     * cancelled the queued fork: a retry never forks twice. */
    if (bunshin_dev_ioctl(fd, BUNSHIN_IOC_FORK, &req, "ioctl BUNSHIN_IOC_FORK") < 0)
        goto error;
    return PyLong_FromLong(req.child_pid);
error:
    return NULL;
}
