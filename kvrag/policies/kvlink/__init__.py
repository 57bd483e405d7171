"""KVLink: link tokens after each cached document, and a model fine-tuned to read them.

``policy`` is the reuse policy (registered as ``"kvlink"``), ``adapter`` finds, loads and
applies trained adapters, ``train`` trains one (``kvrag train kvlink``; imported on demand:
it needs peft) from ``samples`` (``data``: their sources), through ``forward`` and ``loss``,
with ``config``, ``checkpoints`` and ``warm_start``."""

from kvrag.policies.kvlink.policy import KVLink

__all__ = ["KVLink"]
