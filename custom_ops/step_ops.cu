// CUDA side of the library's StepRecorder (custom_ops/step_ops.cc): dtype dispatch and
// launches of routing_kernels.cuh on the stream of the step buffer's device.  Compiled only
// into a CUDA build of the library (Paddle GPU wheel + nvcc); step_ops.cc calls these after
// validating every argument.
//
// Status: compile-checked with nvcc (scripts/cuda_compile_check.sh); not yet built against
// a GPU Paddle or run on a GPU.
#ifdef PADDLE_WITH_CUDA

#include <cstdint>

#include "paddle/extension.h"
#include "paddle/phi/core/cuda_stream.h"
#include "routing_kernels.cuh"

namespace {

using paddle::DataType;

void CheckCuda(cudaError_t err, const char* what) {
  PD_CHECK(err == cudaSuccess, "fdrr: CUDA error in ", what, ": ", cudaGetErrorString(err));
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

void FdrrRecordRowsCUDA(paddle::Tensor& buffer, const paddle::Tensor& topk_ids,
                        paddle::Tensor& counters, const fdrr::RowsArgs& a) {
  cudaError_t err;
  switch (buffer.dtype()) {
    case DataType::UINT8: err = RecordRowsByIds<uint8_t>(buffer, topk_ids, counters, a); break;
    case DataType::UINT16: err = RecordRowsByIds<uint16_t>(buffer, topk_ids, counters, a); break;
    default: err = RecordRowsByIds<uint32_t>(buffer, topk_ids, counters, a); break;
  }
  CheckCuda(err, "record");
}

void FdrrOffloadCUDA(const paddle::Tensor& buffer, const fdrr::Offload& offload, void* event) {
  CheckCuda(fdrr::cuda::launch_offload(offload, static_cast<cudaEvent_t>(event), StreamOf(buffer)),
            "step offload");
}

void* FdrrEventCreate() {
  cudaEvent_t event = nullptr;
  CheckCuda(fdrr::cuda::create_event(&event), "event create");
  return event;
}

void FdrrEventDestroy(void* event) { cudaEventDestroy(static_cast<cudaEvent_t>(event)); }

void FdrrEventSynchronize(void* event) {
  CheckCuda(fdrr::cuda::wait_event(static_cast<cudaEvent_t>(event)), "event synchronize");
}

bool FdrrHostRegister(void* ptr, int64_t bytes) { return fdrr::cuda::pin_host(ptr, bytes); }

void FdrrHostUnregister(void* ptr) { cudaHostUnregister(ptr); }

void FdrrFillCUDA(paddle::Tensor& buffer, int64_t bytes) {
  CheckCuda(fdrr::cuda::launch_fill(buffer.data(), bytes, StreamOf(buffer)), "fill");
}

#endif  // PADDLE_WITH_CUDA
