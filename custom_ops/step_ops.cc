// The token-major step buffer: record_rows (Paddle op + directly bound entry point) and the
// per-step offload to host memory.
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
// Two ways in:
//   * fdrr_record_rows_ — a registered Paddle op (static graphs, to_static);
//   * StepRecorder      — a pybind11 class in this same library (PYBIND11_MODULE below):
//     the buffer, counters, layer map and host staging are validated once when it is
//     bound; a call checks only what can change per call (topk_ids' dtype, shape and
//     place: integer compares) and launches.  Paddle's generic custom-op dispatch
//     (_C_ops._run_custom_op) costs 10-170 us per call and grows with the number of
//     registered ops; this path does not go through it.
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "paddle/extension.h"
#include "paddle/utils/pybind.h"
#include "pybind11/numpy.h"
#include "routing_kernels.h"

#ifdef PADDLE_WITH_CUDA
// Defined in routing_ops.cu.
void FdrrRecordRowsCUDA(paddle::Tensor& buffer, const paddle::Tensor& topk_ids,
                        paddle::Tensor& counters, const fdrr::RowsArgs& args);
void FdrrCopyToHostAsync(const paddle::Tensor& on, const void* device_src, void* host_dst,
                         int64_t bytes);
void* FdrrEventCreate();
void FdrrEventDestroy(void* event);
void FdrrEventRecord(void* event, const paddle::Tensor& on);
void FdrrEventSynchronize(void* event);
bool FdrrHostRegister(void* ptr, int64_t bytes);
void FdrrHostUnregister(void* ptr);
void FdrrFillBytesCUDA(paddle::Tensor& t);
#endif

namespace {

using paddle::DataType;

int64_t BufferElemBytes(DataType dtype) {
  switch (dtype) {
    case DataType::UINT8: return 1;
    case DataType::UINT16: return 2;
    case DataType::UINT32: return 4;
    default:
      PD_THROW("fdrr: the step buffer must be uint8, uint16 or uint32 (the routing dtype), got ",
               phi::DataTypeToString(dtype));
  }
  return 0;
}

int64_t FillOf(int64_t elem) {
  return elem == 4 ? int64_t{0xFFFFFFFF} : (int64_t{1} << (8 * elem)) - 1;
}

// Checks the buffer and counters once; returns the element size.
int64_t CheckBufferAndCounters(const paddle::Tensor& buffer, const paddle::Tensor& counters) {
  const int64_t elem = BufferElemBytes(buffer.dtype());
  const auto s = buffer.shape();
  PD_CHECK(s.size() == 3, "fdrr: the step buffer must be 3-D [max_batched_tokens, num_layers, top_k]");
  PD_CHECK(buffer.is_contiguous(), "fdrr: the step buffer must be contiguous");
  PD_CHECK(counters.dtype() == DataType::INT64 && counters.shape().size() == 1 &&
               counters.numel() == 1 + s[1],
           "fdrr: counters must be int64 [1 + num_layers] = [", 1 + s[1], "]");
  PD_CHECK(counters.is_contiguous(), "fdrr: counters must be contiguous");
  PD_CHECK(counters.place() == buffer.place(), "fdrr: counters are on ",
           counters.place().DebugString(), " but the step buffer is on ",
           buffer.place().DebugString());
  return elem;
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

// The write itself, after every check; shared by the op and the bound entry point.
void LaunchRecordRows(paddle::Tensor& buffer, const paddle::Tensor& topk_ids,
                      paddle::Tensor& counters, const fdrr::RowsArgs& a, int64_t elem) {
  if (a.num_tokens == 0) return;  // empty step: nothing written, no call counted
  if (buffer.is_gpu()) {
#ifdef PADDLE_WITH_CUDA
    FdrrRecordRowsCUDA(buffer, topk_ids, counters, a);
    return;
#else
    PD_THROW("fdrr: this build of the routing ops has no CUDA kernels");
#endif
  }
  int64_t errors = 0;
  void* data = buffer.data();
  switch (elem) {
    case 1: errors = RowsByIds<uint8_t>(data, topk_ids, a); break;
    case 2: errors = RowsByIds<uint16_t>(data, topk_ids, a); break;
    default: errors = RowsByIds<uint32_t>(data, topk_ids, a); break;
  }
  auto* c = static_cast<int64_t*>(counters.data());
  c[0] += errors;
  c[1 + a.layer] += 1;
}

// topk_ids against a checked buffer: the per-call checks (integer compares only; dims()
// instead of shape(), which allocates).
fdrr::RowsArgs CheckTopk(const paddle::Tensor& buffer, const std::vector<int64_t>& s,
                         const paddle::Tensor& topk_ids, int64_t layer, int64_t num_experts) {
  const DataType dtype = topk_ids.dtype();
  PD_CHECK(dtype == DataType::INT32 || dtype == DataType::INT64,
           "fdrr: topk_ids must be int32 or int64, got ", phi::DataTypeToString(dtype));
  const auto& ids = topk_ids.dims();
  PD_CHECK(ids.size() == 2 && ids[1] == s[2], "fdrr: topk_ids must be [num_tokens, top_k] with top_k = ",
           s[2]);
  PD_CHECK(ids[0] <= s[0], "fdrr: ", ids[0], " tokens exceed the step buffer's ", s[0], " rows");
  PD_CHECK(layer >= 0 && layer < s[1], "fdrr: layer ", layer, " is out of range [0, ", s[1], ")");
  PD_CHECK(topk_ids.place() == buffer.place(), "fdrr: topk_ids are on ",
           topk_ids.place().DebugString(), " but the step buffer is on ", buffer.place().DebugString());
  PD_CHECK(topk_ids.is_contiguous(), "fdrr: topk_ids must be contiguous");
  return fdrr::RowsArgs{s[0], s[1], s[2], ids[0], layer, num_experts};
}

// ---------------------------------------------------------------------------------------
// The registered op (static graphs)

void RecordRows(paddle::Tensor& buffer, const paddle::Tensor& topk_ids, paddle::Tensor& counters,
                int64_t layer, int64_t num_experts) {
  const int64_t elem = CheckBufferAndCounters(buffer, counters);
  PD_CHECK(num_experts >= 0 && num_experts <= FillOf(elem), "fdrr: num_experts ", num_experts,
           " does not fit the buffer dtype (at most ", FillOf(elem), ")");
  const auto s = buffer.shape();
  LaunchRecordRows(buffer, topk_ids, counters, CheckTopk(buffer, s, topk_ids, layer, num_experts),
                   elem);
}

std::vector<std::vector<int64_t>> RecordRowsInferShape(const std::vector<int64_t>& buffer,
                                                       const std::vector<int64_t>&,
                                                       const std::vector<int64_t>& counters) {
  return {buffer, counters};
}

std::vector<DataType> RecordRowsInferDtype(DataType buffer, DataType, DataType counters) {
  return {buffer, counters};
}

// ---------------------------------------------------------------------------------------
// The bound entry point

class StepRecorder {
 public:
  // host_rows: capacity rows of the buffer's row size; host_counters: 1 + L int64;
  // host_extra: extra_bytes for one more tensor per step (FastDeploy 2.6's slot mapping).
  // Addresses of host arrays the caller keeps alive (numpy); on a GPU they are
  // page-locked here so the per-step copies are truly asynchronous.
  StepRecorder(const paddle::Tensor& buffer, const paddle::Tensor& counters, int64_t num_experts,
               std::vector<int64_t> layer_rows, uintptr_t host_rows, uintptr_t host_counters,
               uintptr_t host_extra, int64_t extra_bytes)
      : buffer_(buffer), counters_(counters), layer_rows_(std::move(layer_rows)),
        host_rows_(reinterpret_cast<void*>(host_rows)),
        host_counters_(reinterpret_cast<void*>(host_counters)),
        host_extra_(reinterpret_cast<void*>(host_extra)), extra_bytes_(extra_bytes) {
    elem_ = CheckBufferAndCounters(buffer_, counters_);
    shape_ = buffer_.shape();
    PD_CHECK(num_experts >= 0 && num_experts <= FillOf(elem_), "fdrr: num_experts ", num_experts,
             " does not fit the buffer dtype (at most ", FillOf(elem_), ")");
    num_experts_ = num_experts;
    for (int64_t row : layer_rows_) {
      PD_CHECK(row < shape_[1], "fdrr: layer map row ", row, " is out of range [0, ", shape_[1], ")");
    }
    PD_CHECK(host_rows_ != nullptr && host_counters_ != nullptr, "fdrr: host staging is missing");
    PD_CHECK(extra_bytes_ >= 0 && (extra_bytes_ == 0 || host_extra_ != nullptr),
             "fdrr: extra host staging is missing");
    row_bytes_ = shape_[1] * shape_[2] * elem_;
#ifdef PADDLE_WITH_CUDA
    if (buffer_.is_gpu()) {
      pinned_rows_ = FdrrHostRegister(host_rows_, shape_[0] * row_bytes_);
      pinned_counters_ = FdrrHostRegister(host_counters_, (1 + shape_[1]) * 8);
      if (extra_bytes_ > 0) pinned_extra_ = FdrrHostRegister(host_extra_, extra_bytes_);
      event_ = FdrrEventCreate();
    }
#endif
  }

  ~StepRecorder() {
#ifdef PADDLE_WITH_CUDA
    if (event_ != nullptr) FdrrEventDestroy(event_);
    if (pinned_rows_) FdrrHostUnregister(host_rows_);
    if (pinned_counters_) FdrrHostUnregister(host_counters_);
    if (pinned_extra_) FdrrHostUnregister(host_extra_);
#endif
  }

  StepRecorder(const StepRecorder&) = delete;
  StepRecorder& operator=(const StepRecorder&) = delete;

  // One MoE layer: buffer[t, row(layer_idx), :] = topk_ids[t, :] for every token t.
  // expected_rows >= 0: topk_ids must have exactly that many rows (the step's tokens).
  void Record(pybind11::handle topk, int64_t layer_idx, int64_t expected_rows) {
    PyObject* obj = topk.ptr();
    PD_CHECK(paddle::pybind::PyCheckTensor(obj), "fdrr: topk_ids must be a paddle.Tensor");
    const paddle::Tensor& ids = paddle::pybind::CastPyArg2Tensor(obj, 0);
    int64_t row = layer_idx;
    if (!layer_rows_.empty()) {
      PD_CHECK(layer_idx >= 0 && layer_idx < static_cast<int64_t>(layer_rows_.size()) &&
                   layer_rows_[layer_idx] >= 0,
               "fdrr: MoE layer ", layer_idx, " is not in the layer map; check "
               "moe_layer_start_index / first_k_dense_replace");
      row = layer_rows_[layer_idx];
    }
    const fdrr::RowsArgs a = CheckTopk(buffer_, shape_, ids, row, num_experts_);
    PD_CHECK(expected_rows < 0 || a.num_tokens == expected_rows, "fdrr: MoE layer ", layer_idx,
             ": ", a.num_tokens, " routed rows for ", expected_rows, " tokens");
    LaunchRecordRows(buffer_, ids, counters_, a, elem_);
  }

  // Copies rows [0, num_tokens) and the counters (and the first num_tokens elements of
  // `extra`, when given) to the host
  // staging: asynchronous on a GPU (the buffer's stream, then an event), a memcpy on CPU.
  void Offload(int64_t num_tokens, pybind11::handle extra) {
    PD_CHECK(num_tokens >= 0 && num_tokens <= shape_[0], "fdrr: offload of ", num_tokens,
             " rows from a step buffer of ", shape_[0]);
    const paddle::Tensor* extra_tensor = nullptr;
    int64_t extra_size = 0;
    if (!extra.is_none()) {
      PD_CHECK(paddle::pybind::PyCheckTensor(extra.ptr()), "fdrr: extra must be a paddle.Tensor");
      extra_tensor = &paddle::pybind::CastPyArg2Tensor(extra.ptr(), 1);
      PD_CHECK(extra_tensor->is_contiguous(), "fdrr: extra must be contiguous");
      // The first num_tokens elements (FastDeploy's slot mapping buffer is larger).
      const int64_t count = extra_tensor->numel() < num_tokens ? extra_tensor->numel() : num_tokens;
      extra_size = count * static_cast<int64_t>(phi::SizeOf(extra_tensor->dtype()));
      PD_CHECK(extra_size <= extra_bytes_, "fdrr: extra has ", extra_size,
               " bytes; the staging holds ", extra_bytes_);
    }
    const int64_t counter_bytes = (1 + shape_[1]) * 8;
    if (buffer_.is_gpu()) {
#ifdef PADDLE_WITH_CUDA
      FdrrCopyToHostAsync(buffer_, buffer_.data(), host_rows_, num_tokens * row_bytes_);
      FdrrCopyToHostAsync(buffer_, counters_.data(), host_counters_, counter_bytes);
      if (extra_tensor != nullptr) {
        if (extra_tensor->is_gpu()) {
          FdrrCopyToHostAsync(buffer_, extra_tensor->data(), host_extra_, extra_size);
        } else {
          std::memcpy(host_extra_, extra_tensor->data(), static_cast<size_t>(extra_size));
        }
      }
      FdrrEventRecord(event_, buffer_);
      return;
#else
      PD_THROW("fdrr: this build of the routing ops has no CUDA kernels");
#endif
    }
    std::memcpy(host_rows_, buffer_.data(), static_cast<size_t>(num_tokens * row_bytes_));
    std::memcpy(host_counters_, counters_.data(), static_cast<size_t>(counter_bytes));
    if (extra_tensor != nullptr) {
      PD_CHECK(extra_tensor->is_cpu(), "fdrr: extra is on ", extra_tensor->place().DebugString(),
               " but the step buffer is on the CPU");
      std::memcpy(host_extra_, extra_tensor->data(), static_cast<size_t>(extra_size));
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
#ifdef PADDLE_WITH_CUDA
    if (buffer_.is_gpu()) {
      FdrrFillBytesCUDA(buffer_);
      return;
    }
#endif
    std::memset(buffer_.data(), 0xFF, static_cast<size_t>(shape_[0] * row_bytes_));
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
  void* host_rows_;
  void* host_counters_;
  void* host_extra_;
  int64_t extra_bytes_;
  void* event_ = nullptr;
  bool pinned_rows_ = false;
  bool pinned_counters_ = false;
  bool pinned_extra_ = false;
};

// ---------------------------------------------------------------------------------------
// Host-side step bookkeeping, one pass each over numpy arrays (no per-sequence Python).

namespace py = pybind11;
using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// Where the step's tokens sit.  Per batch slot b: decoder[b] (first position), this_time[b]
// (tokens forwarded), tracked[b] (a request we record; None: every slot).  Token j of slot b
// is row cu[b] + j of the step buffer (cu = prefix sums of this_time over every slot,
// tracked or not) at position decoder[b] + j; its KV slot is
// block_table[b, p / bs] * bs + p % bs (-1 without a table, past its row, or on an
// unassigned block).  Returns (batch_ids, positions, rows, kv_slots, active, step_tokens)
// for the tracked tokens / slots.
py::tuple StepPlan(const I64Array& decoder, const I64Array& this_time, const py::object& tracked_obj,
                   const py::object& table_obj, int64_t block_size) {
  const int64_t n = this_time.shape(0);
  PD_CHECK(decoder.shape(0) >= n, "fdrr: seq_lens_decoder has ", decoder.shape(0),
           " entries for ", n, " slots");
  const int64_t* dec = decoder.data();
  const int64_t* cnt = this_time.data();
  py::array_t<bool, py::array::c_style | py::array::forcecast> tracked;
  const bool* track = nullptr;
  if (!tracked_obj.is_none()) {
    tracked = tracked_obj.cast<py::array_t<bool, py::array::c_style | py::array::forcecast>>();
    PD_CHECK(tracked.shape(0) >= n, "fdrr: tracked mask has ", tracked.shape(0), " entries for ", n);
    track = tracked.data();
  }
  const void* table = nullptr;
  int64_t table_bytes = 0, table_rows = 0, table_width = 0;
  py::array table_arr;
  if (!table_obj.is_none()) {
    table_arr = table_obj.cast<py::array>();
    PD_CHECK(table_arr.ndim() == 2 && (table_arr.flags() & py::array::c_style) &&
                 table_arr.dtype().kind() == 'i' && (table_arr.itemsize() == 4 || table_arr.itemsize() == 8),
             "fdrr: block table must be a C-contiguous int32/int64 [slots, blocks] array");
    PD_CHECK(block_size > 0, "fdrr: block_size must be positive");
    table = table_arr.data();
    table_bytes = table_arr.itemsize();
    table_rows = table_arr.shape(0);
    table_width = table_arr.shape(1);
  }
  int64_t total = 0, slots_active = 0;
  for (int64_t b = 0; b < n; ++b) {
    if (cnt[b] > 0 && (track == nullptr || track[b])) {
      total += cnt[b];
      ++slots_active;
    }
  }
  I64Array batch(total), pos(total), rows(total), kv(total), active(slots_active);
  int64_t* ob = batch.mutable_data();
  int64_t* op = pos.mutable_data();
  int64_t* orow = rows.mutable_data();
  int64_t* oslot = kv.mutable_data();
  int64_t* oact = active.mutable_data();
  int64_t row = 0, out = 0, a = 0;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t count = cnt[b] > 0 ? cnt[b] : 0;
    if (count == 0) continue;
    if (track != nullptr && !track[b]) {
      row += count;
      continue;
    }
    oact[a++] = b;
    for (int64_t j = 0; j < count; ++j, ++row, ++out) {
      const int64_t p = dec[b] + j;
      int64_t slot = -1;
      if (table != nullptr && p >= 0 && b < table_rows && p / block_size < table_width) {
        const int64_t at = b * table_width + p / block_size;
        const int64_t blk = table_bytes == 4 ? static_cast<int64_t>(static_cast<const int32_t*>(table)[at])
                                             : static_cast<const int64_t*>(table)[at];
        if (blk >= 0) slot = blk * block_size + p % block_size;
      }
      ob[out] = b;
      op[out] = p;
      orow[out] = row;
      oslot[out] = slot;
    }
  }
  return py::make_tuple(batch, pos, rows, kv, active, row);
}

// cache[slots[i]] = staging[rows[i]] for every i with 0 <= slots[i] < len(cache) and
// 0 <= rows[i] < len(staging); cache and staging C-contiguous with rows of equal size.
// Returns how many rows were written.
int64_t ScatterRows(py::array cache, const py::array& staging, const I64Array& slots,
                    const I64Array& rows) {
  PD_CHECK((cache.flags() & py::array::c_style) && (staging.flags() & py::array::c_style) &&
               cache.writeable() && cache.ndim() >= 1 && staging.ndim() == cache.ndim(),
           "fdrr: cache and staging must be C-contiguous arrays of the same rank (cache writeable)");
  const int64_t row_bytes = cache.shape(0) > 0 ? cache.nbytes() / cache.shape(0) : 0;
  PD_CHECK(staging.shape(0) == 0 || staging.nbytes() / staging.shape(0) == row_bytes,
           "fdrr: staging rows differ in size from the cache rows");
  PD_CHECK(slots.shape(0) == rows.shape(0), "fdrr: slots and rows differ in length");
  auto* dst = static_cast<unsigned char*>(cache.mutable_data());
  const auto* src = static_cast<const unsigned char*>(staging.data());
  const int64_t num_slots = cache.shape(0), num_rows = staging.shape(0), n = slots.shape(0);
  const int64_t* s = slots.data();
  const int64_t* r = rows.data();
  int64_t written = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (s[i] < 0 || s[i] >= num_slots || r[i] < 0 || r[i] >= num_rows) continue;
    std::memcpy(dst + s[i] * row_bytes, src + r[i] * row_bytes, static_cast<size_t>(row_bytes));
    ++written;
  }
  return written;
}

}  // namespace

PD_BUILD_OP(fdrr_record_rows_)
    .Inputs({"buffer", "topk_ids", "counters"})
    .Outputs({"buffer_out", "counters_out"})
    .Attrs({"layer: int64_t", "num_experts: int64_t"})
    .SetInplaceMap({{"buffer", "buffer_out"}, {"counters", "counters_out"}})
    .SetKernelFn(PD_KERNEL(RecordRows))
    .SetInferShapeFn(PD_INFER_SHAPE(RecordRowsInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RecordRowsInferDtype));

void RegisterStepLedger(pybind11::module_& m);   // custom_ops/step_ledger.cc

// The module name must equal the library's file name (fdrr_routing_ops): Python imports
// the library Paddle already loaded (same path, same handle) to reach StepRecorder.
PYBIND11_MODULE(fdrr_routing_ops, m) {
  m.doc() = "fd-routing-replay's directly bound step-buffer entry points";
  m.attr("abi_version") = 2;   // 2: StepLedger
  pybind11::class_<StepRecorder>(m, "StepRecorder")
      .def(pybind11::init<const paddle::Tensor&, const paddle::Tensor&, int64_t,
                          std::vector<int64_t>, uintptr_t, uintptr_t, uintptr_t, int64_t>(),
           pybind11::arg("buffer"), pybind11::arg("counters"), pybind11::arg("num_experts"),
           pybind11::arg("layer_rows"), pybind11::arg("host_rows"), pybind11::arg("host_counters"),
           pybind11::arg("host_extra"), pybind11::arg("extra_bytes"))
      .def("record", &StepRecorder::Record, pybind11::arg("topk_ids"), pybind11::arg("layer_idx"),
           pybind11::arg("expected_rows") = -1)
      .def("offload", &StepRecorder::Offload, pybind11::arg("num_tokens"),
           pybind11::arg("extra") = pybind11::none())
      .def("wait", &StepRecorder::Wait)
      .def("fill", &StepRecorder::Fill)
      .def_property_readonly("pinned", &StepRecorder::pinned);
  m.def("step_plan", &StepPlan, "positions, rows and KV slots of a step's tracked tokens");
  m.def("scatter_rows", &ScatterRows, "rows of the host staging into the slot cache");
  RegisterStepLedger(m);
}
