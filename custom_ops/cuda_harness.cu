// C-ABI harness around routing_kernels.cuh -- no Paddle, no framework.
//
// scripts/cuda_compile_check.sh compiles it (object and shared library) for sm_80 and
// sm_90 so CI proves the kernels build; scripts/device_check.sh builds it as a shared
// library for the local GPU and drives it from Python (ctypes + NumPy only) on a GPU
// machine.  It exposes exactly what the library's StepRecorder runs on a GPU: the record
// kernel (launch_record_rows), the step's offload into page-locked host staging
// (pin_host, launch_offload, wait_event) and the refill (launch_fill), plus the plain device
// memory calls the driver needs.  Every function returns 0 on success, a cudaError_t value
// on a CUDA failure, or -1 for an unsupported argument.  Work goes to the legacy default
// stream.
//
// Dtype codes are element sizes in bytes: buffer 1/2/4 (uint8/uint16/uint32), ids 4/8
// (int32/int64).
#include <cuda_runtime.h>

#include <cstdint>

#include "routing_kernels.cuh"

namespace {

template <typename BufT>
int record_rows_by_ids(void* buffer, const void* ids, int id_bytes, const fdrr::RowsArgs& a,
                       unsigned long long* counters) {
  if (id_bytes == 4) {
    return static_cast<int>(fdrr::cuda::launch_record_rows<BufT, int32_t>(
        static_cast<BufT*>(buffer), static_cast<const int32_t*>(ids), a, counters, nullptr));
  }
  if (id_bytes == 8) {
    return static_cast<int>(fdrr::cuda::launch_record_rows<BufT, int64_t>(
        static_cast<BufT*>(buffer), static_cast<const int64_t*>(ids), a, counters, nullptr));
  }
  return -1;
}

}  // namespace

extern "C" {

int fdrr_h_malloc(int64_t bytes, void** out) {
  return static_cast<int>(cudaMalloc(out, static_cast<size_t>(bytes > 0 ? bytes : 1)));
}

int fdrr_h_free(void* ptr) { return static_cast<int>(cudaFree(ptr)); }

int fdrr_h_upload(void* device_dst, const void* host_src, int64_t bytes) {
  return static_cast<int>(cudaMemcpy(device_dst, host_src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice));
}

int fdrr_h_download(void* host_dst, const void* device_src, int64_t bytes) {
  return static_cast<int>(cudaMemcpy(host_dst, device_src, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost));
}

// Step buffer [capacity, num_layers, top_k]: buffer[t, layer, :] = topk_ids[t, :];
// counters[0] += bad ids, counters[1 + layer] += 1 (int64 [1 + num_layers] on the device).
int fdrr_h_record_rows(void* buffer, int buffer_bytes, int64_t capacity, int64_t num_layers, int64_t top_k,
                       const void* topk_ids, int id_bytes, int64_t num_tokens, int64_t layer,
                       int64_t num_experts, unsigned long long* counters) {
  if (num_tokens < 0 || num_tokens > capacity || layer < 0 || layer >= num_layers) return -1;
  const fdrr::RowsArgs a{capacity, num_layers, top_k, num_tokens, layer, num_experts};
  switch (buffer_bytes) {
    case 1: return record_rows_by_ids<uint8_t>(buffer, topk_ids, id_bytes, a, counters);
    case 2: return record_rows_by_ids<uint16_t>(buffer, topk_ids, id_bytes, a, counters);
    case 4: return record_rows_by_ids<uint32_t>(buffer, topk_ids, id_bytes, a, counters);
    default: return -1;
  }
}

// Page-locks host memory the caller owns; *pinned = 1 when the driver agreed (copies into
// unpinned memory stay correct, only synchronous).
int fdrr_h_pin(void* ptr, int64_t bytes, int* pinned) {
  *pinned = fdrr::cuda::pin_host(ptr, bytes) ? 1 : 0;
  return 0;
}

int fdrr_h_unpin(void* ptr) { return static_cast<int>(cudaHostUnregister(ptr)); }

int fdrr_h_event_create(void** event) {
  return static_cast<int>(fdrr::cuda::create_event(reinterpret_cast<cudaEvent_t*>(event)));
}

int fdrr_h_event_destroy(void* event) { return static_cast<int>(cudaEventDestroy(static_cast<cudaEvent_t>(event))); }

// The step's offload (rows [0, num_tokens), the counters, `extra_bytes` of `extra` when not
// null) into host staging, then `event` recorded; returns without waiting.
int fdrr_h_offload(const void* rows, int64_t row_bytes, int64_t num_tokens, const void* counters,
                   int64_t counter_bytes, const void* extra, int64_t extra_bytes, void* host_rows,
                   void* host_counters, void* host_extra, void* event) {
  if (num_tokens < 0 || row_bytes < 0 || counter_bytes <= 0 || extra_bytes < 0) return -1;
  const fdrr::Offload offload{rows, row_bytes, num_tokens, counters, counter_bytes, extra, extra_bytes,
                                    host_rows, host_counters, host_extra};
  return static_cast<int>(fdrr::cuda::launch_offload(offload, static_cast<cudaEvent_t>(event), nullptr));
}

// Blocks until the copies of the last offload recorded on `event` have landed.
int fdrr_h_wait(void* event) { return static_cast<int>(fdrr::cuda::wait_event(static_cast<cudaEvent_t>(event))); }

int fdrr_h_fill(void* buffer, int64_t bytes) {
  return static_cast<int>(fdrr::cuda::launch_fill(buffer, bytes, nullptr));
}

// Blocks until all work on the device is done; returns its status.
int fdrr_h_synchronize(void) { return static_cast<int>(cudaDeviceSynchronize()); }

// Human-readable name of a status returned above.
const char* fdrr_h_error_string(int status) {
  if (status == -1) return "unsupported argument";
  return cudaGetErrorString(static_cast<cudaError_t>(status));
}

}  // extern "C"
