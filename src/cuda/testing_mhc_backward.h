// Host-side entry points to the mHC / RMSNorm backward kernels (src/cuda/mhc_backward.cu), for the kernel tests:
// host vectors in, the gradient buffers uploaded with their values (the kernels accumulate), run, downloaded.
// Workspaces are poisoned with NaN, so a read of an element the kernels did not write shows.
#pragma once
#include <cstdint>
#include <vector>

namespace nextlm::cuda_testing {

// cuda::mhc_pre_backward on h [T, S, D] with fn [(2+S)S, S·D], base [(2+S)S], scale [3], norm_w [D] and the output
// gradients dpost [T, S], dcomb [T, S, S], da [T, D] (an empty vector passes null). dh [T, S, D], dfn, dbase,
// dscale, dnorm_w are added to. forward_mix: cuda::mhc_pre first writes h's mix (into NaN), which the backward
// then takes (as training's backward does).
void mhc_pre_backward(const std::vector<float>& h, const std::vector<float>& fn, const std::vector<float>& base,
                      const std::vector<float>& scale, const std::vector<float>& norm_w,
                      const std::vector<float>& dpost, const std::vector<float>& dcomb, const std::vector<float>& da,
                      int64_t T, int64_t S, int64_t D, float rms_eps, float hc_eps, int iters, std::vector<float>& dh,
                      std::vector<float>& dfn, std::vector<float>& dbase, std::vector<float>& dscale,
                      std::vector<float>& dnorm_w, bool forward_mix = false);

// A site's backward with its mHC frozen, as training runs it (written, not added: outputs start as NaN): the
// post-mix's backward (cuda::mhc_post_backward on h_out's gradient dout, y, post, comb) and then the pre-mix's
// (cuda::mhc_pre_backward on h with fn, base, scale, norm_w, the forward's mix, that dpost and dcomb, and da), with
// fold: the pre-mix's forming the post-mix's dh term (the post-mix's given no dh), else the post-mix's writing dh
// and the pre-mix's adding to it. dh [T, S, D], dy [T, D], dpost [T, S], dcomb [T, S, S] come out.
void mhc_site_backward_frozen(const std::vector<float>& h, const std::vector<float>& y, const std::vector<float>& post,
                              const std::vector<float>& comb, const std::vector<float>& dout,
                              const std::vector<float>& fn, const std::vector<float>& base,
                              const std::vector<float>& scale, const std::vector<float>& norm_w,
                              const std::vector<float>& da, int64_t T, int64_t S, int64_t D, float rms_eps,
                              float hc_eps, int iters, bool fold, std::vector<float>& dh, std::vector<float>& dy,
                              std::vector<float>& dpost, std::vector<float>& dcomb);

// cuda::mhc_post_backward: dh [T, S, D], dy [T, D], dpost [T, S], dcomb [T, S, S] are added to, or without
// accumulate written (their device buffers then start as NaN, so an element left unwritten shows). With dy16, dy's
// bf16 bits too (written, from NaN); with fp32_dy false the kernel gets no fp32 dy (dy is left alone).
void mhc_post_backward(const std::vector<float>& h, const std::vector<float>& y, const std::vector<float>& post,
                       const std::vector<float>& comb, const std::vector<float>& dout, int64_t T, int64_t S, int64_t D,
                       std::vector<float>& dh, std::vector<float>& dy, std::vector<float>& dpost,
                       std::vector<float>& dcomb, bool accumulate = true, std::vector<uint16_t>* dy16 = nullptr,
                       bool fp32_dy = true);

// cuda::mhc_post, the forward's post-mix: the new streams [T, S, D] from h [T, S, D] and y [T, D], in place
// (in_place) or into a separate output; h_after gets what h's device buffer holds afterwards.
std::vector<float> mhc_post(const std::vector<float>& h, const std::vector<float>& y, const std::vector<float>& post,
                            const std::vector<float>& comb, int64_t T, int64_t S, int64_t D, bool in_place,
                            std::vector<float>& h_after);

// cuda::rmsnorm_backward on x [rows, ldx] (the first n columns of each row are the norm's input), w [n] (empty:
// unweighted), dy [rows, n]: dx [rows, n] and dw [n] (unused when w is empty) are added to.
void rmsnorm_backward(const std::vector<float>& x, int64_t ldx, const std::vector<float>& w,
                      const std::vector<float>& dy, int64_t rows, int64_t n, float eps, std::vector<float>& dx,
                      std::vector<float>& dw);

// cuda::stream_mean_norm_backward: dh [T, S, D] (without accumulate: written, its device buffer starting as NaN)
// and dw [D] are added to.
void stream_mean_norm_backward(const std::vector<float>& h, const std::vector<float>& w,
                               const std::vector<float>& dout, int64_t T, int64_t S, int64_t D, float eps,
                               std::vector<float>& dh, std::vector<float>& dw, bool accumulate = true);

}  // namespace nextlm::cuda_testing
