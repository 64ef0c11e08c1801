"""`loragw serve` (the chat demo until the HTTP gateway lands)."""

from __future__ import annotations

from gateway.cli import main


def test_serve_answers_one_prompt_and_exits(tiny_llama_dir, capsys):
    assert main(["serve", "--model", str(tiny_llama_dir), "--prompt", "Hi", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("you> Hi\nbot> ")
    assert "[4 tokens in" in out


def test_serve_reports_a_bad_model_path(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path / "missing"), "--prompt", "Hi"]) == 1
    assert "error:" in capsys.readouterr().err
