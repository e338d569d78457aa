"""The torch-free rescoring engine: model bundles and the neural scorer, KenLM n-grams, n-best and k-best lists,
features, tuning and metrics, the rescoring job, the lm-serve client and the decoders' adapters. lm-rescore's command
layer over it is ``commands/``, which nothing here imports."""
