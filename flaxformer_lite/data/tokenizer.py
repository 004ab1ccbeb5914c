"""A joint sentencepiece vocabulary for source and target, trained on train data only;
or, for a model imported from Marian / OPUS-MT, its pair of sentencepiece models over
one shared vocabulary (:class:`PairTokenizer`).

Ids: pad 0, EOS 1, BOS 2, unknown 3 (``ModelConfig`` uses the same pad/eos/bos).
The model lives in the workdir (``tokenizer.model``) and is reused on resume,
so a run never silently changes its vocabulary. A pair is stored under the same
name as a zip archive (its two models and its pieces), so every reader of the
workdir's tokenizer gets it through :meth:`Tokenizer.load`.

Code that knows which column it encodes asks ``tokenizer.side(i)`` (0: source,
1: target); a joint tokenizer is both of its sides.
"""

from __future__ import annotations

import io
import json
import os
import re
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import sentencepiece as spm

from flaxformer_lite.workdir import location, storage

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
MODEL_NAME = "tokenizer.model"


class Tokenizer:
    """Thin wrapper: ``encode`` to int32 ids (+EOS), ``decode`` back to text."""

    unk_id = UNK_ID

    def __init__(self, processor: spm.SentencePieceProcessor, path: Path | None = None):
        self.sp = processor
        self.path = path  # a local file (a bucket's model: its copy in this machine's cache)
        self.origin = path  # where it was read from (a run folder, local or in a bucket)
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

    def ids(self, texts: list[str], alpha: float = 0.0) -> list[list[int]]:
        """Piece ids of each text, no EOS (``alpha`` > 0: a sampled segmentation)."""
        if alpha:
            return [
                self.sp.encode(t, enable_sampling=True, alpha=alpha, nbest_size=-1) for t in texts
            ]
        return self.sp.encode(texts)

    def side(self, column: int) -> Tokenizer:
        """The tokenizer of column ``column`` (0 source, 1 target): itself."""
        return self

    def id_to_piece(self, i: int) -> str:
        return self.sp.id_to_piece(int(i))

    def piece_to_id(self, piece: str) -> int:
        return self.sp.piece_to_id(piece)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids up to the first EOS; pad/BOS are skipped."""
        return self.sp.decode(_until_eos(ids, (PAD_ID, BOS_ID)))

    @classmethod
    def load(cls, path) -> Tokenizer:
        """A sentencepiece model, or a :class:`PairTokenizer` archive (local, or in a
        bucket: read through a local copy, which token-cache workers and exports open)."""
        origin = location.path(path, "tokenizer")
        if not origin.is_file():
            raise FileNotFoundError(f"no sentencepiece model at {origin}")
        path = Path(storage.local_copy(origin))
        if zipfile.is_zipfile(path):
            tokenizer = PairTokenizer.load(path)
        else:
            sp = spm.SentencePieceProcessor()
            try:
                sp.load(str(path))
            except (OSError, RuntimeError) as e:
                raise ValueError(
                    f"{origin} is not a valid sentencepiece model ({e}); delete it to train a "
                    "new one"
                ) from e
            tokenizer = cls(sp, path)
        tokenizer.origin = origin
        return tokenizer


def _until_eos(ids: Iterable[int], skip: tuple[int, ...]) -> list[int]:
    """The ids before the first EOS, without those in ``skip``."""
    out = []
    for i in ids:
        i = int(i)
        if i == EOS_ID:
            break
        if i not in skip:
            out.append(i)
    return out


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
    path = location.path(path)
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
    storage.write_atomic(path, buffer.getvalue())  # never a half-written model
    return Tokenizer.load(path)


def load_or_train(
    workdir,
    sentences_fn,
    vocab_size: int,
    user_symbols: tuple[str, ...] = (),
    given: str | Path = "",
) -> Tokenizer:
    """The workdir's tokenizer: trained from ``sentences_fn()`` the first time, or copied
    from ``given`` (``data.tokenizer``, an existing model) after checking that it fits
    (ids, ``vocab_size``, the tags). A workdir that holds another tokenizer than
    ``given`` is refused: its run learned that vocabulary."""
    path = location.path(workdir) / MODEL_NAME
    if given:
        return _adopt(location.path(given, "data.tokenizer"), path, vocab_size, user_symbols)
    if path.exists():
        tokenizer = Tokenizer.load(path)
        _check_symbols(
            tokenizer, user_symbols, "Use a new workdir (or delete the tokenizer to retrain it)"
        )
        return tokenizer
    return train_tokenizer(sentences_fn(), path, vocab_size, user_symbols=tuple(user_symbols))


def _check_symbols(tokenizer: Tokenizer, symbols: tuple[str, ...], fix: str) -> None:
    for symbol in symbols:
        if tokenizer.piece_to_id(symbol) == tokenizer.unk_id:
            raise ValueError(
                f"{tokenizer.origin} has no piece for the tag {symbol!r}; it was trained "
                f"without it. {fix}"
            )


def _adopt(given, path, vocab_size: int, symbols: tuple[str, ...]) -> Tokenizer:
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
        storage.write_atomic(path, data)  # never a half-written model
    return Tokenizer.load(path)


LANGUAGE_CODE = re.compile(r">>[^<>]+<<")  # a multilingual model's target tag, e.g. >>fra<<


class PairTokenizer(Tokenizer):
    """Marian's tokenizer (OPUS-MT): a source and a target sentencepiece model whose
    pieces index one shared vocabulary, renumbered so that pad is 0 and EOS 1 as in
    every model here (``pieces[i]`` is our id i's piece). Encoding is the source
    side's (a leading ``>>xx<<`` language code is one piece, as MarianTokenizer
    splits it), decoding the target side's; ``side(1)`` encodes targets."""

    def __init__(self, source: bytes, target: bytes, pieces: list[str], unk_id: int,
                 path: Path | None = None, column: int = 0):  # fmt: skip
        self.path, self.pieces, self.unk_id, self.column = path, pieces, unk_id, column
        self.origin = path
        self._models = (source, target)
        self._index = {p: i for i, p in enumerate(pieces)}
        self.sp = _processor(source if column == 0 else target)
        self._sides: dict[int, PairTokenizer] = {column: self}

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def side(self, column: int) -> PairTokenizer:
        column = min(column, 1)
        if column not in self._sides:
            other = PairTokenizer(*self._models, self.pieces, self.unk_id, self.path, column)
            other._sides = self._sides
            other.origin = self.origin
            self._sides[column] = other
        return self._sides[column]

    def ids(self, texts: list[str], alpha: float = 0.0) -> list[list[int]]:
        out = []
        for text in texts:
            code = LANGUAGE_CODE.match(text) if text.startswith(">>") else None
            if code:
                text = text[code.end() :]
            sampling = {"enable_sampling": True, "alpha": alpha, "nbest_size": -1} if alpha else {}
            # pieces as strings: an unknown character is its own text, which the shared
            # vocabulary may hold (from the other side's model), as MarianTokenizer reads it
            found = self.sp.encode(text, out_type=str, **sampling)
            index, unk = self._index, self.unk_id
            out.append([index.get(p, unk) for p in ([code.group(0)] if code else []) + found])
        return out

    def encode(self, text: str, add_eos: bool = True) -> np.ndarray:
        ids = self.ids([text])[0]
        if add_eos:
            ids.append(EOS_ID)
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        """The target side's text of ids up to the first EOS (special pieces skipped)."""
        kept = _until_eos(ids, (PAD_ID, self.unk_id))
        pieces = [self.pieces[i] for i in kept if 0 <= i < len(self.pieces)]
        return "".join(pieces).replace("\u2581", " ").strip()

    def id_to_piece(self, i: int) -> str:
        return self.pieces[int(i)]

    def piece_to_id(self, piece: str) -> int:
        return self._index.get(piece, self.unk_id)

    def to_bytes(self) -> bytes:
        """The archive stored as the workdir's ``tokenizer.model`` (deterministic bytes)."""
        buffer = io.BytesIO()
        meta = {"kind": "marian pair", "unk_id": self.unk_id, "pieces": self.pieces}
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
            for name, data in (
                ("source.spm", self._models[0]),
                ("target.spm", self._models[1]),
                ("pieces.json", json.dumps(meta, ensure_ascii=False).encode()),
            ):
                z.writestr(zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0)), data)
        return buffer.getvalue()

    def source_model(self) -> bytes:
        return self._models[0]

    def target_model(self) -> bytes:
        return self._models[1]

    @classmethod
    def load(cls, path: str | Path) -> PairTokenizer:
        """The archive's three members and nothing else, each read up to
        :data:`MEMBER_LIMIT` bytes whatever its header claims (a zip bomb is refused,
        never expanded)."""
        path = Path(path)
        try:
            with zipfile.ZipFile(path) as z:
                meta = json.loads(_member(z, "pieces.json"))
                source, target = _member(z, "source.spm"), _member(z, "target.spm")
            pieces, unk = meta["pieces"], meta["unk_id"]
            if not (isinstance(pieces, list) and all(isinstance(p, str) for p in pieces)):
                raise ValueError("its pieces are not a list of strings")
            if not isinstance(unk, int) or not 0 <= unk < len(pieces):
                raise ValueError(f"its unknown id {unk!r} is not one of its pieces")
            return cls(source, target, pieces, unk, path)
        except (KeyError, TypeError, ValueError, RuntimeError, zipfile.BadZipFile) as e:
            raise ValueError(f"{path} is not a valid pair tokenizer ({e}); import it again") from e


MEMBER_LIMIT = 64 << 20  # bytes: a sentencepiece model or piece list far past any real one


def _member(archive: zipfile.ZipFile, name: str) -> bytes:
    """One member of a tokenizer archive, read to at most MEMBER_LIMIT bytes."""
    with archive.open(name) as f:
        data = f.read(MEMBER_LIMIT + 1)
    if len(data) > MEMBER_LIMIT:
        raise ValueError(f"its {name} expands past {MEMBER_LIMIT >> 20} MiB")
    return data


def _processor(model: bytes) -> spm.SentencePieceProcessor:
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(model)
    return sp
