"""Every ``AccumConfig`` field is reachable from the commands or declared no setting of a run, with
the reason (gradaccum.train.settings): a new field in neither fails here, so it cannot be forgotten."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from gradaccum.cli.main import build_parser
from gradaccum.moe import MODES
from gradaccum.step.config import AccumConfig
from gradaccum.train.settings import (
    ACCUM_SETTINGS,
    BALANCE_CHOICES,
    NOT_RUN_SETTINGS,
    OTHER_FLAGS,
    RUN_SETTINGS,
)
from gradaccum.train.spec import CARD_FIELDS, TrainSpec


def _options(command: str) -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {flag: action for action in sub.choices[command]._actions for flag in action.option_strings}


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(AccumConfig)])
def test_every_accum_config_field_is_a_flag_or_declared_not_a_run_setting(field: str) -> None:
    homes = [
        field in {s.name for s in ACCUM_SETTINGS},
        field in OTHER_FLAGS,
        field in NOT_RUN_SETTINGS,
    ]
    assert sum(homes) == 1, (
        f"AccumConfig.{field} must be exactly one of: a row of gradaccum.train.settings.ACCUM_SETTINGS "
        "(a flag of train, recorded and replayed), OTHER_FLAGS (a flag of its own shape) or "
        "NOT_RUN_SETTINGS (with the reason it is no setting of a run)"
    )
    if field in NOT_RUN_SETTINGS:
        assert len(NOT_RUN_SETTINGS[field]) > 20  # a reason, not a placeholder
    if field in OTHER_FLAGS:
        flag = OTHER_FLAGS[field].split()[0]
        owners = [c for c in ("train", "bench", "accept") if flag in _options(c)]
        assert owners, f"{flag} (AccumConfig.{field}) is no flag of train, bench or accept"


@pytest.mark.parametrize("setting", RUN_SETTINGS, ids=lambda s: s.name)
def test_every_row_is_a_flag_a_spec_field_and_fixed_by_a_run_card(setting: object) -> None:
    name, flag = setting.name, setting.flag  # type: ignore[attr-defined]
    assert name in {f.name for f in dataclasses.fields(TrainSpec)}
    assert name in CARD_FIELDS  # beside --runcard it is refused, naming the card's value
    for command in setting.commands:  # type: ignore[attr-defined]
        action = _options(command)[flag]
        assert action.dest == name
        assert tuple(action.choices) == setting.choices  # type: ignore[attr-defined]
    if setting in ACCUM_SETTINGS:
        for choice in setting.choices:  # type: ignore[attr-defined]
            assert getattr(AccumConfig(**{name: choice}), name) == choice


def test_the_balance_choices_are_the_load_balance_modes_and_off() -> None:
    assert (*MODES, "off") == BALANCE_CHOICES
