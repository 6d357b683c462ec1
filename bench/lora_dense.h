// `lora_dense_T4096`: the dense LoRA adapters' rank-r products of the slice's LoRA step (T = 4096, rank 16: the
// KDA's q, f_b and o, the MLA's q_b, kv_b and o, the MLPs' down and gate, and the stacked groups' A side at 96 and
// 32 columns) on lora_dense.h's kernels (ours) against the cuBLASLt GEMMs and rounding passes train.cu ran before
// (peer), alternately, on random inputs. One JSON line {"case", "ours_ms", "peer_ms", "floor_ms", "note"}: the sums
// over the shapes of each's median; the note has every shape's pair and the largest relative difference between the
// two forms' outputs (u, s·dy·B, dA, dB); the floor is each operand read once (x twice: u and dA) at 4.14 TB/s.
#pragma once
#include <string>

namespace nextlm::bench {

void lora_dense_case(const std::string& name);

}  // namespace nextlm::bench
