"""Parameter types: bad usage exits 2 with a usage message."""

from __future__ import annotations

import re
from typing import Any, ClassVar

import click

from ckptconv.errors import TransformError
from ckptconv.transforms.keys import compile_pattern


class Regex(click.ParamType):  # type: ignore[type-arg]
    name = "REGEX"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            compile_pattern(value)
        except TransformError as error:
            self.fail(str(error), param, ctx)
        return str(value)


class RenameRule(click.ParamType):  # type: ignore[type-arg]
    name = "REGEX=REPL"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[str, str]:
        if isinstance(value, tuple):
            return value
        match = re.match(r"^((?:[^=\\]|\\.)*)=(.*)$", value, re.S)
        if not match or not match.group(1):
            self.fail(f"{value!r} is not REGEX=REPLACEMENT (e.g. '^backbone\\.=encoder.')", param, ctx)
        pattern, replacement = match.group(1).replace("\\=", "="), match.group(2)
        try:
            regex = compile_pattern(pattern)
        except TransformError as error:
            self.fail(str(error), param, ctx)
        for group in re.findall(r"\\(\d+)|\\g<(\w+)>", replacement):
            number, name = group
            known = (
                int(number) <= regex.groups
                if number
                else (name.isdigit() and int(name) <= regex.groups) or name in regex.groupindex
            )
            if not known:
                self.fail(f"replacement {replacement!r} refers to a group {pattern!r} does not have", param, ctx)
        try:
            regex.sub(replacement, "")  # parses the template even where nothing matches: bad escapes such as \\x
        except (re.error, IndexError) as error:
            self.fail(f"replacement {replacement!r} is invalid: {error}", param, ctx)
        return pattern, replacement


class CastTarget(click.ParamType):  # type: ignore[type-arg]
    name = "fp16|bf16|fp32|fp64"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from ckptconv.dtypes import parse_cast_target

        try:
            return parse_cast_target(value).name
        except ValueError as error:
            self.fail(str(error), param, ctx)


class Size(click.ParamType):  # type: ignore[type-arg]
    name = "SIZE"
    _UNITS: ClassVar[dict[str, int]] = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).upper() if match else ""
        if not match or unit not in self._UNITS:
            self.fail(f"{value!r} is not a size such as 5GB, 500MB or 2GiB", param, ctx)
        from fractions import Fraction

        size = Fraction(match.group(1)) * self._UNITS[unit]  # exact: 0.1GB is 100000000 bytes
        if size < 1 or size.denominator != 1:
            self.fail(f"{value!r} is not a whole number of bytes of at least 1 (e.g. 5GB, 500MB, 2GiB)", param, ctx)
        return int(size)


class Prefix(click.ParamType):  # type: ignore[type-arg]
    name = "PREFIX"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        if not str(value).strip(". "):
            self.fail("a prefix must name at least one component, e.g. 'module'", param, ctx)
        return str(value)


# ---------------------------------------------------------------------------------------
# Option sets: the options fields' flags come from ckptconv.options; the rest are shared here


class ShardSpec(click.ParamType):  # type: ignore[type-arg]
    """``--shard INDEX/COUNT`` or ``auto`` (the scheduler's variables), checked here: a bad one exits 2."""

    name = "INDEX/COUNT"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        import os

        from ckptconv.batching.sharding import Shard, parse_shard

        if isinstance(value, Shard):
            return value
        try:
            return parse_shard(str(value), os.environ)
        except ValueError as error:
            self.fail(str(error), param, ctx)


class PartSpec(click.ParamType):  # type: ignore[type-arg]
    """``--part INDEX/COUNT``, checked here: a bad one exits 2; the options field keeps its spelling."""

    name = "INDEX/COUNT"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from ckptconv.writing.parts import parse_part

        try:
            return str(parse_part(str(value)))
        except ValueError as error:
            self.fail(str(error), param, ctx)
