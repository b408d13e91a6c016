#!/usr/bin/env python3
"""Copy the text-side oracle data (tokenizers, templates, their goldens) into the repository.

The oracle folders (`shared/oracle/<variant>/`) hold tiny random Gemma 4 checkpoints and
the outputs transformers produces for them. Their `golden.json` files are large because
of the logits; the tokenizer and chat-template tests only need:

* for the tiny variants (e-style, dense-k-eq-v, moe, unified): `tokenizer.json`,
  `tokenizer_config.json`, `chat_template.jinja`, and the `tokenizer_cases` and
  `chat_template_cases` of `golden.json`, written to
  `tests/fixtures/text/oracle/<variant>/`;
* for `real-vocab` (the real Gemma 4 tokenizer and Google's 31B template): the three
  rendered conversations (`messages`, `tools`, `template_kwargs`, `text`, `input_ids`),
  written to `tests/fixtures/text/real_vocab_conversations.json`, plus
  `tests/fixtures/text/real_vocab_tokenizer_cases.json`: a varied set of strings with the
  ids the real `tokenizer.json` gives (run with Hugging Face `tokenizers`, no special
  tokens added) and what it decodes them to, with and without special tokens, and
  `generation_config.json` (the stop ids).

Requirements: `pip install tokenizers`.

Usage (from the repository root):
    python tools/extract_oracle_text_cases.py [--oracle ../shared/oracle]
"""

import argparse
import json
import os
import shutil
import sys

import tokenizers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO, "tests", "fixtures", "text")
TINY_VARIANTS = ["e-style", "dense-k-eq-v", "moe", "unified"]
COPIED_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
CONVERSATION_FIELDS = ["name", "messages", "tools", "template_kwargs", "text", "input_ids"]


TEXTS = [
    "Hello world",
    "  two  spaces and   three",
    "\t\ttabs\tinside\t",
    "\n\n\n\nfour newlines then text\n",
    "line one\nline two\r\nline three",
    "1234567890 3.14159 -42 1e-10 0x1F 1,000,000",
    "naïve café ☃ façade résumé",
    "Привет, мир! 日本語のテキスト、中文文本。한국어 텍스트 مرحبا بالعالم",
    "😀 🤖🫠 👨\u200d👩\u200d👧\u200d👦 🇫🇷 ✅",
    "rare CJK \u3400\u3461x and \U00020000\U000203f5 and private \U0010fffd\ue000",
    "def f(x):\n    return {\"k\": x ** 2}  # done\n",
    "<bos><|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>Hello<turn|><eos>",
    "<|tool>declaration:f{}<tool|><|tool_call>call:f{a:<|\"|>x<|\"|>}<tool_call|>"
    "<|tool_response>response:f{value:1}<tool_response|><|think|>",
    "<|image><|image|><image|> <|audio><|audio|><audio|> <|video|> <pad><unk><mask>",
    "▁literal▁metaspace▁",
    "\u0000\u0001 control \u007f bytes",
    "Zero\u200bwidth and\u00a0nbsp",
    "   \n   \n",
]


def write_json(path, value):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, indent=1)
        f.write("\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--oracle", default=os.path.join(REPO, "..", "shared", "oracle"))
    args = parser.parse_args()

    for variant in TINY_VARIANTS:
        src = os.path.join(args.oracle, variant)
        dst = os.path.join(OUT_DIR, "oracle", variant)
        os.makedirs(dst, exist_ok=True)
        for name in COPIED_FILES:
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
        with open(os.path.join(src, "golden.json"), encoding="utf-8") as f:
            golden = json.load(f)
        cases = {
            "source": f"oracle/{variant}/golden.json",
            "versions": golden.get("versions"),
            "tokenizer_cases": golden["tokenizer_cases"],
            "chat_template_cases": golden["chat_template_cases"],
        }
        write_json(os.path.join(dst, "cases.json"), cases)
        print(f"{dst}: {len(cases['tokenizer_cases'])} tokenizer cases, "
              f"{len(cases['chat_template_cases'])} chat template cases")

    with open(os.path.join(args.oracle, "real-vocab", "golden.json"), encoding="utf-8") as f:
        golden = json.load(f)
    conversations = [{key: prompt[key] for key in CONVERSATION_FIELDS} for prompt in golden["prompts"]]
    out = {
        "source": "oracle/real-vocab/golden.json",
        "template_file": "templates/google-gemma-4-31B-it.jinja",
        "versions": golden.get("versions"),
        "conversations": conversations,
    }
    path = os.path.join(OUT_DIR, "real_vocab_conversations.json")
    write_json(path, out)
    print(f"{path}: {len(conversations)} conversations")

    real_vocab = os.path.join(args.oracle, "real-vocab")
    shutil.copyfile(
        os.path.join(real_vocab, "generation_config.json"),
        os.path.join(OUT_DIR, "real_vocab_generation_config.json"),
    )
    tokenizer = tokenizers.Tokenizer.from_file(os.path.join(real_vocab, "tokenizer.json"))
    cases = []
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        cases.append(
            {
                "text": text,
                "input_ids": ids,
                "decoded": tokenizer.decode(ids, skip_special_tokens=False),
                "decoded_skip_special": tokenizer.decode(ids, skip_special_tokens=True),
            }
        )
    out = {
        "source": "oracle/real-vocab/tokenizer.json",
        "versions": {"python": sys.version.split()[0], "tokenizers": tokenizers.__version__},
        "add_special_tokens": False,
        "cases": cases,
    }
    path = os.path.join(OUT_DIR, "real_vocab_tokenizer_cases.json")
    write_json(path, out)
    print(f"{path}: {len(cases)} cases")


if __name__ == "__main__":
    main()
