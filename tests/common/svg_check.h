// A small XML well-formedness check for the SVG files the project writes (loss curve, plan
// preview): every element closed, in order. Header-only, no LibTorch.
#pragma once

#include <regex>
#include <string>
#include <vector>

namespace roundpipe::testing {

/// True when every element is closed in order; otherwise false with the first problem in `why`.
inline bool tags_balanced(const std::string& svg, std::string* why) {
  std::regex tag("<(/?)([a-zA-Z]+)[^>]*?(/?)>");
  std::vector<std::string> stack;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), tag); it != std::sregex_iterator(); ++it) {
    const std::smatch& m = *it;
    if (m[3] == "/") {
      continue;  // self-closing
    }
    if (m[1] == "/") {
      if (stack.empty() || stack.back() != m[2]) {
        *why = "unexpected </" + m[2].str() + ">";
        return false;
      }
      stack.pop_back();
    } else {
      stack.push_back(m[2]);
    }
  }
  *why = stack.empty() ? "" : "unclosed <" + stack.back() + ">";
  return stack.empty();
}

}  // namespace roundpipe::testing
