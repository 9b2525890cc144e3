"""`epp check-config PATH...`: validate configs and say how each loads.

One plain config file prints its resolved pipeline (exit 0) or the error (exit 1), as it always
did. Several paths, a folder, or a Helm values file print one line per config instead: `loads`,
`maps with notices` (it loads, and some llm-d plugin or field is served differently here: the
first notice is shown) or `refused` with the one-line reason; then a count. A values file holds
its configs as strings under some key (the llm-d guides' `router.epp.pluginsCustomConfig`); each
string that is an EndpointPickerConfig is checked under its key path. `--details` prints every
loaded config's pipeline too.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from epp.config.describe import describe
from epp.config.loader import load_config, load_config_text
from epp.config.schema import KIND
from epp.framework.errors import ConfigError
from epp.requestcontrol.pipeline import LoadedConfig

CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
# Helm or shell templates: their text is not a config until rendered.
_TEMPLATE = re.compile(r"\{\{.*?\}\}|\$\{[A-Za-z_][A-Za-z0-9_]*\}")

LOADS, MAPS, REFUSED, TEMPLATE = "loads", "maps with notices", "refused", "template"


@dataclass(frozen=True)
class ConfigText:
    """One EndpointPickerConfig found in a file: where (the file, and the key path in a values file) and its text."""

    file: str
    key: str  # "" for a config file; `router.epp.pluginsCustomConfig.x.yaml` in a values file
    text: str | None  # None: the file itself is the config (loaded from disk, so errors name its lines)

    @property
    def label(self) -> str:
        return f"{self.file} ({self.key})" if self.key else self.file


@dataclass(frozen=True)
class Outcome:
    """How one config fared: LOADS, MAPS, REFUSED or TEMPLATE, and the one-line reason or notices."""

    config: ConfigText
    status: str
    detail: str = ""
    notices: tuple[str, ...] = ()
    loaded: LoadedConfig | None = None

    def line(self) -> str:
        """The one line `epp check-config` prints for this config."""
        if self.status == LOADS:
            return f"{self.config.label}: loads"
        if self.status == MAPS:
            more = f" (+{len(self.notices) - 1} more)" if len(self.notices) > 1 else ""
            return f"{self.config.label}: maps with notices: {self.notices[0]}{more}"
        return f"{self.config.label}: {self.status}: {self.detail}"


def _is_config(value: Any) -> bool:
    return isinstance(value, dict) and value.get("kind") == KIND


def _embedded(node: Any, path: str) -> Iterator[tuple[str, str]]:
    """(key path, text) of every string under `node` that holds an EndpointPickerConfig."""
    if isinstance(node, dict):
        for key, value in node.items():
            child = f"{path}.{key}" if path else str(key)
            if isinstance(value, str) and KIND in value:
                yield child, value
            else:
                yield from _embedded(value, child)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _embedded(value, f"{path}[{i}]")


def find_configs(path: str) -> tuple[list[ConfigText], list[Outcome]]:
    """The configs in one file, and outcomes for what cannot be read as any (an unreadable file)."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        return [], [Outcome(ConfigText(path, "", None), REFUSED, f"cannot read the file: {reason}")]
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError:
        # A config file gets the loader's own YAML error (with line and column); see load_one.
        return [ConfigText(path, "", None)], []
    if len(documents) == 1 and _is_config(documents[0]):
        return [ConfigText(path, "", None)], []
    found: list[ConfigText] = []
    for i, document in enumerate(documents):
        prefix = f"document {i + 1}" if len(documents) > 1 else ""
        if _is_config(document):
            found.append(ConfigText(path, prefix or "document", yaml.safe_dump(document, sort_keys=False)))
            continue
        for key, embedded in _embedded(document, ""):
            found.append(ConfigText(path, f"{prefix}: {key}" if prefix else key, embedded))
    return found, []


def _notices(loaded: LoadedConfig) -> tuple[str, ...]:
    return tuple(loaded.notices)


def load_one(config: ConfigText) -> Outcome:
    """Load one config and classify the outcome."""
    text = config.text
    if text is None:
        try:
            with open(config.file, encoding="utf-8") as fh:
                raw = fh.read()
        except OSError as exc:
            return Outcome(config, REFUSED, f"cannot read the file: {exc.strerror or exc}")
    else:
        raw = text
    template = _TEMPLATE.search(raw)
    if template:
        return Outcome(config, TEMPLATE, f"holds {template.group(0)!r}: render the template, then check the result")
    try:
        loaded = load_config(config.file) if text is None else load_config_text(text, source=config.label)
    except ConfigError as exc:
        message = str(exc)
        for prefix in (f"{config.label}: ", f"{config.file}: "):
            message = message.removeprefix(prefix)
        return Outcome(config, REFUSED, message)
    notices = _notices(loaded)
    return Outcome(config, MAPS if notices else LOADS, notices=notices, loaded=loaded)


def config_files(paths: Sequence[str]) -> tuple[list[str], list[str]]:
    """The files to check (folders walked for .yaml/.yml/.json, sorted) and the paths that do not exist."""
    files: list[str] = []
    missing: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            for root, dirs, names in os.walk(path):
                dirs.sort()
                files.extend(os.path.join(root, n) for n in sorted(names) if n.endswith(CONFIG_SUFFIXES))
        elif os.path.exists(path):
            files.append(path)
        else:
            missing.append(path)
    return files, missing


def check_paths(paths: Sequence[str]) -> tuple[list[Outcome], list[str]]:
    """Every config under `paths`, loaded; and the files that hold none (values files without a config)."""
    files, missing = config_files(paths)
    outcomes = [Outcome(ConfigText(p, "", None), REFUSED, "no such file or folder") for p in missing]
    without: list[str] = []
    for path in files:
        found, errors = find_configs(path)
        outcomes.extend(errors)
        if not found and not errors:
            without.append(path)
        outcomes.extend(load_one(config) for config in found)
    return outcomes, without


def summary(outcomes: Sequence[Outcome]) -> str:
    """`N configs: a load, b map with notices, c refused[, d templates set aside]`."""
    counts = {status: sum(1 for o in outcomes if o.status == status) for status in (LOADS, MAPS, REFUSED, TEMPLATE)}
    text = (f"{len(outcomes)} config(s): {counts[LOADS]} load, {counts[MAPS]} map with notices, "
            f"{counts[REFUSED]} refused")
    if counts[TEMPLATE]:
        text += f", {counts[TEMPLATE]} template(s) set aside"
    return text


def check_config_main(paths: str | Sequence[str], *, details: bool = False, listing: bool | None = None) -> int:
    """`epp check-config`: exit 0 when every config loads, else 1.

    One plain config file prints its pipeline (or its error on stderr); anything else (several
    paths, a folder, a values file, `listing=True`) prints one line per config and a count.
    """
    paths = [paths] if isinstance(paths, str) else list(paths)
    single = len(paths) == 1 and not os.path.isdir(paths[0])
    if single and not listing:
        found, errors = find_configs(paths[0]) if os.path.exists(paths[0]) else ([], [])
        if not os.path.exists(paths[0]) or errors or (len(found) == 1 and found[0].text is None):
            try:
                loaded = load_config(paths[0])
            except ConfigError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            sys.stdout.write(describe(loaded))
            return 0
    outcomes, without = check_paths(paths)
    for outcome in outcomes:
        print(outcome.line())
        if details and outcome.loaded is not None:
            sys.stdout.write("".join(f"    {line}\n" for line in describe(outcome.loaded).splitlines()))
    for path in without:
        print(f"{path}: no EndpointPickerConfig in it")
    print(summary(outcomes))
    return 0 if outcomes and all(o.status in (LOADS, MAPS) for o in outcomes) else 1
