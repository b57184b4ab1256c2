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

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from safetensors import safe_open
from safetensors.numpy import save_file

import gpt
from jobs import (ByteTokenizer, ExecutionSpec, HFTokenizer, Node, UsageError, builtin_items, exit_status,
                  first_line, flatten, is_eval_item, job, load_checkpoint, load_tokenizer,
                  model_config, parse_options, read_config, unbox_shapes)


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
            # the prefix token is added once here, not also by the tokenizer (lm-eval 0.4
            # adds Llama's BOS twice in rolling windows: its issue #3333)
            tokens = encoding.encode(sample["text"], add_special_tokens=False)
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
        rate, se_rate, tokens = token_weighted(records, "nll")
        bpb = rate * tokens / (math.log(2) * sum(r["bytes"] for r in records))
        # exp() of the mean nll per token; its standard error by the delta method
        return math.exp(rate), math.exp(rate) * se_rate, {"bits_per_byte": bpb, "tokens": tokens}


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

    def forward(self, tokens: jax.Array, mask: jax.Array, variables: Any = None) -> jax.Array:
        """Logits [B, T, V] for left-padded tokens (mask True at real ones); no dropout."""
        variables = self.variables if variables is None else variables
        logits, _ = self.model.apply(variables, tokens, padding_mask=mask, deterministic=True)
        return logits

    def _score_block(self, variables, tokens_CBT, targets_CBT, weights_CBT, mask_CBT):
        """Per row of a [chunks, batch, length] block: summed log-probability of the weighted
        targets, how many of them are the argmax, and how many there are. One lax.scan over
        the chunks, so only one chunk's logits [batch, length, vocab] exist at a time."""
        def one_chunk(_, chunk):
            tokens, targets, weights, mask = chunk
            logits = self.forward(tokens, mask, variables)
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
        evaluations = [builtin_evaluation(name) for name in trainer.EVALUATION]
        return cls.from_parts(trainer.spec, trainer.model, trainer.variables, trainer.tokenizer,
                              trainer.mesh, evaluations, EvaluatorConfig(quiet=True, seed=trainer.spec.seed))

    @classmethod
    def from_parts(cls, spec: ExecutionSpec, model: gpt.GPT, variables: Any, tokenizer: Any,
                   mesh: jax.sharding.Mesh, evaluations: List[Evaluation],
                   config: Optional[EvaluatorConfig] = None) -> "Evaluator":
        """An evaluator over parameters already in memory (nothing is loaded)."""
        self = cls.__new__(cls)
        self.spec, self.base = spec, None
        self.args = config or spec.config or EvaluatorConfig()
        self.attach(model, variables, tokenizer, mesh)
        self.evaluations = evaluations
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
        self.spec.check_out_dir()
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
            "model": model_config(self.model), "checkpoint": self.args.ckpt,
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


# Supported model types: gpt2, llama, qwen2, qwen3, gpt_neox. Weights come only from
# *.safetensors files, read one tensor at a time with safetensors' numpy reader: nothing is
# ever unpickled and no remote code runs. What makes each family different is gpt.FAMILIES;
# this section only maps names and layouts onto it.

SUPPORTED = ("gpt2", "llama", "qwen2", "qwen3", "gpt_neox")
# Buffers some checkpoints carry that are not parameters (causal masks, rotary tables)
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias",
                    "rotary_emb.inv_freq")
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")  # fp8/int: quantized, refused
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def read_hf_config(path: str):
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
    from transformers import AutoConfig  # lazily: native checkpoints never pay for it
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises many kinds; the user needs one line
        raise UsageError(f"{config_file}: transformers cannot read it ({first_line(e)})") from None


def rope_settings(config) -> tuple:
    """(theta, rotary fraction) of a rotary model; only plain (default) rotary is supported."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)  # older spelling, if a config still has it
    if isinstance(scaling, dict):
        rope = {**scaling, **rope}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise UsageError(f"{config.model_type}: rope scaling {rope_type!r} is not supported "
                            "(only default rotary embeddings)")
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    # Only GPT-NeoX rotates part of each head; Llama/Qwen rotary use the full head width
    # in transformers even if a partial_rotary_factor is present.
    fraction = rope.get("partial_rotary_factor", 1.0) if config.model_type == "gpt_neox" else 1.0
    return float(theta), float(fraction)


def _mlp_kind(config, name: str, value: str) -> str:
    kinds = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact",
             "silu": "swiglu", "swish": "swiglu"}
    gated = config.model_type in ("llama", "qwen2", "qwen3")
    kind = kinds.get(value)
    if kind is None or (kind == "swiglu") != gated:
        raise UsageError(f"{config.model_type}: {name} {value!r} is not supported for this model type")
    return kind


def hf_fields(config) -> dict:
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
                    mlp=_mlp_kind(config, "activation_function", config.activation_function),
                    norm_eps=config.layer_norm_epsilon, tie_embeddings=bool(config.tie_word_embeddings))
    theta, fraction = rope_settings(config)
    heads = config.num_attention_heads
    fields = dict(gpt.FAMILIES[t], n_layers=config.num_hidden_layers, n_embd=config.hidden_size,
                  n_head=heads, block_size=config.max_position_embeddings,
                  vocab_size=config.vocab_size, mlp_hidden=config.intermediate_size,
                  mlp=_mlp_kind(config, "hidden_act", config.hidden_act),
                  rope_theta=theta, rotary_fraction=fraction,
                  tie_embeddings=bool(config.tie_word_embeddings))
    if t == "gpt_neox":
        if config.hidden_size % heads:
            raise UsageError(f"gpt_neox: hidden_size {config.hidden_size} is not a multiple of "
                                f"num_attention_heads {heads}")
        return dict(fields, n_kv_head=heads, head_dim=config.hidden_size // heads,
                    norm_eps=config.layer_norm_eps, qkv_bias=bool(config.attention_bias),
                    parallel_residual=bool(config.use_parallel_residual))
    # llama, qwen2, qwen3
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or any(k != "full_attention" for k in layer_types):
        raise UsageError(f"{t}: sliding-window attention is not supported")
    attention_bias = bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    qkv_bias = True if t == "qwen2" else attention_bias  # Qwen2 always has q/k/v biases
    out_bias = attention_bias if t != "qwen2" else False
    return dict(fields, n_kv_head=config.num_key_value_heads,
                head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                norm_eps=config.rms_norm_eps, qkv_bias=qkv_bias, bias=out_bias or mlp_bias)


class Checkpoint:
    """The tensors of a directory's safetensors file(s), read lazily one at a time.

    `get` checks the shape and names the tensor in any error; `unused` lists the tensors
    that were never read, so a config/file mismatch (say, more layers in the file) shows up.
    """

    def __init__(self, path: str, prefix: str = "", dtype: str = "float32"):
        self.path = path
        self.dtype = np.dtype(gpt.dtype_of(dtype))
        self.where = self._locate(path)  # tensor name -> file
        # transformers saves the whole *ForCausalLM ("model.layers.0...", "transformer.h.0...");
        # Hub GPT-2 and bare base models have no prefix. Decide once, so errors name the
        # tensor as this file would spell it.
        self.prefix = prefix if any(n.startswith(prefix) for n in self.where) else ""
        self.read = set()

    @staticmethod
    def _locate(path: str) -> dict:
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise UsageError(f"{index}: no readable weight_map ({e})") from None
            return {name: os.path.join(path, file) for name, file in weight_map.items()}
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            if any(f.endswith(PICKLE_SUFFIXES) for f in os.listdir(path)):
                raise UsageError(f"{path}: only pickle weights (*.bin/*.pt); convert them to "
                                    "safetensors (model.safetensors), pickle is never loaded")
            raise UsageError(f"{path}: no model.safetensors")
        where = {}
        for file in files:  # model.safetensors, or shards without an index
            full = os.path.join(path, file)
            try:
                with safe_open(full, framework="numpy") as f:
                    where.update({name: full for name in f.keys()})
            except Exception as e:
                raise UsageError(f"{full}: unreadable safetensors file ({e})") from None
        return where

    def name(self, name: str, prefixed: bool = True) -> str:
        """The stored name of a base-model tensor (prefixed) or of lm_head (not prefixed)."""
        return self.prefix + name if prefixed else name

    def has(self, name: str, prefixed: bool = True) -> bool:
        return self.name(name, prefixed) in self.where

    def get(self, name: str, shape: tuple, prefixed: bool = True) -> np.ndarray:
        stored = self.name(name, prefixed)
        if stored not in self.where:
            raise UsageError(f"{self.path}: tensor {stored!r} is missing")
        file = self.where[stored]
        try:
            with safe_open(file, framework="numpy") as f:
                array = f.get_tensor(stored)
        except Exception as e:
            raise UsageError(f"{file}: cannot read tensor {stored!r} ({e})") from None
        if array.dtype.name not in FLOAT_DTYPES:
            raise UsageError(f"{file}: tensor {stored!r} has dtype {array.dtype}; only float "
                                "weights are supported (no quantized checkpoints)")
        if tuple(array.shape) != tuple(shape):
            raise UsageError(f"{file}: tensor {stored!r} has shape {list(array.shape)}, "
                                f"config.json implies {list(shape)}")
        self.read.add(stored)
        return array.astype(self.dtype)

    def zeros(self, shape: tuple) -> np.ndarray:
        return np.zeros(shape, self.dtype)

    def unused(self) -> list:
        return sorted(n for n in self.where if n not in self.read and not n.endswith(IGNORED_SUFFIXES))


def _gpt2_params(ck: Checkpoint, m: gpt.GPT) -> dict:
    """GPT-2: Conv1D weights are already [in, out]; c_attn holds q|k|v side by side."""
    D, F, V = m.n_embd, m.mlp_hidden, m.vocab_size
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


def _linear(ck: Checkpoint, name: str, n_in: int, n_out: int, bias: bool, want_bias: bool) -> dict:
    """A torch nn.Linear ([out, in]) as our [in, out] kernel; a bias we need but the family
    lacks is zero."""
    p = {"kernel": ck.get(name + ".weight", (n_out, n_in)).T}
    if want_bias:
        p["bias"] = ck.get(name + ".bias", (n_out,)) if bias else ck.zeros((n_out,))
    return p


def _llama_params(ck: Checkpoint, m: gpt.GPT, config) -> dict:
    """Llama / Qwen2 / Qwen3: Linear weights are [out, in]; RMSNorm has only a scale."""
    D, F, V, H, K, E = m.n_embd, m.mlp_hidden, m.vocab_size, m.n_head, m.n_kv_head, m.head_dim
    t = config.model_type
    attention_bias = bool(getattr(config, "attention_bias", False)) and t != "qwen2"
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    qkv = m.qkv_bias
    p = {"wte": {"embedding": ck.get("embed_tokens.weight", (V, D))}}
    for i in range(m.n_layers):
        h = f"layers.{i}."
        attn = {"q": _linear(ck, h + "self_attn.q_proj", D, H * E, qkv, qkv),
                "k": _linear(ck, h + "self_attn.k_proj", D, K * E, qkv, qkv),
                "v": _linear(ck, h + "self_attn.v_proj", D, K * E, qkv, qkv),
                "o": _linear(ck, h + "self_attn.o_proj", H * E, D, attention_bias, m.bias)}
        if m.qk_norm:
            attn["q_norm"] = {"scale": ck.get(h + "self_attn.q_norm.weight", (E,))}
            attn["k_norm"] = {"scale": ck.get(h + "self_attn.k_norm.weight", (E,))}
        p[f"blocks_{i}"] = {
            "ln_1": {"scale": ck.get(h + "input_layernorm.weight", (D,))},
            "ln_2": {"scale": ck.get(h + "post_attention_layernorm.weight", (D,))},
            "attn": attn,
            "mlp": {"gate": _linear(ck, h + "mlp.gate_proj", D, F, mlp_bias, m.bias),
                    "up": _linear(ck, h + "mlp.up_proj", D, F, mlp_bias, m.bias),
                    "down": _linear(ck, h + "mlp.down_proj", F, D, mlp_bias, m.bias)}}
    p["ln_f"] = {"scale": ck.get("norm.weight", (D,))}
    if not m.tie_embeddings:
        p["lm_head"] = {"kernel": ck.get("lm_head.weight", (V, D), prefixed=False).T}
    return p


def _neox_params(ck: Checkpoint, m: gpt.GPT) -> dict:
    """GPT-NeoX: query_key_value's outputs are laid out per head as [H, 3, E] (not q|k|v)."""
    D, F, V, H, E = m.n_embd, m.mlp_hidden, m.vocab_size, m.n_head, m.head_dim
    norm = lambda name: {"scale": ck.get(name + ".weight", (D,)), "bias": ck.get(name + ".bias", (D,))}
    p = {"wte": {"embedding": ck.get("embed_in.weight", (V, D))}}
    for i in range(m.n_layers):
        h = f"layers.{i}."
        w = ck.get(h + "attention.query_key_value.weight", (3 * D, D)).reshape(H, 3, E, D)
        if m.qkv_bias:
            b = ck.get(h + "attention.query_key_value.bias", (3 * D,)).reshape(H, 3, E)
        attn = {}
        for j, name in enumerate("qkv"):
            attn[name] = {"kernel": w[:, j].reshape(H * E, D).T}
            if m.qkv_bias:
                attn[name]["bias"] = b[:, j].reshape(H * E)
        attn["o"] = _linear(ck, h + "attention.dense", D, D, m.qkv_bias, True)  # attention_bias
        p[f"blocks_{i}"] = {
            "ln_1": norm(h + "input_layernorm"), "ln_2": norm(h + "post_attention_layernorm"),
            "attn": attn,
            "mlp": {"up": _linear(ck, h + "mlp.dense_h_to_4h", D, F, True, True),
                    "down": _linear(ck, h + "mlp.dense_4h_to_h", F, D, True, True)}}
    p["ln_f"] = norm("final_layer_norm")
    if not m.tie_embeddings:  # Hub files call it embed_out; transformers 5 may write lm_head
        name = "embed_out.weight" if ck.has("embed_out.weight", prefixed=False) else "lm_head.weight"
        p["lm_head"] = {"kernel": ck.get(name, (V, D), prefixed=False).T}
    return p


def _check_tree(model: gpt.GPT, params: dict, path: str) -> None:
    """The host tree must have exactly the paths and shapes GPT.init would make."""
    expected = flatten(unbox_shapes(model))
    got = {name: tuple(np.shape(v)) for name, v in flatten(params).items()}
    if got.keys() != expected.keys():
        extra, missing = sorted(got.keys() - expected.keys()), sorted(expected.keys() - got.keys())
        raise UsageError(f"{path}: parameter tree mismatch (missing {missing[:3]}, extra {extra[:3]})")
    for name, shape in got.items():
        if shape != tuple(expected[name]):
            raise UsageError(f"{path}: parameter {name} has shape {list(shape)}, GPT expects "
                             f"{list(expected[name])}")


def load_backbone(path: str, dtype: str = "float32"):
    """(gpt.GPT, {"params": numpy tree}) for a HuggingFace directory, in `dtype`.

    The host tree is plain numpy in `dtype` (bfloat16 via ml_dtypes); put it on a mesh with
    gpt.place_params(model, mesh, host), which copies each device's slice only.
    """
    path = os.fspath(path)
    if dtype not in gpt.DTYPES:
        raise UsageError(f"dtype {dtype!r} is not supported; choose one of {', '.join(gpt.DTYPES)}")
    config = read_hf_config(path)
    fields = hf_fields(config)
    model = gpt.GPT(**fields, param_dtype=dtype, activation_dtype=dtype)
    # GPT's optional fields are resolved here so the readers can use them directly
    model = model.clone(n_kv_head=model.n_kv_head or model.n_head,
                        head_dim=model.head_dim or model.n_embd // model.n_head,
                        qkv_bias=model.bias if model.qkv_bias is None else model.qkv_bias)
    t = config.model_type
    prefix = {"gpt2": "transformer.", "gpt_neox": "gpt_neox."}.get(t, "model.")
    ck = Checkpoint(path, prefix, dtype)
    if t == "gpt2":
        params = _gpt2_params(ck, model)
    elif t == "gpt_neox":
        params = _neox_params(ck, model)
    else:
        params = _llama_params(ck, model, config)
    unused = ck.unused()
    if unused and not (model.tie_embeddings and unused == ["lm_head.weight"]):  # a tied copy is fine
        raise UsageError(f"{path}: {len(unused)} tensor(s) that config.json does not account for, "
                            f"e.g. {unused[0]!r}")
    _check_tree(model, params, path)
    return model, {"params": params}


def _is_gpt2_layout(m: gpt.GPT) -> bool:
    head_dim = m.head_dim or m.n_embd // m.n_head
    return (not m.rope and m.mlp in ("gelu", "gelu_exact") and m.norm == "layernorm" and m.bias
            and m.qkv_bias in (None, True) and not m.qk_norm and not m.parallel_residual
            and (m.n_kv_head or m.n_head) == m.n_head and head_dim * m.n_head == m.n_embd)


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
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.fspath(tokenizer_dir), local_files_only=True,
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


def export_gpt2(model: gpt.GPT, variables, path: str, tokenizer_dir=None) -> None:
    """Write a GPT-2-layout GPT as a HuggingFace GPT-2 directory (config.json, float32
    model.safetensors, and the tokenizer of `tokenizer_dir` if given) that GPT2LMHeadModel
    loads as is. `variables` may be {"params": tree} or the tree, on host or on a mesh."""
    from transformers import GPT2Config

    if not _is_gpt2_layout(model):
        raise UsageError("export_gpt2: the model is not GPT-2 layout (needs rope=False, gelu MLP, "
                         "layernorm, biases, no q/k norm, no grouped heads, sequential residual)")
    params = jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32),
                          nn.meta.unbox(variables.get("params", variables)))
    os.makedirs(path, exist_ok=True)
    tokenizer = save_hf_tokenizer(tokenizer_dir, path, model.vocab_size) if tokenizer_dir else None
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    bos = tokenizer.bos_token_id if tokenizer is not None else None
    GPT2Config(
        vocab_size=model.vocab_size, n_positions=model.block_size, n_embd=model.n_embd,
        n_layer=model.n_layers, n_head=model.n_head, n_inner=model.mlp_hidden or 4 * model.n_embd,
        activation_function="gelu_new" if model.mlp == "gelu" else "gelu",
        layer_norm_epsilon=model.norm_eps, tie_word_embeddings=model.tie_embeddings,
        resid_pdrop=model.dropout, embd_pdrop=model.dropout, attn_pdrop=model.dropout,
        bos_token_id=bos if bos is not None else eos, eos_token_id=eos,
        architectures=["GPT2LMHeadModel"], dtype="float32").save_pretrained(path)
    # metadata format=pt: transformers expects it in files it did not write itself
    save_file(gpt2_tensors(model, params), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


# ----------------------------------------------------------------------------- command line


def start_processes(a: EvaluatorConfig) -> None:
    """Join a multi-process (multi-host) run; on CPU the collectives go through gloo."""
    if a.num_processes > 1 or a.coordinator:
        # must happen before anything touches a device; the setting only affects CPU devices
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=a.coordinator, num_processes=a.num_processes,
                                   process_id=a.process_id)


def evaluate_command(argv: List[str]) -> None:
    """`python evaluate.py ...`: a HuggingFace directory goes to BackboneEvaluate, a native
    checkpoint or nothing (fresh weights) to Evaluate."""
    a = parse_options(EvaluatorConfig, argv)
    a.validate()
    start_processes(a)
    hf = a.ckpt is not None and Path(a.ckpt).is_dir() and not Node(a.ckpt).is_native
    cls = BackboneEvaluate if hf else Evaluate
    spec = ExecutionSpec(name=cls.KEY, out_dir=a.out, mesh=a.mesh, seed=a.seed, config=a)
    cls(spec, Node(a.ckpt) if a.ckpt else None).run()


def main(argv: List[str]) -> int:
    return exit_status(lambda: evaluate_command(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
