// The KV integrity check on the CPU (hearth.kv.integrity.BatchedPageTagCheck): every entry of a step's
// page table against the pool's tag for that page, read straight from the step's two Python int lists.
//
// Why compiled, when the arithmetic is a gather and a compare: the check runs once per step right after
// the previous step's forward has pushed everything else out of the caches, and there NumPy's code path
// (array from lists, .numpy(), fancy index, two compares, any) ran cold: ~110-150 us a step at batch 1
// (the same calls ~12 us back to back), ~1.5% of a 7.7 ms decode step. This loop is a few cache lines of
// code, and the pybind11 dispatch and CPython int reads it uses are the ones every kernel call of the
// forward has just used. ATen core headers only (see rms_norm.cpp); bindings.cpp wraps it for pybind11.
#include <Python.h>

#include <ATen/core/Tensor.h>

#include <cstdint>

// New reference: a list of the flat indices i where expected[i] != padding_tag and page_table[i] is not
// a page of the pool or pool_tags[page_table[i]] != expected[i]; empty when every entry matches.
// nullptr with a Python error set when an item is not an int.
PyObject* check_page_tags_lists(const at::Tensor& pool_tags, PyObject* page_table, PyObject* expected,
                                int64_t padding_tag) {
  TORCH_CHECK(pool_tags.device().is_cpu() && pool_tags.dim() == 1 && pool_tags.scalar_type() == at::kLong &&
                  pool_tags.is_contiguous(),
              "check_page_tags: pool_tags must be a contiguous 1-D int64 CPU tensor");
  const Py_ssize_t n = PyList_GET_SIZE(page_table);
  TORCH_CHECK(PyList_GET_SIZE(expected) == n, "check_page_tags: ", n, " page table entries but ",
              PyList_GET_SIZE(expected), " expected tags");
  const int64_t* tags = pool_tags.data_ptr<int64_t>();
  const int64_t num_pages = pool_tags.size(0);
  PyObject* bad = PyList_New(0);
  if (bad == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const long long want = PyLong_AsLongLong(PyList_GET_ITEM(expected, i));
    if (want == -1 && PyErr_Occurred()) break;
    if (want == padding_tag) continue;  // padding: never read
    const long long page = PyLong_AsLongLong(PyList_GET_ITEM(page_table, i));
    if (page == -1 && PyErr_Occurred()) break;
    // An id outside the pool is as wrong as a reused page (and must not be read here either).
    if (page < 0 || page >= num_pages || tags[page] != want) {
      PyObject* index = PyLong_FromSsize_t(i);
      if (index == nullptr || PyList_Append(bad, index) != 0) {
        Py_XDECREF(index);
        break;
      }
      Py_DECREF(index);
    }
  }
  if (PyErr_Occurred()) {
    Py_DECREF(bad);
    return nullptr;
  }
  return bad;
}
