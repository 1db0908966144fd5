"""Engine options are defined once, on `EngineConfig`'s fields: every command that builds an engine has
exactly one flag per field with the field's default, the config imports no torch, and the flags every
command shares (`hearth.contracts.cli_common`) mean the same everywhere."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import textwrap

import pytest

from hearth.contracts.options import OPTION, Option, options_of
from hearth.engine.config import GROUPS, EngineConfig


def _serve_parser() -> argparse.ArgumentParser:
    from hearth.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def _offline_parser() -> argparse.ArgumentParser:
    from hearth.bench.offline import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def _node_parser() -> argparse.ArgumentParser:
    from hearth.engine.ranks.node import build_parser

    return build_parser()


ENGINE_CLIS = {"hearth serve": _serve_parser, "hearth bench offline": _offline_parser, "node": _node_parser}
# Flags that fill several fields at once (parsed into them by `EngineConfig.from_cli_args`).
COMPOSITE_FLAGS = {"speculative_config"}


def test_every_field_is_an_option_or_says_it_is_not():
    for f in dataclasses.fields(EngineConfig):
        assert OPTION in f.metadata, f"{f.name}: use option(...) or not_an_option(...)"
    options = dict((f.name, spec) for f, spec in options_of(EngineConfig))
    assert set(options) == {f.name for f in dataclasses.fields(EngineConfig)} - {
        "load_progress",
        "ngram_lookup",
    }
    assert {spec.group for spec in options.values()} == set(GROUPS)


@pytest.mark.parametrize("cli", sorted(ENGINE_CLIS))
def test_each_engine_cli_has_one_flag_per_field_with_its_default(cli):
    parser = ENGINE_CLIS[cli]()
    field_names = {f.name for f in dataclasses.fields(EngineConfig)}
    listed = [a for a in parser._actions if a.dest in field_names and a.help != argparse.SUPPRESS]
    by_dest: dict[str, list[argparse.Action]] = {}
    for action in listed:
        by_dest.setdefault(action.dest, []).append(action)
    for f, spec in options_of(EngineConfig):
        actions = by_dest.pop(f.name, [])
        assert len(actions) == 1, f"{cli}: {f.name} has {len(actions)} flags"
        action = actions[0]
        flags = tuple(
            s for s in action.option_strings if not s.startswith("--no-")
        )  # BooleanOptionalAction's
        assert flags == spec.flag_names(f.name), f.name
        default = None if f.default is dataclasses.MISSING else f.default
        assert action.default == default, (
            f"{cli}: --{f.name} defaults to {action.default!r}, the field to {default!r}"
        )
        if spec.choice_names() is not None:
            assert tuple(action.choices) == spec.choice_names(), f.name
    assert by_dest == {}, f"{cli}: flags for fields that are not options: {sorted(by_dest)}"
    extra = {a.dest for a in parser._actions if a.dest in COMPOSITE_FLAGS}
    assert extra == COMPOSITE_FLAGS


def test_each_sub_config_is_owned_by_its_layer_and_holds_its_groups_options():
    from hearth.engine.config import SchedulerOptions
    from hearth.engine.speculative.options import SpeculativeOptions
    from hearth.kv.options import CacheOptions, KVTierOptions
    from hearth.kv_transfer.options import KVTransferOptions
    from hearth.model.options import ModelOptions
    from hearth.parallel.options import ParallelOptions

    owners = {
        "model": ModelOptions,
        "cache": CacheOptions,
        "scheduler": SchedulerOptions,
        "parallel": ParallelOptions,
        "speculative": SpeculativeOptions,
        "kv_transfer": KVTransferOptions,
        "kv_tiers": KVTierOptions,
    }
    assert set(owners) == set(GROUPS)
    config = EngineConfig(model="/m")
    every_field: list[str] = []
    for group, owner in owners.items():
        names = [f.name for f in dataclasses.fields(owner)]
        assert {f.name for f, spec in options_of(owner)} == {
            f.name for f, spec in options_of(EngineConfig) if spec.group == group
        }, group
        assert isinstance(config, owner)
        every_field += names
    assert sorted(every_field) == sorted(f.name for f in dataclasses.fields(EngineConfig))  # each once
    assert dataclasses.fields(EngineConfig)[0].name == "model"  # EngineConfig("/m", ...) keeps working


def test_no_flags_give_the_constructors_defaults():
    for cli, build in ENGINE_CLIS.items():
        args = build().parse_args(["--model", "/m"])
        assert EngineConfig.from_cli_args(args) == EngineConfig(model="/m"), cli


def test_a_field_value_outside_its_choices_is_refused_as_the_flag_would_be():
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda, got 'tpu'"):
        EngineConfig(model="/m", device="tpu")
    with pytest.raises(ValueError, match="role must be one of mixed, prefill, decode"):
        EngineConfig(model="/m", role="both")
    with pytest.raises(ValueError, match="unknown speculative method 'medusa'; choose one of draft, eagle3"):
        EngineConfig(model="/m", speculative_method="medusa")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model="/m", kv_cache_dtype="int8")


def test_the_config_module_imports_no_torch():
    code = textwrap.dedent(
        """
        import argparse, sys
        from hearth.engine.config import EngineConfig
        parser = argparse.ArgumentParser()
        EngineConfig.add_cli_arguments(parser)
        args = parser.parse_args(["--speculative-config", '{"method": "suffix"}', "-q", "awq_marlin"])
        EngineConfig.from_cli_args(args, model="/m")
        EngineConfig(model="/m", speculative_method="ngram", kv_transfer="mooncake", role="decode")
        print("torch" in sys.modules)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def _router_parser() -> argparse.ArgumentParser:
    from hearth.router.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def _launch_parser() -> argparse.ArgumentParser:
    from hearth.launch import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


SHARED = {"hearth serve": _serve_parser, "hearth route": _router_parser, "hearth launch": _launch_parser}


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    return next((a for a in parser._actions if flag in a.option_strings), None)


@pytest.mark.parametrize(
    "flag",
    [
        "--host",
        "--port",
        "--log-level",
        "--page-size",
        "--kv-transfer-secret-file",
        "--admin-key-file",
        "--admin-key",
        "--kv-transfer-secret",
    ],
)
def test_a_flag_the_commands_share_means_the_same_in_each(flag):
    actions = {cli: _action(build(), flag) for cli, build in SHARED.items()}
    present = {cli: a for cli, a in actions.items() if a is not None}
    assert present, flag
    first = next(iter(present.values()))
    for cli, action in present.items():
        assert (action.type, action.choices, action.metavar, action.dest) == (
            first.type,
            first.choices,
            first.metavar,
            first.dest,
        ), f"{flag} differs in {cli}"


def test_shared_flags_parse_alike():
    for cli in ("hearth serve", "hearth route", "hearth launch"):
        parser = SHARED[cli]()
        with pytest.raises(SystemExit):
            parser.parse_args(["--port", "70000"])
    assert _router_parser().parse_args(["--log-level", "DEBUG"]).log_level == "debug"
    assert _serve_parser().parse_args([]).log_level == "info"
    assert _router_parser().parse_args([]).log_level == "warning"
    assert _router_parser().parse_args([]).page_size == EngineConfig(model="/m").page_size


def test_option_is_a_frozen_spec():
    spec = Option(help="h", group="model")
    assert spec.flag_names("max_num_seqs") == ("--max-num-seqs",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.help = "x"  # type: ignore[misc]
