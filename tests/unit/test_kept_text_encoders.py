"""host/kept_text_encoders.py: when auto keeps a text encoder, and the one-per-kind slot (no ComfyUI needed)."""

from __future__ import annotations

import pytest
from comfyui_lowvram_dit.host import kept_text_encoders as kept

GIB = 1 << 30


def test_auto_keeps_from_48_gib_of_ram_and_the_choices_override_it() -> None:
    assert kept.keeps("auto", 64 * GIB)[0] and kept.keeps("auto", 48 * GIB)[0]
    keep, why = kept.keeps("auto", 47 * GIB)
    assert not keep and "47 GiB" in why and "48 GiB" in why, why
    assert kept.keeps("keep", 8 * GIB) == (True, "keep_encoder = keep")
    assert kept.keeps("free", 512 * GIB) == (False, "keep_encoder = free")
    with pytest.raises(ValueError, match="keep_encoder: 'always'"):
        kept.keeps("always", 64 * GIB)


def test_one_encoder_per_kind_for_one_key(tmp_path) -> None:  # noqa: ANN001
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.write_bytes(b"x")
    b.write_bytes(b"yy")
    ka, kb = kept.key_of(a, "cuda:0"), kept.key_of(b, "cuda:0")
    assert kept.key_of(a, "cpu") != ka and ka != kb
    try:
        assert kept.take("enc", ka) is None
        clip = object()
        kept.keep("enc", ka, clip)
        kept.keep("other", kb, "another kind")
        assert kept.take("enc", ka) is clip and kept.take("enc", ka) is clip  # stays kept
        assert kept.take("enc", kb) is None and kept.take("enc", ka) is None  # another key let it go
        assert kept.take("other", kb) == "another kind"
        a.write_bytes(b"changed")  # rewritten under the same name: another key
        assert kept.key_of(a, "cuda:0") != ka
    finally:
        kept.release("enc")
        kept.release("other")
    assert not kept.release("enc")
