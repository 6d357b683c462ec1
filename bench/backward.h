// The training backward's recurrence and attention kernels at the model's shapes, each beside its simpler peer timed
// in the same run (bench/backward.cu). One JSON line a case: {"case", "ours_ms", "peer", "peer_ms", "floor_ms",
// "note"}, medians of CUDA-event timings after warm-up on random inputs; the note also says whether ours agreed
// with the peer on those inputs.
#pragma once
#include <string>

namespace nextlm::bench {

// `kda_bwd_T4096_H64`: cuda::kda_chunked_backward at T = 4096 in one sequence, H = 64, K = 128 (fp32); peer: the
// step-serial cuda::kda_recurrent_backward on the same inputs. The note gives both at 4 sequences of 1024.
void kda_backward_case(const std::string& name);

// `kda_bwd_T4096_H64_train`: the same as a training step runs it (4 sequences of 1024, bf16 products, bf16 q, k and
// v, the gate formed from f, the tensor-core forward's kept chunk states, gradients written), reading dO and v_new in
// bf16 (cuda::KdaBf16Operands); peer: the same values in fp32, same run; the note says whether the bits agree.
void kda_backward_train_case(const std::string& name);

// `mla_bwd_T4096_NH64`: cuda::mla_sparse_attention_backward_tc at T = 4096, NH = 64, dqk = dv = 256, causal random
// top-2048 selections; peer: the fp32 tiled cuda::mla_sparse_attention_backward. The note adds the fp32 scatter
// kernel (mla_sparse_attention_backward_scatter).
void mla_backward_case(const std::string& name);

}  // namespace nextlm::bench
