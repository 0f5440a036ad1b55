"""What the installed package says about itself: its version and its licence."""

from __future__ import annotations

from pathlib import Path

import pytest

import fsdp_replay

REPO = Path(__file__).resolve().parents[2]


def test_version_is_the_one_pyproject_declares() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert fsdp_replay.__version__ == declared


def test_license_file_is_the_bsd_3_clause_pyproject_names() -> None:
    tomllib = pytest.importorskip("tomllib")
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license"] == {"text": "BSD-3-Clause"}
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and "the fsdp_replay authors" in text
