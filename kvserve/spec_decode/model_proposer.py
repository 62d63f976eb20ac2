"""What the draft-model and EAGLE proposers share: their own KV pool, the K-step draft loop, the draft draws (q).

KV layout (both proposers): the proposer owns a pool with exactly the target's number of blocks and block size,
in its own model's shape, and uses the target's block tables and slot mapping unchanged. Block b of the draft
pool holds the draft's K/V for the same tokens as block b of the target pool. This keeps the scheduler, prefix
cache and preemption unaware of the draft:

* every step the proposer first runs over the same positions the target just computed (`mirror`), so whatever
  the target's KV holds for a position, the draft's does too. A prefix-cache hit on target blocks is therefore
  a hit on the draft's blocks as well; recompute preemption (which frees both) needs nothing, and swap
  preemption and a KV connector (the offload tiers) move the draft's block with the target's of the same id
  (worker/swap.py, KVConnectorWorker.register_kv_caches);
* the draft steps then write positions past the target's computed tokens. Those slots are in blocks the
  request owns alone (never full of computed tokens, so never hashed); like the target's rejected drafts, they
  are overwritten when the target computes those positions. The scheduler allocates K lookahead slots per
  request for them; a request without room (max_model_len, or no lookahead allocated) gets fewer drafts
  instead of writing outside its blocks.

Device: the pool, the model, the draws and q live on the target's device (inputs are built in numpy and copied
over, as in the runner); only the drafted token ids come back to the host, once per draft step.

Draws: a greedy request drafts the argmax (a one-hot q suffices, since its p is one-hot too). A sampling request
draws the draft token from q = the draft's distribution after the request's temperature, min-p, top-k and top-p,
and q is kept for the rejection sampler, which then makes the output distribution exactly the target's. Its
noise key is independent of the target's keys for the same position: a seeded request's draft is a hash of
("draft", seed, position), so seeded outputs stay reproducible.
"""

from __future__ import annotations

import time
from abc import abstractmethod

import numpy as np
import torch
import xxhash

from kvserve.attention.base import AttentionBackend, AttentionInputs, KVCache
from kvserve.sample.sampler import Sampler, SamplingMetadata
from kvserve.spec_decode.base import DraftProposal, DraftStepInputs, Proposer
from kvserve.spec_decode.draft_vocab import DraftVocab
from kvserve.spec_decode.skipped import SkippedPositions
from kvserve.worker.input_batch import InputBatch, RequestState
from kvserve.worker.kv_cache import allocate_kv_cache, bytes_per_block
from kvserve.worker.sampling_inputs import build_sampling_metadata

_KEY_RANGE = 1 << 62


class ModelProposer(Proposer):
    """A proposer that runs a model with its own paged KV cache (see the module docstring)."""

    runs_model = True

    def __init__(
        self,
        source: str,
        num_speculative_tokens: int,
        backend: AttentionBackend,
        num_layers: int,
        block_size: int,
        dtype: torch.dtype,
        vocab_size: int,
        max_model_len: int,
        generator: torch.Generator,
        device: torch.device,
    ) -> None:
        self.source = source  # the draft model's or head's folder
        self.k = num_speculative_tokens
        self.device = device
        self.backend = backend
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.generator = generator
        self.num_layers = num_layers
        self.dtype = dtype
        self.sampler = Sampler(device)
        self._kv_caches: list[KVCache] = []  # allocate_kv_cache, once the target's pool is sized
        # q of each request's pending drafts, until the step that verifies them (or the request leaves).
        self._pending: dict[str, tuple[list[int], torch.Tensor]] = {}
        # Requests left out of the pass: their first position without draft KV, and (reads_target_hidden) the
        # target's hidden rows of the positions since, to catch up on when they are given drafts again.
        self._skipped = SkippedPositions(self.reads_target_hidden)
        # A frequency-ranked draft vocabulary (draft_vocab.py), set by the subclass: then `mirror` and `decode`
        # return logits over its columns, and the drafted columns map back to full ids here.
        self.draft_vocab: DraftVocab | None = None

    def bytes_per_block(self) -> int:
        """What one block of the proposer's pool takes: the target's KV budget pays for both pools."""
        return bytes_per_block(self.backend, self.block_size, self.num_layers, self.dtype)

    def layout_id(self) -> str:
        """What decides what the bytes of the proposer's blocks mean (a KV connector's stored blocks carry them)."""
        shape = self.backend.kv_cache_shape(1, self.block_size)
        return f"{self.source}|{self.backend.describe(self.block_size)}|{shape}|{self.dtype}|layers={self.num_layers}"

    @property
    def kv_caches(self) -> list[KVCache]:
        return self._kv_caches

    def allocate_kv_cache(self, num_blocks: int) -> None:
        # NOTE: the same block count as the target's pool, in the draft's own shape (module docstring).
        self._kv_caches = allocate_kv_cache(
            self.backend, num_blocks, self.block_size, self.num_layers, self.dtype, self.device
        )

    # ------------------------------------------------------------------ subclass hooks

    @abstractmethod
    def mirror(self, step: DraftStepInputs, last_rows: np.ndarray) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run over the target's step positions (filling the draft KV there). `last_rows` [S]: each sampling
        request's row in the step's tokens at its last accepted position. Returns (logits [S, V] of the first
        draft, or None when the first draft needs a decode step; per-request features [S, ...] or None)."""

    @abstractmethod
    def decode(
        self, token_ids: torch.Tensor, positions: np.ndarray, attn_metadata: object, features: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft step of single-token queries: token_ids [A] at positions [A] -> (logits [A, V] fp32, or
        [A, N] over `draft_vocab`'s columns when it is set; features [A, ...] for the next step or None)."""

    # True when `mirror` reads the target's hidden states of the positions (EAGLE): the proposer then keeps them
    # for the positions it skips, to catch up on later.
    reads_target_hidden: bool = False

    @property
    @abstractmethod
    def mirror_gives_first_draft(self) -> bool:
        """True when `mirror` already returns the first draft's logits (EAGLE); then the decode steps start at
        the first unverified position with the first draft as input, else with the last emitted token."""

    # ------------------------------------------------------------------ the loop

    def propose(self, step: DraftStepInputs) -> DraftProposal:
        """Drafts for `step.sample_idx`; requests the policy leaves out (`step.awake` false) get none, and the
        pass skips their positions (remembered, and caught up on when they are given drafts again)."""
        if step.awake is not None and not step.awake.any():
            # Everyone asleep, the usual step where drafts do not pay: only the record, and where every request
            # decoded one token (no prompt chunk, no drafts verified) even that later, with others (skipped.py).
            if len(step.input_ids) == len(step.rows):
                self._skipped.defer(step.states, step.rows, step.positions, step.hidden)
            else:
                with torch.inference_mode():
                    self._remember_skipped(step)
            return self._no_drafts(step)
        return self._propose_awake(step)

    def _no_drafts(self, step: DraftStepInputs) -> DraftProposal:
        num_sampled = len(step.sample_idx)
        if self._pending:
            for i in step.sample_idx.tolist():
                self._pending.pop(step.states[i].req_id, None)
        return DraftProposal([[] for _ in range(num_sampled)], [None] * num_sampled)

    @torch.inference_mode()
    def _propose_awake(self, step: DraftStepInputs) -> DraftProposal:
        num_sampled = len(step.sample_idx)
        if step.awake is not None and not step.awake.all():
            self._remember_skipped(step)
        sub, kept = self._awake_step(step)
        if sub is None:
            return self._no_drafts(step)
        proposal = self._propose(sub)
        if kept is None:
            return proposal
        drafts: list[list[int]] = [[] for _ in range(num_sampled)]
        probs: list[torch.Tensor | None] = [None] * num_sampled
        parents: list[list[int]] = [[] for _ in range(num_sampled)]
        for j, i in enumerate(kept.tolist()):
            drafts[i], probs[i] = proposal.drafts[j], proposal.probs[j]
            if proposal.parents is not None:
                parents[i] = proposal.parents[j]
        for i in np.setdiff1d(np.arange(num_sampled), kept).tolist():
            self._pending.pop(step.states[int(step.sample_idx[i])].req_id, None)
        proposal.drafts, proposal.probs = drafts, probs
        if proposal.parents is not None:
            proposal.parents = parents
        return proposal

    def _propose(self, step: DraftStepInputs) -> DraftProposal:
        batch = step.batch
        idx = step.sample_idx
        rows = step.rows[idx]
        states = [step.states[i] for i in idx.tolist()]
        num_s = len(idx)
        # After verification the computed count is the position of the last emitted token (not yet in KV).
        next_pos = batch.num_computed_tokens[rows].astype(np.int64)  # [S]
        start_pos = step.positions[step.query_start_loc[:-1][idx]]
        last_rows = step.query_start_loc[:-1][idx] + (next_pos - 1 - start_pos)
        capacity = np.minimum(batch.num_blocks[rows] * self.block_size, self.max_model_len)

        logits, features = self.mirror(step, last_rows)
        if not num_s:
            return DraftProposal([], [], num_pass_requests=len(step.rows))
        width = self.vocab_size if self.draft_vocab is None else self.draft_vocab.size
        sampling = _DraftSampling(states, batch, width, self.generator, self.device)
        drafts = np.zeros((num_s, self.k), dtype=np.int64)
        num_drafts = np.zeros(num_s, dtype=np.int64)
        probs = torch.zeros(num_s, self.k, self.vocab_size, device=self.device) if sampling.any_random else None
        limits = np.minimum(step.max_drafts, self.k)
        active = np.flatnonzero(limits > 0)
        if logits is not None:
            if len(active) < num_s:
                picked = self.to_device(active)
                logits, features = logits[picked], None if features is None else features[picked]
            tokens = self._draw(sampling, logits, active, batch.num_tokens[rows[active]], drafts, num_drafts, probs)
            done = num_drafts[active] < limits[active]
            if not done.all():
                kept = self.to_device(done)
                active, tokens = active[done], tokens[kept]
                features = None if features is None else features[kept]
        else:
            tokens = self.to_device(batch.token_ids[rows[active], next_pos[active]])
        pos = next_pos
        draft_started = time.perf_counter()
        num_before = int(num_drafts.sum())
        while len(active):
            # Only requests with a KV slot for this position take part; positions only grow, so a request
            # that drops out stays out.
            keep = pos[active] < capacity[active]
            if not keep.all():
                kept = self.to_device(keep)
                active, tokens = active[keep], tokens[kept]
                features = None if features is None else features[kept]
            if not len(active):
                break
            step_pos = pos[active]
            md = self.backend.build_metadata(self._decode_inputs(batch, rows[active], step_pos))
            logits, features = self.decode(tokens, step_pos, md, features)
            tokens = self._draw(
                sampling, logits, active, batch.num_tokens[rows[active]] + num_drafts[active], drafts, num_drafts, probs
            )
            pos = pos + 1
            done = num_drafts[active] < limits[active]
            if not done.all():
                kept = self.to_device(done)
                active, tokens = active[done], tokens[kept]
                features = None if features is None else features[kept]

        draft_seconds = time.perf_counter() - draft_started
        num_loop_tokens = int(num_drafts.sum()) - num_before
        out_drafts = [drafts[i, : num_drafts[i]].tolist() for i in range(num_s)]
        out_probs: list[torch.Tensor | None] = [
            None if probs is None or sampling.greedy[i] else probs[i, : num_drafts[i]] for i in range(num_s)
        ]
        for state, d, q in zip(states, out_drafts, out_probs, strict=True):
            if q is None:
                self._pending.pop(state.req_id, None)
            else:
                self._pending[state.req_id] = (d, q)
        return DraftProposal(out_drafts, out_probs, len(step.rows), draft_seconds, num_loop_tokens)

    # ------------------------------------------------------------------ requests left out, and catching up

    def _remember_skipped(self, step: DraftStepInputs) -> None:
        """Record the requests the pass skips this step (skipped.py): one vectorized update for all of them."""
        assert step.awake is not None
        asleep = np.flatnonzero(~step.awake)
        qsl = step.query_start_loc
        rows = step.rows[asleep]
        self._skipped.remember(
            lambda i: step.states[int(asleep[i])].req_id,
            rows,
            qsl[asleep],
            step.positions[qsl[asleep]].astype(np.int64),
            step.batch.num_computed_tokens[rows].astype(np.int64),
            step.hidden,
        )

    def _awake_step(self, step: DraftStepInputs) -> tuple[DraftStepInputs | None, np.ndarray | None]:
        """The step restricted to the requests given drafts, each starting at its first position not mirrored
        (at most CATCH_UP_WINDOW back: older ones keep stale draft KV, which costs acceptance, not
        correctness), and which of `step.sample_idx` it keeps (None: all, and `step` itself is returned)."""
        awake = step.awake
        if (awake is None or awake.all()) and not self._skipped.any_behind(step.rows):
            return step, None
        sel = np.arange(len(step.states)) if awake is None else np.flatnonzero(awake)
        if not len(sel):
            return None, None
        qsl = step.query_start_loc
        starts = step.positions[qsl[:-1][sel]].astype(np.int64)
        ends = starts + np.diff(qsl)[sel]
        firsts = starts.copy()
        caught_hidden: dict[int, torch.Tensor] = {}  # step request index -> hidden rows of its caught-up positions
        for j, i in enumerate(sel.tolist()):
            record = self._skipped.take(step.states[i].req_id, int(step.rows[i]), int(starts[j]))
            if record is None:
                continue
            firsts[j], rows_h = record
            if rows_h is not None:
                caught_hidden[i] = rows_h
        # Requests with one query token ("decodes") come first in attention inputs.
        lens = ends - firsts
        order = np.argsort(lens > 1, kind="stable")
        sel, starts, ends, firsts, lens = sel[order], starts[order], ends[order], firsts[order], lens[order]
        batch = step.batch
        rows = step.rows[sel]
        token_rows = np.repeat(rows, lens)
        new_qsl = np.zeros(len(sel) + 1, dtype=np.int64)
        np.cumsum(lens, out=new_qsl[1:])
        positions = np.repeat(firsts, lens) + (np.arange(int(new_qsl[-1])) - np.repeat(new_qsl[:-1], lens))
        input_ids = batch.token_ids[token_rows, positions].astype(step.input_ids.dtype)
        # This step's own positions keep the step's inputs (its drafts there, since overwritten in the rows).
        own = positions >= np.repeat(starts, lens)
        src = np.repeat(qsl[:-1][sel] - starts, lens) + positions
        input_ids[own] = step.input_ids[src[own]]
        hidden = step.hidden[:0]
        if self.reads_target_hidden:
            pieces = []
            for i in sel.tolist():
                if i in caught_hidden:
                    pieces.append(caught_hidden[i])
                pieces.append(step.hidden[int(qsl[i]) : int(qsl[i + 1])])
            hidden = torch.cat(pieces)
        block_table = step.attn_inputs.block_table[sel]
        row_of_token = np.repeat(np.arange(len(sel)), lens)
        slot_mapping = (
            block_table[row_of_token, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )
        attn_inputs = AttentionInputs(
            num_decodes=int((lens == 1).sum()),
            query_start_loc=new_qsl,
            seq_lens=ends,
            block_table=block_table,
            slot_mapping=slot_mapping,
            block_size=self.block_size,
        )
        where = {int(i): j for j, i in enumerate(sel.tolist())}
        kept = np.array([j for j, i in enumerate(step.sample_idx.tolist()) if i in where], dtype=np.int64)
        sub = DraftStepInputs(
            batch,
            [step.states[i] for i in sel.tolist()],
            rows,
            input_ids,
            positions,
            new_qsl,
            attn_inputs,
            None,
            hidden,
            np.array([where[int(step.sample_idx[j])] for j in kept.tolist()], dtype=np.int64),
            step.max_drafts[kept],
            None,
            None if step.max_depths is None else step.max_depths[kept],
        )
        return sub, kept

    def draft_probs(self, req_ids: list[str], draft_ids: np.ndarray, num_drafts: np.ndarray) -> torch.Tensor | None:
        """[S, K, V] q of the drafts being verified (rows of greedy requests zero), or None when all are greedy.
        `draft_ids` [S, K] are the scheduled drafts: a prefix of what this proposer proposed for the request."""
        found = [self._pending.pop(r, None) for r in req_ids]
        if all(f is None for f in found):
            return None
        out = torch.zeros(len(req_ids), draft_ids.shape[1], self.vocab_size, device=self.device)
        for i, f in enumerate(found):
            if f is None:
                continue
            proposed, q = f
            n = int(num_drafts[i])
            # The scheduler verifies a prefix of the proposal; anything else would make q wrong.
            assert proposed[:n] == draft_ids[i, :n].tolist(), (proposed, draft_ids[i])
            out[i, :n] = q[:n]
        return out

    def forget_pending(self, req_id: str) -> None:
        """Drop the request's pending q (its next drafts carry none)."""
        self._pending.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
        self._skipped.forget(req_id)

    # ------------------------------------------------------------------ helpers

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """A numpy array as a tensor on the proposer's device (on the CPU, the same memory)."""
        t = torch.from_numpy(array)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def _decode_inputs(self, batch: InputBatch, rows: np.ndarray, positions: np.ndarray) -> AttentionInputs:
        block_table = batch.block_table[rows]
        block_ids = block_table[np.arange(len(rows)), positions // self.block_size].astype(np.int64)
        return AttentionInputs(
            num_decodes=len(rows),
            query_start_loc=np.arange(len(rows) + 1, dtype=np.int64),
            seq_lens=positions + 1,
            block_table=block_table,
            slot_mapping=block_ids * self.block_size + positions % self.block_size,
            block_size=self.block_size,
        )

    def _draw(
        self,
        sampling: _DraftSampling,
        logits: torch.Tensor,  # [A, V], or [A, N] over the draft vocabulary's columns
        active: np.ndarray,  # [A] indices into the sampling requests
        token_index: np.ndarray,  # [A] sequence index of the token being drafted
        drafts: np.ndarray,  # [S, K] filled in place
        num_drafts: np.ndarray,  # [S] advanced in place
        probs: torch.Tensor | None,  # [S, K, V] filled in place for random rows
    ) -> torch.Tensor:
        """Draw each active request's next draft; returns its full vocabulary ids [A]."""
        tokens = self.sampler.argmax(logits)
        if probs is not None:
            random_rows = np.flatnonzero(~sampling.greedy[active])
            if len(random_rows):
                sel = active[random_rows]
                rows_t = self.to_device(random_rows)
                transformed = self.sampler.apply_transforms(logits[rows_t], sampling.metadata(sel))
                keys = sampling.keys(sel, token_index[random_rows]).to(self.device)
                tokens[rows_t] = self.sampler.gumbel(transformed, keys)
                q = torch.softmax(transformed.float(), dim=-1)
                sel_t, num_t = self.to_device(sel), self.to_device(num_drafts[sel])
                if self.draft_vocab is None:
                    probs[sel_t, num_t] = q
                else:
                    # q is zero outside the draft vocabulary (the rows start zero).
                    probs[sel_t[:, None], num_t[:, None], self.draft_vocab.token_ids[None, :]] = q
        if self.draft_vocab is not None:
            tokens = self.draft_vocab.token_ids[tokens]
        drafts[active, num_drafts[active]] = tokens.cpu().numpy()
        num_drafts[active] += 1
        return tokens


class _DraftSampling:
    """The sampling requests' transforms (temperature, min-p, top-k, top-p) and draft noise keys."""

    def __init__(
        self,
        states: list[RequestState],
        batch: InputBatch,
        vocab_size: int,
        generator: torch.Generator,
        device: torch.device,
    ) -> None:
        self.greedy = np.array([s.sampling_params.greedy for s in states], dtype=bool)
        self.any_random = bool((~self.greedy).any())
        self.seeds = [s.sampling_params.seed for s in states]
        self.generator = generator
        self.device = device
        self._md = (
            build_sampling_metadata(states, batch, vocab_size, generator, device=device) if self.any_random else None
        )

    def metadata(self, sel: np.ndarray) -> SamplingMetadata:
        md = self._md
        assert md is not None and md.temperature is not None
        t = torch.from_numpy(sel).to(self.device)

        def pick(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[t]

        return SamplingMetadata(
            all_greedy=False,
            temperature=md.temperature[t],
            top_k=pick(md.top_k),
            top_p=pick(md.top_p),
            min_p=pick(md.min_p),
        )

    def keys(self, sel: np.ndarray, token_index: np.ndarray) -> torch.Tensor:
        """[len(sel)] int64 noise keys, on the CPU (the generator's device)."""
        keys = torch.randint(0, _KEY_RANGE, (len(sel),), generator=self.generator)
        for j, (i, pos) in enumerate(zip(sel.tolist(), token_index.tolist(), strict=True)):
            seed = self.seeds[i]
            if seed is not None:
                keys[j] = xxhash.xxh64_intdigest(f"draft:{seed}:{pos}".encode()) % _KEY_RANGE
        return keys
