// CUDA side of fd-routing-replay's Paddle ops: dtype dispatch + launches of the kernels in
// routing_kernels.cuh.  Compiled only into a CUDA build of the ops (Paddle GPU wheel +
// nvcc); routing_ops.cc calls these after validating shapes, dtypes and places.
//
// Status: the kernels are compile-checked with nvcc (scripts/cuda_compile_check.sh) and
// this file has not yet been built against a GPU Paddle or run on a GPU.
#ifdef PADDLE_WITH_CUDA

#include <cstdint>
#include <vector>

#include "paddle/extension.h"
#include "routing_kernels.cuh"

namespace {

using paddle::DataType;

void CheckCuda(cudaError_t err, const char* what) {
  PD_CHECK(err == cudaSuccess, "fdrr: CUDA error in ", what, ": ", cudaGetErrorString(err));
}

int64_t ElemBytes(DataType dtype) {
  switch (dtype) {
    case DataType::UINT8: return 1;
    case DataType::UINT16: return 2;
    case DataType::UINT32: return 4;
    default: PD_THROW("fdrr: routing dtype must be uint8, uint16 or uint32");
  }
  return 0;
}

template <typename TableT, typename IdT, typename IdxT>
cudaError_t Record(paddle::Tensor& table, const paddle::Tensor& ids, const paddle::Tensor& batch,
                   const paddle::Tensor& cu, const paddle::Tensor& dec,
                   paddle::Tensor& error_count, const fdrr::RecordArgs& a) {
  return fdrr::cuda::launch_record_routing<TableT, IdT, IdxT>(
      static_cast<TableT*>(table.data()), static_cast<const IdT*>(ids.data()),
      static_cast<const IdxT*>(batch.data()), static_cast<const IdxT*>(cu.data()),
      static_cast<const IdxT*>(dec.data()), a,
      reinterpret_cast<unsigned long long*>(error_count.data()), table.stream());
}

template <typename TableT, typename IdT>
cudaError_t RecordByIndex(paddle::Tensor& table, const paddle::Tensor& ids,
                          const paddle::Tensor& batch, const paddle::Tensor& cu,
                          const paddle::Tensor& dec, paddle::Tensor& errors,
                          const fdrr::RecordArgs& a) {
  if (batch.dtype() == DataType::INT32) {
    return Record<TableT, IdT, int32_t>(table, ids, batch, cu, dec, errors, a);
  }
  return Record<TableT, IdT, int64_t>(table, ids, batch, cu, dec, errors, a);
}

template <typename TableT>
cudaError_t RecordByIds(paddle::Tensor& table, const paddle::Tensor& ids,
                        const paddle::Tensor& batch, const paddle::Tensor& cu,
                        const paddle::Tensor& dec, paddle::Tensor& errors,
                        const fdrr::RecordArgs& a) {
  if (ids.dtype() == DataType::INT32) {
    return RecordByIndex<TableT, int32_t>(table, ids, batch, cu, dec, errors, a);
  }
  return RecordByIndex<TableT, int64_t>(table, ids, batch, cu, dec, errors, a);
}

// Device words for the index checks, one per index array (kNoBadIndex = all in range).
paddle::Tensor NewBadWords(const paddle::Place& place, int n) {
  return paddle::empty({n}, DataType::INT64, place);
}

unsigned long long* BadWord(paddle::Tensor& words, int i) {
  return reinterpret_cast<unsigned long long*>(words.data()) + i;
}

// Resets *word and checks index against [0, bound) on the stream.
cudaError_t FindBad(const paddle::Tensor& index, int64_t bound, unsigned long long* word,
                    cudaStream_t stream) {
  if (index.dtype() == DataType::INT32) {
    return fdrr::cuda::launch_find_bad_index(static_cast<const int32_t*>(index.data()),
                                             index.numel(), bound, word, stream);
  }
  return fdrr::cuda::launch_find_bad_index(static_cast<const int64_t*>(index.data()),
                                           index.numel(), bound, word, stream);
}

// Copies the check words to the host (synchronising the stream) and throws naming the
// first out-of-range index.  The copy kernels already skipped every write.
void RaiseIfBad(const paddle::Tensor& words, const std::vector<const char*>& names,
                const std::vector<const paddle::Tensor*>& indices,
                const std::vector<int64_t>& bounds) {
  paddle::Tensor host = words.copy_to(paddle::CPUPlace(), true);
  const auto* w = static_cast<const unsigned long long*>(host.data());
  for (size_t i = 0; i < names.size(); ++i) {
    if (w[i] == fdrr::cuda::kNoBadIndex) continue;
    const int64_t pos = static_cast<int64_t>(w[i]);
    paddle::Tensor value = indices[i]->slice(pos, pos + 1).copy_to(paddle::CPUPlace(), true);
    const int64_t v = value.dtype() == DataType::INT32
                          ? static_cast<int64_t>(*static_cast<const int32_t*>(value.data()))
                          : *static_cast<const int64_t*>(value.data());
    PD_THROW("fdrr: ", names[i], "[", pos, "] = ", v, " is out of range [0, ", bounds[i], ")");
  }
}

}  // namespace

void FdrrRecordRoutingCUDA(paddle::Tensor& table, const paddle::Tensor& topk_ids,
                           const paddle::Tensor& batch_id_per_token,
                           const paddle::Tensor& cu_seqlens_q,
                           const paddle::Tensor& seq_lens_decoder, paddle::Tensor& error_count,
                           const fdrr::RecordArgs& a) {
  cudaError_t err = cudaSuccess;
  switch (ElemBytes(table.dtype())) {
    case 1:
      err = RecordByIds<uint8_t>(table, topk_ids, batch_id_per_token, cu_seqlens_q,
                                 seq_lens_decoder, error_count, a);
      break;
    case 2:
      err = RecordByIds<uint16_t>(table, topk_ids, batch_id_per_token, cu_seqlens_q,
                                  seq_lens_decoder, error_count, a);
      break;
    default:
      err = RecordByIds<uint32_t>(table, topk_ids, batch_id_per_token, cu_seqlens_q,
                                  seq_lens_decoder, error_count, a);
      break;
  }
  CheckCuda(err, "record_routing");
}

void FdrrPackRoutingCUDA(const paddle::Tensor& source, const paddle::Tensor& slots,
                         paddle::Tensor& out) {
  const auto s = source.shape();
  auto stream = source.stream();
  paddle::Tensor words = NewBadWords(source.place(), 1);
  CheckCuda(FindBad(slots, s[0], BadWord(words, 0), stream), "pack_routing index check");
  const int64_t elem = ElemBytes(source.dtype());
  cudaError_t err;
  if (slots.dtype() == DataType::INT32) {
    err = fdrr::cuda::launch_pack_routing(source.data(), s[1], s[2], elem,
                                          static_cast<const int32_t*>(slots.data()),
                                          slots.numel(), out.data(), BadWord(words, 0), 1, stream);
  } else {
    err = fdrr::cuda::launch_pack_routing(source.data(), s[1], s[2], elem,
                                          static_cast<const int64_t*>(slots.data()),
                                          slots.numel(), out.data(), BadWord(words, 0), 1, stream);
  }
  CheckCuda(err, "pack_routing");
  RaiseIfBad(words, {"slots"}, {&slots}, {s[0]});
}

void FdrrGatherRoutingRowsCUDA(const paddle::Tensor& table, const paddle::Tensor& batch_ids,
                               const paddle::Tensor& positions, paddle::Tensor& out) {
  const auto s = table.shape();
  auto stream = table.stream();
  paddle::Tensor words = NewBadWords(table.place(), 2);
  CheckCuda(FindBad(batch_ids, s[0], BadWord(words, 0), stream), "gather index check");
  CheckCuda(FindBad(positions, s[1], BadWord(words, 1), stream), "gather index check");
  const int64_t row_bytes = s[2] * s[3] * ElemBytes(table.dtype());
  cudaError_t err;
  if (batch_ids.dtype() == DataType::INT32) {
    err = fdrr::cuda::launch_gather_routing_rows(
        table.data(), s[1], row_bytes, static_cast<const int32_t*>(batch_ids.data()),
        static_cast<const int32_t*>(positions.data()), batch_ids.numel(), out.data(),
        BadWord(words, 0), 2, stream);
  } else {
    err = fdrr::cuda::launch_gather_routing_rows(
        table.data(), s[1], row_bytes, static_cast<const int64_t*>(batch_ids.data()),
        static_cast<const int64_t*>(positions.data()), batch_ids.numel(), out.data(),
        BadWord(words, 0), 2, stream);
  }
  CheckCuda(err, "gather_routing_rows");
  RaiseIfBad(words, {"batch_ids", "positions"}, {&batch_ids, &positions}, {s[0], s[1]});
}

void FdrrClearRoutingRowsCUDA(paddle::Tensor& table, const paddle::Tensor& batch_ids) {
  const auto s = table.shape();
  auto stream = table.stream();
  paddle::Tensor words = NewBadWords(table.place(), 1);
  CheckCuda(FindBad(batch_ids, s[0], BadWord(words, 0), stream), "clear index check");
  const int64_t seq_bytes = s[1] * s[2] * s[3] * ElemBytes(table.dtype());
  cudaError_t err;
  if (batch_ids.dtype() == DataType::INT32) {
    err = fdrr::cuda::launch_clear_routing_rows(table.data(), seq_bytes,
                                                static_cast<const int32_t*>(batch_ids.data()),
                                                batch_ids.numel(), BadWord(words, 0), 1, stream);
  } else {
    err = fdrr::cuda::launch_clear_routing_rows(table.data(), seq_bytes,
                                                static_cast<const int64_t*>(batch_ids.data()),
                                                batch_ids.numel(), BadWord(words, 0), 1, stream);
  }
  CheckCuda(err, "clear_routing_rows");
  RaiseIfBad(words, {"batch_ids"}, {&batch_ids}, {s[0]});
}

#endif  // PADDLE_WITH_CUDA
