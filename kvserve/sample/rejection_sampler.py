"""Speculative verification: the rejection sampler of Leviathan et al. (2023), vectorised over batch and drafts.

A request with k draft tokens x_1..x_k is scored at k + 1 positions: p_j is the target's distribution at draft
position j (after every transform the plain sampler applies: banned stop tokens, penalties, temperature, min-p,
top-k, top-p), and p_{k+1} that after the last draft. Draft x_j is accepted with probability
min(1, p_j(x_j) / q_j(x_j)); at the first rejection the token is drawn from normalize(max(0, p_j - q_j)) and the
rest is dropped; when all k are accepted, a bonus token is drawn from p_{k+1}. Each emitted token is then
distributed exactly as p at its position, whatever q was.

Drafts without probabilities (n-gram) are one-hot q. For them the test and the residual draw fold into one: draw
y_j from p_j exactly as the plain sampler would (Gumbel-max with the row's key) and accept x_j iff y_j == x_j.
P(accept) = p_j(x_j) = min(1, p_j(x_j) / 1), and a rejected position emits y_j conditioned on y_j != x_j, which
is p_j with x_j removed and renormalised = normalize(max(0, p_j - onehot(x_j))). The output is then not only
equal in distribution but token-identical to sampling without speculation for a seeded request (same keys,
same draws); greedy is the same rule with argmax for the draw.

With full draft distributions, the acceptance uniform of a position comes from the same row key as its Gumbel
noise, hashed at an index past the vocabulary, so seeded requests stay reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.sample.sampler import Sampler, SamplerOutput, SamplingMetadata, add_logprobs, hash_uniform

PLACEHOLDER_TOKEN_ID = -1


@dataclass
class DraftInputs:
    """The drafts of B requests. Request i owns logits rows [cu_i, cu_i + k_i] (k_i drafts, then the bonus)."""

    draft_token_ids: torch.Tensor  # [B, K] int64, padded past each request's count
    num_draft_tokens: torch.Tensor  # [B] int64, k_i <= K
    draft_probs: torch.Tensor | None = None  # [B, K, V] fp32 q; None = one-hot drafts


@dataclass
class RejectionOutput:
    output_token_ids: torch.Tensor  # [B, K + 1] int64: accepted drafts then one more, PLACEHOLDER_TOKEN_ID after
    num_output_tokens: torch.Tensor  # [B] int64, num accepted + 1
    # Per logits row: the token emitted at that position if it is reached, and its logprobs when asked.
    row_output: SamplerOutput


@dataclass
class TargetDraw:
    greedy_pick: torch.Tensor  # [N] argmax of the constrained logits
    transformed: torch.Tensor | None  # [N, V] logits whose softmax is p (None when every row is greedy)
    keys: torch.Tensor | None  # [N] the rows' noise keys (None when every row is greedy)
    target: torch.Tensor  # [N] the draw from p (greedy rows: greedy_pick)


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata, drafts: DraftInputs) -> RejectionOutput:
        """logits [N, V] fp32 with N = sum(k_i + 1) rows in request order; `md` describes those N rows (each
        position its own row: its position's seed key, penalties over the tokens before it)."""
        num_rows = logits.shape[0]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.max_num_logprobs is not None else None
        num_drafts = drafts.num_draft_tokens
        b, k_max = drafts.draft_token_ids.shape
        # [B, K + 1] logits row of each (request, position); padding repeats the bonus row and is masked.
        starts = torch.cumsum(num_drafts + 1, dim=0) - (num_drafts + 1)
        device = logits.device
        pos = torch.arange(k_max + 1, device=device)[None, :]
        rows = starts[:, None] + torch.minimum(pos, num_drafts[:, None])
        is_draft = pos < num_drafts[:, None]  # [B, K + 1]
        draft_ids = torch.cat([drafts.draft_token_ids, torch.zeros(b, 1, dtype=torch.int64, device=device)], dim=1)
        draft_ids = torch.where(is_draft, draft_ids, 0)

        draw = self.draw_targets(logits, md)
        if drafts.draft_probs is None or draw.transformed is None:
            # One-hot drafts (or every row greedy, where p is one-hot and any q gives the same rule).
            tokens = draw.target[rows]  # [B, K + 1]
            accepted = is_draft & (tokens == draft_ids)
        else:
            assert draw.keys is not None
            tokens, accepted = self._full_q(
                draw.transformed,
                draw.greedy_pick,
                self.sampler.greedy_rows(md),
                draw.keys,
                rows,
                is_draft,
                draft_ids,
                drafts.draft_probs,
                draw.target,
            )

        num_accepted = torch.cumprod(accepted.to(torch.int64), dim=1).sum(dim=1)
        num_output = num_accepted + 1
        output = torch.where(pos < num_output[:, None], tokens, PLACEHOLDER_TOKEN_ID)

        # Every row's token (rows past the accepted run hold what would have been drawn there).
        row_tokens = torch.empty(num_rows, dtype=torch.int64, device=device)
        row_tokens[rows.flatten()] = tokens.flatten()
        row_output = SamplerOutput(sampled_token_ids=row_tokens)
        if raw_logprobs is not None:
            add_logprobs(row_output, raw_logprobs, md, self.sampler.topk)
        return RejectionOutput(output, num_output, row_output)

    def draw_targets(self, logits: torch.Tensor, md: SamplingMetadata) -> TargetDraw:
        """What the plain sampler would emit at each of the N rows (constraints, transforms, the keyed Gumbel draw;
        argmax for greedy rows). A draft tree's walk calls this first to pick its path (worker/tree_step.py)."""
        sampler = self.sampler
        logits = sampler.apply_constraints(logits, md)
        greedy_pick = sampler.argmax(logits)  # [N]
        if md.all_greedy:
            return TargetDraw(greedy_pick, None, None, greedy_pick)
        transformed = sampler.apply_transforms(logits, md)
        keys = sampler.draw_keys(md, logits.shape[0]).to(logits.device)
        target = torch.where(sampler.greedy_rows(md), greedy_pick, sampler.gumbel(transformed, keys))
        return TargetDraw(greedy_pick, transformed, keys, target)

    def _full_q(
        self,
        transformed: torch.Tensor,  # [N, V] logits whose softmax is p
        greedy_pick: torch.Tensor,  # [N]
        greedy_rows: torch.Tensor,  # [N] bool
        keys: torch.Tensor,  # [N]
        rows: torch.Tensor,  # [B, K + 1]
        is_draft: torch.Tensor,  # [B, K + 1]
        draft_ids: torch.Tensor,  # [B, K + 1]
        draft_probs: torch.Tensor,  # [B, K, V]
        target: torch.Tensor,  # [N] the draw from p per row (the bonus)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Leviathan's test against a full q: returns (token per position [B, K + 1], accepted [B, K + 1])."""
        b, k1 = rows.shape
        vocab = transformed.shape[1]
        p = torch.softmax(transformed, dim=-1)
        p = torch.where(greedy_rows[:, None], torch.nn.functional.one_hot(greedy_pick, vocab).to(p.dtype), p)
        q = torch.cat([draft_probs.float(), torch.zeros(b, 1, vocab, device=p.device)], dim=1)  # [B, K + 1, V]
        p_pos = p[rows]  # [B, K + 1, V]
        px = p_pos.gather(2, draft_ids[:, :, None]).squeeze(2)
        qx = q.gather(2, draft_ids[:, :, None]).squeeze(2)
        pos_keys = keys[rows]
        # Index `vocab` is past every token's Gumbel noise: an independent stream from the same key.
        u = hash_uniform(pos_keys, torch.full_like(pos_keys, vocab))
        accepted = is_draft & (px > 0) & (u * qx <= px)

        residual = (p_pos - q).clamp_(min=0)
        mass = residual.sum(dim=-1, keepdim=True)
        # p == q leaves no residual (and then a rejection has probability 0): fall back to p.
        residual = torch.where(mass > 0, residual, p_pos)
        recovered = self.sampler.gumbel(residual.log().view(b * k1, vocab), pos_keys.flatten()).view(b, k1)
        tokens = torch.where(accepted, draft_ids, recovered)
        tokens = torch.where(is_draft, tokens, target[rows])
        return tokens, accepted
