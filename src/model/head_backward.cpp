// The ends of the model in fp32: the embedding into S streams and its backward (padding_idx row frozen, as
// torch.nn.Embedding), and the head: mean over streams (Glm5NextTextHyperHead), final RMSNorm, lm_head and the
// summed next-token cross-entropy, with its backward. The lm_head runs in row blocks so [T, V] is never held.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/linear.h"
#include "cpu/linear_backward.h"
#include "model/backward.h"
#include "model/norm.h"

namespace nextlm {

void embedding_forward(const Tensor& embed, const int32_t* tokens, int64_t T, int64_t S, float* h) {
  const int64_t D = embed.dim(1);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < S; ++s)
      std::copy_n(embed.ptr() + static_cast<int64_t>(tokens[t]) * D, D, h + (t * S + s) * D);
}

void embedding_backward(const int32_t* tokens, int64_t T, int64_t S, const float* dh, std::optional<int64_t> pad_id,
                        Tensor& dembed) {
  const int64_t D = dembed.dim(1);
  for (int64_t t = 0; t < T; ++t) {
    if (pad_id && tokens[t] == *pad_id) continue;
    float* row = dembed.ptr() + static_cast<int64_t>(tokens[t]) * D;
    for (int64_t s = 0; s < S; ++s)
      for (int64_t d = 0; d < D; ++d) row[d] += dh[(t * S + s) * D + d];
  }
}

namespace {

// hn [T, D] = RMSNorm(mean_s h[t, s]); hm [T, D] the mean.
void head_hidden(const ModelWeights& w, const ModelConfig& c, const float* h, int64_t T, std::vector<float>& hm,
                 std::vector<float>& hn) {
  const int64_t S = c.hc_mult, D = c.hidden_size;
  hm.assign(T * D, 0.0f);
  hn.assign(T * D, 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0.0f;
      for (int64_t s = 0; s < S; ++s) acc += h[(t * S + s) * D + d];
      hm[t * D + d] = acc / static_cast<float>(S);
    }
  rmsnorm_forward(hm.data(), w.final_norm.ptr(), hn.data(), T, D, static_cast<float>(c.rms_norm_eps));
}

// target[t] = the next token of t's sequence, or −1 for the last token of a sequence.
std::vector<int64_t> targets(const std::vector<int32_t>& tokens, const std::vector<int64_t>& cu) {
  std::vector<int64_t> out(tokens.size(), -1);
  for (size_t n = 0; n + 1 < cu.size(); ++n)
    for (int64_t t = cu[n]; t + 1 < cu[n + 1]; ++t) out[t] = tokens[t + 1];
  return out;
}

// Loss of the rows [b0, b1) of hn, and (when dhn is not null) the cross-entropy gradient: dlogits = softmax − onehot
// on rows with a target, pushed through the lm_head into dhn and dlm_head.
// With target_weight (indexed by the predicted token's position) each row's loss and gradient are scaled by it.
double head_block(const ModelWeights& w, const ModelConfig& c, const std::vector<float>& hn,
                  const std::vector<int64_t>& target, const float* target_weight, int64_t b0, int64_t b1, float* dhn,
                  Tensor* dlm_head) {
  const int64_t D = c.hidden_size, V = c.vocab_size, n = b1 - b0;
  std::vector<float> logits(n * V);
  cpu::linear(hn.data() + b0 * D, n, D, w.lm_head, logits.data());
  double loss = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    float* row = logits.data() + i * V;
    const int64_t tgt = target[b0 + i];
    const float wt = target_weight && tgt >= 0 ? target_weight[b0 + i + 1] : 1.0f;  // row t predicts t + 1
    if (tgt < 0 || wt == 0.0f) {
      std::fill(row, row + V, 0.0f);
      continue;
    }
    const float mx = *std::max_element(row, row + V);
    double sum = 0.0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(row[v]) - mx);
    const double lse = mx + std::log(sum);
    loss += target_weight ? wt * (lse - row[tgt]) : lse - row[tgt];
    for (int64_t v = 0; v < V; ++v) row[v] = static_cast<float>(std::exp(static_cast<double>(row[v]) - lse));
    row[tgt] -= 1.0f;
    if (target_weight)
      for (int64_t v = 0; v < V; ++v) row[v] *= wt;
  }
  if (dhn) cpu::linear_backward(hn.data() + b0 * D, n, D, w.lm_head, logits.data(), dhn + b0 * D, dlm_head);
  return loss;
}

int64_t block_rows(int64_t V) { return std::max<int64_t>(1, (int64_t{1} << 24) / V); }  // ~64 MB of logits

}  // namespace

double head_loss_forward(const ModelWeights& w, const ModelConfig& c, const float* h, const std::vector<int32_t>& tokens,
                         const std::vector<int64_t>& cu, const float* target_weight) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  std::vector<float> hm, hn;
  head_hidden(w, c, h, T, hm, hn);
  const std::vector<int64_t> target = targets(tokens, cu);
  double loss = 0.0;
  for (int64_t b0 = 0; b0 < T; b0 += block_rows(c.vocab_size))
    loss += head_block(w, c, hn, target, target_weight, b0, std::min(T, b0 + block_rows(c.vocab_size)), nullptr,
                       nullptr);
  return loss;
}

double head_loss_backward(const ModelWeights& w, const ModelConfig& c, const float* h,
                          const std::vector<int32_t>& tokens, const std::vector<int64_t>& cu, float* dh,
                          ModelWeights& dw, const float* target_weight) {
  const int64_t T = static_cast<int64_t>(tokens.size()), S = c.hc_mult, D = c.hidden_size;
  std::vector<float> hm, hn;
  head_hidden(w, c, h, T, hm, hn);
  const std::vector<int64_t> target = targets(tokens, cu);
  std::vector<float> dhn(T * D, 0.0f), dhm(T * D, 0.0f);
  double loss = 0.0;
  for (int64_t b0 = 0; b0 < T; b0 += block_rows(c.vocab_size))
    loss += head_block(w, c, hn, target, target_weight, b0, std::min(T, b0 + block_rows(c.vocab_size)), dhn.data(),
                       &dw.lm_head);
  rmsnorm_backward(hm.data(), w.final_norm.ptr(), dhn.data(), T, D, static_cast<float>(c.rms_norm_eps), dhm.data(),
                   dw.final_norm.ptr());
  const float inv = 1.0f / static_cast<float>(S);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t d = 0; d < D; ++d) dh[(t * S + s) * D + d] += dhm[t * D + d] * inv;
  return loss;
}

}  // namespace nextlm
