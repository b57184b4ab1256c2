"""A minimal trainer: the default tiny GPT learns the built-in data, then is evaluated.

    python train.py                          # 600 steps on CPU (about 4 minutes), into runs/train
    python train.py --steps 300 --out DIR    # the same as: python jobs.py gpt/train/pretrain ...
    python evaluate.py --ckpt runs/train     # score the checkpoint it wrote
    python train.py --sft --init runs/train --out runs/sft   # then fine-tune it on addition's answers (gpt/train/sft)
    python train.py --rl --init runs/sft --out runs/rl       # then reinforce its addition (gpt/train/rl)

Reading order: TrainConfig -> the training text (a mix of the four built-in tasks) ->
BaseTrainer: optimizer, batches, one jitted step, the loop (checkpoints, logs, and an
evaluation through Evaluator.from_trainer at the end) -> the supervised stage: SFTConfig,
answer_batches, SupervisedTrainer (the same step on addition's answers) -> the reinforcement-learning stage:
RLConfig, advantages, the REINFORCE loss, ReinforceTrainer (rollouts through
Evaluator.evaluate, one jitted step, the same loop).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import gpt
import checkpoints
import jobs
from evaluate import Evaluator, EvaluatorConfig, RolloutEvaluation, check_processes, start_processes
from inference import MIN_TEMPERATURE
from checkpoints import Node, load_native, save_checkpoint
from jobs import ByteTokenizer, ExecutionSpec, UsageError, builtin_items, job, option


@dataclasses.dataclass
class TrainConfig:
    """Options of `python train.py` (the job gpt/train/pretrain)."""

    out: str = option("runs/train", "checkpoint directory, then what evaluate.py --ckpt takes")
    steps: int = option(600, "optimizer steps")
    batch_size: int = option(32, "sequences per step")
    micro_batch_size: int = option(0, "accumulate gradients over micro-batches of this size (0: off)")
    seq_len: int = option(128, "tokens per sequence")
    lr: float = option(3e-3, "peak learning rate (AdamW)")
    warmup: int = option(50, "steps of linear warmup, then cosine decay")
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of --lr")
    weight_decay: float = option(0.1, "AdamW weight decay on matrices")
    eval_every: int = option(0, "evaluate every N steps (0: only at the end)")
    ckpt_every: int = option(200, "write a checkpoint every N steps (and at the end)")
    seed: int = option(0, "initial weights and data order")
    mesh: Optional[str] = option(None, "device mesh BATCHxSHARD (default: every device on batch)")
    n_layers: int = option(4, "transformer blocks")
    n_embd: int = option(128, "model width")
    n_head: int = option(4, "attention heads")
    rope: bool = option(True, "rotary positions (learn copying and digit alignment much faster)")
    quiet: bool = option(False, "no progress output")

    def validate(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "ckpt_every", "n_layers", "n_embd", "n_head"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
        if not 0 <= self.seed <= jobs.MAX_SEED:
            raise UsageError(f"--seed must be in [0, {jobs.MAX_SEED}] (what the PRNG takes), got {self.seed}")
        micro = self.micro_batch_size or self.batch_size
        if micro < 1 or self.batch_size % micro:
            raise UsageError(f"--batch-size {self.batch_size} is not a multiple of --micro-batch-size {micro}")
        check_optimizer_options(self)
        if not 0 <= self.min_lr_ratio <= 1:
            raise UsageError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        rows = f"--micro-batch-size {micro}" if self.micro_batch_size else f"--batch-size {micro}"
        check_batch_fits(self.model(), micro, self.seq_len, f"{rows} and --seq-len {self.seq_len}")

    def model(self) -> gpt.GPT:
        """The GPT these options make, checked as a checkpoint's config.json is: no checkpoint
        of a width its heads do not divide could be read back, nor one beyond memory built."""
        fields = dict(n_layers=self.n_layers, n_embd=self.n_embd, n_head=self.n_head, rope=self.rope,
                      block_size=max(self.seq_len, gpt.GPT.block_size))
        return checkpoints.check_model_fields(fields, "--n-layers, --n-embd, --n-head and --seq-len")


def check_optimizer_options(cfg: Any) -> None:
    """Options that cannot be right, refused before anything runs: a learning rate that is not
    above 0 and finite (NaN trained to the end into NaN weights, a negative one climbs the
    loss), weight decay below 0 or not finite, a negative count of steps (--warmup, --eval-every)."""
    if not 0 < cfg.lr < math.inf:
        raise UsageError(f"--lr must be above 0 and finite, got {cfg.lr}")
    if not 0 <= cfg.weight_decay < math.inf:
        raise UsageError(f"--weight-decay must be at least 0 and finite, got {cfg.weight_decay}")
    for name in ("warmup", "eval_every"):
        if getattr(cfg, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 0, got {getattr(cfg, name)}")


def check_later_stage(cfg: Any) -> None:
    """The options --sft and --rl share: a checkpoint to start from and another to write
    (its checkpoints would overwrite the start), a seed the PRNG takes, the optimizer's, and
    the weight of the pretraining loss."""
    if not cfg.init:
        raise UsageError("--init CKPT is needed: the native checkpoint to start from (python train.py "
                         "writes runs/train)")
    if Path(cfg.out).resolve() == Path(cfg.init).resolve():
        raise UsageError(f"--out {cfg.out} is the checkpoint --init names; choose another --out")
    if not 0 <= cfg.seed <= jobs.MAX_SEED:
        raise UsageError(f"--seed must be in [0, {jobs.MAX_SEED}] (what the PRNG takes), got {cfg.seed}")
    check_optimizer_options(cfg)
    if not 0 <= cfg.ptx < math.inf:
        raise UsageError(f"--ptx must be at least 0 and finite, got {cfg.ptx}")


def check_batch_fits(model: gpt.GPT, rows: int, length: int, options: str) -> None:
    """Refuse a training batch that cannot fit, before it is built, as evaluate.py refuses its
    batches: at least the float32 input of each layer's matmuls, kept for the backward pass,
    and the logits and their gradient, of this process's rows, against the memory available.
    XLA holds several times more, so this refuses only what cannot fit; a batch between the
    two ends in one line when XLA runs out (BaseTrainer.run)."""
    m = model
    per_token = m.n_layers * (2 * m.n_embd + m.n_head * m.head_width + m.mlp_width) + 2 * m.vocab_size
    needed = np.dtype(np.float32).itemsize * -(-rows // jax.process_count()) * length * per_token
    free = gpt.available_memory()
    if needed > free:
        raise UsageError(f"{options}: a training batch of {rows} x {length} tokens needs at least "
                         f"{gpt.gigabytes(needed)}, more than the {gpt.gigabytes(free)} of memory available")


# ----------------------------------------------------------------------------- data

TRAINING_MIX = {"addition": 0.6, "repeat": 0.2, "grammar": 0.1, "text": 0.1}  # share of lines
PTX_LEN = 128  # the later stages' --ptx batches: sequences as long as the pretrainer's
ANSWER_LEN = 16  # the tokens of an addition item, prompt and answer: what --sft's rows hold


def training_text(seed: int) -> Iterator[str]:
    """Lines mixing all four tasks, from the train split only. Addition and copying are
    the slowest to learn, so they get most of the lines."""
    streams = {t: builtin_items(t, "train", seed) for t in TRAINING_MIX}
    rng = random.Random(seed)
    while True:
        task = rng.choices(list(TRAINING_MIX), weights=list(TRAINING_MIX.values()))[0]
        item = next(streams[task])
        yield item if isinstance(item, str) else item[0] + item[1]  # pairs: prompt + answer


def packed_batches(tokenizer: ByteTokenizer, seed: int, rows: int, seq_len: int) -> Iterator[np.ndarray]:
    """[rows, seq_len + 1] windows of the packed byte stream of training_text, EOS between lines."""
    lines, need = training_text(seed), rows * (seq_len + 1)
    buffer: List[int] = []
    while True:
        while len(buffer) < need:
            buffer += tokenizer.encode(next(lines)) + [tokenizer.eos_token_id]
        chunk, buffer = buffer[:need], buffer[need:]
        yield np.array(chunk, np.int32).reshape(rows, seq_len + 1)


def text_pair(tokens_BT: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of windows of text: each token's target is the next one."""
    return tokens_BT[:, :-1], tokens_BT[:, 1:]


# ----------------------------------------------------------------------------- trainer


@job("gpt/train/pretrain")
class BaseTrainer:
    """Train a GPT on the built-in data with AdamW; checkpoints are native directories."""

    CONFIG = TrainConfig
    EVALUATION = ["text", "grammar", "addition", "repeat"]  # built-in evaluations, by name
    LOG_EVERY_S = 5.0  # without a terminal (a log file, CI), a progress line this often

    def __init__(self, spec: ExecutionSpec, base: Optional[Node] = None):
        self.spec, self.base = spec, base
        self.cfg: TrainConfig = spec.cfg or TrainConfig()
        self.mesh = spec.make_mesh()
        self.model = self.cfg.model()
        self.variables = gpt.init_params(self.model, self.mesh, spec.seed)
        self.tokenizer = ByteTokenizer()
        self.step = 0

    @classmethod
    def config(cls) -> List[type]:
        return [cls.CONFIG]

    def optimizer(self) -> optax.GradientTransformation:
        """AdamW (b2 0.95; no decay on norms and biases), warmup then cosine, clipping at 1."""
        c = self.cfg
        schedule = optax.warmup_cosine_decay_schedule(0.0, c.lr, c.warmup, max(c.steps, c.warmup + 1),
                                                      c.lr * c.min_lr_ratio)
        decay = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
        return optax.chain(optax.clip_by_global_norm(1.0),
                           optax.adamw(schedule, b2=0.95, weight_decay=c.weight_decay, mask=decay))

    def batches(self) -> Iterator[List[Tuple[np.ndarray, np.ndarray]]]:
        """Each step's batch: its parts, each (inputs, targets) [rows, T]. Here one part, windows
        of the packed training text, each token's target the next one."""
        windows = packed_batches(self.tokenizer, self.spec.seed, self.cfg.batch_size, self.cfg.seq_len)
        return ([text_pair(tokens_BT)] for tokens_BT in windows)

    def loss_weights(self) -> List[float]:
        """The weight of each part's mean loss in the step's loss."""
        return [1.0]

    def train_step(self, tx: optax.GradientTransformation) -> Callable:
        """One AdamW step on a batch of parts (batches), targets -1 where no loss is taken, the
        loss their weighted sum (loss_weights); gradients accumulate over micro-batches with
        lax.scan."""
        c, model, weights = self.cfg, self.model, self.loss_weights()
        micro = c.micro_batch_size or c.batch_size
        accum = c.batch_size // micro

        def loss_fn(params, batch, key):
            loss = 0.0
            for weight, (inputs_BT, targets_BT) in zip(weights, batch):
                loss += weight * model.apply({"params": params}, inputs_BT, targets_BT, deterministic=False,
                                             rngs={"dropout": key})[1]
            return loss

        def step(state, batch, key):
            params, opt_state = state

            def add(total, micro_batch):
                loss, grads = jax.value_and_grad(loss_fn)(params, micro_batch, key)
                return jax.tree.map(jnp.add, total, (loss, grads)), None

            zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
            micro_batches = jax.tree.map(lambda a: a.reshape(accum, micro, -1), batch)
            (loss, grads), _ = jax.lax.scan(add, zero, micro_batches)
            grads = jax.tree.map(lambda g: g / accum, grads)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss / accum

        return step

    def run(self) -> None:
        """Train, holding --out (jobs.DirectoryLock) so that no other run writes there meanwhile;
        its train_log.jsonl starts afresh, as the run's checkpoints replace the ones there."""
        lock = None
        if self.spec.is_main:
            Path(self.cfg.out).mkdir(parents=True, exist_ok=True)
            lock = jobs.DirectoryLock(Path(self.cfg.out))
            (Path(self.cfg.out) / "train_log.jsonl").unlink(missing_ok=True)  # a killed or an earlier run's
        try:
            with jax.set_mesh(self.mesh):  # traced under the mesh, as InferenceJob's kernels (gpt.rows_at_a_time)
                self.train()
        except jax.errors.JaxRuntimeError as e:  # a batch beyond check_batch_fits' estimate, yet beyond memory
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            raise UsageError(f"out of memory while training ({jobs.first_line(e)}); a smaller batch would fit "
                             "(--batch-size, --micro-batch-size, --seq-len, --ptx-rows)") from None
        finally:
            if lock is not None:
                lock.release()

    def train(self) -> None:
        c = self.cfg
        tx = self.optimizer()
        params = self.variables["params"]
        state = (params, self.place_optimizer_state(jax.jit(tx.init)(params)))
        state_shardings = jax.tree.map(lambda x: x.sharding, state)
        batch_sharding = gpt.input_sharding(self.model, self.mesh, ("batch", None))
        step = jax.jit(self.train_step(tx), out_shardings=(state_shardings, None), donate_argnums=0)
        bar = tqdm(total=c.steps, desc="train", disable=c.quiet or not sys.stderr.isatty())
        data = self.batches()
        started, last_line = time.time(), 0.0  # the first line comes at once, then every LOG_EVERY_S
        for self.step in range(1, c.steps + 1):
            host_batch = next(data)
            tokens_per_step = sum(inputs_BT.size for inputs_BT, _ in host_batch)
            batch = jax.device_put(host_batch, batch_sharding)
            state, loss = step(state, batch, jax.random.key(self.spec.seed * 1_000_003 + self.step))
            self.variables = {"params": state[0]}
            if self.step % 10 == 0 or self.step == c.steps:
                rate = tokens_per_step * self.step / (time.time() - started)
                bar.set_postfix(loss=f"{float(loss):.3f}", tok_s=f"{rate:,.0f}")
                self.log({"step": self.step, "loss": float(loss), "tokens_per_s": rate})
                last_line = self.progress_line(bar, f"loss {float(loss):.3f}, {rate:,.0f} tokens/s", last_line)
            self.after_step(bar)
        self.finish(bar)

    def progress_line(self, bar: Any, text: str, last_line: float) -> float:
        """Where no bar shows (a log file, CI), "step N/STEPS: text" every LOG_EVERY_S; the
        time of the last line printed."""
        c = self.cfg
        if bar.disable and not c.quiet and time.time() - last_line > self.LOG_EVERY_S:
            self.say(f"step {self.step}/{c.steps}: {text}")
            return time.time()
        return last_line

    def after_step(self, bar: Any) -> None:
        """The bar moved; a checkpoint every ckpt_every steps and at the last; an evaluation
        every eval_every steps (the last one's comes with finish)."""
        c = self.cfg
        bar.update(1)
        if self.step % c.ckpt_every == 0 or self.step == c.steps:
            self.save()
        if c.eval_every and self.step % c.eval_every == 0 and self.step != c.steps:
            self.evaluate()

    def finish(self, bar: Any) -> None:
        bar.close()
        self.evaluate()
        self.say(f"checkpoint: {self.cfg.out} (python evaluate.py --ckpt {self.cfg.out})")

    def start_from(self, base: Node) -> None:
        """The later stages' start: the model, parameters and tokenizer of a native checkpoint."""
        self.base, self.mesh, self.step = base, self.spec.make_mesh(), 0
        self.model, self.variables, self.tokenizer = load_native(base.path, self.mesh)

    def place_optimizer_state(self, opt_state: Any) -> Any:
        """Adam's moments inherit their parameter's sharding; step counters are replicated."""
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        keep = lambda x: x.sharding if isinstance(x.sharding, jax.sharding.NamedSharding) else replicated
        return jax.device_put(opt_state, jax.tree.map(keep, opt_state))

    def log(self, record: Dict[str, Any]) -> None:
        if self.spec.is_main:
            Path(self.cfg.out).mkdir(parents=True, exist_ok=True)
            with open(Path(self.cfg.out) / "train_log.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def say(self, text: str) -> None:
        if self.spec.is_main and not self.cfg.quiet:
            print(text, file=sys.stderr)

    def save(self) -> None:
        save_checkpoint(self.cfg.out, self.model, self.variables, self.tokenizer.describe(),
                        {"step": self.step, "seed": self.spec.seed})

    def evaluate(self) -> Dict[str, float]:
        """The declared EVALUATION on the live parameters, through Evaluator.from_trainer."""
        scores = Evaluator.from_trainer(self).evaluate()
        self.say(f"step {self.step}: " + ", ".join(f"{k} {v:.4g}" for k, v in scores.items()))
        self.log({"step": self.step, "eval": scores})
        return scores


# ----------------------------------------------------------------------------- supervised fine-tuning
# The pretrainer's step on the right answers of addition's training prompts, one item a row as
# the evaluation prompts it, the loss on the answer tokens alone: what a sampled rollout finds
# one time in ten (a digit the checkpoint guesses), this stage is shown every time. As
# nanochat goes base -> SFT -> RL, the RL stage starts from its checkpoint.


@dataclasses.dataclass
class SFTConfig:
    """Options of `python train.py --sft` (the job gpt/train/sft)."""

    init: str = option("", "native checkpoint to start from (python train.py writes runs/train)")
    out: str = option("runs/sft", "checkpoint directory, then what train.py --rl --init and evaluate.py "
                      "--ckpt take")
    steps: int = option(500, "optimizer steps")
    batch_size: int = option(128, "training items of addition per step, one a row")
    ptx: float = option(2.0, "weight of the pretraining loss on a batch of the training mix, added to the "
                        "answers' loss: keeps the other tasks where they were")
    ptx_rows: int = option(32, "sequences of 128 tokens of the training mix in each step's --ptx batch")
    lr: float = option(1e-3, "peak learning rate (AdamW)")
    warmup: int = option(20, "steps of linear warmup, then cosine decay")
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of --lr")
    weight_decay: float = option(0.0, "AdamW weight decay on matrices")
    eval_every: int = option(0, "evaluate every N steps (0: only at the end)")
    ckpt_every: int = option(100, "write a checkpoint every N steps (and at the end)")
    seed: int = option(0, "order of the training items")
    mesh: Optional[str] = option(None, "device mesh BATCHxSHARD (default: every device on batch)")
    quiet: bool = option(False, "no progress output")
    micro_batch_size = 0  # the pretrainer's step: one batch, no accumulation

    def validate(self) -> None:
        for name in ("steps", "batch_size", "ptx_rows", "ckpt_every"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
        if not 0 <= self.min_lr_ratio <= 1:
            raise UsageError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        check_later_stage(self)


def answer_batches(tokenizer: ByteTokenizer, items: Iterator[Tuple[str, str]],
                   rows: int) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
    """(inputs, targets) [rows, T]: one item a row, its prompt, answer and EOS from position 0
    (as the evaluation prompts it), then EOS padding; the targets are the answer's tokens and
    its EOS, -1 at the prompt and the padding. T is the batch's longest item (the built-in
    addition's items are all one length: one shape, one compilation)."""
    while True:
        pairs = [(tokenizer.encode(prompt), tokenizer.encode(answer) + [tokenizer.eos_token_id])
                 for prompt, answer in itertools.islice(items, rows)]
        width = max(len(prompt) + len(answer) for prompt, answer in pairs)
        tokens_BL = np.full((rows, width), tokenizer.eos_token_id, np.int32)
        answer_BL = np.zeros((rows, width), bool)
        for row, (prompt, answer) in enumerate(pairs):
            tokens_BL[row, :len(prompt) + len(answer)] = prompt + answer
            answer_BL[row, len(prompt):len(prompt) + len(answer)] = True
        yield tokens_BL[:, :-1], np.where(answer_BL[:, 1:], tokens_BL[:, 1:], -1)


@job("gpt/train/sft")
class SupervisedTrainer(BaseTrainer):
    """Fine-tune a trained GPT on the right answers of addition's training prompts (SFT)."""

    CONFIG = SFTConfig
    TASK = "addition"

    def __init__(self, spec: ExecutionSpec, base: Optional[Node] = None):
        self.spec, self.cfg = spec, spec.cfg or SFTConfig()
        self.start_from(base or Node(self.cfg.init))
        if self.cfg.batch_size % self.mesh.shape["batch"] or self.cfg.ptx_rows % self.mesh.shape["batch"]:
            raise UsageError(f"--batch-size ({self.cfg.batch_size}) and --ptx-rows ({self.cfg.ptx_rows}) must be "
                             f"multiples of the mesh's batch size {self.mesh.shape['batch']}")
        check_batch_fits(self.model, self.cfg.batch_size, ANSWER_LEN, f"--batch-size {self.cfg.batch_size}")
        if self.cfg.ptx:
            check_batch_fits(self.model, self.cfg.ptx_rows, min(PTX_LEN, self.model.block_size),
                             f"--ptx-rows {self.cfg.ptx_rows}")

    def batches(self) -> Iterator[List[Tuple[np.ndarray, np.ndarray]]]:
        """Two parts: the answer rows (answer_batches), then --ptx-rows windows of the training mix
        (none at --ptx 0)."""
        c = self.cfg
        answers = answer_batches(self.tokenizer, self.training_items(), c.batch_size)
        if not c.ptx:
            return ([answer_pair] for answer_pair in answers)
        texts = packed_batches(self.tokenizer, self.spec.seed, c.ptx_rows, min(PTX_LEN, self.model.block_size))
        return ([answer_pair, text_pair(tokens_BT)] for answer_pair, tokens_BT in zip(answers, texts))

    def loss_weights(self) -> List[float]:
        return [1.0, self.cfg.ptx]

    def training_items(self) -> Iterator[Tuple[str, str]]:
        """(prompt, answer) pairs of the training split: never a held-out one."""
        return builtin_items(self.TASK, "train", self.spec.seed)


# ----------------------------------------------------------------------------- reinforcement learning
# REINFORCE on the evaluation's own rollouts, as nanochat's chat_rl.py does after its SFT: each
# step samples k answers to each of a few training prompts of addition through
# Evaluator.evaluate (the decoder the evaluation runs), rewards each answer token with its own
# correctness (--reward digits; exact: the evaluation's exact match for all of them), and
# raises the log-probability of the tokens that did better than their prompt's mean at the
# same place (--positive; without it, the worse ones are lowered too). No KL term and no
# clipped ratio: every step's answers come from the current weights. The learning rate is
# small because a step of the rollouts' gradient helps only while it is short (docs/api.md);
# --ptx adds the pretraining loss for runs at larger rates.


@dataclasses.dataclass
class RLConfig:
    """Options of `python train.py --rl` (the job gpt/train/rl)."""

    init: str = option("", "native checkpoint to start from (python train.py writes runs/train)")
    out: str = option("runs/rl", "checkpoint directory, then what evaluate.py --ckpt takes")
    steps: int = option(300, "optimizer steps, one batch of rollouts each")
    prompts: int = option(16, "training prompts of addition per step")
    samples: int = option(8, "answers sampled per prompt (the group whose mean is the baseline)")
    temperature: float = option(1.0, "sampling temperature of the rollouts (the policy trained)")
    reward: str = option("digits", "digits: each answer token its own correctness (its end and beyond: the "
                         "exact match); exact: each answer's exact match, for all its tokens")
    positive: bool = option(True, "keep only the advantages above 0: learn from the better answers alone "
                            "(--positive=false: full REINFORCE)")
    ptx: float = option(0.0, "weight of the pretraining loss on a batch of the training mix, added to the "
                        "RL loss (InstructGPT's ptx): keeps the other tasks where they were")
    ptx_rows: int = option(16, "sequences of 128 tokens of the training mix in each step's --ptx batch")
    lr: float = option(1e-5, "learning rate (AdamW), constant after --warmup steps")
    warmup: int = option(20, "steps of linear warmup")
    weight_decay: float = option(0.0, "AdamW weight decay on matrices")
    eval_every: int = option(0, "evaluate every N steps (0: only at the end)")
    ckpt_every: int = option(50, "write a checkpoint every N steps (and at the end)")
    seed: int = option(0, "order of the training prompts")
    mesh: Optional[str] = option(None, "device mesh BATCHxSHARD (default: every device on batch)")
    quiet: bool = option(False, "no progress output")
    coordinator: Optional[str] = option(None, "HOST:PORT of process 0, for a multi-process run")
    num_processes: int = option(1, "processes in a multi-process run")
    process_id: int = option(0, "this process's index in a multi-process run")

    def validate(self) -> None:
        for name in ("steps", "prompts", "samples", "ckpt_every", "ptx_rows"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
        if self.reward not in ("exact", "digits"):
            raise UsageError(f"--reward must be exact or digits, got {self.reward!r}")
        if not MIN_TEMPERATURE <= self.temperature < math.inf:
            raise UsageError(f"--temperature must be in [{MIN_TEMPERATURE:g}, inf): the rollouts are sampled")
        check_later_stage(self)
        check_processes(self)


def token_rewards(new_BM: np.ndarray, targets: List[List[int]], exact_B: np.ndarray, dense: bool) -> np.ndarray:
    """[B, M]: the reward of each of the M generated slots. Dense: 1 where the slot's token is the
    answer's token at that place, and past the answer (its end and beyond) the exact match; else
    the exact match everywhere."""
    if not dense:
        return np.repeat(exact_B[:, None], new_BM.shape[1], 1).astype(np.float32)
    places = np.arange(new_BM.shape[1])
    target_BM = np.array([(t + [-1] * len(places))[:len(places)] for t in targets])
    inside_BM = places[None, :] < np.array([len(t) for t in targets])[:, None]
    return np.where(inside_BM, new_BM == target_BM, exact_B[:, None]).astype(np.float32)


def advantages(rewards_NKM: np.ndarray, positive: bool) -> np.ndarray:
    """Each reward minus the mean of its prompt's k samples at the same slot, [N * K, M]. A
    prompt whose answers all scored alike teaches nothing there. Positive: the worse answers
    are not pushed down, only the better ones up (it learns more per step)."""
    centred_NKM = rewards_NKM - rewards_NKM.mean(1, keepdims=True)
    if positive:
        centred_NKM = np.maximum(centred_NKM, 0.0)
    return centred_NKM.reshape(-1, rewards_NKM.shape[2]).astype(np.float32)


def reinforce_loss(logits_BTV: jax.Array, targets_BT: jax.Array, generated_BT: jax.Array,
                   advantages_BT: jax.Array, temperature: float) -> jax.Array:
    """-(advantage x log-probability) of each generated token under the sampling policy
    (logits / temperature), averaged over generated tokens. Prompt and padding positions are
    dropped by `where`, not multiplied by 0, so their gradient is exactly zero."""
    nll_BT = gpt.token_nll(logits_BTV / temperature, targets_BT)
    weighted_BT = jnp.where(generated_BT, advantages_BT * nll_BT, 0.0)  # -(advantage x log p)
    return weighted_BT.sum() / jnp.maximum(generated_BT.sum(), 1)


def generated_positions(mask_BL: np.ndarray, n_new: int) -> np.ndarray:
    """True at the real tokens of a rollout row's last n_new slots (inference.rollout_row)."""
    return mask_BL & (np.arange(mask_BL.shape[1]) >= mask_BL.shape[1] - n_new)


def real_columns(mask_BL: np.ndarray, multiple: int = 8) -> slice:
    """The columns of a batch of rollout rows that hold a real token in some row, widened on
    the left to a multiple of `multiple` (few shapes, few compilations). Rows are left-padded
    prompts, then their new tokens: an addition prompt pads to 16 slots and its answer fills
    4 of 8, so more than half of the slots are padding in every row. Positions count from
    each row's first real token and padded keys are never attended to, so the columns cut
    change no logit, only the work."""
    used = np.flatnonzero(mask_BL.any(0)) if mask_BL.any() else np.zeros(1, int)
    end = used[-1] + 1
    width = min(-(-(end - used[0]) // multiple) * multiple, mask_BL.shape[1])
    start = max(end - width, 0)
    return slice(start, start + width)


@job("gpt/train/rl")
class ReinforceTrainer(BaseTrainer):
    """Reinforce a trained GPT's addition on the evaluation's own rollouts (REINFORCE)."""

    CONFIG = RLConfig
    TASK, MAX_NEW_TOKENS = "addition", 8  # as the built-in evaluation decodes it

    def __init__(self, spec: ExecutionSpec, base: Optional[Node] = None):
        self.spec, self.cfg = spec, spec.cfg or RLConfig()
        start_processes(self.cfg)  # before anything touches a device
        self.start_from(base or Node(self.cfg.init))
        rows = self.cfg.prompts * self.cfg.samples
        if rows % self.mesh.shape["batch"] or self.cfg.ptx and self.cfg.ptx_rows % self.mesh.shape["batch"]:
            raise UsageError(f"--prompts x --samples ({rows}) and, with --ptx, --ptx-rows ({self.cfg.ptx_rows}) must "
                             f"be multiples of the mesh's batch size {self.mesh.shape['batch']}")
        if self.cfg.ptx:
            check_batch_fits(self.model, self.cfg.ptx_rows, min(PTX_LEN, self.model.block_size),
                             f"--ptx-rows {self.cfg.ptx_rows}")

    def optimizer(self) -> optax.GradientTransformation:
        c = self.cfg
        schedule = optax.linear_schedule(0.0, c.lr, c.warmup) if c.warmup else c.lr
        decay = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
        return optax.chain(optax.clip_by_global_norm(1.0),
                           optax.adamw(schedule, b2=0.95, weight_decay=c.weight_decay, mask=decay))

    def prompt_groups(self) -> Iterator[Dict[str, str]]:
        """Each step's samples: --prompts training items (never held-out ones), each --samples times."""
        items = builtin_items(self.TASK, "train", self.spec.seed)
        while True:
            for prompt, answer in itertools.islice(items, self.cfg.prompts):
                yield from [{"prompt": prompt, "answer": answer}] * self.cfg.samples

    def rollouts(self, evaluator: Evaluator, samples: List[Dict[str, str]]) -> Tuple[np.ndarray, ...]:
        """(rewards [N*K], tokens [N*K, L], mask, generated) of one step's samples, decoded by the
        evaluator with the live parameters; every process holds them all."""
        evaluator.variables = self.variables  # its kernels take the parameters as an argument: no recompiling
        evaluator.evaluations = [RolloutEvaluation(self.TASK, samples, max_new_tokens=self.MAX_NEW_TOKENS)]
        scores, rows = evaluator.evaluate(reduce="none", return_intermediates=True,
                                          temperature=self.cfg.temperature, seed=self.step)
        tokens_BL = np.stack([t for t, _ in rows[self.TASK]])
        mask_BL = np.stack([m for _, m in rows[self.TASK]])
        return scores[self.TASK], tokens_BL, mask_BL, generated_positions(mask_BL, self.MAX_NEW_TOKENS)

    def advantages(self, samples: List[Dict[str, str]], exact_B: np.ndarray, tokens_BL: np.ndarray) -> np.ndarray:
        """[B, L]: each generated slot's advantage (token_rewards, then advantages), 0 elsewhere."""
        c, m = self.cfg, self.MAX_NEW_TOKENS
        targets = [self.tokenizer.encode(s["answer"].strip()) for s in samples]
        rewards_BM = token_rewards(tokens_BL[:, -m:], targets, exact_B, c.reward == "digits")
        advantages_BM = advantages(rewards_BM.reshape(c.prompts, c.samples, m), c.positive)
        return np.pad(advantages_BM, ((0, 0), (tokens_BL.shape[1] - m, 0)))

    def reinforce_step(self, tx: optax.GradientTransformation) -> Callable:
        """One AdamW step on reinforce_loss over a batch of rollout rows, plus --ptx x the language-model
        loss of a batch of pretraining text where one is given."""
        model, temperature, ptx = self.model, self.cfg.temperature, self.cfg.ptx

        def loss_fn(params, tokens_BL, mask_BL, generated_BL, advantages_BL, *text_BS):
            logits_BTV, _ = model.apply({"params": params}, tokens_BL[:, :-1], padding_mask=mask_BL[:, :-1],
                                        deterministic=True)
            loss = reinforce_loss(logits_BTV, tokens_BL[:, 1:], generated_BL[:, 1:], advantages_BL[:, 1:],
                                  temperature)
            for text in text_BS:
                loss += ptx * model.apply({"params": params}, text[:, :-1], text[:, 1:], deterministic=True)[1]
            return loss

        def step(state, *batch):
            params, opt_state = state
            loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        return step

    def train(self) -> None:
        c = self.cfg
        tx = self.optimizer()
        params = self.variables["params"]
        state = (params, self.place_optimizer_state(jax.jit(tx.init)(params)))
        step = jax.jit(self.reinforce_step(tx), out_shardings=(jax.tree.map(lambda x: x.sharding, state), None),
                       donate_argnums=0)
        evaluator = Evaluator.from_parts(self.spec, self.model, self.variables, self.tokenizer, self.mesh, [],
                                         EvaluatorConfig(quiet=True, batch_size=c.prompts * c.samples))
        bar = tqdm(total=c.steps, desc="rl", disable=c.quiet or not sys.stderr.isatty())
        samples, started, last_line = self.prompt_groups(), time.time(), 0.0
        texts = packed_batches(self.tokenizer, self.spec.seed, c.ptx_rows,
                               min(PTX_LEN, self.model.block_size))  # a checkpoint of a shorter context
        for self.step in range(1, c.steps + 1):
            group = list(itertools.islice(samples, c.prompts * c.samples))
            rewards, *rows = self.rollouts(evaluator, group)
            columns = real_columns(rows[1])
            batch = [a[:, columns] for a in (*rows, self.advantages(group, rewards, rows[0]))]
            batch += [next(texts)] if c.ptx else []
            state, loss = step(state, *(evaluator.put(a, 0) for a in batch))  # each process its rows
            self.variables = {"params": state[0]}
            rate = c.prompts * c.samples * self.step / (time.time() - started)
            bar.set_postfix(reward=f"{rewards.mean():.3f}", samples_s=f"{rate:,.0f}")
            self.log({"step": self.step, "reward": float(rewards.mean()), "loss": float(loss), "samples_per_s": rate})
            last_line = self.progress_line(bar, f"reward {rewards.mean():.3f}, {rate:,.0f} samples/s", last_line)
            self.after_step(bar)
        self.finish(bar)


if __name__ == "__main__":
    # `python train.py --sft ...` is the job gpt/train/sft, `--rl` gpt/train/rl; neither: gpt/train/pretrain.
    # Only the first is taken: a second stage's flag is left to be refused as an unknown option.
    stages = {"--sft": SupervisedTrainer.KEY, "--rl": ReinforceTrainer.KEY}
    flag = next((arg for arg in sys.argv[1:] if arg in stages), None)
    args = list(sys.argv[1:])
    if flag:
        args.remove(flag)
    jobs.leave_torch_unloaded()
    sys.exit(jobs.main([stages.get(flag, BaseTrainer.KEY), *args]))
