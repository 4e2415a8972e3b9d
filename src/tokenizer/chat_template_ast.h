// The parsed form of a chat template: statements (text, output, if, for, set, macro, loop
// controls) over expressions. Built by the parser, walked by the renderer; immutable after parsing.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "tokenizer/chat_template_value.h"

namespace quantmla::detail::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

enum class ExprKind {
  kLiteral,      // literal
  kName,         // name
  kList,         // children: items
  kTuple,        // children: items
  kDict,         // children: key, value, key, value, ...
  kAttribute,    // children[0].name
  kSubscript,    // children[0][children[1]]
  kSlice,        // children[0][children[1]:children[2]:children[3]], absent parts null
  kCall,         // children[0](children[1..], keyword)
  kFilter,       // children[0] | name(children[1..], keyword)
  kTest,         // children[0] is [not] name(children[1..], keyword); negated
  kNot,          // not children[0]
  kNegate,       // -children[0]
  kPlus,         // +children[0]
  kBinary,       // children[0] name children[1]: + - * / // % ** ~
  kAnd,          // children[0] and children[1]
  kOr,           // children[0] or children[1]
  kCompare,      // children[0] ops[0] children[1] ops[1] ... (chained, like Python)
  kConditional,  // children[0] if children[1] else children[2] (absent else: undefined)
};

struct Expr {
  ExprKind kind;
  size_t offset = 0;  // in the source, for runtime error positions
  Value literal;
  std::string name;
  std::vector<ExprPtr> children;
  std::vector<std::pair<std::string, ExprPtr>> keyword;
  std::vector<std::string> ops;
  bool negated = false;
};

struct Node;
using Body = std::vector<Node>;

// The variables a frame (the template, a for body or else, a macro body, a set block, a call
// block) assigns, and what each holds when the frame is entered: the value the name has outside
// (`missing` false), or undefined. jinja2 fixes this at compile time (idtracking.py), which is why
// a loop that reads x before a later top-level {% set x %} sees x undefined rather than the
// context's x. Filled by analyze_frames().
struct FrameInfo {
  std::vector<std::pair<std::string, bool>> slots;  // (name, missing)
};

struct TextNode {
  std::string text;
};
struct OutputNode {
  ExprPtr value;
};
struct IfNode {
  std::vector<std::pair<ExprPtr, Body>> branches;  // if, then each elif
  Body otherwise;
};
// What `for` and `set` assign to: one name, names unpacked from a sequence, or (set only) a
// namespace attribute.
struct Target {
  std::vector<std::string> names;
  bool unpack = false;
  std::string attribute;  // set ns.attr: names[0] is the namespace
};
struct ForNode {
  Target target;
  ExprPtr iterable;
  ExprPtr condition;  // for x in xs if condition; may be null
  Body body;
  Body otherwise;  // rendered when no item was looped over
  FrameInfo body_frame;
  FrameInfo otherwise_frame;
};
struct SetNode {
  Target target;
  ExprPtr value;  // null for {% set x %}...{% endset %}: the rendered body
  Body body;
  FrameInfo body_frame;
};
struct MacroNode {
  std::string name;
  std::vector<std::string> parameters;
  std::vector<ExprPtr> defaults;  // per parameter; null where none
  Body body;
  FrameInfo frame;
};
struct LoopControlNode {
  bool is_break;
};
// {% generation %}...{% endgeneration %}: transformers' marker for assistant tokens; renders its
// body.
struct GenerationNode {
  Body body;
  FrameInfo frame;
};

struct Node {
  size_t offset = 0;
  std::variant<TextNode, OutputNode, IfNode, ForNode, SetNode, MacroNode, LoopControlNode,
               GenerationNode>
      content;
};

}  // namespace quantmla::detail::jinja
