// jinja2's compile-time scoping of a parsed template: which variables each frame owns and what
// they start as (see FrameInfo).
#pragma once

#include "tokenizer/chat_template_ast.h"

namespace quantmla::detail::jinja {

// Fills the FrameInfo of every nested frame in `body` and returns the template's own.
FrameInfo analyze_frames(Body& body);

}  // namespace quantmla::detail::jinja
