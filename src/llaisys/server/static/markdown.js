// A small Markdown renderer and code highlighter for the chat UI, written for it (no third-party
// code). Every piece of input text goes through escapeHtml; the only tags in the output are the
// ones written below, and links keep only http(s) and mailto addresses.
//
// Blocks: fenced code (``` or ~~~, left open while an answer streams), ATX headings, rules,
// block quotes, bullet and numbered lists (nested by indentation), pipe tables, paragraphs
// (a single newline is a line break, as chat answers mean it). Inline: code spans, **bold**,
// *italic*, ~~strike~~, [links](url), <autolinks> and bare http(s) addresses, backslash escapes.
(function (global) {
  "use strict";

  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  function escapeHtml(text) {
    return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
  }

  // ---------------------------------------------------------------- code highlighting

  const C_KEYWORDS = "auto break case char const continue default do double else enum extern float for goto if " +
    "inline int long register restrict return short signed sizeof static struct switch typedef union unsigned " +
    "void volatile while bool class namespace template typename public private protected virtual override new " +
    "delete this throw try catch using constexpr nullptr operator friend explicit mutable noexcept static_cast " +
    "dynamic_cast reinterpret_cast const_cast size_t uint8_t uint16_t uint32_t uint64_t int8_t int16_t int32_t " +
    "int64_t __global__ __device__ __host__ __shared__";
  const LANGS = {
    python: {
      comment: /#[^\n]*/,
      string: /[rRbBuUfF]{0,2}(?:"""[\s\S]*?(?:"""|$)|'''[\s\S]*?(?:'''|$)|"(?:\\.|[^"\\\n])*"?|'(?:\\.|[^'\\\n])*'?)/,
      keywords: "and as assert async await break class continue def del elif else except finally for from global " +
        "if import in is lambda nonlocal not or pass raise return try while with yield match case self",
      literals: "True False None",
    },
    javascript: {
      comment: /\/\/[^\n]*|\/\*[\s\S]*?(?:\*\/|$)/,
      string: /"(?:\\.|[^"\\\n])*"?|'(?:\\.|[^'\\\n])*'?|`(?:\\[\s\S]|[^`\\])*`?/,
      keywords: "async await break case catch class const continue debugger default delete do else export " +
        "extends finally for from function if import in instanceof let new of return static super switch this " +
        "throw try typeof var void while with yield interface type enum implements declare readonly as",
      literals: "true false null undefined NaN Infinity",
    },
    c: {
      comment: /\/\/[^\n]*|\/\*[\s\S]*?(?:\*\/|$)|^[ \t]*#[^\n]*/m,
      string: /"(?:\\.|[^"\\\n])*"?|'(?:\\.|[^'\\\n])*'?/,
      keywords: C_KEYWORDS,
      literals: "true false NULL nullptr",
    },
    rust: {
      comment: /\/\/[^\n]*|\/\*[\s\S]*?(?:\*\/|$)/,
      string: /b?"(?:\\.|[^"\\])*"?|b?'(?:\\.|[^'\\\n])'/,
      keywords: "as async await break const continue crate dyn else enum extern fn for if impl in let loop " +
        "match mod move mut pub ref return self Self static struct super trait type unsafe use where while",
      literals: "true false Some None Ok Err",
    },
    go: {
      comment: /\/\/[^\n]*|\/\*[\s\S]*?(?:\*\/|$)/,
      string: /"(?:\\.|[^"\\\n])*"?|`[^`]*`?|'(?:\\.|[^'\\\n])*'?/,
      keywords: "break case chan const continue default defer else fallthrough for func go goto if import " +
        "interface map package range return select struct switch type var",
      literals: "true false nil iota",
    },
    bash: {
      comment: /(?:^|[ \t])#[^\n]*/m,
      string: /"(?:\\.|[^"\\])*"?|'[^']*'?/,
      keywords: "if then else elif fi for while until do done case esac in function return local export " +
        "source echo cd set unset exit shift",
      literals: "true false",
    },
    sql: {
      comment: /--[^\n]*|\/\*[\s\S]*?(?:\*\/|$)/,
      string: /'(?:''|[^'])*'?|"(?:""|[^"])*"?/,
      keywords: "select from where insert into values update set delete create table index drop alter add " +
        "primary key foreign references join left right inner outer on group by order having limit offset as " +
        "and or not null is in like distinct union all case when then else end begin commit",
      literals: "true false",
      caseless: true,
    },
  };
  const ALIASES = {
    py: "python", python3: "python", js: "javascript", ts: "javascript", typescript: "javascript",
    jsx: "javascript", tsx: "javascript", mjs: "javascript", json: "javascript", cpp: "c", "c++": "c",
    cc: "c", cxx: "c", h: "c", hpp: "c", cu: "c", cuda: "c", java: "c", cs: "c", rs: "rust", golang: "go",
    sh: "bash", shell: "bash", zsh: "bash", console: "bash",
  };
  const NUMBER = /\b(?:0[xX][\da-fA-F_]+|0[bB][01_]+|0[oO][0-7_]+|\d[\d_]*(?:\.\d[\d_]*)?(?:[eE][+-]?\d+)?)[a-zA-Z]*\b/;
  const CALL = /\b[A-Za-z_]\w*(?=\s*\()/;
  const compiled = {};

  function words(list) {
    return list.split(/\s+/).map((w) => w.replace(/[^\w]/g, "\\$&")).join("|");
  }

  function grammar(lang) {
    const name = ALIASES[lang] || lang;
    if (!LANGS[name]) return null;
    if (!compiled[name]) {
      const g = LANGS[name];
      const parts = [g.comment.source, g.string.source, NUMBER.source,
        "\\b(?:" + words(g.keywords) + ")\\b", "\\b(?:" + words(g.literals) + ")\\b", CALL.source];
      const flags = "gm" + (g.caseless ? "i" : "");
      compiled[name] = new RegExp(parts.map((p) => "(" + p + ")").join("|"), flags);
    }
    return compiled[name];
  }

  const CLASSES = ["tok-comment", "tok-string", "tok-number", "tok-keyword", "tok-literal", "tok-function"];

  // The code as HTML: escaped, with comments, strings, numbers, keywords, literals and called
  // names wrapped in <span class="tok-...">. An unknown language is only escaped.
  function highlight(code, lang) {
    const re = grammar(String(lang || "").toLowerCase());
    if (!re) return escapeHtml(code);
    re.lastIndex = 0;
    let out = "";
    let at = 0;
    let m;
    while ((m = re.exec(code)) !== null) {
      if (m[0] === "") { re.lastIndex++; continue; }
      const group = m.findIndex((g, i) => i > 0 && g !== undefined) - 1;
      out += escapeHtml(code.slice(at, m.index)) + '<span class="' + CLASSES[group] + '">' + escapeHtml(m[0]) + "</span>";
      at = m.index + m[0].length;
    }
    return out + escapeHtml(code.slice(at));
  }

  // ---------------------------------------------------------------- inline Markdown

  function safeUrl(url) {
    url = url.trim();
    return /^(https?:\/\/|mailto:)/i.test(url) ? url : null;
  }

  function link(href, labelHtml) {
    return '<a href="' + escapeHtml(href) + '" target="_blank" rel="noopener noreferrer">' + labelHtml + "</a>";
  }

  const PUNCT = /[!-\/:-@\[-`{-~]/;

  // Where the closing ``delim`` of an emphasis opened at ``from`` is, or -1: not after a space,
  // not inside a code span, and a single delimiter skips doubled ones (so *a **b** c* nests).
  function findCloser(text, from, delim) {
    for (let i = from; i < text.length; i++) {
      const c = text[i];
      if (c === "\\") { i++; continue; }
      if (c === "`") {
        const run = /^`+/.exec(text.slice(i))[0];
        const end = text.indexOf(run, i + run.length);
        if (end > 0) i = end + run.length - 1;
        continue;
      }
      if (text.startsWith(delim, i) && i > from && !/\s/.test(text[i - 1])) {
        if (delim.length === 1 && text[i + 1] === delim) { i++; continue; }
        if (delim === "_" && /\w/.test(text[i + 1] || "")) continue;
        return i;
      }
    }
    return -1;
  }

  function inline(text, depth) {
    depth = depth || 0;
    let out = "";
    let i = 0;
    while (i < text.length) {
      const c = text[i];
      const rest = text.slice(i);
      let m;
      if (c === "\\" && i + 1 < text.length && PUNCT.test(text[i + 1])) {
        out += escapeHtml(text[i + 1]);
        i += 2;
        continue;
      }
      if (c === "\n") { out += "<br>"; i++; continue; }
      if (c === "`") {
        const run = /^`+/.exec(rest)[0];
        const end = text.indexOf(run, i + run.length);
        if (end > 0 && text[end + run.length] !== "`") {
          let code = text.slice(i + run.length, end).replace(/\n/g, " ");
          if (/^ .*[^ ].* $/.test(code)) code = code.slice(1, -1);
          out += "<code>" + escapeHtml(code) + "</code>";
          i = end + run.length;
        } else {
          out += escapeHtml(run);
          i += run.length;
        }
        continue;
      }
      if (depth < 8) {
        if (c === "[" && (m = /^\[((?:\\.|[^\\\[\]]|\[[^\]]*\])*)\]\(\s*<?([^\s<>()]*(?:\([^\s()]*\)[^\s<>()]*)*)>?(?:\s+"[^"]*")?\s*\)/.exec(rest))) {
          const href = safeUrl(m[2]);
          const label = inline(m[1], depth + 1);
          out += href ? link(href, label) : label;
          i += m[0].length;
          continue;
        }
        if (c === "<" && (m = /^<((?:https?:\/\/|mailto:)[^\s<>]+)>/i.exec(rest))) {
          out += link(m[1], escapeHtml(m[1]));
          i += m[0].length;
          continue;
        }
        if ((c === "h" || c === "H") && !/\w/.test(text[i - 1] || "") && (m = /^https?:\/\/[^\s<>"]+/i.exec(rest))) {
          const url = m[0].replace(/[.,;:!?)\]'"*_]+$/, "");
          out += link(url, escapeHtml(url));
          i += url.length;
          continue;
        }
        const delim = rest.startsWith("**") ? "**" : rest.startsWith("__") ? "__" : rest.startsWith("~~") ? "~~"
          : c === "*" || c === "_" ? c : null;
        if (delim && text[i + delim.length] && !/\s/.test(text[i + delim.length]) &&
            !(c === "_" && /\w/.test(text[i - 1] || ""))) {
          const end = findCloser(text, i + delim.length, delim);
          if (end > i + delim.length) {
            const tag = delim === "~~" ? "del" : delim.length === 2 ? "strong" : "em";
            out += "<" + tag + ">" + inline(text.slice(i + delim.length, end), depth + 1) + "</" + tag + ">";
            i = end + delim.length;
            continue;
          }
        }
      }
      out += escapeHtml(c);
      i++;
    }
    return out;
  }

  // ---------------------------------------------------------------- blocks

  const FENCE = /^( {0,3})(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
  const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$/;
  const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
  const QUOTE = /^ {0,3}> ?/;
  const ITEM = /^( *)([-*+]|\d{1,9}[.)])(?:[ \t]+(.*))?$/;
  const TABLE_RULE = /^ *\|? *:?-+:? *(?:\| *:?-+:? *)*\|? *$/;

  function indentOf(line) {
    return /^ */.exec(line)[0].length;
  }

  function startsBlock(line, next) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
      (ITEM.test(line) && ITEM.exec(line)[3] !== undefined) || isTableStart(line, next);
  }

  function isTableStart(line, next) {
    return line.includes("|") && next !== undefined && next.includes("-") && TABLE_RULE.test(next);
  }

  function splitRow(line) {
    let s = line.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
    const cells = [];
    let cell = "";
    let inCode = false;
    for (let i = 0; i < s.length; i++) {
      if (s[i] === "\\" && s[i + 1] === "|") { cell += "|"; i++; continue; }
      if (s[i] === "`") inCode = !inCode;
      if (s[i] === "|" && !inCode) { cells.push(cell.trim()); cell = ""; continue; }
      cell += s[i];
    }
    cells.push(cell.trim());
    return cells;
  }

  function codeBlock(code, lang) {
    const cls = lang ? ' class="language-' + escapeHtml(lang) + '"' : "";
    return '<div class="code-block"><div class="code-head"><span class="code-lang">' + escapeHtml(lang || "text") +
      '</span><button type="button" class="copy-code" title="Copy code">Copy</button></div><pre><code' + cls + ">" +
      highlight(code, lang) + "</code></pre></div>";
  }

  function blocks(lines, depth) {
    let out = "";
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) { i++; continue; }
      if (depth > 8) { // nesting this deep is not worth rendering: show the text
        out += "<p>" + inline(lines.slice(i).join("\n"), 8) + "</p>";
        break;
      }
      if ((m = FENCE.exec(line))) {
        const indent = m[1].length;
        const fence = m[2];
        const body = [];
        i++;
        while (i < lines.length) {
          const close = /^ {0,3}(`{3,}|~{3,})[ \t]*$/.exec(lines[i]);
          if (close && close[1][0] === fence[0] && close[1].length >= fence.length) { i++; break; }
          body.push(lines[i].slice(Math.min(indent, indentOf(lines[i]))));
          i++;
        }
        out += codeBlock(body.join("\n"), m[3]);
        continue;
      }
      if ((m = HEADING.exec(line))) {
        const n = m[1].length;
        out += "<h" + n + ">" + inline(m[2] || "", 0) + "</h" + n + ">";
        i++;
        continue;
      }
      if (RULE.test(line)) { out += "<hr>"; i++; continue; }
      if (QUOTE.test(line)) {
        const inner = [];
        while (i < lines.length && lines[i].trim() && QUOTE.test(lines[i])) inner.push(lines[i++].replace(QUOTE, ""));
        out += "<blockquote>" + blocks(inner, depth + 1) + "</blockquote>";
        continue;
      }
      if ((m = ITEM.exec(line))) {
        const r = list(lines, i, depth);
        out += r.html;
        i = r.next;
        continue;
      }
      if (isTableStart(line, lines[i + 1])) {
        const head = splitRow(line);
        const align = splitRow(lines[i + 1]).map((c) =>
          c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "");
        const cell = (tag, text, k) =>
          "<" + tag + (align[k] ? ' class="align-' + align[k] + '"' : "") + ">" + inline(text, 0) + "</" + tag + ">";
        let html = "<table><thead><tr>" + head.map((c, k) => cell("th", c, k)).join("") + "</tr></thead><tbody>";
        i += 2;
        while (i < lines.length && lines[i].trim() && lines[i].includes("|")) {
          const row = splitRow(lines[i++]);
          html += "<tr>" + head.map((_, k) => cell("td", row[k] || "", k)).join("") + "</tr>";
        }
        out += '<div class="table-wrap">' + html + "</tbody></table></div>";
        continue;
      }
      const para = [line.trim()];
      i++;
      while (i < lines.length && lines[i].trim() && !startsBlock(lines[i], lines[i + 1])) para.push(lines[i++].trim());
      out += "<p>" + inline(para.join("\n"), 0) + "</p>";
    }
    return out;
  }

  // A list starting at lines[start]: items at the first item's indentation and of its kind;
  // lines indented past the marker (and blank lines between them) belong to the item above.
  function list(lines, start, depth) {
    const first = ITEM.exec(lines[start]);
    const base = first[1].length;
    const ordered = /\d/.test(first[2]);
    const items = [];
    let loose = false;
    let i = start;
    while (i < lines.length) {
      const m = ITEM.exec(lines[i]);
      if (!m || m[1].length !== base || /\d/.test(m[2]) !== ordered) break;
      const width = m[1].length + m[2].length + 1;
      const body = [m[3] || ""];
      i++;
      let blank = 0;
      while (i < lines.length) {
        const l = lines[i];
        if (!l.trim()) { blank++; i++; continue; }
        const ind = indentOf(l);
        const sub = ITEM.exec(l);
        if (ind >= Math.min(width, base + 2) && !(sub && sub[1].length <= base)) {
          for (; blank > 0; blank--) body.push("");
          body.push(l.slice(Math.min(ind, width)));
          i++;
          continue;
        }
        if (!blank && !sub && !startsBlock(l, lines[i + 1])) { body.push(l.trim()); i++; continue; } // lazy line
        break;
      }
      const after = i < lines.length ? ITEM.exec(lines[i]) : null;
      if (blank && after && after[1].length === base && /\d/.test(after[2]) === ordered) loose = true;
      items.push(body);
    }
    const startAttr = ordered && parseInt(first[2], 10) !== 1 ? ' start="' + parseInt(first[2], 10) + '"' : "";
    const tag = ordered ? "ol" : "ul";
    let html = "<" + tag + startAttr + (loose ? ' class="loose"' : "") + ">";
    for (const body of items) html += "<li>" + blocks(body, depth + 1) + "</li>";
    return { html: html + "</" + tag + ">", next: i };
  }

  // The Markdown ``text`` as HTML.
  function render(text) {
    return blocks(String(text || "").replace(/\r\n?/g, "\n").replace(/\t/g, "    ").split("\n"), 0);
  }

  global.LlaisysMarkdown = { render, highlight, escapeHtml };
})(typeof window !== "undefined" ? window : globalThis);
