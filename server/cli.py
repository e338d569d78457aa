"""lm-serve: run the gRPC language-model service, or call one.

lm-serve serve --config serve.toml [--port 50051] [--replicas 2]
lm-serve client --server 127.0.0.1:50051 score [--model NAME] [--per-token] < sentences.txt
lm-serve client rescore dev.jsonl --profile dev_clean --out dev.rescored.jsonl
lm-serve client models
lm-serve client reload                      # load the config's models again (or: kill -HUP <server pid>)
lm-serve client --tls-ca ca.pem [--tls-cert client.pem --tls-key client.key] health
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from lmserve.core.command import add_common_arguments, parse_args, run_command
from lmserve.core.lines import read_lines
from lmserve.core.outputs import check_outputs
from lmserve.rescoring.client import DEFAULT_TARGET, LMServeClient, normalisation_name, ranked_lists
from lmserve.rescoring.nbest import FOLDER_FORMATS, FORMATS, MAX_WORDS, read_nbest, write_nbest
from lmserve.rescoring.nbest.checks import parse_defaults
from lmserve.rescoring.ngram import NgramError
from lmserve.rescoring.score_lines import FORMATS as SCORE_FORMATS
from lmserve.rescoring.score_lines import score_line
from lmserve.rescoring.scorer_args import add_device_argument
from lmserve.server.config import load_config
from lmserve.server.logs import setup_logging

SCORE_BATCH = 256  # sentences per ScoreSentences call: well under the default limit, and streams long inputs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lm-serve", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    add_common_arguments(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="load the models of a TOML config and serve them until SIGTERM/SIGINT")
    serve.add_argument("--config", required=True, type=Path, help="TOML config (server/config.py documents it)")
    serve.add_argument("--host", help="address to bind (default: the config's, else 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: the config's, else 50051; 0 = any free port)")
    serve.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0 = any free port, -1 = off)")
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_device_argument(serve, default=None, where="the config's server.device, else cpu")
    serve.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="run N server processes on ports PORT..PORT+N-1 (all free ones with --port 0) for clients that go "
        "round-robin over them (server/replicas.py); give each workers = 1",
    )
    serve.set_defaults(func=_serve)

    client = sub.add_parser("client", help="call a running server")
    client.add_argument(
        "--server",
        default=DEFAULT_TARGET,
        help="HOST:PORT, or ipv4:HOST:PORT,HOST:PORT for replicas (default: %(default)s)",
    )
    client.add_argument("--timeout", type=float, default=60.0, help="deadline of each call in seconds")
    client.add_argument("--tls", action="store_true", help="TLS with the system's root certificates")
    client.add_argument("--tls-ca", type=Path, help="PEM file of the CA that signed the server certificate (TLS)")
    client.add_argument("--tls-cert", type=Path, help="client certificate (PEM) for mutual TLS")
    client.add_argument("--tls-key", type=Path, help="its private key (PEM)")
    calls = client.add_subparsers(dest="call", required=True)

    score = calls.add_parser("score", help="one score per input line (ScoreSentences)")
    score.add_argument("--model", default="", help="model name (default: the server's default model)")
    score.add_argument("--input", default="-", help="sentences, one per line (default: standard input)")
    score.add_argument("--per-token", action="store_true", help="also print every token's score (</s> last)")
    score.add_argument("--log10", action="store_true", help="log10 instead of natural log")
    score.add_argument(
        "--score", choices=("neural", "ngram", "interpolated"), default="neural", help="which model's score to print"
    )
    score.add_argument(
        "--format", choices=SCORE_FORMATS, default="text", help="text or jsonl, laid out as lm-rescore score's"
    )
    score.set_defaults(func=_score)

    rescore = calls.add_parser("rescore", help="rerank an n-best/k-best list (RescoreNBest, or RescoreKBest)")
    rescore.add_argument("list", type=Path, help="n-best/k-best list (file or folder; the format is detected)")
    rescore.add_argument("--format", choices=sorted(FORMATS), help="override format detection")
    rescore.add_argument("--references", nargs="+", type=Path, help="reference files, one sentence per line")
    rescore.add_argument(
        "--feature-default",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="the value of feature NAME for hypotheses that lack it (default: such a hypothesis is an error), as "
        "lm-rescore's",
    )
    rescore.add_argument(
        "--max-words", type=int, default=MAX_WORDS, help="longest hypothesis, in words (default: %(default)s)"
    )
    rescore.add_argument("--model", default="")
    rescore.add_argument("--profile", default="", help="a weights profile of the model (see `info`)")
    rescore.add_argument("--weights", default="", help="inline weights instead: am=1,neural=0.3,length=0.5")
    rescore.add_argument(
        "--define", action="append", default=[], metavar="NAME=EXPR", help="e.g. am=0.6*decoder+0.4*ctc"
    )
    rescore.add_argument("--lambda", dest="lam", type=float, default=0.0, help="λ of the interp feature")
    rescore.add_argument("--kbest", action="store_true", help="MT k-best lists: RescoreKBest, evaluated with BLEU")
    rescore.add_argument("--out", type=Path, help="reranked lists to write (with every feature and 'rescore')")
    rescore.add_argument("--out-format", choices=sorted(FORMATS), default="jsonl")
    rescore.add_argument("--html", type=Path, help="HTML error analysis to write (needs references)")
    rescore.set_defaults(func=_rescore, conflicts=_rescore_conflicts)

    models = calls.add_parser("models", help="the server's models (ListModels), as JSON")
    models.set_defaults(func=_models)
    info = calls.add_parser("info", help="one model's manifest, n-gram and profiles (GetModelInfo), as JSON")
    info.add_argument("model", nargs="?", default="")
    info.set_defaults(func=_info)
    health = calls.add_parser("health", help="the server's health status (grpc.health.v1)")
    health.set_defaults(func=_health)
    reload = calls.add_parser("reload", help="load the server's models again (Admin.ReloadModels), as JSON")
    reload.set_defaults(func=_reload)
    return parser


def _serve(args) -> int:
    setup_logging(args.log_level)
    if args.replicas < 1:
        raise ValueError(f"--replicas {args.replicas}: expected at least 1")
    if args.replicas > 1:
        from lmserve.server.replicas import serve_replicas

        config = load_config(args.config)
        return serve_replicas(
            config, args.replicas, args.host, args.port, args.metrics_port, args.log_level, args.device
        )
    asyncio.run(_serve_async(args))
    # stopped cleanly: a repeated SIGTERM (service managers may send more than one) must not turn exit 0 into a kill
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    return 0


async def _serve_async(args) -> None:
    from lmserve.server.app import serve  # grpc.aio and the models load only for this command

    await serve(load_config(args.config), args.host, args.port, args.metrics_port, args.device)


def _client(args) -> LMServeClient:
    return LMServeClient(
        args.server, timeout=args.timeout, tls=args.tls, ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key
    )


def _score(args) -> int:
    if args.input == "-":
        sentences = read_lines(sys.stdin.buffer, "<stdin>")
    else:
        with open(args.input, "rb") as f:
            sentences = read_lines(f, args.input)
    with _client(args) as client:
        for start in range(0, len(sentences), SCORE_BATCH):
            batch = sentences[start : start + SCORE_BATCH]
            response = client.score_sentences(batch, args.model, args.per_token)
            for text, s in zip(batch, response.sentences, strict=True):
                if not s.HasField(args.score):
                    raise ValueError(f"model {response.model!r} gives no {args.score} score (no n-gram or no λ)")
                chosen = getattr(s, args.score)
                tokens = list(zip(s.tokens, chosen.token_logprobs, strict=True)) if args.per_token else None
                sys.stdout.write(score_line(text, chosen.logprob, s.oov, args.format, args.log10, tokens))
    return 0


def _rescore_conflicts(args) -> str | None:
    """What ``client rescore`` refuses at parse time (``command.parse_args``) rather than send to be refused."""
    inline = [
        flag
        for flag, given in (("--weights", args.weights), ("--define", args.define), ("--lambda", args.lam))
        if given
    ]
    if args.profile and inline:
        return (
            f"--profile with {inline[0]}: a profile carries its own weights, definitions and λ; give one or the other"
        )
    return None


def _rescore(args) -> int:
    check_outputs(
        {"--out": args.out, "--html": args.html},
        {"LIST": args.list, "--references": args.references},
        folders={"--out"} if args.out_format in FOLDER_FORMATS else (),
    )
    defaults = parse_defaults(args.feature_default)
    nbest = read_nbest(args.list, args.format, args.references, feature_defaults=defaults, max_words=args.max_words)
    weights = {}
    for item in filter(None, (x.strip() for x in args.weights.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--weights: {item!r} is not NAME=WEIGHT")
        weights[name.strip()] = float(value)
    combination = {
        "profile": args.profile,
        "weights": weights,
        "definitions": args.define,
        "interpolation_weight": args.lam,
    }
    with _client(args) as client:
        call = client.rescore_kbest if args.kbest else client.rescore_nbest
        result = call(nbest, args.model, **combination)
        info = client.model_info(result.model) if args.html else None
    if args.out:
        write_nbest(ranked_lists(result), args.out, args.out_format)
    if args.html:
        _write_html(args.html, nbest, result, info)
    summary = {"model": result.model, "profile": result.profile, "lists": len(result.lists)}
    summary["weights"] = {w.feature: w.weight for w in result.weights}
    if result.HasField("evaluation"):
        e = result.evaluation
        summary["evaluation"] = {
            "metric": e.metric,
            "first_pass": e.first_pass,
            "rescored": e.rescored,
            "oracle": e.oracle,
            "changed_choices": e.changed_choices,
            "bootstrap_p_value": e.bootstrap_p_value,
            "signature": e.signature,
        }
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    return 0


def _write_html(path: Path, nbest, result, info) -> None:
    """``lm-rescore nbest --html``'s page from the server's answer: its ranked lists (the chosen hypothesis first,
    each with its original rank), its report, and the model's normalisation."""
    from lmserve.rescoring.report_html import write_html

    if not result.HasField("evaluation"):
        raise ValueError("--html: the server returned no evaluation (the lists need references)")
    ranked = ranked_lists(result)
    chosen = [entry.hypotheses[0].rank - 1 for entry in ranked]
    rep = json.loads(result.evaluation.report_json)
    rep["weights"] = {w.feature: w.weight for w in result.weights}
    rep["setup"] = {"server model": result.model, "profile": result.profile, "lambda": result.interpolation_weight}
    rep["normalisation"] = normalisation_name(info.normalisation)
    write_html(path, rep, nbest, ranked, chosen)


def _models(args) -> int:
    with _client(args) as client:
        print(json.dumps(MessageToDict(client.list_models(), preserving_proto_field_name=True), indent=2))
    return 0


def _info(args) -> int:
    with _client(args) as client:
        print(json.dumps(MessageToDict(client.model_info(args.model), preserving_proto_field_name=True), indent=2))
    return 0


def _reload(args) -> int:
    with _client(args) as client:
        print(json.dumps(MessageToDict(client.reload_models(), preserving_proto_field_name=True), indent=2))
    return 0


def _health(args) -> int:
    with _client(args) as client:
        status = client.health()
    print(status)
    return 0 if status == "SERVING" else 1


def main(argv: list[str] | None = None) -> int:
    """A failed call ends in ``lm-serve: CODE: details`` (exit 1); errors, Ctrl-C and SIGTERM outside the server's own
    handling in one line (``core.command``); ``LMSERVE_DEBUG=1`` or ``--debug`` shows tracebacks."""
    args = parse_args(build_parser(), argv)

    def call() -> int:
        try:
            return args.func(args)
        except grpc.RpcError as e:
            if not hasattr(e, "code"):
                raise
            print(f"lm-serve: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1

    return run_command("lm-serve", call, args.debug, user_errors=(NgramError,))


if __name__ == "__main__":
    sys.exit(main())
