"""Options several sub-commands share, spelled and meaning the same everywhere.

``--cache-dir`` is always a KV store directory (what ``KVRag(cache_dir=...)`` takes); the kvrag
home (model conversions, codebooks, KVLink models: ``$KVRAG_HOME``) is ``--home``.
"""

from __future__ import annotations

import argparse

#: ``--model``'s help on every command that loads a model (the names are ``kvrag.model.MODEL_NAMES``,
#: written out: importing ``kvrag.model`` imports torch, and building the parser must not).
MODEL_HELP = (
    "HF model dir, .gguf, a model name (smollm2, gemma3-270m) or a Hugging Face repo id org/name[@revision], "
    "read from the HF cache or downloaded unless HF_HUB_OFFLINE=1 (default: SmolLM2-135M-Instruct)"
)


class _StoreIsNotHome(argparse.Action):
    """``--cache-dir`` on a command that needs the kvrag home: refused, because a store directory
    passed by habit would silently become a second home."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(
            "--cache-dir names a KV store directory (as KVRag(cache_dir=...)); this command "
            "reads the kvrag home (model conversions): pass --home DIR (default $KVRAG_HOME)"
        )


#: ``--home``'s help, wherever it is an option.
HOME_HELP = (
    "kvrag home: converted models, codebooks (default $KVRAG_HOME, else the user cache directory, ~/.cache/kvrag "
    "on Linux)"
)


def add_home_option(p: argparse.ArgumentParser) -> None:
    """``--home``, and ``--cache-dir`` refused (see ``_StoreIsNotHome``): for a command that
    reads the kvrag home and no store. One that reads both adds ``--home`` with ``HOME_HELP``."""
    p.add_argument("--home", metavar="DIR", default=None, help=HOME_HELP)
    p.add_argument("--cache-dir", action=_StoreIsNotHome, help=argparse.SUPPRESS)
