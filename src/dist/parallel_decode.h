// Tensor/expert-parallel incremental decoding on the CPU: model/decode.h's prefill, decode steps and generation loop
// on a ShardedModel. Each rank's KDA caches hold its heads only (conv history and recurrent state); the DSA caches
// (MLA latents, indexer pools) are replicated, since the latent and the indexer are.
#pragma once
#include <cstdint>
#include <optional>
#include <vector>

#include "dist/parallel_model.h"
#include "model/decode.h"

namespace nextlm::dist {

struct ParallelDecodeState {
  ParallelDecodeState(const ShardedModel& m, const Mesh& mesh);  // the empty sequence

  const ShardedModel* model;
  const Mesh* mesh;
  int64_t length = 0;
  std::vector<std::optional<KdaCache>> kda;  // [layers]: this rank's heads
  std::vector<std::optional<DsaCache>> dsa;  // [layers]
};

// As prefill / decode_step: the full logits [V] of the last token, the same on every rank (the vocab slices are
// gathered for the one row).
std::vector<float> parallel_prefill(ParallelDecodeState& state, const std::vector<int32_t>& tokens);
std::vector<float> parallel_decode_step(ParallelDecodeState& state, int32_t token);

// As generate: every rank samples from the same logits with the same seed, and rank 0's token is broadcast so that
// the ranks can never disagree. The result is the same on every rank.
Generation parallel_generate(const ShardedModel& m, const Mesh& mesh, const std::vector<int32_t>& prompt,
                             const GenerateOptions& opt);

}  // namespace nextlm::dist
