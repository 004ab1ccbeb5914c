"""``Translator``: a trained workdir as a Python API (the line-filter commands built
on it are in :mod:`flaxformer_lite.inference.streaming`).

  from flaxformer_lite.inference.translate import Translator
  t = Translator.from_workdir("runs/ende_small")
  t.translate(["Where is the station?"], beam_size=4, alpha=0.6)

  python -m flaxformer_lite.main translate --workdir=runs/ende_small "Where is the station?"
  python -m flaxformer_lite.main translate --workdir=runs/ende_small < sentences.txt

Loads the run's config, tokenizer and parameters (averaged if present, else
the best validation checkpoint, else the last; of a run with a parameter EMA,
the moving average, as its evaluations used). Sentences are batched,
decoded with beam search (default: the paper's beam 4, alpha 0.6, at most
source length + 50 tokens), and returned in input order.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections import Counter
from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.config.experiment import DecodeConfig
from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.data.tokenizer import MODEL_NAME, Tokenizer
from flaxformer_lite.inference import batching, decoding
from flaxformer_lite.inference.ahead import Ahead, Call, default_streams
from flaxformer_lite.inference.continuous import beam_continuous, greedy_continuous
from flaxformer_lite.inference.generate import generate
from flaxformer_lite.inference.inputs import LONG_INPUTS, TranslateError, one_line
from flaxformer_lite.inference.run import Run
from flaxformer_lite.model.lm import LanguageModel
from flaxformer_lite.workdir import checkpoints as ckpt_lib
from flaxformer_lite.workdir import location

__all__ = ["LONG_INPUTS", "TranslateError", "Translator", "one_line"]


def _without_training_only(c: ModelConfig) -> ModelConfig:
    """The config with the fields that only act in training (dropout) zeroed."""
    return c.replace(
        embedding_dropout=0.0,
        residual_dropout=0.0,
        attention_dropout=0.0,
        ffn_dropout=0.0,
        source_token_dropout=0.0,
        target_token_dropout=0.0,
        dropout_bits=8,
    )


def _padded(x: np.ndarray, rows: np.ndarray, m: int):
    """``x[rows]`` as int32, then zero rows up to ``m`` (a queue's padding)."""
    out = np.zeros((m, *x.shape[1:]), np.int32)
    out[: len(rows)] = x[rows]
    return jnp.asarray(out)


class Translator:
    """Translates (encoder-decoder runs) or continues text (language-model runs)
    with a model's parameters and its tokenizer.

    Build one from a trained run with :meth:`from_workdir`, or from a model, its
    parameters (a tuple of parameter trees decodes with their ensemble) and a
    :class:`~flaxformer_lite.data.tokenizer.Tokenizer`. Inputs are batched
    sorted by length, ``decode.batch_tokens`` source tokens a batch (or, given
    ``batch_size``, that many sentences), and returned in input order;
    ``too_long`` says what happens to an input longer than ``model.max_len``
    (``truncate`` with a warning, or ``refuse``). ``decode`` holds the decoding
    options that :meth:`translate` uses when not given (a run's ``decode`` section;
    default: the paper's beam 4, alpha 0.6, at most source length + 50 pieces).
    """

    def __init__(
        self,
        model: nn.Module,
        params,
        tokenizer: Tokenizer,
        *,
        batch_size: int | None = None,
        too_long: str = "truncate",
        decode: DecodeConfig | None = None,
    ):
        if too_long not in LONG_INPUTS:
            raise TranslateError(f"too_long={too_long!r}; choose one of {', '.join(LONG_INPUTS)}")
        self.model, self.params, self.tokenizer = model, params, tokenizer
        self.config: ModelConfig = model.config
        self.batch_size, self.too_long = batch_size, too_long
        self.decode = decode or DecodeConfig()
        self.checkpoint = ""  # which checkpoint(s) the parameters came from, for reports
        self.run: Run | None = None  # the run it was loaded from, if any

    @classmethod
    def from_workdir(
        cls,
        workdir: str | location.Path,
        kind: str | None = None,
        ensemble: Sequence[str] = (),
        **kwargs,
    ) -> Translator:
        """``kind``: averaged | best | last (default: the first of these that exists).
        ``ensemble``: more models to decode with, averaging next-token probabilities:
        ``"WORKDIR"`` (its averaged/best/last checkpoint), ``"WORKDIR@STEP"`` or
        ``"@STEP"`` (a kept checkpoint of this or that run, e.g. two seeds or the
        last checkpoints of one run). Members must share the model config and tokenizer."""
        run = Run.open(workdir)
        params, kind, step = run.newest_params(kind)
        kwargs.setdefault("decode", run.config.decode)
        translator = cls(run.model(), params, run.tokenizer, **kwargs)
        translator.checkpoint = f"{kind} checkpoint, step {step}"
        translator.run = run
        if ensemble:
            translator._add_members(run, ensemble)
        return translator

    @property
    def run_config(self):
        """The experiment config of the run the translator was loaded from (or None)."""
        return None if self.run is None else self.run.config

    def _add_members(self, run: Run, specs: Sequence[str]) -> None:
        """Decode with the mean probability of this model and the ``specs``' models."""
        members, names = [self.params], []
        for spec in specs:
            path, _, step_text = spec.rpartition("@")
            if not step_text.isdigit():
                path, step_text = spec, ""
            member_dir = location.path(path, "--ensemble") if path else run.workdir
            try:
                member = Run.open(member_dir)
            except ckpt_lib.CheckpointError:
                raise ckpt_lib.CheckpointError(
                    f"ensemble member {spec!r}: {member_dir} is not a training run "
                    f"(no {ckpt_lib.CONFIG_FILE}); give WORKDIR, WORKDIR@STEP or @STEP"
                ) from None
            if _without_training_only(member.model_config) != _without_training_only(self.config):
                raise ckpt_lib.CheckpointError(
                    f"ensemble member {spec!r} has another model config than {run.workdir}; "
                    "members must share the model and the tokenizer (dropout may differ)"
                )
            tokenizer = member_dir / MODEL_NAME
            if (
                not tokenizer.is_file()
                or tokenizer.read_bytes() != (run.workdir / MODEL_NAME).read_bytes()
            ):
                raise ckpt_lib.CheckpointError(
                    f"ensemble member {spec!r} has another tokenizer than {run.workdir}; "
                    "members must share the model and the tokenizer"
                )
            if step_text:
                params, step = member.params("last", int(step_text))
                names.append(f"{member_dir}@{step}")
            else:
                params, kind, step = member.newest_params()
                names.append(f"{member_dir} ({kind}, step {step})")
            members.append(params)
        self.params = tuple(members)
        self.checkpoint += f"; ensemble of {len(members)} with " + ", ".join(names)

    # Encoding ---------------------------------------------------------------------------
    def _encode(self, sentences: Sequence[str], report: Counter | None) -> list[np.ndarray]:
        limit = self.config.max_len
        out, too_long = [], []
        for i, s in enumerate(sentences):
            if not isinstance(s, str):
                raise TranslateError(f"sentence {i} is {type(s).__name__}, not a string")
            ids = self.tokenizer.encode(one_line(s).strip())
            if len(ids) > limit:
                if self.too_long == "refuse":
                    raise TranslateError(
                        f"sentence {i} has {len(ids)} tokens, more than model.max_len={limit}; "
                        "shorten it or use too_long='truncate'"
                    )
                too_long.append((i, len(ids)))
                ids = np.append(ids[: limit - 1], self.config.eos_id).astype(np.int32)
            out.append(ids)
        if too_long and report is not None:
            report["truncated"] += len(too_long)
        elif too_long:
            i, n = too_long[0]
            warnings.warn(
                f"{len(too_long)} of {len(sentences)} sentences have more than "
                f"model.max_len={limit} pieces (the first: sentence {i}, {n} pieces); each is "
                f"translated from its first {limit - 1}",
                stacklevel=3,
            )
        return out

    # Translating --------------------------------------------------------------------------
    def translate(
        self,
        sentences: Sequence[str],
        beam_size: int | None = None,
        alpha: float | None = None,
        max_length: int | None = None,
        no_repeat_ngram: int | None = None,
        min_length_ratio: float | None = None,
        max_length_ratio: float | None = None,
        report: Counter | None = None,
    ) -> list[str]:
        """Translations of ``sentences``, one per sentence, in order (empty or blank
        sentences give ''; line breaks and other control characters inside a sentence
        count as spaces; one longer than ``model.max_len`` pieces is translated from its
        first pieces, see ``too_long``). With ``report`` (a Counter) the blank and
        truncated sentences are counted there instead of warned about.

        An option left at None takes its value from ``self.decode``.

        ``no_repeat_ngram`` = n > 0: no output repeats n tokens (beam search, also
        with ``beam_size=1``, which then equals greedy decoding under that rule).
        ``min_length_ratio`` = r > 0: an output has at least ``floor(r * n)`` pieces
        for a source of ``n`` pieces; ``max_length_ratio`` = r > 0: at most
        ``ceil(r * n) + 5`` (beam search; 0 = off). A weak model's beam prefers short
        outputs, which BLEU's brevity penalty charges for; and a large ``alpha``
        alone lets some outputs run on to ``max_length``.
        """
        if isinstance(sentences, str):
            raise TranslateError("translate() takes a list of sentences, not one string")
        if isinstance(self.model, LanguageModel):
            raise TranslateError("this workdir holds a language model; use generate()")
        given = dict(
            beam_size=beam_size, alpha=alpha, no_repeat_ngram=no_repeat_ngram,
            min_length_ratio=min_length_ratio, max_length_ratio=max_length_ratio,
        )  # fmt: skip
        # The run's decode section with the options given: checked as the config is.
        d = self.decode.replace(**{k: v for k, v in given.items() if v is not None})
        results = [""] * len(sentences)
        todo = [i for i, s in enumerate(sentences) if isinstance(s, str) and one_line(s).strip()]
        if len(todo) < len(sentences):
            bad = [i for i, s in enumerate(sentences) if not isinstance(s, str)]
            if bad:
                raise TranslateError(f"sentence {bad[0]} is not a string")
            blank = [i for i, s in enumerate(sentences) if not one_line(s).strip()]
            if report is not None:
                report["empty"] += len(blank)
            else:
                warnings.warn(
                    f"{len(blank)} of {len(sentences)} sentences are empty or blank (the "
                    f"first is sentence {blank[0]}); each translates to '' so the outputs "
                    "stay in line",
                    stacklevel=2,
                )
        encoded = self._encode([sentences[i] for i in todo], report)
        c = self.config
        groups = []
        for idx, rows, longest in batching.batches(
            encoded, c.max_len, d.batch_tokens, self.batch_size
        ):
            limit = batching.output_limit(longest, d, c.max_len, max_length)
            size = batching.output_limit(rows.shape[1], d, c.max_len, max_length)
            lengths = [len(encoded[i]) - 1 for i in idx]
            groups.append((idx, rows, limit, size, lengths))
        streams = d.streams or default_streams(self.params)
        plain = not (d.no_repeat_ngram or d.min_length_ratio or d.max_length_ratio)
        if (plain or d.beam_size > 1) and d.continuous and not c.sparse_attention:
            batches, calls = self._queues(groups, d, bool(max_length), streams)
        else:
            batches = [g[0] for g in groups]
            calls = [self._search(r, n, lim, w, d, bool(max_length)) for _, r, lim, w, n in groups]
        # The wider batches' searches compile meanwhile; on CPU two batches run at once.
        with Ahead(calls, streams) as ahead:
            for idx, ids in zip(batches, ahead.results(), strict=True):
                ids = ids[0][:, 0] if isinstance(ids, tuple) else ids  # beams: the best
                for r, tokens in zip(idx, decoding.strip(ids, c.eos_id), strict=False):
                    results[todo[r]] = self.tokenizer.decode(tokens)
        return results

    def _queues(self, groups, d, given_limit: bool, streams: int):
        """Greedy decoding or beam search by continuous batching (:mod:`~flaxformer_lite.
        inference.continuous`): each source width's sentences dealt to ``streams`` queues
        in turn, each queue one search with a batch's rows as its slots. A queue is padded
        to ``slots * 2^j`` rows (one program serves test sets of similar sizes); each
        sentence's limit is :meth:`_search`'s (a beam's: its batch's), so the outputs are
        the same."""
        c, out, calls = self.config, [], []
        search, beams = greedy_continuous, {}
        if d.beam_size > 1:
            search = beam_continuous
            beams = dict(beam_size=d.beam_size, alpha=float(d.alpha), stop=d.beam_stop,
                         no_repeat_ngram=d.no_repeat_ngram)  # fmt: skip
        for _, same in itertools.groupby(groups, key=lambda g: g[1].shape[1]):
            same = list(same)
            idx = [i for g in same for i in g[0]]
            rows = np.concatenate([g[1][: len(g[0])] for g in same])
            n = np.asarray([x for g in same for x in g[4]])
            top = max(g[2] for g in same)
            own = np.full(len(n), top) if given_limit else np.minimum(n + 1 + d.max_extra, top)
            size, bounds = decoding.bucket(max(top, same[0][3]), c.max_len), {}
            if d.beam_size > 1:  # as _search's; the outputs that outgrow it: searched again
                own = np.asarray([g[2] for g in same for _ in g[0]])
                bounds = batching.length_bounds(d, n, own, np.ones(len(n), bool))
                extra = 16 * (d.beam_stop == "exact")
                beams["first_length"] = decoding.bucket(rows.shape[1] + extra, size)
            for part in range(min(streams, len(idx))):
                mine = np.arange(part, len(idx), streams)
                # a batch's rows, or fewer for a short queue (every slot runs every step)
                slots = min(same[0][1].shape[0], 2 ** math.ceil(math.log2(len(mine))))
                m = slots * 2 ** math.ceil(math.log2(math.ceil(len(mine) / slots)))
                out.append([idx[r] for r in mine])
                arrays = {"limit": own, **bounds}
                calls.append(Call(
                    search, self.model, self.params, _padded(rows, mine, m),
                    max_length=size, eos_id=c.eos_id, bos_id=c.bos_id, slots=slots,
                    count=jnp.int32(len(mine)), **beams,
                    **{name: _padded(x, mine, m) for name, x in arrays.items()},
                ))  # fmt: skip
        return out, calls

    def _search(
        self, rows: np.ndarray, lengths: list[int], limit: int, widest: int, d,
        given_limit: bool = False,
    ) -> Call:  # fmt: skip
        """The search of a batch of source ``rows`` (``lengths``: the real rows' source
        pieces, EOS excluded) under ``d``: at most ``limit`` tokens (traced), compiled
        for the bucket of ``widest`` (the widest batch of this width's limit): one
        search per width. Greedy gives ``[b, t]`` ids, beam (``[b, k, t]``, scores)."""
        c = self.config
        real = np.arange(len(rows)) < len(lengths)  # the others pad the batch
        n = np.asarray(lengths + [0] * (len(rows) - len(lengths)))
        size = decoding.bucket(max(limit, widest), c.max_len)
        # Beam outputs are about as long as their source: the cache starts that long
        # (stepping.first_cache_length), 16 more where the exact rule steps longer.
        first = decoding.bucket(rows.shape[1] + 16 * (d.beam_stop == "exact"), size)
        traced = jnp.asarray(limit, jnp.int32)
        plain = not (d.no_repeat_ngram or d.min_length_ratio or d.max_length_ratio)
        if d.beam_size == 1 and plain:  # each row its own limit: batch-mates change nothing
            own = np.full(len(n), limit) if given_limit else np.minimum(n + 1 + d.max_extra, limit)
            own = jnp.asarray(np.where(real, own, 0), jnp.int32)
            return Call(
                decoding.sample, self.model, self.params, jnp.asarray(rows), max_length=size,
                eos_id=c.eos_id, bos_id=c.bos_id, limit=own,
            )  # fmt: skip
        bounds = {k: jnp.asarray(v) for k, v in batching.length_bounds(d, n, limit, real).items()}
        return Call(
            decoding.beam_search, self.model, self.params, jnp.asarray(rows),
            beam_size=d.beam_size, alpha=float(d.alpha), max_length=size, eos_id=c.eos_id,
            bos_id=c.bos_id, no_repeat_ngram=d.no_repeat_ngram, limit=traced,
            stop=d.beam_stop, first_length=first, **bounds,
        )  # fmt: skip

    # Generating (decoder-only LM): the run's model continues prompts; see
    # flaxformer_lite.inference.generate (the function takes the Translator as its run).
    generate = generate
