// The CPU training loop: data, packing, accumulation, AdamW steps, and checkpoints that resume bit for bit.
#include "model/trainer.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "model/init.h"
#include "model/train.h"

namespace nextlm {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::vector<TrainExample> read_train_jsonl(const std::string& path, int64_t vocab_size, int64_t max_len) {
  check(max_len >= 2, "batch size of ", max_len, " tokens is too small (at least 2)");
  std::error_code ec;
  check(!fs::is_directory(path, ec), "data ", path, " is a directory, not a JSONL file");
  std::ifstream in(path);
  if (!in.good()) fail("cannot read data file ", path, ": ", std::strerror(errno));
  std::vector<TrainExample> out;
  std::string line;
  int64_t lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    check(line.find_first_not_of(" \t") != std::string::npos, path, ":", lineno, ": empty line");
    const json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    check(!j.is_discarded(), path, ":", lineno, ": not valid JSON");
    check(j.is_object() && j.contains("tokens") && j.at("tokens").is_array(), path, ":", lineno,
          ": expected an object with a \"tokens\" list");
    const json& toks = j.at("tokens");
    check(!toks.empty(), path, ":", lineno, ": \"tokens\" is empty");
    TrainExample ex;
    for (size_t i = 0; i < toks.size(); ++i) {
      const json& v = toks[i];
      check(v.is_number_integer(), path, ":", lineno, ": token ", i, " is not an integer");
      const bool too_big = v.is_number_unsigned() && v.get<uint64_t>() >= static_cast<uint64_t>(vocab_size);
      const int64_t id = too_big ? vocab_size : v.get<int64_t>();
      check(id >= 0 && id < vocab_size, path, ":", lineno, ": token id ", v.dump(), " at position ", i,
            " is outside the vocabulary [0, ", vocab_size, ")");
      ex.tokens.push_back(static_cast<int32_t>(id));
    }
    if (j.contains("loss_mask")) {
      const json& m = j.at("loss_mask");
      check(m.is_array() && m.size() == toks.size(), path, ":", lineno, ": \"loss_mask\" must be a list of ",
            toks.size(), " values (one per token)");
      for (size_t i = 0; i < m.size(); ++i) {
        check(m[i].is_number() && (m[i].get<double>() == 0.0 || m[i].get<double>() == 1.0), path, ":", lineno,
              ": loss_mask value ", i, " must be 0 or 1, got ", m[i].dump());
        ex.mask.push_back(static_cast<float>(m[i].get<double>()));
      }
    }
    for (const auto& kv : j.items())
      check(kv.key() == "tokens" || kv.key() == "loss_mask", path, ":", lineno, ": unknown key \"", kv.key(),
            "\" (expected tokens and loss_mask)");
    // Cut into pieces that fit a micro-batch.
    const int64_t T = static_cast<int64_t>(ex.tokens.size());
    for (int64_t b = 0; b < T; b += max_len) {
      const int64_t e = std::min(T, b + max_len);
      if (e - b < 2) continue;
      TrainExample piece;
      piece.tokens.assign(ex.tokens.begin() + b, ex.tokens.begin() + e);
      if (!ex.mask.empty()) piece.mask.assign(ex.mask.begin() + b, ex.mask.begin() + e);
      out.push_back(std::move(piece));
    }
  }
  check(!in.bad(), "error reading ", path);
  check(!out.empty(), path, ": no sequence of at least 2 tokens to train on");
  return out;
}

std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  Rng rng(seed * 0x9e3779b97f4a7c15ULL + static_cast<uint64_t>(epoch) + 1);
  for (int64_t i = n - 1; i > 0; --i) std::swap(order[i], order[rng.next() % static_cast<uint64_t>(i + 1)]);
  return order;
}

namespace {

void check_options(const std::vector<TrainExample>& data, const TrainOptions& opt) {
  check(!data.empty(), "no training data");
  check(opt.steps >= 0 && opt.warmup >= 0 && opt.grad_accum >= 1 && opt.batch_tokens >= 2,
        "invalid training options");
}

// The text model's prefix in a checkpoint, chosen as load_weights chooses it: multimodal checkpoints hold it under
// model.language_model., text-only ones under model.
std::string text_prefix(const TensorShapes& s) {
  const std::string mm = "model.language_model.";
  return !s.count(mm + "embed_tokens.weight") && s.count("model.embed_tokens.weight") ? "model." : mm;
}

}  // namespace

Trainer::Trainer(Model model, std::vector<TrainExample> data, TrainOptions opt)
    : model_(std::move(model)),
      data_(std::move(data)),
      opt_(opt),
      grads_(zeros_like(model_.weights())),
      adam_({}, opt.adamw) {
  check_options(data_, opt_);
  if (opt_.lora) {
    lora_.emplace(model_.config(), *opt_.lora, opt_.seed);
    lora_base_ = lora_->capture(model_.weights());
    lora_->apply(lora_base_, model_.mutable_weights());  // B = 0: W_eff = W, written the one way it always is
  }
  init_optimizer();
}

Trainer::Trainer(ModelConfig config, const TensorShapes& base_shapes, std::vector<TrainExample> data,
                 TrainOptions opt)
    : model_(std::move(config), ModelWeights{}), data_(std::move(data)), opt_(opt), adam_({}, opt.adamw),
      base_(LoraBase::Disk) {
  check_options(data_, opt_);
  check(opt_.lora.has_value(), "a trainer with its base on disk trains LoRA adapters: the options have no LoRA");
  const ModelConfig& c = model_.config();
  validate(c);
  // The embedding's shape ties the config to the checkpoint (as Model::load would check it); the adapted
  // projections' shapes are the only other ones the host needs to know.
  const std::string prefix = text_prefix(base_shapes), embed = prefix + "embed_tokens.weight";
  const std::vector<int64_t> embed_shape{c.vocab_size, c.hidden_size};
  const auto it = base_shapes.find(embed);
  check(it != base_shapes.end(), "checkpoint ", opt_.base_model, " is missing tensor ", embed);
  check(it->second == embed_shape, "tensor ", embed, " in ", opt_.base_model, " has shape ", shape_str(it->second),
        ", expected ", shape_str(embed_shape));
  lora_.emplace(c, *opt_.lora, opt_.seed);
  lora_->check_base_shapes(base_shapes, prefix);
  init_optimizer();
}

TensorShapes read_tensor_shapes(const std::string& dir) {
  const Checkpoint ck(dir);  // maps the files and parses their headers; no tensor's data is touched
  TensorShapes out;
  for (const std::string& name : ck.names()) out.emplace(name, ck.find(name)->shape);
  return out;
}

Trainer Trainer::with_base_on_disk(std::vector<TrainExample> data, TrainOptions opt) {
  check(opt.lora.has_value(), "a trainer with its base on disk trains LoRA adapters: the options have no LoRA");
  std::error_code ec;
  check(fs::is_directory(opt.base_model, ec), "LoRA base model ", opt.base_model, " does not exist");
  const fs::path cfg = fs::path(opt.base_model) / "config.json";
  check(fs::exists(cfg, ec), "no config.json in ", opt.base_model);
  ModelConfig c = load_config(cfg.string());
  const TensorShapes shapes = read_tensor_shapes(opt.base_model);
  return Trainer(std::move(c), shapes, std::move(data), std::move(opt));
}

void Trainer::init_optimizer() {
  reset_params();
  adam_ = AdamW(params_, opt_.adamw);
  order_ = epoch_order(static_cast<int64_t>(data_.size()), opt_.seed, pos_.epoch);
}

const Model& Trainer::model() const {
  check(base_ == LoraBase::Host, "this LoRA trainer holds no model: its base stays in ", opt_.base_model);
  return model_;
}

// PEFT module names use transformers' module tree, whose text model is model.language_model.* in 5.x.
const char* const kPrefix = "model.language_model.";

void Trainer::reset_params() {
  params_ = lora_ ? lora_->params(kPrefix) : trainable_params(model_.config(), model_.mutable_weights(), grads_, kPrefix);
}

int64_t Trainer::num_trainable() const {
  int64_t n = 0;
  for (const ParamRef& p : params_) n += p.n;
  return n;
}

PackedBatch Trainer::next_batch() { return next_packed_batch(data_, opt_, pos_, order_); }

PackedBatch next_packed_batch(const std::vector<TrainExample>& data, const TrainOptions& opt, DataPosition& pos,
                              std::vector<int64_t>& order) {
  // Whole sequences in epoch order until the next would not fit; every sequence fits alone (read_train_jsonl).
  PackedBatch b;
  const int64_t n = static_cast<int64_t>(data.size());
  bool any_mask = false;
  while (true) {
    if (pos.cursor == n) {
      pos.cursor = 0;
      order = epoch_order(n, opt.seed, ++pos.epoch);
    }
    const TrainExample& ex = data[order[pos.cursor]];
    if (b.num_tokens() > 0 && b.num_tokens() + static_cast<int64_t>(ex.tokens.size()) > opt.batch_tokens) break;
    if (!ex.mask.empty() && !any_mask) {
      any_mask = true;
      b.target_weight.assign(b.tokens.size(), 1.0f);
    }
    if (any_mask) {
      if (ex.mask.empty()) {
        b.target_weight.insert(b.target_weight.end(), ex.tokens.size(), 1.0f);
      } else {
        b.target_weight.insert(b.target_weight.end(), ex.mask.begin(), ex.mask.end());
      }
    }
    b.add(ex.tokens);
    ++pos.cursor;
  }
  return b;
}

double prediction_weight(const PackedBatch& b) {
  double weight = 0.0;
  for (int64_t s = 0; s < b.num_seqs(); ++s)
    for (int64_t t = b.cu_seqlens[s] + 1; t < b.cu_seqlens[s + 1]; ++t)
      weight += b.target_weight.empty() ? 1.0 : b.target_weight[t];
  return weight;
}

StepStats Trainer::step() {
  check(base_ == LoraBase::Host || grad_fn_,
        "a LoRA trainer with its base on disk needs a gradient function that reads the base (set_gradient_fn)");
  const auto t0 = std::chrono::steady_clock::now();
  if (!device_opt_.update)  // a device optimizer keeps the gradients where they are computed
    for (ParamRef& p : params_) std::fill_n(p.g, p.n, 0.0f);
  // The full-model weight gradients, from which the adapters' come.
  if (lora_ && !grad_fn_) zero_gradients(model_.config(), grads_);
  double loss = 0.0, weight = 0.0;
  int64_t tokens = 0;
  for (int64_t a = 0; a < opt_.grad_accum; ++a) {
    const PackedBatch b = next_batch();
    loss += grad_fn_ ? grad_fn_(model_, lora_ ? &*lora_ : nullptr, adam_.steps(), b, grads_)
                     : model_forward_backward(model_, b, grads_, opt_.recompute);
    tokens += b.num_tokens();
    weight += prediction_weight(b);
  }
  if (lora_ && !grad_fn_) lora_->backward(grads_);  // dA, dB from dW summed over the micro-batches (linear: exact)
  // The per-token mean makes the step size independent of the batch size; a step with nothing to predict (every
  // token masked) still counts as a step and leaves the weights alone apart from weight decay.
  const float inv = weight > 0 ? static_cast<float>(1.0 / weight) : 0.0f;
  StepStats st;
  st.lr = lr_at(adam_.steps(), opt_.steps, opt_.warmup, opt_.adamw.lr, opt_.min_lr_ratio);
  if (device_opt_.update) {
    st.grad_norm = device_opt_.update(st.lr, adam_.steps() + 1, inv, opt_.clip);
    adam_.set_steps(adam_.steps() + 1);
    device_stale_ = true;
  } else {
    for (ParamRef& p : params_)
      for (int64_t i = 0; i < p.n; ++i) p.g[i] *= inv;
    st.grad_norm = clip_grad_norm(params_, opt_.clip);
    adam_.step(params_, st.lr);
    ModelWeights& w = model_.mutable_weights();
    if (lora_) {
      if (base_ == LoraBase::Host) lora_->apply(lora_base_, w);
    } else if (model_.config().tie_word_embeddings) {
      w.lm_head.data = w.embed.data;  // same size: no reallocation
    }
  }
  st.step = adam_.steps();
  st.loss = weight > 0 ? loss / weight : 0.0;
  st.tokens = tokens;
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

namespace {

json options_json(const TrainOptions& o) {
  json j{{"steps", o.steps},          {"warmup", o.warmup}, {"batch_tokens", o.batch_tokens},
         {"grad_accum", o.grad_accum}, {"clip", o.clip},     {"min_lr_ratio", o.min_lr_ratio},
         {"seed", o.seed},            {"lr", o.adamw.lr},   {"beta1", o.adamw.beta1},
         {"beta2", o.adamw.beta2},    {"eps", o.adamw.eps}, {"weight_decay", o.adamw.weight_decay},
         {"recompute", recompute_to_string(o.recompute)}};
  if (o.lora) {
    j["lora"] = lora_options_json(*o.lora);
    j["base_model"] = o.base_model;
  }
  return j;
}

TrainOptions options_from_json(const json& j) {
  TrainOptions o;
  o.steps = j.at("steps").get<int64_t>();
  o.warmup = j.at("warmup").get<int64_t>();
  o.batch_tokens = j.at("batch_tokens").get<int64_t>();
  o.grad_accum = j.at("grad_accum").get<int64_t>();
  o.clip = j.at("clip").get<double>();
  o.min_lr_ratio = j.at("min_lr_ratio").get<double>();
  o.seed = j.at("seed").get<uint64_t>();
  o.adamw.lr = j.at("lr").get<double>();
  o.adamw.beta1 = j.at("beta1").get<double>();
  o.adamw.beta2 = j.at("beta2").get<double>();
  o.adamw.eps = j.at("eps").get<double>();
  o.adamw.weight_decay = j.at("weight_decay").get<double>();
  // Checkpoints written before the policy existed recomputed everything (the default).
  if (j.contains("recompute")) o.recompute = parse_recompute(j.at("recompute").get<std::string>());
  if (j.contains("lora") && !j.at("lora").is_null()) {
    o.lora = lora_options_from_json(j.at("lora"));
    o.base_model = j.at("base_model").get<std::string>();
  }
  return o;
}

json read_state(const std::string& dir) {
  const std::string path = (fs::path(dir) / "trainer_state.json").string();
  std::ifstream in(path);
  check(in.good(), "cannot resume from ", dir, ": no trainer_state.json (not a training checkpoint)");
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  check(!j.is_discarded() && j.is_object(), path, ": not valid JSON");
  return j;
}

// Swaps the complete directory `tmp` in as `dir` atomically: renameat2(RENAME_EXCHANGE) when dir exists (then the
// old checkpoint, now at tmp, is removed); where the file system cannot exchange, the old one is moved aside first
// (resume() also looks for it there).
void swap_in(const std::string& tmp, const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) {
    if (std::rename(tmp.c_str(), dir.c_str()) != 0) fail("cannot rename ", tmp, " to ", dir, ": ", std::strerror(errno));
    return;
  }
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(tmp, ec);
    return;
  }
  const std::string old = dir + ".old";
  fs::remove_all(old, ec);
  if (std::rename(dir.c_str(), old.c_str()) != 0) fail("cannot rename ", dir, " to ", old, ": ", std::strerror(errno));
  if (std::rename(tmp.c_str(), dir.c_str()) != 0) fail("cannot rename ", tmp, " to ", dir, ": ", std::strerror(errno));
  fs::remove_all(old, ec);
}

}  // namespace

void write_training_checkpoint(const std::string& dir, const std::function<void(const std::string& tmp)>& write_model,
                               const std::vector<TensorToWrite>& moments, const TrainerState& st,
                               const TrainOptions& opt) {
  const std::string tmp = dir + ".tmp." + std::to_string(::getpid());
  std::error_code ec;
  fs::remove_all(tmp, ec);
  check(fs::create_directories(tmp, ec) && !ec, "cannot create ", tmp, ": ", ec.message());
  try {
    write_model(tmp);
    write_safetensors((fs::path(tmp) / "optimizer.safetensors").string(), moments, {{"producer", "nextlm train"}});
    const json state{{"step", st.step},
                     {"data_epoch", st.pos.epoch},
                     {"data_cursor", st.pos.cursor},
                     {"num_sequences", st.num_sequences},
                     {"options", options_json(opt)}};
    AtomicFile f((fs::path(tmp) / "trainer_state.json").string());
    f.write(state.dump(2) + "\n");
    f.commit();
    swap_in(tmp, dir);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
}

void Trainer::save(const std::string& dir) {
  if (device_stale_) {
    device_opt_.fetch(*lora_, adam_);
    if (base_ == LoraBase::Host) lora_->apply(lora_base_, model_.mutable_weights());
    device_stale_ = false;
  }
  const std::vector<TensorToWrite> moments = moment_tensors(params_, adam_);
  auto write_model = [&](const std::string& tmp) {
    if (lora_) {
      lora_->save_peft(tmp, opt_.base_model, kPrefix);
    } else {
      save_model(tmp, model_.config(), model_.weights());
    }
  };
  write_training_checkpoint(dir, write_model, moments, TrainerState{adam_.steps(), pos_, data_.size()}, opt_);
}

TrainerState read_trainer_state(const std::string& dir) {
  const json st = read_state(dir);
  TrainerState out;
  try {
    out.step = st.at("step").get<int64_t>();
    out.pos.epoch = st.at("data_epoch").get<int64_t>();
    out.pos.cursor = st.at("data_cursor").get<int64_t>();
    out.num_sequences = st.at("num_sequences").get<size_t>();
  } catch (const json::exception& e) {
    fail(dir, "/trainer_state.json: ", e.what());
  }
  return out;
}

TrainOptions Trainer::stored_options(const std::string& dir) {
  try {
    return options_from_json(read_state(dir).at("options"));
  } catch (const json::exception& e) {
    fail(dir, "/trainer_state.json: ", e.what());
  }
}

Trainer Trainer::resume(const std::string& dir, std::vector<TrainExample> data, TrainOptions opt, LoraBase base) {
  const json st = read_state(dir);
  if (opt.lora) {
    std::error_code ec;
    check(fs::is_directory(opt.base_model, ec), "cannot resume the LoRA run in ", dir, ": its base model ",
          opt.base_model, " does not exist");
  }
  const bool on_disk = opt.lora && base == LoraBase::Disk;
  Trainer tr = on_disk ? with_base_on_disk(std::move(data), opt)
                       : Trainer(Model::load(opt.lora ? opt.base_model : dir), std::move(data), opt);
  if (tr.lora_) {
    tr.lora_->load_values(dir, kPrefix);
    if (!on_disk) tr.lora_->apply(tr.lora_base_, tr.model_.mutable_weights());
  }
  try {
    check(st.at("num_sequences").get<size_t>() == tr.data_.size(), "cannot resume from ", dir, ": it was trained on ",
          st.at("num_sequences").get<size_t>(), " sequences, the data now has ", tr.data_.size(),
          " (use the same --data and --batch-tokens)");
    tr.adam_.set_steps(st.at("step").get<int64_t>());
    tr.pos_.epoch = st.at("data_epoch").get<int64_t>();
    tr.pos_.cursor = st.at("data_cursor").get<int64_t>();
  } catch (const json::exception& e) {
    fail(dir, "/trainer_state.json: ", e.what());
  }
  check(tr.pos_.cursor >= 0 && tr.pos_.cursor <= static_cast<int64_t>(tr.data_.size()) && tr.pos_.epoch >= 0,
        dir, "/trainer_state.json: bad data position");
  tr.order_ = epoch_order(static_cast<int64_t>(tr.data_.size()), tr.opt_.seed, tr.pos_.epoch);
  read_moments(dir, tr.params_, tr.adam_);
  return tr;
}

std::vector<TensorToWrite> moment_tensors(const std::vector<ParamRef>& params, const AdamW& adam) {
  std::vector<TensorToWrite> out;
  for (size_t k = 0; k < params.size(); ++k) {
    out.push_back({"exp_avg." + params[k].name, DType::F32, params[k].shape, adam.m()[k].data()});
    out.push_back({"exp_avg_sq." + params[k].name, DType::F32, params[k].shape, adam.v()[k].data()});
  }
  return out;
}

void read_moments(const std::string& dir, const std::vector<ParamRef>& params, AdamW& adam) {
  const SafetensorsFile f((fs::path(dir) / "optimizer.safetensors").string());
  for (size_t k = 0; k < params.size(); ++k) {
    const ParamRef& p = params[k];
    for (auto [key, dst] : {std::pair{"exp_avg.", &adam.m()[k]}, std::pair{"exp_avg_sq.", &adam.v()[k]}}) {
      const TensorView* t = f.buffer().find(key + p.name);
      check(t && t->shape == p.shape && t->dtype == DType::F32, f.path(), ": missing or mis-shaped ", key, p.name);
      *dst = to_f32(*t);
    }
  }
}

std::string loss_curve_svg(const std::vector<LogRow>& rows) {
  // A 640×400 line chart: loss against step, with the axes' ranges written at their ends.
  const double W = 640, H = 400, L = 60, R = 20, T = 30, B = 40;
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" viewBox=\"0 0 " << W
    << " " << H << "\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"" << W / 2 << "\" y=\"20\" text-anchor=\"middle\" font-family=\"sans-serif\" font-size=\"14\">"
    << "training loss (nats per token)</text>\n";
  o << "<line x1=\"" << L << "\" y1=\"" << H - B << "\" x2=\"" << W - R << "\" y2=\"" << H - B
    << "\" stroke=\"black\"/>\n<line x1=\"" << L << "\" y1=\"" << T << "\" x2=\"" << L << "\" y2=\"" << H - B
    << "\" stroke=\"black\"/>\n";
  if (!rows.empty()) {
    double s0 = rows.front().step, s1 = rows.back().step, lo = rows.front().loss, hi = lo;
    for (const LogRow& r : rows) lo = std::min(lo, r.loss), hi = std::max(hi, r.loss);
    if (s1 <= s0) s1 = s0 + 1;
    if (hi <= lo) hi = lo + 1;
    auto x = [&](double s) { return L + (W - L - R) * (s - s0) / (s1 - s0); };
    auto y = [&](double v) { return H - B - (H - T - B) * (v - lo) / (hi - lo); };
    o << "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"";
    for (const LogRow& r : rows) o << x(r.step) << "," << y(r.loss) << " ";
    o << "\"/>\n";
    auto label = [&](double px, double py, const char* anchor, double v) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.4g", v);
      o << "<text x=\"" << px << "\" y=\"" << py << "\" text-anchor=\"" << anchor
        << "\" font-family=\"sans-serif\" font-size=\"12\">" << buf << "</text>\n";
    };
    label(L - 5, y(hi) + 4, "end", hi);
    label(L - 5, y(lo) + 4, "end", lo);
    label(L, H - B + 16, "middle", s0);
    label(W - R, H - B + 16, "middle", s1);
    o << "<text x=\"" << W / 2 << "\" y=\"" << H - 8
      << "\" text-anchor=\"middle\" font-family=\"sans-serif\" font-size=\"12\">step</text>\n";
  }
  o << "</svg>\n";
  return o.str();
}

}  // namespace nextlm
