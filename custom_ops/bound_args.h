// Argument checks of the library's bound entry points (step_ops.cc, step_ledger.cc).
//
// Every entry point checks its arguments here, once (the Python face in
// fd_routing_replay/ops/step.py passes them through): a malformed one throws
// std::invalid_argument with a message naming it, which the module (PYBIND11_MODULE in
// step_ops.cc) raises as fd_routing_replay.errors.OpsError, a ValueError.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace fdrr {

namespace py = pybind11;

[[noreturn]] inline void Refuse(const std::string& message) { throw std::invalid_argument(message); }

// "a" or "an" before `word` as it is read out ("a uint8", "an int64").
inline std::string WithArticle(const std::string& word) {
  const bool vowel = !word.empty() && std::string("aeioAEIO").find(word[0]) != std::string::npos;
  return (vowel ? "an " : "a ") + word;
}

// What `obj` is, for a message: "a read-only float64 array of shape (2, 3)", or its type.
inline std::string Describe(const py::handle& obj) {
  if (!py::isinstance<py::array>(obj)) return WithArticle(Py_TYPE(obj.ptr())->tp_name);
  const auto a = py::reinterpret_borrow<py::array>(obj);
  std::string shape = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) shape += (i ? ", " : "") + std::to_string(a.shape(i));
  shape += a.ndim() == 1 ? ",)" : ")";
  std::string traits = (a.flags() & py::array::c_style) ? "" : "non-contiguous ";
  if (!a.writeable()) traits += "read-only ";
  return WithArticle(traits + std::string(py::str(a.dtype())) + " array of shape " + shape);
}

// Item sizes as a bit set: bit n allows 2^n bytes (kBytes1 | kBytes8: one or eight bytes).
constexpr int kBytes1 = 1, kBytes2 = 2, kBytes4 = 4, kBytes8 = 8;

// The NumPy names of integer `kind` ('i', 'u' or 'b') at the item sizes in `sizes`.
inline std::string TypeNames(char kind, int sizes) {
  if (kind == 'b') return "bool";
  std::string names;
  for (int bytes : {1, 2, 4, 8}) {
    if (!(sizes & bytes)) continue;
    names += (names.empty() ? "" : "/") + std::string(kind == 'u' ? "uint" : "int") +
             std::to_string(8 * bytes);
  }
  return names;
}

// `obj` as a C-contiguous numpy array of integer `kind` ('i', 'u', 'b') with an item size in
// `sizes`, `ndim` dimensions (-1: any) and writeable when asked; refused naming `name`.
inline py::array Array(const py::handle& obj, const char* name, char kind, int sizes, int ndim,
                       bool writeable) {
  bool ok = py::isinstance<py::array>(obj);
  if (ok) {
    const auto a = py::reinterpret_borrow<py::array>(obj);
    const auto bytes = static_cast<int>(a.itemsize());
    ok = (a.flags() & py::array::c_style) && a.dtype().kind() == kind && bytes <= 8 && (bytes & sizes) &&
         (ndim < 0 || a.ndim() == ndim) && (!writeable || a.writeable());
  }
  if (!ok) {
    const std::string rank = ndim < 0 ? "" : std::to_string(ndim) + "-D ";
    Refuse(std::string(name) + " must be a C-contiguous " + (writeable ? "writeable " : "") + rank +
           TypeNames(kind, sizes) + " numpy array, got " + Describe(obj));
  }
  return py::reinterpret_borrow<py::array>(obj);
}

// `obj` as an int64: a Python or NumPy integer (not a bool, not a float); refused naming `name`.
inline int64_t Int(const py::handle& obj, const std::string& name) {
  PyObject* o = obj.ptr();
  if (PyBool_Check(o) || PyFloat_Check(o) || !PyIndex_Check(o)) {
    Refuse(name + " must be an integer, got " + Describe(obj) + " " + std::string(py::repr(obj)));
  }
  return py::reinterpret_steal<py::object>(PyNumber_Index(o)).cast<int64_t>();
}

}  // namespace fdrr
