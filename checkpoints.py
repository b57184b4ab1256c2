"""Checkpoints: config.json checked before anything is built, and safetensors read a block
at a time. A native checkpoint is written and read here; hf.py reads HuggingFace's
through the same reader.

Reading order: Node (a stored job's directory) -> config.json and the model's fields
(checked against GPT's types, sizes and the memory available before anything is built) ->
LazyTensor (a parameter not read yet) -> TensorFiles (one *.safetensors reader: headers
checked, blocks read into aligned arrays, converted, checked for NaN) -> native checkpoints
(save_checkpoint, load_checkpoint).

This file imports only gpt.py and jobs.py.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import typing
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Tuple

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import multihost_utils
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save

import gpt
from jobs import UsageError, first_line, load_tokenizer, open_regular, read_json, short, write_together


@dataclasses.dataclass
class Node:
    """A handle to what an earlier job stored, which a new job builds on (its `base`): a
    directory, and where it is a hub model's snapshot (hf.resolve_checkpoint), `hub`:
    {"id", "revision", "commit"}."""

    path: str
    hub: Optional[Dict[str, str]] = None

    @property
    def config(self) -> Dict[str, Any]:
        return read_config(Path(self.path))

    @property
    def is_native(self) -> bool:
        return self.config.get("format") == NATIVE_FORMAT


NATIVE_FORMAT = "gpt-native-v1"
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")  # fp8/int: quantized, refused
# safetensors' dtype names as numpy's (a dtype not listed keeps safetensors' name in errors)
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def read_config(directory: Path) -> Dict[str, Any]:
    """config.json of a checkpoint directory, with one-line errors for every way it can fail."""
    if not directory.exists():
        raise UsageError(f"checkpoint {directory} does not exist")
    if not directory.is_dir():
        raise UsageError(f"checkpoint {directory} is not a directory")
    path = directory / "config.json"
    if not os.path.lexists(path):
        raise UsageError(f"checkpoint {directory} has no config.json")
    config = read_json(path, "checkpoint config")
    if not isinstance(config, dict):
        raise UsageError(f"{path} must hold a JSON object")
    return config


def check_model_fields(fields: Any, where: str, mesh: Optional[jax.sharding.Mesh] = None) -> gpt.GPT:
    """The GPT that config fields describe, checked before anything is built: known names,
    JSON types, ranges, head counts that divide, known kinds, and parameters that fit in
    memory (estimated from the sizes, so absurd ones fail at once; on `mesh`, each device's
    share). `where` names the file."""
    if not isinstance(fields, dict):
        raise UsageError(f"{where}: \"model\" must be an object of GPT fields, got {short(fields)}")
    hints = typing.get_type_hints(gpt.GPT)
    for name, value in fields.items():
        if name not in hints or name in ("parent", "name"):
            raise UsageError(f"{where}: unknown model field {short(name)}")
        if not has_type(value, hints[name]):
            raise UsageError(f"{where}: model field {name!r} must be {type_name(hints[name])}, got {short(value)}")
    model = gpt.GPT(**fields)  # a flax dataclass: nothing is built or traced yet
    check_sizes(model, where)
    check_fits_in_memory(model, where, mesh)
    return model


def has_type(value: Any, kind: Any) -> bool:
    """Whether a JSON value fits a GPT field's annotation (int, float, bool, str, Optional)."""
    if typing.get_origin(kind) is typing.Union:  # Optional[X]
        return value is None or has_type(value, typing.get_args(kind)[0])
    if typing.get_origin(kind) is tuple:  # rope_scaling: a JSON list, checked by check_sizes
        return isinstance(value, (list, tuple))
    if kind is bool or isinstance(value, bool):  # JSON true is not 1, nor 1 true
        return kind is bool and isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, kind)


def type_name(kind: Any) -> str:
    if typing.get_origin(kind) is typing.Union:
        return f"{type_name(typing.get_args(kind)[0])} or null"
    if typing.get_origin(kind) is tuple:
        return "a list"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(kind, str(kind))


def check_sizes(m: gpt.GPT, where: str) -> None:
    """Sizes at least 1, heads that divide, known kinds and dtypes, floats in range."""
    for name in ("n_layers", "n_embd", "n_head", "block_size", "vocab_size", "n_kv_head", "head_dim", "mlp_hidden",
                 "sliding_window", "n_experts", "n_experts_per_token", "shared_expert_hidden", "query_block"):
        value = getattr(m, name)
        if value is not None and value < 1:
            raise UsageError(f"{where}: {name} must be at least 1, got {value}")
    if m.head_dim is None and m.n_embd % m.n_head:
        raise UsageError(f"{where}: n_head {m.n_head} does not divide n_embd {m.n_embd}")
    if m.n_head % m.kv_heads:
        raise UsageError(f"{where}: n_kv_head {m.kv_heads} does not divide n_head {m.n_head}")
    if m.n_experts is not None and (m.n_experts_per_token > m.n_experts or m.mlp not in ("swiglu", "geglu") or m.bias):
        raise UsageError(f"{where}: experts are gated MLPs without biases (mlp swiglu or geglu, bias false), "
                         f"n_experts_per_token at most n_experts {m.n_experts}")
    for name, known in (("mlp", gpt.MLP_KINDS), ("norm", gpt.NORM_KINDS), ("param_dtype", gpt.DTYPES),
                        ("activation_dtype", gpt.DTYPES), ("attention", gpt.ATTENTIONS),
                        ("step_attention", gpt.STEP_ATTENTIONS)):
        if getattr(m, name) not in known:
            raise UsageError(f"{where}: unknown {name} {short(getattr(m, name))}; known: {', '.join(known)}")
    ranges = {"dropout": (0 <= m.dropout < 1, "in [0, 1)"), "norm_eps": (m.norm_eps > 0, "above 0"),
              "rotary_fraction": (0 < m.rotary_fraction <= 1, "in (0, 1]"), "rope_theta": (m.rope_theta > 0, "above 0"),
              "window_pattern": (m.window_pattern and set(m.window_pattern) <= set("SG"), "S and G letters")}
    for name in ("local_rope_theta", "attn_scale", "attn_softcap", "logit_softcap"):
        ranges[name] = (getattr(m, name) is None or getattr(m, name) > 0, "above 0 (or null)")
    for name in ("embed_multiplier", "residual_multiplier", "logits_scaling"):
        ranges[name] = (getattr(m, name) > 0, "above 0")
    for name, (ok, allowed) in ranges.items():
        if not ok:
            raise UsageError(f"{where}: {name} must be {allowed}, got {short(getattr(m, name))}")
    if m.rope_scaling is not None:
        try:  # the real rotary width: longrope has one factor per rotated pair
            gpt.rope_frequencies(int(m.head_width * m.rotary_fraction) // 2 * 2, m.rope_theta, m.rope_scaling)
        except (ValueError, TypeError) as e:
            raise UsageError(f"{where}: rope_scaling {short(m.rope_scaling)}: {first_line(e)}") from None


def parameter_count(m: gpt.GPT) -> int:
    """The GPT's parameters counted from its sizes alone, without tracing it (tracing 10**7
    layers would take hours): embeddings and each layer's matrices; biases and norms are
    left out, so this never exceeds the true count. A mixture counts all its experts."""
    D, H, K, E, F, V = m.n_embd, m.n_head, m.kv_heads, m.head_width, m.mlp_width, m.vocab_size
    attention = D * (H + 2 * K) * E + H * E * D
    mlp = (3 if m.mlp in ("swiglu", "geglu") else 2) * D * F
    if m.n_experts is not None:
        mlp = m.n_experts * (mlp + D) + 3 * D * (m.shared_expert_hidden or 0)
    embeddings = V * D * (1 if m.tie_embeddings else 2) + (0 if m.rope else m.block_size * D)
    return m.n_layers * (attention + mlp) + embeddings


def check_fits_in_memory(m: gpt.GPT, where: str, mesh: Optional[jax.sharding.Mesh] = None) -> None:
    """The parameters must fit where they are placed. Without a mesh: the whole model once.
    On a mesh each device holds its share, the model over the "shard" axis (every large
    matrix is split over it; what stays whole is small), and this process's devices hold
    theirs together: against gpt.available_memory(), the host's for CPU devices (they
    share it), the accelerators' own otherwise (nothing is gathered on the host first)."""
    count = parameter_count(m)
    shards, devices = 1, 1
    if mesh is not None:
        shards = mesh.shape["shard"]
        devices = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    share = math.ceil(count / shards) * np.dtype(gpt.dtype_of(m.param_dtype)).itemsize
    needed, free = share * devices, gpt.available_memory()
    if needed > free:
        on = "" if mesh is None else f" ({gpt.gigabytes(share)} on each of this process's {devices} devices)"
        raise UsageError(f"{where}: these sizes make {count:.3g} parameters ({gpt.gigabytes(needed)}{on}), "
                         f"more than the {gpt.gigabytes(free)} of memory available")


class LazyTensor:
    """A parameter not read yet: its shape and dtype, and `read`, which reads one block of it
    (a tuple of slices, one per dimension, each with a start and a stop) as numpy.

    `tensor[index]` reads that block and np.asarray(tensor) the whole; gpt.place_params reads
    each device's block, so a process reads only what its devices hold. A checkpoint's
    layout is a view of its stored tensors, and so still lazy: .T, part (a range along one
    axis), split, stacked, concatenated.
    """

    def __init__(self, shape: Tuple[int, ...], dtype: Any, read: Callable[[Tuple[slice, ...]], np.ndarray]):
        self.shape, self.dtype, self.read = tuple(shape), np.dtype(dtype), read

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __getitem__(self, index: Any) -> np.ndarray:
        return self.read(block_of(index, self.shape))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[()]
        return whole if dtype is None else whole.astype(dtype)

    @property
    def T(self) -> LazyTensor:
        """The transpose: a torch Linear's [out, in] weight as our [in, out] kernel."""
        return LazyTensor(self.shape[::-1], self.dtype, lambda index: self.read(index[::-1]).T)

    def part(self, axis: int, start: int, stop: int) -> LazyTensor:
        """Indices start..stop along `axis`: one of the tensors a fused one holds."""

        def read(index: Tuple[slice, ...]) -> np.ndarray:
            s = index[axis]
            return self.read(index[:axis] + (slice(start + s.start, start + s.stop),) + index[axis + 1:])

        return LazyTensor(self.shape[:axis] + (stop - start,) + self.shape[axis + 1:], self.dtype, read)


def block_of(index: Any, shape: Tuple[int, ...]) -> Tuple[slice, ...]:
    """An index of basic slices (what jax.make_array_from_callback gives; () or ... for the
    whole) as one slice per dimension with its start and stop."""
    index = () if index is Ellipsis else index if isinstance(index, tuple) else (index,)
    if len(index) > len(shape) or not all(isinstance(s, slice) for s in index):
        raise IndexError(f"a lazy tensor of shape {shape} reads blocks of slices, not {index!r}")
    padded = index + (slice(None),) * (len(shape) - len(index))
    ranges = [s.indices(n) for s, n in zip(padded, shape)]
    if any(step != 1 for _, _, step in ranges):
        raise IndexError(f"a lazy tensor reads contiguous blocks, not {index!r}")
    return tuple(slice(start, max(start, stop)) for start, stop, _ in ranges)


def block_shape(index: Tuple[slice, ...]) -> Tuple[int, ...]:
    return tuple(s.stop - s.start for s in index)


def split(tensor: LazyTensor, sizes: List[int], axis: int = 0) -> List[LazyTensor]:
    """The tensors a fused one holds side by side along `axis`, `sizes` long (Phi-3's q|k|v
    rows, GPT-2's c_attn columns)."""
    starts = np.cumsum([0, *sizes]).tolist()
    return [tensor.part(axis, a, b) for a, b in zip(starts, starts[1:])]


def stacked(tensors: List[LazyTensor]) -> LazyTensor:
    """The tensors along a new first axis (a mixture's experts): a block reads only the
    experts it covers."""
    first = tensors[0]

    def read(index: Tuple[slice, ...]) -> np.ndarray:
        blocks = [t.read(index[1:]) for t in tensors[index[0]]]
        return np.stack(blocks) if blocks else np.zeros(block_shape(index), first.dtype)

    return LazyTensor((len(tensors), *first.shape), first.dtype, read)


def stacked_layers(layers: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Each layer's parameter tree as one tree of [L, ...] tensors, the layout of GPT's
    scanned "blocks": a device's block of it reads only the layers it covers."""
    return jax.tree.map(lambda *tensors: stacked(list(tensors)), *layers)


def concatenated(tensors: List[LazyTensor]) -> LazyTensor:
    """The tensors one after another along their first axis (GPT-NeoX's q: each head's rows
    of query_key_value): a block reads only the pieces it overlaps."""
    first = tensors[0]
    starts = np.cumsum([0, *(t.shape[0] for t in tensors)]).tolist()

    def read(index: Tuple[slice, ...]) -> np.ndarray:
        rows = index[0]
        blocks = [t.read((slice(max(rows.start, a) - a, min(rows.stop, b) - a), *index[1:]))
                  for t, a, b in zip(tensors, starts, starts[1:]) if max(rows.start, a) < min(rows.stop, b)]
        return np.concatenate(blocks) if blocks else np.zeros(block_shape(index), first.dtype)

    return LazyTensor((starts[-1], *first.shape[1:]), first.dtype, read)


def zeros(shape: Tuple[int, ...], dtype: Any) -> LazyTensor:
    """A parameter the checkpoint lacks and that computes nothing (a bias a family has not)."""
    return LazyTensor(shape, dtype, lambda index: np.zeros(block_shape(index), dtype))


class TensorFiles:
    """The tensors of a directory's *.safetensors file(s), read a block at a time and checked.

    `get(name, shape)` checks from the file's header that a tensor exists, is floating point
    and has the expected shape, naming file and tensor in any error, and returns it unread,
    as a LazyTensor: a block is read when asked for (plain reads into an aligned array), converted
    from the file's dtype straight to `dtype`, and checked for NaN and infinities. `unused()`
    lists the tensors never asked for, so a config that does not match the file shows up.
    Native checkpoints read flax paths ("blocks/attn/q/kernel"); hf.py reads HuggingFace
    names, under `prefix` ("model.") where the file has one. Nothing is ever unpickled.
    """

    bytes_read = 0  # bytes of weights this process has read, by every TensorFiles (tests and bench.py report it)

    def __init__(self, directory: str, dtype: str = "float32", prefix: str = ""):
        self.directory = directory
        self.dtype = np.dtype(gpt.dtype_of(dtype))
        self.where = self._locate(directory)  # tensor name -> file
        self.prefix = prefix if any(n.startswith(prefix) for n in self.where) else ""
        self.read: set = set()
        self.headers: Dict[str, Dict[str, Tuple[str, Tuple[int, ...], int]]] = {}  # file -> its tensors

    @staticmethod
    def _locate(directory: str) -> Dict[str, str]:
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.lexists(index):
            return TensorFiles._indexed(directory, index)
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if not files:
            if any(f.endswith(PICKLE_SUFFIXES) for f in os.listdir(directory)):
                raise UsageError(f"{directory}: only pickle weights (*.bin/*.pt); convert them to "
                                 "safetensors (model.safetensors), pickle is never loaded")
            raise UsageError(f"{directory}: no model.safetensors")
        where: Dict[str, str] = {}
        for file in files:  # model.safetensors, or shards without an index
            full = os.path.join(directory, file)
            open_regular(Path(full), "weights").close()  # safe_open would wait on a FIFO
            try:
                with safe_open(full, framework="numpy") as f:
                    names = list(f.keys())
            except (SafetensorError, OSError, ValueError) as e:
                raise UsageError(f"{full} is not a readable safetensors file ({first_line(e)})") from None
            for name in names:  # which of two the user meant, no index says
                if name in where:
                    raise UsageError(f"{directory}: tensor {short(name)} is in both {os.path.basename(where[name])} "
                                     f"and {file}, and no index (model.safetensors.index.json) says which to read")
                where[name] = full
        return where

    @staticmethod
    def _indexed(directory: str, index: str) -> Dict[str, str]:
        """Tensor name -> file from a sharded checkpoint's index: a mapping of names to file
        names in the same directory, each a regular file."""
        weight_map = read_json(Path(index), "safetensors index")
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise UsageError(f"{index}: \"weight_map\" must map tensor names to file names")
        for file in set(weight_map.values()):
            if os.path.basename(file) != file or file in ("", ".", ".."):
                raise UsageError(f"{index}: {short(file)} is not a file name in {directory}")
            open_regular(Path(directory) / file, "weights").close()
        return {name: os.path.join(directory, file) for name, file in weight_map.items()}

    def name(self, name: str, prefixed: bool = True) -> str:
        """The stored name: under the prefix, or as given (HuggingFace's lm_head)."""
        return self.prefix + name if prefixed else name

    def has(self, name: str, prefixed: bool = True) -> bool:
        return self.name(name, prefixed) in self.where

    def get(self, name: str, shape: Tuple[int, ...], prefixed: bool = True) -> LazyTensor:
        stored = self.name(name, prefixed)
        if stored not in self.where:
            raise UsageError(f"{self.directory}: tensor {stored!r} is missing")
        file = self.where[stored]
        stored_dtype, stored_shape, _ = self._header(file, stored)
        if stored_dtype not in FLOAT_DTYPES:
            raise UsageError(f"{file}: tensor {stored!r} has dtype {stored_dtype}; only float "
                             "weights are supported (no quantized checkpoints)")
        if stored_shape != tuple(shape):
            raise UsageError(f"{file}: tensor {stored!r} has shape {list(stored_shape)}, "
                             f"the model expects {list(shape)}")
        self.read.add(stored)
        return LazyTensor(stored_shape, self.dtype, lambda index: self._read_block(file, stored, index))

    def stored_shape(self, stored: str) -> Tuple[int, ...]:
        return self._header(self.where[stored], stored)[1]

    def _header(self, file: str, stored: str) -> Tuple[str, Tuple[int, ...], int]:
        """(dtype name as numpy spells it, shape, byte offset in the file) of a stored tensor.
        Each file's header is read once: checked by safe_open (offsets inside the file, sizes
        that match the shapes), then its JSON read for the offsets."""
        if file not in self.headers:
            try:
                with safe_open(file, framework="numpy"):
                    pass
                with open(file, "rb") as f:
                    size = int.from_bytes(f.read(8), "little")
                    header = json.loads(f.read(size))
            except (SafetensorError, OSError, ValueError) as e:
                raise UsageError(f"{file}: cannot read tensor {stored!r} ({first_line(e)})") from None
            self.headers[file] = {name: (SAFETENSORS_DTYPES.get(t["dtype"], t["dtype"]), tuple(t["shape"]),
                                         8 + size + t["data_offsets"][0])
                                  for name, t in header.items() if name != "__metadata__"}
        if stored not in self.headers[file]:  # the index names a file that does not hold it
            raise UsageError(f"{file}: cannot read tensor {stored!r} (the file does not hold it)")
        return self.headers[file][stored]

    def _read_block(self, file: str, stored: str, index: Tuple[slice, ...]) -> np.ndarray:
        """One block of a stored tensor in self.dtype, converted from the file's dtype
        directly (bfloat16 stays bfloat16), checked. Read with plain reads straight into an
        aligned array (jax then places it without a copy): a memory map, as safetensors'
        get_slice reads, costs a page fault a page and is several times slower."""
        dtype, shape, offset = self._header(file, stored)
        block = aligned_empty(block_shape(index), dtype)  # a float dtype: get() checked it
        try:
            with open(file, "rb", buffering=0) as f:
                read_block_into(f, offset, shape, index, block)
        except OSError as e:
            raise UsageError(f"{file}: cannot read tensor {stored!r} ({first_line(e)})") from None
        TensorFiles.bytes_read += block.nbytes
        if block.dtype != self.dtype:
            block = converted(block, self.dtype)
        if not all_finite(block):
            raise UsageError(f"{file}: tensor {stored!r} holds NaN or infinite values (read as "
                             f"{self.dtype.name}): broken weights")
        return block

    def zeros(self, shape: Tuple[int, ...]) -> LazyTensor:
        return zeros(shape, self.dtype)

    def unused(self, ignored: Tuple[str, ...] = ()) -> List[str]:
        """Stored tensors never read, except names ending in one of `ignored`."""
        return sorted(n for n in self.where if n not in self.read and not n.endswith(ignored))


ALIGNMENT = 64  # bytes: XLA's CPU client takes a numpy array this aligned as it is, without a copy


def aligned_empty(shape: Tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialized C-ordered array whose data starts at a multiple of ALIGNMENT bytes."""
    dtype, count = np.dtype(dtype), math.prod(shape)
    raw = np.empty(count * dtype.itemsize + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + count * dtype.itemsize].view(dtype).reshape(shape)


def converted(array: np.ndarray, dtype: Any) -> np.ndarray:
    """array.astype(dtype), into an aligned array."""
    out = aligned_empty(array.shape, dtype)
    np.copyto(out, array, casting="unsafe")
    return out


def read_block_into(f: BinaryIO, offset: int, shape: Tuple[int, ...], index: Tuple[slice, ...],
                    out: np.ndarray) -> None:
    """Read the block `index` of a C-ordered array of `shape` stored at byte `offset` into
    `out`, a contiguous run at a time: the axes after the last one the block cuts are whole,
    so a run spans them, and each run is one seek and one read straight into `out`. A column
    block of a matrix reads a run per row, only its own bytes; a whole tensor is one run."""
    if not out.size:
        return
    strides = [out.itemsize * math.prod(shape[axis + 1:]) for axis in range(len(shape))]
    cut = max((axis for axis, (s, n) in enumerate(zip(index, shape)) if (s.start, s.stop) != (0, n)), default=0)
    run = (index[cut].stop - index[cut].start) * strides[cut]
    outer = itertools.product(*(range(s.start, s.stop) for s in index[:cut]))
    buffer = memoryview(out.reshape(-1).view(np.uint8))
    for n, position in enumerate(outer):
        f.seek(offset + index[cut].start * strides[cut] + sum(i * stride for i, stride in zip(position, strides)))
        done = n * run
        while done < (n + 1) * run:
            got = f.readinto(buffer[done:(n + 1) * run])
            if not got:
                raise OSError("the file ends inside the tensor")
            done += got


def all_finite(array: np.ndarray) -> bool:
    """Whether a float array holds no NaN and no infinity, read from its bits in two passes
    without a copy: a value is not finite when its bits, sign aside, are infinity's or above;
    read as signed integers the positive ones among those are the largest, read as unsigned
    the negative ones. (numpy's own isfinite of bfloat16 runs an element at a time.)"""
    if not array.size:
        return True
    bits = 8 * array.dtype.itemsize
    infinity = int(np.array(np.inf, array.dtype).view(f"uint{bits}"))
    return (int(array.view(f"int{bits}").max()) < infinity
            and int(array.view(f"uint{bits}").max()) < infinity | 1 << (bits - 1))


def flatten(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """{"a": {"b": x}} -> {"a/b": x}: flax parameter paths as safetensors names."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}/{key}" if prefix else key
        flat.update(flatten(value, name) if isinstance(value, dict) else {name: value})
    return flat


def unflatten(flat: Dict[str, Any]) -> Dict[str, Any]:
    tree: Dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def param_shapes(model: gpt.GPT) -> Dict[str, Tuple[int, ...]]:
    """{flat path: shape} of the model's parameters, without allocating them."""
    abstract = nn.meta.unbox(gpt.abstract_params(model))["params"]
    return {name: tuple(x.shape) for name, x in flatten(abstract).items()}


def to_host(variables: Any) -> Dict[str, np.ndarray]:
    """Every parameter as one numpy array on every process (gathers shards across hosts)."""
    flat = flatten(variables["params"])
    if jax.process_count() > 1:
        flat = multihost_utils.process_allgather(flat, tiled=True)
    return {k: np.asarray(v) for k, v in flat.items()}


def model_config(model: gpt.GPT) -> Dict[str, Any]:
    """The GPT's fields as JSON (flax's parent/name are not configuration, nor how it computes:
    gpt.EXECUTION_FIELDS)."""
    return {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
            if f.name not in ("parent", "name", *gpt.EXECUTION_FIELDS)}


def save_checkpoint(directory: str, model: gpt.GPT, variables: Any, tokenizer: Dict[str, Any],
                    extra: Optional[Dict[str, Any]] = None) -> None:
    """Write the checkpoint's files together (write_together): the tokenizer's, then
    model.safetensors, then config.json, each in full before any is renamed.

    A run stopped midway (Ctrl-C, SIGTERM: they wait for the renames) leaves the previous
    complete checkpoint (or none) or the new one, never half a file nor the new weights
    beside the old config.json; other files in the directory (a training log) stay. SIGKILL
    cannot wait: the save's name (save_name) in both files tells a pair of two saves, and
    the weights carry their own config.json in their metadata, so load_checkpoint takes the
    newer save whole (one_save).
    """
    weights = to_host(variables)  # every process takes part in the gather
    if jax.process_index() != 0:
        return
    path, stamp = Path(directory), save_name(weights, (extra or {}).get("step"))
    config = {"format": NATIVE_FORMAT, "model": model_config(model),
              "tokenizer": {k: v for k, v in tokenizer.items() if k != "source"}, **(extra or {}), "save": stamp}
    # a HuggingFace tokenizer travels with its model; config.json, last, says which step the files are
    files = {name: (Path(tokenizer["source"]) / name).read_bytes() for name in tokenizer.get("files", [])}
    files.update({"model.safetensors": save(weights, metadata={"save": stamp, "config": json.dumps(config)}),
                  "config.json": (json.dumps(config, indent=2) + "\n").encode()})
    write_together(path, files)


def save_name(weights: Dict[str, np.ndarray], step: Any) -> str:
    """What names one save in both of its files: its step, where it has one, and a digest of
    its weights (names, dtypes, shapes, bytes), so that two saves differ wherever their weights
    do, and the same weights saved twice have one name."""
    digest = hashlib.sha256()
    for key in sorted(weights):
        array = np.ascontiguousarray(weights[key])
        digest.update(f"{key} {array.dtype} {array.shape}\n".encode())
        digest.update(array.reshape(-1).view(np.uint8))
    return (f"step {step}, " if step is not None else "") + f"weights {digest.hexdigest()[:16]}"


def one_save(path: Path, config: Dict[str, Any]) -> Dict[str, Any]:
    """The config of one save's config.json and model.safetensors (save_checkpoint names it in
    both): SIGKILL between their renames leaves a save's weights beside the previous
    config.json, and then the weights' own copy of their config is the checkpoint's (refused
    where they carry none). Files that name no save (written elsewhere, or before saves were
    named) are taken as they are."""
    weights = path / "model.safetensors"
    if config.get("save") is None or not weights.is_file():
        return config
    try:
        with safe_open(str(weights), framework="numpy") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise UsageError(f"{weights} is not a readable safetensors file ({first_line(e)})") from None
    saved = metadata.get("save")
    if saved is None or saved == config["save"]:
        return config
    try:
        own = json.loads(metadata.get("config", ""))
    except ValueError:
        own = None
    if isinstance(own, dict) and own.get("save") == saved:
        return own
    raise UsageError(f"{path}: config.json is of the save {short(config['save'])}, model.safetensors of "
                     f"{short(saved)}: a run was stopped between their renames; save it again or take "
                     "another checkpoint")


def load_checkpoint(directory: str, mesh: jax.sharding.Mesh, dtype: Optional[str] = None):
    """(model, variables placed in their mesh shardings, config) from a native checkpoint."""
    path = Path(directory)
    config = one_save(path, read_config(path))
    if config.get("format") != NATIVE_FORMAT:
        raise UsageError(f"{path}/config.json is not a native checkpoint (format {NATIVE_FORMAT})")
    if "model" not in config:
        raise UsageError(f"{path}/config.json: no \"model\" (the GPT's fields)")
    fields = config["model"]
    if dtype and isinstance(fields, dict):
        fields = {**fields, "param_dtype": dtype, "activation_dtype": dtype}
    model = check_model_fields(fields, f"{path}/config.json", mesh)
    tensors = TensorFiles(str(path), model.param_dtype)
    check_layer_count(model, tensors)
    stored = {name: native_tensor(tensors, name, shape) for name, shape in param_shapes(model).items()}
    if tensors.unused():
        raise UsageError(f"{path}: {len(tensors.unused())} tensor(s) the model does not use, "
                         f"e.g. {tensors.unused()[0]!r}")
    variables = gpt.place_params(model, mesh, {"params": unflatten(stored)})  # each device's block read here
    return model, variables, config


def load_native(directory: str, mesh: jax.sharding.Mesh, dtype: Optional[str] = None) -> Tuple[gpt.GPT, Any, Any]:
    """(model, variables placed on `mesh`, tokenizer) of a native checkpoint (load_checkpoint,
    then the tokenizer its config.json describes)."""
    model, variables, config = load_checkpoint(directory, mesh, dtype)
    return model, variables, load_tokenizer(config, directory)


def native_tensor(tensors: TensorFiles, name: str, shape: Tuple[int, ...]) -> LazyTensor:
    """A parameter as stored, or a layer's ("blocks/...", [L, ...]) stacked from the tensors
    of each layer ("blocks_0/...") that checkpoints written before layers were scanned hold."""
    if name.startswith("blocks/") and not tensors.has(name):
        return stacked([tensors.get(f"blocks_{i}/{name[len('blocks/'):]}", shape[1:]) for i in range(shape[0])])
    return tensors.get(name, shape)


def check_layer_count(model: gpt.GPT, tensors: TensorFiles) -> None:
    """n_layers must match the file's blocks, checked before the model is traced (tracing a
    wrong, large n_layers would take long only to find a tensor missing)."""
    stacked_names = [name for name in tensors.where if name.startswith("blocks/")]
    if stacked_names:
        shape = tensors.stored_shape(stacked_names[0])
        stored = shape[0] if shape else 0
    else:
        stored = len({name.split("/")[0] for name in tensors.where if name.startswith("blocks_")})
    if stored != model.n_layers:
        raise UsageError(f"{tensors.directory}: config.json says n_layers {model.n_layers}, "
                         f"the weights hold {stored} blocks")
