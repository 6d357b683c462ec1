// The dense LoRA kernels (src/cuda/lora_dense.cu) against a double-precision host reference on the same bf16 inputs:
// dB (+)= dyᵀ·u with g = dy·B (fp32, or bf16(s·g)), dA (+)= pᵀ·x, u = bf16(s·x·Aᵀ). Shapes from one row and eight
// columns (one tile, one chunk: the sums written directly) to thousands of both (many column tiles and row chunks:
// the partial sums and their reductions), rows and widths that are not multiples of a stage, every rank the kernels
// take, strided rows and a column offset. Inputs the kernels must not read (x's and dy's columns outside the
// operand, u's columns past r) are NaN, so reading one shows; every output element outside the written region
// starts as a NaN bit pattern and must keep it. Accumulated outputs start non-zero.
//
// Tolerances: fp32 sums of up to 4100 products against double: 1e-5 in norm leaves a wide margin (fp32's rounding
// over such sums is ~1e-6). bf16 outputs are rounded once from the fp32 sum on both sides; a sum next to a rounding
// boundary can land one bf16 ulp (2^-8 relative) apart: 1e-2 in norm. Runs on a GPU machine (part of test_cuda).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "cuda/lora_dense.h"
#include "cuda_test_buffer.h"
#include "io/safetensors.h"

namespace nextlm {
namespace {

using test::DevBuf;
using test::download;
using test::upload;
using cuda::bf16;

constexpr uint16_t kNan16 = 0xFFFF;
constexpr uint32_t kNan32 = 0xFFFFFFFFu;

float nan32() {
  float f;
  std::memcpy(&f, &kNan32, 4);
  return f;
}
uint32_t bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

struct Case {
  std::string name;
  int64_t T, Q;
  int r;
  int64_t pad;  // extra columns on every strided operand (x/dy before and after the operand, u and g after r)
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// bf16 values with their bit patterns, uniform in ±1.
struct Bf16Matrix {
  int64_t rows = 0, ld = 0;
  std::vector<uint16_t> bits;
  float at(int64_t i, int64_t j) const { return bf16_to_f32(bits[i * ld + j]); }
};
// rows × ld, with the columns [c0, c0 + cols) random and the rest NaN.
Bf16Matrix random_bf16(int64_t rows, int64_t ld, int64_t c0, int64_t cols, std::mt19937& gen) {
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  Bf16Matrix m;
  m.rows = rows, m.ld = ld;
  m.bits.assign(static_cast<size_t>(rows * ld), kNan16);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = c0; j < c0 + cols; ++j) m.bits[i * ld + j] = f32_to_bf16(d(gen));
  return m;
}

double rel_error(const std::vector<double>& got, const std::vector<double>& ref) {
  double e = 0, n = 0;
  for (size_t i = 0; i < ref.size(); ++i) e += (got[i] - ref[i]) * (got[i] - ref[i]), n += ref[i] * ref[i];
  return std::sqrt(e / std::max(n, 1e-300));
}

class CudaLoraDense : public testing::TestWithParam<Case> {};

// dB (+)= dyᵀ·u and g = dy·B, both output forms, accumulating and overwriting; twice, for the same bits.
TEST_P(CudaLoraDense, DyPassMatchesReference) {
  const Case c = GetParam();
  std::mt19937 gen(static_cast<unsigned>(c.T * 131 + c.Q * 7 + c.r));
  const int64_t col0 = c.pad > 0 ? 8 : 0, lddy = col0 + c.Q + c.pad, ldu = c.r + c.pad, ldg = c.r + c.pad;
  const float scale = 2.0f;
  const Bf16Matrix dy = random_bf16(c.T, lddy, col0, c.Q, gen), u = random_bf16(c.T, ldu, 0, c.r, gen),
                   B = random_bf16(c.Q, c.r, 0, c.r, gen);
  std::vector<float> dB0(static_cast<size_t>(c.Q * c.r));
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  for (float& v : dB0) v = d(gen);
  // Reference: dB increments and g in double.
  std::vector<double> ddB(dB0.size(), 0.0), g(static_cast<size_t>(c.T * c.r), 0.0);
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t q = 0; q < c.Q; ++q) {
      const double y = dy.at(t, col0 + q);
      for (int j = 0; j < c.r; ++j) {
        ddB[q * c.r + j] += y * u.at(t, j);
        g[t * c.r + j] += y * B.at(q, j);
      }
    }
  DevBuf ddy(dy.bits.size() * 2), du(u.bits.size() * 2), dBm(B.bits.size() * 2), ddB_dev(dB0.size() * 4),
      dg(static_cast<size_t>(c.T * ldg) * 4),
      work(static_cast<size_t>(std::max<int64_t>(cuda::lora_dense_work(c.T, c.Q, c.r, true, true), 1)) * 4);
  upload(ddy, dy.bits);
  upload(du, u.bits);
  upload(dBm, B.bits);
  for (const bool accumulate : {true, false})
    for (const bool f32 : {true, false}) {
      SCOPED_TRACE(std::string(accumulate ? "accumulate" : "overwrite") + (f32 ? ", fp32 g" : ", bf16 g"));
      std::vector<uint32_t> first_bits;
      for (int rep = 0; rep < 2; ++rep) {
        upload(ddB_dev, accumulate ? dB0 : std::vector<float>(dB0.size(), nan32()));
        upload(dg, std::vector<float>(static_cast<size_t>(c.T * ldg), nan32()));  // bf16 view: 0xFFFF pairs
        cuda::lora_dense_dy(ddy.as<bf16>() + col0, lddy, du.as<bf16>(), ldu, dBm.as<bf16>(), c.r, c.Q, c.T,
                            ddB_dev.as<float>(), accumulate, f32 ? dg.as<float>() : nullptr,
                            f32 ? nullptr : dg.as<bf16>(), ldg, scale, work.as<float>(), nullptr);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<float> dBg = download<float>(ddB_dev, dB0.size());
        std::vector<double> inc(dB0.size());
        for (size_t i = 0; i < inc.size(); ++i) inc[i] = dBg[i] - (accumulate ? dB0[i] : 0.0f);
        EXPECT_LE(rel_error(inc, ddB), 1e-5) << "dB";
        std::vector<double> gg(g.size());
        std::vector<uint32_t> all;
        if (f32) {
          const std::vector<float> gd = download<float>(dg, static_cast<size_t>(c.T * ldg));
          for (int64_t t = 0; t < c.T; ++t)
            for (int64_t j = 0; j < ldg; ++j) {
              if (j < c.r) gg[t * c.r + j] = gd[t * ldg + j];
              else ASSERT_EQ(bits(gd[t * ldg + j]), kNan32) << "g's padding written at " << t << ", " << j;
            }
          EXPECT_LE(rel_error(gg, g), 1e-5) << "g";
          for (float v : gd) all.push_back(bits(v));
        } else {
          const std::vector<uint16_t> gd = download<uint16_t>(dg, static_cast<size_t>(c.T * ldg));
          std::vector<double> ref(g.size());
          for (int64_t t = 0; t < c.T; ++t)
            for (int64_t j = 0; j < ldg; ++j) {
              if (j < c.r) {
                gg[t * c.r + j] = bf16_to_f32(gd[t * ldg + j]);
                ref[t * c.r + j] = bf16_to_f32(f32_to_bf16(static_cast<float>(scale * g[t * c.r + j])));
              } else {
                ASSERT_EQ(gd[t * ldg + j], kNan16) << "gs's padding written at " << t << ", " << j;
              }
            }
          EXPECT_LE(rel_error(gg, ref), 1e-2) << "gs";
          for (uint16_t v : gd) all.push_back(v);
        }
        for (float v : dBg) all.push_back(bits(v));
        if (rep == 0) first_bits = all;
        else EXPECT_EQ(all, first_bits) << "a second launch gave other bits";
      }
    }
}

// dA [r, Q] (+)= pᵀ·x.
TEST_P(CudaLoraDense, GradMatchesReference) {
  const Case c = GetParam();
  std::mt19937 gen(static_cast<unsigned>(c.T * 17 + c.Q * 5 + c.r));
  const int64_t col0 = c.pad > 0 ? 8 : 0, ldx = col0 + c.Q + c.pad, ldp = c.r + c.pad;
  const Bf16Matrix x = random_bf16(c.T, ldx, col0, c.Q, gen), p = random_bf16(c.T, ldp, 0, c.r, gen);
  std::vector<float> dA0(static_cast<size_t>(c.r * c.Q));
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  for (float& v : dA0) v = d(gen);
  std::vector<double> ref(dA0.size(), 0.0);
  for (int64_t t = 0; t < c.T; ++t)
    for (int j = 0; j < c.r; ++j) {
      const double pv = p.at(t, j);
      for (int64_t q = 0; q < c.Q; ++q) ref[j * c.Q + q] += pv * x.at(t, col0 + q);
    }
  DevBuf dx(x.bits.size() * 2), dp(p.bits.size() * 2), ddA(dA0.size() * 4),
      work(static_cast<size_t>(std::max<int64_t>(cuda::lora_dense_work(c.T, c.Q, c.r, false, true), 1)) * 4);
  upload(dx, x.bits);
  upload(dp, p.bits);
  for (const bool accumulate : {true, false}) {
    upload(ddA, accumulate ? dA0 : std::vector<float>(dA0.size(), nan32()));
    cuda::lora_dense_grad(dx.as<bf16>() + col0, ldx, dp.as<bf16>(), ldp, c.r, c.Q, c.T, ddA.as<float>(), accumulate,
                          work.as<float>(), nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> got = download<float>(ddA, dA0.size());
    std::vector<double> inc(got.size());
    for (size_t i = 0; i < inc.size(); ++i) inc[i] = got[i] - (accumulate ? dA0[i] : 0.0f);
    EXPECT_LE(rel_error(inc, ref), 1e-5) << (accumulate ? "accumulate" : "overwrite");
  }
}

// u = bf16(s·x·Aᵀ).
TEST_P(CudaLoraDense, FactorMatchesReference) {
  const Case c = GetParam();
  std::mt19937 gen(static_cast<unsigned>(c.T * 3 + c.Q * 11 + c.r));
  const int64_t col0 = c.pad > 0 ? 8 : 0, ldx = col0 + c.Q + c.pad, ldu = c.r + c.pad;
  const float scale = 0.5f;
  const Bf16Matrix x = random_bf16(c.T, ldx, col0, c.Q, gen), A = random_bf16(c.r, c.Q, 0, c.Q, gen);
  std::vector<double> ref(static_cast<size_t>(c.T * c.r), 0.0);
  for (int64_t t = 0; t < c.T; ++t)
    for (int j = 0; j < c.r; ++j) {
      double s = 0;
      for (int64_t q = 0; q < c.Q; ++q) s += static_cast<double>(x.at(t, col0 + q)) * A.at(j, q);
      ref[t * c.r + j] = bf16_to_f32(f32_to_bf16(static_cast<float>(scale * s)));
    }
  DevBuf dx(x.bits.size() * 2), dA(A.bits.size() * 2), du(static_cast<size_t>(c.T * ldu) * 2),
      work(static_cast<size_t>(std::max<int64_t>(cuda::lora_dense_work(c.T, c.Q, c.r, true, false), 1)) * 4);
  upload(dx, x.bits);
  upload(dA, A.bits);
  upload(du, std::vector<uint16_t>(static_cast<size_t>(c.T * ldu), kNan16));
  cuda::lora_dense_factor(dx.as<bf16>() + col0, ldx, dA.as<bf16>(), c.r, c.Q, c.T, scale, du.as<bf16>(), ldu,
                          work.as<float>(), nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> got = download<uint16_t>(du, static_cast<size_t>(c.T * ldu));
  std::vector<double> g(ref.size());
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t j = 0; j < ldu; ++j) {
      if (j < c.r) g[t * c.r + j] = bf16_to_f32(got[t * ldu + j]);
      else ASSERT_EQ(got[t * ldu + j], kNan16) << "u's padding written at " << t << ", " << j;
    }
  EXPECT_LE(rel_error(g, ref), 1e-2);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaLoraDense,
    testing::Values(Case{"one_row_one_tile", 1, 8, 8, 0}, Case{"short_rows_r16", 77, 64, 16, 8},
                    Case{"one_stage_r24", 128, 256, 24, 0}, Case{"ragged_r32", 300, 264, 32, 16},
                    Case{"tiles_and_chunks_r16", 1100, 1000, 16, 8}, Case{"step_width_r16", 4100, 4096, 16, 0},
                    Case{"wide_r8", 520, 8200, 8, 8}),
    [](const testing::TestParamInfo<Case>& i) { return i.param.name; });

// The checks of a shape the kernels do not take: a one-line error, nothing launched.
TEST(CudaLoraDenseShapes, RejectsShapesItDoesNotTake) {
  EXPECT_FALSE(cuda::lora_dense_takes(4, 64, reinterpret_cast<void*>(256), 64, nullptr, 0)) << "rank 4";
  EXPECT_FALSE(cuda::lora_dense_takes(40, 64, reinterpret_cast<void*>(256), 64, nullptr, 0)) << "rank 40";
  EXPECT_FALSE(cuda::lora_dense_takes(16, 60, reinterpret_cast<void*>(256), 64, nullptr, 0)) << "width 60";
  EXPECT_FALSE(cuda::lora_dense_takes(16, 64, reinterpret_cast<void*>(258), 64, nullptr, 0)) << "unaligned x";
  EXPECT_FALSE(cuda::lora_dense_takes(16, 64, reinterpret_cast<void*>(256), 68, nullptr, 0)) << "odd row stride";
  EXPECT_TRUE(cuda::lora_dense_takes(16, 64, reinterpret_cast<void*>(256), 72, reinterpret_cast<void*>(512), 16));
  EXPECT_THROW(cuda::lora_dense_grad(nullptr, 64, nullptr, 16, 12, 64, 10, nullptr, true, nullptr, nullptr),
               std::exception);
}

}  // namespace
}  // namespace nextlm
