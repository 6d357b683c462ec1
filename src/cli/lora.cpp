// `nextlm merge`: writes base + s·B·A as a hub checkpoint (model/lora.h, merge_adapter_checkpoint) that
// transformers and `nextlm --model` load like the base.
#include "cli/lora.h"

#include <iostream>

#include "model/lora.h"

namespace nextlm {

CLI::App* add_merge_command(CLI::App& app, MergeArgs& a) {
  CLI::App* mg = app.add_subcommand("merge", "merge a LoRA adapter into its base model (full hub checkpoint)");
  mg->add_option("--model", a.model, "base model directory")->required();
  mg->add_option("--adapter", a.adapter, "LoRA adapter directory (adapter_config.json + adapter_model.safetensors)")
      ->required();
  mg->add_option("--out", a.out, "new model directory to write (must not exist)")->required();
  mg->add_option("--dtype", a.dtype, "same: every tensor in the base's dtype; f32: every floating tensor as f32")
      ->capture_default_str()
      ->check(CLI::IsMember({"same", "f32"}));
  return mg;
}

int cmd_merge(const MergeArgs& a) {
  const int64_t n = merge_adapter_checkpoint(a.model, a.adapter, a.out, a.dtype == "f32");
  std::cerr << "merged " << n << " weights of " << a.model << " with the adapter " << a.adapter << " into " << a.out
            << "\n";
  return 0;
}

}  // namespace nextlm
