"""The pack makes no network calls at run time.

- Static: no module that runs inside ComfyUI (``__init__.py``, ``kernels/``, ``nodes/``) imports a network library.
  ``cli/server.py`` is the command-line runner's client: it talks HTTP to the local ComfyUI it starts, outside ComfyUI.
- In process (needs COMFYUI_PATH): with every socket connect and name lookup refused, the Wan path runs end to end
  (loader quantizing a file, Attention auto, Block Swap, KSampler's sampling path) and the Wan Text Encode path
  encodes and caches prompts (the tokenizer comes from the file, nothing is downloaded).
"""

from __future__ import annotations

import ast
import socket
from pathlib import Path

import pytest

PACK = Path(__file__).resolve().parents[2]
NETWORK_MODULES = {"socket", "urllib", "urllib3", "http", "requests", "httpx", "aiohttp", "huggingface_hub",
                   "ftplib", "smtplib", "websocket", "websockets", "xmlrpc", "telnetlib"}


def _runtime_files() -> list[Path]:
    runtime = ("kernels", "nodes", "host", "offload", "checkpoints", "doctor")  # what runs inside ComfyUI
    return [PACK / "__init__.py", *(f for package in runtime for f in sorted((PACK / package).rglob("*.py")))]


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_runtime_module_imports_a_network_library() -> None:
    files = _runtime_files()
    assert len(files) > 10, files
    offenders = {str(f.relative_to(PACK)): sorted(_imported_roots(f) & NETWORK_MODULES) for f in files}
    assert not {f: m for f, m in offenders.items() if m}


def test_the_static_check_sees_imports() -> None:
    """The scan is not vacuous: it finds the runner's HTTP client."""
    assert {"socket", "urllib"} <= _imported_roots(PACK / "cli" / "server.py")


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Refuse every outgoing connection and name lookup in this process; returns the attempts."""
    attempts: list[tuple] = []

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(args[1:] if args and isinstance(args[0], socket.socket) else args)
        raise OSError("network access is disabled in this test")

    for name in ("connect", "connect_ex", "sendto"):
        monkeypatch.setattr(socket.socket, name, refuse)
    for name in ("getaddrinfo", "create_connection", "gethostbyname"):
        monkeypatch.setattr(socket, name, refuse)
    return attempts


@pytest.mark.comfyui
def test_wan_path_runs_offline(tmp_path: Path, no_network: list[tuple], monkeypatch: pytest.MonkeyPatch) -> None:
    from comfy_server import comfyui_in_process_or_skip, sample_wan

    comfyui_in_process_or_skip()
    import folder_paths
    import torch

    from comfyui_lowvram_dit.synthetic import checkpoints as synth
    from comfyui_lowvram_dit.synthetic.specs import UMT5Config
    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.host.attention import apply_attention
    from comfyui_lowvram_dit.host.block_swap import apply_block_swap
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model
    from comfyui_lowvram_dit.host.wan_text import encode_wan_prompts

    monkeypatch.setattr(folder_paths, "get_user_directory", lambda: str(tmp_path / "user"))
    with pytest.raises(OSError, match="disabled"):  # the guard is live
        socket.create_connection(("example.com", 80), timeout=1)
    no_network.clear()

    wan = synth.write_synthetic("wan22_t2v_14B", tmp_path / "wan.safetensors", size="tiny", fmt="bf16", seed=3,
                                num_layers=4)
    model = apply_block_swap(apply_attention(load_wan_model(wan, "per_tensor"), "auto"),
                             SwapConfig(blocks_to_swap=2))
    assert torch.isfinite(sample_wan(model, seed=1)).all()

    te = synth.write_synthetic("umt5_xxl_enc", tmp_path / "umt5.safetensors", fmt="bf16", seed=4,
                               config=UMT5Config(num_layers=24, d_ff=64, num_heads=2, vocab_size=512))
    first, _ = encode_wan_prompts(te, ["a red fox in the snow", ""])
    again, _ = encode_wan_prompts(te, ["a red fox in the snow", ""])  # from the on-disk cache
    assert torch.equal(first[0][0][0], again[0][0][0])
    assert any((tmp_path / "user").rglob("*")), "nothing was cached under the user directory"
    assert no_network == [], f"network access attempted: {no_network}"
