// Tokenizer tests: exact ids against Hugging Face references, decoding, and error reporting.
#include <gtest/gtest.h>

#include <array>
#include <cctype>
#include <cstdint>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "error_matchers.h"
#include "quantmla/error.h"
#include "quantmla/io.h"
#include "quantmla/tokenizer.h"
#include "test_paths.h"
#include "tokenizer/regex.h"

namespace quantmla {
namespace {

namespace fs = std::filesystem;
using ::quantmla::testing::bundled_model;
using ::quantmla::testing::shared_dir;

const std::array<std::string, 4> kReferenceTexts = {"wiki", "valid", "multilingual", "edge"};
const std::array<std::string, 2> kReferenceTokenizers = {"mla-tiny", "deepseek-v3"};

const nlohmann::json& reference() {
  static const nlohmann::json data = nlohmann::json::parse(
      read_text_file(shared_dir() / "reference" / "tokenizer-reference.json"));
  return data;
}

fs::path tokenizer_path(std::string_view name) {
  if (name == "mla-tiny") return bundled_model() / "tokenizer.json";
  return shared_dir() / "tokenizers" / name / "tokenizer.json";
}

// Loading the 128K-entry tokenizer takes a moment, so each is loaded once for the whole suite.
const Tokenizer& tokenizer(std::string_view name) {
  if (name == "mla-tiny") {
    static const Tokenizer mla_tiny = Tokenizer::from_file(tokenizer_path("mla-tiny"));
    return mla_tiny;
  }
  static const Tokenizer deepseek = Tokenizer::from_file(tokenizer_path("deepseek-v3"));
  return deepseek;
}

// Compares whole id sequences, reporting the first difference with its neighbourhood.
::testing::AssertionResult same_ids(const std::vector<int32_t>& expected,
                                    const std::vector<int32_t>& actual) {
  const size_t common = std::min(expected.size(), actual.size());
  size_t first_mismatch = common;
  for (size_t i = 0; i < common; ++i) {
    if (expected[i] != actual[i]) {
      first_mismatch = i;
      break;
    }
  }
  if (first_mismatch == common && expected.size() == actual.size()) {
    return ::testing::AssertionSuccess();
  }
  const auto window = [&](const std::vector<int32_t>& ids) {
    std::string text;
    const size_t begin = first_mismatch >= 3 ? first_mismatch - 3 : 0;
    for (size_t i = begin; i < std::min(ids.size(), first_mismatch + 4); ++i) {
      if (i == first_mismatch) text += '[';
      text += std::to_string(ids[i]);
      text += i == first_mismatch ? "] " : " ";
    }
    return text;
  };
  return ::testing::AssertionFailure()
         << "first mismatch at index " << first_mismatch << " (expected " << expected.size()
         << " ids, got " << actual.size() << "); expected ... " << window(expected)
         << "..., got ... " << window(actual) << "...";
}

std::vector<int32_t> concat(std::initializer_list<std::vector<int32_t>> parts) {
  std::vector<int32_t> ids;
  for (const auto& part : parts) ids.insert(ids.end(), part.begin(), part.end());
  return ids;
}

// A scratch directory for hand-made tokenizer.json files, removed after the test.
class TempDir {
 public:
  TempDir() : path_(fs::temp_directory_path() / ("quantmla_tokenizer_test_" + unique_suffix())) {
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  fs::path write(const std::string& name, const std::string& content) const {
    const fs::path file = path_ / name;
    std::ofstream(file, std::ios::binary) << content;
    return file;
  }

 private:
  static std::string unique_suffix() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    return std::string(info->test_suite_name()) + "_" + info->name();
  }
  fs::path path_;
};

nlohmann::json bundled_json() {
  return nlohmann::json::parse(read_text_file(tokenizer_path("mla-tiny")));
}

// --- Hugging Face reference ids ---------------------------------------------------------------

TEST(TokenizerReference, CoversEveryReferenceEntry) {
  const nlohmann::json& texts = reference().at("texts");
  ASSERT_EQ(texts.size(), kReferenceTexts.size());
  for (const std::string& text_name : kReferenceTexts)
    EXPECT_TRUE(texts.contains(text_name)) << text_name;
  for (const std::string& tokenizer_name : kReferenceTokenizers) {
    EXPECT_EQ(reference().at("ids").at(tokenizer_name).size(), kReferenceTexts.size());
  }
  EXPECT_EQ(reference().at("ids").size(), 2 * kReferenceTokenizers.size());
}

class TokenizerReferenceText
    : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {
 protected:
  std::string_view tokenizer_name() const { return std::get<0>(GetParam()); }
  std::string text_name() const { return std::get<1>(GetParam()); }
  std::string text() const { return reference().at("texts").at(text_name()).get<std::string>(); }
  std::vector<int32_t> expected_ids() const {
    return reference()
        .at("ids")
        .at(std::string(tokenizer_name()))
        .at(text_name())
        .get<std::vector<int32_t>>();
  }
  bool expected_roundtrip() const {
    return reference()
        .at("ids")
        .at(std::string(tokenizer_name()) + "/decode_roundtrip")
        .at(text_name())
        .get<bool>();
  }
};

TEST_P(TokenizerReferenceText, EncodesExactly) {
  EXPECT_TRUE(same_ids(expected_ids(), tokenizer(tokenizer_name()).encode(text())));
}

TEST_P(TokenizerReferenceText, DecodeRoundTripsAsReferenceSays) {
  const Tokenizer& tok = tokenizer(tokenizer_name());
  EXPECT_EQ(tok.decode(expected_ids()) == text(), expected_roundtrip());
  EXPECT_EQ(tok.decode(tok.encode(text())) == text(), expected_roundtrip());
}

INSTANTIATE_TEST_SUITE_P(AllReferenceTexts, TokenizerReferenceText,
                         ::testing::Combine(::testing::ValuesIn(kReferenceTokenizers),
                                            ::testing::ValuesIn(kReferenceTexts)),
                         [](const auto& info) {
                           std::string name =
                               std::string(std::get<0>(info.param)) + "_" + std::get<1>(info.param);
                           for (char& c : name) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name;
                         });

TEST(TokenizerReference, WikiText2TestFileIdsMatch) {
  const std::string text =
      read_text_file_universal_newlines(shared_dir() / "reference" / "wikitext2-test.raw");
  const auto expected = read_ids_file(shared_dir() / "reference" / "wikitext2-test.ids.i32");
  EXPECT_TRUE(same_ids(expected, tokenizer("mla-tiny").encode(text)));
}

TEST(TokenizerReference, ValidFileIdsMatch) {
  const std::string text =
      read_text_file_universal_newlines(shared_dir() / "reference" / "valid.txt");
  const auto expected = read_ids_file(shared_dir() / "reference" / "valid.ids.i32");
  EXPECT_TRUE(same_ids(expected, tokenizer("mla-tiny").encode(text)));
}

// --- Vocabulary, added tokens and decoding ----------------------------------------------------

TEST(Tokenizer, VocabSizeIsMaxIdPlusOne) {
  EXPECT_EQ(tokenizer("mla-tiny").vocab_size(), 4096);
  EXPECT_EQ(tokenizer("deepseek-v3").vocab_size(), 128815);
}

TEST(Tokenizer, TokenToIdFindsVocabAndAddedTokens) {
  const Tokenizer& tiny = tokenizer("mla-tiny");
  EXPECT_EQ(tiny.token_to_id("<|begin_of_text|>"), 0);
  EXPECT_EQ(tiny.token_to_id("!"), 2);
  EXPECT_EQ(tiny.token_to_id("no such token here"), std::nullopt);
  const Tokenizer& deepseek = tokenizer("deepseek-v3");
  EXPECT_EQ(deepseek.token_to_id("<｜begin▁of▁sentence｜>"), 0);
  EXPECT_EQ(deepseek.token_to_id("<｜tool▁sep｜>"), 128814);
  const auto the = deepseek.token_to_id("Ġthe");
  ASSERT_TRUE(the.has_value());
  EXPECT_EQ(deepseek.token_bytes(*the), " the");
}

TEST(Tokenizer, AddedTokensAreCutOutOfText) {
  const Tokenizer& tiny = tokenizer("mla-tiny");
  EXPECT_EQ(tiny.encode("<|begin_of_text|>Hello<|end_of_text|>"),
            concat({{0}, tiny.encode("Hello"), {1}}));
  // Both matching passes: special (normalized=false) and normalized=true added tokens.
  const Tokenizer& deepseek = tokenizer("deepseek-v3");
  EXPECT_EQ(deepseek.encode("<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>"),
            concat({{0, *deepseek.token_to_id("<｜User｜>")},
                    deepseek.encode("Hi"),
                    {*deepseek.token_to_id("<｜Assistant｜>")}}));
}

TEST(Tokenizer, DecodeKeepsOrSkipsSpecialTokens) {
  const Tokenizer& tiny = tokenizer("mla-tiny");
  const std::vector<int32_t> ids = concat({{0}, tiny.encode("Hello world"), {1}});
  EXPECT_EQ(tiny.decode(ids), "<|begin_of_text|>Hello world<|end_of_text|>");
  EXPECT_EQ(tiny.decode(ids, /*skip_special=*/true), "Hello world");
}

TEST(Tokenizer, TokenBytesStreamPartialCharactersAndDecodeRepairsThem) {
  const Tokenizer& tiny = tokenizer("mla-tiny");
  const std::string euro = "\xE2\x82\xAC";  // U+20AC, three bytes, likely split into tokens
  const std::vector<int32_t> ids = tiny.encode(euro);
  std::string streamed;
  for (const int32_t id : ids) streamed += tiny.token_bytes(id);
  EXPECT_EQ(streamed, euro);
  // A lone first byte of a multi-byte character is not UTF-8: decode shows U+FFFD.
  const auto lead_byte_token = tiny.token_to_id("\xC3\xA2");  // byte 0xE2 in byte-level spelling
  ASSERT_TRUE(lead_byte_token.has_value());
  EXPECT_EQ(tiny.token_bytes(*lead_byte_token), "\xE2");
  EXPECT_EQ(tiny.decode({*lead_byte_token}), "\xEF\xBF\xBD");
}

TEST(Tokenizer, EmptyTextHasNoIds) {
  EXPECT_TRUE(tokenizer("mla-tiny").encode("").empty());
  EXPECT_EQ(tokenizer("mla-tiny").decode({}), "");
}

TEST(Tokenizer, LongRunsDoNotOverflowTheRegexEngine) {
  const Tokenizer& tiny = tokenizer("mla-tiny");
  for (const char filler : {' ', 'a', '7', '!', '\n'}) {
    const std::string text(1 << 20, filler);
    const std::vector<int32_t> ids = tiny.encode(text);
    EXPECT_FALSE(ids.empty());
    EXPECT_EQ(tiny.decode(ids), text) << "filler byte " << static_cast<int>(filler);
  }
}

TEST(Tokenizer, FromModelDirReadsTokenizerJson) {
  const Tokenizer tok = Tokenizer::from_model_dir(bundled_model());
  EXPECT_EQ(tok.encode("Hello world"), tokenizer("mla-tiny").encode("Hello world"));
}

// Oniguruma's \s (which Hugging Face uses) excludes U+180E; PCRE2's includes it.
TEST(TokenizerRegex, WhitespaceClassFollowsOniguruma) {
  const detail::Regex gpt2(
      R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)",
      detail::Regex::Syntax::kOniguruma, "test");
  std::vector<std::string_view> pieces;
  gpt2.split_isolated({"\u180E!"}, pieces);
  EXPECT_EQ(pieces, (std::vector<std::string_view>{"\u180E!"}));
  pieces.clear();
  gpt2.split_isolated({"a\u00A0\u3000!"}, pieces);
  EXPECT_EQ(pieces, (std::vector<std::string_view>{"a", "\u00A0", "\u3000", "!"}));
  EXPECT_EQ(detail::oniguruma_to_pcre2(R"([]\s]\S[^\s])"),
            R"([]\x{9}-\x{d}\x{85}\p{Z}][^\x{9}-\x{d}\x{85}\p{Z}][^\x{9}-\x{d}\x{85}\p{Z}])");
}

// Added-token options, on the bundled tokenizer plus hand-made added tokens.
TEST(Tokenizer, AddedTokenStripAndSingleWordOptions) {
  nlohmann::json spec = bundled_json();
  const auto add = [&](int id, const char* content, bool lstrip, bool rstrip, bool single_word) {
    spec["added_tokens"].push_back({{"id", id},
                                    {"content", content},
                                    {"single_word", single_word},
                                    {"lstrip", lstrip},
                                    {"rstrip", rstrip},
                                    {"normalized", false},
                                    {"special", true}});
  };
  add(4096, "<left>", true, false, false);
  add(4097, "<right>", false, true, false);
  add(4098, "qz", false, false, true);
  const TempDir dir;
  const Tokenizer tok = Tokenizer::from_file(dir.write("tokenizer.json", spec.dump()));
  const Tokenizer& base = tokenizer("mla-tiny");
  EXPECT_EQ(tok.vocab_size(), 4099);
  EXPECT_EQ(tok.encode("a  <left> b"), concat({base.encode("a"), {4096}, base.encode(" b")}));
  EXPECT_EQ(tok.encode("a<right> \t b"), concat({base.encode("a"), {4097}, base.encode("b")}));
  EXPECT_EQ(tok.encode("a qz b"), concat({base.encode("a "), {4098}, base.encode(" b")}));
  EXPECT_EQ(tok.encode("aqz b"), base.encode("aqz b"));
  EXPECT_EQ(tok.encode("a qzé"), base.encode("a qzé"));
  EXPECT_EQ(tok.decode(tok.encode("x<left>y"), /*skip_special=*/true), "xy");
}

TEST(Tokenizer, IgnoreMergesLooksUpWholeWordsFirst) {
  nlohmann::json spec = bundled_json();
  spec["model"]["ignore_merges"] = true;
  const TempDir dir;
  const Tokenizer tok = Tokenizer::from_file(dir.write("tokenizer.json", spec.dump()));
  const auto the = tok.token_to_id("Ġthe");
  ASSERT_TRUE(the.has_value());
  EXPECT_EQ(tok.encode(" the"), std::vector<int32_t>{*the});
}

// --- Errors ------------------------------------------------------------------------------------

using testing::error_message;

TEST(TokenizerErrors, MissingFileIsIoError) {
  const std::string message = error_message<IoError>(
      [&] { Tokenizer::from_file(fs::temp_directory_path() / "quantmla_no_such_tokenizer.json"); });
  EXPECT_NE(message.find("quantmla_no_such_tokenizer.json"), std::string::npos) << message;
  EXPECT_THROW(Tokenizer::from_model_dir(fs::temp_directory_path() / "quantmla_no_such_model"),
               IoError);
}

TEST(TokenizerErrors, MalformedJsonIsFormatError) {
  const TempDir dir;
  const fs::path file = dir.write("tokenizer.json", R"({"model": {"type": "BPE", "vocab": )");
  const std::string message = error_message<FormatError>([&] { Tokenizer::from_file(file); });
  EXPECT_NE(message.find(file.string()), std::string::npos) << message;
}

TEST(TokenizerErrors, UnsupportedModelTypeIsNamed) {
  nlohmann::json spec = bundled_json();
  spec["model"] = {{"type", "Unigram"}, {"vocab", nlohmann::json::array()}};
  const TempDir dir;
  const fs::path file = dir.write("tokenizer.json", spec.dump());
  const std::string message = error_message<FormatError>([&] { Tokenizer::from_file(file); });
  EXPECT_NE(message.find("Unigram"), std::string::npos) << message;
}

TEST(TokenizerErrors, UnsupportedComponentsAreNamed) {
  const TempDir dir;
  const auto message_for = [&](const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json spec = bundled_json();
    change(spec);
    const fs::path file = dir.write("tokenizer.json", spec.dump());
    return error_message<FormatError>([&] { Tokenizer::from_file(file); });
  };
  EXPECT_NE(message_for([](auto& s) {
              s["normalizer"] = {{"type", "NFKC"}};
            }).find("NFKC"),
            std::string::npos);
  EXPECT_NE(message_for([](auto& s) {
              s["pre_tokenizer"] = {{"type", "Whitespace"}};
            }).find("Whitespace"),
            std::string::npos);
  EXPECT_NE(message_for([](auto& s) {
              s["decoder"] = {{"type", "Metaspace"}};
            }).find("Metaspace"),
            std::string::npos);
  EXPECT_NE(message_for([](auto& s) { s["model"]["merges"].push_back("Ġ zzzz"); }).find("zzzz"),
            std::string::npos);
  EXPECT_NE(
      message_for([](auto& s) {
        s["pre_tokenizer"] = {
            {"type", "Sequence"},
            {"pretokenizers",
             {{{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}},
              s["pre_tokenizer"]}}};
      }).find("(unclosed"),
      std::string::npos);
}

// Found by fuzz_tokenizer_json: one id of 666666650 among 261 tokens made the dense id tables
// ~21 GB. Gaps of up to 2^20 ids stay accepted.
TEST(TokenizerErrors, SparseIdsBeyondTheVocabularyAreFormatError) {
  const TempDir dir;
  const auto load_with_id = [&](int64_t id) {
    nlohmann::json spec = bundled_json();
    spec["model"]["vocab"]["zzqq"] = id;
    return Tokenizer::from_file(dir.write("tokenizer.json", spec.dump()));
  };
  for (const int64_t id : {int64_t{666666650}, int64_t{2147483647}}) {
    const std::string message = error_message<FormatError>([&] { load_with_id(id); });
    EXPECT_NE(message.find(std::to_string(id)), std::string::npos) << message;
  }
  const int64_t vocab =
      Tokenizer::from_file(dir.write("tokenizer.json", bundled_json().dump())).vocab_size();
  EXPECT_EQ(load_with_id(vocab + 1000).vocab_size(), vocab + 1001);
}

TEST(TokenizerErrors, DecodeOfUnknownIdIsInvalidArgument) {
  const Tokenizer& tiny = tokenizer("mla-tiny");
  const std::string message = error_message<InvalidArgument>([&] { tiny.decode({5, 4096}); });
  EXPECT_NE(message.find("4096"), std::string::npos) << message;
  EXPECT_THROW(tiny.decode({-1}), InvalidArgument);
  EXPECT_TRUE(tiny.knows(0));
  EXPECT_TRUE(tiny.knows(static_cast<int32_t>(tiny.vocab_size() - 1)));
  EXPECT_FALSE(tiny.knows(-1));
  EXPECT_FALSE(tiny.knows(static_cast<int32_t>(tiny.vocab_size())));
  EXPECT_THROW(tiny.token_bytes(1 << 20), InvalidArgument);
}

TEST(TokenizerErrors, InvalidUtf8TextIsInvalidArgument) {
  EXPECT_THROW(tokenizer("mla-tiny").encode("ok \xFF then"), InvalidArgument);
  EXPECT_THROW(tokenizer("mla-tiny").encode("truncated \xE2\x82"), InvalidArgument);
}

}  // namespace
}  // namespace quantmla
