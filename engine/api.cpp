// The public library (engine/include/kestrel/kestrel.h) over the engine: every internal error
// becomes a kestrel::api::Error, the one exception type the shared library exports.
#include "kestrel/kestrel.h"

#include <exception>
#include <string>
#include <utility>

#include "base/error.h"
#include "engine/generate.h"
#include "engine/loader.h"
#include "engine/perplexity.h"

namespace kestrel::api {

struct Model::Impl {
  kestrel::LoadedModel m;  // the spec, tokenizer and weights; sessions are the caller's
};

struct Session::Impl {
  std::shared_ptr<Model::Impl> model;  // keeps the model alive as long as the session
  std::unique_ptr<kestrel::Session> session;
};

namespace {

// Runs f, turning every failure into one api::Error.
template <class F>
auto guarded(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(e.what());
  }
}

}  // namespace

Model Model::load(const std::string& dir, const LoadOptions& o) {
  return guarded([&] {
    kestrel::ModelLoadOptions lo;
    lo.dir = dir;
    lo.device = o.device;
    lo.threads = o.threads;
    lo.quiet = o.quiet;
    lo.cache = {kestrel::parse_kv_type(o.cache_type_k, "cache_type_k"),
                kestrel::parse_kv_type(o.cache_type_v, "cache_type_v")};
    lo.open_session = false;  // new_session opens them, of the caller's context
    return Model(std::make_shared<Impl>(Impl{kestrel::load_model(lo)}));
  });
}

std::string Model::device() const { return impl_->m.model->device_name(); }
std::string Model::architecture() const { return impl_->m.config().architecture; }
int Model::max_context() const { return impl_->m.config().max_pos; }
int Model::vocab_size() const { return impl_->m.config().vocab; }

std::vector<int> Model::tokenize(std::string_view text, bool add_special) const {
  return guarded([&] { return impl_->m.tok->encode(std::string(text), add_special); });
}

std::string Model::detokenize(const std::vector<int>& ids) const {
  return guarded([&] { return impl_->m.tok->decode(ids); });
}

std::unique_ptr<Session> Model::new_session(int context) const {
  return guarded([&] {
    auto s = std::make_unique<Session::Impl>();
    s->model = impl_;
    s->session = impl_->m.model->new_session(context, /*quiet=*/true);
    return std::unique_ptr<Session>(new Session(std::move(s)));
  });
}

PerplexityResult Model::perplexity(std::string_view text, int window, int64_t max_windows) const {
  return guarded([&] {
    const std::vector<int> ids = impl_->m.tok->encode(std::string(text), /*with_specials=*/true);
    std::unique_ptr<kestrel::Session> s = impl_->m.model->new_session(window, /*quiet=*/true);
    const kestrel::PerplexityResult r = kestrel::perplexity(*s, ids, window, max_windows, false);
    return PerplexityResult{r.ppl, r.tokens, r.windows, r.seconds};
  });
}

Session::Session(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Session::~Session() = default;

int Session::context_length() const { return impl_->session->context_length(); }

GenerateResult Session::generate(std::string_view prompt, const GenerateOptions& o,
                                 const std::function<void(std::string_view)>& on_text) {
  return guarded([&] {
    return generate(impl_->model->m.tok->encode(std::string(prompt), /*with_specials=*/true), o,
                    on_text);
  });
}

GenerateResult Session::generate(const std::vector<int>& prompt_ids, const GenerateOptions& o,
                                 const std::function<void(std::string_view)>& on_text) {
  return guarded([&] {
    kestrel::GenerateOptions g;
    g.max_new_tokens = o.max_tokens;
    g.sampling.temperature = o.temperature;
    g.sampling.top_k = o.top_k;
    g.sampling.top_p = o.top_p;
    g.sampling.min_p = o.min_p;
    g.sampling.repeat_penalty = o.repeat_penalty;
    g.sampling.seed = o.seed;
    g.stop = o.stop;
    g.ignore_eos = o.ignore_eos;
    const kestrel::GenerateResult r =
        generate_cached(*impl_->session, *impl_->model->m.tok, prompt_ids, g, on_text);
    GenerateResult out;
    out.text = r.text;
    out.ids = r.ids;
    out.finish_reason = r.finish_reason;
    out.prompt_tokens = (int)r.prompt_ids.size();
    out.cached_tokens = r.n_cached;
    out.prompt_ms = r.prompt_ms;
    out.generation_ms = r.gen_ms;
    return out;
  });
}

}  // namespace kestrel::api
