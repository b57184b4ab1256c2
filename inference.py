"""The inference core: requests in, log-likelihoods and generations out, on a device mesh.

    from inference import InferenceJob, Request
    job = InferenceJob(model, variables, tokenizer, mesh, batch_size=8)   # gpt.py's GPT on a mesh
    [(request, scored)] = job.loglikelihood([Request(0, context_ids, continuation_ids)])

This file and gpt.py are all it needs: copy the two into another project. Reading order:
the tokenizer it expects -> the three request types and their results -> how requests
become fixed-shape blocks (padding, sorting, scheduling) -> InferenceJob: the jitted
kernels (one lax.scan over a block's batches), then loglikelihood, loglikelihood_rolling
and generate_until, named as lm-evaluation-harness names them:
- loglikelihood: the log-probability of a continuation given a context (token ids);
- loglikelihood_rolling: a whole document scored token by token in windows of the
  context length (perplexity, next-token accuracy);
- generate_until: new tokens after a prompt until EOS, a stop string or the limit.
Each request carries the index of its document, and results come back in request order.
"""
from __future__ import annotations

import dataclasses
import itertools
import sys
from typing import Any, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Protocol, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import gpt


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


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    cut = min([text.index(s) for s in stops if s and s in text], default=len(text))
    return text[:cut]




# ----------------------------------------------------------------------------- blocks


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

    def __init__(self, model: gpt.GPT, variables: Any, tokenizer: Tokenizer, mesh: jax.sharding.Mesh,
                 batch_size: int = 8, chunks: int = 16, seed: int = 0, quiet: bool = False):
        """`variables` are the model's parameters placed on `mesh` (gpt.init_params or
        gpt.place_params); batch_size is the most rows per forward pass (rounded up to a
        multiple of the mesh's "batch" size), chunks how many batches one jitted call scans,
        seed the default of generate_until's sampling, quiet turns the progress bars off."""
        if tokenizer.vocab_size > model.vocab_size:
            raise RequestError(f"the tokenizer's ids reach {tokenizer.vocab_size - 1} (vocab_size "
                               f"{tokenizer.vocab_size}), beyond the model's embedding of {model.vocab_size} rows")
        self.model, self.variables, self.tokenizer, self.mesh = model, variables, tokenizer, mesh
        self.requested_batch_size, self.chunks, self.seed, self.quiet = batch_size, chunks, seed, quiet
        self.dp = mesh.shape["batch"]
        self.replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self._score = jax.jit(self._score_block, out_shardings=self.replicated)
        self._generators: Dict[Tuple, Callable] = {}
        self.blocks_run: List[Tuple[int, int, int, int]] = []  # (real tokens, chunks, rows, length) of each

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
                chunks = self.chunks if len(group) >= self.chunks else 1
                yield group[0][0], chunks, rows, length
                group = group[chunks:]

    def in_blocks(self, requests: Iterable[Any], length_of: Callable[[Any], int], cap: int,
                  run_block: Callable[[List[Any], int, int, int], List[Any]]) -> Iterator[Tuple[Any, Any]]:
        """(request, result) in request order; run_block(requests, chunks, rows, length) runs
        one block. A window of SORT_WINDOW blocks' requests is sorted by length at a time,
        so memory does not grow with the dataset."""
        requests = iter(requests)
        while window := list(itertools.islice(requests, self.batch_size * self.chunks * SORT_WINDOW)):
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
        needed, free = logits + kv + scores, gpt.available_memory()
        if needed > free:
            raise RequestError(f"batch size {self.requested_batch_size}: a batch of {rows} x {length} tokens needs "
                             f"about {gpt.gigabytes(needed)}, more than the {gpt.gigabytes(free)} available")

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
                raise RequestError(f"a continuation of {len(r.continuation)} tokens does not fit "
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
            raise RequestError(f"--max-new-tokens {n_new} leaves no room in the context of {self.max_len}")
        eos, run = self.tokenizer.eos_token_id, self._generator(n_new, temperature, top_p)
        seed = self.seed if seed is None else seed

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
        quiet = self.quiet or not sys.stderr.isatty() or jax.process_index() != 0
        return tqdm(items, desc=name, total=total, unit="sample", disable=quiet, leave=False)


