/* errors.c: exceptions that name the syscall, and argument converters. */
#include "bunshin_c.h"

#include <string.h>

static PyObject *
make_oserror(int err, PyObject *message, PyObject *filename, PyObject *filename2)
{
    PyObject *args = NULL, *exc = NULL;

    if (filename2 != NULL) {
        args = Py_BuildValue("(iOOOO)", err, message, filename ? filename : Py_None,
                             Py_None, filename2);
    }
    else if (filename != NULL) {
        args = Py_BuildValue("(iOO)", err, message, filename);
    }
    else {
        args = Py_BuildValue("(iO)", err, message);
    }
    if (args == NULL)
        goto error;
    /* OSError.__new__ picks the subclass for errno (ESRCH -> ProcessLookupError). */
    exc = PyObject_Call(PyExc_OSError, args, NULL);
    if (exc == NULL)
        goto error;
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
error:
    Py_XDECREF(exc);
    Py_XDECREF(args);
    return NULL;
}

PyObject *
bunshin_set_errno(int err, const char *syscall, PyObject *filename, PyObject *filename2)
{
    PyObject *message = PyUnicode_FromFormat("%s: %s", syscall, strerror(err));

    if (message == NULL)
        return NULL;
    make_oserror(err, message, filename, filename2);
    Py_DECREF(message);
    return NULL;
}

PyObject *
bunshin_set_errno_detail(int err, const char *syscall, const char *detail, PyObject *filename)
{
    PyObject *message = PyUnicode_FromFormat("%s: %s (%s)", syscall, strerror(err), detail);

    if (message == NULL)
        return NULL;
    make_oserror(err, message, filename, NULL);
    Py_DECREF(message);
    return NULL;
}

int
bunshin_path_converter(PyObject *obj, void *out)
{
    /* PyUnicode_FSConverter accepts str, bytes and os.PathLike, and supports
     * cleanup (Py_CLEANUP_SUPPORTED) when called with NULL. */
    return PyUnicode_FSConverter(obj, out);
}

int
bunshin_optional_path_converter(PyObject *obj, void *out)
{
    if (obj == Py_None) {
        *(PyObject **)out = NULL;
        return 1;
    }
    return PyUnicode_FSConverter(obj, out);
}

int
bunshin_u64_converter(PyObject *obj, void *out)
{
    PyObject *index = PyNumber_Index(obj);
    unsigned long long value;

    if (index == NULL)
        return 0;
    value = PyLong_AsUnsignedLongLong(index);
    Py_DECREF(index);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    *(uint64_t *)out = (uint64_t)value;
    return 1;
}

int
bunshin_ulong_converter(PyObject *obj, void *out)
{
    PyObject *index = PyNumber_Index(obj);
    unsigned long value;

    if (index == NULL)
        return 0;
    value = PyLong_AsUnsignedLong(index);
    Py_DECREF(index);
    if (value == (unsigned long)-1 && PyErr_Occurred())
        return 0;
    *(unsigned long *)out = value;
    return 1;
}

PyObject *
bunshin_path_for_error(PyObject *bytes_path)
{
    if (bytes_path == NULL)
        Py_RETURN_NONE;
    return PyUnicode_DecodeFSDefaultAndSize(PyBytes_AS_STRING(bytes_path),
                                            PyBytes_GET_SIZE(bytes_path));
}

PyObject *
bunshin_set_errno_path(int err, const char *syscall, PyObject *bytes_path)
{
    PyObject *name = bunshin_path_for_error(bytes_path);

    if (name == NULL)
        return NULL;
    bunshin_set_errno(err, syscall, name, NULL);
    Py_DECREF(name);
    return NULL;
}
