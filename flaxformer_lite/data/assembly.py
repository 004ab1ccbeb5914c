"""A run's data, assembled from its config: text splits -> tokenizer -> token ids.

``prepare_data(config, workdir)`` selects the training splits' records (their subsets,
auxiliary-split filter and tags, reversed pairs and per-epoch pools) as index arrays,
trains or reloads the workdir's tokenizer, and takes every split's token ids from the
token cache (:mod:`~flaxformer_lite.data.token_store`: tokenized once per corpus and
tokenizer, memory-mapped); the training examples are an
:class:`~flaxformer_lite.data.table.ExampleTable`, arrays over those stores, which the
pipeline (:mod:`~flaxformer_lite.data.packing`) packs and batches. Only the features
that need the texts keep them in memory: subword sampling (``data.subword_alpha``),
the known-word filter of auxiliary splits (``data.aux_min_count``) and the
validation split (for BLEU). ``ppmi_table`` computes the co-occurrence start of the
embeddings from the texts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np

from flaxformer_lite.config.experiment import TEXT_TASKS, ExperimentConfig
from flaxformer_lite.config.fields import ConfigError, json_of
from flaxformer_lite.data import (
    cooccurrence,
    files,
    pipeline,
    shared,
    sources,
    synthetic,
    token_store,
)
from flaxformer_lite.data.table import ExampleTable
from flaxformer_lite.data.token_store import Store, View
from flaxformer_lite.data.tokenizer import MODEL_NAME, Tokenizer, load_or_train
from flaxformer_lite.workdir import location, storage


@dataclasses.dataclass
class TrainingData:
    """A run's training and validation examples (token ids), its tokenizer and counts."""

    tokenizer: Tokenizer | None  # None for a generated task (its examples are ids)
    train: ExampleTable
    validation: list[dict[str, np.ndarray]]
    stats: dict[str, pipeline.PipelineStats]
    validation_texts: list[tuple[str, ...]]  # for BLEU during training
    train_texts: list[tuple[str, ...]] | None = None  # of ``train``; for subword sampling
    # data.resample_subsets: (pool of examples, how many of it each epoch draws); the
    # epoch's examples are ``train`` plus those draws (pipeline.SubsetSampler)
    train_pools: list[tuple[ExampleTable, int]] = dataclasses.field(default_factory=list)

    def sampler(self, seed: int) -> pipeline.SubsetSampler | None:
        return (
            pipeline.SubsetSampler(self.train, self.train_pools, seed) if self.train_pools else None
        )


@dataclasses.dataclass
class Selection:
    """The records of one training split a run takes (``index``), and the tag before
    their source (``data.aux_tag`` for an auxiliary split)."""

    name: str
    source: object  # the split's tfds data source
    index: np.ndarray
    aux: str = ""
    features: tuple[str, ...] = ()

    def rows(self, indices) -> list[tuple[str, ...]]:
        """The texts of the selected records at ``indices`` (positions in ``index``)."""
        return sources.read_rows(self.source, self.index[indices], self.features, self.name)


def select_splits(config: ExperimentConfig) -> tuple[list[Selection], list[tuple[Selection, int]]]:
    """The fixed selections of ``data.train_splits`` and the pools drawn per epoch."""
    d = config.data
    fixed: list[Selection] = []
    pools: list[tuple[Selection, int]] = []
    counts = None  # word counts of the first split, per feature (for aux_min_count)
    splits = d.train_splits
    for i, (name, limit) in enumerate(splits):
        source = sources.open_split(d.dataset, name, d.features, d.data_dir)
        index = np.arange(len(source))
        if i == 0 and d.aux_min_count:
            counts = sources.word_counts(sources.read_rows(source, index, d.features, name))
        elif i > 0 and counts is not None:
            texts = sources.read_rows(source, index, d.features, name)
            index = sources.known_word_indices(texts, counts, d.aux_min_count)
            print(
                f"{name}: kept {len(index)} of {len(texts)} pairs whose words all occur >= "
                f"{d.aux_min_count}x in {splits[0][0]}"
            )
        draw = d.resample_subsets and i > 0 and limit is not None and limit < len(index)
        if not draw:
            index = index[sources.fixed_subset_indices(len(index), limit)]
        # The source says where the pair comes from (aux_tag) and which way it goes.
        aux = f"{d.aux_tag} " if i > 0 and d.aux_tag else ""
        selection = Selection(name, source, index, aux, d.features)
        if draw:  # all of them; each epoch draws `limit` (of each direction on its own)
            pools.append((selection, limit))
        else:
            fixed.append(selection)
    return fixed, pools


def tokenizer_sentences(
    selections: list[Selection], max_sentences: int, width: int, max_characters: int = 0
):
    """The sentences the tokenizer learns from: the selections' pairs (one direction,
    tagged) in a permutation seeded by 0, up to ``max_sentences`` sentences and
    ``max_characters`` characters (0: no bound; whole pairs). sentencepiece holds
    ~20 bytes per character it learns from, so the characters bound its memory: at
    WMT's sentence length 1M sentences took 3 GiB. Read a chunk of pairs at a time."""
    sizes = np.array([len(s.index) for s in selections], np.int64)
    ends = np.cumsum(sizes)
    order = np.random.default_rng(0).permutation(int(ends[-1]))[: max_sentences // width]
    left = max_characters or float("inf")
    for start in range(0, len(order), _CHUNK):
        part = order[start : start + _CHUNK]
        which = np.searchsorted(ends, part, side="right")
        local = part - (ends - sizes)[which]
        texts: dict[int, dict[int, tuple[str, ...]]] = {}
        for k, selection in enumerate(selections):
            wanted = np.unique(local[which == k])
            view = View(prefix=selection.aux)
            rows = map(view.apply, selection.rows(wanted)) if wanted.size else ()
            texts[k] = dict(zip(wanted.tolist(), rows, strict=True))
        for k, j in zip(which.tolist(), local.tolist(), strict=True):
            pair = texts[k].pop(j)  # each pair once: sentencepiece keeps its own copy
            left -= sum(len(text) for text in pair)
            if left < 0:
                return
            yield from pair


_CHUNK = 100_000  # pairs read at once for the tokenizer


def split_store(
    config: ExperimentConfig, selection: Selection, view: View, tokenizer: Tokenizer
) -> Store:
    """Every record of ``selection``'s split seen through ``view``, as token ids: from
    the token cache under ``data.data_dir`` (built there the first time)."""
    d, source = config.data, selection.source
    count = len(source)
    where = f"the {selection.name!r} split of {d.dataset}"

    rows = sources.SplitRows(source, tuple(d.features), where)

    keys = KEYS[len(d.features)]
    if tokenizer.path is None:  # an in-memory tokenizer: nothing to key a cache by
        return token_store.tokenize_rows(map(view.apply, rows(0, count)), keys, tokenizer)
    identity = sources.identity(source, selection.name)
    tokenizer_sha = token_store.file_sha256(tokenizer.path)
    key = token_store.cache_key(identity, selection.name, d.features, view, tokenizer_sha)
    root = Path(shared.local_root(d.data_dir)) / token_store.CACHE_DIR
    root = root / identity["name"].replace("/", "_")
    name = f"{selection.name}-{key[:16]}"
    shared.fetch(d.data_dir, str(root / name), token_store.META)  # a bucket's cache
    store = token_store.cached_store(
        root,
        name,
        key,
        rows=rows,
        count=count,
        keys=keys,
        view=view,
        tokenizer=tokenizer,
        tokenizer_sha=tokenizer_sha,
        describe={"dataset": d.dataset, "split": selection.name, "features": list(d.features)},
        workers=os.cpu_count() or 1,
    )
    shared.publish(d.data_dir, str(root / name), token_store.META)
    return store


KEYS = {1: ("targets",), 2: ("inputs", "targets")}


def examples_of(
    store: Store, rows: np.ndarray, max_length: int, too_long: str
) -> tuple[ExampleTable, pipeline.PipelineStats]:
    """``rows`` of ``store`` as training examples: empty texts (no piece before EOS)
    skipped, those over ``max_length`` dropped or cut (``too_long``)."""
    empty = np.zeros(len(rows), bool)
    long = np.zeros(len(rows), bool)
    lengths = np.empty((len(rows), len(store.keys)), np.int32)
    for f, key in enumerate(store.keys):  # a feature at a time: one int32 an example
        raw = store.lengths(key)
        lengths[:, f] = raw[rows]
        del raw
        empty |= lengths[:, f] <= 1
        long |= lengths[:, f] > max_length
    long &= ~empty
    keep = ~empty & ~long if too_long == "drop" else ~empty
    np.minimum(lengths, max_length, out=lengths)
    table = ExampleTable([store], np.zeros(int(keep.sum()), np.int16), rows[keep], lengths[keep])
    dropped = int(long.sum()) if too_long == "drop" else 0
    cut = 0 if too_long == "drop" else int(long.sum())
    return table, pipeline.PipelineStats(len(table), dropped, cut, int(empty.sum()))


def _add(a: pipeline.PipelineStats, b: pipeline.PipelineStats) -> pipeline.PipelineStats:
    return pipeline.PipelineStats(
        *(x + y for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b), strict=True))
    )


def stream_table(tables: list[ExampleTable], max_length: int) -> ExampleTable:
    """A language model's running text: the examples in order (each ending in EOS),
    back to back and cut into rows of ``max_length`` tokens (the last may be shorter)."""
    key = tables[0].keys[0]
    (only,) = tables if len(tables) == 1 else (None,)
    whole = (
        only is not None
        and len(only.stores) == 1
        and len(only) == len(only.stores[0])
        and np.array_equal(only.row, np.arange(len(only)))
    )
    if whole:  # the store's own ids are the stream: no copy
        ids = only.stores[0].ids[key]
    else:
        parts = [t.gather(key, np.arange(len(t))) for t in tables if len(t)]
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    total = len(ids)
    ends = np.append(np.arange(max_length, total, max_length), total) if total else []
    return ExampleTable.of_store(Store((key,), {key: ids}, {key: np.asarray(ends, np.int64)}))


def prepare_data(config: ExperimentConfig, workdir) -> TrainingData:
    """Text splits -> the workdir's tokenizer (trained on train splits once) -> token
    ids (the token cache); for a generated task (``recall``, ``classify``) its
    examples, which are ids already."""
    config = ExperimentConfig.from_config(config)
    if config.data.task not in TEXT_TASKS:
        return generated_data(config)
    d = config.data
    columns = d.features
    if files.is_files(d.dataset):
        check_corpus(workdir, d.dataset, files.corpus_fingerprint(d.dataset, columns))
    fixed, pools = select_splits(config)
    eval_pairs = sources.load_texts(d.dataset, d.eval_split, columns, d.data_dir)

    # The tokenizer learns from one direction: the fixed pairs and every pool pair.
    learn = fixed + [selection for selection, _ in pools]
    tags = tuple(tag for tag in (d.aux_tag, d.reverse_tag) if tag)
    started, trained = time.perf_counter(), not (location.path(workdir) / MODEL_NAME).exists()
    tokenizer = load_or_train(
        workdir,
        lambda: tokenizer_sentences(
            learn, d.tokenizer_max_sentences, len(columns), d.tokenizer_max_characters
        ),
        config.model.vocab_size,
        tags,
        d.tokenizer,
    )
    if trained and not d.tokenizer:
        print(
            f"tokenizer: {tokenizer.vocab_size:,} pieces learned in "
            f"{time.perf_counter() - started:.0f} s",
            flush=True,
        )

    def views(selection: Selection) -> list[View]:
        forward = View(prefix=selection.aux)
        if not d.reverse_tag:
            return [forward]
        return [forward, View(swap=True, prefix=f"{d.reverse_tag} {selection.aux}")]

    # Fixed examples: every split forward, then (data.reverse_tag) every split reversed.
    tables, train_stats, train_texts = [], pipeline.PipelineStats(0, 0, 0, 0), None
    keep_texts = d.subword_alpha and not d.stream
    if keep_texts:
        train_texts = []
    for direction in range(len(views(fixed[0])) if fixed else 1):
        for selection in fixed:
            view = views(selection)[direction]
            store = split_store(config, selection, view, tokenizer)
            too_long = "drop" if d.stream else d.too_long  # a stream is cut, never dropped
            limit = np.iinfo(np.int32).max if d.stream else d.max_length
            table, stats = examples_of(store, selection.index, limit, too_long)
            tables.append(table)
            train_stats = _add(train_stats, stats)
            if keep_texts:
                rows = sources.read_rows(selection.source, table.row, columns, selection.name)
                train_texts += [view.apply(r) for r in rows]
    if d.stream:
        train = stream_table(tables, d.max_length)
        train_stats = pipeline.PipelineStats(len(train), 0, 0, train_stats.dropped_empty)
    else:
        train = ExampleTable.concat(tables) if tables else None
    kept_pools = []
    for selection, count in pools:
        for view in views(selection):
            store = split_store(config, selection, view, tokenizer)
            pool, stats = examples_of(store, selection.index, d.max_length, d.too_long)
            train_stats = _add(train_stats, stats)
            if len(pool) > count:
                kept_pools.append((pool, count))
            else:  # fewer left than drawn (too-long pairs dropped): all of them, every epoch
                train = ExampleTable.concat([train, pool]) if train is not None else pool
    validation, eval_stats = validation_examples(config, tokenizer, eval_pairs)
    return TrainingData(
        tokenizer,
        train,
        validation,
        {"train": train_stats, "validation": eval_stats},
        eval_pairs,
        train_texts,
        kept_pools,
    )


def check_generated(config: ExperimentConfig) -> synthetic.Spec:
    """The generated dataset of a recall or classify run, checked against the config."""
    d, m = config.data, config.model
    spec = synthetic.parse(d.dataset)
    if spec is None:
        raise ValueError(
            f"data.task={d.task!r} reads a generated dataset (mqar/l512_p32, needle/l1024, "
            f"listops/l512), not data.dataset={d.dataset!r}"
        )
    task = synthetic.TASK_OF[spec.task]
    if task != d.task:
        raise ValueError(f"data.dataset={d.dataset!r} is a {task} task; set data.task={task}")
    if m.vocab_size < synthetic.VOCAB[spec.task]:
        raise ValueError(
            f"model.vocab_size={m.vocab_size} is smaller than {spec.task}'s "
            f"{synthetic.VOCAB[spec.task]} token ids; set it to at least that"
        )
    if task == "classify" and m.num_classes != synthetic.NUM_CLASSES[spec.task]:
        raise ValueError(
            f"model.num_classes={m.num_classes}, but {spec.task} has "
            f"{synthetic.NUM_CLASSES[spec.task]} classes"
        )
    if spec.length > d.max_length:
        raise ValueError(
            f"data.max_length={d.max_length} is shorter than the rows of {d.dataset} "
            f"({spec.length} tokens); set data.max_length={spec.length}"
        )
    return spec


CORPUS_FILE = "corpus.json"


def check_corpus(workdir, dataset: str, fingerprint: str) -> None:
    """Record which files a run trains on (``corpus.json``); a resume that finds other
    content there is refused, since the run's tokenizer and data order came from it."""
    path = location.path(workdir) / CORPUS_FILE
    if path.exists():
        try:
            before = json_of(path.read_text(), dict, str(path))
        except ConfigError as e:
            raise files.CorpusError(f"{e}; restore it, or train in a new --workdir") from None
        if before.get("fingerprint") != fingerprint:
            raise files.CorpusError(
                f"--workdir={workdir} trained on {before.get('dataset')} with content "
                f"{before.get('fingerprint', '?')[:16]}; {dataset} now reads as "
                f"{fingerprint[:16]} (its files changed). Use a new --workdir, or the files "
                "the run had"
            )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"dataset": dataset, "fingerprint": fingerprint}
    storage.write_atomic(path, json.dumps(record, indent=2))


def validation_examples(
    config: ExperimentConfig, tokenizer: Tokenizer, pairs: list[tuple[str, ...]] | None = None
) -> tuple[list[dict[str, np.ndarray]], pipeline.PipelineStats]:
    """The validation examples the training loop evaluates (``data.eval_split``'s
    ``pairs``, read if not given): truncated to ``data.max_length``, or with
    ``data.stream`` one running text cut into rows; and their counts."""
    d = config.data
    if pairs is None:
        pairs = sources.load_texts(d.dataset, d.eval_split, d.features, d.data_dir)
    if d.stream:
        return pipeline.stream_rows(pairs, tokenizer, d.max_length)
    return pipeline.tokenize_pairs(pairs, tokenizer, d.max_length, "truncate")


def generated_data(config: ExperimentConfig) -> TrainingData:
    """The examples of a generated task (no tokenizer: they are ids already)."""
    d = config.data
    check_generated(config)
    train = []
    for name, limit in d.train_splits:
        train += sources.fixed_subset(synthetic.load_examples(d.dataset, name, d.data_dir), limit)
    validation = synthetic.load_examples(d.dataset, d.eval_split, d.data_dir)
    stats = {
        "train": pipeline.PipelineStats(len(train), 0, 0, 0),
        "validation": pipeline.PipelineStats(len(validation), 0, 0, 0),
    }
    return TrainingData(None, train, validation, stats, validation_texts=[])


def ppmi_table(config: ExperimentConfig, tokenizer: Tokenizer) -> np.ndarray:
    """``[vocab, d_model]`` PPMI co-occurrence vectors of the pairs of
    ``train.embedding_init_splits`` (default: ``data.train_splits``), the start of
    the token embeddings when ``train.embedding_init=ppmi``."""
    config = ExperimentConfig.from_config(config)
    d, t = config.data, config.train
    started = time.perf_counter()
    columns = d.features
    documents = []
    for name, limit in t.embedding_init_splits or d.train_splits:
        texts = sources.load_texts(d.dataset, name, columns, d.data_dir)
        texts = sources.fixed_subset(texts, limit)
        pieces = [
            tokenizer.side(i).ids(list(column)) for i, column in enumerate(zip(*texts, strict=True))
        ]
        documents += [np.concatenate(parts) for parts in zip(*pieces, strict=True)]
    vocab, dim = config.model.vocab_size, config.model.d_model
    table, covered = cooccurrence.ppmi_embeddings(documents, vocab, dim, seed=t.seed)
    print(
        f"embeddings: PPMI vectors for {covered} of {vocab} pieces from {len(documents)} "
        f"pairs in {time.perf_counter() - started:.0f} s"
    )
    return table
