// The nextlm command line: `score` and `info` (more commands arrive with training and decoding).
#pragma once

namespace nextlm {

// Parses argv and runs the command. Returns the process exit code: 0 on success, 1 on an error in the input or
// model (one line "error: …" on stderr), 2 on bad command-line arguments.
int run_cli(int argc, char** argv);

}  // namespace nextlm
