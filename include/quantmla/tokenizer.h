// Hugging Face `tokenizer.json` byte-level BPE (GPT-2 / Llama-3 / DeepSeek style).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace quantmla {

class Tokenizer {
 public:
  // Loads tokenizer.json. Supported: model BPE (merges as "a b" strings or [a, b] pairs), no or
  // empty-Sequence normalizer, pre_tokenizer ByteLevel (use_regex true/false) or Sequence of
  // Split(Regex, Isolated) + ByteLevel, ByteLevel decoder, added/special tokens. Anything else
  // throws FormatError naming the unsupported component.
  static Tokenizer from_file(const std::filesystem::path& tokenizer_json);
  // Looks for DIR/tokenizer.json.
  static Tokenizer from_model_dir(const std::filesystem::path& model_dir);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Whole-text encoding as HF `tokenizer.encode(text, add_special_tokens=False)`: added tokens are
  // matched first, the rest is pre-tokenized and BPE-merged. No BOS.
  std::vector<int32_t> encode(std::string_view text) const;
  // Inverse byte-level mapping; special tokens are kept unless skip_special.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;
  // Decoder for streaming: bytes of one token (may be an incomplete UTF-8 sequence).
  std::string token_bytes(int32_t id) const;

  int64_t vocab_size() const;  // max id + 1 over the model vocab and added tokens
  // Whether `id` names a token (decode and token_bytes refuse the others). A model may generate
  // ids its tokenizer lacks (make-random-model's production-size vocabularies over the bundled
  // tokenizer); the server and `generate` show them as no text, as Hugging Face's decode skips
  // them.
  bool knows(int32_t id) const;
  // Whether a known id is a special token (decode(..., skip_special) leaves those out).
  bool is_special(int32_t id) const;
  std::optional<int32_t> token_to_id(std::string_view token) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace quantmla
