"""A2ATS on the compute device: the codes, the scores and the selected rows live where the K/V
live, and a decode step waits on the device for nothing."""

import os

import pytest
import torch
from helpers.fusion import pieces_for, rand_ids, tiny

from kvrag.arch import Arch
from kvrag.bench.ops import count_ops
from kvrag.layout.state import Layout
from kvrag.policies import get_policy
from kvrag.policies.a2ats import calibrate as cal
from kvrag.query.decode import FusedStepper
from kvrag.query.fusion import FusionEngine

N_STEPS = 12  # decoded tokens leave a2ats' window of 8 and get codes

PARAMS = dict(topk=0.1, sink=2, window=8)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(tiny llama's arch, the path of codebooks fitted for it)."""
    arch = Arch(tiny("llama"))
    g = torch.Generator().manual_seed(0)
    books = cal.fit_codebooks(arch, [rand_ids(128, g) for _ in range(6)], n_codes=16, iters=3, seed=0)
    return arch, str(books.save(tmp_path_factory.mktemp("a2ats") / "llama.safetensors"))


def _layout(arch, pol, seed=4):
    """Plain text, two cached chunks (the first with the codes precompute stores), a question."""
    g = torch.Generator().manual_seed(seed)
    segs = [(rand_ids(5, g), False), (rand_ids(30, g), True), (rand_ids(30, g), True), (rand_ids(6, g), False)]
    pieces = pieces_for(arch, segs)
    e = pieces[1].entry
    e.extras = pol.chunk_extras(arch, e.keys, e.values, e.token_ids)
    return Layout.build(pieces)


def run_case(arch, path, params):
    """(prefill result, stepper, prefill codes, per step and layer the rows read, tokens) of a
    fused prefill and ``N_STEPS`` greedy decode steps."""
    pol = get_policy("a2ats", codebook=path, **params)
    res = FusionEngine(arch).prefill(_layout(arch, pol), pol, keep_state=True)
    prefill_codes = [c.clone() for c in res.state.scratch["a2ats"]["codes"]]
    stepper = FusedStepper(arch, res.K, res.V, res.next_position, pol, res.state, res.positions)
    seen = []
    select = pol.decode_select

    def spy(layer, q, st):
        idx = select(layer, q, st)
        seen.append(idx)
        return idx

    pol.decode_select = spy
    tokens = [int(res.logits.argmax())]
    for _ in range(N_STEPS):
        tokens.append(int(stepper.step(tokens[-1:])[-1].argmax()))
    return res, stepper, prefill_codes, seen, tokens


def test_codes_and_selected_rows_live_on_the_kv_device_as_long(model):
    """Codes after the prefill and after decoding, and every decode selection, are on the
    K/V's device (``$KVRAG_TEST_DEVICE``, default the CPU) and long; the policy scores with
    codebooks moved there once."""
    arch, path = model
    dev = torch.device(os.environ.get("KVRAG_TEST_DEVICE", "cpu"))
    arch.model.to(dev)
    try:
        res, _, prefill_codes, seen, _ = run_case(arch, path, PARAMS)
    finally:
        arch.model.to("cpu")
    assert res.K[0].device.type == dev.type
    sc = res.state.scratch["a2ats"]
    for codes in prefill_codes + sc["codes"]:
        assert codes.device == res.K[0].device and codes.dtype == torch.long
    assert sc["codes"][0].shape[1] > prefill_codes[0].shape[1]  # decoded rows were coded
    selected = [idx for idx in seen if idx is not None]
    assert selected and all(idx.device == res.K[0].device and idx.dtype == torch.long for idx in selected)
    cb = sc["codebooks"]
    assert cb.device == res.K[0].device and cb.to(res.K[0].device) is cb


def test_codebooks_move_to_a_device_once():
    """``Codebooks.to`` copies the scoring and coding tensors once per device (here the meta
    device, which needs no GPU) and keeps the identity of the codebooks."""
    from kvrag.policies.a2ats import codebook as books

    g = torch.Generator().manual_seed(0)
    cb = books.Codebooks(torch.randn(2, 2, 8, 4, generator=g), torch.eye(4).expand(2, 2, 4, 4), torch.zeros(2, 2, 3, 4))
    assert cb.to("cpu") is cb
    meta = cb.to("meta")
    assert meta is cb.to(torch.device("meta")) and meta is not cb
    assert meta.device.type == "meta" and meta.chol.device.type == "meta" and meta.digest == cb.digest
    assert cb.device.type == "cpu" and meta.probe is cb.probe


HOST_READS = ("cpu", "tolist", "item", "numpy")


def test_a_per_head_decode_step_never_waits_for_the_device(model, monkeypatch):
    """A decode step of a model without sliding windows (``selection='per_head'``) runs no op
    that makes a CUDA host wait (``count.syncs == 0``) and copies nothing back to the host
    (``.cpu()``, ``.tolist()``, ``.item()``, ``.numpy()``: on the CPU such copies dispatch no
    op, so they are counted here by name), also at the steps that code the rows leaving the
    window. The byte statistics come from shapes and host counters."""
    arch, path = model
    pol = get_policy("a2ats", codebook=path, **PARAMS)
    res = FusionEngine(arch).prefill(_layout(arch, pol), pol, keep_state=True)
    stepper = FusedStepper(arch, res.K, res.V, res.next_position, pol, res.state, res.positions)
    tokens = rand_ids(N_STEPS, torch.Generator().manual_seed(1))
    reads = []
    for name in HOST_READS:
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _r=real, _n=name, **k: reads.append(_n) or _r(t, *a, **k))
    codes = res.state.scratch["a2ats"]["codes"]
    for tok in tokens:
        count, _ = count_ops(stepper.step, [tok])
        assert count.syncs == 0, count.by_op
    assert reads == []
    assert codes[0].shape[1] > res.K[0].shape[1]  # the last steps coded decoded rows
