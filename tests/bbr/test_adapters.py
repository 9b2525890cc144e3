"""The adapter -> base model mapping: its files, its checks, and its reloading while the router runs."""

from __future__ import annotations

import os

import pytest

from epp.bbr.adapters import AdapterMapError, AdapterWatcher, load_mapping, parse_mapping

LLAMA = b"baseModel: llama-3.1-8b\nadapters: [sql-lora, code-lora]\n"


def test_each_adapter_maps_to_its_base_and_other_models_to_themselves(tmp_path):
    (tmp_path / "llama").write_bytes(LLAMA)
    (tmp_path / "qwen.yaml").write_bytes(b"baseModel: qwen-7b\nadapters:\n- chat-lora\n---\nbaseModel: phi\n")
    (tmp_path / ".hidden").write_bytes(b"not: [yaml")  # Kubernetes' ..data links and the like are skipped
    mapping = load_mapping([str(tmp_path)])
    assert dict(mapping.bases) == {"sql-lora": "llama-3.1-8b", "code-lora": "llama-3.1-8b", "chat-lora": "qwen-7b"}
    assert [mapping.base_of(m) for m in ("sql-lora", "chat-lora", "llama-3.1-8b", "other")] == [
        "llama-3.1-8b", "qwen-7b", "llama-3.1-8b", "other"]


@pytest.mark.parametrize("content, problem", [
    (b"baseModel: [", "not YAML"),
    (b"- a\n- b\n", "must be a mapping with baseModel and adapters"),
    (b"baseModel: m\nadapter: [x]\n", "unknown key(s) ['adapter']"),
    (b"adapters: [x]\n", "baseModel must be a non-empty string"),
    (b"baseModel: m\nadapters: x\n", "adapters must be a list of adapter names"),
    (b"baseModel: m\nadapters: [m]\n", "'m' is listed as an adapter of itself"),
    (b"baseModel: m\nadapters: [x]\n---\nbaseModel: n\nadapters: [x]\n",
     "(document 2): adapter 'x' has base model 'n' here and 'm' in"),
    (b"\xff\xfe", "not YAML"),
])
def test_a_mapping_that_cannot_be_used_names_the_file_and_the_problem(content, problem):
    with pytest.raises(AdapterMapError) as err:
        parse_mapping([("cm/config", content)])
    assert str(err.value).startswith("cm/config") and problem in str(err.value)


def test_a_missing_path_is_an_error(tmp_path):
    with pytest.raises(AdapterMapError, match="no such file or folder"):
        load_mapping([str(tmp_path / "nope")])


async def test_the_watcher_swaps_in_a_changed_mapping_and_keeps_the_last_good_one(tmp_path):
    # A mounted ConfigMap: the key's file is a link into a ..data folder that Kubernetes swaps.
    def publish(version: str, content: bytes) -> None:
        folder = tmp_path / f"..{version}"
        folder.mkdir()
        (folder / "config").write_bytes(content)
        link = tmp_path / "..data_tmp"
        link.symlink_to(folder.name)
        os.replace(link, tmp_path / "..data")

    publish("v1", LLAMA)
    (tmp_path / "config").symlink_to("..data/config")
    outcomes: list[str] = []
    watcher = AdapterWatcher([str(tmp_path)], on_reload=outcomes.append)
    assert watcher.load_now().base_of("sql-lora") == "llama-3.1-8b"
    assert await watcher.check() is False  # nothing changed
    publish("v2", b"baseModel: llama-3.1-8b\nadapters:\n- sql-lora\n- new-lora\n")
    assert await watcher.check() is True
    assert watcher.current.base_of("new-lora") == "llama-3.1-8b"
    publish("v3", b"baseModel: [broken")
    assert await watcher.check() is False
    assert await watcher.check() is False  # the same problem: logged and counted once
    assert watcher.current.base_of("new-lora") == "llama-3.1-8b"  # the last good mapping stays
    publish("v4", b"baseModel: qwen\nadapters: [new-lora]\n")
    assert await watcher.check() is True
    assert watcher.current.base_of("new-lora") == "qwen" and watcher.current.base_of("sql-lora") == "sql-lora"
    assert outcomes == ["ok", "error", "ok"]
