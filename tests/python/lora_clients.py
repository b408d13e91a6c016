#!/usr/bin/env python3
"""Drives a gemma4 server that holds LoRA adapters with the official
`openai`, `anthropic` and `ollama` Python clients, choosing the adapter by
the request's `model`, and prints what they saw as one JSON object.

    python3 tests/python/lora_clients.py --url http://127.0.0.1:8000 \
        --model base --model adapter-a --prompt-ids '[2, 10, 20]' --max-tokens 8
"""

import argparse
import json
import sys

import anthropic
import ollama
import openai


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the server's root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", action="append", required=True, help="repeatable: names to request")
    p.add_argument("--prompt-ids", required=True, help="a completions prompt as token ids (JSON)")
    p.add_argument("--prompt", default="Say something.", help="a chat turn's text")
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args()
    oa = openai.OpenAI(base_url=f"{args.url}/v1", api_key="unused", max_retries=0, timeout=120)
    an = anthropic.Anthropic(base_url=args.url, api_key="unused", max_retries=0, timeout=120)
    ol = ollama.Client(host=args.url)
    ids = json.loads(args.prompt_ids)
    user = [{"role": "user", "content": args.prompt}]
    greedy = {"ignore_eos": True}
    out = {
        "models": [{"id": m.id, "parent": getattr(m, "parent", None)} for m in oa.models.list().data],
        "tags": [{"name": m.model, "parent": m.details.parent_model} for m in ol.list().models],
        "runs": {},
    }
    for model in args.model:
        completion = oa.completions.create(
            model=model, prompt=ids, max_tokens=args.max_tokens, temperature=0, extra_body=greedy
        )
        chat = oa.chat.completions.create(
            model=model, messages=user, max_tokens=args.max_tokens, temperature=0
        )
        message = an.messages.create(
            model=model, messages=user, max_tokens=args.max_tokens,
            extra_body={"temperature": 0},
        )
        ollama_chat = ol.chat(
            model=model, messages=user, options={"temperature": 0, "num_predict": args.max_tokens}
        )
        out["runs"][model] = {
            "completion": completion.choices[0].text,
            "completion_model": completion.model,
            "chat": chat.choices[0].message.content,
            "anthropic": "".join(b.text for b in message.content if b.type == "text"),
            "anthropic_model": message.model,
            "ollama": ollama_chat.message.content,
        }
    try:
        oa.completions.create(model="no-such-adapter", prompt=ids, max_tokens=1)
        out["unknown"] = None
    except openai.NotFoundError as e:
        out["unknown"] = {"status": e.status_code, "body": e.body}
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
