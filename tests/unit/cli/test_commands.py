"""The ``kvrag`` command: sub-command discovery, error reporting, ``kvrag model info``."""

import json
import os
import subprocess
import sys

import pytest

from kvrag.cli import build_parser, main
from kvrag.errors import KVRagError
from kvrag.model import ModelHandle


def _subcommands(parser) -> set:
    action = next(a for a in parser._actions if a.dest == "command")
    return set(action.choices)


def test_model_subcommand_is_discovered():
    assert "model" in _subcommands(build_parser())


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_missing_model_prints_error_and_exits_2(tmp_path, capsys):
    missing = tmp_path / "nope"
    rc = main(["model", "info", "--model", str(missing), "--home", str(tmp_path)])
    out = capsys.readouterr()
    assert rc == 2
    assert out.err.startswith("kvrag: error: ")
    assert str(missing) in out.err and "does not exist" in out.err
    assert "Traceback" not in out.err


def test_module_entry_point_help():
    r = subprocess.run(
        [sys.executable, "-m", "kvrag", "model", "info", "--help"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "--model" in r.stdout and "--json" in r.stdout


def test_model_info_shows_windows_and_nope_layers(capsys):
    from kvrag.cli.model import _attention

    for model_type, extra, expect in [
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
            "sliding window 8 on layers 2-3",
        ),
        ("smollm3", {}, "no RoPE on layers 3"),
        # Gemma 3: each layer type's RoPE base, and the window on the local layers only.
        (
            "gemma3_text",
            {},
            "'full_attention': 'default (base 1000000.0)', 'sliding_attention': 'default (base 10000.0)'"
            "}; sliding window 8 on layers 0, 2",
        ),
    ]:
        from kvrag.testing import tiny_llama

        d = tiny_llama(model_type=model_type, num_hidden_layers=4, **extra).describe()
        assert expect in _attention(d), (model_type, _attention(d))


# ---- bad input: one line on stderr, exit code 2, before any model load ------------------------
@pytest.fixture
def no_model_load(monkeypatch):
    """A model load fails the test: every check under test must come before it."""
    import kvrag.engine

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(ModelHandle, "load", boom)
    monkeypatch.setattr(kvrag.engine.KVRag, "__init__", boom)


def _fails(argv, capsys, *needles):
    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 2, (argv, out.out, out.err)
    assert out.err.startswith("kvrag: error: ") and "Traceback" not in out.err, out.err
    assert len(out.err.strip().splitlines()) == 1, out.err
    for n in needles:
        assert n in out.err, (n, out.err)
    return out.err


def test_value_and_os_errors_of_a_subcommand_are_one_line_errors(monkeypatch, capsys):
    import kvrag.cli.policies as pol

    def bad_value(args):
        raise ValueError("the value is bad")

    monkeypatch.setattr(pol, "run", bad_value)
    _fails(["policies"], capsys, "the value is bad")
    monkeypatch.setattr(pol, "run", lambda args: open("/nonexistent/dir/file"))
    _fails(["policies"], capsys, "No such file or directory", "/nonexistent/dir/file")
    # --debug keeps the traceback (the exception propagates), for bug reports.
    with pytest.raises(FileNotFoundError):
        main(["--debug", "policies"])
    # A bug (any other exception) is not disguised as a user error.
    monkeypatch.setattr(pol, "run", lambda args: {}["missing"])
    with pytest.raises(KeyError):
        main(["policies"])


@pytest.mark.parametrize(
    "corpus, needle",
    [
        (None, "file not found"),
        ("{not json", "not valid JSON"),
        ('[{"documents": ["a"]}]', "expected a JSON object"),
        ('{"documents": ["Tom lives in Paris."]}', "no 'questions'"),
        ('{"documents": ["Tom lives in Paris."], "questions": []}', "'questions' must be a non-empty list"),
        ('{"documents": [""], "questions": ["Where?"]}', "'documents' must be a non-empty list"),
        ('{"documents": ["a"], "questions": ["q"], "instruction": 3}', "'instruction' must be a string"),
    ],
)
def test_demo_rejects_a_bad_corpus_before_loading(tmp_path, capsys, no_model_load, corpus, needle):
    path = tmp_path / "corpus.json"
    if corpus is not None:
        path.write_text(corpus)
    _fails(["demo", "--corpus", str(path)], capsys, "--corpus", needle)
    _fails(["demo", "--corpus", str(tmp_path)], capsys, "not a file")


def test_demo_rejects_bad_options_before_loading(tmp_path, capsys, no_model_load):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    _fails(["demo", "--policies", "bogus"], capsys, "unknown 'bogus'", "registered:")
    _fails(["demo", "--policies", ",,"], capsys, "--policies", "no policy")
    _fails(["demo", "--max-new-tokens", "0"], capsys, "--max-new-tokens must be >= 1")
    _fails(["demo", "--max-new-tokens", "-1"], capsys, "--max-new-tokens must be >= 1")
    _fails(["demo", "--cache-dir", str(a_file)], capsys, "--cache-dir", "not a directory")
    _fails(["demo", "--cache-dir", str(a_file / "sub")], capsys, "--cache-dir", f"{a_file} is not a directory")


def test_demo_policies_are_deduplicated_in_order():
    from kvrag.cli.demo import parse_policies

    assert parse_policies("cacheblend, full_prefill,cacheblend,,full_prefill") == ["cacheblend", "full_prefill"]


def _train(tmp_path, *extra):
    data = tmp_path / "train.json"
    if not data.exists():
        data.write_text(
            json.dumps(
                [
                    {
                        "question": "Where does Tom live?",
                        "answers": ["Paris"],
                        "ctxs": [{"title": "Tom", "text": "Tom lives in Paris."}],
                    }
                ]
            )
        )
    return ["train", "kvlink", "--data", str(data), *extra]


def test_train_kvlink_checks_before_loading(tmp_path, capsys, no_model_load, monkeypatch):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    _fails(_train(tmp_path, "--out", str(a_file / "adapter")), capsys, "--out", f"{a_file} is not a directory")
    _fails(_train(tmp_path, "--out", str(a_file)), capsys, "--out", "not a directory")
    _fails(_train(tmp_path, "--threads", "-1"), capsys, "--threads must be >= 1")
    err = _fails(_train(tmp_path, "--max-minutes", "-1"), capsys, "--max-minutes must be >= 0")
    assert "max_seconds" not in err
    _fails(_train(tmp_path, "--lora-rank", "-1"), capsys, "--lora-rank must be an integer >= 0")
    _fails(_train(tmp_path, "--holdout", "1"), capsys, "--holdout 1 leaves no training examples")
    _fails(["train", "kvlink", "--data", str(tmp_path / "missing.json")], capsys, "missing.json", "does not exist")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "kvlink.json").write_text("{}")
    _fails(_train(tmp_path, "--out", str(adapter)), capsys, "already holds a KVLink adapter", "--force")
    monkeypatch.setenv("KVRAG_HOME", str(a_file))  # the default --out lives under it
    _fails(_train(tmp_path), capsys, "$KVRAG_HOME/kvlink", "not a directory")


def test_calibrate_a2ats_checks_before_loading(tmp_path, capsys, no_model_load):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    _fails(["calibrate", "a2ats", "--out", str(tmp_path)], capsys, "--out", "is a directory")
    _fails(["calibrate", "a2ats", "--out", str(a_file / "cb.safetensors")], capsys, f"{a_file} is not a directory")
    _fails(["calibrate", "a2ats", "--tokens", "10", "--codes", "64"], capsys, "--tokens 10", "--codes 64", "codewords")
    nostr = tmp_path / "nostr.json"
    nostr.write_text('[1, 2, {"a": 3, "b": "short"}]')
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    out = tmp_path / "cb.safetensors"
    _fails(["calibrate", "a2ats", "--text", str(nostr), "--out", str(out)], capsys, "nostr.json", "no calibration text")
    _fails(["calibrate", "a2ats", "--text", str(empty), "--out", str(out)], capsys, "empty.txt", "is empty")
    _fails(["calibrate", "a2ats", "--text", str(tmp_path), "--out", str(out)], capsys, "is a directory")
    _fails(
        ["calibrate", "a2ats", "--store", str(tmp_path / "nowhere"), "--out", str(out)],
        capsys,
        "no KV store",
        "nowhere",
    )
    from kvrag.store import DiskStore

    DiskStore(tmp_path / "empty-store").close()
    _fails(
        ["calibrate", "a2ats", "--store", str(tmp_path / "empty-store"), "--out", str(out)],
        capsys,
        "empty-store",
        "holds no chunk text",
    )
    assert not out.exists()


# ---- an unusable kvrag home / --cache-dir for the model conversion ------------------------------
@pytest.fixture
def fake_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"GGUF not really")
    return p


def test_unusable_cache_dir_for_a_conversion_is_a_clear_error(tmp_path, capsys, fake_gguf, monkeypatch):
    import kvrag.model.gguf as kg
    from kvrag.errors import ModelLoadError

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for root in (a_file, a_file / "sub"):
        with pytest.raises(ModelLoadError, match="must be a writable directory") as e:
            ModelHandle.load(fake_gguf, cache_dir=root)
        assert str(root) in str(e.value)
        _fails(["model", "info", "--model", str(fake_gguf), "--home", str(root)], capsys, str(root), "writable")
        monkeypatch.setenv("KVRAG_HOME", str(root))
        _fails(["model", "info", "--model", str(fake_gguf)], capsys, str(root), "writable")
        monkeypatch.delenv("KVRAG_HOME")
    # A read-only home (simulated: tests may run as root, where chmod does not stop writes).
    home = tmp_path / "ro-home"
    (home / "models").mkdir(parents=True)
    real_access = os.access
    monkeypatch.setattr(
        kg.os, "access", lambda p, mode, **k: False if str(p).startswith(str(home)) else real_access(p, mode, **k)
    )
    with pytest.raises(ModelLoadError, match="not writable") as e:
        ModelHandle.load(fake_gguf, cache_dir=home)
    assert str(home) in str(e.value)


def test_read_only_home_with_the_conversion_done_still_loads(tmp_path, fake_gguf, monkeypatch):
    import kvrag.model.digests as kd
    import kvrag.model.gguf as kg
    from kvrag.testing import tiny_llama

    home = tmp_path / "home"
    digest = kd.file_digest(fake_gguf, home)
    conv = kg.conversion_dir(home, digest)
    tiny = tiny_llama(seed=1)
    tiny.model.save_pretrained(conv)
    tiny.tokenizer.save_pretrained(conv)
    (conv / kg.CONVERSION_MARKER).write_text("{}")

    def read_only(*a, **k):
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(kd, "atomic_write_text", read_only)
    monkeypatch.setattr(kg, "convert_gguf", read_only)
    h = ModelHandle.load(fake_gguf, cache_dir=home)
    assert h.load_info == {"weights_dir": str(conv), "converted": False}


def test_output_path_checks_try_the_directory_not_only_its_mode_bits(tmp_path):
    """``os.access`` says yes to root everywhere (read-only mounts, /proc): the check makes and
    removes a temporary file, so a bench/train/calibrate output that cannot be written fails
    before the model loads, and a writable one is left as it was."""
    from kvrag.outpaths import check_dir, check_file

    for path in ("/proc/kvrag-out", "/proc"):
        with pytest.raises(KVRagError, match="not writable"):
            check_dir(path, "--out")
    with pytest.raises(KVRagError, match="not writable"):
        check_file("/proc/kvrag-report.md", "--report")
    assert check_dir(tmp_path / "new" / "out", "--out") == tmp_path / "new" / "out"
    assert check_file(tmp_path / "report.md", "--report") == tmp_path / "report.md"
    assert list(tmp_path.iterdir()) == []
