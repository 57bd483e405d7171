"""The ``kvrag`` command as a newcomer meets it: one meaning for ``--cache-dir``, a
store found without arguments, what ``model info`` and ``policies`` say, a light parser."""

import json
import os
import subprocess
import sys

import pytest

from kvrag.cli import build_parser, main
from kvrag.engine import KVRag
from kvrag.testing import tiny_llama


def test_building_the_parser_imports_no_torch():
    """``kvrag --version`` / ``--help`` build every sub-command's parser: that must not import
    torch (seconds on a busy machine)."""
    code = (
        "import sys; from kvrag.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_calibrate_defaults_agree_with_the_calibrator():
    from kvrag.cli.calibrate import DEFAULTS
    from kvrag.policies.a2ats import calibrate as cal

    assert DEFAULTS == dict(
        tokens=cal.DEFAULT_TOKENS,
        codes=cal.DEFAULT_CODES,
        iters=cal.DEFAULT_ITERS,
        seq_len=cal.DEFAULT_SEQ_LEN,
        uuid_fraction=cal.DEFAULT_UUID_FRACTION,
        rope_offset=cal.DEFAULT_ROPE_OFFSET,
    )


def _helps(parser):
    """Every description and help text of ``parser`` and its sub-parsers."""
    import argparse

    out = [parser.description or ""]
    for a in parser._actions:
        out.append(a.help or "")
        if isinstance(a, argparse._SubParsersAction):
            out += [c.help or "" for c in a._choices_actions]
            for sub in a.choices.values():
                out += _helps(sub)
    return out


def test_help_has_no_raw_backticks_and_every_command_a_description():
    parser = build_parser()
    assert not [h for h in _helps(parser) if "``" in h]
    action = next(a for a in parser._actions if a.dest == "command")
    assert all(sub.description for sub in action.choices.values()), [
        name for name, sub in action.choices.items() if not sub.description
    ]


def test_cache_dir_means_a_store_everywhere(capsys):
    with pytest.raises(SystemExit) as e:
        main(["model", "info", "--cache-dir", "data/kv"])
    assert e.value.code == 2
    assert "--home" in capsys.readouterr().err


def test_cache_stats_finds_the_quickstarts_stores(tmp_path, monkeypatch, capsys):
    rag = KVRag(tiny_llama(seed=0), cache_dir=tmp_path / "data" / "kv")
    rag.precompute(["One passage about foxes."])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    assert main(["cache", "stats"]) == 2
    err = capsys.readouterr().err
    assert f"stores under this directory: {os.path.join('data', 'kv')}" in err
    assert main(["cache", "stats", "data/kv", "--json"]) == 0  # the directory as an argument
    assert json.loads(capsys.readouterr().out)["entries"] == 1
    assert main(["cache", "stats", "--cache-dir", "data/kv"]) == 0


def test_policies_marks_the_default_and_what_needs_setting_up(capsys):
    assert main(["policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # Every model's default is listed beside its policy; a model without evidence gets cacheblend.
    assert any(line.startswith("cacheblend (default for") and "any other model" in line for line in lines)
    assert any("SmolLM2-135M-Instruct" in line for line in lines if "(default for" in line)
    a2ats = lines.index(next(line for line in lines if line.startswith("a2ats")))
    assert "kvrag calibrate a2ats" in lines[a2ats + 1]


def test_model_info_shows_the_stores_fingerprint_and_bytes(tmp_path, capsys):
    handle = tiny_llama(seed=0)
    d = tmp_path / "m"
    handle.model.save_pretrained(d)
    handle.tokenizer.save_pretrained(d)
    rag = KVRag(str(d), cache_dir=tmp_path / "kv")
    rag.precompute(["One passage about foxes."])
    assert main(["model", "info", "--model", str(d), "--home", str(tmp_path / "home"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["cache_fingerprint"] == rag.fingerprint != info["model_fingerprint"]
    entry = rag.store.get(rag.chunk_key("One passage about foxes."), info["cache_fingerprint"])
    assert entry is not None and entry.fingerprint == info["cache_fingerprint"]
    per_token = (entry.keys.numel() + entry.values.numel()) * entry.keys.element_size() // entry.token_ids.numel()
    assert info["kv_bytes_per_token"] == per_token


@pytest.mark.skipif(sys.platform != "linux", reason="XDG_CACHE_HOME is the Linux convention platformdirs follows")
def test_the_kvrag_home_follows_xdg_cache_home(tmp_path, monkeypatch):
    from kvrag.paths import default_home

    monkeypatch.delenv("KVRAG_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_home() == tmp_path / "xdg" / "kvrag"
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "mine"))
    assert default_home() == tmp_path / "mine"


def test_sizes_are_parsed_and_printed_in_binary_units():
    from kvrag.cli.cache import human, parse_size

    assert parse_size("2 GiB") == parse_size("2G") == 2 * 2**30 and parse_size("0.5K") == 512
    assert human(23040) == "22.5 KiB" and human(517 * 2**20) == "517 MiB"
