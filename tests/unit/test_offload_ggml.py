"""CPU tests of the Block Swap engine (offload/engine.py) streaming GGUF weights as ComfyUI-GGUF holds them.

ComfyUI-GGUF is not imported here (its layers need ComfyUI): ``GGMLTensor`` below has what its tensor class
(``ops.py``) does that matters to the engine: raw bytes of the file, ``tensor_type`` and ``tensor_shape``
attributes, ``shape`` reporting the real shape, and ``detach`` / ``clone`` returning the tensor itself. The layer
dequantizes with the ``gguf`` package and adds the deltas found in its weight's ``patches``, as ComfyUI-GGUF's
layers apply LoRA on use. Needs ``gguf`` (the ``[test]`` extra); skipped without it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from comfyui_lowvram_dit.offload import engine as offload
from comfyui_lowvram_dit.offload import ggml_tensors as ggml
from comfyui_lowvram_dit.offload import host_memory
from comfyui_lowvram_dit.offload.engine import BlockStreamer
from comfyui_lowvram_dit.offload.plan import SwapConfig, plan_swap
from comfyui_lowvram_dit.synthetic.gguf_checkpoints import q4_k_blocks

gguf = pytest.importorskip("gguf", reason="the gguf package is missing: pip install -e '.[test]' adds it")


class GGMLTensor(torch.Tensor):
    """ComfyUI-GGUF's tensor as the engine meets it (see the module docstring)."""

    def detach(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return self

    def clone(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return self

    @property
    def shape(self) -> torch.Size:
        return self.tensor_shape if hasattr(self, "tensor_shape") else self.size()


def as_ggml(raw: torch.Tensor, qtype: object, shape: tuple[int, ...]) -> torch.nn.Parameter:
    t = raw.as_subclass(GGMLTensor)
    t.tensor_type, t.tensor_shape = qtype, torch.Size(shape)
    return torch.nn.Parameter(t, requires_grad=False)  # a custom tensor stays itself, marked a parameter


def dequantized(t: torch.Tensor) -> torch.Tensor:
    raw = t.as_subclass(torch.Tensor)
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        w = raw.float()
    else:
        w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), t.tensor_type)).reshape(t.tensor_shape)
    for delta, _key in getattr(t, "patches", []):
        w = w + delta
    return w


class GGMLLinear(torch.nn.Module):
    """A Linear whose weight is Q8_0 or Q4_K and whose bias is F32, dequantized on every call."""

    def __init__(self, fin: int, fout: int, qtype: str, gen: np.random.Generator) -> None:
        super().__init__()
        Q = gguf.GGMLQuantizationType
        if qtype == "Q4_K":
            seeded = torch.Generator().manual_seed(int(gen.integers(1 << 31)))
            raw, kind = q4_k_blocks(fout, fin, seeded).numpy(), Q.Q4_K
        else:
            raw, kind = gguf.quants.quantize(gen.standard_normal((fout, fin)).astype(np.float32) * 0.05, Q.Q8_0), Q.Q8_0
        self.weight = as_ggml(torch.from_numpy(raw), kind, (fout, fin))
        self.bias = as_ggml(torch.from_numpy(gen.standard_normal(fout).astype(np.float32) * 0.01), Q.F32, (fout,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, dequantized(self.weight), dequantized(self.bias))


class Block(torch.nn.Module):
    def __init__(self, d: int, qtype: str, gen: np.random.Generator) -> None:
        super().__init__()
        self.modulation = torch.nn.Parameter(torch.from_numpy(gen.standard_normal((1, d)).astype(np.float32)) * 0.1)
        self.q = GGMLLinear(d, d, qtype, gen)
        self.ffn = GGMLLinear(d, d, qtype, gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(torch.tanh(self.q(x + self.modulation)))


class TinyGGUFModel(torch.nn.Module):
    def __init__(self, n: int = 4, d: int = 256, qtype: str = "Q8_0", seed: int = 0) -> None:
        super().__init__()
        gen = np.random.default_rng(seed)
        self.blocks = torch.nn.ModuleList(Block(d, qtype, gen) for _ in range(n))

    def forward(self, x: torch.Tensor, streamer: BlockStreamer | None = None, seen: list | None = None) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if streamer is not None:
                streamer.before_block(i)
            if seen is not None:
                seen.append((i, block.q.weight))
            x = block(x)
            if streamer is not None:
                streamer.after_block(i)
        return x


def _streamer(model: TinyGGUFModel, swap: int = 2, prefetch: int = 1) -> BlockStreamer:
    plan = plan_swap([offload.block_nbytes(b) for b in model.blocks], SwapConfig(blocks_to_swap=swap, prefetch=prefetch))
    return BlockStreamer(model.blocks, plan, "cpu", pinned=False)


def _forward(model: TinyGGUFModel, st: BlockStreamer, x: torch.Tensor, seen: list | None = None) -> torch.Tensor:
    st.begin_forward()
    try:
        return model(x, streamer=st, seen=seen)
    finally:
        st.end_forward()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_ggml_blocks_stream_their_own_bytes_and_give_the_same_output(qtype: str) -> None:
    model = TinyGGUFModel(qtype=qtype)
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(1))
    originals = {n: ggml.stored(t).clone() for n, t in model.blocks[1].named_parameters()}
    with torch.no_grad():
        ref = model(x)
        st = _streamer(model)
        assert st.plan.streamed == (1, 3)
        # a slot holds the file's bytes: Q8_0 is 34 bytes per 32 weights, Q4_K 144 per 256, far below bf16
        raw_bytes = sum(ggml.stored(t).numel() * ggml.stored(t).element_size() for t in model.blocks[1].parameters())
        assert raw_bytes <= offload.block_nbytes(model.blocks[1]) < raw_bytes + 256 * 8
        st.activate()
        for _ in range(3):
            seen = []
            assert torch.equal(_forward(model, st, x, seen), ref)
            inside = dict(seen)[1]  # block 1's weight while it ran: a view into the ring
            assert type(inside) is GGMLTensor and isinstance(inside, torch.nn.Parameter)
            assert inside.tensor_type == model.blocks[0].q.weight.tensor_type and inside.shape == (256, 256)
            assert any(s.flat.data_ptr() <= inside.data_ptr() < s.flat.data_ptr() + s.flat.numel() for s in st.slots)
        between = model.blocks[1].q.weight  # between forwards: a view into the host arena, still a GGML tensor
        assert type(between) is GGMLTensor and st.arena.contains(between)
        for n, t in model.blocks[1].named_parameters():
            assert torch.equal(ggml.stored(t), originals[n]), n
        st.release()
        assert torch.equal(model(x), ref)


def test_patches_set_on_a_streamed_tensor_reach_every_view_it_is_bound_to() -> None:
    model, patched = TinyGGUFModel(seed=2), TinyGGUFModel(seed=2)
    x = torch.randn(1, 3, 256, generator=torch.Generator().manual_seed(3))
    delta = torch.randn(256, 256, generator=torch.Generator().manual_seed(4)) * 0.01
    patched.blocks[1].q.weight.patches = [(delta, "blocks.1.q.weight")]
    with torch.no_grad():
        ref, ref_patched = model(x), patched(x)
        assert not torch.equal(ref, ref_patched)
        st = _streamer(model, swap=2, prefetch=2)
        st.activate()
        assert torch.equal(_forward(model, st, x), ref)  # GPU views exist now; they must get the patches too
        st.set_tensor_attr(1, "q.weight", "patches", [(delta, "blocks.1.q.weight")])
        for _ in range(2):
            assert torch.equal(_forward(model, st, x), ref_patched)
        st.detach()
        st.activate()  # a kept arena: the patches stay
        assert torch.equal(_forward(model, st, x), ref_patched)
        st.set_tensor_attr(1, "q.weight", "patches", [])
        assert torch.equal(_forward(model, st, x), ref)
        st.release()


def test_an_idle_gguf_block_goes_back_to_the_file_and_its_private_tensors_get_copies(tmp_path) -> None:
    """Weights mapped from a GGUF file (as ComfyUI-GGUF reads it), biases private: idle = weights on the file, each
    private GGML tensor copied into memory of its own (a GGML tensor's ``clone`` returns itself)."""
    model = TinyGGUFModel(n=4)
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch="wan")
    for name, t in model.named_parameters():
        if name.endswith("weight"):
            writer.add_tensor(name, ggml.stored(t).numpy(), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for tensor in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors:  # mapped, as ComfyUI-GGUF's loader keeps them
        module = model.get_submodule(tensor.name.rpartition(".")[0])
        module.weight = as_ggml(torch.from_numpy(np.asarray(tensor.data)), tensor.tensor_type, module.weight.shape)
    assert host_memory.is_file_backed(model.blocks[1].q.weight)
    x = torch.randn(1, 3, 256, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(x)
        st = _streamer(model, swap=2)
        st.activate()
        b = st.plan.streamed[0]
        arena_bias = model.blocks[b].q.bias
        assert st.arena.contains(arena_bias) and st.drops_arena_on_release()
        st.release()
        assert st.arena is None and host_memory.is_file_backed(model.blocks[b].q.weight)
        bias = model.blocks[b].q.bias
        assert type(bias) is GGMLTensor and bias.tensor_type == gguf.GGMLQuantizationType.F32
        assert bias.data_ptr() != arena_bias.data_ptr() and torch.equal(ggml.stored(bias), ggml.stored(arena_bias))
        assert torch.equal(model(x), ref)
        st.activate()  # and back into a new arena
        assert torch.equal(_forward(model, st, x), ref)
        st.release()


def test_a_tensor_with_a_ggml_type_but_no_real_shape_is_not_streamed() -> None:
    m = torch.nn.Linear(4, 4)
    t = torch.randn(4, 4).as_subclass(GGMLTensor)
    t.tensor_type = gguf.GGMLQuantizationType.Q8_0
    m.weight = torch.nn.Parameter(t, requires_grad=False)
    assert not ggml.is_ggml(m.weight)
    with pytest.raises(TypeError, match="weight holds a GGMLTensor, which Block Swap cannot stream"):
        offload.block_tensors(m)
