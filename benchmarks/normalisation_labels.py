"""The bundle label every PTB objective row gets under the measured rule -> normalisation_labels.json

    python -m benchmarks.normalisation_labels

No training: the rows and their log Z mean and standard deviation (measured on the PTB test text) are those recorded
in objectives_ptb.json; ``training.export.normalisation_label`` turns each into the ``normalisation`` export would
now write. The old label came from the objective alone (``self_normalised`` -> "self-normalised").
"""

from __future__ import annotations

import hashlib
import json

from benchmarks.common import RESULTS, write_result
from lmserve.training.export import SELFNORM_MAX_ABS_MEAN, SELFNORM_MAX_STD, normalisation_label

SOURCE = "objectives_ptb.json"


def main() -> None:
    source = json.loads((RESULTS / SOURCE).read_text())
    rows = []
    for r in source["rows"]:
        self_normalised = not r["normalised"]  # what the objective asked for: served through unnormalised scores
        label = normalisation_label(self_normalised, r["logz_mean"], r["logz_std"])
        rows.append(
            {
                "row": r["row"],
                "head": r["head"],
                "objective": r["objective"],
                "selfnorm_alpha": r["selfnorm_alpha"],
                "logz_mean": round(r["logz_mean"], 3),
                "logz_std": round(r["logz_std"], 3),
                "test_ppl": round(r["test_ppl"], 2),
                "old_label": "self-normalised" if self_normalised else "exact",
                "label": label,
            }
        )
        print(
            f"{r['row']:26} log Z {r['logz_mean']:6.2f} ± {r['logz_std']:4.2f}  {rows[-1]['old_label']:16} -> {label}"
        )
    counts = {label: sum(r["label"] == label for r in rows) for label in ("exact", "self-normalised", "unnormalised")}
    write_result(
        "normalisation_labels",
        {**counts, "relabelled": sum(r["label"] != r["old_label"] for r in rows)},
        thresholds={"max_abs_logz_mean": SELFNORM_MAX_ABS_MEAN, "max_logz_std": SELFNORM_MAX_STD},
        # the input is a committed result file (its sha256 names it); the run that wrote it started from commit
        # source_run_commit with uncommitted changes in the tree, which that file's own "commit" field records
        source={
            "file": f"benchmarks/results/{SOURCE}",
            "sha256": hashlib.sha256((RESULTS / SOURCE).read_bytes()).hexdigest(),
            "source_run_commit": source["commit"].removesuffix("-dirty"),
            "source_run_tree_had_uncommitted_changes": source["commit"].endswith("-dirty"),
            "date": source["date"],
        },
        rows=rows,
    )


if __name__ == "__main__":
    main()
