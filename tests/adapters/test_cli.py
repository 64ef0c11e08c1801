"""`loragw adapters import | list | rm` on a data dir under tmp_path."""

from __future__ import annotations

import pytest

from gateway.cli import main


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAGW_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("LORAGW_MODEL", raising=False)
    return tmp_path / "data"


def _import(name, src, model):
    return main(["adapters", "import", name, str(src), "--model", str(model)])


def test_import_list_rm(valid_adapter_dir, tiny_llama_dir, data_dir, capsys):
    assert _import("support-bot", valid_adapter_dir, tiny_llama_dir) == 0
    ref, digest = capsys.readouterr().out.split()
    assert ref == "support-bot@1" and len(digest) == 64
    assert (data_dir / "adapters" / "blobs" / f"{digest}.safetensors").is_file()

    assert main(["adapters", "list"]) == 0
    line = capsys.readouterr().out
    assert line.startswith(f"support-bot@1\t{digest[:12]}\tr=4\tdown_proj,gate_proj,")

    assert main(["adapters", "rm", "support-bot@1"]) == 0
    assert capsys.readouterr().out == "deleted support-bot@1\n"
    assert main(["adapters", "list", "--all"]) == 0
    assert capsys.readouterr().out == ""


def _assert_one_line_error(capsys, *fragments):
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err


def test_import_of_a_bad_adapter_fails_cleanly(tmp_path, tiny_llama_dir, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "adapter_config.json").write_text("{}")
    assert _import("x", tmp_path / "src", tiny_llama_dir) == 1
    _assert_one_line_error(capsys, "missing adapter_model.safetensors")
    assert _import("Bad/Name", tmp_path / "src", tiny_llama_dir) == 1
    _assert_one_line_error(capsys, "invalid adapter name 'Bad/Name'")
    assert _import("x", tmp_path / "src", tmp_path / "no-model") == 1
    _assert_one_line_error(capsys, "does not exist")


def test_import_validates_against_smollm2_by_default(valid_adapter_dir, smollm_dir, capsys):
    # The adapter was trained for the tiny Llama (intermediate 128), not SmolLM2 (intermediate 1536).
    assert main(["adapters", "import", "x", str(valid_adapter_dir)]) == 1
    _assert_one_line_error(capsys, "down_proj.lora_A has wrong shape [4, 128], expected [4, 1536]")


@pytest.mark.parametrize("ref, message", [("ghost", "no adapter ghost"), ("a@x", "invalid adapter reference")])
def test_rm_errors(ref, message, capsys):
    assert main(["adapters", "rm", ref]) == 1
    _assert_one_line_error(capsys, message)
