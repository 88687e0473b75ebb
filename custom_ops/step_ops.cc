// The token-major step buffer's bound recorder, and the library's pybind11 module.
//
//   buffer[max_batched_tokens, num_layers, top_k]   routing dtype (uint8/uint16/uint32)
//   counters[1 + num_layers]                        int64 on the buffer's device:
//       counters[0]      ids outside [0, num_experts), written as the fill;
//       counters[1 + l]  calls that recorded MoE layer row l.
//
// Token t of the step is row t, so a MoE layer's write needs no index tensor, no lookup,
// no allocation and no host sync (CUDA-graph capturable); the counters live on the device
// and are read once per step with the rows, so they stay right under graph replay.
//
// StepRecorder is a pybind11 class: the buffer, counters, layer map and host staging are
// validated once when it is bound; a call checks only what can change per call (topk_ids'
// dtype, shape and place: integer compares) and launches.  No Paddle op is registered:
// Paddle's generic custom-op dispatch (_C_ops._run_custom_op) costs 10-170 us per call and
// grows with the number of registered ops; this path does not go through it.
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "bound_args.h"
#include "paddle/extension.h"
#include "paddle/utils/pybind.h"
#include "routing_kernels.h"

#ifdef PADDLE_WITH_CUDA
// Defined in step_ops.cu.
void FdrrRecordRowsCUDA(paddle::Tensor& buffer, const paddle::Tensor& topk_ids,
                        paddle::Tensor& counters, const fdrr::RowsArgs& args);
void FdrrOffloadCUDA(const paddle::Tensor& buffer, const fdrr::Offload& offload, void* event);
void* FdrrEventCreate();
void FdrrEventDestroy(void* event);
void FdrrEventSynchronize(void* event);
bool FdrrHostRegister(void* ptr, int64_t bytes);
void FdrrHostUnregister(void* ptr);
void FdrrFillCUDA(paddle::Tensor& buffer, int64_t bytes);
#endif

namespace {

namespace py = pybind11;
using fdrr::Refuse;
using paddle::DataType;

// The class every refusal of this module is raised as (fd_routing_replay.errors.OpsError,
// set by fd_routing_replay.ops.backend when it loads the module).
PyObject* g_error_type = PyExc_ValueError;

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// `obj` as a Paddle tensor, refused naming `name` otherwise.
const paddle::Tensor& TensorArg(const py::handle& obj, const char* name, ssize_t position) {
  if (!paddle::pybind::PyCheckTensor(obj.ptr())) {
    Refuse(std::string(name) + " must be a paddle.Tensor, got " + fdrr::Describe(obj));
  }
  return paddle::pybind::CastPyArg2Tensor(obj.ptr(), position);
}

int64_t BufferElemBytes(DataType dtype) {
  switch (dtype) {
    case DataType::UINT8: return 1;
    case DataType::UINT16: return 2;
    case DataType::UINT32: return 4;
    case DataType::BFLOAT16:
      Refuse("buffer must be uint8, uint16 or uint32 (the routing dtype), got bfloat16: Paddle's dtype "
             "string 'uint16' means bfloat16; make the buffer with new_step_buffer");
    default:
      Refuse("buffer must be uint8, uint16 or uint32 (the routing dtype), got " +
             phi::DataTypeToString(dtype));
  }
}

int64_t FillOf(int64_t elem) {
  return elem == 4 ? int64_t{0xFFFFFFFF} : (int64_t{1} << (8 * elem)) - 1;
}

template <typename BufT>
int64_t RowsByIds(void* buffer, const paddle::Tensor& topk_ids, const fdrr::RowsArgs& a) {
  if (topk_ids.dtype() == DataType::INT32) {
    return fdrr::record_rows_cpu(static_cast<BufT*>(buffer),
                                 static_cast<const int32_t*>(topk_ids.data()), a);
  }
  return fdrr::record_rows_cpu(static_cast<BufT*>(buffer),
                               static_cast<const int64_t*>(topk_ids.data()), a);
}

class StepRecorder {
 public:
  // buffer, counters: tensors on one device (new_step_buffer, int64 [1 + L]); num_experts:
  // ids at or above it are bad; layer_rows: None, or the buffer row of each FastDeploy MoE
  // layer index (negative: not a MoE layer); host_rows [capacity, L, K] of the buffer's
  // dtype, host_counters int64 [1 + L], host_extra uint8 [n]: numpy staging this object
  // keeps alive and, on a GPU, page-locks so the per-step copies are asynchronous.
  StepRecorder(const py::handle& buffer, const py::handle& counters, const py::handle& num_experts,
               const py::handle& layer_rows, const py::handle& host_rows, const py::handle& host_counters,
               const py::handle& host_extra)
      : buffer_(TensorArg(buffer, "buffer", 0)), counters_(TensorArg(counters, "counters", 1)) {
    elem_ = BufferElemBytes(buffer_.dtype());
    shape_ = buffer_.shape();
    if (shape_.size() != 3) {
      Refuse("buffer must be 3-D [max_batched_tokens, num_layers, top_k], got shape " + ShapeText(shape_));
    }
    if (!buffer_.is_contiguous()) Refuse("buffer must be contiguous");
    if (counters_.dtype() != DataType::INT64 || counters_.shape().size() != 1 ||
        counters_.numel() != 1 + shape_[1] || !counters_.is_contiguous()) {
      Refuse("counters must be a contiguous int64 tensor of shape [1 + num_layers] = [" +
             std::to_string(1 + shape_[1]) + "], got " + phi::DataTypeToString(counters_.dtype()) + " " +
             ShapeText(counters_.shape()));
    }
    if (!(counters_.place() == buffer_.place())) {
      Refuse("counters are on " + counters_.place().DebugString() + " but the buffer is on " +
             buffer_.place().DebugString());
    }
    num_experts_ = fdrr::Int(num_experts, "num_experts");
    if (num_experts_ < 1 || num_experts_ > FillOf(elem_)) {
      Refuse("num_experts=" + std::to_string(num_experts_) + " does not fit the buffer's dtype: 1 to " +
             std::to_string(FillOf(elem_)));
    }
    if (!layer_rows.is_none()) {
      if (!py::isinstance<py::sequence>(layer_rows) || py::isinstance<py::str>(layer_rows)) {
        Refuse("layer_rows must be None or a sequence of ints, got " + fdrr::Describe(layer_rows));
      }
      const auto rows = py::reinterpret_borrow<py::sequence>(layer_rows);
      for (size_t i = 0; i < rows.size(); ++i) {
        const std::string name = "layer_rows[" + std::to_string(i) + "]";
        const int64_t row = fdrr::Int(rows[i], name);
        if (row >= shape_[1]) {
          Refuse(name + " = " + std::to_string(row) + " is outside the buffer's " +
                 std::to_string(shape_[1]) + " layers");
        }
        layer_rows_.push_back(row);
      }
    }
    row_bytes_ = shape_[1] * shape_[2] * elem_;
    host_rows_ = fdrr::Array(host_rows, "host_rows", 'u', static_cast<int>(elem_), 3, true);
    if (host_rows_.shape(0) != shape_[0] || host_rows_.shape(1) != shape_[1] || host_rows_.shape(2) != shape_[2]) {
      Refuse("host_rows must have the buffer's shape " + ShapeText(shape_) + ", got " + fdrr::Describe(host_rows));
    }
    host_counters_ = fdrr::Array(host_counters, "host_counters", 'i', fdrr::kBytes8, 1, true);
    if (host_counters_.shape(0) != 1 + shape_[1]) {
      Refuse("host_counters must be int64 [1 + num_layers] = [" + std::to_string(1 + shape_[1]) + "], got " +
             fdrr::Describe(host_counters));
    }
    host_extra_ = fdrr::Array(host_extra, "host_extra", 'u', fdrr::kBytes1, 1, true);
#ifdef PADDLE_WITH_CUDA
    if (buffer_.is_gpu()) {
      pinned_rows_ = FdrrHostRegister(host_rows_.mutable_data(), host_rows_.nbytes());
      pinned_counters_ = FdrrHostRegister(host_counters_.mutable_data(), host_counters_.nbytes());
      if (host_extra_.nbytes() > 0) pinned_extra_ = FdrrHostRegister(host_extra_.mutable_data(), host_extra_.nbytes());
      event_ = FdrrEventCreate();
    }
#endif
  }

  ~StepRecorder() {
#ifdef PADDLE_WITH_CUDA
    if (event_ != nullptr) FdrrEventDestroy(event_);
    if (pinned_rows_) FdrrHostUnregister(host_rows_.mutable_data());
    if (pinned_counters_) FdrrHostUnregister(host_counters_.mutable_data());
    if (pinned_extra_) FdrrHostUnregister(host_extra_.mutable_data());
#endif
  }

  StepRecorder(const StepRecorder&) = delete;
  StepRecorder& operator=(const StepRecorder&) = delete;

  // One MoE layer: buffer[t, row(layer_idx), :] = topk_ids[t, :] for every token t.
  // expected_rows >= 0: topk_ids must have exactly that many rows (the step's tokens).
  void Record(const py::handle& topk, int64_t layer_idx, int64_t expected_rows) {
    const paddle::Tensor& ids = TensorArg(topk, "topk_ids", 0);
    int64_t row = layer_idx;
    if (!layer_rows_.empty()) {
      if (layer_idx < 0 || layer_idx >= static_cast<int64_t>(layer_rows_.size()) || layer_rows_[layer_idx] < 0) {
        Refuse("MoE layer " + std::to_string(layer_idx) +
               " is not in the layer map; check moe_layer_start_index / first_k_dense_replace");
      }
      row = layer_rows_[layer_idx];
    }
    const DataType dtype = ids.dtype();
    if (dtype != DataType::INT32 && dtype != DataType::INT64) {
      Refuse("topk_ids must be int32 or int64, got " + phi::DataTypeToString(dtype));
    }
    const auto& dims = ids.dims();   // dims(), not shape(): no allocation per call
    if (dims.size() != 2 || dims[1] != shape_[2]) {
      Refuse("topk_ids must be [num_tokens, top_k] with top_k = " + std::to_string(shape_[2]) + ", got " +
             ShapeText(ids.shape()));
    }
    if (dims[0] > shape_[0]) {
      Refuse("topk_ids has " + std::to_string(dims[0]) + " tokens; they exceed the step buffer's " +
             std::to_string(shape_[0]) + " rows");
    }
    if (row < 0 || row >= shape_[1]) {
      Refuse("layer " + std::to_string(row) + " is out of range [0, " + std::to_string(shape_[1]) + ")");
    }
    if (!(ids.place() == buffer_.place())) {
      Refuse("topk_ids are on " + ids.place().DebugString() + " but the step buffer is on " +
             buffer_.place().DebugString());
    }
    if (!ids.is_contiguous()) Refuse("topk_ids must be contiguous");
    if (expected_rows >= 0 && dims[0] != expected_rows) {
      Refuse("MoE layer " + std::to_string(layer_idx) + ": " + std::to_string(dims[0]) + " routed rows for " +
             std::to_string(expected_rows) + " tokens");
    }
    const fdrr::RowsArgs a{shape_[0], shape_[1], shape_[2], dims[0], row, num_experts_};
    if (a.num_tokens == 0) return;  // empty step: nothing written, no call counted
    if (buffer_.is_gpu()) {
#ifdef PADDLE_WITH_CUDA
      FdrrRecordRowsCUDA(buffer_, ids, counters_, a);
      return;
#else
      Refuse("this build of the routing ops has no CUDA kernels; the step buffer is on " +
             buffer_.place().DebugString());
#endif
    }
    int64_t errors = 0;
    void* data = buffer_.data();
    switch (elem_) {
      case 1: errors = RowsByIds<uint8_t>(data, ids, a); break;
      case 2: errors = RowsByIds<uint16_t>(data, ids, a); break;
      default: errors = RowsByIds<uint32_t>(data, ids, a); break;
    }
    auto* c = static_cast<int64_t*>(counters_.data());
    c[0] += errors;
    c[1 + row] += 1;
  }

  // Copies rows [0, num_tokens) and the counters (and the first num_tokens elements of
  // `extra`, when given) to the host staging: asynchronous on a GPU (the buffer's stream,
  // then an event), a memcpy on CPU.
  void Offload(int64_t num_tokens, const py::handle& extra) {
    if (num_tokens < 0 || num_tokens > shape_[0]) {
      Refuse("offload of " + std::to_string(num_tokens) + " rows from a step buffer of " +
             std::to_string(shape_[0]));
    }
    const paddle::Tensor* extra_tensor = nullptr;
    int64_t extra_size = 0;
    if (!extra.is_none()) {
      extra_tensor = &TensorArg(extra, "extra", 1);
      if (!extra_tensor->is_contiguous()) Refuse("extra must be contiguous");
      // The first num_tokens elements (FastDeploy's slot mapping buffer is larger).
      const int64_t count = extra_tensor->numel() < num_tokens ? extra_tensor->numel() : num_tokens;
      extra_size = count * static_cast<int64_t>(phi::SizeOf(extra_tensor->dtype()));
      if (extra_size > host_extra_.nbytes()) {
        Refuse("extra has " + std::to_string(extra_size) + " bytes for this step; host_extra holds " +
               std::to_string(host_extra_.nbytes()));
      }
    }
    const int64_t counter_bytes = (1 + shape_[1]) * 8;
    if (buffer_.is_gpu()) {
#ifdef PADDLE_WITH_CUDA
      const bool extra_on_device = extra_tensor != nullptr && extra_tensor->is_gpu();
      if (extra_tensor != nullptr && !extra_on_device) {
        std::memcpy(host_extra_.mutable_data(), extra_tensor->data(), static_cast<size_t>(extra_size));
      }
      const fdrr::Offload offload{buffer_.data(), row_bytes_, num_tokens, counters_.data(), counter_bytes,
                                        extra_on_device ? extra_tensor->data() : nullptr, extra_size,
                                        host_rows_.mutable_data(), host_counters_.mutable_data(),
                                        host_extra_.mutable_data()};
      FdrrOffloadCUDA(buffer_, offload, event_);
      return;
#else
      Refuse("this build of the routing ops has no CUDA kernels; the step buffer is on " +
             buffer_.place().DebugString());
#endif
    }
    std::memcpy(host_rows_.mutable_data(), buffer_.data(), static_cast<size_t>(num_tokens * row_bytes_));
    std::memcpy(host_counters_.mutable_data(), counters_.data(), static_cast<size_t>(counter_bytes));
    if (extra_tensor != nullptr) {
      if (!extra_tensor->is_cpu()) {
        Refuse("extra is on " + extra_tensor->place().DebugString() + " but the step buffer is on the CPU");
      }
      std::memcpy(host_extra_.mutable_data(), extra_tensor->data(), static_cast<size_t>(extra_size));
    }
  }

  // Blocks until the last Offload's copies have landed (no-op on CPU).
  void Wait() {
#ifdef PADDLE_WITH_CUDA
    if (event_ != nullptr) FdrrEventSynchronize(event_);
#endif
  }

  // Every row back to the fill (RL round cleanup).
  void Fill() {
    const int64_t bytes = shape_[0] * row_bytes_;
#ifdef PADDLE_WITH_CUDA
    if (buffer_.is_gpu()) {
      FdrrFillCUDA(buffer_, bytes);
      return;
    }
#endif
    std::memset(buffer_.data(), 0xFF, static_cast<size_t>(bytes));
  }

  bool pinned() const { return pinned_rows_ && pinned_counters_; }

 private:
  paddle::Tensor buffer_;
  paddle::Tensor counters_;
  std::vector<int64_t> layer_rows_;
  std::vector<int64_t> shape_;
  int64_t elem_ = 1;
  int64_t num_experts_ = 0;
  int64_t row_bytes_ = 0;
  py::array host_rows_, host_counters_, host_extra_;   // kept alive while bound
  void* event_ = nullptr;
  bool pinned_rows_ = false;
  bool pinned_counters_ = false;
  bool pinned_extra_ = false;
};

}  // namespace

void RegisterStepLedger(py::module_& m);   // custom_ops/step_ledger.cc

// The module name must equal the library's file name (fdrr_routing_ops).
PYBIND11_MODULE(fdrr_routing_ops, m) {
  m.doc() = "fd-routing-replay's bound capture entry points";
  m.attr("abi_version") = 3;   // 3: arrays checked here, refusals raised as the set error type
  // Only this module's functions: a refusal (std::invalid_argument) becomes g_error_type.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(g_error_type, e.what());
    }
  });
  m.def("set_error_type", [](const py::handle& type) {
    if (!PyType_Check(type.ptr()) || !PyObject_IsSubclass(type.ptr(), PyExc_ValueError)) {
      Refuse("set_error_type needs a subclass of ValueError, got " + fdrr::Describe(type));
    }
    Py_INCREF(type.ptr());   // held for the life of the process
    g_error_type = type.ptr();
  }, py::arg("type"), "the exception class refusals are raised as (a ValueError subclass)");
  py::class_<StepRecorder>(m, "StepRecorder")
      .def(py::init<const py::handle&, const py::handle&, const py::handle&, const py::handle&,
                    const py::handle&, const py::handle&, const py::handle&>(),
           py::arg("buffer"), py::arg("counters"), py::arg("num_experts"), py::arg("layer_rows"),
           py::arg("host_rows"), py::arg("host_counters"), py::arg("host_extra"))
      .def("record", &StepRecorder::Record, py::arg("topk_ids"), py::arg("layer_idx"),
           py::arg("expected_rows") = -1)
      .def("offload", &StepRecorder::Offload, py::arg("num_tokens"), py::arg("extra") = py::none())
      .def("wait", &StepRecorder::Wait)
      .def("fill", &StepRecorder::Fill)
      .def_property_readonly("pinned", &StepRecorder::pinned);
  RegisterStepLedger(m);
}
