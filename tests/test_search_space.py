"""The fine-tuning search space: parsing, one-line errors, and what Tune receives. No Ray cluster needed."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from ray import tune

from pipelines.image.search_space import PARAMS, SearchSpace, build_search_alg

ROOT = Path(__file__).resolve().parent.parent


def test_constants_and_distributions_become_tune_domains():
    space = SearchSpace.parse({"lr": {"loguniform": [1e-3, 1e-1]}, "steps": {"grid": [100, 200]}, "resolution": 64})
    tuned = space.to_tune("grid")
    assert isinstance(tuned["lr"], tune.search.sample.Float)
    assert tuned["lr"].lower == pytest.approx(1e-3) and tuned["lr"].upper == pytest.approx(1e-1)
    assert tuned["steps"] == {"grid_search": [100, 200]}
    assert tuned["resolution"] == 64


def test_unset_parameters_take_the_given_defaults_then_the_built_in_ones():
    tuned = SearchSpace.parse({"lr": 0.03}).to_tune("random", {"resolution": 32})
    assert tuned == {"lr": 0.03, "steps": PARAMS["steps"][1], "resolution": 32, "weight_decay": 0.0, "aug_strength": 0.0}


def test_a_parameter_without_any_value_is_an_error():
    with pytest.raises(ValueError, match="no value for resolution"):
        SearchSpace.parse({}).to_tune("grid")


def test_grid_lists_are_choices_for_the_random_searcher():
    tuned = SearchSpace.parse({"lr": {"grid": [0.1, 0.01]}}).to_tune("random", {"resolution": 32})
    assert isinstance(tuned["lr"], tune.search.sample.Categorical)
    assert tuned["lr"].categories == [0.1, 0.01]


def test_randint_includes_its_upper_bound():
    tuned = SearchSpace.parse({"steps": {"randint": [10, 20]}}).to_tune("random", {"resolution": 32})
    assert (tuned["steps"].lower, tuned["steps"].upper) == (10, 21)  # Tune's upper bound is exclusive



def test_numbers_that_yaml_reads_as_strings_in_exponent_notation_are_numbers():
    import yaml

    # PyYAML (YAML 1.1) reads 1e-4, without a dot, as the string '1e-4'; pydantic's float fields take it.
    space = SearchSpace.parse(yaml.safe_load("lr: {loguniform: [1e-4, 1e-2]}\nweight_decay: 1e-5\nsteps: {grid: [1e3]}"))
    assert space.get("lr").values == (1e-4, 1e-2)
    assert space.get("weight_decay").value == 1e-5
    assert space.get("steps").values == (1000,)

@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"momentum": 0.9}, r"search_space: unknown parameter 'momentum'; known: lr, steps"),
        ({"lr": {"loguniform": [0.1, 0.01]}}, r"search_space\.lr: empty range \[0\.1, 0\.01\]"),
        ({"weight_decay": {"uniform": [0.1, 0.1]}}, r"search_space\.weight_decay: empty range"),
        ({"steps": {"grid": []}}, r"search_space\.steps: grid is empty"),
        ({"lr": {"choice": []}}, r"search_space\.lr: choice is empty"),
        ({"steps": {"uniform": [10, 20]}}, r"search_space\.steps: takes integers"),
        ({"lr": {"randint": [1, 3]}}, r"search_space\.lr: takes real numbers"),
        ({"lr": -0.1}, r"search_space\.lr: -0\.1 is out of range \(must be > 0"),
        ({"aug_strength": {"grid": [0.5, 1.5]}}, r"search_space\.aug_strength: 1\.5 is out of range"),
        ({"steps": 12.5}, r"search_space\.steps: expected an integer"),
        ({"lr": {"loguniform": [0.0, 0.1]}}, r"search_space\.lr: 0\.0 is out of range"),
        ({"weight_decay": {"loguniform": [0.0, 0.1]}}, r"search_space\.weight_decay: loguniform needs low > 0"),
        ({"lr": {"normal": [0, 1]}}, r"search_space\.lr: expected a number or one of"),
        ({"lr": {"uniform": [0.1]}}, r"search_space\.lr: uniform expects \[low, high\]"),
        ({"lr": "fast"}, r"search_space\.lr: expected a number"),
    ],
)
def test_bad_specs_raise_one_line_naming_the_parameter(spec, message):
    with pytest.raises(ValueError, match=message) as info:
        SearchSpace.parse(spec)
    assert "\n" not in str(info.value)


def test_the_grid_searcher_refuses_ranges():
    space = SearchSpace.parse({"lr": {"loguniform": [1e-3, 1e-1]}})
    with pytest.raises(ValueError, match=r"searcher 'grid' takes constants and grid values only; search_space\.lr is loguniform"):
        space.check_searcher("grid")
    space.check_searcher("random")  # accepted


def test_trial_count_is_the_grid_product_times_samples_for_grid_and_samples_otherwise():
    space = SearchSpace.parse({"lr": {"grid": [1, 2, 3]}, "steps": {"grid": [10, 20]}, "weight_decay": 0.0})
    assert space.num_trials("grid", 2) == 12
    assert space.num_trials("random", 5) == 5


def test_pbt_mutates_only_the_searched_parameters_that_can_change_mid_trial():
    space = SearchSpace.parse({"lr": {"loguniform": [1e-3, 1e-1]}, "steps": {"grid": [10, 20]}, "weight_decay": {"choice": [0.0, 1e-4]}})
    mutations = space.pbt_mutations()
    assert set(mutations) == {"lr", "weight_decay"}
    assert mutations["weight_decay"] == [0.0, 1e-4]


def test_pbt_without_a_mutable_searched_parameter_is_an_error():
    with pytest.raises(ValueError, match="scheduler 'pbt' needs at least one of lr, weight_decay, aug_strength searched"):
        SearchSpace.parse({"lr": 0.01, "steps": {"grid": [10, 20]}}).pbt_mutations()


def test_the_bayes_searcher_is_optuna_proposing_values_inside_the_space():
    from ray.tune.search.optuna import OptunaSearch

    space = SearchSpace.parse({"lr": {"loguniform": [1e-3, 1e-1]}, "steps": {"grid": [10, 20]}})
    space.check_searcher("bayes")
    searcher = build_search_alg("bayes", "val_top1", "max", 0)
    assert isinstance(searcher, OptunaSearch)
    assert searcher.set_search_properties("val_top1", "max", space.to_tune("bayes", {"resolution": 16}))
    proposals = [searcher.suggest(f"trial-{i}") for i in range(5)]
    assert all(1e-3 <= p["lr"] <= 1e-1 and p["steps"] in (10, 20) for p in proposals)
    assert len({p["lr"] for p in proposals}) == 5  # sampled, not a constant


def _site_packages_without(tmp_path: Path, *missing: str) -> Path:
    """This interpreter's site-packages, entry by entry as links, less the distributions named `missing`."""
    farm = tmp_path / "site-packages"
    farm.mkdir()
    for sitedir in dict.fromkeys((sysconfig.get_path("purelib"), sysconfig.get_path("platlib"))):
        for entry in Path(sitedir).iterdir():
            project = entry.name.split("-")[0].split(".")[0].lower()  # optuna/, optuna-5.1.0.dist-info
            if project not in missing and not (farm / entry.name).exists():
                (farm / entry.name).symlink_to(entry)
    return farm


def test_the_bayes_searcher_without_a_backend_says_none_is_installed(tmp_path):
    # `bayes_backend` asks `importlib.util.find_spec`, which finds any package on the path, even one that fails
    # to import: so a Python (-S: no site-packages of its own) whose site-packages lacks both backends.
    farm = _site_packages_without(tmp_path, "optuna", "hyperopt")
    check = ("import site, sys; site.addsitedir(sys.argv[1]); from pipelines.image.search_space import SearchSpace; "
             "SearchSpace.parse({'lr': {'loguniform': [1e-3, 1e-1]}}).check_searcher('bayes')")
    done = subprocess.run([sys.executable, "-S", "-c", check, str(farm)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "ValueError: searcher 'bayes' needs optuna or hyperopt installed; neither is (use 'random' or 'grid')")


def test_grid_and_random_use_tunes_own_variant_generator_holding_the_concurrency_limit():
    from ray.tune.search.basic_variant import BasicVariantGenerator

    for searcher in ("grid", "random"):
        alg = build_search_alg(searcher, "val_top1", "max", 0, max_concurrent=3)
        assert isinstance(alg, BasicVariantGenerator) and alg.max_concurrent == 3


def _drawn_configs(seed: int) -> list[dict]:
    """The trial configs the random searcher draws with `seed`, generated without Ray."""
    space = SearchSpace.parse({"lr": {"loguniform": [1e-3, 1e-1]}, "aug_strength": {"uniform": [0.0, 1.0]}})
    alg = build_search_alg("random", "val_top1", "max", seed)
    alg.add_configurations({"sweep": {"run": lambda config: None, "num_samples": 4,
                                      "config": space.to_tune("random", {"resolution": 16})}})
    trials = iter(alg.next_trial, None)
    return [trial.config for trial in trials]


def test_the_random_searcher_draws_the_same_trials_from_the_same_seed():
    first = _drawn_configs(0)
    assert _drawn_configs(0) == first
    assert _drawn_configs(1) != first
