// models::ChatTemplate against transformers' apply_chat_template (Python, jinja2): SmolLM2's real
// template (from its GGUF, loaded with from_model_dir), templates written with the constructs of
// the published Qwen2.5, Qwen3, Llama-3.1/3.2, Mistral and gpt-oss ones (tests/models/data/
// chat_templates/), a `{% generation %}` template (spans compared), and ~150 snippets, one Jinja
// construct each; every case rendered by both, text compared exactly, errors on the same cases.
// One Python run serves the whole suite (tests/models/chat_template_oracle.py).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <optional>
#include <thread>
#include <string>
#include <vector>

#include "roundpipe/models/chat_template.h"
#include "tests/models/test_files.h"

namespace roundpipe::testing {
namespace {

using models::ChatRenderOptions;
using models::ChatTemplate;
using models::ChatTemplateError;
using json = nlohmann::ordered_json;

// strftime_now's clock in every case (2026-07-25, local time on both sides).
constexpr int64_t kNow = 1785000000;

std::string data_dir() { return std::string(ROUNDPIPE_SOURCE_DIR) + "/tests/models/data"; }

const json& conversations_file() {
  static const json file = json::parse(read_bytes(data_dir() + "/chat_conversations.json"));
  return file;
}

struct TemplateSpec {
  std::string name;
  json special_tokens;
  std::vector<json> variable_sets;
  bool spans = false;
};

std::vector<TemplateSpec> template_specs() {
  const json tools = conversations_file()["tools"];
  const json qwen = {{"eos_token", "<|im_end|>"}, {"pad_token", "<|endoftext|>"}};
  const json llama = {{"bos_token", "<|begin_of_text|>"}, {"eos_token", "<|eot_id|>"}};
  const json mistral = {{"bos_token", "<s>"}, {"eos_token", "</s>"}, {"unk_token", "<unk>"}};
  const json smollm2 = {{"bos_token", "<|im_start|>"}, {"eos_token", "<|im_end|>"},
                        {"unk_token", "<|endoftext|>"}, {"pad_token", "<|im_end|>"}};
  return {
      {"qwen2_5", qwen, {json::object(), {{"tools", tools}}}},
      {"qwen3", qwen, {json::object(), {{"tools", tools}}, {{"enable_thinking", false}}}},
      {"llama3_1",
       llama,
       {json::object(),
        {{"tools", tools}},
        {{"tools", tools}, {"tools_in_user_message", false}, {"date_string", "01 Jan 2025"}},
        {{"tools", tools}, {"builtin_tools", {"brave_search", "code_interpreter", "get_weather"}}}}},
      {"llama3_2", llama, {json::object(), {{"tools", tools}}, {{"date_string", "02 Feb 2025"}}}},
      {"mistral", mistral, {json::object()}},
      {"mistral_v3", mistral, {json::object()}},
      {"gpt_oss",
       {{"eos_token", "<|return|>"}, {"pad_token", "<|endoftext|>"}},
       {json::object(),
        {{"tools", tools}},
        {{"reasoning_effort", "high"}, {"builtin_tools", {"browser", "python"}}, {"model_identity", "You are a test."}}}},
      {"smollm2_generation", smollm2, {json::object()}, /*spans=*/true},
  };
}

// Values the snippets read besides messages.
json snippet_variables() {
  return json::parse(R"({
    "s": "  Hello World, hello jinja  ", "u": "héllo wörld ÉTÉ ǅungla ß", "n": 7, "neg": -7, "f": 2.5,
    "big": 12345678901234, "tiny": 0.0001, "l": [3, 1, 2], "strs": ["b", "A", "c", "a"],
    "d": {"b": 1, "a": [1, 2.0, "x"], "c": {"k": null}}, "nothing": null, "t": true, "no": false,
    "people": [{"name": "Ann", "age": 31, "tags": ["x"]}, {"name": "bob", "age": 25},
               {"name": "Cid", "age": 31, "nick": "C"}],
    "multiline": "line one\nline two\n\nline four", "empty": "", "empty_list": [], "empty_dict": {}
  })");
}

// One construct each (or a few). Both engines render every snippet; an error on one side must be
// an error on the other.
const std::vector<std::string>& snippets() {
  static const std::vector<std::string> list = {
      // output of values: Python's str()
      "{{ n }}|{{ f }}|{{ t }}|{{ no }}|{{ nothing }}|{{ l }}|{{ d }}|{{ strs }}|{{ big }}|{{ tiny }}",
      "{{ 1.0 }} {{ 0.1 + 0.2 }} {{ 1e20 }} {{ 1.5e-7 }} {{ 123456789.125 }} {{ 10 / 4 }} {{ 10 / 5 }} {{ -0.0 }}",
      "{{ (1, 2) }} {{ (1,) }} {{ () }} {{ [] }} {{ {} }} {{ {'a': (1, 'x')} }} {{ [none, true, 'it\\'s'] }}",
      "{{ ['say \"hi\"', 'both \\' and \"', 'tab\\there', 'nl\\n', 'é😀', '\\x01'] }}",
      "{{ undefined_name }}|{{ d.missing }}|{{ d['missing'] }}|{{ l[10] }}|{{ nothing.x }}|{{ 'abc'.zz }}",
      // literals and escapes
      "{{ 'a\\tb\\nc\\\\d\\x41\\u00e9\\U0001F600\\101' }}|{{ \"dq 'in' \\\"esc\\\"\" }}|{{ 'adj' 'acent' }}",
      "{{ 1_000 + 0x0 if false else 3 }}",
      "{{ True }} {{ False }} {{ None }} {{ true and True }} {{ none is none }}",
      // arithmetic and operators
      "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }}",
      "{{ 1 + 2 * 3 - 4 / 2 }} {{ (1 + 2) * 3 }} {{ -n }} {{ +n }} {{ - -n }} {{ -f|abs }} {{ 3 + true }}",
      "{{ 'a' ~ 1 ~ none ~ undefined_name ~ [1] ~ 2.0 }} {{ 'ab' * 3 }} {{ 3 * [0] }} {{ [1] + [2, 3] }}",
      "{{ 'a' + 1 }}",
      "{{ n + undefined_name }}",
      "{{ 1 / 0 }}",
      "{{ 1 == 1.0 }} {{ 1 == true }} {{ 'a' == 'a' }} {{ [1, 2] == [1, 2] }} {{ (1, 2) == [1, 2] }} {{ d == d }} {{ none == false }}",
      "{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ 2 >= 2.0 }} {{ 1 != 2 }}",
      "{{ 1 < 'a' }}",
      "{{ undefined_name == 1 }} {{ undefined_name != 1 }} {{ undefined_name == undefined_other }}",
      "{{ 'ell' in s }} {{ 1 in l }} {{ 'a' in d }} {{ 'z' not in d }} {{ 'x' in undefined_name }} {{ not 1 in l }}",
      "{{ 1 in 'abc' }}",
      "{{ n or 'x' }}|{{ 0 or 'y' }}|{{ '' and 'z' }}|{{ l and 'w' }}|{{ not l }}|{{ not not empty }}|{{ nothing or none }}",
      "{{ 'yes' if t else 'no' }}|{{ 'yes' if no else 'no' }}|{{ 'only' if no }}|{{ 1 if 0 else 2 if 0 else 3 }}",
      // attribute, item, slicing
      "{{ d.a }} {{ d['a'][2] }} {{ d.a.2 }} {{ l[-1] }} {{ l[-3] }} {{ l[-4] }} {{ d.c.k }} {{ people[0].name }}",
      "{{ l[::-1] }} {{ l[1:] }} {{ l[:-1] }} {{ l[::2] }} {{ l[5:] }} {{ l[-2:] }} {{ u[1:4] }} {{ u[::-1] }} {{ s[2] }} {{ u[-1] }}",
      "{{ l[1:2:0] }}",
      "{{ undefined_name.attr }}",
      "{{ undefined_name['k'] }}",
      "{{ d.missing.deeper }}",
      // string methods
      "[{{ s.strip() }}][{{ s.lstrip() }}][{{ s.rstrip() }}][{{ 'xxhixx'.strip('x') }}][{{ '\\n\\nhi\\n'.lstrip('\\n') }}][{{ 'ab'.rstrip('ba') }}]",
      "{{ s.split() }} {{ 'a,b,,c'.split(',') }} {{ 'a b c'.split(' ', 1) }} {{ 'a b c'.rsplit(' ', 1) }} {{ '  a  b '.rsplit() }} {{ ''.split() }} {{ ''.split(',') }}",
      "{{ 'a<x>b<x>c'.split('<x>')[-1] }} {{ 'k=v=w'.split('=', 1)[1] }} {{ 'k=v=w'.rsplit('=', 1)[0] }}",
      "{{ s.startswith('  He') }} {{ s.endswith('ja  ') }} {{ s.startswith(('x', '  H')) }} {{ 'abc'.startswith('b', 1) }} {{ 'abc'.endswith('b', 0, 2) }}",
      "{{ s.replace('l', 'L') }} {{ s.replace('l', 'L', 2) }} {{ 'ab'.replace('', '-') }} {{ u.upper() }} {{ u.lower() }} {{ s.title() }} {{ \"they're bill's\".title() }} {{ u.capitalize() }}",
      "{{ s.find('o') }} {{ s.rfind('o') }} {{ s.find('zz') }} {{ u.find('w') }} {{ s.count('l') }} {{ '-'.join(['a', 'b']) }} {{ multiline.splitlines() }}",
      "{{ '42'.isdigit() }} {{ '4a'.isdigit() }} {{ 'abc'.isalpha() }} {{ ' \\t'.isspace() }} {{ 'abc'.islower() }} {{ 'ABC'.isupper() }} {{ 'pre_x'.removeprefix('pre_') }}",
      // dict and list methods
      "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{{ d.keys() | list }}{{ d.values() | list }}{{ d.get('b') }}{{ d.get('zz') }}{{ d.get('zz', 5) }}",
      "{{ l.index(1) }} {{ l.count(3) }}",
      "{{ l.append(4) }}",
      // filters
      "[{{ s|trim }}][{{ 'xxhixx'|trim('x') }}][{{ s|length }}][{{ u|length }}][{{ l|length }}][{{ d|count }}][{{ undefined_name|length }}]",
      "{{ l|tojson }} {{ d|tojson }} {{ u|tojson }} {{ u|tojson(ensure_ascii=true) }} {{ d|tojson(indent=2) }} {{ d|tojson(sort_keys=true) }}",
      "{{ people|tojson(indent='\\t', separators=(',', ':')) }} {{ [f, 1e20, tiny, -0.0, nothing, t]|tojson }} {{ 'a\\u2028\\x7f\\x00\"\\\\/'|tojson }}",
      "{{ {1: 'int key', 2.5: 'float', none: 'n', true: 'b'}|tojson }}",
      "{{ undefined_name|tojson }}",
      "{{ n|string }}{{ l|string }}{{ s|lower }}{{ s|upper }}{{ 'hello world-foo(bar)x'|title }}{{ 'hELLO wORLD'|capitalize }}",
      "{{ s|replace('l', '_') }} {{ s|replace('l', '_', 1) }} {{ l|join(', ') }} {{ people|join('/', attribute='name') }} {{ 'abc'|join('.') }}",
      "{{ undefined_name|default('dflt') }} {{ nothing|default('dflt') }} {{ empty|default('dflt', true) }} {{ n|d(3) }} {{ undefined_name|default }}",
      "{{ l|first }} {{ l|last }} {{ 'abc'|first }} {{ empty_list|first }} {{ d|first }} {{ 'abc'|list }} {{ d|list }} {{ d|items|list }}",
      "{{ people|selectattr('age', 'equalto', 31)|map(attribute='name')|list }} {{ people|rejectattr('nick')|map(attribute='name')|join(',') }}",
      "{{ people|selectattr('nick', 'defined')|list|length }} {{ people|selectattr('age', '>', 26)|list|length }} {{ l|select('odd')|list }} {{ l|reject('even')|list }}",
      "{{ people|map(attribute='nick', default='-')|list }} {{ strs|map('upper')|list }} {{ l|map('string')|join }} {{ people|map(attribute='tags.0')|list }}",
      "{{ l|select('odd')|length }}",
      "{% if empty_list|select('odd') %}generator is truthy{% endif %}",
      "{% set g = l|map('string') %}{{ g|join }}|{{ g|join }}",
      "{{ f|int }} {{ '42'|int }} {{ ' 7 '|int }} {{ '3.9'|int }} {{ 'x'|int }} {{ 'x'|int(5) }} {{ n|float }} {{ '2.5'|float }} {{ none|int }}",
      "{{ neg|abs }} {{ 2.5|round }} {{ 3.5|round }} {{ 2.567|round(2) }} {{ 2.1|round(0, 'ceil') }} {{ 2.9|round(method='floor') }} {{ 7|round }}",
      "{{ strs|unique|list }} {{ strs|unique(case_sensitive=true)|list }} {{ strs|sort }} {{ strs|sort(reverse=true, case_sensitive=true) }} {{ people|sort(attribute='age')|map(attribute='name')|list }}",
      "{{ l|reverse|list }} {{ 'abc'|reverse }} {{ l|min }} {{ l|max }} {{ strs|max }} {{ l|sum }} {{ people|sum(attribute='age') }} {{ d|dictsort }}",
      "{{ multiline|indent }}|{{ multiline|indent(2, true) }}|{{ multiline|indent(width='> ', blank=true) }}|{{ ''|indent(first=true) }}",
      "{{ '<a href=\"x\">&</a>'|e }} {{ '<b>'|safe }} {{ 'one two  three'|wordcount }}",
      // tests
      "{{ n is defined }} {{ undefined_name is defined }} {{ undefined_name is undefined }} {{ nothing is none }} {{ n is number }} {{ t is number }} {{ f is float }} {{ n is integer }} {{ t is integer }}",
      "{{ s is string }} {{ d is mapping }} {{ l is iterable }} {{ s is iterable }} {{ n is iterable }} {{ d is sequence }} {{ l is sequence }} {{ t is boolean }} {{ t is true }} {{ no is false }} {{ 1 is true }}",
      "{{ n is odd }} {{ n is even }} {{ 9 is divisibleby 3 }} {{ 9 is divisibleby(4) }} {{ 1 is in l }} {{ n is eq 7 }} {{ n is equalto 8 }} {{ n is ne 7 }} {{ n is gt 3 }} {{ n is lt 3 }} {{ n is ge 7 }} {{ n is le 6 }}",
      "{{ nothing is sameas none }} {{ t is sameas true }} {{ 'abc' is lower }} {{ 'ABC' is upper }} {{ n is not defined }} {{ n is not none }} {{ undefined_name is not undefined }}",
      "{{ range is callable }} {{ 'trim' is filter }} {{ 'odd' is test }} {{ l is not string }}",
      "{{ n is prime }}",
      // statements
      "{% if n > 5 %}big{% elif n > 2 %}mid{% else %}small{% endif %}|{% if no %}x{% endif %}|{% if undefined_name %}u{% else %}not u{% endif %}",
      "{% for x in l %}{{ loop.index0 }}{{ loop.index }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}:{{ x }} {% endfor %}",
      "{% for x in l %}{{ loop.previtem }}/{{ loop.nextitem }}/{{ loop.cycle('a', 'b') }}/{{ loop.depth }} {% endfor %}",
      "{% for x in empty_list %}never{% else %}empty{% endfor %}|{% for x in l if x > 1 %}{{ x }}{{ loop.length }}{% else %}none{% endfor %}|{% for x in l if x > 5 %}{% else %}filtered out{% endfor %}",
      "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}{{ x }}{% endfor %}|{{ range(3)|list }}{{ range(1, 7, 2)|list }}{{ range(3) == range(3) }}{{ range(3) == [0, 1, 2] }}{{ range(5)[1:]|list }}{{ range(3)|length }}{{ range(5, 0, -2)|list }}",
      "{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }}{% endfor %}|{% for k in d %}{{ k }}{% endfor %}|{% for c in 'héé' %}[{{ c }}]{% endfor %}|{% for x in undefined_name %}x{% endfor %}",
      "{% for a, b in [[1, 2, 3]] %}{% endfor %}",
      "{% for x in n %}{% endfor %}",
      "{% set x = 1 %}{% for i in range(3) %}{{ x }}{% set x = x + 1 %}{{ x }},{% endfor %}{{ x }}",
      "{% for i in range(2) %}{% set y = i %}{% endfor %}[{{ y }}]{% if true %}{% set z = 5 %}{% endif %}[{{ z }}]",
      "{% set ns = namespace(count=0, items=[]) %}{% for i in range(4) %}{% set ns.count = ns.count + i %}{% set ns.items = ns.items + [i] %}{% endfor %}{{ ns.count }}{{ ns.items }}",
      "{% set ns = namespace(d, extra=1) %}{{ ns.a }}{{ ns.extra }}{{ ns.missing }}",
      "{% set x = 3 %}{% set x.attr = 1 %}",
      "{% set ns = namespace() %}{% set ns._private = 1 %}",
      "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set c = 1, 2 %}{{ c }}{% set (e, f) = 'xy' %}{{ e }}{{ f }}",
      "{% set block %}inside {{ n }}\n{% endset %}[{{ block }}]",
      "{% for i in range(3) %}{% set x %}a{% if i == 1 %}{% break %}{% endif %}b{% endset %}{{ i }}{{ x }}{% endfor %}|{% for i in range(3) %}{% set y %}{% continue %}{% endset %}{{ y }}{% endfor %}",
      "{% for i in [] %}{% else %}{% for j in [1] %}{% break %}{% endfor %}E{% endfor %}",
      "{% macro greet(name, greeting='Hello', punct=none) %}{{ greeting }}, {{ name }}{{ punct or '!' }}{% endmacro %}{{ greet('Ann') }}|{{ greet('Bob', 'Hi') }}|{{ greet(greeting='Yo', name='Cid', punct='?') }}|{{ greet() }}",
      "{% macro outer() %}[{{ inner() }}{{ late }}]{% endmacro %}{% macro inner() %}in{% endmacro %}{% set late = 'L' %}{{ outer() }}",
      "{% macro fact(k) %}{% if k <= 1 %}1{% else %}{{ k }}*{{ fact(k - 1) }}{% endif %}{% endmacro %}{{ fact(5) }}",
      "{% macro m(a) %}{{ a }}{% endmacro %}{{ m(1, 2) }}",
      "{% macro m(a) %}{{ a }}{% endmacro %}{{ m(b=2) }}",
      "{% macro forever(k) %}{{ forever(k + 1) }}{% endmacro %}{{ forever(0) }}",
      "{{ dict(a=1, b='x') }} {{ dict(d)|length }} {{ namespace(a=1).a }}",
      "{{ raise_exception('Custom failure: ' ~ n) }}",
      "{{ strftime_now('%Y-%m-%d %H:%M %A %b %-d') }}",
      // whitespace control: trim_blocks, lstrip_blocks, -, +
      "a\n  {% if true %}\n    b\n  {% endif %}\nc\n",
      "a  {%- if true -%}  b  {%- endif -%}  c",
      "a\n  {%+ if true %}b{% endif +%}\nc",
      "  {{ n }}  \n  {{- n -}}  \n{{ n }}\n",
      "x {# comment #}\n  {# another #}\ny {#- stripped -#}  z",
      "{% raw %}{{ not rendered }} {% if %}{% endraw %}\n  {% raw -%}  raw ws  {%- endraw %}|",
      "line1\r\nline2\rline3\n",
      "{% for m in messages %}\n  {{ m.role }}\n{% endfor %}\n\n",
      "\t{% if true %}tab-indented{% endif %}\n\t {% for x in l %}{{ x }}{% endfor %}",
      "{%- for m in messages -%}\n    {{- m.role }}:{{ m.content -}}\n{% endfor -%}\n",
      "{{ messages|length }} {{ messages[0] }} {{ messages[-1].role }} {{ add_generation_prompt }} {{ tools }} {{ documents }} {{ bos_token }} {{ eos_token }}",
      "{% set v = 1 %}{% generation %}{% set v = 2 %}{{ v }}{% endgeneration %}{{ v }}",
      // scoping of macros, loops and sets
      "{% set q = 1 %}{% macro m() %}{{ q }}{% endmacro %}{% set q = 2 %}{{ m() }}",
      "{% macro m() %}{{ q }}{% endmacro %}{% for q in [5] %}{{ m() }}{% endfor %}",
      "{% for i in [1] %}{% macro m() %}{{ i }}{% endmacro %}{% set i = 9 %}{{ m() }}{% endfor %}",
      "{% set q = 1 %}{% for i in [1, 2] %}{% macro m() %}{{ q }}{% endmacro %}{% set q = q + i %}{{ m() }}{% endfor %}{{ q }}",
      "{% macro m(x) %}{% set q = x %}{{ q }}{% endmacro %}{% set q = 1 %}{{ m(2) }}{{ q }}",
      "{% macro m() %}{{ messages|length }}{% endmacro %}{% set messages = messages[1:] %}{{ m() }}",
      "{% macro outer() %}{% set v = 'o' %}{% macro inner() %}{{ v }}{% endmacro %}{{ inner() }}{% endmacro %}{{ outer() }}",
      "{% for i in [1, 2] %}{{ j }}{% set j = i %}{{ j }}{% endfor %}",
      "{% set x = 1 %}{% for i in [1] %}{% if true %}{% set x = 2 %}{% endif %}{{ x }}{% endfor %}{{ x }}",
      "{% macro m(a, b=a) %}{{ b }}{% endmacro %}{{ m(3) }}{% macro k(a, b=c) %}{{ b }}{% endmacro %}{% set c = 4 %}{{ k(3) }}",
      "{% set ns = namespace(x=1) %}{% macro m() %}{% set ns.x = ns.x + 1 %}{% endmacro %}{{ m() }}{{ m() }}{{ ns.x }}",
      "{% for a in [1] %}{% for b in [2] %}{{ loop.index }}{{ a }}{% endfor %}{{ loop.index }}{% endfor %}{% set loop = 5 %}{{ loop }}",
      // found by differential fuzzing against jinja2
      "{{ -2 is upper }} {{ 'A1' is upper }} {{ '1' is lower }} {{ nothing|map('string')|list }} {{ 0|select|list }} {{ l|wordcount }} {{ messages|wordcount }}",
      "{{ n|indent }}",
      "{{ d in d }}",
      "{{ people|unique|list }}",
      "{{ {[1]: 2} }}",
      "{{ n is defined is number }}",
      "{{ s|abs }}",
      "{{ (-1) ** 3 }} {{ (-2) ** 5 }} {{ 0 ** 0 }} {{ 2 ** 62 }} {{ 2.0 ** 0.5 }} {{ 2.5 is even }} {{ 3.0 is odd }} {{ 4.5 is divisibleby 1.5 }}",
      "{{ 0 ** -1 }}",
      "{{ undefined_name|int }}",
      "{{ '1_000'|int }} {{ ' -12 '|int }} {{ '+7'|int }} {{ '1__0'|int }} {{ '0x10'|int }} {{ 'nan'|int(-1) }} {{ '2.9e2'|int }} {{ '1_0.5'|float }} {{ '.5'|float }} {{ '5.'|float }} {{ 'Infinity'|float }} {{ '-inf'|float }} {{ 'nan'|float }} {{ '1e400'|float }} {{ 'abc'|float(1) }} {{ 1.5e3 }} {{ 1e400 }}",
      "{{ 'inf'|int }} {{ (1e400 - 1e400)|int(5) }}",
      "{{ 1e400|int }}",
      "{{ people|map(attribute='tags.99999999999999999999')|list }}",
      "{{ undefined_name in {} }} {{ undefined_name in l }}",
      // syntax errors: both sides refuse
      "{% if true %}unclosed",
      "{{ 1 + }}",
      "{% endfor %}",
      "{{ 'unterminated }}",
      "{% for x in l %}{% break %}{% endfor %}{% break %}",
  };
  return list;
}

struct Case {
  std::string label;
  std::string template_name;
  std::string source;
  json special_tokens;
  json messages;
  bool add_generation_prompt = false;
  json variables = json::object();
  bool spans = false;
  bool smollm2_dir = false;
};

std::vector<Case> build_cases() {
  std::vector<Case> cases;
  const json& convs = conversations_file()["conversations"];
  for (const auto& spec : template_specs()) {
    const std::string source = read_bytes(data_dir() + "/chat_templates/" + spec.name + ".jinja");
    for (const auto& [conv_name, messages] : convs.items()) {
      for (size_t v = 0; v < spec.variable_sets.size(); ++v) {
        for (bool agp : {false, true}) {
          Case c;
          c.label = spec.name + "/" + conv_name + "/vars" + std::to_string(v) + (agp ? "/gen" : "");
          c.template_name = spec.name;
          c.source = source;
          c.special_tokens = spec.special_tokens;
          c.messages = messages;
          c.add_generation_prompt = agp;
          c.variables = spec.variable_sets[v];
          c.spans = spec.spans;
          cases.push_back(std::move(c));
        }
      }
    }
  }
  for (const auto& [conv_name, messages] : convs.items()) {
    for (bool agp : {false, true}) {
      Case c;
      c.label = std::string("smollm2/") + conv_name + (agp ? "/gen" : "");
      c.template_name = "smollm2";
      c.messages = messages;
      c.add_generation_prompt = agp;
      c.smollm2_dir = true;
      cases.push_back(std::move(c));
    }
  }
  const json snippet_messages = convs["system_multi_turn"];
  for (size_t i = 0; i < snippets().size(); ++i) {
    Case c;
    c.label = "snippet " + std::to_string(i) + ": " + snippets()[i];
    c.template_name = "snippet";
    c.source = snippets()[i];
    c.special_tokens = {{"bos_token", "<s>"}, {"eos_token", "</s>"}};
    c.messages = snippet_messages;
    c.variables = snippet_variables();
    cases.push_back(std::move(c));
  }
  return cases;
}

// The oracle's renders of build_cases(), computed once per process; the scratch directory (which
// also holds SmolLM2's tokenizer directory) goes at exit.
struct OracleRun {
  std::vector<Case> cases = build_cases();
  ScratchDir dir;
  json result;
  std::string error;

  OracleRun() {
    json input = {{"cases", json::array()}};
    for (const auto& c : cases) {
      input["cases"].push_back({{"template", c.source},
                                {"special_tokens", c.special_tokens.is_null() ? json::object() : c.special_tokens},
                                {"messages", c.messages},
                                {"add_generation_prompt", c.add_generation_prompt},
                                {"variables", c.variables},
                                {"now", kNow},
                                {"spans", c.spans},
                                {"smollm2_dir", c.smollm2_dir}});
    }
    write_bytes(dir.file("cases.json"), input.dump());
    const std::string cmd = std::string("TOKENIZERS_PARALLELISM=false \"") + ROUNDPIPE_TEST_PYTHON + "\" \"" +
                            ROUNDPIPE_SOURCE_DIR + "/tests/models/chat_template_oracle.py\" \"" + dir.path() +
                            "\" \"" + dir.file("cases.json") + "\" 2>\"" + dir.file("stderr.txt") + "\"";
    if (std::system(cmd.c_str()) != 0) {
      error = "chat_template_oracle.py failed: " + read_bytes(dir.file("stderr.txt"));
    } else {
      result = json::parse(read_bytes(dir.file("result.json")));
    }
  }
};

const OracleRun& oracle() {
  static const OracleRun run;
  return run;
}

// Byte offset of code point `index` in UTF-8 `text` (transformers' spans count characters).
size_t byte_offset(const std::string& text, size_t index) {
  size_t cp = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xC0) != 0x80) {
      if (cp == index) return i;
      ++cp;
    }
  }
  return text.size();
}

// Renders case `c` with `tmpl` and compares with the oracle's `expected`; returns false on a
// difference (reported through ADD_FAILURE, at most a few per test).
bool check_case(const Case& c, const ChatTemplate& tmpl, const json& expected, int& reported) {
  ChatRenderOptions options;
  options.add_generation_prompt = c.add_generation_prompt;
  options.variables = &c.variables;
  options.now = static_cast<std::time_t>(kNow);
  const auto report = [&](const std::string& what) {
    if (++reported <= 8) ADD_FAILURE() << c.label << ": " << what;
    return false;
  };
  std::string ours;
  std::vector<std::pair<size_t, size_t>> spans;
  std::string our_error;
  try {
    auto rendered = tmpl.render(c.messages, options);
    ours = std::move(rendered.text);
    spans = std::move(rendered.generation_spans);
  } catch (const ChatTemplateError& e) {
    our_error = e.what();
    // Every error names the template and, when tied to one, the line.
    if (e.template_name() != tmpl.name()) return report("error without the template name: " + our_error);
    if (expected.contains("error")) {
      const std::string theirs = expected["error"].get<std::string>();
      if (theirs.rfind("TemplateError: ", 0) == 0 && !e.raised_by_template()) {
        return report("transformers raised from the template (" + theirs + "), we failed with: " + our_error);
      }
      if (e.raised_by_template() && "TemplateError: " + e.message() != theirs) {
        return report("raise_exception message differs: ours " + e.message() + ", transformers " + theirs);
      }
      return true;
    }
  }
  if (expected.contains("error")) {
    return report("transformers fails (" + expected["error"].get<std::string>() + ") but we render " +
                  ::testing::PrintToString(ours));
  }
  if (!our_error.empty()) {
    return report("we fail (" + our_error + ") but transformers renders " +
                  ::testing::PrintToString(expected["text"].get<std::string>()));
  }
  const std::string theirs = expected["text"].get<std::string>();
  if (ours != theirs) {
    size_t at = 0;
    while (at < ours.size() && at < theirs.size() && ours[at] == theirs[at]) ++at;
    return report("text differs at byte " + std::to_string(at) + "\n  ours         " +
                  ::testing::PrintToString(ours.substr(at > 40 ? at - 40 : 0, 120)) + "\n  transformers " +
                  ::testing::PrintToString(theirs.substr(at > 40 ? at - 40 : 0, 120)));
  }
  if (c.spans) {
    std::vector<std::pair<size_t, size_t>> want;
    for (const auto& span : expected["spans"]) {
      want.emplace_back(byte_offset(theirs, span[0].get<size_t>()), byte_offset(theirs, span[1].get<size_t>()));
    }
    if (spans != want) {
      return report("generation spans differ: ours " + ::testing::PrintToString(spans) + ", transformers " +
                    ::testing::PrintToString(want));
    }
  }
  return true;
}

class ChatTemplateParityTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ChatTemplateParityTest, Render_MatchesTransformers) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers jinja2 tokenizers");
  const OracleRun& run = oracle();
  ASSERT_TRUE(run.error.empty()) << run.error;
  const std::string name = GetParam();
  std::optional<ChatTemplate> tmpl;
  if (name == "smollm2") {
    const json& info = run.result["smollm2"];
    if (info.contains("missing")) {
      const std::string reason = info["missing"].get<std::string>();
      ROUNDPIPE_ORACLE_MISSING(reason + " (run scripts/setup.sh)");
    }
    tmpl = ChatTemplate::from_model_dir(info["dir"].get<std::string>());
    EXPECT_EQ(tmpl->eos_token(), "<|im_end|>");
  }
  size_t compared = 0;
  size_t errors = 0;
  size_t failed = 0;
  int reported = 0;
  for (size_t i = 0; i < run.cases.size(); ++i) {
    const Case& c = run.cases[i];
    if (c.template_name != name) continue;
    const json& expected = run.result["results"][i];
    errors += expected.contains("error");
    ++compared;
    if (name != "smollm2") {
      try {
        tmpl = ChatTemplate::from_string(c.source, c.template_name, &c.special_tokens);
      } catch (const ChatTemplateError& e) {
        if (!expected.contains("error") && ++reported <= 8) {
          ADD_FAILURE() << c.label << ": we refuse to parse (" << e.what() << ") but transformers renders "
                        << ::testing::PrintToString(expected["text"].get<std::string>());
        }
        failed += !expected.contains("error");
        continue;
      }
    }
    failed += !check_case(c, *tmpl, expected, reported);
  }
  EXPECT_GT(compared, 0u);
  EXPECT_EQ(failed, 0u) << failed << " of " << compared << " renders differ";
  RecordProperty("renders", std::to_string(compared));
  RecordProperty("errors_on_both_sides", std::to_string(errors));
}

INSTANTIATE_TEST_SUITE_P(Templates, ChatTemplateParityTest,
                         ::testing::Values("smollm2", "qwen2_5", "qwen3", "llama3_1", "llama3_2", "mistral",
                                           "mistral_v3", "gpt_oss", "smollm2_generation", "snippet"),
                         [](const auto& info) { return info.param; });


// Differential test: 1,500 random templates of the supported constructs (generated by the oracle
// with a fixed seed) render to the same text as jinja2, or fail on both sides.
TEST(ChatTemplateRandomTest, RandomTemplates_MatchJinja2) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers jinja2 tokenizers");
  const OracleRun& run = oracle();
  ASSERT_TRUE(run.error.empty()) << run.error;
  const json& cases = run.result["random"];
  ASSERT_GT(cases.size(), 0u);
  size_t failed = 0;
  size_t errors = 0;
  int reported = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const json& c = cases[i];
    Case k;
    k.label = "random " + std::to_string(i) + ": " + c["template"].get<std::string>();
    k.template_name = "random";
    k.source = c["template"].get<std::string>();
    k.messages = c["messages"];
    k.variables = c["variables"];
    errors += c.contains("error");
    try {
      const ChatTemplate tmpl = ChatTemplate::from_string(k.source, "random");
      failed += !check_case(k, tmpl, c, reported);
    } catch (const ChatTemplateError& e) {
      if (!c.contains("error") && ++reported <= 8) ADD_FAILURE() << k.label << ": we refuse to parse: " << e.what();
      failed += !c.contains("error");
    }
  }
  EXPECT_EQ(failed, 0u) << failed << " of " << cases.size() << " random templates differ";
  RecordProperty("templates", std::to_string(cases.size()));
  RecordProperty("errors_on_both_sides", std::to_string(errors));
}

// --- behaviour without the oracle: unsupported constructs, errors, loading, limits ---

json two_messages() {
  return json::parse(R"([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])");
}

// The ChatTemplateError of parsing and rendering `source`, or nullopt when it renders.
std::optional<ChatTemplateError> template_error(const std::string& source, const json& variables = json::object()) {
  try {
    const ChatTemplate tmpl = ChatTemplate::from_string(source, "test.jinja");
    ChatRenderOptions options;
    options.variables = &variables;
    tmpl.render(two_messages(), options);
  } catch (const ChatTemplateError& e) {
    return e;
  }
  return std::nullopt;
}

TEST(ChatTemplateTest, UnsupportedConstructs_FailNamingTemplateLineAndConstruct) {
  struct Unsupported {
    std::string source;
    int line;
    std::string fragment;
  };
  const std::vector<Unsupported> cases = {
      {"line one\n{% include 'other.jinja' %}", 2, "unsupported tag 'include'"},
      {"{% extends 'base.jinja' %}", 1, "unsupported tag 'extends'"},
      {"a\nb\n{% call m() %}x{% endcall %}", 3, "unsupported tag 'call'"},
      {"{% filter upper %}x{% endfilter %}", 1, "unsupported tag 'filter'"},
      {"\n{% with a = 1 %}{{ a }}{% endwith %}", 2, "unsupported tag 'with'"},
      {"{% do messages.append(1) %}", 1, "unsupported tag 'do'"},
      {"{% frobnicate %}", 1, "unknown tag 'frobnicate'"},
      {"{% for m in messages recursive %}{% endfor %}", 1, "recursive for loops"},
      {"{{ messages[0] | wordwrap(5) }}", 1, "unsupported filter 'wordwrap'"},
      {"\n\n{{ 'x' is prime }}", 3, "unsupported test 'prime'"},
      {"{{ '{}'.format(1) }}", 1, "unsupported method str.format()"},
      {"{{ messages[0].copy() }}", 1, "unsupported method dict.copy()"},
      {"{{ 'a %s' % 'b' }}", 1, "printf-style string formatting"},
      {"{{ messages[1, 2] }}", 1, "tuple subscripts"},
      {"{{ range(*[1, 2]) }}", 1, "*args / **kwargs"},
      {"{{ messages[0].items }}", 1, "printing a function"},
      {"{{ messages | map(attribute='role') }}", 1, "printing a generator"},
      {"{{ range(3) }}", 1, "printing a range"},
      {"{{ messages.append(1) }}", 1, "modifies a value"},
      {"{% set x | upper %}a{% endset %}", 1, "filters on a block set"},
      {"{% set g = messages | map(attribute='role') %}{{ g | first }}{{ g | list }}", 1, "partial read"},
      {"{% macro m() %}{% generation %}x{% endgeneration %}{% endmacro %}{{ m() }}", 1, "{% generation %} inside a macro"},
      {"{{ 9223372036854775807 + 1 }}", 1, "integer overflow"},
      {"{{ strftime_now('%H:%M:%S.%f') }}", 1, "strftime_now: %f is not supported"},
      {"{{ '\\N{BULLET}' }}", 1, "escape \\N is not supported"},
      {"{% set ns = namespace() %}{% set ns._hidden = 1 %}", 1, "underscore-prefixed"},
  };
  for (const auto& c : cases) {
    const auto error = template_error(c.source);
    ASSERT_TRUE(error.has_value()) << "renders without an error: " << c.source;
    EXPECT_EQ(error->template_name(), "test.jinja");
    EXPECT_EQ(error->line(), c.line) << c.source << ": " << error->what();
    EXPECT_NE(std::string(error->what()).find(c.fragment), std::string::npos)
        << c.source << ": expected \"" << c.fragment << "\" in: " << error->what();
    EXPECT_NE(std::string(error->what()).find("chat template 'test.jinja' line " + std::to_string(c.line) + ": "),
              std::string::npos)
        << error->what();
    EXPECT_FALSE(error->raised_by_template());
  }
}

TEST(ChatTemplateTest, RaiseException_CarriesTheTemplatesMessageAndLine) {
  const auto error = template_error(
      "{% for m in messages %}\n{% if m.role == 'assistant' %}\n{{ raise_exception('No ' ~ m.role ~ ' turns') }}\n"
      "{% endif %}{% endfor %}");
  ASSERT_TRUE(error.has_value());
  EXPECT_TRUE(error->raised_by_template());
  EXPECT_EQ(error->line(), 3);
  EXPECT_EQ(error->message(), "No assistant turns");
  EXPECT_STREQ(error->what(), "chat template 'test.jinja' line 3: No assistant turns");
}

TEST(ChatTemplateTest, UndefinedAndSyntaxErrors_NameTheLine) {
  auto error = template_error("ok\n\n{{ messages[0].content.missing.deeper }}");
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->line(), 3);
  EXPECT_NE(std::string(error->what()).find("'str object' has no attribute 'missing'"), std::string::npos)
      << error->what();
  error = template_error("{% if true %}\n{% for x in y %}\n");
  ASSERT_TRUE(error.has_value());
  EXPECT_NE(std::string(error->what()).find("unexpected end of template, expected 'endfor' or 'else'"),
            std::string::npos)
      << error->what();
  error = template_error("a\n{{ 1 + }}");
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->line(), 2);
  error = template_error("{{ x }");
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->line(), 1);
  error = template_error("\xC3(");
  ASSERT_TRUE(error.has_value());
  EXPECT_NE(std::string(error->what()).find("not valid UTF-8"), std::string::npos);
}

TEST(ChatTemplateTest, Limits_StopRunawayTemplates) {
  auto error = template_error("{% macro m(k) %}{{ m(k + 1) }}{% endmacro %}{{ m(0) }}");
  ASSERT_TRUE(error.has_value());
  EXPECT_NE(std::string(error->what()).find("macro calls nested deeper than 64"), std::string::npos) << error->what();
  error = template_error("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}");
  ASSERT_TRUE(error.has_value());
  EXPECT_NE(std::string(error->what()).find("the output exceeds"), std::string::npos) << error->what();
  error = template_error("{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}");
  ASSERT_TRUE(error.has_value());
  EXPECT_NE(std::string(error->what()).find("the render exceeds 5000000 steps"), std::string::npos) << error->what();
  error = template_error("{{ range(100001) | length }}");
  ASSERT_TRUE(error.has_value());
  EXPECT_NE(std::string(error->what()).find("range too big"), std::string::npos) << error->what();
  error = template_error("{{ 'x' * 100000000 }}");
  ASSERT_TRUE(error.has_value());
  error = template_error("{{ " + std::string(500, '(') + "1" + std::string(500, ')') + " }}");
  ASSERT_TRUE(error.has_value());
  EXPECT_NE(std::string(error->what()).find("nested deeper than"), std::string::npos) << error->what();
  error = template_error("{% set ns = namespace(a=1) %}{% set ns.a = ns %}{{ ns }}");
  ASSERT_TRUE(error.has_value());
  EXPECT_NE(std::string(error->what()).find("nested deeper than"), std::string::npos) << error->what();
}

TEST(ChatTemplateTest, Messages_NoneDroppedAndReasoningAliased) {
  const ChatTemplate tmpl = ChatTemplate::from_string(
      "{% for m in messages %}{{ m | tojson }}|{{ m.content is defined }}\n{% endfor %}", "t");
  const json messages = json::parse(R"([
      {"role": "assistant", "content": null, "reasoning": "r1", "x": 1},
      {"role": "assistant", "content": "c", "thinking": "t2", "reasoning_content": null}])");
  EXPECT_EQ(tmpl.render(messages).text,
            "{\"thinking\": \"r1\", \"role\": \"assistant\", \"reasoning\": \"r1\", \"x\": 1, \"reasoning_content\": \"r1\"}|False\n"
            "{\"thinking\": \"t2\", \"role\": \"assistant\", \"content\": \"c\", \"reasoning_content\": \"t2\"}|True\n");
  EXPECT_THROW(tmpl.render(json::object()), std::invalid_argument);
  EXPECT_THROW(tmpl.render(json::parse("[1]")), std::invalid_argument);
  const json bad_vars = {{"messages", json::array()}};
  ChatRenderOptions options;
  options.variables = &bad_vars;
  EXPECT_THROW(tmpl.render(messages, options), std::invalid_argument);
}

TEST(ChatTemplateTest, FromModelDir_ReadsJinjaFileOrTokenizerConfig) {
  ScratchDir dir;
  EXPECT_THROW(ChatTemplate::from_model_dir(dir.path()), std::runtime_error);
  // tokenizer_config.json only: special tokens as strings or {"content": ...}.
  json config = {{"bos_token", {{"content", "<s>"}, {"lstrip", false}}},
                 {"eos_token", "</s>"},
                 {"pad_token", nullptr},
                 {"chat_template", "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
                                   "{{ pad_token is defined }}"}};
  write_bytes(dir.file("tokenizer_config.json"), config.dump());
  ChatTemplate tmpl = ChatTemplate::from_model_dir(dir.path());
  EXPECT_EQ(tmpl.render(two_messages()).text, "<s>Hi</s>Hello</s>False");
  EXPECT_EQ(tmpl.eos_token(), "</s>");
  // A list of named templates: "default", and "tool_use" when tools are given.
  config["chat_template"] = json::parse(R"([{"name": "tool_use", "template": "tools: {{ tools | length }}"},
                                            {"name": "default", "template": "default {{ messages | length }}"}])");
  write_bytes(dir.file("tokenizer_config.json"), config.dump());
  tmpl = ChatTemplate::from_model_dir(dir.path());
  EXPECT_EQ(tmpl.render(two_messages()).text, "default 2");
  const json tools = {{"tools", json::parse(R"([{"type": "function"}])")}};
  ChatRenderOptions options;
  options.variables = &tools;
  EXPECT_EQ(tmpl.render(two_messages(), options).text, "tools: 1");
  // chat_template.jinja wins over tokenizer_config.json; one trailing newline is dropped (jinja2).
  write_bytes(dir.file("chat_template.jinja"), "file {{ eos_token }}\n");
  tmpl = ChatTemplate::from_model_dir(dir.path());
  EXPECT_EQ(tmpl.render(two_messages()).text, "file </s>");
  EXPECT_EQ(tmpl.name(), dir.file("chat_template.jinja"));
  write_bytes(dir.file("tokenizer_config.json"), "{not json");
  try {
    ChatTemplate::from_model_dir(dir.path());
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer_config.json: not valid JSON"), std::string::npos) << e.what();
  }
}

TEST(ChatTemplateTest, GenerationSpans_AreByteRangesOfTheOutput) {
  const ChatTemplate tmpl = ChatTemplate::from_string(
      "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}!"
      "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
      "t");
  const json messages = json::parse(R"([{"role": "user", "content": "é"}, {"role": "assistant", "content": "ça"},
                                        {"role": "user", "content": "x"}, {"role": "assistant", "content": ""}])");
  const auto rendered = tmpl.render(messages);
  EXPECT_EQ(rendered.text, "<user>é<assistant>ça!<user>x<assistant>!");
  ASSERT_EQ(rendered.generation_spans.size(), 2u);
  EXPECT_EQ(rendered.text.substr(rendered.generation_spans[0].first,
                                 rendered.generation_spans[0].second - rendered.generation_spans[0].first),
            "ça!");
  EXPECT_EQ(rendered.generation_spans[1], std::make_pair(rendered.text.size() - 1, rendered.text.size()));
}

TEST(ChatTemplateTest, Render_FromManyThreadsGivesTheSameText) {
  const ChatTemplate tmpl = ChatTemplate::from_string(
      read_bytes(data_dir() + "/chat_templates/qwen3.jinja"), "qwen3", nullptr);
  const json messages = conversations_file()["conversations"]["reasoning"];
  const std::string expected = tmpl.render(messages).text;
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) mismatches[t] += tmpl.render(messages).text != expected;
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

}  // namespace
}  // namespace roundpipe::testing
