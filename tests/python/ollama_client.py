"""Drives the server's Ollama routes with the official `ollama` Python client
and prints what the client parsed as one JSON object on stdout.

    python ollama_client.py --host http://127.0.0.1:PORT --model M --prompt "Hi" --max-tokens 24

Every reply is parsed by the client's own types; a reply they reject raises.
"""

import argparse
import json

import ollama


# `--speculative-decoding`: the extension option (`on` leaves it out).
SPECULATIVE = {"on": {}, "off": {"speculative_decoding": False}, "bad": {"speculative_decoding": "no"}}


def merged(chunks, key):
    """A streamed chat's message field, joined across its chunks."""
    return "".join(getattr(c.message, key) or "" for c in chunks)


def chat_both_ways(c, kw):
    whole = c.chat(stream=False, **kw)
    chunks = list(c.chat(stream=True, **kw))
    calls = [t.model_dump() for ch in chunks for t in (ch.message.tool_calls or [])]
    last = chunks[-1]
    return {
        "whole": whole.model_dump(mode="json", exclude_none=True),
        "stream": {"content": merged(chunks, "content"), "thinking": merged(chunks, "thinking"),
                   "tool_calls": calls, "done": [ch.done for ch in chunks],
                   "done_reason": last.done_reason, "eval_count": last.eval_count,
                   "prompt_eval_count": last.prompt_eval_count},
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--host", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", default="Weather in Paris?")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--image", action="append", default=[], help="image path: only a chat turn with these")
    p.add_argument("--speculative-decoding", choices=sorted(SPECULATIVE),
                   help="only one greedy chat turn, drafting left on, turned off in `options`, or a bad value")
    args = p.parse_args()
    c = ollama.Client(host=args.host)
    if args.speculative_decoding:
        options = {"temperature": 0, "num_predict": args.max_tokens, **SPECULATIVE[args.speculative_decoding]}
        try:
            r = c.chat(model=args.model, messages=[{"role": "user", "content": args.prompt}], options=options)
        except ollama.ResponseError as e:
            print(json.dumps({"error": {"status": e.status_code, "error": e.error}}))
            return
        print(json.dumps({"text": r.message.content, "eval_count": r.eval_count}))
        return
    if args.image:
        kw = {"model": args.model, "options": {"temperature": 0, "num_predict": args.max_tokens},
              "messages": [{"role": "user", "content": args.prompt, "images": args.image}]}
        whole = c.chat(**kw)
        streamed = merged(list(c.chat(stream=True, **kw)), "content")
        print(json.dumps({"content": whole.message.content, "streamed": streamed,
                          "prompt_eval_count": whole.prompt_eval_count}))
        return
    user = [{"role": "user", "content": args.prompt}]
    options = {"temperature": 0, "num_predict": args.max_tokens}
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
              "required": ["city"], "additionalProperties": False}
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    out = {
        "plain": chat_both_ways(c, {"model": args.model, "messages": user, "options": options}),
        "format": chat_both_ways(c, {"model": args.model, "messages": user, "options": options, "format": schema}),
        "think": chat_both_ways(c, {"model": args.model, "messages": user, "options": options, "think": True}),
        "tools": chat_both_ways(c, {"model": args.model, "messages": user, "options": options, "tools": [weather]}),
    }
    # A tool round trip as Ollama clients send it: the call, then its answer by tool name.
    history = user + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "21 C, sunny", "tool_name": "get_weather"},
    ]
    out["round_trip"] = c.chat(model=args.model, messages=history, tools=[weather], options=options).model_dump(
        mode="json", exclude_none=True)
    whole = c.generate(model=args.model, prompt=args.prompt, options=options)
    chunks = list(c.generate(model=args.model, prompt=args.prompt, options=options, stream=True))
    out["generate"] = {"whole": whole.model_dump(mode="json", exclude_none=True),
                       "streamed": "".join(ch.response or "" for ch in chunks),
                       "done_reason": chunks[-1].done_reason}
    out["list"] = c.list().model_dump(mode="json", exclude_none=True)
    out["show"] = c.show(args.model).model_dump(mode="json", exclude_none=True, by_alias=True)
    out["ps"] = c.ps().model_dump(mode="json", exclude_none=True)
    try:
        c.chat(model="no-such-model", messages=user)
        out["unknown_model"] = "accepted"
    except ollama.ResponseError as e:
        out["unknown_model"] = {"status": e.status_code, "error": e.error}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
