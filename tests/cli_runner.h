// Runs the quantmla program as a user would and captures what it printed.
#pragma once

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "test_paths.h"

namespace quantmla::testing {

struct CliResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

inline std::string slurp(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// `args` is appended to the program path as shell words; runs in the source directory so the
// default model path resolves.
inline CliResult run_cli(const std::string& args) {
  const auto dir =
      std::filesystem::temp_directory_path() /
      ("quantmla-cli-" + std::to_string(::getpid()) + "-" + std::to_string(std::rand()));
  std::filesystem::create_directories(dir);
  const std::string command = "cd '" + source_dir().string() + "' && '" + cli_path().string() +
                              "' " + args + " >'" + (dir / "out").string() + "' 2>'" +
                              (dir / "err").string() + "' </dev/null";
  const int status = std::system(command.c_str());
  CliResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  result.out = slurp(dir / "out");
  result.err = slurp(dir / "err");
  std::filesystem::remove_all(dir);
  return result;
}

}  // namespace quantmla::testing
