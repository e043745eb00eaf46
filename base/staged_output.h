// Outputs written whole or not at all. A program writes its output directory (or file) under a
// temporary name beside the destination, on the same filesystem, and renames it into place only
// once it is complete: a failure, a full disk or Ctrl-C leaves the destination as it was.
//
//   StagedDir out(dest, force);        // refuses a non-empty dest unless force
//   write_everything(out.path());      // <dest>.kestrel-tmp-<pid>/
//   out.commit();                      // one rename; the old dest (force) goes only now
//
// Until commit() the temporary is removed by the destructor (an exception) or, in a program
// that called remove_staged_outputs_on_signals(), by SIGINT, SIGTERM and SIGHUP.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

namespace kestrel {

// An output directory.
class StagedDir {
 public:
  // Throws kestrel::Error for a dest that is not a directory, or a non-empty one unless
  // `replace` (--force). Creates dest's missing parents and the temporary directory beside it.
  StagedDir(const std::string& dest, bool replace);
  ~StagedDir();  // not committed: removes the temporary, and the parents it created
  StagedDir(const StagedDir&) = delete;
  StagedDir& operator=(const StagedDir&) = delete;

  // The same checks as the constructor, creating nothing: to refuse before any work.
  static void check(const std::string& dest, bool replace);

  const std::filesystem::path& path() const { return tmp_; }  // write here
  const std::string& dest() const { return shown_; }          // as the user named it
  // Moves path() to dest in one rename (an exchange when dest holds an old output, which is
  // then removed). Throws kestrel::Error, leaving dest as it was, when that fails.
  void commit();

 private:
  std::filesystem::path dest_, tmp_;
  std::filesystem::path created_;  // the outermost parent this created, empty if none
  std::string shown_;
  bool replace_ = false;
  bool committed_ = false;
};

// An output file: written through write(), renamed over dest by commit().
class StagedFile {
 public:
  // Throws kestrel::Error when dest is a directory or the temporary cannot be created.
  explicit StagedFile(const std::string& dest);
  ~StagedFile();  // not committed: removes the temporary
  StagedFile(const StagedFile&) = delete;
  StagedFile& operator=(const StagedFile&) = delete;

  void write(std::string_view text);  // throws kestrel::Error naming dest when the write fails
  void commit();

 private:
  std::filesystem::path dest_, tmp_;
  std::string shown_;
  std::ofstream file_;
  bool committed_ = false;
};

// From now on SIGINT, SIGTERM and SIGHUP remove the staged outputs not yet committed, print
// "<program>: interrupted; nothing written to DEST" on stderr and exit with 128 + the signal
// number (base/interrupt.h runs it). A SIGINT the program catches (catch_interrupts) sets its
// flag instead.
void remove_staged_outputs_on_signals(const std::string& program);

}  // namespace kestrel
