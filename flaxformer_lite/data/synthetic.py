"""Long-range tasks generated locally, as TFDS builders (array_record), no download.

Each task is a deterministic generator (a seed per split) of token-id sequences over
its own small vocabulary; the builders write them like the corpora, so that the same
pipeline, sweeps and workdirs serve them. A dataset is named ``task/config``:

* ``mqar/l{L}_p{P}[_k{K}]``: multi-query associative recall (Zoology, Arora et al.
  2023): ``P`` key-value pairs, then every key queried once, in random order, at
  random places of the rest of a row of ``L`` tokens (filler elsewhere), each query
  followed by its value. A decoder-only model reads the row; it is scored on the
  values after the queries (``weights``), where only recall can tell the answer. Keys
  and values are drawn from ``K`` symbols each (default and at most 128; fewer
  symbols, more rows per symbol: a small model learns recall sooner, see
  experiments/long_range). The vocabulary stays the task's, whatever ``K``.
* ``needle/l{L}[_k{K}]``: one query at the end of a row of ``L`` tokens of key-value
  pairs asks for the pair whose key stands ``d`` tokens before it (``d`` drawn per row
  from powers of two up to ``L - 2``: ``group`` holds it), every other pair a
  distractor with another key; scored on the one answer, to draw accuracy against
  distance. Keys and values from ``K`` symbols each, as for ``mqar`` (at least 2: the
  distractors need a key other than the needle's).
* ``listops/l{L}``: the Long Range Arena's ListOps grammar (our own generator):
  nested ``[MAX``, ``[MIN``, ``[MED``, ``[SM`` (sum mod 10) over digits, up to 10
  levels and 10 arguments, rows of at most ``L`` tokens (at least ``L/4``); the
  ``label`` is the value, 0-9, for a sequence classifier.

Token ids: 0 padding, 1 EOS, 2 BOS (the model's defaults), then the task's own
symbols (:data:`VOCAB` gives each task's size, which ``model.vocab_size`` must reach).
Examples are dicts of int32 arrays: ``targets`` + ``weights`` (recall tasks: a
decoder-only LM), or ``inputs`` + ``targets`` (the label) + ``weights`` (classify).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import numpy as np
import tensorflow_datasets as tfds

from flaxformer_lite.data import progress, shared

FILL, FIRST = 3, 4  # the filler token; the first of a task's symbols
KEYS = VALUES = 128  # recall tasks: key and value symbols
OPS = ("[MAX", "[MIN", "[MED", "[SM")
LISTOPS_SYMBOLS = (*OPS, "]", *"0123456789")
VOCAB = {"mqar": FIRST + KEYS + VALUES, "needle": FIRST + KEYS + VALUES,
         "listops": FIRST + len(LISTOPS_SYMBOLS)}  # fmt: skip
TASK_OF = {"mqar": "recall", "needle": "recall", "listops": "classify"}  # data.task of each
NUM_CLASSES = {"listops": 10}
SPLITS = {"train": 16384, "validation": 512, "test": 1024}
_SPLIT_SEED = {"train": 0, "validation": 1, "test": 2}


def key_token(k):
    return FIRST + np.asarray(k)


def value_token(v):
    return FIRST + KEYS + np.asarray(v)


# Generators -------------------------------------------------------------------------------


def mqar_example(
    rng: np.random.Generator, length: int, pairs: int, symbols: int = KEYS
) -> dict[str, np.ndarray]:
    """One MQAR row: ``pairs`` key-value pairs (keys and values from the first
    ``symbols`` of each set), then each key queried once."""
    if not 0 < symbols <= KEYS:
        raise ValueError(f"mqar: k{symbols} symbols must be 1 to {KEYS}")
    if not 0 < pairs <= symbols or 4 * pairs > length:
        raise ValueError(
            f"mqar: {pairs} pairs need 0 < pairs <= {symbols} (the k symbols) and "
            f"4 * pairs <= {length}"
        )
    keys = key_token(rng.choice(symbols, pairs, replace=False))
    values = value_token(rng.integers(0, symbols, pairs))
    tokens = np.full(length, FILL, np.int32)
    tokens[0 : 2 * pairs : 2], tokens[1 : 2 * pairs : 2] = keys, values
    slots = (length - 2 * pairs) // 2  # two-token places for the queries after the pairs
    where = 2 * pairs + 2 * np.sort(rng.choice(slots, pairs, replace=False))
    order = rng.permutation(pairs)
    tokens[where], tokens[where + 1] = keys[order], values[order]
    weights = np.zeros(length, np.int32)
    weights[where + 1] = 1  # the value after each query: recall decides it
    return {"targets": tokens, "weights": weights}


def needle_distances(length: int) -> np.ndarray:
    """The query-to-key distances of ``needle/l{length}``: 2, 4, 8, ... and ``length-2``."""
    powers = [2**k for k in range(1, 32) if 2**k < length - 2]
    return np.asarray([*powers, length - 2], np.int32)


def needle_example(
    rng: np.random.Generator, length: int, symbols: int = KEYS
) -> dict[str, np.ndarray]:
    """A row of key-value pairs ending in one query whose key stands ``distance`` before
    it (``group``); the other pairs' keys differ from the queried one. Keys and values
    are drawn from the first ``symbols`` of each set."""
    if length < 6 or length % 2:
        raise ValueError(f"needle: the length must be even and >= 6, got {length}")
    if not 2 <= symbols <= KEYS:
        raise ValueError(f"needle: k{symbols} symbols must be 2 to {KEYS}")
    distance = int(rng.choice(needle_distances(length)))
    query = length - 2
    needle = rng.integers(0, symbols)
    others = rng.integers(0, symbols - 1, query // 2)
    keys = np.where(others >= needle, others + 1, others)  # every key but the needle's
    keys[(query - distance) // 2] = needle
    tokens = np.empty(length, np.int32)
    tokens[0:query:2] = key_token(keys)
    tokens[1:query:2] = value_token(rng.integers(0, symbols, query // 2))
    tokens[query], tokens[query + 1] = key_token(needle), tokens[query - distance + 1]
    weights = np.zeros(length, np.int32)
    weights[query + 1] = 1
    return {"targets": tokens, "weights": weights, "group": np.asarray([distance], np.int32)}


def _listops_tree(rng: np.random.Generator, budget: int, depth: int, max_depth: int,
                  max_args: int):  # fmt: skip
    """A random ListOps expression of at most ``budget`` symbols: a digit, or (operator,
    arguments) whose arguments share the budget left after the brackets."""
    if budget < 4 or depth >= max_depth:
        return int(rng.integers(0, 10))
    inner = budget - 2  # the operator and its closing bracket
    k = min(int(rng.integers(2, max_args + 1)), inner)
    cuts = np.sort(rng.choice(np.arange(1, inner), k - 1, replace=False))
    parts = np.diff([0, *cuts, inner])
    op = OPS[int(rng.integers(0, len(OPS)))]
    return op, [_listops_tree(rng, int(p), depth + 1, max_depth, max_args) for p in parts]


def listops_value(tree) -> int:
    if isinstance(tree, int):
        return tree
    op, args = tree
    values = [listops_value(a) for a in args]
    if op == "[MAX":
        return max(values)
    if op == "[MIN":
        return min(values)
    if op == "[MED":
        return int(np.median(values))  # LRA's: the median, rounded down
    return sum(values) % 10


def listops_symbols(tree) -> list[str]:
    if isinstance(tree, int):
        return [str(tree)]
    op, args = tree
    return [op, *(s for a in args for s in listops_symbols(a)), "]"]


def listops_example(
    rng: np.random.Generator, length: int, max_depth: int = 10, max_args: int = 10
) -> dict[str, np.ndarray]:
    """An expression of ``length // 4`` to ``length`` symbols and its value (the label):
    a budget drawn in that range, spent top-down (an expression rarely uses all of it)."""
    ids = {s: FIRST + i for i, s in enumerate(LISTOPS_SYMBOLS)}
    while True:
        budget = int(rng.integers(length // 4, length + 1))
        tree = _listops_tree(rng, budget, 0, max_depth, max_args)
        symbols = listops_symbols(tree)
        if length // 4 <= len(symbols) <= length:
            break
    return {
        "inputs": np.asarray([ids[s] for s in symbols], np.int32),
        "targets": np.asarray([listops_value(tree)], np.int32),
        "weights": np.ones(1, np.int32),
    }


# The datasets ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec:
    """A generated dataset: its task, row length and (recall) number of pairs and of
    key (and value) symbols."""

    task: str
    length: int
    pairs: int = 0
    symbols: int = KEYS

    @property
    def name(self) -> str:
        pairs = f"_p{self.pairs}" if self.task == "mqar" else ""
        symbols = f"_k{self.symbols}" if self.symbols != KEYS else ""
        return f"l{self.length}{pairs}{symbols}"

    def examples(self, split: str) -> Iterator[dict[str, np.ndarray]]:
        seed = [sum(map(ord, self.task)), self.length, self.pairs, _SPLIT_SEED[split]]
        if self.symbols != KEYS:  # the 128-symbol datasets keep the seeds they had
            seed.append(self.symbols)
        rng = np.random.default_rng(seed)
        for _ in range(SPLITS[split]):
            if self.task == "mqar":
                yield mqar_example(rng, self.length, self.pairs, self.symbols)
            elif self.task == "needle":
                yield needle_example(rng, self.length, self.symbols)
            else:
                yield listops_example(rng, self.length)


_NAME = re.compile(r"^(mqar|needle|listops)/l(\d+)(?:_p(\d+))?(?:_k(\d+))?$")
_EXAMPLE = {
    "mqar": "mqar/l512_p32 (or mqar/l512_p32_k16)",
    "needle": "needle/l512 (or needle/l512_k16)",
    "listops": "listops/l512",
}


def parse(dataset: str) -> Spec | None:
    """The Spec of ``task/l{L}[_p{P}][_k{K}]``, None for another name, ValueError for a
    bad one."""
    task = dataset.split("/")[0]
    if task not in TASK_OF:
        return None
    m = _NAME.match(dataset)
    if (
        not m
        or (task == "mqar") != (m.group(3) is not None)
        or (task == "listops" and m.group(4) is not None)
    ):
        example = _EXAMPLE[task]
        raise ValueError(f"data.dataset={dataset!r}: write {task} datasets as {example}")
    spec = Spec(task, int(m.group(2)), int(m.group(3) or 0), int(m.group(4) or KEYS))
    next(iter(spec.examples("validation")))  # checks sizes
    return spec


def _sequence() -> tfds.features.Tensor:
    return tfds.features.Tensor(shape=(None,), dtype=np.int16)


class _Generated(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """A generated task's builder; its configs are made on demand (one per length and
    number of pairs, named as :func:`parse` reads them)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Generated locally with fixed seeds."}
    FEATURES: tuple[str, ...] = ()

    def _info(self) -> tfds.core.DatasetInfo:
        features = {name: _sequence() for name in self.FEATURES}
        return tfds.core.DatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict(features),
            disable_shuffling=True,  # record i is the generator's example i
        )

    def _split_generators(self, dl_manager):
        spec = parse(f"{self.name}/{self.builder_config.name}")
        return {split: self._generate_examples(spec, split) for split in SPLITS}

    def _generate_examples(self, spec: Spec, split: str):
        for i, example in enumerate(spec.examples(split)):
            yield i, {k: v.astype(np.int16) for k, v in example.items()}


class Mqar(_Generated):
    """Multi-query associative recall (see the module docstring)."""

    FEATURES = ("targets", "weights")


class Needle(_Generated):
    """One recall query at a controlled distance (see the module docstring)."""

    FEATURES = ("targets", "weights", "group")


class Listops(_Generated):
    """The Long Range Arena's ListOps grammar, our own generator (see the module docstring)."""

    FEATURES = ("inputs", "targets", "weights")


BUILDERS = {"mqar": Mqar, "needle": Needle, "listops": Listops}


def builder(dataset: str, data_dir: str) -> tfds.core.DatasetBuilder:
    """The builder of ``task/config`` (its config made for that name)."""
    spec = parse(dataset)
    config = tfds.core.BuilderConfig(name=spec.name, description=f"{spec}")
    return BUILDERS[spec.task](config=config, data_dir=data_dir, file_format="array_record")


def build(dataset: str, data_dir: str) -> tfds.core.DatasetBuilder:
    """The builder of ``task/config``, its splits written if they were not (with
    ``data_dir`` in a bucket: in its local copy, taken from or given to the bucket)."""
    root = shared.local_root(data_dir)
    b = builder(dataset, root)
    if not b.is_prepared() and shared.fetch(data_dir, b.data_dir):
        b = builder(dataset, root)
    if not b.is_prepared():
        with progress.where_seen():
            b.download_and_prepare()
    shared.publish(data_dir, b.data_dir)
    return b


def load_examples(dataset: str, split: str, data_dir: str) -> list[dict[str, np.ndarray]]:
    """The examples of a split, built first if needed (int32 arrays)."""
    b = build(dataset, data_dir)
    source = b.as_data_source(split=split)
    records = source.__getitems__(list(range(len(source))))
    return [{k: np.asarray(v, np.int32) for k, v in r.items()} for r in records]
