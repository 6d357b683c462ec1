// Data-, tensor- and expert-parallel CPU training (see parallel_trainer.h): Trainer::step's accumulation,
// normalisation, clipping and AdamW over one rank's slices, with the sums over the DP group and the replica.
#include "dist/parallel_trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>

#include "core/error.h"
#include "dist/parallel_train.h"
#include "io/safetensors.h"
#include "model/init.h"
#include "model/train.h"

namespace nextlm::dist {

namespace fs = std::filesystem;

namespace {

// The names the optimizer state is kept under (Trainer's kPrefix: transformers 5.x's module tree).
const char* const kPrefix = "model.language_model.";

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// FNV-1a over the bytes of some floats, continuing from h.
uint64_t fnv1a(uint64_t h, const float* x, int64_t n) {
  const unsigned char* p = reinterpret_cast<const unsigned char*>(x);
  for (size_t i = 0; i < static_cast<size_t>(n) * sizeof(float); ++i) {
    h ^= p[i];
    h *= 0x100000001b3ULL;
  }
  return h;
}

// Rank 0 runs fn; its error, if any, is thrown on every rank of comm (so no rank is left waiting in a collective).
template <class Fn>
void on_rank0(Comm& comm, Fn&& fn) {
  std::string err;
  if (comm.rank() == 0) {
    try {
      fn();
    } catch (const std::exception& e) {
      err = e.what();
      if (err.empty()) err = "unknown error";
    }
  }
  uint64_t len = err.size();
  comm.broadcast(&len, sizeof len, 0);
  err.resize(len);
  if (len) comm.broadcast(err.data(), len, 0);
  if (len) throw Error(err);
}

}  // namespace

Placement placement_of(const std::string& name) {
  if (name.find(".mlp.experts.") != std::string::npos) return Placement::Expert;
  static const char* const kTpSliced[] = {
      // vocabulary rows
      "embed_tokens.weight", "lm_head.weight",
      // KDA heads (rows; o_proj columns)
      ".self_attn.q_proj.weight", ".self_attn.k_proj.weight", ".self_attn.v_proj.weight",
      ".self_attn.q_conv1d.weight", ".self_attn.k_conv1d.weight", ".self_attn.v_conv1d.weight",
      ".self_attn.f_b_proj.weight", ".self_attn.dt_bias", ".self_attn.A_log", ".self_attn.b_proj.weight",
      ".self_attn.g_b_proj.weight", ".self_attn.o_proj.weight",
      // MLA heads
      ".self_attn.q_b_proj.weight", ".self_attn.kv_b_proj.weight",
      // dense MLP and shared expert width (gate/up rows, down columns)
      ".gate_proj.weight", ".up_proj.weight", ".down_proj.weight"};
  for (const char* tail : kTpSliced)
    if (ends_with(name, tail)) return Placement::TpSliced;
  return Placement::Replicated;
}

Range replica_share(const PackedBatch& b, int n, int d) {
  const int64_t T = b.num_tokens(), S = b.num_seqs();
  // Sequence s belongs to replica floor(n · mid_s / T), mid_s = (cu[s] + cu[s+1]) / 2: in integers, with 2·mid_s.
  auto owner = [&](int64_t s) {
    const int64_t mid2 = b.cu_seqlens[s] + b.cu_seqlens[s + 1];
    return std::min<int64_t>(n - 1, mid2 * n / (2 * T));
  };
  Range r{0, 0};
  while (r.begin < S && owner(r.begin) < d) ++r.begin;
  r.end = r.begin;
  while (r.end < S && owner(r.end) == d) ++r.end;
  return r;
}

PackedBatch sub_batch(const PackedBatch& b, Range seqs) {
  PackedBatch out;
  for (int64_t s = seqs.begin; s < seqs.end; ++s) {
    const int64_t t0 = b.cu_seqlens[s], t1 = b.cu_seqlens[s + 1];
    out.add(std::vector<int32_t>(b.tokens.begin() + t0, b.tokens.begin() + t1));
    if (!b.target_weight.empty())
      out.target_weight.insert(out.target_weight.end(), b.target_weight.begin() + t0, b.target_weight.begin() + t1);
  }
  return out;
}

void all_reduce_gradients(Comm& comm, const std::vector<ParamRef>& params, size_t chunk) {
  check(chunk > 0, "all_reduce_gradients: chunk must be positive");
  std::vector<float> stage;
  size_t first = 0;  // stage holds the gradients of params [first, i)
  auto flush = [&](size_t end) {
    if (!stage.empty()) {
      comm.all_reduce_sum(stage.data(), stage.size());
      const float* p = stage.data();
      for (size_t k = first; k < end; ++k) {
        std::copy_n(p, params[k].n, params[k].g);
        p += params[k].n;
      }
      stage.clear();
    }
    first = end;
  };
  for (size_t i = 0; i < params.size(); ++i) {
    const size_t n = static_cast<size_t>(params[i].n);
    if (stage.size() + n > chunk) flush(i);
    if (n > chunk) {  // in place, a chunk at a time
      for (size_t j = 0; j < n; j += chunk) comm.all_reduce_sum(params[i].g + j, std::min(chunk, n - j));
      first = i + 1;
      continue;
    }
    stage.insert(stage.end(), params[i].g, params[i].g + n);
  }
  flush(params.size());
}

ShardedModel shard_weights(const ModelConfig& c, const ModelWeights& full, const Mesh& mesh) {
  std::map<std::string, TensorView> views;
  for (const TensorToWrite& t : hub_tensors(c, full)) {
    TensorView v;
    v.name = t.name;
    v.dtype = t.dtype;
    v.shape = t.shape;
    v.data = static_cast<const std::byte*>(t.data);
    v.nbytes = static_cast<size_t>(Tensor::count(t.shape)) * dtype_size(t.dtype);
    v.file = "(memory)";
    views.emplace(t.name, std::move(v));
  }
  const TensorSource src{[&](const std::string& name) -> const TensorView* {
                           auto it = views.find(name);
                           return it == views.end() ? nullptr : &it->second;
                         },
                         "the initial weights"};
  return load_sharded(src, c, mesh, /*frozen=*/true);
}

ParallelTrainer::ParallelTrainer(ShardedModel model, const Mesh& mesh, std::vector<TrainExample> data,
                                 TrainOptions opt)
    : model_(std::move(model)),
      mesh_(&mesh),
      data_(std::move(data)),
      opt_(opt),
      grads_(zeros_like(model_.weights)),
      adam_({}, opt.adamw) {
  check(!data_.empty(), "no training data");
  check(opt_.steps >= 0 && opt_.warmup >= 0 && opt_.grad_accum >= 1 && opt_.batch_tokens >= 2,
        "invalid training options");
  if (opt_.lora) {
    lora_.emplace(model_.config, *opt_.lora, opt_.seed);
    shard_lora_ = ShardLora(*lora_, model_, mesh);
    shard_lora_.apply(*lora_, model_.weights);  // B = 0: W_eff = W, written the one way it always is
    params_ = lora_->params(kPrefix);
  } else {
    params_ = trainable_params(model_.config, model_.weights, grads_, kPrefix);
    for (const ParamRef& p : params_) placement_.push_back(placement_of(p.name));
  }
  adam_ = AdamW(params_, opt_.adamw);
  order_ = epoch_order(static_cast<int64_t>(data_.size()), opt_.seed, pos_.epoch);
}

ParallelTrainer ParallelTrainer::resume(const std::string& dir, const Mesh& mesh, std::vector<TrainExample> data,
                                        TrainOptions opt) {
  const TrainerState st = read_trainer_state(dir);
  if (opt.lora) {
    std::error_code ec;
    check(fs::is_directory(opt.base_model, ec), "cannot resume the LoRA run in ", dir, ": its base model ",
          opt.base_model, " does not exist");
  }
  ParallelTrainer tr(load_sharded(opt.lora ? opt.base_model : dir, mesh), mesh, std::move(data), opt);
  check(st.num_sequences == tr.data_.size(), "cannot resume from ", dir, ": it was trained on ", st.num_sequences,
        " sequences, the data now has ", tr.data_.size(), " (use the same --data and --batch-tokens)");
  tr.adam_.set_steps(st.step);
  tr.pos_ = st.pos;
  check(tr.pos_.cursor >= 0 && tr.pos_.cursor <= static_cast<int64_t>(tr.data_.size()) && tr.pos_.epoch >= 0,
        dir, "/trainer_state.json: bad data position");
  tr.order_ = epoch_order(static_cast<int64_t>(tr.data_.size()), tr.opt_.seed, tr.pos_.epoch);
  if (tr.lora_) {
    // The adapter and its moments whole on every rank, as Trainer::resume reads them.
    tr.lora_->load_values(dir, kPrefix);
    tr.shard_lora_.apply(*tr.lora_, tr.model_.weights);
    read_moments(dir, tr.params_, tr.adam_);
    return tr;
  }
  // The moments are sliced like the weights they belong to: load_sharded over optimizer.safetensors.
  const SafetensorsFile f((fs::path(dir) / "optimizer.safetensors").string());
  for (auto [key, dst] : {std::pair{"exp_avg.", &tr.adam_.m()}, std::pair{"exp_avg_sq.", &tr.adam_.v()}}) {
    const std::string k = key;
    const TensorSource src{[&](const std::string& name) { return f.buffer().find(k + name); }, f.path()};
    ShardedModel mom = load_sharded(src, tr.model_.config, mesh, /*frozen=*/false);
    const std::vector<GradTensor> g = hub_gradients(tr.model_.config, mom.weights, kPrefix);
    check(g.size() == tr.params_.size(), f.path(), ": moments do not match the model's tensors");
    for (size_t i = 0; i < g.size(); ++i) {
      check(static_cast<int64_t>(Tensor::count(g[i].shape)) == tr.params_[i].n, f.path(), ": mis-shaped ", k,
            tr.params_[i].name);
      (*dst)[i].assign(g[i].data, g[i].data + tr.params_[i].n);
    }
  }
  return tr;
}

StepStats ParallelTrainer::step() {
  const auto t0 = std::chrono::steady_clock::now();
  Comm& dp = *mesh_->dp;
  if (lora_) {
    zero_gradients(model_.config, grads_);  // the base's weight gradients, from which the adapter's come
  } else {
    for (ParamRef& p : params_) std::fill_n(p.g, p.n, 0.0f);
  }
  double loss = 0.0, weight = 0.0;
  int64_t tokens = 0;
  for (int64_t a = 0; a < opt_.grad_accum; ++a) {
    // Every rank draws the same micro-batch; this replica computes its share.
    const PackedBatch b = next_packed_batch(data_, opt_, pos_, order_);
    tokens += b.num_tokens();
    weight += prediction_weight(b);
    const Range share = replica_share(b, dp.size(), dp.rank());
    if (share.size() > 0)
      loss += parallel_forward_backward(model_, *mesh_, sub_batch(b, share), grads_, opt_.recompute);
  }
  // Sums over the replicas (one flat buffer), then the TP sums of the partial gradients. With LoRA the replica's
  // weight gradients become the adapter's shares first, which are then summed over the world.
  if (lora_) {
    if (dp.size() > 1) dp.all_reduce_sum(&loss, 1);
    reduce_partial_gradients(*mesh_, grads_);
    shard_lora_.gradients(*lora_, grads_);
    all_reduce_gradients(*mesh_->world, params_);
  } else if (dp.size() > 1) {
    all_reduce_gradients(dp, params_);
    dp.all_reduce_sum(&loss, 1);
  }
  if (!lora_) reduce_partial_gradients(*mesh_, grads_);
  // Trainer::step's per-prediction mean (over the whole step's predictions) and global-norm clipping.
  const float inv = weight > 0 ? static_cast<float>(1.0 / weight) : 0.0f;
  for (ParamRef& p : params_)
    for (int64_t i = 0; i < p.n; ++i) p.g[i] *= inv;
  double sq = 0.0;
  for (size_t k = 0; k < params_.size(); ++k) {
    if (!counted_here(k)) continue;
    const ParamRef& p = params_[k];
    for (int64_t i = 0; i < p.n; ++i) sq += static_cast<double>(p.g[i]) * p.g[i];
  }
  if (!lora_) mesh_->replica->all_reduce_sum(&sq, 1);  // an adapter's gradients are whole on every rank
  StepStats st;
  st.grad_norm = std::sqrt(sq);
  if (opt_.clip > 0 && st.grad_norm > opt_.clip) {  // clip_grad_norm's scaling
    const float scale = static_cast<float>(opt_.clip / (st.grad_norm + 1e-6));
    for (ParamRef& p : params_)
      for (int64_t i = 0; i < p.n; ++i) p.g[i] *= scale;
  }
  st.lr = lr_at(adam_.steps(), opt_.steps, opt_.warmup, opt_.adamw.lr, opt_.min_lr_ratio);
  adam_.step(params_, st.lr);
  if (lora_) {
    shard_lora_.apply(*lora_, model_.weights);
  } else if (model_.config.tie_word_embeddings) {
    model_.weights.lm_head.data = model_.weights.embed.data;
  }
  st.step = adam_.steps();
  st.loss = weight > 0 ? loss / weight : 0.0;
  st.tokens = tokens;
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

bool ParallelTrainer::counted_here(size_t k) const {
  // Replicated tensors on the replica's rank 0, TP slices on its first TP group (its ranks 0..tp-1 hold each slice
  // once), experts on its first EP group.
  if (lora_) return true;  // every rank holds the whole adapter and its gradients
  const int me = mesh_->replica->rank();
  switch (placement_[k]) {
    case Placement::Replicated:
      return me == 0;
    case Placement::TpSliced:
      return me < mesh_->opt.tp;
    case Placement::Expert:
      return me < mesh_->opt.ep;
  }
  return false;
}

int64_t ParallelTrainer::num_trainable() const {
  if (lora_) return lora_->num_parameters();
  double n = 0.0;
  for (size_t k = 0; k < params_.size(); ++k)
    if (counted_here(k)) n += static_cast<double>(params_[k].n);
  mesh_->replica->all_reduce_sum(&n, 1);
  return static_cast<int64_t>(n);
}

void ParallelTrainer::check_replicas_agree() const {
  uint64_t all = 0xcbf29ce484222325ULL, replicated = all;
  for (size_t k = 0; k < params_.size(); ++k) {
    all = fnv1a(all, params_[k].w, params_[k].n);
    if (lora_ || placement_[k] == Placement::Replicated) replicated = fnv1a(replicated, params_[k].w, params_[k].n);
  }
  // With LoRA every rank holds the same adapter: the replica check covers it, the DP one the merged slices too.
  if (lora_)
    for (const GradTensor& t : hub_gradients(model_.config, model_.weights, ""))
      all = fnv1a(all, t.data, static_cast<int64_t>(Tensor::count(t.shape)));
  const std::vector<uint64_t> dp = mesh_->dp->all_gather_value(all);
  const std::vector<uint64_t> rep = mesh_->replica->all_gather_value(replicated);
  const bool ok = std::all_of(dp.begin(), dp.end(), [&](uint64_t h) { return h == dp[0]; }) &&
                  std::all_of(rep.begin(), rep.end(), [&](uint64_t h) { return h == rep[0]; });
  // Every rank must throw alike: agree on the verdict over the world.
  float bad = ok ? 0.0f : 1.0f;
  mesh_->world->all_reduce_max(&bad, 1);
  check(bad == 0.0f, "the data-parallel replicas disagree on the weights after step ", adam_.steps(),
        " (their copies are no longer in step)");
}

ModelWeights ParallelTrainer::moments_as_weights(const std::vector<std::vector<float>>& moments) const {
  ModelWeights x = zeros_like(model_.weights);
  const std::vector<GradTensor> g = hub_gradients(model_.config, x, kPrefix);
  check(g.size() == moments.size(), "optimizer state does not match the model's tensors");
  for (size_t k = 0; k < g.size(); ++k) std::copy(moments[k].begin(), moments[k].end(), const_cast<float*>(g[k].data));
  return x;
}

void ParallelTrainer::save(const std::string& dir) const {
  check_replicas_agree();
  if (lora_) {  // Trainer::save's LoRA checkpoint: the adapter and its moments are whole on every rank
    on_rank0(*mesh_->world, [&] {
      write_training_checkpoint(
          dir, [&](const std::string& tmp) { lora_->save_peft(tmp, opt_.base_model, kPrefix); },
          moment_tensors(params_, adam_), TrainerState{adam_.steps(), pos_, data_.size()}, opt_);
    });
    return;
  }
  const ModelConfig& c = model_.config;
  const ModelWeights full = gather_weights(model_, *mesh_, model_.weights);
  const ModelWeights m = gather_weights(model_, *mesh_, moments_as_weights(adam_.m()));
  const ModelWeights v = gather_weights(model_, *mesh_, moments_as_weights(adam_.v()));
  on_rank0(*mesh_->world, [&] {
    const std::vector<GradTensor> gm = hub_gradients(c, m, kPrefix), gv = hub_gradients(c, v, kPrefix);
    std::vector<TensorToWrite> moments;
    for (size_t k = 0; k < gm.size(); ++k) {
      moments.push_back({"exp_avg." + gm[k].name, DType::F32, gm[k].shape, gm[k].data});
      moments.push_back({"exp_avg_sq." + gv[k].name, DType::F32, gv[k].shape, gv[k].data});
    }
    write_training_checkpoint(
        dir, [&](const std::string& tmp) { save_model(tmp, c, full); }, moments,
        TrainerState{adam_.steps(), pos_, data_.size()}, opt_);
  });
}

}  // namespace nextlm::dist
