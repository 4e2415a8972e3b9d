// StreamText, the text a streaming client sees, against its definition on random token streams of
// the DeepSeek-V3 tokenizer (byte-level tokens that split characters, special tokens, ids beyond
// the vocabulary) fed in random pieces, with random stop strings: every update's text is a prefix
// of the next one's and of the final text, never holds a stop string or a broken character, and
// the final text is decode(known ids, skip special) cut before the first stop string.
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "quantmla/stream_text.h"
#include "quantmla/tokenizer.h"
#include "test_paths.h"
#include "test_seed.h"
#include "tokenizer/utf8.h"

namespace quantmla {
namespace {

const Tokenizer& deepseek() {
  static const Tokenizer t =
      Tokenizer::from_file(testing::shared_dir() / "tokenizers/deepseek-v3/tokenizer.json");
  return t;
}

std::string reference_text(const Tokenizer& tokenizer, std::span<const int32_t> ids,
                           const std::vector<std::string>& stop, bool& stopped) {
  std::vector<int32_t> known;
  for (const int32_t id : ids) {
    if (tokenizer.knows(id)) known.push_back(id);
  }
  std::string text = tokenizer.decode(known, /*skip_special=*/true);
  size_t cut = std::string::npos;
  for (const std::string& s : stop) cut = std::min(cut, text.find(s));
  stopped = cut != std::string::npos;
  if (stopped) text.resize(cut);
  return text;
}

TEST(StreamText, GrowsByPrefixesToTheDecodedTextCutAtTheFirstStop) {
  const Tokenizer& tokenizer = deepseek();
  std::mt19937_64 rng(testing::test_seed("GrowsByPrefixesToTheDecodedTextCutAtTheFirstStop"));
  const auto vocab = static_cast<int32_t>(tokenizer.vocab_size());
  // Byte-level tokens (one or a few bytes of a multi-byte character) are what split characters.
  std::vector<int32_t> fragments;
  for (int32_t id = 0; id < vocab && fragments.size() < 2000; ++id) {
    if (!tokenizer.knows(id)) continue;
    const std::string bytes = tokenizer.token_bytes(id);
    if (detail::find_invalid_utf8(bytes).has_value()) fragments.push_back(id);
  }
  ASSERT_GT(fragments.size(), 50u);
  int stopped_cases = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<int32_t> ids;
    const int length = std::uniform_int_distribution<int>(1, 60)(rng);
    for (int i = 0; i < length; ++i) {
      const int kind = std::uniform_int_distribution<int>(0, 9)(rng);
      if (kind < 4) {
        ids.push_back(fragments[rng() % fragments.size()]);
      } else if (kind == 4) {
        ids.push_back(vocab + static_cast<int32_t>(rng() % 1000));  // not in the tokenizer
      } else if (kind == 5) {
        ids.push_back(0);  // BOS: special
      } else {
        ids.push_back(static_cast<int32_t>(rng() % 20000));
      }
    }
    // Stop strings: pieces of the decoded text (found), or text that is not there.
    bool unused = false;
    const std::string whole = reference_text(tokenizer, ids, {}, unused);
    std::vector<std::string> stop;
    const int stops = std::uniform_int_distribution<int>(0, 3)(rng);
    for (int s = 0; s < stops; ++s) {
      // A client's stop string is text: whole characters (a piece that is not is skipped).
      const size_t at = whole.size() > 4 ? rng() % (whole.size() - 2) : 0;
      const std::string piece =
          whole.size() > 4 ? whole.substr(at, 1 + rng() % std::min<size_t>(6, whole.size() - at))
                           : std::string();
      if (!piece.empty() && rng() % 2 == 0 && !detail::find_invalid_utf8(piece).has_value() &&
          (static_cast<unsigned char>(piece[0]) & 0xC0) != 0x80) {
        stop.push_back(piece);
      } else {
        stop.push_back("no such text " + std::to_string(s));
      }
    }
    // Generation ends with the token that completes a stop string (the scheduler stops the
    // request there), so no token after it exists: a stop string that would start earlier but
    // complete later never completes.
    bool expected_stop = false;
    for (size_t k = 1; k <= ids.size(); ++k) {
      reference_text(tokenizer, std::span(ids).first(k), stop, expected_stop);
      if (expected_stop) {
        ids.resize(k);
        break;
      }
    }
    const std::string expected = reference_text(tokenizer, ids, stop, expected_stop);
    StreamText text(tokenizer, stop);
    std::string previous;
    for (size_t fed = 0; fed < ids.size();) {
      fed = std::min(ids.size(), fed + 1 + rng() % 4);
      text.update(std::span(ids).first(fed), /*complete=*/false);
      const std::string& now = text.text();
      ASSERT_EQ(now.compare(0, previous.size(), previous), 0) << "text shrank or changed";
      ASSERT_EQ(expected.compare(0, now.size(), now), 0)
          << "not a prefix of the final text: trial " << trial << ", fed " << fed << " of "
          << ids.size() << ", shown \"" << now << "\", final \"" << expected << "\", stops "
          << ::testing::PrintToString(stop);
      ASSERT_FALSE(detail::find_invalid_utf8(now).has_value()) << "a broken character shown";
      for (const std::string& s : stop) ASSERT_EQ(now.find(s), std::string::npos);
      previous = now;
      if (text.stopped()) break;
    }
    text.update(ids, /*complete=*/true);
    EXPECT_EQ(text.text(), expected);
    EXPECT_EQ(text.stopped(), expected_stop);
    stopped_cases += expected_stop;
  }
  EXPECT_GT(stopped_cases, 30) << "the stop strings were exercised";
}

}  // namespace
}  // namespace quantmla
