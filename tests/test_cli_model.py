"""The ``kvrag`` command: sub-command discovery, error reporting, ``kvrag model info``."""
import json
import subprocess
import sys

import pytest

from kvrag.cli import build_parser, main
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
    rc = main(["model", "info", "--model", str(missing), "--cache-dir", str(tmp_path)])
    out = capsys.readouterr()
    assert rc == 2
    assert out.err.startswith("kvrag: error: ")
    assert str(missing) in out.err and "does not exist" in out.err
    assert "Traceback" not in out.err


def test_module_entry_point_help():
    r = subprocess.run(
        [sys.executable, "-m", "kvrag.cli", "model", "info", "--help"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "--model" in r.stdout and "--json" in r.stdout


@pytest.mark.real
def test_model_info_on_default_model(capsys):
    handle = ModelHandle.load()
    cfg = handle.model.config

    assert main(["model", "info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["fingerprint"] == handle.fingerprint
    assert info["source"] == handle.source
    assert (info["layers"], info["heads"], info["kv_heads"]) == (
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    )
    assert info["kv_bytes_per_token"] == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4

    assert main(["model", "info"]) == 0
    lines = dict(line.split(":", 1) for line in capsys.readouterr().out.splitlines())
    assert lines["fingerprint"].strip() == handle.fingerprint
    assert lines["model"].strip() == handle.source
    assert lines["layers"].strip() == "30"
    assert lines["KV bytes/token"].split()[0] == "46080"  # 2 x 30 x 3 x 64 x 4 bytes (SmolLM2, fp32)
