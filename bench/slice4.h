// The 4-layer full-width slice (bench/slice4/config.json): its benchmark cases and the parity mode.
#pragma once
#include <string>

namespace nextlm::bench {

// The slice's config.json: $NEXTLM_SLICE4_CONFIG, else bench/slice4/config.json under $NEXTLM_SOURCE_DIR, the
// source tree the binary was built from, or the working directory.
std::string slice4_config_path();

// `slice4_prefill_T4096`: one 4096-token prefill with the lm_head (log-probs) on random device weights, median of
// several CUDA-event timings after warm-up, then one profiled run broken down by component against each floor.
void slice4_prefill_case(const std::string& name);
// `slice4_train_step_T4096`: one training forward + backward of the slice at 4096 tokens with frozen linear
// weights (CudaModel::set_train_linears(false)): tokens/s and MFU; `small8_full_train_step_T4096` the same with every
// weight's gradient on bench/small8/config.json (a smaller model with the real layer pattern).
void slice4_train_step_case(const std::string& name);
// `slice4_lora_step_T4096` (per-expert adapters) and `slice4_lora_step_T4096_shared_experts`: one LoRA step of the
// slice (rank 16 on every projection; device forward + backward, host AdamW on the adapters), tokens/s and MFU.
void slice4_lora_step_case(const std::string& name);
// `slice4_prefill_T4096_tp2`, `_ep2`, `_tp2_ep2` (builds with NCCL): the prefill split over 2 GPUs (threads, one GPU
// each), beside one GPU's in the same run, with the split run's log-prob difference from one GPU.
void slice4_parallel_prefill_case(const std::string& name);
// The same for a prefill (train false) or a training step with frozen linear weights (train true; the cases
// `slice4_train_step_T4096_tp2`, `_ep2`, `_tp2_ep2`, which slice4_train_step_case passes here).
void slice4_parallel_case(const std::string& name, bool train);
// `mhc`: the mHC share of the slice's layer time (from the same profiled run), target ≤ 7%.
void mhc_share_case(const std::string& name);

// `nextlm_bench parity MODEL_DIR REF.safetensors OUT.json`: loads the checkpoint straight to the GPU in bf16 and
// compares its next-token distributions with the reference log-softmax rows in REF (written by
// bench/peers/hf_slice4.py); writes the per-batch figures to OUT.json. Returns the exit status.
int slice4_parity(int argc, char** argv);

}  // namespace nextlm::bench
