// Host-side entry points to the DSA attention backward kernels (backward_kernels.h), for their tests.
#pragma once
#include <cstdint>
#include <vector>

namespace nextlm::cuda_testing {

// mla_sparse_attention_backward on packed sequences (cu_seqlens [N+1]): q [T, NH, dqk], kv [T, NH, dqk+dv] (k | v
// per head), dout [T, NH, dv]; sel[t] the sorted sequence-relative keys of token t (empty: uniform over its
// sequence), laid out in rows of max_sel (≥ every sel[t].size()) whose unused entries point far outside kv, so a
// read of one faults. dq [T, NH, dqk] and dkv [T, NH, dqk+dv] are uploaded as they are, accumulated into and
// downloaded; guard floats after both device buffers are checked to be untouched (throws otherwise). The workspace
// starts filled with garbage (0xff bytes). scatter: the atomics kernel (mla_sparse_attention_backward_scatter)
// instead of the tiled one. Both kernels are timed at the model's shape by nextlm_bench's mla_bwd_T4096_NH64
// (bench/backward.cu).
void mla_sparse_attention_backward(const std::vector<float>& q, const std::vector<float>& kv,
                                   const std::vector<float>& dout, const std::vector<std::vector<int32_t>>& sel,
                                   const std::vector<int64_t>& cu_seqlens, int64_t NH, int64_t dqk, int64_t dv,
                                   int64_t max_sel, std::vector<float>& dq, std::vector<float>& dkv,
                                   bool scatter = false);

// mla_sparse_attention_backward_tc (the tensor-core kernel) with the same conventions: q and kv are converted to
// bf16 (round to nearest even) for the upload, so a caller comparing against an fp32 reference should round them to
// bf16 first; dout stays fp32. The workspace starts filled with garbage (0xff bytes); guard floats after dq and dkv.
// from_forward: the tensor-core forward (mla_sparse_attention_tc) runs first on the same inputs and the backward
// takes its lse2 and output instead of its own stats pass. bf16_out: the gradients come as bf16 (dq16, dkv16; no
// fp32 arrays given), widened into dq and dkv, which are overwritten rather than added to.
void mla_sparse_attention_backward_tc(const std::vector<float>& q, const std::vector<float>& kv,
                                      const std::vector<float>& dout, const std::vector<std::vector<int32_t>>& sel,
                                      const std::vector<int64_t>& cu_seqlens, int64_t NH, int64_t dqk, int64_t dv,
                                      int64_t max_sel, std::vector<float>& dq, std::vector<float>& dkv,
                                      bool from_forward = false, bool bf16_out = false);

// cuda::mla_backward_tc_bf16_outputs: whether the tensor-core backward writes bf16 gradients at these head dims.
bool mla_backward_tc_bf16_outputs(int64_t dqk, int64_t dv);

}  // namespace nextlm::cuda_testing
