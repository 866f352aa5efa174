"""tests/conftest.py kit_path: only a missing kit skips; a hole in a present kit fails."""

from __future__ import annotations

import re

import pytest

from tests import conftest


def test_no_kit_skips(tmp_path, monkeypatch):
    monkeypatch.setattr(conftest, "KIT", tmp_path / "bench")
    with pytest.raises(pytest.skip.Exception):
        conftest.kit_path("models", "a.onnx")


def test_a_file_missing_from_a_present_kit_fails_naming_it(tmp_path, monkeypatch):
    (tmp_path / "bench" / "models").mkdir(parents=True)
    monkeypatch.setattr(conftest, "KIT", tmp_path / "bench")
    with pytest.raises(pytest.fail.Exception, match=re.escape(str(tmp_path / "bench" / "models" / "a.onnx"))):
        conftest.kit_path("models", "a.onnx")


def test_a_present_file_is_returned(tmp_path, monkeypatch):
    (tmp_path / "bench" / "models").mkdir(parents=True)
    (tmp_path / "bench" / "models" / "a.onnx").write_bytes(b"")
    monkeypatch.setattr(conftest, "KIT", tmp_path / "bench")
    assert conftest.kit_path("models", "a.onnx") == tmp_path / "bench" / "models" / "a.onnx"
