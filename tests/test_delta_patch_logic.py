"""Which layers a sparse delta patches in place, where each tensor lies, and what the patch leaves (`delta_patch`).

Real delta files (`save_checkpoint(..., base=)`); the engine is a small torch
model standing in for vLLM's modules: a fused `qkv_proj` (q, k, v in the order
of `packed_modules_mapping`) and a plain `o_proj`.
"""

from __future__ import annotations

import pytest
import torch

from layerwise_cli.checkpoint.delta.source import open_delta_checkpoint
from layerwise_cli.checkpoint.format.digests import layer_digest, tensor_digest
from layerwise_cli.checkpoint.format.samples import buffer_sample
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.worker.reload.decode_ahead import DecodeAhead
from layerwise_cli.worker.reload.delta_patch import DeltaPatch
from layerwise_cli.worker.repairs.derived_state import DerivedState
from layerwise_cli.worker.state.layer_records import LayerRecord, LayerRecords
from layerwise_cli.worker.state.layer_state import layer_fingerprints
from layerwise_cli.writer.save import save_checkpoint

ATTN = "model.layers.0.self_attn"
QKV, OPROJ = f"{ATTN}.qkv_proj", f"{ATTN}.o_proj"
SHAPES = {"q_proj": (8, 16), "k_proj": (4, 16), "v_proj": (4, 16), "o_proj": (16, 8)}


def _step(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"{ATTN}.{name}.weight": torch.randn(shape, generator=gen).to(torch.bfloat16)
            for name, shape in SHAPES.items()}


def _moved(a: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A with a few values of every tensor changed (every fifth one)."""
    out = {}
    for name, tensor in a.items():
        flat = tensor.clone().reshape(-1)
        flat[::5] = flat[::5] * 2 + 1
        out[name] = flat.reshape(tensor.shape)
    return out


class Model(torch.nn.Module):
    def __init__(self, a: dict[str, torch.Tensor], order=("q_proj", "k_proj", "v_proj")) -> None:
        super().__init__()
        self.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        attn = self.model.layers[0].self_attn = torch.nn.Module()
        attn.qkv_proj = torch.nn.Module()
        attn.qkv_proj.weight = torch.nn.Parameter(torch.cat([a[f"{ATTN}.{n}.weight"] for n in order]),
                                                  requires_grad=False)
        attn.o_proj = torch.nn.Module()
        attn.o_proj.weight = torch.nn.Parameter(a[f"{ATTN}.o_proj.weight"].clone(), requires_grad=False)


@pytest.fixture
def steps(tmp_path):
    a = _step(1)
    b = _moved(a)
    save_checkpoint(a.items(), tmp_path / "A", marker=None)
    save_checkpoint(b.items(), tmp_path / "AB", marker=None, base=tmp_path / "A")
    return a, b, open_delta_checkpoint(tmp_path / "AB")


def _stream(checkpoint) -> list[PlannedTensor]:
    parent = {name: QKV if name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj") else OPROJ for name in
              (t.name for t in checkpoint.tensors)}
    return [PlannedTensor(entry, parent[entry.name]) for entry in checkpoint.tensors]


def _records(a: dict[str, torch.Tensor], stream: list[PlannedTensor]) -> LayerRecords:
    """Records as a reload of A leaves them: digests, a state, and each tensor's samples."""
    records = LayerRecords()
    for layer in {item.parent for item in stream}:
        names = [item.entry.name for item in stream if item.parent == layer]
        digests = {n: tensor_digest("BF16", a[n].shape, a[n].view(torch.uint8).numpy().tobytes()) for n in names}
        samples = {n: buffer_sample("BF16", a[n].shape, a[n].contiguous().view(torch.uint8).numpy()) for n in names}
        records.set(layer, LayerRecord(layer_digest(digests), "state-a", True, samples))
    return records


def _plan(model, checkpoint, records, stream, **kwargs) -> DeltaPatch:
    held = {item.parent: 0 for item in stream}
    return DeltaPatch.plan(model, checkpoint.delta, stream, held, records, kwargs.pop("covers", {}),
                           DerivedState(), **kwargs)


def test_fused_and_plain_tensors_are_found_patched_and_recorded_as_the_step(steps):
    a, b, checkpoint = steps
    model, stream = Model(a), _stream(checkpoint)
    records = _records(a, stream)
    patch = _plan(model, checkpoint, records, stream)
    assert patch.layers == {QKV, OPROJ} and patch.not_patched == {}
    offsets = {site.entry.name.rsplit(".", 2)[-2]: site.offset for site in patch.sites[QKV]}
    assert offsets == {"q_proj": 0, "k_proj": 8 * 16, "v_proj": 12 * 16}

    modules = dict(model.named_modules())
    patch.apply(modules, records)
    assert QKV not in records and OPROJ not in records  # dropped while written: a failure leaves them to the rollback
    want = torch.cat([b[f"{ATTN}.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight.view(torch.int16), want.view(torch.int16))
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight.view(torch.int16),
                       b[f"{ATTN}.o_proj.weight"].view(torch.int16))
    delta = checkpoint.delta.last
    assert patch.read_bytes == sum(delta.patch_nbytes(name) for name in delta.patches)

    groups = {layer: [item.entry.name for item in stream if item.parent == layer] for layer in (QKV, OPROJ)}
    patch.record(records, groups, {QKV: "state-b", OPROJ: "state-b"}, checked=True)
    step = delta.step_digests
    for layer, names in groups.items():
        record = records.get(layer)
        assert record.digest == layer_digest({n: step[n] for n in names}) and record.fingerprint == "state-b"
        assert record.samples == {n: buffer_sample("BF16", b[n].shape, b[n].contiguous().view(torch.uint8).numpy())
                                  for n in names}


def test_a_fused_tensor_in_another_order_is_not_patched(steps):
    a, _, checkpoint = steps
    model, stream = Model(a, order=("k_proj", "q_proj", "v_proj")), _stream(checkpoint)
    patch = _plan(model, checkpoint, _records(a, stream), stream)
    # The mapping says q, k, v; the engine holds k, q, v: the samples refute the place, so vLLM reloads it.
    assert patch.layers == {OPROJ} and "does not hold" in patch.not_patched[QKV]


def test_a_layer_whose_layout_changed_is_not_patched(steps):
    a, _, checkpoint = steps
    model, stream = Model(a), _stream(checkpoint)
    o_proj = model.model.layers[0].self_attn.o_proj
    o_proj.weight = torch.nn.Parameter(o_proj.weight.t().contiguous().reshape(16, 8), requires_grad=False)
    patch = _plan(model, checkpoint, _records(a, stream), stream)
    assert patch.layers == {QKV} and "does not hold" in patch.not_patched[OPROJ]


def test_state_derived_from_a_layer_keeps_it_out(steps):
    a, _, checkpoint = steps
    stream = _stream(checkpoint)
    records = _records(a, stream)
    # A CPU kernel holding a packed copy of the weight (oneDNN, SGL): a patch would leave it computing old weights.
    model = Model(a)
    packed = model.model.layers[0].self_attn.o_proj.weight.clone()
    model.model.layers[0].self_attn.o_proj.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, packed)
    patch = _plan(model, checkpoint, records, stream)
    assert patch.layers == {QKV} and "CPU kernel" in patch.not_patched[OPROJ]
    # `F.linear` itself, or a lambda over the stored weight (vLLM's fallback), holds nothing of its own.
    model.model.layers[0].self_attn.o_proj.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight)
    assert _plan(model, checkpoint, records, stream).layers == {QKV, OPROJ}
    # A module sharing the layer's storage (a tied head) and a layer that must be handed over.
    shared = _plan(Model(a), checkpoint, records, stream, covers={OPROJ: [OPROJ, "lm_head"]}, never={QKV})
    assert shared.layers == set() and "lm_head shares" in shared.not_patched[OPROJ] and QKV in shared.not_patched


def test_a_layer_without_samples_or_in_another_dtype_is_not_patched(steps):
    a, _, checkpoint = steps
    stream = _stream(checkpoint)
    records = _records(a, stream)
    records.set(OPROJ, LayerRecord(records.get(OPROJ).digest, "state-a", True, {}))
    patch = _plan(Model(a), checkpoint, records, stream)
    assert patch.layers == {QKV} and "no samples" in patch.not_patched[OPROJ]
    model = Model(a)
    model.model.layers[0].self_attn.qkv_proj.weight.data = model.model.layers[0].self_attn.qkv_proj.weight.float()
    assert "torch.float32" in _plan(model, checkpoint, _records(a, stream), stream).not_patched[QKV]


def test_a_patch_that_does_not_give_the_step_fails_naming_the_tensor(steps):
    a, _, checkpoint = steps
    model, stream = Model(a), _stream(checkpoint)
    records = _records(a, stream)
    patch = _plan(model, checkpoint, records, stream)
    # The engine changed after the plan (a stale state the base check would have caught): the result is no step.
    model.model.layers[0].self_attn.o_proj.weight.data[0, 1] += 1
    with pytest.raises(LayerwiseError, match=f"tensor {ATTN}.o_proj.weight: patched in place in {OPROJ}.weight"):
        patch.apply(dict(model.named_modules()), records)


def _fingerprints(model):
    modules = dict(model.named_modules())
    return lambda names, known=None: layer_fingerprints(modules, {name: [name] for name in names}, known)


def test_a_layer_written_whole_is_proved_after_the_patch_and_one_changed_since_fails(steps):
    a, _, checkpoint = steps
    model, stream = Model(a), _stream(checkpoint)
    # o_proj holds a buffer no checkpoint tensor names: a patch leaves it alone.
    model.model.layers[0].self_attn.o_proj.register_buffer("scale", torch.ones(4))
    records = _records(a, stream)
    state = _fingerprints(model)([QKV, OPROJ])
    for layer in (QKV, OPROJ):
        records.set(layer, LayerRecord(records.get(layer).digest, state[layer], True, records.get(layer).samples))
    patch = _plan(model, checkpoint, records, stream)
    # Every tensor it writes, it writes whole (q, k and v cover qkv_proj): their state is proved afterwards.
    assert patch.proved_after == {QKV, OPROJ}
    patch.apply(dict(model.named_modules()), records)
    patch.prove_state(_fingerprints(model))
    # The checksums taken while the patch was proved are those a fresh read gives.
    assert len(patch.checksums) == 2 and patch.fingerprints == _fingerprints(model)([QKV, OPROJ])

    # The same, with the buffer written by something else since the base was loaded: the base was not held.
    model, records = Model(a), _records(a, stream)
    model.model.layers[0].self_attn.o_proj.register_buffer("scale", torch.ones(4))
    state = _fingerprints(model)([QKV, OPROJ])
    for layer in (QKV, OPROJ):
        records.set(layer, LayerRecord(records.get(layer).digest, state[layer], True, records.get(layer).samples))
    patch = _plan(model, checkpoint, records, stream)
    model.model.layers[0].self_attn.o_proj.scale[0] = 2
    patch.apply(dict(model.named_modules()), records)
    with pytest.raises(LayerwiseError, match=f"layer {OPROJ}: {OPROJ}.scale changed since"):
        patch.prove_state(_fingerprints(model))


def test_a_fused_tensor_only_partly_patched_is_read_before_not_after(tmp_path):
    a = _step(1)
    b = dict(a)
    b[f"{ATTN}.q_proj.weight"] = _moved(a)[f"{ATTN}.q_proj.weight"]  # k and v as they were
    save_checkpoint(a.items(), tmp_path / "A", marker=None)
    save_checkpoint(b.items(), tmp_path / "AB", marker=None, base=tmp_path / "A")
    checkpoint = open_delta_checkpoint(tmp_path / "AB")
    stream = _stream(checkpoint)
    patch = _plan(Model(a), checkpoint, _records(a, stream), stream)
    assert patch.layers == {QKV} and patch.proved_after == set()


@pytest.mark.parametrize("spare", [set(), {0}])
def test_decode_ahead_returns_each_call_in_order_and_raises_at_its_take(spare):
    """`DecodeAhead` computes the next key while the current one is used (in a thread where a CPU is spare,
    inline otherwise): the results are the calls', a call's error is raised when its key is taken."""
    calls = []

    def call(key):
        calls.append(key)
        if key == "bad":
            raise LayerwiseError("tensor x: its zstd stream is corrupt (corrupt delta)")
        return key * 2

    with DecodeAhead(["a", "b", "bad"], call, spare) as ahead:
        assert ahead.take("a") == "aa" and ahead.take("b") == "bb"
        with pytest.raises(LayerwiseError, match="corrupt"):
            ahead.take("bad")
    assert calls == ["a", "b", "bad"]


@pytest.mark.parametrize("check_finite", [True, False])
def test_a_v2_difference_that_makes_a_nan_is_refused_as_it_is_written(tmp_path, check_finite):
    """A v2 patch stores differences: its new values are known once added to the engine's bits, and a NaN there
    fails the patch (the reload is then rolled back), unless the NaN/Inf check is off (`--allow-nonfinite`)."""
    a = _step(1)
    b = {name: t.clone() for name, t in a.items()}
    b[f"{ATTN}.o_proj.weight"].view(-1)[3] = float("nan")
    save_checkpoint(a.items(), tmp_path / "A", marker=None)
    save_checkpoint(b.items(), tmp_path / "AB", marker=None, base=tmp_path / "A", allow_nonfinite=True)
    checkpoint = open_delta_checkpoint(tmp_path / "AB")
    assert checkpoint.delta.last.patches[f"{ATTN}.o_proj.weight"].kind == "sparse"
    model, stream = Model(a), _stream(checkpoint)
    records = _records(a, stream)
    patch = _plan(model, checkpoint, records, stream, check_finite=check_finite)
    assert patch.layers == {OPROJ}
    if check_finite:
        with pytest.raises(LayerwiseError, match=rf"tensor {ATTN}\.o_proj\.weight: the delta's new values hold NaN"):
            patch.apply(dict(model.named_modules()), records)
    else:
        patch.apply(dict(model.named_modules()), records)
        assert model.model.layers[0].self_attn.o_proj.weight.view(-1)[3].isnan()


@pytest.mark.parametrize("repaired", [(3, 7), (3,)])
def test_a_chain_through_a_nan_link_loads_only_where_a_later_link_rewrites_every_nan(tmp_path, repaired):
    """An RL run goes on after a refused NaN step: its next step is written against it. Patched in place through
    both links, the rebuilt tensor holds the NaN link's values only where the later link did not rewrite them:
    the chain loads when it rewrote every NaN, and is refused (naming the tensor) when one is left."""
    name = f"{ATTN}.o_proj.weight"
    a = _step(1)
    nan = {key: t.clone() for key, t in a.items()}
    nan[name].view(-1)[[3, 7]] = float("nan")
    after = {key: t.clone() for key, t in nan.items()}
    after[name].view(-1)[list(repaired)] = torch.tensor([0.5, -0.25][:len(repaired)], dtype=torch.bfloat16)
    after[name].view(-1)[11] = 2.0  # the later step's own change
    save_checkpoint(a.items(), tmp_path / "A", marker=None)
    save_checkpoint(nan.items(), tmp_path / "B", marker=None, base=tmp_path / "A", allow_nonfinite=True)
    save_checkpoint(after.items(), tmp_path / "C", marker=None, base=tmp_path / "B", allow_nonfinite=True)
    checkpoint = open_delta_checkpoint(tmp_path / "C")
    assert [link.patches[name].kind for link in checkpoint.delta.links] == ["sparse", "sparse"]
    model, stream = Model(a), _stream(checkpoint)
    records = _records(a, stream)
    patch = _plan(model, checkpoint, records, stream)
    assert patch.layers == {OPROJ} and len(patch.links[OPROJ]) == 2
    weight = model.model.layers[0].self_attn.o_proj.weight
    if len(repaired) == 2:
        patch.apply(dict(model.named_modules()), records)
        assert torch.equal(weight, after[name])
    else:
        with pytest.raises(LayerwiseError, match=rf"tensor {ATTN}\.o_proj\.weight: the delta's new values hold NaN"):
            patch.apply(dict(model.named_modules()), records)
        assert weight.view(-1)[7].isnan()
