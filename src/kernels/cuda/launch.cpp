#include "kernels/cuda/launch.h"

#include <atomic>

namespace quantmla::gpu {
namespace {
std::atomic<bool> programmatic{false};
}  // namespace

void set_programmatic_launch(bool on) { programmatic.store(on); }
bool programmatic_launch() { return programmatic.load(); }

}  // namespace quantmla::gpu
