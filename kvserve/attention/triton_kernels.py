"""Triton kernels for paged attention over the standard cache layout [num_blocks, block_size, num_kv_heads,
head_dim] (the layout of attention/torch_ref.py, so either backend can read a cache the other wrote).

- `write_kv`: each new token's K and V go to its slot (block * block_size + offset); slot -1 means "no write"
  (padding rows of a CUDA-graph batch, profiling runs).
- `paged_attention`: one kernel for a whole mixed batch. A program takes up to BLOCK_Q query tokens of one request
  and one KV head; its BLOCK_M rows are (token, query head of that KV head's group) pairs, so GQA heads share
  every K/V tile they load. It walks the request's keys through the block table in tiles of TILE_N, with an
  online softmax, and stops at the last key its rows may see (causality: a token at position p sees keys 0..p).
  Decodes, decodes carrying draft tokens, and prefill chunks after a cached prefix are all the same case.
- Split-K (vLLM's paged attention v2): with few programs and long contexts, each program's key range is cut into
  NUM_SPLITS segments run by separate programs; each writes an unnormalised partial output with its running max
  and sum, and `_reduce_splits_kernel` combines them. The segments are computed inside the kernel from each
  request's length, so one launch shape serves any lengths (what a captured CUDA graph needs).

The programs of a step are listed by the host (`prog_req`, `prog_qstart`): which request and which of its query
tokens each one starts at. Logits are kept in the log2 domain (scale * log2(e)) so the softmax uses exp2.
Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 before this module is imported).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton_ops import rotate_half

LOG2E = 1.4426950408889634


# Integer arguments that vary from step to step are not specialized (Triton would compile a variant for 1, for
# multiples of 16 and for the rest: a compile stall in the middle of serving the first time each one shows up).
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@triton.jit(do_not_specialize=["num_tokens"])
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,  # tokens per program
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    FP8_MAX: tl.constexpr,  # an fp8 cache's largest finite value (values saturate to it); 0: not fp8
    FP8_TINY: tl.constexpr,  # its smallest normal value
    FP8_SUB: tl.constexpr,  # the step of its subnormals
    FP8_DROP: tl.constexpr,  # fp32 mantissa bits it lacks (23 - its own)
):
    # One row per token, its heads' dims side by side: column c is head c // DIM_PAD, dim c % DIM_PAD.
    tokens = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    cols = tl.arange(0, HEADS_PAD * DIM_PAD)
    heads = cols // DIM_PAD
    dims = cols % DIM_PAD
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    mask = (slots >= 0)[:, None] & ((heads < NUM_KV_HEADS) & (dims < HEAD_DIM))[None, :]
    k = tl.load(k_ptr + tokens[:, None] * stride_kt + (heads * stride_kh + dims)[None, :], mask=mask)
    v = tl.load(v_ptr + tokens[:, None] * stride_vt + (heads * stride_vh + dims)[None, :], mask=mask)
    dst = ((slots // BLOCK_SIZE) * stride_cb + (slots % BLOCK_SIZE) * stride_cs)[:, None] + (heads * stride_ch + dims)[
        None, :
    ]
    if FP8_MAX > 0:
        k = _to_fp8(k, FP8_MAX, FP8_TINY, FP8_SUB, FP8_DROP, key_cache_ptr.dtype.element_ty)
        v = _to_fp8(v, FP8_MAX, FP8_TINY, FP8_SUB, FP8_DROP, value_cache_ptr.dtype.element_ty)
    tl.store(key_cache_ptr + dst, k, mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


@triton.jit
def _to_fp8(x, limit: tl.constexpr, tiny: tl.constexpr, sub: tl.constexpr, drop: tl.constexpr, dtype: tl.constexpr):
    """x as an fp8 cache stores it (attention/kv_dtype.py's quantize_kv): NaN -> 0, saturated, nearest even.

    NOTE: the value is rounded to the fp8 grid here, in fp32, so that the final cast is exact: Triton's interpreter
    rounds some values wrongly (a mantissa that carries into the exponent, values between subnormals). Normals:
    round to nearest even on the bits, dropping the `drop` low mantissa bits (the carry propagates by the integer
    add); below the smallest normal: the subnormal grid of step `sub`, by adding and removing 1.5 * 2^23 steps."""
    x = x.to(tl.float32)
    x = tl.where(x != x, 0.0, x)
    x = tl.minimum(tl.maximum(x, -limit), limit)
    bits = x.to(tl.int32, bitcast=True)
    negative = bits < 0  # the sign bit, -0.0 included
    bits = bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)
    normal = (bits & ~((1 << drop) - 1)).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23
    subnormal = ((tl.abs(x) / sub + magic) - magic) * sub
    subnormal = tl.where(negative, -subnormal, subnormal)
    x = tl.where(tl.abs(x) < tiny, subnormal, normal)
    return x.to(dtype, fp_downcast_rounding="rtne")


@triton.jit(do_not_specialize=["stride_bt", "window"])
def _paged_attention_kernel(
    q_ptr,  # [T, H, D]
    key_cache_ptr,  # [N, B, Hkv, D]
    value_cache_ptr,
    out_ptr,  # NUM_SPLITS == 1: [T, H, D] in q's dtype; else the partial sums [T, H, NUM_SPLITS, DIM_PAD] fp32
    max_ptr,  # [T, H, NUM_SPLITS] fp32 running max per split (log2 domain); unused when NUM_SPLITS == 1
    sum_ptr,  # [T, H, NUM_SPLITS] fp32 softmax denominator per split
    block_table_ptr,  # [R, W] int32
    seq_lens_ptr,  # [R] int32: keys after this step (cached + new)
    query_start_ptr,  # [R + 1] int32
    prog_req_ptr,  # [P] int32: the request of each program
    prog_qstart_ptr,  # [P] int32: the program's first query token, counted within its request
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    window,  # each row sees its last `window` keys, itself included; 0: all of them
    alibi_ptr,  # [H] fp32 ALiBi slopes; unused without ALIBI
    hidden_ptr,  # [T] int64 (tree attention): bit b of a token's word hides its position - b; unused without TREE
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program: BLOCK_M // GROUP
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # compute the dots in fp32 (the interpreter's tl.dot mishandles bf16 and fp16)
    ALIBI: tl.constexpr,  # add slope * (key position - query position) to each row's scores
    TREE: tl.constexpr,  # hide the keys each row's hidden_ptr word names (draft trees, common.tree_hidden_keys)
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(prog_req_ptr + pid)
    q_first = tl.load(prog_qstart_ptr + pid)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # keys cached before this step's tokens

    rows = tl.arange(0, BLOCK_M)
    token = q_first + rows // GROUP  # query token within the request
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (token < q_len)
    q_pos = context_len + token  # each row's position: it sees keys 0..q_pos
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    token_idx = (q_start + token).to(tl.int64)
    q = tl.load(
        q_ptr + token_idx[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # Keys up to the program's last valid row, from its first row's first visible key (a sliding window: keys
    # before it are never loaded, their blocks may belong to another request by now); a split program takes
    # its share of those key tiles.
    kv_end = context_len + tl.minimum(q_first + BLOCK_Q, q_len)
    kv_start = tl.where(window > 0, tl.maximum(context_len + q_first - window + 1, 0), 0)
    first_tile = kv_start // TILE_N
    num_tiles = tl.cdiv(kv_end, TILE_N) - first_tile
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, first_tile + num_tiles)
    # The oldest key each row sees: itself and the window - 1 keys before it.
    row_lo = tl.where(window > 0, q_pos - window + 1, 0)
    if ALIBI:
        slope_log2 = tl.load(alibi_ptr + head, mask=row_valid, other=0.0) * 1.4426950408889634  # [BLOCK_M]
    if TREE:
        hidden = tl.load(hidden_ptr + token_idx, mask=row_valid, other=0)  # [BLOCK_M] int64

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE_N + offs_n
        key_valid = (pos < kv_end) & (pos >= kv_start)
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        kv_offset = block * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs + kv_head * stride_ch
        k = tl.load(
            key_cache_ptr + kv_offset[None, :] + dims[:, None],
            mask=key_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )  # [DIM_PAD, TILE_N]
        if UPCAST:
            k = k.to(tl.float32)
        k = k.to(q.dtype)  # an fp8 cache widens to q's dtype; a no-op otherwise
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
        if ALIBI:
            s += slope_log2[:, None] * (pos[None, :] - q_pos[:, None]).to(tl.float32)
        visible = key_valid[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] >= row_lo[:, None])
        if TREE:  # only the row's last 64 keys can be hidden (its tree's query tokens)
            back = q_pos[:, None] - pos[None, :]  # [BLOCK_M, TILE_N], 0 for the row's own key
            in_word = (back >= 0) & (back < 64)
            bit = (hidden[:, None] >> tl.where(in_word, back, 0).to(tl.int64)) & 1
            visible = visible & ~(in_word & (bit != 0))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            value_cache_ptr + kv_offset[:, None] + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )  # [TILE_N, DIM_PAD]
        if UPCAST:
            v = v.to(tl.float32)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    row_head = head.to(tl.int64)
    if NUM_SPLITS == 1:
        # Rows with no key at all (padding) get 0 rather than 0 / 0.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token_idx[:, None] * stride_ot + row_head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        num_heads = tl.num_programs(1) * GROUP
        stat = (token_idx * num_heads + row_head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(out_ptr + stat[:, None] * DIM_PAD + dims[None, :], acc, mask=row_valid[:, None])
        tl.store(max_ptr + stat, m_i, mask=row_valid)
        tl.store(sum_ptr + stat, l_i, mask=row_valid)


@triton.jit(do_not_specialize=["first_token"])
def _reduce_splits_kernel(
    out_ptr,  # [T, H, D]
    partial_ptr,  # [T, H, NUM_SPLITS, DIM_PAD] fp32
    max_ptr,  # [T, H, NUM_SPLITS] fp32
    sum_ptr,
    stride_ot,
    stride_oh,
    first_token,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64) + first_token
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, DIM_PAD)
    stat = (token * NUM_HEADS + head) * NUM_SPLITS + splits
    m = tl.load(max_ptr + stat)
    l_split = tl.load(sum_ptr + stat)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    denom = tl.sum(weight * l_split, 0)
    partial = tl.load(partial_ptr + stat[:, None] * DIM_PAD + dims[None, :])
    out = tl.sum(partial * weight[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM
    )


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D], rows of any stride, each head contiguous
    v: torch.Tensor,
    key_cache: torch.Tensor,  # [N, B, Hkv, D] contiguous
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int32 or int64; -1 = skip
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and key_cache.is_contiguous() and value_cache.is_contiguous()
    fp8 = torch.finfo(key_cache.dtype) if key_cache.dtype in _FP8 else None
    # Few tokens per program on a GPU (many programs in flight); many in the interpreter, which pays per program.
    tokens = 4 if k.device.type == "cuda" else 32
    _write_kv_kernel[(triton.cdiv(num_tokens, tokens),)](
        k,
        v,
        key_cache,
        value_cache,
        slot_mapping,
        num_tokens,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=key_cache.shape[1],
        TOKENS=tokens,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        FP8_MAX=fp8.max if fp8 is not None else 0.0,
        FP8_TINY=fp8.tiny if fp8 is not None else 0.0,
        FP8_SUB=fp8.tiny * fp8.eps if fp8 is not None else 0.0,
        FP8_DROP=23 - round(-math.log2(fp8.eps)) if fp8 is not None else 1,
    )


@triton.jit
def _rotary_write_kv_kernel(
    x_ptr,  # [T, (H + 2 * Hkv) * D]: q heads, k heads, v heads (the fused qkv projection's output)
    pos_ptr,
    cos_ptr,  # [max_position, D / 2]
    sin_ptr,
    key_cache_ptr,  # [N, B, Hkv, D]
    value_cache_ptr,
    slot_ptr,  # [T]; -1 = no write
    stride_x,
    stride_c,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # Program (token, block of heads) over all the row's heads: q and k heads rotated in place (as rotary_ does,
    # bit for bit), then k and v heads stored at the token's slot.
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF_PAD)
    d_mask = d < HALF
    rotated = heads < NUM_Q_HEADS + NUM_KV_HEADS
    is_k = rotated & (heads >= NUM_Q_HEADS)
    is_v = (heads >= NUM_Q_HEADS + NUM_KV_HEADS) & (heads < NUM_Q_HEADS + 2 * NUM_KV_HEADS)
    mask = (heads < NUM_Q_HEADS + 2 * NUM_KV_HEADS)[:, None] & d_mask[None, :]
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_c + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_c + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    first = x_ptr + t * stride_x + heads[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    r1, r2 = rotate_half(x1, x2, cos, sin)
    x1 = tl.where(rotated[:, None], r1, x1)
    x2 = tl.where(rotated[:, None], r2, x2)
    rot_mask = mask & rotated[:, None]
    tl.store(first, x1, mask=rot_mask)
    tl.store(first + HALF, x2, mask=rot_mask)
    kv_head = tl.where(is_k, heads - NUM_Q_HEADS, heads - NUM_Q_HEADS - NUM_KV_HEADS)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kv_head[:, None] * stride_ch + d[None, :]
    # The slot's test as a vector: the interpreter turns bool-vector & bool-scalar into int32, which no mask takes.
    slot_ok = (slot + tl.zeros([BLOCK_H], tl.int64)) >= 0
    k_mask = mask & (is_k & slot_ok)[:, None]
    v_mask = mask & (is_v & slot_ok)[:, None]
    tl.store(key_cache_ptr + dst, x1, mask=k_mask)
    tl.store(key_cache_ptr + dst + HALF, x2, mask=k_mask)
    tl.store(value_cache_ptr + dst, x1, mask=v_mask)
    tl.store(value_cache_ptr + dst + HALF, x2, mask=v_mask)


def rotary_write_kv(
    positions: torch.Tensor,  # [T]
    qkv: torch.Tensor,  # [T, (H + 2 * Hkv) * D], rows of any stride, unit stride within; rotated in place
    cos: torch.Tensor,  # [max_position, D / 2] in qkv's dtype
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    key_cache: torch.Tensor,  # [N, B, Hkv, D] contiguous, qkv's dtype
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]; -1 = skip
) -> None:
    """Rotary embedding of the q and k heads (in place, as kernels.triton_ops.rotary_) and write_kv of the rotated
    k and the v heads, in one launch: at batch 1 each is a ~1.4 us kernel plus its gap, 64 of them a step of a
    32-layer model."""
    t = qkv.shape[0]
    if t == 0:
        return
    half = cos.shape[1]
    total = num_heads + 2 * num_kv_heads
    assert qkv.stride(1) == 1 and qkv.shape[1] == total * 2 * half and key_cache.dtype == qkv.dtype
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    block_h = min(triton.next_power_of_2(total), 16)
    _rotary_write_kv_kernel[(t, triton.cdiv(total, block_h))](
        qkv,
        positions,
        cos,
        sin,
        key_cache,
        value_cache,
        slot_mapping,
        qkv.stride(0),
        cos.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_Q_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        BLOCK_H=block_h,
        BLOCK_SIZE=key_cache.shape[1],
        enable_fp_fusion=False,  # the rotation's products are rounded one by one (triton_ops.rotary_)
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, D], rows of any stride, each head contiguous
    key_cache: torch.Tensor,  # [N, B, Hkv, D] contiguous
    value_cache: torch.Tensor,
    out: torch.Tensor,  # [T, H, D] contiguous, written here
    block_table: torch.Tensor,  # [R, W] int32
    seq_lens: torch.Tensor,  # [R] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    prog_req: torch.Tensor,  # [P] int32
    prog_qstart: torch.Tensor,  # [P] int32
    scale: float,
    block_m: int,
    tile_n: int,
    num_splits: int = 1,
    first_token: int = 0,
    window: int = 0,
    alibi_slopes: torch.Tensor | None = None,
    hidden_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the query tokens the programs cover over their request's keys, read through the block table
    (K/V of this step's tokens must be written first). `block_m` rows per program (BLOCK_Q = block_m // group
    tokens, the stride of `prog_qstart`); `num_splits` > 1 (a power of 2) splits each program's keys over that
    many programs and reduces after, over tokens `first_token`.. (the programs must cover them all: tokens before
    belong to another kernel, the decode rows of triton_decode.py). `window` > 0: each token sees only its last
    `window` keys, and no key before the window of a program's first token is loaded. `alibi_slopes` ([H] fp32):
    head h's score of key position k for a query at position p gets slope[h] * (k - p). `hidden_keys` ([T] int64,
    tree attention, attention/common.py's tree_hidden_keys): bit b of token t's word hides the key at t's position - b
    from it. Returns `out`."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    num_programs = prog_req.shape[0]
    if num_tokens == 0 or num_programs == 0:
        return out
    assert q.stride(2) == 1 and out.is_contiguous() and key_cache.is_contiguous() and value_cache.is_contiguous()
    assert block_m >= group and num_splits & (num_splits - 1) == 0
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    # fp32 models get fp32 dots (Triton's default for fp32 is tf32, ~3e-4 relative error: no HF parity).
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if num_splits == 1:
        partial = max_buf = sum_buf = out  # unused by the kernel when NUM_SPLITS == 1
    else:
        partial = torch.empty(num_tokens, num_heads, num_splits, dim_pad, dtype=torch.float32, device=q.device)
        max_buf = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        sum_buf = torch.empty_like(max_buf)
    _paged_attention_kernel[(num_programs, num_kv_heads, num_splits)](
        q,
        key_cache,
        value_cache,
        out if num_splits == 1 else partial,
        max_buf,
        sum_buf,
        block_table,
        seq_lens,
        query_start_loc,
        prog_req,
        prog_qstart,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        window,
        alibi_slopes if alibi_slopes is not None else max_buf,
        hidden_keys if hidden_keys is not None else max_buf,
        GROUP=group,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_Q=block_m // group,
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        DOT_PRECISION=precision,
        UPCAST=q.device.type == "cpu",
        ALIBI=alibi_slopes is not None,
        TREE=hidden_keys is not None,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens - first_token, num_heads)](
            out,
            partial,
            max_buf,
            sum_buf,
            out.stride(0),
            out.stride(1),
            first_token,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            NUM_SPLITS=num_splits,
        )
    return out


def block_m_for(group: int, max_query_len: int) -> int:
    """Rows per program: at least 16 (tl.dot's smallest tile) and a whole GQA group; up to 64 when requests bring
    several query tokens (prefill chunks, draft tokens), so that each K/V tile loaded serves more of them."""
    rows = min(64, max(16, triton.next_power_of_2(max_query_len * group)))
    return max(rows, triton.next_power_of_2(group))


def num_splits_for(num_programs: int, max_kv_len: int, tile_n: int, target_programs: int) -> int:
    """Split-K factor (a power of 2, at most 16): 1 when the batch already has `target_programs` programs (about
    two per multiprocessor) or the contexts are short; otherwise enough splits to fill the GPU while each split
    keeps at least 4 key tiles."""
    if num_programs >= target_programs:
        return 1
    tiles = math.ceil(max_kv_len / tile_n)
    splits = 1
    while splits < 16 and num_programs * splits < target_programs and tiles >= 8 * splits:
        splits *= 2
    return splits
