"""Flags and LORAGW_* variables generated from dataclass fields, on a small
config of the test's own: naming, variables, "0: none", repeatable lists."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from engine.config_flags import add_flags, config_from_args, section, setting


@dataclass(frozen=True)
class Limits:
    max_waiting: int = setting(8, help="queued requests")
    max_wait_s: float | None = setting(None, zero_is_none=True, help="seconds (0: no bound)")


@dataclass
class Demo:
    port: int = setting(80, help="port")
    drain_timeout_s: float = setting(30.0, help="seconds")
    enable_tiers: bool = setting(True, help="tiers off")
    verbose: bool = setting(False, help="say more")
    db_url: str | None = setting(None, flag="--db", help="database")
    cap: int | None = setting(256, zero_is_none=True, help="cap (0: none)")
    endpoints: tuple[str, ...] = setting(("a",), flag="--endpoint", help="repeatable")
    mode: str = setting("x", choices=("x", "y"), help="mode")
    secret: str | None = setting(None, flag=None, help="set in code")
    premium: Limits = section(Limits, prefix="premium-")
    standard: Limits = section(lambda: Limits(max_waiting=4, max_wait_s=10.0), prefix="standard-", title="std")


def parse(argv: list[str], environ: dict | None = None, config=None) -> Demo:
    config = config or Demo()
    parser = argparse.ArgumentParser()
    add_flags(parser, config, environ=environ or {})
    return config_from_args(config, vars(parser.parse_args(argv)))


def test_flag_names_follow_the_fields():
    parser = argparse.ArgumentParser()
    dests = add_flags(parser, Demo(), environ={})
    options = sorted(o for a in parser._actions for o in a.option_strings if a.dest in dests)
    assert options == sorted([
        "--port", "--drain-timeout", "--no-tiers", "--verbose", "--db", "--cap", "--endpoint", "--mode",
        "--premium-max-waiting", "--premium-max-wait", "--standard-max-waiting", "--standard-max-wait"])
    assert "secret" not in dests


def test_no_flags_give_the_instance_back():
    assert parse([]) == Demo()
    custom = Demo(port=81, premium=Limits(max_waiting=1))
    assert parse([], config=custom) == custom


def test_flags_set_fields_sections_included():
    got = parse(["--port", "81", "--drain-timeout", "2.5", "--no-tiers", "--verbose", "--db", "sqlite://",
                 "--premium-max-waiting", "3", "--standard-max-wait", "7", "--mode", "y"])
    assert (got.port, got.drain_timeout_s, got.enable_tiers, got.verbose, got.db_url, got.mode) == (
        81, 2.5, False, True, "sqlite://", "y")
    assert got.premium == Limits(max_waiting=3)
    assert got.standard == Limits(max_waiting=4, max_wait_s=7.0)


def test_variables_feed_flags_and_a_flag_beats_its_variable():
    env = {"LORAGW_PORT": "90", "LORAGW_DB": "pg://", "LORAGW_NO_TIERS": "yes", "LORAGW_VERBOSE": "1",
           "LORAGW_PREMIUM_MAX_WAITING": "5", "LORAGW_STANDARD_MAX_WAIT": "0", "LORAGW_ENDPOINT": "p, q"}
    got = parse([], env)
    assert (got.port, got.db_url, got.enable_tiers, got.verbose) == (90, "pg://", False, True)
    assert got.premium.max_waiting == 5 and got.standard.max_wait_s is None
    assert got.endpoints == ("p", "q")
    assert parse(["--port", "91"], env).port == 91
    # A switch's variable is on only when it says so.
    assert parse([], {"LORAGW_NO_TIERS": "0", "LORAGW_VERBOSE": "off"}) == Demo()


def test_a_bad_variable_is_refused_like_a_bad_flag(capsys):
    with pytest.raises(SystemExit):
        parse([], {"LORAGW_PORT": "eighty"})
    assert "invalid int value: 'eighty'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--mode", "z"])


def test_zero_means_none_where_the_field_says_so():
    assert parse(["--cap", "0"]).cap is None
    assert parse(["--cap", "64"]).cap == 64
    assert parse([]).cap == 256


def test_a_list_flag_repeats_and_replaces_its_default():
    assert parse([]).endpoints == ("a",)
    assert parse(["--endpoint", "b"]).endpoints == ("b",)
    assert parse(["--endpoint", "b,c", "--endpoint", "d"]).endpoints == ("b", "c", "d")
    assert parse(["--endpoint", "e"], {"LORAGW_ENDPOINT": "p"}).endpoints == ("e",)


def test_a_field_without_a_declared_flag_is_refused():
    @dataclass
    class Undeclared:
        port: int = 80

    @dataclass
    class Unsupported:
        when: dict = setting(default_factory=dict, help="no flag for a dict")

    for config in (Undeclared(), Unsupported()):
        with pytest.raises(TypeError):
            add_flags(argparse.ArgumentParser(), config, environ={})


def test_help_shows_the_default_and_the_variable():
    parser = argparse.ArgumentParser()
    add_flags(parser, Demo(), environ={})
    text = parser.format_help()
    assert "[default: 80; env LORAGW_PORT]" in text
    assert "[env LORAGW_NO_TIERS]" in text
    assert "std:" in text  # a titled section is a group of its own

