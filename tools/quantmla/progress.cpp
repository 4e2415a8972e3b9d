#include "progress.h"

#include <unistd.h>

#include <cstdio>

namespace quantmla::cli {

ProgressBar::ProgressBar(std::string label)
    : label_(std::move(label)),
      interactive_(isatty(STDERR_FILENO) != 0),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

void ProgressBar::update(int64_t done, int64_t total) {
  const auto now = std::chrono::steady_clock::now();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double fraction = total > 0 ? static_cast<double>(done) / static_cast<double>(total) : 1.0;
  const double eta = done > 0 ? elapsed / static_cast<double>(done) * (total - done) : 0.0;
  const bool finished = done >= total;
  if (interactive_) {
    if (!finished && now - last_draw_ < std::chrono::milliseconds(100)) return;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(fraction * kWidth);
    std::fprintf(stderr, "\r%s [%-*s] %lld/%lld  %.0fs elapsed, %.0fs left ", label_.c_str(),
                 kWidth, std::string(static_cast<size_t>(filled), '#').c_str(),
                 static_cast<long long>(done), static_cast<long long>(total), elapsed, eta);
    if (finished) std::fputc('\n', stderr);
  } else {
    const int decile = static_cast<int>(fraction * 10);
    if (decile == last_decile_ && !finished) return;
    if (finished && last_decile_ == 10) return;
    last_decile_ = decile;
    std::fprintf(stderr, "%s %lld/%lld (%.0f%%), %.0fs elapsed, %.0fs left\n", label_.c_str(),
                 static_cast<long long>(done), static_cast<long long>(total), fraction * 100.0,
                 elapsed, eta);
  }
  last_draw_ = now;
  std::fflush(stderr);
}

}  // namespace quantmla::cli
