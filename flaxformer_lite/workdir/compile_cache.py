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
lock on and evicts nothing. jax's eviction check reads every entry's size and access
time on each write (under the lock), whatever the limit: over a session of thousands
of entries (the test suite's folder) that scan, not compiling, became the cost, so
:func:`skip_scans_past_reach` skips it where the limit is one no cache reaches.
"""

from __future__ import annotations

import os

from flaxformer_lite.workdir import location

LIMIT = 2 << 30  # bytes: the oldest entries go past it
LOCK_ONLY = 1 << 50  # bytes: a limit no cache reaches (the lock without eviction)


def skip_scans_past_reach() -> None:
    """jax's eviction check returns at once for a cache whose limit is
    :data:`LOCK_ONLY` or more (nothing to evict; the lock stays). Where jax's cache
    class has no such method, nothing changes (the scan stays: slower, still right)."""
    try:
        from jax._src import lru_cache
    except ImportError:  # pragma: no cover - another jax layout
        return
    evict = getattr(lru_cache.LRUCache, "_evict_if_needed", None)
    if evict is None or getattr(evict, "skips_past_reach", False):
        return

    def _evict_if_needed(self, *args, **kwargs):
        if getattr(self, "max_size", 0) >= LOCK_ONLY:
            return None
        return evict(self, *args, **kwargs)

    _evict_if_needed.skips_past_reach = True
    lru_cache.LRUCache._evict_if_needed = _evict_if_needed


def keep_compiled_programs(folder: str) -> None:
    """XLA's compiled programs go to ``folder`` (``--compilation_cache``; '' = off; a
    ``gs://`` folder too), unless a folder is configured already
    (``JAX_COMPILATION_CACHE_DIR``); either way processes sharing it read no torn entry
    (see the module's docstring).

    Without ``filelock`` (a dependency) the cache is unbounded, whatever limit was set:
    with a limit and no filelock, jax reads and writes no entry at all."""
    import jax

    chosen = jax.config.jax_compilation_cache_dir or folder
    if chosen and location.is_remote(chosen):
        # a bucket (gs://): jax reads and writes it through etils.epath; its size limit
        # would lock a local file named after the URL, so none is set (the bucket's
        # lifecycle rules prune it)
        location.check(chosen, "--compilation_cache")
        jax.config.update("jax_compilation_cache_dir", str(location.path(chosen)))
        jax.config.update("jax_compilation_cache_max_size", -1)
        return
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
    skip_scans_past_reach()
