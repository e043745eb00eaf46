// A one-line progress bar on stderr: drawn in place on a terminal, a single final line
// otherwise (logs stay readable).
#pragma once

#include <chrono>
#include <string>

namespace kestrel {

class Progress {
 public:
  Progress(std::string label, double total, std::string unit, bool enabled);
  // Sets the amount done; redraws at most ~20 times per second.
  void update(double done);
  // Draws the final state and ends the line.
  void finish();

 private:
  void draw(bool final);
  std::string label_, unit_;
  double total_, done_ = 0;
  bool enabled_, tty_, finished_ = false;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace kestrel
