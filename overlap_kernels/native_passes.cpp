// The packing ops' per-tensor passes over a list, each one loop in C++ (overlap_kernels/native_passes.py
// builds this file against the installed torch and states the contract of every function).
//
// Every function takes a list or a tuple of tensors. An item that is not exactly a torch.Tensor or
// an nn.Parameter (a subclass may redefine what its data means) makes `addresses`, `contiguous`,
// `dtypes` and `describe` return None and `matches` False, so that the caller takes the Python
// path; `increment_version` raises TypeError for it, as torch's own raises for a non-tensor.
#include <Python.h>

#include <cstdint>
#include <vector>

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

namespace {

// The items of the list or tuple a function was given, for the length of the call.
class Listed {
 public:
  explicit Listed(PyObject* tensors) {
    if (!PyList_Check(tensors) && !PyTuple_Check(tensors)) {
      PyErr_SetString(PyExc_TypeError, "tensors must be a list or a tuple of tensors");
      return;
    }
    fast_ = PySequence_Fast(tensors, "tensors must be a list or a tuple of tensors");
    if (fast_ != nullptr) {
      size_ = PySequence_Fast_GET_SIZE(fast_);
      items_ = PySequence_Fast_ITEMS(fast_);
    }
  }
  ~Listed() { Py_XDECREF(fast_); }
  Listed(const Listed&) = delete;
  Listed& operator=(const Listed&) = delete;

  bool ok() const { return fast_ != nullptr; }
  Py_ssize_t size() const { return size_; }
  PyObject* item(Py_ssize_t i) const { return items_[i]; }
  const at::Tensor& tensor(Py_ssize_t i) const { return THPVariable_Unpack(items_[i]); }
  bool plain(Py_ssize_t i) const { return THPVariable_CheckExact(items_[i]); }
  bool all_plain() const {
    for (Py_ssize_t i = 0; i < size_; ++i) {
      if (!plain(i)) return false;
    }
    return true;
  }
  int64_t python_type(Py_ssize_t i) const {  // 0 torch.Tensor, 1 nn.Parameter (items are plain)
    return Py_TYPE(items_[i]) == reinterpret_cast<PyTypeObject*>(THPVariableClass) ? 0 : 1;
  }

 private:
  PyObject* fast_ = nullptr;
  Py_ssize_t size_ = 0;
  PyObject** items_ = nullptr;
};

// `body()` with a C++ exception (a c10::Error from a tensor read) turned into a RuntimeError.
template <class Body>
PyObject* guarded(Body body) {
  try {
    return body();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// A description is an int64 array: per tensor, kHeader words then its sizes and its strides.
// Header: Python type (0 Tensor, 1 Parameter), dispatch key set (raw), scalar type, device type,
// device index, requires_grad, number of dimensions.
constexpr Py_ssize_t kHeader = 7;

void header_of(const Listed& listed, Py_ssize_t i, int64_t* out) {
  const at::Tensor& t = listed.tensor(i);
  out[0] = listed.python_type(i);
  out[1] = static_cast<int64_t>(t.unsafeGetTensorImpl()->key_set().raw_repr());
  out[2] = static_cast<int64_t>(t.scalar_type());
  out[3] = static_cast<int64_t>(t.device().type());
  out[4] = static_cast<int64_t>(t.device().index());
  out[5] = t.requires_grad() ? 1 : 0;
  out[6] = static_cast<int64_t>(t.dim());
}

// Does item `i` match the description at `words[*at]` (of `size` words)? Advances `*at` past it.
bool matches_one(const Listed& listed, Py_ssize_t i, const int64_t* words, Py_ssize_t size, Py_ssize_t* at) {
  if (!listed.plain(i) || *at + kHeader > size) return false;
  const at::Tensor& t = listed.tensor(i);
  if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return false;
  int64_t header[kHeader];
  header_of(listed, i, header);
  const int64_t* w = words + *at;
  const int64_t ndim = header[6];
  if (*at + kHeader + 2 * ndim > size) return false;
  for (Py_ssize_t k = 0; k < kHeader; ++k) {
    if (w[k] != header[k]) return false;
  }
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  for (int64_t d = 0; d < ndim; ++d) {
    if (w[kHeader + d] != sizes[d] || w[kHeader + ndim + d] != strides[d]) return false;
  }
  *at += kHeader + 2 * ndim;
  return true;
}

// addresses(tensors) -> bytes | None: each tensor's data_ptr(), in order, as native int64 words.
PyObject* addresses(PyObject*, PyObject* tensors) {
  Listed listed(tensors);
  if (!listed.ok()) return nullptr;
  if (!listed.all_plain()) Py_RETURN_NONE;
  PyObject* out = PyBytes_FromStringAndSize(nullptr, listed.size() * static_cast<Py_ssize_t>(sizeof(int64_t)));
  if (out == nullptr) return nullptr;
  auto* words = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(out));
  PyObject* done = guarded([&]() -> PyObject* {
    for (Py_ssize_t i = 0; i < listed.size(); ++i) {
      // Tensor.data_ptr() in Python: the mutable pointer (a lazily copied storage materializes first)
      words[i] = static_cast<int64_t>(reinterpret_cast<intptr_t>(listed.tensor(i).data_ptr()));
    }
    return out;
  });
  if (done == nullptr) Py_DECREF(out);
  return done;
}

// contiguous(tensors) -> bool | None: whether every tensor is contiguous (Tensor.is_contiguous()).
PyObject* contiguous(PyObject*, PyObject* tensors) {
  Listed listed(tensors);
  if (!listed.ok()) return nullptr;
  if (!listed.all_plain()) Py_RETURN_NONE;
  return guarded([&]() -> PyObject* {
    for (Py_ssize_t i = 0; i < listed.size(); ++i) {
      if (!listed.tensor(i).is_contiguous()) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
  });
}

// dtypes(tensors) -> tuple[torch.dtype, ...] | None: each tensor's dtype, in order.
PyObject* dtypes(PyObject*, PyObject* tensors) {
  Listed listed(tensors);
  if (!listed.ok()) return nullptr;
  if (!listed.all_plain()) Py_RETURN_NONE;
  PyObject* out = PyTuple_New(listed.size());
  if (out == nullptr) return nullptr;
  PyObject* done = guarded([&]() -> PyObject* {
    for (Py_ssize_t i = 0; i < listed.size(); ++i) {
      PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(listed.tensor(i).scalar_type()));
      Py_INCREF(dtype);
      PyTuple_SET_ITEM(out, i, dtype);
    }
    return out;
  });
  if (done == nullptr) Py_DECREF(out);
  return done;
}

// increment_version(tensors) -> None: what torch.autograd.graph.increment_version does (a tensor
// made under inference mode has no version counter and is skipped). Every item is checked first.
PyObject* increment_version(PyObject*, PyObject* tensors) {
  Listed listed(tensors);
  if (!listed.ok()) return nullptr;
  for (Py_ssize_t i = 0; i < listed.size(); ++i) {
    if (!THPVariable_Check(listed.item(i))) {
      PyErr_Format(PyExc_TypeError, "tensors[%zd] must be a tensor, got %s", i, Py_TYPE(listed.item(i))->tp_name);
      return nullptr;
    }
  }
  return guarded([&]() -> PyObject* {
    for (Py_ssize_t i = 0; i < listed.size(); ++i) {
      const at::Tensor& t = listed.tensor(i);
      if (!t.is_inference()) torch::autograd::impl::bump_version(t);
    }
    Py_RETURN_NONE;
  });
}

// describe(tensors) -> bytes | None: what `matches` compares a later list with.
PyObject* describe(PyObject*, PyObject* tensors) {
  Listed listed(tensors);
  if (!listed.ok()) return nullptr;
  if (!listed.all_plain()) Py_RETURN_NONE;
  return guarded([&]() -> PyObject* {
    std::vector<int64_t> words;
    for (Py_ssize_t i = 0; i < listed.size(); ++i) {
      const at::Tensor& t = listed.tensor(i);
      if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) Py_RETURN_NONE;
      words.resize(words.size() + kHeader);
      header_of(listed, i, words.data() + words.size() - kHeader);
      const auto sizes = t.sizes();
      const auto strides = t.strides();
      words.insert(words.end(), sizes.begin(), sizes.end());
      words.insert(words.end(), strides.begin(), strides.end());
    }
    return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(words.data()),
                                     static_cast<Py_ssize_t>(words.size() * sizeof(int64_t)));
  });
}

// matches(tensors, description) -> bool: does every tensor still have what `describe` recorded, and
// the list as many tensors as it describes?
PyObject* matches(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyBytes_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "matches(tensors, description: bytes)");
    return nullptr;
  }
  Listed listed(args[0]);
  if (!listed.ok()) return nullptr;
  const auto* words = reinterpret_cast<const int64_t*>(PyBytes_AS_STRING(args[1]));
  const Py_ssize_t size = PyBytes_GET_SIZE(args[1]) / static_cast<Py_ssize_t>(sizeof(int64_t));
  return guarded([&]() -> PyObject* {
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < listed.size(); ++i) {
      if (!matches_one(listed, i, words, size, &at)) Py_RETURN_FALSE;
    }
    return PyBool_FromLong(at == size);  // a longer description: another list
  });
}

PyMethodDef kMethods[] = {
    {"addresses", addresses, METH_O, "Each tensor's data_ptr() as int64 bytes, or None for a non-plain item."},
    {"contiguous", contiguous, METH_O, "Whether every tensor is contiguous, or None for a non-plain item."},
    {"dtypes", dtypes, METH_O, "Each tensor's dtype, or None for a list with a non-plain item."},
    {"increment_version", increment_version, METH_O, "torch.autograd.graph.increment_version over a list."},
    {"describe", describe, METH_O, "A description of each tensor's type, keys, dtype, device, sizes, strides."},
    {"matches", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(matches)), METH_FASTCALL,
     "Whether a list still matches a description."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_passes", nullptr, -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__native_passes() { return PyModule_Create(&kModule); }
