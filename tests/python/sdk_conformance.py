#!/usr/bin/env python3
"""Every reply and every streamed chunk or event, checked against the
official `openai` SDK's own types (generated from OpenAI's OpenAPI spec).

The requests go over plain HTTP, so nothing the SDK would smooth over is
hidden: each JSON object is validated with the SDK model for its kind
(`ChatCompletion`, `ChatCompletionChunk`, `Completion`, `Model`, `Response`
and the Responses stream events), and then for the fields the spec marks
required that the SDK leaves optional (listed in SPEC_REQUIRED). Prints
one JSON object: how many objects were checked and every problem found.

    python3 tests/python/sdk_conformance.py --base-url http://127.0.0.1:8000
"""

import argparse
import json
import typing
import urllib.request

import pydantic
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

# Each Responses stream event's own class, by its `type`.
EVENT_CLASSES = {
    typing.get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}

# Where the SDK is stricter than OpenAI's own servers: its `Completion`
# type, which it also uses for streamed chunks, types `finish_reason` as one
# of three strings, but a chunk before the last carries `null` (so do
# OpenAI's). Those errors, and only those, are not problems.
def sdk_stricter(kind, error):
    loc = error.get("loc", ())
    return kind == "completion chunk" and loc[-1:] == ("finish_reason",) and error.get("input") is None

# Where the SDK is looser than the spec: keys the spec requires (values may
# be null) that the SDK gives a default. Paths use `[]` for every element.
SPEC_REQUIRED = {
    "chat.completion": ["choices[].message.refusal", "choices[].logprobs"],
    "response": [
        "instructions",
        "metadata",
        "temperature",
        "top_p",
        "error",
        "incomplete_details",
        "output[].content[].logprobs",
    ],
}

TOOL = {
    "type": "function",
    "function": {
        "name": "set_volume",
        "description": "Set the volume",
        "parameters": {
            "type": "object",
            "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 10}},
            "required": ["level"],
            "additionalProperties": False,
        },
    },
}


class Checker:
    def __init__(self, base):
        self.base = base.rstrip("/")
        self.checked = 0
        self.problems = []

    def request(self, method, path, body=None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.base + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        return urllib.request.urlopen(req, timeout=120)

    def whole(self, path, body=None, method="POST"):
        with self.request(method, path, body) as r:
            return json.loads(r.read())

    def events(self, path, body):
        """The `data:` payloads of a stream (JSON decoded; `[DONE]` left out)."""
        out = []
        with self.request("POST", path, body) as r:
            for raw in r:
                line = raw.decode().rstrip("\r\n")
                if line.startswith("data: ") and line != "data: [DONE]":
                    out.append(json.loads(line[6:]))
        return out

    def validate(self, what, model, obj, required_key=None, kind=None):
        self.checked += 1
        if model is None:
            self.problems.append(f"{what}: no SDK type has this event type")
            return
        try:
            model.model_validate(obj)
        except pydantic.ValidationError as e:
            errors = [err for err in e.errors() if not sdk_stricter(kind, err)]
            if errors:
                self.problems.append(f"{what}: {errors[:3]}")
        for path in SPEC_REQUIRED.get(required_key or "", []):
            for missing in missing_keys(obj, path.split(".")):
                self.problems.append(f"{what}: the spec requires `{missing}`")


def missing_keys(obj, parts, at=""):
    """The paths, below `obj`, where the key `parts` leads to is absent."""
    if not parts:
        return []
    head, rest = parts[0], parts[1:]
    many = head.endswith("[]")
    key = head[:-2] if many else head
    if not isinstance(obj, dict) or key not in obj:
        return [f"{at}{key}"]
    value = obj[key]
    if not rest:
        return []
    if many:
        return [m for i, v in enumerate(value or []) for m in missing_keys(v, rest, f"{at}{key}[{i}].")]
    return [] if value is None else missing_keys(value, rest, f"{at}{key}.")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True, help="server root, without /v1")
    ap.add_argument("--max-tokens", type=int, default=6)
    a = ap.parse_args()
    c = Checker(a.base_url)
    n = a.max_tokens
    messages = [{"role": "user", "content": "Hello"}]
    forced = {"type": "function", "function": {"name": "set_volume"}}

    c.validate("GET /v1/models", Model, c.whole("/v1/models", method="GET")["data"][0])
    for extra in [{}, {"logprobs": True, "top_logprobs": 2}, {"tools": [TOOL], "tool_choice": forced}]:
        body = {"messages": messages, "max_tokens": n, **extra}
        c.validate(f"chat {sorted(extra)}", ChatCompletion, c.whole("/v1/chat/completions", body), "chat.completion")
        chunks = c.events("/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
        for i, chunk in enumerate(chunks):
            c.validate(f"chat chunk {i} {sorted(extra)}", ChatCompletionChunk, chunk)
    for extra in [{}, {"logprobs": 2}]:
        body = {"prompt": "Hello", "max_tokens": n, **extra}
        c.validate(f"completion {sorted(extra)}", Completion, c.whole("/v1/completions", body))
        for i, chunk in enumerate(c.events("/v1/completions", {**body, "stream": True})):
            c.validate(f"completion chunk {i} {sorted(extra)}", Completion, chunk, kind="completion chunk")
    responses_tool = {"type": "function", **TOOL["function"]}
    for extra in [
        {},
        {"instructions": "Be brief.", "temperature": 0, "metadata": {"k": "v"}},
        {"tools": [responses_tool], "tool_choice": {"type": "function", "name": "set_volume"}},
    ]:
        body = {"input": "Hello", "max_output_tokens": n, **extra}
        c.validate(f"response {sorted(extra)}", Response, c.whole("/v1/responses", body), "response")
        for i, event in enumerate(c.events("/v1/responses", {**body, "stream": True})):
            cls = EVENT_CLASSES.get(event.get("type"))
            c.validate(f"response event {i} {event.get('type')} {sorted(extra)}", cls, event)
            if isinstance(event.get("response"), dict):
                c.validate(f"response of event {i} {event.get('type')}", Response, event["response"], "response")
    print(json.dumps({"checked": c.checked, "problems": c.problems}))


if __name__ == "__main__":
    main()
