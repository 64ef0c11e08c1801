"""`loragw migrate | tenants | keys | adapters` on both stores, with --json."""

from __future__ import annotations

import asyncio
import datetime as dt
import json

import pytest

import migrations
from adapters.registry import AdapterRegistry
from gateway.cli import main
from gateway.store.sql import SqlStore
from tests.gateway.admin_app import ADMIN, admin_client


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAGW_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("LORAGW_DB", raising=False)
    return tmp_path / "data"


@pytest.fixture
def cli(db_url, capsys):
    """cli(*argv) -> parsed --json output; cli(*argv, ok=False) -> the error line."""

    def run(*argv: str, ok: bool = True, as_json: bool = True):
        code = main([*argv, "--db", db_url] + (["--json"] if as_json else []))
        out, err = capsys.readouterr()
        if not ok:
            assert code == 1 and out == "" and err.startswith("error: ") and err.count("\n") == 1, (code, out, err)
            return err
        assert code == 0, err
        return json.loads(out) if as_json else out

    return run


def authenticate(db_url: str, secret: str):
    async def go():
        store = SqlStore.from_url(db_url)
        try:
            return await store.authenticate(secret, now=dt.datetime.now(dt.UTC))
        finally:
            await store.close()

    return asyncio.run(go())


def test_migrate_a_fresh_sqlite_database(tmp_path, capsys):
    url = f"sqlite+aiosqlite:///{tmp_path / 'new.db'}"
    assert main(["migrate", "--db", url]) == 0
    assert capsys.readouterr().out == f"{url} is at revision {migrations.head_revision()}\n"
    assert main(["migrate", "--db", url, "--json"]) == 0  # again: nothing to do
    assert json.loads(capsys.readouterr().out)["revision"] == migrations.head_revision()


def test_default_database_is_in_the_data_dir(data_dir, capsys):
    assert main(["tenants", "create", "acme"]) == 0
    assert (data_dir / "loragw.db").is_file()
    capsys.readouterr()
    assert main(["tenants", "list"]) == 0
    assert capsys.readouterr().out.startswith(
        "acme\tstandard\tmax_concurrent=- requests_per_minute=- tokens_per_minute=-\t")


def test_migrate_on_both_stores(cli):
    assert cli("migrate")["revision"] == migrations.head_revision()


def test_tenant_lifecycle(cli):
    created = cli("tenants", "create", "acme", "--tier", "premium", "--max-concurrent", "4")
    assert (created["object"], created["name"], created["tier"]) == ("tenant", "acme", "premium")
    assert created["limits"] == {"max_concurrent": 4, "requests_per_minute": None, "tokens_per_minute": None}
    cli("tenants", "create", "beta")
    assert [t["name"] for t in cli("tenants", "list")["data"]] == ["acme", "beta"]
    assert cli("tenants", "get", "acme") == created

    updated = cli("tenants", "update", "acme", "--max-concurrent", "none", "--tokens-per-minute", "900")
    assert updated["tier"] == "premium"
    assert updated["limits"] == {"max_concurrent": None, "requests_per_minute": None, "tokens_per_minute": 900}
    assert cli("tenants", "update", "acme", "--tier", "standard")["limits"] == updated["limits"]
    assert "acme\tstandard\tmax_concurrent=- requests_per_minute=- tokens_per_minute=900\t" in cli(
        "tenants", "get", "acme", as_json=False)

    assert cli("tenants", "rm", "acme") == {"object": "tenant", "id": "acme", "deleted": True}
    assert "no tenant 'acme'" in cli("tenants", "get", "acme", ok=False)
    assert "already exists" in cli("tenants", "create", "beta", ok=False)
    assert "name: String should match pattern" in cli("tenants", "create", "Bad Name", ok=False)
    assert "limits.max_concurrent: Input should be greater than 0" in cli(
        "tenants", "create", "gamma", "--max-concurrent", "0", ok=False)


def test_key_lifecycle(cli, db_url):
    cli("tenants", "create", "acme")
    issued = cli("keys", "create", "acme", "--name", "ci", "--expires-in", "90m")
    assert issued["key"].startswith("lgw-") and issued["prefix"] == issued["key"][:12]
    assert (issued["tenant"], issued["name"], issued["status"]) == ("acme", "ci", "active")
    expires_in = dt.datetime.fromisoformat(issued["expires_at"]) - dt.datetime.now(dt.UTC)
    assert dt.timedelta(minutes=89) < expires_in <= dt.timedelta(minutes=90)
    assert authenticate(db_url, issued["key"]).tenant.name == "acme"

    secret = cli("keys", "create", "acme", as_json=False).strip()  # text: only the secret on stdout
    assert secret.startswith("lgw-") and authenticate(db_url, secret) is not None
    listed = cli("keys", "list", "acme")["data"]
    assert [k["id"] for k in listed][0] == issued["id"] and len(listed) == 2
    assert all("key" not in k for k in listed)

    revoked = cli("keys", "revoke", issued["id"])
    assert revoked["status"] == "revoked"
    assert authenticate(db_url, issued["key"]) is None
    assert "no API key" in cli("keys", "revoke", "nope", ok=False)
    assert "no tenant 'ghost'" in cli("keys", "create", "ghost", ok=False)
    assert "expires_at is in the past" in cli("keys", "create", "acme", "--expires-at", "2001-01-01T00:00:00Z",
                                              ok=False)
    assert "expires_in" in cli("keys", "create", "acme", "--expires-in", "soon", ok=False)


def test_adapter_lifecycle(cli, db_url, tiny_adapter_dir, tiny_llama_dir, data_dir):
    cli("tenants", "create", "acme")
    cli("tenants", "create", "beta")
    model = ["--model", str(tiny_llama_dir)]
    imported = cli("adapters", "import", "support-bot", str(tiny_adapter_dir), "--tenant", "acme", *model)
    assert (imported["owner"], imported["shared"], imported["latest_version"]) == ("acme", False, 1)
    assert "belongs to tenant 'acme'" in cli("adapters", "import", "support-bot", str(tiny_adapter_dir),
                                             "--tenant", "beta", *model, ok=False)
    shared = cli("adapters", "import", "common", str(tiny_adapter_dir), "--shared", *model)
    assert (shared["owner"], shared["shared"]) == (None, True)
    assert "no tenant 'ghost'" in cli("adapters", "import", "x", str(tiny_adapter_dir), "--tenant", "ghost",
                                      *model, ok=False)

    listed = cli("adapters", "list")["data"]
    assert [(a["name"], a["owner"], a["shared"]) for a in listed] == [("common", None, True),
                                                                      ("support-bot", "acme", False)]
    text = cli("adapters", "list", as_json=False)
    assert text.splitlines()[1].startswith("support-bot@1\t") and text.splitlines()[1].endswith("\towner=acme")

    assert cli("adapters", "rm", "support-bot") == {"object": "adapter", "id": "support-bot", "deleted": True}
    assert "no adapter" in cli("adapters", "rm", "support-bot", ok=False)
    # The name's grant went with it: another tenant may take the name.
    again = cli("adapters", "import", "support-bot", str(tiny_adapter_dir), "--tenant", "beta", *model)
    assert (again["owner"], again["latest_version"]) == ("beta", 2)
    cli("tenants", "rm", "beta")  # its adapters go too
    assert [a["name"] for a in cli("adapters", "list")["data"]] == ["common"]
    assert [m.name for m in AdapterRegistry(data_dir / "adapters").list()] == ["common"]


def test_import_refuses_by_default_a_rank_that_serve_cannot_load(cli, tiny_llama_dir, tmp_path, data_dir, capsys):
    """It used to accept up to rank 64 where `loragw serve` pads slots to 16:
    the import passed and every request on the adapter was then a 500."""
    from tests.adapters.conftest import build_peft_adapter

    build_peft_adapter(tiny_llama_dir, tmp_path / "r32", r=32, lora_alpha=32, target_modules=["q_proj"])
    capsys.readouterr()  # transformers' progress bars
    model = ["--model", str(tiny_llama_dir)]
    assert "above max_lora_rank 16" in cli("adapters", "import", "wide", str(tmp_path / "r32"), *model, ok=False)
    wide = cli("adapters", "import", "wide", str(tmp_path / "r32"), "--max-lora-rank", "32", *model)
    assert wide["latest_version"] == 1


def test_cli_and_admin_api_show_the_same_objects(cli, db_url, tmp_path, tiny_base_config):
    tenant = cli("tenants", "create", "acme", "--tier", "premium", "--requests-per-minute", "60")
    key = cli("keys", "create", "acme")
    registry = AdapterRegistry(tmp_path / "data" / "adapters", base_config=tiny_base_config)
    with admin_client(db_url, registry) as client:
        assert client.get("/admin/tenants/acme", headers=ADMIN).json() == tenant
        (listed,) = client.get("/admin/tenants/acme/keys", headers=ADMIN).json()["data"]
        assert listed == {k: v for k, v in key.items() if k != "key"}
        client.patch("/admin/tenants/acme", json={"tier": "standard"}, headers=ADMIN)
    assert cli("tenants", "get", "acme")["tier"] == "standard"


def test_cli_integers_past_their_column_and_huge_expiry_are_errors(cli):
    """The CLI parses into the admin API's schemas, so defect 7's bounds hold
    there too: an error line, not a traceback, and nothing is stored."""
    assert "less than or equal to 2147483647" in cli("tenants", "create", "acme", "--max-concurrent", str(2**63),
                                                     ok=False)
    assert "greater than 0" in cli("tenants", "create", "acme", "--max-concurrent", "-1", ok=False)
    cli("tenants", "create", "acme")
    assert "tokens_per_minute" in cli("tenants", "update", "acme", "--tokens-per-minute", str(2**31), ok=False)
    assert "expires_in" in cli("keys", "create", "acme", "--expires-in", "999999999d", ok=False)
    assert "expires_in" in cli("keys", "create", "acme", "--expires-in", "9" * 5000, ok=False)  # was a traceback
    assert "expires_at" in cli("keys", "create", "acme", "--expires-at", "9999-12-31T23:00:00-05:00", ok=False)
    assert cli("keys", "list", "acme")["data"] == []
    assert cli("tenants", "get", "acme")["limits"]["tokens_per_minute"] is None


@pytest.mark.parametrize("text", ["\uff15", "1_000", " 7", "7 ", "+7", "0x10", "٣"])
def test_cli_limits_are_ascii_digits_as_the_api_takes_them(cli, text):
    """int() reads all of these; the API's JSON takes none of them."""
    assert "max_concurrent" in cli("tenants", "create", "acme", "--max-concurrent", text, ok=False)
    assert cli("tenants", "list")["data"] == []


def test_key_names_with_tabs_and_newlines_stay_one_field_of_one_line(cli):
    cli("tenants", "create", "acme")
    name = "ci\tbot\nnight\x1b[31m typed \\t"
    cli("keys", "create", "acme", "--name", name)
    assert cli("keys", "list", "acme")["data"][0]["name"] == name
    lines = cli("keys", "list", "acme", as_json=False).splitlines()
    assert len(lines) == 1 and lines[0].split("\t")[3] == r"ci\tbot\nnight\x1b[31m typed \\t", lines
