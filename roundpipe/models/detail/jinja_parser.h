// Parser of the chat template engine (roundpipe/models/chat_template.h): tokens -> syntax tree,
// with jinja2's grammar and operator precedence for the supported subset.
#pragma once

#include <string_view>

#include "roundpipe/models/detail/jinja_ast.h"

namespace roundpipe::models::detail {

/// Parses `source`. Throws JinjaError("line N: ...") for a syntax error and for every construct
/// outside the subset (e.g. "line 3: unsupported tag 'include'"), never skipping one.
Template parse_template(std::string_view source);

}  // namespace roundpipe::models::detail
