/* untrack.py's walk in C: the tuples and frozensets of a matcher state taken off the cyclic
 * collector's lists (PyObject_GC_UnTrack), stopping at those already untracked. One call per
 * state instead of one ctypes call per tuple (a state's new frames are a few tuples each):
 * 0.45 us a state against 1.2 us. Loaded with ctypes.PyDLL: the GIL is held throughout, as
 * the C API requires. */
#include <Python.h>
#include <stdlib.h>

#define SMALL 64

static int push(PyObject ***stack, Py_ssize_t *n, Py_ssize_t *cap, PyObject **small, PyObject *y) {
    if (*n == *cap) {  /* (a state is a few frames deep: the small stack almost always holds it) */
        Py_ssize_t grown = 2 * *cap;
        PyObject **bigger = (PyObject **)malloc((size_t)grown * sizeof(PyObject *));
        if (bigger == NULL)
            return -1;
        memcpy(bigger, *stack, (size_t)*n * sizeof(PyObject *));
        if (*stack != small)
            free(*stack);
        *stack = bigger;
        *cap = grown;
    }
    (*stack)[(*n)++] = y;
    return 0;
}

static int holds_states(PyObject *y) {
    return (PyTuple_CheckExact(y) || PyFrozenSet_CheckExact(y)) && PyObject_GC_IsTracked(y);
}

void cfg_untrack(PyObject *root) {
    PyObject *small[SMALL];
    PyObject **stack = small;
    Py_ssize_t n = 0, cap = SMALL;
    if (!holds_states(root))
        return;
    stack[n++] = root;
    while (n > 0) {
        PyObject *x = stack[--n];
        if (!PyObject_GC_IsTracked(x))
            continue;
        PyObject_GC_UnTrack(x);
        if (PyTuple_CheckExact(x)) {
            Py_ssize_t size = PyTuple_GET_SIZE(x);
            for (Py_ssize_t i = 0; i < size; i++) {
                PyObject *y = PyTuple_GET_ITEM(x, i);
                if (holds_states(y) && push(&stack, &n, &cap, small, y) < 0)
                    goto done;  /* (out of memory: the rest stays tracked, only collections are slower) */
            }
        } else {  /* a frozenset (of key names: strings mostly) */
            PyObject *it = PyObject_GetIter(x), *y;
            if (it == NULL) {
                PyErr_Clear();
                continue;
            }
            while ((y = PyIter_Next(it)) != NULL) {
                int failed = holds_states(y) && push(&stack, &n, &cap, small, y) < 0;
                Py_DECREF(y);  /* (the set holds it: the pointer stays valid while the state lives) */
                if (failed) {
                    Py_DECREF(it);
                    goto done;
                }
            }
            Py_DECREF(it);
            PyErr_Clear();
        }
    }
done:
    if (stack != small)
        free(stack);
}
