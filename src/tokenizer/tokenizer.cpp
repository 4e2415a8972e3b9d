#include "quantmla/tokenizer.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "quantmla/error.h"
#include "tokenizer/added_tokens.h"
#include "tokenizer/bpe.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/json_fields.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/string_map.h"
#include "tokenizer/utf8.h"

namespace quantmla {
namespace {

void require_identity_normalizer(const nlohmann::json& spec) {
  const auto normalizer = spec.find("normalizer");
  if (normalizer == spec.end() || normalizer->is_null()) return;
  const std::string type = detail::require_string(*normalizer, "type", "normalizer");
  if (type == "Sequence") {
    const nlohmann::json& steps = detail::require_field(*normalizer, "normalizers", "normalizer");
    if (steps.is_array() && steps.empty()) return;
    throw FormatError("unsupported normalizer: Sequence of " + std::to_string(steps.size()) +
                      " normalizers (only an empty Sequence is supported)");
  }
  throw FormatError("unsupported normalizer type '" + type + "' (only none is supported)");
}

void require_byte_level_decoder(const nlohmann::json& spec) {
  const auto decoder = spec.find("decoder");
  if (decoder == spec.end() || decoder->is_null()) {
    throw FormatError("decoder is missing; only the ByteLevel decoder is supported");
  }
  const std::string type = detail::require_string(*decoder, "type", "decoder");
  if (type != "ByteLevel") {
    throw FormatError("unsupported decoder type '" + type + "' (supported: ByteLevel)");
  }
}

void require_no_truncation(const nlohmann::json& spec) {
  // Truncation would cut encode()'s output; padding and the post-processor only matter for
  // batches and for add_special_tokens=True, which this API does not offer.
  const auto truncation = spec.find("truncation");
  if (truncation != spec.end() && !truncation->is_null()) {
    throw FormatError("truncation = " + truncation->dump() + " is not supported");
  }
}

std::vector<detail::AddedToken> parse_added_tokens(const nlohmann::json& spec) {
  std::vector<detail::AddedToken> tokens;
  const auto list = spec.find("added_tokens");
  if (list == spec.end() || list->is_null()) return tokens;
  if (!list->is_array()) {
    throw FormatError(std::string("added_tokens must be an array, got ") + list->type_name());
  }
  for (size_t i = 0; i < list->size(); ++i) {
    const nlohmann::json& entry = (*list)[i];
    const std::string where = "added_tokens[" + std::to_string(i) + "]";
    const nlohmann::json& id = detail::require_field(entry, "id", where);
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      throw FormatError(where + ".id must be an id in [0, 2^31), got " + id.dump());
    }
    detail::AddedToken token;
    token.id = id.get<int32_t>();
    token.content = detail::require_string(entry, "content", where);
    token.single_word = detail::optional_bool(entry, "single_word", false, where);
    token.lstrip = detail::optional_bool(entry, "lstrip", false, where);
    token.rstrip = detail::optional_bool(entry, "rstrip", false, where);
    token.special = detail::optional_bool(entry, "special", false, where);
    token.normalized = detail::optional_bool(entry, "normalized", !token.special, where);
    tokens.push_back(std::move(token));
  }
  return tokens;
}

std::string read_file(const std::filesystem::path& path) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    throw IoError("tokenizer file " + path.string() + " does not exist or is not a regular file");
  }
  std::ifstream stream(path, std::ios::binary);
  if (!stream) {
    throw IoError("cannot open tokenizer file " + path.string() + ": " + std::strerror(errno));
  }
  std::ostringstream content;
  content << stream.rdbuf();
  if (stream.bad()) throw IoError("cannot read tokenizer file " + path.string());
  return std::move(content).str();
}

}  // namespace

struct Tokenizer::Impl {
  enum class TokenKind : uint8_t { kUnassigned, kRegular, kSpecial };

  explicit Impl(const nlohmann::json& spec)
      : model(detail::require_field(spec, "model", "tokenizer.json")),
        pre_tokenizer(detail::require_field(spec, "pre_tokenizer", "tokenizer.json")),
        added_tokens(parse_added_tokens(spec)),
        added_token_matcher(added_tokens) {
    require_identity_normalizer(spec);
    require_byte_level_decoder(spec);
    require_no_truncation(spec);
    build_id_tables();
  }

  // The id tables are dense, indexed by id, as Hugging Face's ids are (0 to the vocabulary's size,
  // a few added tokens past it). A file whose ids leave more than this many unused would make
  // them any size (an id of 2^31 - 1: tens of GB of strings): refused.
  static constexpr int64_t kMaxUnusedIds = int64_t{1} << 20;

  void build_id_tables() {
    int32_t max_id = -1;
    for (const auto& [token, id] : model.vocab()) max_id = std::max(max_id, id);
    for (const detail::AddedToken& token : added_tokens) max_id = std::max(max_id, token.id);
    const int64_t tokens = static_cast<int64_t>(model.vocab().size() + added_tokens.size());
    if (static_cast<int64_t>(max_id) + 1 - tokens > kMaxUnusedIds) {
      throw FormatError("tokenizer.json: token ids reach " + std::to_string(max_id) + " for " +
                        std::to_string(tokens) + " tokens, more than " +
                        std::to_string(kMaxUnusedIds) +
                        " ids unused (ids are expected from 0 up, as a vocabulary numbers them)");
    }
    bytes_of_id.resize(static_cast<size_t>(max_id) + 1);
    kind_of_id.resize(static_cast<size_t>(max_id) + 1, TokenKind::kUnassigned);
    for (const auto& [token, id] : model.vocab()) {
      // As in Hugging Face's ByteLevel decoder, a token with characters outside the byte-level
      // alphabet stands for its own UTF-8 text.
      bytes_of_id[id] = detail::from_byte_level(token).value_or(token);
      kind_of_id[id] = TokenKind::kRegular;
    }
    // Added tokens take precedence over a vocabulary entry with the same id, as when decoding
    // with Hugging Face.
    for (const detail::AddedToken& token : added_tokens) {
      bytes_of_id[token.id] = token.content;
      kind_of_id[token.id] = token.special ? TokenKind::kSpecial : TokenKind::kRegular;
      id_of_added_token.insert_or_assign(token.content, token.id);
    }
  }

  // The bytes of `id`; throws InvalidArgument naming `caller` for an unassigned id.
  const std::string& checked_bytes(int32_t id, std::string_view caller) const {
    if (id < 0 || static_cast<size_t>(id) >= bytes_of_id.size() ||
        kind_of_id[id] == TokenKind::kUnassigned) {
      throw InvalidArgument(std::string(caller) + ": token id " + std::to_string(id) +
                            " is not in the vocabulary (ids 0.." +
                            std::to_string(static_cast<int64_t>(bytes_of_id.size()) - 1) + ")");
    }
    return bytes_of_id[id];
  }

  detail::BpeModel model;
  detail::PreTokenizer pre_tokenizer;
  std::vector<detail::AddedToken> added_tokens;
  detail::AddedTokenMatcher added_token_matcher;
  detail::StringMap<int32_t> id_of_added_token;
  std::vector<std::string> bytes_of_id;
  std::vector<TokenKind> kind_of_id;
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_file(const std::filesystem::path& tokenizer_json) {
  const std::string text = read_file(tokenizer_json);
  try {
    return Tokenizer(std::make_unique<Impl>(nlohmann::json::parse(text)));
  } catch (const nlohmann::json::exception& error) {
    // Parse errors, and type errors that slipped past the explicit checks.
    throw FormatError(tokenizer_json.string() + ": invalid tokenizer JSON: " + error.what());
  } catch (const FormatError& error) {
    throw FormatError(tokenizer_json.string() + ": " + error.what());
  }
}

Tokenizer Tokenizer::from_model_dir(const std::filesystem::path& model_dir) {
  return from_file(model_dir / "tokenizer.json");
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  if (const auto bad_offset = detail::find_invalid_utf8(text)) {
    throw InvalidArgument("Tokenizer::encode: text is not valid UTF-8 at byte " +
                          std::to_string(*bad_offset));
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3);
  std::vector<std::string_view> words;
  for (const detail::TextSegment& segment : impl_->added_token_matcher.split(text)) {
    if (segment.added_token_id) {
      ids.push_back(*segment.added_token_id);
      continue;
    }
    words.clear();
    impl_->pre_tokenizer.split(segment.text, words);
    for (const std::string_view word : words) impl_->model.encode_word(word, ids);
  }
  return ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string bytes;
  for (const int32_t id : ids) {
    const std::string& token = impl_->checked_bytes(id, "Tokenizer::decode");
    if (skip_special && impl_->kind_of_id[id] == Impl::TokenKind::kSpecial) continue;
    bytes += token;
  }
  // A cut through a multi-byte character decodes to U+FFFD, as Hugging Face does.
  return detail::repair_utf8(bytes);
}

std::string Tokenizer::token_bytes(int32_t id) const {
  return impl_->checked_bytes(id, "Tokenizer::token_bytes");
}

bool Tokenizer::knows(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->bytes_of_id.size() &&
         impl_->kind_of_id[id] != Impl::TokenKind::kUnassigned;
}

bool Tokenizer::is_special(int32_t id) const {
  return knows(id) && impl_->kind_of_id[id] == Impl::TokenKind::kSpecial;
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->bytes_of_id.size()); }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (const auto it = impl_->id_of_added_token.find(token); it != impl_->id_of_added_token.end()) {
    return it->second;
  }
  const auto& vocab = impl_->model.vocab();
  if (const auto it = vocab.find(token); it != vocab.end()) return it->second;
  return std::nullopt;
}

}  // namespace quantmla
