#!/usr/bin/env python3
"""Render Gemma 4 chat templates with transformers and store the results as test fixtures.

For each of the three real Gemma 4 templates (Google's gemma-4-31B-it template, its
"interleaved thinking" variant, and the older one embedded in the vocabulary GGUF), this
renders a fixed set of conversations with transformers' `apply_chat_template` (Python
Jinja2, exactly the code path a transformers user runs) and writes, per template,
`tests/fixtures/text/templates/<name>.json` with every conversation, its rendered text
(or the error the template raised) and the token ids of the text under the real
Gemma 4 tokenizer (`add_special_tokens=False`, as apply_chat_template tokenizes).
The template sources are copied next to the fixtures so that the tests need nothing else.

Requirements: `pip install transformers tokenizers jinja2` (no PyTorch needed).

Usage (from the repository root):
    python tools/make_template_fixtures.py [--shared ../shared]

`--shared` is the folder holding `real-gemma4/templates/*.jinja` and
`oracle/real-vocab/` (the real Gemma 4 tokenizer.json).
"""

import argparse
import json
import os
import shutil
import sys

import jinja2
import tokenizers
import transformers
from transformers import AutoTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO, "tests", "fixtures", "text", "templates")

TEMPLATES = {
    "gemma4-31b-it": "google-gemma-4-31B-it.jinja",
    "gemma4-31b-it-interleaved": "google-gemma-4-31B-it-interleaved.jinja",
    "gemma4-vocab-gguf-26b-a4b": "from-vocab-gguf-26B-A4B.jinja",
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
                "days": {"type": "integer", "description": "Forecast length in days"},
            },
            "required": ["city"],
        },
    },
}

SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the documentation index.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "Free-text query"},
                "limit": {"type": "number", "description": "Maximum number of hits", "nullable": True},
                "exact": {"type": "boolean", "description": "Exact phrase match"},
                "tags": {
                    "type": "array",
                    "description": "Tags to filter by",
                    "items": {"type": "string"},
                },
                "filters": {
                    "type": "object",
                    "description": "Structured filters",
                    "properties": {
                        "year": {"type": "integer", "description": "Publication year"},
                        "lang": {"type": "string", "description": "Language code"},
                    },
                    "required": ["year"],
                },
            },
            "required": ["query", "exact"],
        },
        "response": {"type": "object", "description": "The hits, best first."},
    },
}

NO_PARAMS_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "description": "Current UTC time."},
}


def weather_call(call_id="call_1", city="Paris", extra=None):
    arguments = {"city": city, "unit": "celsius"}
    if extra:
        arguments.update(extra)
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


CASES = [
    {
        "name": "single-user",
        "messages": [{"role": "user", "content": "Hello! What is the capital of France?"}],
        "add_generation_prompt": True,
    },
    {
        "name": "single-user-no-generation-prompt",
        "messages": [{"role": "user", "content": "Hello!"}],
        "add_generation_prompt": False,
    },
    {
        "name": "system-multi-turn",
        "messages": [
            {"role": "system", "content": "You are a concise assistant.\n"},
            {"role": "user", "content": "  Name a prime number.  "},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": "And another one?"},
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "developer-role",
        "messages": [
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": "Good morning"},
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "ends-with-assistant",
        "messages": [
            {"role": "user", "content": "Say hi."},
            {"role": "assistant", "content": "Hi!"},
        ],
        "add_generation_prompt": False,
    },
    {
        "name": "thinking-on",
        "messages": [{"role": "user", "content": "Think about the river."}],
        "add_generation_prompt": True,
        "kwargs": {"enable_thinking": True},
    },
    {
        "name": "thinking-on-with-system",
        "messages": [
            {"role": "system", "content": "You reason carefully."},
            {"role": "user", "content": "Is 91 prime?"},
        ],
        "add_generation_prompt": True,
        "kwargs": {"enable_thinking": True},
    },
    {
        "name": "thinking-off-explicit",
        "messages": [{"role": "user", "content": "Quick answer: 2+2?"}],
        "add_generation_prompt": True,
        "kwargs": {"enable_thinking": False},
    },
    {
        "name": "history-with-thought-channel",
        "messages": [
            {"role": "user", "content": "Is 91 prime?"},
            {"role": "assistant", "content": "<|channel>thought\n91 = 7 * 13<channel|>No, 91 = 7 × 13."},
            {"role": "user", "content": "And 97?"},
        ],
        "add_generation_prompt": True,
        "kwargs": {"enable_thinking": True},
    },
    {
        "name": "history-with-reasoning-content",
        "messages": [
            {"role": "user", "content": "Is 91 prime?"},
            {"role": "assistant", "content": "No.", "reasoning_content": "91 = 7 * 13"},
            {"role": "user", "content": "Why?"},
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "tools-declared",
        "messages": [{"role": "user", "content": "What's the weather in Paris?"}],
        "tools": [WEATHER_TOOL, SEARCH_TOOL, NO_PARAMS_TOOL],
        "add_generation_prompt": True,
    },
    {
        "name": "tools-declared-thinking",
        "messages": [
            {"role": "system", "content": "Use tools when useful."},
            {"role": "user", "content": "Find docs about GGUF."},
        ],
        "tools": [SEARCH_TOOL],
        "add_generation_prompt": True,
        "kwargs": {"enable_thinking": True},
    },
    {
        "name": "tool-call-and-result",
        "messages": [
            {"role": "user", "content": "What's the weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [weather_call()]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21, \"sky\": \"clear\"}"},
        ],
        "tools": [WEATHER_TOOL],
        "add_generation_prompt": True,
    },
    {
        "name": "tool-call-pending",
        "messages": [
            {"role": "user", "content": "Weather in Oslo, 3 days?"},
            {"role": "assistant", "tool_calls": [weather_call(city="Oslo", extra={"days": 3})]},
        ],
        "tools": [WEATHER_TOOL],
        "add_generation_prompt": True,
    },
    {
        "name": "tool-call-with-reasoning-thinking",
        "messages": [
            {"role": "user", "content": "Weather in Rome?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "The user wants the weather; call the tool.",
                "tool_calls": [weather_call(call_id="c9", city="Rome")],
            },
            {"role": "tool", "tool_call_id": "c9", "name": "get_weather", "content": "sunny, 25 C"},
        ],
        "tools": [WEATHER_TOOL],
        "add_generation_prompt": True,
        "kwargs": {"enable_thinking": True},
    },
    {
        "name": "parallel-tool-calls",
        "messages": [
            {"role": "user", "content": "Compare Paris and Tokyo weather."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [weather_call("a", "Paris"), weather_call("b", "Tokyo", {"days": 2})],
            },
            {"role": "tool", "tool_call_id": "a", "content": "18 C"},
            {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": "24 C, humid"}]},
        ],
        "tools": [WEATHER_TOOL],
        "add_generation_prompt": True,
    },
    {
        "name": "tool-round-trip-then-user",
        "messages": [
            {"role": "system", "content": "You are a weather bot."},
            {"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [weather_call()]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
            {"role": "assistant", "content": "It is 21 °C in Paris."},
            {"role": "user", "content": "Thanks! And Berlin?"},
        ],
        "tools": [WEATHER_TOOL],
        "add_generation_prompt": True,
    },
    {
        "name": "argument-types",
        "messages": [
            {"role": "user", "content": "Search."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "s1",
                        "type": "function",
                        "function": {
                            "name": "search_docs",
                            "arguments": {
                                "query": "tokenizer \"quotes\" {braces} , commas: ok",
                                "limit": 2.5,
                                "exact": False,
                                "tags": ["gguf", "bpe", 3, True],
                                "filters": {"year": 2024, "lang": "en", "nested": {"deep": [1.0, None]}},
                                "Zeta": "capitalised key",
                            },
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "s1", "content": "no hits"},
        ],
        "tools": [SEARCH_TOOL],
        "add_generation_prompt": True,
    },
    {
        "name": "arguments-as-json-string",
        "messages": [
            {"role": "user", "content": "Weather in Lima"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Lima\"}"}}
                ],
            },
        ],
        "tools": [WEATHER_TOOL],
        "add_generation_prompt": True,
    },
    {
        "name": "native-tool-responses",
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [weather_call()],
                "tool_responses": [
                    {"name": "get_weather", "response": {"temperature": 21, "unit": "celsius", "ok": True, "note": None}}
                ],
            },
        ],
        "tools": [WEATHER_TOOL],
        "add_generation_prompt": True,
    },
    {
        "name": "native-tool-response-scalar-then-answer",
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "It is sunny.",
                "tool_calls": [weather_call()],
                "tool_responses": [{"name": "get_weather", "response": "sunny"}],
            },
            {"role": "user", "content": "Great."},
        ],
        "tools": [WEATHER_TOOL],
        "add_generation_prompt": True,
    },
    {
        "name": "content-parts-with-image",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": " Describe this picture. "},
                    {"type": "image"},
                    {"type": "text", "text": "Be brief."},
                ],
            }
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "unicode-and-whitespace",
        "messages": [
            {"role": "system", "content": "\n\tSystème : réponds en français.\n"},
            {"role": "user", "content": "Ünïcödé 日本語 🙂 — \"quotes\" and {braces}\n\n"},
            {"role": "assistant", "content": "  D'accord !  "},
            {"role": "user", "content": "<b>html</b> & <|not a token|>"},
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "empty-messages",
        "messages": [],
        "add_generation_prompt": True,
    },
]


# Small templates that probe Jinja semantics a chat template may rely on: Python's
# printing of values, undefined handling, filters, tests, string and dict methods,
# loop controls, whitespace control. Each renders with one user message and `vars`.
# (Not covered because MiniJinja lacks it: printf-style `'%s' % x` string formatting.)
SNIPPETS = [
    "{{ missing | upper }}|{{ missing | length }}|{{ missing is defined }}|{{ missing | default('d') }}",
    "{{ 7 / 2 }} {{ 7 // 2 }} {{ 2 ** 10 }} {{ 7 % 3 }} {{ 1 + 2.5 }} {{ -7 // 2 }} {{ 1 == 1.0 }}",
    "{{ 'abc'[1:] }} {{ [1, 2, 3][-1] }} {{ 'ab' * 3 }} {{ 'abc'[::-1] }} {{ [1, 2, 3][:2] }}",
    "{{ 'Hello World'.lower() }} {{ 'x'.upper() }} [{{ ' a '.lstrip() }}] {{ 'a-b-c'.split('-', 1) }}",
    "{{ 'abc'.replace('b', 'B') }} {{ 'abc'.endswith('c') }} {{ 'a b  c\n'.split() }} {{ 'Title case'.title() }}",
    "{{ 'abc'.startswith(('x', 'a')) }} {{ 'a,b'.rsplit(',') if false else 'n' }} {{ '  x '.strip() }}",
    "{{ messages | length }} {{ messages[0].role }} {{ messages[0]['content'] }} {{ messages[0].get('nope', 'dflt') }}",
    "{{ vars | tojson }}",
    "{{ vars | tojson(indent=2) }}",
    "{{ vars.nested | tojson(sort_keys=True) }} {{ vars.nested | tojson(separators=(',', ':')) }}",
    "{{ vars.text | tojson }} {{ vars.text | tojson(ensure_ascii=True) }} {{ none | tojson }} {{ 1.5 | tojson }}",
    "{{ vars.floats }} {{ vars.ints }} {{ vars.flag }} {{ vars.nothing }} {{ vars.nested }}",
    "{{ true and 'yes' or 'no' }} {{ none | default('d') }} {{ '' | default('d', true) }} {{ 0 or 'zero' }}",
    "{{ [3, 1, 2] | sort }} {{ [1, 2, 3] | join(',') }} {{ [1, 2] | first }} {{ [1, 2] | last }} {{ ['a', 'b'] | map('upper') | list }}",
    "{{ 'x' in 'xyz' }} {{ 1 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 'q' not in 'xyz' }}",
    "{% for i in range(3) %}{{ loop.index }}{{ loop.first }}{{ loop.last }}{{ loop.length }},{% endfor %}",
    "{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}",
    "{% for k, v in {'b': 1, 'a': 2}.items() %}{{ k }}{{ v }}{% endfor %} {{ {'b': 1, 'a': 2}.keys() | list }} {{ {'b': 1}.values() | list }}",
    "{% for k, v in vars.nested | dictsort %}{{ k }}={{ v }};{% endfor %}",
    "{% set ns = namespace(a=1) %}{% set ns.a = ns.a + 1 %}{{ ns.a }} {{ raise_exception('no') if false else 'ok' }}",
    "{{ strftime_now('%Y') | length }} {{ 'abc' | capitalize }} {{ 'abc' | reverse }} {{ [1, 2] | reverse | list }}",
    "{{ messages | map(attribute='role') | join(',') }} {{ messages | selectattr('role', 'equalto', 'user') | list | length }}",
    "{{ 3 | string + 'x' }} {{ true | string }} {{ none | string }} {{ 5 | int }} {{ '5' | int + 1 }} {{ '3.5' | float }}",
    "[{{ '  x  ' | trim }}] [{{ 'xxaxx' | trim('x') }}] {{ [1, 2, 3] | sum }} {{ [1, 5, 3] | max }} {{ [4, 2] | min }}",
    "{{ 'a\nb' | indent(2) }}|{{ 'x' | replace('x', 'y') }}|{{ 'AbC' | lower }}|{{ 'a b' | wordcount if false else 2 }}",
    "{% if true %}\n  line\n{% endif %}\n  {% if true %}x{% endif %}\n{%- if true %} y {% endif -%}\n end",
    "{% macro m(a, b='B') %}[{{ a }}{{ b }}]{% endmacro %}{{ m(1) }}{{ m(2, b=3) }}{{ m('x', 'y') }}",
    "{{ vars.text is string }} {{ vars.ints is sequence }} {{ vars.nested is mapping }} {{ vars.flag is boolean }} {{ vars.ints[0] is number }} {{ none is none }}",
    "{{ 'a' ~ none ~ true ~ 1.0 }}",
    "{{ {'b': 1, 'a': 2} | dictsort }}",
    "{{ {'b': 1} | items | list }}",
    "{{ vars.nested.items() | list }}",
    "{{ [1, 2] + [3] }} {{ 'x' if [] else 'empty' }} {{ {} | length }}",
    "{{ vars.ints | join(', ') }} {{ [true, none] | join(',') }}",
    "{{ 'x'.split('') if false else 1 }} {{ 'a.b.c'.rsplit('.', 1) }}",
    "{{ '{}-{}'.format('a', 1) }} {{ 'abc'.find('c') }} {{ 'aXbX'.count('X') }} {{ 'ab'.isalpha() }}",
    "{{ vars.ints | map('string') | join }} {{ vars.ints[1:] }} {{ vars.ints | batch(2) | list }}",
    "{{ range(3) | list }} {{ range(1, 10, 3) | list }} {{ [1, 2][5] is defined }}",
    "{{ 1 if vars.nothing is none }} {{ (1, 2) }} {{ 10 / 4 }} {{ 10 / 5 }} {{ 2 ** -1 }}",
    "{{ vars.ints | tojson(indent=None) }} {{ messages[0] | tojson }}",
    "{{ vars.ints | unique | list }} {{ [[1, 2], [3]] | map('length') | list }} {{ vars.ints | select('odd') | list }}",
]

SNIPPET_VARS = {
    "vars": {
        "text": "é \"quoted\" \\ back\nnew\ttab \u2028 😀",
        "floats": [1.0, 0.5, 1e-7, 1e16, 123.456, -0.0],
        "ints": [3, 1, 3, 12345678901234],
        "flag": True,
        "nothing": None,
        "nested": {"b": [1, {"c": None}], "A": "x", "a": 2.5},
    }
}


def render_case(tokenizer, source, case):
    """(text, None) or (None, error message) as transformers renders the case."""
    kwargs = case.get("kwargs", {})
    try:
        text = tokenizer.apply_chat_template(
            case["messages"],
            tools=case.get("tools"),
            chat_template=source,
            add_generation_prompt=case["add_generation_prompt"],
            tokenize=False,
            **kwargs,
        )
        return text, None
    except (jinja2.TemplateError, TypeError, ValueError, IndexError, KeyError) as err:
        return None, f"{type(err).__name__}: {err}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shared", default=os.path.join(REPO, "..", "shared"))
    args = parser.parse_args()

    template_dir = os.path.join(args.shared, "real-gemma4", "templates")
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.shared, "oracle", "real-vocab"))
    os.makedirs(OUT_DIR, exist_ok=True)
    versions = {
        "python": sys.version.split()[0],
        "transformers": transformers.__version__,
        "jinja2": jinja2.__version__,
        "tokenizers": tokenizers.__version__,
    }

    for name, file_name in TEMPLATES.items():
        shutil.copyfile(os.path.join(template_dir, file_name), os.path.join(OUT_DIR, file_name))
        with open(os.path.join(OUT_DIR, file_name), encoding="utf-8") as f:
            source = f.read()
        cases = []
        for case in CASES:
            text, error = render_case(tokenizer, source, case)
            record = {
                "name": case["name"],
                "messages": case["messages"],
                "tools": case.get("tools"),
                "add_generation_prompt": case["add_generation_prompt"],
                "kwargs": case.get("kwargs", {}),
            }
            if error is None:
                record["text"] = text
                record["input_ids"] = tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                record["error"] = error
            cases.append(record)
        fixture = {
            "template_file": file_name,
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "generated_by": "tools/make_template_fixtures.py",
            "versions": versions,
            "cases": cases,
        }
        out_path = os.path.join(OUT_DIR, f"{name}.json")
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(fixture, f, ensure_ascii=False, indent=1)
            f.write("\n")
        rendered = sum(1 for c in cases if "text" in c)
        print(f"{out_path}: {rendered} rendered, {len(cases) - rendered} errors")

    snippet_messages = [{"role": "user", "content": "hi"}]
    snippets = []
    for source in SNIPPETS:
        case = {"messages": snippet_messages, "add_generation_prompt": False, "kwargs": SNIPPET_VARS}
        text, error = render_case(tokenizer, source, case)
        if error is not None:
            raise SystemExit(f"snippet {source!r} failed in Python: {error}")
        snippets.append({"template": source, "text": text})
    fixture = {
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "generated_by": "tools/make_template_fixtures.py",
        "versions": versions,
        "messages": snippet_messages,
        "kwargs": SNIPPET_VARS,
        "snippets": snippets,
    }
    out_path = os.path.join(OUT_DIR, "snippets.json")
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{out_path}: {len(snippets)} snippets")


if __name__ == "__main__":
    main()
