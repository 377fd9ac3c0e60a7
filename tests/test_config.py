"""Each trainer flag is written once: as a ``TrainConfig`` field, whose metadata the parser is
generated from, and which the launcher, the drill and the checkpoint manager use by the same name.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_config.py
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from elastic_trainer import config, flag_tables, flags
from elastic_trainer.cli import launch
from elastic_trainer.checkpoint import CheckpointManager
from elastic_trainer.config import SECTIONS, TrainConfig, flag_name, train_field, train_flag_fields
from elastic_trainer.drill import scenario

NOT_A_FLAG = {"task_args"}  # the parsed argparse.Namespace handed to the task builder, set by flags.parse_train_config


def _actions_by_dest(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    out: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:  # argparse has no public list of a parser's arguments
        out.setdefault(action.dest, []).append(action)
    return out


def _section_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str | None:
    titles = {title: section for section, title in SECTIONS.items()}
    for group in parser._action_groups:  # nor of its groups
        if action in group._group_actions:
            return titles.get(group.title)
    return None


def test_the_six_sections_are_the_trainers_argument_groups():
    assert list(SECTIONS) == ["data", "optimization", "checkpoint", "logs", "execution", "profiling"]
    with pytest.raises(ValueError, match="section 'misc'"):
        config.flag("misc", "help")


def test_every_trainer_field_has_exactly_one_flag_in_one_section_with_help():
    parser = flags.build_train_parser(environ={})
    actions = _actions_by_dest(parser)
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    assert {f.name for f in train_flag_fields()} == set(names) - NOT_A_FLAG
    for name in set(names) - NOT_A_FLAG:
        assert len(actions.get(name, [])) == 1, f"{name}: {len(actions.get(name, []))} arguments"
        action = actions[name][0]
        assert action.option_strings[0] == flag_name(name), f"{name} is spelled {action.option_strings}"
        assert _section_of(parser, action) == train_field(name).metadata["section"], name
        assert train_field(name).metadata["help"].strip() and train_field(name).metadata["help"] in action.help
    for name in NOT_A_FLAG:
        assert name not in actions


def test_the_parser_has_no_trainer_flag_that_is_not_a_field():
    from elastic_trainer.tasks import example_args

    parser = flags.build_train_parser(environ={})
    fields = {f.name for f in train_flag_fields()}
    example = set(vars(example_args()))
    assert set(_actions_by_dest(parser)) - {"help"} == fields | example
    assert not fields & example, "the example task redeclares a trainer flag"


def test_the_generated_defaults_are_the_dataclass_defaults():
    args = flags.build_train_parser(environ={}).parse_args([])
    for f in train_flag_fields():
        assert getattr(args, f.name) == f.default, f.name
    parsed = flags.parse_train_config([], flags.build_train_parser(environ={}))
    default = TrainConfig()
    for f in train_flag_fields():
        assert getattr(parsed, f.name) == getattr(default, f.name), f.name


def test_the_env_vars_named_in_the_metadata_replace_the_defaults():
    environ = {config.ENV_CHECKPOINT_DIR: "s3://b/ck", config.ENV_LOG_DIR: "/logs"}
    parsed = flags.parse_train_config([], flags.build_train_parser(environ=environ))
    assert (parsed.checkpoint_dir, parsed.log_dir) == ("s3://b/ck", "/logs")
    parsed = flags.parse_train_config(["--checkpoint-dir", "x"], flags.build_train_parser(environ=environ))
    assert parsed.checkpoint_dir == "x"


@pytest.mark.parametrize("argv, name, value", [
    (["--no-resume"], "resume", False),
    (["--resume"], "resume", True),
    (["--no-async-checkpoint"], "async_checkpoint", False),
    (["--sync-checkpoint"], "async_checkpoint", False),  # the older spelling still works
    (["--sample-ledger", "--no-sample-ledger"], "sample_ledger", False),  # the last one wins
    (["--micro-batch-size", "none"], "micro_batch_size", None),
    (["--max-steps", "7"], "max_steps", 7),
])
def test_flags_parse_to_the_field_of_the_same_name(argv, name, value):
    assert getattr(flags.build_train_parser(environ={}).parse_args(argv), name) == value


def test_a_bad_value_names_the_flag():
    with pytest.raises(ValueError, match="--keep-checkpoints must be a positive number"):
        TrainConfig(keep_checkpoints=0)
    with pytest.raises(ValueError, match="--device must be auto, cpu or cuda"):
        TrainConfig(device="tpu")


def test_the_checkpoint_manager_takes_the_configs_names_and_defaults():
    params = inspect.signature(CheckpointManager).parameters
    for name in ("keep_checkpoints", "async_checkpoint"):
        assert params[name].default == train_field(name).default, name


def test_the_launchers_storage_flags_are_the_trainers_declarations():
    launcher = _actions_by_dest(launch.build_parser())
    for name in launch.SHARED_TRAINER_FLAGS:
        (action,) = launcher[name]
        assert action.option_strings == [flag_name(name)]
        default_text = config.RunConfig.__dataclass_fields__[name].metadata["default_text"]
        assert flag_tables.split_default(action.help) == (train_field(name).metadata["help"], default_text)
        assert action.default is None  # "not given here"; the run's default is RunConfig's, which the help names
    trainer_flags = {flag_name(f.name) for f in train_flag_fields()}
    others = {s for a in launch.build_parser()._actions if a.dest not in launch.SHARED_TRAINER_FLAGS
              for s in a.option_strings}
    assert not others & trainer_flags


def test_every_launcher_field_has_one_flag_in_its_section_whose_default_is_the_fields():
    parser = launch.build_parser()
    actions = _actions_by_dest(parser)
    titles = {title: section for section, title in config.RUN_SECTIONS.items()}
    for f in config.run_flag_fields():
        (action,) = actions[f.name]
        assert action.option_strings[0] == flag_name(f.name), f"{f.name} is spelled {action.option_strings}"
        assert action.default is None, f.name  # "not given": the default is the field's, written once
        group = next(g for g in parser._action_groups if action in g._group_actions)
        assert titles[group.title] == f.metadata["section"], f.name
        if not f.metadata["trainer"]:
            assert f.metadata["help"].strip() and f.metadata["help"] in action.help, f.name
    assert {"program", "trainer"}.isdisjoint(actions)  # not flags
    run, default = launch.parse_run_config([]), config.RunConfig(run_id=config.DEFAULT_RUN_ID)
    for f in config.run_flag_fields():
        if f.name not in ("rdzv_conf", "recovery"):  # the launcher chooses the recovery mode
            assert getattr(run, f.name) == getattr(default, f.name), f.name
    assert run.recovery == run.rdzv_conf["recovery"] == "live" and run.trainer == TrainConfig(
        checkpoint_dir=run.checkpoint_dir, log_dir=run.log_dir, task_args=run.trainer.task_args)


def test_the_drill_declares_no_trainer_flag():
    trainer_flags = {flag_name(f.name) for f in train_flag_fields()}
    drill_flags = {s for a in scenario.build_parser()._actions for s in a.option_strings}
    # --seed is the drill's own: the seed of its random fault targets (the trainer's is in --trainer-args)
    assert drill_flags & trainer_flags <= {"--seed"}


def test_the_drills_default_trainer_args_parse_with_the_generated_parser():
    handed_over = {config.ENV_CHECKPOINT_DIR: "out/checkpoints", config.ENV_LOG_DIR: "out/nodes/node-0"}
    parsed = flags.parse_train_config(list(scenario.DEFAULT_TRAINER_ARGS), flags.build_train_parser(environ=handed_over))
    assert parsed.task_args.task_argv == []
    assert (parsed.global_batch_size, parsed.checkpoint_every, parsed.sample_ledger) == (12, 5, True)
    assert not parsed.wandb
    assert parsed.checkpoint_dir == "out/checkpoints"
