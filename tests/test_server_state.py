"""The decoder state token: it round-trips exactly, and any token this model cannot continue from is refused with a
reason (another model, damaged, cut, another version) instead of producing scores of a state nobody made."""

import struct
import zlib

import numpy as np
import pytest

from lmserve.rescoring.decoder_state import DecoderState, StateError, decode, decode_many, encode

L, H, V = 2, 16, 43
FINGERPRINT = bytes(range(32))


def state(context=("w1", "w2")) -> DecoderState:
    rng = np.random.default_rng(0)
    h, c = rng.normal(size=(2, L, H)).astype(np.float32)
    return DecoderState(7, h, c, context)


def reseal(body: bytes) -> bytes:
    """A token with a valid checksum over ``body``: what a client that edits tokens on purpose would send."""
    return body + struct.pack("<I", zlib.crc32(body))


@pytest.mark.parametrize("context", [("w1", "w2"), (), None, ("<s>",)])
def test_round_trip_is_exact_and_compact(context):
    original = state(context)
    token = encode(original, FINGERPRINT)
    back = decode(token, FINGERPRINT, L, H, V)
    assert back.prev_id == 7 and back.ngram_context == context
    np.testing.assert_array_equal(back.h, original.h)
    np.testing.assert_array_equal(back.c, original.c)
    words = len(" ".join(context).encode()) if context is not None else 0
    assert len(token) == 1 + 8 + 1 + 4 + 2 * 4 * L * H + words + 4


TOKEN = encode(state(), FINGERPRINT)
BODY = TOKEN[:-4]
STATE_BYTES = 4 * L * H
BAD_TOKENS = {
    "another model": (encode(state(), bytes(32)), "another model"),
    "flipped byte": (TOKEN[:20] + bytes([TOKEN[20] ^ 1]) + TOKEN[21:], "checksum"),
    "cut": (TOKEN[:30], "bytes, expected at least"),
    "garbage": (b"hello, world" * 30, "checksum"),
    "version": (reseal(b"\x02" + BODY[1:]), "version 2"),
    "word id": (reseal(BODY[:10] + struct.pack("<I", V) + BODY[14:]), "outside the vocabulary"),
    "flags": (reseal(BODY[:9] + b"\x03" + BODY[10:]), "unknown flags"),
    "nan state": (reseal(BODY[:14] + np.full(L * H, np.nan, "<f4").tobytes() + BODY[14 + STATE_BYTES :]), "non-finite"),
    "bad utf-8": (reseal(BODY[: -len("w1 w2")] + b"\xff\xfe"), "UTF-8"),
    "stray bytes": (reseal(encode(state(None), FINGERPRINT)[:-4] + b"x"), "after the LSTM state"),
}


@pytest.mark.parametrize("case", sorted(BAD_TOKENS))
def test_tokens_this_model_cannot_continue_from_are_refused(case):
    token, message = BAD_TOKENS[case]
    with pytest.raises(StateError, match=message):
        decode(token, FINGERPRINT, L, H, V)


def test_a_token_for_another_shape_is_refused():
    token = encode(state(), FINGERPRINT)
    with pytest.raises(StateError):
        decode(token, FINGERPRINT, L, 2 * H, V)


def test_a_batch_decodes_as_its_tokens_one_by_one():
    tokens = [encode(state(context), FINGERPRINT) for context in [("w1", "w2"), (), None, ("<s>",)]]
    prev_ids, h, c, contexts = decode_many(tokens, FINGERPRINT, L, H, V)
    for i, token in enumerate(tokens):
        alone = decode(token, FINGERPRINT, L, H, V)
        assert prev_ids[i] == alone.prev_id and contexts[i] == alone.ngram_context
        np.testing.assert_array_equal(h[:, i], alone.h)
        np.testing.assert_array_equal(c[:, i], alone.c)


@pytest.mark.parametrize("case", sorted(BAD_TOKENS))
def test_a_bad_token_in_a_batch_is_named_with_its_reason(case):
    token, message = BAD_TOKENS[case]
    with pytest.raises(StateError, match=rf"^items\[2\]: .*{message}"):
        decode_many([TOKEN, TOKEN, token, TOKEN], FINGERPRINT, L, H, V, lambda i: f"items[{i}]")
