// `nextlm merge`: a LoRA adapter (PEFT directory) merged into its base model, written as a full hub checkpoint.
#pragma once
#include <string>

#include <CLI/CLI.hpp>

namespace nextlm {

struct MergeArgs {
  std::string model, adapter, out, dtype = "same";
};

// Adds the `merge` subcommand and its flags to app.
CLI::App* add_merge_command(CLI::App& app, MergeArgs& a);

// Runs it; returns the exit status (errors are thrown as nextlm::Error, exit 1).
int cmd_merge(const MergeArgs& a);

}  // namespace nextlm
