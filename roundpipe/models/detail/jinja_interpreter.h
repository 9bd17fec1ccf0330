// Interpreter of the chat template engine (roundpipe/models/chat_template.h): renders a parsed
// Template with jinja2's scoping (a for-loop iteration and a macro call open a scope; if does
// not), loop controls, macros, the transformers globals and `{% generation %}` span tracking.
#pragma once

#include <cstddef>
#include <ctime>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "roundpipe/models/detail/jinja_ast.h"

namespace roundpipe::models::detail {

struct RenderInput {
  /// Template variables (messages, add_generation_prompt, special tokens, extras).
  const ValueDict* variables = nullptr;
  /// The time strftime_now formats (local time); nullopt: the current time.
  std::optional<std::time_t> now;
};

struct RenderOutput {
  std::string text;
  /// Byte ranges [begin, end) of `text` produced inside {% generation %} blocks, in order.
  std::vector<std::pair<size_t, size_t>> generation_spans;
};

/// Renders `tmpl`. Throws LocatedError (with the line) for every error: undefined values used,
/// unsupported filters/tests/methods, raise_exception, a render over the output or step limits.
RenderOutput render_template(const Template& tmpl, const RenderInput& input);

/// Caps that keep any template finite: output bytes, executed statements and loop iterations,
/// and nested macro calls.
inline constexpr size_t kMaxOutputBytes = size_t{64} << 20;
inline constexpr size_t kMaxSteps = 5'000'000;
inline constexpr int kMaxCallDepth = 64;

}  // namespace roundpipe::models::detail
