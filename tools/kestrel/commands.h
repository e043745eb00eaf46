// Each `kestrel` subcommand registers its options and, when chosen, sets `action`.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace kestrel::cli {

void register_generate(CLI::App& app, std::function<int()>& action);
void register_bench(CLI::App& app, std::function<int()>& action);
void register_chat(CLI::App& app, std::function<int()>& action);
void register_perplexity(CLI::App& app, std::function<int()>& action);
void register_tokenize(CLI::App& app, std::function<int()>& action);
void register_info(CLI::App& app, std::function<int()>& action);
void register_serve(CLI::App& app, std::function<int()>& action);

}  // namespace kestrel::cli
