"""``kvrag cache plan``: a corpus's bytes per storage format, worked out by hand here for a tiny
config, the size limit it is fitted in, the precompute measurement, and clear refusals."""

import json

import pytest

from kvrag.cli import main
from kvrag.store import DiskStore
from kvrag.testing import tiny_llama

# tiny_llama: 4 layers, 2 KV heads, head dim 16. A chunk of 128 tokens: two key groups of 64.
L, HKV, D, T = 4, 2, 16, 128
IDS = 8 * T  # token ids, int64
PAIRS = L * HKV  # (layer, KV head) pairs, each with its own keys and values [T, D]
BY_HAND = {
    # keys + values, 2 or 4 bytes an element
    "float16": PAIRS * 2 * T * D * 2 + IDS,
    "bfloat16": PAIRS * 2 * T * D * 2 + IDS,
    "float32": PAIRS * 2 * T * D * 4 + IDS,
    # int8 codes; a float16 scale per key channel per 64 tokens (2 groups x 16 channels), and per
    # value token over its whole head (16 is not a multiple of 64: one group a head)
    "int8": PAIRS * (2 * T * D + 2 * D * 2 + T * 2) + IDS,
    "float8_e4m3fn": PAIRS * (2 * T * D + 2 * D * 2 + T * 2) + IDS,
    # two codes a byte; a float16 scale and zero point per group
    "int4": PAIRS * (2 * T * D // 2 + 2 * D * 4 + T * 4) + IDS,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-model")
    handle = tiny_llama(seed=0)
    handle.model.save_pretrained(d)
    handle.tokenizer.save_pretrained(d)
    return d


def _plan(capsys, *argv) -> dict:
    assert main(["cache", "plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_bytes_per_format_are_the_ones_worked_out_by_hand(model_dir, tmp_path, capsys):
    rec = _plan(
        capsys,
        *("--chunks", "1000", "--tokens", str(T), "--model", str(model_dir), "--home", str(tmp_path / "home")),
        *("--size-limit", "10M", "--cache-dir", str(tmp_path / "none")),
    )
    assert rec["model"] | {"source": None} == {"source": None, "layers": L, "kv_heads": HKV, "head_dim": D}
    assert (rec["size_limit"], rec["size_limit_from"]) == (10 * 2**20, "--size-limit")
    assert set(rec["formats"]) == set(BY_HAND)  # every format
    for f, chunk in BY_HAND.items():
        got = rec["formats"][f]
        assert got["bytes_per_chunk"] == chunk, f
        assert got["kv_bytes_per_token"] == (chunk - IDS) / T, f
        assert got["total_bytes"] == 1000 * chunk
        assert got["chunks_per_gb"] == 10**9 // chunk
        assert got["chunks_fit"] == min(1000, 10 * 2**20 // chunk)
        assert got["fraction_fit"] == got["chunks_fit"] / 1000
    assert rec["formats"]["float16"]["chunks_fit"] == 157  # 10 MiB / 66,560 B
    assert rec["formats"]["int4"]["chunks_fit"] == 465  # 10 MiB / 22,528 B
    assert rec["precompute"] == {"measured": False}


def test_a_shape_needs_no_model_and_formats_can_be_chosen(tmp_path, capsys):
    # An 8B Llama's shape: 32 layers, 8 KV heads, head dim 128; 256 tokens = 4 whole key groups.
    argv = ["--chunks", "100000", "--tokens", "256", "--shape", "32,8,128", "--size-limit", "1T"]
    rec = _plan(capsys, *argv, "--storage-dtype", "int4", "--storage-dtype", "float16")
    assert set(rec["formats"]) == {"int4", "float16"}
    f16 = 32 * 8 * 2 * 256 * 128 * 2 + 8 * 256
    # int4: 64 code bytes per token and head for keys and values each; per group of 64 key tokens
    # a scale and zero point per channel; per value token a scale and zero point per 64 channels.
    int4 = 32 * 8 * (2 * 256 * 64 + 4 * 128 * 4 + 256 * 2 * 4) + 8 * 256
    assert rec["formats"]["float16"]["bytes_per_chunk"] == f16
    assert rec["formats"]["float16"]["kv_bytes_per_token"] == 131072  # 128 KiB, as docs/cache.md says
    assert rec["formats"]["int4"]["bytes_per_chunk"] == int4
    assert rec["formats"]["int4"]["chunks_fit"] == 100000  # 0.94 TB fits in 1 TiB
    assert rec["formats"]["float16"]["chunks_fit"] == 2**40 // f16
    assert rec["model"]["source"] == "--shape"


def test_the_limit_is_the_stores_own_else_a_new_stores(tmp_path, capsys, monkeypatch):
    from kvrag.store.disk import DEFAULT_SIZE_LIMIT

    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))  # no default store there
    argv = ["--chunks", "10", "--tokens", "64", "--shape", "2,2,64"]
    DiskStore(tmp_path / "kv", size_limit=3 * 2**20).close()
    rec = _plan(capsys, *argv, "--cache-dir", str(tmp_path / "kv"))
    assert rec["size_limit"] == 3 * 2**20 and rec["size_limit_from"] == f"recorded in the store {tmp_path / 'kv'}"
    rec = _plan(capsys, *argv, str(tmp_path / "kv"), "--size-limit", "1G")  # the option wins
    assert rec["size_limit"] == 2**30
    rec = _plan(capsys, *argv)
    assert rec["size_limit"] == DEFAULT_SIZE_LIMIT and "a new store's default" in rec["size_limit_from"]


def test_text_output_has_a_row_per_format(model_dir, tmp_path, capsys):
    argv = ["cache", "plan", "--chunks", "1000", "--tokens", str(T), "--model", str(model_dir)]
    assert main([*argv, "--home", str(tmp_path / "home"), "--size-limit", "10M"]) == 0
    out = capsys.readouterr().out
    assert "4 layers x 2 KV heads x head dim 16" in out and "10 MiB (--size-limit)" in out
    row = next(line for line in out.splitlines() if line.startswith("int4 "))
    assert "168" in row and "465 (46.5%)" in row  # K/V bytes per token, chunks that fit
    assert "not measured" in out


def test_measure_times_one_pack_and_each_formats_write(model_dir, tmp_path, capsys):
    rec = _plan(
        capsys,
        *("--chunks", "100", "--tokens", str(T), "--model", str(model_dir), "--home", str(tmp_path / "home")),
        *("--storage-dtype", "float16", "--storage-dtype", "int4", "--measure"),
    )
    pre = rec["precompute"]
    assert pre["measured"] and pre["device"] == "cpu" and pre["dtype"] == "float32"
    assert pre["pack_chunks"] == 2048 // T  # as ingestion packs them (DEFAULT_BATCH_TOKENS)
    assert pre["compute_s_per_chunk"] > 0 and set(pre["store_s_per_chunk"]) == {"float16", "int4"}
    assert all(s > 0 for s in pre["store_s_per_chunk"].values())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--chunks", "0", "--tokens", "256"], "argument --chunks: must be a positive integer, got '0'"),
        (["--chunks", "10", "--tokens", "-5"], "argument --tokens: must be a positive integer, got '-5'"),
        (["--chunks", "ten", "--tokens", "5"], "argument --chunks: must be a positive integer, got 'ten'"),
        (["--chunks", "1", "--tokens", "5", "--storage-dtype", "int3"], "invalid choice: 'int3'"),
        (["--chunks", "1", "--tokens", "5", "--shape", "3,2"], "must be LAYERS,KV_HEADS,HEAD_DIM"),
        (["--chunks", "1", "--tokens", "5", "--shape", "3,0,64"], "must be a positive integer, got '0'"),
    ],
)
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["cache", "plan", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_requests_are_one_line_errors(model_dir, tmp_path, capsys):
    home = ["--home", str(tmp_path / "home")]
    for argv, message in [
        (["--shape", "2,2,64", "--measure"], "--measure times a model's precompute"),
        (["--model", str(model_dir), *home, "--tokens", "5000"], "longer than the model's context (4096 tokens)"),
        (["--model", str(tmp_path / "nope"), *home], "does not exist"),
        (["--shape", "2,2,64", "--size-limit", "0"], "size must be positive"),
    ]:
        argv = ["--chunks", "10", "--tokens", "64", *argv] if "--tokens" not in argv else ["--chunks", "10", *argv]
        assert main(["cache", "plan", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("kvrag: error: ") and message in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "limit,want",
    [
        ("1G", "float16"),  # 100 chunks of 66,560 B fit at full fidelity
        ("5M", "int8"),  # float16's 6.6 MB do not fit; int8's ~3.5 MB do
        ("2M", "int4"),  # neither does int8's; int4 holds the most
    ],
)
def test_the_plan_recommends_the_most_faithful_format_that_holds_the_corpus(model_dir, tmp_path, capsys, limit, want):
    rec = _plan(
        capsys,
        *("--chunks", "100", "--tokens", str(T), "--model", str(model_dir), "--home", str(tmp_path / "home")),
        *("--size-limit", limit, "--cache-dir", str(tmp_path / "none")),
    )
    assert rec["recommended"]["format"] == want, rec["recommended"]
    fits = {f: rec["formats"][f]["fraction_fit"] for f in ("float16", "int8", "int4")}
    if want == "int4":
        assert fits["int4"] < 1 and "int4 changes some" in rec["recommended"]["why"]
    else:
        assert fits[want] == 1 and all(fits[f] < 1 for f in ("float16", "int8")[: ("float16", "int8").index(want)])
    assert (
        main(
            [
                "cache",
                "plan",
                "--chunks",
                "100",
                "--tokens",
                str(T),
                "--model",
                str(model_dir),
                "--home",
                str(tmp_path / "home"),
                "--size-limit",
                limit,
                "--cache-dir",
                str(tmp_path / "none"),
            ]
        )
        == 0
    )
    assert f"recommended {want}:" in capsys.readouterr().out


def test_no_recommendation_without_a_format_it_ranks(tmp_path, capsys):
    argv = ["--chunks", "10", "--tokens", "64", "--shape", "2,1,16", "--storage-dtype", "bfloat16"]
    assert _plan(capsys, *argv)["recommended"] is None
