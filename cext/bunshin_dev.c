/* bunshin_dev.c: the ioctls of /dev/bunshin (kmod/): bunshin_version,
 * bunshin_fork and bunshin_fork_tree, and the BUNSHIN_FORK_* flags. The structures come from the module's uapi header, the one
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
                                BUNSHIN_FORK_REOPEN_FILES) < 0 ||
        PyModule_AddIntConstant(module, "BUNSHIN_TREE_MAX", BUNSHIN_TREE_MAX) < 0 ||
        PyModule_AddIntConstant(module, "BUNSHIN_TREE_SUBST_MAX", BUNSHIN_TREE_SUBST_MAX) < 0 ||
        PyModule_AddIntConstant(module, "BUNSHIN_FEATURE_FORK_TREE",
                                (long)BUNSHIN_FEATURE_FORK_TREE) < 0 ||
        PyModule_AddIntConstant(module, "BUNSHIN_FEATURE_TREE_SUBST",
                                (long)BUNSHIN_FEATURE_TREE_SUBST) < 0)
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

const char bunshin_bunshin_fork_tree_doc[] =
    "bunshin_fork_tree(fd, source_pids, target_pidfd, cgroup_fd, *, subst=())\n--\n\n"
    "BUNSHIN_IOC_FORK_TREE on fd (an open /dev/bunshin): fork the frozen,\n"
    "single-threaded processes source_pids (a sequence of pids, each one's\n"
    "parent before it) into the namespaces, root and cwd of the process\n"
    "target_pidfd refers to, each clone born in the cgroup v2 directory\n"
    "cgroup_fd, the tree keeping its shape, pids, sessions, process groups,\n"
    "pipes and socket pairs. subst, a sequence of (index, fd, caller_fd),\n"
    "gives the clone of source_pids[index] the caller's open file caller_fd\n"
    "at fd instead of a copy of its source's (BUNSHIN_TREE_SUBST, ABI 4).\n"
    "Return the clones' pids (in the caller's pid namespace) as a list, in\n"
    "the order of source_pids.";

PyObject *
bunshin_bunshin_fork_tree(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"fd", "source_pids", "target_pidfd", "cgroup_fd", "subst", NULL};
    struct bunshin_tree_req req;
    struct bunshin_tree_subst *subs = NULL;
    PyObject *seq = NULL, *pids = NULL, *result = NULL, *item, *subst = NULL, *sseq = NULL;
    int32_t *source = NULL, *child = NULL;
    int fd, target_pidfd, cgroup_fd;
    unsigned int s_index, s_fd;
    int s_caller;
    Py_ssize_t n, i, ns = 0;
    long v;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iOii|$O:bunshin_fork_tree", kwlist, &fd,
                                     &pids, &target_pidfd, &cgroup_fd, &subst))
        goto error;
    if (subst != NULL) {
        sseq = PySequence_Fast(subst, "subst must be a sequence of (index, fd, caller_fd)");
        if (sseq == NULL)
            goto error;
        ns = PySequence_Fast_GET_SIZE(sseq);
        if (ns > BUNSHIN_TREE_SUBST_MAX) {
            PyErr_Format(PyExc_ValueError, "subst must hold at most %d entries, not %zd",
                         BUNSHIN_TREE_SUBST_MAX, ns);
            goto error;
        }
        if (ns > 0) {
            subs = PyMem_Calloc((size_t)ns, sizeof(*subs));
            if (subs == NULL) {
                PyErr_NoMemory();
                goto error;
            }
        }
        for (i = 0; i < ns; i++) {
            if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(sseq, i), "IIi;subst entries are "
                                  "(index, fd, caller_fd)", &s_index, &s_fd, &s_caller))
                goto error;
            subs[i].index = s_index;
            subs[i].fd = s_fd;
            subs[i].caller_fd = s_caller;
        }
    }
    seq = PySequence_Fast(pids, "source_pids must be a sequence of pids");
    if (seq == NULL)
        goto error;
    n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > BUNSHIN_TREE_MAX) {
        PyErr_Format(PyExc_ValueError, "source_pids must hold 1 to %d pids, not %zd",
                     BUNSHIN_TREE_MAX, n);
        goto error;
    }
    source = PyMem_Calloc((size_t)n, sizeof(*source));
    child = PyMem_Calloc((size_t)n, sizeof(*child));
    if (source == NULL || child == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (i = 0; i < n; i++) {
        v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v == -1 && PyErr_Occurred())
            goto error;
        if (v <= 0 || v > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "source_pids[%zd] is not a pid: %ld", i, v);
            goto error;
        }
        source[i] = (int32_t)v;
    }
    memset(&req, 0, sizeof(req));
    req.count = (__u32)n;
    req.source_pids = (__u64)(uintptr_t)source;
    req.child_pids = (__u64)(uintptr_t)child;
    req.target_pidfd = target_pidfd;
    req.cgroup_fd = cgroup_fd;
    if (ns > 0) {
        req.flags = BUNSHIN_TREE_SUBST;
        req.subst = (__u64)(uintptr_t)subs;
        req.subst_count = (__u32)ns;
    }
    /* As for bunshin_fork: EINTR only after the module undid everything. */
    if (bunshin_dev_ioctl(fd, BUNSHIN_IOC_FORK_TREE, &req, "ioctl BUNSHIN_IOC_FORK_TREE") < 0)
        goto error;
    result = PyList_New(n);
    if (result == NULL)
        goto error;
    for (i = 0; i < n; i++) {
        item = PyLong_FromLong(child[i]);
        if (item == NULL)
            goto error;
        PyList_SET_ITEM(result, i, item);
    }
    PyMem_Free(subs);
    PyMem_Free(child);
    PyMem_Free(source);
    Py_XDECREF(sseq);
    Py_DECREF(seq);
    return result;
error:
    Py_XDECREF(result);
    PyMem_Free(subs);
    PyMem_Free(child);
    PyMem_Free(source);
    Py_XDECREF(sseq);
    Py_XDECREF(seq);
    return NULL;
}
