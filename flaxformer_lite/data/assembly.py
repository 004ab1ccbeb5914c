"""A run's data, assembled from its config: text splits -> tokenizer -> token ids.

``prepare_data(config, workdir)`` reads the training splits (with their subsets,
auxiliary-split filter and tags, reversed pairs and per-epoch pools), trains or
reloads the workdir's tokenizer, and tokenizes everything once; the pipeline
(:mod:`~flaxformer_lite.data.pipeline`) then packs and batches the ids.
``ppmi_table`` computes the co-occurrence start of the embeddings from the same texts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np

from flaxformer_lite.config.experiment import TEXT_TASKS, ExperimentConfig
from flaxformer_lite.data import cooccurrence, files, pipeline, sources, synthetic
from flaxformer_lite.data.tokenizer import Tokenizer, load_or_train


@dataclasses.dataclass
class TrainingData:
    """A run's training and validation examples (token ids), its tokenizer and counts."""

    tokenizer: Tokenizer | None  # None for a generated task (its examples are ids)
    train: list[dict[str, np.ndarray]]
    validation: list[dict[str, np.ndarray]]
    stats: dict[str, pipeline.PipelineStats]
    validation_texts: list[tuple[str, ...]]  # for BLEU during training
    train_texts: list[tuple[str, ...]] | None = None  # of ``train``; for subword sampling
    # data.resample_subsets: (pool of examples, how many of it each epoch draws); the
    # epoch's examples are ``train`` plus those draws (pipeline.SubsetSampler)
    train_pools: list[tuple[list[dict[str, np.ndarray]], int]] = dataclasses.field(
        default_factory=list
    )

    def sampler(self, seed: int) -> pipeline.SubsetSampler | None:
        return (
            pipeline.SubsetSampler(self.train, self.train_pools, seed) if self.train_pools else None
        )


def prepare_data(config: ExperimentConfig, workdir: Path) -> TrainingData:
    """Text splits -> the workdir's tokenizer (trained on train splits once) -> token ids;
    for a generated task (``recall``, ``classify``) its examples, which are ids already."""
    config = ExperimentConfig.from_config(config)
    if config.data.task not in TEXT_TASKS:
        return generated_data(config)
    d = config.data
    columns = d.features
    if files.is_files(d.dataset):
        check_corpus(workdir, d.dataset, files.corpus_fingerprint(d.dataset, columns))
    train_pairs: list[tuple[str, ...]] = []
    reversed_pairs: list[tuple[str, str]] = []  # data.reverse_tag: target -> source, tagged
    pool_pairs: list[tuple[list, list, int]] = []  # resample_subsets: (fwd, rev, per epoch)
    counts = None  # word counts of the first split, per feature (for aux_min_count)
    splits = d.train_splits
    for i, (name, limit) in enumerate(splits):
        texts = sources.load_texts(d.dataset, name, columns, d.data_dir)
        if i == 0:
            counts = sources.word_counts(texts) if d.aux_min_count else None
        elif counts is not None:
            before = len(texts)
            texts = sources.known_word_pairs(texts, counts, d.aux_min_count)
            print(
                f"{name}: kept {len(texts)} of {before} pairs whose words all occur >= "
                f"{d.aux_min_count}x in {splits[0][0]}"
            )
        draw = d.resample_subsets and i > 0 and limit is not None and limit < len(texts)
        if not draw:
            texts = sources.fixed_subset(texts, limit)
        # The source says where the pair comes from (aux_tag) and which way it goes.
        aux = f"{d.aux_tag} " if i > 0 and d.aux_tag else ""
        forward = [(aux + t[0], *t[1:]) for t in texts]
        backward = (
            [(f"{d.reverse_tag} {aux}{tgt}", src) for src, tgt in texts] if d.reverse_tag else []
        )
        if draw:  # all of them; each epoch draws `limit` (of each direction on its own)
            pool_pairs.append((forward, backward, limit))
        else:
            train_pairs += forward
            reversed_pairs += backward
    eval_pairs = sources.load_texts(d.dataset, d.eval_split, columns, d.data_dir)

    # The tokenizer learns from one direction: the fixed pairs and every pool pair.
    tokenizer_pairs = train_pairs + [pair for forward, _, _ in pool_pairs for pair in forward]

    def sentences():
        rng = np.random.default_rng(0)
        order = rng.permutation(len(tokenizer_pairs))[: d.tokenizer_max_sentences // len(columns)]
        for i in order:
            yield from tokenizer_pairs[i]

    tags = tuple(tag for tag in (d.aux_tag, d.reverse_tag) if tag)
    tokenizer = load_or_train(workdir, sentences, config.model.vocab_size, tags, d.tokenizer)
    train_pairs += reversed_pairs  # after the tokenizer, which learns from one direction
    train_texts: list | None = [] if d.subword_alpha and not d.stream else None
    if d.stream:  # one running text per split (in corpus order), cut into full rows
        train, train_stats = pipeline.stream_rows(train_pairs, tokenizer, d.max_length)
    else:
        train, train_stats = pipeline.tokenize_pairs(
            train_pairs, tokenizer, d.max_length, d.too_long, kept_texts=train_texts
        )
    validation, eval_stats = validation_examples(config, tokenizer, eval_pairs)
    pools = []
    for pairs, count in [(p, n) for fwd, bwd, n in pool_pairs for p in (fwd, bwd) if p]:
        pool, stats = pipeline.tokenize_pairs(pairs, tokenizer, d.max_length, d.too_long)
        train_stats = pipeline.PipelineStats(
            *(
                a + b
                for a, b in zip(
                    dataclasses.astuple(train_stats), dataclasses.astuple(stats), strict=True
                )
            )
        )
        if len(pool) > count:
            pools.append((pool, count))
        else:  # fewer left than drawn (too-long pairs dropped): all of them, every epoch
            train += pool
    return TrainingData(
        tokenizer,
        train,
        validation,
        {"train": train_stats, "validation": eval_stats},
        eval_pairs,
        train_texts,
        pools,
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


def check_corpus(workdir: Path, dataset: str, fingerprint: str) -> None:
    """Record which files a run trains on (``corpus.json``); a resume that finds other
    content there is refused, since the run's tokenizer and data order came from it."""
    path = Path(workdir) / CORPUS_FILE
    if path.exists():
        before = json.loads(path.read_text())
        if before.get("fingerprint") != fingerprint:
            raise files.CorpusError(
                f"--workdir={workdir} trained on {before.get('dataset')} with content "
                f"{before.get('fingerprint', '?')[:16]}; {dataset} now reads as "
                f"{fingerprint[:16]} (its files changed). Use a new --workdir, or the files "
                "the run had"
            )
        return
    Path(workdir).mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"dataset": dataset, "fingerprint": fingerprint}, indent=2))
    os.replace(tmp, path)


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
        pieces = [tokenizer.sp.encode(list(column)) for column in zip(*texts, strict=True)]
        documents += [np.concatenate(parts) for parts in zip(*pieces, strict=True)]
    vocab, dim = config.model.vocab_size, config.model.d_model
    table, covered = cooccurrence.ppmi_embeddings(documents, vocab, dim, seed=t.seed)
    print(
        f"embeddings: PPMI vectors for {covered} of {vocab} pieces from {len(documents)} "
        f"pairs in {time.perf_counter() - started:.0f} s"
    )
    return table
