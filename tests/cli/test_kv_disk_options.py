"""--kv-disk-mb / --kv-disk-dir: off by default for run (and with it run's prefix cache), on for serve
(4096 MiB, at most a quarter of the free disk, under LOCALLLM_HOME/kv-cache)."""

from __future__ import annotations

import shutil

import pytest

from localllm.cli.common import kv_disk_options, one_shot_cache_options
from localllm.engine.kv_disk import DEFAULT_SERVE_MB
from localllm.errors import ConfigError


def test_run_has_it_off_and_serve_on(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    assert kv_disk_options(None, None, default_on=False) == {
        "kv_disk_mb": 0,
        "kv_disk_dir": tmp_path / "kv-cache",
    }
    served = kv_disk_options(None, None, default_on=True)
    free_mb = shutil.disk_usage(tmp_path).free // 2**20
    assert served == {"kv_disk_mb": min(DEFAULT_SERVE_MB, free_mb // 4), "kv_disk_dir": tmp_path / "kv-cache"}


def test_given_values_win(tmp_path):
    assert kv_disk_options(0, tmp_path, default_on=True) == {"kv_disk_mb": 0, "kv_disk_dir": tmp_path}
    assert kv_disk_options(64, tmp_path, default_on=False)["kv_disk_mb"] == 64
    with pytest.raises(ConfigError, match="--kv-disk-mb"):
        kv_disk_options(-1, tmp_path, default_on=True)


def test_run_caches_prefixes_only_for_a_disk_tier(tmp_path):
    assert one_shot_cache_options(None, tmp_path) == {
        "kv_disk_mb": 0, "kv_disk_dir": tmp_path, "enable_prefix_caching": False,
    }  # fmt: skip
    assert one_shot_cache_options(64, tmp_path)["enable_prefix_caching"] is True
