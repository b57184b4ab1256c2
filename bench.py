"""Side-by-side benchmark: this project's evaluation against HuggingFace transformers
(PyTorch) and against the machine's own limits, all measured in one run.

    python bench.py                  # GPT-2 small shape, random weights (4-5 min on 2 CPU cores)
    python bench.py --layers 2 --width 128 --heads 4 --vocab 1000 --seq 128   # quick
    python bench.py --json           # one JSON object of every number instead of the table
    python bench.py --limits         # this project alone against the machine's limits (GPU/TPU)
    python bench.py --shapes --layers 30 --width 576 --heads 9 --kv-heads 3 --mlp-hidden 1536 \
        --context 2048 --batch 16 --init-std 0.1   # the tasks people report, beside lm-eval (30-40 min)
    python bench.py --load DIR --dtype bfloat16   # loading a checkpoint: time and peak memory against `cat`
    python bench.py --make-fixture F   # on a CPU: a small model, data and this CPU's answers, for:
    python bench.py --gpu-report --device cuda --dtype bfloat16 --fixture F ...   # every GPU measurement,
        # one prepared run (docs/speed.md has the whole command)

What it does, in order:
1. Compilation: the built-in suite (the 4 built-in evaluations) on the default tiny GPT,
   run twice in this process; XLA compilations are counted with jax.monitoring, per
   evaluation and per run, and compile time is reported apart from run time.
2. One GPT-2-small-shaped model with random weights is made by transformers
   (GPT2LMHeadModel, initializer_range --init-std so that greedy decoding has no near-ties),
   saved as a HuggingFace directory, and loaded from it twice: by this project
   (hf.load_backbone + gpt.place_params) and by transformers (float32, eval mode).
3. Scoring: a PerplexityEvaluation of --batch random-token documents of --seq tokens.
   Each document is one rolling request ([BOS] + doc[:-1] -> doc), so the project runs
   exactly one jitted [1, batch, seq] block. Timed: the whole evaluation call (requests,
   padding, device transfer, the jitted forward + log-softmax gather, the host copy, the
   records), checking on the way that it ran the rows given to the other two.
   transformers computes the same per-token log-likelihoods from the same rows
   (log_softmax + gather under torch.no_grad), and so does a bare jax.numpy GPT-2 forward
   written below (the ceiling for this model in jax). Summed scores must agree.
4. Generation: greedy decoding with the KV cache, --batch prompts of --prompt tokens,
   exactly --new-tokens new ones (the tokenizer here has no EOS): InferenceJob.generate_until
   against transformers' generate. The tokens must be identical. Each is also timed with
   one new token (the prefill) to give a time per step, which is set beside two floors:
   the step's matmuls alone and one read of every parameter byte.
5. The float32 matmul peak (the best jitted square matmul of --matmul-sizes, raced with
   the scorers) turns FLOP/s into MFU.
With --limits, only bench_limits runs: no transformers, no torch (see its docstring).
With --shapes, only bench_shapes runs: MMLU-shaped (0-shot and 5-shot), hellaswag-, gsm8k-,
gsm8k-CoT- and wikitext-shaped lm-eval tasks through this project's command line and
through lm-eval's HF model, whole processes side by side, with the work each computed and a
check that their answers agree. Our side runs three times: first with an empty persistent
compilation cache, then the same command again, which loads its programs from the cache,
then with an empty cache and no journal (GPT_EVAL_JOURNAL=0); the table counts the
programs each run compiled.
With --gpu-report, the parts of --report-parts run, each in a process of its own (see
gpu_report); with --make-fixture DIR, only make_fixture.
With --load DIR, only bench_load runs: the checkpoint DIR (HuggingFace or native) loaded
onto the mesh of every device in a fresh process, its time and peak host memory, beside
reading its weight files once with `cat > /dev/null`; then evaluate.py's peak memory on it.

Every report begins with the date and the commit it was measured on ("+changes": the
working tree differs from that commit). Every timing is a warm-up call (which compiles),
then --reps rounds in which the contenders take turns, so that other processes' load falls
on all of them alike; the tables show the best (and median) of the rounds.
FLOPs are GPT.flops(seq) / 3 (forward only; attention counted over the full T x T).
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import transformers
from jax.experimental import topologies
from safetensors import safe_open
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

try:  # only the side-by-side run needs torch; --limits runs without it
    import torch
except ImportError:
    torch = None

import evaluate
import fast
import gpt
import inference
from hf import load_backbone
from checkpoints import SAFETENSORS_DTYPES
from jobs import ByteTokenizer, ExecutionSpec, UsageError, exit_status, option, parse_options, write_atomic
from runs import CompileLog, compile_log


@dataclasses.dataclass
class BenchConfig:
    """Options of `python bench.py` (validated: unknown names and bad types fail)."""

    family: str = option("gpt2", "model shape: gpt2, qwen2 (grouped kv heads, SwiGLU, RMSNorm, rotary) or llama")
    layers: int = option(12, "transformer blocks of the benchmarked model")
    width: int = option(768, "model width")
    heads: int = option(12, "attention heads")
    kv_heads: int = option(0, "key/value heads of a qwen2 model or --shapes' llama (0: as many as --heads)")
    mlp_hidden: int = option(0, "MLP width (0: 4 x --width)")
    vocab: int = option(50257, "vocabulary size (--shapes: the most its trained tokenizer may have)")
    context: int = option(1024, "context length (n_positions)")
    batch: int = option(8, "rows scored, and prompts decoded, at once")
    seq: int = option(512, "tokens per scored document")
    prompt: int = option(32, "prompt tokens before decoding")
    new_tokens: int = option(64, "tokens decoded after each prompt")
    reps: int = option(3, "timed rounds after the warm-up")
    init_std: float = option(0.2, "init std (GPT-2 uses 0.02; larger logits keep greedy argmaxes far from ties)")
    matmul_sizes: str = option("2048,4096", "square matmul sizes raced for the FLOP/s peak")
    torch_threads: int = option(0, "torch threads (0: os.cpu_count(), the threads XLA's CPU client uses)")
    seed: int = option(0, "weights, documents and prompts")
    json: bool = option(False, "print one JSON object of every number instead of the tables")
    ragged: int = option(48, "documents of mixed lengths (--seq/4 to --seq tokens) in the ragged workload")
    ragged_prompts: int = option(40, "prompts of mixed lengths (--prompt/2 to 3/2 --prompt) in the ragged workload")
    device: str = option("cpu", "where transformers runs: cpu or cuda (jax runs on its default backend)")
    limits: bool = option(False, "this project alone against the machine's own limits (made for a GPU or TPU)")
    dtype: str = option("float32", "parameters and activations of both contenders (float32 checks exactness)")
    peak_tflops: float = option(0.0, "nominal matmul peak per device at --dtype, e.g. 989 (dense bf16) on an H200 "
                                     "SXM (0: none)")
    memory_tbps: float = option(0.0, "nominal memory bandwidth per device, e.g. 4.8 on an H200 (0: none)")
    shapes: bool = option(False, "benchmark shapes (MMLU, hellaswag, gsm8k, gsm8k-CoT, rolling perplexity) through "
                                 "this project's command line and lm-eval's HF model, a random Llama of --layers ...")
    workloads: str = option("mmlu0,mmlu,hellaswag,gsm8k,gsm8k_cot,wikitext", "the --shapes workloads to run, in order")
    workdir: str = option("", "where --shapes keeps its model and tasks, reused by a rerun (default: a temporary one)")
    mmlu_questions: int = option(40, "--shapes: MMLU-style test questions, 5-shot")
    mmlu0_questions: int = option(100, "--shapes: MMLU-style test questions, 0-shot")
    hellaswag_items: int = option(80, "--shapes: hellaswag-style items")
    gsm8k_questions: int = option(32, "--shapes: gsm8k-style questions")
    max_gen_toks: int = option(256, "--shapes: new tokens at most per gsm8k-style answer (gsm8k's 256)")
    wikitext_docs: int = option(100, "--shapes: documents of the rolling perplexity")
    load: str = option("", "a checkpoint directory to time loading, with its peak memory, beside `cat` (bench_load)")
    gpu_report: bool = option(False, "every accelerator measurement in one prepared run (see --report-parts)")
    report_parts: str = option("device,ceilings,parity,qwen2-1.5b,shapes,smollm2",
                               "--gpu-report's parts, in order: device, ceilings, parity, shapes, or a model "
                               "(smollm2, qwen2-1.5b, tiny)")
    report_dir: str = option("runs/gpu-report", "where --gpu-report's parts write their JSON and logs")
    report_seconds: float = option(420.0, "--gpu-report's time: a part not begun by then is skipped, one "
                                          "running then is stopped")
    report_part: str = option("", "run one --gpu-report part in this process (what --gpu-report calls)")
    decode_batches: str = option("1,16,64", "--gpu-report: the rows decoded at once, one measurement each")
    fixture: str = option("", "--gpu-report's parity part: a directory made by --make-fixture on a CPU")
    parity_runs: str = option("float32-highest,float32,bfloat16", "--gpu-report's parity runs (float32-highest: "
                                                                   "jax's highest matmul precision), and the CPU "
                                                                   "answers --make-fixture writes for them")
    make_fixture: str = option("", "write a small model, data and this machine's answers to this directory "
                                   "(for --gpu-report --fixture)")
    runs_model: str = option("smollm2", "--gpu-report's runs part: the random Llama of REPORT_MODELS that "
                                        "evaluate.py runs on (smollm2, or tiny for a dry run)")
    runs_workloads: str = option("default,mc,ppl,gen", "--gpu-report's runs part: the workloads of RUNS, in order")
    runs_items: int = option(273, "--make-fixture: multiple-choice questions and prompts of the runs part "
                                  "(its prose paragraphs: 101)")
    compile_for: str = option("", "compile the evaluation's programs for a target without running them: v5e (a TPU "
                                  "v5e, by libtpu's ahead-of-time compiler: pip install libtpu; no TPU needed) or "
                                  "cpu; the model is --runs-model's shape in --dtype, --batch rows, --seq tokens "
                                  "scored, --prompt and --new-tokens decoded")


# ----------------------------------------------------------------------------- timing


def race(contenders: Dict[str, Callable[[], Any]], reps: int, log: CompileLog) -> Dict[str, Any]:
    """Time each contender: one warm-up call (which compiles), then `reps` rounds in which
    every contender runs once in turn, so load from other processes falls on all alike.
    Per contender: first-call and compile seconds, best and median, the warm-up's result."""
    out = {}
    for name, fn in contenders.items():
        mark, start = len(log.events), time.perf_counter()
        result = jax.block_until_ready(fn())
        out[name] = {"first": time.perf_counter() - start, "compile": log.since(mark)["seconds"],
                     "out": result, "times": []}
    for _ in range(reps):
        for name, fn in contenders.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            out[name]["times"].append(time.perf_counter() - start)
    for r in out.values():
        r.update(best=min(r["times"]), median=statistics.median(r["times"]))
    return out


# ----------------------------------------------------------------------------- compilation


def evaluator_for(model, variables, tokenizer, mesh, evaluations, batch_size: int) -> evaluate.Evaluator:
    """The project's Evaluator over parameters in memory; nothing is written (only run() writes)."""
    spec = ExecutionSpec(name="gpt/evaluate")
    config = evaluate.EvaluatorConfig(batch_size=batch_size, quiet=True)
    return evaluate.Evaluate.from_parts(spec, model, variables, tokenizer, mesh, evaluations, config)


def compile_counts(log: CompileLog) -> Dict[str, Any]:
    """Compilations and seconds of the built-in suite on the default tiny GPT, run twice
    on one Evaluator (the second run should compile nothing)."""
    mesh = gpt.make_mesh()
    model = gpt.GPT()
    variables = gpt.init_params(model, mesh, seed=0)
    evaluations = [evaluate.builtin_evaluation(name) for name in evaluate.BUILTIN]
    evaluator = evaluator_for(model, variables, ByteTokenizer(), mesh, evaluations, batch_size=8)
    runs = []
    for _ in range(2):
        per_eval = {}
        for e in evaluations:
            mark, start = len(log.events), time.perf_counter()
            e.result(evaluator, evaluator.tokenizer, **evaluator.decoding())
            per_eval[e.name] = dict(log.since(mark), wall=time.perf_counter() - start, kind=e.kind)
        runs.append(per_eval)
    return {"runs": runs}


# ----------------------------------------------------------------------------- the model


class IdTokenizer:
    """Text is token ids separated by spaces: random-token documents without a vocabulary.
    BOS is GPT-2's <|endoftext|> (the perplexity prefix); no EOS, so rollouts never stop early."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.bos_token_id, self.eos_token_id = vocab_size, vocab_size - 1, None

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return list(map(int, text.split()))  # there are no special tokens to add

    def decode(self, ids: List[int]) -> str:
        return " ".join(map(str, ids))


def save_hf_model(cfg: BenchConfig, path: str) -> None:
    """A randomly initialized transformers model of --family written as a HuggingFace directory."""
    torch.manual_seed(cfg.seed)
    common = dict(vocab_size=cfg.vocab, initializer_range=cfg.init_std, bos_token_id=cfg.vocab - 1,
                  eos_token_id=cfg.vocab - 1)
    if cfg.family == "gpt2":
        config = transformers.GPT2Config(n_positions=cfg.context, n_embd=cfg.width, n_layer=cfg.layers,
                                         n_head=cfg.heads, n_inner=cfg.mlp_hidden or None, **common)
    else:
        kind = transformers.Qwen2Config if cfg.family == "qwen2" else transformers.LlamaConfig
        config = kind(max_position_embeddings=cfg.context, hidden_size=cfg.width, num_hidden_layers=cfg.layers,
                      num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads or cfg.heads,
                      intermediate_size=cfg.mlp_hidden or 4 * cfg.width, tie_word_embeddings=True, **common)
    with torch.device(cfg.device):  # a large model is made at once where it runs
        model = transformers.AutoModelForCausalLM.from_config(config)
    (model if cfg.device == "cpu" else model.to(getattr(torch, cfg.dtype))).save_pretrained(path)


def project_model(cfg: BenchConfig) -> gpt.GPT:
    """The same shape as save_hf_model's, as this project's GPT, for --limits."""
    return gpt.GPT(**gpt.FAMILIES[cfg.family], n_layers=cfg.layers, n_embd=cfg.width, n_head=cfg.heads,
                   n_kv_head=cfg.kv_heads or None, mlp_hidden=cfg.mlp_hidden or None, vocab_size=cfg.vocab,
                   block_size=cfg.context, param_dtype=cfg.dtype, activation_dtype=cfg.dtype)


def load_models(cfg: BenchConfig, path: str):
    """(GPT, variables on the mesh, the mesh, transformers' model) from one HuggingFace directory,
    both in --dtype; transformers on --device with its default (sdpa) attention."""
    model, host = load_backbone(path, cfg.dtype)
    mesh = gpt.make_mesh()
    variables = gpt.place_params(model, mesh, host)
    torch.set_num_threads(cfg.torch_threads or os.cpu_count())
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, cfg.dtype))
    hf = hf.to(cfg.device).eval()
    hf.generation_config.eos_token_id = None  # like the project's rollout here: never stop early
    return model, variables, mesh, hf


# ----------------------------------------------------------------------------- scoring


def bare_loglik(params: Any, tokens_BT: jax.Array, targets_BT: jax.Array, n_head: int) -> jax.Array:
    """Summed log-likelihood of targets per row [B]: GPT-2 written in plain jax.numpy."""
    B, T = tokens_BT.shape

    def norm(x_BTD, p):
        mean = x_BTD.mean(-1, keepdims=True)
        var = ((x_BTD - mean) ** 2).mean(-1, keepdims=True)
        return (x_BTD - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]

    def dense(x, p):
        return x @ p["kernel"] + p["bias"]

    wte_VD = params["wte"]["embedding"]
    x_BTD = wte_VD[tokens_BT] + params["wpe"]["embedding"][:T][None]
    causal_TS = jnp.tril(jnp.ones((T, T), bool))
    for i in range(params["blocks"]["ln_1"]["scale"].shape[0]):
        p = jax.tree.map(lambda x: x[i], params["blocks"])
        h_BTD = norm(x_BTD, p["ln_1"])
        q_BTHE, k_BSHE, v_BSHE = (dense(h_BTD, p["attn"][n]).reshape(B, T, n_head, -1) for n in "qkv")
        s_BHTS = jnp.einsum("bthe,bshe->bhts", q_BTHE, k_BSHE) / np.sqrt(q_BTHE.shape[-1])
        s_BHTS = jnp.where(causal_TS[None, None], s_BHTS, -jnp.inf)
        y_BTHE = jnp.einsum("bhts,bshe->bthe", jax.nn.softmax(s_BHTS, -1), v_BSHE)
        x_BTD = x_BTD + dense(y_BTHE.reshape(B, T, -1), p["attn"]["o"])
        h_BTF = jax.nn.gelu(dense(norm(x_BTD, p["ln_2"]), p["mlp"]["up"]), approximate=True)
        x_BTD = x_BTD + dense(h_BTF, p["mlp"]["down"])
    logits_BTV = norm(x_BTD, params["ln_f"]) @ wte_VD.T
    logp_BTV = jax.nn.log_softmax(logits_BTV, -1)
    return jnp.take_along_axis(logp_BTV, targets_BT[..., None], -1)[..., 0].sum(-1)


def to_torch(hf: Any, array: np.ndarray) -> Any:
    return torch.from_numpy(np.asarray(array)).long().to(hf.device)


def hf_loglik(hf: Any, tokens_BT: np.ndarray, targets_BT: np.ndarray, mask_BT: Any = None) -> np.ndarray:
    """Summed log-likelihood of targets per row [B] from transformers (where mask_BT, if given)."""
    mask = None if mask_BT is None else to_torch(hf, mask_BT)
    with torch.no_grad():
        logits_BTV = hf(to_torch(hf, tokens_BT), attention_mask=mask).logits
        logp_BT = torch.log_softmax(logits_BTV.float(), -1).gather(-1, to_torch(hf, targets_BT)[..., None])[..., 0]
        return (logp_BT if mask is None else logp_BT * mask).sum(-1).cpu().numpy()


def matmul_contenders(sizes: List[int], dtype: Any) -> Dict[str, Callable[[], Any]]:
    """Jitted square matmuls, one per size: the FLOP/s ceiling (MFU's denominator)."""
    matmul = jax.jit(jnp.matmul)
    arrays = {n: jax.random.normal(jax.random.key(0), (n, n), dtype) for n in sizes}
    return {f"matmul_{n}": (lambda a_NN=a_NN: matmul(a_NN, a_NN)) for n, a_NN in arrays.items()}


def matmul_peak(out: Dict[str, Any], sizes: List[int]) -> Dict[str, Any]:
    """Take the matmul contenders out of race()'s results: the fastest size's FLOP/s."""
    matmuls = {n: out.pop(f"matmul_{n}") for n in sizes}
    size = max(sizes, key=lambda n: n ** 3 / matmuls[n]["best"])
    return {"size": size, "flops_per_s": 2 * size ** 3 / matmuls[size]["best"]}


def tolerance(cfg: BenchConfig) -> float:
    """How far two correct implementations' summed log-likelihoods may differ, relative."""
    return 1e-4 if cfg.dtype == "float32" else 2e-2


def bench_scoring(cfg: BenchConfig, model, variables, mesh, hf, log: CompileLog,
                  more: Optional[Dict[str, Callable]] = None) -> Dict[str, Any]:
    """Tokens/s of the three scorers on the same rows, raced with the matmul peak;
    asserts that their summed log-likelihoods agree. more: name -> a jitted function of
    (params, tokens_BT, targets_BT) giving each row's summed log-likelihood, raced too."""
    tokenizer = IdTokenizer(cfg.vocab)
    docs_BT = np.random.default_rng(cfg.seed).integers(0, cfg.vocab, (cfg.batch, cfg.seq), dtype=np.int32)
    dataset = [{"text": tokenizer.decode(doc.tolist())} for doc in docs_BT]
    evaluation = evaluate.PerplexityEvaluation("random", dataset)
    evaluator = evaluator_for(model, variables, tokenizer, mesh, [evaluation], cfg.batch)
    tokens_BT = np.concatenate([np.full((cfg.batch, 1), tokenizer.bos_token_id, np.int32), docs_BT[:, :-1]], 1)

    def project():  # the whole evaluation: requests, padding, transfer, jitted scan, records
        return -sum(r["nll"] for r in evaluation.result(evaluator, tokenizer).records)

    bare = jax.jit(lambda p, x, y: bare_loglik(p, x, y, model.n_head))
    x, y = jnp.asarray(tokens_BT), jnp.asarray(docs_BT)
    sizes = [int(n) for n in cfg.matmul_sizes.split(",")]
    contenders = {"project": project, "transformers": lambda: hf_loglik(hf, tokens_BT, docs_BT),
                  "bare_jax": lambda: bare(variables["params"], x, y)}
    if cfg.family != "gpt2":  # the bare forward is written for GPT-2 only
        del contenders["bare_jax"]
    if hf is None:  # no torch here (a TPU machine): the project's own scorers, against its evaluation
        del contenders["transformers"]
    reference = "transformers" if hf is not None else "project"
    for name, fn in (more or {}).items():
        contenders[name] = lambda fn=fn: fn(variables, x, y)
    out = race({**contenders, **matmul_contenders(sizes, gpt.dtype_of(cfg.dtype))}, cfg.reps, log)
    # which rows the evaluation ran, checked after the race (its first call timed with compiling), untimed
    kept = evaluation.result(evaluator, tokenizer, keep_rows=True)
    ran_BT = np.stack([tokens_RT[0] for tokens_RT, _ in kept.intermediates])  # one request each
    assert np.array_equal(ran_BT, tokens_BT), "the project scored other rows than the others"
    peak = matmul_peak(out, sizes)
    sums = {name: float(np.sum(np.asarray(r.pop("out"), np.float64))) for name, r in out.items()}
    for name, value in sums.items():
        rel = abs(value - sums[reference]) / abs(sums[reference])
        assert rel < tolerance(cfg), f"summed log-likelihood: {name} {value} vs {reference} {sums[reference]}"
        out[name].update(loglik=value, rel_diff=rel)
    flops = model.bind(variables).flops(cfg.seq) / 3 * cfg.batch  # forward only
    for r in out.values():
        r.update(tokens_per_s=cfg.batch * cfg.seq / r["best"], flops_per_s=flops / r["best"])
    return {"flops": flops, "peak": peak, **out}


# ----------------------------------------------------------------------------- generation


def hf_generate(hf: Any, prompts_BP: np.ndarray, n_new: int) -> np.ndarray:
    """transformers' greedy decoding of exactly n_new tokens: the new tokens [B, N]."""
    return hf_generate_padded(hf, prompts_BP, np.ones(prompts_BP.shape, bool), n_new)


def hf_generate_padded(hf: Any, prompts_BP: np.ndarray, mask_BP: np.ndarray, n_new: int) -> np.ndarray:
    """The same for left-padded prompts (mask_BP True at real tokens)."""
    ids = to_torch(hf, prompts_BP)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=to_torch(hf, mask_BP), do_sample=False, use_cache=True,
                          max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=0)
    return out[:, prompts_BP.shape[1]:].cpu().numpy()


def hf_step_logits(hf: Any, prompts_BP: np.ndarray, new_BN: np.ndarray) -> np.ndarray:
    """The logits each greedy step chose from [B, N, V], by one teacher-forced forward."""
    ids = to_torch(hf, np.concatenate([prompts_BP, new_BN[:, :-1]], 1))
    with torch.no_grad():
        return hf(ids).logits[:, prompts_BP.shape[1] - 1:].float().cpu().numpy()


def tie_report(ours_BN: np.ndarray, theirs_BN: np.ndarray, logits_BNV: np.ndarray) -> Dict[str, Any]:
    """Whether the tokens agree; the smallest top1-top2 logit gap of transformers' steps; and
    where the tokens first differ, that step and its gap (a near-tie explains a difference)."""
    top2_BN2 = np.sort(logits_BNV, -1)[..., -2:]
    gap_BN = top2_BN2[..., 1] - top2_BN2[..., 0]
    report = {"identical": bool(np.array_equal(ours_BN, theirs_BN)), "min_gap": float(gap_BN.min())}
    if not report["identical"]:
        differs_BN = ours_BN != theirs_BN
        step = int(differs_BN.any(0).argmax())
        row = int(differs_BN[:, step].argmax())
        report.update(first_diff={"row": row, "step": step}, gap_at_diff=float(gap_BN[row, step]))
    return report


def greedy(evaluator: evaluate.Evaluator, prompts: List[List[int]], n_new: int,
           seed: int) -> Callable[[], np.ndarray]:
    """The evaluation's greedy rollout as a contender: padding, transfer, the jitted prefill
    and while_loop, the host copy. Returns the new tokens [B, n_new]."""
    def rollout() -> np.ndarray:
        requests = [inference.GenerationRequest(i, p) for i, p in enumerate(prompts)]
        return np.array([g.tokens for _, g in evaluator.generate_until(requests, n_new, 0.0, 1.0, seed)])
    return rollout


def nbytes(tree: Any) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


FLOOR_STEPS = 16  # iterations of the jitted loop that times the step's matmuls


def decode_floors(variables: Any, rows: int, seed: int) -> Dict[str, Callable[[], Any]]:
    """Floors under one decoding step of `rows` rows, as race() contenders:
    "step_matmuls", the step's products alone, as the model computes them: rows x every
    weight matrix in its stored layout (the tied token embedding [V, D] contracted on D
    for the unembedding), inside one jitted loop of FLOOR_STEPS iterations like the
    decoding loop (so a call's dispatch is spread over the steps; divide its time by
    FLOOR_STEPS), each iteration's input depending on the last one's products so nothing
    is hoisted; "read_params", one jitted sum over as many bytes as the parameters hold;
    "copy_params", one jitted elementwise pass that reads and writes them (a
    device-to-device copy: half its time is a read). Every step must read every parameter
    once; how fast the backend's matmul streams them for a few rows is a property of its
    GEMM, not of this project."""
    leaves = jax.tree_util.tree_leaves_with_path(variables["params"])
    # (matrix, its contracted axis): kernels are [in, out], the layers' stacked [L, in, out];
    # the embedding unembeds as x @ wte.T
    matrices = [(w, 0 if "kernel" in jax.tree_util.keystr(path) else 1) for path, stack in leaves
                if stack.ndim in (2, 3) and "wpe" not in jax.tree_util.keystr(path)
                and (stack.ndim == 2 or "kernel" in jax.tree_util.keystr(path))
                for w in (list(stack) if stack.ndim == 3 else [stack])]
    weights, axes = zip(*matrices)  # the axes stay Python ints: jit traces only the weights
    dtype = weights[0].dtype
    x_RK = jax.random.normal(jax.random.key(seed), (rows, max(w.shape[axis] for w, axis in matrices)), dtype)

    @jax.jit
    def products(x_RK, weights):
        def step(_, x_RK):
            total = sum(jax.lax.dot_general(x_RK[:, :w.shape[axis]], w, (((1,), (axis,)), ((), ()))).sum()
                        for w, axis in zip(weights, axes))
            return x_RK + (total * 1e-30).astype(dtype)
        return jax.lax.fori_loop(0, FLOOR_STEPS, step, x_RK)

    stream_N = jnp.ones((nbytes(variables) // dtype.itemsize,), dtype)
    read = jax.jit(lambda x_N: x_N.sum(dtype=jnp.float32))
    copy = jax.jit(lambda x_N: x_N * 2)
    return {"step_matmuls": lambda: products(x_RK, weights), "read_params": lambda: read(stream_N),
            "copy_params": lambda: copy(stream_N)}


def memory_floor(out: Dict[str, Any]) -> float:
    """Seconds to read the parameters once: the faster of a plain read and half a copy."""
    return min(out.pop("read_params")["best"], out.pop("copy_params")["best"] / 2)


def bench_generation(cfg: BenchConfig, model, variables, mesh, hf, log: CompileLog) -> Dict[str, Any]:
    """New tokens/s of the project's rollout and transformers' generate on the same prompts,
    their time per step less the prefill, and the floors under a step (decode_floors);
    asserts that the tokens are identical unless a near-tie explains the difference."""
    tokenizer = IdTokenizer(cfg.vocab)
    prompts_BP = np.random.default_rng(cfg.seed + 1).integers(0, cfg.vocab, (cfg.batch, cfg.prompt), dtype=np.int32)
    evaluator = evaluator_for(model, variables, tokenizer, mesh, [], cfg.batch)

    prompts = prompts_BP.tolist()
    out = race({"project": greedy(evaluator, prompts, cfg.new_tokens, cfg.seed),
                "transformers": lambda: hf_generate(hf, prompts_BP, cfg.new_tokens),
                "project_prefill": greedy(evaluator, prompts, 1, cfg.seed),
                "transformers_prefill": lambda: hf_generate(hf, prompts_BP, 1),
                **decode_floors(variables, cfg.batch, cfg.seed)}, cfg.reps, log)
    ours, theirs = out["project"].pop("out"), out["transformers"].pop("out")
    check = tie_report(ours, theirs, hf_step_logits(hf, prompts_BP, theirs))
    # float32 sums in another order move logits by ~1e-5 relative: only a near-tie may flip
    # (in bfloat16 many steps are near-ties: the agreement is reported, not asserted)
    assert check["identical"] or check["gap_at_diff"] < 1e-3 or cfg.dtype != "float32", f"tokens differ: {check}"
    floors = {"step_matmuls": out.pop("step_matmuls")["best"] / FLOOR_STEPS, "read_params": memory_floor(out)}
    for name in ("project", "transformers"):
        prefill = out.pop(f"{name}_prefill")["best"]
        out[name].update(tokens_per_s=cfg.batch * cfg.new_tokens / out[name]["best"], prefill=prefill,
                         per_step=(out[name]["best"] - prefill) / (cfg.new_tokens - 1))
    return {"check": check, "floors": floors, "param_bytes": nbytes(variables), **out}


# ----------------------------------------------------------------------------- ragged data


def ragged_rows(rng: np.random.Generator, count: int, shortest: int, longest: int, vocab: int) -> List[List[int]]:
    """`count` random token rows of lengths drawn uniformly from [shortest, longest]."""
    return [rng.integers(0, vocab - 1, n).tolist() for n in rng.integers(shortest, longest + 1, count)]


def padded(rows: List[List[int]], left: bool) -> Tuple[np.ndarray, np.ndarray]:
    """Rows padded with zeros to the longest, on the left or the right, and their mask."""
    width = max(map(len, rows))
    tokens, mask = np.zeros((len(rows), width), np.int64), np.zeros((len(rows), width), bool)
    for i, row in enumerate(rows):
        where = slice(width - len(row), width) if left else slice(0, len(row))
        tokens[i, where], mask[i, where] = row, True
    return tokens, mask


def hf_score_loop(hf: Any, docs: List[List[int]], bos: int, batch: int) -> np.ndarray:
    """A plain transformers loop: the documents in order, `batch` at a time, each batch
    right-padded to its longest; every document's summed log-likelihood after BOS."""
    out: List[float] = []
    for i in range(0, len(docs), batch):
        inputs, mask = padded([[bos] + d[:-1] for d in docs[i:i + batch]], left=False)
        targets, _ = padded(docs[i:i + batch], left=False)
        out += hf_loglik(hf, inputs, targets, mask).tolist()
    return np.array(out)


def hf_generate_loop(hf: Any, prompts: List[List[int]], batch: int, n_new: int) -> np.ndarray:
    """transformers' greedy decoding of the prompts in order, `batch` at a time, left-padded."""
    return np.concatenate([hf_generate_padded(hf, *padded(prompts[i:i + batch], left=True), n_new)
                           for i in range(0, len(prompts), batch)])


def real_share(blocks: List[Tuple[int, ...]]) -> float:
    """The share of real tokens in the slots of the blocks run (InferenceJob.counts)."""
    return sum(b[0] for b in blocks) / sum(c * r * t for _, c, r, t in blocks)


def bench_ragged(cfg: BenchConfig, model, variables, mesh, hf, log: CompileLog) -> Dict[str, Any]:
    """The work users bring: --ragged documents of mixed lengths scored, and --ragged-prompts
    prompts of mixed lengths decoded (--new-tokens each), by the project's evaluation and
    by a plain transformers loop over the same data in batches of --batch, in dataset
    order. Also the share of real tokens in the slots each of them computes."""
    tokenizer = IdTokenizer(cfg.vocab)
    rng = np.random.default_rng(cfg.seed + 2)
    docs = ragged_rows(rng, cfg.ragged, max(1, cfg.seq // 4), cfg.seq, cfg.vocab)
    prompts = ragged_rows(rng, cfg.ragged_prompts, max(1, cfg.prompt // 2), cfg.prompt * 3 // 2, cfg.vocab)
    evaluation = evaluate.PerplexityEvaluation("ragged", [{"text": tokenizer.decode(d)} for d in docs])
    scorer = evaluator_for(model, variables, tokenizer, mesh, [evaluation], cfg.batch)
    generator = evaluator_for(model, variables, tokenizer, mesh, [], cfg.batch)

    def score() -> np.ndarray:
        scorer.counts.blocks.clear()
        return np.array([-r["nll"] for r in evaluation.result(scorer, tokenizer).records])

    out = race({"project_scoring": score,
                "transformers_scoring": lambda: hf_score_loop(hf, docs, tokenizer.bos_token_id, cfg.batch),
                "project_generation": greedy(generator, prompts, cfg.new_tokens, cfg.seed),
                "transformers_generation": lambda: hf_generate_loop(hf, prompts, cfg.batch, cfg.new_tokens)},
               cfg.reps, log)
    ours, theirs = out["project_scoring"].pop("out"), out["transformers_scoring"].pop("out")
    rel = float(np.max(np.abs(ours - theirs) / np.abs(theirs)))
    assert rel < tolerance(cfg), f"ragged scoring: relative difference {rel} to transformers"
    same = out["project_generation"].pop("out") == out["transformers_generation"].pop("out")
    identical = float(same.all(-1).mean())  # prompts whose every new token agrees
    assert identical >= 0.75 or cfg.dtype != "float32", f"ragged generation: only {identical:.0%} identical"
    tokens, new = sum(map(len, docs)), len(prompts) * cfg.new_tokens
    hf_slots = sum(len(docs[i:i + cfg.batch]) * max(map(len, docs[i:i + cfg.batch]))
                   for i in range(0, len(docs), cfg.batch))
    generator.counts.blocks.clear()
    greedy(generator, prompts, 1, cfg.seed)()  # the prefill's blocks, to count their padding
    for name, count in [("scoring", tokens), ("generation", new)]:
        for who in ("project", "transformers"):
            out[f"{who}_{name}"]["tokens_per_s"] = count / out[f"{who}_{name}"]["best"]
    return {"docs": len(docs), "tokens": tokens, "prompts": len(prompts), "rel_diff": rel, "identical": identical,
            "real_share": {"project_scoring": real_share(scorer.counts.blocks), "transformers_scoring": tokens / hf_slots,
                           "project_prefill": real_share(generator.counts.blocks)},
            "blocks": len(scorer.counts.blocks), "shapes": len({b[1:] for b in scorer.counts.blocks}), **out}


# ----------------------------------------------------------------------------- the machine's limits


def bench_limits(cfg: BenchConfig, log: CompileLog) -> Dict[str, Any]:
    """This project alone against limits measured in the same run (made for a GPU or TPU,
    where transformers' PyTorch model is not the peer that matters):
    - scoring: a PerplexityEvaluation of --batch x --seq tokens; its model FLOP/s as a
      fraction of the best square matmul at --dtype;
    - decoding: batch-1 greedy rollout of --new-tokens after a --prompt-token prompt; its
      time per token (less the prefill) against the time it takes to read as many bytes
      as the parameters hold (memory_floor): each step must read every parameter once.
    The model is this project's GPT of --family's shape with random weights, in --dtype."""
    model = project_model(cfg)
    mesh = gpt.make_mesh()
    variables = gpt.init_params(model, mesh, seed=cfg.seed)
    param_bytes = nbytes(variables)
    tokenizer = IdTokenizer(cfg.vocab)
    rng = np.random.default_rng(cfg.seed)
    docs = [{"text": tokenizer.decode(doc.tolist())} for doc in rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq))]
    evaluation = evaluate.PerplexityEvaluation("random", docs)
    scorer = evaluator_for(model, variables, tokenizer, mesh, [evaluation], cfg.batch)
    prompt = rng.integers(0, cfg.vocab, (1, cfg.prompt)).tolist()
    decoder = evaluator_for(model, variables, tokenizer, mesh, [], 1)
    sizes = [int(n) for n in cfg.matmul_sizes.split(",")]
    out = race({"scoring": lambda: evaluation.result(scorer, tokenizer).scores,
                "prefill": greedy(decoder, prompt, 1, cfg.seed),
                "decode": greedy(decoder, prompt, cfg.new_tokens, cfg.seed),
                **decode_floors(variables, 1, cfg.seed), **matmul_contenders(sizes, cfg.dtype)},
               cfg.reps, log)
    for r in out.values():
        r.pop("out")
    peak = matmul_peak(out, sizes)
    # the matmul ran on one device and scoring on all: accelerators add up, while CPU
    # "devices" (--xla_force_host_platform_device_count) share the same cores
    peak["devices"] = 1 if jax.default_backend() == "cpu" else jax.device_count()
    peak["flops_per_s"] *= peak["devices"]
    flops = model.bind(variables).flops(cfg.seq) / 3 * cfg.batch  # forward only
    scoring = dict(out["scoring"], flops=flops, tokens_per_s=cfg.batch * cfg.seq / out["scoring"]["best"],
                   flops_per_s=flops / out["scoring"]["best"])
    per_token = (out["decode"]["best"] - out["prefill"]["best"]) / (cfg.new_tokens - 1)
    bound = memory_floor(out)
    decoding = dict(out["decode"], prefill=out["prefill"]["best"], per_token=per_token, bound=bound,
                    step_matmuls=out["step_matmuls"]["best"] / FLOOR_STEPS)
    return {"params": gpt.count_params(variables), "param_bytes": param_bytes, "peak": peak,
            "bandwidth": param_bytes / bound, "scoring": scoring, "decoding": decoding,
            "device": jax.devices()[0].device_kind, "n_devices": jax.device_count()}


def limits_table(cfg: BenchConfig, r: Dict[str, Any]) -> str:
    x = r["limits"]
    peak, bandwidth, s, d = x["peak"]["flops_per_s"], x["bandwidth"], x["scoring"], x["decoding"]
    mb = x["param_bytes"] / 1e6
    lines = [f"model: {cfg.family}, {cfg.layers} layers, {cfg.width} wide, {cfg.heads} heads, vocab {cfg.vocab}, "
             f"{x['params'] / 1e6:.1f}M parameters, {cfg.dtype} ({mb:.0f} MB), random weights",
             f"machine: {x['n_devices']} x {x['device']}; jax {jax.__version__}",
             f"matmul peak: {peak / 1e12:.2f} TFLOP/s {cfg.dtype} (jitted {x['peak']['size']}^2"
             + (f" on one device, x {x['peak']['devices']})" if x["peak"]["devices"] > 1 else ")"),
             f"memory read: {bandwidth / 1e12:.3f} TB/s (over {mb:.0f} MB: the faster of a jitted sum "
             "and half a jitted copy)", "",
             f"scoring {cfg.batch} x {cfg.seq} tokens (PerplexityEvaluation, {s['flops'] / 1e12:.2f} TFLOP "
             f"forward): best {s['best']:.3f} s (median {s['median']:.3f}, compile {s['compile']:.1f} s), "
             f"{s['tokens_per_s']:.0f} tokens/s",
             f"  {s['flops_per_s'] / 1e12:.2f} TFLOP/s = {s['flops_per_s'] / peak:.1%} of the measured peak"
             + (f", {s['flops_per_s'] / (cfg.peak_tflops * 1e12 * x['peak']['devices']):.1%} of the nominal "
                f"{cfg.peak_tflops:g} TFLOP/s per device" if cfg.peak_tflops else ""),
             f"greedy decoding, batch 1, {cfg.prompt}-token prompt, {cfg.new_tokens} new: best {d['best']:.3f} s "
             f"(median {d['median']:.3f}, compile {d['compile']:.1f} s), prefill {d['prefill'] * 1e3:.1f} ms",
             f"  {d['per_token'] * 1e3:.3f} ms per token; its matmuls alone take "
             f"{d['step_matmuls'] * 1e3:.3f} ms; reading the parameters once {d['bound'] * 1e3:.3f} ms: "
             f"{d['bound'] / d['per_token']:.1%} of this bound"]
    if cfg.memory_tbps:
        nominal = x["param_bytes"] / (cfg.memory_tbps * 1e12)
        lines[-1] += f", {nominal / d['per_token']:.1%} of the nominal {cfg.memory_tbps:g} TB/s bound"
    lines.append(f"\nbench ran {r['seconds']:.0f} s")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- benchmark shapes beside lm-eval
# The tasks people report, in their shapes, through this project's command line and through
# lm-eval's own HF model (HFLM) on the same HuggingFace directory, each a whole process of
# its own. The model is Llama-shaped with random weights and a tokenizer trained here on
# prose: the docstrings of Python's standard library (the same text wherever this Python
# runs). The tasks are local YAMLs that include lm-eval's installed ones (their prompts,
# few-shot choice and metrics) over JSONL data written here in the hub datasets' shapes.

SHAPES = {  # workload -> (task, what it is)
    "mmlu0": ("local_mmlu0", "MMLU-style, 0-shot, 4 one-token choices"),
    "mmlu": ("local_mmlu", "MMLU-style, 5-shot, 4 one-token choices"),
    "hellaswag": ("local_hellaswag", "hellaswag-style, 4 multi-token endings"),
    "gsm8k": ("local_gsm8k", "gsm8k-style, 5-shot generation until stop strings, --max-gen-toks new tokens"),
    "gsm8k_cot": ("local_gsm8k_cot", "gsm8k-CoT-style, the same with 8 fixed examples (a shared prompt prefix)"),
    "wikitext": ("local_wikitext", "rolling perplexity, ragged documents"),
}
# gsm8k's own stop strings, and "." and "," (triviaqa's and nq_open's): random weights never
# write "Question:", but about one token in fifty they emit holds a period or a comma, so
# rows end at varied lengths, a few at the 256-token limit
GSM8K_UNTIL = ["Question:", "</s>", "<|im_end|>", ".", ","]
COT_UNTIL = ["Q:", "</s>", "<|im_end|>", ".", ","]  # gsm8k-cot's own, and the same two
EOT = "<|endoftext|>"
NAMES, ITEMS = ("Tom", "Ana", "Lee", "Sam", "Mia", "Raj"), ("apples", "books", "coins", "pens", "shells")

# The project's side: what `python evaluate.py ARGS` runs, then the work its InferenceJob
# counted, as one JSON line. A script of its own, so that it imports what the command line
# imports (not torch, not bench.py).
OUR_SIDE = """
import json, sys
import jax
import evaluate
from checkpoints import Node
from jobs import ExecutionSpec, leave_torch_unloaded, parse_options, use_compile_cache
leave_torch_unloaded()
compiled, loaded = [], []

def on_event(event, **meta):  # a hit comes within its program's compile event
    if event == "/jax/compilation_cache/cache_hits":
        loaded.append(1)

def on_duration(event, seconds, **meta):  # a program loaded from the cache is reported here too
    if event == "/jax/core/compile/backend_compile_duration" and not (loaded and loaded.pop()):
        compiled.append(meta.get("fun_name", "?"))

jax.monitoring.register_event_listener(on_event)
jax.monitoring.register_event_duration_secs_listener(on_duration)
cfg = parse_options(evaluate.EvaluatorConfig, sys.argv[1:])
cfg.validate()
use_compile_cache(cfg.no_compile_cache)
spec = ExecutionSpec(name=evaluate.BackboneEvaluate.KEY, out_dir=cfg.out, seed=cfg.seed, cfg=cfg)
job = evaluate.BackboneEvaluate(spec, Node(cfg.ckpt))
job.run()
print(json.dumps({"blocks": job.counts.blocks, "rollouts": [r._asdict() for r in job.counts.rollouts],
                  "compiled": compiled}))
"""

# lm-eval's side: its HF model on the same directory and task, with every forward call's
# input shape recorded. Only the local tasks are indexed, as on our side (lm-eval's own
# command line indexes its 14,683 built-in task files first).
HF_SIDE = """
import json, sys
import lm_eval
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from lm_eval.utils import sanitize_list
model_dir, task_dir, task, batch, device, dtype = sys.argv[1:]
hflm = HFLM(pretrained=model_dir, dtype=dtype, batch_size=int(batch), device=device)
shapes = []
def record(module, args, kwargs):
    shapes.append(list((kwargs["input_ids"] if "input_ids" in kwargs else args[0]).shape))
hflm.model.register_forward_pre_hook(record, with_kwargs=True)
out = lm_eval.simple_evaluate(model=hflm, tasks=[task], log_samples=True, bootstrap_iters=0,
                              task_manager=TaskManager(include_path=task_dir, include_defaults=False))
samples = [{"doc_id": s["doc_id"], "filter": s["filter"], "resps": sanitize_list(s["resps"]),
            "filtered_resps": sanitize_list(s["filtered_resps"])} for s in out["samples"][task]]
print(json.dumps({"shapes": shapes, "results": out["results"][task], "samples": samples}))
"""


def stdlib_prose() -> List[str]:
    """Paragraphs of prose from the docstrings of Python's standard library, in file order."""
    paragraphs = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if {"test", "tests", "idlelib", "site-packages", "lib2to3"} & set(path.parts):
            continue
        try:
            tree = ast.parse(path.read_text(errors="ignore"))
        except (SyntaxError, ValueError):
            continue
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docs = [ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds)]
        paragraphs += [p for doc in docs if doc for p in prose_paragraphs(doc)]
    return paragraphs


def prose_paragraphs(docstring: str) -> List[str]:
    """The paragraphs of a docstring that read as prose (letters and punctuation, no code)."""
    texts = (" ".join(block.split()) for block in re.split(r"\n\s*\n", docstring))
    return [t for t in texts if len(t) > 60 and sum(c.isalpha() or c in " ,.;:'" for c in t) > 0.9 * len(t)]


def sentences(paragraphs: List[str]) -> List[str]:
    return [s for p in paragraphs for s in re.split(r"(?<=[.!?]) ", p) if 6 <= len(s.split()) <= 40]


def mmlu_docs(rng: np.random.Generator, lines: List[str], n: int) -> List[Dict[str, Any]]:
    """cais/mmlu rows, about as long as the real ones: two sentences with a run of two to
    four words blanked out, and four runs of that length to fill it (the true one)."""
    docs = []
    for i in rng.choice(len(lines) - 1, n, replace=False):
        words, span = lines[i + 1].split(" "), int(rng.integers(2, 5))
        at = int(rng.integers(0, max(len(words) - span, 0) + 1))
        runs = [" ".join(words[at:at + span])]
        for j in rng.choice(len(lines), 3, replace=False):
            other = lines[j].split(" ")
            runs.append(" ".join(other[:span]))
        answer = int(rng.integers(4))
        runs[0], runs[answer] = runs[answer], runs[0]
        blanked = " ".join(words[:at] + ["_____"] + words[at + span:])
        docs.append({"question": f"{lines[i]} {blanked} Which words fill the blank?",
                     "subject": "python", "choices": runs, "answer": answer})
    return docs


def hellaswag_docs(rng: np.random.Generator, lines: List[str], n: int) -> List[Dict[str, Any]]:
    """Rowan/hellaswag rows, about as long as the real ones: two sentences and the first
    words of the next; four endings, the true rest of that sentence and the rests of three
    others."""
    docs = []
    for i in rng.choice(len(lines) - 2, n, replace=False):
        words, label = lines[i + 2].split(" "), int(rng.integers(4))
        others = [" ".join(lines[j].split(" ")[3:]) for j in rng.choice(len(lines), 3, replace=False)]
        docs.append({"ind": int(i), "activity_label": "Python", "ctx_a": f"{lines[i]} {lines[i + 1]}",
                     "ctx_b": " ".join(words[:3]), "ctx": "", "endings": others[:label] + [" ".join(words[3:])]
                     + others[label:], "source_id": f"s{i}", "split": "val", "split_type": "indomain",
                     "label": str(label)})
    return docs


def gsm8k_docs(rng: np.random.Generator, n: int) -> List[Dict[str, Any]]:
    """openai/gsm8k rows: word problems of one to four additions, a worked answer, "#### N"."""
    docs = []
    for _ in range(n):
        name, item = str(rng.choice(NAMES)), str(rng.choice(ITEMS))
        counts = [int(c) for c in rng.integers(2, 40, int(rng.integers(2, 6)))]
        gifts = "".join(f" A friend gives {name} {c} more." for c in counts[1:])
        sums = [f"{name} has {sum(counts[:k])} + {c} = {sum(counts[:k + 1])} {item}."
                for k, c in enumerate(counts[1:], 1)]
        docs.append({"question": f"{name} has {counts[0]} {item}.{gifts} How many {item} does {name} have now?",
                     "answer": " ".join(sums) + f"\n#### {sum(counts)}"})
    return docs


def wikitext_docs(rng: np.random.Generator, paragraphs: List[str], n: int) -> List[Dict[str, str]]:
    """EleutherAI/wikitext_document_level rows: runs of consecutive paragraphs, 1 to 80 of
    them, log-uniform (a median page of about 300 tokens; a few need two rolling windows)."""
    sizes = np.exp(rng.uniform(0, np.log(80), n)).astype(int)
    starts = rng.integers(0, len(paragraphs) - 80, n)
    return [{"page": "\n".join(paragraphs[s:s + k])} for s, k in zip(starts, sizes)]


def write_task(task_dir: Path, name: str, include: str, splits: Dict[str, List[Dict[str, Any]]],
               **fields: Any) -> None:
    """A task YAML (JSON is YAML) that includes an installed lm-eval task and replaces its
    dataset with one JSONL file per split."""
    files = {}
    for split, rows in splits.items():
        files[split] = str(task_dir / f"{name}_{split}.jsonl")
        Path(files[split]).write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = {"task": name, "include": str(Path(importlib.util.find_spec("lm_eval").origin).parent / "tasks" / include),
              "dataset_path": "json", "dataset_name": None, "dataset_kwargs": {"data_files": files}, **fields}
    (task_dir / f"{name}.yaml").write_text(json.dumps(config, indent=1))


def write_shape_tasks(cfg: BenchConfig, task_dir: Path, paragraphs: List[str]) -> List[str]:
    """The six local tasks; returns the text they hold (the tokenizer learns from it too)."""
    rng, lines = np.random.default_rng(cfg.seed), sentences(paragraphs[: len(paragraphs) // 2])
    mmlu = {"dev": mmlu_docs(rng, lines, 5), "test": mmlu_docs(rng, lines, cfg.mmlu_questions)}
    description = "The following are multiple choice questions (with answers) about python.\n\n"
    write_task(task_dir, "local_mmlu", "mmlu/default/_default_template_yaml", mmlu, num_fewshot=5,
               description=description)
    mmlu0 = {"dev": mmlu["dev"], "test": mmlu_docs(rng, lines, cfg.mmlu0_questions)}
    write_task(task_dir, "local_mmlu0", "mmlu/default/_default_template_yaml", mmlu0, num_fewshot=0,
               description=description)
    hellaswag = {"train": hellaswag_docs(rng, lines, 4), "validation": hellaswag_docs(rng, lines, cfg.hellaswag_items)}
    write_task(task_dir, "local_hellaswag", "hellaswag/hellaswag.yaml", hellaswag)
    gsm8k = {"train": gsm8k_docs(rng, 8), "test": gsm8k_docs(rng, cfg.gsm8k_questions)}
    write_task(task_dir, "local_gsm8k", "gsm8k/gsm8k.yaml", gsm8k, num_fewshot=5,
               generation_kwargs={"until": GSM8K_UNTIL, "do_sample": False, "max_gen_toks": cfg.max_gen_toks})
    # gsm8k-cot.yaml: its own 8 examples before every question (few-shot sampler first_n), as in
    # bbh's and MMLU's chain-of-thought tasks
    write_task(task_dir, "local_gsm8k_cot", "gsm8k/gsm8k-cot.yaml", {"test": gsm8k["test"]},
               generation_kwargs={"until": COT_UNTIL, "do_sample": False, "max_gen_toks": cfg.max_gen_toks})
    pages = wikitext_docs(rng, paragraphs[len(paragraphs) // 2:], cfg.wikitext_docs + 4)
    write_task(task_dir, "local_wikitext", "wikitext/wikitext.yaml",
               {"train": pages[:2], "validation": pages[2:4], "test": pages[4:]})
    return [json.dumps(rows) for task in (mmlu, mmlu0, hellaswag, gsm8k) for rows in task.values()]


def train_tokenizer(texts: List[str], vocab_size: int, path: Path) -> int:
    """A byte-level BPE trained on `texts` (no prefix space, every byte in its alphabet,
    <|endoftext|> as BOS and EOS, none added to texts), saved as PreTrainedTokenizerFast.
    Returns its vocabulary size, which stops short of vocab_size when the text runs out."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                                       show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT).save_pretrained(path)
    config_file = path / "tokenizer_config.json"  # else AutoTokenizer would pick a class by model type
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()),
                                       "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
    return tok.get_vocab_size()


def save_llama(cfg: BenchConfig, vocab: int, eot_id: int, path: Path) -> int:
    """A Llama of --layers/--width/--heads/--kv-heads/--mlp-hidden, random weights of std
    --init-std, tied embeddings, context --context, as a HuggingFace directory; returns
    its parameter count."""
    torch.manual_seed(cfg.seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=cfg.width, intermediate_size=cfg.mlp_hidden or 4 * cfg.width,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads or cfg.heads,
        max_position_embeddings=cfg.context, tie_word_embeddings=True, rope_theta=100000.0,
        initializer_range=cfg.init_std, bos_token_id=eot_id, eos_token_id=eot_id)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def build_shapes(cfg: BenchConfig, workdir: Path, say: Callable[[str], None]) -> Dict[str, Any]:
    """The model directory and the task directory under workdir, made once per recipe (the
    options they depend on): a rerun with the same options reuses them."""
    recipe = {k: getattr(cfg, k) for k in ("layers", "width", "heads", "kv_heads", "mlp_hidden", "context", "vocab",
                                            "init_std", "seed", "mmlu_questions", "mmlu0_questions", "hellaswag_items",
                                            "gsm8k_questions", "max_gen_toks", "wikitext_docs")}
    model_dir, task_dir, made = workdir / "model", workdir / "tasks", workdir / "recipe.json"
    if made.exists() and json.loads(made.read_text()) == recipe:
        return json.loads((workdir / "built.json").read_text())
    say("making the tasks, the tokenizer and the random Llama")
    shutil.rmtree(workdir, ignore_errors=True)
    task_dir.mkdir(parents=True)
    paragraphs = stdlib_prose()
    texts = write_shape_tasks(cfg, task_dir, paragraphs)
    vocab = train_tokenizer(paragraphs + texts, cfg.vocab, model_dir)
    params = save_llama(cfg, vocab, transformers.AutoTokenizer.from_pretrained(model_dir).eos_token_id, model_dir)
    built = {"model": str(model_dir), "tasks": str(task_dir), "vocab": vocab, "params": params}
    (workdir / "built.json").write_text(json.dumps(built))
    made.write_text(json.dumps(recipe))
    return built


def run_side(command: List[str], cache: Path, env: Optional[Dict[str, str]] = None) -> Tuple[float, Dict[str, Any]]:
    """(whole wall seconds, the JSON it printed last) of one contender's process. Each gets
    a fresh datasets cache, so both pay for reading the JSONL files; env: more variables."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache),
           **(env or {})}
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parent)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} ... failed:\n{proc.stderr[-3000:]}")
    return seconds, json.loads(proc.stdout.splitlines()[-1])


def run_ours(cfg: BenchConfig, built: Dict[str, Any], task: str, out: Path,
             compile_cache: Path, journal: bool = True) -> Tuple[float, Dict[str, Any]]:
    """This project's side: its command line's job on the task, then its samples and scores,
    with its persistent compilation cache under `compile_cache` (empty: a first run), as
    XDG_CACHE_HOME: the default cache, with the default settings (JAX_COMPILATION_CACHE_DIR
    would give jax's own, under which programs compiled in less than a second are not kept);
    journal False: GPT_EVAL_JOURNAL=0, the run journals nothing."""
    args = ["--ckpt", built["model"], "--tasks", task, "--include-path", built["tasks"], "--batch-size",
            str(cfg.batch), "--dtype", cfg.dtype, "--log-samples", "--bootstrap-iters", "0", "--out", str(out)]
    seconds, work = run_side([sys.executable, "-c", OUR_SIDE, *args], out / "datasets",
                             {"XDG_CACHE_HOME": str(compile_cache), "JAX_COMPILATION_CACHE_DIR": "",
                              "GPT_EVAL_COMPILE_CACHE": "1", "GPT_EVAL_JOURNAL": "1" if journal else "0"})
    files = json.loads((out / "results.json").read_text())["lm_eval"]
    samples = [json.loads(line) for line in (out / files["samples"][task]).read_text().splitlines()]
    results = json.loads((out / files["results"]).read_text())["results"][task]
    return seconds, {**work, "samples": samples, "results": results}


def leaves(value: Any) -> List[str]:
    """The strings of a nested response (lm-eval's samples hold them as strings)."""
    return [s for v in value for s in leaves(v)] if isinstance(value, list) else [str(value)]


def agreement(theirs: Dict[str, Any], ours: Dict[str, Any]) -> Dict[str, Any]:
    """Every response side by side: the largest relative difference of the numbers (log-
    likelihoods), how many of the rest (is_greedy, texts, answers) are identical, and the
    largest relative difference of the task's scores."""
    key = lambda s: (s["doc_id"], s["filter"])
    pairs = [(a, b) for t, o in zip(sorted(theirs["samples"], key=key), sorted(ours["samples"], key=key))
             for a, b in zip(leaves(t["resps"]) + leaves(t["filtered_resps"]),
                             leaves(o["resps"]) + leaves(o["filtered_resps"]))]
    numbers = [(float(a), float(b)) for a, b in pairs if re.fullmatch(r"-?\d+\.\d*(e-?\d+)?", a)]
    others = [(a, b) for a, b in pairs if not re.fullmatch(r"-?\d+\.\d*(e-?\d+)?", a)]
    scores = [(v, ours["results"][k]) for k, v in theirs["results"].items() if isinstance(v, float)]
    relative = lambda xs: max([abs(b - a) / max(abs(a), 1e-12) for a, b in xs], default=0.0)
    return {"same_count": len(theirs["samples"]) == len(ours["samples"]), "max_rel": relative(numbers),
            "identical": sum(a == b for a, b in others), "compared": len(others), "scores_rel": relative(scores),
            "scores": {k: v for k, v in ours["results"].items() if isinstance(v, float)}}


def work_done(theirs: Dict[str, Any], ours: Dict[str, Any]) -> Dict[str, Any]:
    """Tokens computed per request (the padded slots every forward pass ran) and, for
    generation (ours decoded batches), the decoding steps (new tokens per row, summed over
    batches), both sides."""
    generation = bool(ours["rollouts"])
    requests = sum(len(s["resps"]) for s in ours["samples"] if s["filter"] == ours["samples"][0]["filter"])
    hf_slots = sum(b * t for b, t in theirs["shapes"])
    runs = ours["rollouts"]
    our_slots = sum(r["prefill"] + r["row_steps"] for r in runs) if generation else \
        sum(c * r * t for _, c, r, t in ours["blocks"])
    out = {"requests": requests, "hf_tokens_per_request": hf_slots / requests,
           "our_tokens_per_request": our_slots / requests}
    if generation:  # each of HF's forward calls (prefill included) gives one token per row
        out.update(hf_steps=len(theirs["shapes"]), our_steps=sum(r["steps"] for r in runs),
                   needed_steps=sum(r["needed"] for r in runs),
                   hf_row_steps=sum(b for b, t in theirs["shapes"] if t == 1),
                   our_row_steps=sum(r["row_steps"] for r in runs))
    return out


def bench_shapes(cfg: BenchConfig, say: Callable[[str], None]) -> Dict[str, Any]:
    """Each workload of --workloads through both sides, lm-eval's first; their wall times,
    the work each computed, and whether their answers agree."""
    if torch is None or importlib.util.find_spec("lm_eval") is None:
        raise UsageError("--shapes needs torch and lm-eval's HF model: pip install torch==2.13.0 "
                         "'lm-eval[hf]==0.4.13'")
    unknown = [w for w in cfg.workloads.split(",") if w not in SHAPES]
    if unknown:
        raise UsageError(f"--workloads: unknown {unknown[0]!r}; choose from {', '.join(SHAPES)}")
    workdir = Path(cfg.workdir or tempfile.mkdtemp(prefix="bench-shapes-"))
    built, out = build_shapes(cfg, workdir, say), {}
    for name in cfg.workloads.split(","):
        out[name] = shape_workload(cfg, built, name, workdir / "runs" / name, say)
        # sums in another order: float32 log-likelihoods agree to ~1e-5 (texts may differ after a near-tie)
        assert out[name]["same_count"] and out[name]["max_rel"] < tolerance(cfg), f"{name}: answers differ: {out[name]}"
    if not cfg.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"built": built, "workloads": out}


def shape_workload(cfg: BenchConfig, built: Dict[str, Any], name: str, runs: Path,
                   say: Callable[[str], None]) -> Dict[str, Any]:
    """One workload through lm-eval's HF model, then three times through this project's
    command line (a first run, its compilation cache empty; a second, its programs loaded
    from that cache; a first run with the journal off): the wall times, the programs
    compiled, the work each computed and how far their answers agree. The blocks run are
    the same with the journal and without (asserted)."""
    task = SHAPES[name][0]
    shutil.rmtree(runs, ignore_errors=True)
    say(f"{name}: lm-eval's HF model")
    hf_side = [built["model"], built["tasks"], task, str(cfg.batch), cfg.device, cfg.dtype]
    hf_s, theirs = run_side([sys.executable, "-c", HF_SIDE, *hf_side], runs / "hf-datasets")
    say(f"{name}: this project, a first run (its compilation cache empty), then a second")
    our_s, ours = run_ours(cfg, built, task, runs / "ours", runs / "compile-cache")
    again_s, again = run_ours(cfg, built, task, runs / "again", runs / "compile-cache")
    assert again["samples"] == ours["samples"], f"{name}: a second run answers otherwise"
    say(f"{name}: this project, a first run with the journal off")
    off_s, off = run_ours(cfg, built, task, runs / "off", runs / "compile-cache-off", journal=False)
    assert off["blocks"] == ours["blocks"] and off["samples"] == ours["samples"], f"{name}: the journal changed the work"
    return {"hf_seconds": hf_s, "our_seconds": our_s, "second_seconds": again_s, "no_journal_seconds": off_s,
            "compiled": ours["compiled"], "compiled_again": again["compiled"], **agreement(theirs, ours),
            **work_done(theirs, ours)}


def shapes_table(cfg: BenchConfig, r: Dict[str, Any]) -> str:
    b = r["shapes"]["built"]
    lines = [f"model: llama, {cfg.layers} layers, {cfg.width} wide, {cfg.heads} heads ({cfg.kv_heads or cfg.heads} "
             f"kv), MLP {cfg.mlp_hidden or 4 * cfg.width}, vocab {b['vocab']}, context {cfg.context}, "
             f"{b['params'] / 1e6:.1f}M parameters, {cfg.dtype}, random weights (std {cfg.init_std})",
             f"machine: {os.cpu_count()} CPUs (load average {r['load'][0]:.1f} -> {r['load'][1]:.1f}); lm-eval's "
             f"HF model on {cfg.device}; batch {cfg.batch} for both; whole processes", "",
             f"  {'workload':10s} {'requests':>8s} {'lm-eval s':>9s} {'ours s':>7s} {'ratio':>6s} "
             f"{'2nd s':>6s} {'ratio':>6s} {'no journal':>10s} {'compiled':>8s} {'tokens/request':>15s} "
             f"{'decoding steps':>22s}  agreement"]
    for name, w in r["shapes"]["workloads"].items():
        steps = (f"{w['hf_steps']:6d} {w['our_steps']:6d} ({w['needed_steps']})" if "hf_steps" in w else "-")
        compiled = f"{len(w['compiled'])} / {len(w['compiled_again'])}"
        lines.append(f"  {name:10s} {w['requests']:8d} {w['hf_seconds']:9.1f} {w['our_seconds']:7.1f} "
                     f"{w['hf_seconds'] / w['our_seconds']:5.2f}x {w['second_seconds']:6.1f} "
                     f"{w['hf_seconds'] / w['second_seconds']:5.2f}x {w['no_journal_seconds']:6.1f} "
                     f"{w['our_seconds'] / w['no_journal_seconds'] - 1:+4.0%} {compiled:>8s} {w['hf_tokens_per_request']:7.1f} "
                     f"{w['our_tokens_per_request']:7.1f} {steps:>22s}  log-likelihoods within {w['max_rel']:.1e}, "
                     f"{w['identical']}/{w['compared']} answers identical, scores within {w['scores_rel']:.1e}")
    lines += ["", "  ours: a first run, its compilation cache empty; 2nd: the same command again, its programs "
              "loaded from the cache; no journal: a first run under GPT_EVAL_JOURNAL=0, and how much longer the "
              "first run took; compiled: programs compiled by the first run / the second",
              "  tokens/request: lm-eval's, then ours; decoding steps: lm-eval's, ours (what the stop "
              "strings needed)", *(f"  {name}: {SHAPES[name][1]}" for name in r["shapes"]["workloads"]),
              "", "  programs the first run compiled:",
              *(f"  {name}: {program_counts(w['compiled'])}" for name, w in r["shapes"]["workloads"].items())]
    if max(r["load"]) > os.cpu_count():
        lines += ["", f"note: the machine was busy (load average up to {max(r['load']):.1f} on {os.cpu_count()} "
                  "CPUs): the wall times are noisy"]
    lines.append(f"\nbench ran {r['seconds']:.0f} s")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- one prepared run on a GPU
# `python bench.py --gpu-report` makes every accelerator measurement in one run of at most
# --report-seconds (an accelerator is often lent for minutes at a time). Each part runs in a
# process of its own: one that fails or runs out of time costs only itself, and XLA and torch
# each find the GPU's memory free in turn. A part writes REPORT_DIR/PART.json as it goes, and
# the report is made from whatever is there. `--make-fixture DIR`, on the CPU beforehand,
# writes the model, data and this CPU's answers that the parity part compares the GPU's with.

NOMINAL = {  # nvidia-smi's name, or jax's device kind -> (dense bf16 FLOP/s, HBM bytes/s), from the vendor's sheets
    "NVIDIA H200": (989e12, 4.8e12), "NVIDIA H200 NVL": (835e12, 4.8e12),
    "NVIDIA H100 80GB HBM3": (989e12, 3.35e12), "TPU v5 lite": (197e12, 819e9)}

REPORT_MODELS = {  # a model part's name -> its shape, random weights
    "smollm2": dict(family="llama", layers=30, width=576, heads=9, kv_heads=3, mlp_hidden=1536, vocab=49152),
    "qwen2-1.5b": dict(family="qwen2", layers=28, width=1536, heads=12, kv_heads=2, mlp_hidden=8960, vocab=151936),
    "tiny": dict(family="llama", layers=2, width=64, heads=4, kv_heads=2, mlp_hidden=128, vocab=512),  # a dry run
}
PARITY_RUNS = {"float32-highest": ("float32", "highest"), "float32": ("float32", None), "bfloat16": ("bfloat16", None)}
FIXTURE_MODEL = dict(layers=4, width=256, heads=4, kv_heads=2, mlp_hidden=704, context=512, init_std=0.1, vocab=2048)
FIXTURE_NEW_TOKENS = 32


def parity_runs(cfg: BenchConfig) -> List[str]:
    runs = cfg.parity_runs.split(",")
    unknown = [r for r in runs if r not in PARITY_RUNS]
    if unknown:
        raise UsageError(f"--parity-runs: unknown {unknown[0]!r}; choose from {', '.join(PARITY_RUNS)}")
    return runs


def report_parts(cfg: BenchConfig) -> List[str]:
    parts = cfg.report_parts.split(",")
    unknown = [p for p in parts if p not in ("device", "ceilings", "parity", "runs", "shapes", *REPORT_MODELS)]
    if unknown:
        raise UsageError(f"--report-parts: unknown {unknown[0]!r}; choose from device, ceilings, parity, runs, "
                         "shapes, " + ", ".join(REPORT_MODELS))
    if "runs" in parts and not (Path(cfg.fixture) / "runs" / "tokenizer").is_dir():
        raise UsageError(f"--fixture {cfg.fixture!r} holds no runs/: make one with --make-fixture DIR on a CPU")
    if "runs" in parts and cfg.runs_model not in REPORT_MODELS:
        raise UsageError(f"--runs-model: unknown {cfg.runs_model!r}; choose from {', '.join(REPORT_MODELS)}")
    if "parity" in parts and not (Path(cfg.fixture) / "args.json").is_file():
        raise UsageError(f"--fixture {cfg.fixture!r} holds no fixture: make one with --make-fixture DIR on a CPU")
    missing = [r for r in parity_runs(cfg) if not (Path(cfg.fixture) / f"cpu-{PARITY_RUNS[r][0]}").is_dir()]
    if "parity" in parts and missing:
        raise UsageError(f"--fixture {cfg.fixture!r} holds no CPU answers for {missing[0]}: make it with that in "
                         "--parity-runs")
    return parts


def run_part(command: List[str], seconds: float, env: Optional[Dict[str, str]] = None) -> Tuple[str, str]:
    """(status, stderr) of one part's process, stopped with everything it started once
    `seconds` have passed; env: more variables."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        _, log = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, log = proc.communicate()
        return "stopped: out of time", log
    lines = [line for line in log.splitlines() if line.strip()]
    return ("ok" if proc.returncode == 0 else f"failed: {lines[-1] if lines else proc.returncode}"), log


def gpu_report(cfg: BenchConfig, argv: List[str], say: Callable[[str], None]) -> Dict[str, Any]:
    """Each of --report-parts in a process of its own, in order, while time is left; then
    what they wrote."""
    folder, started, parts = Path(cfg.report_dir), time.perf_counter(), {}
    folder.mkdir(parents=True, exist_ok=True)
    for part in report_parts(cfg):
        left = cfg.report_seconds - (time.perf_counter() - started)
        if left < 30:
            parts[part] = {"status": "skipped: out of time", "seconds": 0.0}
            continue
        say(f"{part}: at most {left:.0f} s")
        began = time.perf_counter()
        shared = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"} if part in REPORT_MODELS else {}  # torch uses the GPU too
        status, log = run_part([sys.executable, str(Path(__file__).resolve()), *argv, "--report-part", part], left,
                               shared)
        (folder / f"{part}.log").write_text(log)
        parts[part] = {"status": status, "seconds": time.perf_counter() - began}
        say(f"{part}: {status} ({parts[part]['seconds']:.0f} s)")
    found = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json")) if p.stem in parts}
    return {"parts": parts, **found}


def report_part(cfg: BenchConfig, say: Callable[[str], None]) -> None:
    """One part, in this process, its results written to REPORT_DIR/PART.json as they come."""
    part, log = cfg.report_part, compile_log()
    path = Path(cfg.report_dir) / f"{part}.json"
    write = lambda result: write_atomic(path, json.dumps(result, indent=1, default=float).encode())
    if part == "device":
        write(device_facts())
    elif part == "ceilings":
        write(ceilings(cfg, log))
    elif part == "parity":
        parity(cfg, write, say)
    elif part == "shapes":
        report_shapes(cfg, write, say)
    elif part == "runs":
        report_runs(cfg, write, say)
    else:
        report_model(cfg, part, write, say, log)


def device_facts() -> Dict[str, Any]:
    """What the machine is: nvidia-smi's name, power limit and clocks, the devices jax sees,
    the versions measured."""
    smi = shutil.which("nvidia-smi")
    query = ["--query-gpu=name,power.limit,clocks.max.sm,memory.total", "--format=csv,noheader"]
    line = subprocess.run([smi, *query], capture_output=True, text=True).stdout.strip() if smi else ""
    versions = {"jax": jax.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0],
                "torch": torch.__version__ if torch else None, "flax": importlib.metadata.version("flax")}
    return {"nvidia_smi": line, "name": line.split(",")[0].strip() if line else jax.devices()[0].device_kind,
            "backend": jax.default_backend(), "devices": [d.device_kind for d in jax.devices()], "versions": versions}


def ceilings(cfg: BenchConfig, log: CompileLog) -> Dict[str, Any]:
    """The machine's own limits at --dtype: the best jitted square matmul of --matmul-sizes,
    and a jitted copy's bytes read and written per second (1 GiB each way on a GPU)."""
    dtype, sizes = gpt.dtype_of(cfg.dtype), [int(n) for n in cfg.matmul_sizes.split(",")]
    x_N = jnp.ones(((1 << 30 if jax.default_backend() != "cpu" else 1 << 24) // jnp.dtype(dtype).itemsize,), dtype)
    copy = jax.jit(lambda x_N: x_N * 2)
    out = race({**matmul_contenders(sizes, dtype), "copy": lambda: copy(x_N)}, cfg.reps, log)
    gemm = {n: 2 * n ** 3 / out[f"matmul_{n}"]["best"] for n in sizes}
    result = {"gemm": matmul_peak(out, sizes), "gemm_by_size": gemm,
              "copy_bytes_per_s": 2 * x_N.nbytes / out["copy"]["best"], "dtype": cfg.dtype}
    if torch is not None and torch.cuda.is_available():  # torch's copy and sum beside XLA's, on as many bytes
        a, b = (torch.ones(x_N.size, dtype=getattr(torch, cfg.dtype), device="cuda") for _ in range(2))
        copy_s = min(timed_call(lambda: b.copy_(a)) for _ in range(cfg.reps + 1))
        sum_s = min(timed_call(lambda: a.sum(dtype=torch.float32)) for _ in range(cfg.reps + 1))
        result.update(torch_copy_bytes_per_s=2 * x_N.nbytes / copy_s, torch_read_bytes_per_s=x_N.nbytes / sum_s)
    return result


# --- parity: the GPU's answers against this CPU's, on one small checkpoint and data


def fixture_data(paragraphs: List[str], folder: Path) -> List[str]:
    """The four --data files (perplexity, multiple choice, generation, accuracy) over prose;
    returns evaluate.py's --data arguments."""
    rng, lines = np.random.default_rng(0), sentences(paragraphs)
    picked = [lines[i] for i in rng.choice(len(lines), 96, replace=False)]
    texts = {"ppl": [{"text": " ".join(paragraphs[i:i + 1 + i % 5])} for i in range(0, 48, 2)],
             "mc": [], "gen": [], "acc": [{"text": p} for p in paragraphs[100:116]]}
    for i, sentence in enumerate(picked[:32]):
        words = sentence.split()
        cut = len(words) // 2
        endings = [" " + " ".join(s.split()[cut:]) for s in [sentence, *picked[32 + 2 * i % 60:][:3]]]
        texts["mc"].append({"context": " ".join(words[:cut]), "choices": endings, "gold": 0})
    for sentence in picked[-16:]:
        words = sentence.split()
        texts["gen"].append({"prompt": " ".join(words[:6]), "answer": " ".join(words[6:])})
    folder.mkdir(parents=True, exist_ok=True)
    for kind, rows in texts.items():
        (folder / f"{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [a for kind in texts for a in ("--data", f"{kind}:data/{kind}.jsonl")]


def make_fixture(cfg: BenchConfig, say: Callable[[str], None]) -> Dict[str, Any]:
    """A small random Llama, a tokenizer trained here, the data, and this CPU's answers in
    float32 and bfloat16 (evaluate.py's samples), under --make-fixture DIR."""
    folder = Path(cfg.make_fixture)
    shutil.rmtree(folder, ignore_errors=True)
    paragraphs = stdlib_prose()
    args = fixture_data(paragraphs, folder / "data")
    small = dataclasses.replace(cfg, **FIXTURE_MODEL)
    vocab = train_tokenizer(paragraphs, small.vocab, folder / "model")
    save_llama(small, vocab, transformers.AutoTokenizer.from_pretrained(folder / "model").eos_token_id,
               folder / "model")
    (folder / "args.json").write_text(json.dumps(args))
    runs_fixture(cfg, paragraphs, folder / "runs")
    for dtype in sorted({PARITY_RUNS[name][0] for name in parity_runs(cfg)}):
        say(f"this CPU's answers in {dtype}")
        evaluate_fixture(folder, dtype, None, folder / f"cpu-{dtype}")
    return {"fixture": str(folder), "vocab": vocab}


def cache_env(cache: Path) -> Dict[str, str]:
    """This environment for a process of evaluate.py with its default persistent compilation
    cache under `cache` (as XDG_CACHE_HOME), jax's own cache settings left out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT"))}
    return {**env, "XDG_CACHE_HOME": str(Path(cache).resolve()), "GPT_EVAL_COMPILE_CACHE": "1"}


def evaluate_fixture(fixture: Path, dtype: str, precision: Optional[str], out: Path) -> float:
    """evaluate.py on the fixture in a process of its own, in `dtype`, with jax's default
    matmul precision set to `precision` (None: jax's own default); its wall seconds. Its
    compilation cache is the fixture's own: a machine that made the fixture loads its
    programs again (the same programs, so the same answers), another compiles its own."""
    args = ["--ckpt", "model", *json.loads((fixture / "args.json").read_text()), "--dtype", dtype,
            "--max-new-tokens", str(FIXTURE_NEW_TOKENS), "--log-samples", "--quiet", "--force",
            "--out", str(out.resolve())]
    env = cache_env(fixture / "compile-cache")
    env.pop("JAX_DEFAULT_MATMUL_PRECISION", None)
    if precision:
        env["JAX_DEFAULT_MATMUL_PRECISION"] = precision
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "evaluate.py"), *args],
                          capture_output=True, text=True, env=env, cwd=fixture)
    if proc.returncode != 0:
        raise RuntimeError(f"evaluate.py on the fixture, {dtype}: {proc.stderr[-2000:]}")
    return time.perf_counter() - started


def compare_samples(ours: Path, reference: Path) -> Dict[str, Any]:
    """Two samples.jsonl files of the same run side by side: the largest relative difference
    of their log-likelihoods (nll, loglik), and how many generations, choices picked and
    next-token counts are identical."""
    pairs = list(zip(*(map(json.loads, f.read_text().splitlines()) for f in (ours, reference))))
    numbers = [(float(a), float(b)) for x, y in pairs for key in ("nll", "loglik") if key in x
               for a, b in zip(np.atleast_1d(x[key]), np.atleast_1d(y[key]))]
    same = lambda key: (sum(x[key] == y[key] for x, y in pairs if key in x), sum(key in x for x, _ in pairs))
    return {"log_likelihoods": len(numbers), "max_rel": max(abs(a - b) / max(abs(b), 1e-12) for a, b in numbers),
            "generations": same("output"), "choices": same("pred"), "next_tokens": same("correct")}


def parity(cfg: BenchConfig, write: Callable[[Any], None], say: Callable[[str], None]) -> None:
    """The fixture evaluated here in float32 at the highest matmul precision, in float32 at
    jax's default one, and in bfloat16; each compared with the CPU's answers in its dtype."""
    fixture, result = Path(cfg.fixture), {}
    for name in parity_runs(cfg):
        dtype, precision = PARITY_RUNS[name]
        say(f"parity: {name}")
        out = Path(cfg.report_dir) / f"parity-{name}"
        seconds = evaluate_fixture(fixture, dtype, precision, out)
        result[name] = {"seconds": seconds, **compare_samples(out / "samples.jsonl",
                                                              fixture / f"cpu-{dtype}" / "samples.jsonl")}
        shutil.rmtree(out, ignore_errors=True)
        write(result)


# --- whole runs of the command line on the device, first and again: what compiling costs


RUNS = {  # workload -> evaluate.py's arguments on the runs model (None: `python evaluate.py`, fresh weights)
    "default": None,
    "mc": ["--data", "mc:data/mmlu.jsonl"],
    "ppl": ["--data", "ppl:data/prose.jsonl"],
    "gen": ["--data", "gen:data/prompts.jsonl", "--max-new-tokens", "32"],
}


def runs_fixture(cfg: BenchConfig, paragraphs: List[str], folder: Path) -> None:
    """The runs part's tokenizer (trained here: the device has no network) and its --data:
    --runs-items MMLU-style questions (0-shot, lm-eval's prompt, four one-token choices) as
    multiple choice and as prompts to answer, and 101 prose paragraphs to score."""
    rng, lines = np.random.default_rng(cfg.seed), sentences(paragraphs[: len(paragraphs) // 2])
    questions = []
    for doc in mmlu_docs(rng, lines, cfg.runs_items):
        options = "".join(f"\n{letter}. {choice}" for letter, choice in zip("ABCD", doc["choices"]))
        questions.append((f"{doc['question'].strip()}{options}\nAnswer:", doc["answer"]))
    texts = {"mmlu": [{"context": q, "choices": [" A", " B", " C", " D"], "gold": gold} for q, gold in questions],
             "prompts": [{"prompt": q, "answer": " " + "ABCD"[gold]} for q, gold in questions],
             "prose": [{"text": p} for p in paragraphs[len(paragraphs) // 2:][:101]]}
    (folder / "data").mkdir(parents=True, exist_ok=True)
    for name, rows in texts.items():
        (folder / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train_tokenizer(paragraphs + [q for q, _ in questions], REPORT_MODELS[cfg.runs_model]["vocab"], folder / "tokenizer")


def write_llama(shape: Dict[str, Any], tokenizer: Path, path: Path, seed: int, init_std: float) -> None:
    """A Llama of REPORT_MODELS' `shape`, random weights, as a HuggingFace directory written
    with numpy (no torch: the device has none), with the tokenizer of `tokenizer`."""
    shutil.copytree(tokenizer, path)
    eot = transformers.AutoTokenizer.from_pretrained(tokenizer).eos_token_id
    shape = dict(shape, vocab=max(shape["vocab"], len(transformers.AutoTokenizer.from_pretrained(tokenizer))))
    D, F, L, H, K = shape["width"], shape["mlp_hidden"], shape["layers"], shape["heads"], shape["kv_heads"]
    E = D // H
    transformers.LlamaConfig(vocab_size=shape["vocab"], hidden_size=D, intermediate_size=F, num_hidden_layers=L,
                             num_attention_heads=H, num_key_value_heads=K, max_position_embeddings=2048,
                             tie_word_embeddings=True, rope_theta=100000.0, bos_token_id=eot,
                             eos_token_id=eot).save_pretrained(path)
    rng = np.random.default_rng(seed)
    normal = lambda *shape: (init_std * rng.standard_normal(shape, np.float32)).astype(np.float32)
    tensors = {"model.embed_tokens.weight": normal(shape["vocab"], D), "model.norm.weight": np.ones(D, np.float32)}
    for i in range(L):
        h = f"model.layers.{i}."
        tensors.update({h + "input_layernorm.weight": np.ones(D, np.float32),
                        h + "post_attention_layernorm.weight": np.ones(D, np.float32),
                        h + "self_attn.q_proj.weight": normal(H * E, D), h + "self_attn.k_proj.weight": normal(K * E, D),
                        h + "self_attn.v_proj.weight": normal(K * E, D), h + "self_attn.o_proj.weight": normal(D, H * E),
                        h + "mlp.gate_proj.weight": normal(F, D), h + "mlp.up_proj.weight": normal(F, D),
                        h + "mlp.down_proj.weight": normal(D, F)})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def timed_run(args: List[str], out: Path, cache: Path) -> Dict[str, Any]:
    """`python evaluate.py ARGS` as a user runs it, a process of its own with its persistent
    compilation cache in `cache` (the default one, under XDG_CACHE_HOME): its wall seconds,
    and what its results.json says it computed and built."""
    script = str(Path(__file__).resolve().parent / "evaluate.py")
    seconds = timed_process([script, *args, "--out", str(out), "--quiet"], cache, out.parent)
    results = json.loads((out / "results.json").read_text())
    return {"seconds": seconds, "programs": results["programs"], "results": results["results"],
            "run_seconds": results["seconds"]}


def timed_process(argv: List[str], cache: Path, cwd: Path) -> float:
    """Wall seconds of `python ARGV` in a process of its own, its compilation cache in `cache`."""
    env = cache_env(cache)
    for attempt in range(2):  # a TPU can refuse a process that starts just as the last one ends: once more
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=cwd)
        seconds = time.perf_counter() - started
        if proc.returncode == 0 or "libtpu" not in proc.stderr or attempt:
            break
        time.sleep(5)
    if proc.returncode != 0:
        raise RuntimeError(f"python {' '.join(argv)}: {proc.stderr[-2000:]}")
    return seconds


def report_runs(cfg: BenchConfig, write: Callable[[Any], None], say: Callable[[str], None]) -> None:
    """Each workload of --runs-workloads through evaluate.py on --runs-model's random Llama in
    --dtype at --batch: a first run with an empty compilation cache, then the same again with
    the programs the first left there; wall seconds, programs built and their seconds."""
    shape, fixture = REPORT_MODELS[cfg.runs_model], Path(cfg.fixture).resolve() / "runs"
    workdir = Path(tempfile.mkdtemp(prefix="bench-report-runs-"))
    shutil.copytree(fixture / "data", workdir / "data")
    say(f"runs: writing the random {cfg.runs_model} Llama")
    write_llama(shape, fixture / "tokenizer", workdir / "model", cfg.seed, 0.02)
    result: Dict[str, Any] = {"model": cfg.runs_model, "shape": shape, "dtype": cfg.dtype, "batch": cfg.batch,
                              "workloads": {}}
    say("runs: a process that imports evaluate.py and opens the devices")
    opening = "import sys; sys.path.insert(0, sys.argv[1]); import evaluate; evaluate.open_devices_meanwhile()"
    result["floor_seconds"] = min(timed_process(["-c", opening, str(Path(__file__).resolve().parent)],
                                                workdir / "floor-cache", workdir) for _ in range(2))
    for name in cfg.runs_workloads.split(","):
        args = RUNS[name] and ["--ckpt", "model", *RUNS[name], "--batch-size", str(cfg.batch), "--dtype", cfg.dtype]
        runs = {}
        for attempt in ("first", "second"):
            say(f"runs: {name}, {attempt} run")
            runs[attempt] = timed_run(args or [], workdir / f"{name}-{attempt}", workdir / f"{name}-cache")
        result["workloads"][name] = runs
        write(result)
    shutil.rmtree(workdir, ignore_errors=True)


def runs_report_table(r: Dict[str, Any]) -> List[str]:
    shape = r["shape"]
    lines = [f"whole runs of evaluate.py: {r['model']} ({shape['layers']} layers, {shape['width']} wide), random "
             f"weights, {r['dtype']}, batch {r['batch']}; a first run (empty compilation cache), then again",
             f"  {'workload':9s} {'first s':>8s} {'programs':>8s} {'compile s':>9s} {'longest':>7s} {'again s':>8s} "
             f"{'loaded':>6s} {'load s':>7s}  programs compiled"]
    for name, w in r["workloads"].items():
        first, second = w["first"], w["second"]
        longest = first["programs"].get("longest_compile", {}).get("seconds", float("nan"))
        lines.append(f"  {name:9s} {first['seconds']:8.1f} {first['programs']['compiled']:8d} "
                     f"{first['programs']['seconds']:9.1f} {longest:7.1f} {second['seconds']:8.1f} {second['programs']['loaded']:6d} "
                     f"{second['programs']['seconds']:7.1f}  " + ", ".join(
                         f"{n.removeprefix('jit(').removesuffix(')')} {k}" for n, k in first["programs"]["by_name"].items()))
    if "floor_seconds" in r:
        lines.append(f"  a process that only imports evaluate.py and opens the devices: {r['floor_seconds']:.1f} s "
                     "(least of 2), the least any run takes")
    return lines


# --- a model's scoring and decoding, beside transformers on the same device


def time_generator_calls(job: inference.InferenceJob, calls: List[Tuple[str, float]]) -> None:
    """Every jitted decoding call of job (start, advance, refill) timed into `calls` as
    (name, seconds), waiting for its results: what the device spends apart from the host."""
    original = job._generator

    def timed(n_new: int, temperature: float, top_p: float) -> Tuple[Callable, ...]:
        def clock(name: str, fn: Callable) -> Callable:
            def call(*args):
                began = time.perf_counter()
                out = jax.block_until_ready(fn(*args))
                calls.append((name, time.perf_counter() - began))
                return out
            return call
        return tuple(clock(name, fn) for name, fn in zip(("start", "advance", "refill"),
                                                         original(n_new, temperature, top_p)))
    job._generator = timed


def harness_decoding(evaluator: evaluate.Evaluator, prompts: List[List[int]], n_new: int, reps: int,
                     seed: int) -> Dict[str, Any]:
    """The evaluation's greedy decoding, a warm-up and `reps` timed rounds: the best round's
    wall seconds, its prefill, its decoding steps and their device time, and the host's
    time between them (checking stop strings, refills)."""
    calls: List[Tuple[str, float]] = []
    time_generator_calls(evaluator, calls)
    rounds = []
    for _ in range(reps + 1):
        calls.clear()
        evaluator.counts.rollouts.clear()
        began = time.perf_counter()
        tokens = greedy(evaluator, prompts, n_new, seed)()
        wall = time.perf_counter() - began
        device = {name: sum(s for n, s in calls if n == name) for name in ("start", "advance", "refill")}
        rounds.append({"wall": wall, "prefill": device["start"], "steps_seconds": device["advance"],
                       "steps": sum(r.steps for r in evaluator.counts.rollouts),
                       "host": wall - sum(device.values()), "tokens": tokens})
    best = min(rounds[1:], key=lambda r: r["wall"])
    return {**best, "first": rounds[0]["wall"], "per_step": best["steps_seconds"] / best["steps"]}


def kv_bytes_per_token(model: gpt.GPT) -> int:
    return 2 * model.n_layers * model.kv_heads * model.head_width * jnp.dtype(model.adtype).itemsize


def report_decoding(cfg: BenchConfig, rows: int, model: gpt.GPT, variables: Any, mesh: Any, hf: Any,
                    log: CompileLog) -> Dict[str, Any]:
    """Greedy decoding of `rows` random prompts of --prompt tokens, --new-tokens each: the
    evaluation's (harness_decoding), gpt.generate in one jitted call, transformers' generate,
    and the step's matmuls alone; per step, against the bytes a step must read (the
    parameters and the live KV cache, on average over the steps)."""
    rng = np.random.default_rng(cfg.seed + rows)
    prompts_BP = rng.integers(0, cfg.vocab - 1, (rows, cfg.prompt), dtype=np.int32)
    evaluator = evaluator_for(model, variables, IdTokenizer(cfg.vocab), mesh, [], rows)
    harness = harness_decoding(evaluator, prompts_BP.tolist(), cfg.new_tokens, cfg.reps, cfg.seed)
    simple = jax.jit(lambda v, p_BP, m_BP: gpt.generate(model, v, p_BP, m_BP, cfg.new_tokens))
    p_BP, m_BP = jnp.asarray(prompts_BP), jnp.ones(prompts_BP.shape, bool)
    contenders = {"simple": lambda: simple(variables, p_BP, m_BP), **decode_floors(variables, rows, cfg.seed)}
    if hf is not None:
        contenders.update(transformers=lambda: hf_generate(hf, prompts_BP, cfg.new_tokens),
                          transformers_prefill=lambda: hf_generate(hf, prompts_BP, 1))
    out = race(contenders, cfg.reps, log)
    ours, simple_tokens = harness.pop("tokens"), np.asarray(out["simple"].pop("out"))
    live = cfg.prompt + (cfg.new_tokens - 1) / 2  # cache slots a step reads, on average
    result = {"rows": rows, "harness": harness, "simple_per_step": (out["simple"]["best"] - harness["prefill"])
              / (cfg.new_tokens - 1), "simple_same_tokens": bool(np.array_equal(ours, simple_tokens)),
              "step_matmuls": out["step_matmuls"]["best"] / FLOOR_STEPS, "read_params": memory_floor(out),
              "step_bytes": nbytes(variables) + rows * live * kv_bytes_per_token(model)}
    if hf is not None:
        theirs = out["transformers"].pop("out")
        result.update(transformers_per_step=(out["transformers"]["best"] - out["transformers_prefill"]["best"])
                      / (cfg.new_tokens - 1), transformers_prefill=out["transformers_prefill"]["best"],
                      same_as_transformers=float((ours == theirs).all(-1).mean()))
    return result


def transformers_static(cfg: BenchConfig, hf: Any, rows: int) -> Dict[str, Any]:
    """transformers' generate with its static cache, which it compiles with torch.compile on
    a GPU: seconds per step less the prefill, after a warm-up that compiles."""
    prompts_BP = np.random.default_rng(cfg.seed + rows).integers(0, cfg.vocab - 1, (rows, cfg.prompt), dtype=np.int32)
    hf.generation_config.cache_implementation = "static"
    try:
        began = time.perf_counter()
        hf_generate(hf, prompts_BP, cfg.new_tokens)
        first = time.perf_counter() - began
        times = {n: min(timed_call(lambda: hf_generate(hf, prompts_BP, n)) for _ in range(cfg.reps))
                 for n in (1, cfg.new_tokens)}
    finally:
        hf.generation_config.cache_implementation = None
    return {"rows": rows, "first": first, "per_step": (times[cfg.new_tokens] - times[1]) / (cfg.new_tokens - 1)}


def timed_call(fn: Callable[[], Any]) -> float:
    began = time.perf_counter()
    fn()
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - began


def report_model(cfg: BenchConfig, name: str, write: Callable[[Any], None], say: Callable[[str], None],
                 log: CompileLog) -> None:
    """One model of REPORT_MODELS in --dtype, loaded by this project and by transformers on
    --device from one HuggingFace directory: scoring --batch x --seq tokens (bench_scoring,
    with this project's plain jitted forward beside), then decoding at each of
    --decode-batches, then transformers' compiled static cache at the middle one."""
    c = dataclasses.replace(cfg, **REPORT_MODELS[name])
    if torch is None:  # this project alone (a TPU machine): its own random weights, made on the mesh
        say(f"{name}: making the random model (no torch here: no transformers beside it)")
        model, mesh, hf = project_model(c), gpt.make_mesh(), None
        variables = gpt.init_params(model, mesh, seed=c.seed)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-report-") as path:
            say(f"{name}: making and loading the random model")
            save_hf_model(c, path)
            model, variables, mesh, hf = load_models(c, path)
    result = {"name": name, "shape": REPORT_MODELS[name], "params": gpt.count_params(variables),
              "param_bytes": nbytes(variables), "dtype": c.dtype, "seq": c.seq, "batch": c.batch,
              "prompt": c.prompt, "new_tokens": c.new_tokens, "decoding": [],
              "attention": {kind: gpt.backend_choice(kind) for kind in gpt.OTHER_BACKEND},
              "device": jax.devices()[0].device_kind}
    say(f"{name}: scoring {c.batch} x {c.seq}")
    rows = max(1, min(c.batch, (1 << 30) // (c.seq * c.vocab * 4)))  # float32 logits of at most 1 GiB at once
    rows = math.gcd(rows, c.batch)

    def forward(v, x_BT, y_BT):  # `rows` rows at a time
        nll = lambda xy: gpt.token_nll(model.apply(v, xy[0])[0], xy[1]).sum(-1)
        split = lambda z_BT: z_BT.reshape(-1, rows, z_BT.shape[1])
        return -jax.lax.map(nll, (split(x_BT), split(y_BT))).reshape(-1)
    forward = jax.jit(forward)
    result["scoring"] = strip_outputs(bench_scoring(c, model, variables, mesh, hf, log, {"forward": forward}))
    write(result)
    batches = [int(b) for b in c.decode_batches.split(",")]
    for rows in batches:
        say(f"{name}: decoding {rows} rows")
        result["decoding"].append(report_decoding(c, rows, model, variables, mesh, hf, log))
        write(result)
    if hf is not None and c.device == "cuda":
        rows = batches[len(batches) // 2]
        say(f"{name}: transformers' static cache, compiled, {rows} rows")
        result["transformers_static"] = transformers_static(c, hf, rows)
        write(result)


def strip_outputs(x: Any) -> Any:
    """A result without the arrays race() keeps (JSON holds the numbers)."""
    if isinstance(x, dict):
        return {k: strip_outputs(v) for k, v in x.items() if k != "out"}
    return x


def report_shapes(cfg: BenchConfig, write: Callable[[Any], None], say: Callable[[str], None]) -> None:
    """The --shapes workloads on the Llama of --layers, --width, ... in --dtype, lm-eval's
    HF model on --device beside this project's command line, each written as it ends."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-report-shapes-"))
    built, result = build_shapes(cfg, workdir, say), {"workloads": {}}
    result["built"] = built
    for name in cfg.workloads.split(","):
        say(f"shapes: {name}")
        try:
            result["workloads"][name] = shape_workload(cfg, built, name, workdir / "runs" / name, say)
        except Exception as e:  # the next workload still runs
            result["workloads"][name] = {"error": f"{type(e).__name__}: {str(e)[-500:]}"}
        write(result)
    shutil.rmtree(workdir, ignore_errors=True)


def gpu_report_table(cfg: BenchConfig, r: Dict[str, Any]) -> str:
    g = r["gpu_report"]
    device, ceiling = g.get("device"), g.get("ceilings")
    kinds = [g[p].get("device") for p in REPORT_MODELS if isinstance(g.get(p), dict)]  # without the device part
    nominal = NOMINAL.get(device["name"] if device else next(filter(None, kinds), ""))
    peak = nominal[0] if nominal and cfg.dtype == "bfloat16" else ceiling and ceiling["gemm"]["flops_per_s"]
    memory = nominal[1] if nominal else ceiling and ceiling["copy_bytes_per_s"]
    lines = []
    if device:
        lines.append(f"device: {device['nvidia_smi'] or device['name']} (jax backend {device['backend']}, "
                     f"{len(device['devices'])} device(s)); " + ", ".join(f"{k} {v}" for k, v in device["versions"].items()))
        lines.append(f"nominal: {nominal[0] / 1e12:.0f} TFLOP/s dense bf16, {nominal[1] / 1e12:.1f} TB/s" if nominal
                     else "nominal: none known for this device; fractions below are of the measured ceilings")
    if ceiling:
        lines.append(f"measured: GEMM {ceiling['gemm']['flops_per_s'] / 1e12:.1f} TFLOP/s {ceiling['dtype']} "
                     f"({ceiling['gemm']['size']}^3 jitted; " + ", ".join(
                         f"{n}: {f / 1e12:.1f}" for n, f in ceiling["gemm_by_size"].items())
                     + f"), copy {ceiling['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + written)"
                     + (f"; torch: copy {ceiling['torch_copy_bytes_per_s'] / 1e12:.2f} TB/s, a sum reads "
                        f"{ceiling['torch_read_bytes_per_s'] / 1e12:.2f} TB/s" if "torch_copy_bytes_per_s" in ceiling
                        else ""))
    if "parity" in g:
        lines += ["", f"answers here against the CPU's (the fixture: {len(g['parity'])} runs of evaluate.py, "
                  "4 kinds of --data)"]
        for name, p in g["parity"].items():
            lines.append(f"  {name:16s} {p['log_likelihoods']} log-likelihoods within {p['max_rel']:.1e} relative; "
                         f"identical: generations {p['generations'][0]}/{p['generations'][1]}, choices "
                         f"{p['choices'][0]}/{p['choices'][1]}, next-token counts {p['next_tokens'][0]}/"
                         f"{p['next_tokens'][1]}  ({p['seconds']:.0f} s)")
    for name in REPORT_MODELS:
        if name in g:
            lines += ["", *model_report_table(g[name], peak, ceiling, memory)]
    if "runs" in g:
        lines += ["", *runs_report_table(g["runs"])]
    if "shapes" in g:
        lines += ["", *shapes_report_table(cfg, g["shapes"])]
    lines += ["", "parts: " + ", ".join(f"{p} {x['status']} ({x['seconds']:.0f} s)" for p, x in g["parts"].items()),
              f"bench ran {r['seconds']:.0f} s"]
    return "\n".join(lines)


def model_report_table(m: Dict[str, Any], peak: float, ceiling: Optional[Dict[str, Any]], memory: float) -> List[str]:
    s, shape = m.get("scoring"), m["shape"]
    lines = [f"{m['name']}: {shape['family']}, {shape['layers']} layers, {shape['width']} wide, {shape['heads']} heads "
             f"({shape['kv_heads']} kv), MLP {shape['mlp_hidden']}, vocab {shape['vocab']}, "
             f"{m['params'] / 1e6:.0f}M parameters, {m['dtype']} ({m['param_bytes'] / 1e9:.2f} GB), random weights",
             "  attention (gpt.BACKEND_ATTENTION): " + ", ".join(f"{k} {v}" for k, v in m.get("attention", {}).items())]
    if s:
        gemm = ceiling["gemm"]["flops_per_s"] if ceiling else s["peak"]["flops_per_s"]
        peak = peak or gemm
        lines += [f"  scoring {m['batch']} x {m['seq']} tokens ({s['flops'] / 1e12:.2f} TFLOP forward), best of the rounds:",
                  f"    {'':36s} {'s':>7s} {'TFLOP/s':>8s} {'of peak':>8s} {'of GEMM':>8s} {'vs hf':>6s}"]
        names = {"project": "the evaluation (PerplexityEvaluation)", "forward": "its jitted forward alone",
                 "transformers": "transformers (sdpa)"}
        hf = s["transformers"]["best"] if "transformers" in s else float("nan")
        for key, label in names.items():
            if key in s:
                x = s[key]
                lines.append(f"    {label:36s} {x['best']:7.4f} {x['flops_per_s'] / 1e12:8.1f} "
                             f"{x['flops_per_s'] / peak:8.1%} {x['flops_per_s'] / gemm:8.1%} {hf / x['best']:6.2f}")
        lines.append(f"    summed log-likelihoods within {max(s['project']['rel_diff'], s['forward']['rel_diff']):.1e} "
                     + ("of transformers'" if "transformers" in s else "of the evaluation's (no transformers here)"))
    if m["decoding"]:
        lines += [f"  greedy decoding, {m['prompt']}-token prompts, {m['new_tokens']} new tokens; ms per step "
                  "(less the prefill):",
                  f"    {'rows':>4s} {'ours':>7s} {'host':>6s} {'simple':>7s} {'hf':>7s} {'matmuls':>8s} {'bound':>7s} "
                  f"{'of bound':>8s} {'vs hf':>6s}  same tokens as hf"]
        for d in m["decoding"]:
            h, bound = d["harness"], d["step_bytes"] / (memory or d["step_bytes"] / d["read_params"])
            hf = d.get("transformers_per_step", float("nan"))
            lines.append(f"    {d['rows']:4d} {h['per_step'] * 1e3:7.3f} {h['host'] / h['steps'] * 1e3:6.3f} "
                         f"{d['simple_per_step'] * 1e3:7.3f} {hf * 1e3:7.3f} {d['step_matmuls'] * 1e3:8.3f} "
                         f"{bound * 1e3:7.3f} {bound / h['per_step']:8.1%} {hf / h['per_step']:6.2f}  "
                         f"{d.get('same_as_transformers', float('nan')):.0%}")
        lines += ["    ours: the evaluation's decoding steps (device time of its segments, per step); host: its "
                  "time between them, per step; simple: gpt.generate in one jitted call",
                  "    bound: the parameters and the live KV cache read once at the nominal bandwidth "
                  "(else the measured copy's)"]
    if "transformers_static" in m:
        t = m["transformers_static"]
        lines.append(f"  transformers, static cache compiled, {t['rows']} rows: {t['per_step'] * 1e3:.3f} ms per step "
                     f"(first call {t['first']:.0f} s)")
    return lines


def shapes_report_table(cfg: BenchConfig, s: Dict[str, Any]) -> List[str]:
    b = s["built"]
    lines = [f"benchmark shapes (--shapes' tasks): llama, {cfg.layers} layers, {cfg.width} wide, {cfg.heads} heads "
             f"({cfg.kv_heads or cfg.heads} kv), {b['params'] / 1e6:.0f}M parameters, vocab {b['vocab']}, "
             f"{cfg.dtype}; lm-eval's HF model on {cfg.device}; whole processes, batch {cfg.batch}",
             f"  {'workload':10s} {'lm-eval s':>9s} {'ours s':>7s} {'ratio':>6s} {'2nd s':>6s} {'ratio':>6s}  agreement"]
    for name, w in s["workloads"].items():
        if "error" in w:
            lines.append(f"  {name:10s} {w['error']}")
            continue
        lines.append(f"  {name:10s} {w['hf_seconds']:9.1f} {w['our_seconds']:7.1f} {w['hf_seconds'] / w['our_seconds']:5.2f}x "
                     f"{w['second_seconds']:6.1f} {w['hf_seconds'] / w['second_seconds']:5.2f}x  log-likelihoods within "
                     f"{w['max_rel']:.1e}, {w['identical']}/{w['compared']} answers identical, scores within "
                     f"{w['scores_rel']:.1e}")
    return lines


# ----------------------------------------------------------------------------- compiling for a target (--compile-for)


TOPOLOGIES = {"v5e": "v5e:1x1"}  # --compile-for's TPUs, by libtpu's topology names


def target_mesh(target: str) -> Any:
    """A one-device mesh of the target: this machine's CPU, or a TPU that libtpu's
    topology describes (its ahead-of-time compiler builds programs for it; no TPU needed)."""
    if target == "cpu":
        return gpt.make_mesh(1, 1, devices=jax.devices("cpu")[:1])
    if target not in TOPOLOGIES:
        raise UsageError(f"--compile-for: unknown target {target!r}; choose from cpu, {', '.join(TOPOLOGIES)}")
    try:
        topology = topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[target],
                                                chip_config_name="default", chips_per_host_bounds=(1, 1, 1),
                                                num_slices=1)
    except Exception as e:  # no libtpu, or one that does not know the target
        raise UsageError(f"--compile-for {target}: no TPU compiler here ({str(e).splitlines()[0][:120]}); "
                         "pip install libtpu") from None
    return gpt.make_mesh(1, 1, devices=list(topology.devices)[:1])


@contextlib.contextmanager
def platform_of(mesh: Any):
    """jax.default_backend() reads as the mesh's platform while its programs are traced, so
    the model takes the target's ways (gpt.BACKEND_ATTENTION's row, splash compiled, not
    interpreted), not this machine's."""
    platform, backend = mesh.devices.flat[0].platform, jax.default_backend
    jax.default_backend = lambda: platform
    try:
        yield
    finally:
        jax.default_backend = backend


def on_mesh(mesh: Any, shape: Tuple[int, ...], dtype: Any, *spec: Optional[str]) -> jax.ShapeDtypeStruct:
    """An argument's shape and dtype, placed on the mesh as `spec` says (none: replicated)."""
    placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=placed)


def cache_copies(text: str, cache_shape: Tuple[int, ...]) -> int:
    """Copies, in a compiled program's text, of the KV cache or of one layer's slots of it."""
    L, *rest = cache_shape
    shapes = [",".join(map(str, s)) for s in ((L, *rest), (1, *rest), tuple(rest))]
    return len(re.findall(r"= \w+\[(?:%s)\]\S* copy(?:-start)?\(" % "|".join(shapes), text))


def compile_programs(cfg: BenchConfig, say: Callable[[str], None]) -> Dict[str, Any]:
    """The evaluation's programs built for --compile-for's target, none run: a scoring block
    of --batch rows of --seq tokens, every position scored (packed rows, and plain ones), and
    a rollout of --batch prompts of --prompt tokens decoding --new-tokens (start, advance,
    refill), for --runs-model's shape in --dtype: each one's compile seconds, and the copies
    of the KV cache each leaves in (0 where it reads and writes the cache in place)."""
    c = dataclasses.replace(cfg, **REPORT_MODELS[cfg.runs_model])
    mesh, model = target_mesh(cfg.compile_for), project_model(c)
    variables = jax.eval_shape(lambda: gpt.init_params(model, mesh))  # shapes and shardings, nothing made
    job = inference.InferenceJob(model, variables, IdTokenizer(c.vocab), mesh, batch_size=c.batch, quiet=True)
    B, T, P = c.batch, c.seq, c.prompt
    ints = lambda *shape: on_mesh(mesh, shape, jnp.int32)
    block = (ints(1, B, T), ints(1, 1, B * T), ints(1, 1, B * T), ints(1))
    start, advance, refill = job._generator(c.new_tokens, 0.0, 1.0)
    prompts = (on_mesh(mesh, (B, P), jnp.int32, "batch"), on_mesh(mesh, (B, P), bool, "batch"))
    with platform_of(mesh), jax.set_mesh(mesh):
        rollout = jax.eval_shape(lambda v, p, m: fast.start_rollout(model, v, p, m, c.new_tokens), variables, *prompts)
        rollout = jax.tree.map(lambda x: on_mesh(mesh, x.shape, x.dtype), rollout)
        programs = {"score, packed": (job._score, (variables, block[0], (block[0],) * 4, *block[1:])),
                    "score": (job._score, (variables, block[0], None, *block[1:])),
                    "start": (start, (variables, *prompts, ints(B), 0, None)),
                    "advance": (advance, (variables, rollout, on_mesh(mesh, (B,), bool), ints(B), 0)),
                    "refill": (refill, (variables, rollout, ints(), ints(1, P), on_mesh(mesh, (1, P), bool),
                                        ints(1), 0))}
        result: Dict[str, Any] = {"target": cfg.compile_for, "device": str(mesh.devices.flat[0].device_kind),
                                  "model": cfg.runs_model, "dtype": c.dtype, "programs": {}}
        for name, (fn, args) in programs.items():
            say(f"compiling {name} for {cfg.compile_for}")
            lowered = fn.lower(*args)
            began = time.perf_counter()
            text = lowered.compile().as_text()
            result["programs"][name] = {"compile_s": time.perf_counter() - began,
                                        "cache_copies": cache_copies(text, rollout.cache.keys.shape)}
    return result


def compile_table(cfg: BenchConfig, r: Dict[str, Any]) -> str:
    c = r["compile"]
    lines = [f"programs compiled for {c['target']} ({c['device']}), none run: {c['model']}'s shape in {c['dtype']}, "
             f"{cfg.batch} rows, {cfg.seq} tokens scored, {cfg.prompt} prompt + {cfg.new_tokens} new",
             f"{'program':16s} {'compile s':>10s} {'KV cache copies':>16s}"]
    lines += [f"{name:16s} {p['compile_s']:10.2f} {p['cache_copies']:16d}" for name, p in c["programs"].items()]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- loading

# Run in a fresh process, so that its peak memory is the load's: the command line's imports
# (not torch), then the load onto a mesh of every device (blocked until placed), then what
# it measured as one JSON line.
LOAD_SIDE = """
import json, sys, time
import jax
import checkpoints, gpt, jobs
from hf import load_backbone
jobs.leave_torch_unloaded()

def rss(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

path, dtype = sys.argv[1], sys.argv[2]
mesh, before, start, cpu = gpt.make_mesh(), rss("VmRSS"), time.perf_counter(), time.process_time()
if checkpoints.Node(path).is_native:
    _, variables, _ = checkpoints.load_checkpoint(path, mesh, dtype)
else:
    _, variables = load_backbone(path, dtype, mesh)
jax.block_until_ready(variables)
seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
placed = sum(s.data.nbytes for x in jax.tree.leaves(variables) for s in x.addressable_shards)
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "rss_before": before, "peak_rss": rss("VmHWM"), "placed": placed,
                  "read": checkpoints.TensorFiles.bytes_read, "devices": len(jax.local_devices())}))
"""


# `python evaluate.py --ckpt DIR --dtype D --data ppl:FILE` in this process, then its peak
# memory: loading and a forward pass, as a user runs it (torch left unloaded, as there)
EVALUATE_SIDE = """
import json, sys
import evaluate, jobs
jobs.leave_torch_unloaded()

status = evaluate.main(sys.argv[1:])
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
print(json.dumps({"peak_rss": peak}))
sys.exit(status)
"""


def weight_files(path: str) -> List[Path]:
    files = sorted(p for p in Path(path).iterdir() if p.name.endswith(".safetensors"))
    if not files:
        raise UsageError(f"--load {path}: no *.safetensors files")
    return files


def largest_tensor(files: List[Path]) -> int:
    """Bytes of the largest tensor the files hold, from their headers."""
    largest = 0
    for file in files:
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                item = np.dtype(SAFETENSORS_DTYPES[tensor.get_dtype()]).itemsize
                largest = max(largest, item * int(np.prod(tensor.get_shape())))
    return largest


def timed_cat(files: List[Path]) -> Tuple[float, float]:
    """(wall seconds, CPU seconds) of `cat FILES > /dev/null`."""
    children, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter() - start, after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime


def bench_load(cfg: BenchConfig, say: Callable[[str], None]) -> Dict[str, Any]:
    """Reading the weight files once (`cat`, run once before to fill the page cache, which
    the load then reads too), against loading the checkpoint onto the mesh in a fresh
    process, --reps times in turn; wall and CPU seconds (on a busy machine the CPU time is
    the steadier), and the load's peak memory."""
    files = weight_files(cfg.load)
    out: Dict[str, Any] = {"file_bytes": sum(f.stat().st_size for f in files), "largest": largest_tensor(files),
                           "cat": [], "loads": []}
    say(f"--load {cfg.load}: {out['file_bytes'] / 2**30:.2f} GiB in {len(files)} files; cat once to warm the cache")
    timed_cat(files)
    for rep in range(cfg.reps):
        out["cat"].append(timed_cat(files))
        say(f"round {rep + 1}: cat {out['cat'][-1][0]:.2f} s; loading")
        proc = subprocess.run([sys.executable, "-c", LOAD_SIDE, cfg.load, cfg.dtype], capture_output=True,
                              text=True, cwd=Path(__file__).resolve().parent)
        if proc.returncode:
            raise UsageError(f"--load {cfg.load}: loading failed: {proc.stderr.strip().splitlines()[-1]}")
        out["loads"].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    out["evaluate"] = evaluate_peak(cfg)
    return out


def evaluate_peak(cfg: BenchConfig) -> Dict[str, Any]:
    """Peak memory and wall seconds of evaluate.py on a four-line perplexity file (loading
    the checkpoint, compiling, one forward pass), in a fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "four.jsonl"
        data.write_text("".join(json.dumps({"text": t}) + "\n" for t in
                                ("the cat sees the dog.", "a small red bird.", "the old king likes the farmer.",
                                 "two birds sing.")))
        argv = ["--ckpt", cfg.load, "--dtype", cfg.dtype, "--data", f"ppl:{data}", "--out", f"{tmp}/out", "--quiet",
                "--no-compile-cache"]
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", EVALUATE_SIDE, *argv], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent)
        seconds = time.perf_counter() - start
    if proc.returncode:
        raise UsageError(f"--load {cfg.load}: evaluate.py failed: {(proc.stderr.strip() or '?').splitlines()[-1]}")
    return {"seconds": seconds, **json.loads(proc.stdout.strip().splitlines()[-1])}


def load_table(cfg: BenchConfig, r: Dict[str, Any]) -> str:
    b, best = r["loading"], min(r["loading"]["loads"], key=lambda x: x["seconds"])
    gib, (cat, cat_cpu) = 2**30, min(b["cat"])
    load_cpu = min(x["cpu_seconds"] for x in b["loads"])
    peak = max(x["peak_rss"] for x in b["loads"])
    lines = [f"checkpoint: {cfg.load}, {b['file_bytes'] / gib:.2f} GiB of safetensors, largest tensor "
             f"{b['largest'] / 2**20:.0f} MiB; loaded in {cfg.dtype} onto {best['devices']} device(s)",
             f"machine: {os.cpu_count()} CPUs (load average {r['load'][0]:.1f} -> {r['load'][1]:.1f}); "
             f"best of {len(b['cat'])} rounds",
             f"  {'':28s} {'wall s':>7s} {'GiB/s':>6s} {'CPU s':>6s}",
             f"  {'cat > /dev/null (page cache)':28s} {cat:7.2f} {b['file_bytes'] / gib / cat:6.2f} {cat_cpu:6.2f}",
             f"  {'load onto the mesh':28s} {best['seconds']:7.2f} {b['file_bytes'] / gib / best['seconds']:6.2f} "
             f"{load_cpu:6.2f}  ({cat / best['seconds']:.2f} of cat's speed)",
             f"  bytes read {best['read'] / gib:.2f} GiB, placed {best['placed'] / gib:.2f} GiB",
             f"  peak RSS {peak / gib:.2f} GiB: {best['rss_before'] / gib:.2f} before loading (jax, transformers), "
             f"so {(peak - best['rss_before']) / gib:.2f} GiB for the load, against placed + largest tensor "
             f"{(best['placed'] + b['largest']) / gib:.2f} GiB",
             f"  evaluate.py on four lines of text: peak RSS {b['evaluate']['peak_rss'] / gib:.2f} GiB, "
             f"{b['evaluate']['seconds']:.1f} s (loading, compiling, one forward pass)"]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- report


def row(name: str, x: Dict[str, Any], width: int = 14) -> str:
    """name, first-call s, compile s (none for eager torch), best s, median s."""
    compile_s = "-" if name.startswith("transformers") else f"{x['compile']:.2f}"
    return f"  {name:{width}s} {x['first']:8.2f} {compile_s:>8s} {x['best']:7.2f} {x['median']:7.2f}"


def scoring_table(cfg: BenchConfig, s: Dict[str, Any]) -> List[str]:
    peak = s["peak"]["flops_per_s"]
    lines = [f"matmul peak: {peak / 1e9:.1f} GFLOP/s {cfg.dtype} "
             f"(jitted {s['peak']['size']}^2, raced with scoring)",
             "", f"scoring {cfg.batch} x {cfg.seq} tokens, forward + log-softmax gather "
             f"({s['flops'] / 1e9:.1f} GFLOP per call, forward only)",
             f"  {'':14s} {'first s':>8s} {'compile':>8s} {'best s':>7s} {'median':>7s} {'tokens/s':>9s} "
             f"{'GFLOP/s':>8s} {'MFU':>6s} {'vs hf':>6s} {'vs bare':>8s}"]
    hf = s["transformers"]["tokens_per_s"]
    for name in [n for n in ("project", "transformers", "bare_jax") if n in s]:
        x = s[name]
        lines.append(f"{row(name, x)} {x['tokens_per_s']:9.0f} {x['flops_per_s'] / 1e9:8.1f} "
                     f"{x['flops_per_s'] / peak:6.1%} {x['tokens_per_s'] / hf:6.2f}"
                     + (f" {x['tokens_per_s'] / s['bare_jax']['tokens_per_s']:8.2f}" if "bare_jax" in s else ""))
    lines.append(f"  summed log-likelihood {s['transformers']['loglik']:.2f}; relative difference to "
                 f"transformers: project {s['project']['rel_diff']:.1e}"
                 + (f", bare jax {s['bare_jax']['rel_diff']:.1e}" if "bare_jax" in s else ""))
    return lines


def generation_table(cfg: BenchConfig, g: Dict[str, Any]) -> List[str]:
    lines = [f"greedy generation, KV cache: {cfg.batch} prompts x {cfg.prompt} tokens, {cfg.new_tokens} new",
             f"  {'':14s} {'first s':>8s} {'compile':>8s} {'best s':>7s} {'median':>7s} {'new tok/s':>9s} "
             f"{'vs hf':>8s}"]
    for name in ("project", "transformers"):
        x = g[name]
        lines.append(f"{row(name, x)} {x['tokens_per_s']:9.1f} "
                     f"{x['tokens_per_s'] / g['transformers']['tokens_per_s']:8.2f}")
    c = g["check"]
    same = "yes" if c["identical"] else f"NO, first at {c['first_diff']}, gap there {c['gap_at_diff']:.2g}"
    lines.append(f"  tokens identical: {same}; smallest top1-top2 logit gap {c['min_gap']:.2g}")
    p, t, f, gb = g["project"], g["transformers"], g["floors"], g["param_bytes"] / 1e9
    lines += [f"  per step, less the prefill: project {p['per_step'] * 1e3:.1f} ms, transformers "
              f"{t['per_step'] * 1e3:.1f} ms (prefill {p['prefill']:.2f} s and {t['prefill']:.2f} s)",
              f"  floors under a step of {cfg.batch} rows: its matmuls alone {f['step_matmuls'] * 1e3:.1f} ms "
              f"(weights at {gb / f['step_matmuls']:.1f} GB/s), reading the parameters once "
              f"{f['read_params'] * 1e3:.1f} ms ({gb / f['read_params']:.1f} GB/s)"]
    return lines


def ragged_table(cfg: BenchConfig, r: Dict[str, Any]) -> List[str]:
    share = r["real_share"]
    lines = [f"ragged data: {r['docs']} documents of {max(1, cfg.seq // 4)}-{cfg.seq} tokens ({r['tokens']} in all) "
             f"scored; {r['prompts']} prompts of {max(1, cfg.prompt // 2)}-{cfg.prompt * 3 // 2} tokens, "
             f"{cfg.new_tokens} new each; batches of {cfg.batch}",
             f"  {'':24s} {'first s':>8s} {'compile':>8s} {'best s':>7s} {'median':>7s} {'tokens/s':>9s} {'vs hf':>6s}"]
    for name in ("scoring", "generation"):
        for who in ("project", "transformers"):
            x, hf = r[f"{who}_{name}"], r[f"transformers_{name}"]
            lines.append(f"{row(f'{who} {name}', x, width=24)} {x['tokens_per_s']:9.1f} "
                         f"{x['tokens_per_s'] / hf['tokens_per_s']:6.2f}")
    lines += [f"  real tokens in the slots computed: project {share['project_scoring']:.1%} "
              f"({r['blocks']} blocks, {r['shapes']} shapes), transformers loop {share['transformers_scoring']:.1%}; "
              f"project prefill {share['project_prefill']:.1%}",
              f"  per-document log-likelihood: max relative difference {r['rel_diff']:.1e}; "
              f"generations identical for {r['identical']:.0%} of the prompts"]
    return lines


def program_counts(names: List[str]) -> str:
    """Compiled programs by name, in order of first compilation: "jit(run) x2, ..."."""
    counts: Dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{name} x{n}" for name, n in counts.items()) or "none"


def compilation_table(runs: List[Dict[str, Any]]) -> List[str]:
    lines = ["compilation: the built-in suite on the default tiny GPT, twice on one Evaluator",
             f"  {'evaluation':16s} {'run':>3s} {'compiles':>8s} {'compile s':>9s} {'run s':>7s}  compiled"]
    for number, run in enumerate(runs, 1):
        for name, x in run.items():
            lines.append(f"  {name + ' (' + x['kind'] + ')':16s} {number:3d} {x['compiles']:8d} "
                         f"{x['seconds']:9.2f} {x['wall'] - x['seconds']:7.2f}  {', '.join(x['names'])}")
    return lines


def table(cfg: BenchConfig, r: Dict[str, Any]) -> str:
    lines = [f"model: {cfg.family}, {cfg.layers} layers, {cfg.width} wide, {cfg.heads} heads, vocab {cfg.vocab}, "
             f"context {cfg.context}, {r['params'] / 1e6:.1f}M parameters, {cfg.dtype}, "
             f"random weights (std {cfg.init_std})",
             f"machine: {r['cpus']} CPUs (load average {r['load'][0]:.1f} -> {r['load'][1]:.1f}); "
             f"jax {jax.__version__}, torch {r['torch']} ({r['torch_threads']} threads), "
             f"transformers {r['transformers']} (attention: {r['hf_attention']})",
             *scoring_table(cfg, r["scoring"]), "", *generation_table(cfg, r["generation"]), "",
             *ragged_table(cfg, r["ragged"]), "", *compilation_table(r["compilation"]["runs"])]
    if max(r["load"]) > r["cpus"]:
        lines += ["", f"note: the machine was busy (load average up to {max(r['load']):.1f} on {r['cpus']} "
                  "CPUs): numbers are noisy, transformers' most (its threads wait on each other; "
                  "compare --torch-threads 1)"]
    lines.append(f"\nbench ran {r['seconds']:.0f} s")
    return "\n".join(lines)


def against_transformers(cfg: BenchConfig, log: CompileLog, say: Callable[[str], None]) -> Dict[str, Any]:
    """The default run: compile counts, then scoring and generation beside transformers."""
    if torch is None:
        raise UsageError("the side-by-side run needs torch (pip install torch==2.13.0); --limits does not")
    transformers.utils.logging.disable_progress_bar()
    results: Dict[str, Any] = {"cpus": os.cpu_count(), "torch": torch.__version__,
                               "transformers": transformers.__version__}
    say("compilation: the built-in suite on the default tiny GPT, twice")
    results["compilation"] = compile_counts(log)
    say("making the random GPT-2 and loading it into the project and transformers")
    with tempfile.TemporaryDirectory(prefix="bench-gpt2-") as path:
        save_hf_model(cfg, path)
        model, variables, mesh, hf = load_models(cfg, path)
    results.update(params=gpt.count_params(variables), hf_attention=hf.config._attn_implementation,
                   torch_threads=torch.get_num_threads())
    say(f"scoring, raced with the matmul peak: warm-up + {cfg.reps} rounds")
    results["scoring"] = bench_scoring(cfg, model, variables, mesh, hf, log)
    say(f"generation: warm-up + {cfg.reps} rounds")
    results["generation"] = bench_generation(cfg, model, variables, mesh, hf, log)
    say(f"ragged data, scoring and generation: warm-up + {cfg.reps} rounds")
    results["ragged"] = bench_ragged(cfg, model, variables, mesh, hf, log)
    return results


def measured_on() -> str:
    """The date and the commit a table is measured on, the commit marked "+changes" where
    the working tree's tracked files differ from it (a table of uncommitted code)."""
    here = Path(__file__).resolve().parent
    git = lambda *args: subprocess.run(["git", *args], capture_output=True, text=True, cwd=here).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") or "unknown (not a git checkout)"
    changed = git("status", "--porcelain", "--untracked-files=no")
    return f"{time.strftime('%Y-%m-%d')}, commit {commit}{'+changes' if changed else ''}"


def bench(argv: List[str]) -> None:
    cfg = parse_options(BenchConfig, argv)
    if cfg.family not in ("gpt2", "qwen2", "llama"):
        raise UsageError(f"--family must be gpt2, qwen2 or llama, got {cfg.family!r}")
    if cfg.dtype not in gpt.DTYPES:
        raise UsageError(f"--dtype: unknown dtype {cfg.dtype!r}; choose one of {', '.join(gpt.DTYPES)}")
    started = time.perf_counter()
    say = lambda text: print(f"[{time.perf_counter() - started:5.0f} s] {text}", file=sys.stderr, flush=True)
    say(f"bench {dataclasses.asdict(cfg)}")
    log = compile_log()
    results: Dict[str, Any] = {"config": dataclasses.asdict(cfg), "load": [os.getloadavg()[0]],
                               "measured_on": measured_on()}
    if cfg.report_part:
        return report_part(cfg, say)
    if cfg.limits:
        say(f"limits: scoring, batch-1 decoding, matmul peak and memory read: warm-up + {cfg.reps} rounds")
        results["limits"] = bench_limits(cfg, log)
    elif cfg.shapes:
        results["shapes"] = bench_shapes(cfg, say)
    elif cfg.load:
        results["loading"] = bench_load(cfg, say)
    elif cfg.make_fixture:
        results["fixture"] = make_fixture(cfg, say)
    elif cfg.gpu_report:
        results["gpu_report"] = gpu_report(cfg, argv, say)
    elif cfg.compile_for:
        results["compile"] = compile_programs(cfg, say)
    else:
        results.update(against_transformers(cfg, log, say))
    results["seconds"] = time.perf_counter() - started
    results["load"].append(os.getloadavg()[0])  # other processes' load makes every number noisy
    if cfg.json:
        print(json.dumps(results, indent=2))
    else:
        report = limits_table if cfg.limits else shapes_table if cfg.shapes else load_table if cfg.load else \
            gpu_report_table if cfg.gpu_report else (lambda cfg, r: json.dumps(r["fixture"])) if cfg.make_fixture \
            else compile_table if cfg.compile_for else table
        print(f"measured on {results['measured_on']}\n{report(cfg, results)}")


if __name__ == "__main__":
    sys.exit(exit_status(lambda: bench(sys.argv[1:])))
