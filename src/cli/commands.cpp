// CLI commands: `score` (per-token log-probabilities of JSONL token sequences) and `info` (model summary).
#include "cli/commands.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <sstream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "cpu/linear.h"
#include "io/atomic_file.h"
#include "io/jsonl.h"
#include "io/safetensors.h"
#include "model/model.h"

namespace nextlm {
namespace {

struct ScoreArgs {
  std::string model, input, output, logits_out, device = "cpu", format = "jsonl";
  int threads = 0;
};

void check_device(const std::string& device) {
  check(device == "cpu", "device \"", device, "\" is not available in this build (use --device cpu)");
}

// JSON numbers with enough digits to round-trip a double.
std::string number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", x);
  return buf;
}

int cmd_score(const ScoreArgs& a) {
  check_device(a.device);
  cpu::set_num_threads(a.threads);
  const auto t0 = std::chrono::steady_clock::now();
  const Model model = Model::load(a.model);
  const auto seqs = read_token_jsonl(a.input, model.config().vocab_size);
  PackedBatch batch;
  for (const auto& s : seqs) batch.add(s);
  const auto lps = model.next_token_logprobs(batch);

  std::ostringstream os;
  if (a.format == "text") {
    for (size_t n = 0; n < seqs.size(); ++n) {
      double sum = 0.0;
      os << "sequence " << n << " (" << seqs[n].size() << " tokens)\n";
      for (size_t t = 0; t < lps[n].size(); ++t) {
        sum += lps[n][t];
        os << "  " << t + 1 << "\ttoken " << seqs[n][t + 1] << "\tlogprob " << number(lps[n][t]) << "\n";
      }
      const size_t m = lps[n].size();
      os << "  sum " << number(sum);
      if (m) os << "  mean " << number(sum / m) << "  perplexity " << number(std::exp(-sum / m));
      os << "\n";
    }
  } else {
    for (size_t n = 0; n < seqs.size(); ++n) {
      double sum = 0.0;
      os << "{\"logprobs\": [";
      for (size_t t = 0; t < lps[n].size(); ++t) {
        sum += lps[n][t];
        os << (t ? ", " : "") << number(lps[n][t]);
      }
      os << "], \"sum\": " << number(sum) << "}\n";
    }
  }

  if (!a.logits_out.empty()) {
    const Tensor h = model.forward_hidden(batch);
    std::vector<Tensor> logits;
    std::vector<TensorToWrite> out;
    for (int64_t n = 0; n < batch.num_seqs(); ++n) logits.push_back(model.logits(h, batch.cu_seqlens[n], batch.cu_seqlens[n + 1]));
    for (int64_t n = 0; n < batch.num_seqs(); ++n)
      out.push_back({"logits." + std::to_string(n), DType::F32, logits[n].shape, logits[n].ptr()});
    write_safetensors(a.logits_out, out, {{"producer", "nextlm score"}});
  }
  if (a.output.empty()) {
    std::cout << os.str() << std::flush;
  } else {
    AtomicFile f(a.output);
    f.write(os.str());
    f.commit();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cerr << "scored " << seqs.size() << " sequences, " << batch.num_tokens() << " tokens in " << number(secs)
            << " s\n";
  return 0;
}

std::string layer_pattern(const ModelConfig& c) {
  std::string s;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    if (c.layer_types[i] == LayerType::LinearAttention) {
      s += 'K';
    } else {
      s += c.indexer_types[i] == IndexerType::Full ? 'D' : 'd';
    }
  }
  return s;
}

int cmd_info(const std::string& dir) {
  LoadReport rep;
  const Model model = Model::load(dir, &rep);
  const ModelConfig& c = model.config();
  auto& o = std::cout;
  o << "model         " << dir << "\n";
  o << "config        glm5_next (" << (c.nested ? "nested text_config" : "flat") << ")\n";
  o << "vocab/hidden  " << c.vocab_size << " / " << c.hidden_size << "\n";
  o << "layers        " << c.num_hidden_layers << ": " << c.num_kda_layers() << " KDA, " << c.num_dsa_layers()
    << " DSA\n";
  o << "pattern       " << layer_pattern(c) << "   (K = KDA, D = DSA with its own indexer, d = shared indexer)\n";
  std::string mlp;
  for (MlpType t : c.mlp_layer_types) mlp += t == MlpType::Dense ? 'M' : 'E';
  o << "mlp           " << mlp << "   (M = dense MLP, E = MoE)\n";
  o << "KDA           " << c.linear_num_heads << " heads x " << c.linear_head_dim << ", conv " << c.linear_conv_kernel_dim
    << ", gate " << (c.linear_lower_bound ? "safe, lower bound " + number(*c.linear_lower_bound) : std::string("softplus"))
    << "\n";
  o << "MLA           " << c.num_attention_heads << " heads, q_lora " << c.q_lora_rank << ", kv_lora " << c.kv_lora_rank
    << ", qk " << c.qk_nope_head_dim << ", v " << c.v_head_dim << " (NoPE)\n";
  o << "indexer       " << c.index_n_heads << " heads x " << c.index_head_dim << ", top-k " << c.index_topk
    << ", kpool " << c.index_kpool << ", tail " << (c.index_kpool_always_select_tail ? "on" : "off") << "\n";
  o << "MoE           " << c.n_routed_experts << " experts, top " << c.num_experts_per_tok << ", " << c.n_shared_experts
    << " shared, groups " << c.n_group << "/" << c.topk_group << ", width " << c.moe_intermediate_size
    << ", scale " << number(c.routed_scaling_factor) << ", swiglu limit " << number(c.swiglu_limit) << "\n";
  o << "mHC           " << c.hc_mult << " streams, " << c.hc_sinkhorn_iters << " Sinkhorn iterations\n";
  o << "parameters    " << model.num_parameters() << " total, " << model.num_active_parameters()
    << " active per token\n";
  o << "tensors       " << rep.loaded_tensors << " loaded; skipped " << rep.vision_tensors << " vision, "
    << rep.mtp_tensors << " MTP-layer, " << rep.shared_head_tensors << " shared_head\n";
  for (const std::string& n : rep.unexpected) std::cerr << "warning: unexpected tensor " << n << " (ignored)\n";
  return 0;
}

}  // namespace

int run_cli(int argc, char** argv) {
  CLI::App app{"nextlm: runs, scores and trains GLM-5.3-Flash (glm5_next) models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "nextlm 0.1.0");

  ScoreArgs score;
  CLI::App* sc = app.add_subcommand("score", "log-probabilities of token sequences (JSONL {\"tokens\": [...]})");
  sc->add_option("--model", score.model, "model directory (config.json + safetensors)")->required();
  sc->add_option("--input", score.input, "JSONL file, one {\"tokens\": [ids...]} per line")->required();
  sc->add_option("--output", score.output, "write JSONL here instead of stdout");
  sc->add_option("--logits-out", score.logits_out, "write logits.{i} [T_i, V] f32 to this safetensors file");
  sc->add_option("--device", score.device, "cpu")->capture_default_str();
  sc->add_option("--format", score.format, "jsonl or text")->check(CLI::IsMember({"jsonl", "text"}))->capture_default_str();
  sc->add_option("--threads", score.threads, "CPU threads (default: all)")->check(CLI::PositiveNumber);

  std::string info_dir;
  CLI::App* in = app.add_subcommand("info", "config summary, layer pattern, parameter counts, skipped tensors");
  in->add_option("--model", info_dir, "model directory")->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::CallForAllHelp& e) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::CallForVersion& e) {
    std::cout << e.what() << "\n";
    return 0;
  } catch (const CLI::ParseError& e) {
    std::cerr << "error: " << e.what() << " (run nextlm --help)\n";
    return 2;
  }
  try {
    if (*sc) return cmd_score(score);
    if (*in) return cmd_info(info_dir);
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  } catch (const std::bad_alloc&) {
    std::cerr << "error: out of memory\n";
    return 1;
  }
  return 2;
}

}  // namespace nextlm
