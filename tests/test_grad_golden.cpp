// The CPU fp32 backward against transformers 5.17.0 autograd (tests/golden/<case>/golden_grads.safetensors, made by
// make_goldens.py): the gradient of L = Σ_seq Σ_t −log p(x[t+1] | x[..t]) over the case's golden sequences, each
// run alone, for every trainable tensor under its hub name, and the loss; and `nextlm grad`, which writes them.
// Tolerances: per tensor ‖g − ref‖/‖ref‖ ≤ 1e-3 and |L − ref|/|ref| ≤ 1e-5. Both sides are fp32 with different
// summation orders (and transformers runs the chunked KDA form, we the recurrent one, which are equal up to
// rounding); the forward agrees to ~1e-5 relative, and the backward compounds that over every layer twice, so
// 1e-3 leaves room for rounding while any missing term (a dropped path, a wrong sign, a mis-scaled parameter)
// gives errors of order 1.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>

#include "io/safetensors.h"
#include "model/train.h"
#include "test_util.h"

namespace nextlm {
namespace {

constexpr double kGradTol = 1e-3;
constexpr double kLossTol = 1e-5;

struct Grads {
  double loss = 0.0;
  ModelWeights g;
  std::vector<GradTensor> named;
};

// Each golden sequence alone (accumulating), or all of them in one packed batch.
Grads compute(const Model& m, const std::string& dir, bool packed) {
  Grads r;
  r.g = zeros_like(m.weights());
  const auto seqs = test::golden_sequences(dir);
  EXPECT_GE(seqs.size(), 5u);
  if (packed) {
    PackedBatch b;
    for (size_t i = seqs.size(); i-- > 0;) b.add(seqs[i]);
    r.loss = model_forward_backward(m, b, r.g);
  } else {
    for (const auto& s : seqs) {
      PackedBatch b;
      b.add(s);
      r.loss += model_forward_backward(m, b, r.g);
    }
  }
  r.named = hub_gradients(m.config(), r.g, text_prefix(Checkpoint(dir)));
  return r;
}

class GradGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(GradGolden, EverySequenceAloneMatchesTransformers) {
  const std::string dir = test::golden_dir(GetParam());
  const Model m = Model::load(dir);
  const Grads mine = compute(m, dir, /*packed=*/false);
  SafetensorsFile ref(dir + "/golden_grads.safetensors");

  const TensorView* loss = ref.buffer().find("loss");
  ASSERT_TRUE(loss && loss->dtype == DType::F64 && loss->numel() == 1);
  double ref_loss;
  std::memcpy(&ref_loss, loss->data, 8);
  EXPECT_LE(std::fabs(mine.loss - ref_loss) / std::fabs(ref_loss), kLossTol) << mine.loss << " vs " << ref_loss;

  std::map<std::string, const GradTensor*> by_name;
  for (const GradTensor& g : mine.named) by_name[g.name] = &g;
  std::set<std::string> golden_names;
  double worst = 0.0;
  std::string worst_name;
  for (const TensorView& t : ref.buffer().tensors()) {
    if (t.name == "loss") continue;
    golden_names.insert(t.name);
    const auto it = by_name.find(t.name);
    if (it == by_name.end()) {
      ADD_FAILURE() << "golden gradient " << t.name << " is not produced";
      continue;
    }
    ASSERT_EQ(it->second->shape, t.shape) << t.name;
    const std::vector<float> r = to_f32(t);
    const double err = test::norm_rel_error(it->second->data, r.data(), r.size());
    EXPECT_LE(err, kGradTol) << t.name;
    if (err > worst) worst = err, worst_name = t.name;
  }
  for (const GradTensor& g : mine.named) EXPECT_TRUE(golden_names.count(g.name)) << g.name << " has no golden";
  std::printf("[grad golden] %s: worst ‖g − ref‖/‖ref‖ = %.3g (%s), loss %.10g vs %.10g\n", GetParam().c_str(), worst,
              worst_name.c_str(), mine.loss, ref_loss);
}

TEST_P(GradGolden, PackedBatchEqualsSequencesAlone) {
  const std::string dir = test::golden_dir(GetParam());
  const Model m = Model::load(dir);
  const Grads alone = compute(m, dir, false), packed = compute(m, dir, true);
  EXPECT_LE(std::fabs(alone.loss - packed.loss) / std::fabs(alone.loss), 1e-6);  // double sums of fp32 terms
  ASSERT_EQ(alone.named.size(), packed.named.size());
  for (size_t i = 0; i < alone.named.size(); ++i) {
    const size_t n = Tensor::count(alone.named[i].shape);
    // The same arithmetic except GEMM blocking over the batch and the order of the sums over tokens: rounding only,
    // largest (~2e-5) for the small mHC base/scale gradients, sums over every token with cancellation.
    EXPECT_LE(test::norm_rel_error(packed.named[i].data, alone.named[i].data, n), 1e-4) << alone.named[i].name;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, GradGolden, ::testing::Values("bf16_sharded", "fp32_tail_off"),
                         [](const auto& info) { return test::param_name(info.param); });

// ---- nextlm grad ------------------------------------------------------------------------------------------------

using test::CliResult;
using test::run_nextlm;
using test::shell_quote;

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

std::string jsonl_of(const std::vector<std::vector<int32_t>>& seqs) {
  std::string s;
  for (const auto& q : seqs) {
    s += "{\"tokens\": [";
    for (size_t i = 0; i < q.size(); ++i) s += (i ? ", " : "") + std::to_string(q[i]);
    s += "]}\n";
  }
  return s;
}

// The golden sequences through the CLI (one packed batch): the file holds exactly the golden's tensors, with the
// checkpoint's shapes (conv weights [C, 1, W]) and dtypes (f32, loss F64 [1]), within the golden tolerances.
TEST(GradCli, WritesTheGoldenGradients) {
  const std::string dir = test::golden_dir("fp32_tail_off");
  test::TempDir tmp;
  write_text(tmp.str("in.jsonl"), jsonl_of(test::golden_sequences(dir)));
  const CliResult r =
      run_nextlm("grad --model " + shell_quote(dir) + " --input " + shell_quote(tmp.str("in.jsonl")) +
                       " --out " + shell_quote(tmp.str("g.safetensors")) + " --threads 2");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(r.out.empty());
  SafetensorsFile mine(tmp.str("g.safetensors")), ref(dir + "/golden_grads.safetensors");
  ASSERT_EQ(mine.buffer().tensors().size(), ref.buffer().tensors().size());
  for (const TensorView& t : ref.buffer().tensors()) {
    const TensorView* m = mine.buffer().find(t.name);
    ASSERT_TRUE(m) << t.name;
    EXPECT_EQ(m->dtype, t.dtype) << t.name;
    EXPECT_EQ(m->shape, t.shape) << t.name;
    if (t.name == "loss") {
      double a, b;
      std::memcpy(&a, m->data, 8);
      std::memcpy(&b, t.data, 8);
      EXPECT_LE(std::fabs(a - b) / std::fabs(b), kLossTol);
      continue;
    }
    const std::vector<float> x = to_f32(*m), y = to_f32(t);
    EXPECT_LE(test::norm_rel_error(x.data(), y.data(), y.size()), kGradTol) << t.name;
  }
}

// Bad input: one line "error: …" on stderr, a non-zero status, and no output file (an existing one untouched).
TEST(GradCli, BadInputLeavesNoOutput) {
  const std::string dir = test::golden_dir("fp32_tail_off");
  test::TempDir tmp;
  write_text(tmp.str("ok.jsonl"), "{\"tokens\": [1, 2, 3]}\n");
  write_text(tmp.str("bad_json.jsonl"), "{\"tokens\": [1, 2, 3]}\n{\"tokens\": [4,\n");
  write_text(tmp.str("bad_id.jsonl"), "{\"tokens\": [1, 256]}\n");
  write_text(tmp.str("empty_line.jsonl"), "{\"tokens\": [1, 2]}\n\n");
  write_text(tmp.str("existing.safetensors"), "keep me");
  const std::string out = tmp.str("g.safetensors");
  struct Case {
    std::string args;
    int rc;
    std::string mention;
  };
  const std::string model = " --model " + shell_quote(dir);
  const std::vector<Case> cases = {
      {"grad" + model + " --input " + shell_quote(tmp.str("bad_json.jsonl")) + " --out " + shell_quote(out), 1, "bad_json.jsonl:2"},
      {"grad" + model + " --input " + shell_quote(tmp.str("bad_id.jsonl")) + " --out " + shell_quote(out), 1, "256"},
      {"grad" + model + " --input " + shell_quote(tmp.str("empty_line.jsonl")) + " --out " + shell_quote(out), 1, "empty_line.jsonl:2"},
      {"grad" + model + " --input " + shell_quote(tmp.str("missing.jsonl")) + " --out " + shell_quote(out), 1, "missing.jsonl"},
      {"grad --model " + shell_quote(tmp.str("nomodel")) + " --input " + shell_quote(tmp.str("ok.jsonl")) + " --out " + shell_quote(out),
       1, "nomodel"},
      {"grad" + model + " --input " + shell_quote(tmp.str("ok.jsonl")) + " --out " + shell_quote(tmp.str("nodir/g.safetensors")),
       1, "nodir"},
      {"grad" + model + " --input " + shell_quote(tmp.str("ok.jsonl")) + " --out " + shell_quote(tmp.str("")), 1, "directory"},
      {"grad" + model + " --input " + shell_quote(tmp.str("ok.jsonl")) + " --out " + shell_quote(tmp.str("ok.jsonl")), 2, "--out"},
      {"grad" + model + " --input " + shell_quote(tmp.str("ok.jsonl")) + " --out " + shell_quote(out) + " --device tpu", 2,
       "--device"},
      {"grad" + model + " --input " + shell_quote(tmp.str("ok.jsonl")) + " --out " + shell_quote(out) +
           " --recompute kda,attention",
       2, "--recompute: unknown"},
      {"grad" + model + " --input " + shell_quote(tmp.str("ok.jsonl")) + " --out " + shell_quote(out) + " --threads 0", 2,
       "--threads"},
      {"grad" + model + " --input " + shell_quote(tmp.str("ok.jsonl")), 2, "--out"},
      {"grad" + model + " --input " + shell_quote(tmp.str("bad_id.jsonl")) + " --out " +
           shell_quote(tmp.str("existing.safetensors")),
       1, "256"},
  };
  for (const Case& c : cases) {
    const CliResult r = run_nextlm(c.args);
    EXPECT_EQ(r.rc, c.rc) << c.args << "\n" << r.err;
    EXPECT_EQ(r.err.rfind("error:", 0), 0u) << c.args << "\n" << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find(c.mention), std::string::npos) << c.args << "\n" << r.err;
    EXPECT_FALSE(std::filesystem::exists(out)) << c.args;
  }
  std::ifstream kept(tmp.str("existing.safetensors"));
  std::string text((std::istreambuf_iterator<char>(kept)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "keep me");
  // Nothing else was left in the directory (no temporaries).
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(tmp.path())) files += e.is_regular_file();
  EXPECT_EQ(files, 5);
}


// --recompute: every policy writes the same file bit for bit (the same functions on the same inputs, at other times).
TEST(GradCli, RecomputePoliciesWriteTheSameGradients) {
  const std::string dir = test::golden_dir("fp32_tail_off");
  test::TempDir tmp;
  write_text(tmp.str("in.jsonl"), jsonl_of(test::golden_sequences(dir)));
  auto run = [&](const std::string& policy) {
    const std::string out = tmp.str("g_" + std::to_string(std::hash<std::string>{}(policy)) + ".safetensors");
    const CliResult r = run_nextlm("grad --model " + shell_quote(dir) + " --input " + shell_quote(tmp.str("in.jsonl")) +
                                   " --out " + shell_quote(out) + " --threads 2 --recompute " + policy);
    EXPECT_EQ(r.rc, 0) << policy << "\n" << r.err;
    std::ifstream f(out, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  };
  const std::string all = run("all");
  ASSERT_FALSE(all.empty());
  for (const std::string policy : {"none", "kda,moe", "mla,mlp,mhc"}) EXPECT_EQ(run(policy), all) << policy;
}

}  // namespace
}  // namespace nextlm
