// A small markdown renderer for the chat page. Safe by construction: the text is HTML-escaped first,
// and only the markup below is added to it (links only for http, https and mailto URLs).
"use strict";

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const SAFE_URL = /^(https?:\/\/|mailto:)[^\s]*$/i;

// Inline markup of one escaped line: `code`, [links](url), **bold**, *italic*, _italic_.
function renderInline(escaped) {
  const held = [];  // code spans and links, kept out of the emphasis rules
  const hold = (html) => `\u0000${held.push(html) - 1}\u0000`;
  let out = escaped.replace(/`([^`]+)`/g, (_, code) => hold(`<code>${code}</code>`));
  out = out.replace(/\[([^\]]+)\]\(([^)\s]+)\)/g, (whole, label, url) => {
    const raw = url.replace(/&amp;/g, "&");  // the URL as written, to check its scheme
    if (!SAFE_URL.test(raw)) return whole;
    return hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`);
  });
  out = out.replace(/\*\*(?=\S)([^*]*?\S)\*\*/g, "<strong>$1</strong>");
  out = out.replace(/__(?=\S)([^_]*?\S)__/g, "<strong>$1</strong>");
  out = out.replace(/(^|[^*\w])\*(?=\S)([^*]*?\S)\*(?![*\w])/g, "$1<em>$2</em>");
  out = out.replace(/(^|[^_\w])_(?=\S)([^_]*?\S)_(?![_\w])/g, "$1<em>$2</em>");
  const placeholder = /\u0000(\d+)\u0000/g;
  while (placeholder.test(out)) out = out.replace(placeholder, (_, index) => held[Number(index)]);  // nested: `code` in a link
  return out;
}

const FENCE = /^\s*```\s*([\w+.#-]*)\s*$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*(\d+)[.)]\s+(.*)$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const QUOTE = /^\s*&gt;\s?(.*)$/;

// Markdown text -> HTML. An unclosed code fence (a stream still arriving) runs to the end.
function renderMarkdown(text) {
  const lines = escapeHtml(String(text).replace(/\u0000/g, "")).split(/\r?\n/);
  const html = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      const code = [];
      for (i += 1; i < lines.length && !FENCE.test(lines[i]); i += 1) code.push(lines[i]);
      i += 1;  // the closing fence
      const language = fence[1] ? ` class="language-${fence[1]}"` : "";
      html.push(`<pre><code${language}>${code.join("\n")}</code></pre>`);
      continue;
    }
    if (!line.trim()) { i += 1; continue; }
    const heading = HEADING.exec(line);
    if (heading) {
      const level = heading[1].length;
      html.push(`<h${level}>${renderInline(heading[2])}</h${level}>`);
      i += 1;
      continue;
    }
    if (BULLET.test(line) || NUMBERED.test(line)) {
      const ordered = !BULLET.test(line);
      const pattern = ordered ? NUMBERED : BULLET;
      const start = ordered ? Number(NUMBERED.exec(line)[1]) : 1;
      const items = [];
      for (; i < lines.length && pattern.test(lines[i]); i += 1) {
        const match = pattern.exec(lines[i]);
        items.push(`<li>${renderInline(ordered ? match[2] : match[1])}</li>`);
      }
      const tag = ordered ? "ol" : "ul";
      const startAttribute = ordered && start !== 1 ? ` start="${start}"` : "";
      html.push(`<${tag}${startAttribute}>${items.join("")}</${tag}>`);
      continue;
    }
    if (QUOTE.test(line)) {
      const quoted = [];
      for (; i < lines.length && QUOTE.test(lines[i]); i += 1) quoted.push(QUOTE.exec(lines[i])[1]);
      html.push(`<blockquote>${quoted.map(renderInline).join("<br>")}</blockquote>`);
      continue;
    }
    const paragraph = [];
    for (; i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !HEADING.test(lines[i])
         && !BULLET.test(lines[i]) && !NUMBERED.test(lines[i]) && !QUOTE.test(lines[i]); i += 1) {
      paragraph.push(renderInline(lines[i]));
    }
    html.push(`<p>${paragraph.join("<br>")}</p>`);
  }
  return html.join("\n");
}

if (typeof module !== "undefined") module.exports = { escapeHtml, renderMarkdown };
