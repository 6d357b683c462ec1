// The training forward and backward on one GPU: CudaModel::forward_backward, the device counterpart of
// model_forward_backward (src/model/train.cpp). The forward keeps the streams entering each mHC site, each
// sub-layer's output, the DSA selections, each KDA or DSA sub-layer's attention core output and each site's mHC
// projection partials; the backward walks the sites from the last, recomputing each one's mHC mix (from those
// partials) and sub-layer up to its output projection but for that core (keeping the activations its backward
// reads, in the arena; the output projection's input is its last one) and then running the backward kernels
// (backward_kernels.h) and the GEMMs dx = dy·W, dW += dyᵀ·x (gemm.h). Under a recompute policy that keeps a
// component (set_recompute), its sites keep their activations from the forward instead. The forward pass and the
// recomputation run the same functions on the same inputs, so every policy gives the same loss bit for bit, and the
// same gradients up to the order of the atomic additions that also separates two runs of one policy (embedding, MLA
// key gradients).
// On one rank of a tensor/expert-parallel model (CudaShard) the same step runs on the rank's slices with the
// collectives of src/dist/parallel_train.h's design: each sub-layer's output and input gradient are shares summed
// over TP (the MoE's over TP and EP), the head is a vocabulary-parallel cross-entropy, and the gradients of the
// replicated tensors that feed only a rank's heads stay partial (dist::gather_gradients sums them; the router's,
// partial over EP, gradients() sums).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>
#include <optional>

#include "cuda/backward_kernels.h"
#include "cuda/model_impl.h"
#include "model/backward.h"

namespace nextlm {

namespace {

// The dense LoRA kinds that read one input, in the order set_lora stacks their A (and dA) back to back: the KDA
// layer's normed input feeds q, k, v, f_a, g_a and b; the MLA layer's q_a and kv_a; an MLP's (and the shared
// expert's) gate and up. Step stacks a site's adapters of one group (see Step::stack_group).
const std::vector<std::vector<LoraKind>>& lora_input_groups() {
  static const std::vector<std::vector<LoraKind>> groups{
      {LoraKind::KdaQ, LoraKind::KdaK, LoraKind::KdaV, LoraKind::KdaFA, LoraKind::KdaGA, LoraKind::KdaB},
      {LoraKind::MlaQA, LoraKind::MlaKVA},
      {LoraKind::MlpGate, LoraKind::MlpUp},
      {LoraKind::SharedGate, LoraKind::SharedUp}};
  return groups;
}

}  // namespace

namespace cuda {
namespace {

__global__ void scale_to_bf16_kernel(const float* x, float s, bf16* y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] = __float2bfloat16(s * x[i]);
}

// y[r, c] (row stride ldy) = bf16(s·x[r, c]) for x [rows, cols] (contiguous): scale_to_bf16_kernel's arithmetic.
__global__ void scale_to_bf16_rows_kernel(const float* x, float s, bf16* y, int64_t ldy, int64_t rows, int64_t cols) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * cols;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[(i / cols) * ldy + i % cols] = __float2bfloat16(s * x[i]);
}

// dst[r, c] = src[r, c] for r < rows, c < cols (bf16, row strides ldd and lds); VEC (cols, strides and bases in
// 16-byte units): eight columns a thread.
template <bool VEC>
__global__ void copy_cols_kernel(bf16* dst, int64_t ldd, const bf16* src, int64_t lds, int64_t rows, int64_t cols) {
  const int64_t per = VEC ? cols / 8 : cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * per;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per, c = i % per;
    if constexpr (VEC)
      *reinterpret_cast<uint4*>(dst + r * ldd + 8 * c) = *reinterpret_cast<const uint4*>(src + r * lds + 8 * c);
    else
      dst[r * ldd + c] = src[r * lds + c];
  }
}

// The vocabulary-parallel cross-entropy of rows of a logits slice [n, V] holding entries begin … begin + V − 1,
// given each row's max gmx, Σ exp(x − gmx) gsum and target logit tl over the whole vocabulary (reduced over TP):
// dlogits = wt·(softmax − onehot) on the slice (bf16, written), loss[r] = wt·(lse − tl) (written; 0 without a term).
__global__ void split_xent_kernel(const float* logits, const int32_t* target, int64_t begin, const float* wt,
                                  const float* gmx, const float* gsum, const float* tl, double* loss, bf16* dlogits,
                                  int64_t n, int64_t V) {
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const float* row = logits + r * V;
    bf16* drow = dlogits + r * V;
    const int32_t tg = target[r];
    const float w = tg >= 0 && wt ? wt[r] : 1.0f;
    if (tg < 0 || w == 0.0f) {
      for (int64_t v = threadIdx.x; v < V; v += blockDim.x) drow[v] = __float2bfloat16(0.0f);
      if (threadIdx.x == 0) loss[r] = 0.0;
      continue;
    }
    const float m = gmx[r], inv = 1.0f / gsum[r];
    const int64_t local = static_cast<int64_t>(tg) - begin;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
      const float p = expf(row[v] - m) * inv;
      drow[v] = __float2bfloat16(w * (v == local ? p - 1.0f : p));
    }
    if (threadIdx.x == 0)
      loss[r] = static_cast<double>(w) *
                (static_cast<double>(m) + log(static_cast<double>(gsum[r])) - static_cast<double>(tl[r]));
  }
}

// The tokens in a vocabulary slice's numbering: tok − begin when held, else `skip` (the embedding backward's pad
// id, so that it adds nothing for them).
__global__ void local_tokens_kernel(const int32_t* tok, int32_t* out, int64_t T, int64_t begin, int64_t rows,
                                    int32_t skip) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t < T) {
    const int64_t r = static_cast<int64_t>(tok[t]) - begin;
    out[t] = r >= 0 && r < rows ? static_cast<int32_t>(r) : skip;
  }
}

// What each sub-layer's backward reads, kept by its training forward (arena memory).
struct KdaActs {
  float *raw, *q, *k, *v, *fa, *f, *g, *beta, *ga, *gate;
  // The tensor-core forward's bf16 q, k and v; the chunked backward reads them (then q, k and v are null).
  bf16 *q16 = nullptr, *k16 = nullptr, *v16 = nullptr;
  // The recurrence's output: bf16 from the tensor-core kernel (the output norm and its backward read it so), else
  // fp32; the other is null.
  float* o = nullptr;
  bf16* o_tc = nullptr;
  bf16 *fa16, *ga16, *o16;
  // The tensor-core recurrence's state entering each chunk and v_new, for the chunked backward (set_kda_keep_states;
  // null: the backward forms them); v_new in bf16 (chunk_u16, chunk_u null) for its bf16 products.
  float *chunk_h = nullptr, *chunk_u = nullptr;
  bf16* chunk_u16 = nullptr;
};
struct DsaActs {
  float *qa, *q, *lat, *kv;
  bf16 *qr, *lat16, *o;
  bf16 *q16 = nullptr, *kv16 = nullptr;  // the tensor-core attention's bf16 q and kv (both passes read them)
  float* lse2 = nullptr;                  // and its rows' log-sum-exp [T, NH], for the backward
};
struct MlpActs {
  float* gu;
  bf16* act;
};
struct MoeActs {
  float *logits, *weights, *gu, *out;
  bf16* gu16 = nullptr;  // the pre-activations in bf16 instead of gu, where the GEMM's epilogue makes the act
  // offsets [El + 1]: this rank's experts' row ranges in the permuted order (El = all E unless expert-parallel;
  // then the other ranks' choices come after them, from row *rows_held on)
  int32_t *experts, *slot_of, *offsets;
  const int32_t* rows_held = nullptr;
  const int32_t* token_of = nullptr;  // [n] each permuted row's token: xp's row i is the input's row token_of[i]
  bf16 *xp, *act;
  MlpActs shared;
};

// One training step's state: the model, the batch plan and the gradients.
class Step {
 public:
  Step(CudaModel::Impl& m, const Plan& p, Grads& g) : m_(m), p_(p), g_(g), c_(m.cfg) {}

  double run(const float* row_weight);

 private:
  int64_t T() const { return p_.T; }
  float* zeros(int64_t n) {
    float* x = m_.arena.alloc<float>(n);
    NEXTLM_CUDA_CHECK(cudaMemsetAsync(x, 0, std::max<int64_t>(n, 0) * sizeof(float), m_.stream));
    return x;
  }
  bf16* half(const float* x, int64_t n) {
    bf16* y = m_.arena.alloc<bf16>(n);
    to_bf16(x, y, n, m_.stream);
    return y;
  }
  // For y = x·Wᵀ (x bf16 [T, W.in], row stride ldx) given dy (bf16 [T, W.out]): dx += dy·W (when dx; = with
  // set_dx, which then need not be zeroed), and dW += dyᵀ·x (when dW).
  void linear_backward(const DLinear& W, const bf16* x, int64_t ldx, const bf16* dy, int64_t rows, float* dx,
                       float* dW, bool set_dx = false) {
    if (dW) m_.gemm->run_dw(dy, W.out, x, ldx, W.out, W.in, rows, dW, true);
    if (dx) m_.gemm->run_dx(dy, W.out, W.w, W.out, W.in, dx, W.in, rows, !set_dx);
  }

  // ---- LoRA (CudaModel::set_lora) ----
  // The adapter of kind k on layer i (expert e for the routed experts), or null.
  const DAdapter* adapter(size_t i, LoraKind k, int64_t e = 0) const {
    if (!m_.lora) return nullptr;
    const auto& v = m_.lora->layers[i].kinds[static_cast<int>(k)];
    if (v.empty()) return nullptr;
    return &v[v.size() == 1 ? 0 : e];
  }
  bf16* scaled_bf16(const float* x, float s, int64_t n) {
    bf16* y = m_.arena.alloc<bf16>(n);
    if (n > 0) {
      scale_to_bf16_kernel<<<static_cast<unsigned>(std::min<int64_t>(ceil_div(n, 256), 4096)), 256, 0, m_.stream>>>(
          x, s, y, n);
      NEXTLM_CUDA_CHECK(cudaGetLastError());
    }
    return y;
  }
  // The same into the columns of y [rows, ldy]: y[r, c] = bf16(s·x[r, c]) for x [rows, cols] (contiguous).
  void scaled_bf16_into(const float* x, float s, bf16* y, int64_t ldy, int64_t rows, int64_t cols) {
    if (rows * cols <= 0) return;
    scale_to_bf16_rows_kernel<<<static_cast<unsigned>(std::min<int64_t>(ceil_div(rows * cols, 256), 4096)), 256, 0,
                                m_.stream>>>(x, s, y, ldy, rows, cols);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  }
  // ---- Stacked adapters (lora_input_groups) ----
  // A site's dense adapters that read the same input rows, when they share rank, input width and scale and set_lora
  // laid their A and dA back to back (and the model is on one GPU): their u come from one GEMM on the stacked A
  // [n·r, in], side by side in one [rows, n·r] buffer; in the backward each member adds its dB and writes its dy·B
  // into its columns of the group's [rows, n·r] buffer, and flush_lora_groups (at the end of the site's sub-layer
  // backward) makes dA [n·r, in] += gsᵀ·x and dx += gs·A in one GEMM each, in place of one per adapter: a single
  // read-modify-write of the fp32 dx, and far fewer launches.
  struct LoraGroup {
    std::vector<const DAdapter*> ads;  // the members, in the group's order
    const bf16* x = nullptr;
    int64_t ldx = 0, rows = 0;
    float* g = nullptr;   // [rows, n·r] the members' dy·B (backward), once the first member's backward ran
    int done = 0;         // members whose backward ran
    float* dx = nullptr;  // their input gradient (the same for every member), or null
    int64_t ld() const { return static_cast<int64_t>(ads.size()) * ads[0]->r; }
  };
  LoraGroup* stacked(const DAdapter& ad) {
    const auto& mem = lora_member_[site_];
    const auto it = mem.find(&ad);
    return it == mem.end() ? nullptr : &lora_groups_[site_][it->second.first];
  }
  // Stacks the group of ad (on this site's layer) if it can: its members' u into lora_u_, the group into
  // lora_groups_. False when ad belongs to no group or the group does not stack.
  bool stack_group(const DAdapter& ad, const bf16* x, int64_t ldx, int64_t rows) {
    if (!m_.lora || m_.tp_comm || m_.ep_comm || !lora_stacking()) return false;
    const size_t i = site_ / 2;
    for (const std::vector<LoraKind>& kinds : lora_input_groups()) {
      std::vector<const DAdapter*> ads;
      bool mine = false;
      for (LoraKind k : kinds)
        if (const DAdapter* a = adapter(i, k)) {
          if (lora_kind_is_expert(k) || m_.lora->layers[i].kinds[static_cast<int>(k)].size() != 1) return false;
          ads.push_back(a);
          mine = mine || a == &ad;
        }
      if (!mine) continue;
      if (ads.size() < 2) return false;
      const DAdapter& a0 = *ads[0];
      for (size_t j = 0; j < ads.size(); ++j) {
        const DAdapter& a = *ads[j];
        const int64_t off = static_cast<int64_t>(j) * a0.r * a0.in;
        if (a.r != a0.r || a.in != a0.in || a.scale != a0.scale || a.A != a0.A + off || a.dA != a0.dA + off)
          return false;
      }
      const int64_t ld = static_cast<int64_t>(ads.size()) * a0.r;
      float* u = m_.arena.alloc<float>(rows * ld);
      m_.gemm->run(x, ldx, a0.A, ld, a0.in, u, ld, rows);
      bf16* us = scaled_bf16(u, a0.scale, rows * ld);
      const size_t gi = lora_groups_[site_].size();
      for (size_t j = 0; j < ads.size(); ++j) {
        lora_u_[site_][{ads[j], x}] = us + static_cast<int64_t>(j) * a0.r;
        lora_member_[site_][ads[j]] = {gi, static_cast<int64_t>(j)};
      }
      LoraGroup g;
      g.ads = std::move(ads), g.x = x, g.ldx = ldx, g.rows = rows;
      lora_groups_[site_].push_back(std::move(g));
      note_lora_stacked_group();
      return true;
    }
    return false;
  }
  // The stacked groups' dA and dx, once every member's backward ran (the end of the site's sub-layer backward).
  void flush_lora_groups() {
    for (LoraGroup& g : lora_groups_[site_]) {
      if (!g.g) continue;
      const int n = static_cast<int>(g.ads.size());
      check(g.done == n, "LoRA: ", n - g.done, " of ", n, " stacked adapters without their backward");
      const DAdapter& a0 = *g.ads[0];
      const int64_t ld = g.ld();
      bf16* gs = scaled_bf16(g.g, a0.scale, g.rows * ld);
      m_.gemm->run_dw(gs, ld, g.x, g.ldx, ld, a0.in, g.rows, a0.dA, true);
      if (g.dx) m_.gemm->run_dx(gs, ld, a0.A, ld, a0.in, g.dx, a0.in, g.rows, true);
      g.g = nullptr, g.done = 0, g.dx = nullptr;
    }
  }
  // ---- Joined narrow input gradients ----
  // A sub-layer's projections of one input a whose outputs are narrow beside the others' (the KDA's g_a, b and f_a;
  // the MLA's kv_a and q_a): their output gradients go, in bf16, into their columns of one [T, ld] buffer (each
  // piece's first column a multiple of 8, zeros between), and their input gradient is one GEMM over their stacked
  // weights [W_1; …; W_m] (copied on every call: they are small, and may train) — with the site's stacked LoRA group
  // on a after them (its s·dy·B and A: flush_lora_groups' dx for it) — in place of one GEMM each, every one after
  // the first reading and writing the fp32 da again. dy null: not joined (narrow_joining off).
  struct Narrow {
    std::vector<const DLinear*> W;
    std::vector<int64_t> col;  // each piece's first column in dy
    int64_t pieces = 0;        // the pieces' columns (padded to 8); a LoRA group's s·dy·B after them
    bf16* dy = nullptr;
    int64_t ld = 0;
    const bf16* x = nullptr;
    int64_t ldx = 0;
    float* dx = nullptr;
  };
  // Null when joining is off, or when a piece has an adapter outside a stacked group: such an adapter adds its own
  // dx as its backward runs, before the GEMM that writes dx (the pieces' join comes after it).
  Narrow narrow(size_t i, std::initializer_list<std::pair<const DLinear*, LoraKind>> pieces, const bf16* x,
                int64_t ldx, float* dx) {
    Narrow n;
    if (!narrow_joining() || !dx) return n;
    const int64_t in = pieces.begin()->first->in;
    int64_t used = 0;  // columns written
    for (const auto& [W, kind] : pieces) {
      const DAdapter* ad = adapter(i, kind);
      if (W->in != in || (ad && !stacked(*ad))) return Narrow{};
      n.W.push_back(W), n.col.push_back(n.pieces);
      n.pieces += ceil_div(W->out, int64_t{8}) * 8, used += W->out;
    }
    n.ld = n.pieces;
    for (const LoraGroup& g : lora_groups_[site_])
      if (g.x == x && g.ads[0]->in == in) n.ld += ceil_div(g.ld(), int64_t{8}) * 8, used += g.ld();
    n.dy = m_.arena.alloc<bf16>(T() * n.ld);
    if (used != n.ld)  // the columns between
      NEXTLM_CUDA_CHECK(cudaMemsetAsync(n.dy, 0, T() * n.ld * sizeof(bf16), m_.stream));
    n.x = x, n.ldx = ldx, n.dx = dx;
    return n;
  }
  // Piece p's output gradient g (fp32 [T, W.out]) into its columns, in bf16 (half's rounding); then, as
  // linear_backward without its dx GEMM, dW and its adapter's backward (a stacked group's member: its s·dy·B goes to
  // the group, whose dx flush_narrow or flush_lora_groups makes).
  void narrow_backward(size_t i, std::initializer_list<LoraKind> kinds, Narrow& n, int p, const float* g, float* dW) {
    const DLinear& W = *n.W[p];
    bf16* dy = n.dy + n.col[p];
    scaled_bf16_into(g, 1.0f, dy, n.ld, T(), W.out);
    if (dW) m_.gemm->run_dw(dy, n.ld, n.x, n.ldx, W.out, W.in, T(), dW, true);
    for (LoraKind k : kinds)
      if (const DAdapter* ad = adapter(i, k)) lora_backward(*ad, n.x, n.ldx, dy, n.ld, T(), n.dx);
  }
  // dx (+)= [dy_1 | … | dy_m | s·dy·B]·[W_1; …; W_m; A], the group's dA from its columns (flush_lora_groups' work,
  // whose dx for the group is then this GEMM's share); without a group whose every member ran its backward onto
  // this dx, the pieces alone (the group flushes as before).
  void flush_narrow(Narrow& n, bool set_dx) {
    const int64_t T = this->T(), in = n.W[0]->in;
    LoraGroup* grp = nullptr;
    for (LoraGroup& g : lora_groups_[site_])
      if (g.g && g.x == n.x && g.dx == n.dx && g.rows == T && g.done == static_cast<int>(g.ads.size()) &&
          n.pieces + ceil_div(g.ld(), int64_t{8}) * 8 == n.ld)
        grp = &g;
    const int64_t K = grp ? n.ld : n.pieces;
    bf16* wj = m_.arena.alloc<bf16>(K * in);
    int64_t used = grp ? grp->ld() : 0;  // rows copied
    for (const DLinear* W : n.W) used += W->out;
    if (used != K) NEXTLM_CUDA_CHECK(cudaMemsetAsync(wj, 0, K * in * sizeof(bf16), m_.stream));  // the rows between
    for (size_t p = 0; p < n.W.size(); ++p)
      NEXTLM_CUDA_CHECK(cudaMemcpyAsync(wj + n.col[p] * in, n.W[p]->w, n.W[p]->out * in * sizeof(bf16),
                                        cudaMemcpyDeviceToDevice, m_.stream));
    if (grp) {
      const DAdapter& a0 = *grp->ads[0];
      const int64_t r = grp->ld();
      bf16* gs = n.dy + n.pieces;
      scaled_bf16_into(grp->g, a0.scale, gs, n.ld, T, r);
      m_.gemm->run_dw(gs, n.ld, grp->x, grp->ldx, r, a0.in, T, a0.dA, true);
      NEXTLM_CUDA_CHECK(cudaMemcpyAsync(wj + n.pieces * in, a0.A, r * in * sizeof(bf16), cudaMemcpyDeviceToDevice,
                                        m_.stream));
      grp->g = nullptr, grp->done = 0, grp->dx = nullptr;  // flushed
    }
    m_.gemm->run_dx(n.dy, n.ld, wj, K, in, n.dx, in, T, !set_dx);
    note_narrow_joined_gradient();
  }
  void clear_lora_site() {
    lora_u_[site_].clear();
    lora_groups_[site_].clear();
    lora_member_[site_].clear();
  }

  // y[:, col0 : col0 + out] (row stride ldy) += s·(x·Aᵀ)·Bᵀ for `rows` rows of x (row stride ldx), or = with
  // accumulate false; keeps u = s·x·Aᵀ (bf16) for the backward. With factors_only_ only u (y unused).
  void lora_forward(const DAdapter& ad, const bf16* x, int64_t ldx, int64_t rows, float* y, int64_t ldy,
                    bool accumulate = true) {
    bf16* us = nullptr;
    int64_t ldu = ad.r;
    if (const LoraGroup* g = stacked(ad); g || stack_group(ad, x, ldx, rows)) {
      g = stacked(ad);
      check(g->x == x && g->rows == rows, "stacked LoRA adapters on different inputs");
      us = lora_u_[site_].at({&ad, x}), ldu = g->ld();
    } else {
      float* u = m_.arena.alloc<float>(rows * ad.r);
      m_.gemm->run(x, ldx, ad.A, ad.r, ad.in, u, ad.r, rows);
      us = scaled_bf16(u, ad.scale, rows * ad.r);
      lora_u_[site_][{&ad, x}] = us;
    }
    if (!factors_only_) m_.gemm->run(us, ldu, ad.B, ad.out, ad.r, y + ad.col0, ldy, rows, accumulate);
  }
  // Its backward given dy (bf16, row stride lddy, the adapted rows at col0): dB += dyᵀ·u, dA += s·(dy·B)ᵀ·x and
  // dx (row stride in) += s·(dy·B)·A.
  void lora_backward(const DAdapter& ad, const bf16* x, int64_t ldx, const bf16* dy, int64_t lddy, int64_t rows,
                     float* dx) {
    const auto& site_u = lora_u_[site_];
    const auto it = site_u.find({&ad, x});
    check(it != site_u.end(), "LoRA backward without its forward");
    if (LoraGroup* sg = stacked(ad)) {
      // dB here; dy·B into the member's columns of the group's gs, whose dA and dx flush_lora_groups makes.
      check(sg->x == x && sg->rows == rows && (sg->done == 0 || sg->dx == dx),
            "stacked LoRA adapters with different inputs or input gradients");
      const int64_t ld = sg->ld(), j = lora_member_[site_].at(&ad).second;
      m_.gemm->run_dw(dy + ad.col0, lddy, it->second, ld, ad.out, ad.r, rows, ad.dB, true);
      if (!sg->g) sg->g = m_.arena.alloc<float>(rows * ld);
      m_.gemm->run_dx(dy + ad.col0, lddy, ad.B, ad.out, ad.r, sg->g + j * ad.r, ld, rows, false);
      sg->dx = dx;
      ++sg->done;
      return;
    }
    m_.gemm->run_dw(dy + ad.col0, lddy, it->second, ad.r, ad.out, ad.r, rows, ad.dB, true);
    float* g = m_.arena.alloc<float>(rows * ad.r);
    m_.gemm->run_dx(dy + ad.col0, lddy, ad.B, ad.out, ad.r, g, ad.r, rows, false);
    bf16* gs = scaled_bf16(g, ad.scale, rows * ad.r);
    m_.gemm->run_dw(gs, ad.r, x, ldx, ad.r, ad.in, rows, ad.dA, true);
    if (dx) m_.gemm->run_dx(gs, ad.r, ad.A, ad.r, ad.in, dx, ad.in, rows, true);
  }
  void copy_cols(bf16* dst, int64_t ldd, const bf16* src, int64_t lds, int64_t rows, int64_t cols) {
    if (rows <= 0 || cols <= 0) return;
    const bool vec = cols % 8 == 0 && ldd % 8 == 0 && lds % 8 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(src) % 16 == 0;
    const int64_t n = rows * (vec ? cols / 8 : cols);
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(ceil_div(n, 256), 8192));
    if (vec) copy_cols_kernel<true><<<grid, 256, 0, m_.stream>>>(dst, ldd, src, lds, rows, cols);
    else copy_cols_kernel<false><<<grid, 256, 0, m_.stream>>>(dst, ldd, src, lds, rows, cols);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  }
  // A projection of layer i whose adapters (of `kinds`) tile its outputs, y = x·Wᵀ + Σ s·(x·Aᵀ)·Bᵀ, as one GEMM over
  // the joined contraction [x | u]·[W | B]ᵀ, u = s·x·Aᵀ in bf16 (the u the adapters' backward reads): one write of
  // y, in fp32 (y) or bf16 (y16), in place of the adapters' products written first and the projection's GEMM adding
  // onto them (a write and a read of the fp32 output more). Several adapters join where they are members of one
  // stacked group (their u side by side): u is the group's, and each adapter's B sits in its rows at its member's
  // columns (zeros elsewhere: the other members' u, or members on other projections, add nothing).
  // It joins where the fp32 output it saves (written and read, 8 bytes an element) outweighs the copy of x (read
  // and written, 4 bytes an element): 2·out > in. The joined weights of a frozen base are kept (LoraState::joined,
  // up to kJoinCacheBytes; W copied once, B on every call: it trains); with a trained base they are copied on every
  // call, and only for inputs up to kJoinMaxIn wide, where that copy costs a small part of what joining saves.
  // False (nothing done) where this does not apply.
  static constexpr int64_t kJoinMaxIn = 2048;
  static constexpr size_t kJoinCacheBytes = size_t{4} << 30;
  bool joined_forward(size_t i, std::initializer_list<LoraKind> kinds, const DLinear& W, const bf16* x, int64_t ldx,
                      float* y, bf16* y16) {
    const bool keep = !m_.train_linears;
    if (!lora_joining() || !m_.lora || 2 * W.out <= W.in || W.in % 8 != 0 || (!keep && W.in > kJoinMaxIn))
      return false;
    std::vector<const DAdapter*> ads;
    for (LoraKind k : kinds) {
      if (m_.lora->layers[i].kinds[static_cast<int>(k)].size() > 1) return false;
      if (const DAdapter* ad = adapter(i, k)) {
        if (ad->in != W.in || (!ads.empty() && ad->r != ads[0]->r)) return false;
        ads.push_back(ad);
      }
    }
    if (!adapters_tile(ads, W.out)) return false;
    const int64_t T = this->T(), r = ads[0]->r;
    factors_only_ = true;
    for (const DAdapter* ad : ads) lora_forward(*ad, x, ldx, T, nullptr, W.out);  // u, kept for the backward
    factors_only_ = false;
    // The joined u: the group's [T, n·r] (ads its members), or the one adapter's [T, r].
    const LoraGroup* g = stacked(*ads[0]);
    for (const DAdapter* ad : ads)
      if (stacked(*ad) != g) return false;
    if (!g && ads.size() > 1) return false;
    // u's columns padded to a multiple of 8 (zeros in x and W there), for 16-byte rows.
    const int64_t Ku = g ? g->ld() : r, Kp = ceil_div(Ku, int64_t{8}) * 8, K = W.in + Kp;
    const bf16* u = lora_u_[site_].at({g ? g->ads[0] : ads[0], x});
    auto member = [&](const DAdapter* ad) { return g ? lora_member_[site_].at(ad).second : int64_t{0}; };
    LoraState& ls = *m_.lora;
    bf16* wj = nullptr;
    std::vector<int64_t> layout;
    for (const DAdapter* ad : ads) layout.insert(layout.end(), {ad->col0, ad->out, member(ad) * r, r});
    bool zeroed = false;  // the u columns hold zeros outside this layout's B blocks already
    if (keep) {
      auto it = ls.joined.find(W.w);
      if (it != ls.joined.end() && it->second.K != K) {
        cudaFree(it->second.w);  // (a stream-ordered use of it ran before: cudaFree waits for the device)
        ls.joined_bytes -= static_cast<size_t>(W.out * it->second.K) * sizeof(bf16);
        ls.joined.erase(it);
        it = ls.joined.end();
      }
      if (it == ls.joined.end()) {
        const size_t bytes = static_cast<size_t>(W.out * K) * sizeof(bf16);
        if (ls.joined_bytes + bytes > kJoinCacheBytes) return false;
        bf16* w = nullptr;
        if (cudaMalloc(&w, bytes) != cudaSuccess) {  // a full card: the additive path, which needs no copy
          (void)cudaGetLastError();
          return false;
        }
        copy_cols(w, K, W.w, W.in, W.out, W.in);
        it = ls.joined.emplace(W.w, LoraState::Joined{w, K}).first;
        ls.joined_bytes += bytes;
      }
      wj = it->second.w;
      zeroed = it->second.layout == layout;
      it->second.layout = layout;
    } else {
      wj = m_.arena.alloc<bf16>(W.out * K);
      copy_cols(wj, K, W.w, W.in, W.out, W.in);
    }
    // u's columns: zeros, then each adapter's B in its rows (a kept copy may hold another layout's B there, as when
    // the same projection ran before with its adapters not stacked; with the same layout only the B blocks change).
    if (!zeroed)
      NEXTLM_CUDA_CHECK(cudaMemset2DAsync(wj + W.in, K * sizeof(bf16), 0, Kp * sizeof(bf16), W.out, m_.stream));
    for (const DAdapter* ad : ads) copy_cols(wj + ad->col0 * K + W.in + member(ad) * r, K, ad->B, r, ad->out, r);
    bf16* xj = m_.arena.alloc<bf16>(T * K);
    copy_cols(xj, K, x, ldx, T, W.in);
    copy_cols(xj + W.in, K, u, Ku, T, Ku);
    if (Kp != Ku)
      NEXTLM_CUDA_CHECK(
          cudaMemset2DAsync(xj + W.in + Ku, K * sizeof(bf16), 0, (Kp - Ku) * sizeof(bf16), T, m_.stream));
    if (y16) m_.gemm->run_bf16(xj, K, wj, W.out, K, y16, W.out, T);
    else m_.gemm->run(xj, K, wj, W.out, K, y, W.out, T);
    note_lora_joined_projection();
    return true;
  }
  // A projection of layer i with the adapters of `kinds` on its rows: y (fp32, row stride W.out) (+)= x·Wᵀ + ….
  // When the adapters' columns tile y's (disjoint, covering all), their rank-r products write y first and the
  // projection's GEMM adds onto it in its epilogue (the same single rounding of the two sums), in place of the
  // adapters' read-modify-write of fp32 y afterwards. cuBLASLt's epilogue does not hide its read of y behind the
  // multiply-adds (LoRA step: the adapters' passes 2.68 → 1.03 ms, the projections +1.07 ms), so this saves the
  // adapters' read of y and little more.
  void linear_forward(size_t i, std::initializer_list<LoraKind> kinds, const DLinear& W, const bf16* x, int64_t ldx,
                      float* y, bool accumulate = false) {
    if (!accumulate && joined_forward(i, kinds, W, x, ldx, y, nullptr)) return;
    std::vector<const DAdapter*> ads;
    for (LoraKind k : kinds)
      if (const DAdapter* ad = adapter(i, k)) ads.push_back(ad);
    if (!accumulate && adapters_tile(ads, W.out)) {
      for (const DAdapter* ad : ads) lora_forward(*ad, x, ldx, T(), y, W.out, false);
      m_.gemm->run(x, ldx, W.w, W.out, W.in, y, W.out, T(), true);
      return;
    }
    m_.gemm->run(x, ldx, W.w, W.out, W.in, y, W.out, T(), accumulate);
    for (const DAdapter* ad : ads) lora_forward(*ad, x, ldx, T(), y, W.out);
  }
  // A sub-layer's output projection: y = x·Wᵀ with its adapters, or in a recomputation (recompute_: the site kept
  // its output from the forward) the adapters' u alone, which their backward reads.
  void output_forward(size_t i, std::initializer_list<LoraKind> kinds, const DLinear& W, const bf16* x, int64_t ldx,
                      float* y) {
    if (!recompute_) return linear_forward(i, kinds, W, x, ldx, y);
    factors_only_ = true;
    for (LoraKind k : kinds)
      if (const DAdapter* ad = adapter(i, k)) lora_forward(*ad, x, ldx, T(), nullptr, W.out);
    factors_only_ = false;
  }
  // Whether the column ranges [col0, col0 + out) of `ads` are disjoint and cover [0, width) (none: false).
  static bool adapters_tile(std::vector<const DAdapter*> ads, int64_t width) {
    if (ads.empty()) return false;
    std::sort(ads.begin(), ads.end(), [](const DAdapter* a, const DAdapter* b) { return a->col0 < b->col0; });
    int64_t next = 0;
    for (const DAdapter* ad : ads) {
      if (ad->col0 != next) return false;
      next += ad->out;
    }
    return next == width;
  }
  // The input gradient of a frozen projection with one adapter on all its rows, dx (+)= dy·W + s·(dy·B)·A, as one
  // GEMM over the joined contraction [dy | gs]·[W ; A] (gs = s·dy·B in bf16, the one dA is formed from): one write of
  // dx in place of the adapter's read-modify-write of the fp32 dx after the projection's GEMM. It joins where the dx
  // it saves (written and read, 8 bytes an element of [rows, in]) outweighs the copy of dy (read and written, 4 bytes
  // an element of [rows, out]): out < 2·in, the sub-layers' output projections (the KDA's and MLA's o, the dense
  // MLP's down). [W ; A] is kept (LoraState::joined_dx): W's rows copied once, A's on every call (it trains); the
  // adapter's dB and dA are lora_backward's. False (nothing done) where this does not apply.
  bool joined_backward(size_t i, std::initializer_list<LoraKind> kinds, const DLinear& W, const bf16* x, int64_t ldx,
                       const bf16* dy, float* dx, float* dW, bool set_dx) {
    if (!lora_joining() || !m_.lora || m_.train_linears || dW || !dx || kinds.size() != 1 || W.out >= 2 * W.in ||
        W.out % 8 != 0)
      return false;
    const auto& v = m_.lora->layers[i].kinds[static_cast<int>(*kinds.begin())];
    if (v.size() != 1) return false;
    const DAdapter& ad = v[0];
    const auto u = lora_u_[site_].find({&ad, x});
    if (ad.col0 != 0 || ad.out != W.out || ad.in != W.in || stacked(ad) || u == lora_u_[site_].end()) return false;
    const int64_t T = this->T(), r = ad.r, K = W.out + ceil_div(r, int64_t{8}) * 8;  // A's rows padded to 8
    LoraState& ls = *m_.lora;
    auto it = ls.joined_dx.find(W.w);
    if (it != ls.joined_dx.end() && it->second.K != K) {
      cudaFree(it->second.w);  // (a stream-ordered use of it ran before: cudaFree waits for the device)
      ls.joined_bytes -= static_cast<size_t>(it->second.K * W.in) * sizeof(bf16);
      ls.joined_dx.erase(it);
      it = ls.joined_dx.end();
    }
    if (it == ls.joined_dx.end()) {
      const size_t bytes = static_cast<size_t>(K * W.in) * sizeof(bf16);
      if (ls.joined_bytes + bytes > kJoinCacheBytes) return false;
      bf16* w = nullptr;
      if (cudaMalloc(&w, bytes) != cudaSuccess) {  // a full card: the additive path, which needs no copy
        (void)cudaGetLastError();
        return false;
      }
      NEXTLM_CUDA_CHECK(cudaMemcpyAsync(w, W.w, W.out * W.in * sizeof(bf16), cudaMemcpyDeviceToDevice, m_.stream));
      NEXTLM_CUDA_CHECK(cudaMemsetAsync(w + (W.out + r) * W.in, 0, (K - W.out - r) * W.in * sizeof(bf16), m_.stream));
      it = ls.joined_dx.emplace(W.w, LoraState::Joined{w, K, {}}).first;
      ls.joined_bytes += bytes;
    }
    bf16* wj = it->second.w;
    NEXTLM_CUDA_CHECK(
        cudaMemcpyAsync(wj + W.out * W.in, ad.A, r * W.in * sizeof(bf16), cudaMemcpyDeviceToDevice, m_.stream));
    // [dy | gs | 0]: dy's columns, the adapter's dB and gs = s·dy·B (as lora_backward forms them) after them.
    bf16* dyj = m_.arena.alloc<bf16>(T * K);
    copy_cols(dyj, K, dy, W.out, T, W.out);
    if (K != W.out + r)
      NEXTLM_CUDA_CHECK(
          cudaMemset2DAsync(dyj + W.out + r, K * sizeof(bf16), 0, (K - W.out - r) * sizeof(bf16), T, m_.stream));
    m_.gemm->run_dw(dy, W.out, u->second, r, ad.out, r, T, ad.dB, true);
    float* g = m_.arena.alloc<float>(T * r);
    m_.gemm->run_dx(dy, W.out, ad.B, ad.out, r, g, r, T, false);
    scaled_bf16_into(g, ad.scale, dyj + W.out, K, T, r);
    m_.gemm->run_dw(dyj + W.out, K, x, ldx, r, ad.in, T, ad.dA, true);
    m_.gemm->run_dx(dyj, K, wj, K, W.in, dx, W.in, T, !set_dx);
    note_lora_joined_input_gradient();
    return true;
  }
  void linear_backward(size_t i, std::initializer_list<LoraKind> kinds, const DLinear& W, const bf16* x, int64_t ldx,
                       const bf16* dy, float* dx, float* dW, bool set_dx = false) {
    if (joined_backward(i, kinds, W, x, ldx, dy, dx, dW, set_dx)) return;
    linear_backward(W, x, ldx, dy, T(), dx, dW, set_dx);
    for (LoraKind k : kinds)
      if (const DAdapter* ad = adapter(i, k)) lora_backward(*ad, x, ldx, dy, W.out, T(), dx);
  }
  // The routed experts' adapters of `kinds` (gate and up on gu [n, 2I], or down on out [n, D]): one for all the
  // permuted rows at once, each expert's on its rows grouped in one launch (grouped_lora.h), or, for shapes the
  // grouped kernels do not take, one expert at a time after a host sync of the boundaries.
  bool has_adapters(size_t i, std::initializer_list<LoraKind> kinds) const {
    if (!m_.lora) return false;
    for (LoraKind k : kinds)
      if (!m_.lora->layers[i].kinds[static_cast<int>(k)].empty()) return true;
    return false;
  }
  // Whether every per-expert adapter of `kinds` on layer i runs grouped (all experts in one launch, no host sync).
  bool grouped_adapters(size_t i, std::initializer_list<LoraKind> kinds) const {
    return m_.lora->layers[i].runs_grouped(kinds);
  }
  GroupedLora grouped_lora(size_t i, LoraKind k, const int32_t* offsets) const {
    const DAdapter& a = m_.lora->layers[i].kinds[static_cast<int>(k)][0];
    const LayerLora::Grouped& g = m_.lora->layers[i].grouped[static_cast<int>(k)];
    return GroupedLora{offsets, static_cast<int>(m_.local_experts), static_cast<int>(a.r), static_cast<int>(a.in),
                       static_cast<int>(a.out), g.A, g.B, a.scale};
  }
  // The input of layer i's grouped expert adapters of `kinds`: the down's act, or for the gate and up the MoE's input
  // a through each row's token (rows: GroupedLora::x_rows; a is 1/k of xp's bytes and stays in L2), where the
  // sub-layer's input is at hand (moe_a_); else xp. key: the rows' identity for lora_u_ (act or xp, either way).
  struct ExpertInput {
    const bf16* x;
    int64_t ld;
    const int32_t* rows;
    const bf16* key;
  };
  ExpertInput expert_input(const MoeActs& x, bool down) const {
    const int64_t D = c_.hidden_size, I = c_.moe_intermediate_size;
    if (down) return {x.act, I, nullptr, x.act};
    if (moe_a_ && x.token_of) return {moe_a_, D, x.token_of, x.xp};
    return {x.xp, D, nullptr, x.xp};
  }
  GroupedLora grouped_lora(size_t i, LoraKind k, const ExpertInput& in, const int32_t* offsets) const {
    GroupedLora g = grouped_lora(i, k, offsets);
    g.x_rows = in.rows;
    return g;
  }
  void expert_adapters_forward(size_t i, MoeActs& x, std::initializer_list<LoraKind> kinds) {
    if (!has_adapters(i, kinds)) return;
    const int64_t D = c_.hidden_size, I = c_.moe_intermediate_size, n = T() * c_.num_experts_per_tok;
    const bool down = *kinds.begin() == LoraKind::ExpertDown;
    const bf16* in = down ? x.act : x.xp;
    const int64_t ld_in = down ? I : D, ld_out = down ? D : 2 * I;
    float* out = factors_only_ ? nullptr : down ? x.out : x.gu;
    if (m_.lora->layers[i].shared_experts) {
      // On the rows of the experts held here: all n unless expert-parallel (then those before the other ranks').
      const int64_t rows = m_.local_experts == c_.n_routed_experts ? n : host_offsets(x.offsets)[m_.local_experts];
      for (LoraKind k : kinds)
        if (const DAdapter* ad = adapter(i, k)) lora_forward(*ad, in, ld_in, rows, out, ld_out);
      return;
    }
    if (grouped_adapters(i, kinds)) {
      const ExpertInput gin = expert_input(x, down);
      for (LoraKind k : kinds) {
        const DAdapter* ad = adapter(i, k);
        if (!ad) continue;
        bf16* u = m_.arena.alloc<bf16>(n * grouped_lora_ld(static_cast<int>(ad->r)));
        const GroupedLora g = grouped_lora(i, k, gin, x.offsets);
        if (factors_only_)
          grouped_lora_factor(g, gin.x, gin.ld, n, u, m_.stream);
        else
          grouped_lora_forward(g, gin.x, gin.ld, n, u, out, ld_out, ad->col0, m_.stream);
        lora_u_[site_][{ad, gin.key}] = u;
      }
      return;
    }
    const std::vector<int32_t> off = host_offsets(x.offsets);
    for (int64_t e = 0; e < m_.local_experts; ++e) {
      const int64_t r0 = off[e], rows = off[e + 1] - r0;
      if (!rows) continue;
      for (LoraKind k : kinds)
        if (const DAdapter* ad = adapter(i, k, e))
          lora_forward(*ad, in + r0 * ld_in, ld_in, rows, out ? out + r0 * ld_out : nullptr, ld_out);
    }
  }
  // The unfolded gate and up adapters' u alone, where a recomputation reuses the kept pre-activations (folded ones
  // made theirs in expert_adapters_factor).
  void gate_up_factors(size_t i, MoeActs& x) {
    factors_only_ = true;
    expert_adapters_forward(i, x, {LoraKind::ExpertGate, LoraKind::ExpertUp});
    factors_only_ = false;
  }
  // The down projection's unfolded adapters: added to x.out, or in a recomputation their u alone.
  void down_adapters_forward(size_t i, MoeActs& x) {
    factors_only_ = recompute_;
    expert_adapters_forward(i, x, {LoraKind::ExpertDown});
    factors_only_ = false;
  }
  // Whether the per-expert adapters of `kinds` on layer i can ride in the grouped GEMM of their projection
  // (GroupedGemm::low_rank): grouped adapters, a wgmma kernel, and ranks that fit its one extra k-tile.
  // backward: for the input-gradient GEMMs (set_expert_lora_fold decides which folds run).
  bool fold_adapters(size_t i, std::initializer_list<LoraKind> kinds, bool backward = false) const {
    const bool tiles = m_.layers[i].moe.layout == GroupedWeightLayout::kTiles;
    const int kernel = moe_expert_gemm() < 0 ? -1 : backward ? moe_expert_gemm_dx(tiles) : moe_expert_gemm();
    if (expert_lora_fold() < (backward ? 2 : 1) || !has_adapters(i, kinds) || !grouped_adapters(i, kinds) ||
        kernel < 0 || !grouped_gemm_is_wgmma(static_cast<GroupedGemmKernel>(kernel)))
      return false;
    int parts = 0;
    for (LoraKind k : kinds) parts += adapter(i, k) != nullptr;
    for (LoraKind k : kinds)
      if (const DAdapter* ad = adapter(i, k); ad && (ad->r % 8 != 0 || ad->r > 64 / parts)) return false;
    return true;
  }
  // Whether layer i's grouped adapters of `kinds` are a pair ({gate, up}, both present) that the one-pass forms take
  // (grouped_lora_pairable): their sums over the shared input x then read it once.
  bool paired(size_t i, std::initializer_list<LoraKind> kinds, const int32_t* offsets) const {
    if (kinds.size() != 2 || !adapter(i, kinds.begin()[0]) || !adapter(i, kinds.begin()[1])) return false;
    return grouped_lora_pairable(grouped_lora(i, kinds.begin()[0], offsets),
                                 grouped_lora(i, kinds.begin()[1], offsets));
  }
  // Forward of folded adapters: each one's u = bf16(scale · in·A_eᵀ) (kept for the backward), and the low-rank
  // parts (u, B_e) that the projection's grouped GEMM adds to its output columns.
  GroupedLowRank expert_adapters_factor(size_t i, MoeActs& x, std::initializer_list<LoraKind> kinds) {
    const int64_t n = T() * c_.num_experts_per_tok;
    const ExpertInput in = expert_input(x, *kinds.begin() == LoraKind::ExpertDown);
    std::array<bf16*, 2> u{};  // by position in kinds
    int j = 0;
    for (LoraKind k : kinds) {
      if (const DAdapter* ad = adapter(i, k)) u[j] = m_.arena.alloc<bf16>(n * grouped_lora_ld(static_cast<int>(ad->r)));
      ++j;
    }
    if (paired(i, kinds, x.offsets)) {
      grouped_lora_factor2(grouped_lora(i, kinds.begin()[0], in, x.offsets),
                           grouped_lora(i, kinds.begin()[1], in, x.offsets), in.x, in.ld, n, u[0], u[1], m_.stream);
    } else {
      j = 0;
      for (LoraKind k : kinds) {
        if (u[j]) grouped_lora_factor(grouped_lora(i, k, in, x.offsets), in.x, in.ld, n, u[j], m_.stream);
        ++j;
      }
    }
    GroupedLowRank lr;
    j = 0;
    for (LoraKind k : kinds) {
      const DAdapter* ad = adapter(i, k);
      bf16* uj = u[j++];
      if (!ad) continue;
      lora_u_[site_][{ad, in.key}] = uj;
      const int p = lr.parts++;
      lr.U[p] = uj, lr.ldu[p] = grouped_lora_ld(static_cast<int>(ad->r)), lr.r[p] = static_cast<int>(ad->r);
      lr.V[p] = m_.lora->layers[i].grouped[static_cast<int>(k)].B;
      lr.c0[p] = static_cast<int>(ad->col0), lr.width[p] = static_cast<int>(ad->out);
    }
    return lr;
  }
  // The grouped adapters' backward on layer i (grouped_lora_backward each, or grouped_lora_backward2 for a pair):
  // their weight gradients (overwritten when zero_grads left them unwritten: LoraState::overwritten), and dx += gs·A_e
  // when dx is given. Returns each kind's gs (null for a kind without one).
  std::array<bf16*, 2> grouped_adapters_backward(size_t i, const MoeActs& x, std::initializer_list<LoraKind> kinds,
                                                 const bf16* dy, float* dx) {
    const int64_t D = c_.hidden_size, I = c_.moe_intermediate_size, n = T() * c_.num_experts_per_tok;
    const bool down = *kinds.begin() == LoraKind::ExpertDown;
    const ExpertInput in = expert_input(x, down);
    const int64_t ld_in = down ? I : D, ld_out = down ? D : 2 * I;  // of dx and dy
    std::array<bf16*, 2> gs{};
    std::array<const bf16*, 2> u{};
    int j = 0;
    for (LoraKind k : kinds) {
      if (const DAdapter* ad = adapter(i, k)) {
        const auto& site_u = lora_u_[site_];
        const auto it = site_u.find({ad, in.key});
        check(it != site_u.end(), "LoRA backward without its forward");
        u[j] = it->second;
        gs[j] = m_.arena.alloc<bf16>(n * grouped_lora_ld(static_cast<int>(ad->r)));
      }
      ++j;
    }
    const auto& grouped = m_.lora->layers[i].grouped;
    if (paired(i, kinds, x.offsets)) {
      const LoraKind k0 = kinds.begin()[0], k1 = kinds.begin()[1];
      const LayerLora::Grouped &g0 = grouped[static_cast<int>(k0)], &g1 = grouped[static_cast<int>(k1)];
      grouped_lora_backward2(grouped_lora(i, k0, in, x.offsets), grouped_lora(i, k1, in, x.offsets), g0.dA, g0.dB,
                             g1.dA, g1.dB, in.x, in.ld, u[0], u[1], dy, ld_out, n, gs[0], gs[1], dx, ld_in,
                             adapter(i, k0)->col0, adapter(i, k1)->col0, m_.stream, m_.lora->unwritten);
      return gs;
    }
    j = 0;
    for (LoraKind k : kinds) {
      if (gs[j]) {
        const LayerLora::Grouped& g = grouped[static_cast<int>(k)];
        grouped_lora_backward(grouped_lora(i, k, in, x.offsets), g.dA, g.dB, in.x, in.ld, u[j], dy, ld_out, n, gs[j],
                              dx, ld_in, adapter(i, k)->col0, m_.stream, m_.lora->unwritten);
      }
      ++j;
    }
    return gs;
  }
  // Backward of folded adapters: their weight gradients, and the low-rank parts (gs = bf16(scale · dy·B_e), A_e)
  // that the input-gradient grouped GEMM adds (dx += gs·A_e).
  GroupedLowRank expert_adapters_backward_factor(size_t i, const MoeActs& x, std::initializer_list<LoraKind> kinds,
                                                 const bf16* dy) {
    const std::array<bf16*, 2> gs = grouped_adapters_backward(i, x, kinds, dy, nullptr);
    GroupedLowRank lr;
    int j = 0;
    for (LoraKind k : kinds) {
      const DAdapter* ad = adapter(i, k);
      bf16* gj = gs[j++];
      if (!ad) continue;
      const int p = lr.parts++;
      lr.U[p] = gj, lr.ldu[p] = grouped_lora_ld(static_cast<int>(ad->r)), lr.r[p] = static_cast<int>(ad->r);
      lr.V[p] = m_.lora->layers[i].grouped[static_cast<int>(k)].A;
    }
    return lr;
  }
  // Their backward: dy the gradient of their output rows (bf16 dgu [n, 2I] or dout [n, D]), dx (+=) that of their
  // input rows (dxp [n, D] or dact [n, I]); off the host's expert boundaries (empty when all n rows are this rank's
  // and the adapter is shared by the experts).
  void expert_adapters_backward(size_t i, const MoeActs& x, const std::vector<int32_t>& off,
                                std::initializer_list<LoraKind> kinds, const bf16* dy, float* dx) {
    if (!has_adapters(i, kinds)) return;
    const int64_t D = c_.hidden_size, I = c_.moe_intermediate_size;
    const bool down = *kinds.begin() == LoraKind::ExpertDown;
    const bf16* in = down ? x.act : x.xp;
    const int64_t ld_in = down ? I : D, ld_out = down ? D : 2 * I;
    if (m_.lora->layers[i].shared_experts) {
      // off is empty when every row is this rank's (no expert parallelism, nothing per expert).
      const int64_t rows = off.empty() ? T() * c_.num_experts_per_tok : off[m_.local_experts];
      for (LoraKind k : kinds)
        if (const DAdapter* ad = adapter(i, k)) lora_backward(*ad, in, ld_in, dy, ld_out, rows, dx);
      return;
    }
    if (grouped_adapters(i, kinds)) {
      grouped_adapters_backward(i, x, kinds, dy, dx);
      return;
    }
    for (int64_t e = 0; e < m_.local_experts; ++e) {
      const int64_t r0 = off[e], rows = off[e + 1] - r0;
      if (!rows) continue;
      for (LoraKind k : kinds)
        if (const DAdapter* ad = adapter(i, k, e))
          lora_backward(*ad, in + r0 * ld_in, ld_in, dy + r0 * ld_out, ld_out, rows, dx + r0 * ld_in);
    }
  }

  // This rank's expert boundaries [El + 1] on the host (synchronises the stream).
  std::vector<int32_t> host_offsets(const int32_t* offsets) {
    std::vector<int32_t> off(m_.local_experts + 1);
    NEXTLM_CUDA_CHECK(
        cudaMemcpyAsync(off.data(), offsets, off.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, m_.stream));
    NEXTLM_CUDA_CHECK(cudaStreamSynchronize(m_.stream));
    return off;
  }

  void kda_forward(size_t i, const DKda& w, const bf16* a, KdaActs& x, float* y);
  void kda_backward(size_t i, const DKda& w, GKda& gw, const bf16* a, const KdaActs& x, const bf16* dy, float* da);
  void dsa_forward(size_t i, const DDsa& w, const bf16* a, const int32_t* sel, const int32_t* count, DsaActs& x,
                   float* y);
  void dsa_backward(size_t i, const DDsa& w, GDsa& gw, const bf16* a, const int32_t* sel, const int32_t* count,
                    const DsaActs& x, const bf16* dy, float* da);
  // A dense MLP, or (shared) the shared expert of a MoE layer: their LoRA kinds differ.
  void mlp_forward(size_t i, bool shared, const DMlp& w, const bf16* a, MlpActs& x, float* y);
  void mlp_backward(size_t i, bool shared, const DMlp& w, GMlp& gw, const bf16* a, const MlpActs& x,
                    const bf16* dy16, float* da);
  // Whether independent work of a sub-layer runs on the side stream (CudaModel::set_train_overlap; on one GPU: a
  // sharded step's collectives stay on one stream): a MoE's shared expert beside its routing and routed experts, a
  // DSA layer's indexer beside its projections, a KDA layer's output gate beside its recurrence (forward and
  // backward).
  bool beside() const { return m_.train_overlap && !m_.tp_comm && !m_.ep_comm; }
  void moe_forward(size_t i, const DMoe& w, const bf16* a, MoeActs& x, float* y);
  void moe_backward(size_t i, const DMoe& w, GMoe& gw, const bf16* a, const MoeActs& x, const float* dy,
                    const bf16* dy16, float* da);
  void head_backward(const float* h, const float* row_weight, float* dh, double* loss_rows);

  // Selection buffers: each full-indexer DSA layer's own, which it and the layer after it attend over.
  int64_t max_sel() const { return c_.index_topk + c_.index_kpool - 1; }
  struct Sel {
    int32_t *sel = nullptr, *count = nullptr;
  };
  std::vector<Sel> sels_;  // per layer: the selection it attends over (DSA layers)
  bool select_ = false;    // the forward pass: full-indexer layers make their selection (dsa_forward)

  // The sub-layer of a site: forward (y from a, activations kept in the arena) and backward (da from dy).
  struct SubActs {
    KdaActs kda;
    DsaActs dsa;
    MlpActs mlp;
    MoeActs moe;
  };
  void sub_forward(size_t i, bool ffn, const bf16* a, SubActs& x, float* y);
  // dy16: the output's gradient in bf16; dy: in fp32 as well, for the MoE alone (its routing weights' gradient).
  // da [T, D] is written, not added to: each sub-layer's first GEMM into it writes (beta = 0), the rest add.
  void sub_backward(size_t i, bool ffn, const bf16* a, const SubActs& x, const float* dy, const bf16* dy16, float* da);

  CudaModel::Impl& m_;
  const Plan& p_;
  Grads& g_;
  const ModelConfig& c_;
  // Per site (2·layer + ffn), each adapter's u = s·x·Aᵀ from the site's last forward, by (adapter, input rows).
  std::vector<std::map<std::pair<const DAdapter*, const bf16*>, bf16*>> lora_u_;
  // Per site, the stacked groups of its adapters and each member's (group, place in it); see stack_group.
  std::vector<std::vector<LoraGroup>> lora_groups_;
  std::vector<std::map<const DAdapter*, std::pair<size_t, int64_t>>> lora_member_;
  size_t site_ = 0;  // the site being run
  // A recomputation before the backward runs: every site kept its sub-layer's output y from the forward, so the
  // output projection (and the MoE's down projection and combine) is skipped, its adapters computing their u alone.
  bool recompute_ = false;
  // The forward pass of a site the policy recomputes: its activations are given back once the site is done, so what
  // only the backward reads is not made (the recomputation makes it): the KDA's fp32 q, k, v and log decay on the
  // tensor-core path, the MoE's pre-activations (unless the policy keeps the experts: core_).
  bool transient_ = false;
  bool factors_only_ = false;  // adapters keep their u and add nothing (lora_forward, expert_adapters_forward)
  // The MoE sub-layer's input a [T, D] during its forward or backward: the grouped gate and up adapters read it by
  // each permuted row's token (MoeActs::token_of) instead of its gathered copy xp (expert_input).
  const bf16* moe_a_ = nullptr;
  // Sets moe_a_ for an MoE sub-layer's forward or backward, clearing it when that returns.
  class MoeInput {
   public:
    MoeInput(const bf16*& at, const bf16* a) : at_(at) { at_ = a; }
    ~MoeInput() { at_ = nullptr; }
    MoeInput(const MoeInput&) = delete;
    MoeInput& operator=(const MoeInput&) = delete;

   private:
    const bf16*& at_;
  };
  // The routed experts' outputs (n × D fp32), which only the forward's combine reads: one buffer for every kept MoE
  // site (Step::run makes it when the policy keeps the MoE layers), else each forward takes its own from the arena
  // and gives it back with the site's activations.
  float* moe_out_ = nullptr;
  // A recomputed KDA or DSA site's attention core output, kept from the forward in the site's own buffers (Step::run
  // allocates them with core_buffers), so that its recomputation skips the recurrence or the attention, the costly
  // and small part of the sub-layer: the tensor-core recurrence's bf16 o (kda_o16) or the fp32 one's o (kda_o); the
  // MLA attention's bf16 o and, on tensor cores, its rows' log-sum-exp. Likewise a recomputed MoE site's routed
  // experts' gate|up pre-activations (fp32, or bf16 in the first half where the GEMM makes the act) and bf16 act
  // where the policy keeps the experts (moe_forward). Null while no site's are wanted (the core runs into the arena).
  struct CoreOut {
    bf16* kda_o16 = nullptr;
    float* kda_o = nullptr;
    bf16* mla_o = nullptr;
    float* mla_lse2 = nullptr;
    float* moe_gu = nullptr;
    bf16* moe_act = nullptr;
  };
  CoreOut core_;
  CoreOut core_buffers(const DLayer& L, bool ffn);
};

Step::CoreOut Step::core_buffers(const DLayer& L, bool ffn) {
  const int64_t T = this->T();
  Arena& ar = m_.arena;
  CoreOut o;
  if (ffn) {
    if (L.moe_layer && !m_.recompute.recomputes_experts()) {
      const int64_t n = T * c_.num_experts_per_tok, I = c_.moe_intermediate_size;
      o.moe_gu = ar.alloc<float>(n * 2 * I);
      o.moe_act = ar.alloc<bf16>(n * I);
    }
  } else if (L.kda_layer) {
    const int64_t HK = c_.linear_num_heads * c_.linear_head_dim;
    if (m_.kda_tc_path()) {
      o.kda_o16 = ar.alloc<bf16>(T * HK);
    } else {
      o.kda_o = ar.alloc<float>(T * HK);
    }
  } else {
    const int64_t NH = c_.num_attention_heads;
    o.mla_o = ar.alloc<bf16>(T * NH * c_.v_head_dim);
    if (mla_tc_supported(c_.qk_nope_head_dim, c_.v_head_dim)) o.mla_lse2 = ar.alloc<float>(T * NH);
  }
  return o;
}

void Step::kda_forward(size_t i, const DKda& w, const bf16* a, KdaActs& x, float* y) {
  const int64_t T = this->T(), D = c_.hidden_size, H = c_.linear_num_heads, K = c_.linear_head_dim, HK = H * K,
                W = c_.linear_conv_kernel_dim;
  const bool has_bound = c_.linear_lower_bound.has_value();
  const float bound = static_cast<float>(c_.linear_lower_bound.value_or(0.0));
  Arena& ar = m_.arena;
  cudaStream_t st = m_.stream;
  x.raw = ar.alloc<float>(T * 3 * HK);
  linear_forward(i, {LoraKind::KdaQ, LoraKind::KdaK, LoraKind::KdaV}, w.qkv, a, D, x.raw);
  // The forward's tensor-core kernel (bf16 q, k, v; the gate in the kernel) runs as inference runs it, and the
  // backward differentiates the function it computed: from those bf16 values (the rounding passes the gradient
  // through unchanged). The chunked backward reads them as they are; the recurrent one (other head dims) fp32 copies
  // holding the same values. A transient forward makes the bf16 ones alone.
  const bool tc = m_.kda_tc_path();
  const bool lean = tc && transient_;
  const bool qkv32 = !tc || (!lean && !kda_chunked_backward_supported(K));
  if (qkv32) x.q = ar.alloc<float>(T * HK), x.k = ar.alloc<float>(T * HK), x.v = ar.alloc<float>(T * HK);
  if (tc) {
    bf16 *q16 = x.q16 = ar.alloc<bf16>(T * HK), *k16 = x.k16 = ar.alloc<bf16>(T * HK),
         *v16 = x.v16 = ar.alloc<bf16>(T * HK);
    if (!qkv32) kda_conv_norm(x.raw, w.conv, p_.seq_start, q16, k16, v16, T, H, K, W, st);
    else kda_conv_norm_rounded(x.raw, w.conv, p_.seq_start, x.q, x.k, x.v, q16, k16, v16, T, H, K, W, st);
  } else {
    kda_conv_norm(x.raw, w.conv, p_.seq_start, x.q, x.k, x.v, T, H, K, W, st);
  }
  x.fa = ar.alloc<float>(T * K);
  linear_forward(i, {LoraKind::KdaFA}, w.f_a, a, D, x.fa);
  x.fa16 = half(x.fa, T * K);
  x.f = ar.alloc<float>(T * HK);
  linear_forward(i, {LoraKind::KdaFB}, w.f_b, x.fa16, K, x.f);
  // The log decay, for the fp32 recurrence and the recurrent backward; the tensor-core kernel and the chunked
  // backward form their own from f.
  if (qkv32) {
    x.g = ar.alloc<float>(T * HK);
    kda_gate(x.f, x.g, w.dt_bias, w.A_log, T, H, K, has_bound, bound, st);
  }
  x.beta = ar.alloc<float>(T * H);
  linear_forward(i, {LoraKind::KdaB}, w.b, a, D, x.beta);
  sigmoid_inplace(x.beta, T * H, st);
  // The output gate beside the recurrence (beside()), joined before the output norm reads it.
  const bool gate_beside = beside();
  const auto gate = [&] {
    x.ga = ar.alloc<float>(T * K);
    linear_forward(i, {LoraKind::KdaGA}, w.g_a, a, D, x.ga);
    x.ga16 = half(x.ga, T * K);
    x.gate = ar.alloc<float>(T * HK);
    linear_forward(i, {LoraKind::KdaGB}, w.g_b, x.ga16, K, x.gate);
  };
  if (gate_beside) m_.run_beside(1, gate);
  else gate();
  // The recurrence, unless this is a recomputation and the forward kept its output (core_).
  const bool core_kept = recompute_ && (core_.kda_o16 || core_.kda_o);
  const float eps = static_cast<float>(c_.rms_norm_eps);
  x.o16 = ar.alloc<bf16>(T * HK);
  if (tc) {
    x.o_tc = core_.kda_o16 ? core_.kda_o16 : ar.alloc<bf16>(T * HK);
    if (!core_kept) {
      // A kept site's forward (neither transient nor a recomputation) keeps the states for the chunked backward.
      KdaTcStates keep;
      if (m_.kda_keeps_states(m_.recompute) && !transient_ && !recompute_) {
        const int64_t C = p_.chunks.num_chunks;
        x.chunk_h = keep.chunk_h = ar.alloc<float>(C * H * K * K);
        if (m_.kda_backward_bf16) x.chunk_u16 = keep.chunk_u16 = ar.alloc<bf16>(C * H * 64 * K);
        else x.chunk_u = keep.chunk_u = ar.alloc<float>(C * H * 64 * K);
      }
      void* work =
          ar.alloc<unsigned char>(static_cast<int64_t>(kda_tc_workspace_bytes(p_.chunks.num_chunks, H, K)));
      kda_chunked_tc(x.q16, x.k16, x.v16, x.f, x.beta, w.dt_bias, w.A_log, bound, x.o_tc, p_.chunks,
                     kda_tc_workspace(work, p_.chunks.num_chunks, H, K), H, K, keep, st);
    }
    if (gate_beside) m_.join(1);
    kda_out_norm(x.o_tc, x.gate, w.o_norm, x.o16, T, H, K, eps, st);
  } else {
    x.o = core_.kda_o ? core_.kda_o : ar.alloc<float>(T * HK);
    if (!core_kept) {
      float* work = ar.alloc<float>(kda_workspace_floats(p_.chunks.num_chunks, H, K));
      kda_chunked(x.q, x.k, x.v, x.g, x.beta, x.o, p_.chunks, work, T, H, K, st);
    }
    if (gate_beside) m_.join(1);
    kda_out_norm(x.o, x.gate, w.o_norm, x.o16, T, H, K, eps, st);
  }
  output_forward(i, {LoraKind::KdaO}, w.o, x.o16, HK, y);
}

void Step::kda_backward(size_t i, const DKda& w, GKda& gw, const bf16* a, const KdaActs& x, const bf16* dy,
                        float* da) {
  const int64_t T = this->T(), D = c_.hidden_size, H = c_.linear_num_heads, K = c_.linear_head_dim, HK = H * K,
                W = c_.linear_conv_kernel_dim;
  const bool has_bound = c_.linear_lower_bound.has_value();
  const float bound = static_cast<float>(c_.linear_lower_bound.value_or(0.0));
  const float eps = static_cast<float>(c_.rms_norm_eps);
  Arena& ar = m_.arena;
  cudaStream_t st = m_.stream;
  // y = o_proj(on); on = RMSNorm_K(o)·sigmoid(gate); gate = g_b(g_a(a))
  float* don = ar.alloc<float>(T * HK);
  linear_backward(i, {LoraKind::KdaO}, w.o, x.o16, HK, dy, don, gw.o, true);
  // The recurrence's backward: in the chunked (WY) form for the head dims it has (which writes its gradients whole),
  // else backward through time (which adds into zeroed ones); the chunked form's products in bf16 only behind the
  // tensor-core forward, whose own products are bf16 (set_kda_backward_bf16), and then reading dO in bf16.
  const bool chunked = kda_chunked_backward_supported(K);
  const auto products = m_.kda_backward_bf16 && m_.kda_tc_path() ? KdaBackwardProducts::Bf16
                                                                 : KdaBackwardProducts::SplitBf16;
  const bool do16 = chunked && products == KdaBackwardProducts::Bf16;
  float* dO = do16 ? nullptr : ar.alloc<float>(T * HK);
  bf16* dO16 = do16 ? ar.alloc<bf16>(T * HK) : nullptr;
  bf16* dgate = ar.alloc<bf16>(T * HK);  // the GEMMs' operand, written in bf16 directly
  float* onw = ar.alloc<float>(kda_out_norm_backward_workspace_floats(T, H, K));
  if (x.o_tc)
    kda_out_norm_backward(x.o_tc, x.gate, w.o_norm, don, dO, nullptr, gw.o_norm, T, H, K, eps, onw, st, false, dgate,
                          dO16);
  else
    kda_out_norm_backward(x.o, x.gate, w.o_norm, don, dO, nullptr, gw.o_norm, T, H, K, eps, onw, st, false, dgate,
                          dO16);
  // da: g_a, b and f_a joined (narrow) after q|k|v's GEMM, which then writes it; else g_a's writes, the later add.
  Narrow n = narrow(i, {{&w.g_a, LoraKind::KdaGA}, {&w.b, LoraKind::KdaB}, {&w.f_a, LoraKind::KdaFA}}, a, D, da);
  // The output gate's backward beside the recurrence's (beside()), joined before b's adds into da.
  const bool gate_beside = beside();
  const auto gate = [&] {
    float* dga = ar.alloc<float>(T * K);
    linear_backward(i, {LoraKind::KdaGB}, w.g_b, x.ga16, K, dgate, dga, gw.g_b, true);
    if (n.dy) narrow_backward(i, {LoraKind::KdaGA}, n, 0, dga, gw.g_a);
    else linear_backward(i, {LoraKind::KdaGA}, w.g_a, a, D, half(dga, T * K), da, gw.g_a, true);
  };
  if (gate_beside) m_.run_beside(1, gate);
  else gate();
  auto grad = [&](int64_t n) { return chunked ? ar.alloc<float>(n) : zeros(n); };
  float *dq = grad(T * HK), *dk = grad(T * HK), *dv = grad(T * HK), *dg = grad(T * HK), *dbeta = grad(T * H);
  if (chunked) {
    void* work = ar.alloc<unsigned char>(
        static_cast<int64_t>(kda_chunked_backward_workspace_bytes(p_.chunks.num_chunks, T, H, K)));
    KdaGateInputs gate;
    if (!x.g) gate = {x.f, w.dt_bias, w.A_log, has_bound, bound};
    const KdaBf16Operands b16{dO16, x.chunk_u16};
    if (x.q)
      kda_chunked_backward(x.q, x.k, x.v, x.g, x.beta, dO, p_.chunks, T, H, K, dq, dk, dv, dg, dbeta, work, st,
                           false, products, x.chunk_h, x.chunk_u, gate, b16);
    else
      kda_chunked_backward(x.q16, x.k16, x.v16, x.g, x.beta, dO, p_.chunks, T, H, K, dq, dk, dv, dg, dbeta, work, st,
                           false, products, x.chunk_h, x.chunk_u, gate, b16);
  } else {
    void* work = ar.alloc<unsigned char>(
        static_cast<int64_t>(kda_recurrent_backward_workspace_bytes(T, p_.num_seqs, H, K)));
    kda_recurrent_backward(x.q, x.k, x.v, x.g, x.beta, dO, p_.cu, p_.num_seqs, T, H, K, dq, dk, dv, dg, dbeta, work,
                           st);
  }
  if (gate_beside) m_.join(1);
  // beta = sigmoid(b_proj·a)
  sigmoid_backward_inplace(x.beta, dbeta, T * H, st);
  if (n.dy) narrow_backward(i, {LoraKind::KdaB}, n, 1, dbeta, gw.b);
  else linear_backward(i, {LoraKind::KdaB}, w.b, a, D, half(dbeta, T * H), da, gw.b);
  // g = gate(f_b(f_a(a)) + dt_bias)
  bf16* df = ar.alloc<bf16>(T * HK);  // the GEMMs' operand, written in bf16 directly
  kda_gate_backward(x.f, w.dt_bias, w.A_log, dg, nullptr, gw.dt_bias, gw.A_log, T, H, K, has_bound, bound,
                    ar.alloc<float>(kda_gate_backward_workspace_floats(T, H, K)), st, df);
  float* dfa = ar.alloc<float>(T * K);
  linear_backward(i, {LoraKind::KdaFB}, w.f_b, x.fa16, K, df, dfa, gw.f_b, true);
  if (n.dy) narrow_backward(i, {LoraKind::KdaFA}, n, 2, dfa, gw.f_a);
  else linear_backward(i, {LoraKind::KdaFA}, w.f_a, a, D, half(dfa, T * K), da, gw.f_a);
  // q, k, v = norms(silu(conv(qkv(a))))
  bf16* draw16 = ar.alloc<bf16>(T * 3 * HK);  // the projection's output gradient, written in bf16 directly
  kda_conv_norm_backward(x.raw, w.conv, p_.seq_start, dq, dk, dv, nullptr, gw.conv, T, H, K, W,
                         ar.alloc<float>(kda_conv_norm_backward_workspace_floats(T, H, K, W)), st, draw16);
  linear_backward(i, {LoraKind::KdaQ, LoraKind::KdaK, LoraKind::KdaV}, w.qkv, a, D, draw16, da,
                  gw.qkv, n.dy != nullptr);
  if (n.dy) flush_narrow(n, false);
}

// The expanded MLA attention in fp32 over a given selection (the indexer ran in the forward pass).
void Step::dsa_forward(size_t i, const DDsa& w, const bf16* a, const int32_t* sel, const int32_t* count, DsaActs& x,
                       float* y) {
  const int64_t T = this->T(), D = c_.hidden_size, NH = c_.num_attention_heads, dqk = c_.qk_nope_head_dim,
                dv = c_.v_head_dim, QL = c_.q_lora_rank, KL = c_.kv_lora_rank;
  const float eps = static_cast<float>(c_.rms_norm_eps);
  Arena& ar = m_.arena;
  cudaStream_t st = m_.stream;
  x.qa = ar.alloc<float>(T * QL);
  linear_forward(i, {LoraKind::MlaQA}, w.q_a, a, D, x.qa);
  x.qr = ar.alloc<bf16>(T * QL);
  rmsnorm_rows(x.qa, QL, w.q_a_norm, x.qr, nullptr, T, QL, eps, st);
  // The indexer's selection (frozen: no gradient), in the forward pass only; beside the projections (beside()),
  // joined before the attention reads it.
  const bool select = select_ && w.has_indexer, indexer_beside = select && beside();
  const auto indexer = [&] { m_.indexer(w, p_, a, x.qr, sels_[i].sel, sels_[i].count, max_sel()); };
  if (indexer_beside) m_.run_beside(1, indexer);
  else if (select) indexer();
  // q and kv: in bf16 for the tensor-core attention, straight from the joined GEMMs with adapters on q_b and kv_b
  // (fp32 copies only for the backward's fp32 kernels, which widen the bf16 ones then); else fp32, then converted.
  const bool tc = mla_tc_supported(dqk, dv);
  const int64_t nq = T * NH * dqk, nkv = T * NH * (dqk + dv);
  auto project = [&](LoraKind kind, const DLinear& W, const bf16* in, int64_t ld, int64_t n, float*& y32, bf16*& y16) {
    y32 = nullptr;
    y16 = tc ? ar.alloc<bf16>(n) : nullptr;
    if (tc && joined_forward(i, {kind}, W, in, ld, nullptr, y16)) return;
    y32 = ar.alloc<float>(n);
    linear_forward(i, {kind}, W, in, ld, y32);
    if (tc) to_bf16(y32, y16, n, st);
  };
  project(LoraKind::MlaQB, w.q_b, x.qr, QL, nq, x.q, x.q16);
  x.lat = ar.alloc<float>(T * KL);
  linear_forward(i, {LoraKind::MlaKVA}, w.kv_a, a, D, x.lat);
  x.lat16 = ar.alloc<bf16>(T * KL);
  rmsnorm_rows(x.lat, KL, w.kv_a_norm, x.lat16, nullptr, T, KL, eps, st);
  project(LoraKind::MlaKVB, w.kv_b, x.lat16, KL, nkv, x.kv, x.kv16);
  if (indexer_beside) m_.join(1);
  // The attention, unless this is a recomputation and the forward kept its output (core_).
  const bool core_kept = recompute_ && core_.mla_o;
  x.o = core_.mla_o ? core_.mla_o : ar.alloc<bf16>(T * NH * dv);
  const int32_t* lens = m_.empty_seen ? p_.seen_len : p_.seq_len;
  if (tc) {
    // The forward's tensor-core kernel on bf16 q and kv, keeping its rows' log-sum-exp for the tensor-core backward.
    const int64_t words = mla_mask_words(p_.max_len);
    x.lse2 = core_.mla_lse2 ? core_.mla_lse2 : ar.alloc<float>(T * NH);
    if (!core_kept)
      mla_sparse_attention_tc(x.q16, x.kv16, sel, count, p_.seq_start, lens, x.o, ar.alloc<uint32_t>(T * words),
                              words, T, NH, dqk, dv, max_sel(), st, x.lse2);
  } else if (!core_kept) {
    mla_sparse_attention(x.q, x.kv, sel, count, p_.seq_start, lens, x.o, T, NH, dqk, dv, max_sel(), st);
  }
  output_forward(i, {LoraKind::MlaO}, w.o, x.o, NH * dv, y);
}

void Step::dsa_backward(size_t i, const DDsa& w, GDsa& gw, const bf16* a, const int32_t* sel, const int32_t* count,
                        const DsaActs& x, const bf16* dy, float* da) {
  const int64_t T = this->T(), D = c_.hidden_size, NH = c_.num_attention_heads, dqk = c_.qk_nope_head_dim,
                dv = c_.v_head_dim, QL = c_.q_lora_rank, KL = c_.kv_lora_rank;
  const float eps = static_cast<float>(c_.rms_norm_eps);
  Arena& ar = m_.arena;
  cudaStream_t st = m_.stream;
  float* dO = ar.alloc<float>(T * NH * dv);
  linear_backward(i, {LoraKind::MlaO}, w.o, x.o, NH * dv, dy, dO, gw.o, true);
  // The projections below take dq and dkv in bf16: the tensor-core kernel writes them so where it can (bf16_grads),
  // else they are fp32 sums, converted.
  float *dq = nullptr, *dkv = nullptr;
  bf16 *dq16 = nullptr, *dkv16 = nullptr;
  // The tensor-core kernel where the forward ran on tensor cores (its bf16 q and kv), else the fp32 tiled one; both
  // deterministic, their cost following the causal triangle's tiles. When the selections are so sparse in the
  // triangle that the scatter kernel's cost, following the selected pairs, is lower (or the head dims exceed the
  // tiled kernel's limits), the scatter one. Measured on the H200 at NH 64, dqk = dv = 256: ~1.6 ns per causal pair
  // on tensor cores (14.7 ms at T 4096), ~18 ns tiled fp32, ~41 ns per selected pair scattered.
  double selected = 0, causal = 0;
  for (const int64_t L : p_.lens) {
    const double l = static_cast<double>(L), m = static_cast<double>(std::min(max_sel(), L));
    selected += m * (m + 1) / 2 + (l - m) * m;  // at most min(max_sel, q + 1) keys for query q
    causal += l * (l + 1) / 2;
  }
  const int32_t* lens = m_.empty_seen ? p_.seen_len : p_.seq_len;
  const bool tiled_dims = (dqk + 3) / 4 * 4 <= 256 && (dqk + 3) / 4 * 4 + (dv + 3) / 4 * 4 <= 512;
  const bool tc = x.q16 && mla_backward_tc_supported(dqk, dv) && T <= (int64_t{1} << 21);
  const bool use_tc = tc && selected * 41.0 >= causal * 1.6,
             bf16_grads = use_tc && mla_backward_tc_bf16_outputs(dqk, dv);
  if (bf16_grads) {
    dq16 = ar.alloc<bf16>(T * NH * dqk), dkv16 = ar.alloc<bf16>(T * NH * (dqk + dv));
  } else {
    dq = zeros(T * NH * dqk), dkv = zeros(T * NH * (dqk + dv));
  }
  // The fp32 kernels' q and kv: the forward's, or where it made them in bf16 alone (joined_forward), those widened
  // (the values the forward's attention ran on).
  auto widened = [&](const float* y32, const bf16* y16, int64_t n) -> const float* {
    if (use_tc || y32) return y32;
    float* w32 = ar.alloc<float>(n);
    bf16_to_f32(y16, w32, n, st);
    return w32;
  };
  const float *q32 = widened(x.q, x.q16, T * NH * dqk), *kv32 = widened(x.kv, x.kv16, T * NH * (dqk + dv));
  if (use_tc) {
    void* work = ar.alloc<unsigned char>(
        static_cast<int64_t>(mla_sparse_attention_backward_tc_workspace_bytes(T, NH, p_.max_len, dqk, dv)));
    mla_sparse_attention_backward_tc(x.q16, x.kv16, sel, count, p_.seq_start, lens, dO, dq, dkv, T, NH, dqk, dv,
                                     max_sel(), p_.max_len, work, st, x.lse2, x.o, dq16, dkv16);
  } else if (!tiled_dims || mla_backward_use_scatter(selected, causal)) {
    mla_sparse_attention_backward_scatter(q32, kv32, sel, count, p_.seq_start, lens, dO, dq, dkv, T, NH, dqk, dv,
                                          max_sel(), st);
  } else {
    void* work = ar.alloc<unsigned char>(
        static_cast<int64_t>(mla_sparse_attention_backward_workspace_bytes(T, NH, p_.max_len)));
    mla_sparse_attention_backward(q32, kv32, sel, count, p_.seq_start, lens, dO, dq, dkv, T, NH, dqk, dv, max_sel(),
                                  p_.max_len, work, st);
  }
  // kv = kv_b(RMSNorm(kv_a(a)))
  float* dlat = ar.alloc<float>(T * KL);
  linear_backward(i, {LoraKind::MlaKVB}, w.kv_b, x.lat16, KL, dkv16 ? dkv16 : half(dkv, T * NH * (dqk + dv)), dlat,
                  gw.kv_b, true);
  float* dlat_raw = zeros(T * KL);
  rmsnorm_backward(x.lat, KL, w.kv_a_norm, dlat, dlat_raw, gw.kv_a_norm, T, KL, eps,
                   ar.alloc<float>(rmsnorm_backward_workspace_floats(T, KL)), st);
  // da: kv_a and q_a joined (narrow), one GEMM writing it; else kv_a's writes (the first), q_a's adds.
  Narrow n = narrow(i, {{&w.kv_a, LoraKind::MlaKVA}, {&w.q_a, LoraKind::MlaQA}}, a, D, da);
  if (n.dy) narrow_backward(i, {LoraKind::MlaKVA}, n, 0, dlat_raw, gw.kv_a);
  else linear_backward(i, {LoraKind::MlaKVA}, w.kv_a, a, D, half(dlat_raw, T * KL), da, gw.kv_a, true);
  // q = q_b(RMSNorm(q_a(a)))
  float* dqr = ar.alloc<float>(T * QL);
  linear_backward(i, {LoraKind::MlaQB}, w.q_b, x.qr, QL, dq16 ? dq16 : half(dq, T * NH * dqk), dqr, gw.q_b, true);
  float* dqa = zeros(T * QL);
  rmsnorm_backward(x.qa, QL, w.q_a_norm, dqr, dqa, gw.q_a_norm, T, QL, eps,
                   ar.alloc<float>(rmsnorm_backward_workspace_floats(T, QL)), st);
  if (!n.dy) return linear_backward(i, {LoraKind::MlaQA}, w.q_a, a, D, half(dqa, T * QL), da, gw.q_a);
  narrow_backward(i, {LoraKind::MlaQA}, n, 1, dqa, gw.q_a);
  flush_narrow(n, true);
}

void Step::mlp_forward(size_t i, bool shared, const DMlp& w, const bf16* a, MlpActs& x, float* y) {
  const int64_t T = this->T(), D = c_.hidden_size;
  const LoraKind gate = shared ? LoraKind::SharedGate : LoraKind::MlpGate, up = shared ? LoraKind::SharedUp
                                                                                          : LoraKind::MlpUp;
  x.gu = m_.arena.alloc<float>(T * 2 * w.I);
  x.act = m_.arena.alloc<bf16>(T * w.I);
  linear_forward(i, {gate, up}, w.gate_up, a, D, x.gu);
  swiglu(x.gu, x.act, T, w.I, static_cast<float>(c_.swiglu_limit), m_.stream);
  output_forward(i, {shared ? LoraKind::SharedDown : LoraKind::MlpDown}, w.down, x.act, w.I, y);
}

void Step::mlp_backward(size_t i, bool shared, const DMlp& w, GMlp& gw, const bf16* a, const MlpActs& x,
                        const bf16* dy16, float* da) {
  const int64_t T = this->T(), D = c_.hidden_size;
  const LoraKind gate = shared ? LoraKind::SharedGate : LoraKind::MlpGate, up = shared ? LoraKind::SharedUp
                                                                                          : LoraKind::MlpUp;
  float* dact = m_.arena.alloc<float>(T * w.I);
  linear_backward(i, {shared ? LoraKind::SharedDown : LoraKind::MlpDown}, w.down, x.act, w.I, dy16, dact, gw.down,
                  true);
  bf16* dgu = m_.arena.alloc<bf16>(T * 2 * w.I);
  swiglu_backward(x.gu, dact, dgu, T, w.I, static_cast<float>(c_.swiglu_limit), m_.stream);
  // The first of da's writers (sub_backward, and the MoE's shared expert): it writes.
  linear_backward(i, {gate, up}, w.gate_up, a, D, dgu, da, gw.gate_up, true);
}

// The MoE keeping the fp32 gate/up outputs (the SwiGLU's backward reads them): the grouped expert GEMM with an fp32
// epilogue, or with set_moe_expert_gemm(-1) one cuBLASLt GEMM per expert after a host sync of the boundaries.
void Step::moe_forward(size_t i, const DMoe& w, const bf16* a, MoeActs& x, float* y) {
  const MoeInput input(moe_a_, a);
  const int64_t T = this->T(), D = c_.hidden_size, E = c_.n_routed_experts, k = c_.num_experts_per_tok,
                I = c_.moe_intermediate_size, n = T * k;
  Arena& ar = m_.arena;
  cudaStream_t st = m_.stream;
  x.logits = ar.alloc<float>(T * E);
  m_.gemm->run(a, D, w.router.w, E, D, x.logits, E, T);
  x.experts = ar.alloc<int32_t>(n);
  x.weights = ar.alloc<float>(n);
  moe_route(x.logits, w.bias, x.experts, x.weights, T, E, c_.n_group, c_.topk_group, k, c_.norm_topk_prob,
            static_cast<float>(c_.routed_scaling_factor), st);
  // Expert parallelism: this rank's El experts run on the rows that chose them; the other choices are sorted after
  // them (moe_localize on a copy: the router's backward needs the chosen experts' own ids), and their output rows
  // are zero, so that their routing weights get no gradient here (the ranks holding them give it).
  const int64_t El = m_.local_experts, buckets = El == E ? E : El + 1;
  // The shared expert beside the routing and the routed experts (beside()): it reads a and writes y, which the
  // combine adds the experts into once the two streams join.
  const bool shared_beside = w.has_shared && beside();
  if (shared_beside) m_.run_beside(0, [&] { mlp_forward(i, true, w.shared, a, x.shared, y); });
  int32_t* keys_in = x.experts;
  if (El != E) {
    keys_in = ar.alloc<int32_t>(n);
    NEXTLM_CUDA_CHECK(cudaMemcpyAsync(keys_in, x.experts, n * sizeof(int32_t), cudaMemcpyDeviceToDevice, st));
    moe_localize(keys_in, n, m_.expert_begin, El, st);
  }
  int32_t *keys = ar.alloc<int32_t>(n), *slots_in = ar.alloc<int32_t>(n), *slots = ar.alloc<int32_t>(n),
          *token_of = ar.alloc<int32_t>(n);
  x.offsets = ar.alloc<int32_t>(buckets + 1);
  x.rows_held = El == E ? nullptr : x.offsets + El;
  x.slot_of = ar.alloc<int32_t>(n);
  const size_t temp_bytes = moe_permute_temp_bytes(n);
  void* temp = ar.alloc<char>(static_cast<int64_t>(temp_bytes));
  moe_permute(keys_in, T, k, buckets, keys, slots_in, slots, token_of, x.slot_of, x.offsets, temp, temp_bytes, st);
  x.xp = ar.alloc<bf16>(n * D);
  gather_rows(a, token_of, x.xp, n, D, st);
  x.token_of = token_of;
  // A recomputed site whose routed experts' gate|up the policy keeps (core_.moe_gu): its forward writes the
  // pre-activations and the act into the site's own buffers, and its recomputation reads them instead of running the
  // GEMM again; it makes the gate and up adapters' u alone.
  const bool experts_kept = core_.moe_gu != nullptr, reuse = experts_kept && recompute_;
  x.gu = experts_kept ? core_.moe_gu : nullptr;
  x.gu16 = nullptr;
  x.act = experts_kept ? core_.moe_act : ar.alloc<bf16>(n * I);
  // A recomputation runs up to the act (and the down adapters' u): the output was kept, and the backward needs no
  // expert outputs (moe_weights_backward).
  if (!recompute_) {
    x.out = moe_out_ ? moe_out_ : ar.alloc<float>(n * D);
    // Under expert parallelism the other ranks' rows stay zero (moe_combine reads them).
    if (El != E) NEXTLM_CUDA_CHECK(cudaMemsetAsync(x.out, 0, n * D * sizeof(float), st));
  }
  if (moe_expert_gemm() >= 0) {
    int32_t* ws = ar.alloc<int32_t>(grouped_gemm_workspace_ints(static_cast<int>(El)));
    const auto kernel = static_cast<GroupedGemmKernel>(moe_expert_gemm());
    // Per-expert adapters ride in the GEMMs' accumulators where they can (fold_adapters), else add afterwards.
    const bool fold_gu = fold_adapters(i, {LoraKind::ExpertGate, LoraKind::ExpertUp}),
               fold_dn = fold_adapters(i, {LoraKind::ExpertDown});
    // The act straight from the gate|up GEMM's accumulators (its SwiGLU epilogue, as the inference forward runs it),
    // keeping the pre-activations for the backward, unless adapters still have to add to them afterwards.
    const bool fuse_act = (fold_gu || !has_adapters(i, {LoraKind::ExpertGate, LoraKind::ExpertUp})) &&
                          grouped_gemm_is_wgmma(kernel);
    // The gate|up: the GEMM's fp32 output, or with the fused act the pre-activations the backward reads, in bf16
    // (half the bytes written and read back; the act comes from the fp32 sums): not made where the site is
    // recomputed, unless kept (the first half of the kept buffer holds them then), the recomputation makes them.
    if (fuse_act) {
      if (experts_kept) x.gu16 = reinterpret_cast<bf16*>(core_.moe_gu), x.gu = nullptr;
      else if (!transient_) x.gu16 = ar.alloc<bf16>(n * 2 * I);
    } else if (!x.gu) {
      x.gu = ar.alloc<float>(n * 2 * I);
    }
    GroupedGemm gu{x.xp, x.offsets, w.gate_up_ptrs, x.gu, n, static_cast<int>(El), static_cast<int>(2 * I),
                   static_cast<int>(D), GroupedEpilogue::kF32, 0.0f, kernel};
    gu.W_all = w.gate_up_all;
    gu.w_layout = w.layout;
    if (fuse_act) {
      gu.C = x.act, gu.pre = x.gu, gu.pre16 = x.gu16;
      gu.epilogue = GroupedEpilogue::kSwiGLU, gu.limit = static_cast<float>(c_.swiglu_limit);
    }
    if (fold_gu) gu.low_rank = expert_adapters_factor(i, x, {LoraKind::ExpertGate, LoraKind::ExpertUp});
    if (reuse) {
      if (!fold_gu) gate_up_factors(i, x);
    } else {
      grouped_gemm(gu, ws, st);
      if (!fold_gu) expert_adapters_forward(i, x, {LoraKind::ExpertGate, LoraKind::ExpertUp});
      if (!fuse_act) swiglu(x.gu, x.act, n, I, static_cast<float>(c_.swiglu_limit), st);
    }
    GroupedGemm dn{x.act, x.offsets, w.down_ptrs, x.out, n, static_cast<int>(El), static_cast<int>(D),
                   static_cast<int>(I), GroupedEpilogue::kF32, 0.0f, kernel};
    dn.W_all = w.down_all;
    dn.w_layout = w.layout;
    if (fold_dn) dn.low_rank = expert_adapters_factor(i, x, {LoraKind::ExpertDown});
    dn.schedule_ready = !reuse && grouped_gemm_same_schedule(gu, dn);  // then the gate|up's schedule serves both
    if (!recompute_) grouped_gemm(dn, ws, st);
    if (!fold_dn) down_adapters_forward(i, x);
  } else {
    w.require_rows();
    const std::vector<int32_t> off = host_offsets(x.offsets);
    if (reuse) {
      gate_up_factors(i, x);
    } else {
      if (!x.gu) x.gu = ar.alloc<float>(n * 2 * I);
      for (int64_t e = 0; e < El; ++e) {
        const int64_t r0 = off[e], rows = off[e + 1] - r0;
        if (rows) m_.gemm->run(x.xp + r0 * D, D, w.experts[e].gate_up.w, 2 * I, D, x.gu + r0 * 2 * I, 2 * I, rows);
      }
      expert_adapters_forward(i, x, {LoraKind::ExpertGate, LoraKind::ExpertUp});
      swiglu(x.gu, x.act, off[El], I, static_cast<float>(c_.swiglu_limit), st);
    }
    for (int64_t e = 0; e < El && !recompute_; ++e) {
      const int64_t r0 = off[e], rows = off[e + 1] - r0;
      if (rows) m_.gemm->run(x.act + r0 * I, I, w.experts[e].down.w, D, I, x.out + r0 * D, D, rows);
    }
    down_adapters_forward(i, x);
  }
  if (shared_beside) {
    m_.join(0);
  } else if (w.has_shared) {
    mlp_forward(i, true, w.shared, a, x.shared, y);  // in a recomputation, up to its act (output_forward)
  } else if (!recompute_) {
    NEXTLM_CUDA_CHECK(cudaMemsetAsync(y, 0, T * D * sizeof(float), st));
  }
  if (recompute_) return;
  // y holds this rank's share of the shared expert; as the forward's moe (model_impl.h): with distinct TP and EP
  // groups it is summed over TP and kept by EP rank 0 alone, then the routed experts' shares are summed over EP.
  if (m_.tp_comm != m_.ep_comm) {
    m_.all_reduce(m_.tp_comm, y, T * D);
    if (m_.ep_comm && m_.shard.ep_rank != 0) NEXTLM_CUDA_CHECK(cudaMemsetAsync(y, 0, T * D * sizeof(float), st));
  }
  moe_combine(y, x.out, x.slot_of, x.weights, T, k, D, st, x.rows_held);
  m_.all_reduce(m_.ep_comm, y, T * D);
}

void Step::moe_backward(size_t i, const DMoe& w, GMoe& gw, const bf16* a, const MoeActs& x, const float* dy,
                        const bf16* dy16, float* da) {
  const MoeInput input(moe_a_, a);
  const int64_t T = this->T(), D = c_.hidden_size, E = c_.n_routed_experts, k = c_.num_experts_per_tok,
                I = c_.moe_intermediate_size, n = T * k;
  Arena& ar = m_.arena;
  cudaStream_t st = m_.stream;
  // y = shared(a) + Σ_i w_i·out_i. The shared expert first: its input gradient is a share over TP, summed, and (as
  // in the forward) kept by EP rank 0 alone when the groups differ; the routed experts' and the router's shares
  // are then added and summed over EP.
  // The shared expert writes da (its first writer); without one the routed experts' gathers add into zeros. Beside
  // the routed experts (beside()), joined before their gathers add into da.
  const bool shared_beside = w.has_shared && beside();
  if (shared_beside) {
    m_.run_beside(0, [&] { mlp_backward(i, true, w.shared, gw.shared, a, x.shared, dy16, da); });
  } else if (w.has_shared) {
    mlp_backward(i, true, w.shared, gw.shared, a, x.shared, dy16, da);
  } else {
    NEXTLM_CUDA_CHECK(cudaMemsetAsync(da, 0, T * D * sizeof(float), st));
  }
  if (m_.tp_comm != m_.ep_comm) {
    m_.all_reduce(m_.tp_comm, da, T * D);
    if (m_.ep_comm && m_.shard.ep_rank != 0) NEXTLM_CUDA_CHECK(cudaMemsetAsync(da, 0, T * D * sizeof(float), st));
  }
  const int64_t El = m_.local_experts;
  // dout = w·dy; the routing weights' gradient dy·out comes from act·dact / w once dact is known (below), so that
  // the backward needs no expert outputs (a recomputation skips the down projection).
  bf16* dout = ar.alloc<bf16>(n * D);
  moe_combine_backward(dy, x.slot_of, x.weights, dout, T, k, D, st);
  // Each expert on its rows: out = down(act), act = swiglu(gate_up(xp)). The input gradients (dx = dy·W, the weights
  // untransposed) run on the grouped GEMM with no host sync, or with set_moe_expert_gemm(-1) one cuBLASLt GEMM per
  // expert; the weight gradients (full training), and per-expert adapters of shapes the grouped LoRA kernels do not
  // take, one expert at a time after a host sync of the boundaries.
  const bool grouped = moe_expert_gemm() >= 0;
  const bool adapters = has_adapters(i, {LoraKind::ExpertDown, LoraKind::ExpertGate, LoraKind::ExpertUp});
  const bool per_expert =
      !grouped || g_.linears ||
      (adapters && (m_.lora->layers[i].shared_experts
                        ? El != E
                        : !grouped_adapters(i, {LoraKind::ExpertDown, LoraKind::ExpertGate, LoraKind::ExpertUp})));
  if (!grouped) w.require_rows();
  const std::vector<int32_t> off = per_expert ? host_offsets(x.offsets) : std::vector<int32_t>{};
  int32_t* ws = grouped ? ar.alloc<int32_t>(grouped_gemm_workspace_ints(static_cast<int>(El))) : nullptr;
  // Input gradients of this rank's expert rows; the other ranks' rows stay zero.
  auto dx_grouped = [&](const bf16* dy, const bf16* const* W, const bf16* W_all, int64_t out_w, int64_t in_w,
                        void* dx, bool dx16, const GroupedLowRank& lr) {
    GroupedGemm g{dy, x.offsets, W, dx, n, static_cast<int>(El), static_cast<int>(in_w), static_cast<int>(out_w),
                  dx16 ? GroupedEpilogue::kBf16 : GroupedEpilogue::kF32, 0.0f,
                  static_cast<GroupedGemmKernel>(moe_expert_gemm_dx(w.layout == GroupedWeightLayout::kTiles))};
    g.w_kn = true;
    g.W_all = W_all;
    g.w_layout = w.layout;
    g.low_rank = lr;
    grouped_gemm(g, ws, st);
  };
  // Adapters folded into the forward's GEMMs fold into these too: their gradients first, then dx += gs·A_e in the
  // input-gradient GEMM's accumulators.
  const bool fold_dn = !per_expert && fold_adapters(i, {LoraKind::ExpertDown}, true),
             fold_gu = !per_expert && fold_adapters(i, {LoraKind::ExpertGate, LoraKind::ExpertUp}, true);
  // dact and dxp in bf16 where the grouped GEMM writes all of them and nothing adds to them afterwards (half the
  // bytes written and read back: the sums that read them are fp32 over bf16 inputs, as the GEMMs' own).
  const bool dact16 = grouped && El == E && (fold_dn || !has_adapters(i, {LoraKind::ExpertDown})),
             dxp16 = grouped && El == E && (fold_gu || !has_adapters(i, {LoraKind::ExpertGate, LoraKind::ExpertUp}));
  float* dact = dact16 ? nullptr : El == E ? ar.alloc<float>(n * I) : zeros(n * I);
  bf16* dact_h = dact16 ? ar.alloc<bf16>(n * I) : nullptr;
  if (grouped)
    dx_grouped(dout, w.down_ptrs, w.down_all, D, I, dact16 ? static_cast<void*>(dact_h) : dact, dact16,
               fold_dn ? expert_adapters_backward_factor(i, x, {LoraKind::ExpertDown}, dout) : GroupedLowRank{});
  for (int64_t e = 0; e < El && (!grouped || g_.linears); ++e) {
    const int64_t r0 = off[e], rows = off[e + 1] - r0;
    if (!rows) continue;
    if (gw.experts[e].down) m_.gemm->run_dw(dout + r0 * D, D, x.act + r0 * I, I, D, I, rows, gw.experts[e].down, true);
    if (!grouped) m_.gemm->run_dx(dout + r0 * D, D, w.experts[e].down.w, D, I, dact + r0 * I, I, rows, false);
  }
  if (!fold_dn && !dact16) expert_adapters_backward(i, x, off, {LoraKind::ExpertDown}, dout, dact);
  float* dweights = ar.alloc<float>(n);
  if (dact16) moe_weights_backward(x.act, dact_h, x.slot_of, x.weights, dweights, T, k, I, st, x.rows_held);
  else moe_weights_backward(x.act, dact, x.slot_of, x.weights, dweights, T, k, I, st, x.rows_held);
  bf16* dgu = ar.alloc<bf16>(n * 2 * I);
  const float L = static_cast<float>(c_.swiglu_limit);
  if (x.gu16 && dact16) swiglu_backward(x.gu16, dact_h, dgu, n, I, L, st, x.rows_held);
  else if (x.gu16) swiglu_backward(x.gu16, dact, dgu, n, I, L, st, x.rows_held);
  else if (dact16) swiglu_backward(x.gu, dact_h, dgu, n, I, L, st, x.rows_held);
  else swiglu_backward(x.gu, dact, dgu, n, I, L, st, x.rows_held);
  float* dxp = dxp16 ? nullptr : El == E ? ar.alloc<float>(n * D) : zeros(n * D);
  bf16* dxp_h = dxp16 ? ar.alloc<bf16>(n * D) : nullptr;
  if (grouped)
    dx_grouped(dgu, w.gate_up_ptrs, w.gate_up_all, 2 * I, D, dxp16 ? static_cast<void*>(dxp_h) : dxp, dxp16,
               fold_gu ? expert_adapters_backward_factor(i, x, {LoraKind::ExpertGate, LoraKind::ExpertUp}, dgu)
                       : GroupedLowRank{});
  for (int64_t e = 0; e < El && (!grouped || g_.linears); ++e) {
    const int64_t r0 = off[e], rows = off[e + 1] - r0;
    if (!rows) continue;
    if (gw.experts[e].gate_up)
      m_.gemm->run_dw(dgu + r0 * 2 * I, 2 * I, x.xp + r0 * D, D, 2 * I, D, rows, gw.experts[e].gate_up, true);
    if (!grouped)
      m_.gemm->run_dx(dgu + r0 * 2 * I, 2 * I, w.experts[e].gate_up.w, 2 * I, D, dxp + r0 * D, D, rows, false);
  }
  if (!fold_gu && !dxp16) expert_adapters_backward(i, x, off, {LoraKind::ExpertGate, LoraKind::ExpertUp}, dgu, dxp);
  if (shared_beside) m_.join(0);
  if (dxp16) moe_gather_backward(dxp_h, x.slot_of, da, T, k, D, st);
  else moe_gather_backward(dxp, x.slot_of, da, T, k, D, st);
  // The router through the chosen experts' weights.
  float* dlogits = ar.alloc<float>(T * E);
  moe_route_backward(x.logits, x.experts, dweights, dlogits, T, E, k, c_.norm_topk_prob,
                     static_cast<float>(c_.routed_scaling_factor), st);
  linear_backward(w.router, a, D, half(dlogits, T * E), T, da, gw.router);
  m_.all_reduce(m_.ep_comm, da, T * D);
}

void Step::sub_forward(size_t i, bool ffn, const bf16* a, SubActs& x, float* y) {
  const DLayer& L = m_.layers[i];
  // On a sharded model each sub-layer's output is a share over TP (the MoE reduces its own, over TP and EP).
  if (ffn && L.moe_layer) return moe_forward(i, L.moe, a, x.moe, y);
  if (ffn) {
    mlp_forward(i, false, L.mlp, a, x.mlp, y);
  } else if (L.kda_layer) {
    kda_forward(i, L.kda, a, x.kda, y);
  } else {
    dsa_forward(i, L.dsa, a, sels_[i].sel, sels_[i].count, x.dsa, y);
  }
  if (!recompute_) m_.all_reduce(m_.tp_comm, y, T() * c_.hidden_size);
}

void Step::sub_backward(size_t i, bool ffn, const bf16* a, const SubActs& x, const float* dy, const bf16* dy16,
                        float* da) {
  const DLayer& L = m_.layers[i];
  GLayer& G = g_.layers[i];
  // The input gradient is a share over TP, as the output was (the MoE reduces its own).
  if (ffn && L.moe_layer) return moe_backward(i, L.moe, G.moe, a, x.moe, dy, dy16, da);
  if (ffn) {
    mlp_backward(i, false, L.mlp, G.mlp, a, x.mlp, dy16, da);
  } else if (L.kda_layer) {
    kda_backward(i, L.kda, G.kda, a, x.kda, dy16, da);
  } else {
    dsa_backward(i, L.dsa, G.dsa, a, sels_[i].sel, sels_[i].count, x.dsa, dy16, da);
  }
  if (da) m_.all_reduce(m_.tp_comm, da, T() * c_.hidden_size);
}

// Rows per block of the lm_head in the training step: at most head_block_bytes() of fp32 logits (2 GiB), the blocks
// as even as that allows and, where it stays under the cap, a multiple of 256 rows, the GEMMs' row tiles (T = 4096
// at V = 154880: two blocks of 2048 rows; under a 1 GiB cap 1536, 1536 and 1024 rows, where 1733, 1733 and 630 left
// a part-filled tile in each: 17 tiles of 256 rows for 16 rows' worth).
int64_t head_block_rows(int64_t T, int64_t V) {
  const int64_t bytes = static_cast<int64_t>(std::min<size_t>(head_block_bytes(), size_t{1} << 62));
  const int64_t cap = std::max<int64_t>(1, std::min<int64_t>(T, bytes / (V * 4)));
  const int64_t even = ceil_div(T, ceil_div(T, cap)), tiled = 256 * ceil_div(even, 256);
  return tiled <= cap ? tiled : even;
}

// Each row's loss into loss_rows [T] (device) from the final streams h [T, S, D], in row blocks of the lm_head
// (head_block_rows), with dL/dh written into dh and the head's gradients added into g_.
void Step::head_backward(const float* h, const float* row_weight, float* dh, double* loss_rows) {
  // V: this rank's vocabulary rows (all of them unless vocabulary-parallel).
  const int64_t T = this->T(), S = c_.hc_mult, D = c_.hidden_size, V = m_.vocab_rows;
  const float eps = static_cast<float>(c_.rms_norm_eps);
  Arena& ar = m_.arena;
  cudaStream_t st = m_.stream;
  bf16* hn = ar.alloc<bf16>(T * D);
  float* hm = ar.alloc<float>(T * D);  // the streams' mean, for the norm's backward
  stream_mean_norm(h, m_.final_norm, hn, T, S, D, eps, st, hm);
  float* dhn = ar.alloc<float>(T * D);  // each row block's rows written by its run_dx (no accumulation)
  const int64_t block = head_block_rows(T, V);
  float* logits = ar.alloc<float>(block * V);
  bf16* dlogits = ar.alloc<bf16>(block * V);
  for (int64_t r0 = 0; r0 < T; r0 += block) {
    const int64_t rows = std::min(block, T - r0);
    m_.gemm->run(hn + r0 * D, D, m_.lm_head, V, D, logits, V, rows);
    const float* wt = row_weight ? row_weight + r0 : nullptr;
    if (!m_.tp_comm) {
      softmax_xent_backward(logits, p_.targets + r0, wt, loss_rows + r0, dlogits, rows, V, st);
    } else {
      // Vocabulary-parallel: each row's max, Σ exp and target logit over the slices, reduced over TP.
      float *mx = ar.alloc<float>(rows), *gmx = ar.alloc<float>(rows), *sum_tl = ar.alloc<float>(2 * rows);
      row_lse_partial(logits, p_.targets + r0, m_.vocab_begin, rows, V, mx, sum_tl, sum_tl + rows, st);
      NEXTLM_CUDA_CHECK(cudaMemcpyAsync(gmx, mx, rows * sizeof(float), cudaMemcpyDeviceToDevice, st));
      m_.tp_comm->all_reduce_max(gmx, static_cast<size_t>(rows));
      lse_rescale(sum_tl, mx, gmx, rows, st);
      m_.all_reduce(m_.tp_comm, sum_tl, 2 * rows);
      split_xent_kernel<<<static_cast<unsigned>(std::min<int64_t>(rows, 65535)), 256, 0, st>>>(
          logits, p_.targets + r0, m_.vocab_begin, wt, gmx, sum_tl, sum_tl + rows, loss_rows + r0, dlogits, rows, V);
      NEXTLM_CUDA_CHECK(cudaGetLastError());
    }
    if (g_.lm_head) m_.gemm->run_dw(dlogits, V, hn + r0 * D, D, V, D, rows, g_.lm_head, true);
    m_.gemm->run_dx(dlogits, V, m_.lm_head, V, D, dhn + r0 * D, D, rows, false);
  }
  m_.all_reduce(m_.tp_comm, dhn, T * D);  // each rank's vocabulary rows' share
  float* work = ar.alloc<float>(rmsnorm_backward_workspace_floats(T, D));
  stream_mean_norm_backward(h, m_.final_norm, dhn, dh, g_.final_norm, T, S, D, eps, work, st, false, hm);
}

double Step::run(const float* row_weight) {
  const int64_t T = this->T(), S = c_.hc_mult, D = c_.hidden_size, TSD = T * S * D;
  const size_t Lyr = m_.layers.size();
  Arena& ar = m_.arena;
  cudaStream_t st = m_.stream;
  if (beside()) m_.use_side_gemm();
  // The rows' losses, read once the backward is queued (reading them after the head would leave the GPU idle while
  // the host waits for them and then starts queueing the backward: 0.14 ms a step).
  double* loss_rows = ar.alloc<double>(T);
  // Kept for the backward: the streams entering every site, and each full indexer's selection.
  std::vector<float*> site_h(2 * Lyr);
  for (float*& s : site_h) s = ar.alloc<float>(TSD);
  sels_.assign(Lyr, Sel{});
  for (size_t i = 0; i < Lyr; ++i) {
    const DLayer& L = m_.layers[i];
    if (L.kda_layer) continue;
    if (L.dsa.has_indexer) {
      sels_[i] = Sel{ar.alloc<int32_t>(T * max_sel()), ar.alloc<int32_t>(T)};
    } else {
      check(i > 0 && !m_.layers[i - 1].kda_layer && m_.layers[i - 1].dsa.has_indexer, "layer ", i,
            " shares the indexer of the layer before it, which has none");
      sels_[i] = sels_[i - 1];
    }
  }
  float* h = ar.alloc<float>(TSD);
  float* post = ar.alloc<float>(T * S);
  float* comb = ar.alloc<float>(T * S * S);
  bf16* a = ar.alloc<bf16>(T * D);
  const int64_t NM = (2 + S) * S + 1;  // a token's mix: fn·h and Σh² (what mhc_pre_backward reuses)
  float* mix = ar.alloc<float>(T * NM);
  moe_out_ = nullptr;
  if (!m_.recompute.moe && std::any_of(m_.layers.begin(), m_.layers.end(), [](const DLayer& L) { return L.moe_layer; }))
    moe_out_ = ar.alloc<float>(T * c_.num_experts_per_tok * D);
  float* mhc_work = ar.alloc<float>(mhc_pre_workspace_floats(T, S, D));
  float* dh = ar.alloc<float>(TSD);  // written by head_backward
  float* dh_prev = ar.alloc<float>(TSD);

  // Forward. A site whose sub-layer the policy recomputes gives its activations back to the arena once it is done;
  // a kept site leaves them there, with its mHC mix (which made the sub-layer's input), in buffers of its own. Every
  // site keeps its sub-layer's output; without recomputing mHC, a recomputed site keeps its mix too. What the sites
  // keep stacks up in site order and the backward, from the last site, pops it in turn (Arena is a stack).
  struct Site {
    bool kept = false, mix_kept = false;
    Arena::Mark mark{};  // where its allocations began
    float *post = nullptr, *comb = nullptr, *mix = nullptr, *y = nullptr;
    bf16* a = nullptr;
    // Where the mix is recomputed: the forward's projection partials of the site's streams (mhc_pre's work), so
    // that the recomputation runs only the mix's second half (mhc_pre_apply).
    float* proj = nullptr;
    CoreOut core;  // a recomputed KDA or DSA site's attention core output (core_)
    SubActs x;
  };
  const RecomputePolicy& policy = m_.recompute;
  auto keeps = [&](const DLayer& L, bool ffn) {
    return ffn ? (L.moe_layer ? !policy.moe : !policy.mlp) : (L.kda_layer ? !policy.kda : !policy.mla);
  };
  std::vector<Site> sites(2 * Lyr);
  lora_u_.assign(2 * Lyr, {});
  lora_groups_.assign(2 * Lyr, {});
  lora_member_.assign(2 * Lyr, {});
  m_.mark_begin("train: forward");
  // The streams go from site to site out of place: each site's post-mix reads its input (kept in site_h) and writes
  // the next site's, the last one h.
  m_.embed_into(p_.tokens, Lyr ? site_h[0] : h, T);
  // Whether a site's post-mix made the next site's projection partials too (mhc_post_fusion; into mhc_work, where
  // the next site keeps its mix), so that its pre-mix runs only the second half.
  bool projected = false;
  for (size_t i = 0; i < Lyr; ++i) {
    const DLayer& L = m_.layers[i];
    m_.wait_lora_update(i);  // a LoRA update beside this forward (Impl::update_stream): this layer's adapters
    for (bool ffn : {false, true}) {
      site_ = 2 * i + ffn;
      Site& s = sites[site_];
      const float* hin = site_h[site_];
      float* hout = site_ + 1 < site_h.size() ? site_h[site_ + 1] : h;
      s.mark = ar.mark();
      s.kept = keeps(L, ffn);
      s.mix_kept = s.kept || !policy.mhc;
      if (s.mix_kept) {
        s.post = ar.alloc<float>(T * S), s.comb = ar.alloc<float>(T * S * S), s.a = ar.alloc<bf16>(T * D);
        s.mix = ar.alloc<float>(T * NM);
      } else {
        s.proj = ar.alloc<float>(mhc_pre_workspace_floats(T, S, D));
      }
      // Every site keeps its sub-layer's output (T × D, what the post-mix backward reads), so that a recomputation
      // skips the output projection.
      s.y = ar.alloc<float>(T * D);
      // A recomputed attention sub-layer keeps its core's output too, so that its recomputation skips the core; a
      // recomputed MoE its experts' gate|up where the policy keeps them.
      if (!s.kept) s.core = core_buffers(L, ffn);
      const Arena::Mark sub_mark = ar.mark();
      float *sp = s.mix_kept ? s.post : post, *sc = s.mix_kept ? s.comb : comb, *sy = s.y;
      bf16* sa = s.mix_kept ? s.a : a;
      if (projected) {
        mhc_pre_apply(m_.mhc_params(L, ffn, T), hin, sp, sc, sa, mhc_work, st, s.mix);
      } else {
        mhc_pre(m_.mhc_params(L, ffn, T), hin, sp, sc, sa, s.mix_kept ? mhc_work : s.proj, st, s.mix);
      }
      projected = false;
      // This pass makes the full indexers' selections (dsa_forward runs the indexer on its normed q latent); the
      // recomputation before each backward reuses them.
      select_ = true;
      core_ = s.core;
      transient_ = !s.kept;
      sub_forward(i, ffn, sa, s.x, sy);
      transient_ = false;
      core_ = {};
      select_ = false;
      // The next site's projection with this post-mix where the next site keeps its mix (its partials go to the
      // shared mhc_work, not to a buffer of the site's own).
      const size_t next = site_ + 1;
      if (mhc_post_fusion() && next < 2 * Lyr && (keeps(m_.layers[next / 2], next % 2) || !policy.mhc)) {
        if (mhc_post_project(hin, hout, sy, sp, sc, m_.mhc_params(m_.layers[next / 2], next % 2, T), mhc_work, st))
          note_mhc_fused_post();
        projected = true;
      } else {
        mhc_post(hin, hout, sy, sp, sc, T, S, D, st);
      }
      if (!s.kept) ar.rewind(sub_mark);
    }
  }
  m_.mark_end("train: forward");
  m_.join_lora_update();  // the rest of the update (the gradients' clearing after it): the backward writes them
  const Arena::Mark head_mark = ar.mark();
  m_.mark_begin("train: head");
  head_backward(h, row_weight, dh, loss_rows);
  m_.mark_end("train: head");
  ar.rewind(head_mark);

  // Backward, site by site from the last: recompute the site (unless kept), then walk back through it.
  for (size_t i = Lyr; i-- > 0;) {
    const DLayer& L = m_.layers[i];
    GLayer& G = g_.layers[i];
    for (bool ffn : {true, false}) {
      site_ = 2 * i + ffn;
      Site& s = sites[site_];
      const std::string kind = ffn ? (L.moe_layer ? "moe" : "mlp") : (L.kda_layer ? "kda" : "dsa");
      const float* hin = site_h[site_];
      const MhcParams mp = m_.mhc_params(L, ffn, T);
      if (!s.kept) {
        if (!s.mix_kept) {
          s.post = post, s.comb = comb, s.a = a, s.mix = mix;
          m_.mark_begin("train: recompute mhc");
          mhc_pre_apply(mp, hin, post, comb, a, s.proj, st, mix);
          m_.mark_end("train: recompute mhc");
        }
        s.x = SubActs{};
        clear_lora_site();
        m_.mark_begin("train: recompute " + kind);
        recompute_ = true;  // up to the output projection, which writes nothing: s.y was kept
        core_ = s.core;     // and without the attention core, whose output was kept
        sub_forward(i, ffn, s.a, s.x, nullptr);
        core_ = {};
        recompute_ = false;
        m_.mark_end("train: recompute " + kind);
      }
      m_.mark_begin("train: backward mhc");
      // The post-mix backward writes dh_prev, dy (bf16, the GEMMs' operand; fp32 too for the MoE's routing
      // weights), dpost and dcomb whole (no zeroing first); the sub-layer's backward writes da (its first writer of
      // da writes, the others add).
      float* dy = ffn && m_.layers[i].moe_layer ? ar.alloc<float>(T * D) : nullptr;
      bf16* dy16 = ar.alloc<bf16>(T * D);
      const GHc& gh = ffn ? G.hc_ffn : G.hc_attn;
      float* const dnorm = ffn ? G.post_norm : G.in_norm;
      // The first site's input gradient (the embedding's) is formed only where something before it trains: the
      // embedding, or this site's mHC or input norm. Else (a LoRA step) neither its pre-mix backward nor its
      // sub-layer's input gradients (the first projections' dx GEMMs) run; its adapters' gradients still do.
      const bool input_grad = site_ > 0 || g_.embed || gh.fn || dnorm;
      float* dpost = input_grad ? ar.alloc<float>(T * S) : nullptr;
      float* dcomb = input_grad ? ar.alloc<float>(T * S * S) : nullptr;
      float* da = input_grad ? ar.alloc<float>(T * D) : nullptr;
      // With the mHC frozen, the pre-mix's backward forms the post-mix's dh term itself (from dh and comb) as it
      // writes dh_prev: the post-mix backward then writes no dh_prev, which nobody reads in between.
      const bool fold = mhc_mix_fold() && mhc_pre_backward_forms_mix(S, gh.fn != nullptr);
      mhc_post_backward(hin, s.y, s.post, s.comb, dh, fold || !input_grad ? nullptr : dh_prev, dy, dpost, dcomb, T, S,
                        D, st, false, dy16);
      m_.mark_end("train: backward mhc");
      m_.mark_begin("train: backward " + kind);
      sub_backward(i, ffn, s.a, s.x, dy, dy16, da);
      flush_lora_groups();
      m_.mark_end("train: backward " + kind);
      if (input_grad) {
        m_.mark_begin("train: backward mhc");
        mhc_pre_backward(mp, hin, dpost, dcomb, da, dh_prev, gh.fn, gh.base, gh.scale, dnorm,
                         ar.alloc<float>(mhc_pre_backward_workspace_floats(T, S, D)), st, s.mix, fold ? dh : nullptr,
                         fold ? s.comb : nullptr);
        m_.mark_end("train: backward mhc");
      }
      std::swap(dh, dh_prev);
      ar.rewind(s.mark);
    }
  }
  if (g_.embed) {
    int64_t pad = c_.pad_token_id.value_or(-1);
    const int32_t* tok = p_.tokens;
    if (m_.vocab_rows != c_.vocab_size) {
      // The slice's rows: tokens renumbered from vocab_begin, those of other slices (and the pad) skipped.
      pad = pad >= m_.vocab_begin && pad < m_.vocab_begin + m_.vocab_rows ? pad - m_.vocab_begin : -1;
      int32_t* local = ar.alloc<int32_t>(T);
      local_tokens_kernel<<<static_cast<unsigned>(ceil_div(T, 256)), 256, 0, st>>>(
          p_.tokens, local, T, m_.vocab_begin, m_.vocab_rows, static_cast<int32_t>(pad));
      NEXTLM_CUDA_CHECK(cudaGetLastError());
      tok = local;
    }
    embedding_backward(tok, dh, g_.embed, T, S, D, pad, st);
  }
  m_.end_timing();  // the step's device work ends here; its loss comes back after
  double* host = static_cast<double*>(m_.loss_host.get(static_cast<size_t>(std::max<int64_t>(T, 1)) * sizeof(double)));
  NEXTLM_CUDA_CHECK(cudaMemcpyAsync(host, loss_rows, T * sizeof(double), cudaMemcpyDeviceToHost, st));
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));
  return std::accumulate(host, host + T, 0.0);
}

// Carves the gradients out of one zeroed allocation, laid out as the weights; without `linears`, those of the
// linear weights (projections, experts, embedding, lm_head) stay null and are not computed; without `small`, those
// of the others (norms, mHC, conv, dt_bias, A_log).
std::unique_ptr<Grads> make_grads(const ModelConfig& c, int64_t V, const std::vector<DLayer>& layers, bool linears,
                                  bool small) {
  auto g = std::make_unique<Grads>();
  g->linears = linears;
  g->small = small;
  std::vector<std::pair<float**, int64_t>> parts;
  auto add = [&](float*& p, int64_t n) { parts.emplace_back(&p, n); };
  auto add_small = [&](float*& p, int64_t n) {
    if (small) add(p, n);
  };
  const int64_t D = c.hidden_size, S = c.hc_mult, M = (2 + S) * S;
  if (linears) {
    add(g->embed, V * D);
    add(g->lm_head, V * D);
  }
  add_small(g->final_norm, D);
  g->layers.resize(layers.size());
  auto lin = [&](float*& p, const DLinear& l) {
    if (linears) add(p, l.out * l.in);
  };
  auto mlp = [&](GMlp& gm, const DMlp& m) {
    lin(gm.gate_up, m.gate_up);
    lin(gm.down, m.down);
  };
  for (size_t i = 0; i < layers.size(); ++i) {
    const DLayer& L = layers[i];
    GLayer& G = g->layers[i];
    for (GHc* h : {&G.hc_attn, &G.hc_ffn}) {
      add_small(h->fn, M * S * D);
      add_small(h->base, M);
      add_small(h->scale, 3);
    }
    add_small(G.in_norm, D);
    add_small(G.post_norm, D);
    if (L.kda_layer) {
      const int64_t H = c.linear_num_heads, K = c.linear_head_dim, HK = H * K, W = c.linear_conv_kernel_dim;
      const DKda& k = L.kda;
      GKda& gk = G.kda;
      lin(gk.qkv, k.qkv);
      lin(gk.f_a, k.f_a);
      lin(gk.f_b, k.f_b);
      lin(gk.b, k.b);
      lin(gk.g_a, k.g_a);
      lin(gk.g_b, k.g_b);
      lin(gk.o, k.o);
      add_small(gk.conv, 3 * HK * W);
      add_small(gk.dt_bias, HK);
      add_small(gk.A_log, H);
      add_small(gk.o_norm, K);
    } else {
      const DDsa& d = L.dsa;
      GDsa& gd = G.dsa;
      lin(gd.q_a, d.q_a);
      lin(gd.q_b, d.q_b);
      lin(gd.kv_a, d.kv_a);
      lin(gd.kv_b, d.kv_b);
      lin(gd.o, d.o);
      add_small(gd.q_a_norm, c.q_lora_rank);
      add_small(gd.kv_a_norm, c.kv_lora_rank);
    }
    if (L.moe_layer) {
      lin(G.moe.router, L.moe.router);
      G.moe.experts.resize(L.moe.experts.size());
      for (size_t e = 0; e < L.moe.experts.size(); ++e) mlp(G.moe.experts[e], L.moe.experts[e]);
      if (L.moe.has_shared) mlp(G.moe.shared, L.moe.shared);
    } else {
      mlp(G.mlp, L.mlp);
    }
  }
  for (const auto& p : parts) g->floats += (p.second + 63) / 64 * 64;  // 256-byte aligned pieces
  NEXTLM_CUDA_CHECK(cudaMalloc(&g->base, static_cast<size_t>(g->floats) * sizeof(float)));
  NEXTLM_CUDA_CHECK(cudaMemset(g->base, 0, static_cast<size_t>(g->floats) * sizeof(float)));
  int64_t off = 0;
  for (const auto& p : parts) {
    *p.first = g->base + off;
    off += (p.second + 63) / 64 * 64;
  }
  return g;
}

// A device gradient into a host tensor of its shape, starting first_element into the device buffer (the parts of
// merged buffers: q | k | v, gate | up, the three convs); a null one (not computed) leaves the zeros.
void download(const float* d, Tensor& t, int64_t first_element = 0) {
  if (!d) return;
  NEXTLM_CUDA_CHECK(cudaMemcpy(t.ptr(), d + first_element, t.numel() * sizeof(float), cudaMemcpyDeviceToHost));
}

}  // namespace
}  // namespace cuda

namespace {

// The device's gradients (the model's and the adapters') set to zero, in stream order; those of the grouped
// per-expert adapters only marked unwritten (the next backward overwrites them: LoraState::overwritten).
void zero_device_grads(CudaModel::Impl& m) {
  if (m.grads)
    NEXTLM_CUDA_CHECK(cudaMemsetAsync(m.grads->base, 0, m.grads->floats * sizeof(float), m.stream));
  if (!m.lora) return;
  // Behind a pending update (which reads these gradients) on its stream, and part of what join_lora_update waits for:
  // the next forward need not wait for them, and the backward after it runs past the join.
  cudaStream_t st = m.update_pending ? m.update_stream : m.stream;
  for (const auto& [at, bytes] : m.lora->cleared)
    NEXTLM_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(m.lora->base) + at, 0, bytes, st));
  if (m.update_pending) NEXTLM_CUDA_CHECK(cudaEventRecord(m.update_done, m.update_stream));
  m.lora->unwritten = !m.lora->overwritten.empty();
}

// Before the adapters' gradients are read: those zero_grads left unwritten (no backward since) set to zero.
void settle_lora_grads(const CudaModel::Impl& m) {
  if (!m.lora || !m.lora->unwritten) return;
  for (const auto& [at, bytes] : m.lora->overwritten)
    NEXTLM_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(m.lora->base) + at, 0, bytes, m.stream));
  m.lora->unwritten = false;
}

// One forward + backward under the policy's current flags.
double forward_backward_once(CudaModel::Impl& m, const PackedBatch& batch) {
  m.start(batch, true);  // the forward waits for a pending LoRA update layer by layer (Step::run)
  const cuda::Plan p = m.plan(batch);
  check(batch.target_weight.empty() || batch.target_weight.size() == batch.tokens.size(),
        "batch: target_weight has ", batch.target_weight.size(), " entries for ", batch.tokens.size(), " tokens");
  if (!m.grads || m.grads->linears != m.train_linears || m.grads->small != m.train_small) {
    m.grads.reset();
    m.grads = cuda::make_grads(m.cfg, m.vocab_rows, m.layers, m.train_linears, m.train_small);
    m.since_zero.clear();  // new gradients are zero
    m.untracked = false;
  }
  // Row t's term is weighted by target_weight[t + 1] (the weight of the token it predicts).
  float* row_weight = nullptr;
  std::vector<float> rw;
  if (!batch.target_weight.empty()) {
    rw.assign(p.T, 0.0f);
    for (int64_t n = 0; n < batch.num_seqs(); ++n)
      for (int64_t t = batch.cu_seqlens[n]; t + 1 < batch.cu_seqlens[n + 1]; ++t) rw[t] = batch.target_weight[t + 1];
    row_weight = m.arena.alloc<float>(p.T);
    NEXTLM_CUDA_CHECK(cudaMemcpyAsync(row_weight, rw.data(), p.T * sizeof(float), cudaMemcpyHostToDevice, m.stream));
  }
  cuda::Step step(m, p, *m.grads);
  const double loss = step.run(row_weight);  // (which marks the end of the step's timing)
  if (m.lora) m.lora->unwritten = false;    // the backward wrote the grouped adapters' gradients
  m.finish_profile();
  return loss;
}

}  // namespace

// Out of device memory under an adaptive policy: the arena freed, the gradients zeroed (the failed backward may have
// added some), then the batches since the last zero_grads and this one again under the next rung, whose losses and
// gradients are those of the first run (every policy gives the same loss bit for bit).
double CudaModel::forward_backward(const PackedBatch& batch) {
  Impl& m = *impl_;
  m.arena.reset_peak();
  bool again = false;
  for (;;) {
    try {
      if (again)
        for (const PackedBatch& b : m.since_zero) forward_backward_once(m, b);
      const double loss = forward_backward_once(m, batch);
      if (m.recompute.adaptive) m.since_zero.push_back(batch);
      else m.untracked = true;
      return loss;
    } catch (const OutOfMemory& e) {
      NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());  // the kernels already queued are done with the arena
      m.arena.release();
      std::optional<RecomputePolicy> next = recompute_fallback(m.recompute);
      // A rung that frees nothing here (the states one where no KDA site keeps chunk states) is passed over.
      auto but_states = [](RecomputePolicy p) {
        p.states = true;
        return p;
      };
      while (next && but_states(*next) == but_states(m.recompute) && !m.kda_keeps_states(m.recompute))
        next = recompute_fallback(*next);
      if (!next || m.untracked) throw;
      RecomputePolicy rung = *next;
      rung.adaptive = false;
      std::fprintf(stderr, "nextlm: %s; --recompute auto: recomputing %s from now on\n", e.what(),
                   recompute_to_string(rung).c_str());
      m.recompute = *next;
      zero_device_grads(m);
      again = true;
    }
  }
}

// Queued on the model's stream, like the steps that add into the gradients and every read of them.
void CudaModel::zero_grads() {
  Impl& m = *impl_;
  zero_device_grads(m);
  m.since_zero.clear();
  m.untracked = false;
}

namespace {

// Where a LoRA kind sits on layer L: its projection and the first of its rows there (merged q | k | v, gate | up).
struct LoraTarget {
  const cuda::DLinear* W = nullptr;
  int64_t out = 0, col0 = 0;
};
LoraTarget lora_target(const ModelConfig& c, const cuda::DLayer& L, LoraKind k) {
  const int64_t HK = c.linear_num_heads * c.linear_head_dim;
  auto part = [](const cuda::DLinear& W, int64_t parts, int64_t i) {
    return LoraTarget{&W, W.out / parts, i * W.out / parts};
  };
  auto whole = [](const cuda::DLinear& W) { return LoraTarget{&W, W.out, 0}; };
  const bool kda = L.kda_layer, dsa = !L.kda_layer, mlp = !L.moe_layer, moe = L.moe_layer;
  const bool shared = moe && L.moe.has_shared;
  switch (k) {
    case LoraKind::KdaQ: if (kda) return LoraTarget{&L.kda.qkv, HK, 0}; break;
    case LoraKind::KdaK: if (kda) return LoraTarget{&L.kda.qkv, HK, HK}; break;
    case LoraKind::KdaV: if (kda) return LoraTarget{&L.kda.qkv, HK, 2 * HK}; break;
    case LoraKind::KdaO: if (kda) return whole(L.kda.o); break;
    case LoraKind::KdaFA: if (kda) return whole(L.kda.f_a); break;
    case LoraKind::KdaFB: if (kda) return whole(L.kda.f_b); break;
    case LoraKind::KdaGA: if (kda) return whole(L.kda.g_a); break;
    case LoraKind::KdaGB: if (kda) return whole(L.kda.g_b); break;
    case LoraKind::KdaB: if (kda) return whole(L.kda.b); break;
    case LoraKind::MlaQA: if (dsa) return whole(L.dsa.q_a); break;
    case LoraKind::MlaQB: if (dsa) return whole(L.dsa.q_b); break;
    case LoraKind::MlaKVA: if (dsa) return whole(L.dsa.kv_a); break;
    case LoraKind::MlaKVB: if (dsa) return whole(L.dsa.kv_b); break;
    case LoraKind::MlaO: if (dsa) return whole(L.dsa.o); break;
    case LoraKind::MlpGate: if (mlp) return part(L.mlp.gate_up, 2, 0); break;
    case LoraKind::MlpUp: if (mlp) return part(L.mlp.gate_up, 2, 1); break;
    case LoraKind::MlpDown: if (mlp) return whole(L.mlp.down); break;
    case LoraKind::SharedGate: if (shared) return part(L.moe.shared.gate_up, 2, 0); break;
    case LoraKind::SharedUp: if (shared) return part(L.moe.shared.gate_up, 2, 1); break;
    case LoraKind::SharedDown: if (shared) return whole(L.moe.shared.down); break;
    case LoraKind::ExpertGate: if (moe) return part(L.moe.experts[0].gate_up, 2, 0); break;
    case LoraKind::ExpertUp: if (moe) return part(L.moe.experts[0].gate_up, 2, 1); break;
    case LoraKind::ExpertDown: if (moe) return whole(L.moe.experts[0].down); break;
  }
  return {};
}

// How a LoRA module of the full model lands on one rank of a sharded one (the projection's own split): B's rows cut
// (an output-split projection: q, k, v, f_b, g_b, b, q_b, kv_b, gate, up), A's columns cut (an input-split one:
// o_proj, down), or whole (the replicated f_a, g_a, q_a, kv_a; the routed experts, whole on their EP rank).
// copies_a / copies_b: how many ranks of the world hold the same piece of dA / dB once lora_gradients has summed the
// shares.
struct LoraSplit {
  enum Kind { kWhole, kRows, kCols } kind = kWhole;
  int64_t begin = 0, count = 0;
  dist::Comm* partial = nullptr;  // the group over which this rank's dA / dB are shares
  bool partial_a = false, partial_b = false;
  int copies_a = 1, copies_b = 1;
};
LoraSplit lora_split(const CudaModel::Impl& m, LoraKind k, bool all_experts) {
  const ModelConfig& f = m.full;
  const int tp = m.shard.tp, tr = m.shard.tp_rank, world = std::lcm(m.shard.tp, m.shard.ep);
  LoraSplit s;
  s.copies_a = s.copies_b = world;
  if (lora_kind_is_expert(k)) {
    // One adapter per expert: on its EP rank only, complete. One for all experts: each EP rank's rows' share.
    s.partial = all_experts ? m.ep_comm : nullptr;
    s.partial_a = s.partial_b = all_experts;
    s.copies_a = s.copies_b = all_experts ? world : world / m.shard.ep;
    return s;
  }
  if (tp == 1) return s;
  const int64_t K = f.linear_head_dim, Hl = f.linear_num_heads / tp, NHl = f.num_attention_heads / tp;
  const int64_t dqk = f.qk_nope_head_dim, dv = f.v_head_dim;
  auto rows = [&](int64_t begin, int64_t count) {
    s.kind = LoraSplit::kRows, s.begin = begin, s.count = count;
    s.partial = m.tp_comm, s.partial_a = true;  // dA = s·(dy·B)ᵀ·x sums over the ranks' rows of B
    s.copies_b = world / tp;
  };
  auto cols = [&](int64_t begin, int64_t count) {
    s.kind = LoraSplit::kCols, s.begin = begin, s.count = count;
    s.partial = m.tp_comm, s.partial_b = true;  // dB = dyᵀ·u sums over the ranks' shares of u = s·x·Aᵀ
    s.copies_a = world / tp;
  };
  const cuda::WeightSource::Slice mlp = cuda::part_of(f.intermediate_size, tp, tr, 0),
                          shared = cuda::part_of(f.moe_intermediate_size * f.n_shared_experts, tp, tr, 0);
  switch (k) {
    case LoraKind::KdaQ: case LoraKind::KdaK: case LoraKind::KdaV: case LoraKind::KdaFB: case LoraKind::KdaGB:
      rows(tr * Hl * K, Hl * K); break;
    case LoraKind::KdaB: rows(tr * Hl, Hl); break;
    case LoraKind::KdaO: cols(tr * Hl * K, Hl * K); break;
    case LoraKind::MlaQB: rows(tr * NHl * dqk, NHl * dqk); break;
    case LoraKind::MlaKVB: rows(tr * NHl * (dqk + dv), NHl * (dqk + dv)); break;
    case LoraKind::MlaO: cols(tr * NHl * dv, NHl * dv); break;
    case LoraKind::MlpGate: case LoraKind::MlpUp: rows(mlp.begin, mlp.count); break;
    case LoraKind::MlpDown: cols(mlp.begin, mlp.count); break;
    case LoraKind::SharedGate: case LoraKind::SharedUp: rows(shared.begin, shared.count); break;
    case LoraKind::SharedDown: cols(shared.begin, shared.count); break;
    default:  // f_a, g_a, q_a, kv_a: replicated, their input and output gradients shares over TP
      s.partial = m.tp_comm, s.partial_a = s.partial_b = true;
      break;
  }
  return s;
}

// The rows [begin, begin + count) of t [R, C], or its columns.
Tensor cut_rows(const Tensor& t, int64_t begin, int64_t count) {
  const int64_t C = t.dim(1);
  Tensor out({count, C});
  std::copy_n(t.ptr() + begin * C, count * C, out.ptr());
  return out;
}
Tensor cut_cols(const Tensor& t, int64_t begin, int64_t count) {
  const int64_t R = t.dim(0), C = t.dim(1);
  Tensor out({R, count});
  for (int64_t r = 0; r < R; ++r) std::copy_n(t.ptr() + r * C + begin, count, out.ptr() + r * count);
  return out;
}

}  // namespace

namespace {

// The per-expert adapters that can run grouped (cuda/grouped_lora.h: the same rank, widths, place and scale for
// every expert, widths and row strides multiples of 8, rank ≤ 64) get device arrays of their experts' pointers.
void group_expert_adapters(const ModelConfig& c, cuda::LoraState& st) {
  std::vector<const void*> ptrs;
  std::vector<std::pair<cuda::LayerLora*, int>> runs;  // (layer, kind) of each run of 4·El pointers
  for (cuda::LayerLora& ll : st.layers) {
    if (ll.shared_experts) continue;
    for (int k = 0; k < kNumLoraKinds; ++k) {
      const std::vector<cuda::DAdapter>& v = ll.kinds[k];
      if (v.empty() || !lora_kind_is_expert(static_cast<LoraKind>(k))) continue;
      const cuda::DAdapter& a = v[0];
      bool ok = a.r >= 1 && a.r <= 64 && a.in % 8 == 0 && a.out % 8 == 0 && a.col0 % 8 == 0 &&
                c.hidden_size % 8 == 0 && c.moe_intermediate_size % 8 == 0;
      for (const cuda::DAdapter& d : v)
        ok = ok && d.r == a.r && d.in == a.in && d.out == a.out && d.col0 == a.col0 && d.scale == a.scale;
      if (!ok) continue;
      for (const cuda::DAdapter& d : v) ptrs.push_back(d.A);
      for (const cuda::DAdapter& d : v) ptrs.push_back(d.B);
      for (const cuda::DAdapter& d : v) ptrs.push_back(d.dA);
      for (const cuda::DAdapter& d : v) ptrs.push_back(d.dB);
      runs.emplace_back(&ll, k);
    }
  }
  if (runs.empty()) return;
  NEXTLM_CUDA_CHECK(cudaMalloc(&st.grouped_ptrs, ptrs.size() * sizeof(void*)));
  NEXTLM_CUDA_CHECK(cudaMemcpy(st.grouped_ptrs, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice));
  void** dev = static_cast<void**>(st.grouped_ptrs);
  for (const auto& [ll, k] : runs) {
    const size_t El = ll->kinds[k].size();
    cuda::LayerLora::Grouped& g = ll->grouped[k];
    g.A = reinterpret_cast<const cuda::bf16* const*>(dev);
    g.B = reinterpret_cast<const cuda::bf16* const*>(dev + El);
    g.dA = reinterpret_cast<float* const*>(dev + 2 * El);
    g.dB = reinterpret_cast<float* const*>(dev + 3 * El);
    dev += 4 * El;
  }
}

// LoraState::overwritten and cleared: the gradients of the per-expert adapters whose backward runs grouped (the
// expert projections' groups that LayerLora::runs_grouped, as the step's backward takes them) and the rest of the
// gradients' range.
void overwritten_grads(cuda::LoraState& st) {
  std::vector<std::pair<size_t, size_t>> over;
  const char* base = static_cast<const char*>(st.base);
  auto take = [&](const cuda::LayerLora& ll, std::initializer_list<LoraKind> group) {
    if (!ll.runs_grouped(group)) return;
    for (LoraKind k : group)
      for (const cuda::DAdapter& d : ll.kinds[static_cast<int>(k)]) {
        over.emplace_back(reinterpret_cast<const char*>(d.dA) - base, size_t(d.r * d.in) * sizeof(float));
        over.emplace_back(reinterpret_cast<const char*>(d.dB) - base, size_t(d.out * d.r) * sizeof(float));
      }
  };
  for (const cuda::LayerLora& ll : st.layers) {
    take(ll, {LoraKind::ExpertGate, LoraKind::ExpertUp});
    take(ll, {LoraKind::ExpertDown});
  }
  std::sort(over.begin(), over.end());
  st.overwritten.clear();
  for (const auto& [at, bytes] : over) {
    if (!st.overwritten.empty() && st.overwritten.back().first + st.overwritten.back().second == at)
      st.overwritten.back().second += bytes;
    else
      st.overwritten.emplace_back(at, bytes);
  }
  st.cleared.clear();
  size_t at = st.grads_at;
  for (const auto& [o, bytes] : st.overwritten) {
    check(o >= at && o + bytes <= st.grads_at + st.grads_bytes, "LoRA: an adapter gradient outside the gradients");
    if (o > at) st.cleared.emplace_back(at, o - at);
    at = o + bytes;
  }
  if (st.grads_at + st.grads_bytes > at) st.cleared.emplace_back(at, st.grads_at + st.grads_bytes - at);
  st.unwritten = false;
}

}  // namespace

void CudaModel::set_lora(const LoraAdapter& adapter) {
  Impl& m = *impl_;
  m.weights_changed();
  // The copies below (the legacy stream's) replace what the model's stream may still read or write (an optimizer
  // update still running).
  m.join_lora_update();
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  const ModelConfig& c = m.cfg;
  const std::vector<LoraModule>& mods = adapter.modules();
  std::vector<std::tuple<int, int64_t, int64_t, int64_t>> keys;
  for (const LoraModule& mod : mods) keys.emplace_back(static_cast<int>(mod.kind), mod.layer, mod.expert, mod.rank);
  if (!m.lora || m.lora->keys != keys) {
    // A new layout: place every module, then carve its buffers out of one allocation (gradients zeroed).
    auto st = std::make_unique<cuda::LoraState>();
    st->keys = keys;
    st->layers.resize(m.layers.size());
    const int64_t E = c.n_routed_experts;
    size_t bytes = 0;
    auto take = [&](size_t n) {
      const size_t at = bytes;
      bytes += (n + 255) & ~size_t{255};
      return at;
    };
    std::vector<std::array<size_t, 4>> at;  // per module: the offsets of A, B, dA, dB (first the sizes of A and B)
    for (const LoraModule& mod : mods) {
      check(mod.layer >= 0 && mod.layer < static_cast<int64_t>(m.layers.size()), "LoRA module on layer ", mod.layer,
            ", the model has ", m.layers.size());
      const cuda::DLayer& L = m.layers[mod.layer];
      const LoraTarget tgt = lora_target(c, L, mod.kind);
      check(tgt.W != nullptr, "LoRA module ", lora_kind_info(mod.kind).path, " has no projection on layer ",
            mod.layer);
      // The module's shapes on this rank (its B rows or A columns on a shard).
      const LoraSplit sp = lora_split(m, mod.kind, mod.expert == LoraModule::kAllExperts);
      const int64_t out = sp.kind == LoraSplit::kRows ? sp.count : mod.B.dim(0),
                    in = sp.kind == LoraSplit::kCols ? sp.count : mod.A.dim(1);
      check(out == tgt.out && in == tgt.W->in && mod.A.dim(0) == mod.rank && mod.B.dim(1) == mod.rank,
            "LoRA module ", lora_kind_info(mod.kind).path, " of layer ", mod.layer, ": shapes [", mod.A.dim(0), ", ",
            mod.A.dim(1), "] and [", mod.B.dim(0), ", ", mod.B.dim(1), "] do not fit its projection");
      cuda::LayerLora& ll = st->layers[mod.layer];
      std::vector<cuda::DAdapter>& v = ll.kinds[static_cast<int>(mod.kind)];
      int64_t slot = 0;
      if (lora_kind_is_expert(mod.kind) && mod.expert != LoraModule::kAllExperts) {
        check(mod.expert >= 0 && mod.expert < E, "LoRA module for expert ", mod.expert, " of ", E);
        // Only the experts held here (all of them unless expert-parallel), by their place among them.
        if (mod.expert < m.expert_begin || mod.expert >= m.expert_begin + m.local_experts) {
          st->order.push_back(nullptr);
          at.push_back({});
          continue;
        }
        if (v.empty()) v.resize(m.local_experts);
        slot = mod.expert - m.expert_begin;
      } else {
        if (lora_kind_is_expert(mod.kind)) ll.shared_experts = true;
        check(v.empty(), "two LoRA modules on ", lora_kind_info(mod.kind).path, " of layer ", mod.layer);
        v.resize(1);
      }
      cuda::DAdapter& d = v[slot];
      d.out = tgt.out, d.in = tgt.W->in, d.r = mod.rank, d.col0 = tgt.col0;
      d.scale = static_cast<float>(mod.scale);
      const int64_t na = d.r * d.in, nb = d.out * d.r;
      at.push_back({static_cast<size_t>(na), static_cast<size_t>(nb), 0, 0});
      st->order.push_back(&d);
    }
    // Placement: first each layer's dense adapters of an input group (lora_input_groups), back to back in the
    // group's order, so that the training step can stack their A and dA (Step::stack_group); then the others. Every
    // A, then every B; then the gradients in the same order, in one range: zero_grads clears them with one memset
    // however many adapters there are (2636 of them with one adapter per expert on the slice).
    std::vector<size_t> place;  // module indices in placement order
    std::vector<char> packed;   // per place: whether it follows the one before back to back (a group's next member)
    {
      std::map<std::pair<int64_t, int>, size_t> dense;  // (layer, kind) → module, for the dense kinds
      for (size_t i = 0; i < mods.size(); ++i)
        if (st->order[i] && !lora_kind_is_expert(mods[i].kind))
          dense[{mods[i].layer, static_cast<int>(mods[i].kind)}] = i;
      std::vector<char> placed(mods.size(), 0);
      for (int64_t l = 0; l < static_cast<int64_t>(m.layers.size()); ++l)
        for (const std::vector<LoraKind>& kinds : lora_input_groups()) {
          bool first = true;
          for (LoraKind k : kinds)
            if (const auto it = dense.find({l, static_cast<int>(k)}); it != dense.end()) {
              // Back to back when the A before it has the same size, a multiple of 16 bytes (aligned for cuBLASLt).
              const size_t na = at[it->second][0];
              packed.push_back(!first && na == at[place.back()][0] && na * 2 % 16 == 0);
              place.push_back(it->second);
              placed[it->second] = 1;
              first = false;
            }
        }
      for (size_t i = 0; i < mods.size(); ++i)
        if (st->order[i] && !placed[i]) place.push_back(i), packed.push_back(0);
    }
    for (size_t i : place) at[i][2] = at[i][0], at[i][3] = at[i][1];  // the sizes, for the gradients
    // A packed A or dA starts where the one before ended (the previous take() reserved its rounded size: give back
    // the rounding first).
    auto place_run = [&](int slot, size_t elem_bytes, int size_slot) {
      size_t end = 0;
      for (size_t p = 0; p < place.size(); ++p) {
        const size_t i = place[p], n = at[i][size_slot] * elem_bytes;
        if (packed[p]) bytes = end;
        at[i][slot] = take(n);
        end = at[i][slot] + n;
      }
    };
    place_run(0, 2, 2);
    for (size_t i : place) at[i][1] = take(at[i][3] * 2);
    st->grads_at = bytes;
    place_run(2, 4, 2);
    for (size_t i : place) at[i][3] = take(at[i][3] * 4);
    st->grads_bytes = bytes - st->grads_at;
    for (const cuda::LayerLora& ll : st->layers)
      for (const auto& v : ll.kinds)
        for (const cuda::DAdapter& d : v) check(d.r > 0, "LoRA: per-expert adapters must cover every expert");
    NEXTLM_CUDA_CHECK(cudaMalloc(&st->base, std::max<size_t>(bytes, 1)));
    st->bytes = bytes;
    char* base = static_cast<char*>(st->base);
    for (size_t i = 0; i < st->order.size(); ++i) {
      if (!st->order[i]) continue;  // an expert held by another rank
      cuda::DAdapter& d = *st->order[i];
      d.A = reinterpret_cast<cuda::bf16*>(base + at[i][0]);
      d.B = reinterpret_cast<cuda::bf16*>(base + at[i][1]);
      d.dA = reinterpret_cast<float*>(base + at[i][2]);
      d.dB = reinterpret_cast<float*>(base + at[i][3]);
    }
    NEXTLM_CUDA_CHECK(cudaMemset(st->base, 0, std::max<size_t>(bytes, 1)));
    group_expert_adapters(c, *st);
    overwritten_grads(*st);
    m.lora = std::move(st);
  }
  m.lora->opt.reset();  // the host's values replace the device optimizer's
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  std::vector<uint16_t> bits;
  auto up = [&](const Tensor& t, cuda::bf16* dst) {
    bits.resize(t.data.size());
    for (size_t i = 0; i < bits.size(); ++i) bits[i] = f32_to_bf16(t.data[i]);
    NEXTLM_CUDA_CHECK(cudaMemcpy(dst, bits.data(), bits.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
  };
  for (size_t i = 0; i < mods.size(); ++i) {
    if (!m.lora->order[i]) continue;
    const LoraSplit sp = lora_split(m, mods[i].kind, mods[i].expert == LoraModule::kAllExperts);
    up(sp.kind == LoraSplit::kCols ? cut_cols(mods[i].A, sp.begin, sp.count) : mods[i].A, m.lora->order[i]->A);
    up(sp.kind == LoraSplit::kRows ? cut_rows(mods[i].B, sp.begin, sp.count) : mods[i].B, m.lora->order[i]->B);
  }
  // The copies from pageable memory may return before their DMA lands; the model's stream does not wait for them.
  NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());
}

void CudaModel::lora_gradients(LoraAdapter& adapter) const {
  const Impl& m = *impl_;
  check(m.lora != nullptr, "no LoRA adapter on the device (set_lora)");
  std::vector<LoraModule>& mods = adapter.modules();
  check(mods.size() == m.lora->order.size(), "LoRA gradients: the adapter has ", mods.size(), " modules, the device ",
        m.lora->order.size());
  m.join_lora_update();
  settle_lora_grads(m);
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  // On a shard: the shares summed over their group (in a device temporary), then this rank's piece added at its
  // place weighted 1/copies, so that what the world's ranks add sums to the gradient.
  std::vector<float> buf;
  float* sum = nullptr;
  auto fetch = [&](const float* src, int64_t n, dist::Comm* group) {
    buf.resize(static_cast<size_t>(n));
    if (group && group->size() > 1) {
      if (!sum) NEXTLM_CUDA_CHECK(cudaMalloc(&sum, m.lora->bytes));
      NEXTLM_CUDA_CHECK(cudaMemcpyAsync(sum, src, n * sizeof(float), cudaMemcpyDeviceToDevice, m.stream));
      group->all_reduce_sum(sum, static_cast<size_t>(n));
      NEXTLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
      src = sum;
    }
    NEXTLM_CUDA_CHECK(cudaMemcpy(buf.data(), src, n * sizeof(float), cudaMemcpyDeviceToHost));
  };
  for (size_t i = 0; i < mods.size(); ++i) {
    const cuda::DAdapter* d = m.lora->order[i];
    if (!d) continue;
    const LoraSplit sp = lora_split(m, mods[i].kind, mods[i].expert == LoraModule::kAllExperts);
    Tensor& dA = mods[i].dA;
    fetch(d->dA, d->r * d->in, sp.partial_a ? sp.partial : nullptr);
    const float wa = 1.0f / static_cast<float>(sp.copies_a), wb = 1.0f / static_cast<float>(sp.copies_b);
    const int64_t col0 = sp.kind == LoraSplit::kCols ? sp.begin : 0;
    for (int64_t r = 0; r < d->r; ++r)
      for (int64_t j = 0; j < d->in; ++j) dA.data[r * dA.dim(1) + col0 + j] += wa * buf[r * d->in + j];
    Tensor& dB = mods[i].dB;
    fetch(d->dB, d->out * d->r, sp.partial_b ? sp.partial : nullptr);
    const int64_t row0 = sp.kind == LoraSplit::kRows ? sp.begin : 0;
    for (int64_t j = 0; j < d->out * d->r; ++j) dB.data[row0 * d->r + j] += wb * buf[j];
  }
  if (sum) cudaFree(sum);
}

namespace {

// The device optimizer's tensors in LoraAdapter::params() order (each module's A, then B), checking that the adapter
// is the one placed on the device, whole (not a shard's part).
const cuda::LoraState& whole_lora(const CudaModel::Impl& m, const LoraAdapter& adapter) {
  check(m.lora != nullptr, "no LoRA adapter on the device (set_lora)");
  check(m.shard.tp == 1 && m.shard.ep == 1, "the device LoRA optimizer runs on one GPU, not on a shard");
  check(adapter.modules().size() == m.lora->order.size(), "LoRA optimizer: the adapter has ",
        adapter.modules().size(), " modules, the device ", m.lora->order.size());
  return *m.lora;
}

}  // namespace

void CudaModel::start_lora_optimizer(const LoraAdapter& adapter, const AdamW* state) {
  Impl& m = *impl_;
  m.join_lora_update();
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));  // as set_lora: an update may still be running
  const cuda::LoraState& ls = whole_lora(m, adapter);
  const std::vector<LoraModule>& mods = adapter.modules();
  const size_t count = 2 * mods.size();
  const bool moments = state && !state->m().empty();
  if (moments)
    check(state->m().size() == count && state->v().size() == count, "LoRA optimizer: ", state->m().size(),
          " moments for ", count, " tensors");
  auto opt = std::make_unique<cuda::LoraState::Optimizer>();
  opt->host.resize(count);
  // One allocation: per tensor w, m, v (256-byte aligned), then the descriptors, the workspace and the norm.
  std::vector<int64_t> sizes(count);
  size_t bytes = 0;
  auto take = [&](size_t n) {
    const size_t at = bytes;
    bytes += (n + 255) & ~size_t{255};
    return at;
  };
  std::vector<std::array<size_t, 3>> at(count);
  for (size_t i = 0; i < mods.size(); ++i) {
    sizes[2 * i] = mods[i].A.numel(), sizes[2 * i + 1] = mods[i].B.numel();
    for (size_t j : {2 * i, 2 * i + 1})
      for (size_t& a : at[j]) a = take(static_cast<size_t>(sizes[j]) * sizeof(float));
  }
  for (size_t j = 0; j < count; ++j) opt->host[j].n = sizes[j];
  opt->chunks = cuda::optim_chunks(opt->host.data(), static_cast<int>(count));
  // The update's runs (Optimizer::runs): the tensors of one layer each where the modules come layer by layer, as
  // LoraAdapter makes them; else one run of them all.
  bool by_layer = true;
  for (size_t i = 1; i < mods.size(); ++i) by_layer = by_layer && mods[i].layer >= mods[i - 1].layer;
  int64_t run_bytes = 0;
  for (size_t i = 0; i < mods.size();) {
    size_t j = i;
    while (j < mods.size() && (!by_layer || mods[j].layer == mods[i].layer)) ++j;
    const int first = static_cast<int>(2 * i), n = static_cast<int>(2 * (j - i));
    const int64_t chunks = cuda::optim_chunks(opt->host.data() + first, n);
    opt->runs.push_back({by_layer ? mods[i].layer : -1, first, n, chunks});
    run_bytes = std::max(run_bytes, cuda::optim_workspace_bytes(n, chunks));
    i = j;
  }
  const size_t at_params = take(count * sizeof(cuda::DeviceParam)),
               at_ws = take(static_cast<size_t>(cuda::optim_workspace_bytes(static_cast<int>(count), opt->chunks))),
               at_sq = take(sizeof(double)), at_uws = take(static_cast<size_t>(run_bytes));
  NEXTLM_CUDA_CHECK(cudaMalloc(&opt->base, std::max<size_t>(bytes, 1)));
  NEXTLM_CUDA_CHECK(cudaMemset(opt->base, 0, std::max<size_t>(bytes, 1)));
  char* base = static_cast<char*>(opt->base);
  const std::vector<ParamRef> refs = const_cast<LoraAdapter&>(adapter).params("");
  for (size_t i = 0; i < mods.size(); ++i) {
    const cuda::DAdapter& d = *ls.order[i];
    for (int half = 0; half < 2; ++half) {
      const size_t j = 2 * i + half;
      cuda::DeviceParam& p = opt->host[j];
      p.w = reinterpret_cast<float*>(base + at[j][0]);
      p.m = reinterpret_cast<float*>(base + at[j][1]);
      p.v = reinterpret_cast<float*>(base + at[j][2]);
      p.g = half ? d.dB : d.dA;
      p.w16 = half ? d.B : d.A;
      p.decay = refs[j].decay ? 1 : 0;
      const Tensor& t = half ? mods[i].B : mods[i].A;
      NEXTLM_CUDA_CHECK(cudaMemcpy(p.w, t.data.data(), sizes[j] * sizeof(float), cudaMemcpyHostToDevice));
      if (moments) {
        check(static_cast<int64_t>(state->m()[j].size()) == sizes[j] &&
                  static_cast<int64_t>(state->v()[j].size()) == sizes[j],
              "LoRA optimizer: moments of ", refs[j].name, " have the wrong size");
        NEXTLM_CUDA_CHECK(cudaMemcpy(p.m, state->m()[j].data(), sizes[j] * sizeof(float), cudaMemcpyHostToDevice));
        NEXTLM_CUDA_CHECK(cudaMemcpy(p.v, state->v()[j].data(), sizes[j] * sizeof(float), cudaMemcpyHostToDevice));
      }
    }
  }
  opt->params = reinterpret_cast<cuda::DeviceParam*>(base + at_params);
  opt->workspace = base + at_ws;
  opt->sq = reinterpret_cast<double*>(base + at_sq);
  opt->update_workspace = base + at_uws;
  NEXTLM_CUDA_CHECK(cudaMemcpy(opt->params, opt->host.data(), count * sizeof(cuda::DeviceParam),
                               cudaMemcpyHostToDevice));
  NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());  // as in set_lora: the copies' DMA has landed before the stream reads
  m.lora->opt = std::move(opt);
}

namespace {

// lora_adamw_step's update on update_stream, after what `stream` has queued (the norm): one adamw_update a run of
// Optimizer::runs, each layer's event recorded after its run (a run of every layer records them all).
void update_beside(CudaModel::Impl& m, const cuda::LoraState::Optimizer& opt, float scale, double max_norm, double lr,
                   const AdamWOptions& o, int64_t t) {
  if (!m.update_stream) {
    NEXTLM_CUDA_CHECK(cudaStreamCreateWithFlags(&m.update_stream, cudaStreamNonBlocking));
    NEXTLM_CUDA_CHECK(cudaEventCreateWithFlags(&m.update_start, cudaEventDisableTiming));
    NEXTLM_CUDA_CHECK(cudaEventCreateWithFlags(&m.update_done, cudaEventDisableTiming));
  }
  while (m.update_ev.size() < m.layers.size()) {
    cudaEvent_t e = nullptr;
    NEXTLM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    m.update_ev.push_back(e);
  }
  m.update_has.assign(m.layers.size(), false);
  NEXTLM_CUDA_CHECK(cudaEventRecord(m.update_start, m.stream));
  NEXTLM_CUDA_CHECK(cudaStreamWaitEvent(m.update_stream, m.update_start, 0));
  for (const cuda::LoraState::Optimizer::Run& r : opt.runs) {
    cuda::adamw_update(opt.params + r.first, r.count, r.chunks, opt.sq, scale, max_norm, lr, o.beta1, o.beta2, o.eps,
                       o.weight_decay, t, opt.update_workspace, m.update_stream);
    for (size_t i = 0; i < m.layers.size(); ++i)
      if (r.layer < 0 || static_cast<int64_t>(i) == r.layer) {
        NEXTLM_CUDA_CHECK(cudaEventRecord(m.update_ev[i], m.update_stream));
        m.update_has[i] = true;
      }
  }
  NEXTLM_CUDA_CHECK(cudaEventRecord(m.update_done, m.update_stream));
  m.update_pending = true;
}

}  // namespace

double CudaModel::lora_adamw_step(const AdamWOptions& o, double lr, int64_t t, double grad_scale, double max_norm) {
  impl_->weights_changed();
  Impl& m = *impl_;
  check(m.lora && m.lora->opt, "no device LoRA optimizer (start_lora_optimizer)");
  cuda::LoraState::Optimizer& opt = *m.lora->opt;
  m.join_lora_update();  // two updates without a forward between them
  settle_lora_grads(m);
  const int count = static_cast<int>(opt.host.size());
  const float scale = static_cast<float>(grad_scale);
  cuda::grad_sq_norm(opt.params, count, opt.chunks, scale, opt.sq, opt.workspace, m.stream);
  double* sq = static_cast<double*>(m.norm_host.get(sizeof(double)));
  NEXTLM_CUDA_CHECK(cudaMemcpyAsync(sq, opt.sq, sizeof(double), cudaMemcpyDeviceToHost, m.stream));
  NEXTLM_CUDA_CHECK(cudaEventRecord(m.norm_ev, m.stream));
  if (m.lora_update_beside && !m.sharded()) {
    // Layer by layer on update_stream, beside the next forward (Impl::update_stream); the same kernels on the same
    // tensors, so the same bits.
    update_beside(m, opt, scale, max_norm, lr, o, t);
  } else {
    cuda::adamw_update(opt.params, count, opt.chunks, opt.sq, scale, max_norm, lr, o.beta1, o.beta2, o.eps,
                       o.weight_decay, t, opt.workspace, m.stream);
  }
  // The norm is back before the update has run: the host goes on (the next step's plan, its launches) meanwhile.
  NEXTLM_CUDA_CHECK(cudaEventSynchronize(m.norm_ev));
  return std::sqrt(*sq);
}

void CudaModel::download_lora(LoraAdapter& adapter, AdamW* state) const {
  const Impl& m = *impl_;
  whole_lora(m, adapter);
  check(m.lora->opt != nullptr, "no device LoRA optimizer (start_lora_optimizer)");
  const cuda::LoraState::Optimizer& opt = *m.lora->opt;
  std::vector<LoraModule>& mods = adapter.modules();
  m.join_lora_update();
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  if (state) {
    state->m().resize(opt.host.size());
    state->v().resize(opt.host.size());
  }
  for (size_t j = 0; j < opt.host.size(); ++j) {
    const cuda::DeviceParam& p = opt.host[j];
    Tensor& t = j % 2 ? mods[j / 2].B : mods[j / 2].A;
    check(t.numel() == p.n, "LoRA optimizer: module ", j / 2, " changed shape");
    NEXTLM_CUDA_CHECK(cudaMemcpy(t.data.data(), p.w, p.n * sizeof(float), cudaMemcpyDeviceToHost));
    if (state) {
      state->m()[j].resize(static_cast<size_t>(p.n));
      state->v()[j].resize(static_cast<size_t>(p.n));
      NEXTLM_CUDA_CHECK(cudaMemcpy(state->m()[j].data(), p.m, p.n * sizeof(float), cudaMemcpyDeviceToHost));
      NEXTLM_CUDA_CHECK(cudaMemcpy(state->v()[j].data(), p.v, p.n * sizeof(float), cudaMemcpyDeviceToHost));
    }
  }
}

void CudaModel::set_train_linears(bool on) { impl_->train_linears = on; }
void CudaModel::set_train_small(bool on) { impl_->train_small = on; }

void CudaModel::set_recompute(const RecomputePolicy& policy) {
  Impl& m = *impl_;
  // A shard cannot run a step again alone (its collectives would wait for the other ranks).
  m.recompute = m.sharded() ? fixed_recompute(policy) : policy;
  m.weights_changed();  // not a weight, but the batches so far were run under another policy
}
const RecomputePolicy& CudaModel::recompute() const { return impl_->recompute; }
void CudaModel::set_activation_limit(size_t bytes) { impl_->arena.set_limit(bytes); }
size_t CudaModel::activation_peak() const { return impl_->arena.peak(); }

ModelWeights CudaModel::gradients() const {
  using cuda::download;
  const Impl& m = *impl_;
  const ModelConfig& c = m.cfg;
  check(m.grads != nullptr, "no gradients yet: run forward_backward first");
  m.join_lora_update();
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  const cuda::Grads& g = *m.grads;
  // On a shard: this rank's slices (the layout of dist::ShardedModel, which dist::gather_gradients assembles), the
  // embedding and lm_head its vocabulary rows.
  const int64_t V = m.vocab_rows, D = c.hidden_size, S = c.hc_mult, M = (2 + S) * S;
  auto t = [](std::vector<int64_t> shape) { return Tensor(std::move(shape)); };
  ModelWeights w;
  w.embed = t({V, D});
  download(g.embed, w.embed);
  w.final_norm = t({D});
  download(g.final_norm, w.final_norm);
  w.lm_head = t({V, D});
  download(g.lm_head, w.lm_head);
  if (c.tie_word_embeddings) {
    for (int64_t i = 0; i < w.embed.numel(); ++i) w.embed.data[i] += w.lm_head.data[i];
    std::fill(w.lm_head.data.begin(), w.lm_head.data.end(), 0.0f);
  }
  auto mlp = [&](const cuda::GMlp& gm, int64_t I) {
    MlpWeights x{t({I, D}), t({I, D}), t({D, I})};
    download(gm.gate_up, x.gate);
    download(gm.gate_up, x.up, I * D);
    download(gm.down, x.down);
    return x;
  };
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const cuda::DLayer& L = m.layers[i];
    const cuda::GLayer& G = g.layers[i];
    LayerWeights lw;
    auto hc = [&](const cuda::GHc& h) {
      HcWeights x{t({M, S * D}), t({M}), t({3})};
      download(h.fn, x.fn);
      download(h.base, x.base);
      download(h.scale, x.scale);
      return x;
    };
    lw.hc_attn = hc(G.hc_attn);
    lw.hc_ffn = hc(G.hc_ffn);
    lw.input_norm = t({D});
    download(G.in_norm, lw.input_norm);
    lw.post_attention_norm = t({D});
    download(G.post_norm, lw.post_attention_norm);
    if (L.kda_layer) {
      const int64_t H = c.linear_num_heads, K = c.linear_head_dim, HK = H * K, W = c.linear_conv_kernel_dim;
      const cuda::GKda& k = G.kda;
      KdaWeights x{t({HK, D}), t({HK, D}), t({HK, D}), t({HK, W}), t({HK, W}), t({HK, W}), t({K, D}), t({HK, K}),
                   t({HK}),    t({H}),     t({H, D}),  t({K, D}),  t({HK, K}), t({K}),     t({D, HK})};
      download(k.qkv, x.q_proj);
      download(k.qkv, x.k_proj, HK * D);
      download(k.qkv, x.v_proj, 2 * HK * D);
      download(k.conv, x.q_conv);
      download(k.conv, x.k_conv, HK * W);
      download(k.conv, x.v_conv, 2 * HK * W);
      download(k.f_a, x.f_a);
      download(k.f_b, x.f_b);
      download(k.dt_bias, x.dt_bias);
      download(k.A_log, x.A_log);
      download(k.b, x.b_proj);
      download(k.g_a, x.g_a);
      download(k.g_b, x.g_b);
      download(k.o_norm, x.o_norm);
      download(k.o, x.o_proj);
      lw.kda = std::move(x);
    } else {
      const int64_t NH = c.num_attention_heads, dqk = c.qk_nope_head_dim, dv = c.v_head_dim, QL = c.q_lora_rank,
                    KL = c.kv_lora_rank;
      const cuda::GDsa& d = G.dsa;
      DsaWeights x{t({QL, D}), t({QL}), t({NH * dqk, QL}), t({KL, D}), t({KL}), t({NH * (dqk + dv), KL}),
                   t({D, NH * dv}), std::nullopt};
      download(d.q_a, x.q_a);
      download(d.q_a_norm, x.q_a_norm);
      download(d.q_b, x.q_b);
      download(d.kv_a, x.kv_a);
      download(d.kv_a_norm, x.kv_a_norm);
      download(d.kv_b, x.kv_b);
      download(d.o, x.o_proj);
      lw.dsa = std::move(x);
    }
    if (L.moe_layer) {
      MoeWeights x;
      x.router = t({c.n_routed_experts, D});
      if (m.ep_comm && G.moe.router) {
        // Each EP rank's share (from its experts' routing weights), summed here: the router is replicated.
        const int64_t n = c.n_routed_experts * D;
        float* sum = nullptr;
        NEXTLM_CUDA_CHECK(cudaMalloc(&sum, n * sizeof(float)));
        NEXTLM_CUDA_CHECK(cudaMemcpyAsync(sum, G.moe.router, n * sizeof(float), cudaMemcpyDeviceToDevice, m.stream));
        m.ep_comm->all_reduce_sum(sum, static_cast<size_t>(n));
        NEXTLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
        download(sum, x.router);
        cudaFree(sum);
      } else {
        download(G.moe.router, x.router);
      }
      for (const cuda::GMlp& e : G.moe.experts) x.experts.push_back(mlp(e, c.moe_intermediate_size));
      if (L.moe.has_shared) x.shared = mlp(G.moe.shared, L.moe.shared.I);
      lw.moe = std::move(x);
    } else {
      lw.mlp = mlp(G.mlp, L.mlp.I);
    }
    w.layers.push_back(std::move(lw));
  }
  return w;
}

}  // namespace nextlm
