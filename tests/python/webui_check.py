"""The chat page in a real browser: Debian's chromium driven by Playwright.

Usage: webui_check.py BASE_URL API_KEY [CHROMIUM]
       webui_check.py attach BASE_URL CHROMIUM FILE...

The server must run with `--api-key API_KEY` and a long `--default-max-tokens`.
Checks, in one tab: the page asks for the key and then names the model; a
prompt typed and sent streams a reply (its text seen growing in several
steps); Stop ends a long reply (the text stops growing, the server counts
the request cancelled); and, with the server's reply replaced by a stream
carrying markup, reasoning and a tool call, the markup renders as text (no
element, no script run), markdown as elements, the reasoning collapsed and
the call shown. Prints one JSON line; exits non-zero on the first failure.

`attach` (a server whose model has image and audio encoders, no key): the
page offers attachments, and the files sent with a prompt reach the server
as `image_url` and `input_audio` parts of one user message, which it answers.
"""

import json
import re
import sys
import time
import urllib.request

from playwright.sync_api import sync_playwright

HOSTILE = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>'


def check(ok, what):
    if not ok:
        raise SystemExit(f"FAILED: {what}")


def cancelled_requests(base):
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    m = re.search(r'gemma4_requests_finished_total\{reason="cancelled"\} (\d+)', text)
    return int(m.group(1)) if m else 0


def last_reply_text(page):
    return page.locator(".message.assistant").last.locator(".content").text_content()


def send(page, text):
    page.fill("#prompt", text)
    page.click("#send")


def streamed_reply(page, seen):
    # Every distinct text the reply shows while it streams.
    page.evaluate("""() => {
        window.snapshots = [];
        new MutationObserver(() => {
            const all = document.querySelectorAll('.message.assistant .content');
            const text = all.length ? all[all.length - 1].textContent : '';
            if (text && window.snapshots[window.snapshots.length - 1] !== text) window.snapshots.push(text);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")
    send(page, "What is the capital of France?")
    page.wait_for_selector("#stop:enabled", timeout=10000)
    page.wait_for_selector("#stop:disabled", timeout=120000)
    snapshots = page.evaluate("window.snapshots")
    final = last_reply_text(page)
    check(final.strip(), "the reply is empty")
    check(len(snapshots) >= 2, f"the reply did not stream: {snapshots}")
    check(all(final.startswith(s) for s in snapshots), "the reply's text was rewritten as it streamed")
    check(page.locator(".message.user").first.inner_text() == "What is the capital of France?", "the prompt is not shown")
    seen["streamed_steps"] = len(snapshots)


def stop_long_reply(page, base, seen):
    before = cancelled_requests(base)
    page.click("#clear")
    send(page, "Count from one to one thousand in words: one, two, three,")
    page.wait_for_function(
        "document.querySelector('.message.assistant .content') && "
        "document.querySelector('.message.assistant .content').textContent.length > 20",
        timeout=60000,
    )
    page.click("#stop")
    page.wait_for_selector("#stop:disabled", timeout=5000)
    stopped = last_reply_text(page)
    time.sleep(1.0)
    check(last_reply_text(page) == stopped, "the reply kept growing after Stop")
    status = page.locator(".message.assistant .status").last.inner_text()
    check("stopped" in status, f"the reply does not say it was stopped: {status!r}")
    deadline = time.monotonic() + 10
    while cancelled_requests(base) <= before:
        check(time.monotonic() < deadline, "the server never counted the stopped request as cancelled")
        time.sleep(0.05)
    seen["stopped_after_chars"] = len(stopped)


def hostile_reply(page, seen):
    chunks = [
        {"reasoning_content": "Thinking about <b>tags</b>."},
        {"content": "Here: " + HOSTILE + "\n\n**bold** and `code`\n\n- one\n- two"},
        {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                         "function": {"name": "lookup", "arguments": '{"q": "<i>x</i>"}'}}]},
    ]
    body = "".join(
        "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                               "choices": [{"index": 0, "delta": d, "finish_reason": None}]}) + "\n\n"
        for d in chunks
    )
    body += "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                   "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}) + "\n\n"
    body += "data: [DONE]\n\n"
    page.route("**/v1/chat/completions",
               lambda route: route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=body))
    page.click("#clear")
    send(page, "Say something risky")
    page.wait_for_selector(".message.assistant .tool-call", timeout=10000)
    page.wait_for_selector("#stop:disabled", timeout=10000)
    reply = page.locator(".message.assistant").last
    check(HOSTILE in reply.locator(".content").text_content(), "the markup is not shown as text")
    check(reply.locator("img, script, b, i").count() == 0, "the model's markup became elements")
    check(page.evaluate("window.pwned") is None, "the model's script ran")
    check(reply.locator("strong").inner_text() == "bold", "markdown bold is not rendered")
    check(reply.locator("code").inner_text() == "code", "markdown code is not rendered")
    check(reply.locator("li").count() == 2, "the markdown list is not rendered")
    details = reply.locator("details.reasoning")
    check(details.count() == 1 and details.get_attribute("open") is None, "the reasoning is not collapsed")
    check("<b>tags</b>" in details.locator("div").text_content(), "the reasoning is not kept as text")
    check("lookup(" in reply.locator(".tool-call").inner_text(), "the tool call is not shown")
    page.unroute("**/v1/chat/completions")
    seen["hostile"] = "rendered as text"


def main(base, key, chromium="/usr/bin/chromium"):
    seen = {}
    with sync_playwright() as p:
        policy = urllib.request.urlopen(base + "/", timeout=10).headers["Content-Security-Policy"]
        check(policy and "script-src 'self'" in policy, f"the page has no script policy: {policy!r}")
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        # The page's policy forbids eval, which Playwright's waits use; the
        # renderer alone must keep the model's markup inert (checked below).
        page = browser.new_context(bypass_csp=True).new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(base + "/")
        page.wait_for_selector("#api-key", state="visible", timeout=10000)
        page.fill("#api-key", key)
        page.click("#save-key")
        page.wait_for_selector("#send:enabled", timeout=30000)
        # Greedy: the demo model's replies to both prompts run to the token limit.
        page.fill("#temperature", "0")
        seen["model"] = page.inner_text("#model")
        check(page.locator("#attach-label").is_hidden(), "attachments offered by a model without encoders")
        streamed_reply(page, seen)
        stop_long_reply(page, base, seen)
        hostile_reply(page, seen)
        check(page.evaluate("sessionStorage.getItem('gemma4-api-key')") == key, "the key is not in session storage")
        check(not errors, f"the page threw: {errors}")
        browser.close()
    print(json.dumps(seen))


def attach(base, chromium, *files):
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        page = browser.new_context(bypass_csp=True).new_page()
        sent = []
        page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
        page.goto(base + "/")
        page.wait_for_selector("#send:enabled", timeout=30000)
        check(page.locator("#attach-label").is_visible(), "no attachments offered by a model with encoders")
        page.set_input_files("#attach", list(files))
        page.fill("#temperature", "0")
        send(page, "What is in these?")
        page.wait_for_selector("#stop:enabled", timeout=10000)
        page.wait_for_selector("#stop:disabled", timeout=120000)
        reply = page.locator(".message.assistant").last
        check("error" not in (reply.get_attribute("class") or ""), f"the reply failed: {reply.inner_text()}")
        parts = sent[-1]["messages"][-1]["content"]
        kinds = [part["type"] for part in parts]
        check(kinds == ["text", "image_url", "input_audio"], f"the message's parts are {kinds}")
        check(parts[1]["image_url"]["url"].startswith("data:image/png;base64,"), "the image is not a data URI")
        check(parts[2]["input_audio"]["format"] == "wav", "the audio's format is not wav")
        browser.close()
    print(json.dumps({"parts": kinds}))


if __name__ == "__main__":
    if sys.argv[1] == "attach":
        attach(*sys.argv[2:])
    else:
        main(*sys.argv[1:4])
