"""``lm-train export``: a checkpoint becomes a model bundle (ONNX graphs, vocabulary, manifest).

The bundle format is documented once, in ``lmserve/core/bundle.py``, which reads and validates it; this module writes
it. Export checks its own work: the exported sentences graph is run with ONNX Runtime on held-out text and compared
with PyTorch token by token, and the manifest records the difference together with the held-out perplexity and the
log Z statistics that say how far self-normalised scores are from log-probabilities.

The bundle's ``normalisation`` is decided by those measurements, not by the objective's intent
(``normalisation_label``): a head served through its normalised scores is ``exact``; a head served through its
unnormalised scores (a sampled objective or the log Z penalty) is ``self-normalised`` only when the held-out log Z is
close to 0 and steady (|mean| <= ``SELFNORM_MAX_ABS_MEAN``, std <= ``SELFNORM_MAX_STD``), else ``unnormalised``.
On PTB (benchmarks/results/normalisation_labels.json) NCE and the models trained with the penalty pass (|mean| <=
0.06, std <= 0.24), except negative sampling with it (0.33 ± 0.18); IS without the penalty (1.49 ± 1.47), negative
sampling (3.05 ± 0.73), BlackOut (0.83 ± 1.01) and β-NCE (-0.38 ± 0.30) do not.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lmserve.core.atomic import replacing_folder
from lmserve.core.bundle import (  # the format, defined once where it is read (no torch there)
    FORMAT,
    FORMAT_VERSION,
    GRAPH_FILES,
    MANIFEST_FILE,
    OPEN_GRAPH_FILE,
    SUBWORD_FORMAT_VERSION,
    VOCAB_FILE,
    WEIGHT_STORAGES,
)
from lmserve.training import objectives
from lmserve.training.batching import SentenceBatches, StreamBatches, sentence_start_id
from lmserve.training.checkpoint import load_model_for_eval, resolve_checkpoint
from lmserve.training.config import expand_data_path
from lmserve.training.corpus import directed, file_fingerprint
from lmserve.training.evaluate import evaluate
from lmserve.training.heads.base import per_candidate
from lmserve.training.model import LSTMLM
from lmserve.training.prepared import open_corpus
from lmserve.training.subword import MODEL_FILE, checkpoint_subword_model, per_word
from lmserve.training.weight_storage import store_weights

OPSET = 17
# Exact fp32 graphs must reproduce PyTorch to this per-token tolerance, or export fails.
PARITY_TOLERANCE = 1e-4
# Unnormalised scores count as self-normalised when the held-out log Z (nats per token) stays this close to 0: the
# self-normalisation target of this project (BENCHMARKS.md, selfnorm_ptb.json). A mean of 0.1 biases a sentence's
# score by 0.1 nats a word (perplexity within 10.5%); the spread says how far single words stray.
SELFNORM_MAX_ABS_MEAN = 0.1
SELFNORM_MAX_STD = 0.5


def normalisation_label(self_normalised: bool, logz_mean: float, logz_std: float) -> str:
    """The bundle's ``normalisation``: "exact" for graphs that normalise; for graphs that serve the head's
    unnormalised scores, "self-normalised" when the measured held-out log Z is within the thresholds above, else
    "unnormalised" (scores that are not log-probabilities and must not be mixed with probabilities)."""
    if not self_normalised:
        return "exact"
    if abs(logz_mean) <= SELFNORM_MAX_ABS_MEAN and logz_std <= SELFNORM_MAX_STD:
        return "self-normalised"
    return "unnormalised"


class SentencesGraph(nn.Module):
    """[B, T] inputs, targets and lengths, and the LSTM state to start from -> per-token scores of the targets, 0 at
    padding. Whole sentences start from zeros; the scorer continues hypothesis suffixes from their branch point."""

    def __init__(self, model: LSTMLM, self_normalised: bool):
        super().__init__()
        self.model = model
        self.score = model.head.target_score if self_normalised else model.head.target_logprob

    def forward(self, input_ids, target_ids, lengths, h0=None, c0=None):
        hidden, _ = self.model(input_ids.transpose(0, 1), None if h0 is None else (h0, c0))
        hidden = hidden.transpose(0, 1)
        scores = self.score(hidden.reshape(-1, hidden.shape[-1]), target_ids.reshape(-1)).reshape(target_ids.shape)
        positions = torch.cumsum(torch.ones_like(target_ids), dim=1)  # 1..T, built from tensors to stay dynamic
        return torch.where(positions <= lengths.unsqueeze(1), scores, torch.zeros_like(scores))


class OpenSentencesGraph(nn.Module):
    """The ``sentences`` graph with the targets' spellings: ``target_chars`` [B, T, C] holds, at each position whose
    target is a word outside the vocabulary (read as <unk>), that word's character ids (``charcnn.spell``, padded
    with 0), and 0s elsewhere. Those positions are scored from the spelling (``LinearHead.spelled_logprob``, or the
    spelled word's unnormalised score for a self-normalised model), the rest as ``SentencesGraph`` scores them."""

    def __init__(self, model: LSTMLM, self_normalised: bool, unk_id: int = 0):
        super().__init__()
        self.model = model
        self.self_normalised = self_normalised
        self.unk_id = unk_id
        self.score = model.head.target_score if self_normalised else model.head.target_logprob

    def forward(self, input_ids, target_ids, lengths, h0, c0, target_chars):
        hidden, _ = self.model(input_ids.transpose(0, 1), (h0, c0))
        hidden = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])
        scores = self.score(hidden, target_ids.reshape(-1))
        chars = target_chars.reshape(-1, target_chars.shape[-1])
        spelled = chars[:, 0] != 0
        rows = torch.nonzero(spelled).reshape(-1)
        head, at = self.model.head, hidden.index_select(0, rows)
        if self.self_normalised:
            opened = head.spelled_score(at, chars.index_select(0, rows))
        else:
            opened = head.spelled_logprob(at, chars.index_select(0, rows), self.unk_id)
        scores = torch.where(spelled, torch.zeros_like(scores).scatter(0, rows, opened), scores).reshape(
            target_ids.shape
        )
        positions = torch.cumsum(torch.ones_like(target_ids), dim=1)
        return torch.where(positions <= lengths.unsqueeze(1), scores, torch.zeros_like(scores))


class StepGraph(nn.Module):
    """One LSTM step over ``prev_ids``; scores of the candidates (or of the whole vocabulary) for the next word."""

    def __init__(self, model: LSTMLM, self_normalised: bool, full: bool):
        super().__init__()
        self.model = model
        self.self_normalised = self_normalised
        self.full = full

    def forward(self, prev_ids, h, c, candidates=None):
        hidden, (h_out, c_out) = self.model(prev_ids.unsqueeze(0), (h, c))
        hidden = hidden[0]
        head = self.model.head
        if self.full:
            return (head.scores(hidden) if self.self_normalised else head.log_probs(hidden)), h_out, c_out
        if self.self_normalised:  # K dot products per row, no normaliser
            return per_candidate(head.target_score, hidden, candidates), h_out, c_out
        return head.candidate_logprobs(hidden, candidates), h_out, c_out


def spelling_fields(speller) -> dict:
    """The manifest's ``spelling``: how the scorer spells a word for the open graph (``core.bundle``)."""
    return {
        "chars": [c for c, _ in sorted(speller.inventory.items(), key=lambda item: item[1])],
        "first_char_id": min(speller.inventory.values(), default=3),
        "max_chars": speller.max_chars,
        "pad": 0,
        "bow": 1,
        "eow": 2,
    }


def export_onnx(module: nn.Module, args: tuple, path: Path, inputs: list[str], outputs: list[str], axes: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter warns about every traced shape; parity is checked
        torch.onnx.export(
            module,
            args,
            str(path),
            dynamo=False,
            opset_version=OPSET,
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=axes,
            do_constant_folding=True,
        )


def export_graphs(model: LSTMLM, self_normalised: bool, out: Path) -> None:
    lstm = model.lstm
    batch = {0: "batch"}
    state = {1: "batch"}
    ids = torch.tensor([[1, 5, 6], [1, 7, 2]])
    zeros = torch.zeros(lstm.num_layers, 2, lstm.hidden_size)
    per_token = {0: "batch", 1: "time"}
    sentence_axes = {
        "input_ids": per_token,
        "target_ids": per_token,
        "lengths": batch,
        "h0": state,
        "c0": state,
        "logprobs": per_token,
    }
    export_onnx(
        SentencesGraph(model, self_normalised),
        (ids, ids.roll(-1, 1), torch.tensor([3, 2]), zeros, zeros),
        out / GRAPH_FILES["sentences"],
        ["input_ids", "target_ids", "lengths", "h0", "c0"],
        ["logprobs"],
        sentence_axes,
    )
    prev = torch.tensor([1, 5])
    state_axes = {"h": state, "c": state, "h_out": state, "c_out": state, "prev_ids": batch}
    export_onnx(
        StepGraph(model, self_normalised, full=False),
        (prev, zeros, zeros, torch.tensor([[5, 6, 7], [2, 3, 4]])),
        out / GRAPH_FILES["step"],
        ["prev_ids", "h", "c", "candidates"],
        ["logprobs", "h_out", "c_out"],
        {**state_axes, "candidates": {0: "batch", 1: "candidates"}, "logprobs": {0: "batch", 1: "candidates"}},
    )
    export_onnx(
        StepGraph(model, self_normalised, full=True),
        (prev, zeros, zeros),
        out / GRAPH_FILES["step_full"],
        ["prev_ids", "h", "c"],
        ["logprobs", "h_out", "c_out"],
        {**state_axes, "logprobs": batch},
    )
    speller = model.head.speller()
    if speller is not None:  # a head that spells: the open-vocabulary sentences graph too
        chars = torch.zeros(2, 3, speller.max_chars + 2, dtype=torch.long)
        chars[0, 1, :3] = torch.tensor([1, 3, 2])  # one spelled target, so that the traced graph has the branch
        export_onnx(
            OpenSentencesGraph(model, self_normalised),
            (ids, ids.roll(-1, 1), torch.tensor([3, 2]), zeros, zeros, chars),
            out / OPEN_GRAPH_FILE,
            ["input_ids", "target_ids", "lengths", "h0", "c0", "target_chars"],
            ["logprobs"],
            {**sentence_axes, "target_chars": per_token},
        )


def quantize_graphs(out: Path) -> None:
    """int8 weights, activations quantised on the fly (ONNX Runtime dynamic quantisation)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    for name in [*GRAPH_FILES.values(), OPEN_GRAPH_FILE]:
        fp32 = out / name
        if not fp32.exists():  # the open graph, for heads that spell only
            continue
        int8 = out / f"{fp32.stem}.int8.onnx"
        quantize_dynamic(fp32, int8, weight_type=QuantType.QInt8)
        int8.replace(fp32)


def heldout_check(model: LSTMLM, self_normalised: bool, graph: Path, corpus, batches: SentenceBatches) -> dict:
    """Run the exported sentences graph with ONNX Runtime next to PyTorch on every held-out sentence."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    reference = SentencesGraph(model, self_normalised).eval()
    total, tokens, max_diff = 0.0, 0, 0.0
    with torch.no_grad():
        for batch in batches.batches():
            inputs, targets = batch.inputs.T.contiguous(), batch.targets.T.contiguous()
            lengths = batch.mask.sum(0)
            zeros = np.zeros((model.lstm.num_layers, len(lengths), model.lstm.hidden_size), dtype=np.float32)
            feed = {"input_ids": inputs.numpy(), "target_ids": targets.numpy(), "lengths": lengths.numpy()}
            got = session.run(None, {**feed, "h0": zeros, "c0": zeros})[0]
            want = reference(inputs, targets, lengths).numpy()
            max_diff = max(max_diff, float(np.abs(got - want).max()))
            total += float(got.sum(dtype=np.float64))
            tokens += int(lengths.sum())
    return {"score_ppl": math.exp(-total / tokens), "max_abs_diff": max_diff}


def open_check(model: LSTMLM, self_normalised: bool, graph: Path, corpus, batches: SentenceBatches, vocab) -> dict:
    """The open-vocabulary graph against PyTorch on held-out sentences, every target scored from its spelling as if
    it were outside the vocabulary (the held-out text's own OOVs are <unk> by now: their spellings are gone)."""
    import onnxruntime as ort

    from lmserve.training.heads.charcnn import PAD, spell

    speller = model.head.speller()
    table = np.full((len(vocab), speller.max_chars + 2), PAD, dtype=np.int64)
    for i, word in enumerate(vocab.tokens):
        spelled = spell(word, speller.inventory, speller.max_chars)
        table[i, : len(spelled)] = spelled
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    reference = OpenSentencesGraph(model, self_normalised).eval()
    max_diff = 0.0
    with torch.no_grad():
        for batch in batches.batches():
            inputs, targets = batch.inputs.T.contiguous(), batch.targets.T.contiguous()
            lengths = batch.mask.sum(0)
            chars = torch.from_numpy(table[targets.numpy()])
            zeros = torch.zeros(model.lstm.num_layers, len(lengths), model.lstm.hidden_size)
            feed = [inputs, targets, lengths, zeros, zeros, chars]
            names = ["input_ids", "target_ids", "lengths", "h0", "c0", "target_chars"]
            got = session.run(None, {n: t.numpy() for n, t in zip(names, feed, strict=True)})[0]
            want = reference(*feed).numpy()
            max_diff = max(max_diff, float(np.abs(got - want).max()))
    return {"open_max_abs_diff": max_diff}


def training_data(ckpt: Path, cfg) -> list[dict]:
    """The training files' fingerprints, recorded when the run started (or taken now for older checkpoints)."""
    state = json.loads((ckpt / "state.json").read_text())
    return state.get("data_fingerprint") or [file_fingerprint(expand_data_path(cfg.data.train))]


def export_bundle(
    checkpoint: str | Path,
    out: str | Path,
    *,
    heldout: str | None = None,
    quantize: str | None = None,
    exact: bool = False,
    weights: str = "fp32",
) -> dict:
    """Write the bundle atomically and return its manifest. ``exact``: normalised graphs whatever the objective (a
    sampled model's exact probabilities, at the full softmax's cost per token). ``weights``: how ``weights.bin``
    stores the graphs' weights (``training.weight_storage``); the held-out check runs on the stored graphs, so the
    manifest's ``score_ppl`` is the shipped bundle's."""
    if quantize not in (None, "int8"):
        raise ValueError(f"--quantize {quantize!r}: expected int8")
    if weights not in WEIGHT_STORAGES:
        raise ValueError(f"--weights {weights!r}: expected one of {', '.join(WEIGHT_STORAGES)}")
    if quantize and weights != "fp32":
        raise ValueError(
            f"--quantize int8 with --weights {weights}: dynamic quantisation already stores int8 weights (and computes "
            "in int8); --weights fp16/int8 narrows the storage of float32 graphs. Choose one"
        )
    ckpt = resolve_checkpoint(checkpoint)
    cfg, vocab, model = load_model_for_eval(ckpt)
    model.eval()
    model.head = model.head.frozen()
    self_normalised = objectives.self_normalised(cfg) and not exact  # decided by head and objective together
    heldout = heldout or expand_data_path(cfg.data.valid)
    subword = checkpoint_subword_model(cfg, ckpt)
    corpus = directed(open_corpus(heldout, "valid", vocab, cfg.data.lowercase, subword), cfg.data.direction)
    stream_trained = cfg.data.mode == "stream"
    start_id = sentence_start_id(cfg.data.mode, vocab)
    batches = SentenceBatches(corpus, start_id, vocab.eos_id, cfg.train.eval_batch_size, shuffle=False)
    exact = evaluate(model, batches, vocab.unk_id)
    stream = {}
    if cfg.data.mode == "stream" and corpus.num_words + corpus.num_sentences >= 2 * cfg.train.eval_batch_size:
        # trained with state carried across sentences, scored from here on sentence by sentence: measure both
        carried = StreamBatches(corpus, vocab.eos_id, cfg.train.eval_batch_size, cfg.train.bptt)
        stream = {"stream_ppl": evaluate(model, carried, vocab.unk_id).ppl}
    out = Path(out)
    with replacing_folder(out) as tmp:
        export_graphs(model, self_normalised, tmp)
        if quantize:
            quantize_graphs(tmp)
        graph_files = [p.name for p in sorted(tmp.glob("*.onnx"))]
        stored = store_weights(tmp, graph_files, weights)
        check = heldout_check(model, self_normalised, tmp / GRAPH_FILES["sentences"], corpus, batches)
        speller = model.head.speller()
        if speller is not None:
            check |= open_check(model, self_normalised, tmp / OPEN_GRAPH_FILE, corpus, batches, vocab)
        worst = max(check["max_abs_diff"], check.get("open_max_abs_diff", 0.0))
        if not quantize and weights == "fp32" and worst > PARITY_TOLERANCE:
            raise RuntimeError(
                f"exported graph differs from PyTorch by {worst:.2e} per token "
                f"(tolerance {PARITY_TOLERANCE}) on {heldout}"
            )
        vocab.save(tmp / VOCAB_FILE)
        vocab_fields = {"file": VOCAB_FILE, "size": len(vocab), "unk": vocab.unk, "bos": "<s>", "eos": "</s>"}
        words = {}
        if subword:
            (tmp / MODEL_FILE).write_bytes(subword.read_bytes())
            vocab_fields |= {"type": "subword", "subword_model": MODEL_FILE}
            words = per_word(exact, corpus)
        manifest = {
            "format": FORMAT,
            "format_version": SUBWORD_FORMAT_VERSION if subword else FORMAT_VERSION,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "head": cfg.head.type,
            **({"sentence_start": "</s>"} if stream_trained else {}),
            **({"direction": "backward"} if cfg.data.direction == "backward" else {}),
            "normalisation": normalisation_label(self_normalised, exact.logz_mean, exact.logz_std),
            "vocab": vocab_fields,
            "text": {"tokenizer": "whitespace", "lowercase": cfg.data.lowercase},
            "model": {
                "layers": cfg.model.layers,
                "hidden_size": cfg.model.hidden_size,
                "embedding_size": cfg.model.embedding_size,
                "projection_size": cfg.model.projection_size,
            },
            "graphs": dict(GRAPH_FILES) | ({"sentences_open": OPEN_GRAPH_FILE} if speller is not None else {}),
            **({"spelling": spelling_fields(speller)} if speller is not None else {}),
            "opset": OPSET,
            "quantization": "int8-dynamic" if quantize else None,
            "weights": stored,
            "heldout": {
                "file": heldout,
                "sentences": corpus.num_sentences,
                "tokens": exact.tokens,
                "oov_rate": corpus.oov_rate,
                "ppl": exact.ppl,
                "ppl_no_oov": exact.ppl_no_oov,
                "logz_mean": exact.logz_mean,
                "logz_std": exact.logz_std,
                **stream,
                **check,
                **words,
            },
            "training": {"checkpoint": str(ckpt), "config": cfg.to_dict(), "data": training_data(ckpt, cfg)},
            "files": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(tmp.iterdir())},
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def export_warnings(manifest: dict) -> list[str]:
    """What the person exporting should know before using the bundle: scores that are not log-probabilities, and a
    model trained in stream mode (state carried across sentences) that every scorer runs sentence by sentence."""
    held = manifest["heldout"]
    out = []
    if manifest["normalisation"] == "unnormalised":
        out.append(
            f"scores are unnormalised: held-out log Z {held['logz_mean']:.2f} ± {held['logz_std']:.2f} (self-normalised "
            f"needs |mean| <= {SELFNORM_MAX_ABS_MEAN} and std <= {SELFNORM_MAX_STD}); use them as a log-linear feature, "
            "not for per-word interpolation"
        )
    if "stream_ppl" in held and manifest.get("direction") != "backward":  # (backward: rescored sentence by sentence)
        out.append(
            f"the model was trained in stream mode: held-out perplexity {held['stream_ppl']:.2f} as a stream, "
            f"{held['ppl']:.2f} sentence by sentence; rescore with the state carried across a document's utterances "
            "(lm-rescore tune/nbest --context) to get the stream's figure"
        )
    return out
