"""Reading the config's YAML strictly: duplicate keys refused, errors on one line naming the file."""

from __future__ import annotations

import math
from typing import Any

import yaml

from epp.framework.errors import ConfigError


class _StrictYamlLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (strict decoding, as GIE does)."""


def _construct_mapping(loader: _StrictYamlLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    mapping: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in mapping:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


_StrictYamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(text: str, source: str) -> Any:
    """The one YAML document in `text`; `ConfigError` naming `source` (the file) and the line."""
    loader = _StrictYamlLoader(text)
    loader.name = source  # YAML errors name the file, not "<unicode string>"
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {_yaml_error(exc)}") from None
    finally:
        loader.dispose()


def _yaml_error(exc: yaml.YAMLError) -> str:
    """A YAML error on one line: where (line, column), what, and the construct it was inside."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return " ".join(str(exc).split())
    mark = exc.problem_mark
    text = f"line {mark.line + 1}, column {mark.column + 1}: {exc.problem}"
    if exc.context:
        inside = exc.context
        if exc.context_mark is not None:
            inside += f" at line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1}"
        text += f" ({inside})"
    return text


def yaml_value(value: Any) -> str:
    """A value as it would be written in the YAML file (`true`, not Python's `True`)."""
    dumped = yaml.safe_dump(value, default_flow_style=True, width=math.inf, allow_unicode=True).strip()
    return dumped.removesuffix("\n...").strip()
