#include "tokenizer/chat_template_parser.h"

#include <charconv>
#include <cstdlib>
#include <initializer_list>
#include <string_view>

#include "quantmla/error.h"
#include "tokenizer/chat_template_builtins.h"

namespace quantmla::detail::jinja {
namespace {

bool is_keyword_literal(const std::string& name) {
  return name == "true" || name == "false" || name == "True" || name == "False" || name == "none" ||
         name == "None";
}

// "'a', 'b' or 'c'", for messages listing what was expected.
std::string quoted_alternatives(std::initializer_list<std::string_view> names) {
  std::string out;
  size_t i = 0;
  for (const std::string_view name : names) {
    if (i > 0) out += i + 1 == names.size() ? " or " : ", ";
    out += '\'';
    out += name;
    out += '\'';
    ++i;
  }
  return out;
}

class Parser {
 public:
  Parser(const std::vector<Token>& tokens, const SourcePositions& positions)
      : tokens_(tokens), positions_(positions) {}

  Body parse() {
    std::string ended_by;
    return parse_body({}, ended_by, "", 0);
  }

 private:
  // --- token access

  const Token& current() const { return tokens_[index_]; }
  const Token& look(size_t ahead = 1) const {
    return tokens_[std::min(index_ + ahead, tokens_.size() - 1)];
  }
  void advance() {
    if (index_ + 1 < tokens_.size()) ++index_;
  }
  bool at_name(std::string_view name) const {
    return current().type == TokenType::kName && current().value == name;
  }
  bool at_operator(std::string_view op) const {
    return current().type == TokenType::kOperator && current().value == op;
  }
  bool skip_name(std::string_view name) {
    if (!at_name(name)) return false;
    advance();
    return true;
  }
  bool skip_operator(std::string_view op) {
    if (!at_operator(op)) return false;
    advance();
    return true;
  }

  [[noreturn]] void fail(const Token& at, const std::string& what) const {
    throw FormatError("chat template " + positions_.describe(at.offset) + ": " + what);
  }
  [[noreturn]] void fail_expected(const std::string& expected) const {
    fail(current(), "expected " + expected + ", got " + describe_token(current()));
  }

  void expect_operator(std::string_view op) {
    if (!skip_operator(op)) fail_expected("'" + std::string(op) + "'");
  }
  std::string expect_name() {
    if (current().type != TokenType::kName) fail_expected("a name");
    std::string name = current().value;
    advance();
    return name;
  }
  void expect_block_end() {
    if (current().type != TokenType::kBlockEnd) fail_expected("end of statement block");
    advance();
  }

  // Parsing recurses once per nested block or operand; a bound keeps a hostile template from
  // exhausting the stack (Python's own recursion limit stops jinja2 near the same depth).
  class NestingGuard {
   public:
    explicit NestingGuard(Parser& parser) : parser_(parser) {
      if (++parser_.nesting_ > kMaxNesting) {
        parser_.fail(parser_.current(),
                     "nested deeper than " + std::to_string(kMaxNesting) + " blocks or operands");
      }
    }
    ~NestingGuard() { --parser_.nesting_; }
    NestingGuard(const NestingGuard&) = delete;
    NestingGuard& operator=(const NestingGuard&) = delete;

   private:
    static constexpr int kMaxNesting = 400;
    Parser& parser_;
  };

  ExprPtr make(ExprKind kind, size_t offset) {
    auto expr = std::make_unique<Expr>();
    expr->kind = kind;
    expr->offset = offset;
    return expr;
  }

  // --- statements

  // Nodes up to a {% tag %} named in `end_tags` (consumed up to and including the tag name, which
  // is returned in `ended_by`) or, with no end tags, the end of the template.
  Body parse_body(std::initializer_list<std::string_view> end_tags, std::string& ended_by,
                  const char* block_name, size_t opened_at) {
    const NestingGuard nesting(*this);
    Body body;
    while (true) {
      const Token& token = current();
      switch (token.type) {
        case TokenType::kEnd:
          if (end_tags.size() == 0) return body;
          fail(token, std::string("unexpected end of template; expected ") +
                          quoted_alternatives(end_tags) + " to close the '" + block_name + "' at " +
                          positions_.describe(opened_at));
        case TokenType::kText:
          body.push_back(Node{token.offset, TextNode{token.value}});
          advance();
          break;
        case TokenType::kVariableBegin: {
          advance();
          ExprPtr value = parse_tuple(true, {}, false);
          if (current().type != TokenType::kVariableEnd) fail_expected("end of print statement");
          advance();
          body.push_back(Node{token.offset, OutputNode{std::move(value)}});
          break;
        }
        case TokenType::kBlockBegin: {
          advance();
          const Token& tag = current();
          if (tag.type != TokenType::kName) fail_expected("a statement name");
          for (const std::string_view end : end_tags) {
            if (tag.value == end) {
              ended_by = tag.value;
              advance();
              return body;
            }
          }
          body.push_back(parse_statement(token.offset, end_tags, block_name, opened_at));
          break;
        }
        default:
          fail(token, "unexpected " + describe_token(token));
      }
    }
  }

  Node parse_statement(size_t offset, std::initializer_list<std::string_view> open_end_tags,
                       const char* open_block, size_t opened_at) {
    const Token& tag = current();
    const std::string name = tag.value;
    advance();
    if (name == "if") return Node{offset, parse_if(offset)};
    if (name == "for") return Node{offset, parse_for(offset)};
    if (name == "set") return Node{offset, parse_set(offset)};
    if (name == "macro") return Node{offset, parse_macro(offset)};
    if (name == "generation") {
      expect_block_end();
      GenerationNode node;
      std::string ended_by;
      node.body = parse_body({"endgeneration"}, ended_by, "generation", offset);
      expect_block_end();
      return Node{offset, std::move(node)};
    }
    if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) fail(tag, "'" + name + "' outside of a for loop");
      expect_block_end();
      return Node{offset, LoopControlNode{name == "break"}};
    }
    if (open_end_tags.size() > 0) {
      fail(tag, "unknown or misplaced tag '" + name + "'; expected " +
                    quoted_alternatives(open_end_tags) + " to close the '" + open_block + "' at " +
                    positions_.describe(opened_at));
    }
    fail(tag, "unknown or misplaced tag '" + name + "'");
  }

  IfNode parse_if(size_t offset) {
    IfNode node;
    ExprPtr condition = parse_tuple(false, {}, false);
    while (true) {
      expect_block_end();
      std::string ended_by;
      Body body = parse_body({"elif", "else", "endif"}, ended_by, "if", offset);
      node.branches.emplace_back(std::move(condition), std::move(body));
      if (ended_by == "elif") {
        condition = parse_tuple(false, {}, false);
        continue;
      }
      if (ended_by == "else") {
        expect_block_end();
        node.otherwise = parse_body({"endif"}, ended_by, "if", offset);
      }
      expect_block_end();
      return node;
    }
  }

  // Names to assign to: "x", "k, v", "(k, v)"; with `with_namespace`, also "ns.attr".
  Target parse_target(bool with_namespace) {
    Target target;
    if (with_namespace && current().type == TokenType::kName &&
        look().type == TokenType::kOperator && look().value == ".") {
      target.names.push_back(expect_name());
      advance();
      target.attribute = expect_name();
      return target;
    }
    const bool parenthesized = skip_operator("(");
    while (true) {
      if (current().type != TokenType::kName || is_keyword_literal(current().value)) {
        fail_expected("a variable name to assign to");
      }
      target.names.push_back(expect_name());
      if (!skip_operator(",")) break;
      target.unpack = true;
      if (current().type != TokenType::kName || at_name("in")) break;  // trailing comma
    }
    if (parenthesized) {
      expect_operator(")");
      target.unpack = target.unpack || target.names.size() > 1;
    }
    return target;
  }

  ForNode parse_for(size_t offset) {
    ForNode node;
    node.target = parse_target(false);
    if (!skip_name("in")) fail_expected("'in'");
    node.iterable = parse_tuple(false, {"recursive"}, false);
    if (skip_name("if")) node.condition = parse_expression(true);
    if (at_name("recursive")) fail(current(), "recursive for loops are not supported");
    expect_block_end();
    std::string ended_by;
    ++loop_depth_;
    node.body = parse_body({"endfor", "else"}, ended_by, "for", offset);
    --loop_depth_;
    if (ended_by == "else") {
      expect_block_end();
      node.otherwise = parse_body({"endfor"}, ended_by, "for", offset);
    }
    expect_block_end();
    return node;
  }

  SetNode parse_set(size_t offset) {
    SetNode node;
    node.target = parse_target(true);
    if (skip_operator("=")) {
      node.value = parse_tuple(true, {}, false);
      expect_block_end();
      return node;
    }
    if (current().type != TokenType::kBlockEnd) fail_expected("'=' or end of statement block");
    if (node.target.unpack || !node.target.attribute.empty()) {
      fail(current(), "a {% set %} block assigns to one plain name");
    }
    advance();
    std::string ended_by;
    node.body = parse_body({"endset"}, ended_by, "set", offset);
    expect_block_end();
    return node;
  }

  MacroNode parse_macro(size_t offset) {
    MacroNode node;
    node.name = expect_name();
    expect_operator("(");
    while (!at_operator(")")) {
      if (!node.parameters.empty()) {
        expect_operator(",");
        if (at_operator(")")) break;
      }
      node.parameters.push_back(expect_name());
      if (skip_operator("=")) {
        node.defaults.push_back(parse_expression(true));
      } else {
        if (!node.defaults.empty() && node.defaults.back() != nullptr) {
          fail(current(), "macro parameter '" + node.parameters.back() +
                              "' without a default follows one with a default");
        }
        node.defaults.push_back(nullptr);
      }
    }
    advance();
    expect_block_end();
    const int saved_depth = loop_depth_;
    loop_depth_ = 0;  // a loop around the definition is not a loop around the body
    std::string ended_by;
    node.body = parse_body({"endmacro"}, ended_by, "macro", offset);
    loop_depth_ = saved_depth;
    expect_block_end();
    return node;
  }

  // --- expressions, in jinja2's precedence order (loosest first)

  bool at_tuple_end(std::initializer_list<std::string_view> extra_end) const {
    const Token& token = current();
    if (token.type == TokenType::kVariableEnd || token.type == TokenType::kBlockEnd ||
        token.type == TokenType::kEnd ||
        (token.type == TokenType::kOperator && token.value == ")")) {
      return true;
    }
    for (const std::string_view name : extra_end) {
      if (at_name(name)) return true;
    }
    return false;
  }

  // "a" or "a, b" (a tuple); in parentheses "()" and "(a,)" are tuples too.
  ExprPtr parse_tuple(bool with_conditional, std::initializer_list<std::string_view> extra_end,
                      bool parenthesized) {
    const size_t offset = current().offset;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_operator(",");
      if (at_tuple_end(extra_end)) break;
      items.push_back(parse_expression(with_conditional));
      if (at_operator(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!parenthesized) fail_expected("an expression");
    }
    ExprPtr tuple = make(ExprKind::kTuple, offset);
    tuple->children = std::move(items);
    return tuple;
  }

  ExprPtr parse_expression(bool with_conditional) {
    return with_conditional ? parse_conditional() : parse_or();
  }

  ExprPtr parse_conditional() {
    ExprPtr value = parse_or();
    while (at_name("if")) {
      const size_t offset = current().offset;
      advance();
      ExprPtr condition = parse_or();
      ExprPtr otherwise = skip_name("else") ? parse_conditional() : nullptr;
      ExprPtr node = make(ExprKind::kConditional, offset);
      node->children.push_back(std::move(value));
      node->children.push_back(std::move(condition));
      node->children.push_back(std::move(otherwise));
      value = std::move(node);
    }
    return value;
  }

  ExprPtr binary(ExprKind kind, std::string op, ExprPtr left, ExprPtr right, size_t offset) {
    ExprPtr node = make(kind, offset);
    node->name = std::move(op);
    node->children.push_back(std::move(left));
    node->children.push_back(std::move(right));
    return node;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (at_name("or")) {
      const size_t offset = current().offset;
      advance();
      left = binary(ExprKind::kOr, "or", std::move(left), parse_and(), offset);
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (at_name("and")) {
      const size_t offset = current().offset;
      advance();
      left = binary(ExprKind::kAnd, "and", std::move(left), parse_not(), offset);
    }
    return left;
  }

  ExprPtr parse_not() {
    if (at_name("not")) {
      const size_t offset = current().offset;
      advance();
      ExprPtr node = make(ExprKind::kNot, offset);
      node->children.push_back(parse_not());
      return node;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const size_t offset = current().offset;
    ExprPtr first = parse_math1();
    ExprPtr node;
    while (true) {
      std::string op;
      if (current().type == TokenType::kOperator &&
          (current().value == "==" || current().value == "!=" || current().value == "<" ||
           current().value == ">" || current().value == "<=" || current().value == ">=")) {
        op = current().value;
        advance();
      } else if (at_name("in")) {
        op = "in";
        advance();
      } else if (at_name("not") && look().type == TokenType::kName && look().value == "in") {
        op = "not in";
        advance();
        advance();
      } else {
        break;
      }
      if (!node) {
        node = make(ExprKind::kCompare, offset);
        node->children.push_back(std::move(first));
      }
      node->ops.push_back(op);
      node->children.push_back(parse_math1());
    }
    return node ? std::move(node) : std::move(first);
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (at_operator("+") || at_operator("-")) {
      const Token& op = current();
      const std::string name = op.value;
      const size_t offset = op.offset;
      advance();
      left = binary(ExprKind::kBinary, name, std::move(left), parse_concat(), offset);
    }
    return left;
  }

  ExprPtr parse_concat() {
    ExprPtr left = parse_math2();
    while (at_operator("~")) {
      const size_t offset = current().offset;
      advance();
      left = binary(ExprKind::kBinary, "~", std::move(left), parse_math2(), offset);
    }
    return left;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (at_operator("*") || at_operator("/") || at_operator("//") || at_operator("%")) {
      const std::string name = current().value;
      const size_t offset = current().offset;
      advance();
      left = binary(ExprKind::kBinary, name, std::move(left), parse_pow(), offset);
    }
    return left;
  }

  // jinja2 groups ** to the left (2 ** 3 ** 2 is 64), unlike Python.
  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (at_operator("**")) {
      const size_t offset = current().offset;
      advance();
      left = binary(ExprKind::kBinary, "**", std::move(left), parse_unary(true), offset);
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    const size_t offset = current().offset;
    const NestingGuard nesting(*this);
    ExprPtr node;
    if (at_operator("-") || at_operator("+")) {
      const bool negate = at_operator("-");
      advance();
      node = make(negate ? ExprKind::kNegate : ExprKind::kPlus, offset);
      node->children.push_back(parse_unary(false));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expression(std::move(node));
    return node;
  }

  ExprPtr literal(Value value, size_t offset) {
    ExprPtr node = make(ExprKind::kLiteral, offset);
    node->literal = std::move(value);
    return node;
  }

  ExprPtr parse_primary() {
    const Token& token = current();
    const size_t offset = token.offset;
    switch (token.type) {
      case TokenType::kName: {
        const std::string name = token.value;
        advance();
        if (name == "true" || name == "True") return literal(Value(true), offset);
        if (name == "false" || name == "False") return literal(Value(false), offset);
        if (name == "none" || name == "None") return literal(Value::none(), offset);
        ExprPtr node = make(ExprKind::kName, offset);
        node->name = name;
        return node;
      }
      case TokenType::kString: {
        // Adjacent literals join, as in Python: 'a' 'b' is 'ab'.
        std::string text;
        while (current().type == TokenType::kString) {
          text += current().value;
          advance();
        }
        return literal(Value(std::move(text)), offset);
      }
      case TokenType::kInteger: {
        int64_t number = 0;
        const std::string& digits = token.value;
        const auto result = std::from_chars(digits.data(), digits.data() + digits.size(), number);
        if (result.ec != std::errc() || result.ptr != digits.data() + digits.size()) {
          fail(token, "integer literal " + digits + " does not fit in 64 bits");
        }
        advance();
        return literal(Value(number), offset);
      }
      case TokenType::kFloat: {
        const double number = std::strtod(token.value.c_str(), nullptr);
        advance();
        return literal(Value(number), offset);
      }
      case TokenType::kOperator:
        if (token.value == "(") {
          advance();
          ExprPtr node = parse_tuple(true, {}, true);
          expect_operator(")");
          return node;
        }
        if (token.value == "[") return parse_list();
        if (token.value == "{") return parse_dict();
        break;
      default:
        break;
    }
    fail_expected("an expression");
  }

  ExprPtr parse_list() {
    ExprPtr node = make(ExprKind::kList, current().offset);
    expect_operator("[");
    while (!at_operator("]")) {
      if (!node->children.empty()) {
        expect_operator(",");
        if (at_operator("]")) break;
      }
      node->children.push_back(parse_expression(true));
    }
    advance();
    return node;
  }

  ExprPtr parse_dict() {
    ExprPtr node = make(ExprKind::kDict, current().offset);
    expect_operator("{");
    while (!at_operator("}")) {
      if (!node->children.empty()) {
        expect_operator(",");
        if (at_operator("}")) break;
      }
      node->children.push_back(parse_expression(true));
      expect_operator(":");
      node->children.push_back(parse_expression(true));
    }
    advance();
    return node;
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (at_operator(".") || at_operator("[")) {
        node = parse_subscript(std::move(node));
      } else if (at_operator("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr object) {
    const size_t offset = current().offset;
    if (skip_operator(".")) {
      const Token& token = current();
      if (token.type == TokenType::kName) {
        ExprPtr node = make(ExprKind::kAttribute, offset);
        node->name = token.value;
        node->children.push_back(std::move(object));
        advance();
        return node;
      }
      if (token.type != TokenType::kInteger) fail_expected("a name or number after '.'");
      ExprPtr node = make(ExprKind::kSubscript, offset);
      node->children.push_back(std::move(object));
      node->children.push_back(parse_primary());
      return node;
    }
    expect_operator("[");
    // [index] or a slice [start:stop:step] with any part left out.
    ExprPtr first = at_operator(":") ? nullptr : parse_expression(true);
    if (first && !at_operator(":")) {
      expect_operator("]");
      ExprPtr node = make(ExprKind::kSubscript, offset);
      node->children.push_back(std::move(object));
      node->children.push_back(std::move(first));
      return node;
    }
    expect_operator(":");
    ExprPtr stop = (at_operator(":") || at_operator("]")) ? nullptr : parse_expression(true);
    ExprPtr step;
    if (skip_operator(":") && !at_operator("]")) step = parse_expression(true);
    expect_operator("]");
    ExprPtr node = make(ExprKind::kSlice, offset);
    node->children.push_back(std::move(object));
    node->children.push_back(std::move(first));
    node->children.push_back(std::move(stop));
    node->children.push_back(std::move(step));
    return node;
  }

  // (positional..., name=value...) into `node`'s children (after those it has) and keywords.
  void parse_call_arguments(Expr& node) {
    expect_operator("(");
    bool need_comma = false;
    while (!at_operator(")")) {
      if (need_comma) {
        expect_operator(",");
        if (at_operator(")")) break;
      }
      if (at_operator("*") || at_operator("**")) {
        fail(current(), "*args and **kwargs in calls are not supported");
      }
      if (current().type == TokenType::kName && look().type == TokenType::kOperator &&
          look().value == "=") {
        std::string key = current().value;
        advance();
        advance();
        node.keyword.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!node.keyword.empty()) fail(current(), "a positional argument follows a keyword one");
        node.children.push_back(parse_expression(true));
      }
      need_comma = true;
    }
    advance();
  }

  ExprPtr parse_call(ExprPtr callee) {
    ExprPtr node = make(ExprKind::kCall, current().offset);
    node->children.push_back(std::move(callee));
    parse_call_arguments(*node);
    return node;
  }

  std::string parse_dotted_name() {
    std::string name = expect_name();
    while (skip_operator(".")) {
      name += '.';
      name += expect_name();
    }
    return name;
  }

  ExprPtr parse_filter_expression(ExprPtr node) {
    while (true) {
      if (at_operator("|")) {
        const size_t offset = current().offset;
        advance();
        const Token& name_token = current();
        const std::string name = parse_dotted_name();
        if (!has_filter(name)) fail(name_token, "no filter named '" + name + "'");
        ExprPtr filter = make(ExprKind::kFilter, offset);
        filter->name = name;
        filter->children.push_back(std::move(node));
        if (at_operator("(")) parse_call_arguments(*filter);
        node = std::move(filter);
      } else if (at_name("is")) {
        node = parse_test(std::move(node));
      } else if (at_operator("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_test(ExprPtr operand) {
    const size_t offset = current().offset;
    advance();  // is
    const bool negated = skip_name("not");
    const Token& name_token = current();
    const std::string name = parse_dotted_name();
    if (!has_test(name)) fail(name_token, "no test named '" + name + "'");
    ExprPtr node = make(ExprKind::kTest, offset);
    node->name = name;
    node->negated = negated;
    node->children.push_back(std::move(operand));
    const Token& next = current();
    const bool starts_argument =
        next.type == TokenType::kName || next.type == TokenType::kString ||
        next.type == TokenType::kInteger || next.type == TokenType::kFloat ||
        (next.type == TokenType::kOperator && (next.value == "[" || next.value == "{"));
    if (at_operator("(")) {
      parse_call_arguments(*node);
    } else if (starts_argument && !at_name("else") && !at_name("or") && !at_name("and")) {
      // jinja2 takes one bare argument: `x is divisibleby 3`, `x is sameas none`.
      if (at_name("is")) fail(current(), "tests cannot be chained with 'is'");
      node->children.push_back(parse_postfix(parse_primary()));
    }
    return node;
  }

  const std::vector<Token>& tokens_;
  const SourcePositions& positions_;
  size_t index_ = 0;
  int loop_depth_ = 0;
  int nesting_ = 0;
};

}  // namespace

Body parse_template(const std::vector<Token>& tokens, const SourcePositions& positions) {
  return Parser(tokens, positions).parse();
}

}  // namespace quantmla::detail::jinja
