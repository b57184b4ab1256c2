"""Tests of the whole project, fast on CPU with 8 simulated devices.

    pip install -r requirements.txt torch==2.13.0 'lm-eval[hf]==0.4.13' pytest pytest-xdist==3.8.0 hypothesis==6.155.2 && python -m pytest -q -n 2 test_all.py

Sections, in reading order: gpt.py (the model layer), evaluate.py and jobs.py (the
harness), HuggingFace backbones against transformers' PyTorch models, scoring conventions
against lm-evaluation-harness, reliability (bad input, interruption, the same answer on
every mesh and on two processes). Torch and lm-eval are test-only: their tests skip with a
reason where they are missing. Two workers (pytest-xdist's -n 2) take 12 minutes on 2 cores
against 17 for one: much of a test is compiling, starting processes and importing, on one core.
"""
import ast
import atexit
import contextlib
import copy
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from unittest import mock

# before jax is imported: 8 host devices, so the mesh tests run on any laptop; and no LLVM
# optimization, since these tiny programs spend far longer compiling than running (2x faster)
os.environ.setdefault("XLA_FLAGS",
                      "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ["HF_DATASETS_OFFLINE"] = "1"  # nothing is ever downloaded
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["DISABLE_MULTIPROC"] = "1"  # lm-eval's bootstrap stderrs without fork() in a JAX process
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One persistent compilation cache for the suite and every process it starts: the same tiny
# programs compile once, not once per command-line run (the project's default is the user's)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="gpt-eval-test-jax-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

import flax.linen as nn
import huggingface_hub
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import load_file, save_file

jax.config.update("jax_numpy_rank_promotion", "raise")  # broadcasting must be explicit
# The processes the suite starts run on the CPU's simulated devices: one process at a time
# can hold an accelerator (this one keeps its default backend: jax read its platforms at import)
os.environ["JAX_PLATFORMS"] = "cpu"
# and a TPU machine's jax warns of its start-up at import, a line beside the one-line errors tested
os.environ["PYTHONWARNINGS"] = "ignore:Transparent hugepages"

import bench as bench_module
import checkpoints
import evaluate
import fast
import gpt
import hf
import inference
import jobs
import runs
import tasks
import train
from hf import export_gpt2, load_backbone
from jobs import HFTokenizer, UsageError

ROOT = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def meshes_within_the_devices(monkeypatch):
    """A test whose mesh needs more devices than the default backend has (one TPU chip)
    skips, saying so: the CPU's 8 simulated devices run it (XLA_FLAGS above)."""
    if jax.device_count() >= 8:
        return
    make_mesh = gpt.make_mesh

    def within(batch=None, shard=1, devices=None):
        have = len(jax.devices() if devices is None else devices)
        if batch is not None and batch * shard > have:
            pytest.skip(f"a {batch}x{shard} mesh on {jax.device_count()} {jax.default_backend()} device(s)")
        return make_mesh(batch, shard, devices)

    monkeypatch.setattr(gpt, "make_mesh", within)

# ---- gpt.py: the model layer

TINY = dict(n_layers=2, n_embd=32, n_head=4, block_size=32)
# every family option at once: grouped kv heads, q/k norm, SwiGLU, RMSNorm, NeoX residual,
# separate unembedding, rotary on a quarter of each head, Gemma's norms and scales, Llama 3
# rope scaling, and a window of 3 tokens on the first of each two layers (sequences of the
# decoding buffer, 13 tokens, are longer), that layer with its own rotary base
EVERYTHING = dict(rope=True, n_kv_head=2, qk_norm=True, mlp="swiglu", norm="rmsnorm",
                  parallel_residual=True, tie_embeddings=False, rotary_fraction=0.25,
                  norm_offset=1.0, sandwich_norm=True, embed_scale=True, attn_scale=0.3, logit_softcap=5.0,
                  rope_scaling=("llama3", 8.0, 1.0, 4.0, 8), sliding_window=3, window_pattern="SG",
                  local_rope_theta=100.0)
# the later families' options at once: a mixture of 4 experts (top 2 renormalised, and a
# shared one), q/k norms over all heads, norms after the sublayers only, soft-capped
# attention scores with a window of 3 on every other layer, Granite's multipliers, and
# longrope on 3/4 of each head (an original context of 16: the decoding buffer is 13)
MIXTURE = dict(rope=True, n_kv_head=2, mlp="swiglu", norm="rmsnorm", bias=False, n_experts=4, n_experts_per_token=2,
               norm_topk_prob=True, shared_expert_hidden=24, qk_norm=True, qk_norm_full=True, pre_norm=False,
               sandwich_norm=True, attn_softcap=2.0, sliding_window=3, window_pattern="SG", embed_multiplier=3.0,
               residual_multiplier=0.5, logits_scaling=2.0, rotary_fraction=0.75,
               rope_scaling=("longrope", 16, 1.2, 1.0, 2.0, 5.0))
# what a checkpoint's config adds to the families that have windows
WINDOWS = {"mistral": dict(sliding_window=4), "gemma3_text": dict(sliding_window=3, window_pattern="SG",
                                                                  local_rope_theta=100.0, attn_scale=0.3)}
# (the later families' rows are run against transformers; their options are MIXTURE's at once)
LATER_ROWS = ("gemma2", "phi3", "olmo2", "granite", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
CONFIGS = {**{name: {**family, "n_kv_head": 2, **WINDOWS.get(name, {})} for name, family in gpt.FAMILIES.items()
              if name not in LATER_ROWS}, "everything": EVERYTHING, "mixture": MIXTURE}


def tiny(**overrides) -> gpt.GPT:
    return gpt.GPT(**{**TINY, **overrides})


def init(model: gpt.GPT, seed: int = 0):
    """Random host parameters, all of them nonzero (biases too, so bias bugs show) and larger
    than the usual 0.02 so attention is far from uniform. numpy: compiling init is slow."""
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        is_scale = jax.tree_util.keystr(path).endswith("['scale']")
        return (is_scale + 0.1 * rng.standard_normal(leaf.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(fill, nn.meta.unbox(gpt.abstract_params(model)))


@functools.lru_cache(maxsize=None)
def forward(model: gpt.GPT):
    """The jitted forward pass (idx, mask) -> logits; eager flax is slow on CPU."""
    return jax.jit(lambda v, idx, mask: model.apply(v, idx, padding_mask=mask, deterministic=True)[0])


def logits_of(model, variables, idx, mask=None) -> np.ndarray:
    mask = np.ones(idx.shape, bool) if mask is None else mask  # one compile per shape, not two
    return np.asarray(forward(model)(variables, idx, mask))


def tokens(shape, seed=0, vocab=320) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def left_pad(rows, seed=1):
    """Ragged rows -> (idx [B, T], mask [B, T]); padding holds junk tokens, not zeros."""
    width = max(len(r) for r in rows)
    idx = tokens((len(rows), width), seed)
    mask = np.zeros((len(rows), width), bool)
    for b, row in enumerate(rows):
        idx[b, width - len(row):], mask[b, width - len(row):] = row, True
    return idx, mask


PROMPT_LENGTHS, STEPS = (5, 1, 3, 7), 6
BUFFER = (len(PROMPT_LENGTHS), max(PROMPT_LENGTHS) + STEPS)  # prompts + new tokens


def ragged_prompts(seed=2):
    return [tokens((n,), seed + n) for n in PROMPT_LENGTHS]


def greedy_recompute(model, variables, idx, mask, steps):
    """Greedy decoding with no cache: rerun the whole sequence for each new token.
    Returns (new tokens [B, steps], top1 - top2 logit gaps [B, steps]).
    One fixed-width buffer keeps it to one compile; by causality the slots after the
    current token (junk, masked) cannot change its logits."""
    B, P = idx.shape
    idx = np.concatenate([idx, tokens((B, steps), seed=9)], 1)
    mask = np.concatenate([mask, np.zeros((B, steps), bool)], 1)
    gaps = []
    for t in range(P, P + steps):
        last_BV = logits_of(model, variables, idx, mask)[:, t - 1]
        top2 = np.sort(last_BV, -1)[:, -2:]
        gaps.append(top2[:, 1] - top2[:, 0])
        idx[:, t], mask[:, t] = last_BV.argmax(-1), True
    return idx[:, P:], np.stack(gaps, 1)


def assert_cache_matches_recompute(model, variables):
    idx, mask = left_pad(ragged_prompts())
    expected, gaps = greedy_recompute(model, variables, idx, mask, STEPS)
    got = jax.jit(lambda v, x, m: gpt.generate(model, v, x, m, STEPS))(variables, idx, mask)
    # a near-tied argmax may fall either way (float rounding differs); each row is compared
    # up to its first near-tie
    trusted = np.cumprod(gaps > 1e-3, axis=1).astype(bool)
    assert trusted.mean() >= 0.75, "too many near-ties for the comparison to mean much"
    np.testing.assert_array_equal(np.asarray(got)[trusted], expected[trusted])


def assert_causal_by_edits(model, variables):
    """Changing the tokens after t leaves logits up to t unchanged (and changes later ones)."""
    idx = tokens(BUFFER)  # the decoding buffer's shape: no extra compile
    t = 5
    edited = idx.copy()
    edited[:, t + 1:] = (edited[:, t + 1:] + 1) % 320
    before, after = logits_of(model, variables, idx), logits_of(model, variables, edited)
    np.testing.assert_array_equal(before[:, :t + 1], after[:, :t + 1])
    assert np.abs(before[:, t + 1:] - after[:, t + 1:]).max() > 1e-4


def test_shapes_and_loss_match_numpy_cross_entropy():
    model = tiny()
    variables = init(model)
    idx, targets = tokens((3, 10)), tokens((3, 10), seed=1)
    targets[0, :4] = targets[2, 7:] = -1  # ignored positions
    apply = jax.jit(lambda v, x, y: model.apply(v, x, y, deterministic=True))
    logits, loss = apply(variables, idx, targets)
    assert logits.shape == (3, 10, model.vocab_size) and logits.dtype == jnp.float32
    assert loss.shape == () and jax.eval_shape(lambda v: model.apply(v, idx)[1], variables) is None
    z = np.asarray(logits, np.float64)
    log_probs = z - z.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    keep = targets != -1
    nll = -np.take_along_axis(log_probs, np.where(keep, targets, 0)[..., None], -1)[..., 0]
    np.testing.assert_allclose(float(loss), nll[keep].mean(), rtol=1e-5)
    all_ignored = apply(variables, idx, np.full_like(targets, -1))[1]
    assert float(all_ignored) == 0.0  # no division by zero


@pytest.mark.parametrize("rope", [False, True])
def test_causal_gradients(rope):
    """d loss[t] / d embedding[s] is exactly zero for s > t, and nonzero for s <= t."""
    model = tiny(rope=rope)
    bound = model.bind(init(model))
    idx, targets = tokens((2, 8)), tokens((2, 8), seed=1)
    x_BTD = bound.embed(idx, deterministic=True)

    def nll_BT(x):
        return gpt.token_nll(bound.unembed(bound.decode(x, deterministic=True)), targets)

    jac = np.abs(np.asarray(jax.jit(jax.jacrev(nll_BT))(x_BTD))).sum(-1)  # [B, T, B, S]
    later = np.triu(np.ones((8, 8), bool), k=1)  # s > t
    for b in range(2):
        assert np.all(jac[b, :, b][later] == 0.0)
        assert np.all(jac[b, :, b][~later] > 0.0)
        assert np.all(jac[b, :, 1 - b] == 0.0)  # rows never mix


@pytest.mark.parametrize("name", list(CONFIGS))
def test_family_options_run_and_are_causal(name):
    """(generation with these options: test_kv_cache_greedy_equals_recompute)"""
    model = tiny(**CONFIGS[name])
    variables = init(model)
    assert model.n_kv_head < model.n_head
    logits = logits_of(model, variables, tokens(BUFFER))
    assert logits.shape == (*BUFFER, model.vocab_size) and np.all(np.isfinite(logits))
    assert_causal_by_edits(model, variables)


@pytest.mark.parametrize("rope", [False, True])
def test_left_padding_changes_nothing(rope):
    model = tiny(rope=rope)
    variables = init(model)
    rows = ragged_prompts()
    idx, mask = left_pad(rows)
    padded = logits_of(model, variables, idx, mask)
    for b, row in enumerate(rows):
        alone = logits_of(model, variables, row[None])[0]
        assert np.abs(padded[b, -len(row):] - alone).max() <= 1e-5


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kv_cache_greedy_equals_recompute(name):
    """gpt2 covers learned positions, the others rotary; all with grouped kv heads."""
    model = tiny(**CONFIGS[name])
    assert_cache_matches_recompute(model, init(model))


@pytest.mark.parametrize("name", ["gpt2", "everything"])
@pytest.mark.parametrize("prefill", ["over the cache", "fresh", "fresh, query blocks of 2"])
def test_extend_logits_equal_full_forward(name, prefill):
    """Prefill a ragged batch, then feed tokens one at a time: each step's logits (those of
    its last token) equal the full forward pass over the whole left-padded sequence. The
    prefill attends over all the cache's slots, or (fresh, as start_rollout asks) among the
    prompts' own tokens, whole or in query blocks (with EVERYTHING's sliding window)."""
    model = tiny(**CONFIGS[name], query_block=2 if prefill.endswith("of 2") else 256)
    variables = init(model)
    idx, mask = left_pad(ragged_prompts())
    extra = tokens((len(idx), STEPS), seed=3)
    full = logits_of(model, variables, np.concatenate([idx, extra], 1),
                     np.concatenate([mask, np.ones_like(extra, bool)], 1))
    extend = jax.jit(lambda v, x, m, c, fresh=False: model.apply(v, x, m, c, fresh, method=gpt.GPT.extend),
                     static_argnums=4)
    cache = model.init_cache(len(idx), idx.shape[1] + extra.shape[1])
    step_logits, cache = extend(variables, idx, mask, cache, prefill != "over the cache")
    got = [np.asarray(step_logits)]
    for t in range(extra.shape[1]):
        step_logits, cache = extend(variables, extra[:, t:t + 1], np.ones((len(idx), 1), bool), cache)
        got.append(np.asarray(step_logits))
    assert np.abs(np.stack(got, 1) - full[:, idx.shape[1] - 1:]).max() <= 1e-5


@pytest.mark.parametrize("name", ["llama", "everything but its window"])
def test_extend_after_a_shared_prefix_equals_full_forward(name):
    """A cache whose shared prefix is held once (init_cache's prefix, as start_rollout
    makes it for few-shot examples) gives, for the ragged prompts after it and the tokens
    fed one at a time, the logits of the full forward pass over prefix + left-padded
    prompt: the prefix seen by every row's prefill and every decoding step (soft-caps,
    scale and q/k norm too)."""
    model = tiny(**(CONFIGS["llama"] if name == "llama" else {**EVERYTHING, "sliding_window": None}))
    variables = init(model)
    idx, mask = left_pad(ragged_prompts())
    shared, extra = tokens((1, 5), seed=4), tokens((len(idx), STEPS), seed=3)
    whole = np.concatenate([np.repeat(shared, len(idx), 0), idx, extra], 1)
    full = logits_of(model, variables, whole, np.concatenate([np.ones_like(shared, bool).repeat(len(idx), 0), mask,
                                                             np.ones_like(extra, bool)], 1))
    extend = jax.jit(lambda v, x, m, c, fresh=False: model.apply(v, x, m, c, fresh, method=gpt.GPT.extend),
                     static_argnums=4)
    _, prefix = extend(variables, shared, np.ones_like(shared, bool), model.init_cache(1, 5), True)
    cache = model.init_cache(len(idx), idx.shape[1] + extra.shape[1], prefix)
    step_logits, cache = extend(variables, idx, mask, cache)
    got = [np.asarray(step_logits)]
    for t in range(extra.shape[1]):
        step_logits, cache = extend(variables, extra[:, t:t + 1], np.ones((len(idx), 1), bool), cache)
        got.append(np.asarray(step_logits))
    assert cache.keys[0].shape[2] == idx.shape[1] + extra.shape[1] and cache.prefix_keys[0].shape[1] == 5
    assert np.abs(np.stack(got, 1) - full[:, 5 + idx.shape[1] - 1:]).max() <= 1e-5


@pytest.mark.parametrize("name,per_row,mesh", [("llama", 1, (1, 1)), ("llama", 2, (2, 4)), ("everything", 1, (1, 1)),
                                               ("everything", 4, (1, 1))])
def test_a_refilled_row_decodes_as_its_prompt_alone(name, per_row, mesh):
    """fast.refill_rollout: a row given a new prompt in the middle of a rollout, its keys and
    values written into the ring of slots its old tokens held (its new tokens going on past
    the last slot round to the first), decodes the tokens its prompt gives alone
    (gpt.generate), and the other row goes on unchanged; with EVERYTHING's sliding window
    (counted across the wrap), soft-caps and q/k norm too; the cache's slots one to a row
    or per_row side by side (a TPU's, gpt.slots_per_row, read by dots), on one device or a mesh of 8."""
    model = tiny(**CONFIGS[name])
    if per_row > 1:  # as a TPU: the cache's rows read as they are by a step's dots
        model = model.clone(cache_lanes=per_row * model.head_width, step_attention="dots")
    mesh = mesh_of(*mesh)
    variables = gpt.place_params(model, mesh, init(model))
    idx, mask = left_pad(ragged_prompts()[:2])
    new_idx, new_mask = tokens((1, idx.shape[1]), seed=7), np.arange(idx.shape[1])[None] >= 2
    N = 20 - idx.shape[1]  # slots: 20, in rows of 1, 2 or 4
    alone = lambda x, m: np.asarray(jax.jit(lambda v: gpt.generate(model, v, x, m, N))(variables))
    with jax.set_mesh(mesh):
        rollout = fast.start_rollout(model, variables, idx, mask, N)
        assert rollout.cache.keys.shape[-1] == per_row * model.head_width
        rollout = fast.continue_rollout(model, variables, rollout, 3)
        rollout = fast.refill_rollout(model, variables, rollout, jnp.int32(0), new_idx, new_mask)
        rollout = fast.continue_rollout(model, variables, rollout, N)
    out = np.asarray(rollout.out_BN)
    np.testing.assert_array_equal(out[0], alone(new_idx, new_mask)[0])
    np.testing.assert_array_equal(out[1], alone(idx, mask)[1])
    assert int(rollout.step) == 3 + N and int(rollout.cache.slot) == (idx.shape[1] + 3 + N) % (idx.shape[1] + N)


def test_sliding_window_matters_only_beyond_it():
    """The window changes nothing in the first W positions and every position after them
    (that the three attention paths apply it alike: the KV-cache tests above and
    test_fused_causal_path_equals_left_padded_masked_path, all with EVERYTHING's window)."""
    model = tiny(**EVERYTHING)
    variables = init(model)
    idx = tokens(BUFFER)
    windowed = logits_of(model, variables, idx)
    W = model.sliding_window
    unwindowed = logits_of(model.clone(sliding_window=None), variables, idx)
    np.testing.assert_array_equal(unwindowed[:, :W], windowed[:, :W])
    assert np.abs(unwindowed[:, W:] - windowed[:, W:]).max(-1).min() > 1e-4


def test_fields_survive_a_native_config_json():
    """A native checkpoint's config.json gives rope_scaling back as a list: GPT makes it the
    tuple again (flax fields must hash)."""
    for fields in (EVERYTHING, MIXTURE):
        model = tiny(**fields)
        again = gpt.GPT(**json.loads(json.dumps(checkpoints.model_config(model))))
        assert again == model and hash(again) == hash(model) and isinstance(again.rope_scaling, tuple)


def test_native_configs_check_the_later_fields():
    """A native config.json's mixture, soft-cap, multipliers and longrope are checked up
    front, as the other fields are (test_bad_native_checkpoints_are_refused_before_anything_is_built)."""
    base = {**TINY, **MIXTURE, "rope_scaling": list(MIXTURE["rope_scaling"])}
    assert checkpoints.check_model_fields(base, "config.json") == tiny(**MIXTURE)
    bad = [("n_experts", 0, "n_experts must be at least 1"), ("n_experts_per_token", 5, "at most n_experts 4"),
           ("mlp", "gelu", "experts are gated MLPs"), ("attn_softcap", 0.0, "attn_softcap must be above 0"),
           ("logits_scaling", 0, "logits_scaling must be above 0"), ("pre_norm", 1, "'pre_norm' must be true or false"),
           ("rope_scaling", ["longrope", 16, 1.2, 1.0, 2.0], "longrope needs an original context, an attention "
                                                            "factor and 3 short factors")]
    for name, value, needle in bad:
        with pytest.raises(UsageError, match=re.escape(needle)):
            checkpoints.check_model_fields({**base, name: value}, "config.json")


@pytest.fixture(scope="module", params=[{}, EVERYTHING, MIXTURE], ids=["gpt2", "everything", "mixture"])
def sharded_case(request):
    """A model, host parameters, a batch, and the logits on a 1x1 mesh of one device."""
    model = tiny(**request.param)
    host = jax.device_get(init(model))
    idx = tokens((8, 16))
    return model, host, idx, run_on_mesh(model, host, idx, gpt.make_mesh(1, 1, jax.devices()[:1]))[0]


def run_on_mesh(model, host, idx, mesh):
    params = gpt.place_params(model, mesh, host)
    x = jax.device_put(idx, NamedSharding(mesh, PartitionSpec("batch")))
    logits = jax.jit(lambda p, x: model.apply(p, x, deterministic=True)[0])(params, x)
    return logits, params, x


@pytest.mark.parametrize("batch,shard", [(8, 1), (4, 2), (2, 4)])
def test_sharded_equals_single_device(sharded_case, batch, shard):
    model, host, idx, reference = sharded_case
    logits, params, x = run_on_mesh(model, host, idx, gpt.make_mesh(batch, shard))
    assert np.abs(np.asarray(logits) - np.asarray(reference)).max() <= 1e-5
    assert x.sharding.spec[0] == "batch" and logits.sharding.spec[0] == "batch"
    assert x.addressable_shards[0].data.shape == (8 // batch, 16)
    if shard > 1:
        assert_tensor_parallel(params["params"], shard, tied=model.tie_embeddings)


@pytest.mark.parametrize("name,batch,shard,block", [("everything", 1, 1, None), ("everything", 4, 2, None),
                                                     ("mixture", 4, 2, None), ("everything", 1, 1, 2),
                                                     ("everything", 4, 2, 2), ("mixture", 4, 2, 2)])
def test_fused_causal_path_equals_left_padded_masked_path(name, batch, shard, block, monkeypatch):
    """Scoring runs right-padded rows with no mask (attend_causal, plain causal);
    generation and the parity tests run left-padded rows with a mask (attend): both give the
    logits of the reference attention (GPT(attention="reference"), attend_reference) at every
    real token, on one device and tensor-parallel. With a query block of 2 both take the
    blocked path (each block only the keys up to its last query, and past the window of 3;
    on the 4x2 mesh a row of each device's share at a time). Soft-capped scores (mixture)
    never take cuDNN's kernel, which cannot cap them. (A padding query's logits are junk
    either way and are not compared.)"""
    model = tiny(**CONFIGS[name], query_block=block or 256)
    mesh = gpt.make_mesh(batch, shard, devices=jax.devices()[:batch * shard])
    params = gpt.place_params(model, mesh, init(model))
    rows = ragged_prompts() + ragged_prompts(seed=9)
    left_idx, left_mask = left_pad(rows)
    right_idx = np.zeros_like(left_idx)
    for b, row in enumerate(rows):
        right_idx[b, :len(row)] = row
    put = lambda x: jax.device_put(x, gpt.input_sharding(model, mesh, ("batch", None)))
    if block is not None:
        assert right_idx.shape[1] > 2 * block and len(rows) > batch  # several blocks, and steps over rows
    if CONFIGS[name].get("attn_softcap") is not None:  # cuDNN's kernel asked for, never taken
        model = model.clone(attention="cudnn")
        monkeypatch.setattr(jax.nn, "dot_product_attention", None)  # calling it would fail
    with jax.set_mesh(mesh):
        reference, masked = (np.asarray(forward(m)(params, put(left_idx), put(left_mask)))
                             for m in (model.clone(attention="reference"), model))
        fused = np.asarray(jax.jit(lambda p, x: model.apply(p, x, deterministic=True)[0])(params, put(right_idx)))
    assert np.abs(masked - reference)[left_mask].max() <= 1e-5
    for b, row in enumerate(rows):
        assert np.abs(reference[b, -len(row):] - fused[b, :len(row)]).max() <= 1e-5


@pytest.mark.parametrize("name,extra", [("llama", {}), ("mistral", {}), ("llama", dict(attn_softcap=2.0))])
@pytest.mark.parametrize("batch,shard", [(1, 1), (4, 2)])
def test_splash_attention_equals_the_reference_attention(name, extra, batch, shard):
    """JAX's Pallas splash kernel (a TPU's choice in half precision; interpreted here) gives
    the reference attention's logits for unmasked rows of 128 and 256 tokens (its blocks of
    128 and 256): grouped heads, a window on every layer (mistral), soft-capped scores; on
    one device and on a 4x2 mesh (each device its own rows and key heads, jax.shard_map);
    and the reference's gradients (mistral's, on one device)."""
    model = tiny(**CONFIGS[name], **extra, block_size=256)
    mesh = gpt.make_mesh(batch, shard, devices=jax.devices()[:batch * shard])
    params = gpt.place_params(model, mesh, init(model))
    put = lambda x: jax.device_put(x, gpt.input_sharding(model, mesh, ("batch", None)))
    splash, reference = model.clone(attention="splash"), model.clone(attention="reference")
    assert gpt.causal_kernel("splash", jnp.float32, 128, False, 2.0) == "splash"
    for length in (128, 256):
        idx = put(np.random.default_rng(length).integers(0, 320, (4, length)))
        with jax.set_mesh(mesh):
            got, want = (np.asarray(jax.jit(lambda p, x: m.apply(p, x, deterministic=True)[0])(params, idx))
                         for m in (splash, reference))
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    if (batch, shard) == (1, 1) and name == "mistral":
        loss = lambda m: jax.jit(jax.grad(lambda p: m.apply(p, idx, deterministic=True)[0].std()))(params)
        for got, want in zip(*(jax.tree.leaves(loss(m)) for m in (splash, reference))):
            assert np.abs(got - want).max() <= 1e-5 * max(np.abs(want).max(), 1e-6)


def test_each_backend_names_a_known_way_and_falls_back_where_it_cannot(monkeypatch):
    """gpt.BACKEND_ATTENTION: every row names a known way for each choice; "fast" takes the
    backend's (a TPU: splash in bfloat16, XLA's in float32); a fused kernel falls back to
    XLA's under a mask, cuDNN's with a soft-cap, splash's where T is no multiple of 128."""
    known = dict(half=gpt.ATTENTIONS[2:], full=gpt.ATTENTIONS[2:], step=gpt.STEP_ATTENTIONS[1:],
                 rows=("all", "device"), lanes=(0, 128), tile=(False, True))
    for row in [*gpt.BACKEND_ATTENTION.values(), gpt.OTHER_BACKEND]:
        assert row.keys() == known.keys() and all(row[k] in known[k] for k in row), row
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    kernel = lambda choice, dtype=jnp.bfloat16, T=256, masked=False, softcap=None: gpt.causal_kernel(
        choice, dtype, T, masked, softcap)
    assert (kernel("fast"), kernel("fast", jnp.float32), gpt.backend_choice("step")) == ("splash", "xla", "dots")
    assert kernel("fast", masked=True) == kernel("splash", T=200) == kernel("cudnn", softcap=2.0) == "xla"
    assert kernel("splash", T=384, softcap=2.0) == "splash" and kernel("xla") == kernel("reference") == "xla"
    # a TPU's cache rows: as many slots as fill 128 lanes, where they divide both evenly
    per_row = lambda width, slots, lanes=gpt.backend_choice("lanes"): gpt.slots_per_row(lanes, width, slots)
    assert [per_row(64, 256), per_row(32, 256), per_row(128, 256), per_row(64, 255), per_row(48, 256)] == \
        [2, 4, 1, 1, 1]
    assert per_row(64, 256, lanes=0) == 1 and tiny().clone(cache_lanes=0).init_cache(1, 16).keys.shape[-2:] == (16, 8)
    assert tiny().init_cache(1, 16).keys.shape[-2:] == (1, 128) and tiny().init_cache(1, 8).keys.shape[-2:] == (8, 8)


def test_fused_attention_falls_back_where_cudnn_is_absent(monkeypatch):
    """On a GPU in bfloat16 attend_causal asks for cuDNN; without it (here: a CPU that says
    it is a GPU) the same call runs XLA's attention instead of failing."""
    q, k, v = (jnp.asarray(np.random.default_rng(i).normal(size=(2, 8, 4, 16)), jnp.bfloat16) for i in range(3))
    expected = np.asarray(gpt.attend_causal(q, k[:, :, :2], v[:, :, :2]), np.float32)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    got = np.asarray(jax.jit(gpt.attend_causal)(q, k[:, :, :2], v[:, :, :2]), np.float32)
    np.testing.assert_array_equal(got, expected)


def assert_tensor_parallel(params, shard, tied):
    """Megatron layout: q/k/v, MLP-up and the vocabulary split their outputs, attention-out
    and MLP-down their inputs; each device holds 1/shard of the split dimension. A
    mixture's experts are split whole over the devices (expert parallel), [X/shard, ...]."""
    out, into = PartitionSpec(None, "shard"), PartitionSpec("shard", None)
    layer_out, layer_into = PartitionSpec(None, None, "shard"), PartitionSpec(None, "shard", None)  # [L, in, out]
    mlp = {"blocks/mlp/up/kernel": layer_out, "blocks/mlp/down/kernel": layer_into}
    if "router" in params["blocks"]["mlp"]:
        experts = PartitionSpec(None, "shard", None, None)
        mlp = {"blocks/mlp/gate": experts, "blocks/mlp/up": experts, "blocks/mlp/down": experts,
               "blocks/mlp/shared/up/kernel": layer_out, "blocks/mlp/shared/down/kernel": layer_into}
    expected = {"blocks/attn/q/kernel": layer_out, "blocks/attn/k/kernel": layer_out,
                "blocks/attn/v/kernel": layer_out, "blocks/attn/o/kernel": layer_into,
                "wte/embedding": into, **mlp, **({} if tied else {"lm_head/kernel": out})}
    for path, spec in expected.items():
        array = functools.reduce(lambda tree, key: tree[key], path.split("/"), params)
        assert array.sharding.spec == spec, path
        split = spec.index("shard")
        assert array.addressable_shards[0].data.shape[split] * shard == array.shape[split], path


def test_float32_models_multiply_at_full_precision():
    """Every matmul of a float32 model, scoring and decoding, asks for the highest precision
    (jax's default on a GPU is TF32); a bfloat16 model's keep jax's default."""
    idx = jnp.zeros((1, 8), jnp.int32)
    for dtype, expected in (("float32", "HIGHEST"), ("bfloat16", "DEFAULT")):
        model = gpt.GPT(**gpt.FAMILIES["llama"], n_layers=1, n_embd=32, n_head=2, n_kv_head=1, vocab_size=64,
                        block_size=16, param_dtype=dtype, activation_dtype=dtype)
        v = init(model)
        score = jax.jit(lambda v, x: model.apply(v, x)[0]).lower(v, idx).as_text()
        step = jax.jit(lambda v, x: model.apply(v, x, jnp.ones((1, 8), bool), model.init_cache(1, 9),
                                                 method=gpt.GPT.extend)[0]).lower(v, idx).as_text()
        for text in (score, step):
            precisions = re.findall(r"dot_general.*?precision = \[(\w+), (\w+)\]", text)
            assert len(precisions) >= 8 and {p for pair in precisions for p in pair} == {expected}, precisions


def test_init_params_same_values_on_every_mesh():
    """A seed means one model: initializing straight into shardings does not depend on the mesh."""
    model = tiny(rope=True, n_layers=1)
    one = jax.device_get(gpt.init_params(model, gpt.make_mesh(1, 1, jax.devices()[:1]), seed=3))
    eight = jax.device_get(gpt.init_params(model, gpt.make_mesh(2, 4), seed=3))
    jax.tree.map(np.testing.assert_array_equal, one, eight)
    block = one["params"]["blocks"]
    assert np.all(block["ln_1"]["scale"] == 1) and np.std(block["mlp"]["up"]["kernel"]) > 0.01


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("size", [dict(n_layers=1, n_embd=32, n_head=4),
                                  dict(n_layers=2, n_embd=64, n_head=4, n_kv_head=2, mlp="swiglu",
                                       tie_embeddings=False),
                                  dict(n_layers=1, n_embd=32, n_head=4, mlp="swiglu", bias=False, n_experts=4,
                                       n_experts_per_token=4, mlp_hidden=64)],
                         ids=["1x32", "2x64_gqa_swiglu_untied", "1x32_4_experts_all_active"])
def test_flops_match_xla_cost_analysis(size, rope):
    """flops() counts matmuls, fwd + bwd = 3x fwd; XLA also counts elementwise work,
    so the two agree to ~5% at these tiny widths. (A mixture with every expert active:
    dense dispatch computes exactly the active ones; see test_flops_count_active_experts.)
    XLA counts a loop's body once, so the program counted is the loop over the layers
    (layer_by_layer), which the scan equals; with one layer, the scanned forward itself."""
    seq = 32
    model = gpt.GPT(block_size=seq, rope=rope, **size)
    idx = jnp.zeros((1, seq), jnp.int32)
    variables = gpt.abstract_params(model, seq)  # shapes only, boxed as init() gives them
    forward = jax.jit(lambda v, x: model.apply(v, x, deterministic=True)[0])
    if model.n_layers > 1:
        forward = jax.jit(lambda v, x: layer_by_layer(model, v, x, jnp.ones(x.shape, bool), jit=lambda f: f)[0])
    cost = forward.lower(variables, idx).compile().cost_analysis()
    xla_flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
    assert model.bind(variables).flops(seq) == pytest.approx(3 * xla_flops, rel=0.10)


def test_flops_count_active_experts():
    """A mixture's flops() counts the router and the k active experts per token (dense
    dispatch computes all X: XLA's count does not depend on k), the shared expert too."""
    seq, D, F, X = 32, 32, 64, 4
    moe = lambda k, **extra: gpt.GPT(n_layers=1, n_embd=D, n_head=4, mlp="swiglu", bias=False, n_experts=X,
                                     n_experts_per_token=k, mlp_hidden=F, block_size=seq, **extra)
    flops = lambda m: m.bind(gpt.abstract_params(m, seq)).flops(seq)
    dense = gpt.GPT(n_layers=1, n_embd=D, n_head=4, mlp="swiglu", bias=False, mlp_hidden=F, block_size=seq)
    expert, router = 3 * 2 * seq * 3 * D * F, 3 * 2 * seq * D * X  # gate, up, down; D -> X logits
    for k in (1, 2, 4):
        assert flops(moe(k)) == flops(dense) + (k - 1) * expert + router
    shared = 3 * 2 * seq * (3 * D * 24 + D)  # an MLP of 24 and its gate D -> 1
    assert flops(moe(2, shared_expert_hidden=24)) == flops(moe(2)) + shared
    idx = jnp.zeros((1, seq), jnp.int32)
    xla = lambda m: jax.jit(lambda v, x: m.apply(v, x, deterministic=True)[0]).lower(
        gpt.abstract_params(m, seq), idx).compile().cost_analysis()
    first = lambda cost: (cost[0] if isinstance(cost, list) else cost)["flops"]
    assert first(xla(moe(1))) == pytest.approx(first(xla(moe(4))), rel=0.01)  # top_k's own work differs


def test_expert_weights_ties_and_normalisation():
    """Exactly k experts per token, the lower index first among equal probabilities, the
    weights the top-k probabilities (renormalised to sum 1 with norm_topk_prob)."""
    logits = jnp.asarray([[[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.0, 2.0, 0.0]]])
    probs = np.asarray(jax.nn.softmax(logits, -1))[0]
    plain, renormed = (np.asarray(gpt.expert_weights(logits, 2, norm))[0] for norm in (False, True))
    assert np.all((plain > 0).sum(-1) == 2)
    np.testing.assert_array_equal(plain > 0, [[0, 1, 1, 0], [1, 1, 0, 0], [1, 0, 1, 0]])
    np.testing.assert_allclose(plain, np.where(plain > 0, probs, 0), rtol=1e-6)
    np.testing.assert_allclose(renormed.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(renormed[2, [0, 2]], probs[2, [0, 2]] / probs[2, [0, 2]].sum(), rtol=1e-6)


def layer_by_layer(model, variables, idx, mask, cache=None, fresh=False, jit=jax.jit):
    """GPT's forward pass (extend's, with a cache) with a Python loop over the layers, each an
    unscanned Block applied to its own slice of the stacked parameters, where GPT.decode
    scans: (logits [B, T, V], each layer's hidden states [L, B, T, D], the cache or None).
    Each part is a program of its own (jit), as each layer is the scan's body: one program
    of them all would let XLA fuse across layers and round differently (fused multiply-adds).
    At the precision GPT's methods take (gpt.float32_in_full: a float32 model's is full)."""
    full = jnp.dtype(model.adtype) == jnp.float32
    with jax.default_matmul_precision("highest" if full else None):
        return loop_over_layers(model, variables, idx, mask, cache, fresh, jit)


def loop_over_layers(model, variables, idx, mask, cache, fresh, jit):
    def start(m, idx, mask, cache):
        B, T = idx.shape
        count = 0 if cache is None else cache.prefix_length + cache.valid_BS.sum(-1)[:, None]
        pos = jnp.maximum(count + jnp.cumsum(mask, -1) - 1, 0)
        valid, query, key, slot, valid_all = mask, jnp.arange(T), jnp.arange(T), None, None
        if cache is not None:
            slot, valid_all = cache.slot, jax.lax.dynamic_update_slice(cache.valid_BS, mask, (0, cache.slot))
            if not fresh:
                valid, query, key = valid_all, slot + jnp.arange(T), jnp.arange(cache.valid_BS.shape[1])
        allowed, local = m.masks(pos, None, True, valid, query, key)
        return m.embed(idx, True, positions=pos), gpt.Context(allowed, local, m.rotary_tables(pos), mask, slot), \
            m.layer_inputs(cache), valid_all

    block = gpt.Block(**model.block_fields())
    run_block = jit(lambda p, x, layer, context: block.apply({"params": p}, x, layer, context, True, fresh))
    x, context, layers, valid_all = jit(lambda v, i, k, c: model.apply(v, i, k, c, method=start))(
        variables, idx, mask, cache)
    hidden, new_kv = [], []
    stacked = nn.meta.unbox(variables["params"]["blocks"])
    for depth in range(model.n_layers):
        mine = lambda tree: jax.tree.map(lambda a: a[depth], tree)
        x, (_, kv) = run_block(mine(stacked), x, mine(layers), context)
        hidden.append(x)
        new_kv.append(kv)
    new = None
    if cache is not None:  # every layer's new keys and values written after the layers, as GPT.decode does
        write = jit(lambda c, n: jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (0, 0, 0, cache.slot, 0)))
        keys, values = (write(c, jnp.stack(n)) for c, n in zip((cache.keys, cache.values), zip(*new_kv)))
        new = cache._replace(keys=keys, values=values, valid_BS=valid_all,
                             slot=(cache.slot + idx.shape[1]) % valid_all.shape[1])
    logits = jit(lambda v, x: model.apply(v, x, method=lambda m, x: m.unembed(m.ln_f(x))))(variables, x)
    return logits, jnp.stack(hidden), new


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_scanned_layers_equal_a_loop_over_them_to_the_last_bit(name):
    """GPT.decode scans one Block over the stacked layers; a Python loop applying the Block to
    each layer's parameters in turn gives the same float32 logits, bit for bit on a CPU (an
    accelerator's compiler may fuse a loop's layers otherwise: within 1e-5 there): scoring
    (left-padded, masked), a prefill into an empty cache and a decoding step after it."""
    same = (np.testing.assert_array_equal if jax.default_backend() == "cpu" else
            functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5))
    model = tiny(**CONFIGS[name])
    variables = init(model)
    idx, mask = left_pad(ragged_prompts())
    both = lambda m, i, k, c: (m(i, padding_mask=k, deterministic=True)[0], *m.extend(i, k, c, True))
    logits = jax.jit(lambda v, i, k, c: model.apply(v, i, k, c, method=both))(
        variables, idx, mask, model.init_cache(len(idx), idx.shape[1] + 1))
    expected, _, cache = layer_by_layer(model, variables, idx, mask, model.init_cache(len(idx), idx.shape[1] + 1),
                                        fresh=True)
    same(np.asarray(logits[0]), np.asarray(expected))
    same(np.asarray(logits[1]), np.asarray(expected[:, -1]))
    jax.tree.map(same, logits[2], cache)
    step = tokens((len(idx), 1), seed=5)
    scanned, scanned_cache = jax.jit(lambda v, i, c: model.apply(v, i, jnp.ones(i.shape, bool), c,
                                                                 method=gpt.GPT.extend))(variables, step, cache)
    looped, _, looped_cache = layer_by_layer(model, variables, step, np.ones(step.shape, bool), cache)
    same(np.asarray(scanned), np.asarray(looped[:, -1]))
    jax.tree.map(same, scanned_cache, looped_cache)


def test_measure_records_one_value_per_layer_only_when_asked(monkeypatch):
    model = tiny()
    variables = init(model)
    idx = tokens((2, 8))
    measured = jax.jit(lambda v, x: model.apply(v, x, deterministic=True, mutable=["intermediates"]))
    (logits, _), state = measured(variables, idx)
    values = np.asarray(state["intermediates"]["residual_update"], np.float32)
    assert values.shape == (model.n_layers,) and np.all(np.isfinite(values)) and np.all(values > 0)
    _, hidden, _ = layer_by_layer(model, variables, idx, np.ones(idx.shape, bool))  # each block's update, by hand
    x = [np.asarray(model.apply(variables, idx, True, method=gpt.GPT.embed)), *np.asarray(hidden)]
    by_hand = [(np.linalg.norm(y - r, axis=-1) / np.linalg.norm(r, axis=-1)).mean() for r, y in zip(x, x[1:])]
    np.testing.assert_allclose(values, by_hand, rtol=1e-5)
    # without mutable: same logits, and not a single extra operation is traced
    np.testing.assert_allclose(logits_of(model, variables, idx), np.asarray(logits), rtol=0, atol=1e-6)

    def trace():  # a fresh function each time: jax caches traces by function
        return str(jax.make_jaxpr(lambda v, x: model.apply(v, x, deterministic=True))(variables, idx))

    traced = trace()
    monkeypatch.setattr(gpt.GPT, "measure", lambda self, *args: None)
    assert trace() == traced


def test_gather_lists_every_part_once():
    parts = gpt.GPT.gather()
    assert parts[0] is gpt.GPT and len(parts) == len(set(parts))
    assert set(parts) == {gpt.GPT, gpt.Block, gpt.Attention, gpt.MLP, gpt.MoE, gpt.Norm, gpt.Linear}
    # and components() is honest: every part real models build is in the list
    built, todo = set(), [tiny(**fields).bind(init(tiny(**fields))) for fields in (EVERYTHING, MIXTURE)]
    while todo:
        module = todo.pop()
        built.add(next(t for t in type(module).__mro__ if t in parts))  # the scanned Block's class is flax's subclass
        todo.extend(module.children_modules())
    assert built == set(parts)


def test_rotary_fraction_leaves_the_rest_of_each_head_alone():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 5, 2, 16)), jnp.float32)
    out = gpt.rotary(x, *gpt.rotary_angles(jnp.arange(5)[None], gpt.rope_frequencies(4, 10000.0)))  # 4 of 16
    np.testing.assert_array_equal(np.asarray(out[..., 4:]), np.asarray(x[..., 4:]))
    assert np.abs(np.asarray(out[:, 1:, :, :4] - x[:, 1:, :, :4])).max() > 1e-3
    np.testing.assert_allclose(np.asarray(out[:, 0]), np.asarray(x[:, 0]))  # position 0: identity


def test_bad_names_and_meshes_fail_clearly():
    with pytest.raises(ValueError, match="unknown dtype"):
        gpt.dtype_of("float64")
    for batch, shard in [(3, 2), (None, 3), (16, 1), (8, 0)]:
        with pytest.raises(ValueError, match="devices, but there are 8"):
            gpt.make_mesh(batch, shard)
    for text in ["3", "ax2", "0x8", "4x2x1", "4x", "-1x8"]:
        with pytest.raises(ValueError, match="BATCHxSHARD"):
            gpt.parse_mesh(text)
    assert gpt.parse_mesh("4x2") == (4, 2) and gpt.parse_mesh("1X8") == (1, 8)
    assert dict(gpt.make_mesh(shard=2).shape) == {"batch": 4, "shard": 2}


# ---- evaluate.py and jobs.py: the harness

SMALL = dict(n_layers=2, n_embd=64, n_head=4, block_size=64, vocab_size=320)  # 64: rolling windows


def mesh_of(batch=1, shard=1):
    return gpt.make_mesh(batch, shard, devices=jax.devices()[: batch * shard])


@pytest.fixture(scope="module")
def small():
    """A tiny GPT with non-trivial weights (scaled init so argmax is rarely tied)."""
    model = gpt.GPT(**SMALL)
    variables = gpt.init_params(model, mesh_of(), seed=3)
    variables = jax.tree.map(lambda x: x * 5.0, variables)
    return model, jax.device_get(variables)


def evaluator(small, evaluations, mesh=(1, 1), **options):
    model, host = small
    mesh = mesh_of(*mesh)
    variables = gpt.place_params(model, mesh, host)
    spec = jobs.ExecutionSpec(name="test", out_dir="/nonexistent")
    config = evaluate.EvaluatorConfig(quiet=True, **options)
    return evaluate.Evaluator.from_parts(spec, model, variables, jobs.ByteTokenizer(), mesh,
                                         evaluations, config)


DOCS = [{"text": "the cat sees the dog. " * k} for k in (1, 2, 7)] + [{"text": "x"}]  # 7x > 64 tokens
MC = [{"context": "the cats", "choices": [" see", " sees", " seen it"], "gold": 0},
      {"context": "2+2= ", "choices": ["4", "5"], "gold": 0},
      {"context": "", "choices": ["a", "b"], "gold": 1}]
GEN = [{"prompt": "12+3", "answer": "15"}, {"prompt": "the", "answer": "cat"},
       {"prompt": "a" * 100, "answer": "b"}]


def all_kinds():
    return [evaluate.PerplexityEvaluation("ppl", DOCS), evaluate.MultipleChoiceEvaluation("mc", MC),
            evaluate.RolloutEvaluation("gen", GEN, max_new_tokens=6),
            evaluate.AccuracyEvaluation("acc", DOCS)]


def test_find_accumulation_steps():
    f = evaluate.Evaluation.find_accumulation_steps
    assert f(64, 8, 2) == (8, 4)
    assert f(60, 8, 2) == (6, 5)
    assert f(7, 8, 2) == (None, None)
    assert f(12, 5, 4) == (3, 1)
    assert f(1, 8, 1) == (1, 1)


def test_rolling_windows_score_every_token_once():
    tokens = list(range(100, 250))
    for max_len in (16, 64, 150, 200):
        requests = inference.rolling_requests(tokens, 7, max_len)
        assert sum((cont for _, cont in requests), []) == tokens
        assert requests[0][0] == [7]
        full = [7] + tokens
        for context, cont in requests:  # each window is a contiguous slice of the document
            end = full.index(cont[-1]) + 1
            assert context + cont == full[end - len(context + cont):end]
            assert len(cont) <= max_len and len(context + cont) <= max_len + 1


def test_is_argmax_breaks_ties_like_argmax():
    # small integer logits tie often; every target of every row is checked
    logits_BV = jnp.asarray(np.random.default_rng(0).integers(0, 3, (64, 6)), jnp.float32)
    targets_BV = jnp.broadcast_to(jnp.arange(6), (64, 6))
    got = jax.vmap(inference.is_argmax, in_axes=(None, 1), out_axes=1)(logits_BV, targets_BV)
    assert (np.asarray(got) == (np.asarray(logits_BV).argmax(-1)[:, None] == np.arange(6))).all()


def test_encode_pair_moves_trailing_space_like_lm_eval():
    tok = jobs.ByteTokenizer()
    context, cont = evaluate.encode_pair(tok, "Q: 2+2= ", "4")
    assert context == list(b"Q: 2+2=") and cont == list(b" 4")


def direct_doc_nll(model, variables, tokens, prefix):
    """Sum of -log p(token) over a short document, straight from GPT.__call__."""
    logp = np.asarray(jax.nn.log_softmax(logits_of(model, variables, np.array([[prefix] + tokens[:-1]]))[0], -1))
    return -float(sum(logp[i, t] for i, t in enumerate(tokens)))


def test_perplexity_equals_direct_computation(small):
    model, host = small
    ev = evaluator(small, [])
    result = evaluate.PerplexityEvaluation("ppl", DOCS[:2]).result(ev, ev.tokenizer)
    for record, doc in zip(result.records, DOCS[:2]):
        tokens = list(doc["text"].encode())
        assert record["tokens"] == len(tokens)
        np.testing.assert_allclose(record["nll"], direct_doc_nll(model, host, tokens, 256), rtol=1e-5)
    nll = sum(r["nll"] for r in result.records)
    count = sum(r["tokens"] for r in result.records)
    np.testing.assert_allclose(result.value, np.exp(nll / count), rtol=1e-6)


def test_multiple_choice_loglik_equals_direct_computation(small):
    model, host = small
    ev = evaluator(small, [])
    result = evaluate.MultipleChoiceEvaluation("mc", MC).result(ev, ev.tokenizer)
    for record, sample in zip(result.records, MC):
        for choice, ll in zip(sample["choices"], record["loglik"]):
            ctx, cont = evaluate.encode_pair(ev.tokenizer, sample["context"], choice)
            ctx = ctx or [256]
            logp = np.asarray(jax.nn.log_softmax(logits_of(model, host, np.array([ctx + cont[:-1]]))[0], -1))
            direct = sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
            np.testing.assert_allclose(ll, direct, rtol=1e-5, atol=1e-5)
        assert record["pred"] == int(np.argmax(record["loglik"]))


class CountingTokenizer(jobs.ByteTokenizer):
    """The byte tokenizer, keeping the length of each text it encodes."""

    def __init__(self):
        self.encoded = []

    def encode(self, text, add_special_tokens=True):
        self.encoded.append(len(text))
        return super().encode(text, add_special_tokens)


def test_a_long_multiple_choice_context_is_encoded_once_and_carried_as_far_as_a_row_reads(small):
    """A context many times the model's length (a 5 MB one took 68-83 s and 2.4 GB, encoded
    twice for each choice and carried whole in each request): encoded once for all its
    choices, then with each choice (lm-eval's split needs the whole text's tokens), and each
    request carries its last max_len tokens, all a row reads: the same log-likelihoods."""
    ev = evaluator(small, [])
    sample = {"context": "the cat sees the dog. " * 20 + " ", "choices": [" yes", "no", " maybe so"], "gold": 0}
    tokenizer = CountingTokenizer()
    requests = list(evaluate.MultipleChoiceEvaluation("mc", [sample]).requests(ev, tokenizer, enumerate([sample])))
    context = len(sample["context"].rstrip())
    assert tokenizer.encoded == [context] + [len(sample["context"]) + len(c) for c in sample["choices"]]
    whole = [inference.Request(0, *evaluate.encode_pair(tokenizer, sample["context"], c)) for c in sample["choices"]]
    assert [r.context for r in requests] == [r.context[-ev.max_len:] for r in whole] and len(whole[0].context) > 400
    assert [r.continuation for r in requests] == [r.continuation for r in whole]
    assert [s for _, s in ev.loglikelihood(requests)] == [s for _, s in ev.loglikelihood(whole)]


def greedy_by_recompute(model, variables, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(logits_of(model, variables, np.array([ids]))[0, -1])))
    return ids[len(prompt):]


def test_rollout_equals_full_recompute_greedy(small):
    model, host = small
    ev = evaluator(small, [], batch_size=3)
    prompts = [list(b"12+3"), list(b"the cat"), list(b"a")]
    requests = [inference.GenerationRequest(i, p) for i, p in enumerate(prompts)]
    out = [(g.tokens, g.truncated) for _, g in ev.generate_until(requests, 6, 0.0, 1.0, 0)]
    for (new, truncated), prompt in zip(out, prompts):
        expected = greedy_by_recompute(model, host, prompt, 6)
        if 256 in expected:
            expected = expected[:expected.index(256)]
        assert new == expected and not truncated


@pytest.mark.parametrize("reduce", ["mean", "sum", "none"])
def test_reduce_modes(small, reduce):
    ev = evaluator(small, [])
    mc = evaluate.MultipleChoiceEvaluation("mc", MC)
    per_sample = mc(ev, ev.tokenizer, reduce="none")
    assert isinstance(per_sample, np.ndarray) and per_sample.shape == (len(MC),)
    out = mc(ev, ev.tokenizer, reduce=reduce)
    expected = {"mean": per_sample.mean(), "sum": per_sample.sum(), "none": per_sample}[reduce]
    np.testing.assert_allclose(out, expected)
    value, rows = mc(ev, ev.tokenizer, reduce=reduce, return_intermediates=True)
    assert len(rows) == len(MC)
    tokens, mask = rows[0]
    assert tokens.shape == mask.shape and tokens.shape[0] == len(MC[0]["choices"])


def scores_of(ev):
    return {e.name: e.result(ev, ev.tokenizer, max_new_tokens=6).scores for e in ev.evaluations}


def test_scores_do_not_depend_on_batch_size_or_mesh(small):
    reference = scores_of(evaluator(small, all_kinds(), batch_size=8))
    for batch, mesh in [(1, (1, 1)), (3, (1, 1)), (8, (8, 1)), (3, (4, 2))]:
        got = scores_of(evaluator(small, all_kinds(), mesh=mesh, batch_size=batch, chunks=2))
        for name in reference:
            if name in ("mc", "gen", "acc"):
                np.testing.assert_array_equal(got[name], reference[name], err_msg=f"{name} {batch} {mesh}")
            else:
                np.testing.assert_allclose(got[name], reference[name], rtol=1e-5)


@pytest.mark.parametrize("batch", [1, 4])
def test_a_short_last_batch_pads_its_rows_only_where_a_later_window_could_share_them(small, batch):
    """11 requests at 8 rows a batch: 8, then 3 rows, padded to 4 (a shape the short batch
    of a later window may share) but not in the last window, where only the mesh's "batch"
    size rounds them up; with an accelerator's lengths (lengths_per_octave 1, the fewest
    programs) to 8 in every window: the full batch's program."""
    model, host = small
    mesh = gpt.make_mesh(batch, 1, devices=jax.devices()[:batch])
    for per_octave, rows_then, last_rows in ((8, 4, 4 if batch == 4 else 3), (1, 8, 8)):
        job = inference.InferenceJob(model, gpt.place_params(model, mesh, host), jobs.ByteTokenizer(), mesh,
                                     batch_size=8, quiet=True, lengths_per_octave=per_octave)
        sizes = [(n,) for n in range(40, 29, -1)]
        rows = lambda last: [rows for _, _, rows, _ in job.schedule(sizes, 64, 1, last)]
        assert rows(False) == [8, rows_then] and rows(True) == [8, last_rows]


def test_ragged_documents_waste_little_on_padding(monkeypatch):
    """Documents of mixed lengths go into blocks of similar lengths (a CPU's, on any platform):
    at most 15% of the scored slots are padding, and there are a handful of block shapes (so
    of compilations: in a set this small, a batch alone in its shape takes the one before it,
    at most a quarter longer)."""
    monkeypatch.setitem(inference.SHAPES, jax.devices()[0].platform, inference.SHAPES["cpu"])
    model = gpt.GPT(n_layers=1, n_embd=32, n_head=2, block_size=512, vocab_size=320)
    host = jax.device_get(gpt.init_params(model, mesh_of(), seed=0))
    rng = np.random.default_rng(0)
    docs = [{"text": "".join(rng.choice(list("abcdefgh "), n))} for n in rng.integers(128, 512, 64)]
    ev = evaluator((model, host), [], batch_size=8, chunks=4)
    result = evaluate.PerplexityEvaluation("ragged", docs).result(ev, ev.tokenizer)
    real = sum(r for r, _, _, _ in ev.counts.blocks)
    slots = sum(c * b * t for _, c, b, t in ev.counts.blocks)
    shapes = {(c, b, t) for _, c, b, t in ev.counts.blocks}
    print(f"ragged: {real / slots:.3f} of {slots} slots real, {len(ev.counts.blocks)} blocks, {len(shapes)} shapes")
    assert real == sum(len(d["text"]) for d in docs) and real / slots >= 0.85
    assert len(shapes) <= 5 and all(b == 8 for _, _, b, _ in ev.counts.blocks)  # 64 = 8 full batches
    assert result.metrics["tokens"] == real



SHARED = [  # contexts shared by one-token choices, by multi-token ones, cut from the left, filling a row
    {"context": "Q: 2+2=? A) 3 B) 4 C) 5 D) 6\nAnswer:", "choices": ["A", "B", "C", "D"], "gold": 1},
    {"context": "the cats", "choices": [" see the dog.", " sees the dog.", " seen", "!"], "gold": 0},
    {"context": "x" * 70, "choices": ["a", "b", " a long ending"], "gold": 2},  # block_size 64
    {"context": "0123456789" * 3, "choices": [" the first long one!", " the second long one", "."], "gold": 2},
    {"context": "Shots: 1+1=2, 2+2=4, 3+3=6. Q: 4+4=", "choices": ["8", "9"], "gold": 0},  # a shared prefix
    {"context": "Shots: 1+1=2, 2+2=4, 3+3=6. Q: 5+5=", "choices": ["10", "11"], "gold": 0},
]


def shared_requests(small):
    """SHARED's requests, and among the second context's choices the model's own greedy
    continuation (so that is_greedy is True somewhere)."""
    tokenizer = jobs.ByteTokenizer()
    requests = [inference.Request(i, *evaluate.encode_pair(tokenizer, s["context"], choice))
                for i, s in enumerate(SHARED) for choice in s["choices"]]
    context = requests[4].context
    return requests[:8] + [inference.Request(1, context, greedy_by_recompute(*small, context, 3))] + requests[8:]


def scored(small, share, mesh=(1, 1), batch=4):
    """Each SHARED request's Scored, and the blocks run, with contexts shared or not."""
    ev = evaluator(small, [], mesh=mesh, batch_size=batch)
    ev.share_contexts = share
    return [s for _, s in ev.loglikelihood(shared_requests(small))], ev.counts.blocks


def test_a_request_without_context_is_refused_the_simple_way_and_the_fast_way(small):
    """A continuation's first token is predicted from the context's last: a request with no
    context token is refused in one line on both paths (the simple path scored it from a
    wrapped slice)."""
    for simple in (False, True):
        ev = evaluator(small, [])
        ev.simple = simple
        with pytest.raises(inference.RequestError, match="at least one context token"):
            list(ev.loglikelihood([inference.Request(0, [], [5, 6])]))


def test_shared_contexts_score_as_alone_with_less_work(small):
    """Requests that see the same context share one row: each log-likelihood and is_greedy
    as when scored alone, on any batch size and mesh, for fewer tokens computed. One-token
    choices add nothing to the context's row; a choice cut from the left sees another
    context; contexts that begin alike share their prefix; a row holds at most block_size
    tokens."""
    packs = list(fast.pack_requests(shared_requests(small), SMALL["block_size"], True))
    assert [len(p.requests) for p in packs] == [4, 5, 2, 1, 1, 2, 4]
    assert packs[0].tokens == list(SHARED[0]["context"].encode()) and len(packs[0].scored) == 4
    prefix = len("Shots: 1+1=2, 2+2=4, 3+3=6. Q: ")
    assert packs[-1].branches == [0] * prefix + [1] * 4 + [2] * 6 and packs[-1].leaves[-6:] == [0] * 4 + [1, 2]
    alone, blocks_alone = scored(small, False)
    assert 0 < sum(s.correct for s in alone) < sum(s.tokens for s in alone)  # is_greedy means something
    for mesh, batch in [((1, 1), 3), ((4, 2), 8)]:
        shared, blocks_shared = scored(small, True, mesh, batch)
        np.testing.assert_allclose([s.logprob for s in shared], [s.logprob for s in alone], rtol=1e-5)
        assert [(s.tokens, s.correct) for s in shared] == [(s.tokens, s.correct) for s in alone]
        real = [sum(b[0] for b in blocks) for blocks in (blocks_alone, blocks_shared)]
        print(f"mesh {mesh}, batch {batch}: {real[0]} tokens computed alone, {real[1]} shared")
        assert real[1] < 0.6 * real[0]
    windowed = gpt.GPT(**{**SMALL, "rope": True}, sliding_window=8)  # in a packed row the window counts positions
    host = jax.device_get(jax.tree.map(lambda x: x * 5.0, gpt.init_params(windowed, mesh_of(), seed=3)))
    alone, shared = (scored((windowed, host), share)[0] for share in (False, True))
    np.testing.assert_allclose([s.logprob for s in shared], [s.logprob for s in alone], rtol=1e-5)


def test_short_packs_fill_rows_and_score_as_alone(small, monkeypatch):
    """Packs of short requests go first-fit, longest first, into rows of FILL_LENGTH
    tokens, each pack its own segment that sees nothing of the others: every log-likelihood
    and is_greedy as with a row each (FILL_LENGTH 1), on 1x1 and 4x2, in fewer token slots,
    with rows that hold several packs."""
    assert fast.fill_rows([5, 9, 3, 7, 12, 2], 12) == [[4], [1, 2], [3, 0], [5]]
    assert fast.fill_rows([20, 3], 12) == [[0], [1]]  # longer than a row: alone
    rng = np.random.default_rng(0)
    text = lambda lo, hi: "".join(rng.choice(list("abcdefgh "), rng.integers(lo, hi)))
    contexts = [list(text(4, 24).encode()) for _ in range(24)]
    choice = lambda context, k: list(text(1, 6).encode()) if k else greedy_by_recompute(*small, context, 2)
    requests = [inference.Request(doc, context, choice(context, k))
                for doc, context in enumerate(contexts) for k in range(rng.integers(1, 4))]
    fill, score_packs, segments = fast.FILL_LENGTH, inference.InferenceJob.score_packs, []
    model, host = small

    def counting_segments(self, packs, *args, **kwargs):  # the most packs a block's rows hold, less one
        segments.append(max(max(p.segments) for p in packs))
        return score_packs(self, packs, *args, **kwargs)

    monkeypatch.setattr(inference.InferenceJob, "score_packs", counting_segments)

    def scored(mesh, batch, fill_length):
        segments.clear()
        ev = inference.InferenceJob(model, gpt.place_params(model, mesh_of(*mesh), host), jobs.ByteTokenizer(),
                                    mesh_of(*mesh), batch_size=batch, quiet=True, fill_length=fill_length)
        results = [s for _, s in ev.loglikelihood(requests)]
        return results, sum(c * b * t for _, c, b, t in ev.counts.blocks), max(segments) + 1

    for mesh, batch in [((1, 1), 4), ((4, 2), 8)]:
        (filled, filled_slots, most), (alone, alone_slots, one) = (scored(mesh, batch, n) for n in (fill, 1))
        print(f"mesh {mesh}: {filled_slots} token slots, up to {most} packs a row; {alone_slots} a pack a row")
        assert_scored_alike(filled, alone)  # float32's rounding differs with a row's layout
        assert 0 < sum(s.correct for s in alone) and filled_slots < 0.85 * alone_slots and most >= 3 and one == 1


def test_a_block_starts_before_the_one_before_it_is_read(small, monkeypatch):
    """run_window keeps one block in flight: within a window (16 packs here, 8 blocks of 2
    rows), block k + 1 is started (traced, compiled, dispatched) before block k's results are
    read, each block is read once, in order, and the scores equal a block at a time (each
    read as soon as it starts)."""
    model, host = small
    rng = np.random.default_rng(1)
    requests = [inference.Request(doc, list(rng.integers(0, 250, rng.integers(2, 60))), [int(rng.integers(0, 250))])
                for doc in range(2 * inference.SORT_WINDOW)]
    score_packs, events = inference.InferenceJob.score_packs, []

    def logged(self, packs, *args, **kwargs):
        block, read = len([e for e in events if e[0] == "start"]), score_packs(self, packs, *args, **kwargs)
        events.append(("start", block))
        return lambda: (events.append(("read", block)), read())[1]

    def read_at_once(self, packs, *args, **kwargs):
        results = score_packs(self, packs, *args, **kwargs)()
        return lambda: results

    def scored(patch):
        monkeypatch.setattr(inference.InferenceJob, "score_packs", patch)
        job = inference.InferenceJob(model, gpt.place_params(model, mesh_of(), host), jobs.ByteTokenizer(),
                                     mesh_of(), batch_size=2, chunks=1, quiet=True, fill_length=1)
        return [s for _, s in job.loglikelihood(requests)]

    pipelined, at_once = scored(logged), scored(read_at_once)
    n = len(events) // 2
    assert n >= 4, events
    assert events == [("start", 0)] + [e for k in range(1, n) for e in (("start", k), ("read", k - 1))] + \
        [("read", n - 1)]
    assert [(s.logprob, s.correct) for s in pipelined] == [(s.logprob, s.correct) for s in at_once]


def test_scoring_unembeds_only_the_pieces_that_hold_scored_tokens(small, monkeypatch):
    """A share's scored slots are unembedded UNEMBED_PIECE at a time up to the last piece
    with a real one: the padding after it is never computed (NaN hidden states there stay
    out of the results), and the real ones score as a direct log-softmax does."""
    model, host = small
    ev = inference.InferenceJob(model, gpt.place_params(model, mesh_of(), host), jobs.ByteTokenizer(), mesh_of(),
                                quiet=True, unembed_piece=4)
    rng = np.random.default_rng(0)
    x_GMD = rng.standard_normal((2, 16, SMALL["n_embd"])).astype(np.float32)
    x_GMD[:, 8:] = np.nan  # 5 real slots: pieces 0-3 and 4-7 run, 8-15 must not
    targets_GM = rng.integers(0, SMALL["vocab_size"], (2, 16)).astype(np.int32)
    logprob, correct = jax.jit(ev.token_scores)(ev.variables, x_GMD, targets_GM, jnp.int32(5))
    logits = np.asarray(ev.model.apply(ev.variables, x_GMD[:, :8], method=gpt.GPT.unembed))
    expected = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), targets_GM[:, :8, None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(logprob)[:, :8], expected, rtol=1e-5)
    assert np.array_equal(np.asarray(correct)[:, :8], logits.argmax(-1) == targets_GM[:, :8])
    assert not np.asarray(logprob)[:, 8:].any() and not np.asarray(correct)[:, 8:].any()


def test_shared_contexts_on_two_processes(small, tiny_ckpt, tmp_path):
    """The command line as two processes (a 2x2 mesh over both) scores every choice as this
    process does with each alone."""
    data, port = write_jsonl(tmp_path / "choices.jsonl", SHARED), free_port()
    args = ["--ckpt", tiny_ckpt, "--data", f"mc:{data}", "--mesh", "2x2", "--batch-size", "2", "--log-samples",
            "--out", tmp_path / "out", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--quiet"]
    procs = [subprocess.Popen([sys.executable, str(ROOT / "evaluate.py"), *map(str, args), "--process-id", str(i)],
                              env=child_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs[0][-2000:] + errs[1][-2000:]
    samples = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    alone = scored(small, False)[0]
    alone = alone[:8] + alone[9:]  # the greedy choice is not in the file
    np.testing.assert_allclose(sum((s["loglik"] for s in samples), []), [s.logprob for s in alone], rtol=1e-5)


def test_progress_lines_when_stderr_is_not_a_terminal(small, capsys, monkeypatch):
    """A line every PROGRESS_SECONDS (here 0: after every block), documents done growing to
    the total, for our evaluations (and lm-eval's requests, where lm-eval is installed); none
    with quiet, none on a process other than the first, none for a call quicker than
    PROGRESS_SECONDS."""
    docs = [{"text": "the cat sees the dog. " * k} for k in range(1, 9)]  # 1 to 3 rolling windows each
    ev = evaluator(small, [], batch_size=2, chunks=1)
    ev.quiet = False
    monkeypatch.setattr(inference, "PROGRESS_SECONDS", 1e9)
    evaluate.PerplexityEvaluation("prose", docs).result(ev, ev.tokenizer)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(inference, "PROGRESS_SECONDS", 0.0)
    evaluate.PerplexityEvaluation("prose", docs).result(ev, ev.tokenizer)
    lines = capsys.readouterr().err.splitlines()
    done = [int(re.fullmatch(r"prose: (\d+)/8 samples, [\d,]+ tokens/s, \d+ s", line).group(1)) for line in lines]
    assert len(set(done)) > 2 and done == sorted(done) and done[-1] == 8, lines
    if importlib.util.find_spec("lm_eval") is not None:  # the suite's core runs without it (test_all.py --core)
        lm = tasks.JaxLM(ev)
        lm.generate_until([types.SimpleNamespace(args=(g["prompt"], {"until": ["\n"], "max_gen_toks": 6}))
                           for g in GEN])
        assert capsys.readouterr().err.splitlines()[-1].startswith(f"generate_until: {len(GEN)}/{len(GEN)} requests, ")
    for quiet, process in [(True, 0), (False, 1)]:
        ev.quiet = quiet
        monkeypatch.setattr(jax, "process_index", lambda: process)
        evaluate.PerplexityEvaluation("prose", docs).result(ev, ev.tokenizer)
        assert capsys.readouterr().err == ""


class Triples:
    """Each token reads as three characters (a letter, a capital, a digit): a capital as a
    stop string arrives in the middle of a token."""

    bos_token_id = eos_token_id = 256
    vocab_size = 320

    def encode(self, text, add_special_tokens=True):
        return list(text.encode())

    def decode(self, ids):
        return "".join(chr(97 + i % 26) + chr(65 + i // 26 % 26) + str(i % 10) for i in ids if i != 256)


def stop_in(text, tokenizer):
    """A stop string that occurs early in `text`: two ASCII characters (two byte tokens), or
    the capital of a Triples token."""
    if isinstance(tokenizer, Triples):
        return text[3 * 4 + 1]
    return next(text[k:k + 2] for k in range(len(text) // 4, len(text) - 1) if text[k:k + 2].isascii())


@pytest.mark.parametrize("tokenizer", [jobs.ByteTokenizer(), Triples()], ids=["across tokens", "inside a token"])
def test_stop_strings_end_decoding_early_with_the_same_texts(small, tokenizer, monkeypatch):
    """Decoding stops once every row of a batch holds a stop string (checked between
    segments of SEGMENT_STEPS steps): the texts are those of decoding to the end and cut,
    each row's tokens end with the one that completed its stop, and a batch runs fewer
    than SEGMENT_STEPS steps past the last of its rows' ends. With rows refilled from the
    waiting prompts (refill, the default) the same texts come from one rollout, in fewer
    steps than a batch at a time."""
    model, host = small
    job = inference.InferenceJob(model, gpt.place_params(model, mesh_of(), host), tokenizer, mesh_of(), batch_size=4,
                                 quiet=True)
    prompts, N = [list(p) for p in (b"the cat", b"hello", b"12+3", b"ab", b"x", b"q")], 32  # batches 0-3, 4-5
    full = [g for _, g in job.generate_until([inference.GenerationRequest(i, p, ()) for i, p in enumerate(prompts)], N)]
    stops = [stop_in(g.text, tokenizer) for g in full]
    ends = [next(k for k in range(1, N + 1) if s in tokenizer.decode(g.tokens[:k])) for g, s in zip(full, stops)]
    runs = {}
    for refill in (False, True):
        job = inference.InferenceJob(model, job.variables, tokenizer, mesh_of(), batch_size=4, quiet=True,
                                     refill=refill)
        cut = [g for _, g in job.generate_until([inference.GenerationRequest(i, p, (s,)) for i, (p, s) in
                                                 enumerate(zip(prompts, stops))], N)]
        assert [g.text for g in cut] == [inference.cut_at_stop(g.text, [s]) for g, s in zip(full, stops)]
        assert [g.tokens for g in cut] == [g.tokens[:k] for g, k in zip(full, ends)]
        assert all(0 <= r.steps - r.needed < inference.SEGMENT_STEPS for r in job.counts.rollouts)
        runs[refill] = list(job.counts.rollouts)
    needed = [max(ends[:4]), max(ends[4:])]
    assert [(r.rows, r.needed) for r in runs[False]] == [(4, needed[0]), (2, needed[1])]
    (refilled,) = runs[True]  # prompts 4 and 5 go into rows that ended, from the segment after
    assert refilled.rows == 4 and refilled.steps <= sum(r.steps for r in runs[False]) < 2 * N - inference.SEGMENT_STEPS


@pytest.mark.parametrize("batch,shard", [(1, 1), (4, 2)])
def test_done_rows_take_waiting_prompts(small, batch, shard, monkeypatch):
    """Continuous batching: a row that is done takes the next waiting prompt between
    segments (refill), its prompt written into the ring of cache slots its old tokens held:
    the same texts and tokens as a batch at a time, greedy and sampled, on one device and
    on a 4x2 mesh, in one rollout of fewer steps (counted)."""
    model, host = small
    mesh = gpt.make_mesh(batch, shard, devices=jax.devices()[:batch * shard])
    job = inference.InferenceJob(model, gpt.place_params(model, mesh, host), jobs.ByteTokenizer(), mesh,
                                 batch_size=4, quiet=True)
    prompts, N = [list(f"{i} + {i * 7} = ".encode()[:4 + i % 5]) for i in range(12)], 24
    full = [g.text for _, g in job.generate_until([inference.GenerationRequest(i, p, ()) for i, p in
                                                   enumerate(prompts)], N)]
    # rows end at varied lengths: each at a character of its own text, 1 to 21 characters in
    requests = [inference.GenerationRequest(i, p, (t[1 + 5 * i % 21:2 + 5 * i % 21] or "?",))
                for i, (p, t) in enumerate(zip(prompts, full))]
    runs = {}
    for refill in (False, True):
        job = inference.InferenceJob(model, job.variables, jobs.ByteTokenizer(), mesh, batch_size=4, quiet=True,
                                     refill=refill)
        greedy = [(g.text, g.tokens) for _, g in job.generate_until(requests, N)]
        sampled = [(g.text, g.tokens) for _, g in job.generate_until(requests, N, temperature=0.8, seed=5)]
        runs[refill] = (greedy, sampled, list(job.counts.rollouts))
    assert runs[True][:2] == runs[False][:2] and len({t for t, _ in runs[True][0]}) > 6
    batches, (greedy_run, _) = runs[False][2], runs[True][2]
    assert len(batches) == 6 and greedy_run.rows == 4 and greedy_run.steps < sum(r.steps for r in batches[:3])


def test_an_empty_prompt_generates_nothing(small):
    """A request without a single prompt token is done at once, with no tokens, beside the
    others: its row never waits for tokens that will not come."""
    model, host = small
    job = inference.InferenceJob(model, gpt.place_params(model, mesh_of(), host), jobs.ByteTokenizer(), mesh_of(),
                                 batch_size=2, quiet=True)
    got = [g for _, g in job.generate_until([inference.GenerationRequest(i, p, ()) for i, p in
                                             enumerate([[], list(b"ab"), [], []])], 6)]
    assert [(g.text, g.tokens) for g in got[::2]] == [("", [])] * 2 and len(got[1].tokens) == 6


@pytest.mark.parametrize("batch,shard", [(1, 1), (4, 2)])
def test_done_rows_are_dropped_between_segments(small, batch, shard):
    """Once a batch's running rows fit in a quarter of its rows, they go on in a smaller
    rollout (the next power of two, a multiple of the mesh's "batch" size): the same texts
    and tokens as decoding every row to the batch's end, in fewer row-steps (counted), on
    one device and on a 4x2 mesh (16 rows -> 4, 1 device: -> 1)."""
    model, host = small
    mesh = gpt.make_mesh(batch, shard, devices=jax.devices()[:batch * shard])
    job = inference.InferenceJob(model, gpt.place_params(model, mesh, host), Triples(), mesh, batch_size=16,
                                 quiet=True, compact_rows=True)  # (a CPU's default)
    prompts, N = [list(f"{w} {i}".encode()) for i, w in enumerate(["the cat", "hello", "12+3", "ab"] * 4)], 40
    full = [g for _, g in job.generate_until([inference.GenerationRequest(i, p, ()) for i, p in enumerate(prompts)], N)]
    # a stop string is a token's text (Triples): every row ends by its 8th token but one, after its 33rd
    late = next(t for k, t in enumerate(full[0].tokens) if k >= 33 and t not in full[0].tokens[:k])
    stops = [job.tokenizer.decode([g.tokens[k % 8] if k else late]) for k, g in enumerate(full)]
    requests = [inference.GenerationRequest(i, p, (s,)) for i, (p, s) in enumerate(zip(prompts, stops))]
    sampled = lambda: [g.tokens for _, g in job.generate_until(requests, N, temperature=1.0, seed=5)]
    dropped_sampled = sampled()
    job.counts.rollouts.clear()
    dropped = [g for _, g in job.generate_until(requests, N)]
    job.compact_rows = False  # (an accelerator's default)
    kept = [g for _, g in job.generate_until(requests, N)]
    assert [(g.text, g.tokens) for g in dropped] == [(g.text, g.tokens) for g in kept]
    assert sampled() == dropped_sampled  # each row's sampling keys go with it
    ends = sorted(next(k for k in range(1, N + 1) if s in job.tokenizer.decode(g.tokens[:k]))
                  for g, s in zip(full, stops))
    early = -(-ends[-2] // inference.SEGMENT_STEPS) * inference.SEGMENT_STEPS  # when one row is left
    (run, whole) = job.counts.rollouts[:2]
    assert early < 32 < ends[-1] and run.steps == whole.steps and whole.row_steps == 16 * whole.steps
    assert run.row_steps <= 16 * early + 4 * (run.steps - early) < whole.row_steps


@pytest.mark.parametrize("batch,shard", [(1, 1), (4, 2)])
def test_generation_computes_a_shared_prompt_prefix_once(small, batch, shard):
    """Prompts that begin alike (few-shot examples) are prefilled from one row of their
    common beginning, in steps of shared_prefix_step tokens, each prompt keeping a token of
    its own, and the cache holds that beginning once for all rows: the same tokens as
    prefilling every prompt whole, for fewer prefill slots and fewer cache slots read per
    decoding step (counted), on one device and on a 4x2 mesh, through compaction to fewer
    rows (the prefix is the batch's, not a row's)."""
    model, host = small
    mesh = gpt.make_mesh(batch, shard, devices=jax.devices()[:batch * shard])
    variables = gpt.place_params(model, mesh, host)

    def job(batch_size: int, step: int, **settings) -> inference.InferenceJob:  # step 1000: every prompt whole
        return inference.InferenceJob(model, variables, jobs.ByteTokenizer(), mesh, batch_size=batch_size,
                                      quiet=True, shared_prefix_step=step, **settings)

    shots = list(b"Q: 2+2? A: 4. Q: 3+5? A: 8. ")  # 28 tokens
    prompts = [shots + list(q) for q in (b"Q: 1+1? A:", b"Q: 7?", b"Q", b"Q: 12+30? A:", b"Q: 9+", b"x")]
    requests = [inference.GenerationRequest(i, p, ()) for i, p in enumerate(prompts)]
    by_step = job(4, 8), job(4, 1000)
    shared, whole = ([g.tokens for _, g in j.generate_until(requests, 12)] for j in by_step)
    assert by_step[0].shared_prefix(prompts[:4]) == shots[:24] == by_step[0].shared_prefix(prompts[4:])
    assert shared == whole and all(len(t) == 12 for t in shared)
    (run,), (alone,) = (j.counts.rollouts for j in by_step)  # one rollout each: prompts 4 and 5 take rows that are done
    length = alone.prefill // len(prompts)  # the padded prompt length
    assert run.prefill == 24 + len(prompts) * (length - 24) < alone.prefill
    assert run.cache_slots == 24 + run.rows * (length - 24 + 12) < alone.cache_slots == run.rows * (length + 12)
    # every row but the first ends at its text's second character: one batch of 16 rows moves
    # to a quarter (compact) or fewer
    texts = [jobs.ByteTokenizer().decode(t) for t in whole]
    stops = [inference.GenerationRequest(i, prompts[i % 6], (texts[i % 6][1:2] or "?",) if i else ())
             for i in range(16)]

    def texts_and_runs(step: int):
        sixteen = job(16, step, segment_steps=2, compact_rows=True)
        return [g.text for _, g in sixteen.generate_until(stops, 12)], sixteen.counts.rollouts

    (shared_texts, runs), (whole_texts, _) = texts_and_runs(8), texts_and_runs(1000)
    assert shared_texts == whole_texts and any(r.row_steps < r.rows * r.steps for r in runs)


# ---- the fast path against the simple path: property-based differential tests
# Every mechanism of inference.py's fast path (contexts shared in a packed row, short packs
# filling rows, one-token continuations without a row token, a few-shot prefix held once,
# continuous batching with refills into a ring of cache slots and compaction, stop strings
# checked between segments, blocks sorted, scheduled and sharded over a mesh) is checked
# against a reference that has none of them: a request a row in a plain causal forward pass
# (scoring), a prompt alone through gpt.generate decoded to max_gen_toks and cut afterwards
# (generation). hypothesis draws the inputs; profile "ci" (the default) is derandomized and
# short, HYPOTHESIS_PROFILE=long runs FUZZ_LONG times as many examples of each property.
# Which draw covers which mechanism is said beside each strategy.

FUZZ_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
FUZZ_LONG = 60
FUZZ_MESHES = [(1, 1), (4, 2), (2, 4)]


def fuzz_settings(examples):
    return hypothesis.settings(max_examples=examples * (FUZZ_LONG if FUZZ_PROFILE == "long" else 1),
                               derandomize=FUZZ_PROFILE != "long", deadline=None, database=None,
                               print_blob=True, suppress_health_check=list(hypothesis.HealthCheck),
                               # no "explain" phase: it traces every line of a failing example, for minutes
                               phases=[p for p in hypothesis.Phase if p != hypothesis.Phase.explain])


@fuzz_settings(3)
@hypothesis.given(name=st.sampled_from(sorted(CONFIGS)), lengths=st.lists(st.integers(1, 12), min_size=1, max_size=5),
                  prefix=st.integers(0, 6), fresh=st.booleans(), block=st.sampled_from([2, 256]),
                  steps=st.integers(1, 4), seed=st.integers(0, 9), step=st.sampled_from(gpt.STEP_ATTENTIONS[1:]),
                  per_row=st.sampled_from([1, 2, 4]), tile=st.booleans())
@hypothesis.example(name="everything", lengths=[1], prefix=0, fresh=False, block=2, steps=1, seed=0, step="dots",
                    per_row=2, tile=True)
@hypothesis.example(name="llama", lengths=[5, 2], prefix=3, fresh=True, block=256, steps=3, seed=1, step="dots",
                    per_row=4, tile=False)
def test_fast_attention_equals_the_reference_attention(name, lengths, prefix, fresh, block, steps, seed, step,
                                                       per_row, tile):
    """Every fast attention path gives the logits of attend_reference (GPT(attention=
    "reference")), within 1e-5 of the largest: unmasked rows (attend_causal, whole-square or
    in query blocks), masked left-padded rows (attend), a KV cache's prefill (fresh, or over
    the cache's slots), decoding steps (attend's one-query path), and a shared prefix held
    once (KVCache.prefix_keys), on every family's options; a step's grouped heads by sums or
    dots (gpt.BACKEND_ATTENTION), its own key and value beside the cache's (attend's `own`);
    the cache's slots one to a row or per_row side by side (a TPU's, gpt.slots_per_row), a
    step's written into its row or its whole tile (a TPU's, gpt.write_tile)."""
    model = tiny(**CONFIGS[name], query_block=block, step_attention=step)
    model = model.clone(cache_lanes=per_row * model.head_width if per_row > 1 else 0)
    prefix = 0 if model.sliding_window is not None else prefix  # a shared prefix counts no window
    variables = init(model, seed)
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, 320, n) for n in lengths]
    idx, mask = left_pad(rows)
    right_idx = np.zeros_like(idx)
    for b, row in enumerate(rows):
        right_idx[b, :len(row)] = row
    extra, shared = rng.integers(0, 320, (len(rows), steps)), rng.integers(0, 320, (1, prefix))

    def logits(m):
        extend = jax.jit(lambda v, x, k, c, fresh=False: m.apply(v, x, k, c, fresh, method=gpt.GPT.extend),
                         static_argnums=4)
        unmasked = np.asarray(jax.jit(lambda v, x: m.apply(v, x, deterministic=True)[0])(variables, right_idx))
        unmasked = np.concatenate([unmasked[b, :len(row)] for b, row in enumerate(rows)])
        masked = np.asarray(forward(m)(variables, idx, mask))[mask]
        held = None
        if prefix:
            _, held = extend(variables, shared, np.ones((1, prefix), bool), m.init_cache(1, prefix), True)
        slots = lambda per: -(-(idx.shape[1] + steps) // per) * per
        longest = m.rope_scaling[1] if m.rope_scaling and m.rope_scaling[0] == "longrope" else m.block_size
        per_tile = per_row * gpt.TILE_BYTES // 4  # a tile's rows of float32 slots, where the model takes them
        cache = m.init_cache(len(rows), slots(per_tile if tile and slots(per_tile) <= longest else per_row), held)
        step, cache = extend(variables, idx, mask, cache, fresh and not prefix)
        steps_BNV = [np.asarray(step)]
        with mock.patch.dict(gpt.BACKEND_ATTENTION[jax.default_backend()], tile=tile and m is model):
            for t in range(steps):
                step, cache = extend(variables, extra[:, t:t + 1], np.ones((len(rows), 1), bool), cache)
                steps_BNV.append(np.asarray(step))
        return unmasked, masked, np.stack(steps_BNV, 1)

    for fast, plain in zip(logits(model), logits(model.clone(attention="reference"))):
        assert np.abs(fast - plain).max() <= 1e-5 * max(1.0, np.abs(plain).max())


@fuzz_settings(4)
@hypothesis.given(mesh_shape=st.sampled_from(FUZZ_MESHES), dtype=st.sampled_from(["float32", "bfloat16"]),
                  layers=st.integers(1, 3), rows=st.sampled_from([2, 4, 8]), heads=st.sampled_from([2, 4]),
                  tiles=st.integers(1, 3), seed=st.integers(0, 99))
@hypothesis.example(mesh_shape=(4, 2), dtype="bfloat16", layers=2, rows=4, heads=2, tiles=3, seed=0)
def test_a_tiles_put_by_dma_equals_xlas_update(mesh_shape, dtype, layers, rows, heads, tiles, seed):
    """gpt.put_tile (a TPU's step write, one Pallas DMA; interpreted here) equals
    jax.lax.dynamic_update_slice_in_dim into the cache's rows, in place of its argument
    (donated), on one device and on a mesh that splits rows and heads (jax.shard_map)."""
    H = gpt.TILE_BYTES // jnp.dtype(dtype).itemsize
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(layers, rows, heads, tiles * H, 128)), dtype)
    tile = jnp.asarray(rng.normal(size=(layers, rows, heads, H, 128)), dtype)
    first = jnp.int32(int(rng.integers(0, tiles)) * H)
    mesh = gpt.make_mesh(*mesh_shape, devices=jax.devices()[:math.prod(mesh_shape)])
    # rows and heads split where the mesh divides them, else held whole on each device
    spec = PartitionSpec(None, gpt.mesh_axis(mesh, "batch", rows), gpt.mesh_axis(mesh, "shard", heads))
    x = jax.device_put(x, NamedSharding(mesh, spec))
    want = np.asarray(jax.lax.dynamic_update_slice_in_dim(x, tile, first, 3))
    with jax.set_mesh(mesh):
        got = jax.jit(gpt.put_tile, donate_argnums=0)(x, tile, first)
    assert x.is_deleted() and np.array_equal(np.asarray(got), want)


class Pieces:
    """A tokenizer whose tokens read as one to three characters (so a stop string can end
    inside a token or span several) from a five-letter alphabet (so stop strings occur),
    and whose EOS is a token the model often picks (so rows end at EOS, some at once)."""

    ALPHABET = "ab. \n"
    bos_token_id = None
    vocab_size = SMALL["vocab_size"]

    def __init__(self, eos):
        self.eos_token_id = eos

    def encode(self, text, add_special_tokens=True):
        return [self.ALPHABET.index(c) for c in text]

    def piece(self, i):
        a = self.ALPHABET
        return a[i % 5] + a[i // 5 % 5] * (i // 25 % 2) + a[i // 50 % 5] * (i // 100 % 2)

    def decode(self, ids):
        return "".join(self.piece(i) for i in ids if i != self.eos_token_id)


@functools.lru_cache(maxsize=None)
def reference_generate(model, n_new, temperature, top_p):
    """gpt.generate jitted: prompts [16, P] left-padded, each decoded to n_new tokens."""
    def run(variables, idx, mask, eos, docs, seed):
        keys = jax.vmap(lambda d: jax.random.fold_in(jax.random.key(seed), d))(docs)
        return gpt.generate(model, variables, idx, mask, n_new, eos, temperature, top_p, keys)
    return jax.jit(run)


def plain_loglikelihood(small, requests):
    """Each request alone in a plain causal row, written out in numpy (the oracle of the
    library's simple path): the last max_len + 1 tokens of context + continuation, less the
    last, its continuation scored at the last predictions; (logprob, tokens, argmax count)
    from float64 log-probabilities."""
    model, host = small
    T, rows = model.block_size, []
    for r in requests:
        row = (r.context + r.continuation)[-(T + 1):]
        rows.append((row[:-1], row[1:], len(r.continuation)))
    out = []
    for at in range(0, len(rows), 16):
        batch = rows[at:at + 16]
        idx = np.zeros((16, T), np.int32)
        for b, (inp, _, _) in enumerate(batch):
            idx[b, :len(inp)] = inp
        logp = np.asarray(jax.nn.log_softmax(logits_of(model, host, idx).astype(np.float64), -1))
        for b, (inp, targets, n) in enumerate(batch):
            where = np.arange(len(inp) - n, len(inp))
            picked = logp[b, where, np.asarray(targets[len(targets) - n:], int)]
            greedy = logp[b, where].argmax(-1) == np.asarray(targets[len(targets) - n:])
            out.append((float(picked.sum()), n, int(greedy.sum())))
    return out


def plain_generate(small, tokenizer, requests, n_new, temperature=0.0, top_p=1.0, seed=0):
    """Each prompt through gpt.generate, decoded to n_new tokens whatever its stop strings,
    then cut: at EOS (dropped), then through the first token whose text completes a stop
    string (the oracle of the library's simple path): (text, tokens, truncated) as
    InferenceJob.generate_until defines them."""
    model, host = small
    room, eos = model.block_size - n_new, tokenizer.eos_token_id
    prompts = [r.prompt[-room:] for r in requests]
    out = []
    for at in range(0, len(requests), 16):
        batch = list(zip(requests[at:at + 16], prompts[at:at + 16]))
        idx, mask = np.zeros((16, room), np.int32), np.zeros((16, room), bool)
        for b, (_, p) in enumerate(batch):
            idx[b, room - len(p):], mask[b, room - len(p):] = p, True
        docs = np.array([r.doc for r, _ in batch] + [0] * (16 - len(batch)), np.int32)
        new = np.asarray(reference_generate(model, n_new, temperature, top_p)(host, idx, mask, eos, docs, seed))
        for b, (r, p) in enumerate(batch):
            ids = new[b].tolist() if p else []
            ids = ids[:ids.index(eos)] if eos in ids else ids
            stops = [s for s in r.until if s]
            end = next((k for k in range(1, len(ids) + 1) if any(s in tokenizer.decode(ids[:k]) for s in stops)),
                       len(ids))
            out.append((inference.cut_at_stop(tokenizer.decode(ids[:end]), r.until), ids[:end],
                        len(r.prompt) > room))
    return out


@pytest.fixture(scope="module")
def fuzz(small):
    """(small, a Pieces tokenizer, job(mesh, batch_size, chunks, simple=False, **settings) -> an
    InferenceJob, the last few kept so that each shape compiles once per job)."""
    model, host = small
    last = np.asarray(logits_of(model, host, tokens((64, 8), vocab=250)))[:, -1]
    eos = int(np.bincount(last.argmax(-1)).argmax())  # the commonest first greedy token
    tokenizer = Pieces(int(eos))

    @functools.lru_cache(maxsize=16)  # each kept job's programs hold ~300 memory maps; a process may have 65,530
    def job(mesh, batch_size, chunks, simple=False, **settings):
        m = mesh_of(*mesh)
        return inference.InferenceJob(model, gpt.place_params(model, m, host), tokenizer, m, batch_size=batch_size,
                                      chunks=chunks, quiet=True, simple=simple, **settings)
    return Fuzzed(small, tokenizer, job)


class Fuzzed(tuple):
    """The fuzz fixture, named in a falsifying example by its name, not its parameters."""

    def __new__(cls, *parts):
        return super().__new__(cls, parts)

    def __repr__(self):
        return "fuzz"


@st.composite
def token_lists(draw, vocab, min_size=0, max_size=8):
    return draw(st.lists(st.integers(0, vocab - 1), min_size=min_size, max_size=max_size))


@st.composite
def contexts_alike(draw, count, max_len):
    """`count` contexts that begin with one random beginning: each shares 0, 1, 2, a few,
    nearly all or all of its tokens (then it is the others' shared prefix, its own part
    empty), then a tail of its own; some longer than max_len (cut from the left). A small
    vocabulary draws equal contexts and prefixes by chance too."""
    vocab = draw(st.sampled_from([3, 20, 250]))
    base = draw(token_lists(vocab, 1, 2 * max_len))
    out = []
    for _ in range(count):
        shared = draw(st.sampled_from([0, 1, 2, 8, len(base) - 1, len(base)]))
        tail = draw(token_lists(vocab, 0, draw(st.sampled_from([0, 4, max_len]))))
        context = base[:shared] + tail
        out.append(context or [0])
    return vocab, out


@st.composite
def loglikelihood_requests(draw, max_len=SMALL["block_size"]):
    """Contexts alike (shared prefixes), each with 1-4 continuations: one token (a scored
    slot and no row token), a few, as long as max_len (longer than the context, which is
    then cut), a repeat of the one before (duplicates); requests in any order."""
    vocab, contexts = draw(contexts_alike(draw(st.integers(1, 9)), max_len))
    requests = []
    for doc, context in enumerate(contexts):
        for _ in range(draw(st.integers(1, 4))):
            kind = draw(st.sampled_from(["one", "few", "long", "again"]))
            if kind == "again" and requests:
                continuation = requests[-1].continuation
            else:
                size = {"one": (1, 1), "few": (2, 6), "long": (7, max_len)}.get(kind, (1, 3))
                continuation = draw(token_lists(vocab, *size))
            requests.append(inference.Request(doc, context, continuation))
    return draw(st.permutations(requests)) if draw(st.booleans()) else requests


def assert_scored_alike(got, want):
    """Log-likelihoods within 1e-5 relative, token counts and is_greedy counts identical
    (want: Scored, or (logprob, tokens, correct))."""
    want = [(w.logprob, w.tokens, w.correct) if isinstance(w, inference.Scored) else w for w in want]
    np.testing.assert_allclose([s.logprob for s in got], [w[0] for w in want], rtol=1e-5, atol=1e-5)
    assert [(s.tokens, s.correct) for s in got] == [w[1:] for w in want]


def simple_scores(job, requests):
    """The library's simple path (InferenceJob(simple=True)): a request a row."""
    return [s for _, s in job((1, 1), 16, 1, True).loglikelihood(requests)]


def simple_generations(job, requests, *decoding):
    """The library's simple path: batches of prompts through gpt.generate, cut afterwards."""
    return [(g.text, g.tokens, g.truncated) for _, g in job((1, 1), 16, 1, True).generate_until(requests, *decoding)]


@fuzz_settings(4)
@hypothesis.given(requests=loglikelihood_requests(), prompts=st.data(), n_new=st.sampled_from([0, 6]),
                  sampling=st.sampled_from([(0.0, 1.0), (0.8, 0.9)]))
def test_the_simple_path_is_a_plain_forward_pass_and_gpt_generate(fuzz, requests, prompts, n_new, sampling):
    """InferenceJob(simple=True), which the fast path is tested against, against the same
    written out in numpy: log-likelihoods from float64 log-probabilities, and generations
    from gpt.generate cut by a search over their texts."""
    small, tokenizer, job = fuzz
    assert_scored_alike(simple_scores(job, requests), plain_loglikelihood(small, requests))
    drawn = at_room(prompts.draw(generation_prompts()), SMALL["block_size"] - n_new)
    stops = prompts.draw(STOPS)
    requests = [inference.GenerationRequest(i, p, stop_strings(specs, tokenizer.decode(p[-3:])))
                for i, (p, specs) in enumerate(zip(drawn, stops))]
    assert (simple_generations(job, requests, n_new, *sampling, 1)
            == plain_generate(small, tokenizer, requests, n_new, *sampling, 1))


def test_the_simple_path_runs_none_of_the_fast_mechanisms():
    """`--simple`, the path a reader follows and the fast one is tested against, stays simple:
    a multiple-choice item and a generated prompt through it run no function of fast.py and,
    of gpt.py's attention, only attend_reference (traced afresh: a model no other test builds)."""
    model = gpt.GPT(n_layers=1, n_embd=32, n_head=2, block_size=48, vocab_size=320)
    mesh = mesh_of()
    ran = set()

    def on_call(frame, event, arg):
        if event == "call" and Path(frame.f_code.co_filename).parent == ROOT:
            ran.add((Path(frame.f_code.co_filename).name, frame.f_code.co_name))

    evaluations = [evaluate.MultipleChoiceEvaluation("mc", MC[:1]),
                   evaluate.RolloutEvaluation("gen", GEN[:1], max_new_tokens=3)]
    ev = evaluate.Evaluator.from_parts(jobs.ExecutionSpec(name="test", out_dir="/nonexistent"), model,
                                       gpt.init_params(model, mesh), jobs.ByteTokenizer(), mesh, evaluations,
                                       evaluate.EvaluatorConfig(quiet=True, simple=True))
    sys.setprofile(on_call)
    try:
        for evaluation in evaluations:
            evaluation.result(ev, ev.tokenizer)
    finally:
        sys.setprofile(None)
    attention = {name for file, name in ran if file == "gpt.py" and name.startswith(("attend", "splash", "put_tile"))}
    assert attention == {"attend_reference"} and ("gpt.py", "generate") in ran
    assert {name for file, name in ran if file == "fast.py"} == set(), ran
    assert ("inference.py", "simple_scored") in ran and ("inference.py", "simple_generations") in ran


# the shapes each platform gets (inference.SHAPES), searched on this CPU
SHAPES_OF = {"cpu": inference.SHAPES["cpu"], "accelerator": inference.ACCELERATOR_SHAPES}
PLATFORMS = list(SHAPES_OF)


SIX_HELLOS = [inference.Request(i, list(f"hello {i}".encode()), list(choice.encode()))
              for i in range(6) for choice in "wcm"]  # 18 one-token choices: more scored slots than tokens
PREFIX_ALONE = [inference.Request(0, list(b"Q: 1+1=2. Q: 3+3="), list(b"6")),
                inference.Request(1, list(b"Q: 1+1=2. Q: "), list(b"ok")),  # its neighbours' shared prefix
                inference.Request(2, list(b"Q: 1+1=2. Q: 4+4="), list(b"8"))]


@fuzz_settings(10)
@hypothesis.given(requests=loglikelihood_requests(), mesh=st.sampled_from(FUZZ_MESHES), batch=st.integers(1, 17),
                  chunks=st.sampled_from([1, 16]), fill=st.sampled_from([fast.FILL_LENGTH, 24, 1]),
                  platform=st.sampled_from(PLATFORMS))
@hypothesis.example(requests=SIX_HELLOS, mesh=(1, 1), batch=4, chunks=16, fill=fast.FILL_LENGTH, platform="cpu")
@hypothesis.example(requests=PREFIX_ALONE, mesh=(1, 1), batch=4, chunks=16, fill=fast.FILL_LENGTH, platform="cpu")
def test_loglikelihood_equals_a_request_a_row(fuzz, requests, mesh, batch, chunks, fill, platform):
    """loglikelihood on any mesh, batch size and chunking, with packing, shared prefixes and
    row filling (rows of `fill` tokens), in a CPU's shapes or an accelerator's, scores every
    request as the simple path does."""
    _, _, job = fuzz
    got = [s for _, s in job(mesh, batch, chunks, fill_length=fill, **SHAPES_OF[platform]).loglikelihood(requests)]
    assert_scored_alike(got, simple_scores(job, requests))


@fuzz_settings(6)
@hypothesis.given(data=st.data(), mesh=st.sampled_from(FUZZ_MESHES), batch=st.integers(1, 17),
                  platform=st.sampled_from(PLATFORMS))
def test_rolling_loglikelihood_equals_a_window_a_row(fuzz, data, mesh, batch, platform):
    """Documents of 0 to 3 x max_len tokens, alike or not, scored in rolling windows: each
    window as it scores alone."""
    small, tokenizer, job = fuzz
    max_len = SMALL["block_size"]
    _, documents = data.draw(contexts_alike(data.draw(st.integers(1, 6)), max_len))
    documents = [d[:data.draw(st.sampled_from([0, len(d), 3 * max_len]))] for d in documents]
    got = list(job(mesh, batch, 16, **SHAPES_OF[platform]).loglikelihood_rolling(documents))
    windows = [inference.rolling_requests(d, tokenizer.eos_token_id, max_len) or [([tokenizer.eos_token_id], [])]
               for d in documents]
    want = simple_scores(job, [inference.Request(0, c, t) for w in windows for c, t in w])
    assert [len(g) for g in got] == [len(w) for w in windows]
    assert_scored_alike([s for g in got for s in g], want)


@st.composite
def generation_prompts(draw, max_len=SMALL["block_size"]):
    """Prompts alike (for a shared few-shot prefix), each cut to 0 tokens, kept whole, or
    cut to "room" or "room+1" tokens: at and beyond the room n_new leaves (resolved by
    at_room)."""
    _, prompts = draw(contexts_alike(draw(st.integers(1, 12)), max_len))
    return [(p, draw(st.sampled_from([0, "whole", "room", "room+1"]))) for p in prompts]


def at_room(prompts, room):
    return [p[:{"whole": len(p), "room": room, "room+1": room + 1}.get(cut, cut)] for p, cut in prompts]


# each prompt's stop strings: 0-2 of (a piece of its text, from character `at`, 1-4 long;
# or a string of the alphabet that may or may not occur; or an empty one, which stops nothing)
STOPS = st.lists(st.lists(st.tuples(st.sampled_from(["text", "\n", ". ", "zz", ""]), st.integers(0, 120),
                                    st.integers(1, 4)), max_size=2), min_size=12, max_size=12)


def stop_strings(specs, text):
    return tuple(text[at % max(len(text), 1):][:n] or "a" if kind == "text" else kind for kind, at, n in specs)


# an empty prompt beside others: their shared prefix was the first one's tokens but the last
# SHARED_PREFIX_STEP (a slice at -1 // step * step), the other rows decoded after its beginning
EMPTY_BESIDE_ALIKE = [(list(b"ab. ab. ab."), "whole"), (list(b"b. ab. ab."), "whole"), ([], 0)]


@fuzz_settings(7)
@hypothesis.given(prompts=generation_prompts(), stops=STOPS, mesh=st.sampled_from(FUZZ_MESHES),
                  batch=st.integers(1, 17), n_new=st.sampled_from([0, 1, 6, 20]),
                  sampling=st.sampled_from([(0.0, 1.0), (0.8, 0.9)]), seed=st.integers(0, 3), refill=st.booleans(),
                  prefix_step=st.sampled_from([4, 16, inference.SHARED_PREFIX_STEP]),
                  platform=st.sampled_from(PLATFORMS))
@hypothesis.example(prompts=EMPTY_BESIDE_ALIKE, stops=[[]] * 12, mesh=(1, 1), batch=4, n_new=6,
                    sampling=(0.0, 1.0), seed=0, refill=True, prefix_step=4, platform="cpu")
def test_generation_equals_a_prompt_alone_decoded_to_the_end(fuzz, prompts, stops, mesh, batch, n_new, sampling,
                                                             seed, refill, prefix_step, platform):
    """generate_until, greedy or sampled, with continuous batching (refill) or a batch at a
    time, a shared few-shot prefix held once (in steps of prefix_step), rows dropped as they
    end and stop strings checked between segments: the texts and tokens of each prompt alone
    decoded to n_new tokens and cut afterwards. Prompts alike, empty, at and beyond the
    room left by n_new; stop strings inside and across tokens, never met, or none; EOS
    (Pieces') often the first token. Rollouts in a CPU's shapes or an accelerator's."""
    small, tokenizer, job = fuzz
    temperature, top_p = sampling
    prompts = at_room(prompts, SMALL["block_size"] - n_new)
    whole = simple_generations(job, [inference.GenerationRequest(i, p, ()) for i, p in enumerate(prompts)],
                               n_new, temperature, top_p, seed)
    requests = [inference.GenerationRequest(i, p, stop_strings(specs, w[0]))
                for i, (p, w, specs) in enumerate(zip(prompts, whole, stops))]
    want = simple_generations(job, requests, n_new, temperature, top_p, seed)
    got = [(g.text, g.tokens, g.truncated) for _, g in job(mesh, batch, 16, refill=refill, shared_prefix_step=prefix_step,
                                                           **SHAPES_OF[platform])
           .generate_until(requests, n_new, temperature, top_p, seed)]
    assert got == want


def test_a_job_of_no_rows_is_refused_where_it_is_built(small):
    """InferenceJob from Python (another project's code) with batch_size, chunks, segment_steps
    or lengths_per_octave below 1: refused in the constructor, naming the argument, not deep
    inside a later call (or, for lengths_per_octave 0, taken silently as the platform's)."""
    model, host = small
    for setting in ({"batch_size": 0}, {"batch_size": -1}, {"chunks": 0}, {"segment_steps": 0},
                    {"lengths_per_octave": 0}):
        with pytest.raises(inference.RequestError, match=f"{next(iter(setting))} must be at least 1"):
            inference.InferenceJob(model, host, Pieces(0), mesh_of(), **setting)


def test_an_accelerators_shapes_build_fewer_programs_with_the_same_answers():
    """An accelerator's shapes (inference.ACCELERATOR_SHAPES: powers of two) against a CPU's:
    identical scores and generations, from fewer programs. Requests of 340-1000 tokens, four a
    block, score in blocks of 512 and 1024 tokens (a CPU's: 448, 704, 1024); three windows of
    prompts of 210-500 tokens, each window's longest a different length, the second's a power
    of two shorter than the first's, decode in one rollout length (a CPU's: three)."""
    model = gpt.GPT(n_layers=1, n_embd=32, n_head=2, block_size=1024, vocab_size=320)
    host = jax.device_get(gpt.init_params(model, mesh_of(), seed=0))
    rng = np.random.default_rng(0)
    scored = [inference.Request(i, rng.integers(1, 256, n - 4).tolist(), rng.integers(1, 256, 4).tolist())
              for i, n in enumerate([1000, 980, 960, 940, 700, 680, 660, 640, 400, 380, 360, 340])]
    longest = [500, 250, 400]  # each window's (32 prompts at a batch of 4)
    prompts = [inference.GenerationRequest(32 * w + i, rng.integers(1, 256, longest[w] - 40 * (i > 0)).tolist(), ())
               for w in range(3) for i in range(32)]
    answers, programs = {}, {}
    for platform in PLATFORMS:
        job = inference.InferenceJob(model, gpt.place_params(model, mesh_of(), host), Pieces(0), mesh_of(),
                                     batch_size=4, chunks=1, quiet=True, fill_length=1, **SHAPES_OF[platform])
        mark = len(runs.compile_log().events)
        answers[platform] = ([s for _, s in job.loglikelihood(scored)],
                             [g.tokens for _, g in job.generate_until(prompts, 6)])
        built = [name for event, name, *_ in runs.compile_log().events[mark:] if event == runs.CompileLog.BACKEND]
        programs[platform] = {name: built.count(f"jit({name})")  # compiled, or loaded from the cache
                              for name in ("_score_block", "start", "advance")}
    assert_scored_alike(answers["accelerator"][0], answers["cpu"][0])
    assert answers["accelerator"][1] == answers["cpu"][1]
    assert programs["accelerator"] == {"_score_block": 2, "start": 1, "advance": 1}
    assert programs["cpu"] == {"_score_block": 3, "start": 3, "advance": 3}


def test_an_accelerators_rollout_takes_the_fewer_cache_slots():
    """On an accelerator a rollout's prompt slots are a power of two, or its whole cache's
    slots are (prompt and new tokens, which a step reads all of), whichever are fewer; a
    later rollout takes an earlier one's slots where that cache is at most twice its own.
    Where a TPU packs slots into rows and writes whole tiles, a cache is whole tiles."""
    model = gpt.GPT(n_layers=1, n_embd=32, n_head=2, block_size=1024, vocab_size=320)
    variables = init(model)
    new_job = lambda: inference.InferenceJob(model, variables, Pieces(0), mesh_of(), batch_size=4, quiet=True,
                                             **inference.ACCELERATOR_SHAPES)
    plan = lambda job, n, n_new: job.plan_rollout([inference.GenerationRequest(0, [1 + i % 7 for i in range(n)], ())],
                                                  1024 - n_new, n_new, True).length
    assert [plan(new_job(), *p) for p in [(192, 64), (200, 64), (100, 28), (40, 300)]] == [192, 256, 100, 64]
    job = new_job()
    assert [plan(job, 100, 28), plan(job, 33, 28), plan(job, 20, 28)] == [100, 100, 32]  # 128 slots: 2 x (36 + 28)
    wide = gpt.GPT(n_layers=1, n_embd=128, n_head=2, block_size=1024, vocab_size=320)  # heads 64 wide
    with mock.patch.dict(gpt.BACKEND_ATTENTION[jax.default_backend()], lanes=128, tile=True):
        tiled = lambda: inference.InferenceJob(wide, init(wide), Pieces(0), mesh_of(), batch_size=4, quiet=True,
                                               **inference.ACCELERATOR_SHAPES)
        assert wide.tile_slots() == 2 * 8  # two slots a row of 128 lanes, 8 rows of float32 a tile
        assert [plan(tiled(), *p) for p in [(192, 64), (100, 50), (40, 300)]] == [192, 142, 68]
    assert plan(new_job(), 100, 50) == 128 and wide.tile_slots() == 1


# the same properties through the command line: random --data files of the four kinds, and
# random lm-eval task YAMLs over local JSONL, against the simple path of our own and
# against lm-eval's own HF model

def main_in_process(*args):
    """evaluate.main in this process (no start-up, the suite's compiled programs): (exit
    status, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = evaluate.main([str(a) for a in args])
    return status, err.getvalue()


FUZZ_TEXT = "ab c.\né"  # é: two bytes, so a character can end inside a token pair


@st.composite
def texts_alike(draw, count, max_len=SMALL["block_size"]):
    """`count` texts that begin alike (contexts_alike's tokens as characters), some empty."""
    _, token_rows = draw(contexts_alike(count, max_len))
    return ["".join(FUZZ_TEXT[t % len(FUZZ_TEXT)] for t in row[:draw(st.sampled_from([0, len(row)]))])
            for row in token_rows]


@st.composite
def data_files(draw):
    """Lines of the four kinds: documents (one to three windows), multiple choice with
    contexts alike and one- or few-character choices, prompts alike with and without their
    own stop strings, next-token accuracy texts."""
    n = lambda: draw(st.integers(1, 7))
    short = lambda: draw(st.text(FUZZ_TEXT, min_size=1, max_size=draw(st.sampled_from([1, 4]))))
    ppl = [{"text": t or "a"} for t in draw(texts_alike(n(), 3 * SMALL["block_size"]))]
    choices = lambda: draw(st.lists(st.text(FUZZ_TEXT, min_size=1, max_size=draw(st.sampled_from([1, 4]))),
                                    min_size=2, max_size=4, unique=True))  # equal choices tie: either is right
    mc = [{"context": t, "choices": c, "gold": draw(st.integers(0, len(c) - 1))}
          for t, c in ((t, choices()) for t in draw(texts_alike(n())))]
    until = lambda: {"until": [short()]} if draw(st.booleans()) else {}
    gen = [{"prompt": t or "a", "answer": short().strip() or "a", **until()}
           for t in draw(texts_alike(n()))]
    acc = [{"text": t + "ab"} for t in draw(texts_alike(n()))]
    return {"ppl": ppl, "mc": mc, "gen": gen, "acc": acc}


def samples_alike(got, want):
    """samples.jsonl lines: numbers within 1e-5 relative, everything else identical."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), (g, w)
        for key, value in w.items():
            if isinstance(value, float) or (isinstance(value, list) and value and isinstance(value[0], float)):
                np.testing.assert_allclose(g[key], value, rtol=1e-5, atol=1e-6, err_msg=f"{w['eval']} {key}")
            else:
                assert g[key] == value, (w["eval"], key, g, w)


@fuzz_settings(3)
@hypothesis.given(files=data_files(), batch=st.integers(1, 17), mesh=st.sampled_from(["1x1", "4x2", "2x4", "8x1"]),
                  n_new=st.sampled_from([1, 6]), sampling=st.sampled_from([["--temperature", "0"],
                                                                           ["--temperature", "0.8", "--seed", "3"]]))
def test_cli_data_files_score_as_the_simple_path(tiny_ckpt, files, batch, mesh, n_new, sampling):
    """`evaluate.py --data` on random files of the four kinds, any batch size and mesh: the
    samples and results of the simple path (--simple: a request a row, batch 1, one device)."""
    with tempfile.TemporaryDirectory() as tmp:
        data = sum([["--data", f"{kind}:{write_jsonl(Path(tmp) / f'{kind}.jsonl', rows)}"]
                    for kind, rows in files.items()], [])
        common = ["--ckpt", tiny_ckpt, *data, "--max-new-tokens", n_new, *sampling, "--log-samples", "--quiet"]
        status, err = main_in_process(*common, "--batch-size", batch, "--mesh", mesh, "--out", Path(tmp) / "fast")
        assert status == 0, err
        status, err = main_in_process(*common, "--simple", "--batch-size", 1, "--mesh", "1x1", "--out",
                                      Path(tmp) / "simple")
        assert status == 0, err
        got, want = ([json.loads(line) for line in (Path(tmp) / d / "samples.jsonl").read_text().splitlines()]
                     for d in ("fast", "simple"))
        samples_alike(got, want)
        np.testing.assert_allclose(list(results_of(Path(tmp) / "fast").values()),
                                   list(results_of(Path(tmp) / "simple").values()), rtol=1e-5)


def test_checkpoint_round_trip(small, tmp_path):
    model, host = small
    mesh = mesh_of()
    checkpoints.save_checkpoint(str(tmp_path / "ck"), model, gpt.place_params(model, mesh, host), {"kind": "bytes"})
    restored, variables, config = checkpoints.load_checkpoint(str(tmp_path / "ck"), mesh_of(4, 2))
    assert restored == model and config["tokenizer"] == {"kind": "bytes"}
    jax.tree.map(np.testing.assert_array_equal, host, jax.device_get(variables))  # bit-exact weights
    spec = variables["params"]["blocks"]["mlp"]["up"]["kernel"].sharding.spec
    assert spec == jax.sharding.PartitionSpec(None, None, "shard")
    idx = jnp.array([list(b"hello world")])
    np.testing.assert_allclose(model.apply(host, idx, deterministic=True)[0],
                               restored.apply(variables, idx, deterministic=True)[0], atol=1e-4)
    # a checkpoint of the layout before layers were scanned (a tensor per layer: blocks_0/...) loads the same
    flat = checkpoints.flatten(jax.device_get(host["params"]))
    per_layer = {name.replace("blocks/", f"blocks_{i}/"): np.ascontiguousarray(x[i])
                 for name, x in flat.items() if name.startswith("blocks/") for i in range(model.n_layers)}
    save_file({**{n: x for n, x in flat.items() if not n.startswith("blocks/")}, **per_layer},
              str(tmp_path / "ck" / "model.safetensors"))
    _, old, _ = checkpoints.load_checkpoint(str(tmp_path / "ck"), mesh)
    jax.tree.map(np.testing.assert_array_equal, host, jax.device_get(old))


def child_env(devices, **changes):
    """The environment of a process the suite starts: `devices` simulated CPU devices and,
    as in this process, XLA's quick compilation (tiny programs compile 2x faster)."""
    flags = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    return {**os.environ, "XLA_FLAGS": flags, **changes}


def cli(*args, devices=2, timeout=300, **env_changes):
    """`python evaluate.py ARGS` in a fresh process with `devices` simulated CPU devices."""
    env = child_env(devices, **env_changes)
    return subprocess.run([sys.executable, str(ROOT / "evaluate.py"), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_ckpt(small, tmp_path_factory):
    model, host = small
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    checkpoints.save_checkpoint(str(path), model, gpt.place_params(model, mesh_of(), host), {"kind": "bytes"})
    return path


def write_jsonl(path, rows):
    """Rows as JSON lines; a str row is written as is (for malformed lines)."""
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return path


def test_cli_end_to_end_with_every_kind(tiny_ckpt, tmp_path):
    files = {"ppl": write_jsonl(tmp_path / "docs.jsonl", DOCS),
             "mc": write_jsonl(tmp_path / "choices.jsonl", MC),
             "gen": write_jsonl(tmp_path / "qa.jsonl", GEN),
             "acc": write_jsonl(tmp_path / "seq.jsonl", DOCS)}
    data = sum([["--data", f"{k}:{p}"] for k, p in files.items()], [])
    out = tmp_path / "out"
    proc = cli("--ckpt", str(tiny_ckpt), *data, "--out", str(out), "--log-samples",
                   "--max-new-tokens", "4", "--quiet")
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert set(results["results"]) == {"docs", "choices", "qa", "seq"}
    assert results["higher_is_better"] == {"docs": False, "choices": True, "qa": True, "seq": True}
    assert results["n_samples"] == {"docs": 4, "choices": 3, "qa": 3, "seq": 4}
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 14
    by_eval = {}
    for s in samples:
        by_eval.setdefault(s["eval"], []).append(s)
    assert [s["index"] for s in by_eval["docs"]] == [0, 1, 2, 3]
    assert {"nll", "tokens", "score"} <= set(by_eval["docs"][0])
    assert {"loglik", "pred", "gold", "score"} <= set(by_eval["choices"][0])
    assert {"output", "answer", "score"} <= set(by_eval["qa"][0])
    assert {"correct", "tokens", "score"} <= set(by_eval["seq"][0])
    nll = sum(s["nll"] for s in by_eval["docs"])
    tokens = sum(s["tokens"] for s in by_eval["docs"])
    np.testing.assert_allclose(results["results"]["docs"], np.exp(nll / tokens), rtol=1e-9)
    # a finished job is not redone: the file stays byte-identical
    before = (out / "results.json").read_bytes()
    again = cli("--ckpt", str(tiny_ckpt), *data, "--out", str(out), "--log-samples", "--max-new-tokens", "4")
    assert again.returncode == 0 and "nothing to do" in again.stderr
    assert (out / "results.json").read_bytes() == before


def test_cli_malformed_line_names_file_and_line(tiny_ckpt, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    proc = cli("--ckpt", str(tiny_ckpt), "--data", f"ppl:{bad}", "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert f"{bad}:2" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o" / "results.json").exists()


AS_MAIN = r"""
import contextlib, io, json, runpy, sys
script, runs = sys.argv[1], json.loads(sys.argv[2])
results = []
for argv in runs:
    sys.argv, out, err, status = [script, *argv], io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (e.code is not None)
    results.append({"status": status, "out": out.getvalue(), "err": err.getvalue()})
print(json.dumps(results))
"""


def as_main(script, *runs):
    """`python SCRIPT ARGV` for each ARGV, each run as __main__ by runpy in one fresh process:
    its exit status, stdout and stderr."""
    proc = subprocess.run([sys.executable, "-c", AS_MAIN, str(script), json.dumps(runs)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_registry_and_jobs_cli(capsys):
    assert {"gpt/evaluate", "backbone/evaluate", "gpt/train/pretrain"} <= set(jobs.JOBS)
    assert jobs.JOBS["gpt/evaluate"] is evaluate.Evaluate
    # `python jobs.py KEY` finds each job through ENTRY_POINTS: the table says what @job says
    assert {key: f"{cls.__module__}:{cls.__name__}" for key, cls in jobs.JOBS.items()} == jobs.ENTRY_POINTS
    listing = subprocess.run([sys.executable, str(ROOT / "jobs.py")], capture_output=True, text=True)
    assert listing.returncode == 0 and "gpt/train/pretrain" in listing.stdout
    helped = cli("--help")
    assert helped.returncode == 0
    for field in dataclasses.fields(evaluate.EvaluatorConfig):  # every option says what it does
        line = next(l for l in helped.stdout.splitlines() if l.split()[:1] == ["--" + field.name.replace("_", "-")])
        assert field.metadata["help"] in line, line
    # under a profiler's __main__ (cProfile's, not evaluate.py's) the options' types still resolve
    profiled = subprocess.run([sys.executable, "-m", "cProfile", "-o", os.devnull, str(ROOT / "evaluate.py"),
                               "--help"], capture_output=True, text=True, cwd=ROOT)
    assert profiled.returncode == 0 and "--ckpt" in profiled.stdout, profiled.stderr[-2000:]
    # `python train.py ARGS` four times, its __main__ run by runpy in one process (a start-up each is 5 s)
    trained, reinforced, supervised, both = as_main(ROOT / "train.py", ["--help"], ["--rl", "--help"],
                                                    ["--sft", "--help"], ["--sft", "--init", "x", "--rl"])
    assert trained["status"] == 0 and "--micro-batch-size" in trained["out"] and "optimizer steps" in trained["out"]
    assert reinforced["status"] == 0 and "--samples" in reinforced["out"] and "--micro-batch-size" not in reinforced["out"]
    assert supervised["status"] == 0 and "--ptx-rows" in supervised["out"] and "--samples" not in supervised["out"]
    # one stage a run
    assert both["status"] == 2 and both["err"].count("\n") == 1 and "unknown option --rl" in both["err"], both["err"]
    for args, needle in [(["nope/job"], "unknown job"), (["gpt/train/pretrain", "--stepz", "3"], "--stepz"),
                         (["gpt/train/pretrain", "--steps", "three"], "must be int"),
                         (["gpt/train/pretrain", "--steps", "0"], "--steps"), (["gpt/train/rl"], "--init CKPT is needed"),
                         (["gpt/train/rl", "--init", "/nonexistent"], "does not exist"),
                         (["gpt/train/rl", "--init", "x", "--temperature", "0"], "--temperature"),
                         (["gpt/train/rl", "--init", "x", "--reward", "bits"], "--reward must be exact or digits"),
                         (["gpt/train/rl", "--init", "x", "--ptx-rows", "0"], "--ptx-rows must be at least 1"),
                         (["gpt/train/sft"], "--init CKPT is needed"),
                         (["gpt/train/sft", "--init", "/nonexistent"], "does not exist"),
                         (["gpt/train/sft", "--init", "x", "--batch-size", "0"], "--batch-size must be at least 1"),
                         (["gpt/train/sft", "--init", "x", "--samples", "8"], "unknown option --samples")]:
        assert jobs.main(args) == 2  # what `python jobs.py ARGS` exits with
        assert needle in capsys.readouterr().err


def test_exit_status_gives_back_the_callers_signal_handlers(capsys):
    """A program that calls a main() in its own process keeps its own Ctrl-C and SIGTERM
    handlers and unraisable hook afterwards, whether the command succeeded, was refused
    (status 2) or raised: only the command runs under exit_status's."""
    mine = lambda signum, frame: None
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    hook = sys.unraisablehook
    seen = []

    def usage():
        raise jobs.UsageError("no")

    def fails():
        raise ValueError("a bug")

    try:
        for s in saved:
            signal.signal(s, mine)
        sys.unraisablehook = mine
        for command in (lambda: seen.append(signal.getsignal(signal.SIGTERM)), usage, fails):
            try:
                status = jobs.exit_status(command)
            except ValueError:
                status = None
            assert status == {usage: 2, fails: None}.get(command, 0)
            assert signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is mine
            assert sys.unraisablehook is mine
        assert seen == [jobs.on_signal]  # the command itself ran under exit_status's handler
        assert "error: no" in capsys.readouterr().err
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        sys.unraisablehook = hook


PROJECT_FILES = {"gpt": 0, "fast": 1, "jobs": 1, "inference": 2, "checkpoints": 2, "hf": 3, "runs": 3, "tasks": 4,
                 "evaluate": 5, "train": 6, "bench": 6}  # import order


def test_every_relative_link_in_the_docs_resolves():
    """README.md and docs/*.md link to files of the repository (and their anchors) that exist."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 2
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.name}: link to {target} goes nowhere"
            if anchor:
                headings = re.findall(r"^#+ (.*)$", linked.read_text(), re.M)
                slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
                assert anchor in slugs, f"{page.name}: no heading {anchor!r} in {linked.name}"


def test_readme_python_example_runs_as_shown(capsys):
    """The README's Python blocks, run as they are: the scores they print are the ones shown."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    exec(compile("\n".join(blocks), "README.md", "exec"), {})
    scores_line, quiz_line, scored_line = capsys.readouterr().out.splitlines()
    shown = re.search(r"print\(evaluator.evaluate\(\)\)\s+# (\{.*\})", blocks[0]).group(1)
    for name, value in re.findall(r"'(\w+)': ([\d.]+)", shown):
        assert f"'{name}': {value.rstrip('.')}" in scores_line, (scores_line, shown)
    assert quiz_line == "[0.]" and scored_line.endswith(" 5")


def test_imports_flow_one_way_and_sit_at_the_top():
    """gpt.py <- fast.py, jobs.py <- inference.py, checkpoints.py <- hf.py, runs.py <- tasks.py <-
    evaluate.py <- train.py, bench.py: each file imports only files before it, and only at
    module level (no import inside a function, but for transformers, imported where a
    HuggingFace file is read: half a second of every other process); fast.py and jobs.py do
    not import each other, nor inference.py and checkpoints.py, nor hf.py and runs.py; not
    even a type-only import names a later file. Every file is in the README's table."""
    table = re.findall(r"^\| `(\w+)\.py` \|", (ROOT / "README.md").read_text(), re.M)
    assert sorted(table) == sorted([*PROJECT_FILES, "test_all"]) == sorted(p.stem for p in ROOT.glob("*.py"))
    for name, rank in PROJECT_FILES.items():
        tree = ast.parse((ROOT / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = [ast.unparse(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
                assert set(inner) <= {"import transformers"}, f"{name}.py: {node.name} imports {inner}"
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                       [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for module in modules:
                top = module.split(".")[0]
                assert PROJECT_FILES.get(top, -1) < rank, f"{name}.py imports {top}.py"


def without_the_project(env):
    """An environment whose PYTHONPATH keeps the packages installed by path (as on a lent TPU
    machine) but not this repository, on one simulated device."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT.resolve()]
    return {**env, "PYTHONPATH": os.pathsep.join(paths), "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


def test_gpt_py_works_copied_alone(tmp_path):
    shutil.copy(ROOT / "gpt.py", tmp_path)
    env = without_the_project(os.environ)
    proc = subprocess.run([sys.executable, "gpt.py"], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0 and "parameters" in proc.stdout and "greedy" in proc.stdout, proc.stderr[-2000:]


INFERENCE_ALONE = '''
import gpt, inference
class Letters:  # the tokenizer protocol of inference.Tokenizer, written out as another project would
    bos_token_id, eos_token_id, vocab_size = 0, 1, 28
    def encode(self, text, add_special_tokens=True):
        return [2 + ord(c) - ord("a") for c in text]
    def decode(self, ids):
        return "".join(chr(ord("a") + i - 2) for i in ids if i >= 2)
model = gpt.GPT(n_layers=1, n_embd=32, n_head=2, block_size=16, vocab_size=28)
mesh = gpt.make_mesh()
job = inference.InferenceJob(model, gpt.init_params(model, mesh, seed=0), Letters(), mesh, batch_size=2)
[(request, scored)] = job.loglikelihood([inference.Request(0, [0, 2, 3], [4, 5])])
[(_, generation)] = job.generate_until([inference.GenerationRequest(0, [0, 2, 3], ())], 4)
print(scored.tokens, round(scored.logprob, 6), len(generation.tokens))
'''


def test_inference_core_works_copied_with_fast_py_and_gpt_py(tmp_path):
    """inference.py, fast.py and gpt.py together, in an empty directory, with a tokenizer of
    their own: a request is scored, and the log-likelihood is what the forward pass gives."""
    for name in ("gpt.py", "fast.py", "inference.py"):
        shutil.copy(ROOT / name, tmp_path)
    (tmp_path / "use.py").write_text(INFERENCE_ALONE)
    env = without_the_project(os.environ)
    proc = subprocess.run([sys.executable, "use.py"], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    count, logprob, generated = proc.stdout.split()
    model = gpt.GPT(n_layers=1, n_embd=32, n_head=2, block_size=16, vocab_size=28)
    logits = logits_of(model, gpt.init_params(model, mesh_of(), seed=0), np.array([[0, 2, 3, 4]], np.int32))
    logp = jax.nn.log_softmax(logits[0], -1)
    assert int(count) == 2 and int(generated) == 4
    assert float(logprob) == pytest.approx(float(logp[2, 4] + logp[3, 5]), abs=1e-5)


def test_trainer_learns_and_evaluates_through_from_trainer(tmp_path):
    config = train.TrainConfig(out=str(tmp_path / "train"), steps=30, batch_size=8, micro_batch_size=4,
                              seq_len=64, n_layers=1, n_embd=32, n_head=2, warmup=5, ckpt_every=15,
                              quiet=True)
    spec = jobs.ExecutionSpec(name="gpt/train/pretrain", out_dir=config.out, cfg=config)
    trainer = train.BaseTrainer(spec)
    trainer.run()
    log = [json.loads(line) for line in (tmp_path / "train" / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert losses[-1] < losses[0] - 1.0
    assert set(log[-1]["eval"]) == set(trainer.EVALUATION)
    model, _, config_json = checkpoints.load_checkpoint(str(tmp_path / "train"), mesh_of())
    assert config_json["step"] == 30 and model == trainer.model
    assert not (tmp_path / "train" / jobs.LOCK_FILE).exists()
    held = jobs.DirectoryLock(tmp_path / "train")  # another run writing there: refused before a step
    with pytest.raises(UsageError, match="another run is writing to"):
        train.BaseTrainer(spec).run()
    held.release()


# prompts of `small` and a printable byte it gives each a probability of 0.29, 0.18 and 0.17
CHOSEN = {"b": "e", "no": "Z", "world": "X"}


class ChosenToken(train.ReinforceTrainer):
    """The RL stage on a toy reward: one new token, 1 where it is the prompt's chosen byte."""

    TASK, MAX_NEW_TOKENS, EVALUATION = "chosen", 1, ["grammar"]

    def prompt_groups(self):
        while True:
            for prompt, answer in CHOSEN.items():
                yield from [{"prompt": prompt, "answer": answer}] * self.cfg.samples


def chosen_probability(model, variables):
    """The expected reward: the mean probability of each prompt's chosen byte."""
    return np.mean([jax.nn.softmax(logits_of(model, variables, np.array([list(p.encode())]))[0, -1])[ord(c)]
                    for p, c in CHOSEN.items()])


@pytest.mark.parametrize("mesh, ptx", [((1, 1), 0.0), ((4, 2), 0.1)])  # on 4x2, the pretraining loss beside
def test_rl_steps_raise_a_toy_reward(small, tiny_ckpt, tmp_path, mesh, ptx, monkeypatch):
    monkeypatch.setattr(jobs.ExecutionSpec, "make_mesh", lambda spec: mesh_of(*mesh))  # 1x1 of the 8 devices
    config = train.RLConfig(init=str(tiny_ckpt), out=str(tmp_path / "rl"), steps=6, prompts=len(CHOSEN), samples=8,
                            lr=1e-3, warmup=0, ptx=ptx, quiet=True)
    trainer = ChosenToken(jobs.ExecutionSpec(name="gpt/train/rl", out_dir=config.out, cfg=config))
    trainer.run()
    log = [json.loads(line) for line in (tmp_path / "rl" / "train_log.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in log if "reward" in r]
    before, after = chosen_probability(*small), chosen_probability(trainer.model, jax.device_get(trainer.variables))
    assert before < 0.3 and after > before + 0.3 and np.mean(rewards[-2:]) > np.mean(rewards[:2]) + 0.2, rewards
    assert set(log[-1]["eval"]) == {"grammar"}  # Evaluator.from_trainer at the end
    model, _, config_json = checkpoints.load_checkpoint(str(tmp_path / "rl"), mesh_of())
    assert config_json["step"] == 6 and model == trainer.model


class ChosenAnswers(train.SupervisedTrainer):
    """The SFT stage on the same toy task: each prompt's chosen byte is its answer."""

    EVALUATION = ["grammar"]

    def training_items(self):
        while True:
            yield from CHOSEN.items()


@pytest.mark.parametrize("mesh", [(1, 1), (4, 2)])
def test_sft_then_rl_raise_a_toy_reward(small, tiny_ckpt, tmp_path, mesh, monkeypatch):
    """The three-stage demo in small: SFT on the right answers (the training mix beside), then
    the RL stage from SFT's checkpoint (per-token rewards, the better answers raised); each
    raises the expected reward, on one device and on 4x2."""
    monkeypatch.setattr(jobs.ExecutionSpec, "make_mesh", lambda spec: mesh_of(*mesh))
    sft = train.SFTConfig(init=str(tiny_ckpt), out=str(tmp_path / "sft"), steps=2, batch_size=8, ptx_rows=4,
                          lr=1e-4, warmup=0, quiet=True)
    ChosenAnswers(jobs.ExecutionSpec(name="gpt/train/sft", out_dir=sft.out, cfg=sft)).run()
    rl = train.RLConfig(init=sft.out, out=str(tmp_path / "rl"), steps=4, prompts=len(CHOSEN), samples=8,
                        lr=1e-3, warmup=0, quiet=True)  # a rate for so few steps on a toy
    trainer = ChosenToken(jobs.ExecutionSpec(name="gpt/train/rl", out_dir=rl.out, cfg=rl))
    before, after_sft = chosen_probability(*small), chosen_probability(trainer.model, jax.device_get(trainer.variables))
    trainer.run()
    after_rl = chosen_probability(trainer.model, jax.device_get(trainer.variables))
    assert before + 0.1 < after_sft and after_sft + 0.1 < after_rl, (before, after_sft, after_rl)
    model, _, config_json = checkpoints.load_checkpoint(sft.out, mesh_of())  # SFT wrote what --rl --init took
    assert config_json["step"] == 2 and model == trainer.model


def test_sft_gradient_is_zero_at_prompt_and_padding_positions(small):
    """d loss / d logits of the SFT step's answer rows: nonzero where the target is an answer
    token or its EOS, exactly zero where it is a prompt token or padding."""
    model, host = small
    items = [("7+5=", "12"), ("12+30=", "042"), ("1+1=", "2")]  # of three lengths: two rows padded
    inputs_BT, targets_BT = next(train.answer_batches(jobs.ByteTokenizer(), iter(items), len(items)))
    for row, (prompt, answer) in enumerate(items):  # the targets are the answer and EOS, at their places
        np.testing.assert_array_equal(inputs_BT[row, :len(prompt)], list(prompt.encode()))
        expected = [-1] * (len(prompt) - 1) + list(answer.encode()) + [256]
        np.testing.assert_array_equal(targets_BT[row], expected + [-1] * (targets_BT.shape[1] - len(expected)))
    logits = logits_of(model, host, inputs_BT)
    grad = jax.grad(model.loss)(jnp.asarray(logits), jnp.asarray(targets_BT))
    touched_BT = np.abs(np.asarray(grad)).max(-1) > 0
    assert (targets_BT == -1).any() and (targets_BT[:, -1] == -1).any()  # prompt and padding both there
    np.testing.assert_array_equal(touched_BT, targets_BT != -1)


def sampled_rollouts(small, records=False):
    """Sampled generations of the GEN prompts, three each: (scores, rows), and the records of
    the same run again (the texts scored) if asked."""
    ev = evaluator(small, [])
    gen = evaluate.RolloutEvaluation("gen", GEN * 3, max_new_tokens=6)
    scores, rows = gen(ev, ev.tokenizer, reduce="none", return_intermediates=True, temperature=1.0, seed=5)
    return scores, rows, gen.result(ev, ev.tokenizer, temperature=1.0, seed=5).records if records else None


def test_rollouts_returned_are_what_the_evaluation_scored(small):
    scores, rows, records = sampled_rollouts(small, records=True)
    assert len(rows) == len(records) == len(GEN) * 3
    for (tokens, mask), record, score in zip(rows, records, scores):
        prompt = list(GEN[record["index"] % len(GEN)]["prompt"].encode())[-(SMALL["block_size"] - 6):]  # as cut
        assert tokens[:-6][mask[:-6]].tolist() == prompt and not mask[:-6][:-len(prompt)].any()  # left-padded
        new = tokens[-6:][mask[-6:]].tolist()
        assert mask[-6:].tolist() == [True] * len(new) + [False] * (6 - len(new))
        text = jobs.ByteTokenizer().decode(new[:-1] if new and new[-1] == 256 else new)
        assert inference.cut_at_stop(text, ("\n",)) == record["output"]
        assert score == float(record["output"].strip() == record["answer"].strip()) == record["score"]


def test_rl_gradient_is_zero_at_prompt_and_padding_positions(small):
    """d loss / d logits on real rollout rows: nonzero where a generated token is predicted
    (advantage != 0), exactly zero where the target is a prompt token or padding."""
    model, host = small
    _, rows, _ = sampled_rollouts(small)
    tokens_BL, mask_BL = np.stack([t for t, _ in rows]), np.stack([m for _, m in rows])
    generated_BL = train.generated_positions(mask_BL, 6)
    advantages_BT = np.linspace(-1, 1, tokens_BL[:, 1:].size, dtype=np.float32).reshape(len(rows), -1) + 1e-3
    logits = logits_of(model, host, tokens_BL[:, :-1], mask_BL[:, :-1])
    grad = jax.grad(train.reinforce_loss)(jnp.asarray(logits), tokens_BL[:, 1:], generated_BL[:, 1:],
                                          advantages_BT, 1.0)  # none is 0
    touched_BT = np.abs(np.asarray(grad)).max(-1) > 0
    assert generated_BL[:, 1:].any() and (~generated_BL[:, 1:]).any()
    np.testing.assert_array_equal(touched_BT, generated_BL[:, 1:])


def test_rl_rows_cut_to_their_real_columns_lose_alike(small):
    """The trainer drops the columns where no rollout row has a real token (left of the
    shortest prompt's padding, right of the longest answer), widened to a multiple of 8:
    every real token is kept, and the loss is the same."""
    model, host = small
    ev = evaluator(small, [])
    gen = evaluate.RolloutEvaluation("gen", GEN[:2] * 4, max_new_tokens=6)  # short prompts: 16 slots hold them
    _, rows = gen(ev, ev.tokenizer, reduce="none", return_intermediates=True, temperature=1.0, seed=3)
    tokens_BL, mask_BL = np.stack([t for t, _ in rows]), np.stack([m for _, m in rows])
    columns = train.real_columns(mask_BL)
    width = columns.stop - columns.start
    assert width % 8 == 0 and width < tokens_BL.shape[1] and mask_BL[:, columns].sum() == mask_BL.sum()
    advantages_BL = np.random.default_rng(0).normal(size=tokens_BL.shape).astype(np.float32)
    generated_BL = train.generated_positions(mask_BL, 6)

    def loss(t, m, g, a):
        return train.reinforce_loss(jnp.asarray(logits_of(model, host, t[:, :-1], m[:, :-1])), t[:, 1:], g[:, 1:],
                                    a[:, 1:], 1.0)
    np.testing.assert_allclose(loss(tokens_BL, mask_BL, generated_BL, advantages_BL),
                               loss(*(a[:, columns] for a in (tokens_BL, mask_BL, generated_BL, advantages_BL))),
                               rtol=1e-5)


@fuzz_settings(200)
@hypothesis.given(spans=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), min_size=1, max_size=6),
                  width=st.integers(1, 40))
def test_real_columns_keep_every_real_token(spans, width):
    """Any rows of real tokens between padding: the slice holds all of them, is a multiple of
    8 wide (or the whole row), and lies within the row."""
    mask_BL = np.zeros((len(spans), width), bool)
    for row, (start, length) in enumerate(spans):
        mask_BL[row, min(start, width):min(start + length, width)] = True
    columns = train.real_columns(mask_BL)
    assert 0 <= columns.start < columns.stop <= width and mask_BL[:, columns].sum() == mask_BL.sum()
    assert (columns.stop - columns.start) % 8 == 0 or columns.stop - columns.start == width


def test_rl_digit_rewards_and_their_per_slot_advantages():
    """--reward digits: each answer token its own correctness, past the answer the exact
    match; each slot's baseline is its prompt's mean at that slot; --positive keeps the
    advantages above 0."""
    new_BM = np.array([[48, 51, 49, 256], [48, 51, 50, 256], [49, 51, 50, 10]])  # "031", "032", "132"+"\n"
    exact_B = np.array([0.0, 1.0, 0.0])
    dense_BM = train.token_rewards(new_BM, [[48, 51, 50]] * 3, exact_B, dense=True)
    np.testing.assert_array_equal(dense_BM, [[1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]])
    np.testing.assert_array_equal(train.token_rewards(new_BM, [[48, 51, 50]] * 3, exact_B, dense=False),
                                  np.repeat(exact_B[:, None], 4, 1))
    advantages = train.advantages(dense_BM[None], positive=False)  # one prompt, three samples
    np.testing.assert_allclose(advantages, dense_BM - dense_BM.mean(0), atol=1e-6)
    assert not advantages[:, 1].any()  # all three got the middle digit right: nothing to learn there
    np.testing.assert_allclose(train.advantages(dense_BM[None], positive=True), np.maximum(advantages, 0))


def test_gen_stop_strings_per_line_and_from_the_command_line(small, tmp_path):
    """--stop (repeatable, escapes, '' for none) and a line's own "until" cut the generated text
    at the first stop string, as lm-eval's generate_until does."""
    assert evaluate.stop_strings(["\\n", "", "a\\tb", "\\\\n", "."]) == ("\n", "a\tb", "\\n", ".")
    prompts = [{"prompt": p, "answer": ""} for p in ("12+3", "the", "ab", "x")]
    ev = evaluator(small, [])
    full = [r["output"] for r in evaluate.RolloutEvaluation("g", prompts, 8, stop=()).result(ev, ev.tokenizer).records]
    assert all(len(text) >= 3 for text in full), full
    cut = lambda text, stop: text[:text.index(stop)]  # at the first occurrence
    # n characters of a text whose first occurrence is past its start: an answer cut there is not empty
    inside = lambda text, n: next(text[i:i + n] for i in range(1, len(text)) if text.index(text[i:i + n]) > 0)
    stop, until = inside(full[0], 1), inside(full[1], 2)  # both occur in those texts
    lines = [{**prompts[0], "answer": cut(full[0], stop)},  # the --stop strings
             {**prompts[1], "until": [until, "never"], "answer": cut(full[1], until)},  # its own
             {**prompts[2], "until": [], "answer": full[2]},  # none at all
             {**prompts[3], "answer": "no"}]
    data = write_jsonl(tmp_path / "gen.jsonl", lines)
    cfg = jobs.parse_options(evaluate.EvaluatorConfig, ["--data", f"gen:{data}", "--stop", "never",
                                                        "--stop", stop, "--stop", "", "--max-new-tokens", "8"])
    ev = evaluator(small, None, data=cfg.data, stop=cfg.stop, max_new_tokens=cfg.max_new_tokens)
    records = ev.evaluations[0].result(ev, ev.tokenizer, **ev.decoding()).records
    assert [r["output"] for r in records] == [line["answer"] for line in lines[:3]] + [
        inference.cut_at_stop(full[3], [stop])]
    assert [r["score"] for r in records[:3]] == [1.0, 1.0, 1.0] and len(records[0]["output"]) < len(full[0])
    for bad in ('{"prompt": "a", "answer": "b", "until": "x"}', '{"prompt": "a", "answer": "b", "until": [1]}'):
        with pytest.raises(UsageError, match="f.jsonl:3: 'until' must be a list of strings"):
            runs.check_sample("gen", bad.encode(), "f.jsonl:3")


# ---- HuggingFace backbones: parity with transformers' PyTorch models

try:
    import torch
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="the transformers reference models need torch "
                                 "(test-only: pip install torch==2.13.0)")

# the five families, then Llama 3.x rope scaling, Mistral, Gemma 3, the later families and the
# mixtures of experts (see hf_config)
MIXTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
LATER = ("gemma2", "phi3", "olmo2", "granite") + MIXTURES
NEW_FAMILIES = ("llama3", "mistral", "gemma3") + LATER
FAMILIES = ("gpt2", "llama", "qwen2", "qwen3", "gpt_neox") + NEW_FAMILIES
# Qwen2-MoE is Qwen3-MoE's layers without q/k norms plus a shared expert: its logits,
# greedy tokens and 4x2 logits check those; the harness and bfloat16 would repeat Qwen3-MoE's
SCORED_FAMILIES = tuple(f for f in FAMILIES if f != "qwen2_moe")


def load_tokenizer(path):
    """transformers' own tokenizer object of a local directory."""
    return HFTokenizer(path).tok
VOCAB = 384  # model vocabulary: the tokenizer's (<= 384) rounded up, divisible by the 2 shards
EOT = "<|endoftext|>"
TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "Hello, world!",
         "In the beginning the Universe was created. This has made a lot of people very angry.",
         "import numpy as np; x = np.zeros(3)"]
CORPUS = [t * 3 for t in TEXTS] + [
    "A small tokenizer for tests learns merges from a few sentences of plain English text.",
    "Numbers like 12, 345 and 6789 appear too, with punctuation: commas, periods; colons!",
    "def f(x):\n    return x * 2  # code has indentation and symbols like {} [] () <> == !=",
] * 4


def train_tokenizer(out_dir, vocab_size=VOCAB, add_bos=False):
    """A byte-level BPE trained here (no hub): no prefix space, all 256 bytes in the
    alphabet so any text encodes, <|endoftext|> as BOS and EOS, saved as
    PreTrainedTokenizerFast (tokenizer_class in tokenizer_config.json). add_bos: it
    prepends BOS to every text, as Gemma's tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{EOT} $A", pair=f"{EOT} $A $B",
                                                           special_tokens=[(EOT, tok.token_to_id(EOT))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT)
    fast.save_pretrained(out_dir)
    config_file = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_file) as f:
        config = json.load(f)
    # without it AutoTokenizer picks the class from model_type (Qwen2Tokenizer for qwen2,
    # built from vocab/merges, ignoring tokenizer.json)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2)
    return tok


def hf_config(family, eot_id):
    """A tiny transformers config per family: 2 layers (Gemma 3: 4), width 64, and each
    family's quirk. initializer_range 0.2 (not 0.02) makes logits peaked so greedy decoding
    has clear winners. The rows of the test texts have 10-54 tokens (plus 16 generated),
    longer than the windows (6, 8); rolling perplexity reaches position 127, beyond the
    Llama 3 config's original context (32)."""
    import transformers as tf
    common = dict(vocab_size=VOCAB, bos_token_id=eot_id, eos_token_id=eot_id, initializer_range=0.2)
    rotary = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                  **common)
    if family == "gpt2":
        return tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, n_inner=96, **common)
    if family == "llama":  # grouped kv heads, untied, non-default theta and eps, biases
        return tf.LlamaConfig(intermediate_size=96, num_key_value_heads=2, tie_word_embeddings=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                              rms_norm_eps=1e-5, attention_bias=True, **rotary)
    if family == "qwen2":  # q/k/v bias only, tied
        return tf.Qwen2Config(intermediate_size=96, num_key_value_heads=2, tie_word_embeddings=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, **rotary)
    if family == "qwen3":  # head_dim 32 != 64 / 4, q/k norm
        return tf.Qwen3Config(intermediate_size=96, num_key_value_heads=2, head_dim=32,
                              tie_word_embeddings=True, **rotary)
    if family == "gpt_neox":  # a quarter of each head rotated, parallel residual, untied
        return tf.GPTNeoXConfig(intermediate_size=128, use_parallel_residual=True, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.25}, **rotary)
    if family == "llama3":  # untied; head_dim 16 has frequencies in all three llama3 bands
        return tf.LlamaConfig(intermediate_size=96, num_key_value_heads=2, tie_word_embeddings=False,
                              rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 32}, **rotary)
    if family == "mistral":  # window 8, head_dim 32 != 64 / 4, untied; linear rope scaling (Mistral
        # checkpoints have none, but this is the flat rope_parameters every Llama-like family reads)
        return tf.MistralConfig(intermediate_size=96, num_key_value_heads=2, head_dim=32, sliding_window=8,
                                tie_word_embeddings=False,
                                rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 4.0},
                                **rotary)
    if family == "gemma3":  # 4 layers: local, local, global, local (pattern 3); window 6; head_dim
        # 32; query scale 24 ** -0.5 (not head_dim's); the global layer's rope linear x8 as in the
        # 4B-27B checkpoints; final logits soft-capped; tied; a tokenizer that adds BOS
        return tf.Gemma3TextConfig(intermediate_size=96, num_key_value_heads=2, head_dim=32, sliding_window=6,
                                   sliding_window_pattern=3, query_pre_attn_scalar=24, pad_token_id=0,
                                   final_logit_softcapping=30.0, rope_parameters={
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                          "rope_theta": 100000.0}},
                                   **dict(rotary, num_hidden_layers=4))
    if family == "gemma2":  # layers local, global; window 6; attention scores capped at 10 (the
        # checkpoints' 50 is rarely reached by these tiny models), logits at 30; query scale 24 ** -0.5
        return tf.Gemma2Config(intermediate_size=96, num_key_value_heads=2, head_dim=32, sliding_window=6,
                               query_pre_attn_scalar=24, attn_logit_softcapping=10.0, final_logit_softcapping=30.0,
                               pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                               **rotary)
    if family == "phi3":  # as Phi-4-mini: 3/4 of each head rotated, longrope (6 short factors, the
        # attention factor from max / original positions), untied; window 8 as Phi-3-mini-4k's
        factors = dict(short_factor=[1.0, 1.3, 1.9, 2.6, 4.0, 7.5], long_factor=[1.5, 2.5, 4.0, 7.0, 11.0, 16.0])
        return tf.Phi3Config(intermediate_size=96, num_key_value_heads=2, original_max_position_embeddings=72,
                             sliding_window=8, tie_word_embeddings=False, pad_token_id=0,
                             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.75, **factors}, **rotary)
    if family == "olmo2":  # norms after the sublayers, q/k norms over all heads; untied
        return tf.Olmo2Config(intermediate_size=96, num_key_value_heads=2, tie_word_embeddings=False,
                              pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 500.0}, **rotary)
    if family == "granite":  # Granite 3's multipliers (attention's 0.1, not 1 / sqrt(16)); tied
        return tf.GraniteConfig(intermediate_size=96, num_key_value_heads=2, tie_word_embeddings=True,
                                embedding_multiplier=12.0, attention_multiplier=0.1, residual_multiplier=0.22,
                                logits_scaling=2.0, **rotary)
    moe = dict(num_experts_per_tok=2, num_key_value_heads=2, pad_token_id=0, tie_word_embeddings=False)
    if family == "mixtral":  # 4 experts of 32, top 2 renormalised
        return tf.MixtralConfig(intermediate_size=32, num_local_experts=4, **moe, **rotary)
    if family == "qwen2_moe":  # q/k/v biases, a shared expert of 48 with its sigmoid gate
        return tf.Qwen2MoeConfig(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
                                 intermediate_size=96, **moe, **rotary)
    if family == "qwen3_moe":  # head_dim 32, q/k norm, top 2 renormalised (norm_topk_prob)
        return tf.Qwen3MoeConfig(moe_intermediate_size=32, intermediate_size=96, num_experts=4, head_dim=32,
                                 norm_topk_prob=True, **moe, **rotary)
    if family == "olmoe":  # q/k norms over all heads, top 2 not renormalised
        return tf.OlmoeConfig(intermediate_size=32, num_experts=4, norm_topk_prob=False, **moe, **rotary)
    raise ValueError(family)


def make_tiny_hf(family, out_dir, seed=0):
    """Build, randomize and save_pretrained a tiny transformers model plus the local tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    eot_id = train_tokenizer(out_dir, add_bos=family.startswith("gemma")).token_to_id(EOT)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, eot_id), attn_implementation="eager")
    with torch.no_grad():  # transformers' init zeroes biases and sets norm scales to 1: perturb
        for p in model.parameters():  # them so the loader's handling of each is exercised
            p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(out_dir)
    # AutoTokenizer must give exactly the ids of the tokenizer.json on disk
    from tokenizers import Tokenizer
    on_disk = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    for text in TEXTS + ["  two spaces, tabs\tand ünïcödé"]:
        assert auto(text)["input_ids"] == on_disk.encode(text).ids, (family, type(auto).__name__, text)
    return model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    if torch is None:
        pytest.skip("needs torch")
    """family -> (directory, transformers model)."""
    root = tmp_path_factory.mktemp("hf")
    return {f: (str(root / f), make_tiny_hf(f, str(root / f))) for f in FAMILIES}


def left_padded(tokenizer, texts=TEXTS):
    """ids [B, T] (pad id 0, never read) and mask [B, T] for ragged texts, left-padded."""
    rows = [tokenizer(t)["input_ids"] for t in texts]
    T = max(map(len, rows))
    ids = np.zeros((len(rows), T), np.int32)
    mask = np.zeros((len(rows), T), bool)
    for b, row in enumerate(rows):
        ids[b, T - len(row):], mask[b, T - len(row):] = row, True
    return ids, mask


def hf_logits(model, ids, mask):
    """transformers' logits with the positions our GPT uses: cumsum(mask) - 1, clipped at 0."""
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long),
                    position_ids=torch.tensor(positions, dtype=torch.long))
    return out.logits.float().numpy()


def our_logits(model, params, ids, mask):
    fn = jax.jit(lambda p, x, m: model.apply(p, x, padding_mask=m, deterministic=True)[0])
    return np.asarray(fn(params, ids, mask))


def max_diff_at_real(a, b, mask):
    return float(np.abs(a - b)[mask].max())


# the options a checkpoint's config sets, each with the value that turns it off
OPTIONS = dict(rope_scaling=None, sliding_window=None, local_rope_theta=None, attn_scale=None, attn_softcap=None,
               logit_softcap=None, rotary_fraction=1.0, embed_multiplier=1.0, residual_multiplier=1.0,
               logits_scaling=1.0, norm_topk_prob=False)


@needs_torch
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(hf_models, family):
    path, hf = hf_models[family]
    model, host = load_backbone(path)
    ids, mask = left_padded(load_tokenizer(path))
    theirs = hf_logits(hf, ids, mask)
    diff = max_diff_at_real(our_logits(model, host, ids, mask), theirs, mask)
    print(f"{family}: max |logit diff| = {diff:.2e}")
    assert diff <= 1e-4
    for option, off in OPTIONS.items():  # none is idle
        if getattr(model, option) != off:  # (longrope has a factor per rotated pair: it goes with the fraction)
            changes = dict({option: off}, **({"rope_scaling": None} if option == "rotary_fraction" else {}))
            without = max_diff_at_real(our_logits(model.clone(**changes), host, ids, mask), theirs, mask)
            print(f"{family} without {option}: max |logit diff| = {without:.2e}")
            assert without > 1e-2, option


@needs_torch
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers(hf_models, family):
    path, hf = hf_models[family]
    model, host = load_backbone(path)
    tokenizer = load_tokenizer(path)
    ids, mask = left_padded(tokenizer)
    N = 16
    hf.generation_config.eos_token_id = None  # exactly N new tokens, like ours without eos_id
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor(ids, dtype=torch.long),
                          attention_mask=torch.tensor(mask, dtype=torch.long), max_new_tokens=N,
                          do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    theirs = out.sequences[:, ids.shape[1]:].numpy()
    ours = np.asarray(jax.jit(lambda p, x, m: gpt.generate(model, p, x, m, N))(host, ids, mask))
    # A step whose top-1/top-2 gap is below float noise may legitimately go either way;
    # compare each row up to its first such near-tie (none expected with this init).
    top2 = np.sort(np.stack([s.float().numpy() for s in out.logits], 1), -1)[..., -2:]  # [B, N, 2]
    clear = np.cumprod(top2[..., 1] - top2[..., 0] >= 1e-3, axis=1).astype(bool)
    print(f"{family}: {clear.sum()}/{clear.size} greedy tokens compared, "
          f"{len(np.unique(theirs))} distinct, min top-1/top-2 gap {np.min(top2[..., 1] - top2[..., 0]):.2e}")
    assert clear.sum() >= 0.75 * clear.size, f"too many near-ties to compare ({family})"
    np.testing.assert_array_equal(ours[clear], theirs[clear])


@needs_torch
def test_logits_on_4x2_mesh(hf_models):
    """Parameters placed in their tensor-parallel shardings, the batch split over 4."""
    mesh = gpt.make_mesh(4, 2)
    for family in FAMILIES:
        path, hf = hf_models[family]
        model, host = load_backbone(path)
        params = gpt.place_params(model, mesh, host)
        q_kernel = params["params"]["blocks"]["attn"]["q"]["kernel"]
        assert q_kernel.sharding.spec == PartitionSpec(None, None, "shard")  # really tensor-parallel
        ids, mask = left_padded(load_tokenizer(path))
        batch = NamedSharding(mesh, PartitionSpec("batch"))
        ids_d, mask_d = jax.device_put(ids, batch), jax.device_put(mask, batch)
        diff = max_diff_at_real(our_logits(model, params, ids_d, mask_d), hf_logits(hf, ids, mask), mask)
        print(f"{family} on 4x2 mesh: max |logit diff| = {diff:.2e}")
        assert diff <= 1e-4, family


def assert_same_placed(placed, expected):
    """Two parameter trees on a mesh: the same shardings, and the same values on every device."""
    def same(a, b):
        assert a.sharding == b.sharding and a.dtype == b.dtype
        for x, y in zip(a.addressable_shards, b.addressable_shards):
            assert x.device == y.device and x.index == y.index
            np.testing.assert_array_equal(np.asarray(x.data), np.asarray(y.data))
    jax.tree.map(same, placed, expected)


@st.composite
def stored_blocks(draw):
    """A stored tensor (up to 4 axes, some of length 0 or 1, in each float dtype a file may
    hold) and a block of it: each axis cut anywhere, or whole."""
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=4)))
    index = []
    for n in shape:
        start = draw(st.integers(0, n))
        index.append(slice(start, draw(st.integers(start, n))))
    return shape, tuple(index), draw(st.sampled_from(checkpoints.FLOAT_DTYPES))


@fuzz_settings(60)
@hypothesis.given(stored=stored_blocks(), dtype=st.sampled_from(["float32", "bfloat16"]), seed=st.integers(0, 2**16))
def test_a_block_read_from_a_file_is_the_tensors_slice(tmp_path_factory, stored, dtype, seed):
    """TensorFiles reads a block a contiguous run at a time into an aligned array (which jax
    places without a copy): equal to numpy's slice of the stored tensor in the model's dtype,
    and only the block's bytes read."""
    shape, index, stored_dtype = stored
    tensor = np.random.default_rng(seed).standard_normal(shape).astype(stored_dtype)
    path = tmp_path_factory.mktemp("block")
    save_file({"pad": np.ones(3, np.float16), "w": tensor}, str(path / "model.safetensors"))  # w at an odd offset
    before = checkpoints.TensorFiles.bytes_read
    block = checkpoints.TensorFiles(str(path), dtype).get("w", shape)[index]
    np.testing.assert_array_equal(block, tensor[index].astype(dtype))
    assert block.dtype == np.dtype(dtype) and block.flags.c_contiguous
    assert block.ctypes.data % checkpoints.ALIGNMENT == 0 or not block.size
    assert checkpoints.TensorFiles.bytes_read - before == tensor[index].nbytes


@fuzz_settings(100)
@hypothesis.given(dtype=st.sampled_from(checkpoints.FLOAT_DTYPES), data=st.data())
def test_the_nan_check_reads_every_bit_pattern_as_isfinite_does(dtype, data):
    """checkpoints.all_finite (two integer maxima over the bits, no copy) against numpy's isfinite:
    any bit patterns, so every NaN, both infinities, -0 and the largest finite values."""
    bits = 8 * np.dtype(dtype).itemsize
    words = data.draw(st.lists(st.integers(0, 2**bits - 1), max_size=6))
    array = np.array(words, f"uint{bits}").view(dtype)
    assert checkpoints.all_finite(array) == bool(np.isfinite(array.astype(np.float64)).all())


@needs_torch
def test_parameters_made_on_the_mesh_from_the_files_are_the_host_trees_placed(hf_models):
    """load_backbone on a mesh reads each device's block from the files, through every
    family's layout (transposes, GPT-2's c_attn, NeoX's heads, Phi-3's fused q|k|v and
    gate|up, experts over "shard"): the arrays are those of the host tree placed, bit for
    bit, on 4x2 and 1x8, and in bfloat16; a block is read once per process, however many
    devices hold it."""
    for mesh in (gpt.make_mesh(4, 2), gpt.make_mesh(1, 8)):
        for family in FAMILIES:
            path = hf_models[family][0]
            model, host = load_backbone(path)
            before = checkpoints.TensorFiles.bytes_read
            _, placed = load_backbone(path, mesh=mesh)
            assert_same_placed(placed, gpt.place_params(model, mesh, host))
            # each block read once however many devices hold it: at most the float32 files' bytes
            assert checkpoints.TensorFiles.bytes_read - before <= 4 * sum(x.size for x in jax.tree.leaves(host))
    path = hf_models["qwen3_moe"][0]
    model, host = load_backbone(path, "bfloat16")
    assert_same_placed(load_backbone(path, "bfloat16", mesh)[1], gpt.place_params(model, mesh, host))


TWO_PROCESS_LOAD = """
import sys
import jax, numpy as np
jax.distributed.initialize(coordinator_address=sys.argv[2], num_processes=2, process_id=int(sys.argv[3]))
import checkpoints, gpt
from hf import load_backbone
# a 2x4 mesh whose "shard" axis spans both processes: each holds two of the four shards, each twice
d = jax.devices()
mesh = gpt.make_mesh(2, 4, devices=[d[4 * (s // 2) + 2 * b + s % 2] for b in range(2) for s in range(4)])
model, placed = load_backbone(sys.argv[1], mesh=mesh)
read = checkpoints.TensorFiles.bytes_read
_, host = load_backbone(sys.argv[1])
for a, whole in zip(jax.tree.leaves(placed), jax.tree.leaves(host)):
    for shard in a.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), whole[shard.index])
replicated = sum(a.nbytes for a in jax.tree.leaves(placed) if a.sharding.is_fully_replicated)
split = sum(a.nbytes for a in jax.tree.leaves(placed) if not a.sharding.is_fully_replicated)
print(read, replicated, split)
"""


@needs_torch
def test_two_processes_each_read_only_their_devices_blocks(hf_models):
    """Two processes of 4 devices, a 2x4 mesh with "shard" across them: each reads the
    whole of what is replicated and half of what is split (its two shards, each once for
    its two devices that hold it; two of Mixtral's four experts), counted in bytes, and
    places what the files hold."""
    path, port = hf_models["mixtral"][0], free_port()
    procs = [subprocess.Popen([sys.executable, "-c", TWO_PROCESS_LOAD, path, f"127.0.0.1:{port}", str(i)],
                              cwd=ROOT, env=child_env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    for out, _ in outs:
        read, replicated, split = map(int, out.split())
        print(f"one process read {read:,} bytes: {replicated:,} replicated + half of {split:,} split")
        assert split > 2 * replicated and read == replicated + split // 2


# A forward pass in DTYPE compiled after evaluate.start_processes set up the process, as the
# command line does: its temporaries, and a float32 copy of its parameters, in bytes
FORWARD_TEMPORARIES = r"""
import os, sys, types
import jax, jax.numpy as jnp
import evaluate, gpt
dtype = sys.argv[1]
evaluate.start_processes(types.SimpleNamespace(dtype=dtype, num_processes=1, coordinator=None))
model = gpt.GPT(n_layers=8, n_embd=256, n_head=4, block_size=64, vocab_size=320, param_dtype=dtype,
                activation_dtype=dtype)
tokens = jax.ShapeDtypeStruct((2, 64), jnp.int32)
variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((2, 64), jnp.int32)))
forward = jax.jit(lambda v, x: model.apply(v, x, deterministic=True)[0])
print(forward.lower(variables, tokens).compile().memory_analysis().temp_size_in_bytes,
      4 * sum(x.size for x in jax.tree.leaves(variables)), int("scheduler=false" in os.environ["XLA_FLAGS"]))
"""


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA's CPU scheduler")
def test_a_bfloat16_forward_converts_each_weight_where_it_is_used():
    """XLA's CPU matmuls take float32. For a bfloat16 model the command line selects XLA's
    memory-minimizing scheduler: each block's weights are converted when the block runs, so
    the temporaries stay far below a float32 copy of the model. A float32 model keeps the
    default scheduler (faster there), which in bfloat16 would convert them all first."""
    runs = {}
    for dtype in ("bfloat16", "float32"):
        proc = subprocess.run([sys.executable, "-c", FORWARD_TEMPORARIES, dtype], cwd=ROOT, env=child_env(1),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[dtype] = tuple(map(int, proc.stdout.split()))
    (bf16_temporaries, float32_copy, bf16_lean), (f32_temporaries, _, f32_lean) = runs["bfloat16"], runs["float32"]
    print(f"bfloat16 temporaries {bf16_temporaries / 2**20:.1f} MiB, a float32 copy of the model "
          f"{float32_copy / 2**20:.1f} MiB; float32's own temporaries {f32_temporaries / 2**20:.1f} MiB")
    assert bf16_temporaries < float32_copy / 4 and bf16_lean and not f32_lean


@needs_torch
@pytest.mark.parametrize("family", [f for f in NEW_FAMILIES if f in SCORED_FAMILIES])
def test_bfloat16_close_to_float32(hf_models, family):
    """Our bfloat16 logits are no further from transformers' float32 ones than twice
    transformers' own bfloat16 run, and the mean NLL (log perplexity) moves by under 1%.
    A mixture's worst token is one whose routing the rounding flips (its k-th and next
    expert nearly tied), in either implementation (2-4 of these 116 tokens move by over
    0.5 in both): there the error per token is compared on average, not at the worst."""
    path, hf = hf_models[family]
    ids, mask = left_padded(load_tokenizer(path))
    model, host = load_backbone(path, dtype="bfloat16")
    ours = our_logits(model, host, ids, mask)
    theirs = hf_logits(hf, ids, mask)
    theirs_bf16 = hf_logits(copy.deepcopy(hf).to(torch.bfloat16), ids, mask)
    ours_BT, their_BT = (np.abs(logits - theirs).max(-1)[mask] for logits in (ours, theirs_bf16))
    nll = lambda logits: float(gpt.token_nll(logits[:, :-1], ids[:, 1:])[mask[:, :-1]].mean())
    nll_change = abs(nll(ours) - nll(theirs)) / nll(theirs)
    print(f"{family} bfloat16: max |logit diff| to float32 {ours_BT.max():.2f}, mean {ours_BT.mean():.3f} "
          f"(transformers' bfloat16: {their_BT.max():.2f}, {their_BT.mean():.3f}; logits up to "
          f"{np.abs(theirs[mask]).max():.1f}), mean NLL rel change {nll_change:.1e}")
    compare = np.mean if family in MIXTURES else np.max
    assert compare(ours_BT) <= 2 * compare(their_BT) and nll_change <= 0.01


@needs_torch
def test_sharded_checkpoint_loads_like_single_file(hf_models, tmp_path):
    path, _ = hf_models["llama"]
    sharded = str(tmp_path / "sharded")
    shutil.copytree(path, sharded)
    os.remove(os.path.join(sharded, "model.safetensors"))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for k, part in enumerate((names[::2], names[1::2])):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, os.path.join(sharded, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    _, single = load_backbone(path)
    _, split = load_backbone(sharded)
    jax.tree.map(np.testing.assert_array_equal, single, split)


@needs_torch
def test_export_gpt2_round_trip(hf_models, tmp_path):
    """Native GPT-2-layout GPT -> HuggingFace directory -> transformers gives our logits,
    and load_backbone reads back the same parameters."""
    from transformers import GPT2LMHeadModel
    tokenizer_dir, _ = hf_models["gpt2"]
    model = gpt.GPT(n_layers=2, n_embd=64, n_head=4, block_size=64, vocab_size=VOCAB, mlp_hidden=96)
    params = gpt.nn.meta.unbox(model.init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32), deterministic=True))
    leaves, tree = jax.tree.flatten(params)  # nonzero biases, non-unit scales
    keys = jax.random.split(jax.random.key(2), len(leaves))
    params = jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    out = str(tmp_path / "exported")
    export_gpt2(model, params, out, tokenizer_dir=tokenizer_dir)

    hf = GPT2LMHeadModel.from_pretrained(out, local_files_only=True).eval()
    ids, mask = left_padded(load_tokenizer(out))
    np.testing.assert_array_equal((ids, mask), left_padded(load_tokenizer(tokenizer_dir)))
    diff = max_diff_at_real(our_logits(model, params, ids, mask), hf_logits(hf, ids, mask), mask)
    print(f"export_gpt2 round trip: max |logit diff| = {diff:.2e}")
    assert diff <= 1e-4
    back_model, back = load_backbone(out)
    assert back_model.vocab_size == VOCAB and back_model.tie_embeddings
    jax.tree.map(np.testing.assert_array_equal, params, back)


@needs_torch
def test_hub_style_files_load_like_transformers_saves(hf_models, tmp_path):
    """GPT-2 without the "transformer." prefix (as on the Hub) and weights stored in
    bfloat16 (as most Llama/Qwen checkpoints are) load into the same float32 tree."""
    import ml_dtypes
    _, saved = load_backbone(hf_models["gpt2"][0])
    path = rewrite(hf_models["gpt2"][0], str(tmp_path / "gpt2"), lambda t: t.update(
        {k.removeprefix("transformer."): t.pop(k) for k in list(t)}))
    jax.tree.map(np.testing.assert_array_equal, saved, load_backbone(path)[1])

    to_bf16 = lambda t: t.update({k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()})
    path = rewrite(hf_models["llama"][0], str(tmp_path / "llama"), to_bf16)
    _, f32 = load_backbone(hf_models["llama"][0])
    _, from_bf16 = load_backbone(path)
    rounded = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32), f32)
    jax.tree.map(np.testing.assert_array_equal, rounded, from_bf16)
    model, bf16 = load_backbone(path, dtype="bfloat16")
    assert model.param_dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(bf16)} == {np.dtype(ml_dtypes.bfloat16)}


def rewrite(src, dst, change):
    """Copy an HF directory, applying change(tensors) to its model.safetensors."""
    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return dst


@needs_torch
def test_unsupported_model_type(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "bert"}, f)
    with pytest.raises(UsageError, match=r"'bert'.*gpt2, llama, qwen2, qwen3, gpt_neox"):
        load_backbone(str(tmp_path))


@needs_torch
def test_missing_tensor(hf_models, tmp_path):
    name = "transformer.h.1.mlp.c_fc.bias"
    path = rewrite(hf_models["gpt2"][0], str(tmp_path / "m"), lambda t: t.pop(name))
    with pytest.raises(UsageError, match=name.replace(".", r"\.") + ".*missing"):
        load_backbone(path)


@needs_torch
def test_wrong_shape(hf_models, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"
    path = rewrite(hf_models["llama"][0], str(tmp_path / "m"),
                   lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(UsageError, match=name.replace(".", r"\.") + ".*shape"):
        load_backbone(path)


@needs_torch
def test_pickle_only_directory_is_refused_unread(hf_models, tmp_path):
    shutil.copy(os.path.join(hf_models["gpt2"][0], "config.json"), tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle, and never opened")
    with pytest.raises(UsageError, match="safetensors"):
        load_backbone(str(tmp_path))


def with_config(src, dst, **changes):
    """Copy an HF directory, changing keys of its config.json."""
    shutil.copytree(src, dst)
    config_file = Path(dst) / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **changes}))
    return str(dst)


# config.json as Hub checkpoints spell it (before transformers 5), the sizes of Llama-3.2-1B,
# a Llama 2 with linear scaling (the pre-4.45 "type"), Mistral-7B-v0.1, Gemma-3-1B and the
# text part of Gemma-3-4B; and the GPT fields each must become
LLAMA_1B = dict(model_type="llama", hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                num_hidden_layers=16, intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072,
                hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=500000.0)
GEMMA_1B = dict(model_type="gemma3_text", hidden_size=1152, num_attention_heads=4, num_key_value_heads=1,
                head_dim=256, num_hidden_layers=26, intermediate_size=6912, vocab_size=262144,
                max_position_embeddings=32768, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None, sliding_window=512,
                sliding_window_pattern=6, attn_logit_softcapping=None, final_logit_softcapping=None)
HUB_CONFIGS = {
    "llama-3.2-1b": ({**LLAMA_1B, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
                     dict(rope_theta=500000.0, rope_scaling=("llama3", 32.0, 1.0, 4.0, 8192), head_dim=64)),
    "llama-linear": ({**LLAMA_1B, "rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 4.0}},
                     dict(rope_theta=10000.0, rope_scaling=("linear", 4.0))),
    "mistral-7b": (dict(LLAMA_1B, model_type="mistral", hidden_size=4096, head_dim=None, num_hidden_layers=32,
                        rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False),
                   dict(sliding_window=4096, window_pattern="S", rope_scaling=None, head_dim=128)),
    "gemma-3-1b": (GEMMA_1B, dict(sliding_window=512, window_pattern="SSSSSG", rope_theta=1000000.0,
                                  local_rope_theta=10000.0, rope_scaling=None, attn_scale=1 / 16, mlp="geglu")),
    "gemma-3-4b-text": ({**GEMMA_1B, "hidden_size": 2560, "num_hidden_layers": 34, "sliding_window": 1024,
                         "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
                        dict(sliding_window=1024, window_pattern="SSSSSG", rope_scaling=("linear", 8.0),
                             local_rope_theta=10000.0)),
}


SHORT_FACTORS = [1.0 + i / 16 for i in range(48)]  # 48: Phi's head_dim 128 (x 0.75: 96) over 2
PHI_35 = dict(model_type="phi3", hidden_size=3072, num_attention_heads=32, num_key_value_heads=32, num_hidden_layers=32,
              intermediate_size=8192, vocab_size=32064, max_position_embeddings=131072, hidden_act="silu",
              original_max_position_embeddings=4096, rope_theta=10000.0, sliding_window=262144, rms_norm_eps=1e-5,
              rope_scaling={"type": "longrope", "short_factor": SHORT_FACTORS, "long_factor": SHORT_FACTORS[::-1]})
LONGROPE_4K = ("longrope", 4096, math.sqrt(1 + math.log(32) / math.log(4096)), *SHORT_FACTORS)
MIXTRAL = dict(model_type="mixtral", hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
               num_hidden_layers=32, intermediate_size=14336, vocab_size=32000, max_position_embeddings=32768,
               num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6, sliding_window=None, hidden_act="silu")
HUB_CONFIGS.update({  # the later families: Phi-3.5-mini, Phi-4-mini, Gemma-2-2B, OLMo-2-1B, Granite-3.0-2B and
    # the mixtures Mixtral-8x7B, Qwen3-30B-A3B, OLMoE-1B-7B
    "phi-3.5-mini": (PHI_35, dict(block_size=4096, rope_scaling=LONGROPE_4K, rotary_fraction=1.0,
                                  sliding_window=262144)),
    "phi-4-mini": ({**PHI_35, "num_attention_heads": 24, "num_key_value_heads": 8, "vocab_size": 200064,
                    "partial_rotary_factor": 0.75, "tie_word_embeddings": True},
                   dict(block_size=4096, rope_scaling=LONGROPE_4K, rotary_fraction=0.75, n_kv_head=8)),
    "gemma-2-2b": (dict(model_type="gemma2", hidden_size=2304, num_attention_heads=8, num_key_value_heads=4,
                        head_dim=256, num_hidden_layers=26, intermediate_size=9216, vocab_size=256000,
                        max_position_embeddings=8192, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096,
                        rope_theta=10000.0),
                   dict(window_pattern="SG", sliding_window=4096, attn_softcap=50.0, logit_softcap=30.0,
                        attn_scale=1 / 16, norm_offset=1.0, embed_scale=True)),
    "olmo-2-1b": (dict(model_type="olmo2", hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                       num_hidden_layers=16, intermediate_size=8192, vocab_size=100352, max_position_embeddings=4096,
                       rope_theta=500000.0, rms_norm_eps=1e-6, hidden_act="silu"),
                  dict(qk_norm_full=True, pre_norm=False, sandwich_norm=True, rope_theta=500000.0)),
    "granite-3.0-2b": (dict(model_type="granite", hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                            num_hidden_layers=40, intermediate_size=8192, vocab_size=49155,
                            max_position_embeddings=4096, embedding_multiplier=12.0, attention_multiplier=0.015625,
                            residual_multiplier=0.22, logits_scaling=8.0, tie_word_embeddings=True),
                       dict(embed_multiplier=12.0, attn_scale=0.015625, residual_multiplier=0.22, logits_scaling=8.0)),
    "mixtral-8x7b": (MIXTRAL, dict(n_experts=8, n_experts_per_token=2, norm_topk_prob=True, mlp_hidden=14336,
                                   sliding_window=None)),
    "qwen3-30b-a3b": (dict(model_type="qwen3_moe", hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                           head_dim=128, num_hidden_layers=48, intermediate_size=6144, moe_intermediate_size=768,
                           num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                           mlp_only_layers=[], vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
                           use_sliding_window=False, sliding_window=None, max_window_layers=48, hidden_act="silu"),
                      dict(n_experts=128, n_experts_per_token=8, norm_topk_prob=True, mlp_hidden=768, head_dim=128)),
    "olmoe-1b-7b": (dict(model_type="olmoe", hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                         num_hidden_layers=16, intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
                         norm_topk_prob=False, clip_qkv=None, vocab_size=50304, max_position_embeddings=4096,
                         rope_theta=10000.0),
                    dict(n_experts=64, n_experts_per_token=8, norm_topk_prob=False, mlp_hidden=1024,
                         qk_norm_full=True)),
})


def rotary_frequencies_of(config):
    """transformers' own inverse frequencies and cos/sin scale: {layer type (None: every
    layer): (inv_freq, attention scaling)}."""
    if config.model_type == "gemma3_text":
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
        rotary = Gemma3RotaryEmbedding(config)
        return {k: (getattr(rotary, f"{k}_inv_freq").numpy(), 1.0) for k in ("full_attention", "sliding_attention")}
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding  # its partial rotary
    rotary = (Phi3RotaryEmbedding if config.model_type == "phi3" else LlamaRotaryEmbedding)(config)
    return {None: (rotary.inv_freq.numpy(), rotary.attention_scaling)}


@needs_torch
@pytest.mark.parametrize("name", list(HUB_CONFIGS))
def test_hub_config_spellings_map_onto_gpt_fields(tmp_path, name):
    """A Hub-style config.json and transformers 5's rewrite of it (rope_parameters, layer_types)
    give the same GPT fields, whose rotary frequencies are transformers' own per layer."""
    raw, expected = HUB_CONFIGS[name]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(raw))
    config = hf.read_hf_config(str(tmp_path / "old"))
    fields = hf.hf_fields(config)
    assert {k: fields[k] for k in expected} == expected
    config.save_pretrained(tmp_path / "new")
    assert "rope_parameters" in json.loads((tmp_path / "new" / "config.json").read_text())
    assert hf.hf_fields(hf.read_hf_config(str(tmp_path / "new"))) == fields
    model = gpt.GPT(**fields)
    rot = int(model.head_width * model.rotary_fraction) // 2 * 2
    for layer_type, (theirs, scaling) in rotary_frequencies_of(config).items():
        depth = config.layer_types.index(layer_type) if layer_type else 0
        block = model.attention_config(model.is_local(depth))
        ours = gpt.rope_frequencies(rot, block.rope_theta, block.rope_scaling)
        np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-6)  # XLA's pow and torch's: an ulp apart
        assert (block.rope_scaling[2] if block.rope_scaling and block.rope_scaling[0] == "longrope" else 1.0) == scaling


LOCAL_LINEAR = {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 100000.0}}
REFUSED = [  # (family, config.json changes, what the one line says)
    ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 500.0,
                                    "original_max_position_embeddings": 64}), "rope scaling 'yarn' is not supported"),
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}), "'dynamic'"),
    ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 0.0, "rope_theta": 500.0}),
     "rope_scaling .*factor above 0"),
    ("llama", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                    "high_freq_factor": 1.0, "original_max_position_embeddings": 32,
                                    "rope_theta": 500.0}), "low_freq_factor < high_freq_factor"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8), "sliding-window attention is not supported"),
    ("mistral", dict(layer_types=["sliding_attention", "full_attention"]), "as 'ministral'"),
    ("mistral", dict(sliding_window=0), "sliding_window 0 is not a positive whole number"),
    ("gemma3", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma3", dict(rope_parameters=LOCAL_LINEAR), "rope scaling on sliding-window layers"),
    ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("qwen3_moe", dict(mlp_only_layers=[1]), "dense layers among the experts"),
    ("qwen2_moe", dict(decoder_sparse_step=2), "dense layers among the experts"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=8), "sliding-window attention is not supported"),
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv is not supported"),
    ("mixtral", dict(num_experts_per_tok=5), "num_experts_per_tok 5 is more than the 4 experts"),
]


@needs_torch
@pytest.mark.parametrize("family,changes,needle", REFUSED, ids=[f"{f}-{next(iter(c))}" for f, c, _ in REFUSED])
def test_unsupported_options_refused(hf_models, tmp_path, family, changes, needle):
    path = with_config(hf_models[family][0], tmp_path / "m", **changes)
    with pytest.raises(UsageError, match=needle):
        load_backbone(path)


@needs_torch
def test_config_with_fewer_layers_than_file(hf_models, tmp_path):
    path = with_config(hf_models["qwen3"][0], tmp_path / "m", num_hidden_layers=1,
                       layer_types=["full_attention"])
    with pytest.raises(UsageError, match=r"does not account for.*model\.layers\.1\."):
        load_backbone(path)


@needs_torch
def test_longrope_holds_to_its_original_context(hf_models):
    """Longrope (Phi-3.5, Phi-4-mini): past original_max_position_embeddings transformers
    switches every position of the sequence to the long factors (seen here: the first 72
    positions' logits change once the row is longer). The model's block_size is that
    original context, so the harness cuts every input to it, and the GPT refuses a longer
    sequence in one line rather than compute it with the short factors."""
    path, hf = hf_models["phi3"]
    model, host = load_backbone(path)
    assert model.block_size == 72 < hf.config.max_position_embeddings
    ids = np.asarray([load_tokenizer(path)(" ".join(TEXTS))["input_ids"] * 2], np.int32)[:, :100]
    mask = np.ones(ids.shape, bool)
    short = hf_logits(hf, ids[:, :72], mask[:, :72])
    assert np.abs(hf_logits(hf, ids, mask)[:, :72] - short).max() > 1e-2  # the switch
    assert max_diff_at_real(our_logits(model, host, ids[:, :72], mask[:, :72]), short, mask[:, :72]) <= 1e-4
    with pytest.raises(ValueError, match="longrope: 100 positions exceed original_max_position_embeddings 72"):
        our_logits(model, host, ids, mask)


def route_everything_to(expert):
    """Tensor changes that send every token to `expert` first in every layer: all
    embeddings share a large first coordinate (10), which RMSNorm keeps positive and near
    sqrt(64), and only that expert's router row reads it."""
    def change(tensors):
        tensors["model.embed_tokens.weight"][:, 0] = 10.0
        for name, router in tensors.items():
            if name.endswith("block_sparse_moe.gate.weight"):
                router[:, 0] = 0.0
                router[expert, 0] = 2.0
    return change


def tie_routers(tensors):
    """Experts 1 and 2 get the same router row and the same weights: their probabilities
    tie exactly at every token (often at the k-th place, where only one of them is taken)."""
    for name in list(tensors):
        if name.endswith("block_sparse_moe.gate.weight"):
            tensors[name][2] = tensors[name][1]
        if ".experts.2." in name:
            tensors[name] = tensors[name.replace(".experts.2.", ".experts.1.")].copy()


@needs_torch
@pytest.mark.parametrize("case", ["every_token_to_one_expert", "tied_routers"])
def test_mixture_routing_matches_transformers_at_the_extremes(hf_models, tmp_path, case):
    """Mixtral with every token sent to expert 3 (no capacity: none is dropped), and with
    two experts tied at every token (exactly 2 experts each, whichever of the tied ones
    each implementation takes): the logits are transformers' (1e-4), on 1x1 and 4x2."""
    from transformers import AutoModelForCausalLM
    change = route_everything_to(3) if case == "every_token_to_one_expert" else tie_routers
    path = rewrite(hf_models["mixtral"][0], str(tmp_path / "m"), change)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    ids, mask = left_padded(load_tokenizer(path))
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                 output_router_logits=True)
    top = np.stack([torch.topk(r, 2, -1).indices.numpy() for r in out.router_logits])  # [L, B*T, 2]
    real = mask.reshape(-1)
    if case == "every_token_to_one_expert":
        assert np.all(top[:, real, 0] == 3)
    else:
        probs = np.stack([torch.softmax(r, -1).numpy() for r in out.router_logits])[:, real]
        at_the_kth = np.isin(top[:, real], [1, 2]).sum(-1) == 1  # one of the tied pair taken, one left
        print(f"tied at the k-th place: {at_the_kth.sum()} of {at_the_kth.size} token-layers")
        assert np.all(probs[..., 1] == probs[..., 2]) and at_the_kth.sum() >= 10
    model, host = load_backbone(path)
    theirs = hf_logits(hf, ids, mask)
    for mesh in [(1, 1), (4, 2)]:
        m = gpt.make_mesh(*mesh, devices=jax.devices()[: mesh[0] * mesh[1]])
        put = lambda x: jax.device_put(x, gpt.input_sharding(model, m, ("batch", None)))
        diff = max_diff_at_real(our_logits(model, gpt.place_params(model, m, host), put(ids), put(mask)), theirs, mask)
        print(f"mixtral, {case}, mesh {mesh}: max |logit diff| = {diff:.2e}")
        assert diff <= 1e-4


@needs_torch
def test_python_hf_py_says_what_each_family_becomes(hf_models, capsys):
    """`python hf.py DIR` (hf.describe): the family's fields, with what its config adds."""
    says = {"gemma2": "attn_softcap=10.0", "phi3": "rope_scaling=('longrope', 72, 1.065", "olmo2": "pre_norm=False",
            "granite": "residual_multiplier=0.22", "mixtral": "n_experts=4", "qwen2_moe": "shared_expert_hidden=48",
            "qwen3_moe": "norm_topk_prob=True", "olmoe": "qk_norm_full=True"}
    for family, needle in says.items():
        hf.describe(hf_models[family][0])
        out = capsys.readouterr().out
        assert "M parameters" in out and "gpt.GPT(" in out and needle in out, (family, out)



HARNESS_DOCS = [{"text": t} for t in TEXTS] + [{"text": TEXTS[2] * 6}]  # the last one needs rolling windows
HARNESS_MC = [{"context": "The quick brown", "choices": [" fox", " dog", " numpy"], "gold": 0},
              {"context": "Hello, ", "choices": ["world!", "Universe."], "gold": 0}]


def hf_evaluator(path, mesh=(1, 1)):
    model, host = load_backbone(path)
    mesh = gpt.make_mesh(*mesh, devices=jax.devices()[: mesh[0] * mesh[1]])
    spec = jobs.ExecutionSpec(name="test")
    return evaluate.Evaluator.from_parts(spec, model, gpt.place_params(model, mesh, host), HFTokenizer(path),
                                         mesh, [], evaluate.EvaluatorConfig(quiet=True, batch_size=2))


def hf_continuation_logprob(hf, context, continuation):
    """Summed log p(continuation | context) straight from transformers, no padding."""
    ids = torch.tensor([(context + continuation)[:-1]])  # the last token predicts nothing
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=ids).logits[0].double(), -1)
    return sum(float(logp[len(context) - 1 + i, t]) for i, t in enumerate(continuation))


def hf_document_nll(hf, tokens, prefix, max_len):
    """Every token scored once, windows of max_len as in lm-eval's loglikelihood_rolling."""
    return -sum(hf_continuation_logprob(hf, ctx, cont)
                for ctx, cont in inference.rolling_requests(tokens, prefix, max_len))


@needs_torch
@pytest.mark.parametrize("family", SCORED_FAMILIES)
def test_harness_scores_match_transformers(hf_models, family):
    """On 1x1 and 4x2; the later families on 1x1 (the harness's own sharding is tested
    here with the others, their sharded layers and experts by test_logits_on_4x2_mesh and
    test_mixture_routing_matches_transformers_at_the_extremes)."""
    path, hf = hf_models[family]
    theirs = []  # transformers' numbers do not depend on our mesh: computed on the first
    for mesh in [(1, 1)] if family in LATER else [(1, 1), (4, 2)]:
        ev = hf_evaluator(path, mesh)
        tok = ev.tokenizer
        ours, first = [], not theirs
        ppl = evaluate.PerplexityEvaluation("ppl", HARNESS_DOCS).result(ev, tok)
        assert len(tok.encode(HARNESS_DOCS[-1]["text"])) > ev.max_len  # really rolled
        for record, doc in zip(ppl.records, HARNESS_DOCS):
            doc_ids = tok.encode(doc["text"], add_special_tokens=False)  # the harness adds prefix_id only
            ours.append(record["nll"])
            theirs += [hf_document_nll(hf, doc_ids, ev.prefix_id, ev.max_len)] if first else []
        mc = evaluate.MultipleChoiceEvaluation("mc", HARNESS_MC).result(ev, tok)
        for record, sample in zip(mc.records, HARNESS_MC):
            for choice, ll in zip(sample["choices"], record["loglik"]):
                ctx, cont = evaluate.encode_pair(tok, sample["context"], choice)
                ours.append(ll)
                theirs += [hf_continuation_logprob(hf, ctx, cont)] if first else []
        ours = np.array(ours)
        print(f"{family} on mesh {mesh}: max rel diff {np.max(np.abs(ours - np.array(theirs)) / np.abs(theirs)):.1e}")
        np.testing.assert_allclose(ours, theirs, rtol=1e-4)


@needs_torch
def test_huggingface_model_saved_native_reloads_identically(hf_models, tmp_path):
    path, _ = hf_models["qwen3"]
    model, host = load_backbone(path)
    mesh = gpt.make_mesh(1, 1, devices=jax.devices()[:1])
    checkpoints.save_checkpoint(str(tmp_path / "native"), model, gpt.place_params(model, mesh, host),
                         HFTokenizer(path).describe())
    restored, variables, config = checkpoints.load_checkpoint(str(tmp_path / "native"), mesh)
    tokenizer = jobs.load_tokenizer(config, str(tmp_path / "native"))
    ids, mask = left_padded(tokenizer.tok)
    np.testing.assert_array_equal(our_logits(model, host, ids, mask), our_logits(restored, variables, ids, mask))
    assert tokenizer.encode(TEXTS[0]) == HFTokenizer(path).encode(TEXTS[0])


@needs_torch
def test_cli_on_a_huggingface_directory(hf_models, tmp_path):
    """Its scores are transformers', in float32 and bfloat16, and the process reads the
    config and the tokenizer through transformers without importing torch (installed here),
    lm-eval's tasks included (where lm-eval is installed: a task from a JSON file beside)."""
    path, hf = hf_models["gpt2"]
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps(d) + "\n" for d in HARNESS_DOCS[:2]))
    task = []
    if tasks.lm_eval is not None:
        (tmp_path / "choose.yaml").write_text(json.dumps(
            {"task": "choose", "dataset_path": "json", "dataset_name": None, "test_split": "test",
             "dataset_kwargs": {"data_files": {"test": str(write_jsonl(tmp_path / "q.jsonl", MC[:2]))}},
             "doc_to_text": "context", "output_type": "multiple_choice", "doc_to_choice": "choices",
             "doc_to_target": "gold", "metric_list": [{"metric": "acc"}]}))
        task = ["--tasks", "choose", "--include-path", tmp_path, "--bootstrap-iters", "0"]
    proc = cli("--ckpt", path, "--data", f"ppl:{docs}", *task, "--out", tmp_path / "o", "--log-samples", "--quiet",
               PYTHONPROFILEIMPORTTIME="1")  # a line on stderr for each module imported
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert {"transformers.configuration_utils", "transformers.tokenization_utils_base", "tokenizers"} <= imported
    assert not {name for name in imported if name.split(".")[0] == "torch"}
    results = json.loads((tmp_path / "o" / "results.json").read_text())
    assert results["job"] == "backbone/evaluate"
    tok = HFTokenizer(path)
    samples = [json.loads(l) for l in (tmp_path / "o" / "samples.jsonl").read_text().splitlines()]
    for sample, doc in zip(samples, HARNESS_DOCS):
        expected = hf_document_nll(hf, tok.encode(doc["text"], add_special_tokens=False), tok.eos_token_id, 128)
        np.testing.assert_allclose(sample["nll"], expected, rtol=1e-4)
    # bfloat16 parameters and activations: the same documents, close to the float32 numbers
    proc = cli("--ckpt", path, "--data", f"ppl:{docs}", "--out", tmp_path / "bf16", "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.splitlines()[-1] == f"results: {tmp_path / 'bf16' / 'results.json'}"  # says where
    bf16 = json.loads((tmp_path / "bf16" / "results.json").read_text())
    assert bf16["model"]["param_dtype"] == "bfloat16"
    np.testing.assert_allclose(bf16["results"]["docs"], results["results"]["docs"], rtol=0.05)


# ---- scoring conventions against lm-evaluation-harness itself (offline)

try:
    import lm_eval
except ImportError:
    lm_eval = None
needs_lm_eval = pytest.mark.skipif(torch is None or lm_eval is None, reason="needs torch and "
                                   "lm-evaluation-harness (test-only: pip install 'lm-eval[hf]')")

CONTEXT = 64  # n_positions: lm-eval's max_length (from the config) and our block_size
LM_DOCS = [{"text": t} for t in TEXTS] + [
    {"text": "  leading spaces, a tab\tand ünïcödé\nthen a second line."},
    {"text": TEXTS[2] * 5},  # several rolling windows
    {"text": " ".join(TEXTS) * 2},  # a window boundary elsewhere
]
LM_MC = [  # contexts ending in spaces; choices without and with a leading space (appended as given)
    {"context": "The quick brown ", "choices": ["fox", "dog", " numpy"], "gold": 0},
    {"context": "Hello, ", "choices": ["world!", "Universe.", " world!"], "gold": 1},
    {"context": "In the beginning", "choices": [" the Universe was created.", " a fox", "!"], "gold": 0},
    {"context": "x = np.zeros(3)  ", "choices": ["# zeros", "\n", "return x * 2"], "gold": 2},
    {"context": "Numbers like ", "choices": ["12, 345", "ünïcödé", "6789 appear too"], "gold": 2},
    {"context": TEXTS[2] * 4 + " ", "choices": ["This", "That has made a lot"], "gold": 1},  # cut left
    {"context": "", "choices": ["Hello", " Hello", "The quick"], "gold": 2},  # BOS/EOS as the context
]
LM_GEN_NEW = 8
LM_GEN = [{"prompt": t[: len(t) // 2], "answer": t[len(t) // 2:]} for t in TEXTS] + [
    {"prompt": "def f(x):\n    return", "answer": " x * 2"},
    {"prompt": TEXTS[2] * 4, "answer": ""},  # longer than the room left: cut from the left
]


def make_gpt2(out_dir, seed=0, positions=CONTEXT):
    """A random tiny GPT-2 (initializer_range 0.2 and perturbed biases: peaked, untied scores)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    eot = train_tokenizer(out_dir).token_to_id(EOT)
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=positions, n_embd=64, n_layer=2, n_head=4, n_inner=96,
                        bos_token_id=eot, eos_token_id=eot, initializer_range=0.2)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(out_dir)
    return model


def write_task(task_dir, data_dir, name, lines, **fields):
    data = os.path.join(data_dir, f"{name}.jsonl")
    with open(data, "w") as f:
        f.write("".join(json.dumps(x) + "\n" for x in lines))
    config = {"task": name, "dataset_path": "json",
              "dataset_kwargs": {"data_files": {"test": data}, "cache_dir": os.path.join(data_dir, "cache")},
              "test_split": "test", **fields}
    with open(os.path.join(task_dir, f"{name}.yaml"), "w") as f:
        json.dump(config, f, indent=1)  # JSON is YAML


def run_lm_eval(model_dir, task_dir, tasks):
    """lm-eval's "hf" model on our local tasks: {task: samples ordered by doc_id}."""
    from lm_eval.tasks import TaskManager
    out = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": model_dir, "dtype": "float32"},
                                  tasks=tasks, device="cpu", batch_size=4,
                                  task_manager=TaskManager(include_path=task_dir, include_defaults=False),
                                  log_samples=True, bootstrap_iters=0)
    return {task: sorted(rows, key=lambda s: s["doc_id"]) for task, rows in out["samples"].items()}


def our_evaluator(model_dir):
    model, host = load_backbone(model_dir)
    assert model.block_size == CONTEXT
    mesh = gpt.make_mesh(1, 1, devices=jax.devices()[:1])
    ev = evaluate.Evaluator.from_parts(jobs.ExecutionSpec(name="lmeval"), model, gpt.place_params(model, mesh, host),
                                       HFTokenizer(model_dir), mesh, [],
                                       evaluate.EvaluatorConfig(quiet=True, batch_size=4))
    assert ev.max_len == CONTEXT
    return ev


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    if torch is None or lm_eval is None:
        pytest.skip("needs torch and lm-eval")
    """(model directory, task directory) with the three tasks written."""
    root = tmp_path_factory.mktemp("lmeval")
    model_dir, task_dir, data_dir = (str(root / d) for d in ("model", "tasks", "data"))
    for d in (task_dir, data_dir):
        os.makedirs(d)
    make_gpt2(model_dir)
    write_task(task_dir, data_dir, "ours_ppl", LM_DOCS, output_type="loglikelihood_rolling",
               doc_to_text="", doc_to_target="text", metric_list=[{"metric": "byte_perplexity"}])
    write_task(task_dir, data_dir, "ours_mc", LM_MC, output_type="multiple_choice", doc_to_text="context",
               doc_to_choice="choices", doc_to_target="gold", target_delimiter="",
               metric_list=[{"metric": "acc"}, {"metric": "acc_norm"}])
    write_task(task_dir, data_dir, "ours_gen", LM_GEN, output_type="generate_until", doc_to_text="prompt",
               doc_to_target="answer", target_delimiter="",
               generation_kwargs={"until": ["\n"], "max_gen_toks": LM_GEN_NEW, "do_sample": False},
               metric_list=[{"metric": "exact_match"}])
    return model_dir, task_dir


@pytest.fixture(scope="module")
def both_runs(workdir):
    """(lm-eval's samples per task, our Results per kind, our evaluator, the model directory)."""
    model_dir, task_dir = workdir
    started = time.time()
    samples = run_lm_eval(model_dir, task_dir, ["ours_ppl", "ours_mc", "ours_gen"])
    lm_seconds = time.time() - started
    started = time.time()
    ev = our_evaluator(model_dir)
    ours = {"ppl": evaluate.PerplexityEvaluation("ppl", LM_DOCS).result(ev, ev.tokenizer),
            "mc": evaluate.MultipleChoiceEvaluation("mc", LM_MC).result(ev, ev.tokenizer),
            "gen": evaluate.RolloutEvaluation("gen", LM_GEN, max_new_tokens=LM_GEN_NEW, stop=("\n",)).result(
                ev, ev.tokenizer)}
    print(f"\nlm-eval: {lm_seconds:.1f}s, ours: {time.time() - started:.1f}s")
    return samples, ours, ev, model_dir


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@needs_lm_eval
def test_rolling_nll_matches_lm_eval(both_runs):
    samples, ours, ev, _ = both_runs
    rows = samples["ours_ppl"]
    assert [s["doc"]["text"] for s in rows] == [d["text"] for d in LM_DOCS]
    assert max(len(ev.tokenizer.encode(d["text"])) for d in LM_DOCS) > 2 * CONTEXT  # really rolled
    worst = 0.0
    for sample, record in zip(rows, ours["ppl"].records):
        (theirs,) = sample["filtered_resps"]  # the document's summed log-likelihood
        assert float(sample["resps"][0][0]) == float(theirs)
        worst = max(worst, rel(record["nll"], -float(theirs)))
        np.testing.assert_allclose(record["nll"], -float(theirs), rtol=1e-4)
        assert record["tokens"] == len(ev.tokenizer.encode(sample["doc"]["text"]))
    print(f"ppl: {len(rows)} documents, max relative nll difference {worst:.2e}")


@needs_lm_eval
def test_multiple_choice_matches_lm_eval(both_runs):
    samples, ours, ev, _ = both_runs
    rows = samples["ours_mc"]
    assert len(ev.tokenizer.encode(LM_MC[-2]["context"])) > CONTEXT  # lm-eval and we cut it from the left
    assert [s["doc"]["context"] for s in rows] == [m["context"] for m in LM_MC]
    worst, gaps = 0.0, []
    for sample, record, doc in zip(rows, ours["mc"].records, LM_MC):
        # lm-eval's requests: (context, target_delimiter "" + the choice exactly as given)
        assert [tuple(a) for a in sample["arguments"]] == [(doc["context"], c) for c in doc["choices"]]
        theirs = [float(r[0]) for r in sample["filtered_resps"]]
        assert len(theirs) == len(doc["choices"]) == len(record["loglik"])
        for ll, t in zip(record["loglik"], theirs):
            worst = max(worst, rel(ll, t))
        np.testing.assert_allclose(record["loglik"], theirs, rtol=1e-4)
        top = np.sort(theirs)[-2:]
        gaps.append(top[1] - top[0])
        assert record["pred"] == int(np.argmax(theirs))
        assert record["score"] == sample["acc"]
        assert record["acc_norm"] == sample["acc_norm"]
        # acc_norm: log-likelihood / len(choice) in characters (not tokens, not bytes)
        lens = np.array([float(len(c)) for c in doc["choices"]])
        assert record["acc_norm"] == float(np.argmax(np.array(theirs) / lens) == doc["gold"])
    assert min(gaps) > 1e-3, "near-tie between choices: the pred comparison would be fragile"
    accs = [r["score"] for r in ours["mc"].records], [s["acc"] for s in rows]
    norms = [r["acc_norm"] for r in ours["mc"].records], [s["acc_norm"] for s in rows]
    print(f"mc: {sum(map(len, (m['choices'] for m in LM_MC)))} choices, max relative loglik difference "
          f"{worst:.2e}; acc ours/lm-eval {accs}; acc_norm {norms}; min top-2 gap {min(gaps):.3f}")
    # a meaningful check: acc and acc_norm differ on some sample
    assert accs[0] != norms[0]


def greedy_gaps(model_dir, ev, prompt):
    """transformers' greedy top-1/top-2 logit gaps over LM_GEN_NEW steps from the left-cut prompt."""
    from transformers import GPT2LMHeadModel
    hf = GPT2LMHeadModel.from_pretrained(model_dir, local_files_only=True).eval()
    ids = (ev.tokenizer.encode(prompt) or [ev.prefix_id])[-(CONTEXT - LM_GEN_NEW):]
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=LM_GEN_NEW, do_sample=False,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    top2 = np.sort(np.stack([s[0].float().numpy() for s in out.logits]), -1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


@needs_lm_eval
def test_greedy_generation_matches_lm_eval(both_runs):
    samples, ours, ev, model_dir = both_runs
    rows = samples["ours_gen"]
    assert [s["doc"]["prompt"] for s in rows] == [g["prompt"] for g in LM_GEN]
    assert ours["gen"].records[-1]["truncated"]
    compared, outputs = 0, []
    for sample, record, doc in zip(rows, ours["gen"].records, LM_GEN):
        (theirs,) = sample["filtered_resps"]
        outputs.append((record["output"], theirs))
        if record["output"] != theirs:  # allowed only where float noise could flip a step
            assert greedy_gaps(model_dir, ev, doc["prompt"]).min() < 1e-3, (doc["prompt"], record["output"], theirs)
            continue
        compared += 1
        assert record["score"] == float(sample["exact_match"])
    print(f"gen: {compared}/{len(rows)} greedy outputs identical: {outputs}")
    assert compared >= len(rows) - 1
    assert any(o for o, _ in outputs), "all outputs empty: the comparison says little"


@needs_lm_eval
def test_lm_eval_scripts_reach_our_model_by_name_and_as_an_object(both_runs, workdir):
    """As lm-eval's users script their runs: simple_evaluate(model="gpt-eval", model_args=...)
    (the name tasks.py registers) and simple_evaluate(model=JaxLM(InferenceJob(...))) answer
    every request of the three tasks as lm-eval's own HF model does; a batch size of "auto"
    is refused in one line before anything loads."""
    from lm_eval.tasks import TaskManager
    samples, _, ev, model_dir = both_runs
    names = ["ours_ppl", "ours_mc", "ours_gen"]
    run = lambda model, model_args=None: lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=names, log_samples=True, bootstrap_iters=0,
        task_manager=TaskManager(include_path=workdir[1], include_defaults=False))
    by_name = run(tasks.MODEL_NAME, f"pretrained={model_dir},batch_size=4,mesh=1x1,dtype=float32")
    by_object = run(tasks.JaxLM(ev))
    assert by_name["config"]["model"] == "gpt-eval"
    for out in (by_name, by_object):
        for name in names:
            compare_samples(samples[name], out["samples"][name])
    with pytest.raises(UsageError, match="model_args batch_size must be int, got 'auto'"):
        tasks.JaxLM.create_from_arg_string(f"pretrained={model_dir},batch_size=auto")


# model_args that the command line refuses as options (lm-eval's parser makes "0" an int, "true"
# True, "8" an int), each with the words of its one line and the option the command line refuses
REFUSED_MODEL_ARGS = [
    ("batch_size=0", "model_args batch_size must be at least 1", ["--batch-size", "0"]),
    ("batch_size=-1", "model_args batch_size must be at least 1", ["--batch-size", "-1"]),
    ("chunks=0", "model_args chunks must be at least 1", ["--chunks", "0"]),
    ("mesh=8", "model_args mesh: mesh '8' is not BATCHxSHARD", ["--mesh", "8"]),
    ({"mesh": [4, 2]}, "model_args mesh: mesh '[4, 2]' is not BATCHxSHARD", ["--mesh", "[4, 2]"]),
    ("seed=-1", "model_args seed must be in [0, 2147483647]", ["--seed", "-1"]),
    ("dtype=float16", "model_args dtype must be float32 or bfloat16, got 'float16'", ["--dtype", "float16"]),
    ("dtype=float8", "model_args dtype must be float32 or bfloat16, got 'float8'", ["--dtype", "float8"]),
    ("batch_size=true", "model_args batch_size must be int, got 'True'", ["--batch-size", "True"]),
    ({"batch_size": 2.0}, "model_args batch_size must be int, got '2.0'", ["--batch-size", "2.0"]),
    ("max_gen_toks=0", "model_args max_gen_toks must be at least 1", ["--max-new-tokens", "0"]),
    ("foo=1", "unknown model_args foo; known: batch_size", ["--foo", "1"])]


@needs_lm_eval
def test_lm_eval_model_args_are_checked_as_the_command_line_checks_its_options(ckpt):
    """simple_evaluate(model="gpt-eval", model_args=...) refuses in one line naming the
    argument, before anything loads, each value the command line refuses for its option (the
    same dataclass's checks, jobs.ModelOptions), and simple_evaluate's batch_size where
    model_args says another; what it takes (a quoted number as text) reaches the job."""
    run = lambda model_args, **kw: lm_eval.simple_evaluate(model=tasks.MODEL_NAME, model_args=model_args,
                                                           tasks=["never-loaded"], **kw)
    for model_args, words, option in REFUSED_MODEL_ARGS:
        given = ({"pretrained": str(ckpt), **model_args} if isinstance(model_args, dict)
                 else f"pretrained={ckpt},{model_args}")
        with pytest.raises(UsageError, match=re.escape(words)):
            run(given)
        with pytest.raises(UsageError, match=re.escape(option[0])):
            jobs.parse_options(evaluate.EvaluatorConfig, option).validate()
    with pytest.raises(UsageError, match="model_args pretrained is needed"):
        run("batch_size=2")
    with pytest.raises(UsageError, match="model_args pretrained is given twice"):  # lm-eval would take the last
        run(f"pretrained={ckpt},batch_size=2,pretrained=elsewhere")
    with pytest.raises(UsageError, match="model_args mesh: mesh 64x1 needs 64 devices"):  # parsed, then too big
        run(f"pretrained={ckpt},mesh=64x1")
    with pytest.raises(UsageError, match="model_args batch_size 4 and simple_evaluate's batch_size 8 differ"):
        run(f"pretrained={ckpt},batch_size=4", batch_size=8)
    lm = tasks.JaxLM.create_from_arg_string(f"pretrained={ckpt},batch_size='2',mesh=1x1,seed=3,device=cpu")
    assert (lm.inference.batch_size, lm.seed, lm.inference.seed, lm.max_gen_toks) == (2, 3, 3, 256)


@needs_lm_eval
def test_reloading_tasks_keeps_gpt_eval_registered():
    """importlib.reload(tasks) (a notebook's autoreload reloads too) registered JaxLM again, which
    lm-eval refuses for a second class under a name (ValueError: alias 'gpt-eval' already
    registered): the name keeps the class first registered."""
    from lm_eval.api.registry import get_model
    first = get_model(tasks.MODEL_NAME)
    importlib.reload(tasks)
    assert get_model(tasks.MODEL_NAME) is first and first.__qualname__ == "JaxLM" and tasks.JaxLM is not first


@needs_lm_eval
def test_lm_eval_chat_turns_by_name_without_a_template_are_refused_in_one_line(ckpt, tmp_path):
    """simple_evaluate(model="gpt-eval", ..., apply_chat_template=True) on a checkpoint whose
    tokenizer has no chat template (the byte tokenizer): the line --apply-chat-template gives,
    naming the argument, where lm-eval's request building met None.apply_chat_template."""
    from lm_eval.tasks import TaskManager
    write_task(str(tmp_path), str(tmp_path), "chat_mc", MC[:1], output_type="multiple_choice",
               doc_to_text="context", doc_to_choice="choices", doc_to_target="gold", metric_list=[{"metric": "acc"}])
    with pytest.raises(UsageError, match="^apply_chat_template: the tokenizer of this model has no chat template$"):
        lm_eval.simple_evaluate(model=tasks.MODEL_NAME, model_args=f"pretrained={ckpt},mesh=1x1", tasks=["chat_mc"],
                                task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
                                apply_chat_template=True)


@needs_lm_eval
def test_bos_adding_tokenizer_follows_lm_eval_except_its_double_bos(workdir, tmp_path):
    """A tokenizer that prepends BOS (Llama, Mistral): multiple-choice contexts start with it,
    exactly as lm-eval 0.4 scores them. For perplexity we prepend BOS once; lm-eval also lets
    the tokenizer add it, scoring p(BOS | BOS) and shifting windows (its issue #3333)."""
    from tokenizers import Tokenizer, processors
    model_dir, task_dir = workdir
    bos_dir = str(tmp_path / "bos")
    shutil.copytree(model_dir, bos_dir)
    tok = Tokenizer.from_file(os.path.join(bos_dir, "tokenizer.json"))
    bos = tok.token_to_id(EOT)
    tok.post_processor = processors.TemplateProcessing(single=f"{EOT} $A", pair=f"{EOT} $A $B",
                                                       special_tokens=[(EOT, bos)])
    tok.save(os.path.join(bos_dir, "tokenizer.json"))
    samples = run_lm_eval(bos_dir, task_dir, ["ours_mc", "ours_ppl"])
    ev = our_evaluator(bos_dir)
    assert ev.tokenizer.encode("Hello")[0] == bos  # the tokenizer really adds BOS
    mc = evaluate.MultipleChoiceEvaluation("mc", LM_MC).result(ev, ev.tokenizer)
    for record, sample in zip(mc.records, samples["ours_mc"]):
        np.testing.assert_allclose(record["loglik"], [float(r[0]) for r in sample["filtered_resps"]], rtol=1e-4)
    ppl = evaluate.PerplexityEvaluation("ppl", LM_DOCS).result(ev, ev.tokenizer)
    plain = evaluate.PerplexityEvaluation("ppl", LM_DOCS).result(our_evaluator(model_dir), ev.tokenizer)
    assert [r["nll"] for r in ppl.records] == [r["nll"] for r in plain.records]  # BOS once, not twice
    # lm-eval's rolling log-likelihoods are exactly ours with its extra BOS: the document encoded
    # with the tokenizer's BOS, after the prefix BOS; without it, ours differ from them
    theirs = [float(s["filtered_resps"][0]) for s in samples["ours_ppl"]]
    doubled = [sum(s.logprob for s in windows)
               for windows in ev.loglikelihood_rolling(ev.tokenizer.encode(d["text"]) for d in LM_DOCS)]
    np.testing.assert_allclose(doubled, theirs, rtol=1e-5)
    differences = [rel(-r["nll"], t) for r, t in zip(ppl.records, theirs)]
    assert min(differences) > 1e-3
    print(f"#3333: lm-eval vs ours with its double BOS: max rel {max(map(rel, doubled, theirs)):.1e}; "
          f"vs ours: {min(differences):.1e} to {max(differences):.1e}")


# ---- the lm-eval backend: lm-eval's own tasks on our model, against lm-eval's HF model (offline)
# Local task YAMLs `include:` the installed ones (their prompts, process_docs, filters and
# metrics are lm-eval's own) and point them at JSONL data written here, in the real datasets'
# shapes. One run of each side over every task answers all the parity tests below.

HARNESS_CONTEXT = 128  # room for few-shot prompts
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WORDS = ("the cat sat on the mat and the dog saw a bird in the tree near the old house while "
         "children played quietly numbers like 12 345 and 6789 appear too").split()
BOOTSTRAP = 1000  # lm-eval's bootstrap stderrs (perplexities): both sides, fewer resamples than 100000


def sentence(i, n=12):
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n))


def hellaswag_docs(n, offset=0):
    """Rowan/hellaswag rows (lm-eval's process_docs builds query, choices and gold from them)."""
    return [{"ind": i, "activity_label": ["Cooking", "Sports", "Home [title] tips"][i % 3],
             "ctx_a": sentence(i, 8) + ".", "ctx_b": sentence(i + 1, 3), "ctx": "",
             "endings": [sentence(i + k, 4 + k) + "." for k in range(4)], "source_id": f"s{i}",
             "split": "val", "split_type": "indomain", "label": str(i % 4)} for i in range(offset, offset + n)]


def arc_docs(n, offset=0):
    """allenai/ai2_arc rows: 3 or 4 choices, labelled A-D or 1-4."""
    docs = []
    for i in range(offset, offset + n):
        k = 3 + i % 2
        labels = list("ABCD")[:k] if i % 3 else [str(j + 1) for j in range(k)]
        docs.append({"id": f"q{i}", "question": sentence(i, 6) + "?", "answerKey": labels[i % k],
                     "choices": {"text": [sentence(i + j, 2 + j % 3) for j in range(k)], "label": labels}})
    return docs


def lambada_docs(model, tokenizer, n):
    """EleutherAI/lambada_openai rows. Half end in the model's own greedy next word, so that
    lm-eval's acc (the continuation is the argmax) is 1 on some documents and 0 on others."""
    greedy, plain = [], []
    for i in range(200):
        context = sentence(i, 6 + i % 5)
        with torch.no_grad():
            logits = model(torch.tensor([tokenizer.encode(context)])).logits[0, -1]
        word = tokenizer.decode([int(logits.argmax())])
        if len(greedy) < n // 2 and re.fullmatch(r" [A-Za-z]+", word):
            greedy.append({"text": context + word})
        elif len(plain) < n - n // 2:
            plain.append({"text": context + " " + WORDS[i % len(WORDS)]})
    assert len(greedy) == n // 2, "too few contexts whose greedy next token is a word"
    return greedy + plain


def wikitext_docs(n):
    """EleutherAI/wikitext_document_level rows (wikitext markup, detokenized by lm-eval);
    the longer ones need several rolling windows."""
    base = (" = Title = \n The cat @-@ dog sat on the mat , and 1 @,@ 000 birds ( many ) sang . \n"
            " It was the year 1 @.@ 5 ; nobody knew . \n")
    return [{"page": base * (1 + 3 * i) + sentence(i, 20)} for i in range(n)]


def gsm8k_docs(n, offset=0, answers=None):
    """openai/gsm8k rows: "#### " and the sum, or one of `answers` (numbers this model writes:
    a random model solves nothing, but its digits sometimes match)."""
    return [{"question": f"Tom has {3 + i} apples and buys {10 + 2 * i} more. How many apples?",
             "answer": f"He has {3 + i} + {10 + 2 * i} apples.\n#### "
                       f"{answers[i % len(answers)] if answers else 13 + 3 * i}"}
            for i in range(offset, offset + n)]


def write_lm_task(task_dir, data_dir, name, splits, **fields):
    """A task YAML (JSON is YAML) over local JSONL files, one per split: dataset_path json,
    data_files, and dataset_name null (else the included config name, e.g. ARC-Easy, would be
    taken for a json builder config)."""
    files = {split: str(write_jsonl(Path(data_dir) / f"{name}_{split}.jsonl", rows)) for split, rows in splits.items()}
    config = {"task": name, "dataset_path": "json", "dataset_name": None,
              "dataset_kwargs": {"data_files": files, "cache_dir": str(Path(data_dir) / "cache")}, **fields}
    (Path(task_dir) / f"{name}.yaml").write_text(json.dumps(config, indent=1))


def write_harness_tasks(task_dir, data_dir, stand_in, model, tokenizer, n=6):
    """Local tasks in the shapes of lm-eval's hellaswag, arc_easy, lambada_openai, wikitext and
    gsm8k (0-shot and 2-shot), a sampled gsm8k, and a task importing HuggingFace's `evaluate`."""
    installed = Path(lm_eval.__file__).parent / "tasks"
    include = lambda path: {"include": str(installed / path)}
    write_lm_task(task_dir, data_dir, "local_hellaswag", {"train": hellaswag_docs(4, 100),
                  "validation": hellaswag_docs(n)}, **include("hellaswag/hellaswag.yaml"))
    write_lm_task(task_dir, data_dir, "local_arc_easy", {"train": arc_docs(4, 100), "validation": arc_docs(2, 200),
                  "test": arc_docs(n)}, num_fewshot=2, **include("arc/arc_easy.yaml"))
    write_lm_task(task_dir, data_dir, "local_lambada", {"test": lambada_docs(model, tokenizer, n)},
                  **include("lambada/lambada_openai.yaml"))
    write_lm_task(task_dir, data_dir, "local_wikitext", {"train": wikitext_docs(2), "validation": wikitext_docs(2),
                  "test": wikitext_docs(4)}, **include("wikitext/wikitext.yaml"))
    write_lm_task(task_dir, data_dir, "local_gsm8k", {"train": gsm8k_docs(4, 100),
                  "test": gsm8k_docs(n, answers=[34, 7, 1, 9, 5, 2])},
                  num_fewshot=2, generation_kwargs={"until": ["Question:", "</s>", "<|im_end|>", "ces"],
                                                    "do_sample": False, "max_gen_toks": 24},
                  **include("gsm8k/gsm8k.yaml"))
    variants = {"local_hellaswag_2shot": {"include": "local_hellaswag.yaml", "num_fewshot": 2},
                "local_gsm8k_sampled": {"include": "local_gsm8k.yaml", "num_fewshot": 0, "repeats": 2,
                                        "generation_kwargs": {"until": ["Question:"], "do_sample": True,
                                                              "temperature": 0.8, "top_p": 0.9,
                                                              "max_gen_toks": 16}}}
    for name, fields in variants.items():  # includes relative to this directory
        (Path(task_dir) / f"{name}.yaml").write_text(json.dumps({"task": name, **fields}))
    write_clash_task(task_dir, data_dir, stand_in)
    write_torch_task(task_dir)


def write_clash_task(task_dir, data_dir, stand_in):
    """What some of lm-eval's tasks do (squad_v2, mbpp, ...): their utils.py imports
    HuggingFace's `evaluate` package. It scores 1 when that import gave the package, not our
    file. The package is played by a stand-in in directory `stand_in`, put on the path before
    site-packages: importing the real one takes about 10 s (it loads transformers' pipelines)."""
    package = Path(stand_in) / "evaluate"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('"""Stands in for HuggingFace\'s evaluate."""\n\n\ndef load(path):\n'
                                         '    return path\n')
    (Path(task_dir) / "clash_utils.py").write_text(
        "import evaluate\n\n\ndef process_results(doc, results):\n"
        "    return {'acc': float(callable(getattr(evaluate, 'load', None)))}\n")
    data = write_jsonl(Path(data_dir) / "clash.jsonl", [{"q": "2 + 2 =", "a": " 4"}, {"q": "1 + 1 =", "a": " 2"}])
    (Path(task_dir) / "local_hf_evaluate.yaml").write_text(
        "task: local_hf_evaluate\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\noutput_type: loglikelihood\n"
        "doc_to_text: q\ndoc_to_target: a\nprocess_results: !function clash_utils.process_results\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")


def write_torch_task(task_dir):
    """A task whose utils.py imports torch (as evalita_llm's metrics do), which the command
    line leaves unloaded until a task needs it. It scores 1 when torch works there; its data
    and fields are local_hf_evaluate's."""
    (Path(task_dir) / "torch_utils.py").write_text(
        "import torch\n\n\ndef process_results(doc, results):\n"
        "    return {'acc': float(torch.ones(2).sum().item() == 2.0)}\n")
    (Path(task_dir) / "local_torch_utils.yaml").write_text(
        (Path(task_dir) / "local_hf_evaluate.yaml").read_text().replace("local_hf_evaluate", "local_torch_utils")
        .replace("clash_utils", "torch_utils"))


PARITY_TASKS = ["local_hellaswag", "local_hellaswag_2shot", "local_arc_easy", "local_lambada", "local_wikitext",
                "local_gsm8k"]
OURS_ONLY = ["local_gsm8k_sampled", "local_hf_evaluate", "local_torch_utils"]
CHAT_TASKS = ["local_hellaswag", "local_arc_easy", "local_lambada", "local_gsm8k"]  # 0-shot and 2-shot as turns
VARIANTS = [("plain", PARITY_TASKS, OURS_ONLY, False), ("chat", CHAT_TASKS, [], True)]  # lm-eval's, ours too, chat
CLI_TASKS = ["local_lambada", "local_wikitext", "local_gsm8k", "local_hf_evaluate",  # the three request types
             "local_torch_utils"]


def harness_config(task_dir, tasks, chat):
    return evaluate.EvaluatorConfig(tasks=",".join(tasks), include_path=task_dir, apply_chat_template=chat,
                                    log_samples=True, batch_size=4, quiet=True, bootstrap_iters=BOOTSTRAP)


def run_ours(ev, cfg):
    """Our backend through tasks.evaluate_tasks, as the command line runs it. One evaluator
    serves every variant (as one process would), so each shape compiles once."""
    ev.cfg = cfg
    return tasks.evaluate_tasks(tasks.JaxLM(ev, seed=cfg.seed), cfg)


def run_hflm(hflm, task_dir, tasks, chat=False):
    """lm-eval's own HF model on the same tasks, with the options our command line passes."""
    from lm_eval.tasks import TaskManager
    return lm_eval.simple_evaluate(model=hflm, tasks=tasks, log_samples=True, bootstrap_iters=BOOTSTRAP,
                                   task_manager=TaskManager(include_path=task_dir, include_defaults=False),
                                   apply_chat_template=chat, fewshot_as_multiturn=chat, fewshot_random_seed=1234)


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """({variant: (lm-eval's results, ours)} for "plain" and "chat", the model directory, the
    task directory, the directory of the stand-in `evaluate` package, lm-eval's HF model, our
    evaluator)."""
    if torch is None or lm_eval is None:
        pytest.skip("needs torch and lm-eval")
    from lm_eval.models.huggingface import HFLM
    root = tmp_path_factory.mktemp("harness")
    model_dir, task_dir, data_dir, stand_in = (str(root / d) for d in ("model", "tasks", "data", "site"))
    for d in (task_dir, data_dir):
        os.makedirs(d)
    model = make_gpt2(model_dir, positions=HARNESS_CONTEXT)
    Path(model_dir, "chat_template.jinja").write_text(CHAT_TEMPLATE)  # where transformers reads it from
    write_harness_tasks(task_dir, data_dir, stand_in, model, load_tokenizer(model_dir))
    sys.path.insert(0, stand_in)  # where `import evaluate` goes once past our evaluate.py
    hflm = HFLM(pretrained=model_dir, dtype="float32", batch_size=4, device="cpu")
    jax_model, host = load_backbone(model_dir)
    ev = evaluate.Evaluator.from_parts(jobs.ExecutionSpec(name="lmeval"), jax_model,
                                       gpt.place_params(jax_model, mesh_of(), host), HFTokenizer(model_dir),
                                       mesh_of(), [])
    seconds, runs = {}, {}
    for variant, names, ours_too, chat in VARIANTS:
        started = time.time()
        theirs = run_hflm(hflm, task_dir, names, chat)
        middle = time.time()
        ours = run_ours(ev, harness_config(task_dir, names + ours_too, chat))
        seconds[variant] = (middle - started, time.time() - middle)
        runs[variant] = (theirs, ours)
    print("\n" + ", ".join(f"{v}: lm-eval hf {a:.1f}s, ours {b:.1f}s" for v, (a, b) in seconds.items()))
    yield runs, model_dir, task_dir, stand_in, hflm, ev
    sys.path.remove(stand_in)


def responses(sample):
    """A sample's model responses, one per request and repeat: (logprob, is_greedy), a logprob, or a text."""
    return [response for request in sample["resps"] for response in request]


def logprob_and_greedy(response):
    """(logprob, is_greedy) of a loglikelihood response, (logprob, None) of a rolling one."""
    return (response, None) if isinstance(response, float) else tuple(response)


def compare_samples(theirs, ours):
    """One task's samples, request by request: log-likelihoods within 1e-4 relative (their worst
    relative difference is returned), everything else identical: prompts, is_greedy, texts,
    filtered answers, per-sample metrics."""
    key = lambda s: (s["doc_id"], s["filter"])
    theirs, ours = sorted(theirs, key=key), sorted(ours, key=key)
    assert [key(s) for s in theirs] == [key(s) for s in ours]
    worst = 0.0
    for t, o in zip(theirs, ours):
        assert t["arguments"] == o["arguments"] and t["target"] == o["target"]  # same prompts and shots
        for a, b in zip(responses(t) + t["filtered_resps"], responses(o) + o["filtered_resps"]):
            if isinstance(a, str):
                assert a == b, (t["doc_id"], a, b)
                continue
            (a, greedy_a), (b, greedy_b) = logprob_and_greedy(a), logprob_and_greedy(b)
            assert greedy_a == greedy_b, t["doc_id"]
            worst = max(worst, rel(b, a))
        for metric in t["metrics"]:
            np.testing.assert_allclose(np.asarray(o[metric], float), np.asarray(t[metric], float), rtol=1e-4)
    assert worst < 1e-4
    return worst


def assert_same_scores(theirs, ours, task, rtol=1e-4):
    """Aggregate scores and their stderrs of one task ("N/A" stderrs alike)."""
    assert ours["results"][task].keys() == theirs["results"][task].keys()
    for key, value in theirs["results"][task].items():
        if isinstance(value, float):
            np.testing.assert_allclose(ours["results"][task][key], value, rtol=rtol, err_msg=f"{task} {key}")
        else:
            assert ours["results"][task][key] == value, (task, key)
    assert ours["n-shot"][task] == theirs["n-shot"][task] and ours["n-samples"][task] == theirs["n-samples"][task]


@needs_lm_eval
def test_lm_eval_tasks_match_lm_evals_hf_model(harness):
    runs = harness[0]
    for variant, (theirs, ours) in runs.items():
        worst = {}
        for task in theirs["samples"]:
            worst[task] = compare_samples(theirs["samples"][task], ours["samples"][task])
            assert_same_scores(theirs, ours, task)
        print(f"{variant}: max relative log-likelihood difference per task "
              + ", ".join(f"{t} {w:.1e}" for t, w in worst.items()))
    assert {runs["plain"][1]["n-shot"][t] for t in PARITY_TASKS} == {0, 2}


@needs_lm_eval
def test_lm_eval_tasks_are_not_trivial(harness):
    """The parity above means something: scores differ between documents, some greedy
    continuations match, generations are texts, some cut at a stop string, some numbers found."""
    samples = harness[0]["plain"][1]["samples"]
    for task, metric in [("local_hellaswag", "acc_norm"), ("local_arc_easy", "acc"), ("local_lambada", "acc"),
                         ("local_gsm8k", "exact_match")]:
        assert len({s[metric] for s in samples[task]}) == 2, (task, metric)  # some 0, some 1
    texts = [responses(s)[0] for s in samples["local_gsm8k"] if s["filter"] == "flexible-extract"]
    assert all(texts) and len(set(texts)) == len(texts)
    tokenizer = load_tokenizer(harness[1])
    assert any(len(tokenizer.encode(t)) < 20 for t in texts)  # cut by a stop string (24 tokens otherwise)
    assert {s["filtered_resps"][0] for s in samples["local_gsm8k"]} > {"[invalid]"}


@needs_lm_eval
def test_lm_eval_sampling_and_tasks_importing_hf_evaluate(harness):
    ours = harness[0]["plain"][1]
    sampled = [responses(s) for s in ours["samples"]["local_gsm8k_sampled"]]
    assert all(len(texts) == 2 for texts in sampled)  # repeats: 2
    assert any(a != b for a, b in sampled)  # each repeat draws its own sample
    # a task's `import evaluate` got HuggingFace's package, and our module is ours again
    assert ours["results"]["local_hf_evaluate"]["acc,none"] == 1.0
    assert sys.modules["evaluate"] is evaluate


@st.composite
def lm_eval_task(draw):
    """One random task over local JSONL: multiple choice (contexts alike, choices of one word
    or several, a question that is its neighbours' shared beginning), loglikelihood, rolling
    perplexity or generation (stop strings, max_gen_toks 1 to 64), 0 or 2 shots."""
    kind = draw(st.sampled_from(["multiple_choice", "loglikelihood", "loglikelihood_rolling", "generate_until"]))
    words = lambda lo, hi: " ".join(draw(st.lists(st.sampled_from(WORDS), min_size=lo, max_size=hi)))
    stem = words(0, 12)
    docs = [{"q": f"{stem} {words(0, 4)}".strip() or "the", "a": words(1, 3),
             "choices": draw(st.lists(st.builds(lambda k: words(1, k), st.sampled_from([1, 1, 4])), min_size=2,
                                      max_size=4, unique=True))} for _ in range(draw(st.integers(1, 6)))]
    for d in docs:
        d["gold"] = draw(st.integers(0, len(d["choices"]) - 1))
    fields = {"output_type": kind, "doc_to_text": "{{q}}", "doc_to_target": "{{a}}",
              "metric_list": [{"metric": "acc"}]}
    if kind == "multiple_choice":
        fields.update(doc_to_choice="{{choices}}", doc_to_target="{{gold}}",
                      metric_list=[{"metric": "acc"}, {"metric": "acc_norm"}])
    elif kind == "loglikelihood":
        fields.update(metric_list=[{"metric": "perplexity"}, {"metric": "acc"}])
    elif kind == "loglikelihood_rolling":
        fields.update(doc_to_text="", doc_to_target="{{q}} {{a}}", metric_list=[{"metric": "word_perplexity"},
                                                                               {"metric": "bits_per_byte"}])
    else:
        until = draw(st.lists(st.sampled_from(["\n", ".", " the", "and", "Question:"]), max_size=2))
        fields.update(generation_kwargs={"until": until, "max_gen_toks": draw(st.sampled_from([1, 8, 64])),
                                         "do_sample": False}, metric_list=[{"metric": "exact_match"}])
    shots = draw(st.sampled_from([0, 2])) if kind != "loglikelihood_rolling" else 0
    return docs, dict(fields, num_fewshot=shots, test_split="test", fewshot_split="train", target_delimiter=" ")


@needs_lm_eval
@fuzz_settings(2)
@hypothesis.given(task=lm_eval_task(), batch=st.integers(1, 17))
def test_random_lm_eval_tasks_match_lm_evals_hf_model(harness, task, batch):
    """A random task YAML over local JSONL, through --tasks' code on our model at any batch
    size, gives lm-eval's own HF model's every request and score."""
    _, model_dir, _, _, hflm, ev = harness
    docs, fields = task
    with tempfile.TemporaryDirectory() as tmp:
        write_lm_task(tmp, tmp, "fuzzed", {"test": docs, "train": docs[::-1]}, **fields)
        theirs = run_hflm(hflm, tmp, ["fuzzed"])
        cfg = harness_config(tmp, ["fuzzed"], False)
        ev.requested_batch_size = batch
        try:
            ours = run_ours(ev, dataclasses.replace(cfg, batch_size=batch))
        finally:
            ev.requested_batch_size = 4
    compare_samples(theirs["samples"]["fuzzed"], ours["samples"]["fuzzed"])
    assert_same_scores(theirs, ours, "fuzzed")


def assert_close_values(a, b, rtol):
    """Nested lists of strings: numbers within rtol, anything else identical."""
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_close_values(x, y, rtol)
        return
    try:
        np.testing.assert_allclose(float(b), float(a), rtol=rtol)
    except ValueError:
        assert a == b


@needs_lm_eval
def test_lm_eval_tasks_on_two_processes_over_a_4x2_mesh(harness, tmp_path):
    """The command line as two processes of 4 devices, one 4x2 mesh over both: every answer as
    on one device, a task importing HuggingFace's `evaluate` works when evaluate.py is the
    script, and one importing torch, only process 0 writes, lm-eval's make_table reads our
    results file, and results.json gains the tasks' scores."""
    from lm_eval.loggers.evaluation_tracker import GeneralConfigTracker
    from lm_eval.utils import make_table
    runs, model_dir, task_dir, stand_in = harness[:4]
    theirs, ours = runs["plain"]
    out, port = tmp_path / "out", free_port()
    args = ["--ckpt", model_dir, "--tasks", ",".join(CLI_TASKS), "--include-path", task_dir,
            "--log-samples", "--bootstrap-iters", BOOTSTRAP, "--mesh", "4x2", "--out", out, "--quiet",
            "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    env = child_env(4, PYTHONPATH=stand_in)
    procs = [subprocess.Popen([sys.executable, str(ROOT / "evaluate.py"), *map(str, args), "--process-id", str(i)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    summary = json.loads((out / "results.json").read_text())
    files = summary["lm_eval"]
    written = json.loads((out / files["results"]).read_text())
    # lm-eval's own results file: the keys its EvaluationTracker writes, read by its make_table
    expected = (set(theirs) - {"samples"}) | {"task_hashes"} | set(dataclasses.asdict(GeneralConfigTracker()))
    assert set(written) == expected
    table = make_table(written)
    assert all(task in table for task in CLI_TASKS)
    key = lambda s: (s["doc_id"], s["filter"])
    for task in CLI_TASKS:
        assert_same_scores(ours, written, task, rtol=1e-5)
        lines = sorted((json.loads(line) for line in (out / files["samples"][task]).read_text().splitlines()), key=key)
        expected_lines = sorted((json.loads(tasks.sample_line(s)) for s in ours["samples"][task]), key=key)
        assert [key(s) for s in lines] == [key(s) for s in expected_lines]
        for line, reference in zip(lines, expected_lines):
            assert line["arguments"] == reference["arguments"]
            assert_close_values(line["resps"], reference["resps"], rtol=1e-5)
            assert_close_values(line["filtered_resps"], reference["filtered_resps"], rtol=1e-5)
    assert written["results"]["local_hf_evaluate"]["acc,none"] == 1.0  # evaluate.py as the script
    assert written["results"]["local_torch_utils"]["acc,none"] == 1.0  # torch, once a task imports it
    # results.json: our format, the tasks' scores under "<task>/<metric>,<filter>"
    name = "local_lambada/acc,none"
    assert summary["results"][name] == written["results"]["local_lambada"]["acc,none"]
    assert summary["stderr"][name] == written["results"]["local_lambada"]["acc_stderr,none"]
    assert summary["kind"][name] == "lm-eval" and summary["higher_is_better"][name] is True
    assert summary["higher_is_better"]["local_wikitext/word_perplexity,none"] is False
    assert summary["n_samples"]["local_gsm8k/exact_match,strict-match"] == 6
    assert summary["processes"] == 2 and summary["mesh"] == {"batch": 4, "shard": 2}
    assert sorted(p.name for p in out.iterdir()) == ["lm_eval", "results.json"]  # no samples of our own kinds


@needs_lm_eval
def test_lm_eval_bad_options_and_tasks_fail_clearly(small, tmp_path, monkeypatch):
    for fields, needle in [(dict(tasks="x", num_fewshot=-1), "--num-fewshot must be"),
                           (dict(tasks="x", include_path=str(tmp_path / "absent")), "is not a directory"),
                           (dict(num_fewshot=2), "--num-fewshot applies to lm-eval tasks only"),
                           (dict(apply_chat_template=True), "--apply-chat-template applies"),
                           (dict(tasks=" , "), "names no task"),
                           (dict(tasks="x", bootstrap_iters=-1), "--bootstrap-iters")]:
        with pytest.raises(UsageError, match=needle):
            evaluate.EvaluatorConfig(**fields).validate()
    from lm_eval.tasks import TaskManager
    # only the local index, so that the test does not wait for lm-eval's 14,683 built-in tasks
    monkeypatch.setattr(tasks, "task_manager",
                        lambda names, path: TaskManager(include_path=path, include_defaults=False))
    ev = evaluator(small, [], tasks="nope", include_path=str(tmp_path))
    with pytest.raises(UsageError, match="'nope' is not an lm-eval task"):
        tasks.evaluate_tasks(tasks.JaxLM(ev), ev.cfg)
    ev = evaluator(small, [], tasks="nope", apply_chat_template=True)
    with pytest.raises(UsageError, match="no chat template"):  # a byte tokenizer has none
        tasks.evaluate_tasks(tasks.JaxLM(ev), ev.cfg)
    lm = tasks.JaxLM(ev)
    with pytest.raises(UsageError, match="num_beams"):
        lm.decoding({"until": ["\n"], "num_beams": 4})
    with pytest.raises(UsageError, match="64 new tokens"):  # lm-eval's HF model would assert
        lm.decoding({"until": ["\n"], "max_gen_toks": 64})


def test_tasks_without_lm_eval_fail_with_one_line(ckpt, tmp_path):
    """Without lm-eval (here an lm_eval that fails to import, first on the path), evaluate.py
    still loads, and --tasks says in one line what to install."""
    fake = tmp_path / "site" / "lm_eval"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named lm_eval')\n")
    env = child_env(1, PYTHONPATH=str(tmp_path / "site"))
    proc = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), "--ckpt", str(ckpt), "--tasks", "hellaswag",
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, env=env)
    assert_usage_error(proc, "--tasks", "pip install lm-eval==0.4.13", out=tmp_path / "o")


@needs_lm_eval
def test_jaxlm_answers_as_our_own_kinds(small):
    """lm-eval's requests through JaxLM give what our own kinds compute for the same texts,
    here with the byte tokenizer (no transformers tokenizer, no text for its special tokens)."""
    ev = evaluator(small, [])
    lm = tasks.JaxLM(ev)
    request = lambda *args: types.SimpleNamespace(args=args)  # what JaxLM reads of lm-eval's Instance
    mc = evaluate.MultipleChoiceEvaluation("mc", MC).result(ev, ev.tokenizer).records
    answers = lm.loglikelihood([request(m["context"], c) for m in MC for c in m["choices"]])
    assert [ll for ll, _ in answers] == [ll for r in mc for ll in r["loglik"]]
    gen = evaluate.RolloutEvaluation("gen", GEN, max_new_tokens=6).result(ev, ev.tokenizer).records
    texts = lm.generate_until([request(g["prompt"], {"until": ["\n"], "max_gen_toks": 6}) for g in GEN])
    assert texts == [r["output"] for r in gen] and any(texts)


# ---- bench.py: it runs and its own checks hold (speed itself is never asserted)

TINY_BENCH = ["--layers", "2", "--width", "64", "--heads", "4", "--vocab", "500", "--seq", "64",
              "--batch", "4", "--prompt", "8", "--new-tokens", "8", "--matmul-sizes", "128",
              "--reps", "1", "--ragged", "10", "--ragged-prompts", "6", "--json"]


def bench(*args):
    env = child_env(1)
    env.pop("JAX_COMPILATION_CACHE_DIR")  # bench counts compilations: none may come from a cache
    env["GPT_EVAL_COMPILE_CACHE"] = "0"  # nor from the user's (the processes of --shapes)
    proc = subprocess.run([sys.executable, str(ROOT / "bench.py"), *TINY_BENCH, *args],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@needs_torch
def test_bench_against_transformers_compiles_once():
    """Same scores and tokens as transformers (bench asserts both); the built-in suite
    compiles on its first run and never on the second."""
    r = bench()
    assert r["scoring"]["project"]["rel_diff"] < 1e-4 and r["generation"]["check"]["identical"]
    ragged = r["ragged"]  # documents and prompts of mixed lengths, beside a plain transformers loop
    assert ragged["rel_diff"] < 1e-4 and ragged["identical"] >= 0.75 and ragged["tokens"] >= 10 * 16
    assert 0 < ragged["real_share"]["project_scoring"] <= 1 and ragged["shapes"] <= ragged["blocks"]
    first, second = r["compilation"]["runs"]
    assert all(x["compiles"] >= 1 for x in first.values())
    assert all(x["compiles"] == 0 for x in second.values())


def test_bench_limits_mode():
    """--limits measures this project alone: scoring FLOP/s and batch-1 decoding against the
    time to read every parameter byte once."""
    x = bench("--limits", "--dtype", "bfloat16")["limits"]
    model = gpt.GPT(n_layers=2, n_embd=64, n_head=4, vocab_size=500, block_size=1024)
    assert x["params"] == gpt.count_params(gpt.abstract_params(model))
    assert x["param_bytes"] == 2 * x["params"]  # bfloat16
    assert x["scoring"]["flops"] == pytest.approx(4 * model.bind(init(model)).flops(64) / 3)
    assert x["decoding"]["best"] > 0 and x["decoding"]["bound"] > 0 and x["peak"]["flops_per_s"] > 0


def test_bench_load_mode(ckpt):
    """--load: a checkpoint loaded onto the mesh in a fresh process, beside `cat`: every
    parameter byte read once and placed, the peak memory above what the process held before;
    then evaluate.py's own peak on the checkpoint."""
    x = bench("--load", ckpt)["loading"]
    [load], [(cat_seconds, _)] = x["loads"], x["cat"]
    params = gpt.count_params(gpt.abstract_params(gpt.GPT(**SMALL)))
    assert load["read"] == load["placed"] == 4 * params < x["file_bytes"]  # float32; the file adds its header
    assert load["peak_rss"] > load["rss_before"] and load["seconds"] > 0 and cat_seconds > 0
    assert x["evaluate"]["peak_rss"] > load["rss_before"] and x["evaluate"]["seconds"] > 0


@needs_torch
def test_bench_gpu_report_dry_run(tmp_path):
    """--gpu-report, the accelerator's prepared run, here with tiny shapes: every part ends
    well and writes its JSON; the fixture's answers computed again on the same machine are
    the CPU's own, bit for bit; the model part's scorers agree with transformers and its
    greedy tokens with gpt.generate. (The shapes part runs --shapes' own workload function,
    tested above.)"""
    fixture, runs = tmp_path / "fixture", ["--runs-model", "tiny", "--runs-items", "8", "--runs-workloads", "gen"]
    assert bench("--make-fixture", fixture, "--parity-runs", "float32", *runs)["fixture"]["vocab"] > 256
    r = bench("--gpu-report", "--report-parts", "device,ceilings,parity,tiny,runs", "--fixture", fixture,
              "--parity-runs", "float32", "--decode-batches", "2", "--report-dir", tmp_path / "report",
              "--matmul-sizes", "128,256", "--reps", "1", *runs)["gpu_report"]
    assert [(p, x["status"]) for p, x in r["parts"].items()] == [
        (p, "ok") for p in ("device", "ceilings", "parity", "tiny", "runs")]
    for w in r["runs"]["workloads"].values():  # the command line run twice: built, then loaded from the cache
        first, second = w["first"], w["second"]
        assert first["programs"]["compiled"] > 0 and second["programs"] == {**second["programs"], "compiled": 0}
        assert second["programs"]["loaded"] >= first["programs"]["compiled"] and first["results"] == second["results"]
        assert 0 < r["runs"]["floor_seconds"] < first["seconds"]  # a process that only starts: less than a run
    assert r["device"]["backend"] == "cpu" and r["ceilings"]["gemm"]["flops_per_s"] > 0
    p = r["parity"]["float32"]
    assert p["max_rel"] == 0 and p["log_likelihoods"] == 24 + 4 * 32
    assert p["generations"] == [16, 16] and p["choices"] == [32, 32] and p["next_tokens"] == [16, 16]
    m = r["tiny"]
    assert m["device"] == jax.devices()[0].device_kind and m["attention"]["lanes"] == 0
    assert m["scoring"]["project"]["rel_diff"] < 1e-4 and m["scoring"]["forward"]["rel_diff"] < 1e-4
    [d] = m["decoding"]
    assert d["rows"] == 2 and d["simple_same_tokens"] and d["same_as_transformers"] == 1.0
    assert d["harness"]["steps"] >= 8 and d["step_bytes"] > m["param_bytes"]


def test_bench_compiles_for_a_target_and_no_program_copies_the_kv_cache():
    """--compile-for, here for this CPU (a TPU's needs libtpu): every program of the
    evaluation builds without running, and none copies the KV cache or a layer's slots of it
    (the layers read the cache where it lies and it is written in place: written inside the
    layers' loop, a CPU's start and advance copied a layer's slots, a TPU's every program)."""
    r = bench("--compile-for", "cpu", "--runs-model", "tiny", "--seq", "128", "--prompt", "16")["compile"]
    assert r["target"] == "cpu" and list(r["programs"]) == ["score, packed", "score", "start", "advance", "refill"]
    assert all(p["compile_s"] > 0 and p["cache_copies"] == 0 for p in r["programs"].values()), r["programs"]
    with pytest.raises(AssertionError, match="unknown target 'v6'"):
        bench("--compile-for", "v6")


def test_a_gpu_report_part_out_of_time_is_stopped_with_what_it_started():
    """A part (and every process it started) is killed once its time is up, and reported so."""
    started = time.perf_counter()
    status, _ = bench_module.run_part([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen("
                                       "[sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"], 2)
    assert status == "stopped: out of time" and time.perf_counter() - started < 20


COUNT_COMPILES = r"""
import json, sys, jax
import evaluate
counts = {"compiled": 0, "loaded": 0}

def on_duration(event, seconds, **meta):  # a program loaded from the cache is reported here too
    counts["compiled"] += event == "/jax/core/compile/backend_compile_duration"

def on_event(event, **meta):
    counts["loaded"] += event == "/jax/compilation_cache/cache_hits"

jax.monitoring.register_event_duration_secs_listener(on_duration)
jax.monitoring.register_event_listener(on_event)
status = evaluate.main(sys.argv[1:])
counts["compiled"] -= counts["loaded"]
print(json.dumps({"status": status, **counts}))
"""


def test_a_tpus_premapped_buffer_is_1_gib_unless_the_user_set_it(monkeypatch):
    """evaluate.py (open_devices_meanwhile) and jobs.py's jobs (run_job, train.py's too)
    set TPU_PREMAPPED_BUFFER_SIZE, read as a TPU's runtime starts, to PREMAPPED_BYTES where
    it is unset, before the job runs, and leave a user's value alone."""
    seen = []

    @dataclasses.dataclass
    class Options:
        pass

    class Job:
        CONFIG = Options

        def __init__(self, spec):
            pass

        def run(self):
            seen.append(os.environ["TPU_PREMAPPED_BUFFER_SIZE"])

    monkeypatch.setattr(jobs, "load_job", lambda key: Job)
    for start in (evaluate.open_devices_meanwhile, lambda: jobs.run_job("any", [])):
        monkeypatch.delenv("TPU_PREMAPPED_BUFFER_SIZE", raising=False)
        start()
        assert os.environ["TPU_PREMAPPED_BUFFER_SIZE"] == str(jobs.PREMAPPED_BYTES) == str(1 << 30)
        monkeypatch.setenv("TPU_PREMAPPED_BUFFER_SIZE", "8589934592")
        start()
        assert os.environ["TPU_PREMAPPED_BUFFER_SIZE"] == "8589934592"
    assert seen == [str(1 << 30), "8589934592"]


def test_jobs_use_the_persistent_compile_cache_as_evaluate_py_does(monkeypatch):
    """`python jobs.py KEY` (train.py's stages too) turns on the compilation cache that
    evaluate.py uses (use_compile_cache, shown end to end by the second-run test below),
    off where the job's options say --no-compile-cache."""
    calls = []

    @dataclasses.dataclass
    class Options:
        no_compile_cache: bool = jobs.option(False, "no cache")

    class Job:
        CONFIG = Options

        def __init__(self, spec):
            self.spec = spec

        def run(self):
            calls.append(("run", self.spec.cfg.no_compile_cache))

    monkeypatch.setattr(jobs, "load_job", lambda key: Job)
    monkeypatch.setattr(jobs, "use_compile_cache", lambda off: calls.append(("cache", off)))
    jobs.run_job("any", [])
    jobs.run_job("any", ["--no-compile-cache"])
    assert calls == [("cache", False), ("run", False), ("cache", True), ("run", True)]


def test_an_evaluation_reads_its_tokenizer_before_it_needs_a_device(hf_gpt2, monkeypatch):
    """What needs no device comes first (the checkpoint's tokenizer, which imports
    transformers), so that a TPU's runtime starts meanwhile (open_devices_meanwhile): the
    mesh is made after the tokenizer is read, and the parameters placed after both."""
    order = []
    for owner, name in ((jobs.HFTokenizer, "__init__"), (jobs.ExecutionSpec, "make_mesh"), (gpt, "place_params")):
        def recorded(*args, _name=name, _original=getattr(owner, name), **kwargs):
            order.append(_name)
            return _original(*args, **kwargs)
        monkeypatch.setattr(owner, name, recorded)
    cfg = jobs.parse_options(evaluate.EvaluatorConfig, ["--ckpt", str(hf_gpt2), "--mesh", "1x1", "--quiet"])
    spec = jobs.ExecutionSpec(name=evaluate.BackboneEvaluate.KEY, mesh=cfg.mesh, cfg=cfg)
    evaluator = evaluate.BackboneEvaluate(spec, checkpoints.Node(str(hf_gpt2)))
    assert order == ["__init__", "make_mesh", "place_params"]
    assert isinstance(evaluator.tokenizer, jobs.HFTokenizer) and evaluator.tokenizer.directory == str(hf_gpt2)


def test_a_second_run_compiles_nothing_through_the_default_compile_cache(tmp_path):
    """The persistent compilation cache is on by default, in the user's cache directory: a
    second process on the same shapes loads every program and compiles none, with the same
    results; --no-compile-cache compiles them all again and leaves the cache alone."""
    env = child_env(1, XDG_CACHE_HOME=str(tmp_path / "home"))
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
        env.pop(name, None)
    cache = tmp_path / "home" / "gpt-eval" / "jax"

    def run(out, *more):
        args = ["--evals", "text,grammar,addition", "--limit", "6", "--quiet", "--out", str(tmp_path / out), *more]
        proc = subprocess.run([sys.executable, "-c", COUNT_COMPILES, *args], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1])

    first = run("first")
    entries = sorted(p.name for p in cache.iterdir())
    second, off = run("second"), run("off", "--no-compile-cache")
    assert first["compiled"] >= 3 and len(entries) >= first["compiled"]
    assert second["compiled"] == 0 and second["loaded"] >= first["compiled"]
    assert off["compiled"] == first["compiled"] and off["loaded"] == 0
    assert sorted(p.name for p in cache.iterdir()) == entries
    assert without_timing(tmp_path / "first") == without_timing(tmp_path / "second")
    # results.json says what each run built, as jax reported it (the model's initialisation is
    # built before the Evaluator, whose programs results.json counts: one fewer)
    programs = {out: json.loads((tmp_path / out / "results.json").read_text())["programs"]
                for out in ("first", "second", "off")}
    assert programs["first"]["compiled"] == programs["off"]["compiled"] and programs["second"]["compiled"] == 0
    assert 0 < programs["first"]["compiled"] <= first["compiled"] and programs["second"]["loaded"] > 0
    assert sum(programs["first"]["by_name"].values()) == programs["first"]["compiled"]


@needs_lm_eval
def test_bench_shapes_beside_lm_evals_hf_model(tmp_path):
    """--shapes, its gsm8k-CoT-style workload: lm-eval's template through our command line
    and through lm-eval's HF model (bench asserts that the log-likelihoods agree), the same
    answers, texts and scores, for less than half the tokens per request (its 8 examples
    once), in no more decoding steps; our second run (bench asserts the same answers)
    compiles nothing. The other workloads differ only in their tasks' YAML (MMLU-style
    scoring of shared contexts: test_shared_contexts_score_as_alone_with_less_work)."""
    # std 0.1: at the default 0.2 a 12-layer model's greedy texts turned on float rounding
    # (the same code gives other texts with its sums in another order)
    runs = bench("--shapes", "--workloads", "gsm8k_cot", "--layers", "4", "--width", "256", "--heads", "4",
                 "--vocab", "2000", "--mlp-hidden", "128", "--kv-heads", "2", "--gsm8k-questions", "6",
                 "--max-gen-toks", "24", "--batch", "4", "--context", "2048", "--init-std", "0.1",
                 "--workdir", tmp_path)["shapes"]["workloads"]
    r = runs["gsm8k_cot"]  # generation: the same texts, the examples computed once, rows refilled
    assert r["identical"] == r["compared"] and r["requests"] == 6 and r["scores_rel"] < 1e-4
    assert r["our_tokens_per_request"] < 0.5 * r["hf_tokens_per_request"]
    assert 0 <= r["our_steps"] - r["needed_steps"] < 8 and r["our_steps"] <= r["hf_steps"]
    assert r["compiled"] and r["compiled_again"] == []


# ---- reliability: bad input, interruption, the same answer everywhere

def assert_usage_error(proc, *needles, out=None):
    """Exit 2, one line on stderr naming the problem (after the progress lines a slow machine
    may print first, messages), no traceback, no results written."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in messages(proc.stderr) if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    if out is not None:
        assert not (Path(out) / "results.json").exists()


# `python evaluate.py ARGS` for many ARGS in one interpreter: the command line's own main()
# (parse, validate, load, run, exit status) without Python's and jax's start-up (4 s) per
# case. A {"write": PATH, "text": TEXT} step rewrites a file between runs, a {"fsize": N}
# step caps the size of files written (a full disk; None lifts the cap), and an
# {"after_window": PATH, "text": TEXT, "mode": "a" or "w"} step writes a file while the next run
# goes on, once its journal has recorded its first window. A case still running after 20 s is
# stopped and reported, so a wait on a FIFO fails the test.
DRIVER = r"""
import contextlib, io, json, os, resource, signal, sys, time
resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))  # a blow-up fails the test, not the machine
os.umask(0o022)  # the usual umask, so that file modes can be checked
import evaluate, runs

class StillRunning(Exception):  # not an OSError, which main() would report as exit 2
    pass

def stop(signum, frame):
    raise StillRunning("still running after 20 s")

signal.signal(signal.SIGALRM, stop)
journal_add = runs.Journal.add

def write_after_window(change):  # after the first window the journal records
    def add_then_write(*args):
        journal_add(*args)
        runs.Journal.add = journal_add  # once
        open(change["after_window"], change["mode"]).write(change["text"])
    runs.Journal.add = add_then_write

outcomes = []
for case in json.loads(sys.stdin.read()):
    if isinstance(case, dict) and "write" in case:
        open(case["write"], "w").write(case["text"])
        continue
    if isinstance(case, dict) and "after_window" in case:
        write_after_window(case)
        continue
    if isinstance(case, dict):
        limit = resource.RLIM_INFINITY if case["fsize"] is None else case["fsize"]
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        continue
    stderr, start = io.StringIO(), time.time()
    signal.alarm(20)
    try:
        with contextlib.redirect_stderr(stderr):
            status = evaluate.main(case)
    except BaseException as e:  # a traceback or a wait: the test shows which
        status = f"{type(e).__name__}: {e}"
    signal.alarm(0)
    outcomes.append({"returncode": status, "stderr": stderr.getvalue(), "seconds": time.time() - start})
print(json.dumps(outcomes))
"""


def driver_env(devices=1):
    return child_env(devices)


def cli_many(*cases, devices=1, compile_cache=True, env=None):
    """Run DRIVER over `cases` (each a list of arguments, or a step); one outcome (returncode,
    stderr, seconds) per run, in order. compile_cache False: no persistent compilation cache
    (a capped file size would fail its writes too); env: more environment variables."""
    env = {**driver_env(devices), **(env or {})}
    if not compile_cache:
        env.pop("JAX_COMPILATION_CACHE_DIR")
        env["GPT_EVAL_COMPILE_CACHE"] = "0"  # nor the user's, the default
    cases = [case if isinstance(case, dict) else [str(a) for a in case] for case in cases]
    proc = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(cases), capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120 + 25 * len(cases))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [types.SimpleNamespace(**o) for o in json.loads(proc.stdout.splitlines()[-1])]


def files_of(out):
    return {p.name: p.read_bytes() for p in Path(out).iterdir()}


def save_tiny(path, scale=1.0, **fields):
    model = gpt.GPT(**{**SMALL, **fields})
    mesh = gpt.make_mesh(1, 1, devices=jax.devices()[:1])
    variables = jax.tree.map(lambda x: x * scale, gpt.init_params(model, mesh, seed=1))
    checkpoints.save_checkpoint(str(path), model, variables, {"kind": "bytes"})
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("rel") / "tiny", scale=4.0)


def broken_checkpoints(ckpt, tmp):
    """(directory, words the error must contain) for every way a checkpoint can be bad."""
    import shutil
    from safetensors.numpy import load_file, save_file

    def copy(name):
        target = tmp / name
        shutil.copytree(ckpt, target)
        return target

    cases = [(tmp / "missing", ["does not exist"])]
    empty = tmp / "empty"
    empty.mkdir()
    cases.append((empty, ["no config.json"]))
    bad_json = copy("badjson")
    (bad_json / "config.json").write_text("{not json")
    cases.append((bad_json, ["config.json", "not valid JSON"]))
    truncated = copy("truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases.append((truncated, ["model.safetensors"]))
    garbage = copy("garbage")
    (garbage / "model.safetensors").write_bytes(b"this is not safetensors at all")
    cases.append((garbage, ["model.safetensors"]))
    weights = load_file(str(ckpt / "model.safetensors"))
    missing = copy("missingparam")
    save_file({k: v for k, v in weights.items() if k != "ln_f/scale"}, str(missing / "model.safetensors"))
    cases.append((missing, ["ln_f/scale", "missing"]))
    shape = copy("badshape")
    save_file({**weights, "ln_f/scale": np.ones(3, np.float32)}, str(shape / "model.safetensors"))
    cases.append((shape, ["ln_f/scale", "shape"]))
    small = copy("smallvocab")
    config = json.loads((small / "config.json").read_text())
    config["model"]["vocab_size"] = 200  # the byte tokenizer needs 257
    (small / "config.json").write_text(json.dumps(config))
    save_file({**weights, "wte/embedding": weights["wte/embedding"][:200]}, str(small / "model.safetensors"))
    cases.append((small, ["tokenizer", "257", "200"]))
    return cases


def test_bad_checkpoints_fail_with_one_line(ckpt, tmp_path):
    cases = broken_checkpoints(ckpt, tmp_path)
    outcomes = cli_many(*(["--ckpt", directory, "--evals", "grammar", "--limit", "2", "--out", tmp_path / "o"]
                          for directory, _ in cases))
    for (_, needles), proc in zip(cases, outcomes):
        assert_usage_error(proc, *needles, out=tmp_path / "o")


def bad_datasets(tmp):
    cases = [("nope", write_jsonl(tmp / "x.jsonl", [{"text": "a"}]), ["unknown kind", "nope"]),
             ("ppl", tmp / "absent.jsonl", ["does not exist"]),
             ("ppl", write_jsonl(tmp / "empty.jsonl", []), ["empty"]),
             ("ppl", write_jsonl(tmp / "notjson.jsonl", [{"text": "a"}, "{oops\n"]), ["notjson.jsonl:2", "not JSON"]),
             ("mc", write_jsonl(tmp / "nofield.jsonl", [{"context": "a", "choices": ["x", "y"]}]),
              ["nofield.jsonl:1", "gold"]),
             ("gen", write_jsonl(tmp / "type.jsonl", [{"prompt": "a", "answer": 3}]), ["type.jsonl:1", "answer"]),
             ("mc", write_jsonl(tmp / "gold.jsonl", [{"context": "a", "choices": ["x", "y"], "gold": 2}]),
              ["gold.jsonl:1", "gold"]),
             ("mc", write_jsonl(tmp / "one.jsonl", [{"context": "a", "choices": ["x"], "gold": 0}]),
              ["one.jsonl:1", "choices"])]
    utf = tmp / "latin1.jsonl"
    utf.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    cases.append(("ppl", utf, ["latin1.jsonl:2", "UTF-8"]))
    return cases


def test_bad_datasets_fail_with_one_line(ckpt, tmp_path):
    cases = bad_datasets(tmp_path)
    outcomes = cli_many(*(["--ckpt", ckpt, "--data", f"{kind}:{path}", "--out", tmp_path / "o"]
                          for kind, path, _ in cases))
    for (_, _, needles), proc in zip(cases, outcomes):
        assert_usage_error(proc, *needles, out=tmp_path / "o")


BAD_OPTIONS = [
    (["--evals", "grammar,nope"], ["nope", "grammar", "addition"]),
    (["--mesh", "3x3"], ["mesh", "9 devices", "XLA_FLAGS=--xla_force_host_platform_device_count=N"]),
    (["--mesh", "fourxtwo"], ["mesh", "BATCHxSHARD"]),
    (["--batch-size", "0"], ["--batch-size"]),
    (["--limit", "-1"], ["--limit"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["--temperature", "-0.5"], ["--temperature"]),
    (["--top-p", "0"], ["--top-p"]),
    (["--top-p", "1.5"], ["--top-p"]),
    (["--batch-size", "many"], ["--batch-size", "int"]),
    (["--colour", "red"], ["unknown option", "--colour"]),
    (["--dtype", "int8"], ["--dtype"]),
    (["--data", "nocolon.jsonl"], ["KIND:FILE"]),
    (["--evals", "grammar", "--limit", "2", "--out", "/dev/null/results"], ["output directory", "/dev/null"]),
]


def test_bad_options_fail_with_one_line(ckpt, tmp_path):
    outcomes = cli_many(*(["--ckpt", ckpt, "--out", tmp_path / "o", *args] for args, _ in BAD_OPTIONS), devices=2)
    for (args, needles), proc in zip(BAD_OPTIONS, outcomes):
        assert_usage_error(proc, *needles, out=tmp_path / "o")


def test_awkward_inputs_are_handled_and_counted(ckpt, tmp_path):
    long_doc = "the cat sees the dog. " * 20  # 440 bytes > 64-token context: rolling windows
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"text": ""}, {"text": long_doc}, {"text": "hi"}])
    gen = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "x" * 200, "answer": "y"}, {"prompt": "1", "answer": "2"}])
    proc = cli("--ckpt", ckpt, "--data", f"ppl:{docs}", "--data", f"gen:{gen}", "--out", tmp_path / "o",
               "--log-samples", "--max-new-tokens", "4", "--quiet")
    assert proc.returncode == 0, proc.stderr
    results = json.loads((tmp_path / "o" / "results.json").read_text())
    assert results["metrics"]["docs"]["skipped"] == 1 and results["n_samples"]["docs"] == 2
    assert results["metrics"]["docs"]["tokens"] == len(long_doc) + 2  # every byte scored once
    assert results["metrics"]["long"]["truncated"] == 1


def long_run_args(ckpt, tmp_path, out):
    docs = write_jsonl(tmp_path / "many.jsonl", [{"text": f"document {i} " * 30} for i in range(3000)])
    return ["--ckpt", ckpt, "--data", f"ppl:{docs}", "--out", out, "--batch-size", "1", "--chunks", "1"]


def start_cli(*args):
    """`python evaluate.py ARGS`, not waited for. A script's background job (`cmd &`) runs
    with SIGINT ignored, children inherit that, and Python keeps an inherited SIG_IGN (as
    `cmd &` and nohup intend): so that the child takes Ctrl-C, this process must not ignore it."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a child execs with SIG_DFL
    env = child_env(1)
    return subprocess.Popen([sys.executable, str(ROOT / "evaluate.py"), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


PREVIOUS = b'{"results": {"earlier": 1.0}}\n'


@pytest.mark.parametrize("sig,previous", [(signal.SIGINT, None), (signal.SIGKILL, PREVIOUS)],
                         ids=["SIGINT-no-previous", "SIGKILL-previous"])
def test_interrupted_run_leaves_previous_results_or_none(ckpt, tmp_path, sig, previous):
    out = tmp_path / "o"
    args = long_run_args(ckpt, tmp_path, out)
    if previous is not None:
        out.mkdir()
        (out / "results.json").write_bytes(previous)
    proc = start_cli(*args, "--force")
    time.sleep(12)  # past start-up and compilation, midway through scoring
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and err.strip().splitlines()[-1].startswith("interrupted"), err
        assert "Traceback" not in err
    files = sorted(p.name for p in out.iterdir()) if out.exists() else []
    left = [".journal"] + ([".lock"] if sig == signal.SIGKILL else [])  # the pieces finished; an unlocked lock
    assert files == left + ([] if previous is None else ["results.json"]), files  # no temporary left
    if previous is not None:
        assert (out / "results.json").read_bytes() == previous


def results_of(out):
    return json.loads((Path(out) / "results.json").read_text())["results"]


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("suite")
    docs = write_jsonl(tmp / "docs.jsonl", [{"text": f"the {w} sees {i} dogs. " * (1 + i % 5)}
                                      for i, w in enumerate(["cat", "king", "robot"] * 4)])
    gen = write_jsonl(tmp / "qa.jsonl", [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(10)])
    return ["--data", f"ppl:{docs}", "--data", f"gen:{gen}", "--evals", "grammar,repeat", "--limit", "24",
            "--max-new-tokens", "6"]


def test_same_scores_twice_and_on_every_mesh(ckpt, suite, tmp_path):
    run = lambda name, mesh: ["--ckpt", ckpt, *suite, "--mesh", mesh, "--out", tmp_path / name, "--quiet",
                              "--batch-size", "3"]
    for name in "ab":  # the same command in two fresh processes
        proc = cli(*run(name, "1x1"), devices=1)
        assert proc.returncode == 0, proc.stderr[-2000:]
    one_of_eight = [a for a in run("f", "1x1") if a != "--quiet"]  # the first device of 8, and it says so
    meshes = cli_many(run("c", "8x1"), run("d", "4x2"), run("e", "2x4"), one_of_eight, devices=8)
    assert all(proc.returncode == 0 for proc in meshes), [proc.stderr[-2000:] for proc in meshes]
    assert meshes[-1].stderr.splitlines()[0] == "mesh 1x1: the first 1 of 8 devices"
    runs = {name: results_of(tmp_path / name) for name in "abcdef"}
    assert runs["a"] == runs["b"] == runs["f"]
    for name in "cde":
        for key, value in runs["a"].items():
            if key == "docs":
                np.testing.assert_allclose(runs[name][key], value, rtol=1e-5)
            else:
                assert runs[name][key] == value, (name, key)


def free_port():
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    except OSError as e:  # a sandbox without sockets (a lent TPU machine) runs no second process
        pytest.skip(f"several processes need a socket on the loopback: {e}")


def test_two_processes_resume_a_journal_and_give_the_single_process_scores(ckpt, suite, tmp_path):
    """Two processes over 2 x 2 devices give the scores of one process over 4, resuming from
    the journal of a one-process run of the same command killed between two windows: process
    0 reads it, the other gets its windows through it, and neither computes them again."""
    pages = write_jsonl(tmp_path / "pages.jsonl", [{"text": f"page {i} of the book. " * (1 + i % 4)}
                                                   for i in range(40)])
    # the suite's files, and grammar and pages in windows of 32 + 8 packs: the batch is 4 on 4 devices either way
    data = suite[:suite.index("--evals")]
    args = ["--ckpt", str(ckpt), "--evals", "grammar", "--data", f"ppl:{pages}", *data, "--limit", "40",
            "--max-new-tokens", "6", "--temperature", "0.7", "--batch-size", "4", "--chunks", "1"]
    killed = subprocess.run([sys.executable, "-c", KILLER, "between", "3", *args, "--out", str(tmp_path / "multi")],
                            capture_output=True, text=True, env=child_env(4), cwd=ROOT)
    assert killed.returncode == 9, killed.stderr[-2000:]
    port = free_port()
    env = child_env(2)
    procs = [subprocess.Popen([sys.executable, str(ROOT / "evaluate.py"), *args, "--out", str(tmp_path / "multi"),
                               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                               "--process-id", str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs[0][-2000:] + errs[1][-2000:]
    assert "resuming: 3 window(s) of grammar, pages from the journal" in errs[0], errs[0][-2000:]
    single = cli(*args, "--out", tmp_path / "single", "--quiet", devices=4)
    assert single.returncode == 0, single.stderr[-2000:]
    multi, one = results_of(tmp_path / "multi"), results_of(tmp_path / "single")
    assert multi.keys() == one.keys()
    for key in one:
        np.testing.assert_allclose(multi[key], one[key], rtol=1e-5)
    assert json.loads((tmp_path / "multi" / "results.json").read_text())["processes"] == 2


def test_sampling_is_reproducible_and_independent_of_batch_and_mesh(ckpt, tmp_path):
    gen = write_jsonl(tmp_path / "qa.jsonl", [{"prompt": f"{i}+", "answer": "x"} for i in range(7)])
    outputs = []
    for batch, mesh, devices in [(1, "1x1", 1), (4, "1x1", 1), (3, "4x2", 8)]:
        out = tmp_path / f"s{batch}{mesh}"
        proc = cli("--ckpt", ckpt, "--data", f"gen:{gen}", "--temperature", "1.0", "--top-p", "0.9",
                   "--seed", "5", "--batch-size", batch, "--mesh", mesh, "--out", out, "--log-samples",
                   "--max-new-tokens", "8", "--quiet", devices=devices)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outputs.append([json.loads(l)["output"] for l in (out / "samples.jsonl").read_text().splitlines()])
    assert outputs[0] == outputs[1] == outputs[2]
    assert len(set(outputs[0])) > 1  # it really sampled


# Ctrl-C where Python or jax does not let a KeyboardInterrupt through as it is
CTRL_C_SCRIPTS = {
    # Python swallows what a gc callback raises, and jax runs one at every collection
    "in a gc callback": """
def ctrl_c_in_gc_callback(phase, info):
    if phase == "start":
        signal.raise_signal(signal.SIGINT)  # handled inside the callback
def command():
    gc.callbacks.append(ctrl_c_in_gc_callback)
    gc.collect()
    gc.callbacks.remove(ctrl_c_in_gc_callback)
    time.sleep(30)  # the rest of a long run
""",
    # jax re-raises one that lands in a callback from its C++ (a pytree's __eq__) as a ValueError
    "wrapped by jax": """
def command():
    try:
        signal.raise_signal(signal.SIGINT)
    except KeyboardInterrupt as e:
        raise ValueError("Exception raised while checking equality of metadata fields of pytree") from e
""",
}


@pytest.mark.parametrize("where", list(CTRL_C_SCRIPTS))
def test_ctrl_c_ends_the_run_where_python_or_jax_would_hide_it(where):
    # The command's own time, printed as it ends: importing jax on a busy machine takes 30 s
    script = ("import gc, signal, sys, time\nimport jobs\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # as in a terminal
              + CTRL_C_SCRIPTS[where]
              + "def timed():\n    start = time.time()\n    try:\n        command()\n"
                "    finally:\n        print(time.time() - start)\n"
                "sys.exit(jobs.exit_status(timed))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 130 and float(proc.stdout) < 20, proc.stderr
    assert proc.stderr.strip().splitlines() == ["interrupted: nothing partial was written"]


TRAINING = ["gpt/train/pretrain", "--steps", "1", "--n-layers", "1", "--n-embd", "32", "--quiet"]
BAD_TRAINING = [  # (options, words of the error): each refused before a step or a rollout
    (["--lr", "nan"], "--lr must be"), (["--lr", "-0.001"], "--lr must be"), (["--lr", "inf"], "--lr must be"),
    (["--lr", "0"], "--lr must be"), (["--min-lr-ratio", "1.5"], "--min-lr-ratio must be in [0, 1]"),
    (["--weight-decay", "nan"], "--weight-decay must be"), (["--weight-decay", "-1"], "--weight-decay must be"),
    (["--warmup", "-3"], "--warmup must be at least 0"), (["--eval-every", "-1"], "--eval-every must be at least 0"),
    (["--n-embd", "30", "--n-head", "4"], "n_head 4 does not divide n_embd 30"),
    (["--n-layers", "100000000"], "memory available"),
    (["--seq-len", "100000000"], "--seq-len", "memory available")]


def test_training_options_that_cannot_be_right_are_refused_before_anything_runs(ckpt, tmp_path, capsys, monkeypatch):
    """A learning rate that is NaN, infinite, negative or 0 (NaN trained to the end, then the
    weights were blamed), other non-finite or impossible values, sizes no checkpoint can hold,
    batches that cannot fit in 16 GB (the RL stage's --ptx-rows 200000 ran 30 s into a
    traceback asking for 243 GB), --out the checkpoint that --init names (--rl and --sft):
    exit 2 and one line, nothing trained, nothing written. A batch that XLA finds beyond memory all the same ends
    in one line too."""
    monkeypatch.setattr(gpt, "available_memory", lambda: 16 * 10**9)
    rl = ["gpt/train/rl", "--init", str(ckpt), "--steps", "1", "--quiet"]
    cases = [(TRAINING + args + ["--out", str(tmp_path / f"p{i}")], words) for i, (args, *words) in enumerate(BAD_TRAINING)]
    cases += [(rl + args + ["--out", str(tmp_path / f"r{i}")], words) for i, (args, *words) in enumerate([
        (["--lr", "nan"], "--lr must be"), (["--lr", "-1e-3"], "--lr must be"), (["--ptx", "nan"], "--ptx must be"),
        (["--ptx", "-0.1"], "--ptx must be"), (["--warmup", "-1"], "--warmup must be at least 0"),
        (["--weight-decay", "inf"], "--weight-decay must be"),
        (["--ptx", "0.1", "--ptx-rows", "200000"], "--ptx-rows 200000", "memory available")])]
    sft = ["gpt/train/sft", "--init", str(ckpt), "--steps", "1", "--quiet"]
    cases += [(sft + args + ["--out", str(tmp_path / f"s{i}")], words) for i, (args, *words) in enumerate([
        (["--lr", "inf"], "--lr must be"), (["--ptx", "nan"], "--ptx must be"),
        (["--min-lr-ratio", "2"], "--min-lr-ratio must be"), (["--batch-size", "9000000"], "--batch-size 9000000",
                                                              "memory available"),
        (["--ptx-rows", "200000"], "--ptx-rows 200000", "memory available")])]
    before = files_of(ckpt)
    cases += [(stage + ["--out", out], ["--out", "is the checkpoint --init names"])
              for stage in (rl, sft) for out in (ckpt, f"{ckpt}/", ckpt / ".")]
    for args, words in cases:
        assert jobs.main(args) == 2, args
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and all(word in lines[0] for word in words), (args, lines)
    assert files_of(ckpt) == before and sorted(p.name for p in tmp_path.iterdir()) == []

    def out_of_memory(trainer):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 242790897320 bytes.")
    monkeypatch.setattr(train.BaseTrainer, "train", out_of_memory)
    assert jobs.main(TRAINING + ["--out", str(tmp_path / "oom")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: out of memory while training (JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating "
        "242790897320 bytes.); a smaller batch would fit (--batch-size, --micro-batch-size, --seq-len, --ptx-rows)"]


def test_killed_training_leaves_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "train"
    env = child_env(1)
    proc = subprocess.Popen([sys.executable, str(ROOT / "jobs.py"), "gpt/train/pretrain", "--out", str(out),
                             "--steps", "100000", "--ckpt-every", "2", "--batch-size", "4", "--seq-len", "32",
                             "--n-layers", "1", "--n-embd", "32"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / "model.safetensors").exists() and time.time() < deadline:
        time.sleep(0.5)
    time.sleep(3)
    proc.kill()
    _, err = proc.communicate()
    assert "step 10/100000: loss" in err  # no terminal: progress comes as plain lines
    mesh = gpt.make_mesh(1, 1, devices=jax.devices()[:1])
    model, variables, config = checkpoints.load_checkpoint(str(out), mesh)
    assert config["step"] >= 2 and model.n_embd == 32


# `python jobs.py gpt/train/pretrain ARGS` sent SIGTERM right after its second checkpoint's
# model.safetensors is renamed into place, before its config.json is
SIGTERM_BETWEEN_CHECKPOINT_FILES = r"""
import os, signal, sys
import jobs
replace, renamed = os.replace, []

def replace_then_sigterm(source, target):
    replace(source, target)
    renamed.append(os.path.basename(target))
    if renamed.count("model.safetensors") == 2 and renamed[-1] == "model.safetensors":
        os.kill(os.getpid(), signal.SIGTERM)

os.replace = replace_then_sigterm
sys.exit(jobs.main(["gpt/train/pretrain", *sys.argv[1:]]))
"""


def test_a_signal_between_a_checkpoints_files_leaves_the_new_checkpoint_whole(tmp_path):
    """SIGTERM between the renames of a checkpoint's weights and its config.json (which said
    step 2 beside the weights of step 4): it waits for the last rename, so the checkpoint is
    the new one whole, and no temporary is left."""
    out = tmp_path / "train"
    proc = subprocess.run([sys.executable, "-c", SIGTERM_BETWEEN_CHECKPOINT_FILES, "--out", str(out), "--steps", "6",
                           "--ckpt-every", "2", "--batch-size", "4", "--seq-len", "32", "--n-layers", "1", "--n-embd",
                           "32", "--quiet"], cwd=ROOT, env=child_env(1), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 143 and messages(proc.stderr) == ["terminated: nothing partial was written"], proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["step"] == 4


def test_a_trainer_run_again_starts_its_log_afresh(ckpt, tmp_path, monkeypatch):
    """An SFT run into an --out where a killed one left train_log.jsonl (steps 10 to 30) logs
    its own steps from the start of the file, where they followed the killed run's and the
    steps restarted mid-file: the log is the run's whose checkpoints replace those there."""
    out = tmp_path / "sft"
    out.mkdir()
    (out / "train_log.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (10, 20, 30)))
    monkeypatch.setattr(train.BaseTrainer, "train", lambda trainer: trainer.log({"step": 10, "loss": 0.5}))
    assert jobs.main(["gpt/train/sft", "--init", str(ckpt), "--steps", "10", "--quiet", "--out", str(out)]) == 0
    assert (out / "train_log.jsonl").read_text().splitlines() == ['{"step": 10, "loss": 0.5}']


class Killed(Exception):
    """Where a test stops a save, as SIGKILL would."""


def test_a_checkpoint_killed_between_its_renames_loads_the_newer_save(tmp_path, monkeypatch):
    """SIGKILL between a save's renames (model.safetensors, then config.json) leaves step 20's
    weights beside step 10's config.json: the weights' own copy of their config makes the
    checkpoint step 20's, whole. Weights of another save without one are refused in one
    line naming both saves; files that name no save load as before."""
    path, model, mesh = tmp_path / "ck", gpt.GPT(**SMALL), mesh_of()
    variables = gpt.init_params(model, mesh, seed=0)
    save = lambda step: checkpoints.save_checkpoint(str(path), model, jax.tree.map(lambda x: x * step, variables),
                                                    {"kind": "bytes"}, {"step": step})
    save(10)
    replace = os.replace

    def killed_after_the_weights(source, target):
        replace(source, target)
        if Path(target).name == "model.safetensors":
            raise Killed
    monkeypatch.setattr(os, "replace", killed_after_the_weights)
    with pytest.raises(Killed):
        save(20)
    monkeypatch.setattr(os, "replace", replace)
    assert json.loads((path / "config.json").read_text())["step"] == 10
    _, loaded, config = checkpoints.load_checkpoint(str(path), mesh)
    assert config["step"] == 20
    jax.tree.map(lambda got, want: np.testing.assert_array_equal(np.asarray(got), np.asarray(want * 20)),
                 loaded, variables)
    weights = load_file(str(path / "model.safetensors"))
    save_file(weights, str(path / "model.safetensors"), metadata={"save": config["save"]})
    with pytest.raises(UsageError) as refused:  # weights of another save, without their config
        checkpoints.load_checkpoint(str(path), mesh)
    assert re.fullmatch(rf"{path}: config.json is of the save 'step 10, weights \w{{16}}', model.safetensors of "
                        rf"'step 20, weights \w{{16}}': a run was stopped between their renames; save it again or "
                        "take another checkpoint", str(refused.value)), refused.value
    save(20)
    assert checkpoints.load_checkpoint(str(path), mesh)[2]["step"] == 20
    config = {k: v for k, v in json.loads((path / "config.json").read_text()).items() if k != "save"}
    (path / "config.json").write_text(json.dumps({**config, "step": 10}))  # as written before saves were named
    assert checkpoints.load_checkpoint(str(path), mesh)[2]["step"] == 10


# ---- trust under misuse: a finished run is known by what it computed, an interrupted one
# resumes, results.json and samples.jsonl go together, and bad input is refused up front

def test_a_finished_run_is_known_by_what_it_computed(ckpt, tmp_path):
    """Same fingerprint: nothing to do. Another model, data or scoring option: refused,
    naming what differs, unless --force. Batch size and chunks are not scores."""
    model = tmp_path / "ck"
    shutil.copytree(ckpt, model)
    docs = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    same_lines = tmp_path / "elsewhere"
    same_lines.mkdir()
    shutil.copy(docs, same_lines / "docs.jsonl")
    out = tmp_path / "o"
    run = ["--ckpt", model, "--evals", "grammar", "--limit", "4", "--data", f"ppl:{docs}", "--out", out]
    refused = {"fresh weights": ([a for a in run if a not in ("--ckpt", model)], "model.checkpoint"),
               "--seed 1": (run + ["--seed", "1"], "options.seed: 0 -> 1"),
               "--dtype bfloat16": (run + ["--dtype", "bfloat16"], "options.dtype"),
               "--limit 3": (run[:4] + ["--limit", "3"] + run[6:], "options.limit: 4 -> 3"),
               "--log-samples": (run + ["--log-samples"], "options.log_samples"),
               "same lines elsewhere": (run[:7] + [f"ppl:{same_lines / 'docs.jsonl'}"] + run[8:], "datasets.docs.path")}
    changed_data = {"write": str(docs), "text": json.dumps({"text": "other words"}) + "\n"}
    changed_model = {"write": str(model / "config.json"),
                     "text": json.dumps({**json.loads((model / "config.json").read_text()), "step": 7})}
    first, again, spread, *outcomes = cli_many(
        run, run, run + ["--batch-size", "3", "--chunks", "2"], *(args for args, _ in refused.values()),
        changed_data, run, changed_model, run, run + ["--force"], run)
    assert first.returncode == 0, first.stderr
    assert oct((out / "results.json").stat().st_mode & 0o777) == "0o644"  # not mkstemp's 0600
    recorded = json.loads((out / "results.json").read_text())["fingerprint"]
    assert recorded["model"]["checkpoint"] == str(model)
    assert set(recorded["model"]["files"]) == {"config.json", "model.safetensors"}
    assert recorded["datasets"]["docs"]["sha256"] == hashlib.sha256(docs.read_bytes()).hexdigest()
    assert set(recorded["options"]) >= {"evals", "limit", "dtype", "seed", "temperature", "top_p", "max_new_tokens"}
    assert not set(recorded["options"]) & {"batch_size", "mesh", "chunks", "quiet", "out"}
    for proc in (again, spread):
        assert proc.returncode == 0 and "nothing to do" in proc.stderr, proc.stderr
    *refusals, new_data, new_model, forced, after = outcomes
    for (_, needle), proc in zip(refused.values(), refusals):
        assert_usage_error(proc, "holds another run", needle, "--force")
    assert_usage_error(new_data, "datasets.docs.")  # the same path, other lines
    assert_usage_error(new_model, "model.files.config.json")
    assert forced.returncode == 0 and after.returncode == 0 and "nothing to do" in after.stderr
    assert json.loads((out / "results.json").read_text())["n_samples"]["docs"] == 1


PROGRESS_LINE = re.compile(r"[\w.-]+: \d+/\d+ \w+, [\d,]+ tokens/s, \d+ s")


def messages(stderr):
    """stderr's lines but the progress lines a slow or busy machine prints (a block that
    took over PROGRESS_SECONDS)."""
    return [line for line in stderr.strip().splitlines() if not PROGRESS_LINE.fullmatch(line)]


def journaled_so_far(out):
    """The evaluations whose windows the journal in `out` holds so far, in order."""
    try:
        payloads, _ = runs.read_frames((out / runs.JOURNAL_FILE).read_bytes())
    except OSError:
        return []
    return list(dict.fromkeys(p["call"].split("/")[0] for p in payloads[1:]))


def test_an_interrupted_run_resumes_and_ends_as_an_uninterrupted_one(ckpt, tmp_path):
    """SIGTERM during the third of four evaluations: exit 143 with one line, the windows of
    the two finished ones and the third's first journaled; the same command again computes
    the rest, and results.json and samples.jsonl equal those of a run never interrupted."""
    data = [("mc", "choices", MC), ("gen", "qa", GEN),
            ("ppl", "long", [{"text": f"document {i} " * 30} for i in range(60)]), ("acc", "seq", DOCS)]
    args = ["--ckpt", ckpt, "--batch-size", "1", "--chunks", "1", "--max-new-tokens", "4", "--log-samples"]
    for kind, name, rows in data:
        args += ["--data", f"{kind}:{write_jsonl(tmp_path / (name + '.jsonl'), rows)}"]
    out = tmp_path / "o"
    proc = subprocess.Popen([sys.executable, str(ROOT / "evaluate.py"), *map(str, args), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=driver_env())
    deadline = time.time() + 120
    while len(journaled_so_far(out)) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.terminate()  # SIGTERM, as kill and schedulers send it
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and messages(err) == ["terminated: nothing partial was written"], err
    assert journaled_so_far(out) == ["choices", "qa", "long"] and not (out / "results.json").exists()
    again, whole = cli_many(args + ["--out", out], args + ["--out", tmp_path / "whole"])
    assert again.returncode == 0 and "of choices, qa, long from the journal" in again.stderr, again.stderr[-2000:]
    assert whole.returncode == 0, whole.stderr[-2000:]
    first, second = (json.loads((d / "results.json").read_text()) for d in (tmp_path / "whole", out))
    for key in ("results", "metrics", "n_samples", "stderr", "fingerprint"):
        assert first[key] == second[key], key
    assert (out / "samples.jsonl").read_bytes() == (tmp_path / "whole" / "samples.jsonl").read_bytes()
    assert sorted(files_of(out)) == ["results.json", "samples.jsonl"]  # the journal is gone


FINGERPRINT = {"model": {"checkpoint": "org/tiny", "commit": "a" * 40, "files": {}},
               "datasets": {"docs": {"kind": "acc", "sha256": "1"}}, "options": {"seed": 0}}


@needs_lm_eval
def test_the_journal_changes_no_block_a_run_executes(ckpt, tmp_path, monkeypatch):
    """The journal records what the inference core finished and plans nothing: a run executes
    the same blocks (count and shapes) and the same rollouts with it as without it (the
    library's evaluate, and a run under GPT_EVAL_JOURNAL=0), on --data files of each kind
    and on an lm-eval task, each several of the core's windows long (windows of 2 x 2 x 8
    packs, 2 x 8 prompts)."""
    rows = {"mc": [{"context": f"{i} cats", "choices": [" see", f" saw {i}"], "gold": 0} for i in range(40)],
            "gen": [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)],
            "ppl": [{"text": f"the {i} dogs see a cat. " * (1 + i % 7)} for i in range(40)],
            "acc": [{"text": f"abc{i}|abc{i}"} for i in range(40)]}
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    (task_dir / "choose.yaml").write_text(json.dumps(
        {"task": "choose", "dataset_path": "json", "dataset_name": None, "test_split": "test",
         "dataset_kwargs": {"data_files": {"test": str(write_jsonl(tmp_path / "q.jsonl", rows["gen"]))}},
         "doc_to_text": "prompt", "output_type": "multiple_choice", "doc_to_choice": ["{{answer}}", " no"],
         "doc_to_target": 0, "metric_list": [{"metric": "acc"}]}))
    args = ["--ckpt", str(ckpt), "--mesh", "1x1", "--batch-size", "2", "--chunks", "2", "--max-new-tokens", "4", "--quiet",
            "--tasks", "choose", "--include-path", str(task_dir), "--bootstrap-iters", "0",
            *sum([["--data", f"{kind}:{write_jsonl(tmp_path / f'{kind}.jsonl', r)}"] for kind, r in rows.items()], [])]

    def job(out):
        cfg = jobs.parse_options(evaluate.EvaluatorConfig, args + ["--out", str(tmp_path / out)])
        cfg.validate()
        spec = jobs.ExecutionSpec(name=evaluate.BackboneEvaluate.KEY, out_dir=cfg.out, mesh=cfg.mesh, seed=cfg.seed,
                                  cfg=cfg)
        return evaluate.BackboneEvaluate(spec, checkpoints.Node(cfg.ckpt)), spec, cfg

    journaled, _, _ = job("run")
    journaled.run()  # the command line's run, its journal written as it goes
    alone, spec, cfg = job("alone")
    alone.evaluate()  # the library's: no journal
    tasks.run_tasks(alone, spec, cfg, lambda text: None)
    monkeypatch.setenv("GPT_EVAL_JOURNAL", "0")
    unjournaled, _, _ = job("off")
    unjournaled.run()
    runs = [(j.counts.blocks, j.counts.rollouts) for j in (journaled, alone, unjournaled)]
    assert runs[0] == runs[1] == runs[2] and len(runs[0][0]) >= 12 and len(runs[0][1]) >= 3
    assert results_of(tmp_path / "run") == results_of(tmp_path / "off")


SCORED = [[-1.5, 4, 1], [-2.25, 4, 4]]  # (log-probability, tokens, correct ones) of two requests


def test_the_journal_keeps_whole_records_of_its_own_fingerprint_only(tmp_path):
    """Records cut short or failing their checksum end what is read (and are cut off before
    the next append); a journal of another option, data byte or revision is never read; a
    window holding a NaN is not journaled, nor any after it in its call."""
    spec = jobs.ExecutionSpec("gpt/evaluate", out_dir=str(tmp_path))
    path = spec.path(runs.JOURNAL_FILE)
    journal = runs.Journal(spec, FINGERPRINT)
    journal.add("docs/loglikelihood_rolling/0", "a" * 64, SCORED[:1])
    journal.add("docs/loglikelihood_rolling/0", "b" * 64, SCORED)
    journal.add("docs/generate_until/0", "c" * 64, [["text", [1, 2], False]])
    journal.add("other/loglikelihood/0", "d" * 64, [[math.nan, 4, 1]])
    journal.add("other/loglikelihood/0", "e" * 64, SCORED)
    journal.close()
    whole = path.read_bytes()
    path.write_bytes(whole + runs.frame(b'{"call": "docs/loglikelihood/1", "digest": "", "results": []}')[:-5])
    journal = runs.Journal(spec, FINGERPRINT)  # a kill mid-append, above
    assert journal.kept("docs/loglikelihood_rolling/0") == [("a" * 64, SCORED[:1]), ("b" * 64, SCORED)]
    assert journal.kept("docs/generate_until/0") == [("c" * 64, [["text", [1, 2], False]])]
    assert journal.kept("other/loglikelihood/0") == [] and path.read_bytes() == whole
    journal.close()
    path.write_bytes(whole.replace(b'-2.25', b'-2.5'))  # a changed byte fails its record's checksum
    assert list(runs.Journal(spec, FINGERPRINT).windows) == ["docs/loglikelihood_rolling/0"]
    for where, value in [("options", {"seed": 1}), ("datasets", {"docs": {"sha256": "2"}}),
                         ("model", {**FINGERPRINT["model"], "commit": "b" * 40})]:
        path.write_bytes(whole)
        assert runs.journal_holds(path, FINGERPRINT)
        assert runs.Journal(spec, {**FINGERPRINT, where: value}).windows == {}, where
        assert not runs.journal_holds(path, FINGERPRINT)  # replaced by the other run's


# `python evaluate.py ARGS` killed (os._exit, as SIGKILL leaves it) at a chosen point: "between"
# windows, after the AFTER-th is journaled; "torn", halfway through writing the AFTER-th; "final",
# once every window is journaled, before results.json is written.
KILLER = r"""
import json, os, sys
import evaluate, runs
mode, after, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
add, added = runs.Journal.add, []

def add_then_kill(self, call, digest, results):
    added.append(call)
    if mode == "torn" and len(added) == after:
        record = runs.frame(json.dumps({"call": call, "digest": digest, "results": results}).encode())
        os.write(self.fd, record[:len(record) // 2])
        os._exit(9)
    add(self, call, digest, results)
    if mode == "between" and len(added) == after:
        os._exit(9)

runs.Journal.add = add_then_kill
if mode == "final":
    evaluate.Evaluator.write_results = lambda *args: os._exit(9)
sys.exit(evaluate.main(argv))
"""


def without_timing(out):
    """results.json less what differs between two runs of one command: the time, the programs
    built (a run compiles or loads what the runs before it left in the cache), and --out."""
    results = json.loads((Path(out) / "results.json").read_text())
    del results["seconds"], results["programs"], results["config"]["out"]
    return results


def test_a_killed_run_resumes_from_its_journal_and_ends_as_an_uninterrupted_one(ckpt, tmp_path):
    """Killed between two windows, in the middle of journaling one, and after the last one
    before the final write: the same command computes only the windows the journal lacks and
    writes the results.json (less timing) and samples.jsonl of a run never killed, sampled
    generation included. Results changed in a journal are what a resumed run reports (it
    reads them), and never what a run of another option reports."""
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"text": f"the {i} dogs see a cat. " * (1 + i % 9)} for i in range(40)])
    gen = write_jsonl(tmp_path / "qa.jsonl", [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(36)])
    args = ["--ckpt", ckpt, "--data", f"ppl:{docs}", "--data", f"gen:{gen}", "--max-new-tokens", "4",
            "--temperature", "1.0", "--seed", "3", "--log-samples", "--batch-size", "4",
            "--chunks", "1"]  # windows: ppl three of 32 packs or fewer (rolling windows), gen 32+4 prompts
    kills = {"between": 4, "torn": 2, "final": 0}
    for mode, after in kills.items():
        proc = subprocess.run([sys.executable, "-c", KILLER, mode, str(after), *map(str, args), "--out",
                               str(tmp_path / mode)], capture_output=True, text=True, env=driver_env(), cwd=ROOT)
        assert proc.returncode == 9, proc.stderr[-2000:]
        assert not (tmp_path / mode / "results.json").exists()
    tampered = tmp_path / "tampered"
    shutil.copytree(tmp_path / "between", tampered)
    journal = tampered / runs.JOURNAL_FILE
    payloads, _ = runs.read_frames(journal.read_bytes())
    for payload in payloads[1:]:  # ppl's windows, and gen's first
        if payload["call"].startswith("qa/"):
            for result in payload["results"]:
                result[0] = "journaled"
    journal.write_bytes(b"".join(runs.frame(json.dumps(p).encode()) for p in payloads))
    shutil.copytree(tampered, tmp_path / "other")
    other = [a if a != "3" else "4" for a in args]  # --seed 4
    *resumed, whole, reused, not_reused, other_whole = cli_many(
        *(args + ["--out", tmp_path / mode] for mode in kills), args + ["--out", tmp_path / "whole"],
        args + ["--out", tampered], other + ["--out", tmp_path / "other"], other + ["--out", tmp_path / "other-whole"])
    for (mode, windows), proc in zip({"between": 4, "torn": 1, "final": 5}.items(), resumed):
        assert proc.returncode == 0 and f"resuming: {windows} window(s)" in proc.stderr, (mode, proc.stderr[-2000:])
        assert without_timing(tmp_path / mode) == without_timing(tmp_path / "whole"), mode
        assert files_of(tmp_path / mode)["samples.jsonl"] == files_of(tmp_path / "whole")["samples.jsonl"], mode
        assert sorted(files_of(tmp_path / mode)) == ["results.json", "samples.jsonl"], mode  # the journal is gone
    assert reused.returncode == 0 and not_reused.returncode == 0 and other_whole.returncode == 0
    outputs = [json.loads(line).get("output") for line in (tampered / "samples.jsonl").read_text().splitlines()]
    assert outputs[40:] == ["journaled"] * 32 + [json.loads(line)["output"] for line in
                                                 (tmp_path / "whole" / "samples.jsonl").read_text().splitlines()[72:]]
    assert "resuming" not in not_reused.stderr
    assert without_timing(tmp_path / "other") == without_timing(tmp_path / "other-whole")


@pytest.mark.skipif(tasks.lm_eval is None, reason=f"needs {tasks.LM_EVAL}")
def test_a_killed_lm_eval_run_resumes_from_its_journal(ckpt, tmp_path):
    """--tasks journals lm-eval's requests window by window too: killed after some windows,
    the same command reads them back, computes the rest, and reports what a run never
    killed reports (log-likelihoods and sampled generations), its samples included."""
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    qa = write_jsonl(tmp_path / "qa.jsonl", [{"q": f"{i} + {i} =", "a": f" {2 * i}"} for i in range(50)])
    for name, fields in [("choose", {"output_type": "multiple_choice", "doc_to_choice": ["{{a}}", " no"],
                                     "doc_to_target": 0, "metric_list": [{"metric": "acc"}]}),
                         ("sample", {"output_type": "generate_until", "doc_to_target": "a",
                                     "metric_list": [{"metric": "exact_match"}],
                                     "generation_kwargs": {"until": ["\n"], "do_sample": True, "temperature": 1.0,
                                                           "max_gen_toks": 3}})]:
        (task_dir / f"{name}.yaml").write_text(json.dumps(
            {"task": name, "dataset_path": "json", "dataset_name": None, "test_split": "test",
             "dataset_kwargs": {"data_files": {"test": str(qa)}}, "doc_to_text": "q", **fields}))
    args = ["--ckpt", ckpt, "--tasks", "choose,sample", "--include-path", task_dir, "--log-samples",
            "--batch-size", "4", "--chunks", "1"]  # windows of 4 x 8 packs (of a question's 2 choices), 4 x 8 prompts
    killed = subprocess.run([sys.executable, "-c", KILLER, "between", "3", *map(str, args), "--out",
                             str(tmp_path / "killed")], capture_output=True, text=True, env=driver_env(), cwd=ROOT)
    assert killed.returncode == 9, killed.stderr[-2000:]
    resumed, whole = cli_many(args + ["--out", tmp_path / "killed"], args + ["--out", tmp_path / "whole"])
    assert resumed.returncode == 0 and "resuming: 3 window(s) of lm-eval" in resumed.stderr, resumed.stderr[-2000:]
    assert whole.returncode == 0, whole.stderr[-2000:]
    results = {d: without_timing(tmp_path / d) for d in ("whole", "killed")}
    for key in ("results", "stderr", "n_samples"):
        assert results["whole"][key] == results["killed"][key], key
    for task in ("choose", "sample"):  # lm-eval's samples files, each run's own (their names hold a time)
        lines = [[{k: json.loads(line)[k] for k in ("doc_id", "resps", "filtered_resps")}
                  for line in (tmp_path / d / run["lm_eval"]["samples"][task]).read_text().splitlines()]
                 for d, run in results.items()]
        assert lines[0] == lines[1] and len(lines[0]) == 50, task
    assert not (tmp_path / "killed" / runs.JOURNAL_FILE).exists()


@pytest.fixture(scope="module")
def journaled(ckpt, tmp_path_factory):
    """A run of the four kinds killed once every window was journaled (windows of 8 samples at
    batch size 1 and one chunk: two an evaluation), so that a resumed run reads every
    evaluation from the journal; and the same run never killed.
    (arguments but --out, the killed run's directory, its journal's payloads, the whole run's directory)"""
    tmp = tmp_path_factory.mktemp("journaled")
    data = {"ppl": [{"text": f"the {i} dogs see a cat. " * (1 + i % 3)} for i in range(9)] + [{"text": ""}],
            "mc": [{"context": f"{i}+{i}=", "choices": [str(2 * i), str(i)], "gold": 0} for i in range(10)],
            "gen": [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(10)],
            "acc": [{"text": f"abc{i}|abc{i}"} for i in range(10)]}
    args = ["--ckpt", ckpt, *sum([["--data", f"{kind}:{write_jsonl(tmp / f'{kind}.jsonl', rows)}"]
                                  for kind, rows in data.items()], []),
            "--max-new-tokens", "3", "--log-samples", "--batch-size", "1", "--chunks", "1", "--quiet"]
    killed = subprocess.run([sys.executable, "-c", KILLER, "final", "0", *map(str, args), "--out", str(tmp / "killed")],
                            capture_output=True, text=True, env=driver_env(), cwd=ROOT)
    assert killed.returncode == 9, killed.stderr[-2000:]
    whole, = cli_many(args + ["--out", tmp / "whole"])
    assert whole.returncode == 0, whole.stderr[-2000:]
    payloads, _ = runs.read_frames((tmp / "killed" / runs.JOURNAL_FILE).read_bytes())
    assert len(payloads) == 9, payloads  # the header, and two windows of each evaluation
    return args, tmp / "killed", payloads, tmp / "whole"


def with_journal(killed, target, payloads):
    """A copy of the killed run's directory whose journal holds `payloads`, each checksummed."""
    shutil.copytree(killed, target)
    (target / runs.JOURNAL_FILE).write_bytes(b"".join(runs.frame(json.dumps(p).encode()) for p in payloads))
    return target


def tampered(payloads, position, change):
    """The payloads, with change(payload) applied to a copy of the one at `position`."""
    payloads = copy.deepcopy(payloads)
    change(payloads[position])
    return payloads


def test_journal_records_of_another_shape_are_dropped_with_what_follows(journaled, tmp_path):
    """A checksum says a record is whole, not that this version wrote it: a window whose call
    is a list, one whose results are strings (as many as its requests), one holding a NaN
    log-probability, one with more right tokens than tokens, one whose digest is no digest.
    Each is dropped with the windows after it, as a torn one is (the file cut there), and
    the run resumes from those before it, ending as the run never killed. A window of the
    right shape asked by other requests (another digest) ends what its call takes back."""
    args, killed, payloads, whole = journaled
    position = {p["call"].split("/")[0]: n for n, p in reversed(list(enumerate(payloads))) if n}  # first windows
    nan = lambda p: p["results"][1].__setitem__(0, math.nan)
    cases = {"call-list": (position["mc"] + 1, lambda p: p.update(call=[p["call"]])),
             "strings": (position["gen"], lambda p: p.update(results=["x"] * len(p["results"]))),
             "nan": (position["acc"], nan),
             "right": (position["ppl"], lambda p: p["results"][0].__setitem__(2, p["results"][0][1] + 1)),
             "digest": (position["mc"], lambda p: p.update(digest="0" * 63)),
             "other-requests": (position["mc"], lambda p: p.update(digest="0" * 64))}
    spec = jobs.ExecutionSpec("gpt/evaluate", out_dir=str(tmp_path / "read"))
    with_journal(killed, tmp_path / "read", tampered(payloads, position["acc"], nan))
    journal = runs.Journal(spec, payloads[0]["fingerprint"])
    journal.close()
    assert list(journal.windows) == list(dict.fromkeys(p["call"] for p in payloads[1:position["acc"]]))
    assert runs.read_frames((tmp_path / "read" / runs.JOURNAL_FILE).read_bytes())[0] == payloads[:position["acc"]]
    outcomes = cli_many(*(args + ["--out", with_journal(killed, tmp_path / name, tampered(payloads, n, change))]
                          for name, (n, change) in cases.items()))
    for (name, (n, _)), proc in zip(cases.items(), outcomes):
        assert proc.returncode == 0, (name, proc.returncode, proc.stderr[-2000:])
        assert without_timing(tmp_path / name) == without_timing(whole), name
        assert files_of(tmp_path / name)["samples.jsonl"] == files_of(whole)["samples.jsonl"], name


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=3), max_leaves=6)


RESULTS = st.lists(JSON_VALUES | st.lists(JSON_VALUES, min_size=3, max_size=3), max_size=3)


@st.composite
def reshaped(draw, payloads):
    """The payloads with one changed in shape: its fields (or one of its results) replaced
    by any JSON values, one of them set to any JSON value or removed (the names this version
    writes among them), or any JSON value, or a window of any results, added after it as a
    record of its own."""
    payloads = copy.deepcopy(payloads)
    position = draw(st.integers(0, len(payloads) - 1))
    target = payloads[position]
    names = sorted(target) + ["call", "digest", "results", "format", "zz"]
    how = draw(st.sampled_from(["replace", "set", "remove", "insert", "result"]))
    if how == "insert":
        payloads.insert(position + 1, draw(JSON_VALUES | st.fixed_dictionaries(
            {"call": st.sampled_from([p["call"] for p in payloads[1:]] + ["ppl/generate_until/0", "x/y/0"]),
             "digest": st.sampled_from([p["digest"] for p in payloads[1:]]) | st.text(max_size=4),
             "results": RESULTS})))
    elif how == "result" and position:
        results = target["results"]
        results[draw(st.integers(0, len(results) - 1))] = draw(JSON_VALUES | st.lists(JSON_VALUES, min_size=3,
                                                                                       max_size=3))
    elif how == "replace":
        target.clear()
        target.update(draw(st.dictionaries(st.sampled_from(names), JSON_VALUES | RESULTS, max_size=4)))
    elif how == "set":
        target[draw(st.sampled_from(names))] = draw(JSON_VALUES | RESULTS)
    else:
        target.pop(draw(st.sampled_from(names)), None)
    return payloads


@fuzz_settings(12)
@hypothesis.given(data=st.data())
def test_any_well_checksummed_journal_resumes_or_is_dropped_cleanly(journaled, data):
    """Journals whose records are whole and checksummed but of any shape: the run resumes
    from what it can read, computes the rest, and ends as a run does (exit 0, every sample
    scored), never in a traceback. (A window of the right shape and of this run's requests
    is taken back as it is: values no model gives, a log-probability of -1e300, end in the
    one line that refuses a non-finite score, as broken weights do.)"""
    args, killed, payloads, _ = journaled
    changed = data.draw(reshaped(payloads))
    with tempfile.TemporaryDirectory() as tmp:
        out = with_journal(killed, Path(tmp) / "o", changed)
        status, err = main_in_process(*args, "--out", out)
        if status == 2:
            assert "non-finite" in err and len(messages(err)) == 1, err
            return
        assert status == 0, err
        assert json.loads((out / "results.json").read_text())["n_samples"] == {"ppl": 9, "mc": 10, "gen": 10, "acc": 10}


def test_results_and_samples_are_replaced_together_or_not_at_all(ckpt, tmp_path):
    """A full disk (file size capped) while writing samples.jsonl, then while writing
    results.json: the previous pair stays as it was, the error names the file, and no
    temporary is left. A run without --log-samples leaves no earlier samples.jsonl behind."""
    out = tmp_path / "o"
    run = ["--ckpt", ckpt, "--evals", "grammar", "--quiet", "--force"]
    first, = cli_many(run + ["--limit", "4", "--log-samples", "--out", out])
    assert first.returncode == 0, first.stderr
    pair = files_of(out)
    samples, results = len(pair["samples.jsonl"]), len(pair["results.json"])
    assert samples < results  # so a cap between the two sizes fails only results.json
    shutil.copytree(out, tmp_path / "o2")
    other = run + ["--limit", "2"]  # fewer samples: a replaced samples.jsonl would show
    # its journal whole (a run killed before its final write), so that only the final write meets the cap
    killed = subprocess.run([sys.executable, "-c", KILLER, "final", "0", *map(str, other), "--log-samples", "--out",
                             str(tmp_path / "killed")], capture_output=True, text=True, env=driver_env(), cwd=ROOT)
    assert killed.returncode == 9, killed.stderr[-2000:]
    journal = (tmp_path / "killed" / runs.JOURNAL_FILE).read_bytes()
    (out / runs.JOURNAL_FILE).write_bytes(journal)
    no_room_for_samples, no_room_for_results, no_samples = cli_many(
        {"fsize": samples // 4}, other + ["--log-samples", "--out", out],
        {"fsize": (samples + results) // 2}, other + ["--log-samples", "--out", out],
        {"fsize": None}, other + ["--out", tmp_path / "o2"], compile_cache=False)
    assert_usage_error(no_room_for_samples, "File too large", str(out / "samples.jsonl"))
    assert_usage_error(no_room_for_results, "File too large", str(out / "results.json"))
    assert files_of(out) == {**pair, runs.JOURNAL_FILE: journal}
    assert no_samples.returncode == 0 and sorted(files_of(tmp_path / "o2")) == ["results.json"]


def with_model_config(ckpt, target, change):
    """A copy of a native checkpoint, change(config) applied to its config.json."""
    shutil.copytree(ckpt, target)
    config = json.loads((target / "config.json").read_text())
    change(config)
    (target / "config.json").write_text(json.dumps(config))
    return target


def with_tensors(ckpt, target, change):
    shutil.copytree(ckpt, target)
    tensors = load_file(str(target / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(target / "model.safetensors"))
    return target


ABSURD = [("n_layers", 10**7), ("vocab_size", 10**12), ("n_embd", 4 * 10**6), ("mlp_hidden", 10**13),
          ("n_layers", 10**30)]  # each would take hours or terabytes to build
BAD_MODEL_FIELDS = [  # (field, value, words of the error)
    ("n_head", 0, "n_head must be at least 1"), ("n_head", 3, "n_head 3 does not divide n_embd 64"),
    ("n_layers", -1, "n_layers must be at least 1"), ("vocab_size", 0, "vocab_size must be at least 1"),
    ("n_embd", 64.5, "'n_embd' must be an integer"), ("n_embd", "64", "'n_embd' must be an integer"),
    ("n_embd", True, "'n_embd' must be an integer"), ("block_size", None, "'block_size' must be an integer"),
    ("mlp", "relu", "unknown mlp 'relu'"), ("norm", "batchnorm", "unknown norm 'batchnorm'"),
    ("norm_eps", -1.0, "norm_eps must be above 0"), ("dropout", "x", "'dropout' must be a number"),
    ("rotary_fraction", 2.0, "rotary_fraction must be in (0, 1]"), ("rope", "yes", "'rope' must be true or false"),
    ("n_kv_head", 3, "n_kv_head 3 does not divide n_head 4"), ("head_dim", 0, "head_dim must be at least 1"),
    ("foo", 1, "unknown model field 'foo'"), ("n_layers", 1000, "n_layers 1000, the weights hold 2 blocks"),
    ("sliding_window", 0, "sliding_window must be at least 1"), ("window_pattern", "SX", "window_pattern must be"),
    ("logit_softcap", -30.0, "logit_softcap must be above 0"), ("rope_scaling", ["yarn", 4.0], "rope_scaling"),
    ("rope_scaling", ["llama3", 8.0], "rope_scaling"), ("rope_scaling", "linear", "'rope_scaling' must be a list or null"),
] + [(name, value, "memory available") for name, value in ABSURD]


def test_bad_native_checkpoints_are_refused_before_anything_is_built(ckpt, tmp_path):
    """Every config.json field checked for presence, type and range; absurd sizes refused at
    once from an estimate of the parameter bytes; weights that are not floats, that the
    model does not use, or that two files without an index both hold (the last file's were
    read), refused."""
    cases = [(with_model_config(ckpt, tmp_path / f"f{i}", lambda c, n=name, v=value: c["model"].update({n: v})),
              ["config.json", words]) for i, (name, value, words) in enumerate(BAD_MODEL_FIELDS)]
    cases += [(with_model_config(ckpt, tmp_path / "nomodel", lambda c: c.pop("model")), ['no "model"']),
              (with_model_config(ckpt, tmp_path / "listmodel", lambda c: c.update(model=[2, 64])),
               ['"model" must be an object']),
              (with_model_config(ckpt, tmp_path / "tokenizer", lambda c: c.update(tokenizer="bytes")),
               ['"tokenizer" must be']),
              (with_model_config(ckpt, tmp_path / "huge", lambda c: c.update(notes="x" * (9 << 20))), ["over 8 MB"])]
    for dtype in (np.int32, bool):
        cases.append((with_tensors(ckpt, tmp_path / f"t{np.dtype(dtype)}",
                                   lambda t, d=dtype: t.update({"ln_f/scale": np.ones(64, d)})),
                      ["ln_f/scale", f"dtype {np.dtype(dtype)}"]))
    cases.append((with_tensors(ckpt, tmp_path / "extra", lambda t: t.update({"extra/w": np.ones(3, np.float32)})),
                  ["does not use", "extra/w"]))
    twice = tmp_path / "twice"  # two files without an index, both holding a tensor: which did the user mean?
    shutil.copytree(ckpt, twice)
    save_file({"ln_f/scale": np.full(64, 2.0, np.float32)}, str(twice / "more.safetensors"))
    cases.append((twice, ["'ln_f/scale'", "model.safetensors", "more.safetensors", "no index"]))
    outcomes = cli_many(*(["--ckpt", path, "--evals", "grammar", "--limit", "2", "--out", tmp_path / "o"]
                          for path, _ in cases))
    for (path, needles), proc in zip(cases, outcomes):
        assert_usage_error(proc, *needles, out=tmp_path / "o")
    for proc, (_, _, words) in zip(outcomes, BAD_MODEL_FIELDS):
        if words == "memory available" or "blocks" in words:
            assert proc.seconds < 1, (words, proc.seconds)  # estimated, never built


@pytest.fixture(scope="module")
def hf_gpt2(tmp_path_factory):
    """A tiny HuggingFace GPT-2 directory with a tokenizer trained here (no torch needed)."""
    root = tmp_path_factory.mktemp("hfgpt2")
    train_tokenizer(str(root / "tokenizer"))
    model = gpt.GPT(**{**SMALL, "vocab_size": VOCAB})  # SMALL is GPT-2 layout
    export_gpt2(model, gpt.init_params(model, mesh_of(), seed=0), str(root / "gpt2"), str(root / "tokenizer"))
    return root / "gpt2"


def test_bad_huggingface_directories_are_refused(hf_gpt2, tmp_path):
    """Impossible sizes, a weight_map that is not a mapping of file names, no tokenizer
    files; and transformers' warnings never come before the error line."""
    def changed(name, **config):
        return with_config(hf_gpt2, tmp_path / name, **config)

    def index(name, weight_map):
        target = tmp_path / name
        shutil.copytree(hf_gpt2, target)
        (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        return target

    def misplaced(name):  # the index puts the embedding in a file that does not hold it
        target = index(name, {})
        save_file({"other": np.ones(2, np.uint16)}, str(target / "other.safetensors"))  # a dtype never read
        weight_map = {n: "model.safetensors" for n in load_file(str(target / "model.safetensors"))}
        (target / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {**weight_map, "transformer.wte.weight": "other.safetensors"}}))
        return target

    def without_tokenizer():
        target = tmp_path / "notokenizer"
        shutil.copytree(hf_gpt2, target, ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges*",
                                                                       "special_tokens*"))
        return target

    cases = [(changed("nohead", n_head=0), ["n_head must be a positive integer"]),
             (changed("fivehead", n_head=5), ["n_head 5 does not divide n_embd 64"]),
             (changed("negative", n_embd=-64), ["n_embd must be a positive integer"]),
             (changed("nopositions", n_positions=0), ["n_positions must be a positive integer"]),
             (changed("inner", n_inner=-1), ["n_inner must be a positive integer"]),
             (changed("deep", n_layer=10**7), ["memory available"]),
             (index("list", ["model.safetensors"]), ['"weight_map" must map tensor names to file names']),
             (index("ints", {"transformer.wte.weight": 5}), ['"weight_map" must map']),
             (index("escape", {"transformer.wte.weight": "../gpt2/model.safetensors"}), ["is not a file name in"]),
             (misplaced("misplaced"), ["other.safetensors: cannot read tensor 'transformer.wte.weight'",
                                       "the file does not hold it"]),
             (without_tokenizer(), ["no tokenizer files"])]
    outcomes = cli_many(*(["--ckpt", path, "--evals", "grammar", "--limit", "2", "--out", tmp_path / "o"]
                          for path, _ in cases))
    for (path, needles), proc in zip(cases, outcomes):
        assert_usage_error(proc, *needles, out=tmp_path / "o")
    # a fresh process, as transformers' logging writes to the stderr it found first
    no_vocabulary = changed("novocabulary", vocab_size=0)
    assert_usage_error(cli("--ckpt", no_vocabulary, "--evals", "grammar", "--limit", "2", "--out", tmp_path / "o",
                           devices=1), "vocab_size must be a positive integer", out=tmp_path / "o")


def hub_cache(cache, repo, snapshots, refs):
    """A HuggingFace cache as huggingface_hub writes it: models--ORG--NAME/blobs/ holding each
    file once by its hash, snapshots/COMMIT/NAME linking to them, refs/REF holding a commit.
    `snapshots`: {commit: directory whose files it holds}."""
    root = cache / ("models--" + repo.replace("/", "--"))
    for commit, directory in snapshots.items():
        for source in sorted(Path(directory).rglob("*")):
            if source.is_file():
                data = source.read_bytes()
                blob = root / "blobs" / hashlib.sha256(data).hexdigest()
                blob.parent.mkdir(parents=True, exist_ok=True)
                blob.write_bytes(data)
                link = root / "snapshots" / commit / source.relative_to(directory)
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(os.path.relpath(blob, link.parent))
    for ref, commit in refs.items():
        (root / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return root


MAIN, TAGGED, SHARDED = "a" * 40, "b" * 40, "c" * 40  # commits


def test_hub_ids_resolve_offline_through_the_cache(hf_gpt2, tmp_path, monkeypatch):
    """ORG/NAME at a branch, a tag, a commit, from a cache laid out here (HF_HUB_OFFLINE=1,
    as everywhere in the suite); a revision not cached, a snapshot missing a shard its index
    names and an incomplete listing each refused in one line; a local directory of the same
    name wins and says so; the download fetches no pickle and no code."""
    sharded = tmp_path / "sharded"
    shutil.copytree(hf_gpt2, sharded)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    names = list(load_file(sharded / "model-00001-of-00002.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}}))
    cache = tmp_path / "cache"
    root = hub_cache(cache, "org/tiny", {MAIN: hf_gpt2, TAGGED: hf_gpt2, SHARDED: sharded},
                     {"main": MAIN, "v1": TAGGED, "refs/pr/1": SHARDED})
    monkeypatch.setattr(hf.hub_constants, "HF_HUB_CACHE", str(cache))
    assert hf.huggingface_hub.constants.HF_HUB_OFFLINE  # set at the top of this file, before any import
    for text, commit, revision in [("org/tiny", MAIN, "main"), ("org/tiny@main", MAIN, "main"),
                                   ("org/tiny@v1", TAGGED, "v1"), (f"org/tiny@{TAGGED}", TAGGED, TAGGED)]:
        node = hf.resolve_checkpoint(text)
        assert node.hub == {"id": "org/tiny", "revision": revision, "commit": commit}, text
        assert Path(node.path) == root / "snapshots" / commit and not node.is_native
    refused = {"org/tiny@v2": "no snapshot of revision 'v2'", "org/other": "HF_HUB_OFFLINE=1",
               "org/tiny@refs/pr/1": "lacks model-00002-of-00002.safetensors, which model.safetensors.index.json"}
    for text, needle in refused.items():
        with pytest.raises(UsageError, match=re.escape(needle)):
            hf.resolve_checkpoint(text)
    # huggingface_hub's own listing of a commit (what it wrote when it downloaded it), checked offline
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache
    write_tree_cache(str(root), MAIN, {name: TreeCacheEntry(size=1, blob_id="0" * 40)
                                       for name in ["config.json", "model.safetensors", "extra.safetensors"]})
    with pytest.raises(UsageError, match="incomplete.*extra.safetensors"):
        hf.resolve_checkpoint("org/tiny")
    said = []
    monkeypatch.chdir(tmp_path)
    shutil.copytree(hf_gpt2, tmp_path / "org" / "tiny")
    assert hf.resolve_checkpoint("org/tiny", said.append) == checkpoints.Node("org/tiny")
    assert len(said) == 1 and "the local directory" in said[0]
    assert hf.resolve_checkpoint("org", said.append) == checkpoints.Node("org") and len(said) == 1  # no hub id
    from huggingface_hub.utils import filter_repo_objects  # what snapshot_download fetches of a listing
    listing = ["config.json", "generation_config.json", "model.safetensors", "model-00001-of-00002.safetensors",
               "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "merges.txt",
               "chat_template.jinja", "additional_chat_templates/tools.jinja", "pytorch_model.bin",
               "pytorch_model.bin.index.json", "training_args.pt", "modeling_tiny.py", "tokenization_tiny.py",
               "model.onnx", "README.md", "flax_model.msgpack", "tf_model.h5", "original/consolidated.pth"]
    fetched = set(filter_repo_objects(listing, allow_patterns=hf.HUB_FILES))
    assert fetched == set(listing[:10])


def test_a_cached_commit_resolves_without_asking_the_hub(hf_gpt2, tmp_path, monkeypatch):
    """Without HF_HUB_OFFLINE and without a network, a commit the cache holds resolves from it
    at once (its listing was asked for, five times over twenty seconds, printing each retry);
    a branch is still asked for (it moves), and falls back on the cache's ref as before; a
    commit the cache lacks goes to the hub, which cannot be reached: one line."""
    cache = tmp_path / "cache"
    hub_cache(cache, "org/tiny", {MAIN: hf_gpt2}, {"main": MAIN})
    monkeypatch.setattr(hf.hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf.hub_constants, "HF_HUB_OFFLINE", False)
    asked = []

    def unreachable(self, repo_id, *args, **kwargs):
        asked.append(kwargs.get("revision"))
        raise huggingface_hub.errors.OfflineModeIsEnabled("no network")
    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", unreachable)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_tree", unreachable)
    assert hf.resolve_checkpoint(f"org/tiny@{MAIN}").hub["commit"] == MAIN and asked == []
    assert hf.resolve_checkpoint("org/tiny").hub["commit"] == MAIN and asked == ["main"]
    with pytest.raises(UsageError, match="the hub cannot be reached"):
        hf.resolve_checkpoint(f"org/tiny@{TAGGED}")
    assert asked == ["main", TAGGED]


def test_a_hub_id_scores_as_its_snapshot_and_records_its_commit(hf_gpt2, tmp_path):
    """--ckpt ORG/NAME through an offline cache gives the snapshot directory's scores; the
    commit goes into results.json and the fingerprint, so a branch that moved is another run."""
    cache = tmp_path / "cache"
    other = with_config(hf_gpt2, tmp_path / "other", layer_norm_epsilon=1e-3)
    root = hub_cache(cache, "org/tiny", {MAIN: hf_gpt2, TAGGED: other}, {"main": MAIN})
    args = ["--evals", "grammar", "--limit", "4"]
    by_name, by_path, moved = cli_many(
        ["--ckpt", "org/tiny", *args, "--out", tmp_path / "a"],
        ["--ckpt", root / "snapshots" / MAIN, *args, "--out", tmp_path / "b"],
        {"write": str(root / "refs" / "main"), "text": TAGGED},
        ["--ckpt", "org/tiny@main", *args, "--out", tmp_path / "a"], env={"HF_HUB_CACHE": str(cache)})
    assert by_name.returncode == 0 and by_path.returncode == 0, (by_name.stderr, by_path.stderr)
    named, direct = (json.loads((tmp_path / d / "results.json").read_text()) for d in "ab")
    assert named["results"] == direct["results"] and named["metrics"] == direct["metrics"]
    assert named["hub"] == {"id": "org/tiny", "revision": "main", "commit": MAIN} and direct["hub"] is None
    assert named["fingerprint"]["model"]["commit"] == MAIN and named["checkpoint"] == "org/tiny"
    assert named["fingerprint"]["model"]["files"] == direct["fingerprint"]["model"]["files"]
    assert_usage_error(moved, "holds another run", "model.commit: 'aaaa")


@pytest.fixture(scope="module")
def hostile_cache(hf_gpt2, tmp_path_factory):
    """A HuggingFace cache beside a model folder outside it (x/outside_model) and a file naming
    that folder (x/outside_ref), as the hostile sweep laid them out: org/tiny's refs hold a
    commit (main), the outside path (evil), a path climbing out of snapshots/ (climb); its
    snapshot TAGGED is a link to the outside folder (linked); org/evil's main names the
    outside folder too."""
    tmp = tmp_path_factory.mktemp("hostile")
    outside = tmp / "x" / "outside_model"
    shutil.copytree(hf_gpt2, outside)
    (tmp / "x" / "outside_ref").write_text(str(outside))
    root = hub_cache(tmp / "cache", "org/tiny", {MAIN: hf_gpt2},
                     {"main": MAIN, "evil": str(outside), "climb": "../../../x/outside_model", "linked": TAGGED})
    (root / "snapshots" / TAGGED).symlink_to(outside)
    hub_cache(tmp / "cache", "org/evil", {}, {"main": str(outside)})
    return tmp


def climbing_revision(tmp):
    """A revision that walks from the cache's refs/ up to x/outside_ref (the sweep's case)."""
    return "../" * 12 + str(tmp / "x" / "outside_ref").lstrip("/")


def assert_inside_snapshots(node, tmp):
    """A resolved hub id is a folder snapshots/COMMIT of its model's cache folder, links followed."""
    snapshots = (tmp / "cache" / "models--org--tiny" / "snapshots").resolve()
    assert Path(node.path).resolve().parent == snapshots and re.fullmatch("[0-9a-f]{40}", node.hub["commit"])
    assert Path(node.path).resolve().name == node.hub["commit"]


def test_a_hub_revision_never_leads_out_of_the_cache(hostile_cache, monkeypatch):
    """A revision holding '..' (the sweep's, which reached a file naming a model outside the
    cache), a ref whose content is a path out of the cache, a snapshot that links elsewhere:
    each refused in one line, and through the command line nothing is evaluated (exit 2)."""
    tmp = hostile_cache
    monkeypatch.setattr(hf.hub_constants, "HF_HUB_CACHE", str(tmp / "cache"))
    refused = {f"org/tiny@{climbing_revision(tmp)}": "is not a branch, a tag or a commit",
               "org/tiny@..": "is not a branch, a tag or a commit", "org/tiny@refs/../main": "is not a branch",
               "org/tiny@/main": "is not a branch", "org/tiny@caf\u00e9": "is not a branch",
               "org/tiny@evil": "not a snapshot folder", "org/tiny@climb": "not a snapshot folder",
               "org/tiny@linked": "not a snapshot folder", f"org/tiny@{TAGGED}": "not a snapshot folder",
               "org/evil": "not a snapshot folder"}
    for text, needle in refused.items():
        with pytest.raises(UsageError, match=re.escape(needle)):
            hf.resolve_checkpoint(text)
    assert_inside_snapshots(hf.resolve_checkpoint("org/tiny@main"), tmp)
    data = write_jsonl(tmp / "p.jsonl", [{"text": "the cat sees the dog."}])
    outcomes = cli_many(*(["--ckpt", text, "--data", f"ppl:{data}", "--out", tmp / "o"]
                          for text in [f"org/tiny@{climbing_revision(tmp)}", "org/evil"]),
                        env={"HF_HUB_CACHE": str(tmp / "cache")})
    for proc in outcomes:
        assert_usage_error(proc, "--ckpt org/", out=tmp / "o")


REVISION_PIECES = ["main", "v1", "refs", "pr", "1", "evil", "climb", "linked", "..", ".", "", "~", "x", "outside_ref",
                   "outside_model", "snapshots", "models--org--tiny", "caf\u00e9", "\u202e", "a" * 300, MAIN, TAGGED]


@fuzz_settings(200)
@hypothesis.given(pieces=st.lists(st.one_of(st.sampled_from(REVISION_PIECES), st.text(max_size=4)), max_size=14),
                  absolute=st.booleans())
def test_any_revision_is_refused_or_resolved_inside_the_cache(hostile_cache, monkeypatch, pieces, absolute):
    """Revisions drawn from a grammar of path pieces ('..', '.', empty, names of refs and of
    the folders around the cache, unicode, very long) joined by '/': each is refused
    (UsageError: one line) or resolves to a snapshot folder inside the cache."""
    monkeypatch.setattr(hf.hub_constants, "HF_HUB_CACHE", str(hostile_cache / "cache"))
    revision = ("/" if absolute else "") + "/".join(pieces)
    try:
        node = hf.resolve_checkpoint(f"org/tiny@{revision}")
    except UsageError:
        return
    if node.hub is None:  # no hub id (an empty revision): a local path, which does not exist
        assert node.path == f"org/tiny@{revision}" and not os.path.lexists(node.path)
        return
    assert_inside_snapshots(node, hostile_cache)


def test_bad_dataset_lines_are_refused_naming_file_and_line(ckpt, tmp_path):
    """What JSON lets through but no evaluation can use: nesting too deep, integers too long
    to read, lone surrogates (no tokenizer encodes them), empty multiple-choice choices."""
    deep = '{"text": "a", "notes": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    cases = [("ppl", [{"text": "fine"}, deep], [":2", "nested too deep"]),
             ("mc", ['{"context": "a", "choices": ["x", "y"], "gold": ' + "1" * 5000 + "}\n"],
              [":1", "a number too long"]),
             ("ppl", ['{"text": "a\\ud800b"}\n'], [":1", "'text' holds a lone surrogate"]),
             ("mc", ['{"context": "a", "choices": ["x", "\\udc00"], "gold": 0}\n'], ["choice 1 holds a lone surrogate"]),
             ("gen", ['{"prompt": "1+1=", "answer": "\\ud83d"}\n'], ["'answer' holds a lone surrogate"]),
             ("mc", [{"context": "the cat", "choices": ["", " sees"], "gold": 1}], ["choice 0 is empty"])]
    paths = [write_jsonl(tmp_path / f"d{i}.jsonl", rows) for i, (_, rows, _) in enumerate(cases)]
    outcomes = cli_many(*(["--ckpt", ckpt, "--data", f"{kind}:{path}", "--out", tmp_path / "o"]
                          for (kind, _, _), path in zip(cases, paths)))
    for (_, _, needles), path, proc in zip(cases, paths, outcomes):
        assert_usage_error(proc, str(path), *needles, out=tmp_path / "o")


def test_bad_options_are_refused_and_batch_sizes_pad_to_the_data(ckpt, tmp_path):
    """Seeds the PRNG cannot take and malformed --coordinator addresses are refused; a
    --batch-size far beyond the data pads only to what the data needs (same scores as 1);
    one whose batch cannot fit in memory is refused before it is built."""
    wide = save_tiny(tmp_path / "wide", vocab_size=50304, block_size=4096)
    # one long document among shorter ones (each too long to share a row), so that the first
    # batch (the longest rows first) is 1024 rows of 4,096 tokens
    long_docs = write_jsonl(tmp_path / "long.jsonl", [{"text": "x" * 4000}] + [{"text": f"{i} " + "x" * 300}
                                                                                for i in range(1023)])
    run = ["--ckpt", ckpt, "--evals", "grammar", "--limit", "2"]
    bad = [(["--seed", seed], [f"--seed must be in [0, {2**31 - 1}]"]) for seed in ("-1", str(2**31), str(2**64))]
    bad += [(["--coordinator", address], ["--coordinator must be HOST:PORT"])
            for address in ("nohost", "localhost:abc", "127.0.0.1:99999", ":1234", "a b:1234")]
    outcomes = cli_many(*(run + args + ["--out", tmp_path / "o"] for args, _ in bad),
                        run + ["--batch-size", "1", "--out", tmp_path / "one"],
                        run + ["--batch-size", str(10**9), "--out", tmp_path / "huge"],
                        ["--ckpt", wide, "--data", f"ppl:{long_docs}", "--batch-size", "1024", "--out", tmp_path / "o"])
    *refused, one, huge, beyond = outcomes
    for (_, needles), proc in zip(bad, refused):
        assert_usage_error(proc, *needles, out=tmp_path / "o")
    assert one.returncode == 0 and huge.returncode == 0, huge.stderr[-2000:]
    assert results_of(tmp_path / "huge") == results_of(tmp_path / "one")
    assert_usage_error(beyond, "batch size 1024", "more than", out=tmp_path / "o")


def test_the_simple_path_refuses_a_batch_beyond_memory_in_one_line(ckpt, tmp_path, monkeypatch):
    """--simple with a --batch-size whose rows cannot fit: one line and exit 2 before the batch
    is built, scoring and generating, as the fast path's check (it went on into XLA's
    RESOURCE_EXHAUSTED, asking for 185 GB and 41 GB); a batch that XLA finds beyond memory all
    the same (the estimate is a lower bound) ends in one line too, on either path."""
    monkeypatch.setattr(gpt, "available_memory", lambda: 3 * 10**6)  # the model fits, 64 rows do not
    data = {"ppl": [{"text": "the cat sees the dog."}], "gen": [{"prompt": "12+3=", "answer": "15"}]}
    files = {kind: write_jsonl(tmp_path / f"{kind}.jsonl", rows) for kind, rows in data.items()}
    run = lambda kind, *more: main_in_process("--ckpt", ckpt, "--data", f"{kind}:{files[kind]}", "--mesh", "1x1",
                                              "--max-new-tokens", 4, "--quiet", "--out", tmp_path / "o", *more)
    for kind in data:  # rows of the whole context: 64 tokens, or 60 of prompt and 4 new
        status, err = run(kind, "--simple", "--batch-size", 64)
        assert status == 2 and err.startswith("error: batch size 64: a batch of 64 x 64 tokens needs about "), err
        assert err.strip().endswith("more than the 0.003 GB available") and len(err.splitlines()) == 1, err

    def beyond(evaluator):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 41236000000 bytes.")
    monkeypatch.setattr(evaluate.Evaluator, "run_evaluations", beyond)
    assert run("ppl", "--batch-size", 1) == (2, "error: out of memory while evaluating (JaxRuntimeError: "
                                                "RESOURCE_EXHAUSTED: Out of memory allocating 41236000000 bytes.); "
                                                "try a smaller --batch-size\n")


def test_files_that_are_not_regular_are_refused_without_waiting(ckpt, tmp_path):
    """A FIFO, a device or a directory where a dataset, a checkpoint's config or weights, or
    results.json belongs: refused at once, never read without limit or waited on."""
    def fifo(path):
        os.mkfifo(path)

    def in_checkpoint(name, make):
        target = tmp_path / f"ck-{name}-{make.__name__}"
        shutil.copytree(ckpt, target)
        (target / name).unlink()
        make(target / name)
        return target

    def in_out(name, make):
        out = tmp_path / f"out-{name}-{make.__name__}"
        out.mkdir()
        make(out / name)
        return out

    def device(path):
        path.symlink_to("/dev/zero")

    directory = Path.mkdir
    run = ["--evals", "grammar", "--limit", "2"]
    cases = [(["--data", f"ppl:{tmp_path / 'fifo.jsonl'}"], "a FIFO"), (["--data", f"ppl:{tmp_path}"], "a directory"),
             (["--data", "ppl:/dev/zero"], "a device")]
    fifo(tmp_path / "fifo.jsonl")
    cases += [(["--ckpt", in_checkpoint("config.json", make)] + run, kind)
              for make, kind in ((fifo, "a FIFO"), (directory, "a directory"), (device, "a device"))]
    cases += [(["--ckpt", in_checkpoint("model.safetensors", fifo)] + run, "a FIFO")]
    cases += [(["--ckpt", ckpt, "--out", in_out("results.json", make)] + run, kind)
              for make, kind in ((fifo, "a FIFO"), (directory, "a directory"), (device, "a device"))]
    cases += [(["--ckpt", ckpt, "--log-samples", "--out", in_out("samples.jsonl", directory)] + run, "a directory")]
    outcomes = cli_many(*(args + (["--ckpt", ckpt] if "--ckpt" not in args else [])
                          + (["--out", tmp_path / "o"] if "--out" not in args else []) for args, _ in cases))
    for (args, kind), proc in zip(cases, outcomes):
        assert_usage_error(proc, kind, "not a regular file")
        assert proc.seconds < 10, proc.seconds


# ---- trust at the edges: ids beyond the embedding, non-finite scores, what a tokenizer
# cannot score, tiny temperatures, data that changes under a run, an output directory
# inside a checkpoint, signals between paired writes, one run per output directory, and
# lm-eval tasks that fail as one line

def with_tokenizer_file(hf_dir, target, name, change):
    """A copy of a HuggingFace directory, change(JSON) applied to one of its tokenizer files."""
    shutil.copytree(hf_dir, target)
    config = json.loads((target / name).read_text())
    change(config)
    (target / name).write_text(json.dumps(config))
    return target


def joined_pair(tokenizer):
    """(context, choice) that the tokenizer encodes as one token once joined, the context
    alone as several: "hel" and "lo" where "hello" is one token."""
    for text, token in sorted(tokenizer.tok.get_vocab().items()):
        if text.isalpha() and len(text) > 2 and tokenizer.encode(text) == [token] \
                and len(tokenizer.encode(text[:-1])) > 1:
            return text[:-1], text[-1]
    raise AssertionError("no such token in the vocabulary")


def test_what_cannot_be_scored_is_refused_at_once(ckpt, hf_gpt2, tmp_path):
    """Each refused with one line, nothing written:
    - a vocabulary entry beyond the embedding (len() still fits), once the checkpoint is
      loaded, naming the id and the rows; NaN in the weights as they are read, naming the
      tensor, whatever the kind (gen too);
    - finite weights whose logits overflow, at the first sample of every kind that scores
      (so samples.jsonl never holds bare NaN), and in generation (an argmax over NaN
      printed garbage with exit 0); a perplexity beyond float range (it ended in
      OverflowError);
    - a choice the tokenizer joins to its context (an empty continuation scores 0.0 and
      always wins), naming file, line and choice; a blank gen answer (an empty output
      would match it); a document when the tokenizer has neither BOS nor EOS (it was given
      token 0), while multiple choice on non-empty contexts still runs;
    - temperatures whose logits / T overflow float32, with the range;
    - and an error naming a tensor of 100,000 characters is one line of at most 1,000."""
    beyond = with_tokenizer_file(hf_gpt2, tmp_path / "beyond", "tokenizer.json",
                                 lambda t: t["model"]["vocab"].update({"hello": 5000}))
    no_prefix = with_tokenizer_file(hf_gpt2, tmp_path / "noprefix", "tokenizer_config.json",
                                    lambda c: [c.pop(key) for key in ("bos_token", "eos_token")])
    nan = save_tiny(tmp_path / "nan", scale=float("nan"))
    overflow = with_tensors(ckpt, tmp_path / "overflow",  # finite, but the logits are not
                            lambda t: t.update({"wte/embedding": np.full_like(t["wte/embedding"], 3e38)}))
    huge = save_tiny(tmp_path / "huge", scale=1e6)  # finite logits around 1e12: perplexity exp(1e10)
    long_name = with_tensors(ckpt, tmp_path / "long", lambda t: t.update({"x" * 100_000: np.ones(1, np.float32)}))
    context, joined = joined_pair(HFTokenizer(str(hf_gpt2)))
    mc = write_jsonl(tmp_path / "mc.jsonl", MC)
    glued = write_jsonl(tmp_path / "glued.jsonl", [{"context": "the cat", "choices": [" sees", " see"], "gold": 0},
                                                   "\n", {"context": context, "choices": [" world", joined], "gold": 0}])
    blank = write_jsonl(tmp_path / "gen.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": " \t"}])
    cases = [(beyond, ["--evals", "grammar"], ["the tokenizer's ids reach 5000", "embedding of 384 rows"]),
             (nan, ["--evals", "addition"], ["model.safetensors: tensor", "holds NaN or infinite values"]),
             (overflow, ["--evals", "text"], ["evaluation text: non-finite log-likelihood at sample 0"]),
             (overflow, ["--evals", "repeat"], ["evaluation repeat: non-finite log-likelihood"]),
             (overflow, ["--data", f"mc:{mc}"], [f"non-finite loglik at {mc}:1"]),
             (overflow, ["--evals", "addition"], ["non-finite logits while generating for document 0"]),
             (huge, ["--evals", "text"], ["evaluation text: non-finite score"]),
             (hf_gpt2, ["--data", f"mc:{glued}"], [f"{glued}:3: choice 1 {joined!r} adds no token to the context"]),
             (hf_gpt2, ["--data", f"gen:{blank}"], [f"{blank}:2: 'answer' is empty or only whitespace"]),
             (no_prefix, ["--evals", "text"], ["neither a BOS nor an EOS token"]),
             (ckpt, ["--temperature", "1e-40"], ["--temperature must be 0 (greedy) or in [1e-06, inf)", "got 1e-40"]),
             (ckpt, ["--temperature", "1e-38"], ["got 1e-38"]),
             (long_name, ["--evals", "grammar"], ["does not use", "characters cut"])]
    *outcomes, choices = cli_many(*(["--ckpt", path, *args, "--limit", "2", "--log-samples", "--out", tmp_path / "o"]
                                    for path, args, _ in cases),
                                  ["--ckpt", no_prefix, "--evals", "grammar", "--limit", "2", "--out", tmp_path / "mc"])
    for (_, _, needles), proc in zip(cases, outcomes):
        assert_usage_error(proc, *needles, out=tmp_path / "o")
    assert len(outcomes[-1].stderr.strip()) <= len("error: ") + jobs.MAX_ERROR_LINE < 100_000
    assert choices.returncode == 0, choices.stderr[-2000:]


def test_a_run_reads_what_it_checked_and_writes_only_its_out(ckpt, hf_gpt2, tmp_path):
    """A --data file appended once the first evaluation is kept: the new lines are never
    read, n_samples and the fingerprint are those of the lines checked (the same command
    afterwards sees other data); rewritten meanwhile: one line, nothing written of it.
    Tokenizer files are found by exact names: --out CKPT/tokenizer_eval is none, and the
    checkpoint reads and fingerprints as before (its chat template counted); an --out named
    as a file the checkpoint is read from is refused; so is one that access() calls
    writable but that is not (/sys/fs as root), before anything is computed."""
    lines = [{"text": f"document {i}"} for i in range(40)]
    appended, rewritten = write_jsonl(tmp_path / "appended.jsonl", lines), write_jsonl(tmp_path / "rewritten.jsonl", lines)
    checked = {"bytes": appended.stat().st_size, "sha256": hashlib.sha256(appended.read_bytes()).hexdigest()}
    model = tmp_path / "ck"
    shutil.copytree(hf_gpt2, model)
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # a tokenizer file too
    run = ["--evals", "grammar", "--limit", "40", "--quiet"]
    on_model = ["--ckpt", model, "--evals", "grammar", "--limit", "2", "--quiet"]
    unwritable = ["/sys/fs"] if os.access("/sys/fs", os.W_OK) else []  # root: sysfs takes no new files
    first, again, changed, inside, elsewhere, weights, tokenizer, *sys_fs = cli_many(
        {"after_window": str(appended), "mode": "a", "text": '{"text": "added later"}\n' * 500},
        ["--ckpt", ckpt, *run, "--data", f"ppl:{appended}", "--out", tmp_path / "a"],
        ["--ckpt", ckpt, *run, "--data", f"ppl:{appended}", "--out", tmp_path / "a"],
        {"after_window": str(rewritten), "mode": "w", "text": rewritten.read_text().replace("document 7", "DOCUMENT 7")},
        ["--ckpt", ckpt, *run, "--data", f"ppl:{rewritten}", "--out", tmp_path / "r"],
        on_model + ["--out", model / "tokenizer_eval"], on_model + ["--out", tmp_path / "elsewhere"],
        on_model + ["--out", model / "eval.safetensors"], on_model + ["--out", model / "tokenizer.json" / "x"],
        *(on_model + ["--out", out] for out in unwritable))
    assert first.returncode == 0, first.stderr[-2000:]
    results = json.loads((tmp_path / "a" / "results.json").read_text())
    assert results["n_samples"]["appended"] == 40 and len(appended.read_text().splitlines()) == 540
    assert {k: results["fingerprint"]["datasets"]["appended"][k] for k in checked} == checked
    assert_usage_error(again, "holds another run", "datasets.appended.bytes")
    assert_usage_error(changed, f"{rewritten} changed while this run read it", out=tmp_path / "r")
    assert sorted(files_of(tmp_path / "r")) == [".journal"]  # grammar's window kept, for the next try
    assert inside.returncode == 0 and elsewhere.returncode == 0, (inside.stderr[-2000:], elsewhere.stderr[-2000:])
    fingerprints = [json.loads((d / "results.json").read_text())["fingerprint"]["model"]
                    for d in (model / "tokenizer_eval", tmp_path / "elsewhere")]
    assert fingerprints[0] == fingerprints[1]
    assert set(fingerprints[0]["files"]) == {"config.json", "model.safetensors", "tokenizer.json",
                                             "tokenizer_config.json", "chat_template.jinja"}
    assert_usage_error(weights, "'eval.safetensors' in checkpoint", "would be read as one of its files")
    assert_usage_error(tokenizer, "'tokenizer.json' in checkpoint")
    for proc in sys_fs:  # root, where access() says yes and the file system no
        assert_usage_error(proc, "the output directory /sys/fs is not writable")
        assert proc.seconds < 5, proc.seconds


# `python evaluate.py ARGS` stopped at an exact point of its writes, as real signals hit
# these windows only by chance: "mkstemp" sends SIGTERM once the temporary of samples.jsonl
# exists and before write_temporary has returned; "renames" sends it right after the new
# samples.jsonl is renamed into place, before results.json is, and then waits there until
# the file FLAG exists (FLAG.stalled says that it waits).
SIGNAL_AT = r"""
import os, signal, sys, tempfile, time
import evaluate
where, flag, args = sys.argv[1], sys.argv[2], sys.argv[3:]
mkstemp, replace = tempfile.mkstemp, os.replace

def mkstemp_then_sigterm(*a, **k):
    made = mkstemp(*a, **k)
    if k.get("prefix") == ".samples.jsonl.":
        os.kill(os.getpid(), signal.SIGTERM)
    return made

def replace_then_sigterm(source, target):
    replace(source, target)
    if str(target).endswith("samples.jsonl"):
        os.kill(os.getpid(), signal.SIGTERM)
        open(flag + ".stalled", "w").close()
        while not os.path.exists(flag):
            time.sleep(0.02)

if where == "mkstemp":
    tempfile.mkstemp = mkstemp_then_sigterm
else:
    os.replace = replace_then_sigterm
sys.exit(evaluate.main(args))
"""


def start_signalled(where, flag, *args):
    return subprocess.Popen([sys.executable, "-c", SIGNAL_AT, where, str(flag), *map(str, args)], cwd=ROOT,
                            env=driver_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_signals_between_paired_writes_and_a_second_run_into_the_same_out(ckpt, tmp_path):
    """SIGTERM right after the temporary is made, and between the two renames: exit 143 with
    one line, no temporary left, and the pair either the previous one or the new one, never
    mixed. While a run holds --out (stalled between its renames), a second run into it is
    refused naming the holder's pid, and the holder's pair is not mixed with the second's.
    The lock is gone once the run ends; a temporary that a killed run left is removed by the
    next run."""
    run = ["--ckpt", ckpt, "--evals", "grammar", "--log-samples", "--quiet", "--limit", "2", "--force"]
    made, cut = tmp_path / "made", tmp_path / "cut"
    for out in (made, cut):  # an earlier run's pair
        out.mkdir()
        (out / "results.json").write_bytes(PREVIOUS)
        (out / "samples.jsonl").write_text('{"eval": "earlier"}\n')
    previous = files_of(made)
    (made / ".results.json.k1ll3d_x.tmp").write_text("left by a run killed with SIGKILL")
    flag = tmp_path / "go"
    at_mkstemp = start_signalled("mkstemp", flag, *run, "--out", made)
    between = start_signalled("renames", flag, *run, "--out", cut)
    deadline = time.time() + 120
    while not Path(f"{flag}.stalled").exists() and between.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    holder = (cut / ".lock").read_text()
    second, = cli_many(run + ["--out", cut])
    flag.touch()
    for proc in (at_mkstemp, between):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 143 and messages(err) == ["terminated: nothing partial was written"], err
    assert holder.startswith(f"pid {between.pid} on ")
    assert_usage_error(second, f"another run is writing to {cut} (pid {between.pid} on", "choose another --out")
    made_files = files_of(made)
    assert made_files.pop(runs.JOURNAL_FILE) and made_files == previous  # the previous pair, and the journal
    results = json.loads((cut / "results.json").read_text())
    samples = (cut / "samples.jsonl").read_text().splitlines()
    assert sorted(files_of(cut)) == ["results.json", "samples.jsonl"]  # no temporary, no lock
    assert results["n_samples"]["grammar"] == len(samples) == 2  # the new pair, whole


@pytest.mark.skipif(lm_eval is None, reason="needs lm-evaluation-harness (pip install lm-eval==0.4.13)")
def test_lm_eval_tasks_that_cannot_run_fail_with_one_line(hf_gpt2, tmp_path):
    """Exit 2 and one line, not a traceback: a task whose `!function` names no module, more
    few-shot examples than a task has (lm-eval itself stops in random.sample), a chat
    template that raises (again without the system turn), a continuation the tokenizer
    joins to its context, a task sampling at a temperature that overflows float32, a task
    asking for fewer than one new token (-3 was a traceback from jax; lm-eval's HF model
    fails on 0 in transformers' generate) or for a number of them, or a temperature, that is
    no number. The other libraries' progress bars are off, so that stderr holds only our line."""
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    context, joined = joined_pair(HFTokenizer(str(hf_gpt2)))
    qa = write_jsonl(tmp_path / "qa.jsonl", [{"q": "2 + 2 =", "a": " 4"}, {"q": "1 + 1 =", "a": " 2"}])
    glued = write_jsonl(tmp_path / "glued.jsonl", [{"q": context, "a": joined}])

    def task(name, data=qa, **fields):
        config = {"task": name, "dataset_path": "json", "dataset_name": None, "test_split": "test",
                  "dataset_kwargs": {"data_files": {"test": str(data), "train": str(data)}},
                  "output_type": "loglikelihood", "doc_to_text": "q", "doc_to_target": "a",
                  "metric_list": [{"metric": "acc"}], **fields}
        (task_dir / f"{name}.yaml").write_text(json.dumps(config))  # JSON is YAML
    task("few", fewshot_split="train")
    task("glued", glued, target_delimiter="")
    task("sampled", output_type="generate_until", metric_list=[{"metric": "exact_match"}],
         generation_kwargs={"until": ["\n"], "do_sample": True, "temperature": 1e-40, "max_gen_toks": 4})
    for name, kwargs in [("negative", {"max_gen_toks": -3}), ("none", {"max_gen_toks": 0}),
                         ("wordy", {"max_gen_toks": "many"}), ("hot", {"do_sample": True, "temperature": "hot"})]:
        task(name, output_type="generate_until", metric_list=[{"metric": "exact_match"}],
             generation_kwargs={"until": ["\n"], **kwargs})
    (task_dir / "missing.yaml").write_text("task: missing\ndataset_path: json\ndataset_name: null\n"
                                           f"dataset_kwargs:\n  data_files:\n    test: {qa}\ntest_split: test\n"
                                           "output_type: loglikelihood\ndoc_to_text: q\ndoc_to_target: a\n"
                                           "process_results: !function no_such_module.process_results\n"
                                           "metric_list:\n  - metric: acc\n")
    chat = tmp_path / "chat"
    shutil.copytree(hf_gpt2, chat)
    (chat / "chat_template.jinja").write_text("{{ raise_exception('no ' + messages[0]['role'] + ' turns here') }}")
    run = ["--include-path", task_dir, "--out", tmp_path / "o", "--quiet"]
    cases = [(["--ckpt", hf_gpt2, "--tasks", "missing"], ["--tasks:", "no_such_module"]),
             (["--ckpt", hf_gpt2, "--tasks", "few", "--num-fewshot", "5"],
              ["--tasks: few asks for 5 few-shot examples but has 2 few-shot documents"]),
             (["--ckpt", chat, "--tasks", "few", "--apply-chat-template"],
              ["--apply-chat-template: the tokenizer's chat template fails", "no user turns here"]),
             (["--ckpt", hf_gpt2, "--tasks", "glued"], [f"the continuation {joined!r} adds no token to the context"]),
             (["--ckpt", hf_gpt2, "--tasks", "sampled"], ["temperature must be 0 (greedy) or in [1e-06, inf)"]),
             (["--ckpt", hf_gpt2, "--tasks", "negative"], ["a task asks for -3 new tokens (max_gen_toks)", "at least 1"]),
             (["--ckpt", hf_gpt2, "--tasks", "none"], ["a task asks for 0 new tokens (max_gen_toks)", "at least 1"]),
             (["--ckpt", hf_gpt2, "--tasks", "wordy"], ["generation_kwargs", "'many'"]),
             (["--ckpt", hf_gpt2, "--tasks", "hot"], ["lm-eval cannot build hot", "'hot'"])]
    outcomes = cli_many(*(args + run for args, _ in cases),
                        env={"TQDM_DISABLE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"})
    for (_, needles), proc in zip(cases, outcomes):
        assert_usage_error(proc, *needles, out=tmp_path / "o")


def core_tests() -> list:
    """The device-independent core of the suite, as pytest node ids: the model layer, the
    harness, the fast path against the simple one and parity with transformers (the sections
    before lm-eval's), which run in this process on its default backend (a mesh beyond its
    devices skips)."""
    tree = ast.parse(Path(__file__).read_text())
    end = next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1)
               if line.startswith("# ---- scoring conventions against lm-evaluation-harness"))
    return [f"{Path(__file__).name}::{node.name}" for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and node.lineno < end]


if __name__ == "__main__":  # python -m pytest -q $(python test_all.py --core): the core on an accelerator
    print("\n".join(core_tests()) if sys.argv[1:] == ["--core"] else __doc__)
