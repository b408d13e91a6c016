#!/usr/bin/env python3
"""Drives a gemma4 server with the official `openai` Python client.

Each scenario prints one JSON object on stdout describing what the client
saw; the Rust tests (crates/gemma4-cli/tests/server.rs) check it. The script
itself only fails (non-zero exit) when the client could not run at all.

    python3 tests/python/openai_client.py --base-url http://127.0.0.1:8000/v1 \
        --scenario basic --prompt "Hello world" --max-tokens 8
"""

import argparse
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import openai

# Extensions the server understands; the openai client passes them through.
GREEDY_EXTRA = {"ignore_eos": True}


def client(args, api_key=None):
    return openai.OpenAI(
        base_url=args.base_url,
        api_key=api_key if api_key is not None else (args.api_key or "unused"),
        max_retries=0,
        timeout=120,
    )


def error_info(err):
    info = {"class": type(err).__name__, "message": str(getattr(err, "message", err))}
    status = getattr(err, "status_code", None)
    if status is not None:
        info["status"] = status
        info["retry_after"] = err.response.headers.get("retry-after")
    body = getattr(err, "body", None)
    if isinstance(body, dict):
        info["body"] = body
    return info


def chat_once(c, args, prompt, **kw):
    r = c.chat.completions.create(
        model=args.model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=args.max_tokens,
        temperature=0,
        extra_body=GREEDY_EXTRA,
        **kw,
    )
    return {
        "id": r.id,
        "object": r.object,
        "model": r.model,
        "n": len(r.choices),
        "text": r.choices[0].message.content,
        "texts": [ch.message.content for ch in r.choices],
        "indexes": [ch.index for ch in r.choices],
        "finish_reason": r.choices[0].finish_reason,
        "usage": r.usage.model_dump(exclude_none=True) if r.usage else None,
    }


def chat_stream(c, args, prompt, include_usage=False):
    kw = {"stream_options": {"include_usage": True}} if include_usage else {}
    stream = c.chat.completions.create(
        model=args.model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=args.max_tokens,
        temperature=0,
        stream=True,
        extra_body=GREEDY_EXTRA,
        **kw,
    )
    text, finish, usage, chunks, role = "", None, None, 0, None
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage.model_dump(exclude_none=True)
        for ch in chunk.choices:
            if ch.delta.role:
                role = ch.delta.role
            if ch.delta.content:
                text += ch.delta.content
            if ch.finish_reason:
                finish = ch.finish_reason
    return {"text": text, "finish_reason": finish, "usage": usage, "chunks": chunks, "role": role}


def completion_once(c, args, prompt):
    r = c.completions.create(
        model=args.model, prompt=prompt, max_tokens=args.max_tokens, temperature=0, extra_body=GREEDY_EXTRA
    )
    return {
        "id": r.id,
        "object": r.object,
        "text": r.choices[0].text,
        "finish_reason": r.choices[0].finish_reason,
        "usage": r.usage.model_dump(exclude_none=True) if r.usage else None,
    }


def completion_stream(c, args, prompt, include_usage=False):
    kw = {"stream_options": {"include_usage": True}} if include_usage else {}
    stream = c.completions.create(
        model=args.model,
        prompt=prompt,
        max_tokens=args.max_tokens,
        temperature=0,
        stream=True,
        extra_body=GREEDY_EXTRA,
        **kw,
    )
    text, finish, usage, chunks = "", None, None, 0
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage.model_dump(exclude_none=True)
        for ch in chunk.choices:
            text += ch.text or ""
            if ch.finish_reason:
                finish = ch.finish_reason
    return {"text": text, "finish_reason": finish, "usage": usage, "chunks": chunks}


def scenario_basic(args):
    c = client(args)
    prompt = args.prompt[0]
    return {
        "models": [m.id for m in c.models.list().data],
        "chat": chat_once(c, args, prompt),
        "chat_n2": chat_once(c, args, prompt, n=2),
        "chat_stream": chat_stream(c, args, prompt, include_usage=True),
        "completion": completion_once(c, args, prompt),
        "completion_stream": completion_stream(c, args, prompt, include_usage=True),
    }


def scenario_concurrent(args):
    """Each prompt as a completion and as a chat: alone first, then all streams at once."""
    c = client(args)
    jobs = [(kind, p) for p in args.prompt for kind in ("completion", "chat")]
    solo = []
    for kind, p in jobs:
        r = completion_once(c, args, p) if kind == "completion" else chat_once(c, args, p)
        solo.append({"kind": kind, "prompt": p, "text": r["text"], "finish_reason": r["finish_reason"]})
    start = threading.Barrier(len(jobs))

    def run(job):
        kind, p = job
        start.wait()
        r = completion_stream(c, args, p) if kind == "completion" else chat_stream(c, args, p)
        return {"kind": kind, "prompt": p, "text": r["text"], "finish_reason": r["finish_reason"]}

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        concurrent = list(pool.map(run, jobs))
    return {"solo": solo, "concurrent": concurrent}


def scenario_queue(args):
    """More simultaneous requests than running slots plus queue places."""
    c = client(args)
    start = threading.Barrier(args.count)
    if args.wait_for_go:
        # The caller fills the server only once this process is ready, so
        # the burst lands within milliseconds of its word.
        print("ready", flush=True)
        sys.stdin.readline()

    def run(_):
        start.wait()
        try:
            r = completion_once(c, args, args.prompt[0])
            return {"status": 200, "finish_reason": r["finish_reason"]}
        except openai.APIStatusError as e:
            return error_info(e)

    with ThreadPoolExecutor(max_workers=args.count) as pool:
        outcomes = list(pool.map(run, range(args.count)))
    return {"outcomes": outcomes}


def scenario_timeout(args):
    c = client(args)
    out = {}
    try:
        out["plain"] = {"unexpected_success": completion_once(c, args, args.prompt[0])}
    except openai.APIStatusError as e:
        out["plain"] = error_info(e)
    try:
        out["stream"] = {"unexpected_success": chat_stream(c, args, args.prompt[0])}
    except openai.APIError as e:
        out["stream"] = error_info(e)
    return out


def scenario_errors(args):
    """Bad requests as the client library reports them."""
    c = client(args)
    out = {}
    cases = {
        "unknown_model": lambda: c.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        ),
        "empty_messages": lambda: c.chat.completions.create(model=args.model, messages=[], max_tokens=2),
        "wrong_type": lambda: c.completions.create(
            model=args.model, prompt="hi", max_tokens=2, extra_body={"temperature": "hot"}
        ),
        "max_tokens_over_context": lambda: c.completions.create(model=args.model, prompt="hi", max_tokens=10**7),
    }
    for name, call in cases.items():
        try:
            call()
            out[name] = {"unexpected_success": True}
        except openai.APIStatusError as e:
            out[name] = error_info(e)
    return out


def scenario_auth(args):
    """The configured key works; a wrong one is refused."""
    out = {}
    try:
        client(args, api_key="wrong-key").models.list()
        out["wrong_key"] = {"unexpected_success": True}
    except openai.APIStatusError as e:
        out["wrong_key"] = error_info(e)
    out["right_key"] = completion_once(client(args), args, args.prompt[0])
    return out


def extra(obj, name):
    """A field the openai types do not declare (reasoning_content)."""
    value = getattr(obj, name, None)
    if value is None and obj.model_extra:
        value = obj.model_extra.get(name)
    return value


def scenario_protocol(args):
    """Reasoning with a thinking budget (whole and streamed), tool_choice, a tool round trip."""
    c = client(args)
    messages = [{"role": "user", "content": args.prompt[0]}]
    body = {
        "ignore_eos": True,
        "thinking_token_budget": args.budget,
        "chat_template_kwargs": {"enable_thinking": True},
        "logit_bias": {str(t): -100 for t in args.ban},
    }
    out = {}
    r = c.chat.completions.create(
        model=args.model, messages=messages, max_tokens=args.max_tokens, temperature=0, extra_body=body
    )
    m = r.choices[0].message
    out["whole"] = {
        "content": m.content,
        "reasoning": extra(m, "reasoning_content"),
        "tool_calls": len(m.tool_calls or []),
        "finish_reason": r.choices[0].finish_reason,
        "usage": r.usage.model_dump(exclude_none=True),
        "system_fingerprint": r.system_fingerprint,
    }
    stream = c.chat.completions.create(
        model=args.model,
        messages=messages,
        max_tokens=args.max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=body,
    )
    content, reasoning, finish, usage = "", "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump(exclude_none=True)
        for ch in chunk.choices:
            content += ch.delta.content or ""
            reasoning += extra(ch.delta, "reasoning_content") or ""
            finish = ch.finish_reason or finish
    out["stream"] = {"content": content, "reasoning": reasoning, "finish_reason": finish, "usage": usage}

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    r = c.chat.completions.create(
        model=args.model, messages=messages, max_tokens=8, tools=tools, tool_choice="none", extra_body={"ignore_eos": True}
    )
    out["tool_choice_none"] = {"tool_calls": len(r.choices[0].message.tool_calls or [])}
    round_trip = messages + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    r = c.chat.completions.create(model=args.model, messages=round_trip, max_tokens=4, tools=tools)
    out["round_trip"] = {"finish_reason": r.choices[0].finish_reason}
    try:
        c.chat.completions.create(model=args.model, messages=messages, max_tokens=4, tool_choice="required")
        out["required"] = {"unexpected_success": True}
    except openai.APIStatusError as e:
        out["required"] = error_info(e)
    return out


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}}, "required": ["zone"]}}},
]


def scenario_structured(args):
    """Outputs a random model can only produce valid because they are enforced."""
    c = client(args)
    messages = [{"role": "user", "content": args.prompt[0]}]
    out = {}
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "strict": True, "schema": WEATHER_SCHEMA}}
    for thinking in (False, True):
        body = {"chat_template_kwargs": {"enable_thinking": thinking}, "thinking_token_budget": args.budget,
                "logit_bias": {str(t): -100 for t in args.ban}}
        r = c.chat.completions.create(
            model=args.model, messages=messages, max_tokens=args.max_tokens, temperature=1.0, seed=7,
            response_format=fmt, extra_body=body,
        )
        m = r.choices[0].message
        out[f"json_schema_thinking_{str(thinking).lower()}"] = {
            "content": m.content, "reasoning": extra(m, "reasoning_content"),
            "finish_reason": r.choices[0].finish_reason,
        }
    r = c.chat.completions.create(
        model=args.model, messages=messages, max_tokens=args.max_tokens, temperature=0,
        response_format={"type": "json_object"},
    )
    out["json_object"] = {"content": r.choices[0].message.content, "finish_reason": r.choices[0].finish_reason}
    calls = {}
    for name, choice in (("required", "required"),
                         ("named", {"type": "function", "function": {"name": "get_time"}})):
        r = c.chat.completions.create(
            model=args.model, messages=messages, max_tokens=4 * args.max_tokens, temperature=0,
            tools=TOOLS, tool_choice=choice,
        )
        m = r.choices[0].message
        calls[name] = {
            "finish_reason": r.choices[0].finish_reason,
            "content": m.content,
            "calls": [{"id": t.id, "type": t.type, "name": t.function.name, "arguments": t.function.arguments}
                      for t in (m.tool_calls or [])],
        }
    stream = c.chat.completions.create(
        model=args.model, messages=messages, max_tokens=4 * args.max_tokens, temperature=0,
        tools=TOOLS, tool_choice="required", stream=True,
    )
    streamed, finish, names = {}, None, {}
    for chunk in stream:
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for t in ch.delta.tool_calls or []:
                if t.function and t.function.name:
                    names[t.index] = names.get(t.index, "") + t.function.name
                if t.function and t.function.arguments:
                    streamed[t.index] = streamed.get(t.index, "") + t.function.arguments
    calls["required_stream"] = {
        "finish_reason": finish,
        "calls": [{"name": names.get(i), "arguments": streamed.get(i, "")} for i in sorted(names)],
    }
    out["tools"] = calls
    # Schema keywords a hand-written grammar easily drops: wide integer ranges,
    # minItems/maxItems, patterns, formats, a $ref, one call only.
    budget = {"type": "object", "$defs": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
              "properties": {"amount": {"type": "integer", "minimum": 0, "maximum": 100000},
                             "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                      "minItems": 1, "maxItems": 3},
                             "code": {"$ref": "#/$defs/code"},
                             "when": {"type": "string", "format": "date"}},
              "required": ["amount", "tags", "code", "when"], "additionalProperties": False}
    tools = TOOLS + [{"type": "function", "function": {"name": "set_budget", "parameters": budget}}]
    forced = {}
    for name, choice in (("named", {"type": "function", "function": {"name": "set_budget"}}),
                         ("required", "required")):
        r = c.chat.completions.create(
            model=args.model, messages=messages, max_tokens=4 * args.max_tokens, temperature=0,
            tools=tools, tool_choice=choice, parallel_tool_calls=False,
        )
        forced[name] = {
            "finish_reason": r.choices[0].finish_reason,
            "calls": [{"name": t.function.name, "arguments": t.function.arguments}
                      for t in (r.choices[0].message.tool_calls or [])],
        }
    out["schemas"] = {"tools": tools, "forced": forced}
    r = c.completions.create(
        model=args.model, prompt=args.prompt[0], max_tokens=args.max_tokens, temperature=0,
        extra_body={"guided_choice": ["alpha", "beta"]},
    )
    out["guided_choice"] = r.choices[0].text
    try:
        c.chat.completions.create(
            model=args.model, messages=messages, max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "u", "schema": {
                "type": "array", "uniqueItems": True}}},
        )
        out["uncompilable"] = {"unexpected_success": True}
    except openai.APIStatusError as e:
        out["uncompilable"] = error_info(e)
    return out


def without_ids(output):
    """Output items with their per-request ids removed, for comparing two runs."""
    items = []
    for item in output:
        item = dict(item)
        item.pop("id", None)
        item.pop("call_id", None)
        items.append(item)
    return items


def scenario_responses(args):
    """The Responses API whole, as raw stream events, and through the SDK's stream helper."""
    c = client(args)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
              "required": ["city"], "additionalProperties": False}
    cases = {
        "json_schema": {"input": args.prompt[0], "max_output_tokens": args.max_tokens,
                        "text": {"format": {"type": "json_schema", "name": "w", "schema": schema, "strict": True}}},
        "named_call": {"input": [{"role": "user", "content": [{"type": "input_text", "text": args.prompt[0]}]}],
                       "tools": [{"type": "function", "name": "get_time", "parameters": {
                           "type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
                           "required": ["zone"]}}],
                       "tool_choice": {"type": "function", "name": "get_time"},
                       "max_output_tokens": args.max_tokens},
        "thinking": {"input": args.prompt[0], "max_output_tokens": args.max_tokens,
                     "extra_body": {"chat_template_kwargs": {"enable_thinking": True},
                                    "thinking_token_budget": args.budget,
                                    "logit_bias": {str(t): -100 for t in args.ban}}},
    }
    out = {}
    for name, kw in cases.items():
        whole = c.responses.create(model=args.model, temperature=0, **kw)
        types, numbers, last = [], [], None
        for event in c.responses.create(model=args.model, temperature=0, stream=True, **kw):
            types.append(event.type)
            numbers.append(event.sequence_number)
            last = event
        with c.responses.stream(model=args.model, temperature=0, **kw) as s:
            ended = None
            for event in s:
                ended = event
            # The helper keeps a final response only for `response.completed`.
            helper = s.get_final_response() if ended.type == "response.completed" else ended.response
        out[name] = {
            "whole": {"status": whole.status, "output": [i.model_dump(exclude_none=True) for i in whole.output],
                      "usage": whole.usage.model_dump(exclude_none=True), "output_text": whole.output_text},
            "stream": {"types": types, "sequence_numbers": numbers, "status": last.response.status,
                       "output": [i.model_dump(exclude_none=True) for i in last.response.output],
                       "usage": last.response.usage.model_dump(exclude_none=True)},
            "helper": {"status": helper.status, "output": [i.model_dump(exclude_none=True) for i in helper.output]},
        }
        for part in out[name].values():
            part["output"] = without_ids(part["output"])
    return out


def data_uri(path, mime="image/png"):
    import base64

    with open(path, "rb") as f:
        return f"data:{mime};base64," + base64.b64encode(f.read()).decode()


def scenario_images(args):
    """A chat turn with images and videos as data URIs (and audio), whole and streamed, and bad media."""
    c = client(args)
    import base64

    content = [{"type": "text", "text": args.prompt[0]}] + [
        {"type": "image_url", "image_url": {"url": data_uri(path)}} for path in args.image
    ] + [
        {"type": "video_url", "video_url": {"url": data_uri(path, "image/gif")}} for path in args.video
    ]
    for path in args.audio:
        with open(path, "rb") as f:
            data = base64.b64encode(f.read()).decode()
        fmt = path.rsplit(".", 1)[-1].lower()
        content.append({"type": "input_audio", "input_audio": {"data": data, "format": fmt}})
    messages = [{"role": "user", "content": content}]
    r = c.chat.completions.create(
        model=args.model, messages=messages, max_tokens=args.max_tokens, temperature=0,
        extra_body=GREEDY_EXTRA,
    )
    stream = c.chat.completions.create(
        model=args.model, messages=messages, max_tokens=args.max_tokens, temperature=0,
        extra_body=GREEDY_EXTRA, stream=True, stream_options={"include_usage": True},
    )
    streamed, stream_usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            stream_usage = chunk.usage.model_dump()
        for ch in chunk.choices:
            if ch.delta.content:
                streamed.append(ch.delta.content)
    bad = {}
    cases = {
        "corrupt": "data:image/png;base64," + "iVBORw0KGgo" + "A" * 41,
        "not_base64": "data:image/png;base64,!!!",
        "not_an_image": "data:image/png;base64,aGVsbG8gd29ybGQ=",
        "remote": "https://example.com/cat.png",
    }
    for name, url in cases.items():
        try:
            c.chat.completions.create(
                model=args.model, max_tokens=1,
                messages=[{"role": "user", "content": [
                    {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]}],
            )
            bad[name] = {"status": 200}
        except openai.APIError as e:
            bad[name] = error_info(e)
    return {
        "text": r.choices[0].message.content,
        "finish_reason": r.choices[0].finish_reason,
        "usage": r.usage.model_dump(),
        "streamed": "".join(streamed),
        "stream_usage": stream_usage,
        "bad": bad,
    }


def scenario_scoring(args):
    """A prompt (token ids, JSON in --prompt) scored as evaluation harnesses
    score it: `echo` with `logprobs`, whole and streamed, with nothing or a
    few tokens generated; and vLLM's `prompt_logprobs`."""
    c = client(args)
    ids = json.loads(args.prompt[0])

    def whole(**kw):
        r = c.completions.create(model=args.model, prompt=ids, temperature=0, echo=True, logprobs=2, **kw)
        return r.model_dump()

    def streamed(**kw):
        text, finish = "", None
        lps = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        stream = c.completions.create(
            model=args.model, prompt=ids, temperature=0, echo=True, logprobs=2, stream=True, **kw
        )
        for chunk in stream:
            for ch in chunk.choices:
                text += ch.text or ""
                if ch.logprobs is not None:
                    for key in lps:
                        lps[key] += getattr(ch.logprobs, key) or []
                if ch.finish_reason:
                    finish = ch.finish_reason
        return {"text": text, "logprobs": lps, "finish_reason": finish}

    return {
        "prompt_only": whole(max_tokens=0),
        "prompt_only_stream": streamed(max_tokens=0),
        "with_tokens": whole(max_tokens=args.max_tokens),
        "with_tokens_stream": streamed(max_tokens=args.max_tokens),
        "vllm": whole(max_tokens=1, extra_body={"prompt_logprobs": 2}),
    }


SCENARIOS = {
    "scoring": scenario_scoring,
    "images": scenario_images,
    "responses": scenario_responses,
    "structured": scenario_structured,
    "protocol": scenario_protocol,
    "basic": scenario_basic,
    "concurrent": scenario_concurrent,
    "queue": scenario_queue,
    "timeout": scenario_timeout,
    "errors": scenario_errors,
    "auth": scenario_auth,
}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    p.add_argument("--model", default="", help="model id to send (empty: the served one)")
    p.add_argument("--api-key", default="")
    p.add_argument("--prompt", action="append", default=[], help="repeatable")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--image", action="append", default=[], help="PNG path, repeatable (images scenario)")
    p.add_argument("--video", action="append", default=[], help="animated GIF path, repeatable (images scenario)")
    p.add_argument("--audio", action="append", default=[], help="WAV, MP3 or FLAC path, repeatable (images scenario)")
    p.add_argument("--count", type=int, default=4, help="simultaneous requests (queue scenario)")
    p.add_argument("--wait-for-go", action="store_true", help="print `ready`, then wait for a line on stdin (queue scenario)")
    p.add_argument("--budget", type=int, default=12, help="thinking_token_budget (protocol scenario)")
    p.add_argument("--ban", type=int, action="append", default=[], help="token id to ban (protocol scenario)")
    args = p.parse_args()
    if not args.prompt:
        args.prompt = ["Hello world"]
    json.dump(SCENARIOS[args.scenario](args), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
