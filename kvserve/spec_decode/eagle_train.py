"""Fitting an EAGLE head (kvserve.spec_decode.eagle's layout) to a target model, on text the target generates.

`EagleReference` is the head as a plain, differentiable torch module (HF's Llama decoder layer over dense causal
attention, no paged KV); its state dict is the published checkpoint layout, so what it learns loads into
kvserve's `EagleHead` unchanged, and tests use it as the reference for the paged implementation.

Training (EAGLE's recipe, shortened for a CPU budget of minutes): at position i the head gets the embedding of
token i + 1 and the target's final hidden state h_i (after the norm, slightly noised so the head tolerates its
own errors when it drafts several tokens from its own features); the loss is SmoothL1(pred_i, h_{i+1}) (features
scaled to unit std) plus `ce_weight` x the cross-entropy of the target's LM head on pred_i against the target's
own distribution at i + 1. The head starts as the identity on the feature (fc = [0 | I], attention and MLP
outputs zero), i.e. "the next feature is this one", and learns the difference. The target's hidden states come
from kvserve itself (a forward hook on its model during one prefill per sequence).
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import dataclass, field

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Most memory train_head keeps the target's distributions in (fp32, one row per position and vocabulary entry).
_P_TARGET_CACHE_BYTES = 512 << 20


class EagleReference(nn.Module):
    """fc over concat(embedding, feature), then one HF Llama decoder layer without its input norm."""

    def __init__(self, hf_config, fc_bias: bool = True) -> None:
        from transformers.models.llama import modeling_llama

        super().__init__()
        config = hf_config.__class__.from_dict(hf_config.to_dict())
        config._attn_implementation = "sdpa"
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        layer = modeling_llama.LlamaDecoderLayer(config, layer_idx=0)
        layer.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([layer])
        self.rotary = modeling_llama.LlamaRotaryEmbedding(config)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """embeds, features [B, L, hidden] -> predicted features [B, L, hidden] (causal over L)."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        position_ids = torch.arange(x.shape[1])[None, :].expand(x.shape[0], -1)
        cos_sin = self.rotary(x, position_ids)
        return self.layers[0](x, attention_mask=None, position_ids=position_ids, position_embeddings=cos_sin)

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """The published layout: fc.*, layers.0.* (no rotary buffers)."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("rotary")}


@dataclass
class TrainResult:
    num_sequences: int
    num_tokens: int
    num_epochs: int
    train_seconds: float
    final_loss: float
    top1_accuracy: float  # held-out: argmax of the head's logits == the target's argmax at i + 1
    # Held-out, per draft vocabulary size N: the same with the head's argmax over the N most frequent tokens only
    # (kvserve.spec_decode.draft_vocab), and how often the target's argmax is among them (the ceiling).
    top1_by_draft_vocab: dict[int, float] = field(default_factory=dict)
    target_in_draft_vocab: dict[int, float] = field(default_factory=dict)
    num_held_out_tokens: int = 0
    # Held-out, the reply's tokens only (what speculation drafts): the head's argmax at position i predicts token
    # i + 2, so the reply of a prompt of length L is scored from position L - 1 on.
    reply_top1_accuracy: float | None = None
    num_held_out_reply_tokens: int = 0
    reply_top1_by_draft_vocab: dict[int, float] = field(default_factory=dict)  # as top1_by_draft_vocab, replies only
    train_vocab_size: int = 0  # the draft vocabulary the loss was over (train_vocab), 0: the whole vocabulary


def hf_llama_config(arch):
    """An HF LlamaConfig of the target's shape (kvserve ArchConfig), one layer: the head's config."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta,
        rope_scaling=arch.rope_scaling,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        architectures=["LlamaForCausalLM"],
    )


def embedding_and_lm_head(model_config) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding and LM head matrices [vocab, hidden] fp32, read from its checkpoint (the loaded
    model keeps its LM head only in packed form)."""
    from kvserve.loader.gguf_weights import iterate_gguf
    from kvserve.loader.safetensors_weights import iterate_safetensors

    weights = (
        iterate_gguf(model_config.path, model_config.arch)
        if model_config.format == "gguf"
        else iterate_safetensors(model_config.path)
    )
    found = {n: t.float() for n, t in weights if n in ("model.embed_tokens.weight", "lm_head.weight")}
    embed = found["model.embed_tokens.weight"]
    return embed, found.get("lm_head.weight", embed)


@torch.no_grad()
def target_features(llm, sequences: list[list[int]]) -> list[torch.Tensor]:
    """The target's last hidden state after its final norm, per sequence: [L, hidden] fp32, from one kvserve
    prefill of each sequence (prefix caching must be off, so that every position is computed)."""
    from kvserve.sampling_params import SamplingParams

    model = llm.engine.engine_core.executor.driver_runner.model
    captured: list[torch.Tensor] = []
    handle = model.register_forward_hook(lambda _m, _args, out: captured.append(out.clone()))
    out = []
    try:
        for seq in sequences:
            captured.clear()
            llm.generate({"prompt_token_ids": seq}, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
            hidden = torch.cat(captured)[: len(seq)]  # the prefill steps of this sequence alone, in order
            out.append(model.model.norm(hidden).float())
    finally:
        handle.remove()
    return out


def train_head(
    hf_config,
    embed_weight: torch.Tensor,  # [vocab, hidden]
    lm_head_weight: torch.Tensor,  # [vocab, hidden]
    sequences: list[list[int]],
    features: list[torch.Tensor],
    train_seconds: float,
    lr: float = 2e-3,
    noise: float = 0.05,
    ce_weight: float = 0.5,
    seed: int = 0,
    held_out: tuple[list[list[int]], list[torch.Tensor]] | None = None,
    draft_vocabs: dict[int, torch.Tensor] | None = None,
    held_out_reply_starts: list[int] | None = None,
    unroll: int = 0,
    train_steps: int | None = None,
    autocast_bf16: bool = False,
    train_vocab: torch.Tensor | None = None,
) -> tuple[EagleReference, TrainResult]:
    """Fit a head for about `train_seconds` of wall time (or exactly `train_steps` sequence updates, where given:
    the same head on any machine and under any load, as tests need) on all the sequences, scored on `held_out`
    (sequences, features); without it, on all but a held-out tenth of the sequences, scored on that tenth.
    `draft_vocabs`: N -> the ids of a draft vocabulary of N tokens, also scored. `held_out_reply_starts` (with
    `held_out`): each held-out sequence's prompt length; then the reply's tokens are also scored alone
    (`reply_top1_accuracy`).
    `unroll`: also train that many further draft steps, each fed the head's own predicted features (see `_loss`;
    True is 1). `autocast_bf16`: the head's and the loss's products in bf16 (autocast: several times faster where
    the CPU has AMX or avx512_bf16; the loss's LM head is most of an update); the target distributions stay fp32.
    `train_vocab`: token ids [N] (a draft vocabulary, draft_vocab.py): the loss's distributions, the head's and the
    target's, are over those tokens only, as the engine's drafts with `draft_vocab_size` N are (the target's
    renormalised over them); the LM head's share of an update shrinks by vocab / N. Scores stay over the whole
    vocabulary (and per `draft_vocabs`)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    embed = nn.Embedding.from_pretrained(embed_weight)
    lm_head = nn.Linear(embed_weight.shape[1], embed_weight.shape[0], bias=False)
    lm_head.weight = nn.Parameter(lm_head_weight, requires_grad=False)
    # The loss's LM head: the draft vocabulary's rows only, where one is trained for (softmax over a subset of the
    # logits is the whole softmax restricted to it and renormalised).
    loss_head = lm_head
    if train_vocab is not None:
        # skip_init: no random initialisation, so the head's own initialisation (next) draws the same numbers.
        loss_head = nn.utils.skip_init(nn.Linear, embed_weight.shape[1], len(train_vocab), bias=False)
        loss_head.weight = nn.Parameter(lm_head_weight[train_vocab], requires_grad=False)
    head = EagleReference(hf_config)
    scale = torch.cat(features).std().item()
    with torch.no_grad():
        hidden = hf_config.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, hidden:] = torch.eye(hidden)
        head.fc.weight[:, :hidden].normal_(0.0, 0.01)
        head.fc.bias.zero_()
        layer = head.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    order = list(range(len(sequences)))
    rng.shuffle(order)
    if held_out is None:
        num_val = max(1, len(order) // 10)
        val, train = order[:num_val], order[num_val:]
        val_sequences, val_features = [sequences[i] for i in val], [features[i] for i in val]
    else:
        train = order
        val_sequences, val_features = held_out
    # The target's next-token distributions do not change while the head learns: computed once per sequence where
    # they fit in _P_TARGET_CACHE_BYTES (a few short sequences, as tests fit), else at every update. The same
    # call on the same rows, so the head fitted is the same either way.
    vocab = loss_head.weight.shape[0]
    p_targets: dict[int, torch.Tensor] = {}
    if sum(len(sequences[i]) - 1 for i in train) * vocab * 4 <= _P_TARGET_CACHE_BYTES:
        p_targets = {i: _target_probs(loss_head, features[i]) for i in train}
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    start = time.perf_counter()
    epochs = 0
    steps = 0
    loss_value = float("nan")

    def progress() -> float:
        if train_steps is not None:
            return steps / train_steps
        return (time.perf_counter() - start) / train_seconds

    while progress() < 1.0:
        rng.shuffle(train)
        for n, i in enumerate(train):
            done = progress()
            if done >= 1.0:
                break
            # Cosine decay over the budget.
            for g in opt.param_groups:
                g["lr"] = lr * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * done)).item())
            seq, feats = sequences[i], features[i]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
                loss = _loss(
                    head, embed, loss_head, seq, feats, noise * scale, scale, ce_weight, int(unroll), p_targets.get(i)
                )
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            loss_value = loss.item()
            steps += 1
            if n % 20 == 0:
                elapsed = time.perf_counter() - start
                logger.info("epoch %d seq %d/%d loss %.4f (%.0fs)", epochs, n, len(train), loss_value, elapsed)
        epochs += 1
    seconds = time.perf_counter() - start
    scores = top1_agreement(head, embed, lm_head, val_sequences, val_features, draft_vocabs or {})
    num_tokens = sum(len(s) for s in sequences)
    result = TrainResult(len(sequences), num_tokens, epochs, seconds, loss_value, scores.pop("full"))
    result.train_vocab_size = 0 if train_vocab is None else len(train_vocab)
    for n, (hit, inside) in scores.items():
        result.top1_by_draft_vocab[n], result.target_in_draft_vocab[n] = hit, inside
    result.num_held_out_tokens = sum(len(s) - 1 for s in val_sequences)
    if held_out_reply_starts is not None:
        reply = top1_agreement(
            head, embed, lm_head, val_sequences, val_features, draft_vocabs or {}, held_out_reply_starts
        )
        result.reply_top1_accuracy = reply.pop("full")
        result.reply_top1_by_draft_vocab = {n: hit for n, (hit, _) in reply.items()}
        result.num_held_out_reply_tokens = sum(
            len(s) - r for s, r in zip(val_sequences, held_out_reply_starts, strict=True)
        )
    return head, result


def _inputs(embed, seq: list[int], feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(seq[1:])
    return embed(ids)[None].float(), feats[:-1][None]


def _loss(
    head,
    embed,
    lm_head,
    seq: list[int],
    feats: torch.Tensor,
    noise: float,
    scale: float,
    ce_weight: float,
    unroll: int = 0,
    p_target: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss of one sequence. Each of `unroll` further passes feeds every position the previous pass's
    prediction of its feature (pred_{i-1}) and the embedding of the token after, as the engine's next draft is:
    teacher-forced training alone leaves a head that cannot read its own features (EAGLE-3's training-time test
    does this with an exact mask; here the context is the predicted features too, a stricter approximation).
    Pass d predicts the feature d + 1 positions past its last true one, as the engine's draft d + 1 does."""
    with torch.no_grad():
        e, f = _inputs(embed, seq, feats)
        f = f + noise * torch.randn_like(f)
        target = feats[1:][None]
        if p_target is None:
            p_target = _target_probs(lm_head, feats)
    pred = head(e, f)
    loss = _step_loss(lm_head, pred, target, p_target, scale, ce_weight)
    for depth in range(1, unroll + 1):
        if pred.shape[1] < 2:
            break
        pred = head(e[:, depth:], pred[:, :-1])
        loss = loss + _step_loss(lm_head, pred, target[:, depth:], p_target[:, depth:], scale, ce_weight)
    return loss


@torch.no_grad()
def _target_probs(lm_head, feats: torch.Tensor) -> torch.Tensor:
    """The target's next-token distribution at every position after the first: [1, len - 1, vocab], fp32 (also
    under bf16 autocast: these are the labels)."""
    with torch.autocast("cpu", enabled=False):
        return torch.softmax(lm_head(feats[1:][None].float()), dim=-1)


def _step_loss(lm_head, pred, target, p_target, scale: float, ce_weight: float) -> torch.Tensor:
    reg = torch.nn.functional.smooth_l1_loss(pred / scale, target / scale)
    logp = torch.log_softmax(lm_head(pred).float(), dim=-1)
    ce = -(p_target * logp).sum(-1).mean()
    return reg + ce_weight * ce


@torch.no_grad()
def top1_agreement(
    head, embed, lm_head, sequences, features, draft_vocabs: dict[int, torch.Tensor], starts: list[int] | None = None
) -> dict:
    """How often the head's argmax is the target's at i + 1, over every position: {"full": rate} and, per draft
    vocabulary N -> (rate with the head's argmax over those ids only, rate of target argmaxes among them).
    `starts`: per sequence, the first token index scored (a prompt's length: only the reply's tokens count)."""
    hits = total = 0
    sub_hits = {n: 0 for n in draft_vocabs}
    inside = {n: 0 for n in draft_vocabs}
    masks = {}
    for n, ids in draft_vocabs.items():
        masks[n] = torch.zeros(lm_head.weight.shape[0], dtype=torch.bool)
        masks[n][ids] = True
    for n_seq, (seq, feats) in enumerate(zip(sequences, features, strict=True)):
        e, f = _inputs(embed, seq, feats)
        # Row i predicts token i + 2: rows from start - 1 on predict the tokens after the reply's first (that one
        # comes from the target's prefill; nothing drafts it).
        first = 0 if starts is None else max(starts[n_seq] - 1, 0)
        logits = lm_head(head(e, f))[0][first:]
        want = lm_head(feats[1:]).argmax(-1)[first:]
        hits += int((logits.argmax(-1) == want).sum())
        total += len(want)
        for n, ids in draft_vocabs.items():
            sub_hits[n] += int((ids[logits[:, ids].argmax(-1)] == want).sum())
            inside[n] += int(masks[n][want].sum())
    out: dict = {"full": hits / max(total, 1)}
    for n in draft_vocabs:
        out[n] = (sub_hits[n] / max(total, 1), inside[n] / max(total, 1))
    return out


def save_head(head: EagleReference, hf_config, folder: str, result: TrainResult) -> None:
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file(head.checkpoint(), os.path.join(folder, "model.safetensors"))
    config = hf_config.to_dict()
    if result.train_vocab_size:  # the engine then drafts over that vocabulary unless told otherwise (EAGLE-3's key)
        config["draft_vocab_size"] = result.train_vocab_size
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1, default=str)
    with open(os.path.join(folder, "train_result.json"), "w") as f:
        json.dump(result.__dict__, f, indent=1)
