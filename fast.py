"""The fast path's parts, each equal to a simple one: the first words of its docstring say which.

    import fast   # inference.py's InferenceJob runs them; gpt.py's GPT computes every forward pass

Reading order: the loglikelihood request (Request, which inference.py names too) -> a
plan's own check (PlanError) -> packed rows for scoring: requests that
share a context in one row, each token seeing what it sees alone (pack_requests,
packed_allowed), short packs end to end in one row (fill_rows), and where each scored
token sits (scored_slots) -> the fast decoder: gpt.generate's prefill and loop as parts
that run in segments, stop once every row is done, and give a done row a new prompt
(start_rollout, continue_rollout, refill_rollout), over gpt.py's KV cache as a ring with a
shared prefix held once.
"""
from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator, List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

import gpt


class Request(NamedTuple):
    """loglikelihood: score `continuation` given `context` (token ids, at least one), for
    document `doc`. (Here, below inference.py, which names it too, so that the packs can.)"""

    doc: int
    context: List[int]
    continuation: List[int]


class PlanError(RuntimeError):
    """A size the fast path planned that does not hold (a bug, never the input): raised
    where the size is made, naming a request of the document it concerns, so that it ends
    as one line, not as a broadcast error deep in numpy or a silently wrong score."""


def check_plan(holds: bool, doc: int, what: str) -> None:
    if not holds:
        raise PlanError(f"internal error at document {doc}: {what}; please report it with the input")


# ----------------------------------------------------------------------------- shared contexts
# Multiple choice asks for one context with several continuations (MMLU's " A" ... " D",
# hellaswag's four endings), and few-shot prompts begin alike (MMLU 5-shot: the same five
# examples before every question of a subject). So consecutive requests share rows: one row
# holds a prefix its contexts have in common, then each context's own tokens, each followed
# by the input tokens of its continuations (all but their last). Every token keeps the
# position it has alone and sees what it sees alone, the prefix and its own context and
# continuation, never another's (packed_allowed): the scores are those of each request
# alone. A continuation's first token is predicted at its context's last position, so
# one-token continuations add nothing to the row: one pass answers them all.
#
# Why one packed row, not the shared tokens prefilled once into a KV cache and the rest
# extended from it: a packed row is one sequence like any other, so it goes through the same
# sorted, fixed-shape blocks and one kernel; the cache way needs a second kernel, caches
# copied per continuation and a schedule in two dimensions. What packing gives up: a packed
# block attends through an explicit mask, not the fused causal kernel (cuDNN on a GPU), and
# its rows are longer; blocks with nothing packed still take the fused kernel.

PACK_EXTRA = 512  # a packed row is at most this many tokens longer than its longest request alone


class Pack(NamedTuple):
    """Requests scored in one row (see pack_requests): the row's tokens, the position of
    each, its segment (0; i: the i-th of several packs that share a row, see fill_rows),
    branch (0: the shared prefix; q: the q-th context's own tokens and its continuations')
    and leaf (0: the context's own tokens; k: its k-th continuation's), and each scored
    token as (index of the row token that predicts it, target, request)."""

    requests: List[Request]
    tokens: List[int]
    positions: List[int]
    segments: List[int]
    branches: List[int]
    leaves: List[int]
    scored: List[Tuple[int, int, int]]


class Context(NamedTuple):
    """One context of a pack: its tokens after the shared prefix, and its requests, each
    with its continuation's input tokens."""

    own: List[int]
    members: List[Tuple[Request, List[int]]]


def split_request(r: Request, max_len: int) -> Tuple[List[int], List[int]]:
    """(the context as the request sees it, its continuation's input tokens). Alone, a
    request runs the last max_len + 1 tokens of context + continuation minus the last one,
    and its continuation is scored at the last len(continuation) predictions: that row is
    these two lists joined. A request cut from the left sees a shorter context."""
    row = (r.context + r.continuation)[-(max_len + 1):][:-1]
    tail = max(len(r.continuation) - 1, 0)
    return row[:len(row) - tail], row[len(row) - tail:]


def make_pack(prefix: List[int], contexts: List[Context]) -> Pack:
    tokens, positions, branches, leaves = list(prefix), list(range(len(prefix))), [0] * len(prefix), [0] * len(prefix)
    requests: List[Request] = []
    scored: List[Tuple[int, int, int]] = []

    def add(ids: List[int], start: int, branch: int, leaf: int) -> None:
        tokens.extend(ids)
        positions.extend(range(start, start + len(ids)))
        branches.extend([branch] * len(ids))
        leaves.extend([leaf] * len(ids))

    for q, context in enumerate(contexts, 1):
        add(context.own, len(prefix), q, 0)
        # the context's last token: its own last one, or the prefix's where the context is the
        # prefix alone (not the row's last token so far, another context's)
        last = len(tokens) - 1 if context.own else len(prefix) - 1
        start = len(prefix) + len(context.own)
        for k, (r, tail) in enumerate(context.members, 1):
            predictors = [last, *range(len(tokens), len(tokens) + len(tail))]
            scored.extend(zip(predictors, r.continuation, itertools.repeat(len(requests))))
            requests.append(r)
            add(tail, start, q, k)
    return Pack(requests, tokens, positions, [0] * len(tokens), branches, leaves, scored)


def joined(prefix: List[int], contexts: List[Context], seen: List[int], member: Tuple[Request, List[int]],
           longest: int, max_len: int) -> Optional[Tuple[List[int], List[Context]]]:
    """(prefix, contexts) with one more request, whose context is `seen`, or None where it
    does not join them: it shares its whole context with the last one, or a prefix of at
    least as many tokens as it adds (with one context so far, the prefix is theirs in
    common). One token is no prefix: it is BOS alone (the first rolling window of every
    document), and sharing it would pack whole documents to save a token. The row holds at
    most max_len tokens and max_len scored ones, and at most PACK_EXTRA more than `longest`,
    the longest of its requests alone: a row's attention needs memory in the square of its
    length, and a batch that fits alone should fit packed."""
    last = contexts[-1]
    if seen == prefix + last.own:
        contexts = contexts[:-1] + [Context(last.own, last.members + [member])]
    else:
        shared = len(prefix) if len(contexts) > 1 else common_length(prefix, seen)
        if seen[:shared] != prefix[:shared] or shared < len(seen) - shared:
            return None
        if len(contexts) == 1:  # the first context's tokens beyond the common prefix become its own
            contexts = [Context(prefix[shared:], last.members)]
        prefix, contexts = prefix[:shared], contexts + [Context(seen[shared:], [member])]
    size = len(prefix) + sum(len(c.own) + sum(len(t) for _, t in c.members) for c in contexts)
    scored = sum(len(r.continuation) for c in contexts for r, _ in c.members)
    if len(prefix) < 2 or size > min(max_len, longest + PACK_EXTRA) or scored > max_len:
        return None
    return prefix, contexts


def common_length(a: List[int], b: List[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def pack_requests(requests: Iterable[Request], max_len: int, share: bool) -> Iterator[Pack]:
    """Equals a request a row (simple_scored), fewer tokens: requests in order, in packs of consecutive
    ones (see joined); with share False, a row each."""
    prefix: List[int] = []
    contexts: List[Context] = []
    longest = 0  # the longest request of the pack, alone
    for r in requests:
        seen, tail = split_request(r, max_len)
        alone = len(seen) + len(tail)
        grown = joined(prefix, contexts, seen, (r, tail), max(longest, alone), max_len) if share and contexts else None
        if grown is not None:
            (prefix, contexts), longest = grown, max(longest, alone)
            continue
        if contexts:
            yield make_pack(prefix, contexts)
        prefix, contexts, longest = seen, [Context([], [(r, tail)])], alone
    if contexts:
        yield make_pack(prefix, contexts)


# Packs of a few short requests (hellaswag's question and four endings: 60 to 190 tokens)
# would leave much of a block's rows padding, its longest row setting their length; so a
# window of packs (see InferenceJob.in_blocks) first goes into rows of FILL_LENGTH tokens,
# several packs end to end where they fit, each its own segment that sees nothing of the
# others (packed_allowed). Rows that short attend in one block of queries either way
# (GPT.query_block); longer packs (MMLU's 5-shot questions, a long document's windows)
# keep a row each.

FILL_LENGTH = 256


def fill_rows(lengths: List[int], room: int) -> List[List[int]]:
    """Equals a pack a row (fill_length 1), fewer slots: the indices of packs of these lengths in rows
    of at most `room` tokens: longest first, each into the first row it fits (first-fit decreasing:
    at most 11/9 of the fewest rows possible, plus one); a pack longer than `room` alone."""
    rows: List[List[int]] = []
    free: List[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((r for r, f in enumerate(free) if lengths[i] <= f), len(rows))
        if r == len(rows):
            rows.append([])
            free.append(room)
        rows[r].append(i)
        free[r] -= lengths[i]
    return rows


def joined_packs(packs: List[Pack]) -> Pack:
    """Packs end to end as one, the i-th in segment i."""
    if len(packs) == 1:
        return packs[0]
    requests, tokens, positions, segments, branches, leaves, scored = [], [], [], [], [], [], []
    for segment, p in enumerate(packs):
        scored += [(where + len(tokens), target, k + len(requests)) for where, target, k in p.scored]
        requests += p.requests
        tokens += p.tokens
        positions += p.positions
        segments += [segment] * len(p.tokens)
        branches += p.branches
        leaves += p.leaves
    return Pack(requests, tokens, positions, segments, branches, leaves, scored)


def packed_allowed(segments_BT: jax.Array, branches_BT: jax.Array, leaves_BT: jax.Array) -> jax.Array:
    """Equals each request's own causal row: which keys each query of a packed row sees [B, T, T]:
    itself and the earlier tokens of its own segment's shared prefix (branch 0), of its own context
    (its branch, leaf 0) and of its own continuation (its branch and leaf); padding (branch -1)
    none."""
    T = branches_BT.shape[1]
    earlier_1TS = jnp.tril(jnp.ones((T, T), bool))[None]
    same_segment = segments_BT[:, :, None] == segments_BT[:, None, :]
    query_branch, key_branch = branches_BT[:, :, None], branches_BT[:, None, :]
    query_leaf, key_leaf = leaves_BT[:, :, None], leaves_BT[:, None, :]
    own_branch = (key_branch == query_branch) & ((key_leaf == 0) | (key_leaf == query_leaf))
    return earlier_1TS & same_segment & (key_branch >= 0) & ((key_branch == 0) | own_branch)


def scored_slots(packs: List[Pack], shares: int, per_share: int, length: int,
                 width: int) -> Tuple[np.ndarray, ...]:
    """The scored tokens of a block's packs, its rows taken per_share at a time (one
    device's rows): [shares, per_share * width] each of where the token is predicted (in
    the share's rows end to end), its target, and whose it is (the request's index in the
    block, -1 for padding), the real ones first; and [shares] how many are real."""
    where, targets, owner = (np.full((shares, per_share * width), fill, np.int32) for fill in (0, 0, -1))
    counts, first = np.zeros(shares, np.int32), 0  # first: the pack's first request in the block
    for i, p in enumerate(packs):
        share = i // per_share
        n = counts[share]
        if p.scored:
            m = len(p.scored)  # np.fromiter reads the tuples several times faster than np.array
            w, t, k = np.fromiter(itertools.chain.from_iterable(p.scored), np.int32, 3 * m).reshape(m, 3).T
            check_plan(n + m <= per_share * width, p.requests[0].doc,
                       f"{n + m} scored tokens in a share of {per_share} rows of {width} scored slots")
            check_plan(w.max() < len(p.tokens) <= length, p.requests[0].doc,
                       f"a pack of {len(p.tokens)} tokens scored at token {w.max()}, in rows of {length}")
            where[share, n:n + m], targets[share, n:n + m] = (i % per_share) * length + w, t
            owner[share, n:n + m], counts[share] = first + k, n + m
        first += len(p.requests)
    return where, targets, owner, counts


# ----------------------------------------------------------------------------- the fast decoder
# InferenceJob decodes in segments, to stop at stop strings, and gives rows that are done new
# prompts (continuous batching): the same tokens as gpt.generate, from these parts.


class Rollout(NamedTuple):
    """Decoding in progress, between calls of continue_rollout: the decoding steps run,
    each row's next token (chosen, not yet written), the KV cache, the new tokens out_BN
    [B, N], which rows are done (EOS, N tokens, an empty prompt, or whatever the caller
    decided), which rows have had finite logits at every step so far (an argmax over NaN
    is a token too: a caller refuses the text of a row that lost them, rather than print
    garbage), and how many tokens each row has written (a row given a new prompt by
    refill_rollout starts again from 0)."""

    step: jax.Array
    next_B: jax.Array
    cache: gpt.KVCache
    out_BN: jax.Array
    done_B: jax.Array
    finite_B: jax.Array
    written_B: jax.Array


def start_rollout(model: gpt.GPT, params: Any, prompt_BP: jax.Array, mask_BP: jax.Array, max_new_tokens: int,
                  eos_id: Optional[int] = None, temperature: float = 0.0, top_p: float = 1.0,
                  keys_B: Optional[jax.Array] = None, prefix_1Q: Optional[jax.Array] = None) -> Rollout:
    """gpt.generate's prefill, with a shared prefix held once: one GPT.extend call puts the
    left-padded prompts (mask_BP True at real tokens) into a cache of exactly P + max_new_tokens
    slots and picks each first token. A row with an empty prompt only pads the batch: it is done
    from the start.

    prefix_1Q: Q first tokens that every prompt begins with (few-shot examples), which
    prompt_BP then leaves out. They are computed once and held once, as the cache's prefix
    (gpt.KVCache.prefix_keys), before every row's P + max_new_tokens slots, the left padding of
    the rest after them: positions count real tokens, so every token keeps its position and
    sees what it sees in the whole prompt. Not with a sliding window, which counts slots."""
    B, P = prompt_BP.shape
    shared = None
    if prefix_1Q is not None:
        Q = prefix_1Q.shape[1]
        _, shared = model.apply(params, prefix_1Q, jnp.ones((1, Q), bool), model.init_cache(1, Q), True,
                                method=gpt.GPT.extend)
    cache = model.init_cache(B, P + max_new_tokens, shared)
    logits_BV, cache = model.apply(params, prompt_BP, mask_BP, cache, prefix_1Q is None, method=gpt.GPT.extend)
    out_BN = jnp.full((B, max_new_tokens), 0 if eos_id is None else eos_id, jnp.int32)
    first_B = gpt.pick_token(logits_BV, 0, keys_B, temperature, top_p)
    done_B = ~mask_BP.any(-1)
    return Rollout(jnp.zeros((), jnp.int32), first_B, cache, out_BN, done_B, done_B | gpt.finite_rows(logits_BV),
                   jnp.zeros((B,), jnp.int32))


def continue_rollout(model: gpt.GPT, params: Any, rollout: Rollout, steps: int, eos_id: Optional[int] = None,
                     temperature: float = 0.0, top_p: float = 1.0, keys_B: Optional[jax.Array] = None) -> Rollout:
    """gpt.generate's loop, resumable and stopping once all rows are done: up to `steps` more tokens per
    row in one while_loop, which ends early once every row is done; a row is done at eos_id or once
    it has written out_BN's N tokens, and a done row writes nothing more (after eos_id its row holds
    eos_id, as start_rollout filled it)."""
    B, N = rollout.out_BN.shape
    stop = -1 if eos_id is None else eos_id
    end = rollout.step + steps

    def cond(r: Rollout) -> jax.Array:
        return (r.step < end) & ~r.done_B.all()

    def body(r: Rollout) -> Rollout:
        column_B = jnp.where(r.done_B, N, r.written_B)  # past the end: dropped
        out_BN = r.out_BN.at[jnp.arange(B), column_B].set(r.next_B, mode="drop")
        written_B = r.written_B + ~r.done_B
        done_B = r.done_B | (r.next_B == stop) | (written_B >= N)
        logits_BV, cache = model.apply(params, r.next_B[:, None], jnp.ones((B, 1), bool), r.cache,
                                       method=gpt.GPT.extend)
        next_B = jnp.where(done_B, stop, gpt.pick_token(logits_BV, written_B, keys_B, temperature, top_p))
        finite_B = r.finite_B & (done_B | gpt.finite_rows(logits_BV))
        return Rollout(r.step + 1, next_B, cache, out_BN, done_B, finite_B, written_B)

    return jax.lax.while_loop(cond, body, rollout)


def refill_rollout(model: gpt.GPT, params: Any, rollout: Rollout, row: jax.Array, prompt_1P: jax.Array,
                   mask_1P: jax.Array, eos_id: Optional[int] = None, temperature: float = 0.0, top_p: float = 1.0,
                   key_1: Optional[jax.Array] = None) -> Rollout:
    """Equals gpt.generate on the new prompt alone: row `row` of a running rollout, done, takes a new
    left-padded prompt [1, P] (after the cache's prefix, if it has one) and decodes it with the
    other rows from the next step on (continuous batching): its prefill runs alone, and its keys and
    values go into the P slots before the cache's next one, where the row's old tokens were.

    The cache is a ring: a row writes its N new tokens from there on, past the last slot
    round to the first, into slots only its own earlier tokens held. With P + N slots (as
    start_rollout made them for prompts of P tokens) the row's prompt and new tokens fill
    them exactly; attention reads the slots after the next one as older (gpt.GPT.decode)."""
    cache, (_, P) = rollout.cache, prompt_1P.shape
    S = cache.valid_BS.shape[1]
    alone = model.init_cache(1, P)._replace(prefix_keys=cache.prefix_keys, prefix_values=cache.prefix_values)
    logits_1V, alone = model.apply(params, prompt_1P, mask_1P, alone, cache.prefix_keys is None, method=gpt.GPT.extend)
    slots_P = (cache.slot - P + jnp.arange(P)) % S

    def put(x_LBKRW: jax.Array, new_L1KRW: jax.Array) -> jax.Array:
        """The row's S slots whole: the prompt's in slots_P, the others empty (unseen: not
        valid). One update of the row, where a scatter into its slots makes a TPU copy the
        whole cache into another layout and back. Both come in rows (gpt.slots_per_row)."""
        new_L1KPE = gpt.unpack_slots(new_L1KRW, model.head_width)
        row_L1KSE = jnp.concatenate([new_L1KPE, jnp.zeros((*new_L1KPE.shape[:3], S - P, new_L1KPE.shape[4]),
                                                          new_L1KPE.dtype)], 3)
        row_L1KSE = jnp.roll(row_L1KSE, cache.slot - P, axis=3).astype(x_LBKRW.dtype)
        return jax.lax.dynamic_update_slice(x_LBKRW, gpt.pack_slots(row_L1KSE, x_LBKRW.shape[-1]), (0, row, 0, 0, 0))

    cache = cache._replace(keys=put(cache.keys, alone.keys), values=put(cache.values, alone.values),
                           valid_BS=cache.valid_BS.at[row].set(False).at[row, slots_P].set(mask_1P[0]))
    first, done = gpt.pick_token(logits_1V, 0, key_1, temperature, top_p)[0], ~mask_1P[0].any()
    return rollout._replace(next_B=rollout.next_B.at[row].set(first), cache=cache,
                            out_BN=rollout.out_BN.at[row].set(0 if eos_id is None else eos_id),
                            done_B=rollout.done_B.at[row].set(done),
                            finite_B=rollout.finite_B.at[row].set(done | gpt.finite_rows(logits_1V)[0]),
                            written_B=rollout.written_B.at[row].set(0))
