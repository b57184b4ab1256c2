"""The HuggingFace bridge: a local transformers model directory in, our GPT out (and back).

    python hf.py DIR                 # what GPT a HuggingFace directory becomes, and its size
    python hf.py ORG/NAME[@REV]      # the same for a hub model (HF_HUB_OFFLINE=1: from the cache only)

Reading order: hub ids (ORG/NAME[@REVISION] as a snapshot directory of the HuggingFace
cache, downloaded where allowed, and the commit it is) -> the config (read through transformers' config classes) -> GPT fields per
family (gpt.FAMILIES holds what differs; this file maps names and layouts onto it) ->
the tensors of each family through checkpoints.TensorFiles (views of the stored tensors; a block is
read and checked when a device takes it) -> load_backbone -> export_gpt2 (a GPT-2-layout GPT
as a directory transformers loads).

Supported model types: gpt2, llama (with Llama 3.x "llama3" or "linear" rope scaling),
qwen2, qwen3, gpt_neox, mistral (sliding windows), gemma3_text and gemma2 (local and
global layers), phi3 (fused projections, partial rotary, longrope), olmo2, granite, and
the mixtures of experts mixtral, qwen2_moe, qwen3_moe and olmoe. Weights come only from
*.safetensors files: nothing is ever unpickled and no remote code runs. Refused with one
line: other model types, other rope scaling types (yarn, dynamic, ...), Qwen's sliding
windows, Gemma 3's attention soft-capping (transformers ignores it) and bidirectional
attention, Qwen-MoE's dense layers among the experts, OLMoE's clip_qkv, quantized weights,
*.bin pickles. Longrope checkpoints get block_size original_max_position_embeddings (see
gpt.GPT.check_length).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import flax.linen as nn
import huggingface_hub
import jax
import numpy as np
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, IncompleteSnapshotError, LocalEntryNotFoundError
from safetensors.numpy import save_file

# transformers is imported where it is used: half a second of every run that reads no
# HuggingFace file; torch is never needed, and its import-time "PyTorch was not found" is off
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import gpt
from checkpoints import (Node, TensorFiles, check_model_fields, concatenated, flatten, load_checkpoint, param_shapes,
                         read_config, split, stacked, stacked_layers)
from jobs import (CHAT_TEMPLATES, TOKENIZER_FILES, HFTokenizer, UsageError, exit_status, first_line,
                  leave_torch_unloaded, load_tokenizer, read_json, short)

SUPPORTED = ("gpt2", "llama", "qwen2", "qwen3", "gpt_neox", "mistral", "gemma3_text", "gemma2", "phi3", "olmo2",
             "granite", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
MIXTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# Buffers some checkpoints carry that are not parameters (causal masks, rotary tables)
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias",
                    "rotary_emb.inv_freq")
BASE_PREFIX = {"gpt2": "transformer.", "gpt_neox": "gpt_neox."}  # others: "model."


# ----------------------------------------------------------------------------- hub ids
# `--ckpt ORG/NAME[@REVISION]` names a model as the ecosystem does (lm-eval's
# pretrained=ORG/NAME,revision=...). huggingface_hub resolves it to a snapshot folder of its
# cache, snapshots/COMMIT/, downloading only what this project reads; offline
# (HF_HUB_OFFLINE=1) only from the cache. The commit is recorded, so a branch that moved
# since is another run.

HUB_ID = re.compile(r"(?P<id>[\w.-]+/[\w.-]+)(?:@(?P<revision>[^@\s]+))?")
# A revision is a branch or a tag (names of ASCII letters, digits, ".", "_", "+" and "-"
# joined by "/", none starting with "." and no ".." anywhere, as git's refs are, less their
# rarer characters) or a commit: the cache keeps refs/REVISION, so a revision is a path there
REVISION = re.compile(r"(?!.*\.\.)[\w+-][\w.+-]*(?:/[\w+-][\w.+-]*)*", re.ASCII)
COMMIT = re.compile(r"[0-9a-f]{40}")  # a snapshot folder's name
# What a snapshot download fetches: the config, safetensors weights and their index, the
# tokenizer and chat templates. Never pickles (*.bin, *.pt) or code (*.py): neither is read.
HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
             *TOKENIZER_FILES, f"{CHAT_TEMPLATES}/*.jinja"]


def is_hub_id(text: str) -> bool:
    """Whether --ckpt names a hub model (ORG/NAME, ORG/NAME@REVISION) rather than a directory."""
    return HUB_ID.fullmatch(text) is not None


def resolve_checkpoint(text: str, say=lambda line: print(line, file=sys.stderr)) -> Node:
    """The directory --ckpt names: a local directory as it is (one of the same name as a hub
    model wins, as in transformers, and `say` tells so where the HuggingFace cache holds
    that model); a hub id as its snapshot folder, the Node's `hub` recording the id, the
    revision asked for and the commit it resolved to."""
    match = HUB_ID.fullmatch(text)
    if match is None or os.path.lexists(text):
        if match is not None and os.path.isdir(hub_folder(match["id"])):
            say(f"--ckpt {text}: the local directory {os.path.abspath(text)}, not the hub model in the "
                "HuggingFace cache (give another path to the directory, or move it, to use the hub model)")
        return Node(text)
    repo, revision = match["id"], match["revision"] or "main"
    if not REVISION.fullmatch(revision):
        raise UsageError(f"--ckpt {text}: revision {short(revision)} is not a branch, a tag or a commit (names of "
                         "letters, digits, '.', '_', '+' and '-' joined by '/', none starting with '.', no '..')")
    folder = download_snapshot(text, repo, revision)
    check_snapshot(text, repo, folder)
    return Node(folder, hub={"id": repo, "revision": revision, "commit": os.path.basename(folder)})


def hub_folder(repo: str) -> str:
    """Where the HuggingFace cache keeps a model: HF_HUB_CACHE/models--ORG--NAME."""
    return os.path.join(hub_constants.HF_HUB_CACHE, huggingface_hub.file_download.repo_folder_name(
        repo_id=repo, repo_type="model"))


def download_snapshot(text: str, repo: str, revision: str) -> str:
    """The snapshot folder of `repo` at `revision` (a branch, a tag, a commit): from the
    cache where it is there and downloads are off, else downloaded (HUB_FILES only). A
    commit the cache holds whole is taken from it first: a commit never changes, and asking
    the hub for its listing, without a network, retried for seconds on end."""
    try:
        if COMMIT.fullmatch(revision):
            with contextlib.suppress(LocalEntryNotFoundError, IncompleteSnapshotError):  # not cached whole: the hub's
                return huggingface_hub.snapshot_download(repo, revision=revision, allow_patterns=HUB_FILES,
                                                         local_files_only=True)
        return huggingface_hub.snapshot_download(repo, revision=revision, allow_patterns=HUB_FILES)
    except IncompleteSnapshotError as e:  # the cache's own listing of the commit names files not there
        raise UsageError(f"--ckpt {text}: {first_line(e)}") from None
    except LocalEntryNotFoundError:  # offline (or the hub unreachable), and not in the cache
        why = "HF_HUB_OFFLINE=1" if hub_constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        raise UsageError(f"--ckpt {text}: no snapshot of revision {revision!r} in the HuggingFace cache "
                         f"({hub_folder(repo)}), and {why}; run once online to download it") from None
    except (HfHubHTTPError, HFValidationError) as e:  # no such model or revision, gated, a bad name
        raise UsageError(f"--ckpt {text}: {first_line(e)}") from None


def check_snapshot(text: str, repo: str, folder: str) -> None:
    """A snapshot is used only where it is a folder snapshots/COMMIT of the model's own cache
    folder, links followed (a ref file holding a path, or a linked snapshot, would lead
    anywhere). One whose index names a weights file the folder lacks (an interrupted
    download, a file removed from the cache) is refused now, naming the file, not once half
    loaded."""
    snapshots = os.path.realpath(os.path.join(hub_folder(repo), "snapshots"))
    name = os.path.basename(folder)
    if not COMMIT.fullmatch(name) or os.path.realpath(folder) != os.path.join(snapshots, name):
        raise UsageError(f"--ckpt {text}: resolved to {folder}, not a snapshot folder (snapshots/COMMIT) "
                         f"of {hub_folder(repo)}: its refs or snapshots lead out of it")
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.lexists(index):
        return
    weight_map = read_json(Path(index), "safetensors index")
    files = weight_map.get("weight_map", {}) if isinstance(weight_map, dict) else {}
    for file in sorted(set(files.values()) if isinstance(files, dict) else ()):
        if isinstance(file, str) and not os.path.exists(os.path.join(folder, file)):
            raise UsageError(f"--ckpt {text}: snapshot {folder} lacks {file}, which model.safetensors.index.json "
                             "names (download it again, online)")


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
    import transformers
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
              "vocab_size", "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size", "original_max_position_embeddings")


def check_sizes(config: Any, config_file: str) -> None:
    """Every size a config gives must be a positive integer: transformers takes n_head 0 or
    n_embd -64 as they come, and hf_fields would divide by them."""
    for name in SIZE_NAMES:
        value = getattr(config, name, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise UsageError(f"{config_file}: {name} must be a positive integer, got {short(value)}")


def rope_scaling_of(rope: Dict[str, Any], where: str, max_positions: int = 0) -> Optional[Tuple[Any, ...]]:
    """GPT.rope_scaling of one transformers rope_parameters dict; None for plain rotary.

    AutoConfig turns an old config.json's rope_scaling {"rope_type" or "type", ...} and
    top-level rope_theta into this one dict, and fills in original_max_position_embeddings
    (Phi-3's old "su" is its "longrope"). max_positions: the config's max_position_embeddings.
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
        if kind == "longrope":
            return longrope_scaling(rope, max_positions)
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{where}: rope scaling {kind!r} without a usable {first_line(e)}") from None
    raise UsageError(f"{where}: rope scaling {kind!r} is not supported (only linear, llama3 and longrope)")


def longrope_scaling(rope: Dict[str, Any], max_positions: int) -> Tuple[Any, ...]:
    """("longrope", original context, attention factor, *short factors), the attention
    factor as transformers defaults it: sqrt(1 + ln(factor) / ln(original)), the factor
    max_position_embeddings / original unless given. The long factors are never used:
    sequences longer than the original context are refused (gpt.GPT.check_length)."""
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or max_positions / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return ("longrope", original, float(attention), *(float(f) for f in rope["short_factor"]))


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
    # Only GPT-NeoX and Phi-3 rotate part of each head; Llama/Qwen rotary use the full head
    # width in transformers even if a partial_rotary_factor is present.
    fraction = rope.get("partial_rotary_factor", 1.0) if t in ("gpt_neox", "phi3") else 1.0
    return dict(rope_theta=float(theta), rotary_fraction=float(fraction),
                rope_scaling=rope_scaling_of(rope, t, config.max_position_embeddings))


WINDOWED = ("mistral", "phi3", "mixtral")  # one sliding_window on every layer, or null
LAYERED = ("gemma3_text", "gemma2")  # layer_types: sliding_attention (local) or full_attention


def window_settings(config: Any) -> Dict[str, Any]:
    """GPT's sliding_window and window_pattern ("S" local, "G" global, cycled over layers)."""
    t = config.model_type
    layer_types = list(getattr(config, "layer_types", None) or [])
    window = config.sliding_window if t in WINDOWED + LAYERED else None
    if window is not None and (not isinstance(window, int) or window < 1):
        raise UsageError(f"{t}: sliding_window {window!r} is not a positive whole number")
    if t in WINDOWED:  # one window (or none: null) on every layer
        return dict(sliding_window=window, window_pattern="S")
    if t in LAYERED:  # AutoConfig writes layer_types, also from an old sliding_window_pattern
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
    # llama, qwen2, qwen3, olmo2, granite, the Qwen MoEs, olmoe (Qwen's use_sliding_window /
    # max_window_layers stay refused)
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
    is_gated = config.model_type not in ("gpt2", "gpt_neox")
    kind = (gated if is_gated else plain).get(value)
    if kind is None:
        raise UsageError(f"{config.model_type}: {name} {value!r} is not supported for this model type")
    return kind


def llama_biases(config: Any) -> Tuple[bool, bool, bool]:
    """Which linear layers of a Llama-like model have biases: (q/k/v, attention-out, MLP).
    Qwen2 always has q/k/v biases and no others, Qwen2-MoE as its qkv_bias says; the others
    say so in attention_bias and mlp_bias, or have no such fields (Mistral, Phi-3, Mixtral:
    no biases)."""
    if config.model_type == "qwen2":
        return True, False, False
    if config.model_type == "qwen2_moe":
        return bool(config.qkv_bias), False, False
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
    activation = "hidden_activation" if t in ("gemma3_text", "gemma2") else "hidden_act"
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
    # the Llama-like families: llama, qwen2, qwen3, mistral, gemma3_text and the new ones
    qkv_bias, out_bias, mlp_bias = llama_biases(config)
    fields = dict(fields, n_kv_head=config.num_key_value_heads,
                  head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                  norm_eps=config.rms_norm_eps, qkv_bias=qkv_bias, bias=out_bias or mlp_bias)
    if fields["rope_scaling"] is not None and fields["rope_scaling"][0] == "longrope":  # see check_length
        fields["block_size"] = min(fields["block_size"], fields["rope_scaling"][1])
    if t in ("gemma3_text", "gemma2"):
        return dict(fields, **gemma_fields(config))
    if t == "granite":
        return dict(fields, attn_scale=float(config.attention_multiplier),
                    embed_multiplier=float(config.embedding_multiplier),
                    residual_multiplier=float(config.residual_multiplier), logits_scaling=float(config.logits_scaling))
    if t in MIXTURES:
        return dict(fields, **expert_fields(config))
    return fields


def gemma_fields(config: Any) -> Dict[str, Any]:
    """Gemma's query scale and soft-caps. Gemma 3's attn_logit_softcapping is refused:
    transformers stores it but never applies it to Gemma 3 (Gemma3Attention passes no
    softcap to the attention function), so no behaviour could match both."""
    attention_cap = getattr(config, "attn_logit_softcapping", None)
    if config.model_type == "gemma3_text" and attention_cap is not None:
        raise UsageError("gemma3_text: attn_logit_softcapping is not supported (transformers ignores it)")
    cap = getattr(config, "final_logit_softcapping", None)
    return dict(attn_scale=float(config.query_pre_attn_scalar) ** -0.5,
                attn_softcap=None if attention_cap is None else float(attention_cap),
                logit_softcap=None if cap is None else float(cap))


def expert_fields(config: Any) -> Dict[str, Any]:
    """A mixture's sizes: every block's MLP is n_experts experts of mlp_hidden (Qwen's
    moe_intermediate_size), the router's top n_experts_per_token, renormalised where the
    family does (Mixtral always, the others by norm_topk_prob); Qwen2-MoE's shared expert."""
    t = config.model_type
    if t in ("qwen2_moe", "qwen3_moe") and (config.mlp_only_layers or config.decoder_sparse_step != 1):
        raise UsageError(f"{t}: dense layers among the experts (mlp_only_layers, decoder_sparse_step) "
                         f"are not supported")
    if t == "olmoe" and config.clip_qkv is not None:
        raise UsageError("olmoe: clip_qkv is not supported")
    if config.num_experts is None or config.num_experts_per_tok is None:  # check_sizes let None through
        raise UsageError(f"{t}: num_experts and num_experts_per_tok must be given")
    if config.num_experts_per_tok > config.num_experts:
        raise UsageError(f"{t}: num_experts_per_tok {config.num_experts_per_tok} is more than the "
                         f"{config.num_experts} experts")
    fields = dict(n_experts=config.num_experts, n_experts_per_token=config.num_experts_per_tok,
                  norm_topk_prob=t == "mixtral" or bool(config.norm_topk_prob))
    if t in ("qwen2_moe", "qwen3_moe"):
        fields["mlp_hidden"] = config.moe_intermediate_size
    if t == "qwen2_moe":
        fields["shared_expert_hidden"] = config.shared_expert_intermediate_size
    return fields


# ----------------------------------------------------------------------------- tensors per family
# Each reader returns the GPT's parameter tree from a directory's tensors, unread (see
# checkpoints.LazyTensor): the family's layout (transposes, fused tensors split, experts stacked)
# is a view of the stored tensors, so a device's block reads only the bytes it holds. The
# shapes asked for come from the model, so a config that does not match the file fails
# naming the tensor.


def gpt2_params(ck: TensorFiles, m: gpt.GPT) -> Dict[str, Any]:
    """GPT-2: Conv1D weights are already [in, out]; c_attn holds q|k|v side by side."""
    D, F, V = m.n_embd, m.mlp_width, m.vocab_size
    norm = lambda name: {"scale": ck.get(name + ".weight", (D,)), "bias": ck.get(name + ".bias", (D,))}
    dense = lambda name, n_in, n_out: {"kernel": ck.get(name + ".weight", (n_in, n_out)),
                                       "bias": ck.get(name + ".bias", (n_out,))}
    p = {"wte": {"embedding": ck.get("wte.weight", (V, D))},
         "wpe": {"embedding": ck.get("wpe.weight", (m.block_size, D))}}
    layers = []
    for i in range(m.n_layers):
        h = f"h.{i}."
        qkv = dense(h + "attn.c_attn", D, 3 * D)
        q, k, v = ({"kernel": w, "bias": b} for w, b in zip(split(qkv["kernel"], [D] * 3, axis=1),
                                                            split(qkv["bias"], [D] * 3)))
        layers.append({
            "ln_1": norm(h + "ln_1"), "ln_2": norm(h + "ln_2"),
            "attn": {"q": q, "k": k, "v": v, "o": dense(h + "attn.c_proj", D, D)},
            "mlp": {"up": dense(h + "mlp.c_fc", D, F), "down": dense(h + "mlp.c_proj", F, D)}})
    p["blocks"] = stacked_layers(layers)
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
    """The Llama-like families: Linear weights are [out, in]; RMSNorm has only a scale
    (Gemma stores w of its 1 + w)."""
    D, V = m.n_embd, m.vocab_size
    p = {"wte": {"embedding": ck.get("embed_tokens.weight", (V, D))}}
    layers = []
    for i in range(m.n_layers):
        h = f"layers.{i}."
        mlp = expert_params(ck, m, config, h) if m.n_experts is not None else mlp_params(ck, m, config, h)
        layers.append({**block_norms(ck, m, h), "attn": attention_params(ck, m, config, h), "mlp": mlp})
    p["blocks"] = stacked_layers(layers)
    p["ln_f"] = {"scale": ck.get("norm.weight", (D,))}
    if not m.tie_embeddings:
        p["lm_head"] = {"kernel": ck.get("lm_head.weight", (V, D), prefixed=False).T}
    return p


def block_norms(ck: TensorFiles, m: gpt.GPT, h: str) -> Dict[str, Any]:
    """A block's norms. post_attention_layernorm is the norm before the MLP in Llama, but
    the norm of the attention's output in Gemma and OLMo 2 (which has no input norms)."""
    names = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm"}
    if m.sandwich_norm:
        names = {"ln_1": "input_layernorm", "ln_2": "pre_feedforward_layernorm",
                 "ln_attn_out": "post_attention_layernorm", "ln_mlp_out": "post_feedforward_layernorm"}
    if not m.pre_norm:
        names = {k: v for k, v in names.items() if k not in ("ln_1", "ln_2")}
    return {ours: {"scale": ck.get(h + theirs + ".weight", (m.n_embd,))} for ours, theirs in names.items()}


def attention_params(ck: TensorFiles, m: gpt.GPT, config: Any, h: str) -> Dict[str, Any]:
    """q, k, v, o and the q/k norms (per head, or over all heads' width: OLMo 2, OLMoE).
    Phi-3 stores q|k|v as the rows of one qkv_proj and transformers slices it so."""
    D, H, K, E = m.n_embd, m.n_head, m.kv_heads, m.head_width
    qkv, out, _ = llama_biases(config)
    if config.model_type == "phi3":
        q, k, v = split(ck.get(h + "self_attn.qkv_proj.weight", ((H + 2 * K) * E, D)), [H * E, K * E, K * E])
        attn = {"q": {"kernel": q.T}, "k": {"kernel": k.T}, "v": {"kernel": v.T}}
    else:
        attn = {name: linear(ck, h + f"self_attn.{name}_proj", D, heads * E, qkv, qkv)
                for name, heads in (("q", H), ("k", K), ("v", K))}
    attn["o"] = linear(ck, h + "self_attn.o_proj", H * E, D, out, m.bias)
    if m.qk_norm:
        q_width, k_width = (H * E, K * E) if m.qk_norm_full else (E, E)
        attn["q_norm"] = {"scale": ck.get(h + "self_attn.q_norm.weight", (q_width,))}
        attn["k_norm"] = {"scale": ck.get(h + "self_attn.k_norm.weight", (k_width,))}
    return attn


def mlp_params(ck: TensorFiles, m: gpt.GPT, config: Any, h: str, name: str = "mlp",
               width: Optional[int] = None) -> Dict[str, Any]:
    """A gated MLP (gate, up, down) named `name`, `width` wide (default: the model's). Phi-3
    stores gate|up as the rows of one gate_up_proj (transformers' chunk(2) splits it)."""
    D, F = m.n_embd, width or m.mlp_width
    _, _, bias = llama_biases(config)
    if config.model_type == "phi3":
        gate, up = split(ck.get(h + "mlp.gate_up_proj.weight", (2 * F, D)), [F, F])
        return {"gate": {"kernel": gate.T}, "up": {"kernel": up.T},
                "down": linear(ck, h + "mlp.down_proj", F, D, bias, m.bias)}
    return {part: linear(ck, f"{h}{name}.{part}_proj", n_in, n_out, bias, m.bias)
            for part, n_in, n_out in (("gate", D, F), ("up", D, F), ("down", F, D))}


def expert_params(ck: TensorFiles, m: gpt.GPT, config: Any, h: str) -> Dict[str, Any]:
    """A mixture: the router, and each expert's gate/up/down stacked [X, in, out], as the
    files hold them (one tensor per expert: Mixtral's w1, w3, w2 under block_sparse_moe;
    the others' gate_proj, up_proj, down_proj under mlp); Qwen2-MoE's shared expert."""
    X, D, F = m.n_experts, m.n_embd, m.mlp_width
    where, names = ("block_sparse_moe.", ("w1", "w3", "w2")) if config.model_type == "mixtral" else \
        ("mlp.", ("gate_proj", "up_proj", "down_proj"))
    stack = lambda name, shape: stacked([ck.get(f"{h}{where}experts.{x}.{name}.weight", shape).T
                                         for x in range(X)])
    p = {"router": {"kernel": ck.get(h + where + "gate.weight", (X, D)).T},
         "gate": stack(names[0], (F, D)), "up": stack(names[1], (F, D)), "down": stack(names[2], (D, F))}
    if m.shared_expert_hidden is not None:
        p["shared"] = mlp_params(ck, m, config, h, "mlp.shared_expert", m.shared_expert_hidden)
        p["shared_gate"] = {"kernel": ck.get(h + "mlp.shared_expert_gate.weight", (1, D)).T}
    return p


def neox_params(ck: TensorFiles, m: gpt.GPT) -> Dict[str, Any]:
    """GPT-NeoX: query_key_value's outputs are laid out per head as [H, 3, E] (not q|k|v):
    q is the first E rows of each head's 3 E, k the next, v the last."""
    D, F, V, H, E = m.n_embd, m.mlp_width, m.vocab_size, m.n_head, m.head_width
    norm = lambda name: {"scale": ck.get(name + ".weight", (D,)), "bias": ck.get(name + ".bias", (D,))}
    p = {"wte": {"embedding": ck.get("embed_in.weight", (V, D))}}
    layers = []
    for i in range(m.n_layers):
        h = f"layers.{i}."
        w = ck.get(h + "attention.query_key_value.weight", (3 * D, D))
        if m.has_qkv_bias:
            b = ck.get(h + "attention.query_key_value.bias", (3 * D,))
        per_head = lambda t, j: concatenated([t.part(0, (3 * g + j) * E, (3 * g + j + 1) * E) for g in range(H)])
        attn = {}
        for j, name in enumerate("qkv"):
            attn[name] = {"kernel": per_head(w, j).T}
            if m.has_qkv_bias:
                attn[name]["bias"] = per_head(b, j)
        attn["o"] = linear(ck, h + "attention.dense", D, D, m.has_qkv_bias, True)  # attention_bias
        layers.append({
            "ln_1": norm(h + "input_layernorm"), "ln_2": norm(h + "post_attention_layernorm"),
            "attn": attn,
            "mlp": {"up": linear(ck, h + "mlp.dense_h_to_4h", D, F, True, True),
                    "down": linear(ck, h + "mlp.dense_4h_to_h", F, D, True, True)}})
    p["blocks"] = stacked_layers(layers)
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


def load_backbone(path: str, dtype: str = "float32",
                  mesh: Optional[jax.sharding.Mesh] = None) -> Tuple[gpt.GPT, Dict[str, Any]]:
    """(gpt.GPT, {"params": tree}) for a HuggingFace directory, in `dtype`.

    On `mesh`, the parameters are made in their shardings from the files directly: each
    process reads only the blocks its devices hold (gpt.place_params), in `dtype` from the
    file's own, and the "fits in memory" check counts each device's share. Without one,
    the tree is plain numpy on the host (bfloat16 via ml_dtypes), read a tensor at a time.
    """
    path = os.fspath(path)
    if dtype not in gpt.DTYPES:
        raise UsageError(f"dtype {dtype!r} is not supported; choose one of {', '.join(gpt.DTYPES)}")
    config = read_hf_config(path)
    config_file = os.path.join(path, "config.json")
    check_sizes(config, config_file)
    # the same checks as a native config.json (heads that divide, ranges, fits in memory)
    model = check_model_fields(dict(hf_fields(config), param_dtype=dtype, activation_dtype=dtype), config_file,
                               mesh)
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
    if mesh is not None:
        return model, gpt.place_params(model, mesh, {"params": params})
    return model, {"params": jax.tree.map(np.asarray, params)}


def load_model(base: Node, mesh: jax.sharding.Mesh, dtype: str = "float32") -> Tuple[gpt.GPT, Any, Any]:
    """(model, variables placed on `mesh`, tokenizer) of a checkpoint resolve_checkpoint
    found: a native one (train.py's) or a HuggingFace directory."""
    tokenizer = checkpoint_tokenizer(base)
    return (*load_weights(base, mesh, dtype), tokenizer)


def checkpoint_tokenizer(base: Node) -> Any:
    """The tokenizer of a checkpoint resolve_checkpoint found, read without a device: a
    native one's config.json says which; a HuggingFace directory's own, after its config.json
    is checked (a model that cannot load is named before a tokenizer it lacks)."""
    if base.is_native:
        return load_tokenizer(base.config, base.path)
    read_hf_config(base.path)
    return HFTokenizer(base.path)


def load_weights(base: Node, mesh: jax.sharding.Mesh, dtype: str = "float32") -> Tuple[gpt.GPT, Any]:
    """(model, variables placed on `mesh`) of a checkpoint resolve_checkpoint found, each
    device's share read from the files."""
    if base.is_native:
        return load_checkpoint(base.path, mesh, dtype)[:2]
    return load_backbone(base.path, dtype, mesh)


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
        b, h = jax.tree.map(lambda x: x[i], params["blocks"]), f"h.{i}."
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
    import transformers
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
    import transformers
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


def describe(text: str) -> None:
    """`python hf.py DIR` (or ORG/NAME[@REV]): the GPT a HuggingFace directory becomes."""
    path = resolve_checkpoint(text).path
    model, host = load_backbone(path)
    fields = {k: getattr(model, k) for k in hf_fields(read_hf_config(path))}
    print(f"{path}: {sum(x.size for x in jax.tree.leaves(host)) / 1e6:.2f}M parameters")
    print("gpt.GPT(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        sys.exit(2)
    leave_torch_unloaded()
    sys.exit(exit_status(lambda: describe(sys.argv[1])))
