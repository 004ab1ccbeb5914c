"""The run folder on disk: its layout and format in one place.

``config.json``, the orbax checkpoints (last, best, averaged) with their data
position, the training lock. May import ``config/`` (to read a saved config back);
nothing here builds a model or trains.
"""
