// Test helpers (see test_util.h).
#include "test_util.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "model/backward.h"
#include "model/model.h"
#include "model/train.h"

namespace nextlm::test {

// The bundled example model is a golden case too; it lives in examples/ for users.
static const char* const kExampleCase = "tiny-glm5-next";

// The tests and source directories: compiled in, or from the environment when the binaries run elsewhere (the GPU
// machine runs binaries built here from a copy of the tree at another path).
static std::string test_data_dir() {
  const char* e = std::getenv("NEXTLM_TEST_DATA");
  return e ? e : NEXTLM_TEST_DATA;
}
static std::string source_dir() {
  const char* e = std::getenv("NEXTLM_SOURCE_DIR");
  return e ? e : NEXTLM_SOURCE_DIR;
}

std::vector<std::string> golden_cases() {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(test_data_dir() + "/golden"))
    if (e.is_directory() && std::filesystem::exists(e.path() / "golden.safetensors"))
      out.push_back(e.path().filename().string());
  if (std::filesystem::exists(golden_dir(kExampleCase) + "/golden.safetensors")) out.push_back(kExampleCase);
  std::sort(out.begin(), out.end());
  return out;
}

std::string golden_dir(const std::string& name) {
  if (name == kExampleCase) return source_dir() + "/examples/" + name;
  return test_data_dir() + "/golden/" + name;
}

std::string param_name(const std::string& name) {
  std::string out = name;
  for (char& ch : out)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return out;
}

TempDir::TempDir() {
  static int counter = 0;
  path_ = std::filesystem::temp_directory_path() /
          ("nextlm_test_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
  std::filesystem::remove_all(path_);
  std::filesystem::create_directories(path_);
}
TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

double max_rel_error(const float* a, const float* b, size_t n) {
  double diff = 0.0, ref = 0.0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    ref = std::max(ref, std::fabs(static_cast<double>(b[i])));
  }
  return ref > 0 ? diff / ref : diff;
}

double norm_rel_error(const float* a, const float* b, size_t n) {
  double diff = 0.0, ref = 0.0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return std::numeric_limits<double>::infinity();
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    ref += static_cast<double>(b[i]) * b[i];
  }
  return ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff);
}

std::vector<float> randn(size_t n, unsigned seed, float scale) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

namespace {
std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
}  // namespace

void write_byte_jsonl(const std::string& path, const std::vector<std::string>& texts) {
  std::ofstream f(path);
  for (const std::string& t : texts) {
    f << "{\"tokens\": [";
    for (size_t i = 0; i < t.size(); ++i) f << (i ? ", " : "") << int(static_cast<unsigned char>(t[i]));
    f << "]}\n";
  }
  if (!f) throw std::runtime_error("cannot write " + path);
}

int run_command(const std::string& cmd, std::string* out, std::string* err) {
  TempDir tmp;
  const std::string o = tmp.str("out"), e = tmp.str("err");
  const int rc = std::system((cmd + " >" + o + " 2>" + e + " </dev/null").c_str());
  if (out) *out = slurp(o);
  if (err) *err = slurp(e);
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char ch : s) {
    if (ch == '\'') {
      q.append("'\\''");
    } else {
      q.push_back(ch);
    }
  }
  q.push_back('\'');
  return q;
}

CliResult run_nextlm(const std::string& args) {
  // $NEXTLM_BINARY when the tests run away from their build tree (the GPU machine), else the one built with them.
  const char* bin = std::getenv("NEXTLM_BINARY");
  std::string cmd = shell_quote(bin ? bin : NEXTLM_BINARY);
  cmd.push_back(' ');
  cmd.append(args);
  CliResult r;
  r.rc = run_command(cmd, &r.out, &r.err);
  return r;
}

void copy_dir(const std::string& from, const std::string& to) {
  std::filesystem::create_directories(to);
  std::filesystem::copy(from, to, std::filesystem::copy_options::recursive |
                                      std::filesystem::copy_options::overwrite_existing);
}

ServeProcess::ServeProcess(const std::string& binary, std::vector<std::string> args, int start_seconds, bool quiet,
                           const std::vector<std::string>& launcher) {
  int out[2];
  if (::pipe(out) != 0) throw std::runtime_error("pipe failed");
  args.insert(args.begin(), {binary, "serve", "--port", "0"});
  args.insert(args.begin(), launcher.begin(), launcher.end());
  group_ = !launcher.empty();
  pid_ = ::fork();
  if (pid_ == 0) {
    if (!launcher.empty()) ::setpgid(0, 0);
    ::dup2(out[1], 1);
    if (quiet) ::dup2(::open("/dev/null", O_WRONLY), 2);
    ::close(out[0]);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(out[1]);
  out_ = out[0];
  std::string line;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(start_seconds);
  while (line.find('\n') == std::string::npos && std::chrono::steady_clock::now() < deadline) {
    pollfd p = {out_, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    char buf[256];
    const ssize_t n = ::read(out_, buf, sizeof buf);
    if (n <= 0) break;
    line.append(buf, static_cast<size_t>(n));
  }
  const size_t colon = line.rfind(':');
  if (line.rfind("listening on http://127.0.0.1:", 0) != 0 || colon == std::string::npos) {
    ::kill(group_ ? -pid_ : pid_, SIGKILL);  // no destructor runs: take it down here
    ::waitpid(pid_, nullptr, 0);
    ::close(out_);
    throw std::runtime_error("the server did not start: \"" + line + "\"");
  }
  port_ = std::stoi(line.substr(colon + 1));
}

ServeProcess::~ServeProcess() {
  if (pid_ > 0) {
    ::kill(group_ ? -pid_ : pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  if (out_ >= 0) ::close(out_);
}

int ServeProcess::stop(int sig, int timeout_seconds) {
  ::kill(pid_, sig);
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::kill(group_ ? -pid_ : pid_, SIGKILL);
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
  return -1;
}

namespace {

void round_tensor(Tensor& t) {
  for (float& v : t.data) v = bf16_to_f32(f32_to_bf16(v));
}
void round_mlp(MlpWeights& m) {
  round_tensor(m.gate);
  round_tensor(m.up);
  round_tensor(m.down);
}

}  // namespace

// The CPU reference with the weights that the GPU stores in bf16 rounded to bf16 (the projections, experts,
// embedding and lm_head; norms, mHC, conv, gates and the correction bias stay fp32 on both). For a bf16 checkpoint
// this changes nothing; for an fp32 one it removes the weight rounding from the comparison.
LoraAdapter random_lora(const ModelConfig& c, LoraExperts experts, int64_t rank) {
  LoraOptions o;
  o.rank = rank;
  o.alpha = 8;
  o.experts = experts;
  LoraAdapter ad(c, o, 5);
  unsigned seed = 100;
  for (LoraModule& m : ad.modules()) m.B.data = randn(m.B.data.size(), ++seed, 0.05f);
  return ad;
}

double cpu_lora_gradients(const Model& base, LoraAdapter& ad, const PackedBatch& batch) {
  ModelWeights w = base.weights();
  ad.apply(ad.capture(base.weights()), w);
  const Model merged(base.config(), std::move(w));
  ModelWeights g = zeros_like(merged.weights());
  const double loss = model_forward_backward(merged, batch, g);
  ad.backward(g);
  return loss;
}

LoraAdapter without_gradients(LoraAdapter ad) {
  for (LoraModule& m : ad.modules()) {
    std::fill(m.dA.data.begin(), m.dA.data.end(), 0.0f);
    std::fill(m.dB.data.begin(), m.dB.data.end(), 0.0f);
  }
  return ad;
}

std::vector<float> adapter_values(const LoraAdapter& a) {
  std::vector<float> v;
  for (const LoraModule& m : a.modules()) {
    v.insert(v.end(), m.A.data.begin(), m.A.data.end());
    v.insert(v.end(), m.B.data.begin(), m.B.data.end());
  }
  return v;
}

std::vector<TrainExample> synthetic_examples(const std::vector<int>& lengths, int64_t vocab) {
  std::vector<TrainExample> data;
  for (size_t i = 0; i < lengths.size(); ++i) {
    TrainExample ex;
    const int n = lengths[i];
    for (int t = 0; t < n; ++t) ex.tokens.push_back(static_cast<int32_t>((i * 31 + t * 17 + 3) % vocab));
    if (i % 3 == 1)
      for (int t = 0; t < n; ++t) ex.mask.push_back(t < n / 2 ? 0.0f : 1.0f);
    data.push_back(std::move(ex));
  }
  return data;
}

std::vector<double> csv_losses(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line, "step,loss,lr,grad_norm,tokens,seconds") << path;
  std::vector<double> out;
  while (std::getline(in, line)) out.push_back(std::stod(line.substr(line.find(',') + 1)));
  return out;
}

Model bf16_weights_reference(const std::string& dir) { return bf16_weights_reference(Model::load(dir)); }

Model bf16_weights_reference(const Model& m) {
  ModelWeights w = m.weights();
  round_tensor(w.embed);
  round_tensor(w.lm_head);
  for (LayerWeights& l : w.layers) {
    if (l.kda) {
      for (Tensor* t : {&l.kda->q_proj, &l.kda->k_proj, &l.kda->v_proj, &l.kda->f_a, &l.kda->f_b, &l.kda->b_proj,
                        &l.kda->g_a, &l.kda->g_b, &l.kda->o_proj})
        round_tensor(*t);
    }
    if (l.dsa) {
      for (Tensor* t : {&l.dsa->q_a, &l.dsa->q_b, &l.dsa->kv_a, &l.dsa->kv_b, &l.dsa->o_proj}) round_tensor(*t);
      if (l.dsa->indexer)
        for (Tensor* t : {&l.dsa->indexer->wq_b, &l.dsa->indexer->wk, &l.dsa->indexer->weights_proj,
                          &l.dsa->indexer->gate})
          round_tensor(*t);
    }
    if (l.mlp) round_mlp(*l.mlp);
    if (l.moe) {
      round_tensor(l.moe->router);
      for (MlpWeights& e : l.moe->experts) round_mlp(e);
      if (l.moe->shared) round_mlp(*l.moe->shared);
    }
  }
  return Model(m.config(), std::move(w));
}

std::vector<std::vector<int32_t>> golden_sequences(const std::string& dir) {
  SafetensorsFile f(dir + "/golden.safetensors");
  std::vector<std::vector<int32_t>> out;
  for (int i = 0;; ++i) {
    const TensorView* t = f.buffer().find("tokens." + std::to_string(i));
    if (!t) break;
    std::vector<int32_t> ids(t->numel());
    for (int64_t j = 0; j < t->numel(); ++j) {
      int64_t v;
      std::memcpy(&v, t->data + j * 8, 8);
      ids[j] = static_cast<int32_t>(v);
    }
    out.push_back(ids);
  }
  return out;
}

void write_wide_vocab_model(const std::string& dir, int64_t vocab) {
  const std::string src = golden_dir("fp32_flat_softplus");
  nlohmann::json cfg;
  std::ifstream(src + "/config.json") >> cfg;
  if (cfg.contains("text_config")) throw std::runtime_error(src + "/config.json: expected a flat config");
  cfg["vocab_size"] = vocab;
  std::ofstream(dir + "/config.json") << cfg.dump(2);
  SafetensorsFile f(src + "/model.safetensors");
  std::vector<TensorToWrite> out;
  std::vector<std::vector<float>> wide;
  wide.reserve(2);
  for (const TensorView& t : f.buffer().tensors()) {
    if (t.name == "lm_head.weight" || t.name == "model.language_model.embed_tokens.weight") {
      if (vocab < t.shape[0]) throw std::runtime_error("write_wide_vocab_model: vocab below the model's");
      std::vector<float> w = to_f32(t);
      const std::vector<float> extra = randn((vocab - t.shape[0]) * t.shape[1], 17, 0.02f);
      w.insert(w.end(), extra.begin(), extra.end());
      wide.push_back(std::move(w));
      out.push_back({t.name, DType::F32, {vocab, t.shape[1]}, wide.back().data()});
    } else {
      out.push_back({t.name, t.dtype, t.shape, t.data});
    }
  }
  write_safetensors(dir + "/model.safetensors", out);
}

}  // namespace nextlm::test
