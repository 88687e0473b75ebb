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
#include "paddle/phi/core/cuda_stream.h"
#include "routing_kernels.cuh"

namespace {

using paddle::DataType;

cudaStream_t StreamOf(const paddle::Tensor& t);

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
      reinterpret_cast<unsigned long long*>(error_count.data()), StreamOf(table));
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

// The stream Paddle runs work for `t`'s device on (not the current device's: a tensor
// on GPU 1 while GPU 0 is current must not be written from GPU 0's stream).
cudaStream_t StreamOf(const paddle::Tensor& t) {
  return paddle::GetCurrentCUDAStream(t.place())->raw_stream();
}

template <typename BufT>
cudaError_t RecordRowsByIds(paddle::Tensor& buffer, const paddle::Tensor& ids,
                            paddle::Tensor& counters, const fdrr::RowsArgs& a) {
  auto* c = reinterpret_cast<unsigned long long*>(counters.data());
  if (ids.dtype() == DataType::INT32) {
    return fdrr::cuda::launch_record_rows<BufT, int32_t>(
        static_cast<BufT*>(buffer.data()), static_cast<const int32_t*>(ids.data()), a, c,
        StreamOf(buffer));
  }
  return fdrr::cuda::launch_record_rows<BufT, int64_t>(
      static_cast<BufT*>(buffer.data()), static_cast<const int64_t*>(ids.data()), a, c,
      StreamOf(buffer));
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

// pack / gather / clear: no index check on the device and no synchronisation.  Host
// indices were range-checked before upload (fd_routing_replay.ops); the kernels bounds-check
// every index they read (an out-of-range slot packs as the fill, an out-of-range row is
// skipped), so a bad device index cannot write out of bounds.
void FdrrPackRoutingCUDA(const paddle::Tensor& source, const paddle::Tensor& slots,
                         paddle::Tensor& out) {
  const auto s = source.shape();
  const int64_t elem = ElemBytes(source.dtype());
  cudaError_t err;
  if (slots.dtype() == DataType::INT32) {
    err = fdrr::cuda::launch_pack_routing(source.data(), s[0], s[1], s[2], elem,
                                          static_cast<const int32_t*>(slots.data()),
                                          slots.numel(), out.data(), StreamOf(source));
  } else {
    err = fdrr::cuda::launch_pack_routing(source.data(), s[0], s[1], s[2], elem,
                                          static_cast<const int64_t*>(slots.data()),
                                          slots.numel(), out.data(), StreamOf(source));
  }
  CheckCuda(err, "pack_routing");
}

void FdrrGatherRoutingRowsCUDA(const paddle::Tensor& table, const paddle::Tensor& batch_ids,
                               const paddle::Tensor& positions, paddle::Tensor& out) {
  const auto s = table.shape();
  const int64_t row_bytes = s[2] * s[3] * ElemBytes(table.dtype());
  cudaError_t err;
  if (batch_ids.dtype() == DataType::INT32) {
    err = fdrr::cuda::launch_gather_routing_rows(
        table.data(), s[0], s[1], row_bytes, static_cast<const int32_t*>(batch_ids.data()),
        static_cast<const int32_t*>(positions.data()), batch_ids.numel(), out.data(),
        StreamOf(table));
  } else {
    err = fdrr::cuda::launch_gather_routing_rows(
        table.data(), s[0], s[1], row_bytes, static_cast<const int64_t*>(batch_ids.data()),
        static_cast<const int64_t*>(positions.data()), batch_ids.numel(), out.data(),
        StreamOf(table));
  }
  CheckCuda(err, "gather_routing_rows");
}

void FdrrClearRoutingRowsCUDA(paddle::Tensor& table, const paddle::Tensor& batch_ids) {
  const auto s = table.shape();
  const int64_t seq_bytes = s[1] * s[2] * s[3] * ElemBytes(table.dtype());
  cudaError_t err;
  if (batch_ids.dtype() == DataType::INT32) {
    err = fdrr::cuda::launch_clear_routing_rows(table.data(), s[0], seq_bytes,
                                                static_cast<const int32_t*>(batch_ids.data()),
                                                batch_ids.numel(), StreamOf(table));
  } else {
    err = fdrr::cuda::launch_clear_routing_rows(table.data(), s[0], seq_bytes,
                                                static_cast<const int64_t*>(batch_ids.data()),
                                                batch_ids.numel(), StreamOf(table));
  }
  CheckCuda(err, "clear_routing_rows");
}

// ---------------------------------------------------------------------------------------
// The step buffer (custom_ops/step_ops.cc)

void FdrrRecordRowsCUDA(paddle::Tensor& buffer, const paddle::Tensor& topk_ids,
                        paddle::Tensor& counters, const fdrr::RowsArgs& a) {
  cudaError_t err;
  switch (ElemBytes(buffer.dtype())) {
    case 1: err = RecordRowsByIds<uint8_t>(buffer, topk_ids, counters, a); break;
    case 2: err = RecordRowsByIds<uint16_t>(buffer, topk_ids, counters, a); break;
    default: err = RecordRowsByIds<uint32_t>(buffer, topk_ids, counters, a); break;
  }
  CheckCuda(err, "record_rows");
}

// Enqueues a device-to-host copy on `on`'s stream (asynchronous when host_dst is pinned).
void FdrrCopyToHostAsync(const paddle::Tensor& on, const void* device_src, void* host_dst,
                         int64_t bytes) {
  if (bytes <= 0) return;
  CheckCuda(cudaMemcpyAsync(host_dst, device_src, static_cast<size_t>(bytes),
                            cudaMemcpyDeviceToHost, StreamOf(on)),
            "step offload copy");
}

void* FdrrEventCreate() {
  cudaEvent_t event = nullptr;
  CheckCuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "event create");
  return event;
}

void FdrrEventDestroy(void* event) { cudaEventDestroy(static_cast<cudaEvent_t>(event)); }

void FdrrEventRecord(void* event, const paddle::Tensor& on) {
  CheckCuda(cudaEventRecord(static_cast<cudaEvent_t>(event), StreamOf(on)), "event record");
}

void FdrrEventSynchronize(void* event) {
  CheckCuda(cudaEventSynchronize(static_cast<cudaEvent_t>(event)), "event synchronize");
}

// Page-locks caller-owned host memory (numpy staging) so copies into it are asynchronous;
// false (copies stay correct, only synchronous) when the driver refuses.
bool FdrrHostRegister(void* ptr, int64_t bytes) {
  if (ptr == nullptr || bytes <= 0) return false;
  if (cudaHostRegister(ptr, static_cast<size_t>(bytes), cudaHostRegisterDefault) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state
    return false;
  }
  return true;
}

void FdrrHostUnregister(void* ptr) { cudaHostUnregister(ptr); }

void FdrrFillBytesCUDA(paddle::Tensor& t) {
  const int64_t bytes = t.numel() * ElemBytes(t.dtype());
  CheckCuda(cudaMemsetAsync(t.data(), 0xFF, static_cast<size_t>(bytes), StreamOf(t)), "fill");
}

#endif  // PADDLE_WITH_CUDA
