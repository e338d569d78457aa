"""``lm-rescore nbest --html`` / ``tune --html``: one self-contained HTML file to decide whether to trust a rescoring
run by looking at it.

It shows the summary (1-best, rescored and oracle; substitutions, deletions and insertions; the paired bootstrap;
the metric signature; models, weights, the LM's score normalisation and the leakage check), the utterances with their
reference, 1-best and chosen hypothesis aligned (jiwer's alignment, sclite-style: substitutions, insertions and
deletions marked), filters (changed, improved, worsened, unchanged) and sortable columns, WER by utterance length, the
most frequent confusion pairs, and, on demand, every hypothesis of an utterance with its feature values. For
``tune`` it adds plots (matplotlib, embedded as PNG) of the dev metric against λ and against each weight around the
optimum. BLEU lists (MT k-best) get sentence-level BLEU per segment instead of word errors, aligned against their
first reference, and, for lists read from system outputs (a WMT folder), the systems that produced each chosen
candidate and a table of how often each system's output was chosen.

Why this shape: the file must open offline and be mailed around, so the data are one JSON block and the page is
built from it by a little inline JavaScript (no libraries, no network); Python does the alignments once. A filter
or opened utterances can be chosen in the URL (``report.html#filter=worsened&open=1``, ``&features=1`` to show
their hypotheses' features too, ``&sort=-d`` to sort), which is how the screenshots in ``docs/`` were taken.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import jiwer
import numpy as np
import sacrebleu

from lmserve.core.atomic import atomic_write_text
from lmserve.core.words import spaced
from lmserve.rescoring.nbest import NBestList

LENGTH_BINS = ((1, 5), (6, 10), (11, 20), (21, 40), (41, None))  # reference words
CONFUSIONS = 20  # pairs listed
SYSTEM = "sys_"  # the prefix of the system indicators of MT lists read from system outputs
_OPS = {"equal": "=", "substitute": "S", "delete": "D", "insert": "I"}


def _aligned(references: Sequence[str], hypotheses: Sequence[str]) -> list[tuple[list, Counter]]:
    """Per pair the alignment as ``[op, ref words, hyp words]`` chunks (op in "=SDI") and its error counts."""
    if not references:
        return []
    out = jiwer.process_words(list(map(spaced, references)), list(map(spaced, hypotheses)))  # WER's words
    result = []
    for ref, hyp, chunks in zip(out.references, out.hypotheses, out.alignments, strict=True):
        ops, counts = [], Counter()
        for c in chunks:
            op = _OPS[c.type]
            r, h = ref[c.ref_start_idx : c.ref_end_idx], hyp[c.hyp_start_idx : c.hyp_end_idx]
            ops.append([op, r, h])
            if op != "=":
                counts[op] += max(len(r), len(h))
        result.append((ops, counts))
    return result


def _confusions(alignments: list[tuple[list, Counter]]) -> Counter:
    """(reference word, hypothesis word) pairs of the errors; "" stands for nothing (deletions, insertions)."""
    pairs = Counter()
    for ops, _ in alignments:
        for op, r, h in ops:
            if op == "S":
                pairs.update(zip(r, h, strict=True))
            elif op == "D":
                pairs.update((w, "") for w in r)
            elif op == "I":
                pairs.update(("", w) for w in h)
    return pairs


def _length_table(lengths: np.ndarray, errors_first: np.ndarray, errors_rescored: np.ndarray) -> list[dict]:
    rows = []
    for lo, hi in LENGTH_BINS:
        mask = (lengths >= lo) & (lengths <= (hi if hi is not None else lengths.max(initial=0)))
        words = int(lengths[mask].sum())
        rows.append(
            {
                "bin": f"{lo}–{hi}" if hi else f"{lo}+",
                "utterances": int(mask.sum()),
                "words": words,
                "first": 100.0 * errors_first[mask].sum() / words if words else None,
                "rescored": 100.0 * errors_rescored[mask].sum() / words if words else None,
            }
        )
    return rows


def _utterances(rep: dict, nbest: NBestList, ranked: NBestList, chosen: np.ndarray) -> tuple[dict, dict]:
    """The per-utterance records the page is built from, and the tables computed over all of them."""
    metric = rep["metric"]
    refs = [e.references[0] if e.references else "" for e in nbest]
    first = [e.hypotheses[0].text for e in nbest]
    picked = [e.hypotheses[int(k)].text for e, k in zip(nbest, chosen, strict=True)]
    align_first, align_picked = _aligned(refs, first), _aligned(refs, picked)
    names = sorted({name for e in ranked for h in e.hypotheses for name in h.features})
    systems = [n.removeprefix(SYSTEM) for n in names if n.startswith(SYSTEM)]  # MT lists of system outputs
    utts = []
    for i, entry in enumerate(nbest):
        ops_1, counts_1 = align_first[i]
        ops_c, counts_c = align_picked[i]
        if metric == "wer":
            score_1, score_c = sum(counts_1.values()), sum(counts_c.values())
        else:  # sentence BLEU against every reference, as the corpus score uses them
            references = [spaced(r) for r in entry.references]
            score_1 = round(sacrebleu.sentence_bleu(spaced(first[i]), references).score, 2)
            score_c = round(sacrebleu.sentence_bleu(spaced(picked[i]), references).score, 2)
        hyps = [[h.rank, h.text, [_number(h.features.get(n)) for n in names]] for h in ranked.entries[i].hypotheses]
        utts.append(
            {
                "i": i,
                "id": entry.id,
                "n": len(refs[i].split()),
                "k": int(chosen[i]) + 1,
                "s1": score_1,
                "sc": score_c,
                "a1": ops_1,
                "ac": ops_c,
                "h": hyps,
                **({"y": _systems_of(entry.hypotheses[int(chosen[i])], systems)} if systems else {}),
            }
        )
    tables = {"features": names}
    if systems:
        firsts = Counter(s for e in nbest for s in _systems_of(e.hypotheses[0], systems))
        picks = Counter(s for u in utts for s in u["y"])
        tables["systems"] = [[s, firsts[s], picks[s]] for s in sorted(systems, key=lambda s: -picks[s])]
    if metric == "wer":
        lengths = np.array([u["n"] for u in utts])
        tables["by_length"] = _length_table(
            lengths, np.array([u["s1"] for u in utts]), np.array([u["sc"] for u in utts])
        )
        conf_1, conf_c = _confusions(align_first), _confusions(align_picked)
        top = (conf_1 + conf_c).most_common(CONFUSIONS)
        tables["confusions"] = [[r, h, conf_1[r, h], conf_c[r, h]] for (r, h), _ in top]
    return utts, tables


def _systems_of(hypothesis, systems: Sequence[str]) -> list[str]:
    """The systems that produced a candidate of a list read from system outputs (``rescoring.nbest.wmt``)."""
    return [s for s in systems if hypothesis.features.get(SYSTEM + s)]


def _number(value) -> float | None:
    return None if value is None else float(f"{value:.5g}")


def figure_png(fig) -> bytes:
    """A matplotlib figure as PNG bytes (closed afterwards)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def tune_plots(tuned, metric: str, points: int = 41, units: float = 2.0) -> list[tuple[str, bytes]]:
    """For ``tune --html``: the dev metric against λ, and against each searched weight around the optimum (the others
    kept; ``units`` of the tuner's rescaled steps each way: a unit gives the feature the fixed feature's spread)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = []
    lambdas = sorted((k, v) for k, v in tuned.by_lambda.items() if k is not None)
    if len(lambdas) > 1:
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.plot([k for k, _ in lambdas], [v for _, v in lambdas], "o-")
        ax.axvline(tuned.setup.lam, color="grey", ls=":")
        ax.set(xlabel="λ (per-word interpolation weight)", ylabel=f"dev {metric.upper()}", title="dev metric vs λ")
        ax.grid(alpha=0.3)
        plots.append(("dev metric against λ", figure_png(fig)))
    data = tuned.data
    names = list(data.feature_names)
    weights = np.array([tuned.result.weights[n] for n in names])
    spread = data.within_list_spread()
    fixed = names.index(tuned.result.fixed)
    searched = [j for j in range(len(names)) if j != fixed]
    if searched:
        cols = min(3, len(searched))
        rows = -(-len(searched) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
        for ax, j in zip(axes.flat, searched, strict=False):
            unit = spread[fixed] / spread[j] if spread[j] > 0 else 1.0
            values = weights[j] + unit * np.linspace(-units, units, points)
            scores = []
            for v in values:
                w = weights.copy()
                w[j] = v
                scores.append(data.evaluate(w))
            ax.plot(values, scores, "-")
            ax.axvline(weights[j], color="grey", ls=":")
            ax.set(xlabel=f"weight of {names[j]}", ylabel=f"dev {metric.upper()}")
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(searched) :]:
            ax.axis("off")
        fig.suptitle(f"dev metric around the optimum ({names[fixed]} fixed at 1)")
        fig.tight_layout()
        plots.append(("dev metric against each weight around the optimum", figure_png(fig)))
    return plots


def build_html(
    rep: dict,
    nbest: NBestList,
    ranked: NBestList,
    chosen: Sequence[int],
    plots: Sequence[tuple[str, bytes]] = (),
    title: str | None = None,
) -> str:
    """The page. ``rep`` is ``rescoring.rescore.report``'s dict (with whatever the caller added: weights, setup,
    normalisation, overlap); ``nbest`` the list as read, ``ranked`` the reranked one with every feature
    (``rescoring.rescore.reranked``), ``chosen`` per utterance the index of the chosen hypothesis in ``nbest``."""
    chosen = np.asarray(chosen)
    utts, tables = _utterances(rep, nbest, ranked, chosen)
    data = {"report": rep, "utterances": utts, **tables}
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"), default=float).replace("</", "<\\/")
    images = "".join(
        f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        for caption, png in plots
    )
    title = title or f"lm-rescore: {rep['list']}"
    return (
        _PAGE.replace("%TITLE%", html.escape(title))
        .replace("%PLOTS%", f"<h2>Tuning</h2>{images}" if images else "")
        .replace("%DATA%", payload)
    )


def write_html(path: str | Path, *args, **kwargs) -> None:
    """``build_html`` written atomically to ``path``."""
    atomic_write_text(path, build_html(*args, **kwargs))


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>%TITLE%</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1em 2em;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.4em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;margin:.4em 0}td,th{padding:2px 8px;border-bottom:1px solid #eee;text-align:right}
th{background:#f4f4f4}td.t,th.t{text-align:left}.mono{font-family:ui-monospace,monospace}
#utts th{cursor:pointer;user-select:none}#utts th.sorted-asc::after{content:" ▲"}#utts th.sorted-desc::after{content:" ▼"}
#utts tbody tr.row{cursor:pointer}#utts tbody tr.row:hover{background:#f6f9ff}
.improved{color:#176f2c}.worsened{color:#b3261e}.unchanged{color:#777}.changed{color:#1a4fa0}
.filters button{margin-right:.3em;padding:3px 10px;border:1px solid #999;background:#fff;border-radius:4px;cursor:pointer}
.filters button.on{background:#1a4fa0;color:#fff;border-color:#1a4fa0}
.detail td{background:#fafafa;text-align:left}
table.al td{border:none;padding:0 4px;text-align:left;font-family:ui-monospace,monospace;white-space:nowrap}
table.al td.S{background:#fff1b8}table.al td.D{background:#ffd6d6}table.al td.I{background:#d6f5dc}
table.al{margin:0 0 .5em}table.al td.lab{color:#777;font-weight:bold;width:4.5em}.al-wrap{overflow-x:auto;max-width:95vw}
.warn{background:#fff4e5;border:1px solid #f0a030;padding:.4em .8em;border-radius:4px}
figure{display:inline-block;margin:.5em 1em .5em 0}figcaption{color:#555;font-size:.9em}
.small{color:#666;font-size:.9em}.side{display:flex;flex-wrap:wrap;gap:0 3em}
</style></head><body>
<h1>%TITLE%</h1>
<div id="summary"></div>
%PLOTS%
<div id="tables" class="side"></div>
<h2>Utterances</h2>
<div class="filters" id="filters"></div>
<p class="small" id="count"></p>
<table id="utts"><thead><tr></tr></thead><tbody></tbody></table>
<script type="application/json" id="data">%DATA%</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const R = D.report, WER = R.metric === "wer";
const esc = s => String(s).replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
const fmt = (x, d = 2) => x === null || x === undefined ? "–" : (typeof x === "number" ? x.toFixed(d) : esc(x));
function status(u) {
  if (u.k === 1) return "unchanged";
  const better = WER ? u.sc < u.s1 : u.sc > u.s1, worse = WER ? u.sc > u.s1 : u.sc < u.s1;
  return better ? "improved" : worse ? "worsened" : "changed";
}
D.utterances.forEach(u => { u.st = status(u); u.d = u.sc - u.s1; });
const FILTERS = {
  all: u => true, changed: u => u.k !== 1, improved: u => u.st === "improved",
  worsened: u => u.st === "worsened", unchanged: u => u.k === 1,
};
function kv(obj) {
  return Object.entries(obj || {}).map(([k, v]) => `<tr><td class="t">${esc(k)}</td><td class="t mono">${
    typeof v === "number" ? fmt(v, 4) : esc(typeof v === "object" && v !== null ? JSON.stringify(v) : v)}</td></tr>`).join("");
}
function summary() {
  const m = R.metric, rows = ["1best", "rescored", "oracle"].map(n => {
    const r = R[n];
    return WER ? `<tr><td class="t">${n}</td><td>${fmt(r.wer)}</td><td>${r.substitutions}</td><td>${r.deletions}</td><td>${r.insertions}</td><td>${r.reference_words}</td></tr>`
      : `<tr><td class="t">${n}</td><td>${fmt(r.bleu)}</td><td>${r.precisions.map(p => fmt(p, 1)).join(" / ")}</td><td>${fmt(r.bp, 3)}</td><td>${r.sys_len}</td><td>${r.ref_len}</td></tr>`;
  }).join("");
  const head = WER ? "<th class='t'></th><th>WER %</th><th>sub</th><th>del</th><th>ins</th><th>ref words</th>"
    : "<th class='t'></th><th>BLEU</th><th>precisions 1–4</th><th>BP</th><th>sys len</th><th>ref len</th>";
  const b = R.bootstrap;
  let s = `<p>${R.utterances} utterances, ${R.hypotheses} hypotheses, ${R.changed_choices} choices changed.</p>
    <table><thead><tr>${head}</tr></thead><tbody>${rows}</tbody></table>
    <p>rescored vs 1-best: <b>${b.delta >= 0 ? "+" : ""}${fmt(b.delta)}</b>, 95% interval [${fmt(b.delta_ci95[0])}, ${fmt(b.delta_ci95[1])}],
    p = ${fmt(b.p_value, 4)} (paired bootstrap, ${b.samples} samples)</p>
    <p class="small mono">${esc(R["1best"].signature)}<br>${esc(b.signature)}</p>`;
  if (R.normalisation) s += `<p>Neural LM scores: <b>${esc(R.normalisation)}</b></p>`;
  if (R.overlap) {
    const o = R.overlap;
    s += `<p${o.warning ? " class='warn'" : ""}>Leakage check (${o.n}-word windows against ${esc(o.text_files.join(", "))}):
      ${fmt(100 * o.share_references)}% of references, ${fmt(100 * o.share_words)}% of reference words occur in the LM's training text.
      ${o.warning ? "<b>" + esc(o.warning) + "</b>" : ""}</p>`;
  }
  if (R.setup || R.weights) s += `<details><summary>models and weights</summary><table>${kv(R.setup)}${kv(R.weights)}</table></details>`;
  document.getElementById("summary").innerHTML = s;
}
const COLS = [
  ["i", "#"], ["id", "utterance", "t"], ["n", "ref words"], ["s1", WER ? "1-best errors" : "1-best sBLEU"],
  ["sc", WER ? "rescored errors" : "rescored sBLEU"], ["d", "Δ"], ["k", "chosen rank"], ["st", "status", "t"],
];
if (D.systems) COLS.push(["y", "chosen system(s)", "t"]);
let filter = "all", sortKey = "i", sortDir = 1, opened = new Set(), showFeatures = false;
const ALIGN_COLUMNS = 14;  // aligned words per line: long utterances wrap instead of running off the page
function alignTable(ops, label) {
  const top = [], bot = [];
  for (const [op, r, h] of ops) {
    const n = Math.max(r.length, h.length);
    for (let j = 0; j < n; j++) {
      top.push(`<td class="${op === "=" ? "" : op}">${esc(r[j] !== undefined ? r[j] : "***")}</td>`);
      bot.push(`<td class="${op === "=" ? "" : op}">${esc(h[j] !== undefined ? h[j] : "***")}</td>`);
    }
  }
  const rows = [];
  for (let k = 0; k < Math.max(top.length, 1); k += ALIGN_COLUMNS) {
    rows.push(`<table class="al"><tr><td class="lab">REF</td>${top.slice(k, k + ALIGN_COLUMNS).join("")}</tr>` +
      `<tr><td class="lab">${label}</td>${bot.slice(k, k + ALIGN_COLUMNS).join("")}</tr></table>`);
  }
  return `<div class="al-wrap">${rows.join("")}</div>`;
}
function detail(u) {
  const errs = ops => { const c = {S: 0, D: 0, I: 0}; ops.forEach(([op, r, h]) => { if (op !== "=") c[op] += Math.max(r.length, h.length); }); return `S ${c.S}, D ${c.D}, I ${c.I}`; };
  let s = `<p><b>1-best</b> (rank 1; ${WER ? errs(u.a1) : "sentence BLEU " + fmt(u.s1)})</p>${alignTable(u.a1, "1-BEST")}`;
  s += `<p><b>chosen</b> (rank ${u.k}; ${WER ? errs(u.ac) : "sentence BLEU " + fmt(u.sc)})</p>${alignTable(u.ac, "CHOSEN")}`;
  if (!WER) s += `<p class="small">aligned against the first reference; sentence BLEU uses all of them</p>`;
  s += `<details data-i="${u.i}"${showFeatures ? " open" : ""}><summary>all ${u.h.length} hypotheses with their features (reranked order)</summary><div>${showFeatures ? featureTable(u) : ""}</div></details>`;
  return s;
}
function featureTable(u) {
  const head = `<tr><th>rank</th><th class="t">hypothesis</th>${D.features.map(f => `<th>${esc(f)}</th>`).join("")}</tr>`;
  const rows = u.h.map(([rank, text, vals]) => `<tr${rank === 1 ? " style='font-weight:bold'" : ""}><td>${rank}</td><td class="t">${esc(text)}</td>${vals.map(v => `<td>${fmt(v, 3)}</td>`).join("")}</tr>`);
  return `<table class="small">${head}${rows.join("")}</table>`;
}
function render() {
  const rows = D.utterances.filter(FILTERS[filter]);
  rows.sort((a, b) => (a[sortKey] < b[sortKey] ? -1 : a[sortKey] > b[sortKey] ? 1 : a.i - b.i) * sortDir);
  document.getElementById("count").textContent = `${rows.length} of ${D.utterances.length} utterances (${filter}); click a row to see its alignment`;
  const body = [];
  for (const u of rows) {
    body.push(`<tr class="row" data-i="${u.i}">${COLS.map(([key, , cls]) => {
      const v = u[key];
      const c = key === "st" ? ` ${v}` : "";
      const text = key === "y" ? esc(v.join(", ")) : key === "d" ? (v > 0 ? "+" : "") + fmt(v, WER ? 0 : 2) : !WER && (key === "s1" || key === "sc") ? fmt(v) : esc(v);
      return `<td class="${cls || ""}${c}">${text}</td>`;
    }).join("")}</tr>`);
    if (opened.has(u.i)) body.push(`<tr class="detail"><td colspan="${COLS.length}">${detail(u)}</td></tr>`);
  }
  document.querySelector("#utts tbody").innerHTML = body.join("");
  document.querySelectorAll("#utts thead th").forEach(th => {
    th.className = (th.dataset.cls || "") + (th.dataset.key === sortKey ? (sortDir > 0 ? " sorted-asc" : " sorted-desc") : "");
  });
  document.querySelectorAll("#filters button").forEach(b => b.classList.toggle("on", b.dataset.f === filter));
}
function readHash() {
  const p = new URLSearchParams(location.hash.slice(1));
  if (p.get("filter") in FILTERS) filter = p.get("filter");
  if (p.get("sort")) { sortKey = p.get("sort").replace(/^-/, ""); sortDir = p.get("sort").startsWith("-") ? -1 : 1; }
  showFeatures = p.get("features") === "1";
  const open = parseInt(p.get("open") || "0", 10);
  if (open > 0) { opened = new Set(D.utterances.filter(FILTERS[filter]).slice(0, open).map(u => u.i)); }
}
function tables() {
  let s = "";
  if (D.by_length) {
    s += `<div><h2>WER by utterance length</h2><table><tr><th class="t">reference words</th><th>utterances</th><th>words</th><th>1-best WER %</th><th>rescored WER %</th></tr>${
      D.by_length.map(r => `<tr><td class="t">${r.bin}</td><td>${r.utterances}</td><td>${r.words}</td><td>${fmt(r.first)}</td><td>${fmt(r.rescored)}</td></tr>`).join("")}</table></div>`;
  }
  if (D.confusions) {
    s += `<div><h2>Most frequent confusion pairs</h2><table><tr><th class="t">reference</th><th class="t">hypothesis</th><th>1-best</th><th>rescored</th></tr>${
      D.confusions.map(([r, h, a, b]) => `<tr><td class="t mono">${r ? esc(r) : "<i>(insertion)</i>"}</td><td class="t mono">${h ? esc(h) : "<i>(deletion)</i>"}</td><td>${a}</td><td>${b}</td></tr>`).join("")}</table></div>`;
  }
  if (D.systems) {
    s += `<div><h2>Systems chosen</h2><table><tr><th class="t">system</th><th>1-best</th><th>rescored</th></tr>${
      D.systems.map(([n, a, b]) => `<tr><td class="t mono">${esc(n)}</td><td>${a}</td><td>${b}</td></tr>`).join("")}</table>
      <p class="small">how many segments' 1-best and chosen candidate each system produced (a candidate that several systems produced counts for each)</p></div>`;
  }
  document.getElementById("tables").innerHTML = s;
}
document.querySelector("#utts thead tr").innerHTML = COLS.map(([k, label, cls]) => `<th data-key="${k}" data-cls="${cls || ""}">${label}</th>`).join("");
document.getElementById("filters").innerHTML = Object.keys(FILTERS).map(f => {
  const n = D.utterances.filter(FILTERS[f]).length;
  return `<button data-f="${f}">${f} (${n})</button>`;
}).join("");
document.getElementById("filters").addEventListener("click", e => {
  if (!e.target.dataset.f) return;
  filter = e.target.dataset.f; opened.clear();
  history.replaceState(null, "", "#filter=" + filter); render();
});
document.querySelector("#utts thead").addEventListener("click", e => {
  const key = e.target.dataset.key; if (!key) return;
  sortDir = key === sortKey ? -sortDir : 1; sortKey = key; render();
});
document.querySelector("#utts tbody").addEventListener("click", e => {
  const tr = e.target.closest("tr.row"); if (!tr) return;
  const i = +tr.dataset.i; opened.has(i) ? opened.delete(i) : opened.add(i); render();
});
document.querySelector("#utts tbody").addEventListener("toggle", e => {
  const d = e.target; if (d.tagName !== "DETAILS" || !d.open || d.dataset.i === undefined) return;
  d.querySelector("div").innerHTML = featureTable(D.utterances[+d.dataset.i]);
}, true);
window.addEventListener("hashchange", () => { readHash(); render(); });
summary(); tables(); readHash(); render();
</script></body></html>
"""
