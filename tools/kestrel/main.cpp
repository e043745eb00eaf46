// kestrel: generate, chat, serve, bench, perplexity, tokenize, info, devices.
#include <cstring>
#include <iostream>
#include <new>
#include <string>

#include "tools/kestrel/commands.h"
#include "tools/kestrel/common.h"
#include "base/device.h"
#include "base/error.h"

namespace {

const char* const kCommands = "generate, chat, serve, bench, perplexity, tokenize, info, devices";

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Kestrel: fast batch-1 inference of GPTQ language models", "kestrel"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kestrel " KESTREL_VERSION);
  std::function<int()> action;
  kestrel::cli::register_generate(app, action);
  kestrel::cli::register_bench(app, action);
  kestrel::cli::register_chat(app, action);
  kestrel::cli::register_serve(app, action);
  kestrel::cli::register_perplexity(app, action);
  kestrel::cli::register_tokenize(app, action);
  kestrel::cli::register_info(app, action);
  // The GPU Kestrel would use, or why there is none (exit 1): the one check every part of the
  // project asks (base/device.h), for scripts such as scripts/test.sh.
  app.add_subcommand("devices", "show the CUDA GPU Kestrel would use, or why there is none")
      ->callback([&action] {
        action = [] {
          const kestrel::CudaStatus s = kestrel::cuda_status();
          if (!s.usable) {  // an error line like every other command's
            std::cerr << "kestrel: " << s.problem << "\n";
            return 1;
          }
          std::cout << "cuda: " << s.name << " (" << s.device_count << " device"
                    << (s.device_count == 1 ? "" : "s") << ", driver "
                    << kestrel::cuda_version_string(s.driver_version) << ", runtime "
                    << kestrel::cuda_version_string(s.runtime_version) << ")\n";
          return 0;
        };
      });

  // An option given twice takes the last value, as llama.cpp's do (CLI11 would refuse with
  // "At Most 1 required but received 2"); options that collect values (--stop, -r) keep all.
  for (CLI::App* cmd : app.get_subcommands([](CLI::App*) { return true; }))
    for (CLI::Option* o : cmd->get_options())
      if (o->get_expected_max() == 1 && o->get_type_size() == 1)
        o->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);

  // The command comes first; CLI11 alone would answer "kestrel server" with "A subcommand is
  // required" and read llama.cpp's -ngl 99 as -n gl.
  if (argc < 2) {
    std::cerr << "kestrel: a command is required (" << kCommands << "); kestrel --help\n";
    return 1;
  }
  if (argv[1][0] != '-') {
    CLI::App* cmd = nullptr;
    try {
      cmd = app.get_subcommand(argv[1]);
    } catch (const CLI::OptionNotFound&) {
      std::cerr << "kestrel: unknown command '" << argv[1] << "' (" << kCommands << ")\n";
      return 1;
    }
    const std::string bad = kestrel::cli::unknown_short_option(*cmd, argc, argv, 2);
    if (!bad.empty()) {
      std::cerr << "kestrel: " << kestrel::cli::unknown_option_message(bad) << "\n";
      return 1;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version as CLI11 prints them; a bad command line in one line, exit 1 (as
    // kestrel-synth and kestrel-quantize do).
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    std::cerr << "kestrel: " << kestrel::cli::parse_error_message(e, app) << "\n";
    return 1;
  }
  try {
    return action ? action() : 1;
  } catch (const kestrel::Error& e) {
    std::cout.flush();
    std::cerr << "kestrel: " << e.what() << "\n";
  } catch (const std::bad_alloc&) {
    std::cout.flush();
    std::cerr << "kestrel: out of host memory\n";
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << "kestrel: " << e.what() << "\n";
  }
  return 1;
}
