// Mirrors jinja2's idtracking: a frame's statements are visited in order (not looking into the
// frames nested in them); the first use of a name decides what the frame's variable starts as:
//   - read before it is assigned, or assigned only inside an if: the value from outside;
//   - assigned first: the value of an enclosing frame's variable of that name if an enclosing frame
//     uses the name, else undefined (not the context's value).
// Nested frames are analysed after their parent, against the parent's complete symbols.
#include "tokenizer/chat_template_frames.h"

#include <map>
#include <set>
#include <string>

namespace quantmla::detail::jinja {
namespace {

enum class Start { kOutside, kUndefined, kParameter };

class Symbols {
 public:
  explicit Symbols(const Symbols* parent) : parent_(parent) {}

  bool has_ref(const std::string& name) const {
    for (const Symbols* s = this; s != nullptr; s = s->parent_) {
      if (s->refs_.count(name) != 0) return true;
    }
    return false;
  }

  void load(const std::string& name) {
    if (!has_ref(name)) refs_[name] = Start::kOutside;
  }

  void store(const std::string& name) {
    add_store(name);
    if (refs_.count(name) != 0) return;
    refs_[name] =
        parent_ != nullptr && parent_->has_ref(name) ? Start::kOutside : Start::kUndefined;
  }

  void parameter(const std::string& name) {
    add_store(name);
    refs_[name] = Start::kParameter;
  }

  // After an if: what its branches read and assigned becomes the frame's; a name first assigned
  // in a branch starts as its outside value (the branch may not run).
  void merge_branches(const std::vector<Symbols>& branches) {
    std::set<std::string> new_stores;
    for (const Symbols& branch : branches) {
      for (const std::string& name : branch.order_) {
        if (stores_.count(name) == 0) new_stores.insert(name);
      }
    }
    for (const Symbols& branch : branches) {
      for (const auto& [name, start] : branch.refs_) refs_[name] = start;
      for (const std::string& name : branch.order_) add_store(name);
    }
    for (const std::string& name : new_stores) refs_[name] = Start::kOutside;
  }

  FrameInfo frame_info() const {
    FrameInfo info;
    for (const std::string& name : order_) {
      const Start start = refs_.at(name);
      if (start != Start::kParameter) info.slots.emplace_back(name, start == Start::kUndefined);
    }
    return info;
  }

 private:
  void add_store(const std::string& name) {
    if (stores_.insert(name).second) order_.push_back(name);
  }

  const Symbols* parent_;
  std::map<std::string, Start> refs_;
  std::set<std::string> stores_;
  std::vector<std::string> order_;  // stores in first-assignment order
};

void load_names(const Expr* expr, Symbols& symbols) {
  if (expr == nullptr) return;
  if (expr->kind == ExprKind::kName) symbols.load(expr->name);
  for (const ExprPtr& child : expr->children) load_names(child.get(), symbols);
  for (const auto& keyword : expr->keyword) load_names(keyword.second.get(), symbols);
}

void store_target(const Target& target, Symbols& symbols) {
  if (!target.attribute.empty()) {
    symbols.load(target.names[0]);  // ns.attr = ... reads ns
    return;
  }
  for (const std::string& name : target.names) symbols.store(name);
}

// The statements of one frame, in order; nested frames are left for later.
void visit_frame_statements(const Body& body, Symbols& symbols) {
  for (const Node& node : body) {
    if (const auto* output = std::get_if<OutputNode>(&node.content)) {
      load_names(output->value.get(), symbols);
    } else if (const auto* if_node = std::get_if<IfNode>(&node.content)) {
      load_names(if_node->branches[0].first.get(), symbols);
      std::vector<Symbols> branches;
      for (size_t i = 0; i < if_node->branches.size(); ++i) {
        Symbols branch = symbols;
        // jinja2 nests an elif as an if in the else branch: its test is read in that branch.
        if (i > 0) load_names(if_node->branches[i].first.get(), branch);
        visit_frame_statements(if_node->branches[i].second, branch);
        branches.push_back(std::move(branch));
      }
      Symbols otherwise = symbols;
      visit_frame_statements(if_node->otherwise, otherwise);
      branches.push_back(std::move(otherwise));
      symbols.merge_branches(branches);
    } else if (const auto* for_node = std::get_if<ForNode>(&node.content)) {
      load_names(for_node->iterable.get(), symbols);
    } else if (const auto* set_node = std::get_if<SetNode>(&node.content)) {
      load_names(set_node->value.get(), symbols);
      store_target(set_node->target, symbols);
    } else if (const auto* macro = std::get_if<MacroNode>(&node.content)) {
      symbols.store(macro->name);
    }
  }
}

FrameInfo analyze_frame(Body& body, const Symbols* parent,
                        const std::vector<std::string>& parameters,
                        const std::vector<const Expr*>& frame_loads);

// The frames nested in `body`'s statements (recursing through if branches, which are not frames).
void analyze_children(Body& body, const Symbols& symbols) {
  for (Node& node : body) {
    if (auto* if_node = std::get_if<IfNode>(&node.content)) {
      for (auto& branch : if_node->branches) analyze_children(branch.second, symbols);
      analyze_children(if_node->otherwise, symbols);
    } else if (auto* for_node = std::get_if<ForNode>(&node.content)) {
      std::vector<std::string> targets = for_node->target.names;
      targets.push_back("loop");
      for_node->body_frame = analyze_frame(for_node->body, &symbols, targets, {});
      for_node->otherwise_frame = analyze_frame(for_node->otherwise, &symbols, {}, {});
    } else if (auto* set_node = std::get_if<SetNode>(&node.content)) {
      if (!set_node->value) set_node->body_frame = analyze_frame(set_node->body, &symbols, {}, {});
    } else if (auto* macro = std::get_if<MacroNode>(&node.content)) {
      std::vector<const Expr*> defaults;
      for (const ExprPtr& value : macro->defaults) defaults.push_back(value.get());
      macro->frame = analyze_frame(macro->body, &symbols, macro->parameters, defaults);
    } else if (auto* generation = std::get_if<GenerationNode>(&node.content)) {
      generation->frame = analyze_frame(generation->body, &symbols, {}, {});
    }
  }
}

FrameInfo analyze_frame(Body& body, const Symbols* parent,
                        const std::vector<std::string>& parameters,
                        const std::vector<const Expr*>& frame_loads) {
  Symbols symbols(parent);
  for (const std::string& name : parameters) symbols.parameter(name);
  for (const Expr* expr : frame_loads) load_names(expr, symbols);
  visit_frame_statements(body, symbols);
  analyze_children(body, symbols);
  return symbols.frame_info();
}

}  // namespace

FrameInfo analyze_frames(Body& body) { return analyze_frame(body, nullptr, {}, {}); }

}  // namespace quantmla::detail::jinja
