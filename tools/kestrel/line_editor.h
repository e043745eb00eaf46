// Reading the chat's input lines. On a terminal, with libedit (BSD-licensed, Debian's
// libedit-dev): the arrows move and recall earlier lines, Ctrl-R searches them, and ~/.editrc
// applies, as in other programs built on it. Otherwise (a pipe, a file, or a build without
// libedit) plain std::getline. Either way SIGINT ends a read in progress (read() returns
// false), as catch_interrupts() (base/interrupt.h) installs it without SA_RESTART.
#pragma once

#include <memory>
#include <string>

namespace kestrel::cli {

class LineEditor {
 public:
  // `editing`: stdin is a terminal and line editing is wanted.
  explicit LineEditor(bool editing);
  ~LineEditor();
  LineEditor(const LineEditor&) = delete;
  LineEditor& operator=(const LineEditor&) = delete;

  // Shows `prompt` (it may hold terminal escapes, which take no width) and reads one line
  // without its line ending. False at the end of the input or when a signal interrupted it.
  bool read(std::string& line, const std::string& prompt);
  // Whether lines are edited (libedit is in use).
  bool editing() const { return impl_ != nullptr; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kestrel::cli
