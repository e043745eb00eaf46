#include "tools/synth/corpus.h"

#include <sentencepiece_trainer.h>

#include <array>
#include <string_view>

#include <fmt/format.h>

#include "base/error.h"
#include "tools/synth/rng.h"

namespace kestrel::synth {
namespace {

using Words = std::vector<std::string_view>;

const Words kNames = {"Alice", "Bob",   "Clara", "David", "Emma",  "Frank", "Grace", "Henry",
                      "Iris",  "Jack",  "Laura", "Martin", "Nora", "Oscar", "Paul",  "Rosa",
                      "Samuel", "Tara", "Victor", "Wendy", "José", "Zoë",   "Amélie", "Søren"};
const Words kPlaces = {"London",     "Paris",       "Berlin",       "the village", "the harbour",
                       "the valley", "the city",    "the old mill", "the library", "the station",
                       "the market", "the forest",  "the school",   "the café",    "the museum",
                       "the hills",  "the castle",  "the garden",   "the office",  "the coast"};
const Words kNouns = {"cat",      "dog",      "house",    "river",   "mountain", "garden",  "window",
                      "letter",   "book",     "table",    "teacher", "child",    "farmer",  "doctor",
                      "engine",   "machine",  "bridge",   "road",    "storm",    "ship",    "island",
                      "bird",     "tree",     "flower",   "door",    "kitchen",  "question", "answer",
                      "story",    "song",     "morning",  "evening", "winter",   "summer",  "friend",
                      "family",   "computer", "language", "government", "system", "problem", "result",
                      "number",   "idea",     "reason",   "history", "science",  "music",   "picture",
                      "paper",    "water",    "light",    "voice",   "field",    "stone",   "horse",
                      "apple",    "bread",    "coffee",   "clock",   "train",    "street",  "student",
                      "village",  "newspaper", "umbrella", "journey", "country", "market",  "window"};
const Words kAdjectives = {"old",     "young",    "small",   "large",  "quiet",   "bright", "dark",
                           "cold",    "warm",     "happy",   "careful", "strange", "beautiful",
                           "simple",  "important", "ancient", "green", "red",     "blue",   "heavy",
                           "gentle",  "sudden",   "clever",  "tired",  "empty",   "famous", "early",
                           "narrow",  "wooden",   "curious", "honest", "silent",  "naïve"};
const Words kTransitive = {"found",    "saw",       "opened",  "closed",   "carried",  "painted",
                           "built",    "repaired",  "wrote",   "read",     "followed", "watched",
                           "remembered", "visited", "described", "discovered", "counted", "cleaned",
                           "moved",    "bought",    "sold",    "sent",     "answered", "explained",
                           "studied",  "measured",  "borrowed", "forgot",  "noticed",  "preferred"};
const Words kIntransitive = {"arrived", "waited",  "laughed", "slept",    "walked",   "smiled",
                             "disappeared", "returned", "listened", "worked", "travelled", "stopped",
                             "started", "shouted", "rested",  "hesitated", "wondered", "agreed"};
const Words kAdverbs = {"quickly", "slowly",  "quietly", "carefully", "suddenly", "finally",
                        "often",   "never",   "always",  "almost",    "really",   "already",
                        "happily", "patiently", "early", "together"};
const Words kPreps = {"in",     "on",     "near",    "behind", "under", "over",   "across",
                      "through", "beside", "towards", "after", "before", "with", "without",
                      "from",   "into",   "along",   "around"};
const Words kConnectors = {"and", "but", "because", "although", "while", "so", "when", "until"};
const Words kTimes = {"Yesterday", "Last week",  "In the morning", "At night",  "On Monday",
                      "Every day", "After dinner", "Before noon",   "In spring", "That evening",
                      "Later",     "At first"};
const Words kSpeech = {"said", "asked", "replied", "whispered", "explained", "added"};

class Writer {
 public:
  explicit Writer(uint64_t seed) : rng_(seed) {}

  std::string_view pick(const Words& w) { return w[rng_.below((uint32_t)w.size())]; }
  bool chance(double p) { return rng_.uniform() < p; }
  uint32_t below(uint32_t n) { return rng_.below(n); }

  std::string noun_phrase() {
    std::string s = chance(0.5) ? "the " : (chance(0.5) ? "a " : "every ");
    if (chance(0.6)) s += fmt::format("{} ", pick(kAdjectives));
    s += pick(kNouns);
    return s;
  }

  std::string number() {
    switch (rng_.below(5)) {
      case 0: return std::to_string(1800 + rng_.below(230));            // a year
      case 1: return fmt::format("{}.{}", rng_.below(100), rng_.below(10));
      case 2: return fmt::format("{}%", rng_.below(101));
      default: return std::to_string(rng_.below(10000));
    }
  }

  // One clause without final punctuation, first letter lower case.
  std::string clause() {
    switch (rng_.below(6)) {
      case 0:
        return fmt::format("{} {} {} {} {}", noun_phrase(), pick(kTransitive), noun_phrase(),
                           pick(kPreps), noun_phrase());
      case 1:
        return fmt::format("{} {} {} {} {}", pick(kNames), pick(kIntransitive), pick(kAdverbs),
                           pick(kPreps), pick(kPlaces));
      case 2:
        return fmt::format("{} {} {} {}s", pick(kNames), pick(kTransitive), number(), pick(kNouns));
      case 3:
        return fmt::format("{} {} {} ({} {})", noun_phrase(), pick(kIntransitive), pick(kAdverbs),
                           pick(kPreps), pick(kPlaces));
      case 4:
        return fmt::format("{}'s {} was {} {} {}", pick(kNames), pick(kNouns), pick(kAdjectives),
                           pick(kPreps), noun_phrase());
      default:
        return fmt::format("{} and {} {} {}: {} {}", pick(kNames), pick(kNames), pick(kTransitive),
                           noun_phrase(), number(), pick(kNouns));
    }
  }

  std::string sentence() {
    std::string s;
    switch (rng_.below(6)) {
      case 0: s = fmt::format("{}, {}.", pick(kTimes), clause()); break;
      case 1: s = fmt::format("{}, {} {}.", clause(), pick(kConnectors), clause()); break;
      case 2: s = fmt::format("Where is {}?", noun_phrase()); break;
      case 3:
        s = fmt::format("\"{}!\" {} {}.", capitalised(clause()), pick(kSpeech), pick(kNames));
        break;
      case 4: s = fmt::format("{}; {}.", clause(), clause()); break;
      default: s = clause() + (chance(0.1) ? "!" : "."); break;
    }
    return capitalised(s);
  }

  static std::string capitalised(std::string s) {
    if (!s.empty() && s[0] >= 'a' && s[0] <= 'z') s[0] = (char)(s[0] - 'a' + 'A');
    return s;
  }

 private:
  Rng rng_;
};

class LinesIterator : public sentencepiece::SentenceIterator {
 public:
  explicit LinesIterator(const std::vector<std::string>& lines) : lines_(lines) {}
  bool done() const override { return i_ >= lines_.size(); }
  void Next() override { ++i_; }
  const std::string& value() const override { return lines_[i_]; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  const std::vector<std::string>& lines_;
  size_t i_ = 0;
};

}  // namespace

std::vector<std::string> english_like_corpus(uint64_t seed, int n_lines) {
  Writer w(seed);
  std::vector<std::string> lines;
  lines.reserve(n_lines);
  for (int i = 0; i < n_lines; ++i) {
    std::string line = w.sentence();
    const uint32_t extra = w.below(4);  // paragraphs of 1 to 4 sentences
    for (uint32_t j = 0; j < extra; ++j) {
      line += ' ';
      line += w.sentence();
    }
    lines.push_back(std::move(line));
  }
  return lines;
}

std::string train_tokenizer(int vocab_size) {
  // The corpus is fixed (not the model's seed): every synthetic model shares one tokenizer.
  const std::vector<std::string> lines = english_like_corpus(0x5EED, 6000);
  LinesIterator it(lines);
  // Llama's tokenizer settings: BPE, byte fallback, digits split, no normalisation.
  const std::unordered_map<std::string, std::string> args = {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(vocab_size)},
      {"byte_fallback", "true"},
      {"character_coverage", "1.0"},
      {"split_digits", "true"},
      {"normalization_rule_name", "identity"},
      {"add_dummy_prefix", "true"},
      {"remove_extra_whitespaces", "false"},
      {"allow_whitespace_only_pieces", "true"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"num_threads", "1"},
      {"minloglevel", "2"},
  };
  std::string proto;
  const auto status = sentencepiece::SentencePieceTrainer::Train(args, &it, &proto);
  KESTREL_CHECK(status.ok(), fmt::format("training the tokenizer (vocab {}) failed: {}", vocab_size,
                                         status.ToString()));
  return proto;
}

}  // namespace kestrel::synth
