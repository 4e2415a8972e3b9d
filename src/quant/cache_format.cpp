// Cache spec parsing, canonical spelling and encoded sizes of the two MLA cache paths (DESIGN §3).
#include "quantmla/cache_format.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "quant/format_checks.h"
#include "quant/records.h"
#include "quantmla/cache.h"
#include "quantmla/error.h"

namespace quantmla {
namespace {

// How a codec's group size is chosen.
enum class GroupRule {
  kNone,    // f32, bf16: every value is stored on its own
  kFixed,   // fp8, q8_0, q4_0: one group size, which may be spelled out ("fp8:g128")
  kChosen,  // int8, int4, int2: the spec must name the group; a clip ratio may follow
};

struct CodecInfo {
  Codec codec;
  std::string_view name;
  int bits;
  GroupRule group_rule;
  int fixed_group;            // GroupRule::kFixed only
  int scale_bytes_per_group;  // FP32 scale (fp8), FP16 scale + min (int*), FP16 d (q8_0, q4_0)
};

constexpr std::array<CodecInfo, 8> kCodecs = {{
    {Codec::kF32, "f32", 32, GroupRule::kNone, 0, 0},
    {Codec::kBF16, "bf16", 16, GroupRule::kNone, 0, 0},
    {Codec::kFP8, "fp8", 8, GroupRule::kFixed, 128, 4},
    {Codec::kInt8, "int8", 8, GroupRule::kChosen, 0, 4},
    {Codec::kInt4, "int4", 4, GroupRule::kChosen, 0, 4},
    {Codec::kInt2, "int2", 2, GroupRule::kChosen, 0, 4},
    {Codec::kQ8_0, "q8_0", 8, GroupRule::kFixed, 32, 2},
    {Codec::kQ4_0, "q4_0", 4, GroupRule::kFixed, 32, 2},
}};

// kCodecs is indexed by the enumerator value.
constexpr bool table_matches_enum() {
  for (size_t i = 0; i < kCodecs.size(); ++i) {
    if (static_cast<size_t>(kCodecs[i].codec) != i) return false;
  }
  return true;
}
static_assert(table_matches_enum());

constexpr std::array<int, 3> kChoosableGroups = {32, 64, 128};
constexpr std::string_view kAcceptedCodecs = "f32, bf16, fp8, int8, int4, int2, q8_0, q4_0";
constexpr std::string_view kAcceptedGroups = "g32, g64, g128";
constexpr std::string_view kClipPrefix = "clip";
constexpr std::string_view kPairsKey = "bf16pairs";
constexpr std::string_view kPairsExample = "e.g. \"bf16pairs=5+21\"";

const CodecInfo& info(Codec codec) {
  const auto index = static_cast<size_t>(codec);
  if (index >= kCodecs.size()) {
    throw InvalidArgument("cache format: " + std::to_string(index) + " is not a Codec value");
  }
  return kCodecs[index];
}

// fp8 keeps one scale per 128 channels, or per 64 where a path is that narrow (the RoPE key).
constexpr int kFp8NarrowGroup = 64;
bool fixed_group_allowed(const CodecInfo& codec_info, int group) {
  return group == codec_info.fixed_group ||
         (codec_info.codec == Codec::kFP8 && group == kFp8NarrowGroup);
}

// Built by appending: GCC 12 at -O3 warns falsely (-Wrestrict) on `"literal" + std::string&&`.
std::string quoted(std::string_view text) {
  std::string result(1, '"');
  result += text;
  result += '"';
  return result;
}

std::string_view trim(std::string_view text) {
  constexpr std::string_view kBlanks = " \t";
  const size_t first = text.find_first_not_of(kBlanks);
  if (first == std::string_view::npos) return {};
  return text.substr(first, text.find_last_not_of(kBlanks) - first + 1);
}

std::vector<std::string_view> split(std::string_view text, char separator) {
  std::vector<std::string_view> fields;
  size_t start = 0;
  while (true) {
    const size_t end = text.find(separator, start);
    fields.push_back(text.substr(start, end - start));
    if (end == std::string_view::npos) return fields;
    start = end + 1;
  }
}

// Shortest decimal that reads back as the same float, so that to_string round-trips.
std::string shortest_decimal(float value) {
  std::array<char, 32> buffer;
  const auto result = std::to_chars(buffer.data(), buffer.data() + buffer.size(), value);
  return std::string(buffer.data(), result.ptr);
}

std::string group_spelling(int group) {
  std::string spelling(1, 'g');
  spelling += std::to_string(group);
  return spelling;
}

// "clipR" with R in (0, 1].
template <typename Error>
float parse_clip(std::string_view field, const Error& error) {
  const std::string_view digits = field.substr(kClipPrefix.size());
  float clip = 0.0f;
  const auto [end, status] = std::from_chars(digits.data(), digits.data() + digits.size(), clip);
  if (status != std::errc() || end != digits.data() + digits.size() ||
      !(clip > 0.0f && clip <= 1.0f)) {
    throw error("bad clip " + quoted(field) +
                " (accepted: clipR with R in (0, 1], e.g. \"clip0.9\")");
  }
  return clip;
}

// "bf16pairs=I+J+..." with non-negative pair indices in any order, returned sorted. The width
// they must fit is checked later, by check_path_width, where it is known.
template <typename Error>
std::vector<int> parse_pairs(std::string_view field, const Error& error) {
  if (field.size() == kPairsKey.size() || field[kPairsKey.size()] != '=') {
    throw error("bad " + quoted(field) + " (accepted: " + std::string(kPairsKey) +
                "=I+J with pair indices I, J, " + std::string(kPairsExample) + ")");
  }
  const std::string_view list = field.substr(kPairsKey.size() + 1);
  if (list.empty()) {
    throw error("empty pair list in " + quoted(field) + " (" + std::string(kPairsExample) + ")");
  }
  std::vector<int> pairs;
  for (const std::string_view index : split(list, '+')) {
    int pair = -1;
    const auto [end, status] = std::from_chars(index.data(), index.data() + index.size(), pair);
    if (status != std::errc() || end != index.data() + index.size() || pair < 0) {
      throw error("bad pair index " + quoted(index) + " in " + quoted(field) +
                  " (accepted: non-negative integers joined by '+', " + std::string(kPairsExample) +
                  ")");
    }
    pairs.push_back(pair);
  }
  std::sort(pairs.begin(), pairs.end());
  const auto repeated = std::adjacent_find(pairs.begin(), pairs.end());
  if (repeated != pairs.end()) {
    throw error("duplicate pair index " + std::to_string(*repeated) + " in " + quoted(field));
  }
  return pairs;
}

// `context` names the whole text being parsed and starts every error message.
PathFormat parse_path(std::string_view text, const std::string& context) {
  const auto error = [&](const std::string& what) {
    return InvalidArgument(context + ": " + what);
  };
  if (text.empty()) {
    throw error("empty format (accepted: " + std::string(kAcceptedCodecs) + ", e.g. \"int4:g64\")");
  }
  const std::vector<std::string_view> fields = split(text, ':');
  const auto codec_info = std::find_if(kCodecs.begin(), kCodecs.end(), [&](const CodecInfo& entry) {
    return entry.name == fields[0];
  });
  if (codec_info == kCodecs.end()) {
    throw error("unknown codec " + quoted(fields[0]) +
                " (accepted: " + std::string(kAcceptedCodecs) + ")");
  }
  const std::string name(codec_info->name);
  const auto is_group_field = [](std::string_view field) { return field.starts_with('g'); };

  PathFormat format{codec_info->codec, 0, 1.0f};
  size_t next = 1;
  if (codec_info->group_rule == GroupRule::kFixed) {
    format.group = codec_info->fixed_group;
    if (next < fields.size() && is_group_field(fields[next])) {
      if (codec_info->codec == Codec::kFP8 && fields[next] == group_spelling(kFp8NarrowGroup)) {
        format.group = kFp8NarrowGroup;
      } else if (fields[next] != group_spelling(format.group)) {
        throw error("group " + quoted(fields[next]) + " not allowed for " + name + " (fixed at " +
                    group_spelling(format.group) +
                    (codec_info->codec == Codec::kFP8 ? " or g64" : "") + ")");
      }
      ++next;
    }
  } else if (codec_info->group_rule == GroupRule::kChosen) {
    if (next == fields.size()) {
      throw error(quoted(text) + " needs a group (accepted: " + std::string(kAcceptedGroups) +
                  "), e.g. \"" + name + ":g64\"");
    }
    const auto group = std::find_if(kChoosableGroups.begin(), kChoosableGroups.end(),
                                    [&](int size) { return fields[next] == group_spelling(size); });
    if (group == kChoosableGroups.end()) {
      throw error("bad group " + quoted(fields[next]) + " for " + name +
                  " (accepted: " + std::string(kAcceptedGroups) + ")");
    }
    format.group = *group;
    ++next;
    // The clip ratio and the kept pairs may come in either order, each at most once.
    bool seen_clip = false;
    bool seen_pairs = false;
    for (; next < fields.size(); ++next) {
      const std::string_view field = fields[next];
      if (field.starts_with(kClipPrefix)) {
        if (seen_clip) throw error("second clip " + quoted(field) + " in " + quoted(text));
        seen_clip = true;
        format.clip = parse_clip(field, error);
      } else if (field.starts_with(kPairsKey)) {
        if (seen_pairs) throw error("second pair list " + quoted(field) + " in " + quoted(text));
        seen_pairs = true;
        format.bf16_pairs = parse_pairs(field, error);
      } else {
        break;
      }
    }
  }

  if (next < fields.size()) {
    const std::string_view field = fields[next];
    if (field.starts_with(kClipPrefix)) {
      throw error("clip " + quoted(field) + " not allowed for " + name +
                  " (only int8, int4 and int2 take a clip ratio)");
    }
    if (field.starts_with(kPairsKey)) {
      throw error(quoted(field) + " not allowed for " + name +
                  " (only int8, int4 and int2 keep BF16 pairs)");
    }
    if (codec_info->group_rule == GroupRule::kNone && is_group_field(field)) {
      throw error("group " + quoted(field) + " not allowed for " + name +
                  " (it stores every value on its own)");
    }
    const size_t accepted_length = static_cast<size_t>(field.data() - text.data()) - 1;
    throw error("unexpected " + quoted(":" + std::string(field)) + " after " +
                quoted(text.substr(0, accepted_length)));
  }
  return format;
}

int64_t path_bytes(const PathFormat& format, int64_t width, std::string_view path,
                   std::string_view width_name, const CacheFormat& whole) {
  try {
    return format.encoded_bytes(width);
  } catch (const InvalidArgument& error) {
    throw InvalidArgument("cache format " + quoted(whole.to_string()) + ", " + std::string(path) +
                          " path (" + std::string(width_name) + " " + std::to_string(width) +
                          "): " + error.what());
  }
}

}  // namespace

void check_path_width(const PathFormat& format, int64_t width) {
  const CodecInfo& codec_info = info(format.codec);
  const auto error = [&](const std::string& what) {
    return InvalidArgument("path format " + quoted(format.to_string()) + ": " + what);
  };
  // Strings are built only on the way to a throw: this check runs on every encoded vector.
  const auto group = [&] { return std::to_string(format.group); };
  switch (codec_info.group_rule) {
    case GroupRule::kNone:
      if (format.group != 0) {
        throw error("group " + group() + " given, but " + std::string(codec_info.name) +
                    " has no groups (group must be 0)");
      }
      break;
    case GroupRule::kFixed:
      if (!fixed_group_allowed(codec_info, format.group)) {
        throw error("group " + group() + " (" + std::string(codec_info.name) + " needs " +
                    std::to_string(codec_info.fixed_group) + ")");
      }
      break;
    case GroupRule::kChosen:
      if (std::find(kChoosableGroups.begin(), kChoosableGroups.end(), format.group) ==
          kChoosableGroups.end()) {
        throw error("group " + group() + " (accepted: 32, 64, 128)");
      }
      break;
  }
  if (codec_info.group_rule == GroupRule::kChosen) {
    if (!(format.clip > 0.0f && format.clip <= 1.0f)) {
      throw error("clip " + shortest_decimal(format.clip) + " outside (0, 1]");
    }
  } else if (format.clip != 1.0f) {
    throw error("clip " + shortest_decimal(format.clip) + " given, but only int8, int4 and int2 " +
                "take a clip ratio (clip must be 1)");
  }
  if (width < 0) throw error("negative width " + std::to_string(width));
  if (format.group != 0 && width % format.group != 0) {
    throw error("width " + std::to_string(width) + " is not a multiple of the group " + group());
  }
  const std::vector<int>& pairs = format.bf16_pairs;
  if (pairs.empty()) return;
  if (codec_info.group_rule != GroupRule::kChosen) {
    throw error("BF16 pairs given, but only int8, int4 and int2 keep BF16 pairs");
  }
  const auto width_text = [&] { return std::to_string(width); };
  if (static_cast<int64_t>(pairs.size()) > width / 2) {
    throw error(std::to_string(pairs.size()) + " kept pairs, but width " + width_text() +
                " has only " + std::to_string(width / 2) + " pairs");
  }
  for (size_t k = 0; k < pairs.size(); ++k) {
    const int pair = pairs[k];
    if (pair < 0) throw error("negative pair index " + std::to_string(pair));
    if (k > 0 && pair <= pairs[k - 1]) {
      throw error("pair indices not ascending and unique: " + std::to_string(pair) + " after " +
                  std::to_string(pairs[k - 1]));
    }
    const int64_t first_channel = 2 * static_cast<int64_t>(pair);  // no int overflow at INT_MAX
    if (first_channel + 1 >= width) {
      throw error("pair index " + std::to_string(pair) + " (channels " +
                  std::to_string(first_channel) + ", " + std::to_string(first_channel + 1) +
                  ") beyond width " + width_text());
    }
  }
}

int64_t kept_pairs_offset(const PathFormat& format, int64_t width) {
  check_path_width(format, width);
  const CodecInfo& codec_info = info(format.codec);
  const int64_t groups = format.group == 0 ? 0 : width / format.group;
  return width * codec_info.bits / 8 + groups * codec_info.scale_bytes_per_group;
}

int PathFormat::bits() const { return info(codec).bits; }

int64_t PathFormat::encoded_bytes(int64_t width) const {
  return kept_pairs_offset(*this, width) + static_cast<int64_t>(bf16_pairs.size()) * kBf16PairBytes;
}

std::string PathFormat::to_string() const {
  const CodecInfo& codec_info = info(codec);
  std::string text(codec_info.name);
  if (codec_info.group_rule == GroupRule::kFixed && group != codec_info.fixed_group) {
    text += ':';
    text += group_spelling(group);  // fp8:g64
  } else if (codec_info.group_rule == GroupRule::kChosen) {
    text += ':';
    text += group_spelling(group);
    if (clip != 1.0f) {
      text += ':';
      text += kClipPrefix;
      text += shortest_decimal(clip);
    }
  }
  // Spelled for any codec, so that check_path_width's message shows a hand-built misuse.
  for (size_t k = 0; k < bf16_pairs.size(); ++k) {
    if (k == 0) {
      text += ':';
      text += kPairsKey;
      text += '=';
    } else {
      text += '+';
    }
    text += std::to_string(bf16_pairs[k]);
  }
  return text;
}

PathFormat PathFormat::parse(std::string_view text) {
  return parse_path(text, "path format " + quoted(text));
}

CacheFormat CacheFormat::parse(std::string_view spec) {
  const std::string context = "cache spec " + quoted(spec);
  const auto error = [&](const std::string& what) {
    return InvalidArgument(context + ": " + what);
  };
  const std::string_view whole = trim(spec);
  if (whole.empty()) {
    throw error("empty (expected \"content=SPEC,rope=SPEC\", or \"f32\" / \"bf16\" for both)");
  }
  if (whole.find_first_of("=,") == std::string_view::npos) {
    if (whole == "f32" || whole == "bf16") {
      const PathFormat both = parse_path(whole, context);
      return CacheFormat{both, both};
    }
    throw error(quoted(whole) + " is not KEY=FORMAT (keys: content, rope); only f32 and bf16 " +
                "may stand alone for both paths");
  }

  CacheFormat format;
  bool seen_content = false;
  bool seen_rope = false;
  for (const std::string_view entry : split(whole, ',')) {
    const std::string_view item = trim(entry);
    if (item.empty()) throw error("empty entry between commas");
    const size_t equals = item.find('=');
    if (equals == std::string_view::npos) {
      throw error("entry " + quoted(item) + " is not KEY=FORMAT (keys: content, rope)");
    }
    const std::string_view key = trim(item.substr(0, equals));
    PathFormat* target = nullptr;
    bool* seen = nullptr;
    if (key == "content") {
      target = &format.content;
      seen = &seen_content;
    } else if (key == "rope") {
      target = &format.rope;
      seen = &seen_rope;
    } else {
      throw error("unknown key " + quoted(key) + " (accepted: content, rope)");
    }
    if (*seen) throw error("duplicate key " + quoted(key));
    *seen = true;
    const std::string_view path_text = trim(item.substr(equals + 1));
    *target = parse_path(path_text, context);
    // A bare "fp8" on the 64-wide RoPE path scales the whole path at once.
    if (target == &format.rope && target->codec == Codec::kFP8 &&
        path_text.find(":g") == std::string_view::npos) {
      target->group = kFp8NarrowGroup;
    }
  }
  return format;
}

std::string CacheFormat::to_string() const {
  return "content=" + content.to_string() + ",rope=" + rope.to_string();
}

int64_t CacheFormat::record_bytes(int64_t kv_lora_rank, int64_t rope_dim) const {
  return path_bytes(content, kv_lora_rank, "content", "kv_lora_rank", *this) +
         path_bytes(rope, rope_dim, "rope", "rope_dim", *this);
}

// Here rather than beside the paged cache so that tools without the engine (the GPU benchmark)
// count bytes the same way.
int64_t cache_physical_bytes(const CacheShape& shape, const CacheFormat& format, int64_t tokens) {
  const int64_t record = format.record_bytes(shape.kv_lora_rank, shape.rope_dim);
  if (format == CacheFormat::f32()) return shape.num_layers * tokens * record;  // one unpaged array
  const int64_t pages = (tokens + kPageTokens - 1) / kPageTokens;
  const int64_t page_bytes = kPageTokens * record;
  return shape.num_layers * pages * page_bytes + pages * static_cast<int64_t>(sizeof(int32_t));
}

}  // namespace quantmla
