// The training backward's activation-recompute policy (what `--recompute` sets), shared by the CPU trainer
// (model/train.h) and the device one (cuda/device_model.h).
#pragma once
#include <optional>
#include <string>

namespace nextlm {

// Which sub-layers the training backward runs forward again and which keep their activations from the forward.
// Each component either recomputes (true: the forward keeps nothing of it, and its forward runs again, with its
// activations kept, right before its backward: one layer's activations alive at a time) or keeps (false: the forward
// keeps what its backward reads, for every layer, so its forward runs once). Every policy gives the same loss and
// gradients bit for bit: the same functions run on the same inputs, only at other times. What "keep" keeps:
//   kda  KdaActs (16 [T, H·K] buffers, the gates' [T, K] inputs and beta) and the output [T, D] of every KDA layer;
//   mla  DsaActs (q and kv latents, q, kv [T, NH·(dqk+dv)], o) and the output of every DSA layer;
//   moe  the output [T, D] of every MoE layer (the routing is kept under every policy);
//   experts (GPU only; counts only with moe recomputed) the routed experts' gate|up projection: kept, a recomputed
//        MoE keeps its fp32 pre-activations and bf16 act (n·2I·4 + n·I·2 bytes a layer, n = T·top-k rows: the MoE's
//        own buffers, sized for all n rows on an expert-parallel rank too), so that its recomputation skips the
//        costliest part of the sub-layer, the grouped GEMM that reads every expert's gate|up weights;
//   mlp  the output [T, D] of every dense-MLP layer;
//   mhc  at every site the mixing coefficients (HcMix) and the sub-layer input before and after its RMSNorm
//        (2·[T, D]).
// The backward functions recompute some of their forward internally whatever the policy (they take only the
// sub-layer input or the acts above): kda_layer_backward RMSNorm_K(o) and the recurrence's states (from checkpoints
// every 64 steps); dsa_layer_backward each query's softmax weights; mlp_backward and moe_backward the gate and up
// projections, and moe_backward the router's scores and each expert's output; mhc_pre_backward the normed streams
// and the fn logits.
// On the GPU (CudaModel::set_recompute) a kept component's sites keep their device activations and their mHC mix,
// and a recomputed KDA or DSA site keeps its attention core's output, so that its recomputation skips the recurrence
// or the attention (the costly, small part of the sub-layer): the recurrence's o (T·H·K bf16 on tensor cores, else
// fp32), the MLA attention's o (T·NH·dv bf16) and, on tensor cores, its rows' log-sum-exp (T·NH fp32); a
// recomputed mHC mix keeps its projection's partials (T·((2+S)·S + 1)·S·D/1024 fp32), so that its recomputation
// skips the pass over the streams that forms them.
// adaptive ("auto", the default of `train` and `grad`): on one GPU, the fastest policy whose activations fit the
// device: the components' flags are the rung in use, from none (everything kept) on; a step that runs out of device
// memory is run again under the next rung (recompute_fallback: none, then states, then default_recompute(), then
// all), which gives it the same loss bit for bit (CudaModel::forward_backward). Where nothing can be run again (the
// CPU, whose memory is the host's; tensor/expert-parallel ranks, which would have to fall back together) it is
// default_recompute() (fixed_recompute).
// states: a kept KDA site's chunk states (the state entering each 64-token chunk and v_new, fp32: 384 MiB a layer
// at 4096 tokens, 64 heads of 128) formed again by the chunked backward instead of kept from the tensor-core forward
// (on the GPU only: the CPU and the recurrent backward keep none; a recomputed KDA site keeps none either).
struct RecomputePolicy {
  bool kda = true, mla = true, moe = true, mlp = true, mhc = true, experts = true, states = true;
  bool adaptive = false;
  // Whether the routed experts' gate|up runs again (experts counts only inside a recomputed MoE).
  bool recomputes_experts() const { return moe && experts; }
  // Whether the KDA chunk states are formed again (states counts only for a kept KDA).
  bool recomputes_states() const { return kda || states; }
  // Written out (not defaulted): nvcc compiles the CUDA sources that include this header as C++17.
  bool operator==(const RecomputePolicy& o) const {
    return kda == o.kda && mla == o.mla && moe == o.moe && mlp == o.mlp && mhc == o.mhc &&
           recomputes_experts() == o.recomputes_experts() && recomputes_states() == o.recomputes_states() &&
           adaptive == o.adaptive;
  }
};
// The default of `train` and `grad` ("kda,mla,moe,mhc"; RecomputePolicy{} is "all"): every component recomputed but
// the routed experts' gate|up, whose kept pre-activations save the most time for their memory of any component's, and
// the dense MLP, which only the first layers have (GLM-5.3-Flash: layer 0), so that keeping it costs a fixed amount
// of memory whatever the depth (on the GPU T·(2I·4 + I·2) bytes a layer, I its intermediate size: 0.47 GiB at 4096
// tokens, plus the adapters' factors).
RecomputePolicy default_recompute();
// "auto": adaptive, at its first rung (none).
RecomputePolicy auto_recompute();
// The fixed policy p stands for: p itself, or default_recompute() for an adaptive p.
RecomputePolicy fixed_recompute(const RecomputePolicy& p);
// An adaptive policy's next rung (none → states → default_recompute() → all, still adaptive), or none past all or for
// a fixed policy.
std::optional<RecomputePolicy> recompute_fallback(const RecomputePolicy& p);
// The policy as --recompute writes it: "auto" (adaptive), "all", "none", or the recomputed components
// comma-separated in the order kda,mla,moe,experts,mlp,mhc,states (the others are kept; states only with kda kept).
std::string recompute_to_string(const RecomputePolicy& p);
// Reads that form: "auto", "all", "none" or a comma-separated list of the components to recompute (any order, no
// repeats; experts only with moe, states only without kda). Throws Error naming the bad part.
RecomputePolicy parse_recompute(const std::string& s);

}  // namespace nextlm
