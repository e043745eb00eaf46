// kestrel: generate, chat, serve, bench, perplexity, tokenize, info, devices.
#include <cstring>
#include <iostream>
#include <new>
#include <string>

#include "tools/kestrel/commands.h"
#include "tools/kestrel/common.h"
#include "base/device.h"
#include "base/error.h"
#include "engine/loader.h"

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
  // The engines Kestrel can run on: the CPU engine always, then the CUDA GPU it would use or
  // why none is usable (a GPU present but unusable is still named). Exit 0 either way; scripts
  // such as scripts/test.sh look for the "cuda: " line (base/device.h is the one check).
  app.add_subcommand("devices", "list the engines Kestrel can run on: the CPU, and the CUDA GPU "
                                "it would use or why there is none")
      ->callback([&action] {
        action = [] {
          // -t's default: OMP_NUM_THREADS, or the cores other programs leave idle.
          kestrel::set_cpu_threads(kestrel::default_cpu_threads());
          const int t = kestrel::cpu_threads();
          std::cout << "cpu: the CPU engine (fp32 reference), " << t << " thread"
                    << (t == 1 ? "" : "s") << "\n";
          const kestrel::CudaStatus s = kestrel::cuda_status();
          if (!s.usable) {
            std::cout << "cuda unusable: " << s.problem << "\n";
            return 0;
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
  // No command: the usage with its list of commands (as --help prints it), then the one error
  // line, exit 1 (as git does); all on stderr, so that nothing reaches a pipe.
  if (argc < 2) {
    std::cerr << app.help() << "kestrel: a command is required (" << kCommands
              << "); kestrel --help\n";
    return 1;
  }
  kestrel::cli::rewrite_long_short_options(argc, argv);
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
