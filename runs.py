"""A run's bookkeeping, beside the evaluation it observes: what it computes (its
fingerprint), what --out already holds of it, the journal that lets a killed run resume,
and the JSONL files it reads, checked line by line.

Reading order: the programs compiled (CompileLog) -> the fingerprint -> the output directory (held by one run at a time; this
run finished already, or another's) -> the journal (the inference core's finished windows,
each a checksummed record, read back by a resumed run) -> JSONL datasets and their checks.
evaluate.Evaluator.run is where they are used; none of them changes what the inference
core plans or computes.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from checkpoints import Node, model_config, to_host
from jobs import (ExecutionSpec, UsageError, checkpoint_files, file_digest, open_regular, read_json, short,
                  signals_held, write_atomic)

# ----------------------------------------------------------------------------- programs compiled


class CompileLog:
    """Every XLA program this process builds, as jax.monitoring reports it: each compiled, or
    loaded from the persistent compilation cache (a cache hit, then its compile event), with
    the seconds its tracing, lowering and compiling (or loading) took. It observes only."""

    BACKEND = "/jax/core/compile/backend_compile_duration"
    STAGES = (BACKEND, "/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
    CACHE_HIT = "/jax/compilation_cache/cache_hits"

    def __init__(self) -> None:
        self.events: List[Tuple[str, str, float, bool]] = []  # (event, function name, seconds, loaded)
        self.hits = 0  # cache hits whose compile event has not come yet
        jax.monitoring.register_event_listener(self._hit)
        jax.monitoring.register_event_duration_secs_listener(self._record)

    def _hit(self, event: str, **meta: Any) -> None:
        self.hits += event == self.CACHE_HIT

    def _record(self, event: str, seconds: float, **meta: Any) -> None:
        if event in self.STAGES:
            loaded = event == self.BACKEND and self.hits > 0
            self.hits -= loaded
            self.events.append((event, meta.get("fun_name", "?"), seconds, loaded))

    def since(self, mark: int) -> Dict[str, Any]:
        """The programs since events[mark]: how many were compiled (their names, in order) and
        loaded, and the seconds all of them took to trace, lower and compile or load."""
        new = self.events[mark:]
        compiled = [(seconds, name) for event, name, seconds, loaded in new if event == self.BACKEND and not loaded]
        return {"compiles": len(compiled), "names": [name for _, name in compiled],
                "loaded": sum(loaded for *_, loaded in new), "seconds": sum(seconds for _, _, seconds, _ in new),
                "longest": max(compiled, default=(0.0, None))}

    def programs(self, mark: int) -> Dict[str, Any]:
        """since(mark) as results.json records it: counts, seconds, each program's name with
        how many times it was compiled, and the one whose compiling (XLA's part) took longest."""
        new = self.since(mark)
        seconds, name = new["longest"]
        return {"compiled": new["compiles"], "loaded": new["loaded"], "seconds": round(new["seconds"], 3),
                "by_name": dict(collections.Counter(new["names"])),
                "longest_compile": {"name": name, "seconds": round(seconds, 3)}}


_COMPILE_LOG: List[CompileLog] = []


def compile_log() -> CompileLog:
    """This process's CompileLog, listening from the first call on (jax keeps listeners for good)."""
    if not _COMPILE_LOG:
        _COMPILE_LOG.append(CompileLog())
    return _COMPILE_LOG[0]


# ----------------------------------------------------------------------------- fingerprint
# A run's fingerprint is what it computes: the weights, each evaluation's data, every option
# that can change a score. results.json records it, so the same command is not redone and
# another is not written over what it finished; the journal's first record is it too.

# Options that cannot change a score: how the work is spread and shown, and where it goes.
# Every other option is part of a run's fingerprint, so a new option counts unless listed
# here; --ckpt and --data count through what they name (the model's files, the datasets).
UNSCORED_OPTIONS = ("out", "batch_size", "mesh", "chunks", "quiet", "force", "coordinator", "num_processes",
                    "process_id", "ckpt", "data", "no_compile_cache")
JOURNAL_FILE = ".journal"  # the finished windows of requests of an unfinished run (Journal)
OUTPUT_FILES = ("results.json", "samples.jsonl", JOURNAL_FILE)
# where a run killed with SIGKILL can have left temporaries (jobs.write_temporary's names)
STALE_TEMPORARIES = tuple(f".{name}.*.tmp" for name in OUTPUT_FILES) + ("lm_eval/*/.*.tmp",)
TASK_FILES = (".yaml", ".yml", ".py", ".json", ".jsonl")  # what an --include-path task is made of


def run_fingerprint(evaluator: Any) -> Dict[str, Any]:
    """What a run computes, as JSON: the weights, each evaluation's data, and every option
    that can change a score (all but UNSCORED_OPTIONS)."""
    cfg = evaluator.cfg
    options = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in UNSCORED_OPTIONS}
    datasets = {e.name: dataset_fingerprint(e) for e in evaluator.evaluations}
    if cfg.include_path is not None:
        datasets["--include-path"] = task_files_fingerprint(cfg.include_path)
    return json.loads(json.dumps({"model": model_fingerprint(evaluator), "datasets": datasets, "options": options}))


def model_fingerprint(evaluator: Any) -> Dict[str, Any]:
    """A checkpoint: its path, and the size and hash of each file it is read from; a hub
    model's snapshot: its id and commit for the path (a cache moved elsewhere holds the same
    run). Weights made here (fresh, from --seed) or handed over in memory: the model's
    fields and a hash of the parameters."""
    base = evaluator.base
    if base is None and evaluator.cfg.ckpt is not None:  # handed over in memory, yet named
        base = Node(evaluator.cfg.ckpt)
    if base is not None:
        directory = Path(base.path)
        files = {name: file_digest(directory / name, "checkpoint file") for name in checkpoint_files(directory)}
        if base.hub is not None:
            return {"checkpoint": base.hub["id"], "commit": base.hub["commit"], "files": files}
        return {"checkpoint": os.path.abspath(directory), "files": files}
    return {"checkpoint": None, "model": model_config(evaluator.model),
            "sha256": parameters_digest(evaluator.variables)}


def dataset_fingerprint(evaluation: Any) -> Dict[str, Any]:
    """A JSONL file: its path, size and hash. Data made in memory (the built-in sets): a hash
    of its items."""
    dataset = getattr(evaluation, "dataset", None)
    kind = getattr(evaluation, "kind", type(evaluation).__name__)
    if isinstance(dataset, JsonlDataset):  # the bytes its lines were checked in, not the file as it is now
        return {"kind": kind, "path": os.path.abspath(dataset.path), **dataset.digest}
    items = json.dumps(list(dataset) if dataset is not None else None, sort_keys=True)
    return {"kind": kind, "sha256": hashlib.sha256(items.encode()).hexdigest()}


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


@contextlib.contextmanager
def out_dir_held(spec: ExecutionSpec) -> Iterator[None]:
    """The output directory, checked and held by process 0 (which alone writes) for the whole
    run (jobs.DirectoryLock), a killed run's temporaries removed; a second run into it is
    refused, naming the holder, whatever it would do (even nothing: what it would read is
    being replaced). In a multi-process run the others learn whether process 0 could, so
    that none waits in a collective for a process 0 that has left."""
    lock, refusal = None, None
    if spec.is_main:
        try:
            spec.check_out_dir(OUTPUT_FILES)
            lock = spec.lock_out_dir(STALE_TEMPORARIES)
        except UsageError as e:
            refusal = e
    if jax.process_count() > 1:
        refused = bool(multihost_utils.broadcast_one_to_all(np.int32(refusal is not None)))
        if refused and refusal is None:
            raise UsageError("process 0 refused this run (its error says why)")
    if refusal is not None:
        raise refusal
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def previous_run(evaluator: Any, fingerprint: Dict[str, Any]) -> bool:
    """Whether --out already holds this very run, finished. Process 0 alone reads the output
    directory and decides (read_previous); in a multi-process run the others learn its
    decision (refused or finished)."""
    spec, finished, refusal = evaluator.spec, False, None
    if spec.is_main:
        try:
            finished = read_previous(spec, fingerprint, evaluator.cfg.force)
        except UsageError as e:
            refusal = e
    if jax.process_count() > 1:
        flags = np.array([refusal is not None, finished], np.int32)
        flags = np.asarray(multihost_utils.broadcast_one_to_all(flags))
        if not spec.is_main and flags[0]:
            raise UsageError("process 0 refused this run (its error says why)")
        finished = bool(flags[1])
    if refusal is not None:
        raise refusal
    return finished


def read_previous(spec: ExecutionSpec, fingerprint: Dict[str, Any], force: bool) -> bool:
    """True when results.json holds this very run. Another run's results.json is refused
    unless `force`, or unless a try of this run was let in before (it journaled windows)."""
    done = spec.path("results.json")
    if force or not os.path.lexists(done):
        return False
    previous = read_json(done, "results file")
    previous = previous.get("fingerprint") if isinstance(previous, dict) else None
    if previous == fingerprint:
        return True
    if journal_holds(spec.path(JOURNAL_FILE), fingerprint):
        return False
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


# A run journals its work window by window, so that a kill at any instant (SIGKILL, power
# loss) costs at most the windows under way: the inference core tells the journal each window
# of requests it finishes (inference.Recorder), with its results, and a resumed run's core
# takes them back instead of computing them. The windows are the core's own, so a run plans
# the same blocks with a journal or without, and a resumed one plans what is left as the
# first try did: it ends with the same bytes as a run never interrupted.

JOURNAL_FORMAT = "gpt-eval-journal-v2"


def journaling() -> bool:
    """Whether runs journal their work (GPT_EVAL_JOURNAL=0: not, for a benchmark's comparison)."""
    return os.environ.get("GPT_EVAL_JOURNAL") != "0"


def frame(payload: bytes) -> bytes:
    """One journal record: b"LENGTH SHA256\n", the payload, b"\n" (which the length counts)."""
    body = payload + b"\n"
    return f"{len(body)} {hashlib.sha256(body).hexdigest()}\n".encode() + body


def read_frames(data: bytes, wanted: Callable[[int, Any], bool] = lambda position, payload: True
                ) -> Tuple[List[Any], int]:
    """The JSON payloads of the whole, valid records at the start of `data`, and where they
    end: the first record that is cut short or fails its checksum (a kill in the middle of
    an append), or whose payload `wanted(position, payload)` refuses, ends the list, and
    whatever follows it is dropped."""
    payloads, end = [], 0
    while end < len(data):
        header, newline, _ = data[end:end + 100].partition(b"\n")
        length, _, digest = header.decode("ascii", "replace").partition(" ")
        if not newline or not length.isdigit():
            break
        start = end + len(header) + 1
        body = data[start:start + int(length)]
        if len(body) != int(length) or hashlib.sha256(body).hexdigest() != digest:
            break
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):
            break
        if not wanted(len(payloads), payload):
            break
        payloads.append(payload)
        end = start + len(body)
    return payloads, end


# What this version writes, checked before it is read back: a journal's windows (is_window).
# A checksum says that a record is whole, not that this version wrote it: one of another
# shape would end a resumed run in a traceback, or (a NaN) refuse it at every try.
def number(value: Any) -> bool:
    """A finite float, or an integer that a float holds exactly (numpy sums them as floats);
    true is no number."""
    return type(value) is float and math.isfinite(value) or type(value) is int and abs(value) < 2**53


def count(value: Any) -> bool:
    return number(value) and type(value) is int and value >= 0


def is_result(kind: str, fields: Any) -> bool:
    """Whether `fields` is one result of a call of `kind` as inference.as_fields writes it:
    (log-probability, tokens, correct ones), or (text, token ids, truncated)."""
    if type(fields) is not list or len(fields) != 3:
        return False
    if kind == "generate_until":
        text, tokens, truncated = fields
        return type(text) is str and type(tokens) is list and all(map(count, tokens)) and type(truncated) is bool
    logprob, tokens, correct = fields
    return number(logprob) and count(tokens) and count(correct) and correct <= tokens


CALL = re.compile(r"(.*)/(loglikelihood|loglikelihood_rolling|generate_until)/(0|[1-9][0-9]*)")  # InferenceJob.call_name


def is_window(payload: Any) -> bool:
    """Whether `payload` is a window as Journal.add writes it: a call, the digest of its
    requests, and its results, one or more."""
    if type(payload) is not dict or payload.keys() != {"call", "digest", "results"}:
        return False
    call, digest, results = payload["call"], payload["digest"], payload["results"]
    match = CALL.fullmatch(call) if type(call) is str else None
    return (match is not None and type(digest) is str and re.fullmatch("[0-9a-f]{64}", digest) is not None
            and type(results) is list and bool(results) and all(is_result(match[2], r) for r in results))


def journal_shape(header: Dict[str, Any]) -> Callable[[int, Any], bool]:
    """What a journal of `header` holds (read_frames' `wanted`): that header, then windows."""
    return lambda position, payload: payload == header if position == 0 else is_window(payload)


def journal_holds(path: Path, fingerprint: Dict[str, Any]) -> bool:
    """Whether the journal at `path` is one of this fingerprint's (its first record says so)."""
    if not os.path.lexists(path):
        return False
    with open_regular(path, "journal") as f:
        payloads, _ = read_frames(f.read(MAX_HEADER_BYTES), lambda position, payload: position == 0)
    return bool(payloads) and payloads[0] == {"format": JOURNAL_FORMAT, "fingerprint": fingerprint}


MAX_HEADER_BYTES = 16 << 20  # a fingerprint lists a few files and options: never near this


class Journal:
    """DIR/.journal while a run goes on, the run's inference.Recorder: its first record the
    run's fingerprint, then one per window the inference core finished, {"call", "digest",
    "results"} (see frame), each fsynced before the run goes on. One of another fingerprint
    is never read: it is replaced. A record that is not a window of the shape this version
    writes (is_window) is dropped with everything after it, as a torn one is. Process 0
    reads and writes it; in a multi-process run the others get what it read from it."""

    def __init__(self, spec: ExecutionSpec, fingerprint: Dict[str, Any]):
        self.spec, self.fd, self.refused = spec, None, set()
        header = {"format": JOURNAL_FORMAT, "fingerprint": fingerprint}
        data = self._open(header) if spec.is_main else b""
        if jax.process_count() > 1:
            data = broadcast_bytes(data)
        payloads, _ = read_frames(data, journal_shape(header))
        self.windows: Dict[str, List[Tuple[str, List[Any]]]] = {}
        for window in payloads[1:]:
            self.windows.setdefault(window["call"], []).append((window["digest"], window["results"]))

    def _open(self, header: Dict[str, Any]) -> bytes:
        """Open the journal for appending, this run's (cut after its last whole record of the
        right shape) or a new one (replacing another run's); the bytes of this run's records so far."""
        path = self.spec.path(JOURNAL_FILE)
        data = b""
        if os.path.lexists(path):
            with open_regular(path, "journal") as f:
                data = f.read()
        payloads, end = read_frames(data, journal_shape(header))
        if not payloads:
            data = frame(json.dumps(header).encode())
            write_atomic(path, data)
            end = len(data)
        self.fd = os.open(path, os.O_WRONLY)
        if end < len(data):
            os.ftruncate(self.fd, end)  # a record cut short by a kill (or not a window), dropped before any other follows
        os.lseek(self.fd, end, os.SEEK_SET)
        return data[:end]

    def kept(self, call: str) -> List[Tuple[str, List[Any]]]:
        """The call's windows journaled by an earlier try: (digest of its requests, results)."""
        return list(self.windows.get(call, []))

    def add(self, call: str, digest: str, results: List[Any]) -> None:
        """A finished window, on disk (fsync) before the run goes on (process 0). One with a
        NaN or an infinity is not journaled, nor any later window of its call: the run
        refuses its scores, and a retry should compute them again, not read them back."""
        kind = call.rsplit("/", 2)[1]
        if call in self.refused or not all(is_result(kind, fields) for fields in results):
            self.refused.add(call)
            return
        if self.fd is None:
            return
        left = memoryview(frame(json.dumps({"call": call, "digest": digest, "results": results}).encode()))
        try:
            with signals_held():  # Ctrl-C and SIGTERM wait for the record; SIGKILL cuts it (read_frames)
                while left:
                    left = left[os.write(self.fd, left):]
                os.fsync(self.fd)
        except OSError as e:  # a full disk: the error names the journal
            raise OSError(e.errno, e.strerror, str(self.spec.path(JOURNAL_FILE))) from None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def broadcast_bytes(data: bytes) -> bytes:
    """Process 0's `data` on every process."""
    length = int(multihost_utils.broadcast_one_to_all(np.int64(len(data))))
    buffer = np.frombuffer(data, np.uint8) if data else np.zeros(length, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes()


# ----------------------------------------------------------------------------- JSONL datasets
# A JSONL file is checked line by line before anything is computed, so a bad line fails at once,
# naming file and line, not after hours of scoring.


KINDS = {  # kind -> required fields and their types
    "ppl": {"text": str},
    "mc": {"context": str, "choices": list, "gold": int},
    "gen": {"prompt": str, "answer": str},
    "acc": {"text": str},
}


class JsonlDataset:
    """A user JSONL file, checked line by line up front and then streamed (never held whole).

    A run scores exactly the bytes it checked and fingerprinted: the one pass that checks
    the lines also hashes the file (`digest`, what the fingerprint records), and each stream
    reads no further than the lines checked, hashing them again: lines appended meanwhile are
    never read, and bytes changed meanwhile end the run with one line once the stream is read
    through (before anything is written of it)."""

    def __init__(self, kind: str, path: str, limit: Optional[int] = None):
        if kind not in KINDS:
            raise UsageError(f"--data {kind}:{path}: unknown kind {kind!r}; choose {', '.join(KINDS)}")
        self.kind, self.path, self.limit = kind, Path(path), limit
        self.count, self.digest, self.used = self._check()
        if self.count == 0:
            raise UsageError(f"{path}: empty dataset (no JSON lines)")

    def _check(self) -> Tuple[int, Dict[str, Any], Tuple[int, str]]:
        """(samples, {"bytes", "sha256"} of the file, (bytes, sha256) of the lines streamed:
        all of them, or those up to the limit's last sample)."""
        whole, size, count, used = hashlib.sha256(), 0, 0, None
        with open_regular(self.path, "--data file") as f:
            for number, raw in enumerate(f, 1):
                whole.update(raw)
                size += len(raw)
                if used is None and raw.strip():
                    check_sample(self.kind, raw, f"{self.path}:{number}")
                    count += 1
                    if count == self.limit:
                        used = (size, whole.hexdigest())
        return count, {"bytes": size, "sha256": whole.hexdigest()}, used or (size, whole.hexdigest())

    def _lines(self) -> Iterator[Tuple[int, bytes]]:
        """(line number, bytes) of the lines checked, as they are now; UsageError at the end if
        those bytes are no longer the ones checked."""
        digest, left = hashlib.sha256(), self.used[0]
        with open_regular(self.path, "--data file") as f:
            for number, raw in enumerate(f, 1):
                raw = raw[:left]
                digest.update(raw)
                left -= len(raw)
                yield number, raw
                if not left:
                    break
        if left or digest.hexdigest() != self.used[1]:
            raise UsageError(f"{self.path} changed while this run read it; nothing of it was written (run again "
                             "once it no longer changes)")

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        for number, raw in self._lines():
            if raw.strip():
                yield check_sample(self.kind, raw, f"{self.path}:{number}")

    def __len__(self) -> int:
        return self.count

    def line_of(self, index: int) -> str:
        """The line number of sample `index`, for an error message (the file is read again;
        "?" if it no longer has that many lines)."""
        numbers = (str(number) for number, raw in self._lines() if raw.strip())
        return next(itertools.islice(numbers, index, None), "?")


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
    if kind == "gen" and not sample["answer"].strip():  # outputs are compared stripped
        raise UsageError(f"{where}: 'answer' is empty or only whitespace, which an empty output would match")
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
