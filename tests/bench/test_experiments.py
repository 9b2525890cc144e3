"""The contender lists: the comparison's contenders, the registry of experiments apart, and configs that load."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.routing.contenders import CONTENDERS, Tuning, epp_config
from bench.routing.experiments import EXPERIMENTS, FAMILIES, family_of, known, lookup
from bench.standing import anchor
from epp.config import load_config_text
from epp.engine.sim.fleet import default_tokenizer_dir

NOTES = Path(__file__).resolve().parents[2] / "bench" / "notes"


def test_experiments_are_apart_from_the_comparison_and_never_in_all():
    assert not set(EXPERIMENTS) & set(CONTENDERS)
    assert all(not c.default for c in EXPERIMENTS.values())
    # One family per experiment, names unique across the families.
    names = [c.name for f in FAMILIES for c in f.contenders]
    assert len(names) == len(set(names)) == len(EXPERIMENTS)
    # The variants that answered one question once are experiments, not contenders.
    for name in ("epp-approx-random-ties", "epp-precise-pods2-random-ties", "epp-approx-pods2-home",
                 "epp-approx-no-home", "epp-precise-scrape500", "epp-approx-headers-scrape200",
                 "epp-precise-no-tie-break", "epp-approx-w4", "epp-precise-ttft-oracle", "epp-approx-repeat"):
        assert name in EXPERIMENTS and family_of(name).question


def test_every_family_says_where_its_answer_is_written():
    for family in FAMILIES:
        file, _, fragment = family.note.partition("#")
        text = (NOTES / file).read_text()
        assert fragment in {anchor(line) for line in text.splitlines() if line.startswith("#")}, family.note


def test_lookup_finds_both_lists_and_names_them_when_it_cannot():
    assert lookup("epp-approx") is CONTENDERS["epp-approx"]
    assert lookup("epp-approx-random-ties") is EXPERIMENTS["epp-approx-random-ties"]
    assert set(known()) == set(CONTENDERS) | set(EXPERIMENTS)
    with pytest.raises(KeyError, match="experiments: .*epp-approx-random-ties"):
        lookup("epp-nothing")


@pytest.mark.parametrize("name", sorted(n for n, c in known().items() if c.kind == "epp"))
def test_every_epp_contender_and_experiment_config_loads(name):
    tuning = Tuning(tokenizer_dir=default_tokenizer_dir(), block_size=16, prefill_s_per_token=1e-4,
                    mean_prompt_tokens=1000)
    loaded = load_config_text(epp_config(known()[name].variant, tuning), source=name)
    assert loaded.plugins and loaded.source == name
