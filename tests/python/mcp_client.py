"""The official MCP Python SDK against gemma4's MCP server.

Usage: mcp_client.py stdio|http TARGET MODE [EXTRA]
       mcp_client.py config MCP_JSON BINARY
  config: starts the `gemma4` server an `.mcp.json` names, with this
         process's environment (as an agent host does) and GEMMA4_BIN=BINARY,
         and lists its tools and models.
  stdio: TARGET is the gemma4 binary, started as
         `gemma4 mcp --model $GEMMA4_DEMO_GGUF --chat-template EXTRA`.
  http:  TARGET is the server's /mcp URL; EXTRA, when given, is the API key:
         calls send it as a bearer token, and a client without it must be
         refused (401).
  MODE:  `legacy` (the initialize handshake, 2025-11-25) or `2026-07-28`.

Checks: the tool list, a `chat` call with a progress token (the progress
messages spell the reply), `complete` (the demo model says Paris), a malformed argument (an
`isError` result naming it), `count_tokens`, and a long call cancelled by
the client (`server_status` shows nothing running afterwards). Prints one
JSON line with what it saw; exits non-zero on the first failed check.
"""

import json
import os
import sys
import time

import anyio
import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

TOOLS = ["chat", "complete", "count_tokens", "list_models", "server_status"]


def check(ok, what):
    if not ok:
        raise SystemExit(f"FAILED: {what}")


def text_of(result):
    return "".join(getattr(c, "text", "") for c in result.content)


async def status(client):
    result = await client.call_tool("server_status", {})
    check(not result.is_error, f"server_status failed: {text_of(result)}")
    return result.structured_content


async def chat_with_progress(client, seen):
    messages = []

    async def on_progress(progress, total, message):
        if message:
            messages.append(message)

    result = await client.call_tool(
        "chat",
        {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24,
            "temperature": 0,
        },
        progress_callback=on_progress,
    )
    check(not result.is_error, f"chat failed: {text_of(result)}")
    reply = result.structured_content
    check(reply["text"].strip(), "an empty reply")
    check(text_of(result) == reply["text"], "the text content differs from structuredContent.text")
    check(messages, "no progress notification carried text")
    check("".join(messages) == reply["text"], f"progress spelled {''.join(messages)!r}, the reply is {reply['text']!r}")
    check(reply["usage"]["output_tokens"] >= 1, "no output tokens counted")
    seen["reply"] = reply["text"]
    seen["progress_messages"] = len(messages)


async def complete(client, seen):
    result = await client.call_tool(
        "complete", {"prompt": "Q: What is the capital of France?\nA:", "max_tokens": 8, "temperature": 0}
    )
    check(not result.is_error, f"complete failed: {text_of(result)}")
    text = result.structured_content["text"]
    check("Paris" in text, f"the completion names no Paris: {text!r}")
    seen["completion"] = text


async def bad_argument(client, seen):
    result = await client.call_tool(
        "chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}
    )
    check(result.is_error, "a malformed max_tokens was accepted")
    check("max_tokens" in text_of(result), f"the error names no max_tokens: {text_of(result)!r}")
    result = await client.call_tool(
        "chat", {"messages": [{"role": "user", "content": "hi"}], "json_schema": {"type": 5}}
    )
    check(result.is_error, "a schema whose type is 5 was accepted")
    check("json_schema" in text_of(result), f"the error names no json_schema: {text_of(result)!r}")
    result = await client.call_tool("complete", {"prompt": 7})
    check(result.is_error and "prompt" in text_of(result), f"a numeric prompt: {text_of(result)!r}")
    seen["bad_argument"] = text_of(result)


async def count(client, seen):
    result = await client.call_tool("count_tokens", {"text": "The capital of France is"})
    check(not result.is_error, f"count_tokens failed: {text_of(result)}")
    tokens = result.structured_content["tokens"]
    check(2 <= tokens <= 16, f"{tokens} tokens for a five-word text")
    chat = await client.call_tool(
        "count_tokens", {"messages": [{"role": "user", "content": "The capital of France is"}]}
    )
    check(chat.structured_content["tokens"] > tokens, "the chat template added no tokens")
    models = await client.call_tool("list_models", {})
    check(models.structured_content["models"][0]["max_model_len"] > 0, "list_models has no context length")
    seen["tokens"] = tokens


async def cancel_long_call(client, seen):
    started = anyio.Event()

    async def on_progress(progress, total, message):
        started.set()

    async def long_call():
        await client.call_tool(
            "complete",
            # Greedy, the demo model runs this to the token limit.
            {"prompt": "Count from one to one thousand in words: one, two, three,", "max_tokens": 3000,
             "temperature": 0},
            progress_callback=on_progress,
        )

    async with anyio.create_task_group() as group:
        group.start_soon(long_call)
        with anyio.fail_after(60):
            await started.wait()
        # The engine publishes its counts after each step: wait for the step.
        deadline = time.monotonic() + 30
        while (now := await status(client))["running"] != 1:
            check(time.monotonic() < deadline, f"the long call is not running: {now}")
            await anyio.sleep(0.02)
        group.cancel_scope.cancel()
    deadline = time.monotonic() + 10
    while True:
        now = await status(client)
        if now["running"] == 0 and now["waiting"] == 0:
            break
        check(time.monotonic() < deadline, f"the cancelled call still runs: {now}")
        await anyio.sleep(0.05)
    seen["cancelled_in_s"] = round(10 - (deadline - time.monotonic()), 2)


async def main(kind, target, mode, extra=None):
    if kind == "stdio":
        server = StdioServerParameters(
            command=target,
            args=["mcp", "--model", os.environ["GEMMA4_DEMO_GGUF"], "--served-model-name", "demo",
                  "--chat-template", extra],
        )
    elif extra:
        headers = {"Authorization": f"Bearer {extra}"}
        server = streamable_http_client(target, http_client=httpx2.AsyncClient(headers=headers, timeout=120))
        async with httpx2.AsyncClient() as anonymous:
            refused = await anonymous.post(target, json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
            check(refused.status_code == 401, f"a call without the key got {refused.status_code}")
    else:
        server = target
    seen = {"transport": kind, "mode": mode}
    async with Client(server, mode=mode) as client:
        seen["protocol_version"] = client.protocol_version
        tools = [t.name for t in (await client.list_tools()).tools]
        check(tools == TOOLS, f"tools are {tools}")
        # The model may still be loading (stdio starts it now).
        deadline = time.monotonic() + 120
        while (await status(client))["status"] != "ready":
            check(time.monotonic() < deadline, "the model did not load within 120 s")
            await anyio.sleep(0.2)
        await chat_with_progress(client, seen)
        await complete(client, seen)
        await bad_argument(client, seen)
        await count(client, seen)
        await cancel_long_call(client, seen)
    print(json.dumps(seen))


async def from_config(path, binary):
    entry = json.load(open(path))["mcpServers"]["gemma4"]
    env = {**os.environ, "GEMMA4_BIN": binary, **entry.get("env", {})}
    server = StdioServerParameters(command=entry["command"], args=entry.get("args", []), env=env)
    async with Client(server) as client:
        tools = [t.name for t in (await client.list_tools()).tools]
        check(tools == TOOLS, f"tools are {tools}")
        models = (await client.call_tool("list_models", {})).structured_content["models"]
    print(json.dumps({"tools": tools, "model": models[0]["id"]}))


if __name__ == "__main__":
    if sys.argv[1] == "config":
        anyio.run(from_config, sys.argv[2], sys.argv[3])
    else:
        anyio.run(main, *sys.argv[1:5])
