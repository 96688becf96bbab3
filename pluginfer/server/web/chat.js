// The chat page: streams /v1/chat/completions (server-sent events) into the conversation.
"use strict";

const KEY_STORAGE = "pluginfer.apiKey";
const $ = (id) => document.getElementById(id);
const state = { history: [], controller: null, model: null, modelsAsked: 0, empty: null, keyTimer: 0, image: null };
// The settings fields and the /v1/models sampling_defaults entry each shows as its placeholder.
const SAMPLING_FIELDS = [["temperature", "temperature"], ["top_p", "top-p"], ["max_tokens", "max-tokens"]];

function requestHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (_) {
    return response.statusText;
  }
}

function showError(text, status) {
  $("error").textContent = status ? `${status}: ${text}` : text;
  $("error").hidden = false;
  if (status === 401) askForKey();
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

function showSettings(show) {
  $("settings").hidden = !show;
  $("toggle-settings").setAttribute("aria-expanded", String(show));
}

function askForKey() {
  showSettings(true);
  $("api-key-box").classList.add("needed");
  $("api-key").focus();
}

function saveKeyChoice() {
  if ($("remember-key").checked && $("api-key").value.trim()) {
    localStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
  } else {
    localStorage.removeItem(KEY_STORAGE);
  }
}

// Empty fields are not sent: the placeholders show what the server then applies.
function showDefaults(defaults) {
  if (!defaults) return;
  for (const [field, id] of SAMPLING_FIELDS) {
    if (defaults[field] !== undefined && defaults[field] !== null) $(id).placeholder = String(defaults[field]);
  }
  const shown = Object.entries(defaults).map(([name, value]) => `${name} ${value}`).join(", ");
  $("defaults").textContent = `Empty fields take the server's defaults: ${shown}.`;
}

async function loadModel() {
  const asked = ++state.modelsAsked;  // only the answer to the latest key counts
  try {
    const response = await fetch("v1/models", { headers: requestHeaders() });
    if (asked !== state.modelsAsked) return;
    if (!response.ok) {
      $("model").textContent = "";
      $("empty-key").hidden = response.status !== 401;
      showError(await errorText(response), response.status);
      return;
    }
    const models = (await response.json()).data || [];
    if (asked !== state.modelsAsked) return;
    if (models.length) {
      state.model = models[0].id;
      $("model").textContent = `${models[0].id} · context ${models[0].max_model_len ?? "?"} tokens`;
      $("empty-model").textContent = models[0].id;
      showDefaults(models[0].sampling_defaults);
    }
    $("empty-key").hidden = true;
    $("api-key-box").classList.remove("needed");
    clearError();
  } catch (error) {
    if (asked === state.modelsAsked) showError(`cannot reach the server: ${error.message}`);
  }
}

// A key typed or pasted counts without leaving the field: the model is asked for once typing pauses.
function keyTyped() {
  clearTimeout(state.keyTimer);
  state.keyTimer = setTimeout(loadModel, 400);
}

async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = document.createElement("textarea");  // a page not served as a secure context has no clipboard API
  area.value = text;
  area.setAttribute("readonly", "");
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.append(area);
  area.select();
  const copied = document.execCommand("copy");
  area.remove();
  if (!copied) throw new Error("the browser refused to copy");
}

// A Copy button on each code block; it copies the code's text as written.
function addCopyButtons(content) {
  for (const pre of content.querySelectorAll("pre")) {
    const code = pre.querySelector("code");
    const button = document.createElement("button");
    button.type = "button";
    button.className = "copy";
    button.textContent = "Copy";
    button.setAttribute("aria-label", "Copy the code");
    button.addEventListener("click", async () => {
      try {
        await copyText(code.textContent);
        button.textContent = "Copied";
      } catch (error) {
        button.textContent = "Copy failed";
        showError(`cannot copy: ${error.message}`);
      }
      setTimeout(() => { button.textContent = "Copy"; }, 1500);
    });
    pre.append(button);
  }
}

// The image to send with the next message, as a data URI (a file picked, or one pasted into the box).
function attach(file) {
  if (!file || !file.type.startsWith("image/")) return;
  const reader = new FileReader();
  reader.onload = () => showAttachment(reader.result);
  reader.onerror = () => showError(`cannot read the image: ${reader.error}`);
  reader.readAsDataURL(file);
}

function showAttachment(url) {
  state.image = url;
  $("attached").src = url || "";
  $("attachment").hidden = !url;
  if (!url) $("image-file").value = "";
}

// One message in the conversation; an assistant's has a collapsed reasoning section and a status line; a user's
// shows the image it carried.
function addMessage(role, text, image) {
  state.empty.remove();
  const root = document.createElement("div");
  root.className = `message ${role}`;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  root.append(label);
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  reasoning.hidden = true;
  const summary = document.createElement("summary");
  summary.textContent = "Reasoning";
  const reasoningText = document.createElement("div");
  reasoningText.className = "reasoning-text";
  reasoning.append(summary, reasoningText);
  const content = document.createElement("div");
  content.className = "content";
  const status = document.createElement("div");
  status.className = "status";
  if (role === "assistant") root.append(reasoning);
  root.append(content);
  if (role === "assistant") root.append(status);
  if (role === "user") content.textContent = text;  // what the user typed is shown as typed
  if (image) {
    const img = document.createElement("img");
    img.className = "sent-image";
    img.alt = "image sent";
    img.src = image;
    root.append(img);
  }
  $("messages").append(root);
  root.scrollIntoView({ block: "end" });
  return { root, content, reasoning, summary, reasoningText, status };
}

function render(view, content, reasoning, streaming) {
  if (reasoning) {
    view.reasoning.hidden = false;
    view.summary.textContent = streaming && !content ? "Reasoning…" : `Reasoning (${reasoning.length} characters)`;
    view.reasoningText.textContent = reasoning;
  }
  view.content.innerHTML = renderMarkdown(content);  // renderMarkdown escapes the text first
  addCopyButtons(view.content);
  const list = $("messages");
  if (list.scrollHeight - list.scrollTop - list.clientHeight < 80) list.scrollTop = list.scrollHeight;
}

function finish(view, kind, text) {
  view.root.dataset.state = kind;
  view.status.className = `status ${kind}`;
  view.status.textContent = text;
}

function numberField(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

function requestBody() {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  const body = { messages: messages.concat(state.history), stream: true };
  if (state.model) body.model = state.model;
  for (const [field, id] of SAMPLING_FIELDS) {
    const value = numberField(id);
    if (value !== undefined) body[field] = value;
  }
  return body;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// Reads the event stream; calls onEvent with each decoded ``data:`` payload but "[DONE]".
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith("data: ") && line !== "data: [DONE]") onEvent(JSON.parse(line.slice(6)));
      }
    }
  }
}

async function send(text) {
  clearError();
  const image = state.image;
  const parts = image ? [{ type: "text", text }, { type: "image_url", image_url: { url: image } }] : text;
  state.history.push({ role: "user", content: parts });
  showAttachment(null);
  const userView = addMessage("user", text, image);
  const view = addMessage("assistant", "");
  view.root.dataset.state = "streaming";
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  let content = "";
  let reasoning = "";
  let finishReason = null;
  let frame = 0;  // one render per animation frame while the stream arrives
  const schedule = () => {
    if (!frame) frame = requestAnimationFrame(() => { frame = 0; render(view, content, reasoning, true); });
  };
  const renderFinal = () => {
    cancelAnimationFrame(frame);
    frame = 0;
    render(view, content, reasoning, false);
  };
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: requestHeaders(), body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    if (!response.ok) {
      const message = await errorText(response);
      state.history.pop();  // not answered: the text goes back to the box to send again
      userView.root.remove();
      view.root.remove();
      if (!$("messages").children.length) $("messages").append(state.empty);
      $("prompt").value = text;
      if (image) showAttachment(image);  // and the image with it
      showError(message, response.status);
      return;
    }
    await readEvents(response, (event) => {
      if (event.error) throw new Error(event.error.message || "the server reported an error");
      const choice = (event.choices || [])[0];
      if (!choice) return;
      const delta = choice.delta || {};
      if (delta.reasoning_content) reasoning += delta.reasoning_content;
      if (delta.content) content += delta.content;
      if (choice.finish_reason) finishReason = choice.finish_reason;
      schedule();
    });
    renderFinal();
    if (!state.model) loadModel();  // the request went through: the label can be filled now
    finish(view, "done", finishReason === "length" ? "stopped at the token limit" : "");
  } catch (error) {
    renderFinal();
    if (error.name === "AbortError") {
      finish(view, "stopped", "stopped");
    } else {
      finish(view, "failed", `failed: ${error.message}`);
      showError(error.message);
    }
  } finally {
    if (view.root.isConnected && (content || reasoning)) {
      state.history.push({ role: "assistant", content });
    } else if (view.root.isConnected) {
      state.history.pop();  // nothing came back: the question is not part of the conversation
    }
    state.controller = null;
    setBusy(false);
  }
}

function newChat() {
  if (state.controller) state.controller.abort();
  state.history = [];
  $("messages").replaceChildren(state.empty);
  showAttachment(null);
  clearError();
}

function start() {
  state.empty = $("empty");
  const saved = localStorage.getItem(KEY_STORAGE);
  if (saved) {
    $("api-key").value = saved;
    $("remember-key").checked = true;
  }
  $("api-key").addEventListener("change", () => { clearTimeout(state.keyTimer); saveKeyChoice(); loadModel(); });
  $("api-key").addEventListener("input", keyTyped);
  $("remember-key").addEventListener("change", saveKeyChoice);
  $("toggle-settings").addEventListener("click", () => showSettings($("settings").hidden));
  $("new-chat").addEventListener("click", newChat);
  $("image-file").addEventListener("change", (event) => attach(event.target.files[0]));
  $("remove-image").addEventListener("click", () => showAttachment(null));
  $("prompt").addEventListener("paste", (event) => {
    const item = [...(event.clipboardData || { items: [] }).items].find((i) => i.type.startsWith("image/"));
    if (item) {
      event.preventDefault();
      attach(item.getAsFile());
    }
  });
  $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  loadModel();
}

document.addEventListener("DOMContentLoaded", start);
