// Tokens of a chat template to its statement tree, following jinja2's grammar and operator
// precedence for the subset chat templates use.
#pragma once

#include <vector>

#include "tokenizer/chat_template_ast.h"
#include "tokenizer/chat_template_lexer.h"

namespace quantmla::detail::jinja {

// Throws FormatError naming the line and column and what was expected there, and for filters and
// tests this interpreter does not have (jinja2 refuses those at compile time too).
Body parse_template(const std::vector<Token>& tokens, const SourcePositions& positions);

}  // namespace quantmla::detail::jinja
