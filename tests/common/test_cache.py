"""The tools' cache folder: $EAGLE_DEPLOY_CACHE, else ~/.cache/eagle-deploy; the test session
keeps its own (tests/conftest.py), so a test run writes nothing into the user's."""
from __future__ import annotations

from pathlib import Path

from eagle_deploy.common.cache import cache_root


def test_the_variable_names_the_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_DEPLOY_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("EAGLE_DEPLOY_CACHE")
    assert cache_root() == Path.home() / ".cache" / "eagle-deploy"


def test_the_test_session_has_its_own_cache(_own_cache):
    assert cache_root() == _own_cache and cache_root() != Path.home() / ".cache" / "eagle-deploy"
    assert not (cache_root() / "costs").is_symlink()  # measured costs land in the session's folder
