"""Paths (train/config.py: gs:// prefixes mapped to local roots), carry layouts (train/fit.py) and the
multi-process helpers (train/sharding.py) on one process; their multi-process side is in
tests/test_multiprocess_train.py."""

from __future__ import annotations

import json

import pytest

from train.config import parse_root, resolve


def test_prefixes_map_whole_components_and_file_uris_are_local(tmp_path):
    roots = dict([parse_root(f"gs://bucket=file://{tmp_path}/b"), parse_root(f"gs://bucket/deep/={tmp_path}/d")])
    assert str(resolve("gs://bucket/data/x", roots)) == f"{tmp_path}/b/data/x"
    assert str(resolve("gs://bucket", roots)) == f"{tmp_path}/b"
    assert str(resolve("gs://bucket/deep/x", roots)) == f"{tmp_path}/d/x"  # the longest prefix wins
    assert str(resolve("gs://bucket2/x", roots)) == "gs://bucket2/x"  # not a component of gs://bucket
    assert str(resolve(f"file://{tmp_path}/y")) == f"{tmp_path}/y"
    assert str(resolve("rel/dir")).endswith("/rel/dir") and str(resolve("rel/dir")).startswith("/")
    with pytest.raises(ValueError, match="PREFIX=ROOT"):
        parse_root("gs://bucket")
    with pytest.raises(ValueError, match="absolute"):
        resolve("file://relative/path")


def test_a_config_file_behind_a_mapped_prefix_loads_and_keeps_its_roots(tmp_path):
    from train.config import load_config, resolve_config_paths
    from train.fit import RunPaths

    (tmp_path / "c.yaml").write_text("data: {path: gs://b/data}\nrun: {out_dir: gs://b/runs/x, path_roots: "
                                     "{'gs://b/runs': 'file:///elsewhere'}}\n")
    roots = dict([parse_root(f"gs://b=file://{tmp_path}")])
    cfg = resolve_config_paths(load_config(resolve("gs://b/c.yaml", roots)), roots)
    paths = RunPaths.of(cfg)
    assert str(paths.data) == f"{tmp_path}/data" and str(paths.out) == "/elsewhere/x"
    assert paths.carry is None and paths.features is None


def test_old_and_new_carry_layouts_read_alike(tmp_path):
    from train.fit import read_carry

    old = tmp_path / "old"
    old.mkdir()
    (old / "carry.json").write_text(json.dumps({"step": 5, "data": {"next_index": 9}}))
    carry = read_carry(old)
    assert carry["step"] == 5 and carry["data"] == [{"next_index": 9}] and carry["drafter"] == old / "drafter"
    new = tmp_path / "new"
    new.mkdir()
    (new / "carry.json").write_text(json.dumps({"step": 7, "dir": "step-7", "processes": 2,
                                                "data": [{"next_index": 1}, {"next_index": 2}]}))
    carry = read_carry(new)
    assert carry["drafter"] == new / "step-7" / "drafter" and len(carry["data"]) == 2
    assert read_carry(tmp_path / "none") is None and read_carry(None) is None


def test_hosts_on_one_process():
    import numpy as np

    from train.sharding import agree, digest, gather_json, gather_params

    agree({"config": {"a": 1}})  # nothing to compare with
    assert gather_json({"next_index": 3}) == [{"next_index": 3}]
    assert digest({"a": 1, "b": 2}) == digest({"b": 2, "a": 1}) != digest({"a": 1, "b": 3})
    np.testing.assert_array_equal(gather_params({"w": np.ones(3)})["w"], np.ones(3))
