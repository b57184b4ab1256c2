"""The evaluation harness: perplexity, multiple choice, generation, next-token accuracy.

    python evaluate.py                                   # fresh default GPT on the built-in suite (CPU, <1 min)
    python evaluate.py --ckpt runs/train                 # a native checkpoint (python train.py)
    python evaluate.py --ckpt DIR --data ppl:wiki.jsonl  # a HuggingFace model directory on your own data
    python evaluate.py --ckpt DIR --tasks hellaswag      # an lm-evaluation-harness task (pip install lm-eval)

Reading order: the four kinds of evaluation (each turns samples into requests for
inference.InferenceJob and its results into scores) -> the options -> Evaluator (runs the
evaluations, saves results), Evaluate, BackboneEvaluate -> the option checks -> the command
line. How requests run on the mesh is inference.py; a run's bookkeeping (fingerprint, what
--out holds, the journal a killed run resumes from, JSONL files) is runs.py; lm-eval's
tasks are tasks.py; HuggingFace directories are read by hf.py.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import json
import math
import os
import re
import sys
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import jax
import numpy as np

import gpt
from fast import PlanError
# load_backbone: the reference API has it here too
from hf import checkpoint_tokenizer, load_backbone, load_weights, resolve_checkpoint
from inference import (MIN_TEMPERATURE, GenerationRequest, InferenceJob, RequestError,
                       Request, Scored, per_document)
from checkpoints import Node, model_config
from jobs import (ByteTokenizer, ExecutionSpec, ModelOptions, UsageError, builtin_items, exit_status, first_line,
                  is_checkpoint_file, is_eval_item, job, lean_cpu_schedules, leave_torch_unloaded, option,
                  parse_options, premapped_buffer, short, use_compile_cache)
from runs import (JOURNAL_FILE, KINDS, Journal, JsonlDataset, compile_log, journaling, out_dir_held, previous_run,
                  run_fingerprint)
from tasks import LM_EVAL, check_task_options, run_tasks


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
        """Configuration schemas this evaluation needs ([] when none). (The reference API's; the
        harness itself never calls it.)"""
        return []

    def prefix(self) -> str:
        """Prefix for metrics from this evaluation. (The reference API's; results.json keys its
        metrics by the evaluation's name instead.)"""
        return self.name + "_"

    @abstractmethod
    def __len__(self) -> int:
        """Number of samples."""

    @abstractmethod
    def __call__(self, inference: InferenceJob, encoding: Any, reduce: str = "mean",
                 return_intermediates: bool = False, **kwargs: Any) -> Any:
        """Run the evaluation; with return_intermediates also the (tokens, mask) arrays run."""

    def score(self, *args: Any) -> List[float]:
        """One float per sample."""
        raise NotImplementedError

    @staticmethod
    def find_accumulation_steps(dataset_size: int, max_batch_size: int,
                                dp_replicate: int) -> Tuple[int, int] | Tuple[None, None]:
        """Largest per-replica batch <= max_batch_size with batch * dp_replicate dividing the
        dataset, and the number of steps; (None, None) when there is none. (The reference
        API's; InferenceJob pads the last batch instead, see InferenceJob.schedule.)"""
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
    def records(self, inference: InferenceJob, encoding: Any, keep_rows: bool, samples: Iterable[Tuple[int, Any]],
                **kwargs: Any) -> Iterator[Tuple[Dict[str, Any], Any]]:
        """Yield (record, rows run for it) per sample of `samples`, (index, sample) pairs in
        dataset order that can be iterated twice."""

    def score(self, records: List[Dict[str, Any]]) -> List[float]:
        return [r["score"] for r in records]

    def where(self, index: int) -> str:
        """Sample `index` for an error message: FILE:LINE of a JSONL file."""
        if isinstance(self.dataset, JsonlDataset):
            return f"{self.dataset.path}:{self.dataset.line_of(index)}"
        return f"sample {index}"

    def non_finite_error(self, what: str, index: int) -> UsageError:
        return UsageError(f"evaluation {self.name}: non-finite {what} at {self.where(index)} (broken weights?)")

    def aggregate(self, records: List[Dict[str, Any]]) -> Tuple[float, float, Dict[str, float]]:
        """(value, standard error, extra metrics); plain mean unless a kind says otherwise."""
        scores = np.array(self.score(records), np.float64)
        stderr = float(scores.std(ddof=1) / math.sqrt(len(scores))) if len(scores) > 1 else 0.0
        return float(scores.mean()), stderr, {}

    def result(self, inference: InferenceJob, encoding: Any, keep_rows: bool = False, **kwargs: Any) -> Result:
        """Every sample's record, the aggregate and its standard error."""
        pairs = self.records(inference, encoding, keep_rows, Enumerated(self.dataset), **kwargs)
        records, rows = [], []
        for record, row in inference.progress(pairs, self.name, len(self)):
            field = non_finite(record)
            if field is not None:  # NaN would be no score at all, and no JSON in samples.jsonl
                raise self.non_finite_error(field, record["index"])
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


class Enumerated:
    """(index, sample) of a whole dataset, as often as iterated (a JSONL file is read again)."""

    def __init__(self, dataset: Iterable[Dict[str, Any]]):
        self.dataset = dataset

    def __iter__(self) -> Iterator[Tuple[int, Dict[str, Any]]]:
        return enumerate(self.dataset)


def non_finite(record: Dict[str, Any]) -> Optional[str]:
    """The first field of a sample's record holding a NaN or an infinity, if any."""
    for field, value in record.items():
        if any(isinstance(v, float) and not math.isfinite(v) for v in (value if isinstance(value, list) else [value])):
            return field
    return None


class RollingEvaluation(DatasetEvaluation):
    """Every token of each `text` scored once, in rolling windows (loglikelihood_rolling);
    a kind says what a document's record holds and how records aggregate. Empty texts are
    skipped and counted."""

    def records(self, inference, encoding, keep_rows, samples, **kwargs):
        # the prefix token is added once by loglikelihood_rolling, not also by the tokenizer
        # (lm-eval 0.4 adds Llama's BOS twice in rolling windows: its issue #3333)
        documents = (encoding.encode(s["text"], add_special_tokens=False) for _, s in samples)
        results = inference.loglikelihood_rolling(documents, keep_rows)
        for (index, sample), scored in zip(samples, results):
            tokens = sum(r.tokens for r in scored)
            if not all(math.isfinite(r.logprob) for r in scored):  # acc's record would not show it
                raise self.non_finite_error("log-likelihood", index)
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
        return {"score": exp(nll / tokens), "nll": nll, "tokens": tokens,
                "bytes": len(sample["text"].encode("utf-8"))}

    def aggregate(self, records):
        rate, se_rate, tokens = token_weighted(records, "nll")
        bpb = rate * tokens / (math.log(2) * sum(r["bytes"] for r in records))
        # exp() of the mean nll per token; its standard error by the delta method
        return exp(rate), exp(rate) * se_rate, {"bits_per_byte": bpb, "tokens": tokens}


def exp(x: float) -> float:
    """math.exp, infinite where it overflows (a broken model's perplexity), so that the
    non-finite check names it rather than OverflowError ending the run in a traceback."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


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

    def records(self, inference, encoding, keep_rows, samples, **kwargs):
        results = per_document(inference.loglikelihood(self.requests(inference, encoding, samples), keep_rows))
        for (index, sample), scored in zip(samples, results):
            loglik = [r.logprob for r in scored]
            normed = [ll / max(len(c), 1) for ll, c in zip(loglik, sample["choices"])]
            pred, pred_norm = int(np.argmax(loglik)), int(np.argmax(normed))
            yield ({"eval": self.name, "index": index, "score": float(pred == sample["gold"]),
                    "loglik": loglik, "pred": pred, "gold": sample["gold"],
                    "acc_norm": float(pred_norm == sample["gold"])}, rows_of(scored))

    def requests(self, inference: InferenceJob, encoding: Any, samples: Iterable[Tuple[int, Any]]) -> Iterator[Request]:
        """One loglikelihood request per choice, carrying the last max_len tokens of the context,
        all that a row can read. A choice that adds no token once joined to the context ("lo"
        after "hel", where "hello" is one token) is refused: its empty continuation would
        score 0.0 and always win."""
        for index, sample in samples:
            shared = encoding.encode(sample["context"].rstrip())  # once: every choice's context is this
            for number, choice in enumerate(sample["choices"]):
                context, continuation = encode_pair(encoding, sample["context"], choice, shared)
                if not continuation:
                    raise UsageError(f"{self.where(index)}: choice {number} {short(choice)} adds no token to the "
                                     f"context (the tokenizer joins them); an empty continuation has nothing to score")
                yield Request(index, context[-inference.max_len:] or [inference.prefix_id], continuation)

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

    def records(self, inference, encoding, keep_rows, samples, max_new_tokens=None, temperature=0.0,
                top_p=1.0, seed=0, **kwargs):
        requests = (GenerationRequest(index, encoding.encode(s["prompt"]) or [inference.prefix_id],
                                      tuple(s.get("until", self.stop)))
                    for index, s in samples)  # a sampled token's key is its document's index
        outputs = inference.generate_until(requests, max_new_tokens or self.max_new_tokens, temperature,
                                           top_p, seed, keep_rows)
        for (index, sample), (_, out) in zip(samples, outputs):
            yield ({"eval": self.name, "index": index,
                    "score": float(out.text.strip() == sample["answer"].strip()), "output": out.text,
                    "answer": sample["answer"], "truncated": out.truncated}, out.row)

    def aggregate(self, records):
        value, stderr, metrics = super().aggregate(records)
        metrics["truncated"] = sum(r["truncated"] for r in records)
        return value, stderr, metrics


def encode_pair(encoding: Any, context: str, continuation: str,
                context_ids: Optional[List[int]] = None) -> Tuple[List[int], List[int]]:
    """lm-evaluation-harness's split: trailing spaces of the context move to the continuation,
    the whole string is encoded, and the continuation is what follows the context's tokens
    (`context_ids`, the stripped context's, where the caller has them). The whole string is
    encoded even where only its end is read: a tokenizer's tokens at the end of a text can
    depend on any text before them."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = encoding.encode(context + continuation)
    context_ids = encoding.encode(context) if context_ids is None else context_ids
    return context_ids, whole[len(context_ids):]


def rows_of(results: List[Any]) -> Any:
    """The (tokens, mask) rows run for one sample, stacked; None when not kept."""
    rows = [r.row for r in results if r.row is not None]
    if not rows:
        return None
    return np.stack([t for t, _ in rows]), np.stack([m for _, m in rows])


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


# ----------------------------------------------------------------------------- options


@dataclasses.dataclass
class EvaluatorConfig(ModelOptions):
    """Options of `python evaluate.py` (the jobs gpt/evaluate and backbone/evaluate).

    ModelOptions' come first (--batch-size, --mesh, --seed, --dtype, --chunks): lm-eval's
    model_args share them and their checks (tasks.ModelArgs)."""

    ckpt: Optional[str] = option(None, "checkpoint directory: native (python train.py) or HuggingFace; "
                                       "none: fresh default GPT weights")
    evals: Optional[str] = option(None, "comma-separated built-in evaluations (text, grammar, addition, "
                                        "repeat); default: all of them without --data or --tasks")
    data: List[str] = option([], "KIND:FILE, a JSONL dataset of kind ppl, mc, gen or acc (repeatable)")
    out: str = option("runs/eval", "output directory for results.json (and samples.jsonl, lm_eval/)")
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
    log_samples: bool = option(False, "also write samples.jsonl, one line per sample (and lm-eval's samples files)")
    force: bool = option(False, "redo a run whose results.json already exists")
    quiet: bool = option(False, "no table and no progress bars on stderr")
    simple: bool = option(False, "the simple path: a request a row, a batch of prompts at a time through "
                                 "gpt.generate, the plain attention (slow; the same scores, to check or to read)")
    no_compile_cache: bool = option(False, "compile every program afresh: no persistent compilation cache "
                                    "(default: in ~/.cache/gpt-eval/jax, at most 2 GiB; also GPT_EVAL_COMPILE_CACHE=0)")
    coordinator: Optional[str] = option(None, "HOST:PORT of process 0, for a multi-process run")
    num_processes: int = option(1, "processes in a multi-process run")
    process_id: int = option(0, "this process's index in a multi-process run")

    def validate(self) -> None:
        check_options(self)  # at the end of this file, with the other input checks


# ----------------------------------------------------------------------------- evaluators


class Parts(NamedTuple):
    """What an Evaluator runs on: a model, its parameters on the mesh, a tokenizer, the mesh."""

    model: gpt.GPT
    variables: Any
    tokenizer: Any
    mesh: jax.sharding.Mesh


@contextlib.contextmanager
def refused_as_usage() -> Iterator[None]:
    """The inference core's RequestError (a request longer than the context, a batch beyond
    memory) is the user's input: one line and exit 2, like every UsageError. Its PlanError
    (a size it planned that does not hold) is a bug, but still one line naming the document,
    never a traceback from deep in numpy. A batch that XLA finds beyond memory all the same
    (check_memory's estimate is a lower bound) ends in one line too, as a trainer's does."""
    try:
        yield
    except (RequestError, PlanError) as e:
        raise UsageError(str(e)) from None
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise UsageError(f"out of memory while evaluating ({first_line(e)}); try a smaller --batch-size") from None


class Evaluator(InferenceJob):
    """InferenceJob that runs evaluations and saves results."""

    CONFIG = EvaluatorConfig
    EVALUATION: List[str] = list(BUILTIN)  # names of the built-in evaluations it runs

    def __init__(self, spec: ExecutionSpec, base: Optional[Node] = None, parts: Optional[Parts] = None,
                 evaluations: Optional[List[Evaluation]] = None):
        self.spec, self.base = spec, base
        self.compiled_from = len(compile_log().events)  # the programs this evaluator builds, for results.json
        self.cfg: EvaluatorConfig = spec.cfg or EvaluatorConfig()
        if parts is None and base is None and self.cfg.ckpt:  # `python jobs.py KEY --ckpt ...` gives no base
            self.base = resolve_checkpoint(self.cfg.ckpt, say_on_process_0)
        if parts is None:
            # the tokenizer before the mesh: reading it needs no device, so a TPU's runtime starts
            # meanwhile (open_devices_meanwhile)
            tokenizer = self.load_tokenizer()
            mesh = spec.make_mesh()
            parts = Parts(*self.load(mesh), tokenizer, mesh)
        if self.cfg.simple:  # the simplest path end to end: the inference core's and the model's attention
            parts = parts._replace(model=parts.model.clone(attention="reference"))
        with refused_as_usage():
            super().__init__(*parts, batch_size=self.cfg.batch_size, chunks=self.cfg.chunks, seed=spec.seed,
                             quiet=self.cfg.quiet, simple=self.cfg.simple)
        self.evaluations = self.build_evaluations() if evaluations is None else evaluations

    def load_tokenizer(self) -> Any:
        """The tokenizer: each job says where it comes from."""
        raise NotImplementedError

    def load(self, mesh: jax.sharding.Mesh) -> Tuple[gpt.GPT, Any]:
        """(model, variables placed on `mesh`): each job says where they come from."""
        raise NotImplementedError

    @classmethod
    def config(cls, evaluations: Optional[List[type]] = None) -> List[type]:
        """The evaluator's options and those of every evaluation kind it holds. (The reference
        API's; the harness itself never calls it.)"""
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
        """--evals (the built-in suite by default) and each --data file, as evaluations."""
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
        """Evaluate and save, in four steps (the bookkeeping is runs.py's):
        1. what this run computes against what --out holds: this run, finished, is not redone;
           another run's results are refused unless --force; an interrupted try resumes;
        2. every evaluation, the inference core's windows of each in the Journal as they
           finish (a resumed run takes back those an earlier try journaled);
        3. --tasks through lm-eval, last, its requests' windows journaled too;
        4. results.json and samples.jsonl, written together (process 0)."""
        with refused_as_usage(), out_dir_held(self.spec):  # no other run writes there meanwhile
            fingerprint = run_fingerprint(self)  # 1
            if previous_run(self, fingerprint):
                self.say(f"{self.spec.path('results.json')} already holds this run; nothing to do (--force redoes it)")
                return
            started = time.time()
            journal = self.recorder = Journal(self.spec, fingerprint) if journaling() else None
            try:
                if journal is not None and journal.windows:
                    scopes = dict.fromkeys(call.rsplit("/", 2)[0] for call in journal.windows)
                    self.say(f"resuming: {sum(map(len, journal.windows.values()))} window(s) of "
                             f"{', '.join(scopes)} from the journal")
                results = self.run_evaluations()  # 2
                self.scope = "lm-eval"
                tasks = run_tasks(self, self.spec, self.cfg, self.say) if self.cfg.tasks else {}  # 3
            finally:
                self.recorder = None
                if journal is not None:
                    journal.close()
            if self.spec.is_main:  # 4
                self.write_results(results, fingerprint, time.time() - started, tasks)

    def run_evaluations(self) -> List[Result]:
        """Each evaluation's Result, in order (its calls named by the evaluation, for the
        journal); a table."""
        results = []
        for evaluation in self.evaluations:
            self.scope = evaluation.name
            results.append(evaluation.result(self, self.tokenizer, **self.decoding()))
        if results:
            self.say(table(results))
        return results

    def write_results(self, results: List[Result], fingerprint: Dict[str, Any], seconds: float,
                      tasks: Dict[str, Any]) -> None:
        """results.json and samples.jsonl together: neither is replaced unless both are written.
        Without --log-samples an earlier run's samples.jsonl is removed; so is the journal.
        `tasks`: what lm-eval's tasks add to results.json (see tasks.run_tasks)."""
        samples = None
        if self.cfg.log_samples and results:  # allow_nan=False: a NaN left would be a bug, not bare NaN in a file
            samples = "".join(json.dumps(r, allow_nan=False) + "\n" for res in results for r in res.records).encode()
        summary = {**self.summary(results, seconds), "fingerprint": fingerprint}
        for key, entries in tasks.items():  # lm-eval's scores join ours
            summary[key] = {**summary.get(key, {}), **entries}
        results_json = json.dumps(summary, indent=2, allow_nan=False) + "\n"
        self.spec.write_together({"samples.jsonl": samples, "results.json": results_json.encode(),
                                   JOURNAL_FILE: None})
        done = self.spec.path("results.json")
        self.say(f"results: {done}" + (f" and {self.spec.path('samples.jsonl')}" if samples else ""))

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
            "hub": self.base.hub if self.base is not None else None,
            "mesh": dict(self.mesh.shape), "processes": jax.process_count(),
            "config": dataclasses.asdict(self.cfg), "seconds": round(seconds, 3),
            "programs": compile_log().programs(self.compiled_from),
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

    def load_tokenizer(self):
        return ByteTokenizer() if self.base is None else checkpoint_tokenizer(self.base)

    def load(self, mesh):
        c = self.cfg
        if self.base is not None:
            return load_weights(self.base, mesh, c.dtype)
        model = gpt.GPT(param_dtype=c.dtype, activation_dtype=c.dtype)
        return model, gpt.init_params(model, mesh, self.spec.seed)


@job("backbone/evaluate")
class BackboneEvaluate(Evaluator):
    """Evaluate HuggingFace weights or a native checkpoint based on that model."""

    def load_tokenizer(self):
        if self.base is None:
            raise UsageError("backbone/evaluate needs --ckpt (a HuggingFace directory or hub id, or a native one)")
        return checkpoint_tokenizer(self.base)

    def load(self, mesh):
        return load_weights(self.base, mesh, self.cfg.dtype)


# ----------------------------------------------------------------------------- option checks


def check_options(cfg: EvaluatorConfig) -> None:
    """Every option in range, before anything is built: one line naming the option otherwise."""
    cfg.check_model_options()  # as lm-eval's model_args are checked (tasks.ModelArgs)
    for name in ("limit", "max_new_tokens"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if not (cfg.temperature == 0 or MIN_TEMPERATURE <= cfg.temperature < math.inf):
        raise UsageError(f"--temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, inf), got {cfg.temperature:g}")
    if not 0 < cfg.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {cfg.top_p}")
    check_processes(cfg)
    check_out_beside_checkpoint(cfg)
    check_task_options(cfg)


def check_processes(cfg: Any) -> None:
    """--coordinator, --num-processes and --process-id of a multi-process run (of evaluate.py
    or of a trainer that has them too)."""
    if cfg.num_processes < 1:
        raise UsageError("--num-processes must be at least 1")
    if not 0 <= cfg.process_id < cfg.num_processes:
        raise UsageError(f"--process-id must be in [0, {cfg.num_processes})")
    if cfg.num_processes > 1 and not cfg.coordinator:
        raise UsageError("--num-processes > 1 needs --coordinator HOST:PORT")
    if cfg.coordinator is not None:
        check_address(cfg.coordinator)


def check_out_beside_checkpoint(cfg: EvaluatorConfig) -> None:
    """An output directory never changes what a checkpoint is: one inside --ckpt under a name
    the checkpoint is read from (tokenizer.json, eval.safetensors) would be read as part of it."""
    if cfg.ckpt is None:
        return
    try:
        inside = Path(cfg.out).resolve().relative_to(Path(cfg.ckpt).resolve())
    except ValueError:  # not inside the checkpoint
        return
    if inside.parts and is_checkpoint_file(inside.parts[0]):
        raise UsageError(f"--out {cfg.out}: {inside.parts[0]!r} in checkpoint {cfg.ckpt} would be read as one of "
                         "its files; choose another name")


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


# ----------------------------------------------------------------------------- command line


def start_processes(cfg: Any) -> None:
    """Set up this process before anything touches a device: XLA's memory-minimizing CPU
    scheduler for a model in bfloat16 (jobs.lean_cpu_schedules), and joining a multi-process
    (multi-host) run, whose collectives on CPU go through gloo."""
    if getattr(cfg, "dtype", "float32") != "float32":
        lean_cpu_schedules()
    if cfg.num_processes > 1 or cfg.coordinator:
        # must happen before anything touches a device; the setting only affects CPU devices
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=cfg.coordinator, num_processes=cfg.num_processes,
                                   process_id=cfg.process_id)


def open_devices_meanwhile() -> None:
    """The devices opened in a thread while the checkpoint's config and tokenizer are read
    (an Evaluator reads them before it makes its mesh): a TPU's runtime takes seconds to
    start, mostly outside Python, time that importing transformers can share (docs/speed.md).
    Joined before the process ends (an exit mid-start could fail); an error is left to the
    main thread's own call, which raises it again."""
    premapped_buffer()

    def open_devices() -> None:
        with contextlib.suppress(Exception):
            jax.devices()

    opening = threading.Thread(target=open_devices, daemon=True)
    opening.start()
    atexit.register(opening.join)


def evaluate_command(argv: List[str]) -> None:
    """`python evaluate.py ...`: a HuggingFace directory goes to BackboneEvaluate, a native
    checkpoint or nothing (fresh weights) to Evaluate."""
    cfg = parse_options(EvaluatorConfig, argv)
    cfg.validate()
    start_processes(cfg)
    use_compile_cache(cfg.no_compile_cache)
    open_devices_meanwhile()
    base = resolve_checkpoint(cfg.ckpt, say_on_process_0) if cfg.ckpt else None  # a hub id: its snapshot
    hf = base is not None and Path(base.path).is_dir() and not base.is_native
    cls = BackboneEvaluate if hf else Evaluate
    spec = ExecutionSpec(name=cls.KEY, out_dir=cfg.out, mesh=cfg.mesh, seed=cfg.seed, cfg=cfg)
    cls(spec, base).run()


def say_on_process_0(line: str) -> None:
    """A note that even --quiet prints (which model a name meant): once, by process 0."""
    if jax.process_index() == 0:
        print(line, file=sys.stderr)


def main(argv: List[str]) -> int:
    return exit_status(lambda: evaluate_command(argv))


if __name__ == "__main__":
    leave_torch_unloaded()
    sys.exit(main(sys.argv[1:]))
