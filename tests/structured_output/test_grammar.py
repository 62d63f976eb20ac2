"""StructuredOutputsParams, the grammars built from them, and the engine core's matchers and bitmasks."""

from __future__ import annotations

import json

import llguidance
import numpy as np
import pytest

from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.structured_output.grammar import check
from kvserve.structured_output.matcher import StructuredOutputManager, num_words

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"json": SCHEMA, "json_object": True}, "exactly one"),
        ({"json": 3}, "JSON schema"),
        ({"regex": ""}, "non-empty string"),
        ({"grammar": 5}, "non-empty string"),
        ({"choice": []}, "non-empty list"),
        ({"choice": "ab"}, "non-empty list"),
        ({"choice": ["a", ""]}, "non-empty strings"),
    ],
)
def test_params_refuse_bad_shapes(kwargs, error):
    with pytest.raises(ValueError, match=error):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_take_only_structured_outputs_params():
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    assert params.clone().structured_outputs == StructuredOutputsParams(regex="a+")


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(json=json.dumps(SCHEMA)),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"\d{3}-[a-z]+"),
        StructuredOutputsParams(choice=["yes", "no"]),
        StructuredOutputsParams(grammar='start: "yes" | "no"'),
        StructuredOutputsParams(grammar='root ::= "yes" | "no"'),  # GBNF
    ],
)
def test_valid_specs_compile(spec):
    assert llguidance.LLMatcher.validate_grammar(check(spec)) == ""


@pytest.mark.parametrize(
    "spec, error",
    [
        (StructuredOutputsParams(json="{not json"), "not valid JSON"),
        (StructuredOutputsParams(json="[1, 2]"), "must be a dict or a JSON object"),
        (StructuredOutputsParams(json={"type": "no-such-type"}), "invalid structured output"),
        (StructuredOutputsParams(regex="[a-z"), "invalid structured output"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "invalid structured output"),
        (StructuredOutputsParams(grammar="root ::= ("), "cannot read the grammar"),
    ],
)
def test_invalid_specs_are_value_errors(spec, error):
    with pytest.raises(ValueError, match=error):
        check(spec)


@pytest.fixture(scope="module")
def manager(smollm2_gguf, smollm2_tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(smollm2_gguf, len(smollm2_tokenizer))


def allowed_tokens(manager: StructuredOutputManager, grammars, drafts=None, parents=None) -> list[set[int]]:
    drafts = drafts or [[] for _ in grammars]
    bitmask = manager.fill_bitmask(grammars, drafts, parents)
    words = np.frombuffer(bitmask, dtype=np.int32).reshape(-1, manager.num_words)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    return [set(np.flatnonzero(row).tolist()) for row in bits]


def test_choices_are_matched_literally(manager, smollm2_tokenizer):
    """Regex metacharacters in a choice stand for themselves: each choice completes its grammar, and a string
    its unescaped regex would also match does not."""
    choices = ["a.b", "(x|y)", "1+1=2", "a/b", "[z]", "c#d~e&f-g", "$^{2}\\"]
    eos = [smollm2_tokenizer.eos_token_id]
    for choice in choices:
        grammar = manager.new_grammar(StructuredOutputsParams(choice=choices), eos)
        for token in smollm2_tokenizer(choice, add_special_tokens=False).input_ids:
            assert grammar.accept(token), choice
        assert grammar.is_terminated, choice
    grammar = manager.new_grammar(StructuredOutputsParams(choice=choices), eos)
    assert not all(grammar.accept(t) for t in smollm2_tokenizer("axb", add_special_tokens=False).input_ids)


def test_bitmask_follows_each_grammar_and_copies_are_independent(manager, smollm2_tokenizer):
    eos = smollm2_tokenizer.eos_token_id
    spec = StructuredOutputsParams(json=SCHEMA)
    text_ids = smollm2_tokenizer('{"name": "Bo", "ok": true}', add_special_tokens=False).input_ids
    a = manager.new_grammar(spec, [eos])
    num_compiled = len(manager._compiled)
    b = manager.new_grammar(spec, [eos])
    assert len(manager._compiled) == num_compiled  # the second one copied the compiled grammar
    for i, token in enumerate(text_ids):
        allowed_a, allowed_b = allowed_tokens(manager, [a, b])
        assert token in allowed_a
        if i == 0:
            assert allowed_a == allowed_b
        assert a.accept(token)
        assert not a.is_terminated or i == len(text_ids) - 1
    assert a.is_terminated and not b.is_terminated
    (after,) = allowed_tokens(manager, [a])
    assert after == {eos}  # a complete output may only end
    (fresh,) = allowed_tokens(manager, [b])
    assert text_ids[0] in fresh and eos not in fresh
    # Refused tokens put the grammar in an error state, with a message.
    assert not b.accept(smollm2_tokenizer("x", add_special_tokens=False).input_ids[0])
    assert b.error


def test_bitmask_width_covers_a_padded_vocabulary(smollm2_gguf, smollm2_tokenizer):
    """A model vocabulary padded past the tokenizer's: the bitmask covers it, padding tokens never allowed."""
    padded = len(smollm2_tokenizer) + 100
    manager = StructuredOutputManager(smollm2_gguf, padded)
    grammar = manager.new_grammar(StructuredOutputsParams(regex="[a-z]+"), [smollm2_tokenizer.eos_token_id])
    assert manager.num_words == num_words(padded)
    (allowed,) = allowed_tokens(manager, [grammar])
    assert allowed and max(allowed) < len(smollm2_tokenizer)


def test_draft_rows_follow_the_drafts_and_leave_the_parser_where_it_was(manager, smollm2_tokenizer):
    """With drafts, a request gets a row per draft: the tokens allowed after each one, as a parser that took them
    sees it; the grammar does not move. num_valid counts the drafts the grammar takes, in order."""
    eos = smollm2_tokenizer.eos_token_id
    spec = StructuredOutputsParams(json=SCHEMA)
    ids = smollm2_tokenizer('{"name": "Bo", "ok": true}', add_special_tokens=False).input_ids
    a, other = manager.new_grammar(spec, [eos]), manager.new_grammar(StructuredOutputsParams(regex="[0-9]+"), [eos])
    rows = allowed_tokens(manager, [other, a], [[], ids[:3]])
    assert len(rows) == 1 + 4
    reference = manager.new_grammar(spec, [eos])
    for k in range(4):
        (want,) = allowed_tokens(manager, [reference])
        assert rows[1 + k] == want
        if k < 3:
            assert reference.accept(ids[k])
    (again,) = allowed_tokens(manager, [a])
    assert again == rows[1]  # a did not move
    bad = smollm2_tokenizer("x", add_special_tokens=False).input_ids[0]
    assert a.num_valid(ids[:3] + [bad] + ids[3:5]) == 3
    assert a.num_valid(ids) == len(ids)  # the last one completes the output
    (still,) = allowed_tokens(manager, [a])
    assert still == rows[1]


def test_tree_rows_follow_each_nodes_path(manager, smollm2_tokenizer):
    """Drafts that are a tree's nodes (parents given, level by level): node j's row holds what the grammar allows
    after the path root -> j, as a parser that took that path sees it; a node the grammar refuses, and any node
    below it, keeps an all-allowed row (never used: its parent's row excludes it); the grammar does not move."""
    eos = smollm2_tokenizer.eos_token_id
    spec = StructuredOutputsParams(json=SCHEMA)
    a_ids = smollm2_tokenizer('{"name": "Bo", "ok": true}', add_special_tokens=False).input_ids
    b_ids = smollm2_tokenizer('{"name": "Al", "ok": false}', add_special_tokens=False).input_ids
    bad = smollm2_tokenizer("x", add_special_tokens=False).input_ids[0]
    branches = [a_ids[:6], b_ids[:6], a_ids[:2] + [bad, a_ids[2]], a_ids[:1] + [a_ids[2]]]
    # The trie of the branches, numbered level by level (the proposer's topological order).
    nodes: dict[tuple[int, ...], int] = {}
    for depth in range(1, max(map(len, branches)) + 1):
        for branch in branches:
            if len(branch) >= depth and tuple(branch[:depth]) not in nodes:
                nodes[tuple(branch[:depth])] = len(nodes)
    paths = sorted(nodes, key=nodes.get)
    tokens = [p[-1] for p in paths]
    parents = [nodes.get(p[:-1], -1) for p in paths]
    assert parents.count(-1) == 1 and len(paths) > 8

    a, other = manager.new_grammar(spec, [eos]), manager.new_grammar(StructuredOutputsParams(regex="[0-9]+"), [eos])
    (root_want,) = allowed_tokens(manager, [a])
    rows = allowed_tokens(manager, [other, a], [[], tokens], [None, parents])
    assert len(rows) == 1 + 1 + len(tokens) and rows[1] == root_want
    everything = set(range(manager.num_words * 32))
    checked = 0
    for j, path in enumerate(paths):
        reference = manager.new_grammar(spec, [eos])
        if reference.num_valid(list(path)) < len(path):
            assert rows[2 + j] == everything, j  # refused, or below a refused node
            continue
        for token in path:
            assert reference.accept(token)
        if not reference.is_terminated:
            (want,) = allowed_tokens(manager, [reference])
            assert rows[2 + j] == want, j
            checked += 1
    assert checked >= 8
    (again,) = allowed_tokens(manager, [a])
    assert again == root_want  # a did not move
