"""The torch-free rescoring engine: model bundles, the neural scorer, (later) n-grams, n-best lists and metrics."""
