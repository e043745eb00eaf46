#include "tools/kestrel/line_editor.h"

#include <iostream>

#ifdef KESTREL_HAVE_LIBEDIT
#include <histedit.h>
#endif

namespace kestrel::cli {

#ifdef KESTREL_HAVE_LIBEDIT

// libedit's native interface (histedit.h): an EditLine reading stdin, and its history.
struct LineEditor::Impl {
  EditLine* el = nullptr;
  History* hist = nullptr;
  HistEvent ev{};
  std::string prompt;  // escapes wrapped in kLiteral, which libedit prints without counting

  static constexpr char kLiteral = '\1';
  static char* prompt_of(EditLine* el) {
    Impl* self = nullptr;
    el_get(el, EL_CLIENTDATA, &self);
    return self->prompt.data();
  }

  Impl() {
    el = el_init("kestrel", stdin, stdout, stderr);
    hist = history_init();
    history(hist, &ev, H_SETSIZE, 1000);
    history(hist, &ev, H_SETUNIQUE, 1);  // a line repeated at once is kept once
    el_set(el, EL_CLIENTDATA, this);
    el_set(el, EL_EDITOR, "emacs");
    el_set(el, EL_HIST, history, hist);
    el_set(el, EL_PROMPT_ESC, &Impl::prompt_of, kLiteral);
    // Ctrl-R searches the history backwards, as in readline.
    el_set(el, EL_BIND, "^R", "em-inc-search-prev", nullptr);
    el_source(el, nullptr);  // the user's ~/.editrc
  }
  ~Impl() {
    history_end(hist);
    el_end(el);
  }
};

LineEditor::LineEditor(bool editing) {
  if (editing) impl_ = std::make_unique<Impl>();
}

LineEditor::~LineEditor() = default;

bool LineEditor::read(std::string& line, const std::string& prompt) {
  if (!impl_) {
    std::cout << prompt << std::flush;
    if (!std::getline(std::cin, line)) return false;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    return true;
  }
  // Escape sequences (\033[...m) are zero-width: wrap each in the literal marker.
  impl_->prompt.clear();
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] == '\033') {
      const size_t end = prompt.find('m', i);
      const size_t stop = end == std::string::npos ? prompt.size() : end + 1;
      impl_->prompt += Impl::kLiteral + prompt.substr(i, stop - i) + Impl::kLiteral;
      i = stop - 1;
    } else {
      impl_->prompt += prompt[i];
    }
  }
  int count = 0;
  const char* got = el_gets(impl_->el, &count);
  if (!got || count <= 0) return false;
  line.assign(got, count);
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
  if (!line.empty()) history(impl_->hist, &impl_->ev, H_ENTER, line.c_str());
  return true;
}

#else  // without libedit: plain reading

struct LineEditor::Impl {};

LineEditor::LineEditor(bool) {}

LineEditor::~LineEditor() = default;

bool LineEditor::read(std::string& line, const std::string& prompt) {
  std::cout << prompt << std::flush;
  if (!std::getline(std::cin, line)) return false;
  if (!line.empty() && line.back() == '\r') line.pop_back();
  return true;
}

#endif

}  // namespace kestrel::cli
