"""kvrag's exception hierarchy.

Every error that is the *user's* problem (a bad path, an empty chunk, a broken cache
directory) is a :class:`KVRagError`, so callers (and the ``kvrag`` command, which prints
``kvrag: error: <message>`` and exits 2) can tell it apart from a bug in kvrag itself.
"""

from __future__ import annotations


class KVRagError(Exception):
    """Base class of the errors kvrag raises on bad input or a bad environment."""


class ModelLoadError(KVRagError):
    """A model or tokenizer could not be found, converted or loaded."""


class ChunkError(KVRagError):
    """A chunk cannot be cached: it is empty, or longer than the model's context."""


class StoreError(KVRagError):
    """The KV store's directory is unusable (unwritable, wrong format version, ...)."""
