// Paddle registration of fd-routing-replay's custom ops (CPU kernels; the CUDA kernels
// are reached from here when Paddle is built with CUDA and the tensors live on a GPU).
//
// Ops (all names carry the package-private prefix `fdrr_`):
//   fdrr_record_routing_(table, topk_ids, batch_id_per_token, cu_seqlens_q,
//                        seq_lens_decoder, error_count; layer, num_experts)   in place
//   fdrr_pack_routing(source, slots) -> out                 [S,L,K] -> [L,T,K]
//   fdrr_pack_routing_into_(out, source, slots)                               in place
//   fdrr_gather_routing_rows(table, batch_ids, positions) -> out   [N,L,K]
//   fdrr_clear_routing_rows_(table, batch_ids)                                in place
//
// fd_routing_replay/ops/ (checks.py) validates every argument before calling these and turns the
// errors raised here ("fdrr: ..." messages) into OpsError; the checks below are the
// backstop for callers that bypass it (e.g. a static graph).  Loops live in
// routing_kernels.h.  Dtype dispatch is written by hand because
// PD_DISPATCH_INTEGRAL_TYPES has no uint16/uint32.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "paddle/extension.h"
#include "routing_kernels.h"

#ifdef PADDLE_WITH_CUDA
// Defined in routing_ops.cu; called after the checks here have passed.
void FdrrRecordRoutingCUDA(paddle::Tensor& table, const paddle::Tensor& topk_ids,
                           const paddle::Tensor& batch_id_per_token,
                           const paddle::Tensor& cu_seqlens_q,
                           const paddle::Tensor& seq_lens_decoder, paddle::Tensor& error_count,
                           const fdrr::RecordArgs& args);
void FdrrPackRoutingCUDA(const paddle::Tensor& source, const paddle::Tensor& slots,
                         paddle::Tensor& out);
void FdrrGatherRoutingRowsCUDA(const paddle::Tensor& table, const paddle::Tensor& batch_ids,
                               const paddle::Tensor& positions, paddle::Tensor& out);
void FdrrClearRoutingRowsCUDA(paddle::Tensor& table, const paddle::Tensor& batch_ids);
#endif

namespace {

using paddle::DataType;

int64_t TableElemBytes(DataType dtype, const char* what) {
  switch (dtype) {
    case DataType::UINT8: return 1;
    case DataType::UINT16: return 2;
    case DataType::UINT32: return 4;
    default:
      PD_THROW("fdrr: ", what, " must be uint8, uint16 or uint32 (the routing dtype), got ",
               phi::DataTypeToString(dtype));
  }
  return 0;
}

void CheckIndexDtype(const paddle::Tensor& t, const char* what) {
  PD_CHECK(t.dtype() == DataType::INT32 || t.dtype() == DataType::INT64, "fdrr: ", what,
           " must be int32 or int64, got ", phi::DataTypeToString(t.dtype()));
}

void CheckSamePlace(const paddle::Tensor& a, const paddle::Tensor& b, const char* what) {
  PD_CHECK(a.place() == b.place(), "fdrr: ", what, " is on ", b.place().DebugString(),
           " but the table is on ", a.place().DebugString());
}

void CheckContiguous(const paddle::Tensor& t, const char* what) {
  PD_CHECK(t.is_contiguous(), "fdrr: ", what, " must be contiguous");
}

// Most threads a large host pack may use: $FD_RR_OPS_THREADS (1 = single-threaded),
// default 4.  Read once.
int MaxPackThreads() {
  static const int threads = [] {
    const char* env = std::getenv("FD_RR_OPS_THREADS");
    const long value = env != nullptr ? std::strtol(env, nullptr, 10) : 4;
    return static_cast<int>(value < 1 ? 1 : (value > 64 ? 64 : value));
  }();
  return threads;
}

// New uninitialised routing tensor.  Paddle registers no CPU `empty` kernel for uint16 or
// uint32, so wider dtypes are allocated as bytes and reinterpreted (no copy).
// Returns a contiguous tensor of exactly `shape` and `dtype` on `place`.
paddle::Tensor EmptyRouting(std::vector<int64_t> shape, DataType dtype, const paddle::Place& place) {
  const int64_t elem = TableElemBytes(dtype, "routing tensor");
  if (elem == 1) return paddle::empty(shape, dtype, place);
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  if (numel == 0) {  // view_dtype rejects zero-size inputs; casting nothing is free
    return paddle::experimental::cast(paddle::empty(shape, DataType::INT32, place), dtype);
  }
  shape.back() *= elem;
  return paddle::experimental::view_dtype(paddle::empty(shape, DataType::UINT8, place), dtype);
}

// Throws naming index[i] when it is outside [0, bound).  CPU only.
void CheckIndexRange(const paddle::Tensor& index, int64_t bound, const char* what) {
  int64_t bad = -1;
  int64_t value = 0;
  if (index.dtype() == DataType::INT32) {
    const auto* p = static_cast<const int32_t*>(index.data());
    bad = fdrr::first_bad_index(p, index.numel(), bound);
    if (bad >= 0) value = p[bad];
  } else {
    const auto* p = static_cast<const int64_t*>(index.data());
    bad = fdrr::first_bad_index(p, index.numel(), bound);
    if (bad >= 0) value = p[bad];
  }
  PD_CHECK(bad < 0, "fdrr: ", what, "[", bad, "] = ", value, " is out of range [0, ", bound, ")");
}

// ---------------------------------------------------------------------------------------
// record_routing_

template <typename TableT, typename IdT>
int64_t RecordByIndex(void* table, const paddle::Tensor& topk_ids, const paddle::Tensor& batch,
                      const paddle::Tensor& cu, const paddle::Tensor& dec,
                      const fdrr::RecordArgs& a) {
  auto* t = static_cast<TableT*>(table);
  const auto* ids = static_cast<const IdT*>(topk_ids.data());
  if (batch.dtype() == DataType::INT32) {
    return fdrr::record_routing_cpu<TableT, IdT, int32_t>(
        t, ids, static_cast<const int32_t*>(batch.data()), static_cast<const int32_t*>(cu.data()),
        static_cast<const int32_t*>(dec.data()), a);
  }
  return fdrr::record_routing_cpu<TableT, IdT, int64_t>(
      t, ids, static_cast<const int64_t*>(batch.data()), static_cast<const int64_t*>(cu.data()),
      static_cast<const int64_t*>(dec.data()), a);
}

template <typename TableT>
int64_t RecordByIds(void* table, const paddle::Tensor& topk_ids, const paddle::Tensor& batch,
                    const paddle::Tensor& cu, const paddle::Tensor& dec,
                    const fdrr::RecordArgs& a) {
  if (topk_ids.dtype() == DataType::INT32) {
    return RecordByIndex<TableT, int32_t>(table, topk_ids, batch, cu, dec, a);
  }
  return RecordByIndex<TableT, int64_t>(table, topk_ids, batch, cu, dec, a);
}

void RecordRouting(paddle::Tensor& table, const paddle::Tensor& topk_ids,
                   const paddle::Tensor& batch_id_per_token, const paddle::Tensor& cu_seqlens_q,
                   const paddle::Tensor& seq_lens_decoder, paddle::Tensor& error_count,
                   int64_t layer, int64_t num_experts) {
  const int64_t elem = TableElemBytes(table.dtype(), "table");
  const auto shape = table.shape();
  PD_CHECK(shape.size() == 4, "fdrr: table must be 4-D [max_num_seqs, max_len, num_layers, top_k]");
  const auto ids_shape = topk_ids.shape();
  PD_CHECK(ids_shape.size() == 2 && ids_shape[1] == shape[3],
           "fdrr: topk_ids must be [num_tokens, top_k] with top_k = ", shape[3]);
  PD_CHECK(topk_ids.dtype() == DataType::INT32 || topk_ids.dtype() == DataType::INT64,
           "fdrr: topk_ids must be int32 or int64");
  CheckIndexDtype(batch_id_per_token, "batch_id_per_token");
  PD_CHECK(cu_seqlens_q.dtype() == batch_id_per_token.dtype() &&
               seq_lens_decoder.dtype() == batch_id_per_token.dtype(),
           "fdrr: batch_id_per_token, cu_seqlens_q and seq_lens_decoder must share one dtype");
  PD_CHECK(batch_id_per_token.numel() == ids_shape[0],
           "fdrr: batch_id_per_token has ", batch_id_per_token.numel(),
           " elements but topk_ids has ", ids_shape[0], " tokens");
  PD_CHECK(error_count.dtype() == DataType::INT64 && error_count.numel() == 1,
           "fdrr: error_count must be an int64 tensor with one element");
  PD_CHECK(layer >= 0 && layer < shape[2], "fdrr: layer ", layer, " is out of range [0, ",
           shape[2], ")");
  const int64_t fill = (elem == 4) ? int64_t{0xFFFFFFFF} : (int64_t{1} << (8 * elem)) - 1;
  PD_CHECK(num_experts >= 0 && num_experts <= fill, "fdrr: num_experts ", num_experts,
           " does not fit the table dtype (at most ", fill, ")");
  for (const auto* t : {&topk_ids, &batch_id_per_token, &cu_seqlens_q, &seq_lens_decoder,
                        static_cast<const paddle::Tensor*>(&error_count)}) {
    CheckSamePlace(table, *t, "an input");
    CheckContiguous(*t, "every input");
  }
  CheckContiguous(table, "table");
  const fdrr::RecordArgs a{shape[0], shape[1], shape[2], shape[3], ids_shape[0],
                           cu_seqlens_q.numel(), seq_lens_decoder.numel(), layer, num_experts};
  if (a.num_tokens == 0 || a.top_k == 0) return;  // empty batch: nothing to write
  if (table.is_gpu()) {
#ifdef PADDLE_WITH_CUDA
    FdrrRecordRoutingCUDA(table, topk_ids, batch_id_per_token, cu_seqlens_q, seq_lens_decoder,
                          error_count, a);
    return;
#else
    PD_THROW("fdrr: this build of the routing ops has no CUDA kernels");
#endif
  }
  PD_CHECK(table.is_cpu(), "fdrr: unsupported place ", table.place().DebugString());
  int64_t errors = 0;
  void* data = table.data();
  switch (elem) {
    case 1: errors = RecordByIds<uint8_t>(data, topk_ids, batch_id_per_token, cu_seqlens_q,
                                         seq_lens_decoder, a); break;
    case 2: errors = RecordByIds<uint16_t>(data, topk_ids, batch_id_per_token, cu_seqlens_q,
                                          seq_lens_decoder, a); break;
    default: errors = RecordByIds<uint32_t>(data, topk_ids, batch_id_per_token, cu_seqlens_q,
                                           seq_lens_decoder, a); break;
  }
  if (errors != 0) *static_cast<int64_t*>(error_count.data()) += errors;
}

std::vector<std::vector<int64_t>> RecordRoutingInferShape(
    const std::vector<int64_t>& table, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>& error_count) {
  return {table, error_count};
}

std::vector<DataType> RecordRoutingInferDtype(DataType table, DataType, DataType, DataType,
                                              DataType, DataType error_count) {
  return {table, error_count};
}

// ---------------------------------------------------------------------------------------
// pack_routing / pack_routing_into_

void CheckPackArgs(const paddle::Tensor& source, const paddle::Tensor& slots) {
  TableElemBytes(source.dtype(), "source");
  PD_CHECK(source.shape().size() == 3, "fdrr: source must be 3-D [num_slots, num_layers, top_k]");
  CheckIndexDtype(slots, "slots");
  PD_CHECK(slots.shape().size() == 1, "fdrr: slots must be 1-D");
  CheckSamePlace(source, slots, "slots");
  CheckContiguous(source, "source");
  CheckContiguous(slots, "slots");
}

void PackInto(const paddle::Tensor& source, const paddle::Tensor& slots, paddle::Tensor& out) {
  const auto s = source.shape();
  const int64_t num_tokens = slots.numel();
  if (source.is_gpu()) {
#ifdef PADDLE_WITH_CUDA
    FdrrPackRoutingCUDA(source, slots, out);
    return;
#else
    PD_THROW("fdrr: this build of the routing ops has no CUDA kernels");
#endif
  }
  CheckIndexRange(slots, s[0], "slots");
  if (num_tokens == 0 || s[1] == 0 || s[2] == 0) return;
  const int64_t elem = TableElemBytes(source.dtype(), "source");
  if (slots.dtype() == DataType::INT32) {
    fdrr::pack_routing_cpu(source.data(), s[1], s[2], elem,
                           static_cast<const int32_t*>(slots.data()), num_tokens, out.data(),
                           MaxPackThreads());
  } else {
    fdrr::pack_routing_cpu(source.data(), s[1], s[2], elem,
                           static_cast<const int64_t*>(slots.data()), num_tokens, out.data(),
                           MaxPackThreads());
  }
}

std::vector<paddle::Tensor> PackRouting(const paddle::Tensor& source, const paddle::Tensor& slots) {
  CheckPackArgs(source, slots);
  const auto s = source.shape();
  paddle::Tensor out = EmptyRouting({s[1], slots.numel(), s[2]}, source.dtype(), source.place());
  PackInto(source, slots, out);
  return {out};
}

std::vector<std::vector<int64_t>> PackRoutingInferShape(const std::vector<int64_t>& source,
                                                        const std::vector<int64_t>& slots) {
  return {{source[1], slots[0], source[2]}};
}

std::vector<DataType> PackRoutingInferDtype(DataType source, DataType) { return {source}; }

void PackRoutingInto(paddle::Tensor& out, const paddle::Tensor& source,
                     const paddle::Tensor& slots) {
  CheckPackArgs(source, slots);
  const auto s = source.shape();
  PD_CHECK(out.dtype() == source.dtype(), "fdrr: out dtype ", phi::DataTypeToString(out.dtype()),
           " differs from source dtype ", phi::DataTypeToString(source.dtype()));
  const auto o = out.shape();
  PD_CHECK(o.size() == 3 && o[0] == s[1] && o[1] == slots.numel() && o[2] == s[2],
           "fdrr: out must be [num_layers, num_tokens, top_k] = [", s[1], ", ", slots.numel(),
           ", ", s[2], "]");
  CheckSamePlace(source, out, "out");
  CheckContiguous(out, "out");
  PackInto(source, slots, out);
}

std::vector<std::vector<int64_t>> PackRoutingIntoInferShape(const std::vector<int64_t>& out,
                                                            const std::vector<int64_t>&,
                                                            const std::vector<int64_t>&) {
  return {out};
}

std::vector<DataType> PackRoutingIntoInferDtype(DataType out, DataType, DataType) {
  return {out};
}

// ---------------------------------------------------------------------------------------
// gather_routing_rows

std::vector<paddle::Tensor> GatherRoutingRows(const paddle::Tensor& table,
                                              const paddle::Tensor& batch_ids,
                                              const paddle::Tensor& positions) {
  const int64_t elem = TableElemBytes(table.dtype(), "table");
  const auto s = table.shape();
  PD_CHECK(s.size() == 4, "fdrr: table must be 4-D [max_num_seqs, max_len, num_layers, top_k]");
  CheckIndexDtype(batch_ids, "batch_ids");
  PD_CHECK(positions.dtype() == batch_ids.dtype(),
           "fdrr: positions and batch_ids must share one dtype");
  PD_CHECK(batch_ids.shape().size() == 1 && positions.shape().size() == 1 &&
               batch_ids.numel() == positions.numel(),
           "fdrr: batch_ids and positions must be 1-D of equal length");
  CheckSamePlace(table, batch_ids, "batch_ids");
  CheckSamePlace(table, positions, "positions");
  CheckContiguous(table, "table");
  CheckContiguous(batch_ids, "batch_ids");
  CheckContiguous(positions, "positions");
  const int64_t n = batch_ids.numel();
  paddle::Tensor out = EmptyRouting({n, s[2], s[3]}, table.dtype(), table.place());
  if (table.is_gpu()) {
#ifdef PADDLE_WITH_CUDA
    FdrrGatherRoutingRowsCUDA(table, batch_ids, positions, out);
    return {out};
#else
    PD_THROW("fdrr: this build of the routing ops has no CUDA kernels");
#endif
  }
  CheckIndexRange(batch_ids, s[0], "batch_ids");
  CheckIndexRange(positions, s[1], "positions");
  const int64_t row_bytes = s[2] * s[3] * elem;
  if (n == 0 || row_bytes == 0) return {out};
  if (batch_ids.dtype() == DataType::INT32) {
    fdrr::gather_routing_rows_cpu(table.data(), s[1], row_bytes,
                                  static_cast<const int32_t*>(batch_ids.data()),
                                  static_cast<const int32_t*>(positions.data()), n, out.data());
  } else {
    fdrr::gather_routing_rows_cpu(table.data(), s[1], row_bytes,
                                  static_cast<const int64_t*>(batch_ids.data()),
                                  static_cast<const int64_t*>(positions.data()), n, out.data());
  }
  return {out};
}

std::vector<std::vector<int64_t>> GatherRoutingRowsInferShape(
    const std::vector<int64_t>& table, const std::vector<int64_t>& batch_ids,
    const std::vector<int64_t>&) {
  return {{batch_ids[0], table[2], table[3]}};
}

std::vector<DataType> GatherRoutingRowsInferDtype(DataType table, DataType, DataType) {
  return {table};
}

// ---------------------------------------------------------------------------------------
// clear_routing_rows_

void ClearRoutingRows(paddle::Tensor& table, const paddle::Tensor& batch_ids) {
  const int64_t elem = TableElemBytes(table.dtype(), "table");
  const auto s = table.shape();
  PD_CHECK(s.size() == 4, "fdrr: table must be 4-D [max_num_seqs, max_len, num_layers, top_k]");
  CheckIndexDtype(batch_ids, "batch_ids");
  PD_CHECK(batch_ids.shape().size() == 1, "fdrr: batch_ids must be 1-D");
  CheckSamePlace(table, batch_ids, "batch_ids");
  CheckContiguous(table, "table");
  CheckContiguous(batch_ids, "batch_ids");
  if (table.is_gpu()) {
#ifdef PADDLE_WITH_CUDA
    FdrrClearRoutingRowsCUDA(table, batch_ids);
    return;
#else
    PD_THROW("fdrr: this build of the routing ops has no CUDA kernels");
#endif
  }
  CheckIndexRange(batch_ids, s[0], "batch_ids");
  const int64_t seq_bytes = s[1] * s[2] * s[3] * elem;
  const int64_t n = batch_ids.numel();
  if (n == 0 || seq_bytes == 0) return;
  if (batch_ids.dtype() == DataType::INT32) {
    fdrr::clear_routing_rows_cpu(table.data(), seq_bytes,
                                 static_cast<const int32_t*>(batch_ids.data()), n);
  } else {
    fdrr::clear_routing_rows_cpu(table.data(), seq_bytes,
                                 static_cast<const int64_t*>(batch_ids.data()), n);
  }
}

std::vector<std::vector<int64_t>> ClearRoutingRowsInferShape(const std::vector<int64_t>& table,
                                                             const std::vector<int64_t>&) {
  return {table};
}

std::vector<DataType> ClearRoutingRowsInferDtype(DataType table, DataType) { return {table}; }

}  // namespace

PD_BUILD_OP(fdrr_record_routing_)
    .Inputs({"table", "topk_ids", "batch_id_per_token", "cu_seqlens_q", "seq_lens_decoder",
             "error_count"})
    .Outputs({"table_out", "error_count_out"})
    .Attrs({"layer: int64_t", "num_experts: int64_t"})
    .SetInplaceMap({{"table", "table_out"}, {"error_count", "error_count_out"}})
    .SetKernelFn(PD_KERNEL(RecordRouting))
    .SetInferShapeFn(PD_INFER_SHAPE(RecordRoutingInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RecordRoutingInferDtype));

PD_BUILD_OP(fdrr_pack_routing)
    .Inputs({"source", "slots"})
    .Outputs({"out"})
    .SetKernelFn(PD_KERNEL(PackRouting))
    .SetInferShapeFn(PD_INFER_SHAPE(PackRoutingInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PackRoutingInferDtype));

PD_BUILD_OP(fdrr_pack_routing_into_)
    .Inputs({"out", "source", "slots"})
    .Outputs({"out_out"})
    .SetInplaceMap({{"out", "out_out"}})
    .SetKernelFn(PD_KERNEL(PackRoutingInto))
    .SetInferShapeFn(PD_INFER_SHAPE(PackRoutingIntoInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PackRoutingIntoInferDtype));

PD_BUILD_OP(fdrr_gather_routing_rows)
    .Inputs({"table", "batch_ids", "positions"})
    .Outputs({"out"})
    .SetKernelFn(PD_KERNEL(GatherRoutingRows))
    .SetInferShapeFn(PD_INFER_SHAPE(GatherRoutingRowsInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(GatherRoutingRowsInferDtype));

PD_BUILD_OP(fdrr_clear_routing_rows_)
    .Inputs({"table", "batch_ids"})
    .Outputs({"table_out"})
    .SetInplaceMap({{"table", "table_out"}})
    .SetKernelFn(PD_KERNEL(ClearRoutingRows))
    .SetInferShapeFn(PD_INFER_SHAPE(ClearRoutingRowsInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ClearRoutingRowsInferDtype));

// ---------------------------------------------------------------------------------------
// C entry points for host (numpy) buffers, called through ctypes by fd_routing_replay.ops
// so a numpy slot cache is packed in place without Paddle tensors around it (the call
// releases the GIL).  They never throw.

extern "C" {

// Version of the functions below; fd_routing_replay.ops checks it before using them.
int64_t fdrr_host_abi_version() { return 1; }

// pack_routing for host buffers: out[l, t, :] = source[slots[t], l, :].  Returns -1 when
// done, the position of the first slot outside [0, num_slots) (nothing written), -2 for
// an unsupported element or index size, -3 if the pack failed.
int64_t fdrr_host_pack_routing(const void* source, int64_t num_slots, int64_t num_layers,
                               int64_t top_k, int64_t elem_bytes, const void* slots,
                               int64_t idx_bytes, int64_t num_tokens, void* out) {
  if (elem_bytes != 1 && elem_bytes != 2 && elem_bytes != 4) return -2;
  try {
    if (idx_bytes == 4) {
      const auto* index = static_cast<const int32_t*>(slots);
      const int64_t bad = fdrr::first_bad_index(index, num_tokens, num_slots);
      if (bad >= 0) return bad;
      fdrr::pack_routing_cpu(source, num_layers, top_k, elem_bytes, index, num_tokens, out,
                             MaxPackThreads());
      return -1;
    }
    if (idx_bytes == 8) {
      const auto* index = static_cast<const int64_t*>(slots);
      const int64_t bad = fdrr::first_bad_index(index, num_tokens, num_slots);
      if (bad >= 0) return bad;
      fdrr::pack_routing_cpu(source, num_layers, top_k, elem_bytes, index, num_tokens, out,
                             MaxPackThreads());
      return -1;
    }
    return -2;
  } catch (...) {
    return -3;
  }
}

}  // extern "C"
