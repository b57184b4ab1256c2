"""The evaluation harness: perplexity, multiple choice, generation, next-token accuracy.

    python evaluate.py                                   # fresh default GPT on the built-in suite (CPU, <1 min)
    python evaluate.py --ckpt runs/train                 # a native checkpoint (python jobs.py gpt/train/pretrain)
    python evaluate.py --ckpt DIR --data ppl:wiki.jsonl  # a HuggingFace model directory on your own data

Reading order: options -> datasets (JSONL checked line by line, and the built-in ones)
-> Evaluation (the seed's ABC) and its four kinds -> InferenceJob (padding to fixed
shapes, one jitted lax.scan over chunks per call, rollout with the KV cache) -> Evaluator,
Evaluate, BackboneEvaluate -> HuggingFace backbones -> the command line.

Every score is computed from "requests" (context tokens, continuation tokens): the
log-likelihood of the continuation given the context, as lm-evaluation-harness does.
Perplexity and next-token accuracy cut documents into rolling windows of requests;
multiple choice makes one request per choice; generation runs the KV-cache decoder.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import sys
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import gpt
from jobs import (ByteTokenizer, ExecutionSpec, HFTokenizer, Node, UsageError, builtin_items,
                  is_eval_item, job, load_checkpoint, load_tokenizer, parse_options, read_config,
                  save_checkpoint)


@dataclasses.dataclass
class EvaluatorConfig:
    """Options of `python evaluate.py` (see ../shared/CONTRACT.md)."""

    ckpt: Optional[str] = None
    evals: Optional[str] = None  # comma-separated built-in names
    data: List[str] = dataclasses.field(default_factory=list)  # KIND:FILE, repeatable
    out: str = "runs/eval"
    batch_size: int = 8
    mesh: Optional[str] = None
    limit: Optional[int] = None
    max_new_tokens: Optional[int] = None  # None: each evaluation's own default
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    log_samples: bool = False
    force: bool = False
    dtype: str = "float32"
    quiet: bool = False
    chunks: int = 16  # batches scanned inside one jitted call
    coordinator: Optional[str] = None
    num_processes: int = 1
    process_id: int = 0

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
    return sample


def builtin_dataset(name: str, size: int) -> List[Dict[str, Any]]:
    """The held-out items of a built-in task, in the contract's JSONL shapes."""
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
        if not all(math.isfinite(x) for x in [value, *self.score(scored)]):
            raise UsageError(f"evaluation {self.name}: non-finite score (broken weights?)")
        metrics["skipped"] = len(records) - len(scored)
        return Result(self.name, self.kind, value, stderr, np.array(self.score(scored)), records,
                      metrics, rows)

    def __call__(self, inference, encoding, reduce="mean", return_intermediates=False, **kwargs):
        """reduce: "mean" -> the aggregate (token-weighted for ppl/acc), "sum" -> sum of the
        per-sample scores, "none" -> the per-sample scores as a numpy array."""
        if reduce not in ("mean", "sum", "none"):
            raise ValueError(f"reduce must be mean, sum or none, got {reduce!r}")
        result = self.result(inference, encoding, keep_rows=return_intermediates, **kwargs)
        out = {"mean": result.value, "sum": float(result.scores.sum()), "none": result.scores}[reduce]
        return (out, result.intermediates) if return_intermediates else out


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


class PerplexityEvaluation(DatasetEvaluation):
    """Token-weighted perplexity exp(sum nll / sum tokens) of each `text`; lower is better."""

    kind, higher_is_better = "ppl", False

    def requests(self, inference, encoding):
        for sample in self.dataset:
            tokens = encoding.encode(sample["text"])
            nbytes = len(sample["text"].encode("utf-8"))
            yield rolling_requests(tokens, inference.prefix_id, inference.max_len), nbytes

    def records(self, inference, encoding, keep_rows, **kwargs):
        docs = self.requests(inference, encoding)
        for index, (nbytes, results) in enumerate(inference.score_documents(docs, keep_rows)):
            nll = -sum(r.logprob for r in results)
            tokens = sum(r.tokens for r in results)
            if tokens == 0:
                yield {"eval": self.name, "index": index, "skipped": True, "score": None}, None
                continue
            yield ({"eval": self.name, "index": index, "score": math.exp(nll / tokens), "nll": nll,
                    "tokens": tokens, "bytes": nbytes}, rows_of(results))

    def aggregate(self, records):
        nll = np.array([r["nll"] for r in records])
        tokens = np.array([r["tokens"] for r in records], np.float64)
        rate = nll.sum() / tokens.sum()
        n = len(records)  # delta-method standard error of the ratio estimator, then of exp()
        se_rate = math.sqrt(((nll - rate * tokens) ** 2).sum() * n / max(n - 1, 1)) / tokens.sum()
        bpb = nll.sum() / (math.log(2) * sum(r["bytes"] for r in records))
        return math.exp(rate), math.exp(rate) * se_rate, {"bits_per_byte": bpb,
                                                          "tokens": int(tokens.sum())}


class AccuracyEvaluation(PerplexityEvaluation):
    """Next-token accuracy: the share of tokens where the argmax prediction is right
    (token-weighted over all documents, every token scored once in rolling windows)."""

    kind, higher_is_better = "acc", True

    def records(self, inference, encoding, keep_rows, **kwargs):
        docs = self.requests(inference, encoding)
        for index, (_, results) in enumerate(inference.score_documents(docs, keep_rows)):
            correct = sum(r.correct for r in results)
            tokens = sum(r.tokens for r in results)
            if tokens == 0:
                yield {"eval": self.name, "index": index, "skipped": True, "score": None}, None
                continue
            yield ({"eval": self.name, "index": index, "score": correct / tokens, "correct": correct,
                    "tokens": tokens}, rows_of(results))

    def aggregate(self, records):
        correct = np.array([r["correct"] for r in records], np.float64)
        tokens = np.array([r["tokens"] for r in records], np.float64)
        value, n = correct.sum() / tokens.sum(), len(records)
        se = math.sqrt(((correct - value * tokens) ** 2).sum() * n / max(n - 1, 1)) / tokens.sum()
        return float(value), float(se), {"tokens": int(tokens.sum())}


def encode_pair(encoding: Any, context: str, continuation: str) -> Tuple[List[int], List[int]]:
    """lm-evaluation-harness's split: trailing spaces of the context move to the continuation,
    the whole string is encoded, and the continuation is what follows the context's tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = encoding.encode(context + continuation)
    context_ids = encoding.encode(context)
    return context_ids, whole[len(context_ids):]


class MultipleChoiceEvaluation(DatasetEvaluation):
    """Accuracy of picking `gold` by the highest summed log-likelihood of each choice
    (acc; the first index wins ties). acc_norm divides by the choice's length in characters."""

    kind = "mc"

    def requests(self, inference, encoding):
        for sample in self.dataset:
            pairs = [encode_pair(encoding, sample["context"], c) for c in sample["choices"]]
            yield [(ctx or [inference.prefix_id], cont) for ctx, cont in pairs], sample

    def records(self, inference, encoding, keep_rows, **kwargs):
        docs = self.requests(inference, encoding)
        for index, (sample, results) in enumerate(inference.score_documents(docs, keep_rows)):
            loglik = [r.logprob for r in results]
            normed = [ll / max(len(c), 1) for ll, c in zip(loglik, sample["choices"])]
            pred, pred_norm = int(np.argmax(loglik)), int(np.argmax(normed))
            yield ({"eval": self.name, "index": index, "score": float(pred == sample["gold"]),
                    "loglik": loglik, "pred": pred, "gold": sample["gold"],
                    "acc_norm": float(pred_norm == sample["gold"])}, rows_of(results))

    def aggregate(self, records):
        value, stderr, metrics = super().aggregate(records)
        metrics["acc_norm"] = float(np.mean([r["acc_norm"] for r in records]))
        return value, stderr, metrics


class RolloutEvaluation(DatasetEvaluation):
    """Exact match of the generated answer (greedy by default) after stripping whitespace.

    Decoding stops at EOS, at a stop string (default "\\n") or at max_new_tokens; prompts
    longer than the room left in the context are cut from the left and counted."""

    kind = "gen"

    def __init__(self, name, dataset, max_new_tokens: int = 32, stop: Sequence[str] = ("\n",)):
        super().__init__(name, dataset)
        self.max_new_tokens, self.stop = max_new_tokens, tuple(stop)

    def records(self, inference, encoding, keep_rows, max_new_tokens=None, temperature=0.0,
                top_p=1.0, seed=0, **kwargs):
        n_new = max_new_tokens or self.max_new_tokens
        prompts = ((s, encoding.encode(s["prompt"]) or [inference.prefix_id]) for s in self.dataset)
        outputs = inference.rollout(prompts, n_new, temperature, top_p, seed, keep_rows)
        for index, (sample, new_ids, truncated, row) in enumerate(outputs):
            text = cut_at_stop(encoding.decode(new_ids), self.stop)
            yield ({"eval": self.name, "index": index,
                    "score": float(text.strip() == sample["answer"].strip()), "output": text,
                    "answer": sample["answer"], "truncated": truncated}, row)

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


@dataclasses.dataclass
class Scored:
    """One request's outcome: summed log-probability of the continuation, its token count,
    how many of its tokens were the argmax prediction, and the padded row that was run."""

    logprob: float
    tokens: int
    correct: int
    row: Any = None


def rows_of(results: List[Scored]) -> Any:
    rows = [r.row for r in results if r.row is not None]
    if not rows:
        return None
    return np.stack([t for t, _ in rows]), np.stack([m for _, m in rows])


def bucket(n: int, cap: int, smallest: int = 16) -> int:
    """The next power of two >= n (at least `smallest`, at most `cap`): few distinct shapes."""
    return min(cap, max(smallest, 1 << max(n - 1, 0).bit_length()))


class InferenceJob:
    """Holds the model, its sharded parameters, the mesh and the tokenizer, and runs them.

    Work arrives as fixed-shape blocks [chunks, batch, length] (left-padded); one jitted
    call scans over the chunks, so a whole block costs one dispatch and one compilation
    per shape. The batch axis is split over the mesh's "batch" axis.
    """

    def __init__(self, spec: ExecutionSpec, base: Optional[Node] = None):
        self.spec, self.base = spec, base
        self.args: EvaluatorConfig = spec.config or EvaluatorConfig()
        mesh = spec.make_mesh()
        model, variables, tokenizer = self.load(mesh)
        self.attach(model, variables, tokenizer, mesh)

    def load(self, mesh: jax.sharding.Mesh) -> Tuple[gpt.GPT, Any, Any]:
        raise NotImplementedError

    def attach(self, model: gpt.GPT, variables: Any, tokenizer: Any, mesh: jax.sharding.Mesh) -> None:
        self.model, self.variables, self.tokenizer, self.mesh = model, variables, tokenizer, mesh
        if tokenizer.vocab_size > model.vocab_size:
            raise UsageError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's embedding "
                             f"has only {model.vocab_size}")
        self.dp = mesh.shape["batch"]
        self.block_sharding = NamedSharding(mesh, PartitionSpec(None, "batch"))
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self._score = jax.jit(self._score_block, out_shardings=self.replicated)
        self._generators: Dict[Tuple, Callable] = {}

    # --- sizes and padding

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
        return -(-self.args.batch_size // self.dp) * self.dp

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
        """A host block [chunks, batch, ...] onto the mesh, batch split over "batch".
        With several processes each one copies only the slices its own devices hold."""
        return jax.make_array_from_callback(block.shape, self.block_sharding, lambda i: block[i])

    def blocks(self, items: Iterator[Any]) -> Iterator[Tuple[List[Any], int, int]]:
        """Group items into blocks of chunks x batch_size, the chunk count a power of two."""
        per_block = self.batch_size * self.args.chunks
        while True:
            group = list(itertools.islice(items, per_block))
            if not group:
                return
            chunks = bucket(-(-len(group) // self.batch_size), self.args.chunks, smallest=1)
            yield group, chunks, self.batch_size

    # --- the jitted kernels

    def forward(self, tokens: jax.Array, mask: jax.Array) -> jax.Array:
        """Logits [B, T, V] for left-padded tokens; no dropout."""
        logits, _ = self.model.apply(self.variables, tokens, padding_mask=mask, deterministic=True)
        return logits

    def _score_block(self, variables, tokens_CBT, targets_CBT, weights_CBT, mask_CBT):
        def one_chunk(_, chunk):
            tokens, targets, weights, mask = chunk
            logits, _ = self.model.apply(variables, tokens, padding_mask=mask, deterministic=True)
            logprob = jnp.where(weights, -gpt.token_nll(logits, targets), 0.0)
            correct = (jnp.argmax(logits, -1) == targets) & weights
            return None, (logprob.sum(-1), correct.sum(-1), weights.sum(-1))

        return jax.lax.scan(one_chunk, None, (tokens_CBT, targets_CBT, weights_CBT, mask_CBT))[1]

    def score_requests(self, requests: Iterator[Tuple[List[int], List[int]]],
                       keep_rows: bool = False) -> Iterator[Scored]:
        """Log-likelihood of each continuation given its context, in order, streamed."""
        for group, chunks, batch in self.blocks(requests):
            rows = []
            for context, continuation in group:
                if len(continuation) > self.max_len:
                    raise UsageError(f"a continuation of {len(continuation)} tokens does not fit "
                                     f"the context of {self.max_len}")
                whole = (context + continuation)[-(self.max_len + 1):]
                rows.append((whole[:-1], whole[1:], len(continuation)))
            length = bucket(max(len(r[0]) for r in rows), self.max_len)
            n = chunks * batch
            tokens, mask = self.pad([r[0] for r in rows], length, n)
            targets, _ = self.pad([r[1] for r in rows], length, n)
            weights = np.zeros((n, length), bool)
            for i, (_, _, k) in enumerate(rows):
                weights[i, length - k:] = True
            shape = (chunks, batch, length)
            out = self._score(self.variables, *(self.put(a.reshape(shape))
                                                for a in (tokens, targets, weights, mask)))
            logprob, correct, count = (np.asarray(o).reshape(-1) for o in out)
            for i in range(len(rows)):
                row = (tokens[i], mask[i]) if keep_rows else None
                yield Scored(float(logprob[i]), int(count[i]), int(correct[i]), row)

    def score_documents(self, documents: Iterator[Tuple[List[Tuple[List[int], List[int]]], Any]],
                        keep_rows: bool = False) -> Iterator[Tuple[Any, List[Scored]]]:
        """For each (requests, payload): (payload, the requests' results), in order, streamed.
        Requests of many documents share blocks; documents with no requests get []."""
        pending: List[Tuple[Any, int]] = []

        def flatten() -> Iterator[Tuple[List[int], List[int]]]:
            for requests, payload in documents:
                pending.append((payload, len(requests)))
                yield from requests

        results = self.score_requests(flatten(), keep_rows)
        while True:
            first = next(results, None)  # pulls a block, which queues its documents in pending
            while pending and pending[0][1] == 0:
                yield pending.pop(0)[0], []
            if first is None:
                return
            payload, n = pending.pop(0)
            yield payload, [first] + list(itertools.islice(results, n - 1))

    def _generator(self, n_new: int, temperature: float, top_p: float) -> Callable:
        """A jitted rollout of a block [chunks, batch, prompt_len], one per decoding setting."""
        key = (n_new, temperature, top_p)
        if key not in self._generators:
            eos = self.tokenizer.eos_token_id

            def run(variables, prompts_CBP, mask_CBP, sample_ids_CB, seed):
                def one_chunk(_, chunk):
                    prompts, mask, ids = chunk
                    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(ids)
                    new = gpt.generate(self.model, variables, prompts, mask, n_new, eos,
                                       temperature, top_p, keys)
                    return None, new

                return jax.lax.scan(one_chunk, None, (prompts_CBP, mask_CBP, sample_ids_CB))[1]

            self._generators[key] = jax.jit(run, out_shardings=self.replicated)
        return self._generators[key]

    def rollout(self, prompts: Iterator[Tuple[Any, List[int]]], n_new: int, temperature: float,
                top_p: float, seed: int, keep_rows: bool = False) -> Iterator[Tuple[Any, List[int], bool, Any]]:
        """Generate up to n_new tokens after each prompt: (payload, new ids cut at EOS,
        whether the prompt was cut, the prompt row). Sampling keys depend on the sample's
        index only, so the same seed gives the same text at any batch size or mesh."""
        room = self.max_len - n_new
        if room < 1:
            raise UsageError(f"--max-new-tokens {n_new} leaves no room in the context of {self.max_len}")
        eos = self.tokenizer.eos_token_id
        run = self._generator(n_new, temperature, top_p)
        index = 0
        for group, chunks, batch in self.blocks(prompts):
            cut = [ids[-room:] for _, ids in group]
            length = bucket(max(len(c) for c in cut), room, smallest=8)
            n = chunks * batch
            tokens, mask = self.pad(cut, length, n)
            ids = np.arange(index, index + n, dtype=np.int32)
            shape = (chunks, batch, length)
            new = np.asarray(run(self.variables, self.put(tokens.reshape(shape)),
                                 self.put(mask.reshape(shape)), self.put(ids.reshape(chunks, batch)),
                                 self.spec.seed if seed is None else seed)).reshape(n, n_new)
            for i, (payload, original) in enumerate(group):
                out = new[i].tolist()
                out = out[:out.index(eos)] if eos is not None and eos in out else out
                row = (tokens[i], mask[i]) if keep_rows else None
                yield payload, out, len(original) > room, row
            index += len(group)

    def progress(self, items: Iterator[Any], name: str, total: int) -> Iterator[Any]:
        """A tqdm bar on stderr (samples done, samples/s); off with --quiet or no terminal."""
        from tqdm import tqdm

        quiet = self.args.quiet or not sys.stderr.isatty() or not self.spec.is_main
        return tqdm(items, desc=name, total=total, unit="sample", disable=quiet, leave=False)


# ----------------------------------------------------------------------------- evaluators


class Evaluator(InferenceJob):
    """InferenceJob that runs evaluations and saves results."""

    CONFIG = EvaluatorConfig
    EVALUATION: List[str] = list(BUILTIN)  # names of the built-in evaluations it runs

    def __init__(self, spec: ExecutionSpec, base: Optional[Node] = None):
        super().__init__(spec, base)
        self.evaluations = self.build_evaluations()

    @classmethod
    def config(cls, evaluations: Optional[List[type]] = None) -> List[type]:
        """The evaluator's options and those of every evaluation kind it holds."""
        kinds = evaluations if evaluations is not None else list(KIND_CLASSES.values())
        return [cls.CONFIG] + [schema for kind in kinds for schema in kind.config()]

    @classmethod
    def from_trainer(cls, trainer: Any) -> "Evaluator":
        """An evaluator over a trainer's live model and parameters, on the trainer's mesh,
        running the trainer's declared EVALUATION."""
        self = cls.__new__(cls)
        self.spec, self.base = trainer.spec, None
        self.args = EvaluatorConfig(quiet=True, seed=trainer.spec.seed)
        self.attach(trainer.model, trainer.variables, trainer.tokenizer, trainer.mesh)
        self.evaluations = [builtin_evaluation(name) for name in trainer.EVALUATION]
        return self

    def build_evaluations(self) -> List[Evaluation]:
        a = self.args
        names = [n for n in (a.evals or "").split(",") if n.strip()]
        if not names and not a.data:
            names = list(self.EVALUATION)
        evaluations = [builtin_evaluation(n.strip(), a.limit) for n in names]
        for item in a.data:
            kind, sep, path = item.partition(":")
            if not sep or not path:
                raise UsageError(f"--data {item!r} is not KIND:FILE (kinds: {', '.join(KINDS)})")
            dataset = JsonlDataset(kind, path, a.limit)
            evaluations.append(KIND_CLASSES[kind](Path(path).stem, dataset))
        seen = [e.name for e in evaluations]
        if len(set(seen)) != len(seen):
            raise UsageError(f"two evaluations share a name: {', '.join(seen)}")
        return evaluations

    def decoding(self) -> Dict[str, Any]:
        a = self.args
        return dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                    seed=a.seed)

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
        if done.exists() and not self.args.force and is_complete(done):
            self.say(f"{done} already exists; nothing to do (use --force to redo)")
            return
        started = time.time()
        results = [e.result(self, self.tokenizer, keep_rows=False, **self.decoding())
                   for e in self.evaluations]
        self.say(table(results))
        if self.args.log_samples:
            lines = (json.dumps(r) for res in results for r in res.records)
            self.spec.write_text("samples.jsonl", "".join(line + "\n" for line in lines))
        self.spec.write_json("results.json", self.summary(results, time.time() - started))

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
            "model": gpt_fields(self.model), "checkpoint": self.args.ckpt,
            "mesh": dict(self.mesh.shape), "processes": jax.process_count(),
            "config": dataclasses.asdict(self.args), "seconds": round(seconds, 3),
            "versions": {"jax": jax.__version__, "python": sys.version.split()[0]},
        }

    def say(self, text: str) -> None:
        if self.spec.is_main and not self.args.quiet:
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


def gpt_fields(model: gpt.GPT) -> Dict[str, Any]:
    return {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
            if f.name not in ("parent", "name")}


@job("gpt/evaluate")
class Evaluate(Evaluator):
    """Evaluate initialized or restored GPT weights with a declared EVALUATION."""

    def load(self, mesh):
        a = self.args
        if a.ckpt:
            model, variables, config = load_checkpoint(a.ckpt, mesh, a.dtype)
            return model, variables, load_tokenizer(config, a.ckpt)
        model = gpt.GPT(param_dtype=a.dtype, activation_dtype=a.dtype)
        return model, gpt.init_params(model, mesh, self.spec.seed), ByteTokenizer()


@job("backbone/evaluate")
class BackboneEvaluate(Evaluator):
    """Evaluate HuggingFace weights or a native checkpoint based on that model."""

    def load(self, mesh):
        a = self.args
        if not a.ckpt:
            raise UsageError("backbone/evaluate needs --ckpt (a HuggingFace or native directory)")
        if Node(a.ckpt).is_native:
            model, variables, config = load_checkpoint(a.ckpt, mesh, a.dtype)
            return model, variables, load_tokenizer(config, a.ckpt)
        model, host = load_backbone(a.ckpt, a.dtype)
        return model, gpt.place_params(model, mesh, host), HFTokenizer(a.ckpt)


# ----------------------------------------------------------------------------- HuggingFace


def load_backbone(path: str, dtype: str = "float32") -> Tuple[gpt.GPT, Any]:
    """Read the declared HuggingFace architecture and its host parameter tree."""
    raise UsageError(f"{path}: HuggingFace checkpoints are not supported yet")


# ----------------------------------------------------------------------------- command line


def start_processes(a: EvaluatorConfig) -> None:
    """Join a multi-process (multi-host) run; on CPU the collectives go through gloo."""
    if a.num_processes > 1 or a.coordinator:
        # must happen before anything touches a device; the setting only affects CPU devices
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=a.coordinator, num_processes=a.num_processes,
                                   process_id=a.process_id)


def main(argv: List[str]) -> int:
    try:
        a = parse_options(EvaluatorConfig, argv)
        a.validate()
        start_processes(a)
        hf = a.ckpt is not None and Path(a.ckpt).is_dir() and not Node(a.ckpt).is_native
        cls = BackboneEvaluate if hf else Evaluate
        spec = ExecutionSpec(name=cls.KEY, out_dir=a.out, mesh=a.mesh, seed=a.seed, config=a)
        cls(spec, Node(a.ckpt) if a.ckpt else None).run()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: no results written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
