#include "tokenizer/bpe.h"

#include <limits>
#include <queue>

#include "quantmla/error.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/json_fields.h"

namespace quantmla::detail {
namespace {

// A null or empty string option is the neutral value; anything else changes how words are
// spelled (WordPiece-style affixes) and is not supported here.
void require_no_affix(const nlohmann::json& spec, std::string_view key) {
  const auto it = spec.find(key);
  if (it == spec.end() || it->is_null()) return;
  if (it->is_string() && it->get<std::string>().empty()) return;
  throw FormatError("model." + std::string(key) + " = " + it->dump() + " is not supported");
}

}  // namespace

BpeModel::BpeModel(const nlohmann::json& spec) {
  const std::string type = require_string(spec, "type", "model");
  if (type != "BPE") {
    throw FormatError("unsupported model type '" + type + "' (supported: BPE)");
  }
  const auto dropout = spec.find("dropout");
  if (dropout != spec.end() && !dropout->is_null() &&
      !(dropout->is_number() && dropout->get<double>() == 0.0)) {
    throw FormatError("model.dropout = " + dropout->dump() +
                      " is not supported (random merges at inference)");
  }
  if (optional_bool(spec, "byte_fallback", false, "model")) {
    throw FormatError("model.byte_fallback = true is not supported");
  }
  require_no_affix(spec, "continuing_subword_prefix");
  require_no_affix(spec, "end_of_word_suffix");
  ignore_merges_ = optional_bool(spec, "ignore_merges", false, "model");
  fuse_unknown_ = optional_bool(spec, "fuse_unk", false, "model");

  load_vocab(require_field(spec, "vocab", "model"));
  load_merges(require_field(spec, "merges", "model"));

  const auto unknown = spec.find("unk_token");
  if (unknown != spec.end() && !unknown->is_null()) {
    const std::string unknown_token = require_string(spec, "unk_token", "model");
    const auto it = vocab_.find(unknown_token);
    if (it == vocab_.end()) {
      throw FormatError("model.unk_token '" + unknown_token + "' is not in model.vocab");
    }
    unknown_id_ = it->second;
  }
}

void BpeModel::load_vocab(const nlohmann::json& vocab) {
  if (!vocab.is_object()) {
    throw FormatError(std::string("model.vocab must be an object, got ") + vocab.type_name());
  }
  vocab_.reserve(vocab.size());
  for (const auto& [token, id] : vocab.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      throw FormatError("model.vocab['" + token + "'] must be an id in [0, 2^31), got " +
                        id.dump());
    }
    vocab_.emplace(token, id.get<int32_t>());
  }
  for (unsigned byte = 0; byte < 256; ++byte) {
    const auto it = vocab_.find(to_byte_level(std::string(1, static_cast<char>(byte))));
    byte_ids_[byte] = it == vocab_.end() ? -1 : it->second;
  }
}

void BpeModel::load_merges(const nlohmann::json& merges) {
  if (!merges.is_array()) {
    throw FormatError(std::string("model.merges must be an array, got ") + merges.type_name());
  }
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const nlohmann::json& entry = merges[rank];
    const std::string where = "model.merges[" + std::to_string(rank) + "]";
    std::string left;
    std::string right;
    if (entry.is_string()) {
      // "a b": byte-level tokens never contain a plain space, so it separates the halves.
      const std::string text = entry.get<std::string>();
      const size_t space = text.find(' ');
      if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos) {
        throw FormatError(where + " = \"" + text + "\" is not two tokens separated by a space");
      }
      left = text.substr(0, space);
      right = text.substr(space + 1);
    } else if (entry.is_array() && entry.size() == 2 && entry[0].is_string() &&
               entry[1].is_string()) {
      left = entry[0].get<std::string>();
      right = entry[1].get<std::string>();
    } else {
      throw FormatError(where + " = " + entry.dump() + " is neither \"a b\" nor a pair of strings");
    }
    const auto id_of = [&](const std::string& token) {
      const auto it = vocab_.find(token);
      if (it == vocab_.end()) {
        throw FormatError(where + ": token '" + token + "' is not in model.vocab");
      }
      return it->second;
    };
    const int32_t left_id = id_of(left);
    const int32_t right_id = id_of(right);
    const int32_t merged_id = id_of(left + right);
    // A repeated pair keeps its last rank, as in Hugging Face's map construction.
    merges_.insert_or_assign(pair_key(left_id, right_id),
                             Merge{static_cast<uint32_t>(rank), merged_id});
  }
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (word.size() == 1 && byte_ids_[static_cast<uint8_t>(word[0])] >= 0) {
    out.push_back(byte_ids_[static_cast<uint8_t>(word[0])]);
    return;
  }
  if (ignore_merges_) {
    const auto it = vocab_.find(to_byte_level(word));
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  {
    const std::lock_guard lock(cache_mutex_);
    const auto hit = cache_.find(word);
    if (hit != cache_.end()) {
      out.insert(out.end(), hit->second.begin(), hit->second.end());
      return;
    }
  }
  std::vector<int32_t> ids = merge_word(word);
  out.insert(out.end(), ids.begin(), ids.end());
  if (word.size() <= kMaxCachedWordBytes) {
    const std::lock_guard lock(cache_mutex_);
    if (cache_.size() < kCacheCapacity) cache_.emplace(word, std::move(ids));
  }
}

std::vector<int32_t> BpeModel::initial_symbols(std::string_view word) const {
  std::vector<int32_t> symbols;
  symbols.reserve(word.size());
  bool previous_was_unknown = false;
  for (const char byte : word) {
    const int32_t id = byte_ids_[static_cast<uint8_t>(byte)];
    if (id >= 0) {
      symbols.push_back(id);
      previous_was_unknown = false;
    } else if (unknown_id_) {
      if (!(fuse_unknown_ && previous_was_unknown)) symbols.push_back(*unknown_id_);
      previous_was_unknown = true;
    }
    // Without an unknown token, Hugging Face drops a byte that has no token; so do we.
  }
  return symbols;
}

std::vector<int32_t> BpeModel::merge_word(std::string_view word) const {
  struct Symbol {
    int32_t id;
    int32_t prev;  // index of the previous live symbol, -1 at the start
    int32_t next;  // index of the next live symbol, -1 at the end
    bool merged_away;
  };
  struct Candidate {
    uint32_t rank;
    int32_t left;  // index of the pair's left symbol
    int32_t merged_id;
    // std::priority_queue pops the largest: make that the lowest rank, then the leftmost pair.
    bool operator<(const Candidate& other) const {
      return rank != other.rank ? rank > other.rank : left > other.left;
    }
  };

  const std::vector<int32_t> initial = initial_symbols(word);
  const auto count = static_cast<int32_t>(initial.size());
  std::vector<Symbol> symbols(initial.size());
  for (int32_t i = 0; i < count; ++i) {
    symbols[i] = Symbol{initial[i], i - 1, i + 1 < count ? i + 1 : -1, false};
  }

  std::priority_queue<Candidate> queue;
  const auto push_candidate = [&](int32_t left) {
    const Symbol& left_symbol = symbols[left];
    if (left_symbol.next < 0) return;
    const auto it = merges_.find(pair_key(left_symbol.id, symbols[left_symbol.next].id));
    if (it != merges_.end()) queue.push(Candidate{it->second.rank, left, it->second.merged_id});
  };
  for (int32_t i = 0; i + 1 < count; ++i) push_candidate(i);

  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.left];
    if (left.merged_away || left.next < 0) continue;
    // Entries go stale when a neighbour merged first; the pair must still produce this token.
    const auto current = merges_.find(pair_key(left.id, symbols[left.next].id));
    if (current == merges_.end() || current->second.merged_id != top.merged_id) continue;

    Symbol& right = symbols[left.next];
    left.id = top.merged_id;
    left.next = right.next;
    right.merged_away = true;
    if (left.next >= 0) symbols[left.next].prev = top.left;
    if (left.prev >= 0) push_candidate(left.prev);
    push_candidate(top.left);
  }

  std::vector<int32_t> ids;
  for (int32_t i = count > 0 ? 0 : -1; i >= 0; i = symbols[i].next) ids.push_back(symbols[i].id);
  return ids;
}

}  // namespace quantmla::detail
