// Multi-tensor AdamW on the device: the global gradient norm (clip_grad_norm's, accumulated in double) and one AdamW
// update of every tensor with the clipping coefficient read on the device. Matches src/model/optim.cpp's
// clip_grad_norm + AdamW::step (torch.optim.AdamW, torch.nn.utils.clip_grad_norm_) operation for operation.
//
// Per training step, with the tensors' device descriptors uploaded once per layout:
//
//   // once, when the layout (the tensors, their sizes and device pointers) is fixed:
//   std::vector<DeviceParam> host(count);              // w, g, m, v, w16, n, decay of each tensor (device pointers)
//   const int64_t chunks = optim_chunks(host.data(), count);
//   DeviceParam* params = arena.alloc<DeviceParam>(count);   // cudaMemcpy(params, host.data(), ...)
//   void* ws = arena.alloc<std::byte>(optim_workspace_bytes(count, chunks));  // 16-byte aligned
//   double* sq = arena.alloc<double>(1);
//   // every step, after the gradients (unscaled sums over the micro-batches) are complete:
//   grad_sq_norm(params, count, chunks, scale, sq, ws, stream);                  // *sq = Σ (scale·g)²
//   adamw_update(params, count, chunks, sq, scale, max_norm, lr, 0.9, 0.95, 1e-8, 0.1, ++t, ws, stream);
//   // the norm for the log, when wanted: cudaMemcpyAsync of *sq, sqrt on the host
//
// Both launchers only enqueue (no host sync, no allocation), so the step can be captured in a CUDA graph; lr and t are
// kernel arguments, so a captured graph needs them updated (cudaGraphExecKernelNodeSetParams) or a re-capture.
//
// How: a one-block scan turns the tensors' sizes into a prefix of chunk counts (kOptimChunk elements per chunk, the
// last chunk of a tensor shorter) and a grid kernel writes the flattened work list (tensor, chunk) into the
// workspace; one block then handles one chunk, so one launch covers tensors of any mix of sizes. Within a chunk,
// thread j owns the groups of 4 consecutive elements q ≡ j (mod 256), read as float4 when every pointer of the chunk
// is 16-byte aligned and as 4 scalars otherwise; the last group of a chunk may be partial.
//
// The header includes only host-compilable CUDA headers (no common.cuh), so plain C++ tests and the trainer can use it.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace nextlm::cuda {

using bf16 = __nv_bfloat16;

// Elements per work item (a multiple of 4, so that a 16-byte aligned tensor has 16-byte aligned chunks).
constexpr int64_t kOptimChunk = 16384;

// One trainable tensor; every pointer is device memory (unused when n = 0, may then be null).
struct DeviceParam {
  float* w;         // [n] fp32 master weight, updated in place
  const float* g;   // [n] fp32 gradient, unscaled (the sum over the step's micro-batches); read only
  float* m;         // [n] AdamW first moment, updated in place
  float* v;         // [n] AdamW second moment, updated in place
  bf16* w16;        // [n] or null: a bf16 copy of w, rewritten (round to nearest even) from the updated w
  int64_t n;        // elements, >= 0
  int decay;        // 1: decoupled weight decay applies (model/optim.h decays()), 0: it does not
};

// Work items of the tensors (Σ ceil(n / kOptimChunk)); reads only each entry's n of the HOST array host_params.
int64_t optim_chunks(const DeviceParam* host_params, int count);
// Bytes of device workspace both launchers need (the chunk prefix, the work list and one double per chunk).
int64_t optim_workspace_bytes(int count, int64_t chunks);

// *sq = Σ over the tensors and their elements of (scale·g)², each term computed as (double)(scale·g in fp32) squared
// (exact in double) and summed in double: per chunk in a fixed order, then over the chunks in a fixed order. The
// result depends on the tensors' sizes and values only (not on the launch configuration, the timing or the pointers'
// alignment): two runs are bitwise equal. *sq = 0 when there are no elements.
//   params:    device [count]; chunks: optim_chunks of the same list; workspace: optim_workspace_bytes(count, chunks)
//   sq:        device, one double
void grad_sq_norm(const DeviceParam* params, int count, int64_t chunks, float scale, double* sq, void* workspace,
                  cudaStream_t stream);

// One AdamW update of every tensor, exactly AdamW::step's fp32 arithmetic (same constants rounded on the host in the
// same way, same operation order, no FMA contraction, IEEE sqrt and division) on the gradient
//   g' = (scale·g)·coef,  coef = max_norm > 0 && norm > max_norm ? (float)(max_norm / (norm + 1e-6)) : 1,
//   norm = sqrt(*sq), read on the device,
// i.e. what clip_grad_norm does to gradients already multiplied by scale:
//   w ← w·(float)(1 − lr·wd) (decay tensors); m ← β1·m + (1−β1)·g'; v ← β2·v + ((1−β2)·g')·g';
//   w ← w − (lr/(1−β1^t))·m / (√v / √(1−β2^t) + ε);  w16 ← bf16(w).
// With the same *sq the result is bitwise that of AdamW::step; sq from grad_sq_norm differs from the host's double sum
// by rounding only (~1e-16 relative), which can move coef by one fp32 ulp in rare cases.
//   sq:        device double from grad_sq_norm; may be null when max_norm <= 0 (no clipping)
//   t:         the step count after this update (1 for the first), as AdamW::steps() after step()
//   workspace: optim_workspace_bytes(count, chunks); may be the one grad_sq_norm used (stream order)
void adamw_update(const DeviceParam* params, int count, int64_t chunks, const double* sq, float scale,
                  double max_norm, double lr, double beta1, double beta2, double eps, double weight_decay, int64_t t,
                  void* workspace, cudaStream_t stream);

}  // namespace nextlm::cuda
