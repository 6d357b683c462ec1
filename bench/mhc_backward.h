// The backward of one mHC site (src/cuda/mhc_backward.cu), and its post-mix fused with the next site's projection
// (src/cuda/mhc.cu), at the 4-layer slice's full width, against their byte floors.
#pragma once
#include <string>

namespace nextlm::bench {

// `mhc_bwd_T4096`: cuda::mhc_post_backward then cuda::mhc_pre_backward (fed the post backward's dpost and dcomb),
// as the training step runs them at a site, at T = 4096, S = 4, D = 4096 on random inputs; median of CUDA-event
// timings. One JSON line {"case", "ours_ms", "floor_ms", "note"}: the floor is the bytes both must move at 4.14 TB/s
// (post: dout, h, y read, dy and dh read and written; pre: h and da read twice, dh read and written, fn read, dfn
// read and written). The note has each half's median, whether every output is finite, and whether two runs of the
// pre backward from the same gradients gave the same bits. `mhc_bwd_T4096_forward_mix`: the pre backward given the
// forward's mix (mhc_pre's, made once untimed), as the training step runs it. `mhc_bwd_frozen_T4096`: a frozen
// site's (a LoRA step's: dh alone, the forward's mix), the pre backward forming the post backward's dh term
// (mhc_pre_backward's dout and comb) against the post backward writing it, alternately; "peer_ms" is the latter, and
// the note says whether both gave the same dh bits.
void mhc_backward_case(const std::string& name);

// `mhc_post_project_T4096`: a site's post-mix with the next site's projection (cuda::mhc_post_project, as the
// training forward and the prefill run it) at T = 4096, S = 4, D = 4096: the fused kernel ("ours_ms") against the
// post-mix and projection kernels ("peer_ms"), alternately; the floor is the fused form's bytes (h and y read, the
// new streams written) at 4.14 TB/s. The note says whether both gave the same new streams and partials bit for bit.
void mhc_post_project_case(const std::string& name);

}  // namespace nextlm::bench
