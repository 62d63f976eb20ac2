"""StructuredOutputsParams -> an llguidance grammar (its JSON text), checked without a tokenizer.

llguidance (the Rust library vLLM also uses) compiles JSON schemas, regexes and Lark grammars to a parser that
gives, for any prefix of tokens, the set of tokens that may follow. It is pure CPU and has no dependencies.
"""

from __future__ import annotations

from contextlib import contextmanager

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.utils import json_object

# Characters with a meaning in llguidance's regex syntax (Rust's regex crate); every other one stands for itself.
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def grammar_for(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for `params` (not yet validated: see `check`)."""
    if params.json is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(json_object(params.json, "the JSON schema"))
    if params.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return llguidance.LLMatcher.grammar_from_regex("|".join(_escape(c) for c in params.choice))
    assert params.grammar is not None
    try:
        # Lark as it is; GBNF (llama.cpp's and xgrammar's EBNF, "root ::= ...") translated to Lark.
        lark = any_to_lark(params.grammar)
    except Exception as e:  # the translator raises its own error types
        raise ValueError(f"cannot read the grammar: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def check(params: StructuredOutputsParams) -> str:
    """The grammar for `params`, or a ValueError saying what is wrong with it (a user error: HTTP 400)."""
    with library_errors_as_value_errors():
        grammar = grammar_for(params)
        error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise ValueError(f"invalid structured output specification: {error.strip()}")
    return grammar


@contextmanager
def library_errors_as_value_errors():
    """Whatever llguidance raises on a user's spec is that user's error, not the engine's. A Rust panic arrives as
    pyo3's PanicException, a BaseException, which would otherwise end the engine core."""
    try:
        yield
    except ValueError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        raise ValueError(f"invalid structured output specification: {type(e).__name__}: {e}") from None


def _escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)
