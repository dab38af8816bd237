/* mount.c: mount, umount2, pivot_root. */
#include "bunshin_c.h"

#include <sys/mount.h>

#ifndef SYS_pivot_root
#define SYS_pivot_root 155
#endif

static inline int
sys_pivot_root(const char *new_root, const char *put_old)
{
    return (int)syscall(SYS_pivot_root, new_root, put_old);
}

#define PATH_OR_NULL(obj) ((obj) != NULL ? PyBytes_AS_STRING(obj) : NULL)

const char bunshin_mount_doc[] =
    "mount(source, target, fstype=None, flags=0, data=None)\n--\n\n"
    "mount(2). source, fstype and data may be None (for a remount, a bind or\n"
    "a propagation change). Paths may be str, bytes or os.PathLike.";

PyObject *
bunshin_mount(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"source", "target", "fstype", "flags", "data", NULL};
    PyObject *source = NULL, *target = NULL, *fstype = NULL, *data = NULL;
    PyObject *result = NULL;
    unsigned long flags = 0;
    int r, async_err = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O&O&|O&O&O&:mount", kwlist,
                                     bunshin_optional_path_converter, &source,
                                     bunshin_path_converter, &target,
                                     bunshin_optional_path_converter, &fstype,
                                     bunshin_ulong_converter, &flags,
                                     bunshin_optional_path_converter, &data))
        goto error;
    BUNSHIN_SYSCALL(r, async_err,
                    mount(PATH_OR_NULL(source), PyBytes_AS_STRING(target),
                          PATH_OR_NULL(fstype), flags, PATH_OR_NULL(data)));
    if (async_err)
        goto error;
    if (r < 0) {
        bunshin_set_errno_path(errno, "mount", target);
        goto error;
    }
    result = Py_NewRef(Py_None);
error:
    Py_XDECREF(source);
    Py_XDECREF(target);
    Py_XDECREF(fstype);
    Py_XDECREF(data);
    return result;
}

const char bunshin_umount2_doc[] =
    "umount2(target, flags=0)\n--\n\n"
    "umount2(2); flags: MNT_DETACH, MNT_FORCE, MNT_EXPIRE, UMOUNT_NOFOLLOW.";

PyObject *
bunshin_umount2(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"target", "flags", NULL};
    PyObject *target = NULL, *result = NULL;
    int flags = 0, r, async_err = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O&|i:umount2", kwlist,
                                     bunshin_path_converter, &target, &flags))
        goto error;
    BUNSHIN_SYSCALL(r, async_err, umount2(PyBytes_AS_STRING(target), flags));
    if (async_err)
        goto error;
    if (r < 0) {
        bunshin_set_errno_path(errno, "umount2", target);
        goto error;
    }
    result = Py_NewRef(Py_None);
error:
    Py_XDECREF(target);
    return result;
}

const char bunshin_pivot_root_doc[] =
    "pivot_root(new_root, put_old)\n--\n\n"
    "pivot_root(2): make new_root the root mount of the calling process's\n"
    "mount namespace and move the old root to put_old.";

PyObject *
bunshin_pivot_root(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"new_root", "put_old", NULL};
    PyObject *new_root = NULL, *put_old = NULL, *result = NULL;
    PyObject *name = NULL, *name2 = NULL;
    int r, async_err = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O&O&:pivot_root", kwlist,
                                     bunshin_path_converter, &new_root,
                                     bunshin_path_converter, &put_old))
        goto error;
    BUNSHIN_SYSCALL(r, async_err,
                    sys_pivot_root(PyBytes_AS_STRING(new_root), PyBytes_AS_STRING(put_old)));
    if (async_err)
        goto error;
    if (r < 0) {
        int err = errno;
        name = bunshin_path_for_error(new_root);
        name2 = bunshin_path_for_error(put_old);
        if (name != NULL && name2 != NULL)
            bunshin_set_errno(err, "pivot_root", name, name2);
        goto error;
    }
    result = Py_NewRef(Py_None);
error:
    Py_XDECREF(name);
    Py_XDECREF(name2);
    Py_XDECREF(new_root);
    Py_XDECREF(put_old);
    return result;
}
