"""The evaluation harness: perplexity, multiple choice, generation, next-token accuracy.

    python evaluate.py                                   # fresh default GPT on the built-in suite (CPU, <1 min)
    python evaluate.py --ckpt runs/train                 # a native checkpoint (python train.py)
    python evaluate.py --ckpt DIR --data ppl:wiki.jsonl  # a HuggingFace model directory on your own data

Reading order: options -> datasets (JSONL checked line by line, and the built-in ones)
-> Evaluation (the seed's ABC) and its four kinds -> InferenceJob (requests in fixed-shape
blocks, one jitted lax.scan per block, the KV-cache rollout) -> Evaluator, Evaluate,
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

import dataclasses
import itertools
import json
import math
import re
import sys
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import gpt
from hf import export_gpt2, load_backbone  # noqa: F401  (load_backbone: part of the seed API here)
from jobs import (ByteTokenizer, ExecutionSpec, HFTokenizer, Node, UsageError, builtin_items, exit_status,
                  is_eval_item, job, load_checkpoint, load_tokenizer, model_config, option, parse_options)


@dataclasses.dataclass
class EvaluatorConfig:
    """Options of `python evaluate.py` (the jobs gpt/evaluate and backbone/evaluate)."""

    ckpt: Optional[str] = option(None, "checkpoint directory: native (python train.py) or HuggingFace; "
                                       "none: fresh default GPT weights")
    evals: Optional[str] = option(None, "comma-separated built-in evaluations (text, grammar, addition, "
                                        "repeat); default: all of them when no --data is given")
    data: List[str] = option([], "KIND:FILE, a JSONL dataset of kind ppl, mc, gen or acc (repeatable)")
    out: str = option("runs/eval", "output directory for results.json (and samples.jsonl)")
    batch_size: int = option(8, "sequences per forward pass, rounded up to a multiple of the data-parallel size")
    mesh: Optional[str] = option(None, "device mesh BATCHxSHARD (default: every device on batch)")
    limit: Optional[int] = option(None, "evaluate only the first N samples of each evaluation")
    max_new_tokens: Optional[int] = option(None, "generation length (default: each evaluation's own)")
    temperature: float = option(0.0, "sampling temperature for generation (0: greedy)")
    top_p: float = option(1.0, "nucleus sampling: keep the smallest set of tokens with this much probability")
    stop: List[str] = option(["\n"], "stop string of --data gen files (repeatable; \\n and \\t as escapes; "
                                     "'' for none); a line's own \"until\" list wins")
    seed: int = option(0, "fresh weights and sampling")
    log_samples: bool = option(False, "also write samples.jsonl, one line per sample")
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
        if self.mesh is not None:
            try:
                gpt.parse_mesh(self.mesh)
            except ValueError as e:
                raise UsageError(f"--mesh: {e}") from None


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def stop_strings(options: List[str]) -> Tuple[str, ...]:
    """--stop values as stop strings: \\n, \\t, \\r and \\\\ unescaped (a shell passes them
    literally), empty values dropped (so --stop '' means none)."""
    unescaped = (re.sub(r"\\(.)", lambda m: ESCAPES.get(m.group(1), m.group(0)), s) for s in options)
    return tuple(s for s in unescaped if s)


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
        if not self.path.is_file():
            raise UsageError(f"--data {kind}:{path}: file does not exist")
        self.count = sum(1 for _ in self._read())  # validates every line
        if self.count == 0:
            raise UsageError(f"{path}: empty dataset (no JSON lines)")

    def _read(self) -> Iterator[Dict[str, Any]]:
        with open(self.path, "rb") as f:
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
    if not isinstance(sample, dict):
        raise UsageError(f"{where}: expected a JSON object")
    for field, kind_type in KINDS[kind].items():
        if field not in sample:
            raise UsageError(f"{where}: missing field {field!r}")
        value = sample[field]
        if not isinstance(value, kind_type) or isinstance(value, bool):
            raise UsageError(f"{where}: field {field!r} must be {kind_type.__name__}")
    if kind == "mc":
        choices = sample["choices"]
        if len(choices) < 2 or not all(isinstance(c, str) for c in choices):
            raise UsageError(f"{where}: 'choices' must be a list of at least two strings")
        if not 0 <= sample["gold"] < len(choices):
            raise UsageError(f"{where}: 'gold' {sample['gold']} is out of range for {len(choices)} choices")
    if kind == "gen" and "until" in sample:  # optional: this line's own stop strings
        until = sample["until"]
        if not isinstance(until, list) or not all(isinstance(s, str) for s in until):
            raise UsageError(f"{where}: 'until' must be a list of strings")
    return sample


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


def bucket(n: int, cap: int, smallest: int = 16) -> int:
    """The next power of two >= n (at least `smallest`, at most `cap`): few distinct shapes."""
    return min(cap, max(smallest, 1 << max(n - 1, 0).bit_length()))


class Parts(NamedTuple):
    """What an InferenceJob runs: a model, its parameters on the mesh, a tokenizer, the mesh."""

    model: gpt.GPT
    variables: Any
    tokenizer: Any
    mesh: jax.sharding.Mesh


class InferenceJob:
    """Holds the model, its sharded parameters, the mesh and the tokenizer, and runs requests.

    How work reaches the devices: requests are padded into host blocks [chunks, batch,
    length] (left padding, length rounded up to a power of two, so there are few shapes and
    so few compilations). A block's batch dimension is split over the mesh's "batch" axis
    (the model's sharding plan maps the logical "batch" to it) and replicated over "shard",
    where the parameters are split instead. jax.make_array_from_callback asks each process
    only for the slices its own devices hold, so with several hosts no process uploads the
    whole block. One jitted call scans over the chunks (only one chunk's logits exist at a
    time); its outputs are replicated, so every process reads every score.
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

    def pad(self, rows: List[List[int]], length: int, count: int) -> Tuple[np.ndarray, np.ndarray]:
        """Left-pad `rows` to [count, length] tokens and a mask (True at real tokens)."""
        tokens = np.zeros((count, length), np.int32)
        mask = np.zeros((count, length), bool)
        for i, row in enumerate(rows):
            if row:
                tokens[i, length - len(row):] = row
                mask[i, length - len(row):] = True
        return tokens, mask

    def put(self, block: np.ndarray) -> jax.Array:
        """A host block [chunks, batch, ...] onto the mesh, its batch split over "batch"."""
        sharding = gpt.input_sharding(self.model, self.mesh, (None, "batch") + (None,) * (block.ndim - 2))
        return jax.make_array_from_callback(block.shape, sharding, lambda index: block[index])

    def blocks(self, items: Iterator[Any]) -> Iterator[Tuple[List[Any], int, int]]:
        """Group items into blocks of chunks x batch_size, the chunk count a power of two."""
        per_block = self.batch_size * self.cfg.chunks
        while True:
            group = list(itertools.islice(items, per_block))
            if not group:
                return
            chunks = bucket(-(-len(group) // self.batch_size), self.cfg.chunks, smallest=1)
            yield group, chunks, self.batch_size

    # --- the jitted kernels

    def forward(self, tokens: jax.Array, mask: jax.Array, variables: Any = None) -> jax.Array:
        """Logits [B, T, V] for left-padded tokens (mask True at real ones); no dropout."""
        variables = self.variables if variables is None else variables
        logits_BTV, _ = self.model.apply(variables, tokens, padding_mask=mask, deterministic=True)
        return logits_BTV

    def _score_block(self, variables, tokens_CBT, targets_CBT, weights_CBT, mask_CBT):
        """Per row of a [chunks, batch, length] block: summed log-probability of the weighted
        targets, how many of them are the argmax, and how many there are. One lax.scan over
        the chunks, so only one chunk's logits [batch, length, vocab] exist at a time."""
        def one_chunk(_, chunk):
            tokens_BT, targets_BT, weights_BT, mask_BT = chunk
            logits_BTV = self.forward(tokens_BT, mask_BT, variables)
            logprob_BT = jnp.where(weights_BT, -gpt.token_nll(logits_BTV, targets_BT), 0.0)
            correct_BT = (jnp.argmax(logits_BTV, -1) == targets_BT) & weights_BT
            return None, (logprob_BT.sum(-1), correct_BT.sum(-1), weights_BT.sum(-1))

        return jax.lax.scan(one_chunk, None, (tokens_CBT, targets_CBT, weights_CBT, mask_CBT))[1]

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
        """(request, its Scored) for each request, in order, streamed block by block. A
        request with an empty continuation has nothing to score and is not run."""
        for group, chunks, batch in self.blocks(iter(requests)):
            scored = self.score_block([r for r in group if r.continuation], chunks, batch, keep_rows)
            for request in group:
                yield request, next(scored) if request.continuation else Scored(0.0, 0, 0)

    def score_block(self, requests: List[Request], chunks: int, batch: int, keep_rows: bool) -> Iterator[Scored]:
        """Run one block of requests: the last max_len + 1 tokens of context + continuation
        minus the last one go in, the continuation's tokens are scored."""
        if not requests:
            return
        rows = []
        for r in requests:
            if len(r.continuation) > self.max_len:
                raise UsageError(f"a continuation of {len(r.continuation)} tokens does not fit "
                                 f"the context of {self.max_len}")
            whole = (r.context + r.continuation)[-(self.max_len + 1):]
            rows.append((whole[:-1], whole[1:], len(r.continuation)))
        length = bucket(max(len(inputs) for inputs, _, _ in rows), self.max_len)
        n = chunks * batch
        tokens, mask = self.pad([inputs for inputs, _, _ in rows], length, n)
        targets, _ = self.pad([targets for _, targets, _ in rows], length, n)
        weights = np.zeros((n, length), bool)
        for i, (_, _, k) in enumerate(rows):
            weights[i, length - k:] = True
        shape = (chunks, batch, length)
        out = self._score(self.variables, *(self.put(a.reshape(shape)) for a in (tokens, targets, weights, mask)))
        logprob, correct, count = (np.asarray(o).reshape(-1) for o in out)
        for i in range(len(rows)):
            yield Scored(float(logprob[i]), int(count[i]), int(correct[i]),
                         (tokens[i], mask[i]) if keep_rows else None)

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
        so the same seed gives the same text at any batch size or mesh."""
        room = self.max_len - n_new
        if room < 1:
            raise UsageError(f"--max-new-tokens {n_new} leaves no room in the context of {self.max_len}")
        eos = self.tokenizer.eos_token_id
        run = self._generator(n_new, temperature, top_p)
        for group, chunks, batch in self.blocks(iter(requests)):
            cut = [r.prompt[-room:] for r in group]
            length = bucket(max(len(c) for c in cut), room, smallest=8)
            n = chunks * batch
            tokens, mask = self.pad(cut, length, n)
            ids = np.zeros(n, np.int32)
            ids[:len(group)] = [r.doc for r in group]
            shape = (chunks, batch, length)
            new = np.asarray(run(self.variables, self.put(tokens.reshape(shape)), self.put(mask.reshape(shape)),
                                 self.put(ids.reshape(chunks, batch)),
                                 self.spec.seed if seed is None else seed)).reshape(n, n_new)
            for i, request in enumerate(group):
                out = new[i].tolist()
                out = out[:out.index(eos)] if eos is not None and eos in out else out
                text = cut_at_stop(self.tokenizer.decode(out), request.until)
                yield request, Generation(text, out, len(request.prompt) > room,
                                          (tokens[i], mask[i]) if keep_rows else None)

    def progress(self, items: Iterator[Any], name: str, total: int) -> Iterator[Any]:
        """A tqdm bar on stderr (samples done, samples/s); off with --quiet or no terminal."""
        quiet = self.cfg.quiet or not sys.stderr.isatty() or not self.spec.is_main
        return tqdm(items, desc=name, total=total, unit="sample", disable=quiet, leave=False)


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
        if not names and not c.data:
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
        """Evaluate, print a table, write results.json (and samples.jsonl) atomically.
        A finished job (a complete results.json) is not redone unless --force."""
        done = self.spec.path("results.json")
        if done.exists() and not self.cfg.force and is_complete(done):
            self.say(f"{done} already exists; nothing to do (use --force to redo)")
            return
        self.spec.check_out_dir()
        started = time.time()
        results = [e.result(self, self.tokenizer, keep_rows=False, **self.decoding())
                   for e in self.evaluations]
        self.say(table(results))
        if self.cfg.log_samples:
            lines = (json.dumps(r) for res in results for r in res.records)
            self.spec.write_text("samples.jsonl", "".join(line + "\n" for line in lines))
        self.spec.write_json("results.json", self.summary(results, time.time() - started))
        self.say(f"results: {done}" + (f" and {self.spec.path('samples.jsonl')}" if self.cfg.log_samples else ""))

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


def is_complete(path: Path) -> bool:
    try:
        return "results" in json.loads(path.read_text())
    except (json.JSONDecodeError, OSError, UnicodeDecodeError):
        return False


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
