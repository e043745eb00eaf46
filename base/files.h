// Opening the files Kestrel reads from a model directory (configs, tokenizers, weights) and the
// user's own files: only regular files. A FIFO would block the reader until some other program
// writes to it, and a directory or a device is no file to parse; each is refused with one line
// saying what the path is instead.
#pragma once

#include <cstddef>
#include <string>

namespace kestrel {

// Whether anything is at `path` (a file of any kind, or a symlink, even a dangling one): an
// optional file that is present but not a regular file is an error, not an absent file.
bool path_exists(const std::string& path);

// Opens `path` read-only and returns its descriptor (the caller closes it) and its size.
// Throws kestrel::Error "<path>: no such file", "<path> is a directory", "<path> is not a
// regular file (a FIFO)", "<path>: cannot open (<reason>)". Never blocks on a FIFO.
int open_regular_file(const std::string& path, size_t* size);

// The whole content of a regular file, with the errors of open_regular_file.
std::string read_regular_file(const std::string& path);

}  // namespace kestrel
