#include "tokenizer/chat_template_render.h"

#include <memory>
#include <unordered_map>

#include "quantmla/error.h"
#include "tokenizer/chat_template_builtins.h"
#include "tokenizer/chat_template_ops.h"

namespace quantmla::detail::jinja {
namespace {

struct Scope {
  std::unordered_map<std::string, Value> variables;
  std::shared_ptr<Scope> parent;
};

// What a body's rendering ended with: normally, or a {% break %} / {% continue %} for the loop.
enum class Flow { kNormal, kBreak, kContinue };

class Renderer {
 public:
  // The context's variables sit below the template's own frame, which may shadow them.
  Renderer(const SourcePositions& positions, const Dict& context, const FrameInfo& frame)
      : positions_(positions) {
    auto variables = std::make_shared<Scope>();
    for (const auto& [key, value] : context.entries) {
      variables->variables[key.as_string()] = value;
    }
    scope_ = enter_frame(frame, variables);
  }

  // A macro's value holds the scope it was defined in, which holds the macro (or a namespace of
  // an outer scope does): a cycle of shared pointers that would outlive every render. The scopes
  // are emptied here, once nothing can call a macro any more.
  ~Renderer() {
    for (const std::shared_ptr<Scope>& scope : macro_scopes_) {
      scope->variables.clear();
      scope->parent.reset();
    }
  }
  Renderer(const Renderer&) = delete;
  Renderer& operator=(const Renderer&) = delete;

  std::string render(const Body& body) {
    std::string out;
    render_body(body, out);
    return out;
  }

 private:
  // Makes `scope` current until destroyed, also when rendering throws.
  class ScopeGuard {
   public:
    ScopeGuard(Renderer& renderer, std::shared_ptr<Scope> scope)
        : renderer_(renderer), saved_(std::move(renderer.scope_)) {
      renderer_.scope_ = std::move(scope);
    }
    ~ScopeGuard() { renderer_.scope_ = std::move(saved_); }
    ScopeGuard(const ScopeGuard&) = delete;
    ScopeGuard& operator=(const ScopeGuard&) = delete;

   private:
    Renderer& renderer_;
    std::shared_ptr<Scope> saved_;
  };

  [[noreturn]] void fail(size_t offset, const std::string& what) const {
    throw InvalidArgument("chat template " + positions_.describe(offset) + ": " + what);
  }

  std::shared_ptr<Scope> child_scope() const {
    auto scope = std::make_shared<Scope>();
    scope->parent = scope_;
    return scope;
  }

  static Value lookup_from(const Scope* scope, const std::string& name) {
    for (; scope != nullptr; scope = scope->parent.get()) {
      const auto it = scope->variables.find(name);
      if (it != scope->variables.end()) return it->second;
    }
    return find_global(name);
  }

  Value lookup(const std::string& name) const { return lookup_from(scope_.get(), name); }

  // A new scope for a frame inside `outside`, its variables set to what they start as.
  static std::shared_ptr<Scope> enter_frame(const FrameInfo& frame,
                                            std::shared_ptr<Scope> outside) {
    auto scope = std::make_shared<Scope>();
    for (const auto& [name, missing] : frame.slots) {
      scope->variables[name] = missing ? Value::undefined("'" + name + "' is undefined")
                                       : lookup_from(outside.get(), name);
    }
    scope->parent = std::move(outside);
    return scope;
  }

  // --- statements

  Flow render_body(const Body& body, std::string& out) {
    for (const Node& node : body) {
      const Flow flow = render_node(node, out);
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  Flow render_node(const Node& node, std::string& out) {
    try {
      return std::visit([&](const auto& content) { return render(content, node, out); },
                        node.content);
    } catch (const RenderError& error) {
      fail(node.offset, error.what());
    }
  }

  Flow render(const TextNode& text, const Node&, std::string& out) {
    out += text.text;
    return Flow::kNormal;
  }

  Flow render(const OutputNode& output, const Node&, std::string& out) {
    out += to_str(eval(*output.value));
    return Flow::kNormal;
  }

  Flow render(const IfNode& node, const Node&, std::string& out) {
    for (const auto& [condition, body] : node.branches) {
      if (truthy(eval(*condition))) return render_body(body, out);
    }
    return render_body(node.otherwise, out);
  }

  void bind(Scope& scope, const Target& target, const Value& value) {
    if (!target.unpack) {
      scope.variables[target.names[0]] = value;
      return;
    }
    const List parts = iterate(value);
    if (parts.size() != target.names.size()) {
      throw RenderError(parts.size() < target.names.size()
                            ? "ValueError: not enough values to unpack (expected " +
                                  std::to_string(target.names.size()) + ", got " +
                                  std::to_string(parts.size()) + ")"
                            : "ValueError: too many values to unpack (expected " +
                                  std::to_string(target.names.size()) + ")");
    }
    for (size_t i = 0; i < parts.size(); ++i) scope.variables[target.names[i]] = parts[i];
  }

  static Value loop_variable(const List& items, size_t i) {
    const int64_t length = static_cast<int64_t>(items.size());
    const int64_t index = static_cast<int64_t>(i);
    Dict loop;
    loop.set(Value("index"), Value(index + 1));
    loop.set(Value("index0"), Value(index));
    loop.set(Value("revindex"), Value(length - index));
    loop.set(Value("revindex0"), Value(length - index - 1));
    loop.set(Value("first"), Value(i == 0));
    loop.set(Value("last"), Value(index == length - 1));
    loop.set(Value("length"), Value(length));
    loop.set(Value("depth"), Value(int64_t{1}));
    loop.set(Value("depth0"), Value(int64_t{0}));
    if (i > 0) loop.set(Value("previtem"), items[i - 1]);
    if (index + 1 < length) loop.set(Value("nextitem"), items[i + 1]);
    loop.set(Value("cycle"), Value::callable("loop.cycle", [index](const CallArgs& args) {
               if (args.positional.empty()) {
                 throw RenderError("TypeError: no items for cycling given");
               }
               return args.positional[static_cast<size_t>(index) % args.positional.size()];
             }));
    return Value::dict(std::move(loop));
  }

  Flow render(const ForNode& node, const Node&, std::string& out) {
    List items = iterate(eval(*node.iterable));
    if (node.condition) {
      // The filter sees the loop variables but not `loop`; loop.length counts what passes.
      List kept;
      for (const Value& item : items) {
        auto scope = child_scope();
        bind(*scope, node.target, item);
        const ScopeGuard guard(*this, scope);
        if (truthy(eval(*node.condition))) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      const ScopeGuard guard(*this, enter_frame(node.otherwise_frame, scope_));
      return render_body(node.otherwise, out);
    }
    for (size_t i = 0; i < items.size(); ++i) {
      auto scope = enter_frame(node.body_frame, scope_);
      bind(*scope, node.target, items[i]);
      scope->variables["loop"] = loop_variable(items, i);
      const ScopeGuard guard(*this, scope);
      if (render_body(node.body, out) == Flow::kBreak) break;
    }
    return Flow::kNormal;
  }

  Flow render(const SetNode& node, const Node&, std::string&) {
    Value value;
    if (node.value) {
      value = eval(*node.value);
    } else {
      std::string captured;
      const ScopeGuard guard(*this, enter_frame(node.body_frame, scope_));
      render_body(node.body, captured);
      value = Value(std::move(captured));
    }
    const Target& target = node.target;
    if (!target.attribute.empty()) {
      const Value object = lookup(target.names[0]);
      if (object.kind() != Value::Kind::kNamespace) {
        throw RenderError(
            "TemplateRuntimeError: cannot assign attribute on non-namespace object '" +
            target.names[0] + "' (" + type_name(object) + ")");
      }
      object.namespace_attributes().set(Value(target.attribute), std::move(value));
      return Flow::kNormal;
    }
    bind(*scope_, target, value);
    return Flow::kNormal;
  }

  Flow render(const MacroNode& node, const Node&, std::string&) {
    const MacroNode* macro = &node;
    const std::shared_ptr<Scope> defined_in = scope_;
    macro_scopes_.push_back(defined_in);
    scope_->variables[node.name] =
        Value::callable(node.name, [this, macro, defined_in](const CallArgs& args) {
          return call_macro(*macro, defined_in, args);
        });
    return Flow::kNormal;
  }

  Value call_macro(const MacroNode& macro, const std::shared_ptr<Scope>& defined_in,
                   const CallArgs& args) {
    const size_t count = macro.parameters.size();
    if (args.positional.size() > count) {
      throw RenderError("TypeError: macro '" + macro.name + "' takes not more than " +
                        std::to_string(count) + " argument(s)");
    }
    auto scope = enter_frame(macro.frame, defined_in);
    std::vector<bool> given(count, false);
    for (size_t i = 0; i < args.positional.size(); ++i) {
      scope->variables[macro.parameters[i]] = args.positional[i];
      given[i] = true;
    }
    for (const auto& [key, value] : args.keyword) {
      size_t i = 0;
      while (i < count && macro.parameters[i] != key) ++i;
      if (i == count) {
        throw RenderError("TypeError: macro '" + macro.name + "' takes no keyword argument '" +
                          key + "'");
      }
      if (given[i]) {
        throw RenderError("TypeError: macro '" + macro.name +
                          "' got multiple values for argument '" + key + "'");
      }
      scope->variables[key] = value;
      given[i] = true;
    }
    // A macro that calls itself without end would exhaust the stack; Python stops it with
    // RecursionError.
    constexpr int kMaxMacroDepth = 100;
    if (macro_depth_ >= kMaxMacroDepth) {
      throw RenderError("RecursionError: macro calls nested deeper than " +
                        std::to_string(kMaxMacroDepth) + " (in '" + macro.name + "')");
    }
    ++macro_depth_;
    struct DepthGuard {
      int& depth;
      ~DepthGuard() { --depth; }
    } depth_guard{macro_depth_};
    const ScopeGuard guard(*this, scope);
    for (size_t i = 0; i < count; ++i) {
      if (given[i]) continue;
      scope->variables[macro.parameters[i]] =
          macro.defaults[i]
              ? eval(*macro.defaults[i])
              : Value::undefined("parameter '" + macro.parameters[i] + "' was not provided");
    }
    std::string out;
    render_body(macro.body, out);
    return Value(std::move(out));
  }

  Flow render(const LoopControlNode& node, const Node&, std::string&) {
    return node.is_break ? Flow::kBreak : Flow::kContinue;
  }

  // transformers compiles {% generation %} to a call block, whose body has its own scope.
  Flow render(const GenerationNode& node, const Node&, std::string& out) {
    const ScopeGuard guard(*this, enter_frame(node.frame, scope_));
    return render_body(node.body, out);
  }

  // --- expressions

  Value eval(const Expr& expr) {
    try {
      return eval_unchecked(expr);
    } catch (const RenderError& error) {
      fail(expr.offset, error.what());
    }
  }

  CallArgs eval_arguments(const Expr& expr, size_t first) {
    CallArgs args;
    for (size_t i = first; i < expr.children.size(); ++i) {
      args.positional.push_back(eval(*expr.children[i]));
    }
    for (const auto& [key, value] : expr.keyword) args.keyword.emplace_back(key, eval(*value));
    return args;
  }

  bool compare(const std::string& op, const Value& left, const Value& right) {
    if (op == "==") return equal(left, right);
    if (op == "!=") return !equal(left, right);
    if (op == "in") return contains(right, left);
    if (op == "not in") return !contains(right, left);
    return less(left, right, op);
  }

  Value eval_unchecked(const Expr& expr) {
    const auto& c = expr.children;
    switch (expr.kind) {
      case ExprKind::kLiteral:
        return expr.literal;
      case ExprKind::kName:
        return lookup(expr.name);
      case ExprKind::kList:
      case ExprKind::kTuple: {
        List items;
        items.reserve(c.size());
        for (const ExprPtr& item : c) items.push_back(eval(*item));
        return Value::list(std::move(items), expr.kind == ExprKind::kTuple);
      }
      case ExprKind::kDict: {
        Dict dict;
        for (size_t i = 0; i + 1 < c.size(); i += 2) dict.set(eval(*c[i]), eval(*c[i + 1]));
        return Value::dict(std::move(dict));
      }
      case ExprKind::kAttribute:
        return get_attribute(eval(*c[0]), expr.name);
      case ExprKind::kSubscript: {
        const Value object = eval(*c[0]);
        return get_item(object, eval(*c[1]));
      }
      case ExprKind::kSlice: {
        const Value object = eval(*c[0]);
        const auto part = [&](size_t i) { return c[i] ? eval(*c[i]) : Value::none(); };
        const Value start = part(1);
        const Value stop = part(2);
        return get_slice(object, start, stop, part(3));
      }
      case ExprKind::kCall: {
        const Value callee = eval(*c[0]);
        return call_value(callee, eval_arguments(expr, 1));
      }
      case ExprKind::kFilter: {
        const Value operand = eval(*c[0]);
        return apply_filter(expr.name, operand, eval_arguments(expr, 1));
      }
      case ExprKind::kTest: {
        const Value operand = eval(*c[0]);
        return Value(apply_test(expr.name, operand, eval_arguments(expr, 1)) != expr.negated);
      }
      case ExprKind::kNot:
        return Value(!truthy(eval(*c[0])));
      case ExprKind::kNegate:
        return unary_operation("-", eval(*c[0]));
      case ExprKind::kPlus:
        return unary_operation("+", eval(*c[0]));
      case ExprKind::kBinary: {
        const Value left = eval(*c[0]);
        return binary_operation(expr.name, left, eval(*c[1]));
      }
      case ExprKind::kAnd: {
        // Python's and/or give an operand, not a bool: {{ a or 'x' }} renders a when truthy.
        Value left = eval(*c[0]);
        return truthy(left) ? eval(*c[1]) : left;
      }
      case ExprKind::kOr: {
        Value left = eval(*c[0]);
        return truthy(left) ? left : eval(*c[1]);
      }
      case ExprKind::kCompare: {
        Value left = eval(*c[0]);
        for (size_t i = 0; i < expr.ops.size(); ++i) {
          Value right = eval(*c[i + 1]);
          if (!compare(expr.ops[i], left, right)) return Value(false);
          left = std::move(right);
        }
        return Value(true);
      }
      case ExprKind::kConditional:
        if (truthy(eval(*c[1]))) return eval(*c[0]);
        if (c[2]) return eval(*c[2]);
        return Value::undefined("the inline if-expression on line " +
                                std::to_string(positions_.line(expr.offset)) +
                                " evaluated to false and no else section was defined.");
    }
    return Value();
  }

  const SourcePositions& positions_;
  std::shared_ptr<Scope> scope_;
  std::vector<std::shared_ptr<Scope>> macro_scopes_;  // where macros were defined (~Renderer)
  int macro_depth_ = 0;
};

}  // namespace

std::string render_template(const Body& body, const FrameInfo& frame,
                            const SourcePositions& positions, const Dict& context) {
  return Renderer(positions, context, frame).render(body);
}

}  // namespace quantmla::detail::jinja
