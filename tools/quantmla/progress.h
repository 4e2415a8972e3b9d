// A progress bar on stderr: redrawn in place on a terminal, a line per 10% otherwise (CI logs).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace quantmla::cli {

class ProgressBar {
 public:
  explicit ProgressBar(std::string label);
  void update(int64_t done, int64_t total);

 private:
  std::string label_;
  bool interactive_;
  int last_decile_ = -1;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
};

}  // namespace quantmla::cli
