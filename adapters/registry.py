"""The adapter registry: validated LoRA adapters on disk, by name and version.

Layout under `root` (default `default_data_dir() / "adapters"`):

    .lock                                  writers hold an exclusive flock on it
    .ownership.lock                        the gateway's uploads and deletions hold it around
                                           the weights and their grant (gateway/admin_service.py)
    blobs/<sha256>.safetensors             canonical adapter content (see blob.py)
    names/<name>/v<N>.json                 manifest of version N (immutable)
    names/<name>/v<N>.json.deleted         tombstone of a deleted version

Versions count 1, 2, ... per name and are never reused, even after a delete,
so `name@2` always meant one content. Uploading the content of the latest
version again returns that version (an idempotent retry); any other content
becomes a new version. A blob is removed when no live manifest refers to it.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from adapters import blob
from adapters.errors import CONFIG_FILE, PICKLE_MESSAGE, WEIGHTS_FILE, AdapterError, AdapterNotFound
from adapters.peft_config import DEFAULT_MAX_LORA_RANK
from adapters.peft_format import BaseShapes, check_fits, parse_peft_adapter
from adapters.store import exclusive_lock, rename_atomic, write_atomic

DATA_DIR_ENV = "LORAGW_DATA_DIR"
# A real adapter_config.json nests 3 deep (loftq_config, layer_replication);
# a grammar bound, like protobuf's JSON parser's 100, not an operator's knob.
MAX_CONFIG_DEPTH = 16
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
# Versions count up from 1; nine digits keep a reference's version within
# the database's 32-bit integers (and int() of it cheap).
_VERSION = re.compile(r"[1-9][0-9]{0,8}")
_MANIFEST = re.compile(r"v([1-9][0-9]*)\.json(\.deleted)?")
# torch.save zip archives and raw pickles (protocol 2+ starts with 0x80); only
# consulted once the bytes failed to parse as safetensors.
_PICKLE_MAGIC = (b"PK\x03\x04", b"\x80")


def default_data_dir() -> Path:
    """$LORAGW_DATA_DIR, else the platform's user data dir for loragw."""
    override = os.environ.get(DATA_DIR_ENV)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("loragw"))


def validate_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise AdapterError(
            f"invalid adapter name {name!r}: use 1 to 64 of a-z 0-9 . _ -, starting with a "
            "letter or digit, without '..'",
            param="name",
        )
    return name


def parse_ref(ref: str, *, param: str = "model") -> tuple[str, int | None]:
    """"name" -> (name, None); "name@3" -> (name, 3)."""
    name, at, version = str(ref).partition("@")
    if (at and not _VERSION.fullmatch(version)) or not _NAME.fullmatch(name) or ".." in name:
        raise AdapterError(f"invalid adapter reference {ref!r}: expected NAME or NAME@VERSION", param=param)
    return name, int(version) if at else None


@dataclass(frozen=True)
class AdapterManifest:
    name: str
    version: int
    digest: str  # sha256 of the canonical blob
    rank: int  # max over modules
    target_modules: tuple[str, ...]  # sorted, e.g. ("down_proj", "q_proj")
    size_bytes: int
    created_at: str  # ISO 8601, UTC
    base_model_fingerprint: str | None = None  # BaseShapes.fingerprint it was checked against

    @property
    def key(self) -> tuple[str, int, str]:
        """The engine's adapter_key; part of every prefix-cache block hash."""
        return (self.name, self.version, self.digest)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> AdapterManifest:
        fields = json.loads(data)
        fields["target_modules"] = tuple(fields["target_modules"])
        return cls(**fields)


@dataclass
class LoraWeights:
    """An adapter ready for the engine, on the CPU in float32."""

    manifest: AdapterManifest
    # (layer, module) -> (A [r, in_features], B [out_features, r] with the scaling folded in);
    # module is one of adapters.peft_format.LORA_MODULES ("q_proj", ..., "down_proj").
    # delta(x) = x @ A.T @ B.T
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    rank: int


class AdapterRegistry:
    """Stores and serves adapters; safe to share between processes.

    `base_config` is the base model's transformers config (or a BaseShapes).
    With it every upload is checked against the model's shapes and layer
    count, and `load` re-checks stored adapters. Without it (a registry used
    only to list or delete) uploads get every check that does not need the
    base model, and their manifests carry no base_model_fingerprint."""

    def __init__(
        self,
        root: Path | None = None,
        *,
        base_config=None,
        max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
        now: Callable[[], datetime] | None = None,
    ):
        self.root = Path(root) if root is not None else default_data_dir() / "adapters"
        if base_config is None or isinstance(base_config, BaseShapes):
            self.base = base_config
        else:
            self.base = BaseShapes.from_hf_config(base_config)
        self.max_lora_rank = max_lora_rank
        self._now = now or (lambda: datetime.now(UTC))

    # ---- writing ---------------------------------------------------------

    def import_dir(self, name: str, src: Path) -> AdapterManifest:
        """Import a directory written by peft's save_pretrained."""
        validate_name(name)
        src = Path(src)
        if not src.is_dir():
            raise AdapterError(f"{src} is not a directory")
        config, weights = src / CONFIG_FILE, src / WEIGHTS_FILE
        if not config.is_file():
            raise AdapterError(f"missing {CONFIG_FILE} in {src}", param=CONFIG_FILE)
        if not weights.is_file():
            if any(src.glob("*.bin")) or any(src.glob("*.pt")) or any(src.glob("*.pth")):
                raise AdapterError(f"{PICKLE_MESSAGE}; {src} has no {WEIGHTS_FILE}", param=WEIGHTS_FILE)
            raise AdapterError(f"missing {WEIGHTS_FILE} in {src}", param=WEIGHTS_FILE)
        return self.put(name, config.read_bytes(), weights.read_bytes())

    def put(self, name: str, config_json: bytes, weights: bytes) -> AdapterManifest:
        """Validate and store an adapter; returns its (new or existing) version."""
        validate_name(name)
        modules = parse_peft_adapter(
            _parse_config(config_json), _parse_weights(weights), self.base, self.max_lora_rank
        )
        data = blob.encode(modules)
        digest = blob.digest_of(data)
        with exclusive_lock(self.root / ".lock"):
            live = self._live_versions(name)
            if live and (latest := self._read(live[max(live)])).digest == digest:
                return latest
            blob_path = self._blob_path(digest)
            if not blob_path.is_file():
                write_atomic(blob_path, data)
            manifest = AdapterManifest(
                name=name,
                version=1 + max(self._all_version_numbers(name), default=0),
                digest=digest,
                rank=max(m.rank for m in modules.values()),
                target_modules=tuple(sorted({module for _, module in modules})),
                size_bytes=len(data),
                created_at=self._now().isoformat(timespec="seconds"),
                base_model_fingerprint=self.base.fingerprint if self.base else None,
            )
            write_atomic(self._name_dir(name) / f"v{manifest.version}.json", manifest.to_json())
        return manifest

    def delete(self, name: str, version: int | None = None) -> None:
        """Delete one version, or every version of `name`; unknown -> AdapterNotFound."""
        validate_name(name)
        with exclusive_lock(self.root / ".lock"):
            live = self._live_versions(name)
            doomed = sorted(live) if version is None else [version]
            if not live or (version is not None and version not in live):
                what = f"{name}@{version}" if version is not None else name
                raise AdapterNotFound(f"no adapter {what}", param="name")
            digests = {self._read(live[v]).digest for v in doomed}
            for v in doomed:
                path = live[v]
                rename_atomic(path, path.with_name(path.name + ".deleted"))
            still_used = {m.digest for m in self.list(all_versions=True)}
            for digest in digests - still_used:
                self._blob_path(digest).unlink(missing_ok=True)

    # ---- reading ---------------------------------------------------------

    def resolve(self, ref: str) -> AdapterManifest:
        """"name" (latest version) or "name@3" -> its manifest."""
        name, version = parse_ref(ref)
        live = self._live_versions(name)
        if not live:
            raise AdapterNotFound(f"no adapter named {name!r}")
        if version is None:
            version = max(live)
        if version not in live:
            have = ", ".join(str(v) for v in sorted(live))
            raise AdapterNotFound(f"adapter {name!r} has no version {version} (it has {have})")
        return self._read(live[version])

    def list(self, *, all_versions: bool = False) -> list[AdapterManifest]:
        """The latest version of each name, by name; every live version with all_versions."""
        names_dir = self.root / "names"
        out = []
        for name_dir in sorted(names_dir.iterdir()) if names_dir.is_dir() else []:
            if not _NAME.fullmatch(name_dir.name):
                continue
            live = self._live_versions(name_dir.name)
            chosen = sorted(live) if all_versions else sorted(live)[-1:]
            out.extend(self._read(live[v]) for v in chosen)
        return out

    def load(self, ref_or_manifest: str | AdapterManifest) -> LoraWeights:
        """The adapter's tensors in float32, B scaled, checked against the base model."""
        if isinstance(ref_or_manifest, AdapterManifest):
            manifest = ref_or_manifest
        else:
            manifest = self.resolve(ref_or_manifest)
        try:
            data = self._blob_path(manifest.digest).read_bytes()
        except FileNotFoundError:
            raise AdapterNotFound(f"adapter {manifest.ref} was deleted") from None
        if blob.digest_of(data) != manifest.digest:
            raise AdapterError(f"stored content of adapter {manifest.ref} is corrupt (digest mismatch)")
        modules = blob.decode(data)
        if self.base is not None:
            try:
                check_fits(modules, self.base)
            except AdapterError as exc:
                raise AdapterError(f"adapter {manifest.ref} does not fit the base model: {exc.message}") from None
        return LoraWeights(
            manifest=manifest,
            modules={
                key: (m.lora_a.to(torch.float32), m.lora_b.to(torch.float32) * m.scaling)
                for key, m in sorted(modules.items())
            },
            rank=manifest.rank,
        )

    # ---- layout ----------------------------------------------------------

    def load_key(self, key: tuple[str, int, str]) -> LoraWeights:
        """Load by the engine's adapter key (name, version, digest): the exact
        content a request was admitted with, or an error if it is gone."""
        name, version, digest = key
        manifest = self.resolve(f"{name}@{version}")
        if manifest.digest != digest:
            raise AdapterError(f"adapter {manifest.ref} no longer has the content it had")
        return self.load(manifest)

    def _blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / f"{digest}.safetensors"

    def _name_dir(self, name: str) -> Path:
        return self.root / "names" / validate_name(name)

    def _scan(self, name: str) -> list[tuple[int, bool, Path]]:
        """(version, live, path) for every manifest or tombstone of `name`."""
        directory = self._name_dir(name)
        found = []
        for path in directory.iterdir() if directory.is_dir() else []:
            match = _MANIFEST.fullmatch(path.name)
            if match:
                found.append((int(match[1]), match[2] is None, path))
        return found

    def _live_versions(self, name: str) -> dict[int, Path]:
        return {v: path for v, live, path in self._scan(name) if live}

    def _all_version_numbers(self, name: str) -> list[int]:
        return [v for v, _, _ in self._scan(name)]

    @staticmethod
    def _read(path: Path) -> AdapterManifest:
        return AdapterManifest.from_json(path.read_bytes())


def _parse_config(config_json: bytes) -> dict:
    """The config as a dict of finite numbers, nested at most MAX_CONFIG_DEPTH deep.

    Python's json reads `NaN`, `Infinity` and `1e400` (as inf), and raises
    RecursionError on deep nesting; all are refused here, as a 400."""
    try:
        cfg = json.loads(config_json, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise _too_deep() from None
    except (UnicodeDecodeError, ValueError) as exc:  # also: integers past sys.get_int_max_str_digits()
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {exc}", param=CONFIG_FILE) from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object", param=CONFIG_FILE)
    # A shallower tree that json.loads still took could exhaust the recursion
    # limit later, in a repr() for an error message.
    stack = [(cfg, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_CONFIG_DEPTH:
            raise _too_deep()
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return cfg


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number; every number must be finite")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range; every number must be finite")
    return value


def _too_deep() -> AdapterError:
    return AdapterError(f"{CONFIG_FILE} is nested deeper than {MAX_CONFIG_DEPTH} levels of arrays and objects",
                        param=CONFIG_FILE)


def _parse_weights(weights: bytes) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors(weights)
    except (SafetensorError, ValueError, TypeError) as exc:  # truncated, malformed, odd dtype
        if weights.startswith(_PICKLE_MAGIC):
            raise AdapterError(PICKLE_MESSAGE, param=WEIGHTS_FILE) from None
        raise AdapterError(f"{WEIGHTS_FILE} is not a valid safetensors file: {exc}", param=WEIGHTS_FILE) from None
