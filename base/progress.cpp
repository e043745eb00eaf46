#include "base/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

namespace kestrel {

Progress::Progress(std::string label, double total, std::string unit, bool enabled)
    : label_(std::move(label)),
      unit_(std::move(unit)),
      total_(total),
      enabled_(enabled),
      tty_(isatty(fileno(stderr)) != 0),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

void Progress::update(double done) {
  done_ = done;
  if (!enabled_ || !tty_) return;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_draw_ < std::chrono::milliseconds(50)) return;
  last_draw_ = now;
  draw(false);
}

void Progress::finish() {
  if (finished_) return;
  finished_ = true;
  done_ = total_;
  if (enabled_) draw(true);
}

void Progress::draw(bool final) {
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double frac = total_ > 0 ? std::clamp(done_ / total_, 0.0, 1.0) : 1.0;
  const int width = 30, filled = (int)(frac * width);
  std::string bar(filled, '#');
  bar += std::string(width - filled, ' ');
  const double eta = frac > 0 ? elapsed * (1 - frac) / frac : 0;
  std::fprintf(stderr, "%s%s [%s] %3.0f%% %.2f/%.2f %s %.1fs%s%s", tty_ ? "\r" : "", label_.c_str(),
               bar.c_str(), frac * 100, done_, total_, unit_.c_str(), elapsed,
               final ? "" : (" eta " + std::to_string((int)eta) + "s").c_str(),
               final ? "\n" : "\033[K");
  std::fflush(stderr);
}

}  // namespace kestrel
