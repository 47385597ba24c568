"""Sparse deltas between full-weight versions (echo/weights/delta.py): bit for bit, and refused whole
where they do not fit what a sampler holds."""

import pytest
import torch

from echo.model.loading import load_model
from echo.weights.delta import CHANGED, VALUES, DeltaError, apply, changed_fraction, encode, send_whole
from echo.weights.digest import files_digest, tensors_digest
from echo.weights.shards import load_tensors, policy_tensors


def versions(seed: int = 0, dtype=torch.bfloat16, lr: float = 1e-5):
    """Two consecutive versions as a trainer publishes them: fp32 master weights moved by an
    Adam-sized step (about lr an element), cast to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    master = {"embed.weight": torch.randn(512, 64, generator=g) * 0.02, "norm.weight": torch.ones(64),
              "head.bias": torch.zeros(7)}
    stepped = {k: v + lr * torch.sign(torch.randn(v.shape, generator=g)) for k, v in master.items()}
    stepped["norm.weight"][3] = -0.0  # a sign flip of zero is a change of bits, not of value
    return ({k: v.to(dtype) for k, v in master.items()}, {k: v.to(dtype) for k, v in stepped.items()})


def test_a_delta_rebuilds_the_new_version_bit_for_bit_and_is_small_where_little_changed():
    old, new = versions()
    delta = encode(old, new)
    rebuilt = apply(old, delta)
    assert tensors_digest(rebuilt) == tensors_digest(new) != tensors_digest(old)
    assert all(torch.equal(rebuilt[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
    assert "head.bias.changed" in delta  # 0 + 1e-5 is representable: every element moved
    total = sum(t.numel() for t in new.values())
    # bf16 keeps 8 bits of mantissa: a 1e-5 step (full-weight RL's size) moves few 0.02-sized weights' bits
    assert 0 < changed_fraction(delta, total) < 0.3
    assert sum(t.numel() * t.element_size() for t in delta.values()) < 0.5 * sum(
        t.numel() * t.element_size() for t in new.values())


def test_bits_not_values_decide_what_changed():
    old = {"w": torch.tensor([0.0, 1.0, float("nan")])}
    new = {"w": torch.tensor([-0.0, 1.0, float("nan")])}
    delta = encode(old, new)
    assert delta["w.values"].numel() == 1  # -0.0 == 0.0 as values, not as bits; NaN's bits kept
    assert tensors_digest(apply(old, delta)) == tensors_digest(new)
    assert encode(new, new) == {}  # nothing changed, nothing sent


def test_the_old_weights_are_left_as_they_were():
    old, new = versions(1)
    kept = {k: v.clone() for k, v in old.items()}
    apply(old, encode(old, new))
    assert tensors_digest(old) == tensors_digest(kept)


@pytest.mark.parametrize("spoil, reason", [
    (lambda d: d.update({"embed.weight.changed": d["embed.weight.changed"][:-1]}), "a mask of"),
    (lambda d: d.update({"ghost.changed": torch.zeros(1, dtype=torch.uint8),
                         "ghost.values": torch.zeros(0, dtype=torch.bfloat16)}), "no tensor held"),
    (lambda d: d.update({"embed.weight.values": d["embed.weight.values"][1:]}), "values"),
    (lambda d: d.update({"embed.weight.values": d["embed.weight.values"].float()}), "values"),
    (lambda d: d.pop("embed.weight.values"), "none values"),
    (lambda d: d.update({"embed.weight.extra": torch.zeros(1)}), "no tensor held"),
])
def test_a_delta_that_does_not_fit_the_weights_held_is_refused_with_a_reason(spoil, reason):
    old, new = versions(2)
    delta = encode(old, new)
    spoil(delta)
    with pytest.raises(DeltaError, match=reason):
        apply(old, delta)


def test_a_change_past_the_tensors_end_is_refused():
    old = {"w": torch.zeros(5)}  # 5 elements: one byte of mask, its last 3 bits padding
    delta = {"w" + CHANGED: torch.tensor([0b00000100], dtype=torch.uint8), "w" + VALUES: torch.ones(1)}
    with pytest.raises(DeltaError, match="past its 5 elements"):
        apply(old, delta)


def test_tensors_that_changed_shape_or_name_go_whole():
    old, new = versions(3)
    with pytest.raises(DeltaError, match="became"):
        encode(old, {**new, "head.bias": torch.zeros(8, dtype=torch.bfloat16)})
    with pytest.raises(DeltaError, match="differ"):
        encode(old, {k: v for k, v in new.items() if k != "head.bias"})


def test_a_version_goes_whole_first_every_k_versions_and_when_its_delta_is_large():
    assert send_whole(1, None, 10, 1000, every=8, max_share=0.5)  # nothing to be a delta of
    assert not send_whole(2, 1, 10, 1000, every=8, max_share=0.5)
    assert send_whole(9, 1, 10, 1000, every=8, max_share=0.5)  # a late joiner's chain stays short
    assert send_whole(3, 1, 600, 1000, every=8, max_share=0.5)  # a delta larger than the share: whole


def test_a_mixture_of_experts_full_weights_go_as_a_delta_and_load_bit_for_bit():
    """The tiny MoE's every parameter (its stacked experts, 3-D, and its routers) as published,
    a version later: the delta rebuilds it bit for bit and a sampler's model takes it."""
    model = load_model("tiny-moe")[0]
    old = policy_tensors(model, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * torch.sign(torch.randn(p.shape, generator=g)))
    new = policy_tensors(model, torch.bfloat16)
    assert any(t.dim() == 3 for t in new.values())  # the experts, stacked
    rebuilt = apply(old, encode(old, new))
    assert tensors_digest(rebuilt) == tensors_digest(new) != tensors_digest(old)
    sampler = load_model("tiny-moe", dtype=torch.bfloat16)[0]
    load_tensors(sampler, rebuilt)
    assert all(torch.equal(p, new[k]) for k, p in sampler.named_parameters())


def test_one_digest_of_weights_in_memory_on_disk_or_as_a_base_model(tmp_path):
    """The weights digest is one (echo/weights/digest.py): held tensors, safetensors files read
    piece by piece and a base model's folder give the same digest for the same weights, and any
    bit, name, dtype or shape changed gives another."""
    import safetensors.torch

    from echo.model.loading import base_model_digest, model_folder

    tensors = {"a.weight": torch.randn(4, 6).to(torch.bfloat16), "b.bias": torch.arange(5, dtype=torch.int64),
               "c.scale": torch.tensor(0.5), "d.w": torch.randn(3, 3)}
    files = [tmp_path / "x-0.safetensors", tmp_path / "x-1.safetensors"]
    safetensors.torch.save_file({k: tensors[k] for k in ("d.w", "a.weight")}, files[0])
    safetensors.torch.save_file({k: tensors[k] for k in ("c.scale", "b.bias")}, files[1])
    assert files_digest(files) == tensors_digest(tensors) == files_digest(files[::-1])
    assert tensors_digest(tensors).startswith("sha256:")
    flipped = tensors["a.weight"].clone()
    flipped.view(torch.int16)[0, 0] ^= 1
    for other in ({**tensors, "a.weight": flipped}, {**tensors, "d.w": tensors["d.w"].double()},
                  {**tensors, "d.w": tensors["d.w"].reshape(9)}, {("e" + k[1:] if k == "d.w" else k): v
                                                                  for k, v in tensors.items()}):
        assert tensors_digest(other) != tensors_digest(tensors)
    folder = model_folder("tiny")
    held = {name: t for f in sorted(folder.glob("*.safetensors")) for name, t in safetensors.torch.load_file(f).items()}
    assert base_model_digest("tiny") == tensors_digest(held)
