"""The neural scorer on the GPU vs on the CPU of the same machine -> gpu_scorer.json

    python -m benchmarks.gpu_scorer                                       # a machine with an NVIDIA GPU
    python -m benchmarks.gpu_scorer --device cpu --lists 20 --steps 20 --results /tmp/gpu_scorer   # smoke test

Two measurements, each of a scorer on ``--device`` beside the same bundle's scorer on the CPU, taking turns
(``benchmarks.common.time_interleaved``): ``gpu_lists_per_s`` (dev_other 30-best lists through ``Scorer.score_nbest``;
with cuda, fp32 and fp16, the faster of those within ``rescoring.precision.TOKEN_BOUND`` of the CPU's scores, with
the ``parity`` of each and onnxruntime's ``op_profile``; the run stops when more than a fifth of the words are
unknown to the bundle) and ``next_words_p99_ms`` (a batched decoder step, beam ``--beam`` x ``--decoders``, states
kept on the device; ``host_states_p99_ms`` copies them to numpy and back each step). The machine needs
onnxruntime-gpu with its CUDA libraries (docs/bundles.md, "GPU scoring"), torch, the bundle (``--bundle``) and the
lists (``--list``). Figures and the full description: docs/benchmarks/scorer.md ("The scorer on a GPU").
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

import benchmarks.common as common
from benchmarks.common import ROOT, time_interleaved, write_result
from benchmarks.decoding import percentiles
from benchmarks.serve_harness import DEV_OTHER
from lmserve.core.textnorm import PRESETS
from lmserve.rescoring.nbest import NBestList, read_nbest
from lmserve.rescoring.precision import TOKEN_BOUND
from lmserve.rescoring.rescore import LanguageModels
from lmserve.rescoring.scorer import BOS, Scorer, SentenceScore
from lmserve.rescoring.scorer_args import add_device_argument

BUNDLE = ROOT / "var" / "bundles" / "demo"


# at most this share of the lists' words unknown to the bundle; dev_other's: 4.9% to a 50k vocabulary of English
MAX_UNKNOWN = 0.2


def scored_lists(scorer: Scorer, lists: list[list[str]], per_call: int) -> list[list[SentenceScore]]:
    """Every list's scores, ``per_call`` lists a ``score_nbest`` call."""
    return [s for first in range(0, len(lists), per_call) for s in scorer.score_nbest(lists[first : first + per_call])]


def lists_seconds(scorer: Scorer, lists: list[list[str]], per_call: int) -> float:
    start = time.perf_counter()
    scored_lists(scorer, lists, per_call)
    return time.perf_counter() - start


def graph_share(scorer: Scorer, lists: list[list[str]], per_call: int) -> dict:
    """One more pass of :func:`lists_seconds` with every graph run timed: the share of the wall time spent inside
    onnxruntime (the rest is Python: reading, batching, per-word sums) and the runs per call."""
    spent = []
    for session in scorer.sessions.values():

        def timed(*args, run=session.run, **kwargs):
            start = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - start)

        session.run = timed
    try:
        seconds = lists_seconds(scorer, lists, per_call)
    finally:
        for session in scorer.sessions.values():
            del session.run
    return {"graph_share": sum(spent) / seconds, "runs_per_call": len(spent) / -(-len(lists) // per_call)}


def op_profile(scorer: Scorer, lists: list[list[str]], per_call: int, top: int = 12) -> dict:
    """One more pass with onnxruntime's profiler on twins of the scorer's sessions (made as the scorer's): per graph
    its runs and their time, and per kind of node (graph, op, provider) its summed time, the ``top`` kinds by time.
    On the CUDA provider a node's time is what the host spent on it, launching kernels or waiting for the device (a
    node whose output's size the host must know, such as NonZero, or a copy to the host); a run's time beyond its
    nodes' is onnxruntime's own."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = scorer.options.intra_op_num_threads
    options.inter_op_num_threads = 1
    options.enable_profiling = True
    plain = dict(scorer.sessions)
    events: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in plain:
            options.profile_file_prefix = str(Path(tmp) / name)
            source = scorer.graph_source(name)  # the bundle's graph, or its float16 rewrite
            scorer.sessions[name] = ort.InferenceSession(source, options, providers=scorer.session_providers())
        try:
            lists_seconds(scorer, lists, per_call)
        finally:
            profiled, scorer.sessions = scorer.sessions, plain
        for name, session in profiled.items():
            events[name] = json.loads(Path(session.end_profiling()).read_text())
    graphs, kinds = {}, {}
    for name, trace in events.items():
        runs = [e["dur"] for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"]
        if runs:
            graphs[name] = {"runs": len(runs), "run_ms": sum(runs) / 1000}
        for e in trace:
            if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
                key = (name, e["args"].get("op_name", "?"), e["args"].get("provider", "?"))
                kinds.setdefault(key, []).append(e["dur"])
    node_us = sum(sum(d) for d in kinds.values())
    ranked = sorted(kinds.items(), key=lambda kv: -sum(kv[1]))
    return {
        "graphs": graphs,
        "run_ms": sum(g["run_ms"] for g in graphs.values()),
        "node_ms": node_us / 1000,
        "providers": sorted({provider for _, _, provider in kinds}),
        "top": [
            {"graph": g, "op": op, "provider": p, "ms": sum(d) / 1000, "share": sum(d) / node_us, "nodes": len(d)}
            for (g, op, p), d in ranked[:top]
        ],
    }


def parity(want: list[list[SentenceScore]], got: list[list[SentenceScore]]) -> dict:
    """How far ``got``'s scores of the same lists are from ``want``'s: the largest token and sentence differences, and
    the share of lists whose best hypothesis by the neural LM alone is the same (what reranking would notice)."""
    tokens = sentences = 0.0
    same = 0
    for want_list, got_list in zip(want, got, strict=True):
        for w, g in zip(want_list, got_list, strict=True):
            tokens = max(tokens, float(np.abs(w.token_logprobs - g.token_logprobs).max()))
            sentences = max(sentences, abs(w.logprob - g.logprob))
        same += int(np.argmax([s.logprob for s in want_list]) == np.argmax([s.logprob for s in got_list]))
    return {"token_max_abs_diff": tokens, "sentence_max_abs_diff": sentences, "lm_best_agreement": same / len(want)}


def step_latencies(scorer: Scorer, rows: int, steps: int, device_states: bool, seed: int = 0) -> list[float]:
    """Milliseconds of each of ``steps`` chained ``step`` runs over ``rows`` states from the sentence start, each
    hypothesis reading a word drawn from the vocabulary (the words change the work of no head but the adaptive's
    clusters, which a fixed seed keeps the same for every scorer)."""
    rng = np.random.default_rng(seed)
    words = rng.integers(BOS + 1, len(scorer.bundle.tokens), (steps + 1, rows, 1))
    prev = np.full(rows, BOS)
    h, c = scorer.zero_state(rows)
    out = []
    for step in range(steps):
        start = time.perf_counter()
        _, h, c = scorer.next_word_scores(prev, h, c, words[step], device_states=device_states)
        out.append((time.perf_counter() - start) * 1000)
        prev = words[step, :, 0]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_argument(parser, default="cuda")  # cpu: a smoke test, the measured scorer being the CPU one
    parser.add_argument("--bundle", type=Path, default=BUNDLE)
    parser.add_argument("--list", type=Path, default=DEV_OTHER, help="n-best lists, any format lm-rescore reads")
    parser.add_argument("--normalize", default="", help="textnorm preset (default: the bundle's own)")
    parser.add_argument("--lists", type=int, default=500, help="the first this many lists of --list")
    parser.add_argument("--lists-per-call", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-batch-tokens", type=int, default=0, help="of the --device scorer (0: its default)")
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads of each scorer (0: all cores)")
    parser.add_argument("--decoders", type=int, default=16)
    parser.add_argument("--beam", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300, help="measured decoder steps per way")
    parser.add_argument("--warmup", type=int, default=20, help="steps before each way, not measured")
    common.add_results_option(parser)
    args = parser.parse_args(argv)
    common.use_results(args.results)

    normalizer = PRESETS[args.normalize] if args.normalize else None

    def scorer(device: str, precision: str = "fp32") -> Scorer:
        return Scorer(
            args.bundle,
            threads=args.threads,
            device=device,
            normalizer=normalizer,
            max_batch_tokens=args.max_batch_tokens if device == args.device else 0,
            precision=precision,
        )

    scorers = {device: scorer(device) for device in (args.device, "cpu")}  # one scorer for both with --device cpu
    measured, cpu = scorers[args.device], scorers["cpu"]
    nbest = NBestList(read_nbest(args.list).entries[: args.lists], args.list.name)
    # text in the wrong form makes every word <unk>, which times nothing real: the hypotheses of a list become the same
    # string of <unk>, so the CPU's prefix sharing reads almost nothing and the adaptive head's tails never run (the
    # H100 figures at 00274f1: a lower-case bundle, the upper-case preset)
    models = LanguageModels(cpu, None, cpu.normalizer, {"lm": str(args.bundle), "normalize": args.normalize or None})
    unknown = models.check_vocabulary(nbest, MAX_UNKNOWN)
    lists = [[h.text for h in entry.hypotheses] for entry in nbest]
    for each in scorers.values():  # warm-up: sessions' first runs allocate
        lists_seconds(each, lists[: args.lists_per_call], args.lists_per_call)
    fp16_error = None
    if args.device == "cuda":  # the newest path, never run on a GPU before: its failure costs its own figures only
        try:
            half = scorer("cuda", "fp16")
            lists_seconds(half, lists[: args.lists_per_call], args.lists_per_call)
            scorers["cuda_fp16"] = half
        except Exception as e:  # whatever it is, the fp32 figures must still come back
            fp16_error = f"{type(e).__name__}: {e}"
            print("the fp16 scorer failed:", fp16_error, flush=True)
    seconds = time_interleaved(
        {name: lambda s=each: lists_seconds(s, lists, args.lists_per_call) for name, each in scorers.items()},
        args.rounds,
    )
    scored = {name: scored_lists(each, lists, args.lists_per_call) for name, each in scorers.items()}
    # each GPU scorer against the CPU's (--device cpu: the CPU scorer against itself, the comparison run)
    agree = {name: parity(scored["cpu"], scored[name]) for name in scorers if name != "cpu" or args.device == "cpu"}
    print("parity with the CPU", json.dumps(agree), flush=True)
    graph_time = {name: graph_share(each, lists, args.lists_per_call) for name, each in scorers.items()}
    print("graph time", json.dumps(graph_time), flush=True)
    ops = op_profile(measured, lists, args.lists_per_call)
    print("op profile", json.dumps(ops), flush=True)
    # which provider ran each float16 node: one the CUDA provider lacks would run on the CPU, slowly but silently
    fp16_ops = op_profile(scorers["cuda_fp16"], lists, args.lists_per_call) if "cuda_fp16" in scorers else None

    rows = args.beam * args.decoders
    ways = {"device_states": (measured, True), "host_states": (measured, False), "cpu": (cpu, False)}
    if "cuda_fp16" in scorers:
        ways["fp16_device_states"] = (scorers["cuda_fp16"], True)
    steps = {}
    for way, (scorer, on_device) in ways.items():
        step_latencies(scorer, rows, args.warmup, on_device)
        steps[way] = percentiles(step_latencies(scorer, rows, args.steps, on_device))
        print(way, json.dumps(steps[way]), flush=True)

    # the headline: the faster of the GPU's precisions whose scores are within that precision's stated bound of the
    # CPU's (rule set before any GPU had run fp16); each precision's own figure is kept beside it
    held = [name for name in agree if agree[name]["token_max_abs_diff"] <= TOKEN_BOUND[scorers[name].precision]]
    headline = min(held, key=seconds.__getitem__, default=args.device)
    metrics = {
        "gpu_lists_per_s": len(lists) / seconds[headline],
        "gpu_fp32_lists_per_s": len(lists) / seconds[args.device],
        "cpu_lists_per_s": len(lists) / seconds["cpu"],
        "next_words_p99_ms": steps["device_states"]["p99_ms"],
        "next_words_p50_ms": steps["device_states"]["p50_ms"],
        "host_states_p99_ms": steps["host_states"]["p99_ms"],
        "cpu_next_words_p99_ms": steps["cpu"]["p99_ms"],
        "gpu_token_max_abs_diff": agree[args.device]["token_max_abs_diff"],
    }
    if "cuda_fp16" in scorers:
        metrics |= {
            "gpu_fp16_lists_per_s": len(lists) / seconds["cuda_fp16"],
            "fp16_next_words_p99_ms": steps["fp16_device_states"]["p99_ms"],
            **{f"fp16_{key}": value for key, value in agree["cuda_fp16"].items()},
        }
    extra = dict(
        device=args.device,
        gpu_precision=scorers[headline].precision,
        gpu_within_bound=headline in held,
        token_bound=TOKEN_BOUND,
        providers={device: s.sessions["step"].get_providers() for device, s in scorers.items()},
        precision={name: each.precision for name, each in scorers.items()},
        parity=agree,
        fp16_error=fp16_error,
        fp16_op_profile=fp16_ops,
        bundle=str(args.bundle),
        list=str(args.list),
        lists=len(lists),
        hypotheses=sum(len(hyps) for hyps in lists),
        lists_per_call=args.lists_per_call,
        max_batch_tokens={device: s.max_batch_tokens for device, s in scorers.items()},
        normalize=args.normalize or "the bundle's own",
        unknown_share=unknown,
        graph_time=graph_time,
        op_profile=ops,
        rounds=args.rounds,
        threads=args.threads,
        step={"decoders": args.decoders, "beam": args.beam, "rows": rows, "candidates": 1, "ways": steps},
        note="gpu_lists_per_s is the faster GPU precision within its bound of the CPU's scores (gpu_precision); "
        "other gpu_* and next_words_* are the --device scorer's in fp32 (named for the GPU it is meant for), cpu_* "
        "the CPU's, fp16_* the GPU's in float16; *_abs_diff from the CPU's scores of the same lists",
    )
    write_result("gpu_scorer", metrics, **extra)
    print({k: round(v, 3) for k, v in metrics.items()})
    return {"metrics": metrics, **extra}


if __name__ == "__main__":
    main()
