// The chat template interpreter on an arbitrary template, rendered over a fixed conversation:
// parse errors and run-time errors are kestrel::Error, nothing else escapes, nothing crashes.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "tests/fuzz/fuzz_util.h"
#include "tokenizer/jinja/jinja.h"

using namespace kestrel;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view source(reinterpret_cast<const char*>(data), size);
  static const jinja::Json context = {
      {"messages",
       {{{"role", "system"}, {"content", "Be brief."}},
        {{"role", "user"}, {"content", "Hi \u00e9"}},
        {{"role", "assistant"}, {"content", "Hello"}},
        {{"role", "user"}, {"content", "And?"}}}},
      {"add_generation_prompt", true},
      {"bos_token", "<s>"},
      {"eos_token", "</s>"},
      {"tools", nullptr}};
  fuzz::expect_only_kestrel_errors([&] {
    jinja::Template t = jinja::Template::parse(source);
    t.set_function("strftime_now", [](const std::vector<jinja::Json>&, const jinja::Json&) {
      return jinja::Json("01 Dec 2026");
    });
    t.render(context);
  });
  return 0;
}
