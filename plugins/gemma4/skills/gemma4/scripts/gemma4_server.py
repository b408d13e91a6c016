#!/usr/bin/env python3
"""Start, check, ask, benchmark and stop a local gemma4 server.

    gemma4_server.py start [--model PATH] [--port N] [-- SERVE ARGS...]
    gemma4_server.py health
    gemma4_server.py chat "PROMPT" [--max-tokens N] [--complete]
    gemma4_server.py bench [--requests N] [--concurrency LIST]
    gemma4_server.py stop

The server's process id, address and log live in $GEMMA4_SKILL_STATE
(default ~/.cache/gemma4/skill). The binary is $GEMMA4_BIN, else `gemma4`
on PATH. An API key in $GEMMA4_API_KEY is passed to the server and sent by
every command. Needs only python3's standard library.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

STATE = Path(os.environ.get("GEMMA4_SKILL_STATE", Path.home() / ".cache" / "gemma4" / "skill"))


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


def binary():
    path = os.environ.get("GEMMA4_BIN") or shutil.which("gemma4")
    if not path:
        fail("no gemma4 binary: put it on PATH or set GEMMA4_BIN (cargo build --release -p gemma4-cli)")
    return path


def saved():
    try:
        return json.loads((STATE / "server.json").read_text())
    except (OSError, ValueError):
        fail(f"no server started by this skill (nothing in {STATE}); run `start` first")


def call(url, body=None, timeout=600):
    headers = {"Content-Type": "application/json"}
    if os.environ.get("GEMMA4_API_KEY"):
        headers["Authorization"] = "Bearer " + os.environ["GEMMA4_API_KEY"]
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def start(args):
    STATE.mkdir(parents=True, exist_ok=True)
    if (STATE / "server.json").exists() and alive(saved()["pid"]):
        fail(f"a server is already running at {saved()['url']}; `stop` it first")
    command = [binary(), "serve", "--host", "127.0.0.1", "--port", str(args.port)]
    if args.model:
        command += ["--model", args.model]
    command += args.serve_args
    log_path = STATE / "server.log"
    log = open(log_path, "w")
    process = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + args.timeout
    url = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            fail(f"the server exited ({process.returncode}):\n{log_path.read_text()[-2000:]}")
        if url is None:
            m = re.search(r"listening on (http://\S+)", log_path.read_text())
            url = m.group(1) if m else None
        if url is not None:
            try:
                if call(url + "/ready", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
        time.sleep(0.2)
    else:
        process.terminate()
        fail(f"the server was not ready within {args.timeout} s; see {log_path}")
    (STATE / "server.json").write_text(json.dumps({"pid": process.pid, "url": url, "log": str(log_path)}))
    print(url)


def health(_args):
    server = saved()
    if not alive(server["pid"]):
        fail(f"the server (pid {server['pid']}) is not running; see {server['log']}")
    status, body = call(server["url"] + "/ready", timeout=10)
    ready = json.loads(body)
    _, models = call(server["url"] + "/v1/models", timeout=10)
    _, metrics = call(server["url"] + "/metrics", timeout=10)
    gauges = {}
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]:
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", metrics, re.M)
        gauges[name.split(":")[1]] = float(m.group(1)) if m else None
    print(json.dumps({"url": server["url"], "status": ready.get("status"), "ready": status == 200,
                      "models": [m["id"] for m in json.loads(models).get("data", [])], **gauges}))
    sys.exit(0 if status == 200 else 1)


def chat(args):
    server = saved()
    model = json.loads(call(server["url"] + "/v1/models", timeout=10)[1])["data"][0]["id"]
    if args.complete:
        body = {"model": model, "prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0}
        status, reply = call(server["url"] + "/v1/completions", body)
        text = lambda r: r["choices"][0]["text"]
    else:
        body = {"model": model, "messages": [{"role": "user", "content": args.prompt}],
                "max_tokens": args.max_tokens}
        status, reply = call(server["url"] + "/v1/chat/completions", body)
        text = lambda r: r["choices"][0]["message"]["content"]
    if status != 200:
        fail(f"{status}: {reply}")
    print(text(json.loads(reply)))


def bench(args):
    server = saved()
    model = json.loads(call(server["url"] + "/v1/models", timeout=10)[1])["data"][0]["id"]
    out = STATE / "bench.json"
    command = [binary(), "bench", "serve", "--url", server["url"], "--model", model,
               "--concurrency", args.concurrency, "--num-prompts", str(args.requests),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len),
               "--warmup", "1", "--no-progress", "--out", str(out)]
    if os.environ.get("GEMMA4_API_KEY"):
        command += ["--api-key", os.environ["GEMMA4_API_KEY"]]
    subprocess.run(command, check=True)
    print(out)


def stop(args):
    server = saved()
    if alive(server["pid"]):
        os.kill(server["pid"], signal.SIGTERM)
        deadline = time.monotonic() + args.timeout
        while alive(server["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive(server["pid"]):
            os.kill(server["pid"], signal.SIGKILL)
            print("the server did not drain in time; killed it", file=sys.stderr)
    (STATE / "server.json").unlink()
    print("stopped")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("start", help="start a server and wait until it is ready")
    p.add_argument("--model", help="checkpoint folder or GGUF file (default: the demo model)")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--timeout", type=float, default=300, help="seconds to wait for readiness")
    p.add_argument("serve_args", nargs="*", help="more `gemma4 serve` arguments, after --")
    p.set_defaults(run=start)
    commands.add_parser("health", help="readiness, models and load").set_defaults(run=health)
    p = commands.add_parser("chat", help="ask the model")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--complete", action="store_true", help="continue the text (models without a chat template)")
    p.set_defaults(run=chat)
    p = commands.add_parser("bench", help="a short load test; prints the report's path")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.set_defaults(run=bench)
    p = commands.add_parser("stop", help="drain and stop the server")
    p.add_argument("--timeout", type=float, default=60)
    p.set_defaults(run=stop)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
