// make_cuda_runner in a build without CUDA (the CUDA build replaces this file with the runner).
#include "quantmla/error.h"
#include "quantmla/runner.h"

namespace quantmla {

std::unique_ptr<Runner> make_cuda_runner(const std::filesystem::path&, const CudaRunnerOptions&) {
  throw InvalidArgument(
      "--device cuda: this quantmla was built without CUDA (configure with -DQUANTMLA_CUDA=ON on a "
      "machine with nvcc)");
}

}  // namespace quantmla
