"""The HuggingFace bridge: a local transformers model directory in, our GPT out (and back).

    python hf.py DIR                 # what GPT a HuggingFace directory becomes, and its size

Reading order: the config (read through transformers' config classes) -> GPT fields per
family (gpt.FAMILIES holds what differs; this file maps names and layouts onto it) ->
the tensors of each family, read with jobs.TensorFiles (one at a time, each checked) ->
load_backbone -> export_gpt2 (a GPT-2-layout GPT as a directory transformers loads).

Supported model types: gpt2, llama (with Llama 3.x "llama3" or "linear" rope scaling),
qwen2, qwen3, gpt_neox, mistral (sliding windows), gemma3_text (local and global layers).
Weights come only from *.safetensors files: nothing is ever unpickled and no remote code
runs. Refused with one line: other model types, other rope scaling types (yarn, dynamic,
longrope, ...), Qwen's sliding windows, Gemma 3's attention soft-capping (transformers
ignores it) and bidirectional attention, quantized weights, *.bin pickles.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import flax.linen as nn
import jax
import numpy as np
from safetensors.numpy import save_file

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # its import-time "PyTorch was not found"
import transformers  # noqa: E402  (torch is never needed, and the first line on stderr is ours)

import gpt
from jobs import (TensorFiles, UsageError, check_model_fields, exit_status, first_line, flatten, param_shapes,
                  read_config, short)

SUPPORTED = ("gpt2", "llama", "qwen2", "qwen3", "gpt_neox", "mistral", "gemma3_text")
# Buffers some checkpoints carry that are not parameters (causal masks, rotary tables)
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias",
                    "rotary_emb.inv_freq")
BASE_PREFIX = {"gpt2": "transformer.", "gpt_neox": "gpt_neox."}  # others: "model."


# ----------------------------------------------------------------------------- configs


def read_hf_config(path: str) -> Any:
    """transformers' config object for `path`, after checking model_type ourselves.

    Going through AutoConfig normalizes old and new spellings (top-level rope_theta /
    rotary_pct vs transformers 5's rope_parameters). model_type is checked first from the
    raw JSON so that an unknown type gets our message, not transformers' one.
    """
    raw = read_config(Path(path))  # one-line errors for a missing directory, file or bad JSON
    config_file = os.path.join(path, "config.json")
    if raw.get("model_type") not in SUPPORTED:
        raise UsageError(f"{config_file}: model_type {raw.get('model_type')!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED)}")
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises many kinds; the user needs one line
        raise UsageError(f"{config_file}: transformers cannot read it ({first_line(e)})") from None
    if config.model_type != raw["model_type"]:  # mistral with layer_types is read as ministral
        raise UsageError(f"{config_file}: transformers reads model_type {raw['model_type']!r} as "
                         f"{config.model_type!r}, which is not supported")
    return config


# The sizes the families' configs give, under their own names (GPT-2's and the others'),
# plus the names transformers maps them to
SIZE_NAMES = ("n_layer", "n_embd", "n_head", "n_positions", "n_inner", "num_hidden_layers", "hidden_size",
              "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "intermediate_size",
              "vocab_size", "head_dim")


def check_sizes(config: Any, config_file: str) -> None:
    """Every size a config gives must be a positive integer: transformers takes n_head 0 or
    n_embd -64 as they come, and hf_fields would divide by them."""
    for name in SIZE_NAMES:
        value = getattr(config, name, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise UsageError(f"{config_file}: {name} must be a positive integer, got {short(value)}")


def rope_scaling_of(rope: Dict[str, Any], where: str) -> Optional[Tuple[Any, ...]]:
    """GPT.rope_scaling of one transformers rope_parameters dict; None for plain rotary.

    AutoConfig turns an old config.json's rope_scaling {"rope_type" or "type", ...} and
    top-level rope_theta into this one dict, and fills in original_max_position_embeddings.
    """
    kind = rope.get("rope_type", rope.get("type", "default"))
    try:
        if kind in (None, "default"):
            return None
        if kind == "linear":
            return ("linear", float(rope["factor"]))
        if kind == "llama3":
            return ("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                    float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{where}: rope scaling {kind!r} without a usable {first_line(e)}") from None
    raise UsageError(f"{where}: rope scaling {kind!r} is not supported (only linear and llama3)")


def rope_settings(config: Any) -> Dict[str, Any]:
    """GPT's rotary fields of a rotary model: rope_theta, rotary_fraction, rope_scaling and,
    for Gemma 3, local_rope_theta."""
    t = config.model_type
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if t == "gemma3_text":  # transformers 5 nests them per layer type; an old rope_scaling is global's
        full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
        if rope_scaling_of(local, f"{t} sliding_attention") is not None:
            raise UsageError(f"{t}: rope scaling on sliding-window layers is not supported")
        return dict(rope_theta=float(full.get("rope_theta", 1_000_000.0)), rotary_fraction=1.0,
                    rope_scaling=rope_scaling_of(full, f"{t} full_attention"),
                    local_rope_theta=float(local.get("rope_theta", 10_000.0)))
    if any(isinstance(v, dict) for v in rope.values()):
        raise UsageError(f"{t}: rope parameters per layer type are not supported")
    scaling = getattr(config, "rope_scaling", None)  # older spelling, if a config still has it
    if isinstance(scaling, dict):
        rope = {**scaling, **rope}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    # Only GPT-NeoX rotates part of each head; Llama/Qwen rotary use the full head width
    # in transformers even if a partial_rotary_factor is present.
    fraction = rope.get("partial_rotary_factor", 1.0) if t == "gpt_neox" else 1.0
    return dict(rope_theta=float(theta), rotary_fraction=float(fraction), rope_scaling=rope_scaling_of(rope, t))


def window_settings(config: Any) -> Dict[str, Any]:
    """GPT's sliding_window and window_pattern ("S" local, "G" global, cycled over layers)."""
    t = config.model_type
    layer_types = list(getattr(config, "layer_types", None) or [])
    window = config.sliding_window if t in ("mistral", "gemma3_text") else None
    if window is not None and (not isinstance(window, int) or window < 1):
        raise UsageError(f"{t}: sliding_window {window!r} is not a positive whole number")
    if t == "mistral":  # one window (or none: null) on every layer
        return dict(sliding_window=window, window_pattern="S")
    if t == "gemma3_text":  # AutoConfig writes layer_types, also from an old sliding_window_pattern
        if getattr(config, "use_bidirectional_attention", False):
            raise UsageError(f"{t}: use_bidirectional_attention is not supported")
        kinds = {"sliding_attention": "S", "full_attention": "G"}
        if len(layer_types) != config.num_hidden_layers or not set(layer_types) <= set(kinds):
            raise UsageError(f"{t}: layer_types must name sliding_attention or full_attention for each "
                             f"of the {config.num_hidden_layers} layers, not {layer_types}")
        if window is None and "sliding_attention" in layer_types:
            raise UsageError(f"{t}: sliding_attention layers without a sliding_window")
        pattern = "".join(kinds[k] for k in layer_types)
        return dict(sliding_window=window, window_pattern=shortest_period(pattern))
    # llama, qwen2, qwen3 (Qwen's use_sliding_window / max_window_layers stay refused)
    if getattr(config, "use_sliding_window", False) or any(k != "full_attention" for k in layer_types):
        raise UsageError(f"{t}: sliding-window attention is not supported")
    return {}


def shortest_period(pattern: str) -> str:
    """'SSSSSGSSSSSGSS' -> 'SSSSSG': the shortest string that, cycled, gives `pattern`."""
    return next(pattern[:n] for n in range(1, len(pattern) + 1)
                if all(c == pattern[i % n] for i, c in enumerate(pattern)))


def mlp_kind(config: Any, name: str, value: str) -> str:
    """Our MLP kind for a config's activation function. Llama, Qwen, Mistral and Gemma gate
    the MLP with it: silu -> SwiGLU, gelu_tanh (Gemma) -> GeGLU."""
    plain = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact"}
    gated = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}
    is_gated = config.model_type in ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")
    kind = (gated if is_gated else plain).get(value)
    if kind is None:
        raise UsageError(f"{config.model_type}: {name} {value!r} is not supported for this model type")
    return kind


def llama_biases(config: Any) -> Tuple[bool, bool, bool]:
    """Which linear layers of a Llama-like model have biases: (q/k/v, attention-out, MLP).
    Qwen2 always has q/k/v biases and no others; Llama, Qwen3 and Gemma 3 say so in their
    config; Mistral's has no such fields (no biases)."""
    if config.model_type == "qwen2":
        return True, False, False
    attention = bool(getattr(config, "attention_bias", False))
    return attention, attention, bool(getattr(config, "mlp_bias", False))


def hf_fields(config: Any) -> Dict[str, Any]:
    """GPT constructor fields (sizes + family options) for a transformers config.

    Biases: GPT's `bias` switches attention-out, MLP and LayerNorm biases together and
    `qkv_bias` the q/k/v ones. A family that has only some of the `bias` group (Llama with
    attention_bias but not mlp_bias, NeoX without attention_bias) gets bias=True and the
    absent ones are loaded as zeros, which computes exactly the same function.
    """
    t = config.model_type
    if t == "gpt2":
        if not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx:
            raise UsageError("gpt2: only scale_attn_weights=True and "
                             "scale_attn_by_inverse_layer_idx=False are supported")
        if getattr(config, "add_cross_attention", False):
            raise UsageError("gpt2: add_cross_attention is not supported")
        return dict(gpt.FAMILIES["gpt2"], n_layers=config.n_layer, n_embd=config.n_embd,
                    n_head=config.n_head, block_size=config.n_positions, vocab_size=config.vocab_size,
                    mlp_hidden=config.n_inner or 4 * config.n_embd,
                    mlp=mlp_kind(config, "activation_function", config.activation_function),
                    norm_eps=config.layer_norm_epsilon, tie_embeddings=bool(config.tie_word_embeddings))
    heads = config.num_attention_heads
    activation = "hidden_activation" if t == "gemma3_text" else "hidden_act"
    fields = dict(gpt.FAMILIES[t], n_layers=config.num_hidden_layers, n_embd=config.hidden_size,
                  n_head=heads, block_size=config.max_position_embeddings,
                  vocab_size=config.vocab_size, mlp_hidden=config.intermediate_size,
                  mlp=mlp_kind(config, activation, getattr(config, activation)),
                  tie_embeddings=bool(config.tie_word_embeddings),
                  **rope_settings(config), **window_settings(config))
    if t == "gpt_neox":
        if config.hidden_size % heads:
            raise UsageError(f"gpt_neox: hidden_size {config.hidden_size} is not a multiple of "
                             f"num_attention_heads {heads}")
        return dict(fields, n_kv_head=heads, head_dim=config.hidden_size // heads,
                    norm_eps=config.layer_norm_eps, qkv_bias=bool(config.attention_bias),
                    parallel_residual=bool(config.use_parallel_residual))
    # llama, qwen2, qwen3, mistral, gemma3_text
    qkv_bias, out_bias, mlp_bias = llama_biases(config)
    fields = dict(fields, n_kv_head=config.num_key_value_heads,
                  head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                  norm_eps=config.rms_norm_eps, qkv_bias=qkv_bias, bias=out_bias or mlp_bias)
    if t == "gemma3_text":
        return dict(fields, **gemma_fields(config))
    return fields


def gemma_fields(config: Any) -> Dict[str, Any]:
    """Gemma 3's query scale and final soft-cap. Its attn_logit_softcapping is refused:
    transformers stores it but never applies it to Gemma 3 (Gemma3Attention passes no
    softcap to the attention function), so no behaviour could match both."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UsageError("gemma3_text: attn_logit_softcapping is not supported (transformers ignores it)")
    cap = getattr(config, "final_logit_softcapping", None)
    return dict(attn_scale=float(config.query_pre_attn_scalar) ** -0.5,
                logit_softcap=None if cap is None else float(cap))


# ----------------------------------------------------------------------------- tensors per family
# Each reader returns the GPT's parameter tree (numpy) from a directory's tensors; the
# shapes it asks for come from the model, so a config that does not match the file fails
# naming the tensor.


def gpt2_params(ck: TensorFiles, m: gpt.GPT) -> Dict[str, Any]:
    """GPT-2: Conv1D weights are already [in, out]; c_attn holds q|k|v side by side."""
    D, F, V = m.n_embd, m.mlp_width, m.vocab_size
    norm = lambda name: {"scale": ck.get(name + ".weight", (D,)), "bias": ck.get(name + ".bias", (D,))}
    dense = lambda name, n_in, n_out: {"kernel": ck.get(name + ".weight", (n_in, n_out)),
                                       "bias": ck.get(name + ".bias", (n_out,))}
    p = {"wte": {"embedding": ck.get("wte.weight", (V, D))},
         "wpe": {"embedding": ck.get("wpe.weight", (m.block_size, D))}}
    for i in range(m.n_layers):
        h = f"h.{i}."
        qkv = dense(h + "attn.c_attn", D, 3 * D)
        q, k, v = ({"kernel": w, "bias": b} for w, b in zip(np.split(qkv["kernel"], 3, axis=1),
                                                            np.split(qkv["bias"], 3)))
        p[f"blocks_{i}"] = {
            "ln_1": norm(h + "ln_1"), "ln_2": norm(h + "ln_2"),
            "attn": {"q": q, "k": k, "v": v, "o": dense(h + "attn.c_proj", D, D)},
            "mlp": {"up": dense(h + "mlp.c_fc", D, F), "down": dense(h + "mlp.c_proj", F, D)}}
    p["ln_f"] = norm("ln_f")
    if not m.tie_embeddings:
        p["lm_head"] = {"kernel": ck.get("lm_head.weight", (V, D), prefixed=False).T}
    return p


def linear(ck: TensorFiles, name: str, n_in: int, n_out: int, bias: bool, want_bias: bool) -> Dict[str, Any]:
    """A torch nn.Linear ([out, in]) as our [in, out] kernel; a bias we need but the family
    lacks is zero."""
    p = {"kernel": ck.get(name + ".weight", (n_out, n_in)).T}
    if want_bias:
        p["bias"] = ck.get(name + ".bias", (n_out,)) if bias else ck.zeros((n_out,))
    return p


def llama_params(ck: TensorFiles, m: gpt.GPT, config: Any) -> Dict[str, Any]:
    """Llama / Qwen2 / Qwen3 / Mistral / Gemma 3: Linear weights are [out, in]; RMSNorm has
    only a scale (Gemma stores w of its 1 + w). Gemma's post_attention_layernorm norms the
    attention's output; Llama's is the norm before the MLP."""
    D, F, V, H, K, E = m.n_embd, m.mlp_width, m.vocab_size, m.n_head, m.kv_heads, m.head_width
    qkv, out, mlp = llama_biases(config)
    norm = lambda name: {"scale": ck.get(name + ".weight", (D,))}
    p = {"wte": {"embedding": ck.get("embed_tokens.weight", (V, D))}}
    for i in range(m.n_layers):
        h = f"layers.{i}."
        attn = {"q": linear(ck, h + "self_attn.q_proj", D, H * E, qkv, qkv),
                "k": linear(ck, h + "self_attn.k_proj", D, K * E, qkv, qkv),
                "v": linear(ck, h + "self_attn.v_proj", D, K * E, qkv, qkv),
                "o": linear(ck, h + "self_attn.o_proj", H * E, D, out, m.bias)}
        if m.qk_norm:
            attn["q_norm"] = {"scale": ck.get(h + "self_attn.q_norm.weight", (E,))}
            attn["k_norm"] = {"scale": ck.get(h + "self_attn.k_norm.weight", (E,))}
        block = {"ln_1": norm(h + "input_layernorm"), "attn": attn,
                 "mlp": {"gate": linear(ck, h + "mlp.gate_proj", D, F, mlp, m.bias),
                         "up": linear(ck, h + "mlp.up_proj", D, F, mlp, m.bias),
                         "down": linear(ck, h + "mlp.down_proj", F, D, mlp, m.bias)}}
        if m.sandwich_norm:
            block.update(ln_attn_out=norm(h + "post_attention_layernorm"),
                         ln_2=norm(h + "pre_feedforward_layernorm"), ln_mlp_out=norm(h + "post_feedforward_layernorm"))
        else:
            block.update(ln_2=norm(h + "post_attention_layernorm"))
        p[f"blocks_{i}"] = block
    p["ln_f"] = norm("norm")
    if not m.tie_embeddings:
        p["lm_head"] = {"kernel": ck.get("lm_head.weight", (V, D), prefixed=False).T}
    return p


def neox_params(ck: TensorFiles, m: gpt.GPT) -> Dict[str, Any]:
    """GPT-NeoX: query_key_value's outputs are laid out per head as [H, 3, E] (not q|k|v)."""
    D, F, V, H, E = m.n_embd, m.mlp_width, m.vocab_size, m.n_head, m.head_width
    norm = lambda name: {"scale": ck.get(name + ".weight", (D,)), "bias": ck.get(name + ".bias", (D,))}
    p = {"wte": {"embedding": ck.get("embed_in.weight", (V, D))}}
    for i in range(m.n_layers):
        h = f"layers.{i}."
        w = ck.get(h + "attention.query_key_value.weight", (3 * D, D)).reshape(H, 3, E, D)
        if m.has_qkv_bias:
            b = ck.get(h + "attention.query_key_value.bias", (3 * D,)).reshape(H, 3, E)
        attn = {}
        for j, name in enumerate("qkv"):
            attn[name] = {"kernel": w[:, j].reshape(H * E, D).T}
            if m.has_qkv_bias:
                attn[name]["bias"] = b[:, j].reshape(H * E)
        attn["o"] = linear(ck, h + "attention.dense", D, D, m.has_qkv_bias, True)  # attention_bias
        p[f"blocks_{i}"] = {
            "ln_1": norm(h + "input_layernorm"), "ln_2": norm(h + "post_attention_layernorm"),
            "attn": attn,
            "mlp": {"up": linear(ck, h + "mlp.dense_h_to_4h", D, F, True, True),
                    "down": linear(ck, h + "mlp.dense_4h_to_h", F, D, True, True)}}
    p["ln_f"] = norm("final_layer_norm")
    if not m.tie_embeddings:  # Hub files call it embed_out; transformers 5 may write lm_head
        name = "embed_out.weight" if ck.has("embed_out.weight", prefixed=False) else "lm_head.weight"
        p["lm_head"] = {"kernel": ck.get(name, (V, D), prefixed=False).T}
    return p


def check_tree(model: gpt.GPT, params: Dict[str, Any], path: str) -> None:
    """The host tree must have exactly the paths and shapes GPT.init would make."""
    expected = param_shapes(model)
    got = {name: tuple(np.shape(v)) for name, v in flatten(params).items()}
    if got.keys() != expected.keys():
        extra, missing = sorted(got.keys() - expected.keys()), sorted(expected.keys() - got.keys())
        raise UsageError(f"{path}: parameter tree mismatch (missing {missing[:3]}, extra {extra[:3]})")
    for name, shape in got.items():
        if shape != expected[name]:
            raise UsageError(f"{path}: parameter {name} has shape {list(shape)}, GPT expects "
                             f"{list(expected[name])}")


def load_backbone(path: str, dtype: str = "float32") -> Tuple[gpt.GPT, Dict[str, Any]]:
    """(gpt.GPT, {"params": numpy tree}) for a HuggingFace directory, in `dtype`.

    The host tree is plain numpy in `dtype` (bfloat16 via ml_dtypes); put it on a mesh with
    gpt.place_params(model, mesh, host), which copies each device's slice only.
    """
    path = os.fspath(path)
    if dtype not in gpt.DTYPES:
        raise UsageError(f"dtype {dtype!r} is not supported; choose one of {', '.join(gpt.DTYPES)}")
    config = read_hf_config(path)
    config_file = os.path.join(path, "config.json")
    check_sizes(config, config_file)
    # the same checks as a native config.json (heads that divide, ranges, fits in memory)
    model = check_model_fields(dict(hf_fields(config), param_dtype=dtype, activation_dtype=dtype), config_file)
    t = config.model_type
    ck = TensorFiles(path, dtype, prefix=BASE_PREFIX.get(t, "model."))
    if t == "gpt2":
        params = gpt2_params(ck, model)
    elif t == "gpt_neox":
        params = neox_params(ck, model)
    else:
        params = llama_params(ck, model, config)
    unused = ck.unused(IGNORED_SUFFIXES)
    if unused and not (model.tie_embeddings and unused == ["lm_head.weight"]):  # a tied copy is fine
        raise UsageError(f"{path}: {len(unused)} tensor(s) that config.json does not account for, "
                         f"e.g. {unused[0]!r}")
    check_tree(model, params, path)
    return model, {"params": params}


# ----------------------------------------------------------------------------- export


def is_gpt2_layout(m: gpt.GPT) -> bool:
    return (not m.rope and m.mlp in ("gelu", "gelu_exact") and m.norm == "layernorm" and m.bias
            and m.has_qkv_bias and not m.qk_norm and not m.parallel_residual
            and m.kv_heads == m.n_head and m.head_width * m.n_head == m.n_embd)


def gpt2_tensors(model: gpt.GPT, params: Dict[str, Any]) -> Dict[str, np.ndarray]:
    """Our parameter tree under transformers' GPT-2 names: "transformer." prefix, Conv1D
    [in, out] kernels, q|k|v side by side in c_attn, no lm_head when tied."""
    tensors = {"wte.weight": params["wte"]["embedding"], "wpe.weight": params["wpe"]["embedding"],
               "ln_f.weight": params["ln_f"]["scale"], "ln_f.bias": params["ln_f"]["bias"]}
    for i in range(model.n_layers):
        b, h = params[f"blocks_{i}"], f"h.{i}."
        attn = b["attn"]
        tensors.update({
            h + "ln_1.weight": b["ln_1"]["scale"], h + "ln_1.bias": b["ln_1"]["bias"],
            h + "ln_2.weight": b["ln_2"]["scale"], h + "ln_2.bias": b["ln_2"]["bias"],
            h + "attn.c_attn.weight": np.concatenate([attn[n]["kernel"] for n in "qkv"], axis=1),
            h + "attn.c_attn.bias": np.concatenate([attn[n]["bias"] for n in "qkv"]),
            h + "attn.c_proj.weight": attn["o"]["kernel"], h + "attn.c_proj.bias": attn["o"]["bias"],
            h + "mlp.c_fc.weight": b["mlp"]["up"]["kernel"], h + "mlp.c_fc.bias": b["mlp"]["up"]["bias"],
            h + "mlp.c_proj.weight": b["mlp"]["down"]["kernel"],
            h + "mlp.c_proj.bias": b["mlp"]["down"]["bias"]})
    tensors = {"transformer." + k: np.ascontiguousarray(v) for k, v in tensors.items()}
    if not model.tie_embeddings:
        tensors["lm_head.weight"] = np.ascontiguousarray(params["lm_head"]["kernel"].T)
    return tensors


def save_hf_tokenizer(tokenizer_dir: str, path: str, vocab_size: int) -> Any:
    """Copy a tokenizer next to an exported model; returns transformers' tokenizer object."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.fspath(tokenizer_dir), local_files_only=True,
                                                           trust_remote_code=False)
    if len(tokenizer) > vocab_size:
        raise UsageError(f"export_gpt2: tokenizer in {tokenizer_dir} has {len(tokenizer)} tokens, "
                         f"more than the model's vocab_size {vocab_size}")
    tokenizer.save_pretrained(path)
    # transformers 5 writes the loading options is_local/local_files_only into
    # tokenizer_config.json; they describe this machine, not the tokenizer
    config_file = Path(path) / "tokenizer_config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        for key in ("is_local", "local_files_only"):
            config.pop(key, None)
        config_file.write_text(json.dumps(config, indent=2))
    return tokenizer


def export_gpt2(model: gpt.GPT, variables: Any, path: str, tokenizer_dir: Optional[str] = None) -> None:
    """Write a GPT-2-layout GPT as a HuggingFace GPT-2 directory (config.json, float32
    model.safetensors, and the tokenizer of `tokenizer_dir` if given) that GPT2LMHeadModel
    loads as is. `variables` may be {"params": tree} or the tree, on host or on a mesh."""
    if not is_gpt2_layout(model):
        raise UsageError("export_gpt2: the model is not GPT-2 layout (needs rope=False, gelu MLP, "
                         "layernorm, biases, no q/k norm, no grouped heads, sequential residual)")
    params = jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32),
                          nn.meta.unbox(variables.get("params", variables)))
    os.makedirs(path, exist_ok=True)
    tokenizer = save_hf_tokenizer(tokenizer_dir, path, model.vocab_size) if tokenizer_dir else None
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    bos = tokenizer.bos_token_id if tokenizer is not None else None
    transformers.GPT2Config(
        vocab_size=model.vocab_size, n_positions=model.block_size, n_embd=model.n_embd,
        n_layer=model.n_layers, n_head=model.n_head, n_inner=model.mlp_width,
        activation_function="gelu_new" if model.mlp == "gelu" else "gelu",
        layer_norm_epsilon=model.norm_eps, tie_word_embeddings=model.tie_embeddings,
        resid_pdrop=model.dropout, embd_pdrop=model.dropout, attn_pdrop=model.dropout,
        bos_token_id=bos if bos is not None else eos, eos_token_id=eos,
        architectures=["GPT2LMHeadModel"], dtype="float32").save_pretrained(path)
    # metadata format=pt: transformers expects it in files it did not write itself
    save_file(gpt2_tensors(model, params), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def describe(path: str) -> None:
    """`python hf.py DIR`: the GPT a HuggingFace directory becomes."""
    model, host = load_backbone(path)
    fields = {k: getattr(model, k) for k in hf_fields(read_hf_config(path))}
    print(f"{path}: {sum(x.size for x in jax.tree.leaves(host)) / 1e6:.2f}M parameters")
    print("gpt.GPT(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        sys.exit(2)
    sys.exit(exit_status(lambda: describe(sys.argv[1])))
