// Walks a parsed chat template with a context of variables and produces the text, with jinja2's
// scoping: a for loop's iterations each get their own scope (what they set is gone after the
// iteration, hence namespace()), if blocks none, macros their own over the scope they were
// defined in.
#pragma once

#include <string>

#include "tokenizer/chat_template_ast.h"
#include "tokenizer/chat_template_lexer.h"
#include "tokenizer/chat_template_value.h"

namespace quantmla::detail::jinja {

// Runtime errors (a TypeError, using an undefined value) throw InvalidArgument naming the template
// position; raise_exception(msg) throws InvalidArgument(msg) as it is.
// `frame` is the template's own (analyze_frames).
std::string render_template(const Body& body, const FrameInfo& frame,
                            const SourcePositions& positions, const Dict& context);

}  // namespace quantmla::detail::jinja
