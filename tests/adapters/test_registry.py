"""Storage: content addressing, versions, atomic writes, names, deletes."""

from __future__ import annotations

import hashlib
import os
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from adapters.errors import AdapterError, AdapterNotFound
from adapters.registry import AdapterManifest, AdapterRegistry, default_data_dir, parse_ref, validate_name
from tests.adapters.conftest import as_upload

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


@pytest.fixture
def registry(tmp_path, tiny_config) -> AdapterRegistry:
    return AdapterRegistry(tmp_path / "reg", base_config=tiny_config, now=lambda: T0)


def _variant(valid_files, factor: float) -> tuple[bytes, bytes]:
    """The valid adapter with every lora_B multiplied by `factor`: new content."""
    cfg, tensors = valid_files
    return as_upload(cfg, {k: v * factor if "lora_B" in k else v for k, v in tensors.items()})


def _files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_import_writes_a_content_addressed_manifest(registry, valid_adapter_dir):
    m = registry.import_dir("support-bot", valid_adapter_dir)
    blob = registry.root / "blobs" / f"{m.digest}.safetensors"
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == m.digest
    assert (m.name, m.version, m.rank, m.size_bytes) == ("support-bot", 1, 4, blob.stat().st_size)
    assert m.target_modules == ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
    assert m.created_at == "2026-01-02T03:04:05+00:00"
    assert m.base_model_fingerprint == registry.base.fingerprint
    assert m.key == ("support-bot", 1, m.digest)
    assert registry.resolve("support-bot") == registry.resolve("support-bot@1") == m
    assert AdapterManifest.from_json(m.to_json()) == m


def test_new_content_is_a_new_version_and_old_versions_stay(registry, valid_files):
    v1 = registry.put("a", *_variant(valid_files, 1.0))
    v2 = registry.put("a", *_variant(valid_files, 2.0))
    assert (v1.version, v2.version) == (1, 2) and v1.digest != v2.digest
    assert registry.resolve("a") == v2
    assert registry.resolve("a@1") == v1
    b1 = registry.load("a@1").modules[(0, "q_proj")][1]
    b2 = registry.load("a").modules[(0, "q_proj")][1]
    torch.testing.assert_close(b2, 2 * b1)


def test_same_content_again_returns_the_latest_version(registry, valid_files):
    first = registry.put("a", *_variant(valid_files, 1.0))
    assert registry.put("a", *_variant(valid_files, 1.0)) == first
    assert [m.version for m in registry.list(all_versions=True)] == [1]


def test_reuploading_an_older_content_rolls_forward_sharing_the_blob(registry, valid_files):
    v1 = registry.put("a", *_variant(valid_files, 1.0))
    registry.put("a", *_variant(valid_files, 2.0))
    v3 = registry.put("a", *_variant(valid_files, 1.0))
    assert (v3.version, v3.digest) == (3, v1.digest)
    assert registry.resolve("a") == v3
    assert len(list((registry.root / "blobs").iterdir())) == 2


def test_same_content_under_two_names_is_stored_once(registry, valid_files):
    a = registry.put("a", *_variant(valid_files, 1.0))
    b = registry.put("b", *_variant(valid_files, 1.0))
    assert a.digest == b.digest and a.key != b.key
    assert len(list((registry.root / "blobs").iterdir())) == 1


def test_bfloat16_adapters_are_kept_as_uploaded_and_loaded_as_float32(registry, valid_files):
    cfg, tensors = valid_files
    m = registry.put("a", *as_upload(cfg, {k: v.to(torch.bfloat16) for k, v in tensors.items()}))
    a, b = registry.load(m).modules[(1, "down_proj")]
    assert a.dtype == b.dtype == torch.float32
    prefix = "base_model.model.model.layers.1.mlp.down_proj"
    torch.testing.assert_close(b, tensors[f"{prefix}.lora_B.weight"].to(torch.bfloat16).float() * 2.0)


@pytest.mark.parametrize("phase", ["blob", "manifest"])
def test_a_crash_mid_write_leaves_no_partial_version(phase, registry, valid_files, monkeypatch):
    v1 = registry.put("a", *_variant(valid_files, 1.0))
    before = _files_under(registry.root)
    real_replace = os.replace

    def crash(src, dst):
        if (phase == "blob") == str(dst).endswith(".safetensors"):
            raise OSError("disk full (simulated)")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        registry.put("a", *_variant(valid_files, 2.0))
    monkeypatch.setattr(os, "replace", real_replace)

    assert registry.resolve("a") == v1 and registry.list(all_versions=True) == [v1]
    with pytest.raises(AdapterNotFound):
        registry.resolve("a@2")
    leftovers = sorted(set(_files_under(registry.root)) - set(before))
    assert leftovers == ([] if phase == "blob" else [f"blobs/{_digest_of(registry, valid_files)}.safetensors"])
    assert registry.put("a", *_variant(valid_files, 2.0)).version == 2


def _digest_of(registry, valid_files) -> str:
    """Digest of the 2.0 variant, computed in a scratch registry."""
    scratch = AdapterRegistry(registry.root.parent / "scratch", base_config=registry.base)
    return scratch.put("x", *_variant(valid_files, 2.0)).digest


def test_concurrent_writers_get_distinct_versions(registry, valid_files):
    uploads = [_variant(valid_files, 1.0 + i) for i in range(4)]
    results: list = []
    threads = [threading.Thread(target=lambda u=u: results.append(registry.put("a", *u))) for u in uploads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(m.version for m in results) == [1, 2, 3, 4]
    assert len({m.digest for m in results}) == 4
    assert registry.list(all_versions=True) == sorted(results, key=lambda m: m.version)


def test_delete_one_version_never_reuses_its_number(registry, valid_files):
    registry.put("a", *_variant(valid_files, 1.0))
    v2 = registry.put("a", *_variant(valid_files, 2.0))
    registry.delete("a", 2)
    assert registry.resolve("a").version == 1
    with pytest.raises(AdapterNotFound, match="has no version 2"):
        registry.resolve("a@2")
    with pytest.raises(AdapterNotFound, match="was deleted"):
        registry.load(v2)
    assert registry.put("a", *_variant(valid_files, 3.0)).version == 3


def test_delete_a_name_removes_every_version_and_unused_blobs(registry, valid_files):
    registry.put("a", *_variant(valid_files, 1.0))
    registry.put("a", *_variant(valid_files, 2.0))
    kept = registry.put("b", *_variant(valid_files, 2.0))
    registry.delete("a")
    assert registry.list() == [kept]
    assert [p.name for p in (registry.root / "blobs").iterdir()] == [f"{kept.digest}.safetensors"]
    with pytest.raises(AdapterNotFound) as info:
        registry.resolve("a")
    assert info.value.param == "model"
    with pytest.raises(AdapterNotFound, match="no adapter a@7"):
        registry.delete("a", 7)


def test_list_gives_the_latest_of_each_name(registry, valid_files):
    registry.put("b", *_variant(valid_files, 1.0))
    registry.put("a", *_variant(valid_files, 1.0))
    registry.put("a", *_variant(valid_files, 2.0))
    assert [m.ref for m in registry.list()] == ["a@2", "b@1"]
    assert [m.ref for m in registry.list(all_versions=True)] == ["a@1", "a@2", "b@1"]
    assert AdapterRegistry(registry.root.parent / "empty").list() == []


@pytest.mark.parametrize("name", ["..", "a/b", "/abs", "", "Upper", "x" * 65, "a..b", ".hidden", "-x", "a b", "a@1"])
def test_bad_names_are_rejected(name, registry, valid_adapter_dir):
    with pytest.raises(AdapterError, match="invalid adapter name") as info:
        registry.import_dir(name, valid_adapter_dir)
    assert info.value.param == "name"
    assert not (registry.root / "blobs").exists()


@pytest.mark.parametrize("ref", ["a@0", "a@x", "a@", "a@1@2", "A", "../a", "a@01", "a@\u0661",
                                 "a@1234567890", "a@" + "9" * 5000])
def test_bad_references_are_rejected(ref, registry):
    with pytest.raises(AdapterError, match="invalid adapter reference") as info:
        registry.resolve(ref)
    assert info.value.param == "model" and not isinstance(info.value, AdapterNotFound)


@pytest.mark.parametrize("ref", ["a", "a@1", "a@999999999", "a@1000000000", "a@0", "a@01", "a.b-c_d@12", "a..b@1",
                                 "a@", "a@1@2", "Upper@1", "x" * 64 + "@1", "x" * 65])
def test_the_openapi_reference_pattern_agrees_with_parse_ref(ref):
    import re

    from gateway.schemas.admin import ADAPTER_REF_PATTERN

    try:
        parse_ref(ref)
        parsed = True
    except AdapterError:
        parsed = False
    assert (re.search(ADAPTER_REF_PATTERN, ref) is not None) == parsed


def test_unknown_adapter_is_not_found(registry):
    with pytest.raises(AdapterNotFound, match="no adapter named 'nope'") as info:
        registry.resolve("nope@2")
    assert info.value.param == "model"


@given(st.text(max_size=70))
def test_accepted_names_stay_one_directory_below_the_registry(name):
    try:
        validate_name(name)
    except AdapterError:
        return
    root = Path("/registry/names")
    assert (root / name).resolve().parent == root and name not in (".", "..")


def test_load_rechecks_the_adapter_against_the_base(registry, valid_adapter_dir, tiny_config):
    m = registry.import_dir("a", valid_adapter_dir)
    bigger = tiny_config.__class__(**{**tiny_config.to_dict(), "hidden_size": 128, "head_dim": 32})
    with pytest.raises(AdapterError, match="adapter a@1 does not fit the base model: .* has wrong shape"):
        AdapterRegistry(registry.root, base_config=bigger).load(m)


def test_corrupt_blob_is_detected(registry, valid_adapter_dir):
    m = registry.import_dir("a", valid_adapter_dir)
    path = registry.root / "blobs" / f"{m.digest}.safetensors"
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    with pytest.raises(AdapterError, match="corrupt"):
        registry.load("a")


def test_data_dir_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAGW_DATA_DIR", str(tmp_path))
    assert default_data_dir() == tmp_path
    assert AdapterRegistry().root == tmp_path / "adapters"
    monkeypatch.delenv("LORAGW_DATA_DIR")
    assert default_data_dir().name == "loragw"


@pytest.mark.parametrize("depth", [17, 100_000])
def test_deeply_nested_adapter_config_is_refused(depth, registry, valid_files):
    """17 levels pass json.loads and would reach later code; 100,000 make it raise RecursionError."""
    cfg, tensors = valid_files
    config_json, weights = as_upload({**cfg, "eva_config": "HERE"}, tensors)
    nested = b"[" * (depth - 1) + b"]" * (depth - 1)
    with pytest.raises(AdapterError, match="adapter_config.json is nested deeper than 16 levels"):
        registry.put("deep", config_json.replace(b'"HERE"', nested), weights)
    assert registry.list() == []
