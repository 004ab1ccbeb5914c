"""Sparse attention: patterns as data, a blocked kernel, receptive fields, pictures.

See :mod:`flaxformer_lite.components.sparse` for the interface the model uses.
"""
