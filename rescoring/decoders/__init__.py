"""lmserve's LMs inside the beam searches of real decoders (shallow fusion), torch-free.

- :mod:`~lmserve.rescoring.decoders.lm`: :class:`DecoderLM`, what every adapter asks: the LM score of a word after a
  state, for many (state, word) pairs at once, backed by a local bundle (the scorer, with the n-gram interpolated as
  configured) or by lm-serve (ScoreNextWordsBatch or one StreamNextWords stream; tokens or cached states; TLS).
- :mod:`~lmserve.rescoring.decoders.pyctcdecode_lm`: a pyctcdecode language model, and a decoder whose beam steps
  are one LM call each (``build_ctcdecoder``, as users build KenLM decoders today).
- :mod:`~lmserve.rescoring.decoders.flashlight_lm`: a flashlight-text LM (``start``/``score``/``finish``, which
  torchaudio's ``ctc_decoder`` also takes) and a lexicon decoder built on it.

What happens at a word boundary. The LMs are word-level (a word bundle, or a subword bundle that scores whole words
as the sums of their pieces), while decoders spell words in characters or subword pieces. An adapter scores a word
only once the decoder says it is complete: pyctcdecode at the next word separator (a space label, or a piece
starting with "▁") and at the end of the utterance; flashlight's lexicon decoder when its lexicon trie reaches a
word's end. The word is then normalised as the model's text is (the bundle's settings: case, punctuation) and its
tokens are read one after the other (a word that normalises to several tokens gets their summed score, one to none
scores 0). A word the model does not spell as written (text normalisation changed more than its case: "'be" read as
"be", "well-known" as two words, "!!" as nothing) keeps that LM score but counts as out of the vocabulary, since the
transcript keeps what the LM never saw (pyctcdecode: ``unk_score_offset``). Until then a partial word costs nothing
while it is, as written, the prefix of some vocabulary word and ``unk_score_offset`` once it is not (pyctcdecode's
rule for KenLM; flashlight uses its own lexicon lookahead).
The end of the utterance adds ``</s>``. (flashlight's lexicon-free decoder gives the LM every token it emits, which
fits a word-level LM only when the decoder's tokens are words: with characters or pieces, use the lexicon decoder.) Summed along a decoded path, the adapter's scores therefore equal
``lm-rescore score`` of the decoded sentence (tests/test_decoders.py checks it to 1e-4).
"""
