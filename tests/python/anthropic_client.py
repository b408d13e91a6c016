"""Drives the server's Anthropic Messages routes with the official `anthropic`
SDK and prints what the SDK parsed as one JSON object on stdout.

    python anthropic_client.py --base-url http://127.0.0.1:PORT --model M --scenario S \
        --prompt "Weather in Paris?" --max-tokens 40 [--ban ID ...] [--api-key K]

Every reply is parsed by the SDK's own types; a reply they reject raises.
"""

import argparse
import json

import anthropic


WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                     "required": ["city"]},
}
TIME = {
    "name": "get_time",
    "description": "The time in a zone.",
    "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
                     "required": ["zone"]},
}


def client(args, key=None):
    return anthropic.Anthropic(base_url=args.base_url, api_key=key or args.api_key or "none", max_retries=0)


def dump(message):
    return message.model_dump(mode="json", exclude_none=True)


def three_ways(c, kw):
    """The same request whole, as raw stream events, and through the stream helper."""
    whole = c.messages.create(**kw)
    types, last_delta = [], None
    for event in c.messages.create(stream=True, **kw):
        types.append(event.type)
        if event.type == "message_delta":
            last_delta = event
    with c.messages.stream(**kw) as s:
        for _ in s:
            pass
        helper = s.get_final_message()
    return {
        "whole": dump(whole),
        "stream": {"types": types, "stop_reason": last_delta.delta.stop_reason,
                   "output_tokens": last_delta.usage.output_tokens},
        "helper": dump(helper),
    }


def scenario_messages(args):
    c = client(args)
    user = [{"role": "user", "content": args.prompt}]
    base = {"model": args.model, "max_tokens": args.max_tokens, "messages": user,
            "extra_body": {"temperature": 0}}
    ban = {str(t): -100 for t in args.ban}
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
              "required": ["city"], "additionalProperties": False}
    cases = {
        "plain": dict(base, system=[{"type": "text", "text": "Answer briefly."}], stop_sequences=["\n\n\n"]),
        "json_schema": dict(base, output_config={"format": {"type": "json_schema", "schema": schema}}),
        "named_call": dict(base, tools=[WEATHER, TIME], tool_choice={"type": "tool", "name": "get_time"}),
        "any_call": dict(base, tools=[WEATHER, TIME],
                         tool_choice={"type": "any", "disable_parallel_tool_use": True}),
        "thinking": dict(base, thinking={"type": "enabled", "budget_tokens": args.budget},
                         extra_body={"temperature": 0, "logit_bias": ban}),
    }
    out = {name: three_ways(c, kw) for name, kw in cases.items()}
    # Greedy decoding writes the same text again, so a stop sequence taken
    # from the plain reply must end the second one there.
    plain = "".join(b["text"] for b in out["plain"]["whole"]["content"] if b["type"] == "text")
    stop = next((ch for ch in plain if ch.isascii() and ch.isalnum()), None)
    if stop:
        stopped = c.messages.create(**dict(cases["plain"], stop_sequences=[stop]))
        out["stopped"] = {"stop": stop, "plain": plain, "whole": dump(stopped)}
    out["count_tokens"] = c.messages.count_tokens(
        model=args.model, messages=user, system=[{"type": "text", "text": "Answer briefly."}],
    ).input_tokens
    return out


def scenario_round_trip(args):
    """A tool round trip as an agent runs it: the call, its result, the answer."""
    c = client(args)
    messages = [{"role": "user", "content": args.prompt}]
    first = c.messages.create(model=args.model, max_tokens=args.max_tokens, messages=messages,
                              tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True},
                              extra_body={"temperature": 0})
    calls = [b for b in first.content if b.type == "tool_use"]
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": b.id, "content": [{"type": "text", "text": "21 C, sunny"}]}
        for b in calls]})
    second = c.messages.create(model=args.model, max_tokens=args.max_tokens, messages=messages,
                               tools=[WEATHER], extra_body={"temperature": 0})
    counted = c.messages.count_tokens(model=args.model, messages=messages, tools=[WEATHER]).input_tokens
    return {"first": dump(first), "second": dump(second), "counted": counted}


def scenario_errors(args):
    """Bad requests and a wrong key, as the SDK's typed errors."""
    out = {}
    c = client(args)
    try:
        c.messages.create(model=args.model, max_tokens=8, messages=[{"role": "robot", "content": "x"}])
        out["bad_role"] = "accepted"
    except anthropic.BadRequestError as e:
        out["bad_role"] = {"status": e.status_code, "body": e.body}
    try:
        c.messages.create(model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "x"}])
        out["bad_model"] = "accepted"
    except anthropic.NotFoundError as e:
        out["bad_model"] = {"status": e.status_code, "body": e.body}
    if args.api_key:
        try:
            client(args, key="wrong").messages.create(
                model=args.model, max_tokens=8, messages=[{"role": "user", "content": "x"}])
            out["bad_key"] = "accepted"
        except anthropic.AuthenticationError as e:
            out["bad_key"] = {"status": e.status_code, "body": e.body}
    return out


def scenario_image(args):
    """A user turn of text and PNG images (base64 blocks), greedy."""
    import base64

    content = [{"type": "text", "text": args.prompt}]
    for path in args.image:
        with open(path, "rb") as f:
            data = base64.b64encode(f.read()).decode()
        content.append({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}})
    kw = {"model": args.model, "max_tokens": args.max_tokens, "messages": [{"role": "user", "content": content}],
          "extra_body": {"temperature": 0}}
    c = client(args)
    whole = c.messages.create(**kw)
    with c.messages.stream(**kw) as s:
        streamed = "".join(s.text_stream)
    counted = c.messages.count_tokens(model=args.model, messages=kw["messages"]).input_tokens
    return {"whole": dump(whole), "streamed": streamed, "counted": counted}


def scenario_agent(args):
    """The SDK's own agent loop (the beta tool runner) with two tools: it
    calls the model, runs each tool it asks for, and sends the results back."""
    from typing import Literal

    from anthropic import beta_tool

    called = []

    @beta_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city.

        Args:
            city: The city's name.
        """
        called.append(["get_weather", city])
        return "21 C, sunny"

    @beta_tool
    def get_time(zone: Literal["utc", "cet"]) -> str:
        """The time in a time zone.

        Args:
            zone: The zone's name.
        """
        called.append(["get_time", zone])
        return "12:00"

    runner = client(args).beta.messages.tool_runner(
        model=args.model, max_tokens=args.max_tokens, max_iterations=3, thread=False,
        messages=[{"role": "user", "content": args.prompt}], tools=[get_weather, get_time],
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 0})
    turns = [m.model_dump(mode="json", exclude_none=True) for m in runner]
    return {"turns": turns, "called": called}


# `--speculative-decoding`: the extension field as `extra_body` sends it (`on` leaves it out).
SPECULATIVE = {"on": {}, "off": {"speculative_decoding": False}, "bad": {"speculative_decoding": "no"}}


def scenario_one_turn(args):
    """One greedy turn, `--speculative-decoding` in `extra_body`; a 400 as the SDK's error."""
    extra = {"temperature": 0, **SPECULATIVE[args.speculative_decoding]}
    try:
        m = client(args).messages.create(model=args.model, max_tokens=args.max_tokens,
                                          messages=[{"role": "user", "content": args.prompt}],
                                          extra_body=extra)
    except anthropic.BadRequestError as e:
        return {"error": {"status": e.status_code, "body": e.body}}
    return {"text": "".join(b.text for b in m.content if b.type == "text"),
            "output_tokens": m.usage.output_tokens}


SCENARIOS = {"messages": scenario_messages, "agent": scenario_agent, "round_trip": scenario_round_trip, "errors": scenario_errors,
             "image": scenario_image, "one_turn": scenario_one_turn}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    p.add_argument("--prompt", default="Weather in Paris?")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--budget", type=int, default=12)
    p.add_argument("--ban", action="append", default=[])
    p.add_argument("--api-key")
    p.add_argument("--image", action="append", default=[], help="PNG path, repeatable (image scenario)")
    p.add_argument("--speculative-decoding", choices=sorted(SPECULATIVE), default="on",
                   help="one_turn scenario: drafting left on, turned off, or a value that is not a boolean")
    args = p.parse_args()
    print(json.dumps(SCENARIOS[args.scenario](args)))


if __name__ == "__main__":
    main()
