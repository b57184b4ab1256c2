"""The inference core: requests in, log-likelihoods and generations out, on a device mesh.

    from inference import InferenceJob, Request
    job = InferenceJob(model, variables, tokenizer, mesh, batch_size=8)   # gpt.py's GPT on a mesh
    [(request, scored)] = job.loglikelihood([Request(0, context_ids, continuation_ids)])

This file, fast.py and gpt.py are all it needs: copy the three into another project.
Reading order: the tokenizer it expects -> the three request types and their results ->
stop strings -> how requests become fixed-shape blocks (padding, sorting, scheduling) and
progress reports -> InferenceJob: the simple path (a request a row; gpt.generate), then
the fast path (fast.py's packed rows and decoder, run in blocks), whose every mechanism
says in its docstring's first words what it equals, and its jitted kernels (one lax.scan over a
block's batches; decoding in segments), then loglikelihood, loglikelihood_rolling and
generate_until, named as lm-evaluation-harness names them:
- loglikelihood: the log-probability of a continuation given a context (token ids);
  requests in a row that see the same context share one pass over it;
- loglikelihood_rolling: a whole document scored token by token in windows of the
  context length (perplexity, next-token accuracy);
- generate_until: new tokens after a prompt until EOS, a stop string or the limit; a
  row that has reached one takes the next waiting prompt (continuous batching).
Each request carries the index of its document, and results come back in request order.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import sys
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Protocol, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import fast
import gpt
from fast import Request  # loglikelihood's request type, defined where the packs need it


class RequestError(ValueError):
    """A request or batch that cannot be run as asked (longer than the context, larger than
    memory): the caller's input, reported as such, not a bug."""


# The lowest sampling temperature besides 0 (greedy): logits / T overflows float32 long before
# T reaches its smallest values (1e-38 and 1e-40 gave garbage), and below 1e-6 sampling is
# greedy decoding in all but name (a logit gap of 1e-4 already makes the runner-up e^-100 as likely)
MIN_TEMPERATURE = 1e-6


class Tokenizer(Protocol):
    """What InferenceJob needs of a tokenizer (jobs.ByteTokenizer and jobs.HFTokenizer are two).

    encode(text, add_special_tokens) gives token ids, with the tokenizer's own special
    tokens (a Llama tokenizer's BOS) unless add_special_tokens is False; decode(ids) gives
    text without special tokens. bos_token_id and eos_token_id may be None: the first
    context token of a document is BOS, else EOS (prefix_id; with neither, no document and
    no empty context can be scored), and generation stops at EOS. vocab_size is one more
    than the largest id encode can return, at most the model's vocab_size (every id must
    have a row in the embedding).
    """

    bos_token_id: Optional[int]
    eos_token_id: Optional[int]
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]: ...

    def decode(self, ids: List[int]) -> str: ...


# ----------------------------------------------------------------------------- requests and results


class GenerationRequest(NamedTuple):
    """generate_until: new tokens after `prompt` (token ids) for document `doc`, decoding
    stopped and the text cut at the first of the `until` strings."""

    doc: int
    prompt: List[int]
    until: Tuple[str, ...] = ("\n",)


@dataclasses.dataclass
class Scored:
    """One loglikelihood request's outcome: summed log-probability of the continuation,
    its token count, how many of its tokens were the argmax prediction, and the padded row
    that was run (tokens, mask), kept only when asked for (requests packed together share
    their row)."""

    logprob: float
    tokens: int
    correct: int
    row: Any = None


@dataclasses.dataclass
class Generation:
    """One generate_until request's outcome: the text (cut at a stop string), the new token
    ids (up to EOS, or through the token that completed the stop string), whether the prompt
    was cut from the left to fit, and, kept only when asked for, the rollout as a row (tokens,
    mask): the prompt's slots, left-padded, then n_new slots holding the new tokens through
    the one that ended decoding (EOS included), right-padded (see rollout_row)."""

    text: str
    tokens: List[int]
    truncated: bool
    row: Any = None


def per_document(results: Iterable[Tuple[Request, Scored]]) -> Iterator[List[Scored]]:
    """Results of requests in document order -> one list per document (regrouped by tag)."""
    for _, group in itertools.groupby(results, key=lambda pair: pair[0].doc):
        yield [scored for _, scored in group]


class Recorder(Protocol):
    """A run's record of finished work (runs.Journal), which the core only informs and
    reads back: each window of a call's requests, once computed, is added with its results
    (`add`); a call of a resumed run first takes back the windows its first try finished
    (`kept`), as long as their requests are the same, and computes the rest from there. A
    window is the core's own unit of planning (InferenceJob.in_blocks, generate_until), so a
    resumed call plans what is left exactly as the first try did, and a run plans the same
    with a recorder or without one."""

    def kept(self, call: str) -> List[Tuple[str, List[Any]]]:
        """The call's windows recorded so far, in order: (digest of its requests, results)."""

    def add(self, call: str, digest: str, results: List[Any]) -> None:
        """One more window of the call, computed: its requests' digest and its results."""


def window_digest(requests: List[Any], settings: Tuple[Any, ...]) -> str:
    """What a window asked: its requests (token ids, documents, stop strings) and settings."""
    return hashlib.sha256(json.dumps([list(settings), [list(r) for r in requests]]).encode()).hexdigest()


def as_fields(result: Any) -> List[Any]:
    """A Scored or a Generation as a recorder keeps it (the row, kept only on request, is not)."""
    if isinstance(result, Scored):
        return [result.logprob, result.tokens, result.correct]
    return [result.text, result.tokens, result.truncated]


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


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    cut = min([text.index(s) for s in stops if s and s in text], default=len(text))
    return text[:cut]


# ----------------------------------------------------------------------------- stop strings
# A row is done at EOS or once its text holds one of its stop strings; a batch stops
# decoding when all its rows are done. Text exists only on the host, so the jitted loop
# runs segment_steps (SHAPES) tokens at a time with the cache kept on the device, and the host
# checks the new tokens between segments (no round trip per token). A segment of 8 steps
# overshoots the last row's end by 3.5 steps on average (at most 7), a few percent of a
# typical answer, while a check costs a host copy of [B, N] token ids and a few decodes.
# The check decodes the row's tokens so far: a stop string may span tokens or end inside
# one. That assumes the text of the first k tokens is the start of the text of more tokens
# (byte-level BPE, less an unfinished character), as lm-eval's own stopping check does, so
# the text cut at the first stop string is the one the whole decoding would give. Rows that
# are done are dropped between segments once the running ones fit in a quarter of the rows
# (InferenceJob.compact): a step reads every row's KV cache, more bytes than the weights at
# a few hundred slots, so the tail of a batch (its last long answers) costs a few rows' worth.
# Before that, while prompts wait, a done row takes the next one (refill, continuous
# batching: InferenceJob.decode_queue, fast.refill_rollout), so batches' tails overlap.

SEGMENT_STEPS = 8
# A batch's prompts that begin alike (a task's fixed few-shot examples, such as gsm8k-cot's
# 8) are prefilled from one row of that beginning (InferenceJob.shared_prefix)
SHARED_PREFIX_STEP = 64
# The shapes a platform gets (InferenceJob's lengths_per_octave, compact_rows and segment_steps):
# a CPU compiles a program in about the time it computes a few thousand tokens, so blocks take 8
# lengths between two powers of two (little padding) and a rollout's last running rows move into
# fewer (InferenceJob.compact); an accelerator takes seconds a program and pads nearly for free,
# so there lengths are powers of two and every row of a rollout decodes to its end, in segments
# of 32 steps (each segment's program boundary and host check cost more than a few steps there)
SHAPES = {"cpu": dict(lengths_per_octave=8, compact_rows=True, segment_steps=SEGMENT_STEPS)}
ACCELERATOR_SHAPES = dict(lengths_per_octave=1, compact_rows=False, segment_steps=32)  # any platform not in SHAPES


def has_stop(text: str, stops: Sequence[str]) -> bool:
    return any(s in text for s in stops)


def steps_to_end(ids: List[int], eos: Optional[int], until: Sequence[str], decode: Callable[[List[int]], str],
                 first: int = 1) -> Optional[int]:
    """After how many of these new tokens a row is done: through its first EOS, or through
    the token that completes one of its stop strings; None if neither is here yet. The
    first - 1 tokens are known not to end it (the check is exact, not per segment)."""
    by_eos = ids.index(eos) + 1 if eos is not None and eos in ids else None
    text_ids = ids[:by_eos - 1] if by_eos else ids
    stops = [s for s in until if s]
    if stops and has_stop(decode(text_ids), stops):
        return next(k for k in range(max(first, 1), len(text_ids) + 1) if has_stop(decode(text_ids[:k]), stops))
    return by_eos


# ----------------------------------------------------------------------------- blocks and progress


SORT_WINDOW = 8  # blocks' worth of requests sorted by length at a time
LOGITS_BYTES = 1 << 28  # float32 logits unembedded at a time when scoring (256 MB)
UNEMBED_PIECE = 128  # scored positions per share unembedded at a time: the loop skips padding in these steps
PROGRESS_SECONDS = 5.0  # between two progress lines when stderr is not a terminal


def rollout_row(tokens_P: np.ndarray, mask_P: np.ndarray, new: List[int], n_new: int) -> Tuple[np.ndarray, np.ndarray]:
    """(tokens, mask) [P + n_new] of one generation: its left-padded prompt row, then the new
    tokens that were decoded for it (what its text and score come from), then padding. A
    trainer takes the real tokens of the last n_new slots as the generated ones."""
    tokens = np.concatenate([tokens_P, np.zeros(n_new, tokens_P.dtype)])
    mask = np.concatenate([mask_P, np.zeros(n_new, bool)])
    tokens[len(tokens_P):len(tokens_P) + len(new)], mask[len(tokens_P):len(tokens_P) + len(new)] = new, True
    return tokens, mask


def sample_keys(ids_B: jax.Array, seed: Any) -> jax.Array:
    """One sampling key per row, its document's: the same text at any batch size, mesh or order."""
    return jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(ids_B)


def padded_length(n: int, cap: int, per_octave: int = 8) -> int:
    """n rounded up to one of per_octave lengths between two powers of two (a multiple of 16),
    at most cap: with 8, a multiple of 1/16 of its next power of two, so a row of more than 256
    tokens is at most 1/8 padding (3% on average); with 1, its next power of two."""
    step = max(16, (1 << max(n - 1, 0).bit_length()) // (2 * per_octave))
    return min(cap, -(-max(n, 1) // step) * step)


def scored_width(most: int, length: int) -> int:
    """Scored slots per row of a block whose rows hold at most `most` scored tokens in
    `length` token slots: the next power of two (at least 16), but no more than the length
    where that holds them (a slot unembedded for nothing costs a fraction of a token's
    pass). A row can hold more scored tokens than tokens: one-token continuations add a
    scored slot each and no token (six contexts under one prefix, three one-token choices
    each: 18 scored in 8 tokens)."""
    width = 1 << max(most - 1, 15).bit_length()
    return min(width, length) if most <= length else width


def is_argmax(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Whether each target is argmax(logits) [B, T], ties going to the first index as in
    jnp.argmax and torch.argmax: no logit above the target's, none equal before it. One
    fused comparison pass: XLA's CPU backend runs jnp.argmax's paired value-and-index
    reduction slowly (a fourteenth of a scoring call; this, a thousandth)."""
    target_BT1 = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)
    index_BTV = jax.lax.broadcasted_iota(jnp.int32, logits_BTV.shape, logits_BTV.ndim - 1)
    beaten_BTV = (logits_BTV > target_BT1) | ((logits_BTV == target_BT1) & (index_BTV < targets_BT[..., None]))
    return ~beaten_BTV.any(-1)


class Progress:
    """Progress of one call on stderr: documents done of `total` and tokens/s. A tqdm bar on
    a terminal; elsewhere (a batch job's log) a line every PROGRESS_SECONDS, and a last one
    at the end if any came before: a call shorter than that prints nothing, so a quick run
    that fails still ends with its one line. The blocks report what they finish
    (InferenceJob.in_blocks), so it moves while a sorted window is still running."""

    def __init__(self, name: str, total: int, unit: str):
        self.name, self.total, self.unit, self.done, self.tokens = name, total, unit, 0, 0
        self.started = self.shown = time.monotonic()
        self.shown_done = -1  # the count the last line showed
        self.bar = tqdm(desc=name, total=total, unit=unit, leave=False) if sys.stderr.isatty() else None

    def advance(self, documents: int, tokens: int) -> None:
        self.done, self.tokens = self.done + documents, self.tokens + tokens
        if self.bar is not None:
            self.bar.update(documents)
        elif time.monotonic() - self.shown >= PROGRESS_SECONDS:
            self.line()

    def line(self) -> None:
        self.shown, self.shown_done = time.monotonic(), self.done
        seconds = max(self.shown - self.started, 1e-9)
        print(f"{self.name}: {self.done}/{self.total} {self.unit}, {self.tokens / seconds:,.0f} tokens/s, "
              f"{seconds:.0f} s", file=sys.stderr, flush=True)

    def close(self, finished: bool) -> None:
        if self.bar is not None:
            self.bar.close()
        elif finished and 0 <= self.shown_done != self.done:
            self.line()


class BlockRun(NamedTuple):
    """What one block ran: its real tokens, and its shape [chunks, rows, length]."""

    real: int
    chunks: int
    rows: int
    length: int


class DecodeRun(NamedTuple):
    """What one decoded batch ran: its rows, the decoding steps, the steps its rows needed
    (the latest end), the token slots its prefill computed, the row-steps (rows times
    steps, summed over segments: fewer than rows x steps once done rows are dropped), and
    the cache slots a decoding step over all its rows reads (the shared prefix once, then
    each row's own)."""

    rows: int
    steps: int
    needed: int
    prefill: int
    row_steps: int
    cache_slots: int


@dataclasses.dataclass
class Counts:
    """What a job ran, for bench.py and the tests: each block (prompts' prefills and
    refills included) and each rollout. It records what ran and plans nothing."""

    blocks: List[BlockRun] = dataclasses.field(default_factory=list)
    rollouts: List[DecodeRun] = dataclasses.field(default_factory=list)

    def block(self, real: int, chunks: int, rows: int, length: int) -> None:
        self.blocks.append(BlockRun(int(real), chunks, rows, length))


class Queue:
    """A rollout's requests (longest prompt first) and where each stands between segments
    (InferenceJob.decode_queue): the plan (plan_rollout: prompts, shared prefix, cache slots
    per prompt, rows, the padded prompts), each row's request (owner; -1: none) and its
    document id, each request's tokens and end once done, the step it began at and the
    tokens checked for stop strings, the next waiting request, the steps and row-steps run."""

    def __init__(self, requests: List[GenerationRequest], prompts: List[List[int]], prefix: List[int], length: int,
                 rows: int, tokens: np.ndarray, mask: np.ndarray):
        self.requests, self.prompts, self.prefix, self.length, self.rows = requests, prompts, prefix, length, rows
        self.tokens, self.mask = tokens, mask
        self.owner = np.where(np.arange(rows) < len(requests), np.arange(rows), -1)
        self.ids = np.array([requests[i].doc if i >= 0 else 0 for i in self.owner], np.int32)
        self.news: List[List[int]] = [[] for _ in requests]
        self.ends: List[Optional[int]] = [None] * len(requests)
        self.began, self.checked = np.zeros(len(requests), int), np.ones(len(requests), int)
        self.waiting, self.step, self.row_steps = min(rows, len(requests)), 0, 0

    def counted(self, n_new: int) -> DecodeRun:
        """What the rollout ran, for bench.py and the tests."""
        own = self.length - len(self.prefix)  # each row's prompt slots after the shared prefix
        needed = max(int(b) + (n_new if e is None else e) for b, e in zip(self.began, self.ends))
        return DecodeRun(self.rows, self.step, needed, len(self.prefix) + len(self.requests) * own, self.row_steps,
                         len(self.prefix) + self.rows * (own + n_new))


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
    every result. Results come back in the order the requests went in. Generation runs a
    window as one rollout of batch_size rows whose done rows take the waiting prompts
    (decode_queue).

    What ran is counted in `counts` (Counts), for benchmarks and tests: each block's shape
    and real tokens, each rollout's rows, steps and slots.
    """

    def __init__(self, model: gpt.GPT, variables: Any, tokenizer: Tokenizer, mesh: jax.sharding.Mesh,
                 batch_size: int = 8, chunks: int = 16, seed: int = 0, quiet: bool = False,
                 share_contexts: bool = True, simple: bool = False, fill_length: int = fast.FILL_LENGTH,
                 refill: bool = True, shared_prefix_step: int = SHARED_PREFIX_STEP,
                 segment_steps: Optional[int] = None, unembed_piece: int = UNEMBED_PIECE,
                 lengths_per_octave: Optional[int] = None, compact_rows: Optional[bool] = None):
        """`variables` are the model's parameters placed on `mesh` (gpt.init_params or
        gpt.place_params); batch_size is the most rows per forward pass (rounded up to a
        multiple of the mesh's "batch" size), chunks how many batches one jitted call scans,
        seed the default of generate_until's sampling, quiet turns progress reports off,
        share_contexts packs requests of one context into one row (off: a row each), simple
        runs every request type the simple way (see "the simple path" below). The fast
        path's settings, each beside the default it is named after: fill_length (rows that
        short packs fill), refill (a done row takes a waiting prompt; False: a batch at a
        time), shared_prefix_step (the shared prompt beginning's unit; longer than any
        prompt: none), segment_steps (decoding steps between the host's stop checks),
        unembed_piece (scored positions unembedded at a time), lengths_per_octave (block and
        rollout lengths between two powers of two; with 1, the fewest programs: every block and
        rollout has batch_size rows, and a rollout takes an earlier one's slots where they fit),
        compact_rows (a rollout's last running
        rows move into fewer, compact); these two and segment_steps by default SHAPES's for the mesh's
        platform."""
        shapes = SHAPES.get(mesh.devices.flat[0].platform, ACCELERATOR_SHAPES)
        lengths_per_octave = shapes["lengths_per_octave"] if lengths_per_octave is None else lengths_per_octave
        compact_rows = shapes["compact_rows"] if compact_rows is None else compact_rows
        segment_steps = shapes["segment_steps"] if segment_steps is None else segment_steps
        for name, value in (("batch_size", batch_size), ("chunks", chunks), ("segment_steps", segment_steps),
                            ("lengths_per_octave", lengths_per_octave)):
            if value < 1:
                raise RequestError(f"{name} must be at least 1, not {value}")
        if tokenizer.vocab_size > model.vocab_size:
            raise RequestError(f"the tokenizer's ids reach {tokenizer.vocab_size - 1} (vocab_size "
                               f"{tokenizer.vocab_size}), beyond the model's embedding of {model.vocab_size} rows")
        self.model, self.variables, self.tokenizer, self.mesh = model, variables, tokenizer, mesh
        self.requested_batch_size, self.chunks, self.seed, self.quiet = batch_size, chunks, seed, quiet
        self.share_contexts, self.simple = share_contexts, simple
        self.fill_length, self.refill, self.shared_prefix_step = fill_length, refill, shared_prefix_step
        self.segment_steps, self.unembed_piece = segment_steps, unembed_piece
        self.lengths_per_octave, self.compact_rows = lengths_per_octave, compact_rows
        self.dp = mesh.shape["batch"]
        self.replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self._simple_score = jax.jit(self.simple_score, out_shardings=self.replicated)
        self._score = jax.jit(self._score_block, out_shardings=self.replicated)
        self._take_rows = jax.jit(self.take_rows)
        self._generators: Dict[Tuple, Tuple[Callable, Callable]] = {}
        self.counts = Counts()
        self.rollout_lengths: set = set()  # prompt slots of the rollouts so far (plan_rollout)
        self.report: Optional[Progress] = None
        self.recorder: Optional[Recorder] = None  # a run's journal, which the finished windows go to
        self.scope = ""  # what the calls are for (an evaluation's name): with a count, a call's name
        self.calls: Dict[Tuple[str, str], int] = collections.Counter()

    # --- sizes, padding, placement

    @property
    def max_len(self) -> int:
        return self.model.block_size

    @property
    def prefix_id(self) -> int:
        """BOS if the tokenizer has one, else EOS: the first context token (as lm-eval). With
        neither, a document's first token has nothing to be predicted from: refused, rather
        than conditioned on whatever token 0 is."""
        bos, eos = self.tokenizer.bos_token_id, self.tokenizer.eos_token_id
        if bos is None and eos is None:
            raise RequestError("the tokenizer has neither a BOS nor an EOS token, which a document or an "
                               "empty context needs to start from")
        return bos if bos is not None else eos

    @property
    def batch_size(self) -> int:
        """The per-chunk batch, rounded up to a multiple of the data-parallel size."""
        return -(-self.requested_batch_size // self.dp) * self.dp

    def pad(self, rows: List[List[int]], length: int, count: int, left: bool) -> Tuple[np.ndarray, np.ndarray]:
        """`rows` padded to [count, length] tokens, on the left (generation: every prompt ends
        where decoding starts) or the right (scoring), and a mask True at real tokens."""
        tokens = np.zeros((count, length), np.int32)
        mask = np.zeros((count, length), bool)
        for i, row in enumerate(rows):
            where = slice(length - len(row), length) if left else slice(0, len(row))
            tokens[i, where], mask[i, where] = row, True
        return tokens, mask

    def batch_split(self, ndim: int, batch_axis: int) -> jax.sharding.NamedSharding:
        """An array of ndim dimensions with its batch_axis split over "batch"."""
        axes = (None,) * batch_axis + ("batch",) + (None,) * (ndim - batch_axis - 1)
        return gpt.input_sharding(self.model, self.mesh, axes)

    def put(self, block: np.ndarray, batch_axis: int = 1) -> jax.Array:
        """A host block [chunks, batch, ...] (or [batch, ...], batch_axis 0) onto the mesh,
        its batch split over "batch"."""
        sharding = self.batch_split(block.ndim, batch_axis)
        return jax.make_array_from_callback(block.shape, sharding, lambda index: block[index])

    def put_whole(self, block: np.ndarray) -> jax.Array:
        """A host array onto every device whole (each process copies its own)."""
        return jax.make_array_from_callback(block.shape, self.replicated, lambda index: block[index])

    # --- the simple path (simple=True): each request alone in a plain causal row, each batch of
    # prompts through gpt.generate. The fast path below (packing, row filling, shape buckets,
    # continuous batching, a shared prefix) gives the same results; test_all.py checks it.

    def simple_score(self, variables: Any, tokens_BT: jax.Array, targets_BT: jax.Array) -> Tuple[jax.Array, jax.Array]:
        """(log-probability of each target, whether it is the argmax) [B, T]: one forward pass."""
        logits_BTV, _ = self.model.apply(variables, tokens_BT, deterministic=True)
        return -gpt.token_nll(logits_BTV, targets_BT), is_argmax(logits_BTV, targets_BT)

    def simple_scored(self, requests: Iterable[Request], keep_rows: bool) -> Iterator[Tuple[Request, Scored]]:
        """loglikelihood the simple way: a request a row of max_len tokens (its last max_len + 1
        tokens of context + continuation less the last, right-padded), its continuation
        scored at the last predictions; batch_size rows a forward pass."""
        requests, T, B, last_doc = iter(requests), self.max_len, self.batch_size, None
        self.check_memory(B, T, T, T)  # the fast path's estimate: every position scored, the whole square attended
        while batch := list(itertools.islice(requests, B)):
            rows = [(r.context + r.continuation)[-(T + 1):] for r in batch]
            tokens, mask = self.pad([row[:-1] for row in rows], T, B, left=False)
            targets, _ = self.pad([row[1:] for row in rows], T, B, left=False)
            with jax.set_mesh(self.mesh):  # traced under the mesh: gpt.rows_at_a_time reads it
                out = self._simple_score(self.variables, self.put(tokens, 0), self.put(targets, 0))
            logprob, correct = (np.asarray(o) for o in out)
            self.counts.block(mask.sum(), 1, B, T)
            self.advance(len({r.doc for r in batch} - {last_doc}), int(mask.sum()))  # a document's windows run on
            last_doc = batch[-1].doc
            for b, (r, row) in enumerate(zip(batch, rows)):
                scored = slice(len(row) - 1 - len(r.continuation), len(row) - 1)
                yield r, Scored(float(logprob[b, scored].sum(dtype=np.float64)), len(r.continuation),
                                int(correct[b, scored].sum()), (tokens[b], mask[b]) if keep_rows else None)

    def simple_generator(self, n_new: int, temperature: float, top_p: float) -> Callable:
        """gpt.generate jitted once per decoding setting, each row sampled with its document's key."""
        key = ("simple", n_new, temperature, top_p)
        if key not in self._generators:
            def run(variables, prompts_BP, mask_BP, ids_B, seed):
                return gpt.generate(self.model, variables, prompts_BP, mask_BP, n_new, self.tokenizer.eos_token_id,
                                    temperature, top_p, sample_keys(ids_B, seed))
            self._generators[key] = jax.jit(run, out_shardings=self.replicated)
        return self._generators[key]

    def simple_generations(self, requests: Iterable[GenerationRequest], room: int, n_new: int,
                           sampling: Tuple[float, float, int], keep_rows: bool) -> Iterator[Tuple[GenerationRequest,
                                                                                                    Generation]]:
        """generate_until the simple way: batch_size prompts (their last `room` tokens, left-padded)
        decoded to n_new tokens whatever their stop strings, then each cut through EOS or the
        token that completes a stop string (an empty prompt generates nothing)."""
        temperature, top_p, seed = sampling
        generate, requests, B = self.simple_generator(n_new, temperature, top_p), iter(requests), self.batch_size
        self.check_memory(B, room + n_new, 1, room)  # as plan_rollout's, the prompts' queries at once
        while batch := list(itertools.islice(requests, B)):
            prompts = [r.prompt[-room:] for r in batch]
            tokens, mask = self.pad(prompts, room, B, left=True)
            ids = np.array([r.doc for r in batch] + [0] * (B - len(batch)), np.int32)
            with jax.set_mesh(self.mesh):
                new = np.asarray(generate(self.variables, self.put(tokens, 0), self.put(mask, 0), self.put(ids, 0),
                                          seed))
            self.counts.block(mask.sum(), 1, B, room)
            for b, (r, p) in enumerate(zip(batch, prompts)):
                out = new[b].tolist() if p else []
                end = steps_to_end(out, self.tokenizer.eos_token_id, r.until, self.tokenizer.decode)
                row = rollout_row(tokens[b], mask[b], out[:end], n_new) if keep_rows else None
                self.advance(1, len(p) + len(out))
                yield r, self.generation(r, out, end, len(r.prompt) > room, row)

    # --- the fast path: blocks of sorted, packed, filled rows (each equal to the simple path above)

    def schedule(self, sizes: List[Tuple[int, ...]], cap: int, most_chunks: int,
                 last: bool = False) -> Iterator[Tuple[int, int, int, Tuple[int, ...]]]:
        """Equals a row a batch, fewer calls: (start, chunks, rows, shape) blocks for requests of these
        sizes (a row's length first, then any other padded dimension), sorted longest first.
        Consecutive rows make batches (see batch_shapes); batches of one shape go most_chunks at a
        time into a block, the rest one by one; a short last batch has the next power of two of rows
        (a multiple of the data-parallel size), which later windows' short batches may share, or in
        the `last` window, where none comes after it, just its rows (the multiple of the
        data-parallel size above them): MMLU's 40 questions make 6 packed rows of about 1,000
        tokens, which 8 rows would pad by a third. So no batch is all padding, little of a row is,
        and there are only a few shapes (so few compilations) whatever the lengths. With
        lengths_per_octave 1 (an accelerator's, the fewest programs) a short batch has batch_size
        rows: a full batch's program, not one more."""
        batches = self.batch_shapes(sizes, cap)
        for (rows, shape), group in itertools.groupby(batches, key=lambda b: b[1:]):
            group = list(group)
            if rows < self.batch_size and self.lengths_per_octave == 1:
                rows = self.batch_size
            elif rows < self.batch_size:
                rows = rows if last else 1 << (rows - 1).bit_length()
                rows = min(self.batch_size, -(-rows // self.dp) * self.dp)
            while group:
                chunks = most_chunks if len(group) >= most_chunks else 1
                yield group[0][0], chunks, rows, shape
                group = group[chunks:]

    def batch_shapes(self, sizes: List[Tuple[int, ...]], cap: int) -> List[Tuple[int, int, Tuple[int, ...]]]:
        """(start, rows, shape) of each batch: its longest row's padded_length, and in any
        other dimension (scored slots) scored_width. A batch that would be
        alone in its shape takes the shape of the batch before it when that is at most a
        quarter longer: compiling a shape takes as long as computing a few thousand tokens,
        so for a small dataset a little padding is cheaper.
        (In a large one, neighbours in sorted order share shapes and nothing is merged.)"""
        batches = []
        for start in range(0, len(sizes), self.batch_size):
            batch = sizes[start:start + self.batch_size]
            length = padded_length(max(size[0] for size in batch), cap, self.lengths_per_octave)
            others = tuple(scored_width(max(dims), length) for dims in list(zip(*batch))[1:])
            batches.append((start, len(batch), (length, *others)))
        alone = collections.Counter(shape for _, _, shape in batches)
        for i in range(1, len(batches)):
            (_, _, before), (start, rows, shape) = batches[i - 1], batches[i]
            if alone[shape] == 1 and all(b >= s for b, s in zip(before, shape)) and 4 * before[0] <= 5 * shape[0]:
                alone[shape] -= 1
                batches[i] = (start, rows, before)
        return batches

    def in_blocks(self, packs: Iterable[fast.Pack], run_block: Callable[..., Callable[[], List[List[Scored]]]],
                  fill: bool) -> Iterator[List[Tuple[fast.Pack, List[Scored]]]]:
        """Equals simple_scored's request a row, in fixed-shape blocks: each window's [(pack, its
        requests' Scored)], in pack order: the windows of SORT_WINDOW blocks' packs, each run on its
        own (run_window), so memory does not grow with the dataset. A document is reported done
        (self.report) when its last request has run; one that goes on in the next window, when that
        part has."""
        packs = iter(packs)
        size = self.batch_size * self.chunks * SORT_WINDOW
        window = list(itertools.islice(packs, size))
        while window:
            following = list(itertools.islice(packs, size))
            left = collections.Counter(r.doc for p in window for r in p.requests)
            if following:
                left[following[0].requests[0].doc] += 1  # not done before the next window
            yield list(zip(window, self.run_window(window, run_block, fill, left, not following)))
            window = following

    def run_window(self, window: List[fast.Pack], run_block: Callable[..., Callable[[], List[List[Scored]]]],
                   fill: bool, left: Dict[int, int], last: bool) -> List[List[Scored]]:
        """Each pack's requests' Scored: the window's packs filled into rows (fast.fill_rows; with
        fill False a row each), sorted by length and scheduled into blocks, each started by
        run_block(packs, chunks, rows, length, width) (at most self.chunks batches), which returns
        the reader of its packs' Scored; `left` counts each document's requests not run yet.

        Equals reading each block's results before starting the next, with one block in flight:
        a block is read after the next one is started, so the host's packing, and the tracing
        and compiling of a new shape, overlap the device's work (the device runs them in order)."""
        room = min(self.fill_length, self.max_len)
        rows = fast.fill_rows([len(p.tokens) for p in window], room) if fill else [[i] for i in range(len(window))]
        merged = [fast.joined_packs([window[i] for i in row]) for row in rows]
        order = sorted(range(len(rows)), key=lambda r: -len(merged[r].tokens))
        results: List[Any] = [None] * len(window)

        def read(picked: List[int], real: int, reader: Callable[[], List[List[Scored]]]) -> None:
            for r, scored in zip(picked, reader()):
                for i in rows[r]:  # the row's Scored, split back into its packs'
                    results[i], scored = scored[:len(window[i].requests)], scored[len(window[i].requests):]
            docs = [q.doc for r in picked for q in merged[r].requests]
            left.subtract(docs)
            self.advance(sum(left[doc] == 0 for doc in set(docs)), real)

        in_flight = None
        sizes = [(len(merged[r].tokens), len(merged[r].scored)) for r in order]
        for start, chunks, n, shape in self.schedule(sizes, self.max_len, self.chunks, last):
            picked = order[start:start + chunks * n]
            real = sum(len(merged[r].tokens) for r in picked)
            started = picked, real, run_block([merged[r] for r in picked], chunks, n, *shape)
            self.counts.block(real, chunks, n, shape[0])
            if in_flight is not None:
                read(*in_flight)
            in_flight = started
        if in_flight is not None:
            read(*in_flight)
        return results

    def advance(self, documents: int, tokens: int) -> None:
        if self.report is not None:
            self.report.advance(documents, tokens)

    def check_memory(self, rows: int, length: int, scored: int, queries: int) -> None:
        """Refuse a batch that cannot fit before building it: the float32 logits and
        log-probabilities of its `scored` positions per row (a piece at a time, see
        token_scores), the keys and values of every layer, and the float32 attention scores
        and probabilities of `queries` queries per row at once (0: a fused kernel),
        against the memory available."""
        m = self.model
        logits = 2 * min(rows * scored * m.vocab_size * 4, LOGITS_BYTES)
        kv = rows * length * m.n_layers * 2 * m.kv_heads * m.head_width * np.dtype(m.pdtype).itemsize
        scores = 2 * rows * m.n_head * queries * length * 4
        needed, free = logits + kv + scores, gpt.available_memory()
        if needed > free:
            raise RequestError(f"batch size {self.requested_batch_size}: a batch of {rows} x {length} tokens needs "
                             f"about {gpt.gigabytes(needed)}, more than the {gpt.gigabytes(free)} available")

    # --- the jitted kernels

    def hidden(self, variables: Any, tokens_BT: jax.Array, layout: Optional[Tuple[jax.Array, ...]]) -> jax.Array:
        """Final hidden states [B, T, D] of right-padded rows. layout None: each row one
        sequence from position 0, with no padding mask, so attention takes the fused causal
        path (gpt.attend_causal). layout (positions, segments, branches, leaves, each
        [B, T]): packed rows, attention as fast.packed_allowed says."""
        if layout is None:
            causal = lambda m, idx: m.decode(m.embed(idx, True), None, True)
            return self.model.apply(variables, tokens_BT, method=causal)
        positions_BT, segments_BT, branches_BT, leaves_BT = layout

        def embed_and_decode(m, idx, pos, allowed):
            return m.decode(m.embed(idx, True, positions=pos), None, True, positions=pos, allowed=allowed)

        allowed_BTT = fast.packed_allowed(segments_BT, branches_BT, leaves_BT)
        return self.model.apply(variables, tokens_BT, positions_BT, allowed_BTT, method=embed_and_decode)

    def token_scores(self, variables: Any, x_GMD: jax.Array, targets_GM: jax.Array,
                     real: jax.Array) -> Tuple[jax.Array, jax.Array]:
        """Equals simple_score's log-softmax and argmax at the asked positions: (log-probability of
        each target [G, M], whether it is the argmax [G, M]) given the hidden states that predict
        them, of which the first `real` (at most) of each row G are asked for: unembedded
        unembed_piece at a time in a loop that stops after the last real one, so the float32 logits
        [G, M, V] never exist whole (a 151,936-token vocabulary at 16 x 1024 would be 10 GB) and
        padding costs nothing. A multiple choice block pads each row's scored slots to its longest
        row's power of two, about half of them in hellaswag's rows, which the loop never
        unembeds."""
        G, M, D = x_GMD.shape
        P = min(self.unembed_piece, M & -M)  # positions per piece: a power of two dividing M
        while 4 * G * P * self.model.vocab_size > LOGITS_BYTES and P % 2 == 0:
            P //= 2

        def piece(i, scores):
            x_GPD, t_GP = (jax.lax.dynamic_slice_in_dim(a, i * P, P, axis=1) for a in (x_GMD, targets_GM))
            logits_GPV = self.model.apply(variables, x_GPD, method=gpt.GPT.unembed)
            new = -gpt.token_nll(logits_GPV, t_GP), is_argmax(logits_GPV, t_GP)
            return tuple(jax.lax.dynamic_update_slice_in_dim(a, b, i * P, axis=1) for a, b in zip(scores, new))

        empty = jnp.zeros((G, M), jnp.float32), jnp.zeros((G, M), bool)
        return jax.lax.fori_loop(0, -(-real // P), piece, empty)

    def _score_block(self, variables, tokens_CBT, layout_CBT, where_CGM, targets_CGM, real_C):
        """Per scored slot of a [chunks, batch, length] block: the log-probability of its
        target and whether it is the argmax, read from the hidden state at `where`, within
        one of G shares of the batch's rows (one per device of the mesh's "batch" axis, so
        that each device reads and unembeds its own rows). Only those slots are unembedded:
        in multiple choice the context's positions predict nothing anyone asked for. One
        lax.scan over the chunks, so only one chunk's activations exist at a time."""
        def one_chunk(_, chunk):
            tokens_BT, layout, where_GM, targets_GM, real = chunk
            x_BTD = self.hidden(variables, tokens_BT, layout)
            x_GND = x_BTD.reshape(where_GM.shape[0], -1, x_BTD.shape[-1])  # a share's rows end to end
            x_GMD = jnp.take_along_axis(x_GND, where_GM[..., None], axis=1)
            return None, self.token_scores(variables, x_GMD, targets_GM, real)

        return jax.lax.scan(one_chunk, None, (tokens_CBT, layout_CBT, where_CGM, targets_CGM, real_C))[1]

    def take_rows(self, rollout: Any, ids_B: jax.Array, rows_R: jax.Array) -> Tuple[Any, jax.Array]:
        """The rollout and the rows' sample ids, of these rows only (every array with a batch
        dimension; the step, the cache's slot and its shared prefix are the batch's), the
        batch split over the mesh's "batch" axis as before."""
        def take(x: jax.Array, axis: int = 0) -> jax.Array:  # the cache's keys and values: rows on axis 1
            if not x.ndim:
                return x
            taken = x[(slice(None),) * axis + (rows_R,)]
            return jax.lax.with_sharding_constraint(taken, self.batch_split(x.ndim, axis))

        cache = rollout.cache
        rollout, ids_B = jax.tree.map(take, (rollout._replace(cache=None), ids_B))
        cache = cache._replace(keys=take(cache.keys, 1), values=take(cache.values, 1), valid_BS=take(cache.valid_BS))
        return rollout._replace(cache=cache), ids_B

    def _generator(self, n_new: int, temperature: float, top_p: float) -> Tuple[Callable, Callable, Callable]:
        """(start, advance, refill), jitted once per decoding setting: start prefills a batch
        [batch, prompt_len] (fast.start_rollout); advance marks the rows the host found done
        and decodes up to segment_steps more tokens (fast.continue_rollout), its rollout
        donated so the cache is updated in place, and returns the tokens so far and each
        row's count of them, replicated; refill gives a done row a new prompt
        (fast.refill_rollout), the rollout donated too."""
        key = (n_new, temperature, top_p)
        if key not in self._generators:
            eos, keys = self.tokenizer.eos_token_id, sample_keys

            def start(variables, prompts_BP, mask_BP, ids_B, seed, prefix_1Q):
                return fast.start_rollout(self.model, variables, prompts_BP, mask_BP, n_new, eos, temperature, top_p,
                                          keys(ids_B, seed), prefix_1Q)

            def advance(variables, rollout, stopped_B, ids_B, seed):
                rollout = rollout._replace(done_B=rollout.done_B | stopped_B)
                rollout = fast.continue_rollout(self.model, variables, rollout, self.segment_steps, eos, temperature,
                                                top_p, keys(ids_B, seed))
                return rollout, rollout.out_BN, rollout.written_B, rollout.finite_B

            def refill(variables, rollout, row, prompt_1P, mask_1P, id_1, seed):
                return fast.refill_rollout(self.model, variables, rollout, row, prompt_1P, mask_1P, eos, temperature,
                                           top_p, keys(id_1, seed))

            replicated = (self.replicated,) * 3
            self._generators[key] = (jax.jit(start), jax.jit(advance, donate_argnums=1,
                                                             out_shardings=(None, *replicated)),
                                     jax.jit(refill, donate_argnums=1))
        return self._generators[key]

    # --- a run's record of the finished windows (Recorder)

    def call_name(self, kind: str) -> str:
        """A call's name for the recorder: the scope, the request type, and how many calls of
        that type the scope made before (a run makes its calls in the same order every time)."""
        number = self.calls[self.scope, kind]
        self.calls[self.scope, kind] += 1
        return f"{self.scope}/{kind}/{number}"

    def replayed(self, call: str, requests: Iterator[Any], settings: Tuple[Any, ...],
                 result: Callable[..., Any]) -> Tuple[List[Tuple[Any, Any]], Iterator[Any]]:
        """(request, result) of each window of `call` the recorder kept, as long as its
        requests are the ones coming (a window that differs ends them), and the requests
        left to compute, which start where a window of the first try started."""
        pairs: List[Tuple[Any, Any]] = []
        for digest, results in (self.recorder.kept(call) if self.recorder is not None else []):
            window = list(itertools.islice(requests, len(results)))
            if len(window) < len(results) or window_digest(window, settings) != digest:
                requests = itertools.chain(window, requests)
                break
            pairs += zip(window, (result(*fields) for fields in results))
        self.advance(len({r.doc for r, _ in pairs}), 0)
        return pairs, requests

    def finished(self, call: str, settings: Tuple[Any, ...], pairs: List[Tuple[Any, Any]]) -> List[Tuple[Any, Any]]:
        """A window's (request, result) pairs, told to the recorder first."""
        if self.recorder is not None:
            self.recorder.add(call, window_digest([r for r, _ in pairs], settings), [as_fields(x) for _, x in pairs])
        return pairs

    # --- the three request types

    def loglikelihood(self, requests: Iterable[Request], keep_rows: bool = False) -> Iterator[Tuple[Request, Scored]]:
        """(request, its Scored) for each request, in order. A request alone runs the last
        max_len + 1 tokens of context + continuation, minus the last one, and its continuation
        is scored; consecutive requests that see the same context share a row (fast.pack_requests),
        and short packs fill rows (fast.fill_rows) unless rows are kept (keep_rows), so that a kept
        row holds its own pack alone."""
        def checked(requests: Iterable[Request]) -> Iterator[Request]:
            for r in requests:
                if not r.context:
                    raise RequestError("a loglikelihood request needs at least one context token (BOS, or EOS)")
                if len(r.continuation) > self.max_len:
                    raise RequestError(f"a continuation of {len(r.continuation)} tokens does not fit "
                                       f"the context of {self.max_len}")
                yield r

        return self.scored(checked(requests), keep_rows, "loglikelihood")

    def scored(self, requests: Iterable[Request], keep_rows: bool, kind: str) -> Iterator[Tuple[Request, Scored]]:
        """loglikelihood's (request, Scored) pairs: the windows the recorder kept, then each
        other window's once it has run, told to the recorder. (simple: simple_scored.)"""
        call = self.call_name(kind)
        if self.simple:
            yield from self.simple_scored(requests, keep_rows)
            return
        kept, requests = self.replayed(call, iter(requests), (), Scored)
        yield from kept
        packs = fast.pack_requests(requests, self.max_len, self.share_contexts)
        for window in self.in_blocks(packs, lambda *block: self.score_packs(*block, keep_rows=keep_rows),
                                     fill=self.share_contexts and not keep_rows):
            yield from self.finished(call, (), [pair for pack, scored in window for pair in zip(pack.requests, scored)])

    def score_packs(self, packs: List[fast.Pack], chunks: int, rows: int, length: int, width: int,
                    keep_rows: bool) -> Callable[[], List[List[Scored]]]:
        """Equals simple_score for each pack's requests: one block of packs [chunks, rows, length],
        `width` scored slots per row, started on the devices: returns the reader of each pack's
        requests' Scored, which waits for the block. A block with nothing packed runs plain causal
        rows."""
        n, packed = chunks * rows, any(len(p.requests) > 1 for p in packs)
        fast.check_plan(len(packs) <= n, packs[-1].requests[0].doc, f"{len(packs)} packs in a block of {n} rows")
        # a fused attention kernel holds no [T, S] scores in memory; else queries go in blocks of
        # the model's query_block (gpt.attend_causal)
        m = self.model
        fused = gpt.causal_kernel(m.attention, m.adtype, length, packed, m.attn_softcap) != "xla"
        self.check_memory(rows, length, width, 0 if fused else min(length, m.query_block))
        tokens, mask = self.pad([p.tokens for p in packs], length, n, left=False)
        per_share = rows // self.dp
        where, targets, owner, real_per_share = fast.scored_slots(packs, chunks * self.dp, per_share, length, width)
        most_real = self.put_whole(real_per_share.reshape(chunks, self.dp).max(1))  # the unembedding loop's length
        layout = self.packed_layout(packs, chunks, rows, length) if packed else None
        with jax.set_mesh(self.mesh):  # traced under the mesh: gpt.rows_at_a_time reads it
            out = self._score(self.variables, self.put(tokens.reshape(chunks, rows, length)), layout,
                              *(self.put(a.reshape(chunks, self.dp, -1)) for a in (where, targets)), most_real)

        def read() -> List[List[Scored]]:
            logprob, correct = (np.asarray(o).reshape(owner.shape) for o in out)
            real, total = owner >= 0, sum(len(p.requests) for p in packs)  # per request, summed in float64
            logprobs, corrects, counts = (np.bincount(owner[real], weights=w, minlength=total)
                                          for w in (logprob[real], correct[real], None))
            scored = iter([Scored(float(lp), int(k), int(c)) for lp, c, k in zip(logprobs, corrects, counts)])
            return [[dataclasses.replace(next(scored), row=(tokens[i], mask[i]) if keep_rows else None)
                     for _ in p.requests] for i, p in enumerate(packs)]

        return read

    def packed_layout(self, packs: List[fast.Pack], chunks: int, rows: int, length: int) -> Tuple[jax.Array, ...]:
        """(positions, segments, branches, leaves) of a block's packed rows [chunks, rows,
        length] on the mesh; padding is branch -1."""
        n = chunks * rows
        positions, _ = self.pad([p.positions for p in packs], length, n, left=False)
        branches = self.pad([[b + 1 for b in p.branches] for p in packs], length, n, left=False)[0] - 1
        segments, _ = self.pad([p.segments for p in packs], length, n, left=False)
        leaves, _ = self.pad([p.leaves for p in packs], length, n, left=False)
        return tuple(self.put(a.reshape(chunks, rows, length)) for a in (positions, segments, branches, leaves))

    def loglikelihood_rolling(self, documents: Iterable[List[int]], keep_rows: bool = False) -> Iterator[List[Scored]]:
        """Every token of each document (token ids) scored once in rolling windows, after
        the prefix token: one list of window results per document, in order. An empty
        document gives one window with nothing to score."""
        requests = (Request(doc, context, continuation) for doc, tokens in enumerate(documents)
                    for context, continuation in rolling_requests(tokens, self.prefix_id, self.max_len)
                    or [([self.prefix_id], [])])
        return per_document(self.scored(requests, keep_rows, "loglikelihood_rolling"))

    def generate_until(self, requests: Iterable[GenerationRequest], n_new: int, temperature: float = 0.0,
                       top_p: float = 1.0, seed: Optional[int] = None,
                       keep_rows: bool = False) -> Iterator[Tuple[GenerationRequest, Generation]]:
        """Up to n_new tokens after each prompt (greedy, or sampled with temperature/top_p),
        until EOS or one of its `until` strings: (request, its Generation) in order. Sampling
        keys depend on the document index only, so the same seed gives the same text at any
        batch size, mesh or order."""
        room = self.max_len - n_new
        if room < 1:
            raise RequestError(f"--max-new-tokens {n_new} leaves no room in the context of {self.max_len}")
        seed = self.seed if seed is None else seed
        call, settings = self.call_name("generate_until"), (n_new, temperature, top_p, seed)
        if self.simple:
            yield from self.simple_generations(requests, room, n_new, (temperature, top_p, seed), keep_rows)
            return
        kept, requests = self.replayed(call, iter(requests), settings, Generation)
        yield from kept
        while window := list(itertools.islice(requests, self.batch_size * SORT_WINDOW)):
            order = sorted(range(len(window)), key=lambda i: -min(len(window[i].prompt), room))  # longest first
            queue = [window[i] for i in order]
            per_rollout = len(queue) if self.refill else self.batch_size
            results: List[Any] = [None] * len(window)
            for at in range(0, len(queue), per_rollout):
                generations = self.decode_queue(queue[at:at + per_rollout], room, n_new, (temperature, top_p, seed),
                                                keep_rows)
                for i, generation in zip(order[at:at + per_rollout], generations):
                    results[i] = generation
            yield from self.finished(call, settings, list(zip(window, results)))

    def decode_queue(self, queue: List[GenerationRequest], room: int, n_new: int, sampling: Tuple[float, float, int],
                     keep_rows: bool) -> List[Generation]:
        """Equals simple_generations (gpt.generate, then cut), fewer steps: requests, longest prompt
        first, decoded in one rollout of at most batch_size rows, each until EOS, a stop string or
        n_new tokens: gpt.generate's tokens for each prompt alone, cut where it ends. Plan
        (plan_rollout), prefill the first rows together (the prompts' shared beginning once, then
        the rest of each), then segments of segment_steps steps (decode_segment), between which the
        host checks each row's new tokens, a row that is done takes the next waiting prompt
        (continuous batching), and once none waits the rows still running move into a smaller
        rollout (compact, where compact_rows)."""
        temperature, top_p, seed = sampling
        start, advance, refill = self._generator(n_new, temperature, top_p)
        d = self.plan_rollout(queue, room, n_new, keep_rows)
        ids_B, prefix_1Q = self.put(d.ids, 0), self.put_whole(np.array([d.prefix], np.int32)) if d.prefix else None
        with jax.set_mesh(self.mesh):  # traced under the mesh: the prefill's attention reads it (gpt.rows_at_a_time)
            rollout = start(self.variables, self.put(d.tokens[:d.rows], 0), self.put(d.mask[:d.rows], 0), ids_B, seed,
                            prefix_1Q)
        prefilled = sum(map(len, d.prompts[:d.rows]))
        self.counts.block(prefilled, 1, d.rows, d.length)
        self.advance(0, prefilled)
        while (d.owner >= 0).any():
            if d.waiting == len(queue) and self.compact_rows:
                rollout, ids_B, d.owner = self.compact(rollout, ids_B, d.owner)
            rollout, ids_B = self.decode_segment(advance, refill, rollout, ids_B, d, n_new, seed)
        self.counts.rollouts.append(d.counted(n_new))
        return [self.generation(r, d.news[i], d.ends[i], len(r.prompt) > room,
                                rollout_row(d.tokens[i], d.mask[i], d.news[i][:d.ends[i]], n_new) if keep_rows else None)
                for i, r in enumerate(queue)]

    def plan_rollout(self, queue: List[GenerationRequest], room: int, n_new: int, keep_rows: bool) -> "Queue":
        """The rollout's plan: each prompt's last `room` tokens, their shared beginning (none
        for kept rows, which are whole prompts), the cache slots a prompt takes (the longest
        prompt's: every later one fits), the rows, and the prompts left-padded after the
        prefix; each checked to fit, and the whole to fit in memory. With lengths_per_octave 1
        (an accelerator's fewest programs) a rollout has batch_size rows, its prompt slots a
        power of two or its cache's slots one (prompt and n_new, whichever is fewer: a step
        reads them all), its cache in whole tiles (GPT.tile_slots), and takes an earlier rollout's
        slots where its cache is at most twice as long: that rollout's programs."""
        prompts = [r.prompt[-room:] for r in queue]
        prefix = [] if keep_rows else self.shared_prefix(prompts)
        length = padded_length(len(prompts[0]), room, self.lengths_per_octave)
        rows = min(self.batch_size, -(-len(queue) // self.dp) * self.dp)
        if self.lengths_per_octave == 1:  # the fewest programs: an earlier rollout's, where its slots fit
            rows = self.batch_size
            length = min(length, padded_length(len(prompts[0]) + n_new, room + n_new, 1) - n_new)
            short = -(length - len(prefix) + n_new) % self.model.tile_slots()  # a row's slots after the prefix
            length += short if length + short <= room else 0
            length = min([n for n in self.rollout_lengths if length <= n <= min(2 * length + n_new, room)],
                         default=length)
            self.rollout_lengths.add(length)
        for r, p in zip(queue, prompts):  # each prompt, a first row's or a refill's, fits its row's cache slots
            fast.check_plan(len(p) <= length and p[:len(prefix)] == prefix, r.doc, f"a prompt of {len(p)} tokens in "
                            f"{length} cache slots, after a shared prefix of {len(prefix)}")
        self.check_memory(rows, length + n_new, 1, length)  # after a shared prefix, over the cache whole
        tokens, mask = self.pad([p[len(prefix):] for p in prompts], length - len(prefix), max(rows, len(queue)), True)
        return Queue(queue, prompts, prefix, length, rows, tokens, mask)

    def decode_segment(self, advance: Callable, refill: Callable, rollout: Any, ids_B: jax.Array, d: "Queue",
                       n_new: int, seed: int) -> Tuple[Any, jax.Array]:
        """Up to segment_steps more tokens in every running row; then each row the host finds
        done (EOS, a stop string, n_new tokens, or an empty prompt) gives its request its
        tokens and takes the next waiting prompt, if any."""
        live, before = int((d.owner >= 0).sum()), d.step
        rollout, out_RN, written_R, finite_R = advance(self.variables, rollout, self.put(d.owner < 0, 0), ids_B, seed)
        d.step = int(rollout.step)
        out, written, finite = np.asarray(out_RN), np.asarray(written_R), np.asarray(finite_R)
        d.row_steps += len(d.owner) * (d.step - before)
        self.advance(0, live * (d.step - before))  # the new tokens, for tokens/s
        for row in np.flatnonzero(d.owner >= 0):
            if not self.row_done(d, row, out[row, :written[row]].tolist(), bool(finite[row]), n_new):
                continue
            self.advance(1, 0)
            if d.waiting < len(d.requests):  # the row takes the next prompt, decoded from the next step on
                rollout = self.refill_row(refill, rollout, row, d, seed)
                ids_B = self.put(d.ids, 0)
        return rollout, ids_B

    def row_done(self, d: "Queue", row: int, new: List[int], finite: bool, n_new: int) -> bool:
        """Whether the request in `row` is done, its tokens then kept and the row freed; where
        it ends (steps_to_end) from the tokens it had not checked yet on."""
        i = d.owner[row]
        if not finite:  # the tokens after NaN logits are an argmax over NaN
            raise RequestError(f"non-finite logits while generating for document {d.requests[i].doc} (broken "
                               f"weights, or activations beyond {jnp.dtype(self.model.adtype).name}?)")
        d.ends[i] = steps_to_end(new, self.tokenizer.eos_token_id, d.requests[i].until, self.tokenizer.decode,
                                 d.checked[i])
        d.checked[i] = len(new) + 1
        if d.ends[i] is None and len(new) < n_new and d.mask[i].any():  # an empty prompt is done at once
            return False
        d.news[i], d.owner[row] = new, -1
        return True

    def refill_row(self, refill: Callable, rollout: Any, row: int, d: "Queue", seed: int) -> Any:
        """The rollout with this row decoding the next waiting prompt (left-padded, the shared
        prefix left out) from the next step on: fast.refill_rollout, its rollout donated; the
        prompt's sampling key is its document's, as in a batch of its own."""
        w, doc = d.waiting, d.requests[d.waiting].doc
        rollout = refill(self.variables, rollout, self.put_whole(np.array(row, np.int32)),
                         *(self.put_whole(a[None]) for a in (d.tokens[w], d.mask[w], np.array(doc, np.int32))), seed)
        self.counts.block(len(d.prompts[w]), 1, 1, d.length)
        self.advance(0, len(d.prompts[w]))
        d.owner[row], d.ids[row], d.began[w], d.waiting = w, doc, d.step, w + 1
        return rollout

    def shared_prefix(self, prompts: List[List[int]]) -> List[int]:
        """Equals every prompt prefilled whole, once for all rows: the first tokens all prompts of a
        rollout have in common (the few-shot examples of a task), in multiples of shared_prefix_step
        tokens (so rollouts share one shape), each prompt keeping a token of its own: fast.start_rollout
        computes them once, not per row, and the cache holds them once. Empty with a sliding window,
        which counts slots."""
        if self.model.sliding_window is not None or len(prompts) < 2:
            return []
        common = max(min(len(p) for p in prompts) - 1, 0)  # an empty prompt shares nothing
        for p in prompts[1:]:
            common = min(common, fast.common_length(prompts[0], p))
        return prompts[0][:common // self.shared_prefix_step * self.shared_prefix_step]

    def compact(self, rollout: Any, ids_B: jax.Array, owner: np.ndarray) -> Tuple[Any, jax.Array, np.ndarray]:
        """Equals keeping every row, fewer rows a step: the rollout's rows still running, and enough
        done ones to fill the next power of two of rows (a multiple of the data-parallel size), once
        that is at most a quarter of the rows it has; else the rollout as it is. Each row count
        compiles the decoding segment anew: 16 rows go to 4, then 1, never through 8 and 2 (quarters
        beat halves and beat keeping every row: docs/speed.md)."""
        running = np.flatnonzero(owner >= 0)
        rows = -(-(1 << max(len(running) - 1, 0).bit_length()) // self.dp) * self.dp
        if 4 * rows > len(owner):
            return rollout, ids_B, owner
        keep = np.sort(np.concatenate([running, np.flatnonzero(owner < 0)])[:rows])
        rollout, ids_B = self._take_rows(rollout, ids_B, self.put_whole(keep.astype(np.int32)))
        return rollout, ids_B, owner[keep]

    def generation(self, r: GenerationRequest, new: List[int], end: Optional[int], truncated: bool,
                   row: Any) -> Generation:
        """A row's Generation from its new tokens and where it ended (EOS itself is dropped)."""
        eos = self.tokenizer.eos_token_id
        ids = new[:end] if end is not None else new
        ids = ids[:-1] if ids and eos is not None and ids[-1] == eos else ids
        return Generation(cut_at_stop(self.tokenizer.decode(ids), r.until), ids, truncated, row)

    def progress(self, items: Iterable[Any], name: str, total: int, unit: str = "samples") -> Iterator[Any]:
        """The items, reported on stderr as they are computed (see Progress); off with
        quiet and on every process but the first."""
        if self.quiet or jax.process_index() != 0:
            yield from items
            return
        self.report, finished = Progress(name, total, unit), False
        try:
            yield from items
            finished = True
        finally:
            self.report.close(finished)
            self.report = None
