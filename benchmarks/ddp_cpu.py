"""torchrun on this CPU: 2 gloo ranks against 1 process on the same global batch -> ddp_cpu.json

    python -m benchmarks.ddp_cpu [--speed-steps 60] [--rounds 2]

Correctness: the PTB config of the fast run (configs/ptb_fast.toml, sentence mode, no dropout) trained for exactly 20
steps by ``torchrun --nproc-per-node=2`` and by one process on the same global batch of 20 sentences, as
``train.accumulate = 2`` (the two halves one after the other, as the two ranks take them; for NCE both then draw the
noise of the same halves) — full softmax, adaptive softmax and NCE, with SGD and with Adam. Figures: the largest
relative difference of any weight tensor (max |a - b| / max |a|) and the validation perplexities. One process that
takes the whole batch at once (``accumulate = 1``) is reported too: the two halves' padding and matrix shapes round
differently, and 20 steps of SGD at lr 1 grow those last-bit differences to about 2e-4, with or without ranks.

Speed: the same global batch of 64 sentences trained by 2 ranks x 1 thread and by 1 process x 2 threads, taking turns
for ``--rounds`` rounds; the ratio of training tokens/s (2 ranks / 1 process), median over rounds.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics

from safetensors.torch import load_file

from benchmarks.common import ROOT, write_result
from benchmarks.torchrun import lm_train_fit, run_fit
from lmserve.training.config import expand_data_path, load_config
from lmserve.training.corpus import encode_file
from lmserve.training.prepared import PreparedDataset, VocabSettings, prepare

CONFIG = ROOT / "configs" / "ptb_fast.toml"
RUNS = ROOT / "var" / "runs" / "ddp_cpu"
CASES = {
    "full": ['head.type="full"'],
    "adaptive": [],
    "nce": ['head.type="full"', 'objective.type="nce"', "objective.samples=500"],
}


def tokens_of_steps(steps: int) -> int:
    """The training tokens of the first ``steps`` steps of epoch 1: a token budget that stops both runs there."""
    from lmserve.training.batching import SentenceBatches

    cfg = load_config(CONFIG)
    vocab = PreparedDataset(ptb_dataset()).vocab
    corpus = encode_file(expand_data_path(cfg.data.train), vocab)
    plan = SentenceBatches(corpus, 1, 2, cfg.train.batch_size, shuffle=True, seed=cfg.train.seed)
    return sum(b.num_tokens for b in itertools.islice(plan.batches(0), steps))


def ptb_dataset():
    cfg = load_config(CONFIG)
    out = ROOT / "var" / "prepared" / "ptb"
    texts = {split: [expand_data_path(getattr(cfg.data, split))] for split in ("train", "valid", "test")}
    prepare(texts, out, VocabSettings(), workers=2)
    return out


def weights(run) -> dict:
    latest = (run / "checkpoints" / "latest").read_text().strip()
    return load_file(run / "checkpoints" / latest / "model.safetensors")


def max_relative_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)) for k in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--speed-steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    shutil.rmtree(RUNS, ignore_errors=True)
    data = ptb_dataset()
    budget = tokens_of_steps(20)
    common = [
        f'data.train="{data}"',
        f'data.valid="{data}"',
        f'data.test="{data}"',
        "model.dropout=0.0",
        "train.threads=1",
    ]
    common += [f"train.max_tokens={budget}"]
    cases = {}
    for (name, sets), optimizer in itertools.product(CASES.items(), ("sgd", "adam")):
        sets = [*common, *sets, f'optimizer.name="{optimizer}"', f"optimizer.lr={1.0 if optimizer == 'sgd' else 0.003}"]
        key = f"{name}-{optimizer}"
        one = run_fit(lm_train_fit(CONFIG, RUNS / f"{key}-1proc", *sets, "train.accumulate=2"), RUNS / f"{key}-1proc")
        whole = run_fit(lm_train_fit(CONFIG, RUNS / f"{key}-whole", *sets), RUNS / f"{key}-whole")
        two = run_fit(lm_train_fit(CONFIG, RUNS / f"{key}-2ranks", *sets, nproc=2), RUNS / f"{key}-2ranks")
        cases[key] = {
            "steps": 20,
            "tokens_seen": [one["tokens_seen"], two["tokens_seen"]],
            "max_param_rel_diff": max_relative_difference(
                weights(RUNS / f"{key}-1proc"), weights(RUNS / f"{key}-2ranks")
            ),
            "valid_ppl_1proc": one["valid"]["ppl"],
            "valid_ppl_2ranks": two["valid"]["ppl"],
            "test_ppl_1proc": one["test"]["ppl"],
            "test_ppl_2ranks": two["test"]["ppl"],
            "whole_batch_max_param_rel_diff": max_relative_difference(
                weights(RUNS / f"{key}-whole"), weights(RUNS / f"{key}-2ranks")
            ),
            "valid_ppl_whole_batch": whole["valid"]["ppl"],
        }
        print(key, cases[key], flush=True)

    speed_budget = f"train.max_tokens={tokens_of_steps(args.speed_steps)}"
    speeds = {"1proc_2threads": [], "2ranks_1thread": []}
    for r in range(args.rounds):
        one = run_fit(
            lm_train_fit(CONFIG, RUNS / f"speed-1proc-{r}", *common[:-1], speed_budget, "train.threads=2"),
            RUNS / f"speed-1proc-{r}",
        )
        two = run_fit(
            lm_train_fit(CONFIG, RUNS / f"speed-2ranks-{r}", *common[:-1], speed_budget, nproc=2),
            RUNS / f"speed-2ranks-{r}",
        )
        speeds["1proc_2threads"].append(one["tokens_per_s"])
        speeds["2ranks_1thread"].append(two["tokens_per_s"])
        print(r, {k: v[-1] for k, v in speeds.items()}, flush=True)
    ratios = [b / a for a, b in zip(speeds["1proc_2threads"], speeds["2ranks_1thread"], strict=True)]
    sgd = [c for k, c in cases.items() if k.endswith("sgd")]
    write_result(
        "ddp_cpu",
        {
            "max_param_rel_diff": max(c["max_param_rel_diff"] for c in sgd),
            "valid_ppl_1proc": cases["adaptive-sgd"]["valid_ppl_1proc"],
            "valid_ppl_2ranks": cases["adaptive-sgd"]["valid_ppl_2ranks"],
            "valid_ppl_equal_4_digits": all(
                f"{c['valid_ppl_1proc']:.4g}" == f"{c['valid_ppl_2ranks']:.4g}" for c in cases.values()
            ),
            "speed_ratio": statistics.median(ratios),
        },
        cases=cases,
        speed_tokens_per_s=speeds,
        speed_ratios=ratios,
        config=str(CONFIG.relative_to(ROOT)),
    )


if __name__ == "__main__":
    main()
