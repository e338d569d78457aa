"""torchrun on this CPU: 2 ranks x 1 thread against 1 process x 2 threads on the same global batch -> ddp_cpu.json

    python -m benchmarks.ddp_cpu [--speed-steps 60] [--rounds 2]

The PTB config of the fast run (configs/ptb_fast.toml, sentence mode, no dropout) for ``--speed-steps`` steps, the
two cases taking turns for ``--rounds`` rounds; the ratio of training tokens/s (2 ranks / 1 process), median over
rounds. That 2 ranks train what 1 process trains is tests/test_distributed.py's (this script's correctness half, whose
last figures ddp_cpu.json keeps under ``cases``, is retired).
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics

from benchmarks.common import ROOT, write_result
from benchmarks.torchrun import lm_train_fit, run_fit
from lmserve.training.config import expand_data_path, load_config
from lmserve.training.corpus import encode_file
from lmserve.training.prepared import PreparedDataset, VocabSettings, prepare

CONFIG = ROOT / "configs" / "ptb_fast.toml"
RUNS = ROOT / "var" / "runs" / "ddp_cpu"


def ptb_dataset():
    cfg = load_config(CONFIG)
    out = ROOT / "var" / "prepared" / "ptb"
    texts = {split: [expand_data_path(getattr(cfg.data, split))] for split in ("train", "valid", "test")}
    prepare(texts, out, VocabSettings(), workers=2)
    return out


def tokens_of_steps(data, steps: int) -> int:
    """The training tokens of the first ``steps`` steps of epoch 1: a token budget that stops both runs there."""
    from lmserve.training.batching import SentenceBatches

    cfg = load_config(CONFIG)
    corpus = encode_file(expand_data_path(cfg.data.train), PreparedDataset(data).vocab)
    plan = SentenceBatches(corpus, 1, 2, cfg.train.batch_size, shuffle=True, seed=cfg.train.seed)
    return sum(b.num_tokens for b in itertools.islice(plan.batches(0), steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--speed-steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    shutil.rmtree(RUNS, ignore_errors=True)
    data = ptb_dataset()
    sets = [f'data.{split}="{data}"' for split in ("train", "valid", "test")]
    sets += ["model.dropout=0.0", f"train.max_tokens={tokens_of_steps(data, args.speed_steps)}"]
    speeds = {"1proc_2threads": [], "2ranks_1thread": []}
    for r in range(args.rounds):
        one = run_fit(lm_train_fit(CONFIG, RUNS / f"1proc-{r}", *sets, "train.threads=2"), RUNS / f"1proc-{r}")
        two = run_fit(
            lm_train_fit(CONFIG, RUNS / f"2ranks-{r}", *sets, "train.threads=1", nproc=2), RUNS / f"2ranks-{r}"
        )
        speeds["1proc_2threads"].append(one["tokens_per_s"])
        speeds["2ranks_1thread"].append(two["tokens_per_s"])
        print(r, {k: v[-1] for k, v in speeds.items()}, flush=True)
    ratios = [b / a for a, b in zip(speeds["1proc_2threads"], speeds["2ranks_1thread"], strict=True)]
    write_result(
        "ddp_cpu",
        {"speed_ratio": statistics.median(ratios)},
        speed_tokens_per_s=speeds,
        speed_ratios=ratios,
        config=str(CONFIG.relative_to(ROOT)),
    )


if __name__ == "__main__":
    main()
