// The chat page: streams replies from /v1/chat/completions. Model output
// only ever reaches the page as text nodes (the markdown renderer builds
// elements itself), so no HTML or script the model writes can run.
"use strict";

const KEY_STORE = "gemma4-api-key";
const $ = (id) => document.getElementById(id);
const state = {
  key: sessionStorage.getItem(KEY_STORE) || "",
  info: null,
  history: [],
  attachments: [],
  controller: null,
};

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function notice(text) {
  $("notice").textContent = text || "";
  $("notice").hidden = !text;
}

// The message of an error reply in any of the server's shapes.
async function errorText(response) {
  const body = await response.text();
  try {
    const parsed = JSON.parse(body);
    const e = parsed.error;
    return (e && (e.message || e)) || body;
  } catch (_) {
    return body || response.status + " " + response.statusText;
  }
}

async function loadInfo() {
  let response;
  try {
    response = await fetch("/webui/info", { headers: headers() });
  } catch (e) {
    notice("Cannot reach the server: " + e);
    return;
  }
  if (response.status === 401) {
    $("key-form").hidden = false;
    $("model").textContent = "needs an API key";
    $("api-key").focus();
    return;
  }
  if (!response.ok) {
    notice(await errorText(response));
    setTimeout(loadInfo, 2000);
    return;
  }
  const info = await response.json();
  state.info = info;
  $("key-form").hidden = true;
  $("model").textContent = info.model;
  const kinds = [];
  if (info.images) kinds.push("image/*");
  if (info.audio) kinds.push("audio/wav", "audio/x-wav", "audio/mpeg", "audio/flac");
  $("attach").accept = kinds.join(",");
  $("attach-label").hidden = kinds.length === 0;
  $("think-label").hidden = !info.thinking;
  notice(info.chat ? "" : "This model has no chat template: start the server with --chat-template FILE to chat with it.");
  setBusy(false);
}

function setBusy(busy) {
  $("send").disabled = busy || !state.info || !state.info.chat;
  $("stop").disabled = !busy;
}

// --- Markdown, built as elements (never parsed as HTML) ---

const INLINE = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\n]+\*|_[^_\n]+_)|(\[[^\]\n]+\]\([^)\s]+\))/;

function safeLink(url) {
  try {
    const parsed = new URL(url, location.href);
    return parsed.protocol === "http:" || parsed.protocol === "https:" ? parsed.href : null;
  } catch (_) {
    return null;
  }
}

function appendInline(parent, text) {
  while (text) {
    const m = INLINE.exec(text);
    if (!m) {
      parent.appendChild(document.createTextNode(text));
      return;
    }
    if (m.index > 0) parent.appendChild(document.createTextNode(text.slice(0, m.index)));
    const token = m[0];
    if (m[1]) parent.appendChild(el("code", "", token.slice(1, -1)));
    else if (m[2]) appendInline(parent.appendChild(el("strong")), token.slice(2, -2));
    else if (m[3]) appendInline(parent.appendChild(el("em")), token.slice(1, -1));
    else {
      const split = token.indexOf("](");
      const href = safeLink(token.slice(split + 2, -1));
      const label = token.slice(1, split);
      if (href) {
        const a = el("a", "", label);
        a.href = href;
        a.rel = "noopener noreferrer";
        a.target = "_blank";
        parent.appendChild(a);
      } else parent.appendChild(document.createTextNode(token));
    }
    text = text.slice(m.index + token.length);
  }
}

function appendLines(parent, lines) {
  lines.forEach((line, i) => {
    if (i > 0) parent.appendChild(el("br"));
    appendInline(parent, line);
  });
}

function renderMarkdown(container, text) {
  container.replaceChildren();
  const lines = text.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (line.startsWith("```")) {
      const code = [];
      for (i++; i < lines.length && !lines[i].startsWith("```"); i++) code.push(lines[i]);
      i++;
      container.appendChild(el("pre")).appendChild(el("code", "", code.join("\n")));
      continue;
    }
    const heading = /^(#{1,6})\s+(.*)$/.exec(line);
    if (heading) {
      appendInline(container.appendChild(el("h" + Math.min(6, heading[1].length + 2))), heading[2]);
      i++;
      continue;
    }
    const item = /^\s*([-*]|\d+[.)])\s+/;
    if (item.test(line)) {
      const ordered = /\d/.test(item.exec(line)[1]);
      const list = container.appendChild(el(ordered ? "ol" : "ul"));
      for (; i < lines.length && item.test(lines[i]); i++) {
        appendInline(list.appendChild(el("li")), lines[i].replace(item, ""));
      }
      continue;
    }
    if (!line.trim()) {
      i++;
      continue;
    }
    const paragraph = [];
    for (; i < lines.length && lines[i].trim() && !lines[i].startsWith("```") && !item.test(lines[i]); i++) {
      paragraph.push(lines[i]);
    }
    appendLines(container.appendChild(el("p")), paragraph);
  }
}

// --- Messages ---

function addUserMessage(text, names) {
  const node = el("div", "message user", text);
  if (names.length) node.appendChild(el("div", "status", "attached: " + names.join(", ")));
  $("messages").appendChild(node);
}

// An assistant reply as it streams in.
class Reply {
  constructor() {
    this.node = $("messages").appendChild(el("div", "message assistant"));
    this.reasoningBox = el("details", "reasoning");
    this.reasoningBox.appendChild(el("summary", "", "Thinking"));
    this.reasoningText = this.reasoningBox.appendChild(el("div"));
    this.reasoningBox.hidden = true;
    this.node.appendChild(this.reasoningBox);
    this.body = this.node.appendChild(el("div", "content"));
    this.calls = this.node.appendChild(el("div", "tool-calls"));
    this.status = this.node.appendChild(el("div", "status", "…"));
    this.content = "";
    this.reasoning = "";
    this.toolCalls = [];
    this.pending = false;
  }

  addReasoning(text) {
    this.reasoning += text;
    this.reasoningBox.hidden = false;
    this.reasoningText.textContent = this.reasoning;
  }

  addContent(text) {
    this.content += text;
    if (!this.pending) {
      this.pending = true;
      requestAnimationFrame(() => {
        this.pending = false;
        renderMarkdown(this.body, this.content);
      });
    }
  }

  addToolCall(delta) {
    const call = (this.toolCalls[delta.index || 0] ||= { id: "", name: "", arguments: "" });
    if (delta.id) call.id = delta.id;
    if (delta.function && delta.function.name) call.name += delta.function.name;
    if (delta.function && delta.function.arguments) call.arguments += delta.function.arguments;
    this.calls.replaceChildren(...this.toolCalls.map((c) => el("div", "tool-call", c.name + "(" + c.arguments + ")")));
  }

  end(status) {
    renderMarkdown(this.body, this.content);
    this.status.textContent = status;
  }

  fail(message) {
    this.node.classList.add("error");
    this.end(message);
  }

  asMessage() {
    const message = { role: "assistant", content: this.content };
    if (this.toolCalls.length) {
      message.tool_calls = this.toolCalls.map((c) => ({
        id: c.id, type: "function", function: { name: c.name, arguments: c.arguments },
      }));
    }
    return message;
  }
}

// Reads an OpenAI chat stream into the reply; returns the finish reason.
async function readStream(response, reply) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let finish = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return finish;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return finish;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "the server ended the reply");
        const choice = (chunk.choices || [])[0];
        if (!choice) continue;
        const delta = choice.delta || {};
        if (delta.reasoning_content) reply.addReasoning(delta.reasoning_content);
        if (delta.content) reply.addContent(delta.content);
        for (const call of delta.tool_calls || []) reply.addToolCall(call);
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
  }
}

async function userContent(text) {
  if (!state.attachments.length) return text;
  const parts = text ? [{ type: "text", text }] : [];
  for (const file of state.attachments) {
    const url = await new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
    if (file.type.startsWith("image/")) {
      parts.push({ type: "image_url", image_url: { url } });
    } else {
      const format = file.type.includes("mpeg") ? "mp3" : file.type.includes("flac") ? "flac" : "wav";
      parts.push({ type: "input_audio", input_audio: { data: url.slice(url.indexOf(",") + 1), format } });
    }
  }
  return parts;
}

async function send() {
  const text = $("prompt").value.trim();
  if ((!text && !state.attachments.length) || state.controller) return;
  const names = state.attachments.map((f) => f.name);
  let content;
  try {
    content = await userContent(text);
  } catch (e) {
    notice("Cannot read the attachment: " + e);
    return;
  }
  state.history.push({ role: "user", content });
  addUserMessage(text, names);
  $("prompt").value = "";
  state.attachments = [];
  $("attach").value = "";
  $("attachments").replaceChildren();
  const reply = new Reply();
  const body = { model: state.info.model, messages: state.history, stream: true };
  if ($("think").checked) body.chat_template_kwargs = { enable_thinking: true };
  const temperature = $("temperature").value.trim();
  if (temperature !== "") body.temperature = Number(temperature);
  state.controller = new AbortController();
  setBusy(true);
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (!response.ok) {
      state.history.pop();
      reply.fail(await errorText(response));
      return;
    }
    const finish = await readStream(response, reply);
    state.history.push(reply.asMessage());
    reply.end(finish === "length" ? "(cut off: the token limit was reached)" : "");
  } catch (e) {
    if (e.name === "AbortError") {
      state.history.push(reply.asMessage());
      reply.end("(stopped)");
    } else {
      reply.fail(String(e.message || e));
    }
  } finally {
    state.controller = null;
    setBusy(false);
    $("messages").scrollTop = $("messages").scrollHeight;
  }
}

$("compose").addEventListener("submit", (e) => {
  e.preventDefault();
  send();
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    send();
  }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.history = [];
  $("messages").replaceChildren();
});
$("attach").addEventListener("change", () => {
  state.attachments = Array.from($("attach").files);
  $("attachments").replaceChildren(...state.attachments.map((f) => el("span", "", f.name)));
});
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  state.key = $("api-key").value.trim();
  sessionStorage.setItem(KEY_STORE, state.key);
  loadInfo();
});
loadInfo();
