"""A GPT in JAX/Flax with real mesh sharding, a KV cache, and FLOP counting.

This file stands alone: copy it into another project and it still works.

    python gpt.py            # builds the default tiny GPT on CPU, prints its size and a greedy sample

Reading order, bottom-up like nanoGPT: dtypes -> Module (sharding plan, flops,
components/gather) -> Linear, Norm -> rotary embeddings -> attention (attend_reference, the
plain way, GPT(attention="reference"), then the fast paths that equal it, the default) ->
Attention -> MLP, MoE -> Block -> GPT (one Block scanned over the layers' stacked weights)
-> generation (generate: a prefill and a loop) -> mesh helpers.

One GPT covers several HuggingFace families: a handful of fields make each (FAMILIES), and
a checkpoint's config sets the rest (rope scaling, sliding windows, soft-caps, multipliers,
a mixture of experts whose experts the plan splits over the mesh).

Shapes are in the names: B batch, T query length, S key length (cache slots), D model
width, H query heads, K key/value heads, E head width, F MLP width, V vocabulary, L layers,
X experts, A experts active per token.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Type

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_masks
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_of(name: str) -> Any:
    """The jnp dtype called `name`; a clear ValueError for anything else."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


# ----------------------------------------------------------------------------- Module


class Module(nn.Module):
    """Base of every part: dtypes, a sharding plan, FLOP counting, and the part list.
    Parameters carry logical axis names ("embed", "heads", ...), which the plan (`sharding`)
    maps to the mesh axes "batch" and "shard": layers never name mesh axes."""

    param_dtype: str = "float32"
    activation_dtype: str = "float32"

    @property
    def sharding(self) -> List[Tuple[str, Optional[str]]]:
        """Ordered (logical axis, mesh axis or None) pairs; no plan means replicated."""
        return []

    @property
    def pdtype(self) -> Any:
        return dtype_of(self.param_dtype)

    @property
    def adtype(self) -> Any:
        return dtype_of(self.activation_dtype)

    def children_modules(self) -> List["Module"]:
        """The setup() children of a bound module, in the order they were made."""
        self._try_setup()  # flax builds setup() children lazily; make them exist now
        return [m for m in self._state.children.values() if isinstance(m, Module)]

    def flops(self, seq: int) -> float:
        """Forward + backward FLOPs for one sequence of `seq` tokens (module bound): dense matmul
        arithmetic only, a multiply-add 2 FLOPs and backward twice forward (3x its forward);
        composite modules sum their children's."""
        return sum(child.flops(seq) for child in self.children_modules())

    @classmethod
    def components(cls) -> List[Type[Any]]:
        """The types of this module's constituent parts."""
        return []

    @classmethod
    def gather(cls) -> List[Type[Any]]:
        """Depth-first, de-duplicated list of every part type, this class first."""
        found: List[Type[Any]] = []

        def visit(t: Type[Any]) -> None:
            if t in found:
                return
            found.append(t)
            for part in t.components() if issubclass(t, Module) else []:
                visit(part)

        visit(cls)
        return found


def logical_param(module: nn.Module, name: str, shape: Tuple[int, ...], axes: Tuple[str, ...],
                  init: Any, dtype: Any) -> jax.Array:
    """A parameter whose dimensions carry logical axis names for the sharding plan; when
    applying, the given array after a check of its shape (flax's traces every initializer)."""
    if not module.is_initializing() and module.has_variable("params", name):
        value = nn.meta.unbox(module.get_variable("params", name))
        if tuple(value.shape[value.ndim - len(shape):]) != tuple(shape):  # (bound outside the scan: [L, ...])
            where = "/".join((*module.path, name))
            raise ValueError(f"parameter {where} has shape {list(value.shape)}, expected {list(shape)}")
        return value
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class Linear(Module):
    """y = x @ W + b with W of shape [in, out] named by `axes` (logical, not mesh)."""

    features: int = 0
    axes: Tuple[str, str] = ("embed", "mlp")
    use_bias: bool = False
    init_std: float = 0.02

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = logical_param(self, "kernel", (x.shape[-1], self.features), self.axes,
                          nn.initializers.normal(self.init_std), self.pdtype)
        y = jnp.einsum("...i,io->...o", x.astype(self.adtype), w.astype(self.adtype))
        if self.use_bias:
            b = logical_param(self, "bias", (self.features,), self.axes[1:], nn.initializers.zeros, self.pdtype)
            y = y + jax.lax.broadcast_to_rank(b.astype(self.adtype), y.ndim)
        return y

    def flops(self, seq: int) -> float:
        n_in, n_out = nn.meta.unbox(self.variables["params"]["kernel"]).shape[-2:]  # a layer's of a stack
        return 3 * 2 * seq * n_in * n_out


NORM_KINDS = ("layernorm", "rmsnorm")


class Norm(Module):
    """LayerNorm (GPT-2, NeoX) or RMSNorm (Llama, Qwen, Gemma), computed in float32 for
    stability. Gemma scales by (offset + weight) with offset 1, its weights stored around 0."""

    kind: str = "layernorm"
    eps: float = 1e-5
    use_bias: bool = True
    axis_name: str = "embed"
    offset: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        width = x.shape[-1]
        scale = logical_param(self, "scale", (width,), (self.axis_name,), nn.initializers.ones, self.pdtype)
        h = x.astype(jnp.float32)
        if self.kind == "layernorm":
            h = h - h.mean(-1, keepdims=True)
        elif self.kind not in NORM_KINDS:
            raise ValueError(f"unknown norm {self.kind!r}; choose {' or '.join(NORM_KINDS)}")
        scale = scale.astype(jnp.float32) + self.offset
        scale = jax.lax.broadcast_to_rank(scale, h.ndim)  # no implicit rank promotion
        h = h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + self.eps) * scale
        if self.use_bias and self.kind == "layernorm":
            bias = logical_param(self, "bias", (width,), (self.axis_name,), nn.initializers.zeros, self.pdtype)
            h = h + jax.lax.broadcast_to_rank(bias.astype(jnp.float32), h.ndim)
        return h.astype(self.adtype)


# ----------------------------------------------------------------------------- attention


ROPE_SCALINGS = ("linear", "llama3", "longrope")


def rope_frequencies(rot: int, base: float, scaling: Optional[Tuple[Any, ...]] = None) -> jax.Array:
    """The rot/2 rotary frequencies (radians per position), float32, as transformers computes
    them, stretched by `scaling`: ("linear", factor) divides all; ("llama3", factor, low, high,
    original_context) divides wavelengths longer than original / low, keeps those shorter
    than original / high and blends between; ("longrope", original_context, attention_factor,
    *short_factors) divides frequency i by short_factors[i] (Phi-3.5, Phi-4-mini; cos and sin
    scaled by attention_factor, rotary_angles), the factors of sequences up to
    original_context (longer ones are refused: GPT.check_length)."""
    inv_freq = 1.0 / (base ** (jnp.arange(0, rot, 2, dtype=jnp.float32) / rot))
    if scaling is None:
        return inv_freq
    if scaling[0] == "linear":
        if not scaling[1] > 0:  # a factor of 0 would give infinite frequencies, and NaN scores
            raise ValueError(f"linear rope scaling needs a factor above 0, got {scaling[1]}")
        return inv_freq / scaling[1]
    if scaling[0] == "longrope":
        if len(scaling) - 3 != rot // 2 or not (scaling[1] >= 1 and scaling[2] > 0 and min(scaling[3:]) > 0):
            raise ValueError(f"longrope needs an original context, an attention factor and {rot // 2} short "
                             f"factors above 0 (one per rotated pair), got {list(scaling[1:])}")
        return inv_freq / jnp.asarray(scaling[3:], jnp.float32)
    if scaling[0] != "llama3":
        raise ValueError(f"unknown rope scaling {scaling[0]!r}; choose {', '.join(ROPE_SCALINGS)}")
    factor, low, high, original = scaling[1:]
    if not (factor > 0 and 0 < low < high and original >= 1):
        raise ValueError(f"llama3 rope scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and an "
                         f"original context of at least 1, got {list(scaling[1:])}")
    wavelength = 2 * math.pi / inv_freq
    long = jnp.where(wavelength > original / low, inv_freq / factor, inv_freq)
    s = (original / wavelength - low) / (high - low)
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return jnp.where(medium, (1 - s) * long / factor + s * long, long)


def rotary_angles(pos_BT: jax.Array, freq_R: jax.Array, factor: float = 1.0) -> Tuple[jax.Array, jax.Array]:
    """(cos, sin) [B, T, R] of the rotary angles at these positions, float32, for
    rope_frequencies' R frequencies (each half of a head turns by them, rotary);
    longrope's attention factor scales both (transformers scales cos and sin, so q.k by its
    square)."""
    angle_BTR = pos_BT[..., None].astype(jnp.float32) * freq_R[None, None, :]
    cos, sin = jnp.cos(angle_BTR), jnp.sin(angle_BTR)
    return (cos, sin) if factor == 1.0 else (cos * factor, sin * factor)


def rotary(x_BTHE: jax.Array, cos_BTR: jax.Array, sin_BTR: jax.Array) -> jax.Array:
    """Rotary position embedding on the first 2R of each head ("rotate half" layout, as
    Llama and GPT-NeoX store it: its halves x1, x2 become x1 cos - x2 sin, x2 cos + x1 sin),
    by rotary_angles' R-wide tables, in float32; the rest as it is. The halves are a new
    axis, not a concatenation along the head: a TPU compiles that in a third less time."""
    B, T, H, E = x_BTHE.shape
    R = cos_BTR.shape[-1]
    rot = 2 * R
    cos, sin = cos_BTR[:, :, None, None, :], sin_BTR[:, :, None, None, :]  # one per head
    x_BTH2R = x_BTHE[..., :rot].astype(jnp.float32).reshape(B, T, H, 2, R)
    x1, x2 = x_BTH2R[..., :1, :], x_BTH2R[..., 1:, :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -2).reshape(B, T, H, rot)
    return jnp.concatenate([rotated.astype(x_BTHE.dtype), x_BTHE[..., rot:]], -1)


def layer_rotary(c: "AttentionConfig", pos_BT: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """A layer's rotary_angles at these positions, from its config."""
    rot = int(c.head_dim * c.rotary_fraction) // 2 * 2
    longrope = c.rope_scaling is not None and c.rope_scaling[0] == "longrope"
    return rotary_angles(pos_BT, rope_frequencies(rot, c.rope_theta, c.rope_scaling),
                         c.rope_scaling[2] if longrope else 1.0)


def attend_reference(q_BTHE: jax.Array, k_BKSE: jax.Array, v_BKSE: jax.Array, allowed_BTS: jax.Array,
                     scale: Optional[float] = None, softcap: Optional[float] = None,
                     prefix: Optional[Tuple[jax.Array, jax.Array]] = None) -> jax.Array:
    """The plain attention (GPT(attention="reference")), which every fast path below equals:
    each query's scores against all S keys (and a shared prefix's Q keys, seen by every
    query), masked where allowed_BTS is False, softmax in float32, then the weighted sum of
    the values; each group of H/K query heads shares one key/value head."""
    B, T, H, E = q_BTHE.shape
    K = k_BKSE.shape[1]
    if prefix is not None:
        k_BKSE, v_BKSE = (jnp.concatenate([jnp.broadcast_to(p_KQE[None].astype(x.dtype), (B, *p_KQE.shape)), x], 2)
                          for p_KQE, x in zip(prefix, (k_BKSE, v_BKSE)))
        allowed_BTS = jnp.concatenate([jnp.ones((allowed_BTS.shape[0], T, prefix[0].shape[1]), bool), allowed_BTS], -1)
    q_BKGTE = q_BTHE.reshape(B, T, K, H // K, E).transpose(0, 2, 3, 1, 4)
    scores = jnp.einsum("bkgte,bkse->bkgts", q_BKGTE, k_BKSE, preferred_element_type=jnp.float32)
    scores = jnp.where(allowed_BTS[:, None, None], capped(scores, E, scale, softcap), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    y_BKGTE = jnp.einsum("bkgts,bkse->bkgte", probs.astype(v_BKSE.dtype), v_BKSE, preferred_element_type=jnp.float32)
    return y_BKGTE.transpose(0, 3, 1, 2, 4).reshape(B, T, H, E).astype(v_BKSE.dtype)


def attend(q_BTHE: jax.Array, k_BKSE: jax.Array, v_BKSE: jax.Array, allowed_BTS: jax.Array,
           scale: Optional[float] = None, softcap: Optional[float] = None,
           prefix: Optional[Tuple[jax.Array, jax.Array]] = None, step: str = "fast",
           own: Optional[Tuple[jax.Array, jax.Array, jax.Array]] = None) -> jax.Array:
    """attend_reference, fast. Keys and values come head-major, [B, K, S, E], the KV cache's
    own layout, so both einsums are batched over (B, K) and XLA copies nothing of the cache;
    or in the cache's rows of P slots [B, K, S / P, P * E] (slots_per_row), which a step by
    dots reads as they are and anything else as slots. A decoding step (one query per row)
    with grouped heads takes `step`'s way (STEP_ATTENTIONS): "sums", a multiply and a sum for
    each product, or "dots"; GPT-2's one head per key head keeps the matmuls. Scores and
    softmax are float32; fully masked rows (left padding) come out finite and are never read
    by real tokens.

    prefix (k_KQE, v_KQE): Q keys and values every query sees before its row's S (a batch's
    shared few-shot examples, KVCache.prefix_keys): at a decoding step one matmul over all
    rows' queries, read once, the softmax over Q + S together; a prefill sees it copied
    before each row's keys (scores split in two would cost passes).

    own (k_BK1E, v_BK1E, slot): a decoding step's own key and value, not yet in the cache,
    which stand in for slot `slot`'s: equal to attending over the cache with them written
    there, but the cache is only read (GPT.decode writes every layer's after the layers).
    """
    B, T, H, E = q_BTHE.shape
    K, G = k_BKSE.shape[1], H // k_BKSE.shape[1]
    sums = T == 1 and H > K and backend_choice("step", step) == "sums"  # multiplies and sums, not matmuls
    if k_BKSE.shape[-1] != E and (T > 1 or sums):  # rows of P slots (slots_per_row): a step by dots reads them so
        k_BKSE, v_BKSE = unpack_slots(k_BKSE, E), unpack_slots(v_BKSE, E)
    P = k_BKSE.shape[-1] // E
    S, eye_P = k_BKSE.shape[2] * P, jnp.eye(P, dtype=q_BTHE.dtype).reshape(1, 1, 1, P, P)
    if prefix is not None and T > 1:
        k_BKSE, v_BKSE = (jnp.concatenate([jnp.broadcast_to(p_KQE.astype(x.dtype), (B, *p_KQE.shape)), x], 2)
                          for p_KQE, x in zip(prefix, (k_BKSE, v_BKSE)))
        allowed_BTS = jnp.concatenate([jnp.ones((*allowed_BTS.shape[:2], prefix[0].shape[1]), bool),
                                       jnp.broadcast_to(allowed_BTS, (B, *allowed_BTS.shape[1:]))], -1)
        prefix = None
    q_BKGTE = q_BTHE.reshape(B, T, K, G, E).transpose(0, 2, 3, 1, 4)

    def scores_against(k_BKSE: jax.Array) -> jax.Array:
        if sums:
            return (q_BKGTE.astype(jnp.float32) * k_BKSE[:, :, None].astype(jnp.float32)).sum(-1)[:, :, :, None]
        if k_BKSE.shape[-1] != E:  # the query in each of a row's P slots' lanes, the rest zeros: [B, K, G, S/P, P]
            q_BKGPW = (eye_P[..., None] * q_BKGTE[:, :, :, :, None]).reshape(B, K, G, P, -1)
            scores = jnp.einsum("bkgpw,bkrw->bkgrp", q_BKGPW, k_BKSE, preferred_element_type=jnp.float32)
            return scores.reshape(B, K, G, 1, S)
        return jnp.einsum("bkgte,bkse->bkgts", q_BKGTE, k_BKSE, preferred_element_type=jnp.float32)

    scores = scores_against(k_BKSE)
    if own is not None:
        at_own_S = jnp.arange(S) == own[2]
        scores = jnp.where(at_own_S, scores_against(own[0].astype(k_BKSE.dtype)), scores)
    scores = jnp.where(allowed_BTS[:, None, None], capped(scores, E, scale, softcap), jnp.finfo(jnp.float32).min)
    if T == 1:  # one pass over the cache: softmax, then the weighted sum of v fused into it
        Q = 0
        if prefix is not None:
            prefix_scores = jnp.einsum("bkgte,kqe->bkgtq", q_BKGTE, prefix[0].astype(q_BKGTE.dtype),
                                       preferred_element_type=jnp.float32)
            scores, Q = jnp.concatenate([capped(prefix_scores, E, scale, softcap), scores], -1), prefix[0].shape[1]
        probs = jax.nn.softmax(scores, axis=-1)
        probs_BKGS = probs[:, :, :, 0, Q:]
        if own is not None:  # the stale value in the step's own slot weighs nothing; its own value takes its weight
            own_BKG = jax.lax.dynamic_index_in_dim(probs_BKGS, own[2], -1, False)
            probs_BKGS = jnp.where(at_own_S, 0.0, probs_BKGS)
        if sums:
            y_BKGE = (probs_BKGS[..., None] * v_BKSE[:, :, None].astype(jnp.float32)).sum(-2)
        elif P > 1:  # each of a row's P slots weighs the whole row, then takes its own lanes
            y_BKGPW = jnp.einsum("bkgrp,bkrw->bkgpw", probs_BKGS.reshape(B, K, G, S // P, P).astype(v_BKSE.dtype),
                                 v_BKSE, preferred_element_type=jnp.float32)
            y_BKGE = (y_BKGPW.reshape(B, K, G, P, P, E) * eye_P[..., None]).sum((3, 4))
        else:
            y_BKGE = jnp.einsum("bkgs,bkse->bkge", probs_BKGS.astype(v_BKSE.dtype), v_BKSE,
                                preferred_element_type=jnp.float32)
        if own is not None:
            y_BKGE = y_BKGE + own_BKG[..., None] * own[1].astype(jnp.float32)
        if prefix is not None:
            y_BKGE = y_BKGE + jnp.einsum("bkgq,kqe->bkge", probs[:, :, :, 0, :Q].astype(v_BKSE.dtype),
                                         prefix[1].astype(v_BKSE.dtype), preferred_element_type=jnp.float32)
        return y_BKGE.astype(v_BKSE.dtype).reshape(B, T, H, E)
    # softmax normalized after the product with v, T x E divisions instead of T x S: on a
    # CPU each pass over the scores costs more than the products
    weights = jnp.exp(scores - jax.lax.stop_gradient(scores.max(-1, keepdims=True)))
    y_BKGTE = jnp.einsum("bkgts,bkse->bkgte", weights.astype(v_BKSE.dtype), v_BKSE, preferred_element_type=jnp.float32)
    y_BKGTE = y_BKGTE / weights.sum(-1, keepdims=True)
    return y_BKGTE.transpose(0, 3, 1, 2, 4).reshape(B, T, H, E).astype(v_BKSE.dtype)


def capped(scores: jax.Array, E: int, scale: Optional[float], softcap: Optional[float]) -> jax.Array:
    """Scores q.k scaled (None: by 1 / sqrt(E)) and, with a softcap (Gemma 2), softcap *
    tanh(s / softcap) before the mask, as transformers caps them."""
    scores = scores / math.sqrt(E) if scale is None else scores * scale
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """The sizes and options of one attention layer (frozen: flax module fields must hash)."""

    width: int = 128
    n_head: int = 4
    n_kv_head: int = 4
    head_dim: int = 32
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False
    norm_eps: float = 1e-6
    norm_offset: float = 0.0  # q/k norm scale (offset + weight): Gemma 1.0
    rope: bool = False  # its tables come in (GPT.rotary_tables), from these three
    rotary_fraction: float = 1.0
    rope_theta: float = 10000.0
    rope_scaling: Optional[Tuple[Any, ...]] = None
    qk_norm_full: bool = False  # the q/k norm over all heads' width at once (OLMo 2), not per head
    window: Optional[int] = None  # a query sees itself and the window - 1 keys before it; None: all
    scale: Optional[float] = None  # of the scores q.k; None: 1 / sqrt(head_dim)
    softcap: Optional[float] = None  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
    dropout: float = 0.0
    residual_std: float = 0.02
    reference: bool = False  # attend_reference everywhere, instead of the fast paths
    kernel: str = "fast"  # attend_causal's (ATTENTIONS)
    step: str = "fast"  # a decoding step's (STEP_ATTENTIONS)
    query_block: int = 256  # queries per block of attend_causal's blocked path


# How each backend computes attention, never what: every kernel equals attend_reference.
# GPT's attention and step_attention "fast" take their backend's row; a
# choice's name forces it anywhere, so a user can pick and a test compare (docs/speed.md
# measures the TPU's).
#   half, full: attend_causal's kernel for rows without a cache (scoring, training) in half
#     precision, in float32: "xla" attend's einsums (in query blocks, attend_blocks, on long
#     rows), "cudnn" cuDNN's fused kernel (jax.nn.dot_product_attention), "splash" JAX's
#     Pallas splash attention for TPUs (attend_splash). Float32 keeps "xla": its answers
#     equal a CPU's.
#   step: a decoding step's grouped heads (attend): "sums", a multiply and a sum for each
#     product, one pass over the cache (a CPU's dots of G rows read it slowly), or "dots",
#     einsums (a TPU's matrix unit).
#   rows: attend_blocks' rows at a time: "all", or "device", one per device of the mesh's
#     "batch" axis (so a block's scores stay in a CPU's cache).
#   lanes: the KV cache's rows (GPT.cache_lanes, slots_per_row): 0, one slot a row; 128, as
#     many slots side by side as fill a TPU's 128 lanes (a row of 64 would make the TPU tile
#     the cache across its slots, and each step's write touch a tile of 128 slots).
#   tile: whether a decoding step writes the whole tile of the cache around its slot,
#     put back by one DMA (write_tile, put_tile), where a TPU would write the one row piece
#     by piece.
BACKEND_ATTENTION = {
    "cpu": dict(half="xla", full="xla", step="sums", rows="device", lanes=0, tile=False),
    "gpu": dict(half="cudnn", full="xla", step="sums", rows="all", lanes=0, tile=False),
    "tpu": dict(half="splash", full="xla", step="dots", rows="all", lanes=128, tile=True),
}
OTHER_BACKEND = dict(half="xla", full="xla", step="sums", rows="all", lanes=0, tile=False)
TILE_BYTES = 32  # a TPU tile's rows times their values' bytes: 8 rows of float32, 16 of bfloat16
ATTENTIONS = ("fast", "reference", "xla", "cudnn", "splash")  # GPT.attention ("reference": attend_reference)
STEP_ATTENTIONS = ("fast", "sums", "dots")  # GPT.step_attention


def backend_choice(kind: str, choice: Any = "fast") -> Any:
    """`choice`, or for "fast" (or None) this backend's BACKEND_ATTENTION[kind]."""
    return BACKEND_ATTENTION.get(jax.default_backend(), OTHER_BACKEND)[kind] if choice in ("fast", None) else choice


def slots_per_row(lanes: int, width: int, slots: int) -> int:
    """How many of a cache's `slots` (each `width` values) init_cache puts side by side in
    a row of `lanes` values (BACKEND_ATTENTION's lanes): 1 where they do not fit evenly."""
    per_row = lanes // width if lanes > width and lanes % width == 0 else 1
    return per_row if slots % per_row == 0 else 1


def unpack_slots(x_RW: jax.Array, width: int) -> jax.Array:
    """A cache's [..., S / P, P * width] rows (slots_per_row P) as [..., S, width] slots."""
    return x_RW.reshape(*x_RW.shape[:-2], -1, width)


def pack_slots(x_SE: jax.Array, width: int) -> jax.Array:
    """[..., S, E] slots as rows `width` wide, P = width / E slots side by side."""
    return x_SE.reshape(*x_SE.shape[:-2], -1, width)


def write_slots(x_LBKRW: jax.Array, new_LBKTE: jax.Array, slot: jax.Array, fresh: bool) -> jax.Array:
    """A cache's keys or values (rows of P slots) with new ones [L, B, K, T, E] at slots
    slot .. slot + T: a step's into its row's lanes (by whole tiles where the backend's
    `tile` says so), an empty cache's (fresh: slot 0) as whole rows, else through the
    slots' view."""
    new, (T, E) = new_LBKTE.astype(x_LBKRW.dtype), new_LBKTE.shape[3:]
    P, H = x_LBKRW.shape[-1] // E, TILE_BYTES // x_LBKRW.dtype.itemsize
    if T == 1 and P > 1 and backend_choice("tile") and x_LBKRW.shape[-2] % H == 0:
        return write_tile(x_LBKRW, new, slot, H)
    if P == 1:
        return jax.lax.dynamic_update_slice(x_LBKRW, new, (0, 0, 0, slot, 0))
    if T == 1:
        return jax.lax.dynamic_update_slice(x_LBKRW, new, (0, 0, 0, slot // P, slot % P * E))
    if fresh and T % P == 0:
        return jax.lax.dynamic_update_slice(x_LBKRW, pack_slots(new, P * E), (0, 0, 0, slot // P, 0))
    return pack_slots(jax.lax.dynamic_update_slice(unpack_slots(x_LBKRW, E), new, (0, 0, 0, slot, 0)), P * E)


def write_tile(x_LBKRW: jax.Array, new_LBK1E: jax.Array, slot: jax.Array, H: int) -> jax.Array:
    """write_slots of one step, through the H rows around its slot read whole, the slot's
    lanes replaced, and put back by one DMA (put_tile): a TPU writes a tile's single row
    piece by piece, one piece for each layer, row and head."""
    E = new_LBK1E.shape[-1]
    P = x_LBKRW.shape[-1] // E
    row = slot // P
    first = row // H * H
    tile = jax.lax.dynamic_slice_in_dim(x_LBKRW, first, H, 3)
    mine_HW = (jnp.arange(H)[:, None] == row - first) & (jnp.arange(P * E)[None] // E == slot % P)
    return put_tile(x_LBKRW, jnp.where(mine_HW, jnp.tile(new_LBK1E, (1, 1, 1, 1, P)), tile), first)


def put_tile(x_LBKRW: jax.Array, tile_LBKHW: jax.Array, first: jax.Array) -> jax.Array:
    """jax.lax.dynamic_update_slice_in_dim(x, tile, first, 3) in place, by one DMA of a
    Pallas kernel (interpreted off a TPU, for tests): XLA's own update copies the tile's
    pieces one at a time. On a mesh each device puts its own rows and heads (jax.shard_map),
    as a Pallas kernel is opaque to XLA's partitioner."""
    H = tile_LBKHW.shape[3]

    def kernel(first_ref, tile_ref, x_ref, out_ref, done):
        del x_ref  # the same buffer as out_ref
        rows = pl.ds(pl.multiple_of(first_ref[0], H), H)
        copy = pltpu.make_async_copy(tile_ref, out_ref.at[:, :, :, rows, :], done)
        copy.start()
        copy.wait()

    def on_device(first_1, x, tile):
        anywhere = pl.BlockSpec(memory_space=pl.ANY)
        grid = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(1,), in_specs=[anywhere, anywhere],
                                            out_specs=anywhere, scratch_shapes=[pltpu.SemaphoreType.DMA])
        interpret = jax.default_backend() != "tpu"
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid_spec=grid,
                              input_output_aliases={2: 0}, interpret=interpret)(first_1, tile, x)

    first_1 = jnp.reshape(first, (1,)).astype(jnp.int32)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return on_device(first_1, x_LBKRW, tile_LBKHW)
    spec = PartitionSpec(None, mesh_axis(mesh, "batch", x_LBKRW.shape[1]), mesh_axis(mesh, "shard", x_LBKRW.shape[2]))
    return jax.shard_map(on_device, in_specs=(PartitionSpec(), spec, spec), out_specs=spec,
                         check_vma=False)(first_1, x_LBKRW, tile_LBKHW)


def mesh_axis(mesh: Any, axis: str, n: int) -> Optional[str]:
    """`axis` where the mesh has it and it splits n evenly (a shard_map's spec), else None."""
    return axis if axis in mesh.shape and n % mesh.shape[axis] == 0 else None


def causal_kernel(choice: str, dtype: Any, T: int, masked: bool, softcap: Optional[float]) -> str:
    """The kernel attend_causal runs for `choice` (ATTENTIONS, "fast": the backend's for the
    dtype) on T tokens: a fused one ("cudnn", "splash") where it can, else "xla" (also for
    "reference"): not under a mask (packed rows, or where windows mix), not cuDNN's with a
    soft-cap, not splash's where T is no multiple of its blocks."""
    half = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
    kernel = backend_choice("half" if half else "full", choice)
    cannot = masked or (kernel == "cudnn" and softcap is not None) or (kernel == "splash" and T % SPLASH_BLOCK_MIN)
    return "xla" if cannot or kernel not in ("cudnn", "splash") else kernel


def attend_causal(q_BTHE: jax.Array, k_BTKE: jax.Array, v_BTKE: jax.Array, allowed_BTS: Optional[jax.Array] = None,
                  scale: Optional[float] = None, window: Optional[int] = None,
                  softcap: Optional[float] = None, query_block: int = 256, kernel: str = "fast") -> jax.Array:
    """attend_reference without a cache, fast, where no query sees a later key (rows right
    padded, or packed). allowed_BTS None: plain causal within the window W (i - W < j <= i);
    else which keys each query sees. The kernel is causal_kernel's for `kernel`: cuDNN's or
    splash's fused ones; or "xla": rows of at most query_block // 4 tokens through attend's
    einsums, whole squares at once, longer rows in blocks of query_block queries
    (attend_blocks), each over the keys up to its last query only (rows_at_a_time at once)."""
    B, T = q_BTHE.shape[:2]
    kernel = causal_kernel(kernel, q_BTHE.dtype, T, allowed_BTS is not None, softcap)
    if kernel == "splash":
        return attend_splash(q_BTHE, k_BTKE, v_BTKE, scale, window, softcap)
    if kernel == "cudnn":
        local = None if window is None else (window - 1, 0)  # i - left <= j <= i + right
        try:
            return jax.nn.dot_product_attention(q_BTHE, k_BTKE, v_BTKE, scale=scale, is_causal=True,
                                                local_window_size=local, implementation="cudnn")
        except (RuntimeError, ValueError, NotImplementedError):  # raised while tracing, before any work
            pass
    k_BKSE, v_BKSE = k_BTKE.transpose(0, 2, 1, 3), v_BTKE.transpose(0, 2, 1, 3)
    if T <= query_block // 4:
        if allowed_BTS is None:
            allowed_BTS = causal_window(0, T, 0, T, window)[None]
        return attend(q_BTHE, k_BKSE, v_BKSE, allowed_BTS, scale, softcap)
    rows = rows_at_a_time(B)
    if rows == B:
        return attend_blocks(q_BTHE, k_BKSE, v_BKSE, allowed_BTS, scale, softcap, window, query_block)
    if allowed_BTS is not None:  # (one mask for every row, GPT.masks' where windows mix)
        allowed_BTS = jnp.broadcast_to(allowed_BTS, (B, *allowed_BTS.shape[1:]))
    # step i takes rows i, i + B/rows, ...: one row of each device's share, as the batch
    # axis splits rows into contiguous shares (a step over a device's own rows alone would
    # make XLA's partitioner gather every row onto every device)
    steps = lambda x_B: None if x_B is None else x_B.reshape(rows, B // rows, *x_B.shape[1:]).swapaxes(0, 1)
    y_NRTHE = jax.lax.map(lambda args: attend_blocks(*args, scale, softcap, window, query_block),
                          (steps(q_BTHE), steps(k_BKSE), steps(v_BKSE), steps(allowed_BTS)))
    return y_NRTHE.swapaxes(0, 1).reshape(q_BTHE.shape)


SPLASH_BLOCK_MIN, SPLASH_BLOCK_MAX = 128, 512  # splash's query and key blocks: a multiple of 128 that divides T


def attend_splash(q_BTHE: jax.Array, k_BTKE: jax.Array, v_BTKE: jax.Array, scale: Optional[float],
                  window: Optional[int], softcap: Optional[float]) -> jax.Array:
    """attend_causal by JAX's Pallas splash attention kernel for TPUs (interpreted elsewhere,
    for tests): plain causal within the window, the soft-cap inside it, never a [T, S] score
    in memory. Each row and key head is one call of its multi-query kernel over that head's
    G queries; on a mesh each device calls it on its own rows and heads (jax.shard_map), as a
    Pallas kernel is opaque to XLA's partitioner."""
    mesh = jax.sharding.get_abstract_mesh()
    local = functools.partial(splash_on_device, scale=scale, window=window, softcap=softcap)
    if mesh.empty or mesh.size == 1:
        return local(q_BTHE, k_BTKE, v_BTKE)
    spec = PartitionSpec(mesh_axis(mesh, "batch", q_BTHE.shape[0]), None, mesh_axis(mesh, "shard", k_BTKE.shape[2]),
                         None)  # groups stay whole
    return jax.shard_map(local, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)(q_BTHE, k_BTKE, v_BTKE)


def splash_on_device(q_BTHE: jax.Array, k_BTKE: jax.Array, v_BTKE: jax.Array, scale: Optional[float],
                     window: Optional[int], softcap: Optional[float]) -> jax.Array:
    """attend_splash on one device's rows and heads."""
    B, T, H, E = q_BTHE.shape
    K = k_BTKE.shape[2]
    block = math.gcd(T, SPLASH_BLOCK_MAX)
    mask = splash_masks.CausalMask((T, T)) if window is None else splash_masks.LocalMask((T, T), (window - 1, 0), 0)
    sizes = dict(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block, block_kv_dkv=block,
                 block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    kernel = splash.make_splash_mqa_single_device(splash_masks.MultiHeadMask([mask] * (H // K)),
                                                  block_sizes=splash.BlockSizes(**sizes), attn_logits_soft_cap=softcap,
                                                  interpret=jax.default_backend() != "tpu")
    q_BKGTE = q_BTHE.reshape(B, T, K, H // K, E).transpose(0, 2, 3, 1, 4)
    q_BKGTE = q_BKGTE * jnp.asarray(1 / math.sqrt(E) if scale is None else scale, q_BTHE.dtype)
    y_BKGTE = jax.vmap(jax.vmap(kernel))(q_BKGTE, k_BTKE.transpose(0, 2, 1, 3), v_BTKE.transpose(0, 2, 1, 3))
    return y_BKGTE.transpose(0, 3, 1, 2, 4).reshape(B, T, H, E)


def rows_at_a_time(B: int) -> int:
    """How many rows attend_blocks takes at once (BACKEND_ATTENTION's rows): all B, or one per
    device of the "batch" axis of the mesh traced under (jax.set_mesh)."""
    if backend_choice("rows") == "all":
        return B
    mesh = jax.sharding.get_abstract_mesh()
    devices = 1 if mesh.empty else mesh.shape.get("batch", 1)
    return devices if B % devices == 0 else B


def attend_blocks(q_BTHE: jax.Array, k_BKSE: jax.Array, v_BKSE: jax.Array, allowed_BTS: Optional[jax.Array],
                  scale: Optional[float], softcap: Optional[float], window: Optional[int],
                  query_block: int) -> jax.Array:
    """Equals attend_reference with a causal mask: attend_causal's blocked path: queries start .. end
    see keys lo .. end, lo the first key the window lets the block's first query see (0 with
    allowed_BTS given: a packed row's window counts positions, not slots)."""
    T = q_BTHE.shape[1]
    outs = []
    for start in range(0, T, query_block):
        end = min(start + query_block, T)
        if allowed_BTS is None:
            lo = 0 if window is None else max(0, start - window + 1)
            allowed = causal_window(start, end, lo, end, window)[None]
        else:
            lo, allowed = 0, allowed_BTS[:, start:end, :end]
        outs.append(attend(q_BTHE[:, start:end], k_BKSE[:, :, lo:end], v_BKSE[:, :, lo:end], allowed, scale, softcap))
    return jnp.concatenate(outs, 1)


def causal_window(q0: int, q1: int, k0: int, k1: int, window: Optional[int]) -> jax.Array:
    """allowed[t, s] for queries q0 .. q1 and keys k0 .. k1 (slots), every key real."""
    query_T, key_S = jnp.arange(q0, q1), jnp.arange(k0, k1)
    allowed_1TS = causal_allowed(jnp.ones((1, k1 - k0), bool), query_T, key_S)
    return allowed_1TS[0] if window is None else allowed_1TS[0] & window_allowed(query_T, key_S, window)


class Layer(NamedTuple):
    """What differs from one layer to the next, scanned over with the layers' stacked
    parameters (GPT.decode): whether it is a local layer where local and global ones mix
    (None: all alike, see GPT.layer_kinds), its shared prefix's (k_KQE, v_KQE) and its
    slots of the KV cache as they were before this call, in rows (KVCache; None without)."""

    local: Optional[jax.Array]
    prefix: Optional[Tuple[jax.Array, jax.Array]]
    kv: Optional[Tuple[jax.Array, jax.Array]]


class Attention(Module):
    """Causal self-attention with grouped key/value heads, optional q/k norm and rotary. With
    this layer's KV cache (Layer.kv) the queries attend over its S slots with the new keys
    and values at `slot` (attend) as allowed_BTS says, the window included; without one,
    attend_causal (allowed_BTS None: plain causal)."""

    cfg: AttentionConfig = AttentionConfig()

    def setup(self) -> None:
        c, dt = self.cfg, dict(param_dtype=self.param_dtype, activation_dtype=self.activation_dtype)
        H, K, E = c.n_head, c.n_kv_head, c.head_dim
        self.q = Linear(features=H * E, axes=("embed", "heads"), use_bias=c.qkv_bias, **dt)
        self.k = Linear(features=K * E, axes=("embed", "kv_heads"), use_bias=c.qkv_bias, **dt)
        self.v = Linear(features=K * E, axes=("embed", "kv_heads"), use_bias=c.qkv_bias, **dt)
        # GPT-2 scales the init of layers that write into the residual stream by 1/sqrt(2L)
        self.o = Linear(features=c.width, axes=("heads", "embed"), use_bias=c.out_bias, init_std=c.residual_std, **dt)
        if c.qk_norm:  # Qwen3: RMSNorm over each head's width, before rotary; OLMo 2 over all heads'
            norm = dict(kind="rmsnorm", eps=c.norm_eps, use_bias=False, offset=c.norm_offset, **dt)
            q_axis, k_axis = ("heads", "kv_heads") if c.qk_norm_full else ("head_dim", "head_dim")
            self.q_norm, self.k_norm = Norm(axis_name=q_axis, **norm), Norm(axis_name=k_axis, **norm)
        self.drop = nn.Dropout(c.dropout)

    def __call__(self, x_BTD: jax.Array, rotary_tables: Optional[Tuple[jax.Array, jax.Array]],
                 allowed_BTS: Optional[jax.Array], layer: Layer, deterministic: bool = True,
                 slot: Optional[jax.Array] = None, fresh: bool = False):
        """(y_BTD, the new (k_BKTE, v_BKTE) for the cache's slots slot .. slot + T, which
        GPT.decode writes, or None without a cache). rotary_tables: this layer's (cos, sin)
        [B, T, R] (rotary_angles), or None without rotary; fresh: the cache is empty (see
        GPT.decode); layer.prefix: the cache's shared (k_KQE, v_KQE) or None."""
        c = self.cfg
        B, T, D = x_BTD.shape
        q_BTHE = self.q(x_BTD).reshape(B, T, c.n_head, c.head_dim)
        k_BTKE = self.k(x_BTD).reshape(B, T, c.n_kv_head, c.head_dim)
        v_BTKE = self.v(x_BTD).reshape(B, T, c.n_kv_head, c.head_dim)
        if c.qk_norm and c.qk_norm_full:  # OLMo 2: over all heads' width, the projection as it comes
            q_BTHE = self.q_norm(q_BTHE.reshape(B, T, -1)).reshape(q_BTHE.shape)
            k_BTKE = self.k_norm(k_BTKE.reshape(B, T, -1)).reshape(k_BTKE.shape)
        elif c.qk_norm:
            q_BTHE, k_BTKE = self.q_norm(q_BTHE), self.k_norm(k_BTKE)
        if rotary_tables is not None:
            q_BTHE, k_BTKE = rotary(q_BTHE, *rotary_tables), rotary(k_BTKE, *rotary_tables)
        new_kv = None if layer.kv is None else (k_BTKE.transpose(0, 2, 1, 3), v_BTKE.transpose(0, 2, 1, 3))
        # no cache, or an empty one (fresh): the new tokens see only each other, no later key;
        # else they attend over all S slots. With a cache, allowed_BTS holds the window.
        own, prefix = layer.kv is None or fresh, layer.prefix
        step = not own and T == 1 and not c.reference  # attend reads the cache as it is, the new key beside it
        if step:
            k_BKSE, v_BKSE = layer.kv
        elif not own:  # the T new keys and values into a copy of the layer's slots
            k_BKSE, v_BKSE = (jax.lax.dynamic_update_slice(unpack_slots(x, c.head_dim), new.astype(x.dtype),
                                                           (0, 0, slot, 0)) for x, new in zip(layer.kv, new_kv))
        if c.reference:
            if own:
                k_BKSE, v_BKSE = k_BTKE.transpose(0, 2, 1, 3), v_BTKE.transpose(0, 2, 1, 3)
            if allowed_BTS is None:
                allowed_BTS = causal_window(0, T, 0, T, c.window)[None]
            y_BTHE = attend_reference(q_BTHE, k_BKSE.astype(q_BTHE.dtype), v_BKSE.astype(q_BTHE.dtype), allowed_BTS,
                                      c.scale, c.softcap, None if own else prefix)
        elif own:
            y_BTHE = attend_causal(q_BTHE, k_BTKE, v_BTKE, allowed_BTS, c.scale, c.window, c.softcap, c.query_block,
                                   c.kernel)
        else:
            y_BTHE = attend(q_BTHE, k_BKSE.astype(q_BTHE.dtype), v_BKSE.astype(q_BTHE.dtype), allowed_BTS,
                            c.scale, c.softcap, prefix, c.step, (*new_kv, slot) if step else None)
        y_BTD = self.o(y_BTHE.reshape(B, T, c.n_head * c.head_dim))
        return self.drop(y_BTD, deterministic=deterministic), new_kv

    def flops(self, seq: int) -> float:
        scores = 2 * 2 * seq * seq * self.cfg.n_head * self.cfg.head_dim  # q @ k^T and p @ v
        return super().flops(seq) + 3 * scores

    @classmethod
    def components(cls) -> List[Type[Any]]:
        return [Linear, Norm]


MLP_KINDS = ("gelu", "gelu_exact", "swiglu", "geglu")


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """The sizes and kind of one MLP: "gelu" (tanh approximation), "gelu_exact", "swiglu"
    or "geglu"."""

    width: int = 128
    hidden: int = 512
    kind: str = "gelu"
    bias: bool = False
    dropout: float = 0.0
    residual_std: float = 0.02


class MLP(Module):
    """GELU MLP (GPT-2: tanh approximation; NeoX: exact), or gated: SwiGLU (Llama, Qwen,
    Mistral: silu(gate(x)) * up(x)) or GeGLU (Gemma: gelu_tanh(gate(x)) * up(x))."""

    cfg: MLPConfig = MLPConfig()

    def setup(self) -> None:
        c, dt = self.cfg, dict(param_dtype=self.param_dtype, activation_dtype=self.activation_dtype)
        if c.kind not in MLP_KINDS:
            raise ValueError(f"unknown mlp {c.kind!r}; choose {', '.join(MLP_KINDS)}")
        self.up = Linear(features=c.hidden, axes=("embed", "mlp"), use_bias=c.bias, **dt)
        if c.kind in ("swiglu", "geglu"):
            self.gate = Linear(features=c.hidden, axes=("embed", "mlp"), use_bias=c.bias, **dt)
        self.down = Linear(features=c.width, axes=("mlp", "embed"), use_bias=c.bias, init_std=c.residual_std, **dt)
        self.drop = nn.Dropout(c.dropout)

    def __call__(self, x_BTD: jax.Array, deterministic: bool = True) -> jax.Array:
        if self.cfg.kind == "swiglu":
            h_BTF = jax.nn.silu(self.gate(x_BTD)) * self.up(x_BTD)
        elif self.cfg.kind == "geglu":
            h_BTF = jax.nn.gelu(self.gate(x_BTD), approximate=True) * self.up(x_BTD)
        else:
            h_BTF = jax.nn.gelu(self.up(x_BTD), approximate=self.cfg.kind == "gelu")
        return self.drop(self.down(h_BTF), deterministic=deterministic)

    @classmethod
    def components(cls) -> List[Type[Any]]:
        return [Linear]


def expert_weights(logits_BTX: jax.Array, active: int, norm_topk_prob: bool) -> jax.Array:
    """Each token's weight for each of X experts [B, T, X], float32, from its router logits:
    softmax, then the `active` largest probabilities (exactly that many experts, the lower
    index first among equals), renormalised to sum 1 with norm_topk_prob; zero elsewhere."""
    probs_BTX = jax.nn.softmax(logits_BTX.astype(jnp.float32), axis=-1)
    top_BTA, index_BTA = jax.lax.top_k(probs_BTX, active)
    if norm_topk_prob:
        top_BTA = top_BTA / top_BTA.sum(-1, keepdims=True)
    chosen_BTAX = jax.nn.one_hot(index_BTA, logits_BTX.shape[-1], dtype=jnp.float32)
    return (chosen_BTAX * top_BTA[..., None]).sum(-2)


@dataclasses.dataclass(frozen=True)
class ExpertsConfig:
    """n_experts gated MLPs of the MLPConfig's sizes and kind, `active` per token, the picked
    weights renormalised with norm_topk_prob; shared_hidden: one more MLP's width that every
    token goes through, scaled by a sigmoid gate (Qwen2-MoE), or None."""

    n_experts: int = 4
    active: int = 2
    norm_topk_prob: bool = False
    shared_hidden: Optional[int] = None


class MoE(Module):
    """A mixture of gated-MLP experts (Mixtral, Qwen-MoE, OLMoE), X experts, A active, routed
    as transformers routes (expert_weights). Dense dispatch: every expert computes every token,
    weighted zero outside its top A, so no token is dropped and the result is exact, at X/A
    times the active experts' arithmetic (flops() counts the active ones). The experts are
    stacked [X, ...] on the logical axis "experts", split over "shard" (expert parallel): each
    device runs its own on every token, and the weighted sum over X adds the devices' parts."""

    cfg: MLPConfig = MLPConfig(kind="swiglu")
    experts: ExpertsConfig = ExpertsConfig()

    def setup(self) -> None:
        c, dt = self.cfg, dict(param_dtype=self.param_dtype, activation_dtype=self.activation_dtype)
        if c.kind not in ("swiglu", "geglu") or c.bias:
            raise ValueError(f"experts are gated MLPs without biases (swiglu or geglu), not {c.kind!r} "
                             f"with bias={c.bias}")
        X, D, F = self.experts.n_experts, c.width, c.hidden
        self.router = Linear(features=X, axes=("embed", None), **dt)
        expert = lambda name, shape, axes, std: logical_param(self, name, shape, axes, nn.initializers.normal(std),
                                                               self.pdtype)
        self.gate = expert("gate", (X, D, F), ("experts", "embed", "expert_mlp"), 0.02)
        self.up = expert("up", (X, D, F), ("experts", "embed", "expert_mlp"), 0.02)
        self.down = expert("down", (X, F, D), ("experts", "expert_mlp", "embed"), c.residual_std)
        if self.experts.shared_hidden is not None:
            self.shared = MLP(cfg=dataclasses.replace(c, hidden=self.experts.shared_hidden), **dt)
            self.shared_gate = Linear(features=1, axes=("embed", None), **dt)
        self.drop = nn.Dropout(c.dropout)

    def __call__(self, x_BTD: jax.Array, deterministic: bool = True) -> jax.Array:
        weights_BTX = expert_weights(self.router(x_BTD), self.experts.active, self.experts.norm_topk_prob)
        x_BTD, dt = x_BTD.astype(self.adtype), self.adtype
        gate_BTXF = jnp.einsum("btd,xdf->btxf", x_BTD, self.gate.astype(dt))
        up_BTXF = jnp.einsum("btd,xdf->btxf", x_BTD, self.up.astype(dt))
        act = jax.nn.silu if self.cfg.kind == "swiglu" else functools.partial(jax.nn.gelu, approximate=True)
        h_BTXF = act(gate_BTXF) * up_BTXF
        # weighting before the down projection sums over experts and F in one contraction,
        # so no [B, T, X, D] tensor exists (the same sum as weighting each expert's output)
        h_BTXF = (h_BTXF.astype(jnp.float32) * weights_BTX[..., None]).astype(dt)
        y_BTD = jnp.einsum("btxf,xfd->btd", h_BTXF, self.down.astype(dt))
        if self.experts.shared_hidden is not None:
            y_BTD = y_BTD + jax.nn.sigmoid(self.shared_gate(x_BTD)) * self.shared(x_BTD)
        return self.drop(y_BTD, deterministic=deterministic)

    def flops(self, seq: int) -> float:
        """The router, the A active experts per token (not all X that dense dispatch runs),
        and the shared expert."""
        D, X, shared = self.cfg.width, self.experts.n_experts, self.experts.shared_hidden
        gated = lambda hidden: 3 * 2 * seq * 3 * D * hidden  # gate, up, down
        total = 3 * 2 * seq * D * X + self.experts.active * gated(self.cfg.hidden)  # the router, the active experts
        if shared is not None:  # (from the sizes: a stacked layer's setup would see [L, ...] weights)
            total += gated(shared) + 3 * 2 * seq * D
        return total

    @classmethod
    def components(cls) -> List[Type[Any]]:
        return [Linear, MLP]


class Block(Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); parallel_residual (GPT-NeoX):
    x + attn(norm1(x)) + mlp(norm2(x)); sandwich_norm (Gemma) norms each sublayer's output
    too, and without pre_norm (OLMo 2) only its output; residual_multiplier scales each
    output (Granite); with `experts` the MLP is a mixture (MoE)."""

    attention: AttentionConfig = AttentionConfig()
    feedforward: MLPConfig = MLPConfig()
    experts: Optional[ExpertsConfig] = None
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_bias: bool = True
    norm_offset: float = 0.0
    parallel_residual: bool = False
    sandwich_norm: bool = False
    pre_norm: bool = True
    residual_multiplier: float = 1.0

    def setup(self) -> None:
        dt = dict(param_dtype=self.param_dtype, activation_dtype=self.activation_dtype)
        norm = dict(kind=self.norm, eps=self.norm_eps, use_bias=self.norm_bias, offset=self.norm_offset, **dt)
        if self.pre_norm:
            self.ln_1, self.ln_2 = Norm(**norm), Norm(**norm)
        if self.sandwich_norm:
            self.ln_attn_out, self.ln_mlp_out = Norm(**norm), Norm(**norm)
        self.attn = Attention(cfg=self.attention, **dt)
        if self.experts is None:
            self.mlp = MLP(cfg=self.feedforward, **dt)
        else:
            self.mlp = MoE(cfg=self.feedforward, experts=self.experts, **dt)

    def __call__(self, x_BTD: jax.Array, layer: Layer, context: "Context", deterministic: bool = True,
                 fresh: bool = False, measure: bool = False):
        """One layer, as GPT.decode scans it: x_BTD -> (x_BTD after the block, (x_BTD after the
        block if `measure` (GPT.measure's) else None, this layer's new keys and values for
        the KV cache (Attention's) or None))."""
        allowed_BTS, kind = context.allowed_BTS, 0
        if layer.local is not None:  # local and global layers mix: each picks its rotary table and mask
            kind = layer.local.astype(jnp.int32)
            if context.local_BTS is not None:
                allowed_BTS = jnp.where(layer.local, context.local_BTS, context.allowed_BTS)
        rotary_tables = None if context.rotary is None else tuple(t[kind] for t in context.rotary)
        attn_in_BTD = self.ln_1(x_BTD) if self.pre_norm else x_BTD
        a_BTD, new_kv = self.attn(attn_in_BTD, rotary_tables, allowed_BTS, layer, deterministic, context.slot, fresh)
        if self.sandwich_norm:
            a_BTD = self.ln_attn_out(a_BTD)
        a_BTD = a_BTD * self.residual_multiplier
        mlp_in_BTD = x_BTD if self.parallel_residual else x_BTD + a_BTD
        m_BTD = self.mlp(self.ln_2(mlp_in_BTD) if self.pre_norm else mlp_in_BTD, deterministic)
        if self.sandwich_norm:
            m_BTD = self.ln_mlp_out(m_BTD)
        out_BTD = x_BTD + a_BTD + m_BTD * self.residual_multiplier
        return out_BTD, (out_BTD if measure else None, new_kv)

    @classmethod
    def components(cls) -> List[Type[Any]]:
        return [Norm, Attention, MLP, MoE]


# ----------------------------------------------------------------------------- GPT


class KVCache(NamedTuple):
    """The decoder's state: every layer's keys and values [L, B, K, S / P, P * E] (P slots
    side by side in a row, slots_per_row: 1 but on a TPU; unpack_slots gives [L, B, K, S, E]),
    which slots hold real tokens [B, S], the slot the next token goes to; and prefix_keys,
    prefix_values [L, K, Q, E] (or None): Q tokens before every row's slots (a batch's shared few-shot
    examples, fast.start_rollout), held and read once for the batch, not once per row."""

    keys: jax.Array
    values: jax.Array
    valid_BS: jax.Array
    slot: jax.Array
    prefix_keys: Optional[jax.Array] = None
    prefix_values: Optional[jax.Array] = None

    @property
    def prefix_length(self) -> int:
        return 0 if self.prefix_keys is None else self.prefix_keys.shape[2]


class Context(NamedTuple):
    """What every layer sees alike (GPT.decode): which keys each query sees on global and on
    local layers [B, T, S] (None: plain causal; the local ones only where kinds mix), each
    layer kind's rotary (cos, sin) [N, B, T, R] (GPT.rotary_tables), the real tokens [B, T],
    and the cache slot of the new tokens (None without a cache)."""

    allowed_BTS: Optional[jax.Array]
    local_BTS: Optional[jax.Array]
    rotary: Optional[Tuple[jax.Array, jax.Array]]
    mask_BT: jax.Array
    slot: Optional[jax.Array]


def float32_in_full(method: Any) -> Any:
    """A GPT method whose float32 matmuls run at full precision (jax's default on a GPU is
    TF32, on a TPU bfloat16 passes; torch's float32 is float32)."""
    @functools.wraps(method)
    def run(self: "GPT", *args: Any, **kwargs: Any) -> Any:
        with jax.default_matmul_precision("highest" if jnp.dtype(self.adtype) == jnp.float32 else None):
            return method(self, *args, **kwargs)
    return run


class GPT(Module):
    """Decoder-only transformer. Defaults: a tiny byte-level GPT that runs on a laptop CPU."""

    n_layers: int = 4
    n_embd: int = 128
    n_head: int = 4
    block_size: int = 256
    vocab_size: int = 320  # 256 bytes + end-of-text, rounded up to a multiple of 64
    rope: bool = False
    dropout: float = 0.0
    bias: bool = True
    # the family options: GPT-2 is the default; see FAMILIES below for the others
    n_kv_head: Optional[int] = None  # None: as many as n_head (no grouping)
    head_dim: Optional[int] = None  # None: n_embd // n_head
    mlp_hidden: Optional[int] = None  # None: 4 * n_embd
    mlp: str = "gelu"
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    qkv_bias: Optional[bool] = None  # None: as `bias` (Qwen2 has qkv bias and nothing else)
    qk_norm: bool = False
    rotary_fraction: float = 1.0
    rope_theta: float = 10000.0
    parallel_residual: bool = False
    tie_embeddings: bool = True
    norm_offset: float = 0.0  # every norm scales by (offset + weight): Gemma 1.0
    sandwich_norm: bool = False  # norm each sublayer's output too, before the residual add (Gemma)
    embed_scale: bool = False  # token embeddings * sqrt(n_embd), rounded to the activation dtype (Gemma)
    pre_norm: bool = True  # norm each sublayer's input; OLMo 2 norms only outputs (with sandwich_norm)
    qk_norm_full: bool = False  # the q/k norm over all heads' width at once, not per head (OLMo 2, OLMoE)
    norm_topk_prob: bool = False  # experts: renormalise the top-k router weights to sum 1 (Mixtral)
    # the options a checkpoint's config sets (see hf.py)
    rope_scaling: Optional[Tuple[Any, ...]] = None  # ("linear", ...) or ("llama3", ...): rope_frequencies
    sliding_window: Optional[int] = None  # local layers: a query sees itself and the W - 1 tokens before
    window_pattern: str = "S"  # which layers are local (S) or global (G), cycled: Gemma 3 "SSSSSG"
    local_rope_theta: Optional[float] = None  # local layers' own plain rotary base; None: as the others
    attn_scale: Optional[float] = None  # of the scores q.k; None: 1 / sqrt(head_dim)
    attn_softcap: Optional[float] = None  # attention scores -> cap * tanh(scores / cap) (Gemma 2)
    logit_softcap: Optional[float] = None  # logits -> cap * tanh(logits / cap)
    embed_multiplier: float = 1.0  # token embeddings * this (Granite)
    residual_multiplier: float = 1.0  # each sublayer's output * this before it is added (Granite)
    logits_scaling: float = 1.0  # logits / this (Granite)
    n_experts: Optional[int] = None  # a mixture of this many experts in every block, each mlp_hidden wide
    n_experts_per_token: int = 2  # the router's top k
    shared_expert_hidden: Optional[int] = None  # the width of an expert every token uses (Qwen2-MoE)
    # how it is computed, not what: none is saved with a checkpoint (EXECUTION_FIELDS)
    attention: str = "fast"  # the backend's (BACKEND_ATTENTION), "reference" (the simple path) or a kernel
    step_attention: str = "fast"  # a decoding step's grouped heads: the backend's, "sums" or "dots"
    query_block: int = 256  # queries per block of attend_causal's blocked path
    cache_lanes: Optional[int] = None  # the KV cache's rows (slots_per_row); None: the backend's

    def __post_init__(self) -> None:
        # a native checkpoint's config.json gives rope_scaling back as a list; fields must hash
        if isinstance(self.rope_scaling, list):
            object.__setattr__(self, "rope_scaling", tuple(self.rope_scaling))
        super().__post_init__()

    # --- the optional sizes, resolved in one place (everything else reads these)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_width(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    @property
    def mlp_width(self) -> int:
        return self.mlp_hidden or 4 * self.n_embd

    @property
    def has_qkv_bias(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias

    def is_local(self, depth: int) -> bool:
        """Whether block `depth` is a local layer (window_pattern "S"): the sliding window,
        if any, and local_rope_theta, if set, apply to it; global layers see everything."""
        return self.window_pattern[depth % len(self.window_pattern)] == "S"

    @property
    def layer_kinds(self) -> List[bool]:
        """The kinds of layer (is_local): one, or global and local where they mix and differ
        (Gemma 2, 3), each layer's then a scanned input (Layer.local) picking its mask and rotary."""
        kinds = {self.is_local(depth) for depth in range(self.n_layers)}
        differ = self.sliding_window is not None or self.local_rope_theta is not None
        return [False, True] if len(kinds) > 1 and differ else [self.is_local(0)]

    def attention_config(self, local: bool) -> AttentionConfig:
        """A layer's attention: the sizes and options of all of them, and on a local layer its
        own plain rotary base (local_rope_theta), if set, and its sliding window where all
        layers are local (where kinds mix, the mask holds it)."""
        c = AttentionConfig(
            width=self.n_embd, n_head=self.n_head, n_kv_head=self.kv_heads, head_dim=self.head_width,
            qkv_bias=self.has_qkv_bias, out_bias=self.bias, qk_norm=self.qk_norm, norm_eps=self.norm_eps,
            norm_offset=self.norm_offset, rope=self.rope, rotary_fraction=self.rotary_fraction,
            qk_norm_full=self.qk_norm_full, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            scale=self.attn_scale, softcap=self.attn_softcap, dropout=self.dropout,
            residual_std=0.02 / math.sqrt(2 * self.n_layers), reference=self.attention == "reference",
            kernel=self.attention, step=self.step_attention, query_block=self.query_block,
            window=self.sliding_window if self.layer_kinds == [True] else None)
        if local and self.local_rope_theta is not None:  # Gemma 3
            c = dataclasses.replace(c, rope_theta=self.local_rope_theta, rope_scaling=None)
        return c

    def block_fields(self) -> Dict[str, Any]:
        """The fields of the one Block every layer runs (GPT.setup scans it)."""
        feedforward = MLPConfig(width=self.n_embd, hidden=self.mlp_width, kind=self.mlp, bias=self.bias,
                                dropout=self.dropout, residual_std=0.02 / math.sqrt(2 * self.n_layers))
        experts = None if self.n_experts is None else ExpertsConfig(
            n_experts=self.n_experts, active=self.n_experts_per_token, norm_topk_prob=self.norm_topk_prob,
            shared_hidden=self.shared_expert_hidden)
        return dict(attention=self.attention_config(self.layer_kinds[0]), feedforward=feedforward, experts=experts,
                    norm=self.norm, norm_eps=self.norm_eps, norm_bias=self.bias, norm_offset=self.norm_offset,
                    parallel_residual=self.parallel_residual, sandwich_norm=self.sandwich_norm,
                    pre_norm=self.pre_norm, residual_multiplier=self.residual_multiplier,
                    param_dtype=self.param_dtype, activation_dtype=self.activation_dtype)

    def layer_inputs(self, cache: Optional[KVCache]) -> Layer:
        """Each layer's Layer, stacked [L, ...] for the scan."""
        local = jnp.asarray([self.is_local(d) for d in range(self.n_layers)]) if len(self.layer_kinds) > 1 else None
        prefix = None if cache is None or cache.prefix_keys is None else (cache.prefix_keys, cache.prefix_values)
        return Layer(local, prefix, None if cache is None else (cache.keys, cache.values))

    def rotary_tables(self, pos_BT: jax.Array) -> Optional[Tuple[jax.Array, jax.Array]]:
        """(cos, sin) [N, B, T, R] of each kind of layer (layer_kinds) at these positions, or None
        without rotary: computed once for every layer of a kind."""
        if not self.rope:
            return None
        tables = [layer_rotary(self.attention_config(local), pos_BT) for local in self.layer_kinds]
        return tuple(jnp.stack(t) for t in zip(*tables))

    @property
    def sharding(self) -> List[Tuple[str, Optional[str]]]:
        # Data parallel: inputs split their batch over "batch" (see input_sharding). Megatron-
        # style tensor parallel: q/k/v and MLP-up split their outputs over "shard",
        # attention-out and MLP-down their inputs; the vocabulary is split too. Expert
        # parallel: a mixture's experts are split over "shard", each expert whole.
        return [("batch", "batch"), ("vocab", "shard"), ("heads", "shard"), ("kv_heads", "shard"),
                ("mlp", "shard"), ("experts", "shard"), ("expert_mlp", None), ("embed", None), ("head_dim", None),
                ("layers", None)]

    def setup(self) -> None:
        dt = dict(param_dtype=self.param_dtype, activation_dtype=self.activation_dtype)
        init = nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed"))
        self.wte = nn.Embed(self.vocab_size, self.n_embd, embedding_init=init, param_dtype=self.pdtype,
                            dtype=self.adtype)
        if not self.rope:
            pos_init = nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, "embed"))
            self.wpe = nn.Embed(self.block_size, self.n_embd, embedding_init=pos_init, param_dtype=self.pdtype)
        self.drop = nn.Dropout(self.dropout)
        # one Block traced once and scanned over the layers' stacked parameters [L, ...] (the
        # logical axis "layers"), so a program's size and compile time do not grow with depth
        scanned = nn.scan(Block, variable_axes={"params": 0, "intermediates": 0},
                          split_rngs={"params": True, "dropout": True}, in_axes=(0,) + (nn.broadcast,) * 4,
                          length=self.n_layers, metadata_params={nn.PARTITION_NAME: "layers"})
        self.blocks = scanned(**self.block_fields())
        self.ln_f = Norm(kind=self.norm, eps=self.norm_eps, use_bias=self.bias, offset=self.norm_offset, **dt)
        if not self.tie_embeddings:
            self.lm_head = Linear(features=self.vocab_size, axes=("embed", "vocab"), **dt)

    # --- the reference API's four stages: embed -> decode -> unembed -> loss

    def embed(self, idx: jax.Array, deterministic: bool = False, positions: Optional[jax.Array] = None,
              **kwargs: Any) -> jax.Array:
        """Token (+ learned position) embeddings of idx [B, T] -> x [B, T, D]."""
        idx_BT = idx
        x_BTD = self.wte(idx_BT).astype(self.adtype)
        if self.embed_scale:  # as transformers: sqrt(D) in float32, then cast to the weights' dtype
            x_BTD = x_BTD * jnp.asarray(math.sqrt(self.n_embd), jnp.float32).astype(self.adtype)
        x_BTD = x_BTD * self.embed_multiplier
        if not self.rope:
            x_BTD = x_BTD + self.wpe(positions_for(idx_BT, positions)).astype(self.adtype)
        return self.drop(x_BTD, deterministic=deterministic)

    @float32_in_full
    def decode(self, x: jax.Array, padding_mask: Optional[jax.Array] = None, deterministic: bool = False,
               positions: Optional[jax.Array] = None, cache: Optional[KVCache] = None,
               allowed: Optional[jax.Array] = None, fresh: bool = False, **kwargs: Any):
        """Run the blocks over embeddings x [B, T, D]: x, or (x, cache) with a cache.

        padding_mask [B, T] is True at real tokens, which never attend to padding; without
        one, every row is a sequence from position 0 (right padding unseen). With a cache
        (init_cache) the T new tokens go into slots cache.slot .. +T and attend to its prefix
        and every earlier valid slot; a sliding window counts slots, as transformers does
        (with left padding, positions too); slots after the new ones hold older tokens (a
        ring, fast.refill_rollout). fresh: the cache is empty, so the new tokens attend among
        themselves (attend_causal), not over S slots mostly empty. allowed [B, T, T] (no cache)
        says which keys each query sees: sequences packed into a row (fast.py), each with its
        `positions`, a window counting positions.
        """
        x_BTD = x
        B, T, _ = x_BTD.shape
        mask_BT = jnp.ones((B, T), bool) if padding_mask is None else padding_mask.astype(bool)
        pos_BT = positions_for(mask_BT, positions)
        self.check_length(T if cache is None else cache.prefix_length + cache.valid_BS.shape[1])
        if cache is None:
            valid_BS, query_T, key_S, slot = mask_BT, jnp.arange(T), jnp.arange(T), None
        else:
            slot = cache.slot
            cache_valid_BS = jax.lax.dynamic_update_slice(cache.valid_BS, mask_BT, (0, slot))
            if fresh:  # the keys are the new tokens alone
                valid_BS, query_T, key_S = mask_BT, jnp.arange(T), jnp.arange(T)
            else:  # a ring: slots after the new tokens hold older ones (fast.refill_rollout), counted as before slot 0
                key_S = jnp.arange(cache_valid_BS.shape[1])
                query_T, key_S = slot + jnp.arange(T), jnp.where(key_S >= slot + T, key_S - len(key_S), key_S)
                valid_BS = cache_valid_BS
        allowed_BTS, local_BTS = self.masks(pos_BT, allowed, padding_mask is not None or cache is not None,
                                            valid_BS, query_T, key_S)
        context = Context(allowed_BTS, local_BTS, self.rotary_tables(pos_BT), mask_BT, slot)
        measure = self.is_mutable_collection("intermediates")  # asked for: each layer's output too
        # for each layer in turn, on its own slice of the stacked parameters and cache:
        #     x_BTD, (_, new_kv[layer]) = Block(layer params)(x_BTD, layer, context, ...)
        out_BTD, (outs_LBTD, new_kv) = self.blocks(x_BTD, self.layer_inputs(cache), context, deterministic, fresh,
                                                   measure)
        for depth in range(self.n_layers if measure else 0):
            self.measure(outs_LBTD[depth], outs_LBTD[depth - 1] if depth else x_BTD, depth, mask_BT)
        x_BTD = self.ln_f(out_BTD)
        if cache is None:
            return x_BTD
        # every layer's new keys and values in one write, after the layers: inside the scan a
        # TPU would copy each layer's slots into another layout for every write
        keys, values = (write_slots(x, new, slot, fresh) for x, new in zip((cache.keys, cache.values), new_kv))
        return x_BTD, cache._replace(keys=keys, values=values, valid_BS=cache_valid_BS,
                                     slot=(slot + T) % cache_valid_BS.shape[1])

    def masks(self, pos_BT: jax.Array, allowed: Optional[jax.Array], masked: bool, valid_BS: jax.Array,
              query_T: jax.Array, key_S: jax.Array) -> Tuple[Optional[jax.Array], Optional[jax.Array]]:
        """(which keys each query sees on global layers, on local ones) [B, T, S], or None for
        the fused causal path (no padding mask, no cache, nothing packed). Where all layers are
        local the first is the local one; where kinds mix both are made, None never."""
        allowed_BTS = local_BTS = None
        windows_mix = len(self.layer_kinds) > 1 and self.sliding_window is not None
        if allowed is not None:  # packed rows: a window counts positions, not slots
            allowed_BTS = local_BTS = allowed
            if self.sliding_window is not None:
                local_BTS = allowed & (pos_BT[:, :, None] - pos_BT[:, None, :] < self.sliding_window)
        elif masked:
            allowed_BTS = local_BTS = causal_allowed(valid_BS, query_T, key_S)
            if self.sliding_window is not None:
                local_BTS = allowed_BTS & window_allowed(query_T, key_S, self.sliding_window)[None]
        elif windows_mix:
            T = pos_BT.shape[1]
            allowed_BTS, local_BTS = (causal_window(0, T, 0, T, w)[None] for w in (None, self.sliding_window))
        if windows_mix:
            return allowed_BTS, local_BTS
        return (local_BTS if self.is_local(0) else allowed_BTS), None

    def check_length(self, length: int) -> None:
        """Longrope's factors hold up to its original context: past it transformers switches
        every position to the long factors, which a fixed-shape block cannot, so longer
        sequences (or caches) are refused, not computed differently."""
        if self.rope_scaling is not None and self.rope_scaling[0] == "longrope" and length > self.rope_scaling[1]:
            raise ValueError(f"longrope: {length} positions exceed original_max_position_embeddings "
                             f"{self.rope_scaling[1]}, beyond which transformers switches to the long factors")

    def measure(self, x: jax.Array, residual: jax.Array, depth: int, padding_mask: Optional[jax.Array]) -> None:
        """Record block `depth`'s relative update ||x - residual|| / ||residual||, the norms over
        the width at each token, their mean over real tokens, as intermediates["residual_update"]
        [depth]; computed only when apply() is given mutable=["intermediates"]."""
        x_BTD, r_BTD = x.astype(jnp.float32), residual.astype(jnp.float32)
        ratio_BT = jnp.linalg.norm(x_BTD - r_BTD, axis=-1) / (jnp.linalg.norm(r_BTD, axis=-1) + 1e-12)
        weight_BT = jnp.ones_like(ratio_BT) if padding_mask is None else padding_mask.astype(jnp.float32)
        value = (ratio_BT * weight_BT).sum() / jnp.maximum(weight_BT.sum(), 1.0)
        self.sow("intermediates", "residual_update", value, init_fn=lambda: [None] * self.n_layers,
                 reduce_fn=lambda values, v: [v if i == depth else x for i, x in enumerate(values)])

    @float32_in_full
    def unembed(self, x: jax.Array) -> jax.Array:
        """Logits [..., V] of hidden states x [..., D], in float32 (tied: the token embedding's transpose)."""
        if self.tie_embeddings:
            logits = self.wte.attend(x.astype(self.adtype))
        else:
            logits = self.lm_head(x)
        logits = logits.astype(jnp.float32) / self.logits_scaling
        if self.logit_softcap is not None:  # Gemma: logits bounded to (-cap, cap)
            logits = self.logit_softcap * jnp.tanh(logits / self.logit_softcap)
        return logits

    def loss(self, logits: jax.Array, targets: jax.Array) -> jax.Array:
        """Mean cross-entropy of logits [B, T, V] over targets [B, T] that are not -1."""
        keep_BT = targets != -1
        nll_BT = token_nll(logits, jnp.where(keep_BT, targets, 0))
        return (nll_BT * keep_BT).sum() / jnp.maximum(keep_BT.sum(), 1)

    def __call__(self, idx: jax.Array, targets: Optional[jax.Array] = None,
                 padding_mask: Optional[jax.Array] = None, deterministic: bool = False,
                 **kwargs: Any) -> Tuple[jax.Array, Optional[jax.Array]]:
        """idx [B, T] -> (logits [B, T, V], mean loss over targets != -1, or None)."""
        pos_BT = positions_for(padding_mask if padding_mask is not None else idx, None)
        x_BTD = self.embed(idx, deterministic, positions=pos_BT)
        x_BTD = self.decode(x_BTD, padding_mask, deterministic, positions=pos_BT)
        logits_BTV = self.unembed(x_BTD)
        return logits_BTV, None if targets is None else self.loss(logits_BTV, targets)

    def extend(self, idx: jax.Array, padding_mask: jax.Array, cache: KVCache,
               fresh: bool = False) -> Tuple[jax.Array, KVCache]:
        """Append idx [B, T] to a KV cache: (logits of the last token [B, V], the cache), only
        the last position unembedded (decoding needs nothing else); fresh: the cache is empty,
        as init_cache made it (see decode). No dropout."""
        count_B = cache.prefix_length + cache.valid_BS.sum(-1)  # real tokens already in the cache
        pos_BT = jnp.maximum(count_B[:, None] + jnp.cumsum(padding_mask, -1) - 1, 0)
        x_BTD = self.embed(idx, True, positions=pos_BT)
        x_BTD, cache = self.decode(x_BTD, padding_mask, True, positions=pos_BT, cache=cache, fresh=fresh)
        return self.unembed(x_BTD[:, -1]), cache

    def init_cache(self, batch: int, length: int, prefix: Optional[KVCache] = None) -> KVCache:
        """An empty KV cache with `length` slots per sequence. prefix: a one-row cache of
        tokens every sequence begins with (extend into init_cache(1, Q)), held once before
        every row's slots (KVCache.prefix_keys)."""
        per_row = slots_per_row(backend_choice("lanes", self.cache_lanes), self.head_width, length)
        zeros = lambda: jnp.zeros((self.n_layers, batch, self.kv_heads, length // per_row, per_row * self.head_width),
                                  self.adtype)
        cache = KVCache(keys=zeros(), values=zeros(), valid_BS=jnp.zeros((batch, length), bool),
                        slot=jnp.zeros((), jnp.int32))
        if prefix is None:
            return cache
        if self.sliding_window is not None:
            raise ValueError("a shared prefix puts padding inside prompts, where a sliding window counts slots")
        return cache._replace(prefix_keys=unpack_slots(prefix.keys[:, 0], self.head_width),
                              prefix_values=unpack_slots(prefix.values[:, 0], self.head_width))

    def tile_slots(self) -> int:
        """The slots a cache comes in multiples of to be written by whole tiles where the
        backend does (a TPU: 2 x 16 of 64-wide bfloat16 heads; write_tile); else 1."""
        lanes = backend_choice("lanes", self.cache_lanes)
        per_row = slots_per_row(lanes, self.head_width, lanes)
        tiled = backend_choice("tile") and per_row > 1
        return per_row * TILE_BYTES // jnp.dtype(self.adtype).itemsize if tiled else 1

    def flops(self, seq: int) -> float:
        total = self.n_layers * self.blocks.flops(seq)  # the scanned block: one layer's
        if self.tie_embeddings:  # the unembedding matmul; the embedding lookup is a gather
            total += 3 * 2 * seq * self.n_embd * self.vocab_size
        else:
            total += self.lm_head.flops(seq)
        return total

    @classmethod
    def components(cls) -> List[Type[Any]]:
        return [Block, Norm, Linear]


# GPT fields that change how, never what, it computes
EXECUTION_FIELDS = ("attention", "step_attention", "query_block", "cache_lanes")

# What makes each HuggingFace family different, as GPT fields (the loader adds sizes).
FAMILIES = {
    "gpt2": dict(rope=False, mlp="gelu", norm="layernorm", bias=True, tie_embeddings=True),
    "llama": dict(rope=True, mlp="swiglu", norm="rmsnorm", bias=False),
    "qwen2": dict(rope=True, mlp="swiglu", norm="rmsnorm", bias=False, qkv_bias=True),
    "qwen3": dict(rope=True, mlp="swiglu", norm="rmsnorm", bias=False, qk_norm=True),
    "gpt_neox": dict(rope=True, mlp="gelu_exact", norm="layernorm", bias=True,
                     parallel_residual=True, tie_embeddings=False),
    "mistral": dict(rope=True, mlp="swiglu", norm="rmsnorm", bias=False),  # a window on every layer (config)
    # local and global layers (window, pattern and both rotary bases from the config)
    "gemma3_text": dict(rope=True, mlp="geglu", norm="rmsnorm", bias=False, qk_norm=True, norm_offset=1.0,
                        sandwich_norm=True, embed_scale=True),
    # Gemma 3 without the q/k norm; the config adds soft-caps, the query scale, the window pattern "SG"
    "gemma2": dict(rope=True, mlp="geglu", norm="rmsnorm", bias=False, norm_offset=1.0, sandwich_norm=True,
                   embed_scale=True),
    # Llama in a fused file layout; the config adds the rotary fraction, longrope and a window
    "phi3": dict(rope=True, mlp="swiglu", norm="rmsnorm", bias=False),
    # norms after each sublayer only, and q/k norms over all heads' width
    "olmo2": dict(rope=True, mlp="swiglu", norm="rmsnorm", bias=False, qk_norm=True, qk_norm_full=True,
                  pre_norm=False, sandwich_norm=True),
    # Llama; the config adds the embedding, attention, residual and logit multipliers
    "granite": dict(rope=True, mlp="swiglu", norm="rmsnorm", bias=False),
    # mixtures of experts (n_experts, n_experts_per_token, mlp_hidden per expert: from the config)
    "mixtral": dict(rope=True, mlp="swiglu", norm="rmsnorm", bias=False, norm_topk_prob=True),
    "qwen2_moe": dict(rope=True, mlp="swiglu", norm="rmsnorm", bias=False, qkv_bias=True),
    "qwen3_moe": dict(rope=True, mlp="swiglu", norm="rmsnorm", bias=False, qk_norm=True),
    "olmoe": dict(rope=True, mlp="swiglu", norm="rmsnorm", bias=False, qk_norm=True, qk_norm_full=True),
}


def positions_for(mask_or_idx: jax.Array, positions: Optional[jax.Array]) -> jax.Array:
    """Positions count from the first real token: with left padding, cumsum(mask) - 1."""
    if positions is not None:
        return positions
    if mask_or_idx.dtype == jnp.bool_:
        return jnp.maximum(jnp.cumsum(mask_or_idx, -1) - 1, 0)
    return jnp.broadcast_to(jnp.arange(mask_or_idx.shape[-1]), mask_or_idx.shape)


def causal_allowed(valid_BS: jax.Array, query_slot_T: jax.Array, key_slot_S: jax.Array) -> jax.Array:
    """allowed[b, t, s]: key s is a real token and not after query t."""
    return valid_BS[:, None, :] & (key_slot_S[None, None, :] <= query_slot_T[None, :, None])


def window_allowed(query_slot_T: jax.Array, key_slot_S: jax.Array, window: int) -> jax.Array:
    """allowed[t, s]: key s is not `window` or more slots before query t (i - W < j; the
    causal half, j <= i, is causal_allowed's): W keys, the query's own included."""
    return key_slot_S[None, :] > query_slot_T[:, None] - window


def token_nll(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Per-token negative log-likelihood, float32, without a one-hot matrix. (log_softmax
    then a gather: on CPU XLA fuses this better than logsumexp minus the target's logit.)"""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]


# ----------------------------------------------------------------------------- generation


def first_largest(logits_BV: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first of equal largest values) as a max and a masked
    min, two fused passes where XLA's CPU argmax is three times slower. A row holding NaN
    gets the last index; decoding refuses such rows anyway (finite_rows)."""
    V = logits_BV.shape[-1]
    largest_B1 = logits_BV.max(-1, keepdims=True)
    return jnp.where(logits_BV == largest_B1, jnp.arange(V, dtype=jnp.int32), V - 1).min(-1)


def sample_token(logits_BV: jax.Array, keys_B: Optional[jax.Array], temperature: float, top_p: float) -> jax.Array:
    """Greedy when temperature is 0, else temperature + nucleus (top-p) sampling."""
    if temperature == 0.0:
        return first_largest(logits_BV)
    logits = logits_BV.astype(jnp.float32) / temperature
    if top_p < 1.0:  # keep the smallest set of tokens whose probability reaches top_p
        sorted_BV = jnp.sort(logits, -1)[:, ::-1]
        probs = jax.nn.softmax(sorted_BV, -1)
        before = jnp.cumsum(probs, -1) - probs
        kept = jnp.where(before < top_p, sorted_BV, jnp.inf).min(-1, keepdims=True)
        logits = jnp.where(logits < kept, -jnp.inf, logits)
    return jax.vmap(jax.random.categorical)(keys_B, logits).astype(jnp.int32)


def finite_rows(logits_BV: jax.Array) -> jax.Array:
    return jnp.isfinite(logits_BV).all(-1)


def pick_token(logits_BV: jax.Array, step: jax.Array, keys_B: Optional[jax.Array], temperature: float,
               top_p: float) -> jax.Array:
    """The token of new position `step` (one for all rows, or each row's [B]): each sample's
    key folded with the step, so a token depends on its sample and position only, never on
    the batch or on where a call began."""
    if keys_B is not None:
        keys_B = jax.vmap(jax.random.fold_in)(keys_B, jnp.broadcast_to(step, keys_B.shape))
    return sample_token(logits_BV, keys_B, temperature, top_p)


def generate(model: GPT, params: Any, prompt_BP: jax.Array, mask_BP: jax.Array, max_new_tokens: int,
             eos_id: Optional[int] = None, temperature: float = 0.0, top_p: float = 1.0,
             keys_B: Optional[jax.Array] = None) -> jax.Array:
    """Autoregressive decoding with a KV cache, the plain way: the prefill of the left-padded
    prompts (mask_BP True at real tokens), then max_new_tokens steps, each feeding in every
    row's next token; keys_B (a PRNG key per sample) makes sampling independent of batching.
    The new tokens [B, N]: eos_id after a row's eos_id, and throughout for an empty prompt (0
    without one). fast.py's decoder gives the same tokens."""
    B, P = prompt_BP.shape
    fill = 0 if eos_id is None else eos_id
    logits_BV, cache = model.apply(params, prompt_BP, mask_BP, model.init_cache(B, P + max_new_tokens), True,
                                   method=GPT.extend)

    def step(carry: Tuple[jax.Array, KVCache, jax.Array], n: jax.Array):
        logits_BV, cache, done_B = carry
        token_B = jnp.where(done_B, fill, pick_token(logits_BV, n, keys_B, temperature, top_p))
        done_B = done_B | (token_B == (-1 if eos_id is None else eos_id))
        logits_BV, cache = model.apply(params, token_B[:, None], jnp.ones((B, 1), bool), cache, method=GPT.extend)
        return (logits_BV, cache, done_B), token_B

    _, tokens_NB = jax.lax.scan(step, (logits_BV, cache, ~mask_BP.any(-1)), jnp.arange(max_new_tokens))
    return tokens_NB.T


# ----------------------------------------------------------------------------- meshes


def make_mesh(batch: Optional[int] = None, shard: int = 1, devices: Optional[List[Any]] = None) -> Mesh:
    """A ("batch", "shard") mesh over `devices` (default: all), batch devices // shard by
    default; Auto axes: parameters and inputs are sharded, XLA's partitioner does the rest."""
    n = jax.device_count() if devices is None else len(devices)
    batch = n // max(shard, 1) if batch is None else batch
    if batch < 1 or shard < 1 or batch * shard != n:
        raise ValueError(f"mesh {batch}x{shard} needs {batch * shard} devices, but there are {n}")
    return jax.make_mesh((batch, shard), ("batch", "shard"), axis_types=(AxisType.Auto,) * 2, devices=devices)


def parse_mesh(text: str) -> Tuple[int, int]:
    """'4x2' -> (4, 2)."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"mesh {text!r} is not BATCHxSHARD, e.g. 4x2")
    return int(parts[0]), int(parts[1])


def param_shardings(model: Module, mesh: Mesh, boxed_shapes: Any) -> Any:
    """NamedShardings for a tree of logically partitioned parameter shapes; a dimension the
    mesh axis does not divide (GPT-2's 50257-token vocabulary over 2) stays replicated."""
    specs = nn.get_partition_spec(boxed_shapes)
    mesh_specs = nn.logical_to_mesh(specs, model.sharding)
    shapes = nn.meta.unbox(boxed_shapes)

    def fit(spec: PartitionSpec, shape: Any) -> NamedSharding:
        axes = [a if a is None or shape.shape[i] % mesh.shape[a] == 0 else None
                for i, a in enumerate(tuple(spec) + (None,) * (len(shape.shape) - len(spec)))]
        return NamedSharding(mesh, PartitionSpec(*axes))

    return jax.tree.map(fit, mesh_specs, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def input_sharding(model: Module, mesh: Mesh, logical_axes: Tuple[Optional[str], ...]) -> NamedSharding:
    """The sharding of an input whose dimensions carry `logical_axes`, through the model's
    plan: ("batch", None) -> PartitionSpec("batch", None), the data-parallel split."""
    return NamedSharding(mesh, nn.logical_to_mesh_axes(logical_axes, model.sharding))


@functools.lru_cache(maxsize=4)
def abstract_params(model: Module, seq: int = 8) -> Any:
    """Parameter shapes (with logical axis names) without allocating anything, kept for the
    last few models (modules hash by their fields): loading a checkpoint asks twice."""
    idx = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    return jax.eval_shape(lambda idx: model.init(jax.random.key(0), idx, deterministic=True), idx)


def init_params(model: Module, mesh: Mesh, seed: int = 0) -> Any:
    """Initialize parameters directly into their mesh shardings (never whole on one device)."""
    boxed = abstract_params(model)
    shardings = param_shardings(model, mesh, boxed)
    # all of it one program: arrays made outside it (the key, the tokens) would each compile one
    init = lambda seed: nn.meta.unbox(model.init(jax.random.key(seed), jnp.zeros((1, 8), int), deterministic=True))
    return jax.jit(init, out_shardings=shardings)(seed)


def place_params(model: Module, mesh: Mesh, host_params: Any) -> Any:
    """A host parameter tree into the model's mesh shardings, block by block: a leaf is a numpy
    array, or anything whose [index] reads that block as numpy (checkpoints.LazyTensor). Each
    process reads only its devices' blocks, each once, let go once placed."""
    shardings = param_shardings(model, mesh, abstract_params(model))
    dtype = model.pdtype

    def put(array: Any, sharding: NamedSharding) -> jax.Array:
        blocks = {}  # (start, stop) per dimension -> the block, for the devices that share it

        def block(index: Tuple[slice, ...]) -> np.ndarray:
            key = tuple(s.indices(n)[:2] for s, n in zip(index, array.shape))
            if key not in blocks:  # (a CPU device may take an aligned block as it is, as device_put does)
                blocks[key] = np.asarray(array[index], dtype)
            return blocks[key]

        return jax.make_array_from_callback(tuple(array.shape), sharding, block)

    return jax.tree.map(put, host_params, shardings)


def available_memory() -> int:
    """Bytes free for parameters and activations: the free memory of this process's
    accelerators between them where they report it, otherwise (CPU devices, which share it)
    the host's available memory."""
    stats = [device.memory_stats() for device in jax.local_devices()]
    if all(s and "bytes_limit" in s for s in stats):
        return sum(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:  # Linux: MemAvailable counts reclaimable caches
            host = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    return host


def gigabytes(n: int) -> str:
    return f"{n / 1e9:.3g} GB"


def count_params(params: Any) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


if __name__ == "__main__":
    model = GPT()
    mesh = make_mesh()
    params = init_params(model, mesh, seed=0)
    print(f"GPT: {count_params(params) / 1e6:.2f}M parameters on mesh {dict(mesh.shape)}")
    print(f"flops per {model.block_size}-token sequence (fwd+bwd): "
          f"{model.bind(params).flops(model.block_size):.3e}")
    prompt = jnp.array([list(b"Hello")], jnp.int32)
    new = jax.jit(lambda p, x: generate(model, p, x, jnp.ones_like(x, bool), 16))(params, prompt)
    print("greedy continuation of 'Hello' (random weights):", np.asarray(new)[0].tolist())
