"""kernels/hooks.py on the CPU: chain order, replace and remove, try/finally around blocks, copies stay apart."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from comfyui_lowvram_dit.kernels.compile import CompileConfig, CompiledRegions, CompileHook
from comfyui_lowvram_dit.kernels.hooks import HookRegistry, ModelHook, PerModel, find_blocks
from comfyui_lowvram_dit.kernels.nan_guard import NanGuardHook, NonFiniteError


class Recorder(ModelHook):
    """Appends what it sees to a shared list."""

    PER_BLOCK = True

    def __init__(self, tag: str, seen: list, order: int = 50) -> None:
        self.tag, self.seen, self.ORDER = tag, seen, order

    def pre_forward(self, module: Any) -> None:
        self.seen.append(f"{self.tag}>")

    def post_forward(self, module: Any, output: Any) -> Any:
        self.seen.append(f"<{self.tag}")
        return output + 1

    def pre_block(self, index: int, inputs: Any) -> None:
        self.seen.append(f"{self.tag}{index}>")

    def post_block(self, index: int, outputs: Any) -> Any:
        self.seen.append(f"<{self.tag}{index}")
        return outputs


def test_chain_runs_by_order_then_registration_and_post_hooks_can_replace_the_output() -> None:
    seen: list[str] = []
    reg = HookRegistry()
    reg.register("b", Recorder("b", seen, order=50))
    reg.register("a", Recorder("a", seen, order=10))
    reg.register("c", Recorder("c", seen, order=50))
    assert reg.names() == ["a", "b", "c"]
    assert reg.run_forward(None, lambda: seen.append("fwd") or 0) == 3  # each post_forward added 1
    assert seen == ["a>", "b>", "c>", "fwd", "<c", "<b", "<a"]
    seen.clear()
    assert reg.run_block(4, "x", lambda a: seen.append(a) or "y") == "y"
    assert seen == ["a4>", "b4>", "c4>", "x", "<c4", "<b4", "<a4"]


def test_register_replaces_by_name_remove_is_symmetric_and_copies_stay_apart() -> None:
    seen: list[str] = []
    first, second = Recorder("1", seen), Recorder("2", seen)
    reg = HookRegistry()
    reg.register("guard", first)
    copy = reg.copy()
    reg.register("guard", second)  # the last one wins
    assert len(reg) == 1 and reg.get("guard") is second and copy.get("guard") is first
    assert reg.remove("guard") is second and len(reg) == 0 and not reg.per_block
    assert reg.remove("guard") is None
    assert reg.run_forward(None, lambda: 7) == 7 and reg.run_block(0, 1, lambda a: a + 1) == 2
    with pytest.raises(TypeError, match="is not a ModelHook"):
        reg.register("x", object())  # type: ignore[arg-type]


def test_a_hook_without_block_methods_is_left_out_of_the_block_chain() -> None:
    reg = HookRegistry()
    reg.register("plain", ModelHook())
    assert not reg.per_block and not reg.moves_weights()
    assert reg.run_block(0, 1, lambda a: a * 5) == 5


def test_nan_guard_hook_names_the_first_bad_block_through_the_chain() -> None:
    guard = NanGuardHook("blocks", "raise")
    reg = HookRegistry({"guard": guard})

    def forward() -> torch.Tensor:
        x = torch.ones(2, 3)
        for i in range(4):
            x = reg.run_block(i, {"img": x, "txt": None}, lambda a: {"img": a["img"] * (float("nan") if i == 2 else 1)})
            x = x["img"]
        return x

    with pytest.raises(NonFiniteError, match=r"transformer block 2 \(blocks\.2\)"):
        reg.run_forward(None, forward)
    with pytest.raises(ValueError, match="action must be one of"):
        NanGuardHook("blocks", "ignore")


def test_compile_hook_gives_up_cuda_graphs_when_another_hook_moves_weights_and_runs_eager_on_partial_load() -> None:
    class Streams(ModelHook):
        MOVES_WEIGHTS = True

    root = torch.nn.Module()
    root.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    def run(registry: HookRegistry, lowvram: bool) -> CompiledRegions:
        regions = CompiledRegions(CompileConfig(mode="reduce-overhead"), ["blocks.0"], compile_fn=lambda m, **k: m)
        registry.register("compile", CompileHook(regions, partial_load=lambda module: lowvram))
        registry.run_forward(root, lambda: None)
        return regions

    assert not run(HookRegistry(), lowvram=False).streaming_adjusted
    assert run(HookRegistry({"swap": Streams()}), lowvram=False).streaming_adjusted
    partial = run(HookRegistry(), lowvram=True)  # the host streams single layers: no compiled call at all
    assert not partial.streaming_adjusted and "eager (the host loaded this model partially" in partial.status()


def test_find_blocks_names_the_caller_when_there_is_no_block_list() -> None:
    model = torch.nn.Module()
    model.transformer_blocks = torch.nn.ModuleList([torch.nn.Identity()])
    assert find_blocks(model, "X")[0] == "transformer_blocks"
    with pytest.raises(ValueError, match="^Block Swap: Module has no `blocks`/`transformer_blocks` list"):
        find_blocks(torch.nn.Module(), "Block Swap")


class PerModelRecorder(Recorder):
    """A Recorder whose every model gets its own instance (tagged with the model's name)."""

    def __init__(self, tag: str, seen: list) -> None:
        super().__init__(tag, seen)
        self.models = PerModel()

    def for_model(self, module: Any) -> ModelHook:
        return self.models.get(module, self, lambda: PerModelRecorder(f"{self.tag}:{module.name}", self.seen))


def test_two_models_in_two_threads_each_run_their_own_hook_instance() -> None:
    """ComfyUI's MultiGPU split: one registry (the first model's wrappers) serves a model copy per GPU, each in
    its own thread at the same time; blocks must reach the hook instance of the forward that runs them."""
    import threading

    seen: list[str] = []
    reg = HookRegistry()
    reg.register("r", PerModelRecorder("r", seen))
    models = [torch.nn.Module(), torch.nn.Module()]
    models[0].name, models[1].name = "a", "b"
    inside = threading.Barrier(2)

    def forward(model: torch.nn.Module) -> None:
        def call() -> int:
            inside.wait(5)  # both forwards are in flight before either runs its block
            reg.run_block(0, 1, lambda x: x)
            return 0
        reg.run_forward(model, call)

    threads = [threading.Thread(target=forward, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    forwards = {x[:-1] for x in seen if x.endswith(">") and not x.endswith("0>")}
    blocks = {x[:-2] for x in seen if x.endswith("0>")}
    assert len(forwards) == 2 and blocks == forwards  # each forward's block ran through that forward's instance


def test_only_a_per_sample_hook_makes_the_registry_per_sample() -> None:
    regions = CompiledRegions(CompileConfig(), ["blocks.0"], compile_fn=lambda m, **k: m)
    assert not HookRegistry({"r": Recorder("r", [])}).per_sample
    assert HookRegistry({"r": Recorder("r", []), "compile": CompileHook(regions)}).per_sample


def test_split_per_sample_slices_batched_tensors_and_per_chunk_options() -> None:
    from comfyui_lowvram_dit.host.hooks import split_per_sample

    x, t, context, shared = torch.randn(2, 3), torch.tensor([5.0, 5.0]), torch.randn(2, 4, 8), torch.randn(1, 7)
    refs = [torch.randn(2, 3), torch.randn(2, 5)]
    sigmas = torch.tensor([5.0])
    options = {"cond_or_uncond": [0, 1], "uuids": ["c", "u"], "sigmas": sigmas, "patches": {"p": [1]}}
    calls = split_per_sample((x, t, None, context, None, options), {"ref_latents": refs, "clip": shared, "n": 2})
    assert calls is not None and len(calls) == 2
    for i, (args, kwargs) in enumerate(calls):
        assert torch.equal(args[0], x[i:i + 1]) and torch.equal(args[1], t[i:i + 1])
        assert args[2] is None and torch.equal(args[3], context[i:i + 1]) and args[4] is None
        assert args[5]["cond_or_uncond"] == [i] and args[5]["uuids"] == ["cu"[i]]
        assert args[5]["sigmas"] is sigmas and args[5]["patches"] is options["patches"]
        assert [r.shape[0] for r in kwargs["ref_latents"]] == [1, 1]
        assert torch.equal(kwargs["ref_latents"][1], refs[1][i:i + 1])
        assert kwargs["clip"] is shared and kwargs["n"] == 2  # a leading 1 broadcasts; non-tensors pass
    assert options["cond_or_uncond"] == [0, 1]  # the caller's options are left as they were


def test_split_per_sample_maps_samples_to_their_chunk_and_leaves_what_it_cannot_split() -> None:
    from comfyui_lowvram_dit.host.hooks import split_per_sample

    x, t = torch.randn(4, 3), torch.zeros(4)
    calls = split_per_sample((x, t), {"transformer_options": {"cond_or_uncond": [1, 0]}})
    assert calls is not None and [k["transformer_options"]["cond_or_uncond"] for _, k in calls] == [[1], [1], [0], [0]]
    assert split_per_sample((x[:1], t[:1]), {}) is None  # a batch of one
    assert split_per_sample((x, t, None, None, object(), {}), {}) is None  # a ControlNet, positional
    assert split_per_sample((x, t), {"control": {"output": []}}) is None  # a ControlNet, keyword
    assert split_per_sample((x, t), {"odd": torch.zeros(3, 2)}) is None  # a leading dim that is not the batch
    assert split_per_sample((x, t), {"transformer_options": {"uuids": ["a", "b", "c"]}}) is None
