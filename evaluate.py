"""The evaluation harness: perplexity, multiple choice, generation, next-token accuracy.

    python evaluate.py                                   # fresh default GPT on the built-in suite (CPU, <1 min)
    python evaluate.py --ckpt runs/train                 # a native checkpoint (python train.py)
    python evaluate.py --ckpt DIR --data ppl:wiki.jsonl  # a HuggingFace model directory on your own data
    python evaluate.py --ckpt DIR --tasks hellaswag      # an lm-evaluation-harness task (pip install lm-eval)

Reading order: options -> datasets (JSONL checked line by line, and the built-in ones)
-> Evaluation (the seed's ABC) and its four kinds -> InferenceJob (requests in fixed-shape
blocks, one jitted lax.scan per block, the KV-cache rollout) -> the lm-eval backend (JaxLM:
lm-evaluation-harness's model interface over InferenceJob) -> fingerprint and resume
(what a run computed; the evaluations an interrupted run finished) -> Evaluator, Evaluate,
BackboneEvaluate -> the command line. HuggingFace directories are read by hf.py.

Every score comes from requests, named as lm-evaluation-harness names them:
- loglikelihood: the log-probability of a continuation given a context (token ids);
  multiple choice makes one request per choice;
- loglikelihood_rolling: a whole document scored token by token in windows of the
  context length; perplexity and next-token accuracy;
- generate_until: new tokens after a prompt until EOS, a stop string or the limit.
Each request carries the index of its document, and results are regrouped by it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import itertools
import json
import logging
import math
import os
import re
import sys
import time
from abc import ABC, abstractmethod
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import jinja2
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

import gpt
from hf import export_gpt2, load_backbone  # noqa: F401  (load_backbone: part of the seed API here)
from jobs import (MAX_SEED, ByteTokenizer, ExecutionSpec, HFTokenizer, Node, UsageError, available_memory,
                  builtin_items, checkpoint_files, exit_status, file_digest, gigabytes, is_eval_item,
                  job, load_checkpoint, load_tokenizer, model_config, open_regular, option, parse_options,
                  read_json, short, to_host)

try:  # lm-evaluation-harness is optional: only --tasks needs it (these parts load in a fraction of a second)
    import lm_eval
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import handle_non_serializable, hash_string, make_table, sanitize_list, sanitize_model_name
except ImportError:
    lm_eval = None
    TemplateLM = object  # JaxLM below still defines; --tasks refuses to start without lm-eval

LM_EVAL = "lm-eval==0.4.13"  # the version the lm-eval backend is tested with


@dataclasses.dataclass
class EvaluatorConfig:
    """Options of `python evaluate.py` (the jobs gpt/evaluate and backbone/evaluate)."""

    ckpt: Optional[str] = option(None, "checkpoint directory: native (python train.py) or HuggingFace; "
                                       "none: fresh default GPT weights")
    evals: Optional[str] = option(None, "comma-separated built-in evaluations (text, grammar, addition, "
                                        "repeat); default: all of them without --data or --tasks")
    data: List[str] = option([], "KIND:FILE, a JSONL dataset of kind ppl, mc, gen or acc (repeatable)")
    out: str = option("runs/eval", "output directory for results.json (and samples.jsonl, lm_eval/)")
    batch_size: int = option(8, "sequences per forward pass, rounded up to a multiple of the data-parallel size")
    mesh: Optional[str] = option(None, "device mesh BATCHxSHARD (default: every device on batch)")
    limit: Optional[int] = option(None, "evaluate only the first N samples of each evaluation and lm-eval task")
    max_new_tokens: Optional[int] = option(None, "generation length (default: each evaluation's own; "
                                                 "an lm-eval task's max_gen_toks, else 256)")
    temperature: float = option(0.0, "sampling temperature for generation (0: greedy)")
    top_p: float = option(1.0, "nucleus sampling: keep the smallest set of tokens with this much probability")
    stop: List[str] = option(["\n"], "stop string of --data gen files (repeatable; \\n and \\t as escapes; "
                                     "'' for none); a line's own \"until\" list wins")
    tasks: Optional[str] = option(None, "comma-separated lm-evaluation-harness tasks (needs " + LM_EVAL + ")")
    num_fewshot: Optional[int] = option(None, "few-shot examples per lm-eval task (default: each task's own)")
    fewshot_seed: int = option(1234, "seed of lm-eval's choice of few-shot examples (lm-eval's default)")
    apply_chat_template: bool = option(False, "lm-eval tasks as chat turns through the tokenizer's chat "
                                              "template (few-shot examples as turns)")
    include_path: Optional[str] = option(None, "directory of extra lm-eval task YAML files (local tasks)")
    bootstrap_iters: int = option(100000, "resamples for lm-eval's bootstrap stderrs (perplexities; "
                                          "lm-eval's default); 0: none")
    seed: int = option(0, "fresh weights and sampling")
    log_samples: bool = option(False, "also write samples.jsonl, one line per sample (and lm-eval's samples files)")
    force: bool = option(False, "redo a run whose results.json already exists")
    dtype: str = option("float32", "parameters and activations: float32 or bfloat16")
    quiet: bool = option(False, "no table and no progress bars on stderr")
    chunks: int = option(16, "batches scanned inside one jitted call")
    coordinator: Optional[str] = option(None, "HOST:PORT of process 0, for a multi-process run")
    num_processes: int = option(1, "processes in a multi-process run")
    process_id: int = option(0, "this process's index in a multi-process run")

    def validate(self) -> None:
        for name in ("batch_size", "chunks", "num_processes"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("limit", "max_new_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
        if self.temperature < 0 or not math.isfinite(self.temperature):
            raise UsageError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.dtype not in ("float32", "bfloat16"):
            raise UsageError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        if not 0 <= self.process_id < self.num_processes:
            raise UsageError(f"--process-id must be in [0, {self.num_processes})")
        if self.num_processes > 1 and not self.coordinator:
            raise UsageError("--num-processes > 1 needs --coordinator HOST:PORT")
        if self.coordinator is not None:
            check_address(self.coordinator)
        if not 0 <= self.seed <= MAX_SEED:
            raise UsageError(f"--seed must be in [0, {MAX_SEED}] (what the PRNG takes), got {self.seed}")
        if self.mesh is not None:
            try:
                gpt.parse_mesh(self.mesh)
            except ValueError as e:
                raise UsageError(f"--mesh: {e}") from None
        self.validate_tasks()

    def validate_tasks(self) -> None:
        """The lm-eval options: lm-eval installed, names given, a real --include-path."""
        if self.tasks is None:
            given = {"--num-fewshot": self.num_fewshot is not None, "--include-path": self.include_path is not None,
                     "--apply-chat-template": self.apply_chat_template}
            misplaced = [name for name, is_given in given.items() if is_given]
            if misplaced:
                raise UsageError(f"{misplaced[0]} applies to lm-eval tasks only: add --tasks")
            return
        if lm_eval is None:
            raise UsageError(f"--tasks needs lm-evaluation-harness: pip install {LM_EVAL}")
        if not task_names(self.tasks):
            raise UsageError("--tasks names no task")
        if self.bootstrap_iters < 0:
            raise UsageError(f"--bootstrap-iters must be >= 0, got {self.bootstrap_iters}")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise UsageError(f"--num-fewshot must be >= 0, got {self.num_fewshot}")
        if self.include_path is not None and not Path(self.include_path).is_dir():
            raise UsageError(f"--include-path {self.include_path} is not a directory")


def task_names(text: str) -> List[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def stop_strings(options: List[str]) -> Tuple[str, ...]:
    """--stop values as stop strings: \\n, \\t, \\r and \\\\ unescaped (a shell passes them
    literally), empty values dropped (so --stop '' means none)."""
    unescaped = (re.sub(r"\\(.)", lambda m: ESCAPES.get(m.group(1), m.group(0)), s) for s in options)
    return tuple(s for s in unescaped if s)


def check_address(text: str) -> None:
    """--coordinator: HOST:PORT, the port a number jax.distributed can listen on."""
    host, _, port = text.rpartition(":")
    if not host or any(c.isspace() or c == "/" for c in host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--coordinator must be HOST:PORT with a port in 1..65535, got {short(text)}")


# ----------------------------------------------------------------------------- datasets

KINDS = {  # kind -> required fields and their types
    "ppl": {"text": str},
    "mc": {"context": str, "choices": list, "gold": int},
    "gen": {"prompt": str, "answer": str},
    "acc": {"text": str},
}


class JsonlDataset:
    """A user JSONL file, checked line by line up front and then streamed (never held whole)."""

    def __init__(self, kind: str, path: str, limit: Optional[int] = None):
        if kind not in KINDS:
            raise UsageError(f"--data {kind}:{path}: unknown kind {kind!r}; choose {', '.join(KINDS)}")
        self.kind, self.path, self.limit = kind, Path(path), limit
        self.count = sum(1 for _ in self._read())  # validates every line
        if self.count == 0:
            raise UsageError(f"{path}: empty dataset (no JSON lines)")

    def _read(self) -> Iterator[Dict[str, Any]]:
        with open_regular(self.path, "--data file") as f:
            n = 0
            for number, raw in enumerate(f, 1):
                if self.limit is not None and n >= self.limit:
                    return
                if not raw.strip():
                    continue
                yield check_sample(self.kind, raw, f"{self.path}:{number}")
                n += 1

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        return self._read()

    def __len__(self) -> int:
        return self.count


def check_sample(kind: str, raw: bytes, where: str) -> Dict[str, Any]:
    """One parsed, type-checked sample; UsageError naming file and line otherwise."""
    try:
        sample = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"{where}: not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: not JSON ({e.msg})") from None
    except RecursionError:
        raise UsageError(f"{where}: not JSON (nested too deep)") from None
    except ValueError:  # what else json.loads raises: an integer of more than 4300 digits
        raise UsageError(f"{where}: not JSON (a number too long to read)") from None
    if not isinstance(sample, dict):
        raise UsageError(f"{where}: expected a JSON object")
    for field, kind_type in KINDS[kind].items():
        if field not in sample:
            raise UsageError(f"{where}: missing field {field!r}")
        value = sample[field]
        if not isinstance(value, kind_type) or isinstance(value, bool):
            raise UsageError(f"{where}: field {field!r} must be {kind_type.__name__}")
        if isinstance(value, str):
            check_text(value, repr(field), where)
    if kind == "mc":
        choices = sample["choices"]
        if len(choices) < 2 or not all(isinstance(c, str) for c in choices):
            raise UsageError(f"{where}: 'choices' must be a list of at least two strings")
        for i, choice in enumerate(choices):
            check_text(choice, f"choice {i}", where)
            if not choice:
                raise UsageError(f"{where}: choice {i} is empty; an empty continuation has nothing to score")
        if not 0 <= sample["gold"] < len(choices):
            raise UsageError(f"{where}: 'gold' {sample['gold']} is out of range for {len(choices)} choices")
    if kind == "gen" and "until" in sample:  # optional: this line's own stop strings
        until = sample["until"]
        if not isinstance(until, list) or not all(isinstance(s, str) for s in until):
            raise UsageError(f"{where}: 'until' must be a list of strings")
    return sample


def check_text(text: str, what: str, where: str) -> None:
    """Text must be encodable: JSON lets "\\ud800" (half a surrogate pair) through, and no
    tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{where}: {what} holds a lone surrogate {text[e.start]!r} at character "
                         f"{e.start}, which is not text") from None


def builtin_dataset(name: str, size: int) -> List[Dict[str, Any]]:
    """The held-out items of a built-in task, in the JSONL shapes of its kind."""
    items = itertools.islice(builtin_items(name, "eval"), size)
    if name == "grammar":  # the grammatical ending is choice 0 or 1, decided by its text
        out = []
        for prefix, good, bad in items:
            gold = int(is_eval_item(prefix + good + "swap"))
            choices = [bad, good] if gold else [good, bad]
            out.append({"context": prefix, "choices": choices, "gold": gold})
        return out
    if name == "addition":
        return [{"prompt": prompt, "answer": answer} for prompt, answer in items]
    return [{"text": text} for text in items]


# ----------------------------------------------------------------------------- requests


class Request(NamedTuple):
    """loglikelihood: score `continuation` given `context` (token ids), for document `doc`."""

    doc: int
    context: List[int]
    continuation: List[int]


class GenerationRequest(NamedTuple):
    """generate_until: new tokens after `prompt` (token ids) for document `doc`, the text
    cut at the first of the `until` strings."""

    doc: int
    prompt: List[int]
    until: Tuple[str, ...] = ("\n",)


@dataclasses.dataclass
class Scored:
    """One loglikelihood request's outcome: summed log-probability of the continuation,
    its token count, how many of its tokens were the argmax prediction, and the padded row
    that was run (tokens, mask), kept only when asked for."""

    logprob: float
    tokens: int
    correct: int
    row: Any = None


@dataclasses.dataclass
class Generation:
    """One generate_until request's outcome: the text (cut at a stop string), the new token
    ids (cut at EOS), whether the prompt was cut from the left to fit, the prompt row run."""

    text: str
    tokens: List[int]
    truncated: bool
    row: Any = None


def per_document(results: Iterable[Tuple[Request, Scored]]) -> Iterator[List[Scored]]:
    """Results of requests in document order -> one list per document (regrouped by tag)."""
    for _, group in itertools.groupby(results, key=lambda pair: pair[0].doc):
        yield [scored for _, scored in group]


def rolling_requests(tokens: List[int], prefix_id: int, max_len: int) -> List[Tuple[List[int], List[int]]]:
    """Cut a document into (context, continuation) windows scoring every token exactly once.

    As lm-evaluation-harness's loglikelihood_rolling: the first window is [prefix] + tokens,
    later windows predict the next max_len tokens with as much preceding context as fits.
    """
    requests, done = [], 0
    while done < len(tokens):
        n = min(max_len, len(tokens) - done)
        context = [prefix_id] if done == 0 else tokens[max(0, done + n - max_len - 1):done]
        requests.append((context, tokens[done:done + n]))
        done += n
    return requests


def encode_pair(encoding: Any, context: str, continuation: str) -> Tuple[List[int], List[int]]:
    """lm-evaluation-harness's split: trailing spaces of the context move to the continuation,
    the whole string is encoded, and the continuation is what follows the context's tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = encoding.encode(context + continuation)
    context_ids = encoding.encode(context)
    return context_ids, whole[len(context_ids):]


def rows_of(results: List[Any]) -> Any:
    """The (tokens, mask) rows run for one sample, stacked; None when not kept."""
    rows = [r.row for r in results if r.row is not None]
    if not rows:
        return None
    return np.stack([t for t, _ in rows]), np.stack([m for _, m in rows])


# ----------------------------------------------------------------------------- evaluations


class Evaluation(ABC):
    """Abstract base class for all evaluations."""

    higher_is_better = True

    @property
    @abstractmethod
    def name(self) -> str:
        """Name of this evaluation."""

    @classmethod
    def config(cls) -> List[type]:
        """Configuration schemas this evaluation needs ([] when none)."""
        return []

    def prefix(self) -> str:
        """Prefix for metrics from this evaluation."""
        return self.name + "_"

    @abstractmethod
    def __len__(self) -> int:
        """Number of samples."""

    @abstractmethod
    def __call__(self, inference: "InferenceJob", encoding: Any, reduce: str = "mean",
                 return_intermediates: bool = False, **kwargs: Any) -> Any:
        """Run the evaluation; with return_intermediates also the (tokens, mask) arrays run."""

    def score(self, *args: Any) -> List[float]:
        """One float per sample."""
        raise NotImplementedError

    @staticmethod
    def find_accumulation_steps(dataset_size: int, max_batch_size: int,
                                dp_replicate: int) -> Tuple[int, int] | Tuple[None, None]:
        """Largest per-replica batch <= max_batch_size with batch * dp_replicate dividing the
        dataset, and the number of steps; (None, None) when there is none."""
        for batch in range(min(max_batch_size, dataset_size // max(dp_replicate, 1)), 0, -1):
            if dataset_size % (batch * dp_replicate) == 0:
                return batch, dataset_size // (batch * dp_replicate)
        return None, None


@dataclasses.dataclass
class Result:
    """What one evaluation produced: per-sample records and scores, and the aggregate."""

    name: str
    kind: str
    value: float
    stderr: float
    scores: np.ndarray
    records: List[Dict[str, Any]]
    metrics: Dict[str, float]
    intermediates: List[Tuple[np.ndarray, np.ndarray]]


class DatasetEvaluation(Evaluation):
    """An evaluation of one kind over a dataset (built-in list or streamed JSONL file)."""

    kind = ""

    def __init__(self, name: str, dataset: Iterable[Dict[str, Any]]):
        self._name, self.dataset = name, dataset

    @property
    def name(self) -> str:
        return self._name

    def __len__(self) -> int:
        return len(self.dataset)

    @abstractmethod
    def records(self, inference: "InferenceJob", encoding: Any, keep_rows: bool,
                **kwargs: Any) -> Iterator[Tuple[Dict[str, Any], Any]]:
        """Yield (record, rows run for it) per sample, in dataset order."""

    def score(self, records: List[Dict[str, Any]]) -> List[float]:
        return [r["score"] for r in records]

    def aggregate(self, records: List[Dict[str, Any]]) -> Tuple[float, float, Dict[str, float]]:
        """(value, standard error, extra metrics); plain mean unless a kind says otherwise."""
        scores = np.array(self.score(records), np.float64)
        stderr = float(scores.std(ddof=1) / math.sqrt(len(scores))) if len(scores) > 1 else 0.0
        return float(scores.mean()), stderr, {}

    def result(self, inference: "InferenceJob", encoding: Any, keep_rows: bool = False,
               **kwargs: Any) -> Result:
        records, rows = [], []
        for record, row in inference.progress(self.records(inference, encoding, keep_rows, **kwargs),
                                              self.name, len(self)):
            records.append(record)
            if keep_rows:
                rows.append(row)
        scored = [r for r in records if not r.get("skipped")]
        if not scored:
            raise UsageError(f"evaluation {self.name}: no sample could be scored")
        value, stderr, metrics = self.aggregate(scored)
        scores = np.array(self.score(scored), np.float64)
        if not (math.isfinite(value) and np.isfinite(scores).all()):
            raise UsageError(f"evaluation {self.name}: non-finite score (broken weights?)")
        metrics["skipped"] = len(records) - len(scored)
        return Result(self.name, self.kind, value, stderr, scores, records, metrics, rows)

    def __call__(self, inference, encoding, reduce="mean", return_intermediates=False, **kwargs):
        """reduce: "mean" -> the aggregate (token-weighted for ppl/acc), "sum" -> sum of the
        per-sample scores, "none" -> the per-sample scores as a numpy array."""
        if reduce not in ("mean", "sum", "none"):
            raise ValueError(f"reduce must be mean, sum or none, got {reduce!r}")
        result = self.result(inference, encoding, keep_rows=return_intermediates, **kwargs)
        out = {"mean": result.value, "sum": float(result.scores.sum()), "none": result.scores}[reduce]
        return (out, result.intermediates) if return_intermediates else out


class RollingEvaluation(DatasetEvaluation):
    """Every token of each `text` scored once, in rolling windows (loglikelihood_rolling);
    a kind says what a document's record holds and how records aggregate. Empty texts are
    skipped and counted."""

    def records(self, inference, encoding, keep_rows, **kwargs):
        # the prefix token is added once by loglikelihood_rolling, not also by the tokenizer
        # (lm-eval 0.4 adds Llama's BOS twice in rolling windows: its issue #3333)
        documents = (encoding.encode(s["text"], add_special_tokens=False) for s in self.dataset)
        results = inference.loglikelihood_rolling(documents, keep_rows)
        for index, (sample, scored) in enumerate(zip(self.dataset, results)):
            tokens = sum(r.tokens for r in scored)
            if tokens == 0:
                yield {"eval": self.name, "index": index, "skipped": True, "score": None}, None
            else:
                yield {"eval": self.name, "index": index, **self.record(sample, scored, tokens)}, rows_of(scored)

    @abstractmethod
    def record(self, sample: Dict[str, Any], scored: List[Scored], tokens: int) -> Dict[str, Any]:
        """The sample's fields in samples.jsonl, "score" among them."""


class PerplexityEvaluation(RollingEvaluation):
    """Token-weighted perplexity exp(sum nll / sum tokens) of each `text`; lower is better."""

    kind, higher_is_better = "ppl", False

    def record(self, sample, scored, tokens):
        nll = -sum(r.logprob for r in scored)
        return {"score": math.exp(nll / tokens), "nll": nll, "tokens": tokens,
                "bytes": len(sample["text"].encode("utf-8"))}

    def aggregate(self, records):
        rate, se_rate, tokens = token_weighted(records, "nll")
        bpb = rate * tokens / (math.log(2) * sum(r["bytes"] for r in records))
        # exp() of the mean nll per token; its standard error by the delta method
        return math.exp(rate), math.exp(rate) * se_rate, {"bits_per_byte": bpb, "tokens": tokens}


class AccuracyEvaluation(RollingEvaluation):
    """Next-token accuracy: the share of tokens where the argmax prediction is right
    (token-weighted over all documents)."""

    kind, higher_is_better = "acc", True

    def record(self, sample, scored, tokens):
        correct = sum(r.correct for r in scored)
        return {"score": correct / tokens, "correct": correct, "tokens": tokens}

    def aggregate(self, records):
        value, se, tokens = token_weighted(records, "correct")
        return value, se, {"tokens": tokens}


def token_weighted(records: List[Dict[str, Any]], field: str) -> Tuple[float, float, int]:
    """sum(field) / sum(tokens) over documents, the standard error of that ratio estimator
    (documents are the independent units), and the token count."""
    values = np.array([r[field] for r in records], np.float64)
    tokens = np.array([r["tokens"] for r in records], np.float64)
    rate, n = values.sum() / tokens.sum(), len(records)
    se = math.sqrt(((values - rate * tokens) ** 2).sum() * n / max(n - 1, 1)) / tokens.sum()
    return float(rate), float(se), int(tokens.sum())


class MultipleChoiceEvaluation(DatasetEvaluation):
    """Accuracy of picking `gold` by the highest summed log-likelihood of each choice
    (acc; the first index wins ties). acc_norm divides by the choice's length in characters."""

    kind = "mc"

    def records(self, inference, encoding, keep_rows, **kwargs):
        requests = (Request(index, context or [inference.prefix_id], continuation)
                    for index, sample in enumerate(self.dataset) for choice in sample["choices"]
                    for context, continuation in [encode_pair(encoding, sample["context"], choice)])
        results = per_document(inference.loglikelihood(requests, keep_rows))
        for index, (sample, scored) in enumerate(zip(self.dataset, results)):
            loglik = [r.logprob for r in scored]
            normed = [ll / max(len(c), 1) for ll, c in zip(loglik, sample["choices"])]
            pred, pred_norm = int(np.argmax(loglik)), int(np.argmax(normed))
            yield ({"eval": self.name, "index": index, "score": float(pred == sample["gold"]),
                    "loglik": loglik, "pred": pred, "gold": sample["gold"],
                    "acc_norm": float(pred_norm == sample["gold"])}, rows_of(scored))

    def aggregate(self, records):
        value, stderr, metrics = super().aggregate(records)
        metrics["acc_norm"] = float(np.mean([r["acc_norm"] for r in records]))
        return value, stderr, metrics


class RolloutEvaluation(DatasetEvaluation):
    """Exact match of the generated answer (greedy by default) after stripping whitespace.

    Decoding stops at EOS or at max_new_tokens, and the text is cut at the first stop string:
    the sample's own "until" list if it has one, else `stop` (default "\\n"). Prompts longer
    than the room left in the context are cut from the left and counted."""

    kind = "gen"

    def __init__(self, name, dataset, max_new_tokens: int = 32, stop: Sequence[str] = ("\n",)):
        super().__init__(name, dataset)
        self.max_new_tokens, self.stop = max_new_tokens, tuple(stop)

    def records(self, inference, encoding, keep_rows, max_new_tokens=None, temperature=0.0,
                top_p=1.0, seed=0, **kwargs):
        requests = (GenerationRequest(index, encoding.encode(s["prompt"]) or [inference.prefix_id],
                                      tuple(s.get("until", self.stop)))
                    for index, s in enumerate(self.dataset))
        outputs = inference.generate_until(requests, max_new_tokens or self.max_new_tokens, temperature,
                                           top_p, seed, keep_rows)
        for index, (sample, (_, out)) in enumerate(zip(self.dataset, outputs)):
            yield ({"eval": self.name, "index": index,
                    "score": float(out.text.strip() == sample["answer"].strip()), "output": out.text,
                    "answer": sample["answer"], "truncated": out.truncated}, out.row)

    def aggregate(self, records):
        value, stderr, metrics = super().aggregate(records)
        metrics["truncated"] = sum(r["truncated"] for r in records)
        return value, stderr, metrics


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    cut = min([text.index(s) for s in stops if s and s in text], default=len(text))
    return text[:cut]


KIND_CLASSES = {"ppl": PerplexityEvaluation, "mc": MultipleChoiceEvaluation,
                "gen": RolloutEvaluation, "acc": AccuracyEvaluation}
BUILTIN = {"text": ("ppl", 200), "grammar": ("mc", 200), "addition": ("gen", 100),
           "repeat": ("acc", 200)}  # name -> (kind, number of held-out items)


def builtin_evaluation(name: str, limit: Optional[int] = None) -> DatasetEvaluation:
    if name not in BUILTIN:
        raise UsageError(f"unknown evaluation {name!r}; built-in: {', '.join(BUILTIN)}")
    kind, size = BUILTIN[name]
    dataset = builtin_dataset(name, min(size, limit or size))
    if kind == "gen":
        return RolloutEvaluation(name, dataset, max_new_tokens=8)
    return KIND_CLASSES[kind](name, dataset)


# ----------------------------------------------------------------------------- inference


SORT_WINDOW = 8  # blocks' worth of requests sorted by length at a time
LOGITS_BYTES = 1 << 28  # float32 logits unembedded at a time when scoring (256 MB)


def padded_length(n: int, cap: int) -> int:
    """n rounded up to a multiple of 1/16 of its next power of two (at least 16), at most
    cap: a row of more than 256 tokens is at most 1/8 padding (3% on average), and there
    are at most 8 lengths per octave (so few shapes, so few compilations)."""
    step = max(16, (1 << max(n - 1, 0).bit_length()) // 16)
    return min(cap, -(-max(n, 1) // step) * step)


def is_argmax(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Whether each target is argmax(logits) [B, T], ties going to the first index as in
    jnp.argmax and torch.argmax: no logit above the target's, none equal before it. One
    fused comparison pass: XLA's CPU backend runs jnp.argmax's paired value-and-index
    reduction slowly (0.6 s of a 8.5 s GPT-2-small 8 x 512 scoring call; this, 0.01 s)."""
    target_BT1 = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)
    index_BTV = jax.lax.broadcasted_iota(jnp.int32, logits_BTV.shape, logits_BTV.ndim - 1)
    beaten_BTV = (logits_BTV > target_BT1) | ((logits_BTV == target_BT1) & (index_BTV < targets_BT[..., None]))
    return ~beaten_BTV.any(-1)


class Parts(NamedTuple):
    """What an InferenceJob runs: a model, its parameters on the mesh, a tokenizer, the mesh."""

    model: gpt.GPT
    variables: Any
    tokenizer: Any
    mesh: jax.sharding.Mesh


class InferenceJob:
    """Holds the model, its sharded parameters, the mesh and the tokenizer, and runs requests.

    How work reaches the devices: requests are taken a window at a time, sorted by length
    (longest first, as lm-eval's backends do), and cut into blocks [chunks, batch, length]
    of similar lengths, so little of a block is padding (see schedule and padded_length).
    A block's batch dimension is split over the mesh's "batch" axis (the model's sharding
    plan maps the logical "batch" to it) and replicated over "shard", where the parameters
    are split instead. jax.make_array_from_callback asks each process only for the slices
    its own devices hold, so with several hosts no process uploads the whole block. One
    jitted call scans over the chunks; its outputs are replicated, so every process reads
    every result. Results come back in the order the requests went in.
    """

    def __init__(self, spec: ExecutionSpec, base: Optional[Node] = None, parts: Optional[Parts] = None):
        self.spec, self.base = spec, base
        self.cfg: EvaluatorConfig = spec.cfg or EvaluatorConfig()
        if parts is None:
            mesh = spec.make_mesh()
            parts = Parts(*self.load(mesh), mesh)
        self.model, self.variables, self.tokenizer, self.mesh = parts
        if self.tokenizer.vocab_size > self.model.vocab_size:
            raise UsageError(f"tokenizer has {self.tokenizer.vocab_size} tokens but the model's embedding "
                             f"has only {self.model.vocab_size}")
        self.dp = self.mesh.shape["batch"]
        self.replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        self._score = jax.jit(self._score_block, out_shardings=self.replicated)
        self._generators: Dict[Tuple, Callable] = {}
        self.blocks_run: List[Tuple[int, int, int, int]] = []  # (real tokens, chunks, rows, length) of each

    def load(self, mesh: jax.sharding.Mesh) -> Tuple[gpt.GPT, Any, Any]:
        """(model, variables placed on `mesh`, tokenizer): each job says where they come from."""
        raise NotImplementedError

    # --- sizes, padding, placement

    @property
    def max_len(self) -> int:
        return self.model.block_size

    @property
    def prefix_id(self) -> int:
        """BOS if the tokenizer has one, else EOS: the first context token (as lm-eval)."""
        bos, eos = self.tokenizer.bos_token_id, self.tokenizer.eos_token_id
        return bos if bos is not None else (eos if eos is not None else 0)

    @property
    def batch_size(self) -> int:
        """The per-chunk batch, rounded up to a multiple of the data-parallel size."""
        return -(-self.cfg.batch_size // self.dp) * self.dp

    def pad(self, rows: List[List[int]], length: int, count: int, left: bool) -> Tuple[np.ndarray, np.ndarray]:
        """`rows` padded to [count, length] tokens, on the left (generation: every prompt ends
        where decoding starts) or the right (scoring), and a mask True at real tokens."""
        tokens = np.zeros((count, length), np.int32)
        mask = np.zeros((count, length), bool)
        for i, row in enumerate(rows):
            where = slice(length - len(row), length) if left else slice(0, len(row))
            tokens[i, where], mask[i, where] = row, True
        return tokens, mask

    def put(self, block: np.ndarray) -> jax.Array:
        """A host block [chunks, batch, ...] onto the mesh, its batch split over "batch"."""
        sharding = gpt.input_sharding(self.model, self.mesh, (None, "batch") + (None,) * (block.ndim - 2))
        return jax.make_array_from_callback(block.shape, sharding, lambda index: block[index])

    def schedule(self, lengths: List[int], cap: int) -> Iterator[Tuple[int, int, int, int]]:
        """(start, chunks, rows, length) blocks for requests of these lengths, sorted longest
        first. Consecutive rows make batches; each batch is padded to its own longest row
        (padded_length); batches of one length go --chunks at a time into a block, the rest
        one by one; a short last batch has the next power of two of rows (a multiple of the
        data-parallel size). So no batch is all padding, little of a row is, and there are
        only a few shapes (so few compilations) whatever the lengths."""
        batches = [(start, min(self.batch_size, len(lengths) - start),
                    padded_length(lengths[start], cap)) for start in range(0, len(lengths), self.batch_size)]
        for (rows, length), group in itertools.groupby(batches, key=lambda b: b[1:]):
            group = list(group)
            if rows < self.batch_size:
                rows = min(self.batch_size, -(-(1 << (rows - 1).bit_length()) // self.dp) * self.dp)
            while group:
                chunks = self.cfg.chunks if len(group) >= self.cfg.chunks else 1
                yield group[0][0], chunks, rows, length
                group = group[chunks:]

    def in_blocks(self, requests: Iterable[Any], length_of: Callable[[Any], int], cap: int,
                  run_block: Callable[[List[Any], int, int, int], List[Any]]) -> Iterator[Tuple[Any, Any]]:
        """(request, result) in request order; run_block(requests, chunks, rows, length) runs
        one block. A window of SORT_WINDOW blocks' requests is sorted by length at a time,
        so memory does not grow with the dataset."""
        requests = iter(requests)
        while window := list(itertools.islice(requests, self.batch_size * self.cfg.chunks * SORT_WINDOW)):
            order = sorted(range(len(window)), key=lambda i: -length_of(window[i]))
            results: List[Any] = [None] * len(window)
            for start, chunks, rows, length in self.schedule([length_of(window[i]) for i in order], cap):
                picked = order[start:start + chunks * rows]
                for i, result in zip(picked, run_block([window[i] for i in picked], chunks, rows, length)):
                    results[i] = result
                self.blocks_run.append((sum(length_of(window[i]) for i in picked), chunks, rows, length))
            yield from zip(window, results)
    def check_memory(self, rows: int, length: int, fused: bool) -> None:
        """Refuse a batch that cannot fit before building it: its float32 logits and
        log-probabilities (a piece at a time when scoring, see token_scores), the keys and
        values of every layer, and, unless attention is `fused` (cuDNN), its float32 scores
        and probabilities, against the memory available."""
        m = self.model
        logits = 2 * min(rows * length * m.vocab_size * 4, LOGITS_BYTES)
        kv = rows * length * m.n_layers * 2 * m.kv_heads * m.head_width * np.dtype(m.pdtype).itemsize
        scores = 0 if fused else 2 * rows * m.n_head * length * length * 4
        needed, free = logits + kv + scores, available_memory()
        if needed > free:
            raise UsageError(f"--batch-size {self.cfg.batch_size}: a batch of {rows} x {length} tokens needs "
                             f"about {gigabytes(needed)}, more than the {gigabytes(free)} available")

    # --- the jitted kernels

    def hidden(self, variables: Any, tokens_BT: jax.Array) -> jax.Array:
        """Final hidden states [B, T, D] of right-padded rows, each starting at position 0;
        no padding mask, so attention takes the fused causal path (gpt.attend_causal)."""
        embed_and_decode = lambda m, idx: m.decode(m.embed(idx, True), None, True)
        return self.model.apply(variables, tokens_BT, method=embed_and_decode)

    def token_scores(self, variables: Any, x_BTD: jax.Array, targets_BT: jax.Array) -> Tuple[jax.Array, jax.Array]:
        """(log-probability of each target [B, T], whether it is the argmax [B, T]),
        unembedding a few positions at a time so the float32 logits [B, T, V] never exist
        whole (a 151,936-token vocabulary at 16 x 1024 would be 10 GB)."""
        B, T, D = x_BTD.shape
        P = T  # positions per piece: halved while the piece's logits exceed LOGITS_BYTES
        while 4 * B * P * self.model.vocab_size > LOGITS_BYTES and P % 2 == 0:
            P //= 2
        x_NBPD = x_BTD.reshape(B, T // P, P, D).transpose(1, 0, 2, 3)
        targets_NBP = targets_BT.reshape(B, T // P, P).transpose(1, 0, 2)

        def piece(args):
            x_BPD, t_BP = args
            logits_BPV = self.model.apply(variables, x_BPD, method=gpt.GPT.unembed)
            return -gpt.token_nll(logits_BPV, t_BP), is_argmax(logits_BPV, t_BP)

        logprob_NBP, correct_NBP = jax.lax.map(piece, (x_NBPD, targets_NBP))
        return logprob_NBP.transpose(1, 0, 2).reshape(B, T), correct_NBP.transpose(1, 0, 2).reshape(B, T)

    def _score_block(self, variables, tokens_CBT, targets_CBT, weights_CBT):
        """Per row of a [chunks, batch, length] block: summed log-probability of the weighted
        targets, how many of them are the argmax, and how many there are. One lax.scan over
        the chunks, so only one chunk's activations exist at a time."""
        def one_chunk(_, chunk):
            tokens_BT, targets_BT, weights_BT = chunk
            logprob_BT, correct_BT = self.token_scores(variables, self.hidden(variables, tokens_BT), targets_BT)
            logprob_BT = jnp.where(weights_BT, logprob_BT, 0.0)
            return None, (logprob_BT.sum(-1), (correct_BT & weights_BT).sum(-1), weights_BT.sum(-1))

        return jax.lax.scan(one_chunk, None, (tokens_CBT, targets_CBT, weights_CBT))[1]

    def _generator(self, n_new: int, temperature: float, top_p: float) -> Callable:
        """A jitted rollout of a block [chunks, batch, prompt_len], one per decoding setting."""
        key = (n_new, temperature, top_p)
        if key not in self._generators:
            eos = self.tokenizer.eos_token_id

            def run(variables, prompts_CBP, mask_CBP, sample_ids_CB, seed):
                def one_chunk(_, chunk):
                    prompts_BP, mask_BP, ids_B = chunk
                    keys_B = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(ids_B)
                    new_BN = gpt.generate(self.model, variables, prompts_BP, mask_BP, n_new, eos,
                                          temperature, top_p, keys_B)
                    return None, new_BN

                return jax.lax.scan(one_chunk, None, (prompts_CBP, mask_CBP, sample_ids_CB))[1]

            self._generators[key] = jax.jit(run, out_shardings=self.replicated)
        return self._generators[key]

    # --- the three request types

    def loglikelihood(self, requests: Iterable[Request], keep_rows: bool = False) -> Iterator[Tuple[Request, Scored]]:
        """(request, its Scored) for each request, in order. The input is the last max_len + 1
        tokens of context + continuation, minus the last one; the continuation is scored."""
        def inputs(r: Request) -> List[int]:
            if len(r.continuation) > self.max_len:
                raise UsageError(f"a continuation of {len(r.continuation)} tokens does not fit "
                                 f"the context of {self.max_len}")
            return (r.context + r.continuation)[-(self.max_len + 1):]

        def run_block(block: List[Request], chunks: int, rows: int, length: int) -> List[Scored]:
            wholes, n = [inputs(r) for r in block], chunks * rows
            self.check_memory(rows, length, fused=gpt.uses_cudnn(self.model.adtype))
            tokens, mask = self.pad([w[:-1] for w in wholes], length, n, left=False)
            targets, _ = self.pad([w[1:] for w in wholes], length, n, left=False)
            weights = np.zeros((n, length), bool)
            for i, (w, r) in enumerate(zip(wholes, block)):
                weights[i, len(w) - 1 - len(r.continuation):len(w) - 1] = True
            shape = (chunks, rows, length)
            out = self._score(self.variables, *(self.put(a.reshape(shape)) for a in (tokens, targets, weights)))
            logprob, correct, count = (np.asarray(o).reshape(-1) for o in out)
            return [Scored(float(logprob[i]), int(count[i]), int(correct[i]),
                           (tokens[i], mask[i]) if keep_rows else None) for i in range(len(block))]

        return self.in_blocks(requests, lambda r: min(len(r.context) + len(r.continuation) - 1, self.max_len),
                              self.max_len, run_block)

    def loglikelihood_rolling(self, documents: Iterable[List[int]], keep_rows: bool = False) -> Iterator[List[Scored]]:
        """Every token of each document (token ids) scored once in rolling windows, after
        the prefix token: one list of window results per document, in order. An empty
        document gives one window with nothing to score."""
        requests = (Request(doc, context, continuation) for doc, tokens in enumerate(documents)
                    for context, continuation in rolling_requests(tokens, self.prefix_id, self.max_len)
                    or [([self.prefix_id], [])])
        return per_document(self.loglikelihood(requests, keep_rows))

    def generate_until(self, requests: Iterable[GenerationRequest], n_new: int, temperature: float = 0.0,
                       top_p: float = 1.0, seed: Optional[int] = None,
                       keep_rows: bool = False) -> Iterator[Tuple[GenerationRequest, Generation]]:
        """Up to n_new tokens after each prompt (greedy, or sampled with temperature/top_p):
        (request, its Generation) in order. Sampling keys depend on the document index only,
        so the same seed gives the same text at any batch size, mesh or order."""
        room = self.max_len - n_new
        if room < 1:
            raise UsageError(f"--max-new-tokens {n_new} leaves no room in the context of {self.max_len}")
        eos, run = self.tokenizer.eos_token_id, self._generator(n_new, temperature, top_p)
        seed = self.spec.seed if seed is None else seed

        def run_block(block: List[GenerationRequest], chunks: int, rows: int, length: int) -> List[Generation]:
            prompts, n = [r.prompt[-room:] for r in block], chunks * rows
            self.check_memory(rows, length + n_new, fused=False)  # the cache is read with attend's einsums
            tokens, mask = self.pad(prompts, length, n, left=True)
            ids = np.zeros(n, np.int32)
            ids[:len(block)] = [r.doc for r in block]
            shape = (chunks, rows, length)
            new = np.asarray(run(self.variables, self.put(tokens.reshape(shape)), self.put(mask.reshape(shape)),
                                 self.put(ids.reshape(chunks, rows)), seed)).reshape(n, n_new)
            out = []
            for i, r in enumerate(block):
                ids_i = new[i].tolist()
                ids_i = ids_i[:ids_i.index(eos)] if eos is not None and eos in ids_i else ids_i
                out.append(Generation(cut_at_stop(self.tokenizer.decode(ids_i), r.until), ids_i,
                                      len(r.prompt) > room, (tokens[i], mask[i]) if keep_rows else None))
            return out

        return self.in_blocks(requests, lambda r: min(len(r.prompt), room), room, run_block)

    def progress(self, items: Iterator[Any], name: str, total: int) -> Iterator[Any]:
        """A tqdm bar on stderr (samples done, samples/s); off with --quiet or no terminal."""
        quiet = self.cfg.quiet or not sys.stderr.isatty() or not self.spec.is_main
        return tqdm(items, desc=name, total=total, unit="sample", disable=quiet, leave=False)


# ----------------------------------------------------------------------------- lm-evaluation-harness
# lm-eval builds the requests of its tasks (prompts, few-shot examples, chat turns) and computes
# their metrics; JaxLM answers the requests through InferenceJob, as our own evaluations do.

GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature", "top_p"}  # what generate_until honours


class Decoding(NamedTuple):
    """How one generate_until request decodes: new tokens, sampling, stop strings."""

    max_gen_toks: int
    temperature: float  # 0: greedy
    top_p: float
    until: List[str]


class JaxLM(TemplateLM):
    """lm-evaluation-harness's model interface over an InferenceJob: loglikelihood,
    loglikelihood_rolling and generate_until run through the same jitted, sharded blocks
    as the built-in evaluations.

    Every process reports rank 0 of world size 1, so lm-eval builds every request on every
    process and each call here is one SPMD computation over the global mesh. (lm-eval's own
    multi-process mode would hand each process a share of the documents instead.)"""

    backend = "causal"

    def __init__(self, inference: "InferenceJob", max_gen_toks: int = 256, seed: int = 0):
        super().__init__()
        self.inference, self.encoding, self.seed = inference, inference.tokenizer, seed
        self._max_gen_toks = max_gen_toks  # lm-eval's HF model uses 256 when a task sets none
        # transformers' tokenizer where there is one: lm-eval reads its chat template and tokens
        self.tokenizer = getattr(inference.tokenizer, "tok", None)
        self.prefix_text = self.token_text(self.prefix_token_id)
        self.eos_text = self.token_text(self.eot_token_id)

    @property
    def eot_token_id(self) -> int:
        return self.encoding.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return self.inference.prefix_id  # BOS, else EOS

    @property
    def max_length(self) -> int:
        return self.inference.max_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__") if self.tokenizer is not None else "bytes"

    def token_text(self, token: Optional[int]) -> Optional[str]:
        """A special token as text: chat templates write BOS as text, and the EOS text is a
        stop string (as lm-eval's HF model adds it)."""
        if self.tokenizer is None or token is None:
            return None
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> List[int]:
        """As lm-eval's HF model: with the tokenizer's own special tokens (Llama's BOS), except
        when the text already starts with the prefix token's text (a chat template wrote it)."""
        if add_special_tokens is None:
            add_special_tokens = not (self.prefix_text and string.startswith(self.prefix_text))
        return self.encoding.encode(string, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, chat_history: List[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as text through the tokenizer's template; a template that refuses
        system messages gets the conversation without them (as lm-eval's HF model)."""
        def render(messages: List[Dict[str, str]]) -> str:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=not add_generation_prompt)
        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            return render([m for m in chat_history if m["role"] != "system"])

    def get_model_info(self) -> Dict[str, Any]:
        """What lm-eval records about the model in its results' "config"."""
        count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.inference.variables))
        return {"model_num_parameters": count, "model_dtype": self.inference.model.param_dtype}

    # --- the three request types

    def _loglikelihood_tokens(self, requests: List[Tuple[Tuple[str, str], List[int], List[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> List[Tuple[float, bool]]:
        """(log-probability, is_greedy) of each continuation, given ((context, continuation)
        texts, context ids, continuation ids) as TemplateLM.loglikelihood encodes them;
        is_greedy: every continuation token is the argmax prediction."""
        batch = (Request(i, list(context), list(continuation)) for i, (_, context, continuation) in enumerate(requests))
        scored = self.inference.progress(self.inference.loglikelihood(batch), "loglikelihood", len(requests))
        return [(s.logprob, s.correct == s.tokens) for _, s in scored]

    def loglikelihood_rolling(self, requests: List[Any], disable_tqdm: bool = False) -> List[float]:
        """The summed log-likelihood of each whole text, every token scored once after one
        prefix token. lm-eval's HF model lets a BOS-adding tokenizer add BOS as well and scores
        p(BOS | BOS) as the first token (its issue #3333); we add the prefix once."""
        documents = (self.encoding.encode(request.args[0], add_special_tokens=False) for request in requests)
        windows = self.inference.progress(self.inference.loglikelihood_rolling(documents), "loglikelihood_rolling",
                                          len(requests))
        return [sum(s.logprob for s in document) for document in windows]

    def generate_until(self, requests: List[Any], disable_tqdm: bool = False) -> List[str]:
        """Each request's continuation, cut at the first of its `until` strings (the EOS text
        among them); decoding stops at EOS inside the jitted loop. Requests run in groups of
        one decoding setting, each group one rollout; prompts are cut from the left to
        max_length - max_gen_toks tokens, as lm-eval's HF model cuts them. Sampling keys come
        from the seed and each request's position, so they do not depend on batch or mesh."""
        settings = [self.decoding(gen_kwargs) for _, gen_kwargs in (request.args for request in requests)]
        texts = [""] * len(requests)
        for setting in sorted({s[:3] for s in settings}):  # (max_gen_toks, temperature, top_p)
            indices = [i for i, s in enumerate(settings) if s[:3] == setting]
            group = (GenerationRequest(i, self.tok_encode(requests[i].args[0]) or [self.prefix_token_id], ())
                     for i in indices)
            outputs = self.inference.generate_until(group, *setting, seed=self.seed)
            for request, generation in self.inference.progress(outputs, "generate_until", len(indices)):
                texts[request.doc] = postprocess_generated_text(generation.text, settings[request.doc].until, None)
        return texts

    def decoding(self, gen_kwargs: Dict[str, Any]) -> Decoding:
        """A task's generation_kwargs, read as lm-eval's HF model reads them."""
        unknown = sorted(set(gen_kwargs) - GEN_KWARGS)
        if unknown:
            raise UsageError(f"generation_kwargs {', '.join(unknown)} are not supported "
                             f"(supported: {', '.join(sorted(GEN_KWARGS))})")
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        n_new = kwargs["max_gen_toks"]
        if n_new >= self.max_length:
            raise UsageError(f"a task asks for {n_new} new tokens (max_gen_toks), which leaves no room in the "
                             f"context of {self.max_length}; --max-new-tokens sets it for every task")
        until = handle_stop_sequences(kwargs["until"], eos=self.eos_text)
        if not (kwargs["do_sample"] and kwargs["temperature"] > 0):
            return Decoding(n_new, 0.0, 1.0, until)
        top_p = float(kwargs.get("top_p", 1.0))
        if not 0 < top_p <= 1:
            raise UsageError(f"generation_kwargs top_p must be in (0, 1], got {top_p}")
        return Decoding(n_new, float(kwargs["temperature"]), top_p, until)


@contextlib.contextmanager
def hf_evaluate_importable() -> Iterator[None]:
    """Inside, `import evaluate` gives HuggingFace's `evaluate` package, not this file.

    lm-eval imports that package for metrics outside its own registry, and so do some tasks'
    utils.py. Run as `python evaluate.py`, this file's directory comes first on sys.path, so
    their import would load this file a second time; imported as `evaluate` (by jobs.py,
    train.py, a test), this module is sys.modules["evaluate"]. Both are undone inside and
    restored on exit; whoever imported HuggingFace's package inside keeps it."""
    here = Path(__file__).resolve()
    ours = sys.modules.get("evaluate")
    is_ours = ours is not None and Path(getattr(ours, "__file__", None) or "").resolve() == here
    saved_path = list(sys.path)
    if is_ours:
        del sys.modules["evaluate"]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here.parent]  # "" is the cwd
    try:
        yield
    finally:
        sys.path[:] = saved_path
        if is_ours:
            sys.modules["evaluate"] = ours


def task_manager(names: List[str], include_path: Optional[str]) -> Any:
    """lm-eval's index of tasks. Indexing its 14,683 built-in task files takes 7-25 s, so when
    --include-path defines every task asked for, only that directory is indexed (its task
    would win over a built-in one of the same name anyway).

    lm_eval.tasks is loaded here, not at the top of the file: it imports `datasets` (about a
    second), which a run without --tasks never needs."""
    manager_class = importlib.import_module("lm_eval.tasks").TaskManager
    if include_path is not None:
        local = manager_class(include_path=include_path, include_defaults=False)
        if all(name in local.all_subtasks for name in names):
            return local
    return manager_class(include_path=include_path)


def check_task_names(manager: Any, names: List[str], include_path: Optional[str]) -> None:
    """One line for a name that is no task, group, tag or YAML file that lm-eval knows."""
    unknown = [name for name in names if name not in manager.all_tasks and not Path(name).is_file()]
    if unknown:
        where = " or in --include-path" if include_path else " (local tasks: --include-path DIR)"
        raise UsageError(f"--tasks: {unknown[0]!r} is not an lm-eval task, group or tag{where}")


def task_samples(out: Dict[str, Any], name: str) -> int:
    """Documents lm-eval scored for a task, or for all tasks of a group."""
    if name in out["n-samples"]:
        return out["n-samples"][name]["effective"]
    return sum(task_samples(out, sub) for sub in out["group_subtasks"].get(name, []))


def task_entries(out: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """lm-eval's scores as results.json entries, one per task and metric, each named
    "<task>/<metric>,<filter>" as lm-eval keys it (e.g. "hellaswag/acc_norm,none")."""
    entries: Dict[str, Dict[str, Any]] = {key: {} for key in ("results", "higher_is_better", "n_samples",
                                                               "stderr", "kind", "metrics")}
    for task, scores in out["results"].items():
        for key, value in scores.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue  # alias, name, sample_len, and the stderrs (next to their metric below)
            name, stderr = f"{task}/{key}", scores.get(f"{metric}_stderr,{filter_name}")
            entries["results"][name] = value
            entries["higher_is_better"][name] = out["higher_is_better"].get(task, {}).get(metric)
            entries["n_samples"][name] = task_samples(out, task)
            entries["stderr"][name] = stderr if isinstance(stderr, (int, float)) else None  # "N/A"
            entries["kind"][name] = "lm-eval"
            entries["metrics"][name] = {"n-shot": out["n-shot"].get(task), "version": out["versions"].get(task)}
    return entries


def results_file(out: Dict[str, Any], model_name: str, chat_template: Optional[str], multiturn: bool,
                 seconds: float) -> Dict[str, Any]:
    """simple_evaluate's results as lm-eval's EvaluationTracker completes them for its results
    file: without the samples, with a hash of each task's documents, prompts and targets, and
    the run's general settings."""
    samples = out.get("samples", {})
    hashes = {task: hash_string("".join(s["doc_hash"] + s["prompt_hash"] + s["target_hash"] for s in rows))
              for task, rows in samples.items()}
    return {**{key: value for key, value in out.items() if key != "samples"}, "task_hashes": hashes,
            "model_source": "gpt-eval", "model_name": model_name,
            "model_name_sanitized": sanitize_model_name(model_name), "system_instruction": None,
            "system_instruction_sha": None, "fewshot_as_multiturn": multiturn, "chat_template": chat_template,
            "chat_template_sha": hash_string(chat_template) if chat_template else None,
            "total_evaluation_time_seconds": str(seconds)}


def sample_line(sample: Dict[str, Any]) -> str:
    """One line of an lm-eval samples file, as lm-eval writes it: arguments as
    {"gen_args_i": {"arg_j": ...}}, responses as nested strings, the target as a string."""
    line = dict(sample)
    line["arguments"] = {f"gen_args_{i}": {f"arg_{j}": arg for j, arg in enumerate(args)}
                         for i, args in enumerate(sample["arguments"])}
    line["resps"], line["filtered_resps"] = sanitize_list(sample["resps"]), sanitize_list(sample["filtered_resps"])
    line["target"] = str(sample["target"])
    return json.dumps(line, default=handle_non_serializable, ensure_ascii=False) + "\n"


# ----------------------------------------------------------------------------- fingerprint and resume

# Options that cannot change a score: how the work is spread and shown, and where it goes.
# Every other option is part of a run's fingerprint, so a new option counts unless listed
# here; --ckpt and --data count through what they name (the model's files, the datasets).
UNSCORED_OPTIONS = ("out", "batch_size", "mesh", "chunks", "quiet", "force", "coordinator", "num_processes",
                    "process_id", "ckpt", "data")
RESUME_FILE = ".resume.json"  # the finished evaluations of an unfinished run, beside results.json
OUTPUT_FILES = ("results.json", "samples.jsonl", RESUME_FILE)


def dataset_fingerprint(evaluation: Evaluation) -> Dict[str, Any]:
    """A JSONL file: its path, size and hash. Data made in memory (the built-in sets): a hash
    of its items."""
    dataset = getattr(evaluation, "dataset", None)
    kind = getattr(evaluation, "kind", type(evaluation).__name__)
    if isinstance(dataset, JsonlDataset):
        return {"kind": kind, "path": os.path.abspath(dataset.path), **file_digest(dataset.path, "--data file")}
    items = json.dumps(list(dataset) if dataset is not None else None, sort_keys=True)
    return {"kind": kind, "sha256": hashlib.sha256(items.encode()).hexdigest()}


TASK_FILES = (".yaml", ".yml", ".py", ".json", ".jsonl")  # what an --include-path task is made of


def task_files_fingerprint(directory: str) -> Dict[str, Any]:
    """The local task definitions (and data beside them) under --include-path: each file's
    size and hash, by relative path. Hub datasets are lm-eval's to version (its task versions
    are in its results file); data files a YAML names elsewhere are not hashed."""
    root = Path(directory)
    return {str(p.relative_to(root)): file_digest(p, "--include-path file")
            for p in sorted(root.rglob("*")) if p.suffix in TASK_FILES and p.is_file()}


def parameters_digest(variables: Any) -> str:
    """sha256 over every parameter's name, dtype, shape and bytes."""
    digest = hashlib.sha256()
    for name, array in sorted(to_host(variables).items()):
        digest.update(f"{name} {array.dtype} {array.shape}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def plan(spec: ExecutionSpec, fingerprint: Dict[str, Any], force: bool) -> Optional[Dict[str, Result]]:
    """None when the output directory's results.json holds this very run; otherwise the
    results an interrupted try of this run kept ({} if none). Another run's results.json is
    refused unless `force`, or unless a try of this run was let in before (it kept results)."""
    done = spec.path("results.json")
    kept = read_kept(spec.path(RESUME_FILE), fingerprint)
    if force or not os.path.lexists(done):
        return kept
    previous = read_json(done, "results file")
    previous = previous.get("fingerprint") if isinstance(previous, dict) else None
    if previous == fingerprint:
        return None
    if kept:
        return kept
    raise UsageError(f"{done} holds another run ({differences(previous, fingerprint)}); "
                     "--force replaces it, or choose another --out")


def differences(old: Any, new: Dict[str, Any]) -> str:
    """The first few fingerprint entries that differ: 'key: old -> new', 'key: added'."""
    if not isinstance(old, dict):
        return "it records no fingerprint"
    found = changed_keys(old, new)
    return "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")


def changed_keys(old: Any, new: Any, prefix: str = "") -> List[str]:
    """Where two JSON trees differ, at the shallowest key present on one side only."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [] if old == new else [f"{prefix[:-1]}: {short(old)} -> {short(new)}"]
    found = []
    for key in dict.fromkeys([*new, *old]):
        if key not in old or key not in new:
            found.append(f"{prefix}{key}: {'added' if key not in old else 'removed'}")
        else:
            found += changed_keys(old[key], new[key], f"{prefix}{key}.")
    return found


def kept_form(result: Result, with_records: bool) -> Dict[str, Any]:
    """A finished evaluation as JSON, enough to write results.json (and samples.jsonl) later."""
    return {"kind": result.kind, "value": result.value, "stderr": result.stderr, "scores": result.scores.tolist(),
            "metrics": result.metrics, "records": result.records if with_records else []}


def read_kept(path: Path, fingerprint: Dict[str, Any]) -> Dict[str, Result]:
    """The finished evaluations an interrupted try of this very run kept; {} if none (one
    kept by another run is ignored, and replaced once this run keeps its first)."""
    if not os.path.lexists(path):
        return {}
    with open_regular(path, "resume file") as f:
        try:
            kept = json.load(f)
        except ValueError:
            return {}
    if not isinstance(kept, dict) or kept.get("fingerprint") != fingerprint:
        return {}
    return {name: Result(name, r["kind"], r["value"], r["stderr"], np.array(r["scores"], np.float64),
                         r["records"], r["metrics"], []) for name, r in kept["results"].items()}


# ----------------------------------------------------------------------------- evaluators


class Evaluator(InferenceJob):
    """InferenceJob that runs evaluations and saves results."""

    CONFIG = EvaluatorConfig
    EVALUATION: List[str] = list(BUILTIN)  # names of the built-in evaluations it runs

    def __init__(self, spec: ExecutionSpec, base: Optional[Node] = None, parts: Optional[Parts] = None,
                 evaluations: Optional[List[Evaluation]] = None):
        super().__init__(spec, base, parts)
        self.evaluations = self.build_evaluations() if evaluations is None else evaluations

    @classmethod
    def config(cls, evaluations: Optional[List[type]] = None) -> List[type]:
        """The evaluator's options and those of every evaluation kind it holds."""
        kinds = evaluations if evaluations is not None else list(KIND_CLASSES.values())
        return [cls.CONFIG] + [schema for kind in kinds for schema in kind.config()]

    @classmethod
    def from_trainer(cls, trainer: Any) -> "Evaluator":
        """An evaluator over a trainer's live model and parameters, on the trainer's mesh,
        running the trainer's declared EVALUATION."""
        evaluations = [builtin_evaluation(name) for name in trainer.EVALUATION]
        return cls.from_parts(trainer.spec, trainer.model, trainer.variables, trainer.tokenizer,
                              trainer.mesh, evaluations, EvaluatorConfig(quiet=True, seed=trainer.spec.seed))

    @classmethod
    def from_parts(cls, spec: ExecutionSpec, model: gpt.GPT, variables: Any, tokenizer: Any,
                   mesh: jax.sharding.Mesh, evaluations: List[Evaluation],
                   cfg: Optional[EvaluatorConfig] = None) -> "Evaluator":
        """An evaluator over parameters already in memory (nothing is loaded)."""
        if cfg is not None:
            spec = dataclasses.replace(spec, cfg=cfg)
        return cls(spec, parts=Parts(model, variables, tokenizer, mesh), evaluations=evaluations)

    def build_evaluations(self) -> List[Evaluation]:
        c = self.cfg
        names = [n for n in (c.evals or "").split(",") if n.strip()]
        if not names and not c.data and not c.tasks:
            names = list(self.EVALUATION)
        evaluations = [builtin_evaluation(n.strip(), c.limit) for n in names]
        for item in c.data:
            kind, sep, path = item.partition(":")
            if not sep or not path:
                raise UsageError(f"--data {item!r} is not KIND:FILE (kinds: {', '.join(KINDS)})")
            dataset = JsonlDataset(kind, path, c.limit)
            if kind == "gen":
                evaluations.append(RolloutEvaluation(Path(path).stem, dataset, stop=stop_strings(c.stop)))
            else:
                evaluations.append(KIND_CLASSES[kind](Path(path).stem, dataset))
        seen = [e.name for e in evaluations]
        if len(set(seen)) != len(seen):
            raise UsageError(f"two evaluations share a name: {', '.join(seen)}")
        return evaluations

    def decoding(self) -> Dict[str, Any]:
        c = self.cfg
        return dict(max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_p=c.top_p, seed=c.seed)

    def evaluate(self, reduce: str = "mean", return_intermediates: bool = False, **kwargs: Any) -> Any:
        """{name: score} for every evaluation (kwargs such as temperature reach each one);
        with return_intermediates also {name: [(tokens, mask) per sample]}."""
        kwargs = {**self.decoding(), **kwargs}
        scores, intermediates = {}, {}
        for evaluation in self.evaluations:
            out = evaluation(self, self.tokenizer, reduce, return_intermediates, **kwargs)
            scores[evaluation.name], intermediates[evaluation.name] = (
                out if return_intermediates else (out, None))
        return (scores, intermediates) if return_intermediates else scores

    def run(self) -> None:
        """Evaluate, print a table, write results.json (and samples.jsonl) together, atomically.

        results.json records the run's fingerprint: a run whose results.json holds its own
        fingerprint is not redone, another run's is refused unless --force. Each finished
        evaluation is kept (RESUME_FILE) until the end, so the same command after an
        interruption computes only the evaluations still missing. --tasks run last, through
        lm-eval, in one piece; their scores join ours in results.json."""
        self.spec.check_out_dir(OUTPUT_FILES)
        fingerprint = self.fingerprint()
        kept = self.follow_process_0(fingerprint)
        if kept is None:
            self.say(f"{self.spec.path('results.json')} already holds this run; nothing to do (--force redoes it)")
            return
        if kept:
            self.say(f"resuming: {', '.join(kept)} kept from an interrupted try of this run")
        started, results = time.time(), []
        for position, evaluation in enumerate(self.evaluations):
            if evaluation.name in kept:
                results.append(kept[evaluation.name])
                continue
            results.append(evaluation.result(self, self.tokenizer, keep_rows=False, **self.decoding()))
            if position + 1 < len(self.evaluations) or self.cfg.tasks:
                self.keep(results, fingerprint)
        if results:
            self.say(table(results))
        tasks = self.run_tasks() if self.cfg.tasks else {}
        if self.spec.is_main:
            self.write_results(results, fingerprint, time.time() - started, tasks)

    def fingerprint(self) -> Dict[str, Any]:
        """What this run computes, as JSON: the weights, each evaluation's data, and every
        option that can change a score (all but UNSCORED_OPTIONS)."""
        options = {k: v for k, v in dataclasses.asdict(self.cfg).items() if k not in UNSCORED_OPTIONS}
        datasets = {e.name: dataset_fingerprint(e) for e in self.evaluations}
        if self.cfg.include_path is not None:
            datasets["--include-path"] = task_files_fingerprint(self.cfg.include_path)
        return json.loads(json.dumps({"model": self.model_fingerprint(), "datasets": datasets, "options": options}))

    def model_fingerprint(self) -> Dict[str, Any]:
        """A checkpoint: its path, and the size and hash of each file it is read from. Weights
        made here (fresh, from --seed) or handed over in memory: the model's fields and a
        hash of the parameters."""
        source = self.base.path if self.base is not None else self.cfg.ckpt  # `python jobs.py` gives no base
        if source is not None:
            directory = Path(source)
            files = {name: file_digest(directory / name, "checkpoint file") for name in checkpoint_files(directory)}
            return {"checkpoint": os.path.abspath(directory), "files": files}
        return {"checkpoint": None, "model": model_config(self.model), "sha256": parameters_digest(self.variables)}

    def follow_process_0(self, fingerprint: Dict[str, Any]) -> Optional[Dict[str, Optional[Result]]]:
        """Process 0 alone reads the output directory and decides (see plan); in a multi-process
        run the others learn its decision: refused, nothing to do, or which evaluations are
        kept (they skip those too, holding None for them)."""
        decision, refusal = None, None
        if self.spec.is_main:
            try:
                decision = plan(self.spec, fingerprint, self.cfg.force)
            except UsageError as e:
                refusal = e
        if jax.process_count() > 1:
            names = [e.name for e in self.evaluations]
            flags = [refusal is not None, decision is None] + [decision is not None and n in decision for n in names]
            flags = np.asarray(multihost_utils.broadcast_one_to_all(np.array(flags, np.int32)))
            if not self.spec.is_main and flags[0]:
                raise UsageError("process 0 refused this run (its error says why)")
            if not self.spec.is_main:
                decision = None if flags[1] else {n: None for n, kept in zip(names, flags[2:]) if kept}
        if refusal is not None:
            raise refusal
        return decision

    def keep(self, results: List[Result], fingerprint: Dict[str, Any]) -> None:
        """The finished evaluations so far, in RESUME_FILE (process 0 only, which holds them all)."""
        if self.spec.is_main:
            kept = {r.name: kept_form(r, self.cfg.log_samples) for r in results}
            self.spec.write_json(RESUME_FILE, {"fingerprint": fingerprint, "results": kept})

    def write_results(self, results: List[Result], fingerprint: Dict[str, Any], seconds: float,
                      tasks: Dict[str, Any]) -> None:
        """results.json and samples.jsonl together: neither is replaced unless both are written.
        Without --log-samples an earlier run's samples.jsonl is removed; so is RESUME_FILE.
        `tasks`: what lm-eval's tasks add to results.json (see run_tasks)."""
        samples = None
        if self.cfg.log_samples and results:
            samples = "".join(json.dumps(r) + "\n" for res in results for r in res.records).encode()
        summary = {**self.summary(results, seconds), "fingerprint": fingerprint}
        for key, entries in tasks.items():  # lm-eval's scores join ours
            summary[key] = {**summary.get(key, {}), **entries}
        self.spec.write_together({"samples.jsonl": samples, "results.json": (json.dumps(summary, indent=2) + "\n").encode(),
                                  RESUME_FILE: None})
        done = self.spec.path("results.json")
        self.say(f"results: {done}" + (f" and {self.spec.path('samples.jsonl')}" if samples else ""))

    def run_tasks(self) -> Dict[str, Any]:
        """--tasks through lm-eval: print its table, write its results file (and samples files),
        and return what results.json gains: its scores, the files' paths, its version."""
        started = time.time()
        lm = JaxLM(self, seed=self.cfg.seed)
        out = self.evaluate_tasks(lm)
        self.say(make_table(out) + ("\n" + make_table(out, "groups") if "groups" in out else ""))
        template = lm.chat_template(True) if self.cfg.apply_chat_template else None
        files = self.write_lm_eval_files(out, template, time.time() - started)
        self.say(f"lm-eval results: {self.spec.path(files['results'])}")
        return {**task_entries(out), "lm_eval": files, "versions": {"lm_eval": lm_eval.__version__}}

    def evaluate_tasks(self, lm: JaxLM) -> Dict[str, Any]:
        """lm-eval's simple_evaluate of --tasks on `lm`: its results dict (with "samples" under
        --log-samples), the same on every process."""
        c = self.cfg
        if c.apply_chat_template and not getattr(lm.tokenizer, "chat_template", None):
            raise UsageError(f"--apply-chat-template: the tokenizer of {c.ckpt or 'the fresh GPT'} "
                             "has no chat template")
        if c.quiet or not self.spec.is_main:
            logging.getLogger("lm_eval").setLevel(logging.ERROR)
        os.environ.setdefault("DISABLE_MULTIPROC", "1")  # else lm-eval's bootstrap forks this JAX process
        names = task_names(c.tasks)
        with hf_evaluate_importable():
            manager = task_manager(names, c.include_path)
            check_task_names(manager, names, c.include_path)
            lengths = {"max_gen_toks": c.max_new_tokens} if c.max_new_tokens else None  # over the tasks' own
            out = lm_eval.simple_evaluate(
                model=lm, tasks=names, task_manager=manager, num_fewshot=c.num_fewshot,
                fewshot_random_seed=c.fewshot_seed, apply_chat_template=c.apply_chat_template,
                fewshot_as_multiturn=c.apply_chat_template, limit=c.limit, log_samples=c.log_samples,
                bootstrap_iters=c.bootstrap_iters, gen_kwargs=lengths)
        mesh = "x".join(str(n) for n in self.mesh.shape.values())
        out["config"].update(model="gpt-eval", batch_size=self.batch_size, device=jax.default_backend(),
                             model_args={"pretrained": c.ckpt, "dtype": c.dtype, "mesh": mesh,
                                         "processes": jax.process_count()})
        return out

    def write_lm_eval_files(self, out: Dict[str, Any], chat_template: Optional[str],
                            seconds: float) -> Dict[str, Any]:
        """lm-eval's results file and, under --log-samples, one samples file per task, named
        and shaped as lm-eval writes them (OUT/lm_eval/<model>/results_<date>.json and
        samples_<task>_<date>.jsonl), but atomically, by process 0, the results file last.
        Their paths, relative to OUT."""
        model_name = self.cfg.ckpt or "fresh-gpt"
        results = results_file(out, model_name, chat_template, self.cfg.apply_chat_template, seconds)
        folder = Path("lm_eval") / results["model_name_sanitized"]
        date = datetime.now().isoformat().replace(":", "-")
        files: Dict[str, Any] = {"samples": {}}
        for task, rows in out.get("samples", {}).items():
            files["samples"][task] = str(folder / f"samples_{task}_{date}.jsonl")
            self.spec.write_text(files["samples"][task], "".join(sample_line(s) for s in rows))
        files["results"] = str(folder / f"results_{date}.json")
        self.spec.write_text(files["results"], json.dumps(results, indent=2, default=handle_non_serializable,
                                                          ensure_ascii=False) + "\n")
        return files

    def summary(self, results: List[Result], seconds: float) -> Dict[str, Any]:
        evaluations = {e.name: e for e in self.evaluations}
        return {
            "job": self.spec.name, "project": self.spec.project, "group": self.spec.group,
            "results": {r.name: r.value for r in results},
            "higher_is_better": {r.name: evaluations[r.name].higher_is_better for r in results},
            "n_samples": {r.name: len(r.scores) for r in results},
            "stderr": {r.name: r.stderr for r in results},
            "kind": {r.name: r.kind for r in results},
            "metrics": {r.name: r.metrics for r in results},
            "model": model_config(self.model), "checkpoint": self.cfg.ckpt,
            "mesh": dict(self.mesh.shape), "processes": jax.process_count(),
            "config": dataclasses.asdict(self.cfg), "seconds": round(seconds, 3),
            "versions": {"jax": jax.__version__, "python": sys.version.split()[0]},
        }

    def say(self, text: str) -> None:
        if self.spec.is_main and not self.cfg.quiet:
            print(text, file=sys.stderr)


def table(results: List[Result]) -> str:
    lines = [f"{'evaluation':16s} {'kind':4s} {'n':>6s} {'score':>10s} {'stderr':>9s}"]
    for r in results:
        lines.append(f"{r.name:16s} {r.kind:4s} {len(r.scores):6d} {r.value:10.4f} {r.stderr:9.4f}")
    return "\n".join(lines)


@job("gpt/evaluate")
class Evaluate(Evaluator):
    """Evaluate initialized or restored GPT weights with a declared EVALUATION."""

    def load(self, mesh):
        c = self.cfg
        if c.ckpt:
            model, variables, config = load_checkpoint(c.ckpt, mesh, c.dtype)
            return model, variables, load_tokenizer(config, c.ckpt)
        model = gpt.GPT(param_dtype=c.dtype, activation_dtype=c.dtype)
        return model, gpt.init_params(model, mesh, self.spec.seed), ByteTokenizer()


@job("backbone/evaluate")
class BackboneEvaluate(Evaluator):
    """Evaluate HuggingFace weights or a native checkpoint based on that model."""

    def load(self, mesh):
        c = self.cfg
        if not c.ckpt:
            raise UsageError("backbone/evaluate needs --ckpt (a HuggingFace or native directory)")
        if Node(c.ckpt).is_native:
            model, variables, config = load_checkpoint(c.ckpt, mesh, c.dtype)
            return model, variables, load_tokenizer(config, c.ckpt)
        model, host = load_backbone(c.ckpt, c.dtype)
        return model, gpt.place_params(model, mesh, host), HFTokenizer(c.ckpt)


# ----------------------------------------------------------------------------- command line


def start_processes(cfg: EvaluatorConfig) -> None:
    """Join a multi-process (multi-host) run; on CPU the collectives go through gloo."""
    if cfg.num_processes > 1 or cfg.coordinator:
        # must happen before anything touches a device; the setting only affects CPU devices
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=cfg.coordinator, num_processes=cfg.num_processes,
                                   process_id=cfg.process_id)


def evaluate_command(argv: List[str]) -> None:
    """`python evaluate.py ...`: a HuggingFace directory goes to BackboneEvaluate, a native
    checkpoint or nothing (fresh weights) to Evaluate."""
    cfg = parse_options(EvaluatorConfig, argv)
    cfg.validate()
    start_processes(cfg)
    hf = cfg.ckpt is not None and Path(cfg.ckpt).is_dir() and not Node(cfg.ckpt).is_native
    cls = BackboneEvaluate if hf else Evaluate
    spec = ExecutionSpec(name=cls.KEY, out_dir=cfg.out, mesh=cfg.mesh, seed=cfg.seed, cfg=cfg)
    cls(spec, Node(cfg.ckpt) if cfg.ckpt else None).run()


def main(argv: List[str]) -> int:
    return exit_status(lambda: evaluate_command(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
