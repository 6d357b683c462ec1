// Decoding benchmarks on the 4-layer full-width slice (bench/decode.cpp).
#pragma once
#include <cstdint>
#include <string>

namespace nextlm::bench {

// `slice4_decode_b{B}`: median milliseconds of one decoding step of B slots, each after a 4096-token prompt, on the
// slice's random device weights; one JSON line with the floor (the step's weight and cache bytes at 4.14 TB/s).
void slice4_decode_case(const std::string& name, int64_t B);
// slice4_train_inference_b1: decoded log-probs against the forward's score of the same sequence.
void slice4_train_inference_case(const std::string& name);

}  // namespace nextlm::bench
