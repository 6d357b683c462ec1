// nextlm executable entry point.
#include "cli/commands.h"

int main(int argc, char** argv) { return nextlm::run_cli(argc, argv); }
