"""Training: ``train_and_evaluate(config, workdir)`` and its parts.

The loop (``train``) and its periodic actions (``loop``: clock, throughput, stopping),
the pure steps (``steps``), train state and optimizer (``state``, ``schedules``,
``losses``), jit over a device mesh or pmap (``parallel``), several processes
(``distributed``), preemption, logging and FLOP counts. May import every layer below
(``inference/`` for validation BLEU); only ``sweep/`` and ``main`` import it.
"""
