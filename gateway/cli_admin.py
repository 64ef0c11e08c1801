"""`loragw migrate | tenants | keys | adapters`: the admin API's operations
from the command line, on the same database and adapter registry.

Each command parses its flags into the admin API's schemas and calls the
same `AdminService`, so both front ends behave alike; `--json` prints what
the API would answer. Commands bring the database to the newest schema
first (`loragw migrate` does only that).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import sys
from pathlib import Path

from adapters.peft_config import DEFAULT_MAX_LORA_RANK

COMMANDS = ("migrate", "tenants", "keys", "adapters")
LIMIT_FLAGS = {"--max-concurrent": "max_concurrent", "--requests-per-minute": "requests_per_minute",
               "--tokens-per-minute": "tokens_per_minute"}
# At most 12 digits, past any key lifetime the schema allows: longer text goes
# on to the schema, which refuses it, instead of to int() (which refuses
# more than 4,300 digits with a traceback).
_DURATION = re.compile(r"([1-9][0-9]{0,11})([smhd]?)")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
# ASCII digits only: int() also takes "５", "1_000" and " 7 ", which the API's
# JSON never does. Other text goes on to the schema, which refuses it; a
# number of up to 20 digits goes as a number, so that its bound is what the
# error names.
_INTEGER = re.compile(r"-?[0-9]{1,20}")


def add_parsers(sub) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", default=os.environ.get("LORAGW_DB"),
                        help="SQLAlchemy URL; default: loragw.db in the data directory [env LORAGW_DB]")
    common.add_argument("--json", action="store_true", help="print the admin API's JSON")

    sub.add_parser("migrate", parents=[common], help="bring the database to the newest schema")
    _add_tenants(sub, common)
    _add_keys(sub, common)
    _add_adapters(sub, common)


def _limit(value: str) -> int | str | None:
    if value.lower() in ("none", "unlimited"):
        return None
    return int(value) if _INTEGER.fullmatch(value) else value


def _add_tenants(sub, common) -> None:
    cmds = sub.add_parser("tenants", help="manage tenants").add_subparsers(dest="action", required=True)
    create = cmds.add_parser("create", parents=[common], help="add a tenant")
    update = cmds.add_parser("update", parents=[common], help="change a tenant's tier or limits (only those given)")
    for p in (create, update):
        p.add_argument("name")
        p.add_argument("--tier", choices=["premium", "standard"])
        for flag in LIMIT_FLAGS:
            p.add_argument(flag, type=_limit, default=argparse.SUPPRESS, metavar="N|none")
    cmds.add_parser("list", parents=[common], help="list tenants")
    for action, text in (("get", "show a tenant"), ("rm", "delete a tenant, its keys and its adapters")):
        cmds.add_parser(action, parents=[common], help=text).add_argument("name")


def _add_keys(sub, common) -> None:
    cmds = sub.add_parser("keys", help="manage API keys").add_subparsers(dest="action", required=True)
    create = cmds.add_parser("create", parents=[common], help="issue a key (its secret is printed once)")
    create.add_argument("tenant")
    create.add_argument("--name", help="a label, e.g. where the key is used")
    expiry = create.add_mutually_exclusive_group()
    expiry.add_argument("--expires-in", metavar="DURATION", help="e.g. 3600, 90m, 12h, 30d")
    expiry.add_argument("--expires-at", metavar="ISO8601", help="e.g. 2030-01-01T00:00:00Z")
    cmds.add_parser("list", parents=[common], help="list a tenant's keys").add_argument("tenant")
    cmds.add_parser("revoke", parents=[common], help="revoke a key").add_argument("key_id")


def _add_adapters(sub, common) -> None:
    cmds = sub.add_parser("adapters", help="manage LoRA adapters").add_subparsers(dest="action", required=True)
    imp = cmds.add_parser("import", parents=[common], help="validate a PEFT adapter directory and store it")
    imp.add_argument("name", help="adapter name: a-z 0-9 . _ -, at most 64 characters")
    imp.add_argument("dir", help="directory with adapter_config.json and adapter_model.safetensors")
    imp.add_argument("--model", default=os.environ.get("LORAGW_MODEL"),
                     help="base checkpoint to validate against; default: bundled SmolLM2-135M-Instruct")
    imp.add_argument("--max-lora-rank", type=int, default=DEFAULT_MAX_LORA_RANK,
                     help="largest rank accepted: the servers' --max-lora-rank (default %(default)s)")
    imp.add_argument("--tenant", help="the owning tenant (default: none, a platform adapter)")
    imp.add_argument("--shared", action="store_true", help="every tenant may use it")
    ls = cmds.add_parser("list", parents=[common], help="list adapters (latest version of each name)")
    ls.add_argument("--all", action="store_true", help="list every version")
    cmds.add_parser("rm", parents=[common], help="delete NAME (every version) or NAME@VERSION").add_argument("ref")


def run(args: argparse.Namespace) -> int:
    from adapters.errors import AdapterError
    from engine.errors import EngineError
    from gateway.errors import APIError
    from gateway.store.base import StoreError

    try:
        asyncio.run(_run(args))
    except (APIError, StoreError, AdapterError, EngineError, OSError) as exc:
        print(f"error: {getattr(exc, 'message', None) or exc}", file=sys.stderr)
        return 1
    return 0


async def _run(args: argparse.Namespace) -> None:
    import migrations
    from gateway.config import GatewayConfig
    from gateway.store import schema
    from gateway.store.sql import SqlStore

    db_url = args.db or GatewayConfig().resolved_db_url()
    registry = _registry_for(args)  # before the database: a bad --model changes nothing
    await schema.upgrade_async(db_url)
    if args.command == "migrate":
        _print_migrated(args, db_url, migrations.head_revision())
        return
    from gateway.admin_service import AdminService

    store = SqlStore.from_url(db_url)
    try:
        service = AdminService(store, registry=registry, now=lambda: dt.datetime.now(dt.UTC))
        handler = {"tenants": _tenants, "keys": _keys, "adapters": _adapters}[args.command]
        await handler(args, service)
    finally:
        await store.close()


def _registry_for(args: argparse.Namespace):
    """A callable giving the data dir's registry; `adapters import`
    validates against the base model, so it loads that model's config."""
    from adapters.registry import AdapterRegistry

    if args.command == "adapters" and args.action == "import":
        from engine.model.loader import load_hf_config, resolve_model_dir

        registry = AdapterRegistry(base_config=load_hf_config(resolve_model_dir(args.model)),
                                   max_lora_rank=args.max_lora_rank)
    else:
        registry = AdapterRegistry()
    return lambda: registry


def _print_migrated(args, db_url: str, revision: str) -> None:
    from sqlalchemy import make_url

    shown = make_url(db_url).render_as_string(hide_password=True)
    if args.json:
        _print_json({"object": "migration", "db": shown, "revision": revision})
    else:
        print(f"{shown} is at revision {revision}")


async def _tenants(args, service) -> None:
    from gateway.schemas.admin import TenantCreate, TenantUpdate, parse

    limits = {field: getattr(args, field) for field in LIMIT_FLAGS.values() if hasattr(args, field)}
    if args.action == "create":
        body = {"name": args.name, "limits": limits} | ({"tier": args.tier} if args.tier else {})
        _show(args, await service.create_tenant(parse(TenantCreate, body)), _tenant_line)
    elif args.action == "update":
        body = ({"tier": args.tier} if args.tier else {}) | ({"limits": limits} if limits else {})
        _show(args, await service.update_tenant(args.name, parse(TenantUpdate, body)), _tenant_line)
    elif args.action == "list":
        _show(args, await service.list_tenants(), _tenant_line)
    elif args.action == "get":
        _show(args, await service.get_tenant(args.name), _tenant_line)
    else:
        _show(args, await service.delete_tenant(args.name), lambda d: f"deleted tenant {d.id}")


async def _keys(args, service) -> None:
    from gateway.schemas.admin import KeyCreate, parse

    if args.action == "create":
        body = {"name": args.name, "expires_at": args.expires_at}
        if args.expires_in is not None:
            body["expires_in"] = _duration(args.expires_in)
        issued = await service.create_key(args.tenant, parse(KeyCreate, body))
        if not args.json:
            print(f"key {issued.id} for tenant {issued.tenant}: the secret below is shown once", file=sys.stderr)
        _show(args, issued, lambda k: k.key)
    elif args.action == "list":
        _show(args, await service.list_keys(args.tenant), _key_line)
    else:
        _show(args, await service.revoke_key(args.key_id), lambda k: f"revoked {k.id}")


async def _adapters(args, service) -> None:
    from gateway.schemas.admin import AdapterUpload, parse

    if args.action == "import":
        fields = parse(AdapterUpload, {"name": args.name, "tenant": args.tenant, "shared": args.shared})
        adapter = await service.import_adapter_dir(fields, Path(args.dir))
        _show(args, adapter, lambda a: f"{a.versions[-1].ref} {a.versions[-1].digest}")
    elif args.action == "list":
        _show(args, await service.list_adapters(), lambda a: _adapter_lines(a, every=args.all))
    else:
        _show(args, await service.delete_adapter(args.ref), lambda d: f"deleted {d.id}")


def _duration(text: str) -> int | str:
    """Seconds in "3600", "90m", "12h" or "30d"; other text is passed on
    for the schema to reject."""
    match = _DURATION.fullmatch(text.strip())
    return int(match[1]) * _SECONDS[match[2]] if match else text


def _show(args, result, line) -> None:
    """Print a schema (or a list of them) as the API's JSON, or as text lines."""
    items = result if isinstance(result, list) else [result]
    if args.json:
        dumped = [item.model_dump(mode="json") for item in items]
        _print_json({"object": "list", "data": dumped} if isinstance(result, list) else dumped[0])
    else:
        for item in items:
            print(line(item))


def _print_json(data) -> None:
    print(json.dumps(data, indent=2))


def _tenant_line(t) -> str:
    limits = " ".join(f"{k}={'-' if v is None else v}" for k, v in t.limits.model_dump().items())
    return f"{t.name}\t{t.tier.value}\t{limits}\t{t.id}"


def _key_line(k) -> str:
    expires = k.expires_at.isoformat() if k.expires_at else "never"
    return f"{k.id}\t{k.prefix}...\t{k.status}\t{_one_field(k.name) if k.name else '-'}\texpires={expires}"


def _one_field(text: str) -> str:
    """A free-text name escaped so that it stays one tab-separated field of
    one line (a key's name may hold tabs and newlines); a backslash is
    doubled, so that an escaped tab and a typed "\\t" differ."""
    return "".join("\\\\" if c == "\\" else c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _adapter_lines(a, *, every: bool) -> str:
    grant = f"owner={a.owner or '-'}" + ("\tshared" if a.shared else "")
    return "\n".join(
        f"{v.ref}\t{v.digest[:12]}\tr={v.rank}\t{','.join(v.target_modules)}\t{v.size_bytes}B\t{v.created_at}\t{grant}"
        for v in (a.versions if every else a.versions[-1:]))
