"""benchmarks/page_cache: model files out of the page cache for renders that read them from the disk."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from comfyui_lowvram_dit.benchmarks import page_cache
from comfyui_lowvram_dit.benchmarks import server_render

pytestmark = pytest.mark.skipif(not page_cache.supported(), reason="posix_fadvise is Linux only")


def _fs_type(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (longest mount point that prefixes it)."""
    best, kind = "", "?"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, right = line.split(" - ", 1)
        mount = left.split()[4]
        if str(path.resolve()).startswith(mount) and len(mount) > len(best):
            best, kind = mount, right.split()[0]
    return kind


def _models(tmp_path: Path, mib: int = 4) -> Path:
    folder = tmp_path / "models"
    (folder / "diffusion_models").mkdir(parents=True)
    f = folder / "diffusion_models" / "a.safetensors"
    with f.open("wb") as out:
        out.write(os.urandom(mib << 20))
        out.flush()
        os.fsync(out.fileno())
    (folder / "loras").mkdir()
    (folder / "loras" / "link.safetensors").symlink_to(f)
    return folder


def test_model_files_follow_links_and_list_each_file_once(tmp_path: Path) -> None:
    folder = _models(tmp_path)
    assert page_cache.model_files(folder) == [(folder / "diffusion_models" / "a.safetensors").resolve()]


def test_evict_drops_a_read_file_from_the_page_cache(tmp_path: Path) -> None:
    folder = _models(tmp_path)
    f = folder / "diffusion_models" / "a.safetensors"
    assert f.read_bytes()  # read: now cached
    size = f.stat().st_size
    assert page_cache.resident_bytes(f) == size
    if _fs_type(f) in ("tmpfs", "ramfs"):
        pytest.skip("a RAM filesystem's pages are the file itself: nothing to drop")
    assert page_cache.evict(folder) == size
    assert page_cache.resident_bytes(f) < size // 8  # the kernel may read a few pages back at once
    f.read_bytes()
    assert page_cache.resident_bytes(f) == size


def test_cold_read_times_the_largest_file_and_leaves_it_evicted(tmp_path: Path) -> None:
    folder = _models(tmp_path, mib=8)
    (folder / "vae").mkdir()
    (folder / "vae" / "small.safetensors").write_bytes(b"x" * 4096)
    big = folder / "diffusion_models" / "a.safetensors"
    gbs = page_cache.cold_read_gbs(folder, nbytes=4 << 20)
    assert gbs is not None and gbs > 0
    if _fs_type(big) not in ("tmpfs", "ramfs"):
        assert page_cache.resident_bytes(big) < big.stat().st_size // 8
    assert page_cache.cold_read_gbs(tmp_path / "empty_folder_that_does_not_exist") is None


def test_the_report_says_whether_the_page_cache_was_dropped() -> None:
    assert "not dropped" in server_render.page_cache_note(False, None)
    note = server_render.page_cache_note(True, 1.234)
    assert "dropped before every render" in note and "1.23 GB/s" in note
    assert "not measured" in server_render.page_cache_note(True, None)
    bounded = server_render.page_cache_note(False, 1.78, 32.0)  # --ram-gib: the cache is what fits
    assert "bounded by the emulated 32 GiB" in bounded and "1.78 GB/s" in bounded and "each row's start" in bounded
    assert "dropped before every render" in server_render.page_cache_note(True, 1.78, 32.0)
    opts = server_render.parser().parse_args(["--drop-page-cache"])
    assert opts.drop_page_cache and not server_render.parser().parse_args([]).drop_page_cache


def test_every_render_of_a_row_starts_with_its_files_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    monkeypatch.setattr(page_cache, "evict", lambda folder: events.append(f"evict {folder.name}") or 0)

    def fake_render(srv, graph, kind, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        events.append(f"render {kind}")
        return {"status": "ok", "total_s": 1.0}

    monkeypatch.setattr(server_render, "render", fake_render)

    class Srv:
        def log_text(self) -> str:
            return ""

    graph = {"1": {"class_type": "KSampler", "inputs": {"seed": 1}}}
    for drop in (True, False):
        events.clear()
        opts = server_render.parser().parse_args(["--warm-repeats", "2", *(["--drop-page-cache"] if drop else [])])
        opts.models, opts.work = tmp_path / "models", tmp_path
        server_render.render_kind(Srv(), graph, "warm", opts, tmp_path, "row", True)
        assert events == (["evict models", "render warm"] * 2 if drop else ["render warm"] * 2)


def test_an_emulated_machines_row_starts_with_the_model_files_evicted(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """--ram-gib: every row's first render reads its files from the disk (none inherits what writing the models or
    the row before left in the page cache); without it, or with --drop-page-cache (every render), nothing here."""
    advised: list[Path] = []
    monkeypatch.setattr(page_cache, "evict", lambda folder: advised.append(folder) or 3 << 30)
    opts = server_render.parser().parse_args(["--models", str(tmp_path)])
    row = server_render.make_row("wan_t2v_4step", "native_best", 12.0)
    assert server_render.evict_at_row_start(opts, row) is None and advised == []
    row = dataclasses.replace(row, ram_gib=32.0)
    assert server_render.evict_at_row_start(opts, row) == 3.0 and advised == [tmp_path]
    opts.drop_page_cache = True
    assert server_render.evict_at_row_start(opts, row) is None and advised == [tmp_path]
