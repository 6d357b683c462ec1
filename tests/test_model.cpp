// Whole-model tests of the CPU reference: packed batches equal one-sequence-at-a-time, chunked KDA equals the
// recurrent form end to end, the loader's errors and its report of skipped tensors, bad token ids.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "test_util.h"

namespace nextlm {
namespace {

std::vector<int32_t> random_tokens(int64_t n, int64_t V, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> d(0, static_cast<int32_t>(V - 1));
  std::vector<int32_t> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

class ModelCases : public ::testing::TestWithParam<std::string> {};

TEST_P(ModelCases, PackedBatchEqualsEachSequenceAlone) {
  const Model m = Model::load(test::golden_dir(GetParam()));
  const int64_t V = m.config().vocab_size;
  // Awkward lengths: a single token, shorter than a pool, chunk edges, longer than index_topk.
  const std::vector<int64_t> lens{1, 3, 63, 65, 150, 2};
  PackedBatch packed;
  std::vector<std::vector<int32_t>> seqs;
  for (size_t i = 0; i < lens.size(); ++i) {
    seqs.push_back(random_tokens(lens[i], V, static_cast<unsigned>(i + 1)));
    packed.add(seqs.back());
  }
  const Tensor all = m.forward(packed);
  for (size_t i = 0; i < seqs.size(); ++i) {
    PackedBatch one;
    one.add(seqs[i]);
    const Tensor alone = m.forward(one);
    // Same arithmetic per token; only BLAS blocking over a different row count may reorder sums (~1e-7).
    EXPECT_LE(test::max_rel_error(all.ptr() + packed.cu_seqlens[i] * V, alone.ptr(), alone.data.size()), 1e-5)
        << "sequence " << i << " of length " << lens[i];
  }
}

TEST_P(ModelCases, ChunkedAndRecurrentKdaAgree) {
  const Model m = Model::load(test::golden_dir(GetParam()));
  PackedBatch b;
  b.add(random_tokens(130, m.config().vocab_size, 9));
  b.add(random_tokens(64, m.config().vocab_size, 10));
  const Tensor chunked = m.forward(b, ForwardOptions{KdaForm::Chunked});
  const Tensor recurrent = m.forward(b, ForwardOptions{KdaForm::Recurrent});
  // Per layer the forms agree to ~1e-6 (see test_ops); through 8 layers and the lm_head that grows to ~2e-5, the
  // same budget as the goldens.
  EXPECT_LE(test::max_rel_error(chunked.ptr(), recurrent.ptr(), chunked.data.size()), 1e-4);
}

TEST_P(ModelCases, LogprobsAreLogSoftmaxOfLogits) {
  const Model m = Model::load(test::golden_dir(GetParam()));
  const int64_t V = m.config().vocab_size;
  PackedBatch b;
  b.add(random_tokens(20, V, 3));
  b.add(random_tokens(1, V, 4));
  b.add(random_tokens(7, V, 5));
  const auto lp = m.next_token_logprobs(b);
  const Tensor lg = m.forward(b);
  ASSERT_EQ(lp.size(), 3u);
  EXPECT_EQ(lp[0].size(), 19u);
  EXPECT_EQ(lp[1].size(), 0u);
  EXPECT_EQ(lp[2].size(), 6u);
  for (int64_t n = 0; n < 3; ++n)
    for (size_t i = 0; i < lp[n].size(); ++i) {
      const int64_t t = b.cu_seqlens[n] + static_cast<int64_t>(i);
      double z = 0;
      for (int64_t v = 0; v < V; ++v) z += std::exp(static_cast<double>(lg.data[t * V + v]));
      EXPECT_NEAR(lp[n][i], lg.data[t * V + b.tokens[t + 1]] - std::log(z), 1e-5);
    }
}

INSTANTIATE_TEST_SUITE_P(Cases, ModelCases, ::testing::ValuesIn(test::golden_cases()),
                         [](const auto& info) { return test::param_name(info.param); });

TEST(ModelInput, TokenIdOutsideVocabularyIsAnError) {
  const Model m = Model::load(test::golden_dir("fp32_tail_off"));
  for (int32_t bad : {-1, static_cast<int32_t>(m.config().vocab_size)}) {
    PackedBatch b;
    b.add({1, 2, bad});
    try {
      m.forward(b);
      FAIL() << "no error for id " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::to_string(bad)), std::string::npos) << e.what();
    }
  }
  PackedBatch empty_seq;
  empty_seq.add({1, 2});
  empty_seq.add({});
  EXPECT_THROW(m.forward(empty_seq), Error);
}

// Rewrites a golden checkpoint into `dir` after `edit` changed its tensor list.
struct OwnedTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};

std::vector<OwnedTensor> read_all(const std::string& file) {
  SafetensorsFile f(file);
  std::vector<OwnedTensor> out;
  for (const TensorView& t : f.buffer().tensors())
    out.push_back({t.name, t.dtype, t.shape, std::vector<std::byte>(t.data, t.data + t.nbytes)});
  return out;
}

void write_all(const std::string& file, const std::vector<OwnedTensor>& ts) {
  std::vector<TensorToWrite> w;
  for (const auto& t : ts) w.push_back({t.name, t.dtype, t.shape, t.bytes.data()});
  write_safetensors(file, w);
}

std::string load_error(const std::string& dir) {
  try {
    Model::load(dir);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

class LoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    test::copy_dir(test::golden_dir("fp32_tail_off"), dir.str("m"));
    std::filesystem::remove(dir.str("m/golden.safetensors"));
    tensors = read_all(dir.str("m/model.safetensors"));
  }
  test::TempDir dir;
  std::vector<OwnedTensor> tensors;
};

TEST_F(LoaderTest, MissingTensorIsNamed) {
  const std::string victim = "model.language_model.layers.1.self_attn.indexer.wk.weight";
  std::erase_if(tensors, [&](const OwnedTensor& t) { return t.name == victim; });
  write_all(dir.str("m/model.safetensors"), tensors);
  const std::string err = load_error(dir.str("m"));
  EXPECT_NE(err.find("missing tensor " + victim), std::string::npos) << err;
}

TEST_F(LoaderTest, WrongShapeIsNamed) {
  const std::string victim = "model.language_model.layers.0.self_attn.q_proj.weight";
  for (auto& t : tensors)
    if (t.name == victim) std::swap(t.shape[0], t.shape[1]);
  write_all(dir.str("m/model.safetensors"), tensors);
  const std::string err = load_error(dir.str("m"));
  EXPECT_NE(err.find(victim), std::string::npos) << err;
  EXPECT_NE(err.find("expected [32, 48]"), std::string::npos) << err;
}

TEST_F(LoaderTest, TruncatedFileIsAnError) {
  std::filesystem::resize_file(dir.str("m/model.safetensors"), 5000);
  const std::string err = load_error(dir.str("m"));
  EXPECT_NE(err.find("model.safetensors"), std::string::npos) << err;
}

TEST_F(LoaderTest, MtpVisionAndSharedHeadAreSkippedAndOthersReported) {
  const OwnedTensor like = tensors.front();
  auto add = [&](const std::string& name) {
    OwnedTensor t = like;
    t.name = name;
    tensors.push_back(t);
  };
  add("model.language_model.layers.4.hc_attn_base");        // the MTP layer (num_hidden_layers = 4)
  add("model.language_model.layers.4.shared_head.norm.weight");
  add("model.language_model.layers.4.eh_proj.weight");
  add("model.language_model.layers.0.something_new.weight");  // not part of the model
  write_all(dir.str("m/model.safetensors"), tensors);
  LoadReport rep;
  const Model m = Model::load(dir.str("m"), &rep);
  EXPECT_EQ(rep.mtp_tensors, 2);
  EXPECT_EQ(rep.shared_head_tensors, 1);
  EXPECT_GT(rep.vision_tensors, 0);  // the golden checkpoints carry a tiny vision tower
  ASSERT_EQ(rep.unexpected.size(), 1u);
  EXPECT_EQ(rep.unexpected[0], "model.language_model.layers.0.something_new.weight");
}

TEST_F(LoaderTest, ParameterCountIsTheSumOfTextTensors) {
  LoadReport rep;
  const Model m = Model::load(dir.str("m"), &rep);
  int64_t want = 0;
  for (const auto& t : tensors)
    if (t.name.rfind("model.visual.", 0) != 0) want += static_cast<int64_t>(Tensor::count(t.shape));
  EXPECT_EQ(m.num_parameters(), want);
  EXPECT_EQ(rep.loaded_tensors + rep.vision_tensors, static_cast<int64_t>(tensors.size()));
  EXPECT_LT(m.num_active_parameters(), m.num_parameters());
}

}  // namespace
}  // namespace nextlm
