// quantmla: command-line entry point. Library errors are caught here, printed to stderr with their
// message, and turned into a non-zero exit status.
#include <cstdio>
#include <exception>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "commands.h"
#include "quantmla/error.h"

namespace {

// The CPU engine's steps allocate their buffers (a few MB at a prefill chunk) and free them at the
// end. By default glibc maps blocks above a threshold (128 KB, rising towards 32 MB as such blocks
// are freed) on their own and gives the freed top of the heap back past a trim threshold, so those
// buffers are mapped and page-faulted in again step after step: 12-15% of a CPU bench-serve run's
// throughput (perf: page faults under run_forward's memsets). Here blocks below 32 MB come from
// the heap and up to 1 GiB of freed heap stays in the process for the next step. (Setting one
// threshold fixes the other at its default too, so both are set.)
void keep_freed_memory_for_the_next_step() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
#endif
}

}  // namespace

int main(int argc, char** argv) {
  keep_freed_memory_for_the_next_step();
  CLI::App app{"QuantMLA: DeepSeek-family MLA inference with a low-bit KV cache"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Print help for every subcommand");
  quantmla::cli::add_info(app);
  quantmla::cli::add_generate(app);
  quantmla::cli::add_eval_ppl(app);
  quantmla::cli::add_tokenize(app);
  quantmla::cli::add_render_chat(app);
  quantmla::cli::add_eval_kld(app);
  quantmla::cli::add_compare(app);
  quantmla::cli::add_compare_merge(app);
  quantmla::cli::add_error_model(app);
  quantmla::cli::add_calibrate(app);
  quantmla::cli::add_eval_passkey(app);
  quantmla::cli::add_make_random_model(app);
  quantmla::cli::add_bench_serve(app);
  quantmla::cli::add_serve(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const quantmla::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "internal error: %s\n", e.what());
    return 2;
  }
  return 0;
}
