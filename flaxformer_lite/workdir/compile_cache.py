"""XLA's persistent compilation cache: the folder every command compiles into, shared
safely by the processes that use it at once.

A test set's searches took ~2.5 s each to compile on 2 CPU cores, a third of a cold
evaluation: with the cache, the next process (``translate``, ``evaluate``, a sweep's
later points) loads them. Entries are keyed on the program, the jax version and the
flags, so an entry is only ever the same program.

Several processes write one folder at once: a sweep's ``--parallel`` runs, the test
suite's workers and the command lines they start. jax writes an entry in place, and
locks the folder only when it may evict entries (a size limit set, and ``filelock``
installed); without the lock a process can read another's half-written entry ("Error
reading persistent compilation cache entry ... truncated stream") and compile again.
:func:`keep_compiled_programs` therefore always sets a limit where ``filelock``
imports: 2 GiB for the folder it chooses, and for a folder the user chose
(``JAX_COMPILATION_CACHE_DIR``) without a limit, one no cache reaches, which turns the
lock on and evicts nothing.
"""

from __future__ import annotations

import os

LIMIT = 2 << 30  # bytes: the oldest entries go past it
LOCK_ONLY = 1 << 50  # bytes: a limit no cache reaches (the lock without eviction)


def keep_compiled_programs(folder: str) -> None:
    """XLA's compiled programs go to ``folder`` (``--compilation_cache``; '' = off),
    unless a folder is configured already (``JAX_COMPILATION_CACHE_DIR``); either way
    processes sharing it read no torn entry (see the module's docstring).

    Without ``filelock`` (a dependency) the cache is unbounded, whatever limit was set:
    with a limit and no filelock, jax reads and writes no entry at all."""
    import jax

    if jax.config.jax_compilation_cache_dir:  # the user's folder: their limit, if any
        limit = LOCK_ONLY if jax.config.jax_compilation_cache_max_size == -1 else None
    elif folder:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(folder))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        limit = LIMIT
    else:
        return
    try:
        import filelock  # noqa: F401
    except ImportError:
        jax.config.update("jax_compilation_cache_max_size", -1)
        return
    if limit is not None:
        jax.config.update("jax_compilation_cache_max_size", limit)
