"""Which base model each LoRA adapter belongs to: files an operator keeps in a ConfigMap, reloaded on change.

Each file (a ConfigMap key mounted as a file, or any YAML file) holds one or more YAML documents:

```yaml
baseModel: llama-3.1-8b
adapters:
- sql-lora
- code-lora
```

`--adapters PATH` names a file or a folder (its files, not those starting with `.`: Kubernetes
keeps its `..data` links there); several may be given. The router polls them and swaps in the new
mapping when their content changes. A mapping that does not load (bad YAML, an unknown key, an
adapter claimed by two base models, more than `MAX_ADAPTERS`) is refused as a whole: the previous
one stays, the problem is logged and counted once (until it changes).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import yaml

log = logging.getLogger(__name__)

# More adapters than this in the mapping is refused: it is kept in memory and read per request.
MAX_ADAPTERS = 100_000
# Files bigger than this are refused unread (a ConfigMap holds at most 1 MiB).
MAX_FILE_BYTES = 4 * 1024 * 1024
_KEYS = frozenset({"baseModel", "adapters"})


class AdapterMapError(ValueError):
    """A mapping that cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class AdapterMap:
    """Adapter name -> base model name; a model that is no adapter is its own base."""

    bases: Mapping[str, str]

    def base_of(self, model: str) -> str:
        """The base model of `model` (itself when it is no adapter)."""
        return self.bases.get(model, model)

    def __len__(self) -> int:
        return len(self.bases)


EMPTY = AdapterMap(MappingProxyType({}))


def mapping_files(paths: Sequence[str]) -> list[Path]:
    """The files `paths` name: a file itself, a folder's visible regular files (sorted); AdapterMapError if missing."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files.extend(sorted(p for p in path.iterdir() if not p.name.startswith(".") and p.is_file()))
        elif path.is_file():
            files.append(path)
        else:
            raise AdapterMapError(f"{raw}: no such file or folder (--adapters)")
    return files


def read_files(paths: Sequence[str]) -> list[tuple[str, bytes]]:
    """(name, content) of every mapping file, as they are now (blocking I/O: run it off the event loop)."""
    out = []
    for path in mapping_files(paths):
        try:
            size = path.stat().st_size
            if size > MAX_FILE_BYTES:
                raise AdapterMapError(f"{path}: {size} bytes; a mapping file may hold at most {MAX_FILE_BYTES}")
            out.append((str(path), path.read_bytes()))
        except OSError as exc:
            raise AdapterMapError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    return out


def parse_mapping(files: Sequence[tuple[str, bytes]]) -> AdapterMap:
    """The mapping the files' documents declare; AdapterMapError naming the file for any problem."""
    bases: dict[str, str] = {}
    origin: dict[str, str] = {}
    for name, content in files:
        try:
            documents = [d for d in yaml.safe_load_all(content.decode("utf-8")) if d is not None]
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise AdapterMapError(f"{name}: not YAML: {exc}") from None
        for i, doc in enumerate(documents):
            where = f"{name} (document {i + 1})" if len(documents) > 1 else name
            if not isinstance(doc, dict):
                raise AdapterMapError(f"{where}: must be a mapping with baseModel and adapters")
            unknown = sorted(str(k) for k in doc if k not in _KEYS)
            if unknown:
                raise AdapterMapError(f"{where}: unknown key(s) {unknown}; allowed: adapters, baseModel")
            base, adapters = doc.get("baseModel"), doc.get("adapters", [])
            if not isinstance(base, str) or not base:
                raise AdapterMapError(f"{where}: baseModel must be a non-empty string")
            if not isinstance(adapters, list) or not all(isinstance(a, str) and a for a in adapters):
                raise AdapterMapError(f"{where}: adapters must be a list of adapter names")
            for adapter in adapters:
                if adapter == base:
                    raise AdapterMapError(f"{where}: {adapter!r} is listed as an adapter of itself")
                if bases.get(adapter, base) != base:
                    raise AdapterMapError(f"{where}: adapter {adapter!r} has base model {base!r} here and "
                                          f"{bases[adapter]!r} in {origin[adapter]}")
                bases[adapter] = base
                origin[adapter] = where
            if len(bases) > MAX_ADAPTERS:
                raise AdapterMapError(f"{where}: more than {MAX_ADAPTERS} adapters in the mapping")
    return AdapterMap(MappingProxyType(bases))


def load_mapping(paths: Sequence[str]) -> AdapterMap:
    """Read and parse the mapping files now (blocking)."""
    return parse_mapping(read_files(paths))


def fingerprint(files: Sequence[tuple[str, bytes]]) -> bytes:
    """What identifies the files' names and contents (a change to either is a change)."""
    digest = hashlib.sha256()
    for name, content in files:
        digest.update(name.encode() + b"\0" + hashlib.sha256(content).digest())
    return digest.digest()


class AdapterWatcher:
    """Keeps `current` equal to the mapping the files hold, polling every `interval_s` seconds."""

    def __init__(self, paths: Sequence[str], interval_s: float = 1.0, *,
                 on_reload: Callable[[str], None] = lambda outcome: None) -> None:
        self.paths = tuple(paths)
        self.interval_s = interval_s
        self.on_reload = on_reload  # called with "ok" (a new mapping) or "error" (a new problem)
        self.current = EMPTY
        self._seen: bytes | None = None
        self._last_problem: str | None = None
        self._task: asyncio.Task[None] | None = None

    def load_now(self) -> AdapterMap:
        """The first load (blocking, at start-up); AdapterMapError when it fails: the router does not start."""
        files = read_files(self.paths)
        self.current = parse_mapping(files)
        self._seen = fingerprint(files)
        return self.current

    async def check(self) -> bool:
        """Re-read the files once; True when a new mapping was swapped in."""
        try:
            files = await asyncio.to_thread(read_files, self.paths)
            seen = fingerprint(files)
            if seen == self._seen:
                return False
            self._seen = seen
            mapping = parse_mapping(files)
        except AdapterMapError as exc:
            problem = str(exc)
            if problem != self._last_problem:  # logged and counted once per distinct problem
                log.error("adapter mapping not reloaded, the previous one stays: %s", problem)
                self._last_problem = problem
                self.on_reload("error")
            return False
        self._last_problem = None
        self.current = mapping
        log.info("adapter mapping reloaded: %d adapter(s)", len(mapping))
        self.on_reload("ok")
        return True

    def start(self) -> None:
        """Poll in the background on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._poll(), name="bbr-adapters")

    async def stop(self) -> None:
        """Stop polling."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check()
            except Exception:  # never let a bug stop the reloading for good
                log.exception("adapter mapping check failed")
