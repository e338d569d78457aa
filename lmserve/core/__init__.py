"""What every part of lmserve shares, and nothing else: the model bundle format (the contract between ``lm-train
export`` and every scorer), atomic writes of every output, the check of a command's outputs against its inputs, how a
command line ends (exit codes and one-line errors), reading input lines, what a word is, text normalisation and the
fingerprints that tie a result to its models. It imports nothing of lmserve's parts: ``training``, ``rescoring`` and
``server`` import it (docs/design.md, "Layering")."""
