"""A joint sentencepiece vocabulary for source and target, trained on train data only.

Ids: pad 0, EOS 1, BOS 2, unknown 3 (``ModelConfig`` uses the same pad/eos/bos).
The model lives in the workdir (``tokenizer.model``) and is reused on resume,
so a run never silently changes its vocabulary.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import sentencepiece as spm

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
MODEL_NAME = "tokenizer.model"


class Tokenizer:
    """Thin wrapper: ``encode`` to int32 ids (+EOS), ``decode`` back to text."""

    def __init__(self, processor: spm.SentencePieceProcessor, path: Path | None = None):
        self.sp = processor
        self.path = path
        if (self.sp.pad_id(), self.sp.eos_id(), self.sp.bos_id()) != (PAD_ID, EOS_ID, BOS_ID):
            raise ValueError(
                f"sentencepiece model {path} has pad/eos/bos ids "
                f"{self.sp.pad_id()}/{self.sp.eos_id()}/{self.sp.bos_id()}, expected "
                f"{PAD_ID}/{EOS_ID}/{BOS_ID}; train it with flaxformer_lite.data.tokenizer"
            )

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str, add_eos: bool = True) -> np.ndarray:
        ids = self.sp.encode(text)
        if add_eos:
            ids.append(EOS_ID)
        return np.asarray(ids, dtype=np.int32)

    def encode_batch(self, texts: list[str], add_eos: bool = True) -> list[np.ndarray]:
        return [self.encode(t, add_eos) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids up to the first EOS; pad/BOS are skipped."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if i not in (PAD_ID, BOS_ID):
                out.append(i)
        return self.sp.decode(out)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no sentencepiece model at {path}")
        sp = spm.SentencePieceProcessor()
        try:
            sp.load(str(path))
        except (OSError, RuntimeError) as e:
            raise ValueError(
                f"{path} is not a valid sentencepiece model ({e}); delete it to train a new one"
            ) from e
        return cls(sp, path)


def train_tokenizer(
    sentences: Iterator[str],
    path: str | Path,
    vocab_size: int,
    *,
    character_coverage: float = 1.0,
    max_sentences: int = 2_000_000,
    seed_sentencepiece_size: int = 200_000,
    user_symbols: tuple[str, ...] = (),
) -> Tokenizer:
    """Train a unigram sentencepiece model on ``sentences`` and write it atomically to ``path``.

    ``user_symbols`` (e.g. a data tag ``<dict>``) become single pieces wherever they occur.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences,
            model_writer=buffer,
            vocab_size=vocab_size,
            model_type="unigram",
            character_coverage=character_coverage,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            seed_sentencepiece_size=seed_sentencepiece_size,
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            bos_id=BOS_ID,
            unk_id=UNK_ID,
            user_defined_symbols=list(user_symbols),
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise ValueError(
            f"sentencepiece could not train a {vocab_size}-piece vocabulary ({e}); "
            "lower model.vocab_size or add training data"
        ) from e
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, path)  # never a half-written model
    return Tokenizer.load(path)


def load_or_train(
    workdir: str | Path,
    sentences_fn,
    vocab_size: int,
    user_symbols: tuple[str, ...] = (),
    given: str | Path = "",
) -> Tokenizer:
    """The workdir's tokenizer: trained from ``sentences_fn()`` the first time, or copied
    from ``given`` (``data.tokenizer``, an existing model) after checking that it fits
    (ids, ``vocab_size``, the tags). A workdir that holds another tokenizer than
    ``given`` is refused: its run learned that vocabulary."""
    path = Path(workdir) / MODEL_NAME
    if given:
        return _adopt(Path(given), path, vocab_size, user_symbols)
    if path.exists():
        tokenizer = Tokenizer.load(path)
        _check_symbols(
            tokenizer, user_symbols, "Use a new workdir (or delete the tokenizer to retrain it)"
        )
        return tokenizer
    return train_tokenizer(sentences_fn(), path, vocab_size, user_symbols=tuple(user_symbols))


def _check_symbols(tokenizer: Tokenizer, symbols: tuple[str, ...], fix: str) -> None:
    for symbol in symbols:
        if tokenizer.sp.piece_to_id(symbol) == UNK_ID:
            raise ValueError(
                f"{tokenizer.path} has no piece for the tag {symbol!r}; it was trained "
                f"without it. {fix}"
            )


def _adopt(given: Path, path: Path, vocab_size: int, symbols: tuple[str, ...]) -> Tokenizer:
    """``given`` checked and copied to ``path`` (atomically), or ``path`` if it is the same."""
    what = f"data.tokenizer={given}"
    if not given.is_file():
        raise ValueError(f"{what}: no such file; pass the path of a sentencepiece .model file")
    try:
        tokenizer = Tokenizer.load(given)
    except ValueError as e:
        raise ValueError(
            f"{what}: {e}. A model from spm_train needs --pad_id=0 --eos_id=1 --bos_id=2 --unk_id=3"
        ) from None
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"{what} has {tokenizer.vocab_size:,} pieces but model.vocab_size={vocab_size:,}; "
            f"set --config.model.vocab_size={tokenizer.vocab_size}"
        )
    _check_symbols(tokenizer, symbols, "Train it with that user-defined symbol, or drop the tag")
    data = given.read_bytes()
    if path.exists():
        if path.read_bytes() != data:
            raise ValueError(
                f"{what} is not the tokenizer the run in {path.parent} trained with "
                f"({path}); use a new --workdir, or leave data.tokenizer as the run had it"
            )
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # never a half-written model
    return Tokenizer.load(path)
