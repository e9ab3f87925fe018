"""The fine-tuning search space: a typed config, checked up front, turned into a Ray Tune space.

Five hyper-parameters can be searched; each is a constant or one distribution:

    search_space:
      lr: {loguniform: [0.003, 0.1]}
      steps: {grid: [500, 1000]}
      resolution: 384
      weight_decay: 0.0
      aug_strength: {uniform: [0.0, 0.5]}

`resolution` takes a constant, grid or choice only: every size is checked
against the model's patch size before the sweep starts.

Searchers: "grid" runs the cartesian product of the `grid` values (times
`num_samples`); "random" and "bayes" draw `num_samples` trials, reading `grid`
lists as choices. "bayes" uses Optuna or HyperOpt, whichever is installed.
Every searcher's draws are a function of the config's seed.
"""

from __future__ import annotations

import importlib.util
import math
import re
from typing import Any, Literal

from dataclasses import dataclass, field

Searcher = Literal["grid", "random", "bayes"]
KINDS = ("grid", "choice", "uniform", "loguniform", "randint")

# name -> (int-valued?, default, lowest allowed, highest allowed, lowest excluded?)
PARAMS: dict[str, tuple[bool, float | int | None, float, float, bool]] = {
    "lr": (False, 0.01, 0.0, math.inf, True),
    "steps": (True, 500, 1, math.inf, False),
    "resolution": (True, None, 1, math.inf, False),  # None: the data's image size
    "weight_decay": (False, 0.0, 0.0, math.inf, False),
    "aug_strength": (False, 0.0, 0.0, 1.0, False),
}
MUTABLE = ("lr", "weight_decay", "aug_strength")  # what PBT may change mid-trial
# Only listed values can each be checked up front (a resolution must be a multiple of the patch size).
ENUMERATED = ("resolution",)


# A number in exponent notation as PyYAML (YAML 1.1) reads it when it has no dot: the string '1e-4'.
_EXPONENT_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _check_value(name: str, value: Any) -> float | int:
    integer, _, low, high, open_low = PARAMS[name]
    if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value):
        value = float(value)  # `lr: 1e-4` in a YAML config is the number the user wrote, as pydantic reads it
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"search_space.{name}: expected a number, got {value!r}")
    if integer and (not isinstance(value, int) and not float(value).is_integer()):
        raise ValueError(f"search_space.{name}: expected an integer, got {value!r}")
    if not math.isfinite(value) or value < low or value > high or (open_low and value == low):
        bound = f"> {low}" if open_low else f">= {low}"
        upper = f" and <= {high}" if math.isfinite(high) else ""
        raise ValueError(f"search_space.{name}: {value!r} is out of range (must be {bound}{upper})")
    return int(value) if integer else float(value)


@dataclass(frozen=True)
class Param:
    """One searched hyper-parameter: a constant, or exactly one distribution."""

    name: str
    value: float | int | None = None
    kind: str | None = None  # None: the constant `value`
    values: tuple[float | int, ...] = ()  # grid/choice values, or the (low, high) of a range

    @classmethod
    def parse(cls, name: str, spec: Any) -> Param:
        """Read `spec` (a number, or a one-key mapping such as `{loguniform: [lo, hi]}`) for `name`."""
        if name not in PARAMS:
            raise ValueError(f"search_space: unknown parameter {name!r}; known: {', '.join(PARAMS)}")
        integer = PARAMS[name][0]
        if not isinstance(spec, dict):
            return cls(name=name, value=_check_value(name, spec))
        if len(spec) != 1 or next(iter(spec)) not in KINDS:
            raise ValueError(
                f"search_space.{name}: expected a number or one of {{{', '.join(KINDS)}: [...]}}, got {spec!r}"
            )
        kind, raw = next(iter(spec.items()))
        if not isinstance(raw, (list, tuple)):
            raise ValueError(f"search_space.{name}: {kind} expects a list, got {raw!r}")
        if kind in ("grid", "choice"):
            if not raw:
                raise ValueError(f"search_space.{name}: {kind} is empty")
            return cls(name=name, kind=kind, values=tuple(_check_value(name, v) for v in raw))
        if name in ENUMERATED:
            raise ValueError(f"search_space.{name}: {kind} draws sizes that need not be multiples of the patch size; "
                             f"list the sizes with grid or choice")
        if len(raw) != 2:
            raise ValueError(f"search_space.{name}: {kind} expects [low, high], got {raw!r}")
        if kind in ("uniform", "loguniform") and integer:
            raise ValueError(f"search_space.{name}: takes integers; use grid, choice or randint, not {kind}")
        if kind == "randint" and not integer:
            raise ValueError(f"search_space.{name}: takes real numbers; use uniform or loguniform, not randint")
        low, high = (_check_value(name, v) for v in raw)
        if kind == "loguniform" and low <= 0:
            raise ValueError(f"search_space.{name}: loguniform needs low > 0, got {low!r}")
        if low >= high:
            raise ValueError(f"search_space.{name}: empty range [{low!r}, {high!r}] (low must be below high)")
        return cls(name=name, kind=kind, values=(low, high))

    @property
    def candidates(self) -> tuple[float | int, ...]:
        """Every value a discrete parameter can take (ranges: their two ends)."""
        return (self.value,) if self.kind is None else self.values

    def to_tune(self, searcher: Searcher) -> Any:
        """The Tune domain (or constant) for this parameter."""
        from ray import tune

        if self.kind is None:
            return self.value
        if self.kind == "grid" and searcher == "grid":
            return tune.grid_search(list(self.values))
        if self.kind in ("grid", "choice"):
            return tune.choice(list(self.values))
        low, high = self.values
        if self.kind == "uniform":
            return tune.uniform(low, high)
        if self.kind == "loguniform":
            return tune.loguniform(low, high)
        return tune.randint(int(low), int(high) + 1)  # Tune's upper bound is exclusive; ours is inclusive


@dataclass(frozen=True)
class SearchSpace:
    """The five hyper-parameters of a fine-tuning trial (unset ones keep their defaults)."""

    params: dict[str, Param] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: Any) -> SearchSpace:
        """Read a `{parameter: number | {kind: [...]}}` mapping; one-line ValueError on bad input."""
        if spec is None:
            spec = {}
        if not isinstance(spec, dict):
            raise ValueError(f"search_space must be a mapping of parameter -> spec, got {type(spec).__name__}")
        return cls({str(name): Param.parse(str(name), value) for name, value in spec.items()})

    def get(self, name: str) -> Param | None:
        """The parameter `name` as configured, or None when left to its default."""
        return self.params.get(name)

    def max_value(self, name: str) -> float | int | None:
        """The largest value `name` can take, or None when it is unset."""
        param = self.params.get(name)
        return None if param is None else max(param.candidates)

    def values_of(self, name: str) -> tuple[float | int, ...]:
        """All values of a discrete parameter, or the ends of its range."""
        param = self.params.get(name)
        return () if param is None else param.candidates

    def check_searcher(self, searcher: Searcher) -> None:
        """Raise a one-line ValueError when `searcher` cannot take this space."""
        if searcher == "grid":
            ranged = [p.name for p in self.params.values() if p.kind not in (None, "grid")]
            if ranged:
                raise ValueError(
                    f"searcher 'grid' takes constants and grid values only; search_space.{ranged[0]} is "
                    f"{self.params[ranged[0]].kind} (use searcher 'random' or 'bayes')"
                )
        if searcher == "bayes":
            bayes_backend()

    def num_trials(self, searcher: Searcher, num_samples: int) -> int:
        """How many trials Tune will run."""
        if searcher != "grid":
            return num_samples
        return num_samples * math.prod(len(p.values) for p in self.params.values() if p.kind == "grid")

    def to_tune(self, searcher: Searcher, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        """Tune's `param_space`: every parameter; unset ones from `defaults`, else the built-in default."""
        space = {name: spec[1] for name, spec in PARAMS.items()}
        space.update(defaults or {})
        space.update({name: p.to_tune(searcher) for name, p in self.params.items()})
        missing = [name for name, value in space.items() if value is None]
        if missing:
            raise ValueError(f"search_space: no value for {', '.join(missing)}")
        return space

    def pbt_mutations(self) -> dict[str, Any]:
        """PBT's `hyperparam_mutations`: the searched parameters that may change mid-trial."""
        out = {}
        for name in MUTABLE:
            param = self.params.get(name)
            if param is None or param.kind is None:
                continue
            out[name] = list(param.values) if param.kind in ("grid", "choice") else param.to_tune("random")
        if not out:
            raise ValueError(f"scheduler 'pbt' needs at least one of {', '.join(MUTABLE)} searched (not constant)")
        return out

    def pbt_ranges(self) -> dict[str, tuple[float | int, ...]]:
        """The `(low, high)` of each ranged parameter PBT mutates, which its perturbations must stay within."""
        return {name: p.values for name, p in self.params.items()
                if name in MUTABLE and p.kind in ("uniform", "loguniform", "randint")}


class ClipToRanges:
    """PBT's `custom_explore_fn`: Tune multiplies a ranged value by 0.8 or 1.2 whatever its range, so a
    perturbed `aug_strength` could pass 1 (a crop area below zero past 1.33) and `lr` leave the searched
    range; each is put back within its [low, high]. A class, not a closure: Tune pickles its scheduler."""

    def __init__(self, bounds: dict[str, tuple[float | int, ...]]) -> None:
        self.bounds = dict(bounds)

    def __call__(self, config: dict[str, Any]) -> dict[str, Any]:
        for name, (low, high) in self.bounds.items():
            if name in config:
                config[name] = min(max(config[name], low), high)
        return config


def bayes_backend() -> str:
    """"optuna" or "hyperopt", whichever is installed (Optuna first); a ValueError when neither is."""
    for name in ("optuna", "hyperopt"):
        if importlib.util.find_spec(name) is not None:
            return name
    raise ValueError("searcher 'bayes' needs optuna or hyperopt installed; neither is (use 'random' or 'grid')")


def build_search_alg(searcher: Searcher, metric: str, mode: str, seed: int, max_concurrent: int = 0) -> Any:
    """The Tune search algorithm for `searcher`, its draws a function of `seed`.

    Grid and random get Tune's own variant generator, seeded (Tune's default one
    draws from numpy's global RNG) and holding the concurrency limit itself: Tune
    ignores `max_concurrent_trials` for a generator passed in. Bayes gets Optuna
    or HyperOpt; Tune wraps those in its concurrency limiter.
    """
    if searcher != "bayes":
        from ray.tune.search.basic_variant import BasicVariantGenerator

        return BasicVariantGenerator(max_concurrent=max_concurrent, random_state=seed)
    if bayes_backend() == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        return OptunaSearch(metric=metric, mode=mode, seed=seed)
    from ray.tune.search.hyperopt import HyperOptSearch

    return HyperOptSearch(metric=metric, mode=mode, random_state_seed=seed)


__all__ = ["MUTABLE", "PARAMS", "ClipToRanges", "Param", "SearchSpace", "Searcher", "bayes_backend", "build_search_alg"]
