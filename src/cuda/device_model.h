// The bf16 CUDA forward of the glm5_next text model on one GPU (host-facing API: no CUDA headers here).
// Weights live on the device in bf16, except the tensors the spec keeps in fp32 (conv, dt_bias, A_log, the
// correction bias) and the small norm / mHC tensors; activations between GEMMs are bf16, everything else fp32.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/model.h"

namespace nextlm {

// Whether a CUDA device is usable, and its name ("" when not).
std::string cuda_device_name(int device = 0);

class CudaModel {
 public:
  // Uploads the weights of a loaded (fp32 host) model.
  explicit CudaModel(const Model& model, int device = 0);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const ModelConfig& config() const;

  // Logits [T, V] in fp32 on the host.
  Tensor forward(const PackedBatch& batch);
  // log p(x[t+1] | x[..t]) per sequence; the lm_head runs in row blocks with a fused log-softmax.
  std::vector<std::vector<double>> next_token_logprobs(const PackedBatch& batch);
  // The forward up to the final norm, left on the device (for timing); returns after the stream synchronises.
  void forward_hidden_only(const PackedBatch& batch);

  // Test hooks: one sub-layer of layer `layer` (the attention one, or the feed-forward one when ffn) on an input
  // a [T, D] (rounded to bf16 on the way in, as the forward feeds it), returning y [T, D]. A shared-indexer DSA
  // layer is not supported here (it needs the previous layer's selection).
  std::vector<float> sublayer(int64_t layer, bool ffn, const std::vector<float>& a, const PackedBatch& batch);
  // mHC pre of one site on streams h [T, S, D]: post [T, S], comb [T, S, S] and the normed input a [T, D].
  void mhc_pre(int64_t layer, bool ffn, const std::vector<float>& h, std::vector<float>& post, std::vector<float>& comb,
               std::vector<float>& a);

  // Per-component milliseconds of the last forward when profiling is on (CUDA events around each part).
  void set_profiling(bool on);
  std::vector<std::pair<std::string, double>> profile() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace nextlm
