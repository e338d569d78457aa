"""Training side of lmserve: corpora, vocabularies, LSTM language models, output heads and objectives, checkpoints.

The only package of the project that imports torch (docs/design.md).
"""
