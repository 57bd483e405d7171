"""Models named by their Hugging Face repo id (``Qwen/Qwen2.5-7B-Instruct``, optionally
``org/name@revision``), resolved to a snapshot directory of the local Hugging Face cache.

The cache is huggingface_hub's (``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``) and is read through its own API. A snapshot already in the cache
is used as it is, without asking the hub, so a load is reproducible and works offline; only a
model missing there (or missing files of it) is downloaded, and only where ``HF_HUB_OFFLINE``
is unset. Only what loading needs is fetched: the JSON files (config, generation config,
tokenizer files, the weight index), the tokenizer's vocabulary files and the safetensors weights
the index names (or ``model.safetensors``). Pickled weights (``pytorch_model.bin``) are never
fetched nor loaded: unpickling a downloaded file can run code.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from kvrag.errors import ModelLoadError

log = logging.getLogger("kvrag")

#: Files loading needs besides the weights: config.json, generation_config.json, the
#: tokenizer's JSON files, model.safetensors.index.json, and the vocabularies some tokenizers
#: keep outside JSON (SentencePiece, BPE merges, WordPiece, tiktoken) and chat templates.
METADATA_PATTERNS = ("*.json", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt", "*.jinja")

SINGLE_WEIGHTS = "model.safetensors"
WEIGHT_INDEX = "model.safetensors.index.json"
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")

_FIX = (
    "download it on a machine that can reach the Hugging Face Hub (`hf download {id}`, or let kvrag fetch it "
    "with HF_HUB_OFFLINE unset), or point HF_HUB_CACHE (or HF_HOME) at the cache that holds it"
)


@dataclass(frozen=True)
class RepoRef:
    """A Hugging Face model repo id and the revision (branch, tag or commit) to load;
    ``revision=None`` is the repo's default branch (``main``)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def parse_repo_ref(spec: str) -> RepoRef | None:
    """``"org/name"`` or ``"org/name@revision"`` -> a :class:`RepoRef`; ``None`` for anything
    that does not read as a repo id (so the caller reports a missing path instead).

    An owner is required: a bare word is far more often a typo of a registered model name or a
    missing local path than one of the few legacy owner-less repos. A name ending in ``.gguf``
    is a missing GGUF file, not a repo."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo_id, sep, revision = spec.partition("@")
    if repo_id.count("/") != 1 or repo_id.lower().endswith(".gguf") or (sep and not revision.strip()):
        return None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return RepoRef(repo_id, revision or None)


def weight_files(snapshot: Path) -> list[str]:
    """Names of the safetensors files transformers reads from ``snapshot``: the shards the
    weight index names, else ``model.safetensors``.

    The index is data from the cache or the hub: a shard name that is not a plain file name
    is refused (it could point outside the snapshot)."""
    index = snapshot / WEIGHT_INDEX
    if not index.is_file():
        return [SINGLE_WEIGHTS]
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"unreadable weight index {index}: {e}") from None
    bad = [n for n in names if not isinstance(n, str) or not re.fullmatch(r"[\w.\-]+\.safetensors", n)]
    if bad or not names:
        raise ModelLoadError(f"weight index {index} names no usable safetensors shards ({bad[:3] or 'none'})")
    return names


def _snapshot(ref: RepoRef, *, local_only: bool) -> tuple[Path, list[str]]:
    """(snapshot directory, names of the needed files it lacks), from the cache alone or, with
    ``local_only=False``, downloading what is missing. Raises huggingface_hub's errors."""
    from huggingface_hub import snapshot_download

    # Two steps, as transformers loads a sharded model: the index decides which weight files
    # are the model's (a repo may also hold e.g. Mistral's consolidated.safetensors, the same
    # weights again in another layout, which would double the download).
    directory = Path(
        snapshot_download(
            ref.repo_id, revision=ref.revision, allow_patterns=list(METADATA_PATTERNS), local_files_only=local_only
        )
    )
    weights = weight_files(directory)
    if not local_only:
        snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=weights)
    missing = [n for n in ("config.json", *weights) if not (directory / n).is_file()]
    return directory, missing


def _no_safetensors(ref: RepoRef, directory: Path, missing: list[str]) -> ModelLoadError:
    pickles = [n for n in PICKLED_WEIGHTS if (directory / n).is_file()]
    if "config.json" not in missing and pickles:
        return ModelLoadError(
            f"Hugging Face model {str(ref)!r} has only pickled weights ({', '.join(pickles)}), no safetensors: "
            "kvrag never unpickles model files (loading a pickle can run code); use a revision or a copy of the "
            "model with safetensors weights (save_pretrained(DIR, safe_serialization=True) writes them)"
        )
    return ModelLoadError(
        f"Hugging Face model {str(ref)!r} lacks {', '.join(missing)} in {directory}: kvrag loads a repo's "
        f"config.json and its safetensors weights ({SINGLE_WEIGHTS} or the shards {WEIGHT_INDEX} names), "
        "never pickled pytorch_model.bin"
    )


def resolve_repo(ref: RepoRef) -> tuple[Path, str]:
    """The snapshot directory of ``ref`` in the Hugging Face cache, downloading it if it is not
    cached and ``HF_HUB_OFFLINE`` is unset, and the commit it is (the snapshot's name).

    Raises :class:`ModelLoadError` naming the id when it is neither cached nor reachable (with
    how to fix it), when the hub does not know it, and for a repo without safetensors weights."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    fix = _FIX.format(id=ref.repo_id)
    # Read at call time, not import time: huggingface_hub reads its environment once, at import,
    # into these module attributes, which are what its download functions then consult.
    offline = constants.HF_HUB_OFFLINE
    cache = constants.HF_HUB_CACHE
    try:
        directory, missing = _snapshot(ref, local_only=True)
    except LocalEntryNotFoundError:
        directory, missing = None, ["the snapshot"]
    if directory is not None and not missing:
        return directory, directory.name
    if offline:
        if directory is not None and any((directory / n).is_file() for n in PICKLED_WEIGHTS):
            raise _no_safetensors(ref, directory, missing)
        what = "is not in" if directory is None else f"is incomplete in ({', '.join(missing)} missing)"
        raise ModelLoadError(
            f"Hugging Face model {str(ref)!r} {what} the Hugging Face cache {cache}, and HF_HUB_OFFLINE is set so "
            f"kvrag may not download it: {fix}"
        )
    log.info("downloading %s from the Hugging Face Hub into %s", ref, cache)
    try:
        directory, missing = _snapshot(ref, local_only=False)
    except GatedRepoError as e:
        raise ModelLoadError(
            f"Hugging Face model {str(ref)!r} is gated: accept its terms on the Hub and log in (`hf auth login`) "
            f"or set HF_TOKEN; {e}"
        ) from None
    except RepositoryNotFoundError:
        raise ModelLoadError(
            f"no Hugging Face model {ref.repo_id!r} on the Hub (or it is private: log in with `hf auth login` "
            "or set HF_TOKEN); a local model directory or .gguf file of that name does not exist either"
        ) from None
    except RevisionNotFoundError:
        raise ModelLoadError(
            f"Hugging Face model {ref.repo_id!r} has no revision {ref.revision!r} (a branch, tag or commit)"
        ) from None
    except LocalEntryNotFoundError as e:  # the hub is unreachable and the cache lacks it
        raise ModelLoadError(
            f"Hugging Face model {str(ref)!r} is not in the Hugging Face cache {cache} and the Hub could not be "
            f"reached ({e}): {fix}"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        raise ModelLoadError(f"could not download Hugging Face model {str(ref)!r} into {cache}: {e}") from None
    if missing:
        raise _no_safetensors(ref, directory, missing)
    return directory, directory.name
