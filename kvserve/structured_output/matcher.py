"""The engine core's side of structured outputs: one llguidance matcher per constrained request, advanced by the
tokens the scheduler appends, and the step's token bitmask for the requests that sample in it.

Pure Python and numpy (no torch), like the scheduler that calls it. The bitmask travels in the SchedulerOutput
as bytes: int32 words, `num_words(vocab)` per row, bit t of word t // 32 set when token t may come next; a
constrained request has one row, plus one per speculative draft it verifies.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait

import llguidance
import numpy as np
from llguidance.numpy import (
    fill_next_token_bitmask,
    fill_next_token_bitmask_par,
    fill_next_token_bitmask_par_with_draft_tokens,
)

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.grammar import grammar_for, library_errors_as_value_errors

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse: requests with the same schema (the usual case in a service) copy one.
_MAX_CACHED_GRAMMARS = 64
# How long add_request waits for a compile before leaving it to its thread.
_COMPILE_WAIT_S = 0.05


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class RequestGrammar:
    """One request's parser state: what it has generated so far, in its grammar.

    Its grammar may still be compiling (`ready` False): the scheduler leaves the request waiting until it is. A
    grammar that failed to compile raises its ValueError from `matcher` (`failure` gives the message).
    """

    def __init__(self, compiled: Future) -> None:
        self._compiled = compiled  # the shared compiled grammar, copied for this request on first use
        self._matcher: llguidance.LLMatcher | None = None

    @property
    def ready(self) -> bool:
        return self._matcher is not None or self._compiled.done()

    def wait(self, timeout: float) -> None:
        """Block until the grammar is compiled, or `timeout` seconds."""
        futures_wait([self._compiled], timeout)

    @property
    def failure(self) -> str | None:
        """Why the grammar could not be compiled, once ready; None if it was."""
        error = self._compiled.exception() if self._matcher is None else None
        return None if error is None else str(error)

    @property
    def matcher(self) -> llguidance.LLMatcher:
        if self._matcher is None:
            self._matcher = self._compiled.result().deep_copy()
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar refuses it (the mask should have made that impossible)."""
        return self.matcher.consume_token(token_id)

    def num_valid(self, token_ids: list[int]) -> int:
        """How many of `token_ids` (speculative drafts), in order, the grammar would take from here."""
        return self.matcher.validate_tokens(token_ids)

    @property
    def is_terminated(self) -> bool:
        """Nothing may follow: the output is complete (a JSON object closed, a choice made)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class StructuredOutputManager:
    """Compiles grammars for the engine core and fills the step's bitmask.

    The llguidance tokenizer (the vocabulary as bytes, ~0.5 s to build) is made at the first constrained request,
    so an engine that never sees one never pays for it. Grammars compile on a thread of their own: most take
    milliseconds (and a failure then is the caller's ValueError at once), but a large one takes much longer (a
    choice among tens of thousands of strings), which the engine loop, and every other request, must not wait for.
    """

    def __init__(self, tokenizer_path: str, vocab_size: int) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._mask_vocab = vocab_size  # the tokens a bitmask covers, set with the tokenizer
        self._compiled: OrderedDict[str, Future] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None
        self._compiler: ThreadPoolExecutor | None = None

    @property
    def num_words(self) -> int:
        """int32 words per row of a bitmask."""
        return num_words(self._mask_vocab)

    def new_grammar(self, params: StructuredOutputsParams, eos_token_ids: Iterable[int]) -> RequestGrammar:
        """A fresh parser for `params`, maybe still compiling; ValueError if the grammar is invalid (when that shows
        within `_COMPILE_WAIT_S`)."""
        with library_errors_as_value_errors():  # validated by the frontend; compiling checks it again
            grammar = grammar_for(params)
        compiled = self._compiled.get(grammar)
        if compiled is None:
            tokenizer = self._tokenizer(eos_token_ids)
            if self._compiler is None:
                self._compiler = ThreadPoolExecutor(1, thread_name_prefix="kvserve-grammar")
            compiled = self._compiler.submit(_compile, tokenizer, grammar)
            self._compiled[grammar] = compiled
            if len(self._compiled) > _MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        try:
            compiled.result(timeout=_COMPILE_WAIT_S)
        except FutureTimeout:
            pass  # still compiling: the request waits in the queue
        return RequestGrammar(compiled)

    def fill_bitmask(
        self,
        grammars: list[RequestGrammar],
        drafts: list[list[int]],
        parents: list[list[int] | None] | None = None,
    ) -> bytes:
        """The allowed next tokens of each grammar, in order (see the module docstring for the layout), then, for
        each of its drafts (which it must accept: see `num_valid`), those after that draft: 1 + len(drafts[i])
        rows for grammar i. Where `parents[i]` is given, grammar i's drafts are a draft tree's nodes (each node's
        parent, -1 for the root; topological order): node j's row holds what may follow its path from the root,
        and a node the grammar refuses (or below one) keeps an all-allowed row, never used (its parent's row
        excludes it). The parsers end where they started."""
        num_rows = len(grammars) + sum(len(d) for d in drafts)
        # All allowed where nothing is written: the rows after a draft that completes the output, whose tokens
        # the scheduler drops.
        bitmask = np.full((num_rows, self.num_words), -1, dtype=np.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        plain, drafted, row = [], [], 0
        for i, (grammar, tokens) in enumerate(zip(grammars, drafts, strict=True)):
            tree = None if parents is None else parents[i]
            if tokens and tree is not None:
                plain.append((grammar.matcher, row))
                _fill_tree_rows(grammar.matcher, tokens, tree, bitmask, row)
            elif tokens:  # llguidance's draft variant takes no empty list
                drafted.append((grammar.matcher, row, tokens))
            else:
                plain.append((grammar.matcher, row))
            row += 1 + len(tokens)
        if plain:
            fill_next_token_bitmask_par(self._executor, plain, bitmask)
        if drafted:
            fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bitmask)
        return bitmask.tobytes()

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)

    def _tokenizer(self, eos_token_ids: Iterable[int]) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            import llguidance.hf  # imports transformers: only once a constrained request comes

            from kvserve.loader.tokenizer import load_tokenizer

            hf_tokenizer = load_tokenizer(self.tokenizer_path)
            # The model's vocabulary may be padded past the tokenizer's: the padding tokens are never allowed.
            self._mask_vocab = max(self.vocab_size, len(hf_tokenizer))
            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                hf_tokenizer, n_vocab=self._mask_vocab, eos_token=sorted(eos_token_ids)
            )
            logger.info("structured outputs: llguidance tokenizer built (%d tokens)", self._mask_vocab)
        return self._ll_tokenizer


def _fill_tree_rows(
    matcher: llguidance.LLMatcher, tokens: list[int], parents: list[int], bitmask: np.ndarray, row: int
) -> None:
    """Rows row + 1 + j of `bitmask`: what the grammar allows after the path root -> node j, for each node j the
    grammar takes. Nodes come in topological order (a level's nodes before the next level's); the parser moves
    from one node's path to the next's by rolling back to their common ancestor and consuming the rest, and ends
    where it started."""
    at: list[int] = []  # the nodes the parser has consumed, root first
    paths: dict[int, list[int]] = {-1: []}  # node -> its path (itself last), for the nodes the grammar takes
    for j, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
        if parent not in paths:  # below a refused node
            continue
        target = paths[parent]
        common = 0
        while common < min(len(at), len(target)) and at[common] == target[common]:
            common += 1
        if len(at) > common:
            matcher.rollback(len(at) - common)
            del at[common:]
        for node in target[common:]:
            matcher.consume_token(tokens[node])
            at.append(node)
        if matcher.validate_tokens([token]) != 1:  # (consuming a refused token would put the parser in error)
            continue
        matcher.consume_token(token)
        at.append(j)
        paths[j] = list(at)
        if not matcher.is_stopped():  # complete: what follows is dropped, as after a chain's completing draft
            fill_next_token_bitmask(matcher, bitmask, row + 1 + j)
    if at:
        matcher.rollback(len(at))


def _compile(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """The compiled grammar (llguidance releases the GIL while it builds it); ValueError if it is invalid."""
    with library_errors_as_value_errors():
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"invalid structured output specification: {matcher.get_error()}")
    return matcher
