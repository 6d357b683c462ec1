// A dense LoRA adapter's rank-r products on T rows (train.cu's lora_forward / lora_backward on one GPU), in place
// of cuBLASLt GEMMs whose output is r (≤ 32) columns wide and whose sum runs over thousands of rows or columns:
// there cuBLASLt splits the sum and streams its operand at a fraction of the memory bandwidth, and the backward
// reads the output gradient dy twice (once for dB, once for dy·B). These kernels stream their wide operand X [T, Q]
// once, in tiles of 256 columns × a chunk of rows, and do both of its products in that pass:
//   row side     G [T, r]  = X·Wᵀ       W(j, q) from B [Q, r] (g = dy·B) or A [r, Q] (u = x·Aᵀ)
//   column side  D [Q, r] += Xᵀ·P       P [T, r] bf16 (dB = dyᵀ·u, dA = gsᵀ·x)
// A block's row-side sums cover its 256 columns and its column-side sums its row chunk; the partial sums go to an
// fp32 workspace and a second kernel adds them up in a fixed order (a tile or chunk that covers the whole range
// writes its sums directly). The split depends on T, Q and r alone, so every launch gives the same bits for the
// same inputs. Every sum is fp32 on bf16 inputs; G is written as fp32 (unscaled) or as bf16(scale · G), rounded
// once after the full sum, as train.cu's scaled_bf16 rounds a GEMM's fp32 output.
//
// Shapes they take (lora_dense_takes): r a multiple of 8 up to 32, Q a positive multiple of 8, X and P with rows
// 16-byte aligned (row strides multiples of 8 elements, pointers 16-byte aligned), W contiguous and 16-byte
// aligned, G's row stride even. train.cu falls back to cuBLASLt elsewhere (and when set_lora_dense(false)).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace nextlm::cuda {

using bf16 = __nv_bfloat16;

// Whether the kernels take rank r on a Q-wide operand with these pointers and row strides (see above).
bool lora_dense_takes(int r, int64_t Q, const void* x, int64_t ldx, const void* p, int64_t ldp);

// fp32 elements of workspace the calls below need for T rows of a Q-wide X at rank r (0 when a single tile and
// chunk write their sums directly).
int64_t lora_dense_work(int64_t T, int64_t Q, int r, bool row_side, bool column_side);

// One pass over dy [T, Q] (row stride lddy): dB [Q, r] (+)= dyᵀ·u (u [T, r], row stride ldu; accumulate false
// overwrites) and g = dy·B [T, r] (B [Q, r] contiguous), written to g32 (fp32, unscaled, row stride ldg) when g32
// is not null, else to g16 as bf16(scale · g) (row stride ldg).
void lora_dense_dy(const bf16* dy, int64_t lddy, const bf16* u, int64_t ldu, const bf16* B, int r, int64_t Q,
                   int64_t T, float* dB, bool accumulate, float* g32, bf16* g16, int64_t ldg, float scale, float* work,
                   cudaStream_t stream);

// dA [r, Q] (+)= pᵀ·x for x [T, Q] (row stride ldx) and p [T, r] (row stride ldp): a LoRA A's gradient from
// gs = bf16(s·dy·B).
void lora_dense_grad(const bf16* x, int64_t ldx, const bf16* p, int64_t ldp, int r, int64_t Q, int64_t T, float* dA,
                     bool accumulate, float* work, cudaStream_t stream);

// u = bf16(scale · x·Aᵀ) [T, r] (row stride ldu) for x [T, Q] (row stride ldx) and A [r, Q] contiguous.
void lora_dense_factor(const bf16* x, int64_t ldx, const bf16* A, int r, int64_t Q, int64_t T, float scale, bf16* u,
                       int64_t ldu, float* work, cudaStream_t stream);

}  // namespace nextlm::cuda
