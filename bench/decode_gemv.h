// decode_linear, the decoding GEMV (src/cuda/gemv.cuh), at the 4-layer slice's shapes, each against its byte floor
// (the weights it must read once, at 4.14 TB/s) and cuBLASLt timed in the same run.
#pragma once
#include <string>

namespace nextlm::bench {

// `decode_gemv`: one JSON line per measurement, named `<name>_<what>`:
//   decode_linear at M = 1 on every projection shape of a decoding step (out × in = 154880 × 4096 lm_head,
//   24576 × 4096, 4096 × 8192, 8192 × 4096, 4096 × 2048), and at M = 16 and 64 on the first two; peer: cuBLASLt
//   (cuda::Gemm::run, what the forward uses).
// Weights are rotated over copies of more than 256 MB between two reads of the same bytes, so that the 50 MB L2 does
// not serve them. Each line's note has the bandwidth reached and a check of ours against the peer ("CHECK FAILED"
// when off).
void decode_gemv_case(const std::string& name);

}  // namespace nextlm::bench
