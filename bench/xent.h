// The training head's cross-entropy (softmax_xent_backward, src/cuda/moe_backward.cu) at the slice's vocabulary.
#pragma once
#include <string>

namespace nextlm::bench {

// `xent_R2048_V154880`: loss and bf16 dlogits of 2048 rows of fp32 logits over V = 154880 (one row block of the
// LoRA step's head at 4096 tokens), the streaming kernel (each logit read once: ours) against the block-a-row kernel
// (each row read twice: peer, cuda::set_xent_stream(false)), alternately; medians of CUDA-event timings. One JSON
// line {"case", "ours_ms", "peer_ms", "floor_ms", "note"}: the floor reads the logits once and writes dlogits at
// 4.14 TB/s; the note says whether both kernels gave the same losses (within 1e-6 relative) and dlogits (within a
// bf16 step), and whether every output is finite.
void xent_case(const std::string& name);

}  // namespace nextlm::bench
