// quantmla: command-line entry point. Library errors are caught here, printed to stderr with their
// message, and turned into a non-zero exit status.
#include <cstdio>
#include <exception>

#include "commands.h"
#include "quantmla/error.h"

int main(int argc, char** argv) {
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
