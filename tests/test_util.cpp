// Test helpers (see test_util.h).
#include "test_util.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>

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
  std::string cmd = shell_quote(NEXTLM_BINARY);
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

}  // namespace nextlm::test
