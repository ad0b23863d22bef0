// The playground: streams a request with stream_options.include_speculation (docs/speculative.md,
// "Provenance") and colours every token by how it came; side by side, the same request with
// speculation off. Plain browser JavaScript, no build step, no network beyond this server.
"use strict";

const $ = (id) => document.getElementById(id);
let controller = null;

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function status(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

async function getJSON(path) {
  const r = await fetch(path, { headers: headers() });
  if (!r.ok) throw new Error(r.status === 401 ? "this server needs an API key" : `${path}: HTTP ${r.status}`);
  return r.json();
}

async function init() {
  try {
    const models = await getJSON("/v1/models");
    const select = $("model");
    select.innerHTML = "";
    for (const m of models.data) {
      const opt = document.createElement("option");
      opt.value = m.id;
      opt.textContent = m.parent ? `${m.id} (LoRA on ${m.parent})` : m.id;
      select.appendChild(opt);
    }
    const version = await getJSON("/version");
    const method = $("method");
    for (const name of version.speculative_methods || []) {
      if ([...method.options].some((o) => o.value === name)) continue;
      const opt = document.createElement("option");
      opt.value = name;
      opt.textContent = name;
      method.appendChild(opt);
    }
    $("spec-method").textContent = version.speculative_method ? `(${version.speculative_method})` : "";
    status("ready");
  } catch (e) {
    status(e.message, true);
  }
}

function parseField(id) {
  const text = $(id).value.trim();
  if (!text) return undefined;
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new Error(`${id} is not valid JSON: ${e.message}`);
  }
}

function requestBody(speculation) {
  const chat = $("mode").value === "chat";
  const body = {
    model: $("model").value || undefined,
    stream: true,
    stream_options: { include_usage: true, include_speculation: true },
    max_tokens: Number($("max_tokens").value),
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
  };
  const seed = $("seed").value.trim();
  if (seed !== "") body.seed = Number(seed);
  const method = $("method").value;
  const depth = $("num_draft_tokens").value.trim();
  if (!speculation || method === "off") body.speculative = { enabled: false };
  else if (method || depth) {
    body.speculative = {};
    if (method) body.speculative.method = method;
    if (depth) body.speculative.num_draft_tokens = Number(depth);
  }
  const format = parseField("response_format");
  if (format !== undefined) body.response_format = format;
  if (chat) {
    body.messages = [{ role: "user", content: $("prompt").value }];
    const tools = parseField("tools");
    if (tools !== undefined) body.tools = tools;
  } else {
    body.prompt = $("prompt").value;
  }
  return [chat ? "/v1/chat/completions" : "/v1/completions", body];
}

// One streamed request into one pane: returns {text, tokens, seconds, usage}.
async function stream(pane, speculation, signal) {
  const [path, body] = requestBody(speculation);
  const out = $("tokens-" + pane);
  const strip = $("strip-" + pane);
  const depths = $("depths");
  out.innerHTML = "";
  strip.textContent = "";
  if (pane === "spec") depths.innerHTML = "";
  const start = performance.now();
  const r = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
  if (!r.ok) {
    let message = `HTTP ${r.status}`;
    try { message = (await r.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(message);
  }
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let text = "";
  let usage = null;
  const counts = { tokens: 0, accepted: 0, steps: 0, forced: 0, depthSum: 0, drafted: 0 };
  const show = () => {
    const seconds = (performance.now() - start) / 1000;
    const mal = counts.steps ? (counts.tokens - counts.forced) / counts.steps : 0;
    const depth = counts.drafted ? (counts.depthSum / counts.drafted).toFixed(1) : "0";
    strip.textContent = `${counts.tokens} tokens · ${(counts.tokens / seconds).toFixed(1)} tok/s · ` +
      `${mal.toFixed(2)} tokens per target forward · mean draft depth ${depth}`;
  };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          text += choice.text ?? choice.delta?.content ?? "";
          for (const t of choice.speculation || []) {
            const span = document.createElement("span");
            span.className = "tok " + t.kind;
            span.textContent = t.text;
            span.title = `${t.kind} · ${t.proposer || "no draft"} · depth ${t.depth}`;
            span.dataset.kind = t.kind;
            out.appendChild(span);
            counts.tokens += 1;
            if (t.kind === "accepted") counts.accepted += 1;
            else if (t.kind === "forced") counts.forced += 1;
            else {
              counts.steps += 1;
              if (t.kind !== "plain") { counts.depthSum += t.depth; counts.drafted += 1; }
              if (pane === "spec") {
                const bar = document.createElement("span");
                bar.style.height = `${Math.max(2, 4 * t.depth)}px`;
                bar.title = `step ${counts.steps}: depth ${t.depth}`;
                depths.appendChild(bar);
              }
            }
          }
        }
        show();
      }
    }
  }
  show();
  if (usage && usage.speculative) {
    strip.textContent += ` · server: ${usage.speculative.method}, ${usage.speculative.accepted_tokens} accepted`;
  }
  return { text, tokens: counts.tokens, seconds: (performance.now() - start) / 1000, usage };
}

async function run() {
  $("run").disabled = true;
  $("stop").disabled = false;
  $("verdict").textContent = "";
  $("verdict").className = "";
  const compare = $("compare").checked;
  $("panes").className = compare ? "" : "single";
  controller = new AbortController();
  try {
    status("streaming with speculation…");
    const spec = await stream("spec", true, controller.signal);
    document.body.dataset.specText = spec.text;
    if (compare) {
      status("the same request with speculation off…");
      const plain = await stream("plain", false, controller.signal);
      document.body.dataset.plainText = plain.text;
      const same = spec.text === plain.text;
      const ratio = (spec.tokens / spec.seconds) / (plain.tokens / plain.seconds);
      $("verdict").textContent = same
        ? `Identical text. Speculation ran at ${ratio.toFixed(2)}x the speed of plain decoding.`
        : "The texts differ (a sampled request without a seed, or a lossy acceptance rule).";
      $("verdict").className = same ? "same" : "differ";
    }
    status("done");
  } catch (e) {
    status(e.name === "AbortError" ? "stopped" : e.message, e.name !== "AbortError");
  } finally {
    $("run").disabled = false;
    $("stop").disabled = true;
    document.body.dataset.done = "1";
  }
}

$("run").addEventListener("click", () => { document.body.dataset.done = ""; run(); });
$("stop").addEventListener("click", () => controller && controller.abort());
$("key").addEventListener("change", init);
init();
