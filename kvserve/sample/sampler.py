"""Batched sampling: penalties, temperature, min-p/top-k/top-p, greedy or random draw, logprobs.

Order (as in vLLM): raw logprobs are taken from the model's logits before anything else; then min_tokens
masking, penalties, the greedy pick; then temperature, min-p, top-k, top-p and a random draw for the rest.

Random draws use the Gumbel-max trick: token = argmax(logits + G), G = -log(-log(U)), which picks token i with
probability softmax(logits)_i. U comes from a counter-based hash of (row key, token index), not from a stateful
generator, so it costs a few vector instructions per entry (far less than torch's Mersenne Twister per row) and a
seeded request's draw depends on nothing but its key. Its key is derived from (seed, position), so its tokens are the
same whatever else is in the batch and survive preemption and recomputation. The argmax form is also what makes that
hold in practice: different batch compositions round the logits differently (by ~1e-6), and an argmax only moves if
the two best perturbed values are that close, whereas an inverse-CDF draw shifts
whenever the truncated tail's mass does. The C++ kernel (kvserve/kernels/csrc/sampling.cpp) fuses the pass:
`GumbelSample` picks it or the torch draw once, when the sampler is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import xxhash

from kvserve.device_copy import to_device
from kvserve.layers.custom_op import CustomOp


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs for the rows being sampled this step (B rows).

    Optional tensors are None when no row needs the feature, so the common cases skip the work entirely.
    """

    all_greedy: bool
    temperature: torch.Tensor | None  # [B] fp32; 0 for greedy rows
    top_k: torch.Tensor | None  # [B] int64; vocab size where disabled
    top_p: torch.Tensor | None  # [B] fp32; 1 where disabled
    min_p: torch.Tensor | None  # [B] fp32; 0 where disabled
    # The features below default to off (a proposer's draft sampling, tests).
    # row -> (seed, position of the token being sampled); rows absent use the shared generator.
    seeds: dict[int, tuple[int, int]] = field(default_factory=dict)
    generator: torch.Generator | None = None  # shared, for unseeded random rows
    presence_penalty: torch.Tensor | None = None  # [B]
    frequency_penalty: torch.Tensor | None = None  # [B]
    repetition_penalty: torch.Tensor | None = None  # [B]
    output_token_ids: list[list[int]] | None = None  # per row, when penalties are on
    prompt_token_ids: list[list[int]] | None = None  # per row, when the repetition penalty is on
    # (row, token ids) pairs whose tokens are forbidden this step (stop tokens before min_tokens).
    banned_tokens: list[tuple[int, list[int]]] = field(default_factory=list)
    max_num_logprobs: int | None = None  # top-N to return; None when no row asked
    # What the builder knows on the host about the tensors above; None: read from the tensors, which on a GPU
    # waits for everything queued before (with async scheduling, the next step's forward pass).
    any_greedy: bool | None = None  # some rows have temperature 0
    any_temperature: bool | None = None  # some rows have a temperature other than 0 and 1
    max_top_k: int | None = None  # top_k.max()
    # [B] int64 noise keys chosen beforehand (on the CPU): a draft tree's walk drew them for the rows it verifies,
    # and the rejection sampler must draw with the same noise (worker/tree_step.py). None: draw_keys makes them.
    keys: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    # When logprobs were asked: ids [B, N+1] and logprobs [B, N+1] (sampled token first) and ranks [B].
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None


class GumbelSample(CustomOp):
    """The random draw: argmax(logits + Gumbel noise hashed from each row's key): [B, V], [B] int64 -> [B].

    The cpu path is one fused multithreaded kernel pass; the native path is `gumbel_sample` (same hash, a
    different log, so a draw may differ where two perturbed values tie within rounding).
    """

    def forward_native(self, logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return gumbel_sample(logits, keys)

    def forward_cpu(self, logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        assert self.kernels is not None
        return self.kernels.sample_gumbel(logits.float().contiguous(), keys)

    def forward_cuda(self, logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        from kvserve.sample.triton_sampling import gumbel_argmax

        return gumbel_argmax(logits.float().contiguous(), keys)


class Argmax(CustomOp):
    """Each row's greedy pick: [B, V] -> [B] int64, as torch.argmax(dim=-1) (the first maximum; a NaN wins).

    The cpu path is one threaded kernel pass; torch's CPU argmax over a 49k vocabulary takes ~70 us a row.
    """

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=-1)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        assert self.kernels is not None
        return self.kernels.argmax_rows(x.float().contiguous())


class TopK(CustomOp):
    """Each row's k largest values, largest first, and their indices: [B, V] fp32, k -> ([B, k], [B, k] int64).

    The cpu path breaks ties by the lower index, so a row's result depends on that row alone; torch.topk (the
    native path) orders equal values as the algorithm it picks for k happens to, and the sampler's k is the batch's
    largest `logprobs`. Ties are common among the logprobs of a bf16 model's logits.
    """

    def forward_native(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = x.topk(k, dim=-1)
        return values, indices

    def forward_cpu(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.kernels is not None
        return self.kernels.topk_rows(x.float().contiguous(), k)


class TopLogProbs(CustomOp):
    """Each row's k most likely tokens as log-probs, best first: [B, V] fp32 logits, k -> ([B, k], [B, k] int64),
    i.e. TopK of log_softmax(x) (ties to the lower index on the cpu path) without the whole log_softmax row: a
    draft tree takes 4 of 8-16k per expanded node, and torch's topk plus logsumexp cost ~0.15 ms there for 4 rows."""

    def forward_native(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.float()
        values, indices = x.topk(k, dim=-1)
        return values - torch.logsumexp(x, dim=-1, keepdim=True), indices

    def forward_cpu(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.kernels is not None
        return self.kernels.topk_log_softmax_rows(x.float().contiguous(), k)


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", use_kernel: bool = True) -> None:
        self.gumbel = GumbelSample(device, use_kernel)
        # On a GPU, rows with no top-k/top-p/min-p take one fused pass (temperature, noise, argmax, greedy rows);
        # False: the general path (benchmarks compare the two).
        self.fused_draw = self.gumbel.impl == "cuda"
        self.topk = TopK(device, use_kernel)
        self.top_log_probs = TopLogProbs(device, use_kernel)
        self.argmax = Argmax(device, use_kernel)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """logits [B, V] fp32 (not modified in place)."""
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.max_num_logprobs is not None else None
        logits = self.apply_constraints(logits, md)
        if md.all_greedy:
            sampled = self.argmax(logits)
        elif self.fused_draw and md.min_p is None and md.top_k is None and md.top_p is None:
            # Temperature, noise, argmax and the greedy rows in one pass over the logits (triton_sampling.py).
            from kvserve.sample.triton_sampling import gumbel_argmax

            assert md.temperature is not None
            keys = to_device(self.draw_keys(md, logits.shape[0]), logits.device)
            sampled = gumbel_argmax(logits.float().contiguous(), keys, md.temperature)
        else:
            keys = to_device(self.draw_keys(md, logits.shape[0]), logits.device)
            sampled = self.gumbel(self.apply_transforms(logits, md), keys)
            greedy_rows = self.greedy_rows(md)
            if md.any_greedy if md.any_greedy is not None else bool(greedy_rows.any()):
                sampled = torch.where(greedy_rows, self.argmax(logits), sampled)
        out = SamplerOutput(sampled_token_ids=sampled)
        if raw_logprobs is not None:
            add_logprobs(out, raw_logprobs, md, self.topk)
        return out

    @staticmethod
    def apply_constraints(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """What every row sees, greedy ones too: banned tokens (stops before min_tokens) and penalties."""
        if md.banned_tokens:
            logits = logits.clone()
            rows = torch.tensor([row for row, token_ids in md.banned_tokens for _ in token_ids], dtype=torch.int64)
            cols = torch.tensor([t for _, token_ids in md.banned_tokens for t in token_ids], dtype=torch.int64)
            logits[to_device(rows, logits.device), to_device(cols, logits.device)] = float("-inf")
        if md.repetition_penalty is not None or md.presence_penalty is not None or md.frequency_penalty is not None:
            logits = apply_penalties(logits, md)
        return logits

    @staticmethod
    def apply_transforms(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Temperature, min-p, top-k and top-p on constrained logits: softmax of the result is the distribution
        a random row draws from. Greedy rows get temperature 1 here (their pick is the argmax instead)."""
        assert md.temperature is not None
        temp = torch.where(md.temperature == 0, 1.0, md.temperature)
        if md.any_temperature if md.any_temperature is not None else not bool((temp == 1.0).all()):
            logits = logits / temp[:, None]
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        if md.top_k is not None or md.top_p is not None:
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p, md.max_top_k)
        return logits

    @staticmethod
    def greedy_rows(md: SamplingMetadata) -> torch.Tensor:
        """[B] bool."""
        assert md.temperature is not None
        return md.temperature == 0

    @staticmethod
    def draw_keys(md: SamplingMetadata, num_rows: int) -> torch.Tensor:
        """[B] int64 noise keys (on the CPU): a seeded row's from (seed, position), the others from the shared
        generator; `md.keys` when set."""
        if md.keys is not None:
            assert md.keys.shape[0] == num_rows, (md.keys.shape, num_rows)
            return md.keys
        keys = torch.randint(0, _KEY_RANGE, (num_rows,), generator=md.generator)
        if md.seeds:  # one indexed write (a write per row cost ~2 us each, ~0.5 ms a step at 256 rows)
            rows = list(md.seeds)
            keys[rows] = torch.tensor([position_key(s, p) for s, p in md.seeds.values()], dtype=torch.int64)
        return keys


def add_logprobs(out: SamplerOutput, raw_logprobs: torch.Tensor, md: SamplingMetadata, topk: TopK) -> None:
    """Fill `out`'s logprob fields from the model's raw logprobs [B, V] and its sampled tokens."""
    assert md.max_num_logprobs is not None
    sampled = out.sampled_token_ids
    sampled_lp = raw_logprobs.gather(1, sampled[:, None])  # [B, 1]
    out.sampled_ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1
    if md.max_num_logprobs > 0:
        top_lp, top_ids = topk(raw_logprobs, md.max_num_logprobs)
        out.logprobs = torch.cat([sampled_lp, top_lp], dim=1)
        out.logprob_token_ids = torch.cat([sampled[:, None], top_ids], dim=1)
    else:
        out.logprobs, out.logprob_token_ids = sampled_lp, sampled[:, None]


_KEY_RANGE = 1 << 62


def position_key(seed: int, position: int) -> int:
    """The noise key of a seeded request's draw at `position`: a hash of both, independent of everything else."""
    return xxhash.xxh64_intdigest(f"{seed}:{position}".encode()) % _KEY_RANGE


def gumbel_sample(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Torch version of the kernel's draw (same hash; a different log, so not bit-identical): [B, V], [B] -> [B]."""
    idx = torch.arange(logits.shape[-1], dtype=torch.int64, device=logits.device)[None, :]
    u = hash_uniform(keys[:, None], idx)
    g = -torch.log(-torch.log(u))
    return (logits.float() + g).argmax(dim=-1)


def hash_uniform(keys: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Uniforms strictly inside (0, 1) hashed from int64 keys and indices (broadcast together), fp32."""
    mask32 = 0xFFFFFFFF

    def mix32(h: torch.Tensor) -> torch.Tensor:
        h = h ^ (h >> 16)
        h = (h * 0x7FEB352D) & mask32
        h = h ^ (h >> 15)
        h = (h * 0x846CA68B) & mask32
        return h ^ (h >> 16)

    h = mix32(mix32(idx ^ (keys & mask32)) ^ ((keys >> 32) & mask32))
    return ((h >> 9).to(torch.float32) + 0.5) / 8388608.0  # 23 bits: exact in fp32


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int | None = None
) -> torch.Tensor:
    """Keep the k most likely tokens (ties with the k-th kept too), then the smallest set of most likely tokens
    whose probability mass reaches p (at least one token always survives). `max_top_k`: top_k.max() if known."""
    if top_p is None:
        assert top_k is not None
        kth = logits.topk(max_top_k or int(top_k.max()), dim=-1).values.gather(1, (top_k - 1).clamp(min=0)[:, None])
        return logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        vocab = logits.shape[-1]
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(min=0)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Ascending order: drop the low-probability tail whose total mass is at most 1 - p.
    tail_mass = probs.cumsum(dim=-1)
    drop = tail_mass <= (1 - top_p[:, None])
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """vLLM/OpenAI semantics: repetition divides positive (multiplies negative) logits of tokens seen in the
    prompt or output; frequency subtracts penalty x count in the output; presence subtracts it once."""
    b, vocab = logits.shape
    assert md.output_token_ids is not None
    counts = _token_counts(md.output_token_ids, b, vocab, logits.device)
    logits = logits.clone()
    if md.repetition_penalty is not None:
        assert md.prompt_token_ids is not None
        seen = (counts > 0) | (_token_counts(md.prompt_token_ids, b, vocab, logits.device) > 0)
        rp = md.repetition_penalty[:, None].expand_as(logits)
        penalized = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalized, logits)
    if md.frequency_penalty is not None:
        logits -= md.frequency_penalty[:, None] * counts
    if md.presence_penalty is not None:
        logits -= md.presence_penalty[:, None] * (counts > 0).float()
    return logits


def _token_counts(token_ids: list[list[int]], b: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V] fp32 occurrence counts of each token id per row, on `device`."""
    width = max((len(t) for t in token_ids), default=0)
    if width == 0:
        return torch.zeros(b, vocab, dtype=torch.float32, device=device)
    ids = torch.full((b, width), vocab, dtype=torch.int64)  # padding goes to an extra column, cut below
    for row, toks in enumerate(token_ids):
        if toks:
            ids[row, : len(toks)] = torch.tensor(toks, dtype=torch.int64)
    ids = to_device(ids, device)
    padded = torch.zeros(b, vocab + 1, dtype=torch.float32, device=device)
    padded.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return padded[:, :vocab]
