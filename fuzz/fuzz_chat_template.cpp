// libFuzzer target: models::ChatTemplate (docs/models.md, "Chat templates"). The input is a
// template; it is parsed and rendered on a fixed conversation (system, user, assistant with a
// tool call, tool) with tools and extra variables, once without and once with
// add_generation_prompt. Parsing and rendering must either succeed or throw ChatTemplateError
// (anything else, a crash or a hang is a finding); an error's line lies inside the template; a
// render is deterministic, within the output cap, and its generation spans are ordered,
// non-overlapping ranges inside the text. The step, depth and output limits keep every input
// finite.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_file.h"
#include "roundpipe/models/chat_template.h"

namespace {

using roundpipe::models::ChatRenderOptions;
using roundpipe::models::ChatTemplate;
using roundpipe::models::ChatTemplateError;
using json = nlohmann::ordered_json;

const json& messages() {
  static const json m = json::parse(R"([
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris? é 😀"},
    {"role": "assistant", "content": null, "reasoning_content": "call the tool",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "assistant", "content": "21 C."}])");
  return m;
}

const json& variables() {
  static const json v = json::parse(R"({
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
    "enable_thinking": false, "date_string": "01 Jan 2026", "n": 3, "f": 0.5, "l": [1, 2, 3], "d": {"a": [1]}})");
  return v;
}

// Lines as jinja2 counts them: \r\n, \r and \n each end one.
int count_lines(const std::string& s) {
  int lines = 1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\n' || (s[i] == '\r' && (i + 1 == s.size() || s[i + 1] != '\n'))) ++lines;
  }
  return lines;
}

void check_error(const ChatTemplateError& e, const std::string& source) {
  ROUNDPIPE_FUZZ_CHECK(e.template_name() == "fuzz.jinja", "errors name the template");
  ROUNDPIPE_FUZZ_CHECK(e.line() >= 0 && e.line() <= count_lines(source), "an error's line lies in the template");
}

void render(const ChatTemplate& tmpl, const std::string& source, bool add_generation_prompt) {
  ChatRenderOptions options;
  options.add_generation_prompt = add_generation_prompt;
  options.variables = &variables();
  options.now = 1785000000;
  std::string first;
  try {
    const auto rendered = tmpl.render(messages(), options);
    ROUNDPIPE_FUZZ_CHECK(rendered.text.size() <= (size_t{64} << 20), "the output cap holds");
    size_t previous_end = 0;
    for (const auto& [begin, end] : rendered.generation_spans) {
      ROUNDPIPE_FUZZ_CHECK(begin >= previous_end && begin <= end && end <= rendered.text.size(),
                           "generation spans are ordered ranges inside the text");
      previous_end = end;
    }
    first = rendered.text;
  } catch (const ChatTemplateError& e) {
    check_error(e, source);
    return;
  }
  ROUNDPIPE_FUZZ_CHECK(tmpl.render(messages(), options).text == first, "rendering is deterministic");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string source(reinterpret_cast<const char*>(data), size);
  try {
    const ChatTemplate tmpl = ChatTemplate::from_string(source, "fuzz.jinja");
    render(tmpl, source, false);
    render(tmpl, source, true);
  } catch (const ChatTemplateError& e) {
    check_error(e, source);
  }
  return 0;
}
