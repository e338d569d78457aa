"""lm-rescore's command layer over the engine in ``rescoring/``: the command lines (``cli``: the program and its
``score``, ``ngram`` and ``merge`` commands; ``rescore_cli``: ``tune`` and ``nbest``), how a job is spread
(``shards``: ``--shard`` and ``merge``; ``fleet``: ``nbest --server`` over replicas; ``remote``: ``tune --server``'s
LM scores), ``kenlm_tools`` (``ngram install-tools``) and ``score_lines`` (the line layout ``lm-rescore score`` and
``lm-serve client score`` print). The engine never imports from here (``tests/test_layering.py``)."""
