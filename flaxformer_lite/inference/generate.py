"""Generating with a decoder-only language model run: prompts forced after BOS, then
sampling (temperature, top-k, nucleus) or greedy decoding until EOS, in bucketed
batches whose programs are kept like the translator's (``inference/programs.py``).

``Translator.generate`` (a run opened for reading) calls :func:`generate`; the line
filter ``python -m flaxformer_lite.main generate`` is built on it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.inference import decoding
from flaxformer_lite.inference.ahead import Call
from flaxformer_lite.inference.inputs import TranslateError, one_line
from flaxformer_lite.model.lm import LanguageModel


def generate(
    run,
    prompts: Sequence[str],
    max_new_tokens: int | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    first_index: int = 0,
) -> list[str]:
    """Continuations of ``prompts`` by a language-model run (one text per prompt).

    Each prompt's pieces are forced after BOS, then up to ``max_new_tokens``
    (default: 50, or ``model.max_len - 1`` if smaller) pieces are sampled until
    EOS (the LM's end of a training line).
    ``temperature=0`` is greedy; ``top_k`` > 0 and ``top_p`` < 1 filter the
    distribution first. The same ``seed`` gives the same texts (``first_index``:
    the first prompt's index in a longer stream cut into calls, whose texts are
    then those of one call when the cuts fall on whole batches). An empty prompt
    samples from scratch. A prompt too long for ``model.max_len`` keeps its
    last pieces (with a warning) or is refused (``too_long='refuse'``).
    """
    if not isinstance(run.model, LanguageModel):
        raise TranslateError("this workdir holds a translation model; use translate()")
    if isinstance(prompts, str):
        raise TranslateError("generate() takes a list of prompts, not one string")
    limit = run.config.max_len
    if max_new_tokens is None:
        max_new_tokens = min(50, limit - 1)
    if not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens < limit:
        raise TranslateError(
            f"max_new_tokens={max_new_tokens!r} must be an integer in [1, {limit - 1}] "
            f"(model.max_len={limit} holds the prompt and the continuation)"
        )
    if not (isinstance(temperature, int | float) and temperature >= 0):
        raise TranslateError(f"temperature={temperature!r} must be >= 0 (0 = greedy)")
    if not isinstance(top_k, int) or top_k < 0:
        raise TranslateError(f"top_k={top_k!r} must be an integer >= 0 (0 = off)")
    if not (isinstance(top_p, int | float) and 0 < top_p <= 1):
        raise TranslateError(f"top_p={top_p!r} must be in (0, 1] (1 = off)")
    room = limit - max_new_tokens
    forced = []
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise TranslateError(f"prompt {i} is {type(p).__name__}, not a string")
        p = one_line(p).strip()
        ids = run.tokenizer.encode(p, add_eos=False) if p else []
        if len(ids) > room:
            if run.too_long == "refuse":
                raise TranslateError(
                    f"prompt {i} has {len(ids)} pieces; with max_new_tokens={max_new_tokens} "
                    f"at most {room} fit model.max_len={limit}: shorten it, lower "
                    "max_new_tokens or use too_long='truncate'"
                )
            warnings.warn(f"prompt {i} has {len(ids)} pieces; kept its last {room}", stacklevel=2)
            ids = ids[len(ids) - room :]
        forced.append(np.asarray(ids, np.int32))
    c = run.config
    results = []
    size = run.batch_size or 32  # prompts a batch
    for start in range(0, len(forced), size):
        chunk = forced[start : start + size]
        longest = max((len(f) for f in chunk), default=0)
        # Bucketed lengths limit recompiles, like the translation batches.
        length = min(2 ** math.ceil(math.log2(max(longest + max_new_tokens, 8))), limit)
        prefix = np.zeros((size, length), np.int32)  # 0 = not forced
        for r, f in enumerate(chunk):
            prefix[r, : len(f)] = f
        # kept as a program (inference/programs.py): a later process loads it untraced
        call = Call(
            decoding.sample, run.model, run.params, None, max_length=length,
            eos_id=c.eos_id, bos_id=c.bos_id,
            rng=jax.random.fold_in(jax.random.key(seed), first_index + start),
            temperature=float(temperature), top_k=top_k, top_p=float(top_p),
            prefix=jnp.asarray(prefix),
        )  # fmt: skip
        ids = call(call.compile())
        for r, f in enumerate(chunk):
            row = np.asarray(ids[r]).tolist()
            results.append(run.tokenizer.decode(row[len(f) : len(f) + max_new_tokens]))
    return results
