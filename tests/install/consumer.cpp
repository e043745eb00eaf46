// Uses the installed library as a program outside the project would: loads the model given on
// the command line on the CPU, generates greedily with a callback, continues the sequence in
// the same session (its cache reused), and scores perplexity. Exits non-zero on any mismatch.
#include <kestrel/kestrel.h>

#include <cmath>
#include <iostream>
#include <string>

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::cerr << "consumer: FAILED: " << what << "\n";
    ++failures;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: consumer MODEL_DIR\n";
    return 2;
  }
  try {
    kestrel::api::LoadOptions lo;
    lo.device = "cpu";
    const kestrel::api::Model model = kestrel::api::Model::load(argv[1], lo);
    check(model.architecture() == "LlamaForCausalLM", "architecture " + model.architecture());

    const std::vector<int> ids = model.tokenize("The quick brown fox");
    check(ids.size() > 1, "tokenize gave " + std::to_string(ids.size()) + " ids");

    kestrel::api::GenerateOptions o;
    o.max_tokens = 12;
    o.ignore_eos = true;
    std::string streamed;
    auto a = model.new_session(64);
    const kestrel::api::GenerateResult r =
        a->generate("The quick brown fox", o, [&](std::string_view t) { streamed += t; });
    check(r.ids.size() == 12, "generated " + std::to_string(r.ids.size()) + " ids");
    check(streamed == r.text, "the callback's text differs from the result's");
    check(r.cached_tokens == 0, "a fresh session held cached tokens");

    // Another session of the same model, same prompt: the same greedy ids.
    auto b = model.new_session(64);
    check(b->generate(ids, o).ids == r.ids, "a second session generated other ids");

    // The sequence continued in session a: its cache holds the prompt and the reply.
    std::vector<int> more = ids;
    more.insert(more.end(), r.ids.begin(), r.ids.end());
    o.max_tokens = 4;
    const kestrel::api::GenerateResult r2 = a->generate(more, o);
    check(r2.cached_tokens == (int)more.size() - 1,
          "continued with " + std::to_string(r2.cached_tokens) + " cached tokens");

    const kestrel::api::PerplexityResult p =
        model.perplexity("one two three four five six seven eight nine ten eleven twelve", 8);
    check(std::isfinite(p.perplexity) && p.perplexity > 1, "perplexity " +
                                                              std::to_string(p.perplexity));

    // A failure is one kestrel::api::Error.
    bool threw = false;
    try {
      kestrel::api::Model::load(std::string(argv[1]) + "/no-such-model", lo);
    } catch (const kestrel::api::Error& e) {
      threw = std::string(e.what()).find("no-such-model") != std::string::npos;
    }
    check(threw, "loading a missing model did not throw kestrel::api::Error naming it");
  } catch (const kestrel::api::Error& e) {
    std::cerr << "consumer: " << e.what() << "\n";
    return 1;
  }
  if (failures == 0) std::cout << "consumer: the installed library works\n";
  return failures == 0 ? 0 : 1;
}
