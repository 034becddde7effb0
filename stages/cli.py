"""The command line of every stage, generated from its config: one flag per field, with OpenRLHF's names.

    python -m stages.rl --config llama3-8b --advantage_estimator group_norm --help

A stage's values are the `<stage>:` section of --config (a preset name or YAML path) overridden by the flags given;
unknown flags, invalid values, impossible combinations and unset required inputs exit with code 2 naming them.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from stages.config import ConfigError, StageConfig, preset_names, stage_values, validation_messages
from stages.fields import FILES_MAY_BE_READ


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps help text only at spaces, so flag names and numbers in descriptions stay whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

def build_parser(model_cls: type[BaseModel], prog: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one flag per field of `model_cls`, plus --config.

    Unset flags stay out of the namespace, so that a preset's values are only overridden by flags actually given.
    """
    stage = getattr(model_cls, "stage", None)
    parser = argparse.ArgumentParser(
        prog=prog or (f"python -m stages.{stage}" if stage else None),
        usage="%(prog)s [--config PRESET_OR_YAML] [--FLAG VALUE ...] (--help lists every flag)",
        description=(model_cls.__doc__ or "").strip(),
        allow_abbrev=False,
        formatter_class=_HelpFormatter,
    )
    section = f"its {stage}: section" if stage else "its section for this stage"
    parser.add_argument(
        "--config", default=None, metavar="PRESET_OR_YAML",
        help=f"preset ({', '.join(preset_names())}) or YAML path; {section} (or a YAML of this stage's flags "
        "alone) is the base that flags override",
    )
    for name, field in model_cls.model_fields.items():
        _add_field_flag(parser, name, field.annotation, field.default, field.description or "")
    return parser


def _add_field_flag(
    parser: argparse.ArgumentParser, name: str, annotation: Any, default: Any, description: str
) -> None:
    kind, choices, nargs, optional = _cli_shape(name, annotation)
    help_text = description.replace("%", "%%")
    if kind is bool:
        parser.add_argument(f"--{name}", action="store_true", default=argparse.SUPPRESS, help=help_text)
        if not name.startswith("no_"):
            parser.add_argument(
                f"--no_{name}", dest=name, action="store_false", default=argparse.SUPPRESS,
                help=f"turn off --{name} (when a preset turns it on)",
            )
        return
    shown = ("unset" if default is None else " ".join(map(str, default)) if isinstance(default, (tuple, list))
             else default)
    convert: Any = kind
    if optional and nargs is None and choices is None:
        convert = _or_none(kind)
        help_text += "; 'none' unsets it"
    parser.add_argument(
        f"--{name}", type=convert, choices=choices, nargs=nargs, default=argparse.SUPPRESS,
        metavar=None if choices else name.upper(), help=f"{help_text} (default: {shown})",
    )


def _or_none(kind: type) -> Any:
    """The flag's value type, where the word 'none' unsets the field (e.g. a model path a preset sets)."""

    def convert(text: str) -> Any:
        return None if text.lower() == "none" else kind(text)

    convert.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return convert


def _cli_shape(name: str, annotation: Any) -> tuple[type, tuple | None, int | str | None, bool]:
    """(value type, choices, nargs, optional) of a field's flag."""
    optional = False
    if get_origin(annotation) in (Union, types.UnionType):
        options = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(options) != 1:
            raise TypeError(f"field {name}: no command-line form for {annotation!r}")
        annotation, optional = options[0], True
    if get_origin(annotation) is Literal:
        values = get_args(annotation)
        return type(values[0]), values, None, optional
    if get_origin(annotation) is tuple:
        items = get_args(annotation)
        return items[0], None, len(items), optional
    if get_origin(annotation) is list:
        item = get_args(annotation)[0]
        if isinstance(item, type) and issubclass(item, BaseModel):
            return str, None, None, optional  # a YAML file of the items, which the field's validator reads
        return item, None, "+", optional
    if annotation in (bool, int, float, str):
        return annotation, None, None, optional
    raise TypeError(f"field {name}: no command-line form for {annotation!r}")


def parse_stage_args(model_cls: type[StageConfig], argv: list[str] | None = None, *,
                     require_inputs: bool = True) -> StageConfig:
    """The `stage:` section of --config (or the whole file, when it holds only this stage's flags) overridden by
    the flags in argv, validated.

    Exits with code 2 and a message naming the flags on unknown flags, invalid values, impossible combinations
    and (with require_inputs) unset required inputs such as --pretrain.
    """
    stage = model_cls.stage
    parser = build_parser(model_cls)
    argv = sys.argv[1:] if argv is None else list(argv)
    keyed = "--use_wandb" in argv[:-1] and not argv[argv.index("--use_wandb") + 1].startswith("--")
    if keyed or any(word.startswith("--use_wandb=") for word in argv):
        # OpenRLHF's --use_wandb takes the API key; here it is a switch, and the key itself is never echoed.
        parser.error("--use_wandb takes no value here: put the W&B key in WANDB_API_KEY (a key given as a flag "
                     "would reach logs, plans and run parameters)")
    flags = vars(parser.parse_args(argv))
    config = flags.pop("config")
    values: dict[str, Any] = {}
    where = prefix = ""  # the file that values not given as flags come from, and their key prefix there
    if config is not None:
        try:
            values, where, prefix = stage_values(config, stage)
        except ConfigError as error:
            parser.error(str(error))
    values.update(flags)

    def name_of(loc: tuple) -> str:
        field = str(loc[0])
        return f"--{field}" if field in flags or not where else f"{prefix}{field} in {where}"

    try:
        cfg = model_cls.model_validate(values, context=FILES_MAY_BE_READ)
    except ValidationError as error:
        parser.error("\n".join(validation_messages(error, name_of)))
    missing = cfg.missing_inputs() if require_inputs else []
    if missing:
        parser.error(f"missing required {', '.join(missing)}")
    return cfg



def flag_words(name: str, value: Any) -> list[str]:
    """The words of the flag that sets field `name` to `value` on this command line."""
    if isinstance(value, bool):
        return [f"--{name}" if value else f"--no_{name}"]
    if value is None:
        return [f"--{name}", "none"]
    if isinstance(value, (list, tuple)):
        return [f"--{name}", *map(str, value)]
    return [f"--{name}", str(value)]
