"""Models named by a Hugging Face repo id, resolved from a Hugging Face cache laid out in a
temporary directory exactly as huggingface_hub writes one (``models--org--name/{blobs,
snapshots/<commit>,refs}``, snapshot files as relative symlinks to content-named blobs)."""

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest

from kvrag.cli import main
from kvrag.engine import KVRag
from kvrag.errors import ModelLoadError
from kvrag.model import ModelHandle
from kvrag.model.hub import RepoRef, parse_repo_ref, weight_files

REPO = "tiny-org/tiny-llama"
COMMIT_A = "a" * 40
COMMIT_B = "0123456789abcdef0123456789abcdef01234567"


def lay_out_repo(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], refs=("main",)) -> Path:
    """Write ``files`` as one snapshot of ``repo_id`` into the HF cache ``cache``; return the
    snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)  # huggingface_hub writes refs without a newline
    return snapshot


def dir_files(directory) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in Path(directory).iterdir() if f.is_file()}


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty HF cache that huggingface_hub uses, offline. huggingface_hub copies its
    environment into ``constants`` at import, and its functions read those attributes, so both
    are set."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    """A second tiny model (other weights) saved as an HF directory."""
    from kvrag.testing import tiny_llama

    handle = tiny_llama(seed=1)
    d = tmp_path_factory.mktemp("tiny-model-b")
    handle.model.save_pretrained(d)
    handle.tokenizer.save_pretrained(d)
    return str(d)


def test_parse_repo_ref():
    assert parse_repo_ref("Qwen/Qwen2.5-7B-Instruct") == RepoRef("Qwen/Qwen2.5-7B-Instruct")
    assert parse_repo_ref("org/name@v1.0") == RepoRef("org/name", "v1.0")
    assert parse_repo_ref("org/name@refs/pr/3") == RepoRef("org/name", "refs/pr/3")
    assert str(parse_repo_ref(f"org/name@{COMMIT_B}")) == f"org/name@{COMMIT_B}"
    # Not repo ids: bare words (a registered name or a typo of one), paths, a missing .gguf.
    for spec in ("smollm2", "gpt2", "/abs/dir", "./org/name", "a/b/c", "models/x.gguf", "org/name@", "org/na me"):
        assert parse_repo_ref(spec) is None, spec


def test_repo_id_loads_the_cached_snapshot(hf_cache, model_dir, tmp_path):
    snapshot = lay_out_repo(hf_cache, REPO, COMMIT_A, dir_files(model_dir))
    by_id = KVRag(model=REPO, cache_dir=tmp_path / "kv-id")
    by_dir = KVRag(model=str(snapshot), cache_dir=tmp_path / "kv-dir")

    assert by_id.handle.source == f"{REPO}@{COMMIT_A}"
    assert by_id.handle.load_info["weights_dir"] == str(snapshot)
    prompt = "The capital of France is"
    a = by_id.generate(prompt, max_new_tokens=8)
    b = by_dir.generate(prompt, max_new_tokens=8)
    assert len(a.token_ids) == 8 and a.token_ids == b.token_ids
    # The weights are digested by file name and content, as a directory's: the same model in
    # the hub cache and outside it has one fingerprint (and so shares stored chunk caches).
    assert by_id.handle.fingerprint == by_dir.handle.fingerprint == ModelHandle.load(model_dir).fingerprint


def test_fingerprint_does_not_depend_on_the_cache_location(hf_cache, model_dir, tmp_path, monkeypatch):
    lay_out_repo(hf_cache, REPO, COMMIT_A, dir_files(model_dir))
    first = ModelHandle.load(REPO, cache_dir=tmp_path / "home")
    elsewhere = tmp_path / "another" / "cache"
    lay_out_repo(elsewhere, REPO, COMMIT_A, dir_files(model_dir))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(elsewhere))
    second = ModelHandle.load(REPO, cache_dir=tmp_path / "home")
    assert second.load_info["weights_dir"].startswith(str(elsewhere))
    assert first.fingerprint == second.fingerprint


def test_revision_after_at_sign(hf_cache, model_dir, other_model_dir, tmp_path):
    lay_out_repo(hf_cache, REPO, COMMIT_A, dir_files(model_dir), refs=("main",))
    lay_out_repo(hf_cache, REPO, COMMIT_B, dir_files(other_model_dir), refs=("v2",))
    home = tmp_path / "home"
    main_fp = ModelHandle.load(model_dir, cache_dir=home).fingerprint
    other_fp = ModelHandle.load(other_model_dir, cache_dir=home).fingerprint
    assert main_fp != other_fp

    default = ModelHandle.load(REPO, cache_dir=home)
    tag = ModelHandle.load(f"{REPO}@v2", cache_dir=home)
    commit = ModelHandle.load(f"{REPO}@{COMMIT_B}", cache_dir=home)
    assert (default.fingerprint, default.source) == (main_fp, f"{REPO}@{COMMIT_A}")
    assert (tag.fingerprint, tag.source) == (other_fp, f"{REPO}@{COMMIT_B}")
    assert (commit.fingerprint, commit.source) == (other_fp, f"{REPO}@{COMMIT_B}")

    with pytest.raises(ModelLoadError, match=rf"'{REPO}@v9' is not in the Hugging Face cache"):
        ModelHandle.load(f"{REPO}@v9", cache_dir=home)


def test_uncached_id_offline_is_a_clear_error(hf_cache, tmp_path):
    with pytest.raises(ModelLoadError) as e:
        ModelHandle.load("Qwen/Qwen2.5-7B-Instruct", cache_dir=tmp_path / "home")
    msg = str(e.value)
    assert "'Qwen/Qwen2.5-7B-Instruct' is not in the Hugging Face cache" in msg
    assert str(hf_cache) in msg and "HF_HUB_OFFLINE" in msg
    assert "hf download Qwen/Qwen2.5-7B-Instruct" in msg and "HF_HUB_CACHE" in msg


def test_incomplete_snapshot_offline_names_the_missing_weights(hf_cache, model_dir, tmp_path):
    files = {k: v for k, v in dir_files(model_dir).items() if not k.endswith(".safetensors")}
    lay_out_repo(hf_cache, REPO, COMMIT_A, files)
    with pytest.raises(ModelLoadError, match=r"is incomplete in \(model.safetensors missing\)"):
        ModelHandle.load(REPO, cache_dir=tmp_path / "home")


def fake_hub(monkeypatch, cache: Path, remote: dict[str, bytes], fetched: list):
    """Stand in for the Hub behind ``snapshot_download`` (unit tests have no network): online
    calls copy the files of ``remote`` that ``allow_patterns`` selects into ``cache`` as a real
    download does, and record them in ``fetched``; cache-only calls go to huggingface_hub."""
    from huggingface_hub.utils import filter_repo_objects

    real = huggingface_hub.snapshot_download

    def snapshot_download(repo_id, *, revision=None, allow_patterns=None, local_files_only=False, **kw):
        if local_files_only:
            return real(repo_id, revision=revision, allow_patterns=allow_patterns, local_files_only=True, **kw)
        chosen = list(filter_repo_objects(remote, allow_patterns=allow_patterns))
        fetched.extend(chosen)
        return str(lay_out_repo(cache, repo_id, COMMIT_A, {n: remote[n] for n in chosen}))

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)


def test_online_download_fetches_only_what_loading_needs(hf_cache, model_dir, tmp_path, monkeypatch):
    marker = tmp_path / "unpickled"
    remote = dict(dir_files(model_dir))
    remote["pytorch_model.bin"] = pickle.dumps(_Tripwire(marker))  # the same weights, pickled
    remote["consolidated.safetensors"] = remote["model.safetensors"]  # the same weights, another layout
    remote["README.md"] = b"# tiny"
    fetched: list = []
    fake_hub(monkeypatch, hf_cache, remote, fetched)

    h = ModelHandle.load(REPO, cache_dir=tmp_path / "home")
    assert h.source == f"{REPO}@{COMMIT_A}"
    assert "model.safetensors" in fetched and "config.json" in fetched and "tokenizer.json" in fetched
    assert not {"pytorch_model.bin", "consolidated.safetensors", "README.md"} & set(fetched)
    assert h.fingerprint == ModelHandle.load(model_dir, cache_dir=tmp_path / "home").fingerprint
    assert not marker.exists()

    fetched.clear()  # cached now: the next load does not ask the Hub
    assert ModelHandle.load(REPO, cache_dir=tmp_path / "home").fingerprint == h.fingerprint
    assert fetched == []


def test_online_repo_without_safetensors_is_refused(hf_cache, model_dir, tmp_path, monkeypatch):
    marker = tmp_path / "unpickled"
    remote = {k: v for k, v in dir_files(model_dir).items() if not k.endswith(".safetensors")}
    remote["pytorch_model.bin"] = pickle.dumps(_Tripwire(marker))
    fetched: list = []
    fake_hub(monkeypatch, hf_cache, remote, fetched)
    with pytest.raises(ModelLoadError, match=r"lacks model.safetensors.*never pickled pytorch_model.bin"):
        ModelHandle.load(REPO, cache_dir=tmp_path / "home")
    assert "pytorch_model.bin" not in fetched and not marker.exists()


class _Tripwire:
    """Unpickling this creates the file ``marker``: proof that someone unpickled it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_repo_with_only_pickled_weights_is_refused_unread(hf_cache, model_dir, tmp_path):
    marker = tmp_path / "unpickled"
    files = {k: v for k, v in dir_files(model_dir).items() if not k.endswith(".safetensors")}
    files["pytorch_model.bin"] = pickle.dumps(_Tripwire(marker))
    lay_out_repo(hf_cache, REPO, COMMIT_A, files)
    with pytest.raises(ModelLoadError, match=r"only pickled weights \(pytorch_model.bin\).*never unpickles"):
        ModelHandle.load(REPO, cache_dir=tmp_path / "home")
    assert not marker.exists()


def test_existing_local_dir_named_like_an_id_wins(hf_cache, model_dir, other_model_dir, tmp_path, monkeypatch):
    lay_out_repo(hf_cache, REPO, COMMIT_A, dir_files(model_dir))
    monkeypatch.chdir(tmp_path)
    shutil.copytree(other_model_dir, tmp_path / REPO)
    h = ModelHandle.load(REPO, cache_dir=tmp_path / "home")
    assert h.source == REPO and h.load_info["weights_dir"] == REPO
    assert h.fingerprint == ModelHandle.load(other_model_dir, cache_dir=tmp_path / "home").fingerprint


def test_registered_name_is_not_looked_up_as_a_repo(hf_cache, tmp_path, monkeypatch):
    import kvrag.model.packaged as kp

    resolved = []
    monkeypatch.setitem(kp.MODEL_NAMES, "smollm2", lambda cache_dir=None: resolved.append(1) or tmp_path / "none")
    with pytest.raises(ModelLoadError, match="does not exist"):
        ModelHandle.load("smollm2", cache_dir=tmp_path / "home")
    assert resolved == [1]


def test_weight_index_names_the_shards_and_is_checked(tmp_path):
    assert weight_files(tmp_path) == ["model.safetensors"]
    index = tmp_path / "model.safetensors.index.json"
    shards = {"a.weight": "model-00002-of-00002.safetensors", "b.weight": "model-00001-of-00002.safetensors"}
    index.write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    assert weight_files(tmp_path) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index.write_text(json.dumps({"weight_map": {"a.weight": "../../elsewhere.safetensors"}}))
    with pytest.raises(ModelLoadError, match="no usable safetensors shards"):
        weight_files(tmp_path)
    index.write_text("{not json")
    with pytest.raises(ModelLoadError, match="unreadable weight index"):
        weight_files(tmp_path)


def test_cli_model_info_takes_a_repo_id(hf_cache, model_dir, tmp_path, capsys):
    lay_out_repo(hf_cache, REPO, COMMIT_A, dir_files(model_dir))
    home = tmp_path / "home"
    assert main(["model", "info", "--model", REPO, "--home", str(home), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["source"] == f"{REPO}@{COMMIT_A}"
    assert info["model_fingerprint"] == ModelHandle.load(model_dir, cache_dir=home).fingerprint

    assert main(["model", "info", "--model", "nobody/nothing", "--home", str(home)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvrag: error: ") and "'nobody/nothing' is not in the Hugging Face cache" in err
