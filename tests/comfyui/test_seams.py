"""ComfyUI seam detection (host/seams.py): a node whose seams are missing is left out or passes its MODEL through,
with a message naming the node, the missing name and the ComfyUI version; the pack imports without Triton.

CPU tests build a fake ComfyUI on disk from the seam table itself (every probed name exists; the objects that
behaviour probes exercise follow the protocol, or ignore it when a test breaks them), then drop or break one and
check what the real node classes become. The ``comfyui`` tests check the table against a real ComfyUI (each
supported host: no seam falsely missing).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from comfyui_lowvram_dit.host import log as _log
from comfyui_lowvram_dit.host import seams as _seams

REPO = Path(__file__).resolve().parents[2]
LOGGER = "comfyui_lowvram_dit"
# Every top-level module the fake writes (each probe's, comfy_api, comfyui_version): all set aside and forgotten, or a
# fake one (node_helpers, comfy_extras) outlives the test and real ComfyUI modules imported later are built on it.
FAKE_TOP_LEVEL = {p.target.partition(":")[0].split(".")[0] for probes in _seams.SEAMS.values() for p in probes} | {
    "comfy_api", "comfyui_version"}

# A minimal comfy_api.latest: enough for the pack's node modules to import and build their schemas.
FAKE_COMFY_API = '''
import types

class ComfyNode:
    pass

class ComfyExtension:
    pass

class Schema:
    def __init__(self, **kw):
        self.description = ""
        self.inputs, self.outputs = [], []
        self.__dict__.update(kw)

class NodeOutput:
    def __init__(self, *args, **kw):
        self.args, self.ui = args, kw.get("ui")

class _Port:
    def __init__(self, io_type):
        self.io_type = io_type
    def Input(self, id, **kw):
        return types.SimpleNamespace(id=id, io_type=self.io_type, **kw)
    def Output(self, id=None, **kw):
        return types.SimpleNamespace(id=id, io_type=self.io_type, **kw)

_TYPES = ("Model", "Clip", "Conditioning", "Vae", "Latent", "Image", "Int", "Float", "Boolean", "String", "Combo")
Hidden = types.SimpleNamespace(prompt="PROMPT", unique_id="UNIQUE_ID", extra_pnginfo="EXTRA_PNGINFO")
io = types.SimpleNamespace(ComfyNode=ComfyNode, Schema=Schema, NodeOutput=NodeOutput, Hidden=Hidden,
                           **{t: _Port(t.upper()) for t in _TYPES})
ui = types.SimpleNamespace(PreviewText=lambda text: text)
'''


def _emit(tree: dict, indent: str = "") -> list[str]:
    """Source for a nested {name: subtree | None} tree: subtrees become classes, leaves functions."""
    lines = []
    for name, sub in tree.items():
        if isinstance(sub, dict):
            lines += [f"{indent}class {name}:", f"{indent}    pass"] + _emit(sub, indent + "    ")
        else:
            args = "self, *a, **k" if indent else "*a, **k"
            lines += [f"{indent}def {name}({args}):", f"{indent}    return None"]
    return lines


# The objects behaviour probes exercise, as a ComfyUI that keeps each protocol ({"ok"}) or drops it ({"broken"}).
_BLOCK_MODEL = '''
class {name}:
    def __init__(self, **kwargs):
        pass
    def parameters(self):
        return []
    def state_dict(self):
        return {{}}
    def __call__(self, x, t, context, transformer_options=None, **kwargs):
        patch = (transformer_options or {{}}).get("patches_replace", {{}}).get("dit", {{}}).get(("double_block", 0))
        if patch is None or {broken}:
            return x
        return patch({{"img": x}}, {{"original_block": lambda args: args}})
'''
_ATTENTION = '''
def optimized_attention(q, k, v, heads, transformer_options=None, **kwargs):
    override = (transformer_options or {{}}).get("optimized_attention_override")
    if override is None or {broken}:
        return q
    return override(lambda *a, **k: q, q, k, v, heads)
'''
_LOADER = '''
def load_diffusion_model_state_dict(sd, model_options=None):
    ops = (model_options or {{}}).get("custom_operations")
    return None if ops is None or {broken} else ops.Linear(2, 2)
'''
_OPS = '''
class _Linear:
    def __init__(self, *args, **kwargs):
        pass
    def forward_comfy_cast_weights(self, *args, **kwargs):
        return None
class manual_cast:
    Linear = _Linear
disable_weight_init = manual_cast
'''
FAKE_BEHAVIOURS = {
    "comfy.ldm.wan.model:WanModel": _BLOCK_MODEL.replace("{name}", "WanModel"),
    "comfy.ldm.qwen_image.model:QwenImageTransformer2DModel":
        _BLOCK_MODEL.replace("{name}", "QwenImageTransformer2DModel"),
    "comfy.ldm.modules.attention:optimized_attention": _ATTENTION,
    "comfy.sd:load_diffusion_model_state_dict": _LOADER,
}


def write_fake_comfyui(root: Path, version: str, drop: tuple[str, ...] = (), broken: tuple[str, ...] = ()) -> None:
    """A ComfyUI tree in which every seam probe passes, minus the targets in ``drop`` (absent) and ``broken``
    (present, but ignoring the protocol their behaviour probe checks)."""
    modules: dict[str, dict] = {}
    extra: dict[str, list[str]] = {"comfy.ops": [_OPS]}
    for probes in _seams.SEAMS.values():
        for p in probes:
            module, _, path = p.target.partition(":")
            if module.startswith("comfy_api") or p.target in drop:
                continue
            if p.check is not None:
                source = FAKE_BEHAVIOURS[p.target].replace("{broken}", str(p.target in broken))
                extra.setdefault(module, []).append(source.replace("{{", "{").replace("}}", "}"))
                modules.setdefault(module, {})
                continue
            node = modules.setdefault(module, {})
            *parents, leaf = path.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node.setdefault(leaf, None)
    root.mkdir(parents=True, exist_ok=True)
    for module in set(modules) | set(extra):
        parts = module.split(".")
        for i in range(1, len(parts)):  # packages along the way
            pkg = root.joinpath(*parts[:i])
            pkg.mkdir(parents=True, exist_ok=True)
            (pkg / "__init__.py").touch()
        body = _emit(modules.get(module, {})) + extra.get(module, [])
        root.joinpath(*parts[:-1], parts[-1] + ".py").write_text("\n".join(body) + "\n")
    api = root / "comfy_api" / "latest"  # comfy_api is a namespace package in ComfyUI too (no __init__.py)
    api.mkdir(parents=True, exist_ok=True)
    (api / "__init__.py").write_text(FAKE_COMFY_API)
    (root / "comfyui_version.py").write_text(f'__version__ = "{version}"\n')


@pytest.fixture
def fake_comfy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """Returns ``load(version, drop=(), broken=()) -> list of node classes after the seam guard``; every module
    imported meanwhile (fake ComfyUI, the pack's node modules) is forgotten afterwards.

    A real ComfyUI (and the node modules built on it) that an earlier in-process test imported is set aside
    first and put back afterwards, so the fake is what the nodes see whatever ran before."""
    def ours(name: str) -> bool:  # only ComfyUI's and the node modules (torch's lazily loaded parts must stay)
        return name.split(".")[0] in FAKE_TOP_LEVEL or name.startswith("comfyui_lowvram_dit.nodes.")

    saved = {name: mod for name, mod in sys.modules.items() if ours(name)}
    roots: list[str] = []

    def forget() -> None:
        # The parent package's attribute goes too: `from package import mod` reads that attribute before
        # sys.modules, so a later test would get the fake-built module back.
        for name in [n for n in sys.modules if ours(n)]:
            mod = sys.modules.pop(name)
            parent, _, child = name.rpartition(".")
            if parent in sys.modules and getattr(sys.modules[parent], child, None) is mod:
                delattr(sys.modules[parent], child)

    def restore() -> None:
        sys.modules.update(saved)
        for name, mod in saved.items():
            parent, _, child = name.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, mod)

    def load(version: str, drop: tuple[str, ...] = (), broken: tuple[str, ...] = ()) -> list[type]:
        forget()
        _seams.forget_probe_results()
        root = tmp_path / f"comfy{len(roots)}"
        write_fake_comfyui(root, version, drop, broken)
        if roots:
            sys.path.remove(roots[-1])
        roots.append(str(root))
        sys.path.insert(0, str(root))
        _log._SAID_ONCE.clear()
        from comfyui_lowvram_dit import nodes

        return nodes.load_node_classes()

    yield load
    forget()
    _seams.forget_probe_results()
    restore()
    if roots:
        sys.path.remove(roots[-1])
    _log._SAID_ONCE.clear()


def _by_name(classes: list[type]) -> dict[str, type]:
    return {c.__name__: c for c in classes}


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


def test_every_node_declares_known_seams_and_a_policy(fake_comfy) -> None:
    classes = fake_comfy("0.8.0")
    declared = [c for c in classes if getattr(c, "COMFY_SEAMS", ())]
    assert len(declared) >= 7  # every node but the Doctor (and Block Swap until it declares; see host/seams.py)
    for cls in declared:
        assert set(cls.COMFY_SEAMS) <= set(_seams.SEAMS), cls.__name__
        assert cls.IF_SEAMS_MISSING in (_seams.PASS_THROUGH, _seams.DISABLE), cls.__name__
    assert _by_name(classes)["NanGuard"].IF_SEAMS_MISSING == _seams.PASS_THROUGH
    assert _by_name(classes)["WanLoader"].IF_SEAMS_MISSING == _seams.DISABLE


def test_complete_comfyui_keeps_every_node_unchanged(fake_comfy, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    classes = fake_comfy("0.8.0")
    assert all(not hasattr(c, "SEAM_PROBLEM") for c in classes)
    assert {c.__name__ for c in classes} >= {"WanLoader", "BlockSwap", "AttentionSelect", "TorchCompile",
                                             "QwenImageStagedLoader", "QwenImageEditStagedLoader",
                                             "QwenImageDecode", "WanTextEncode",
                                             "NanGuard", "Doctor"}
    assert _warnings(caplog) == []
    assert set(_seams.seam_status().values()) == {"ok"}


def test_missing_wrapper_makes_model_patches_pass_through_and_loaders_disappear(fake_comfy, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    gone = "comfy.patcher_extension:WrappersMP.APPLY_MODEL"
    classes = _by_name(fake_comfy("0.7.2", drop=(gone,)))
    startup = _warnings(caplog)
    # NaN Guard needs the wrapper: it stays in the menu and passes the model through.
    guard = classes["NanGuard"]
    assert guard.SEAM_PROBLEM == ("NaN Guard (LowVRAM) passes the model through unchanged: this ComfyUI (0.7.2) "
                                  "lacks comfy.patcher_extension.WrappersMP.APPLY_MODEL; the pack needs ComfyUI "
                                  ">= 0.8.0. Update ComfyUI.")
    assert guard.define_schema().description.startswith(guard.SEAM_PROBLEM)
    model = object()
    caplog.clear()
    for _ in range(2):
        out = guard.execute(model=model, action="raise")
        assert out.args == (model,)
    assert _warnings(caplog) == [f"lowvram_dit: {guard.SEAM_PROBLEM}"]  # once, at the first run
    # The Qwen-Image loader calls Block Swap, which needs it too: a loader has nothing to pass, so it is left out.
    assert {"QwenImageStagedLoader", "QwenImageEditStagedLoader", "QwenImageLoader"}.isdisjoint(classes)
    for label in ("Qwen-Image Staged Loader", "Qwen-Image-Edit Staged Loader", "Qwen-Image Loader"):
        assert any(m.startswith(f"lowvram_dit: {label} (LowVRAM) is disabled: this ComfyUI (0.7.2) "
                                "lacks comfy.patcher_extension.WrappersMP.APPLY_MODEL") for m in startup), label
    # Nodes that do not use it are untouched.
    for name in ("WanLoader", "AttentionSelect", "QwenImageDecode", "WanTextEncode", "QwenImageTextEncode",
                 "QwenImageEditTextEncode", "Doctor"):
        assert name in classes and not hasattr(classes[name], "SEAM_PROBLEM"), name
    # Block Swap needs the wrapper too and passes the model through (ComfyUI's own partial loading still works).
    assert any(m.startswith("lowvram_dit: Block Swap (LowVRAM) passes the model through unchanged") for m in startup)
    # Torch Compile runs in the same hook chain: it passes the model through (it runs eager).
    assert any(m.startswith("lowvram_dit: Torch Compile (LowVRAM) passes the model through unchanged") for m in startup)
    assert len(startup) == 6  # one line per affected node


def test_missing_folder_paths_function_disables_the_loaders_naming_a_newer_comfyui(fake_comfy, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    classes = _by_name(fake_comfy("0.9.1", drop=("folder_paths:get_user_directory",)))
    assert {"WanLoader", "WanTextEncode", "QwenImageStagedLoader", "QwenImageEditStagedLoader"}.isdisjoint(classes)
    assert {"AttentionSelect", "NanGuard", "TorchCompile", "QwenImageDecode", "Doctor"} <= set(classes)
    msg = next(m for m in _warnings(caplog) if "Wan 2.2 Loader" in m)
    assert msg == ("lowvram_dit: Wan 2.2 Loader (LowVRAM) is disabled: this ComfyUI (0.9.1) lacks "
                   "folder_paths.get_user_directory; the pack needs ComfyUI >= 0.8.0 and was checked on 0.8.0 to 0.33.0; "
                   "a newer ComfyUI may have moved it: update comfyui-lowvram-dit (or report it with this message).")


def test_changed_protocol_is_detected_from_behaviour(fake_comfy, caplog) -> None:
    """Wan's model still exists but its forward no longer runs patches_replace["dit"][("double_block", i)]."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    classes = _by_name(fake_comfy("0.40.0", broken=("comfy.ldm.wan.model:WanModel",)))
    assert ("comfy.ldm.wan.model.WanModel (behaviour: Wan's forward runs per-block replace patches"
            in classes["NanGuard"].SEAM_PROBLEM)
    assert not hasattr(classes["AttentionSelect"], "SEAM_PROBLEM")
    assert _seams.seam_status()["dit.block_replace"].startswith("missing: comfy.ldm.wan.model.WanModel")


def test_attention_override_missing_passes_through(fake_comfy) -> None:
    classes = _by_name(fake_comfy("0.8.0", broken=("comfy.ldm.modules.attention:optimized_attention",)))
    problem = classes["AttentionSelect"].SEAM_PROBLEM
    assert problem.startswith("Attention (LowVRAM) passes the model through unchanged: this ComfyUI (0.8.0) lacks "
                              "comfy.ldm.modules.attention.optimized_attention (behaviour: ComfyUI's attention entry "
                              "point hands the call to")
    assert not hasattr(classes["TorchCompile"], "SEAM_PROBLEM")


def test_custom_operations_ignored_disables_the_loaders(fake_comfy) -> None:
    classes = _by_name(fake_comfy("0.8.0", broken=("comfy.sd:load_diffusion_model_state_dict",)))
    assert "WanLoader" not in classes and "AttentionSelect" in classes


def test_probes_never_raise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "lowvram_broken_mod.py").write_text("raise RuntimeError('broken at import')\n")
    (tmp_path / "lowvram_exiting_mod.py").write_text("import sys\nsys.exit('exits at import')\n")
    (tmp_path / "lowvram_ok_mod.py").write_text("value = 1\nf = len\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "lowvram_blocked_mod", None)
    assert not _seams.Probe("lowvram_broken_mod:x").ok()
    assert not _seams.Probe("lowvram_exiting_mod:x").ok()
    assert not _seams.Probe("lowvram_blocked_mod:x").ok()
    assert not _seams.Probe("lowvram_ok_mod:value.real.nope").ok()
    assert not _seams.Probe("lowvram_ok_mod:f", lambda obj: 1 / 0).ok()  # a behaviour check that raises
    assert not _seams.Probe("lowvram_ok_mod:value", lambda obj: obj == 2).ok()
    assert _seams.Probe("lowvram_ok_mod:value", lambda obj: obj == 1).ok()
    assert _seams.Probe("lowvram_ok_mod:value.real").ok()
    assert _seams.missing_probes("no.such.seam") == ["(unknown seam 'no.such.seam' in host/seams.py)"]


def test_a_broken_check_keeps_the_node(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    class Weird:
        COMFY_SEAMS = ("folder_paths",)

    def boom(names):
        raise TypeError("unexpected")

    monkeypatch.setattr(_seams, "missing_seams", boom)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert _seams.guard_nodes([Weird]) == [Weird]
    assert "could not check the ComfyUI seams of Weird" in _warnings(caplog)[0]


def test_version_outside_comfyui_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "comfyui_version", None)
    monkeypatch.setitem(sys.modules, "folder_paths", None)
    msg = _seams.seam_problem("Wan 2.2 Loader (LowVRAM)", ["folder_paths"])
    assert msg.startswith("Wan 2.2 Loader (LowVRAM) is disabled: this ComfyUI (unknown) lacks "
                          "folder_paths.get_filename_list, folder_paths.get_full_path, "
                          "folder_paths.get_full_path_or_raise (and 2 more); the pack needs ComfyUI >= 0.8.0")
    assert _seams.seam_problem("x", []) is None


# ---- without Triton ---------------------------------------------------------------------------------------------

NO_TRITON_SCRIPT = r"""
import importlib, json, pkgutil, sys
sys.modules["triton"] = None  # "import triton" -> ImportError, as on a machine without it
sys.modules["triton.language"] = None
sys.path.insert(0, sys.argv[1])  # the fake ComfyUI (so the node modules import too)
import comfyui_lowvram_dit.kernels as k
import comfyui_lowvram_dit.nodes as n
failed = {}
for pkg in (k, n):
    for m in pkgutil.iter_modules(pkg.__path__):
        name = f"{pkg.__name__}.{m.name}"
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
import torch
from comfyui_lowvram_dit.kernels import attention, attention_int8, fp8_triton
from comfyui_lowvram_dit.doctor import report as doctor
classes = n.load_node_classes()
report = doctor.collect(gpu_probes=False)
print(json.dumps({
    "failed": failed,
    "fp8_triton": fp8_triton.TRITON_AVAILABLE,
    "int8_supported": attention_int8.is_supported("cuda", torch.bfloat16, 128),
    "int8_reason": attention.unavailable_reason("int8", torch.device("cuda"), torch.bfloat16, 128),
    "triton_import_error": report["versions"].get("triton_import_error"),
    "issues": [i["id"] for i in report["known_issues"]],
    "nodes": sorted(c.__name__ for c in classes),
}))
"""


def test_pack_imports_and_reports_without_triton(tmp_path: Path) -> None:
    import json

    write_fake_comfyui(tmp_path, "0.8.0")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", NO_TRITON_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=240, env=env, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    # The Triton and Gluon kernel files themselves need Triton; their one importer (attention_int8._triton_module,
    # ._gluon_module) guards each.
    assert set(r["failed"]) <= {"comfyui_lowvram_dit.kernels.attention_int8_triton",
                                "comfyui_lowvram_dit.kernels.attention_int8_gluon"}, r["failed"]
    assert all("triton" in v for v in r["failed"].values()), r["failed"]
    assert r["fp8_triton"] is False and r["int8_supported"] is False
    assert r["int8_reason"]  # reported unavailable, with a reason
    assert r["triton_import_error"] and "triton" in r["triton_import_error"]
    assert len(r["nodes"]) >= 9, r["nodes"]  # no node needs Triton to register


# ---- the real ComfyUI -------------------------------------------------------------------------------------------


@pytest.mark.comfyui
def test_no_seam_is_missing_on_the_supported_comfyui() -> None:
    from comfy_server import comfyui_path_or_reason, import_comfyui_in_process

    comfy, reason = comfyui_path_or_reason()
    assert comfy is not None, reason
    import_comfyui_in_process(comfy)
    _seams.forget_probe_results()  # outcomes of an earlier (fake) ComfyUI in this process
    status = _seams.seam_status()
    assert {k: v for k, v in status.items() if v != "ok"} == {}
    from comfyui_lowvram_dit import nodes

    classes = [c for name in nodes.NODE_MODULES
               for c in getattr(__import__(f"comfyui_lowvram_dit.nodes.{name}", fromlist=["NODES"]), "NODES", ())]
    assert _seams.guard_nodes(classes) == classes  # every node kept as is (identity: no pass-through twins)


@pytest.mark.comfyui
def test_pass_through_twin_is_a_valid_v3_node_on_the_real_api(monkeypatch: pytest.MonkeyPatch) -> None:
    from comfy_server import comfyui_path_or_reason, import_comfyui_in_process

    comfy, reason = comfyui_path_or_reason()
    assert comfy is not None, reason
    import_comfyui_in_process(comfy)
    import comfy.patcher_extension as pe
    from comfyui_lowvram_dit.nodes.compile import TorchCompile

    monkeypatch.delattr(pe.WrappersMP, "APPLY_MODEL")
    _seams.forget_probe_results()
    try:
        (twin,) = _seams.guard_nodes([TorchCompile])
    finally:
        _seams.forget_probe_results()  # the attribute comes back when the test ends
    assert twin is not TorchCompile and issubclass(twin, TorchCompile)
    schema = twin.GET_SCHEMA()  # ComfyUI's own class + schema validation
    assert schema.node_id == "LowVRAM_TorchCompile"
    assert "lacks comfy.patcher_extension.WrappersMP.APPLY_MODEL" in schema.description
    locked = twin.PREPARE_CLASS_CLONE(None)  # as execution.py runs it: a clone, then a locked class
    model = object()
    out = locked.execute(model=model, mode="default", backend="inductor", dynamic="auto", fullgraph=False,
                         cache_size_limit=64, fallback=True, scope="blocks")
    assert out.result == (model,)


def test_no_seam_warning_in_the_server_log(comfy_server) -> None:
    log = comfy_server.log_text()
    bad = [ln for ln in log.splitlines() if "lowvram_dit" in ln and ("lacks" in ln or "seam" in ln)]
    assert not bad, "\n".join(bad)

