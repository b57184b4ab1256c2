"""lm-evaluation-harness tasks on our model (`python evaluate.py --tasks ...`).

    pip install lm-eval==0.4.13
    python evaluate.py --ckpt DIR --tasks hellaswag,arc_easy --limit 100   # evaluate.py calls run_tasks

lm-eval builds the requests of its tasks (prompts, few-shot examples, chat turns) and
computes their metrics; JaxLM, lm-eval's model interface over an inference.InferenceJob,
answers the requests through the same jitted, sharded blocks as our own evaluations.
Reading order: JaxLM (the three request types) -> running the tasks (the task index,
simple_evaluate, the `evaluate` name clash) -> lm-eval's files and our results.json
entries -> the option checks.

lm-eval is optional: without it this file still imports, and --tasks is refused with one
line saying what to install.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import math
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import jax
import numpy as np

from hf import load_model, resolve_checkpoint
from inference import MIN_TEMPERATURE, GenerationRequest, InferenceJob, Request
from jobs import ExecutionSpec, ModelOptions, UsageError, first_line, let_torch_load, option, options_of, short

try:  # only --tasks needs lm-eval (these parts load in a fraction of a second)
    import jinja2  # a dependency of lm-eval (and of transformers' chat templates)
    import lm_eval
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import model_registry, register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import (handle_non_serializable, hash_string, make_table, sanitize_list, sanitize_model_name,
                               simple_parse_args_string)
except ImportError:
    lm_eval = None
    TemplateLM = object  # JaxLM below still defines; --tasks refuses to start without lm-eval

LM_EVAL = "lm-eval==0.4.13"  # the version this backend is tested with


# ----------------------------------------------------------------------------- JaxLM


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
    multi-process mode would hand each process a share of the documents instead.)

    Beyond inference.Tokenizer, the job's tokenizer may carry `tok`, the transformers
    tokenizer behind it (jobs.HFTokenizer does): lm-eval reads its chat template and the
    text of its special tokens. Without one (the byte tokenizer) chat templates are refused.

    Every answer goes through lm-eval's cache hook (cache_hook.add_partial), as lm-eval's HF
    model sends it. (A run's journal sees the inference job's windows, as for any evaluation.)"""

    backend = "causal"

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[Dict[str, Any]] = None) -> "JaxLM":
        """lm-eval's way to make a model by name: `lm_eval.simple_evaluate(model=MODEL_NAME,
        model_args="pretrained=ORG/NAME,batch_size=16,mesh=4x2", tasks=[...])` once this file
        is imported (see from_pretrained). A key given twice is refused: lm-eval's parser would keep
        the last, and its results record the string as given, both values in it."""
        keys = [part.split("=")[0].strip() for part in (arg_string or "").split(",") if part]  # as lm-eval splits
        twice = next((key for key in keys if keys.count(key) > 1), None)
        if twice is not None:
            raise UsageError(f"{model_arg(twice)} is given twice in {short(arg_string)}; give it once")
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: Dict[str, Any], additional_config: Optional[Dict[str, Any]] = None
                            ) -> "JaxLM":
        """As create_from_arg_string, for model_args given as a dict; what simple_evaluate
        adds (batch_size, max_batch_size, device) where it is set, as lm-eval's models take it,
        refused where model_args says otherwise (lm-eval's own models fail in a TypeError)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        clash = next((k for k in extra if k in arg_dict and str(arg_dict[k]) != str(extra[k])), None)
        if clash is not None:
            raise UsageError(f"{model_arg(clash)} {arg_dict[clash]!r} and simple_evaluate's {clash} "
                             f"{extra[clash]!r} differ; give one")
        return cls.from_pretrained(**{**arg_dict, **extra})

    @classmethod
    def from_pretrained(cls, pretrained: Any = None, **model_args: Any) -> "JaxLM":
        """A checkpoint (native, a HuggingFace directory or a hub id ORG/NAME[@REVISION]) loaded
        and run as ModelArgs says, each argument checked as the command line checks its option."""
        args = options_of(ModelArgs, {"pretrained": pretrained, **model_args}, model_arg)
        args.validate()
        devices = ExecutionSpec(name=MODEL_NAME, mesh=args.mesh).make_mesh(model_arg("mesh"))
        model, variables, tokenizer = load_model(resolve_checkpoint(args.pretrained), devices, args.dtype)
        job = InferenceJob(model, variables, tokenizer, devices, batch_size=args.batch_size, chunks=args.chunks,
                           seed=args.seed)
        return cls(job, args.max_gen_toks, args.seed)

    def __init__(self, inference: InferenceJob, max_gen_toks: int = 256, seed: int = 0):
        super().__init__()
        self.inference, self.encoding, self.seed = inference, inference.tokenizer, seed
        self._max_gen_toks = max_gen_toks  # lm-eval's HF model uses 256 when a task sets none
        # transformers' tokenizer where there is one: lm-eval reads its chat template and tokens
        self.tokenizer = getattr(inference.tokenizer, "tok", None)
        bos, eos = self.encoding.bos_token_id, self.encoding.eos_token_id
        self.prefix_text = self.token_text(bos if bos is not None else eos)  # prefix_token_id, where there is one
        self.eos_text = self.token_text(eos)

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

    def check_chat_template(self, flag: str, model: str = "this model") -> None:
        """Chat turns need the tokenizer's chat template (the byte tokenizer has none): one line
        naming the option (`flag`) before a prompt is built."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise UsageError(f"{flag}: the tokenizer of {model} has no chat template")

    def apply_chat_template(self, chat_history: List[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as text through the tokenizer's template; a template that refuses
        system messages gets the conversation without them (as lm-eval's HF model). One that
        fails then too is the user's to fix: one line. (simple_evaluate's apply_chat_template
        reaches here without the command line's check.)"""
        self.check_chat_template("apply_chat_template")

        def render(messages: List[Dict[str, str]]) -> str:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=not add_generation_prompt)
        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            pass
        try:
            return render([m for m in chat_history if m["role"] != "system"])
        except Exception as e:  # the template is the user's code: whatever it raises
            raise UsageError(f"--apply-chat-template: the tokenizer's chat template fails ({first_line(e)})") from None

    def get_model_info(self) -> Dict[str, Any]:
        """What lm-eval records about the model in its results' "config"."""
        count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.inference.variables))
        return {"model_num_parameters": count, "model_dtype": self.inference.model.param_dtype}

    # --- the three request types

    def hooked(self, kind: str, requests: List[Any], answers: List[Any]) -> List[Any]:
        """`answers`, each first sent to lm-eval's cache hook (its CachingLM's store, where one
        wraps this model; a no-op otherwise), request by request as lm-eval's HF model does."""
        for request, answer in zip(requests, answers):
            self.cache_hook.add_partial(kind, request.args, answer)
        return answers

    def loglikelihood(self, requests: List[Any], disable_tqdm: bool = False) -> List[Tuple[float, bool]]:
        """TemplateLM's (it encodes each context and continuation), its bar off under --quiet."""
        quiet = disable_tqdm or self.inference.quiet
        return self.hooked("loglikelihood", requests, super().loglikelihood(requests, disable_tqdm=quiet))

    def _loglikelihood_tokens(self, requests: List[Tuple[Tuple[str, str], List[int], List[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> List[Tuple[float, bool]]:
        """(log-probability, is_greedy) of each continuation, given ((context, continuation)
        texts, context ids, continuation ids) as TemplateLM.loglikelihood encodes them;
        is_greedy: every continuation token is the argmax prediction."""
        batch = (Request(i, list(context[-self.max_length:]), list(checked_continuation(texts, continuation)))
                 for i, (texts, context, continuation) in enumerate(requests))  # all of a context a row can read
        scored = self.inference.progress(self.inference.loglikelihood(batch), "loglikelihood", len(requests),
                                         "requests")
        return [(finite(s.logprob), s.correct == s.tokens) for _, s in scored]

    def loglikelihood_rolling(self, requests: List[Any], disable_tqdm: bool = False) -> List[float]:
        """The summed log-likelihood of each whole text, every token scored once after one
        prefix token. lm-eval's HF model lets a BOS-adding tokenizer add BOS as well and scores
        p(BOS | BOS) as the first token (its issue #3333); we add the prefix once."""
        return self.hooked("loglikelihood_rolling", requests, self.rolling_answers(requests))

    def rolling_answers(self, requests: List[Any]) -> List[float]:
        documents = (self.encoding.encode(request.args[0], add_special_tokens=False) for request in requests)
        windows = self.inference.progress(self.inference.loglikelihood_rolling(documents), "loglikelihood_rolling",
                                          len(requests), "requests")
        return [finite(sum(s.logprob for s in document)) for document in windows]

    def generate_until(self, requests: List[Any], disable_tqdm: bool = False) -> List[str]:
        return self.hooked("generate_until", requests, self.generations(requests))

    def generations(self, requests: List[Any]) -> List[str]:
        """Each request's continuation, cut at the first of its `until` strings (the EOS text
        among them); a batch stops decoding once each of its rows has produced EOS or one of
        its stop strings, as lm-eval's HF model stops. Requests run in groups of one decoding
        setting, each group one rollout; prompts are cut from the left to max_length -
        max_gen_toks tokens, as lm-eval's HF model cuts them. Sampling keys come from the
        seed and each request's position in the call, so they depend neither on batch nor
        on mesh."""
        settings = [self.decoding(gen_kwargs) for _, gen_kwargs in (request.args for request in requests)]
        texts = [""] * len(requests)
        for setting in sorted({s[:3] for s in settings}):  # (max_gen_toks, temperature, top_p)
            indices = [i for i, s in enumerate(settings) if s[:3] == setting]
            group = (GenerationRequest(i, self.tok_encode(requests[i].args[0]) or [self.prefix_token_id],
                                       tuple(settings[i].until)) for i in indices)
            outputs = self.inference.generate_until(group, *setting, seed=self.seed)
            for request, generation in self.inference.progress(outputs, "generate_until", len(indices), "requests"):
                i = request.doc
                texts[i] = postprocess_generated_text(generation.text, settings[i].until, None)
        return texts

    def decoding(self, gen_kwargs: Dict[str, Any]) -> Decoding:
        """A task's generation_kwargs, read as lm-eval's HF model reads them."""
        unknown = sorted(set(gen_kwargs) - GEN_KWARGS)
        if unknown:
            raise UsageError(f"generation_kwargs {', '.join(unknown)} are not supported "
                             f"(supported: {', '.join(sorted(GEN_KWARGS))})")
        try:
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        except (TypeError, ValueError) as e:  # int() or float() of a value no number ("max_gen_toks: many")
            raise UsageError(f"generation_kwargs: {first_line(e)}") from None
        n_new = kwargs["max_gen_toks"]
        if n_new < 1:  # lm-eval's HF model fails on these too, in transformers' generate
            raise UsageError(f"a task asks for {n_new} new tokens (max_gen_toks); it must be at least 1 "
                             "(--max-new-tokens sets it for every task)")
        if n_new >= self.max_length:
            raise UsageError(f"a task asks for {n_new} new tokens (max_gen_toks), which leaves no room in the "
                             f"context of {self.max_length}; --max-new-tokens sets it for every task")
        until = handle_stop_sequences(kwargs["until"], eos=self.eos_text)
        if not (kwargs["do_sample"] and kwargs["temperature"] > 0):
            return Decoding(n_new, 0.0, 1.0, until)
        top_p, temperature = float(kwargs.get("top_p", 1.0)), float(kwargs["temperature"])
        if not 0 < top_p <= 1:
            raise UsageError(f"generation_kwargs top_p must be in (0, 1], got {top_p}")
        if not MIN_TEMPERATURE <= temperature < math.inf:
            raise UsageError(f"generation_kwargs temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, inf), "
                             f"got {temperature:g}")
        return Decoding(n_new, temperature, top_p, until)


def model_arg(name: str) -> str:
    """A model_args key as errors name it."""
    return f"model_args {name}"


@dataclasses.dataclass
class ModelArgs(ModelOptions):
    """JaxLM's model_args (simple_evaluate(model="gpt-eval", model_args=...)): the command line's
    ModelOptions, checked by the same method, and what only lm-eval's models take."""

    pretrained: Optional[str] = option(None, "a native checkpoint, a HuggingFace directory or a hub id "
                                             "ORG/NAME[@REVISION], as --ckpt")
    max_gen_toks: int = option(256, "new tokens of a generation task that sets none (256: lm-eval's HF model's)")
    device: Optional[str] = option(None, "lm-eval hands it every model; chooses nothing: jax runs on its backend")
    max_batch_size: Optional[int] = option(None, "lm-eval hands it every model; chooses nothing")

    def validate(self) -> None:
        self.check_model_options(model_arg)
        if not self.pretrained:
            raise UsageError(f"{model_arg('pretrained')} is needed: a checkpoint directory or a hub id ORG/NAME")
        if self.max_gen_toks < 1:  # as --max-new-tokens
            raise UsageError(f"{model_arg('max_gen_toks')} must be at least 1")


MODEL_NAME = "gpt-eval"  # JaxLM's name in lm-eval's model registry


def registered_here(name: str) -> bool:
    """Whether `name` holds a JaxLM of this file: a reload of it (importlib.reload, a notebook's
    autoreload) keeps the class first registered, since lm-eval refuses a second under a name."""
    known = model_registry.get(name, None)
    return isinstance(known, type) and (known.__module__, known.__qualname__) == (__name__, "JaxLM")


if lm_eval is not None and not registered_here(MODEL_NAME):
    register_model(MODEL_NAME)(JaxLM)


def checked_continuation(texts: Tuple[str, str], continuation: List[int]) -> List[int]:
    """A request's continuation ids, refused when there are none: the continuation's text
    joined the context's last token (lm-eval's HF model asserts it never happens)."""
    if not continuation:
        context, text = texts
        raise UsageError(f"lm-eval: the continuation {short(text)} adds no token to the context ending "
                         f"{short(context[-40:])}; an empty continuation has nothing to score")
    return continuation


def finite(logprob: float) -> float:
    """A log-likelihood for lm-eval, refused when it is NaN or infinite (broken weights)."""
    if not math.isfinite(logprob):
        raise UsageError(f"lm-eval: a non-finite log-likelihood ({logprob}) (broken weights?)")
    return logprob


# ----------------------------------------------------------------------------- running the tasks


@contextlib.contextmanager
def hf_evaluate_importable() -> Iterator[None]:
    """Inside, `import evaluate` gives HuggingFace's `evaluate` package, not our evaluate.py.

    lm-eval imports that package for metrics outside its own registry, and so do some tasks'
    utils.py. Run as `python evaluate.py`, its directory comes first on sys.path, so their
    import would load our evaluate.py a second time; imported as `evaluate` (by jobs.py,
    train.py, a test), ours is sys.modules["evaluate"]. Both are undone inside and restored
    on exit; whoever imported HuggingFace's package inside keeps it."""
    here = Path(__file__).resolve().with_name("evaluate.py")
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


def run_tasks(inference: InferenceJob, spec: ExecutionSpec, cfg: Any, say: Callable[[str], None]) -> Dict[str, Any]:
    """--tasks through lm-eval: print its table, write its results file (and samples files),
    and return what results.json gains: its scores, the files' paths, its version. `cfg`
    is the run's options (evaluate.EvaluatorConfig)."""
    started = time.time()
    lm = JaxLM(inference, seed=cfg.seed)
    out = evaluate_tasks(lm, cfg)
    say(make_table(out) + ("\n" + make_table(out, "groups") if "groups" in out else ""))
    template = lm.chat_template(True) if cfg.apply_chat_template else None
    files = write_lm_eval_files(spec, out, cfg, template, time.time() - started)
    say(f"lm-eval results: {spec.path(files['results'])}")
    return {**task_entries(out), "lm_eval": files, "versions": {"lm_eval": lm_eval.__version__}}


def evaluate_tasks(lm: JaxLM, cfg: Any) -> Dict[str, Any]:
    """lm-eval's simple_evaluate of cfg.tasks on `lm`: its results dict (with "samples" under
    --log-samples), the same on every process."""
    c, inference = cfg, lm.inference
    if c.apply_chat_template:  # before anything starts (by name, apply_chat_template checks it)
        lm.check_chat_template("--apply-chat-template", c.ckpt or "the fresh GPT")
    if c.quiet or jax.process_index() != 0:
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
    os.environ.setdefault("DISABLE_MULTIPROC", "1")  # else lm-eval's bootstrap forks this JAX process
    names = task_names(c.tasks)
    with hf_evaluate_importable(), missing_modules_refused(), torch_left_to_tasks():
        manager = task_manager(names, c.include_path)
        check_task_names(manager, names, c.include_path)
        built = build_tasks(manager, names, c.num_fewshot)
        lengths = {"max_gen_toks": c.max_new_tokens} if c.max_new_tokens else None  # over the tasks' own
        out = lm_eval.simple_evaluate(
            model=lm, tasks=built, task_manager=manager, num_fewshot=c.num_fewshot,
            fewshot_random_seed=c.fewshot_seed, apply_chat_template=c.apply_chat_template,
            fewshot_as_multiturn=c.apply_chat_template, limit=c.limit, log_samples=c.log_samples,
            bootstrap_iters=c.bootstrap_iters, gen_kwargs=lengths)
    mesh = "x".join(str(n) for n in inference.mesh.shape.values())
    out["config"].update(model="gpt-eval", batch_size=inference.batch_size, device=jax.default_backend(),
                         model_args={"pretrained": c.ckpt, "dtype": c.dtype, "mesh": mesh,
                                     "processes": jax.process_count()})
    return out


@contextlib.contextmanager
def torch_left_to_tasks() -> Iterator[None]:
    """Inside, torch is importable (jobs.let_torch_load: a task's own code may import it, and
    datasets does), but lm-eval does not import it for its own sake: it asks whether torch
    is installed to seed it and to describe it in the results (torch's collect_env, seconds
    of subprocesses), and this backend runs none, so inside the answer is no."""
    let_torch_load()
    installed = lm_eval.utils.is_torch_available
    lm_eval.utils.is_torch_available = lambda: False
    try:
        yield
    finally:
        lm_eval.utils.is_torch_available = installed


@contextlib.contextmanager
def missing_modules_refused() -> Iterator[None]:
    """A module that cannot be imported, named by a task's YAML (`!function utils.f`) or
    needed by its metrics: the user's to write or install, so one line, not a traceback."""
    try:
        yield
    except ImportError as e:
        raise UsageError(f"--tasks: {first_line(e)} (a task's !function, or a package its metrics need)") from None


def build_tasks(manager: Any, names: List[str], num_fewshot: Optional[int]) -> List[Any]:
    """lm-eval's Task and Group objects of the names asked for (a group, not also its
    members), built once: simple_evaluate takes them as they are. Each task's few-shot
    documents are counted first (check_fewshot)."""
    built = []
    for name in names:
        try:
            loaded = manager.load(name)
        except (TypeError, ValueError) as e:  # lm-eval reads a YAML's values as it builds ("temperature: hot")
            raise UsageError(f"--tasks: lm-eval cannot build {name} ({first_line(e)})") from None
        members = {child for group in loaded["groups"].values() for child in group.child_names}
        built += [item for key, item in {**loaded["groups"], **loaded["tasks"]}.items() if key not in members]
        for task in loaded["tasks"].values():
            check_fewshot(task, num_fewshot)
    return built


def check_fewshot(task: Any, num_fewshot: Optional[int]) -> None:
    """A task must hold the few-shot documents it will draw (one more when they come from the
    split it is evaluated on, so that the document itself can be left out): lm-eval would
    stop in random.sample ("Sample larger than population"), naming neither task nor count.
    The number of shots is the one simple_evaluate sets: --num-fewshot, unless the task's
    own is 0."""
    if not hasattr(task, "fewshot_cfg"):  # not a YAML task (ConfigurableTask): lm-eval draws its own way
        return
    shots = task.get_config("num_fewshot")
    if num_fewshot is not None and shots != 0:
        shots = num_fewshot
    if not shots:
        return
    same = task.fewshot_cfg.split == task.config.test_split
    pool = len(task.sampler.fewshot_docs()) if hasattr(task, "sampler") else 0
    if shots + same > pool:
        raise UsageError(f"--tasks: {task.task_name} asks for {shots} few-shot examples but has {pool} few-shot "
                         f"documents{' (the one asked about among them)' if same else ''}; lower --num-fewshot")


# ----------------------------------------------------------------------------- lm-eval's files and results.json


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
            entries["results"][name] = value if math.isfinite(value) else None  # NaN is no JSON
            entries["higher_is_better"][name] = out["higher_is_better"].get(task, {}).get(metric)
            entries["n_samples"][name] = task_samples(out, task)
            entries["stderr"][name] = stderr if isinstance(stderr, (int, float)) and math.isfinite(stderr) else None
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


def write_lm_eval_files(spec: ExecutionSpec, out: Dict[str, Any], cfg: Any, chat_template: Optional[str],
                        seconds: float) -> Dict[str, Any]:
    """lm-eval's results file and, under --log-samples, one samples file per task, named
    and shaped as lm-eval writes them (OUT/lm_eval/<model>/results_<date>.json and
    samples_<task>_<date>.jsonl), but atomically, by process 0, the results file last.
    Their paths, relative to OUT."""
    model_name = cfg.ckpt or "fresh-gpt"
    results = results_file(out, model_name, chat_template, cfg.apply_chat_template, seconds)
    folder = Path("lm_eval") / results["model_name_sanitized"]
    date = datetime.now().isoformat().replace(":", "-")
    files: Dict[str, Any] = {"samples": {}}
    for task, rows in out.get("samples", {}).items():
        files["samples"][task] = str(folder / f"samples_{task}_{date}.jsonl")
        spec.write_text(files["samples"][task], "".join(sample_line(s) for s in rows))
    files["results"] = str(folder / f"results_{date}.json")
    spec.write_text(files["results"], json.dumps(results, indent=2, default=handle_non_serializable,
                                                 ensure_ascii=False) + "\n")
    return files


# ----------------------------------------------------------------------------- option checks


def check_task_options(cfg: Any) -> None:
    """The lm-eval options of a run: lm-eval installed, names given, a real --include-path;
    the task-only options only with --tasks."""
    if cfg.tasks is None:
        given = {"--num-fewshot": cfg.num_fewshot is not None, "--include-path": cfg.include_path is not None,
                 "--apply-chat-template": cfg.apply_chat_template}
        misplaced = [name for name, is_given in given.items() if is_given]
        if misplaced:
            raise UsageError(f"{misplaced[0]} applies to lm-eval tasks only: add --tasks")
        return
    if lm_eval is None:
        raise UsageError(f"--tasks needs lm-evaluation-harness: pip install {LM_EVAL}")
    if not task_names(cfg.tasks):
        raise UsageError("--tasks names no task")
    if cfg.bootstrap_iters < 0:
        raise UsageError(f"--bootstrap-iters must be >= 0, got {cfg.bootstrap_iters}")
    if cfg.num_fewshot is not None and cfg.num_fewshot < 0:
        raise UsageError(f"--num-fewshot must be >= 0, got {cfg.num_fewshot}")
    if cfg.include_path is not None and not Path(cfg.include_path).is_dir():
        raise UsageError(f"--include-path {cfg.include_path} is not a directory")


def task_names(text: str) -> List[str]:
    return [name.strip() for name in text.split(",") if name.strip()]
