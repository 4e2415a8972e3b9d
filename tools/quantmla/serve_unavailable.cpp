// `quantmla serve` and `bench-serve --url` in a build without cpp-httplib (the GPU machine's
// unpacked dependencies): the commands exist and say what is missing.
#include "bench_online.h"
#include "commands.h"
#include "quantmla/error.h"

namespace quantmla::cli {

void add_serve(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (not in this build)");
  cmd->allow_extras();
  cmd->callback([] {
    throw InvalidArgument(
        "this build has no HTTP server: cpp-httplib was not found when it was configured "
        "(install libcpp-httplib-dev and re-run cmake)");
  });
}

OnlineResult run_bench_online(const std::vector<Request>&, const OnlineOptions&) {
  throw InvalidArgument(
      "this build has no HTTP client for bench-serve --url: cpp-httplib was not found when it was "
      "configured (install libcpp-httplib-dev and re-run cmake)");
}

}  // namespace quantmla::cli
