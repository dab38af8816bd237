/* module.c: the bunshin_async._bunshin_c module: one method table, the
 * constants, and multi-phase initialisation. */
#include "bunshin_c.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>

#ifndef PIDFD_NONBLOCK
#define PIDFD_NONBLOCK O_NONBLOCK
#endif
#ifndef UMOUNT_NOFOLLOW
#define UMOUNT_NOFOLLOW 0x00000008
#endif

/* bunshin_dev.c: the /dev/bunshin ioctls. */
BUNSHIN_DECLARE(bunshin_version);
BUNSHIN_DECLARE(bunshin_fork);
BUNSHIN_DECLARE(bunshin_fork_tree);
int bunshin_dev_exec(PyObject *module);

#define METHOD(name) \
    {#name, (PyCFunction)(void (*)(void))bunshin_##name, METH_VARARGS | METH_KEYWORDS, \
     bunshin_##name##_doc}

static PyMethodDef bunshin_methods[] = {
    METHOD(clone3),
    METHOD(pidfd_open),
    METHOD(pidfd_send_signal),
    METHOD(pidfd_getfd),
    METHOD(setns),
    METHOD(unshare),
    METHOD(mount),
    METHOD(umount2),
    METHOD(pivot_root),
    METHOD(scan_pages),
    METHOD(bunshin_version),
    METHOD(bunshin_fork),
    METHOD(bunshin_fork_tree),
    {NULL, NULL, 0, NULL},
};

static const struct {
    const char *name;
    unsigned long long value;
} bunshin_constants[] = {
#define C(name) {#name, (unsigned long long)(name)}
    C(CLONE_NEWNS), C(CLONE_NEWPID), C(CLONE_NEWNET), C(CLONE_NEWUTS),
    C(CLONE_NEWIPC), C(CLONE_NEWCGROUP), C(CLONE_NEWTIME), C(CLONE_NEWUSER),
    C(CLONE_INTO_CGROUP), C(CLONE_PIDFD), C(CLONE_CLEAR_SIGHAND),
    C(CLONE_PARENT), C(CLONE_FILES), C(CLONE_FS), C(CLONE_SYSVSEM),
    C(MS_RDONLY), C(MS_NOSUID), C(MS_NODEV), C(MS_NOEXEC), C(MS_BIND), C(MS_REC),
    C(MS_PRIVATE), C(MS_SLAVE), C(MS_SHARED), C(MS_UNBINDABLE), C(MS_REMOUNT),
    C(MS_MOVE), C(MS_NOATIME), C(MS_NODIRATIME), C(MS_STRICTATIME), C(MS_RELATIME),
    C(MNT_DETACH), C(MNT_FORCE), C(MNT_EXPIRE), C(UMOUNT_NOFOLLOW),
    C(PIDFD_NONBLOCK),
#undef C
};

static int
bunshin_exec(PyObject *module)
{
    size_t i;

    for (i = 0; i < sizeof(bunshin_constants) / sizeof(bunshin_constants[0]); i++) {
        PyObject *value = PyLong_FromUnsignedLongLong(bunshin_constants[i].value);
        if (value == NULL)
            goto error;
        if (PyModule_AddObject(module, bunshin_constants[i].name, value) < 0) {
            Py_DECREF(value);
            goto error;
        }
    }
    if (bunshin_pagescan_exec(module) < 0)
        goto error;
    if (bunshin_dev_exec(module) < 0)
        goto error;
    return 0;
error:
    return -1;
}

static int
bunshin_traverse(PyObject *module, visitproc visit, void *arg)
{
    bunshin_state *state = bunshin_get_state(module);

    Py_VISIT(state->PageScanType);
    return 0;
}

static int
bunshin_clear(PyObject *module)
{
    bunshin_state *state = bunshin_get_state(module);

    Py_CLEAR(state->PageScanType);
    return 0;
}

static void
bunshin_free(void *module)
{
    bunshin_clear((PyObject *)module);
}

static PyModuleDef_Slot bunshin_slots[] = {
    {Py_mod_exec, bunshin_exec},
    {0, NULL},
};

PyDoc_STRVAR(bunshin_module_doc,
"Linux syscalls the live backend needs (clone3, pidfd_*, setns, unshare,\n"
"mount, umount2, pivot_root) and an exact page scanner (scan_pages).\n"
"\n"
"Errors are OSError subclasses chosen by errno; the message names the\n"
"syscall, e.g. \"[Errno 3] pidfd_open: No such process\".");

static struct PyModuleDef bunshin_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "bunshin_async._bunshin_c",
    .m_doc = bunshin_module_doc,
    .m_size = sizeof(bunshin_state),
    .m_methods = bunshin_methods,
    .m_slots = bunshin_slots,
    .m_traverse = bunshin_traverse,
    .m_clear = bunshin_clear,
    .m_free = bunshin_free,
};

PyMODINIT_FUNC
PyInit__bunshin_c(void)
{
    return PyModuleDef_Init(&bunshin_module);
}
