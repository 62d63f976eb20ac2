"""IncrementalDetokenizer: special tokens and the spaces between them, on a word-level tokenizer whose decoder
joins tokens with spaces (as sentencepiece-style decoders do around added tokens)."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens([AddedToken("<a>", special=True), AddedToken("<b>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize(
    ("skip", "spaces", "text"),
    [
        (True, True, " hello world"),
        (True, False, " hello world"),
        (False, True, " hello <a> <b> world"),
        (False, False, " hello <a><b> world"),
    ],
)
def test_special_tokens_and_the_spaces_between_them(tokenizer, skip, spaces, text):
    ids = tokenizer("hello <a> <b> world").input_ids
    assert ids == [1, 3, 4, 2]
    params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    detok = IncrementalDetokenizer(tokenizer, [2], params)
    for token_id in ids:  # one token per step, as the engine streams them
        detok.update([token_id], skip_last=False)
    assert detok.output_text == text
