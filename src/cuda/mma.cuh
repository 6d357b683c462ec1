// Warp-level tensor-core helpers (sm_80+ mma.sync m16n8k16 bf16 → fp32, ldmatrix, cp.async).
//
// Fragment layouts (g = lane / 4, t = lane % 4):
//   A 16×16 row-major: a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..);
//   B 16×8 (k × n):    b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g);
//   C 16×8 fp32:       c0, c1 = (g, 2t..2t+1), c2, c3 = (g+8, 2t..2t+1).
// The load helpers below take a tile's top-left element and its row stride in elements, and fetch the fragments of
// one 16×16 A block or of two adjacent 8-column B tiles (b[0..1] for the first, b[2..3] for the second).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace nextlm::cuda {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm_x4(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// c += a·b for one m16n8k16 tile.
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// A block stored row-major (m rows, k contiguous).
__device__ __forceinline__ void load_a(uint32_t a[4], const __nv_bfloat16* tile, int ld) {
  const int l = threadIdx.x & 31;
  ldsm_x4(a, tile + (l & 15) * ld + (l >> 4) * 8);
}
// A block stored transposed: rows are k, m contiguous (A = Xᵀ for X [k][m] row-major).
__device__ __forceinline__ void load_a_t(uint32_t a[4], const __nv_bfloat16* tile, int ld) {
  const int l = threadIdx.x & 31;
  ldsm_x4_t(a, tile + ((l & 7) + (l >> 4) * 8) * ld + ((l >> 3) & 1) * 8);
}
// Two B tiles stored as [n][k] (k contiguous), i.e. B = Xᵀ for X [n][k] row-major.
__device__ __forceinline__ void load_b_nk(uint32_t b[4], const __nv_bfloat16* tile, int ld) {
  const int l = threadIdx.x & 31;
  ldsm_x4(b, tile + ((l & 7) + (l >> 4) * 8) * ld + ((l >> 3) & 1) * 8);
}
// Two B tiles stored as [k][n] (n contiguous).
__device__ __forceinline__ void load_b_kn(uint32_t b[4], const __nv_bfloat16* tile, int ld) {
  const int l = threadIdx.x & 31;
  ldsm_x4_t(b, tile + ((l & 7) + ((l >> 3) & 1) * 8) * ld + (l >> 4) * 8);
}

// 16-byte asynchronous copy global → shared; src_bytes 0 zero-fills.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace nextlm::cuda
