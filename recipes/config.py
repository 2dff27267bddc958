"""Training configuration: one YAML file, validated once, so a typo fails before any compute is spent.

Every section forbids unknown fields: a misspelt key is an error that names it, never a silent default.
``routes`` and ``dar`` are routekit's own ``Route`` and ``DAR``, so a recipe means exactly what
``routekit.apply`` is given, with the library's defaults and checks.

A resumed run keeps its checkpoint's configuration; only the ``RESUMABLE`` fields may change, and only
when asked for by name (``resumed``).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

import routekit as rk

PositiveInt = Annotated[int, Field(ge=1)]
Cadence = Annotated[int, Field(ge=0, description="every N steps; 0 turns it off")]


class ConfigError(ValueError):
    """A config that does not validate; the message lists each bad field by its dotted path."""


class Section(BaseModel):
    """Base of every section: unknown keys are errors, and assignments are validated too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    """Which backbone to build: ``backbones.<backbone>.build(size, **overrides)``."""

    backbone: Literal["dit", "rwkv", "mamba"]
    size: str = "S/2"
    overrides: dict[str, Any] = Field(default_factory=dict)


def _by_field(cls: type[BaseModel]) -> Any:
    """``cls`` as a config field whose errors name the bad field (``routes.0.kepe``).

    routekit's constructors fold every problem of a Route or DAR into one ConfigError, which a recipe
    would report at the entry (``routes.0``) only. A subclass with pydantic's plain ``__init__`` runs the
    same field validators but reports each problem at its own path; once it passes, the field holds the
    real ``cls``, built by its own constructor."""
    fields = type(f"{cls.__name__}Fields", (cls,), {"__init__": BaseModel.__init__, "__doc__": cls.__doc__})

    def check(value: Any) -> Any:
        if isinstance(value, dict):
            fields.model_validate(value)  # raises with per-field paths, which pydantic nests under ours
        return value

    return Annotated[cls, BeforeValidator(check)]


RouteField = _by_field(rk.Route)
DARField = _by_field(rk.DAR)


class EDMConfig(Section):
    """EDM (Karras et al. 2022) as used by TREAD: log-normal training sigmas, Heun sampling."""

    kind: Literal["edm"] = "edm"
    P_mean: float = -1.2
    P_std: Annotated[float, Field(gt=0)] = 1.2
    sigma_data: Annotated[float, Field(gt=0)] = 0.5
    sigma_min: Annotated[float, Field(gt=0)] = 0.002
    sigma_max: Annotated[float, Field(gt=0)] = 80.0
    rho: Annotated[float, Field(gt=0)] = 7.0


class RFConfig(Section):
    """Rectified flow / SiT linear interpolant x_t = (1 - t) x + t eps with a velocity target."""

    kind: Literal["rf"] = "rf"
    t_sampling: Literal["uniform", "logit_normal"] = "uniform"


class OptimiserConfig(Section):
    """AdamW with a linear warmup; the rate is constant afterwards, as in DiT/TREAD."""

    lr: Annotated[float, Field(gt=0)] = 1e-4
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    grad_clip: Annotated[float, Field(gt=0)] | None = 1.0


class EMAConfig(Section):
    """Exponential moving average of the weights; before ``start`` the EMA simply copies them."""

    decay: Annotated[float, Field(ge=0, le=1)] = 0.9999
    start: Annotated[int, Field(ge=0)] = 0


class SamplerConfig(Section):
    """How samples are drawn for grids and metrics: ODE steps, the guidance scale and its kind.

    ``guidance_kind: cfg`` is classifier-free guidance: the unconditional half is the same model given the
    null class, both halves in one batched call. ``pdg`` is SPRINT's Path-Drop Guidance: the weak half is the
    model with its fused routes' blocks dropped (``routekit.path_drop``) and the null class, a separate and
    cheaper call; it needs a route with ``fuse`` (the model learnt to predict without those blocks by path
    drop in training)."""

    steps: PositiveInt = 18
    guidance: Annotated[float, Field(ge=0)] = 1.0
    guidance_kind: Literal["cfg", "pdg"] = "cfg"

    @model_serializer(mode="wrap")
    def _kind_only_where_set(self, dump: Any) -> dict[str, Any]:
        """``guidance_kind`` is written only where it is not the default: the section then dumps as it did
        before the field existed, so the configurations that runs, checkpoints and the convergence benchmark's
        fingerprints recorded before it read back, compare and hash as they were."""
        data = dump(self)
        if self.guidance_kind == "cfg":
            data.pop("guidance_kind")
        return data


STAGE_FORM = "{step: N, rate: R} or {seconds: S, rate: R}"


class Stage(Section):
    """From ``step`` steps taken (or ``seconds`` training seconds) on, every route routes ``rate`` of its
    tokens around its blocks. SPRINT pre-trains with most tokens dropped and fine-tunes briefly with none.

    A stage by step is exact: a run resumed across it takes the same steps as one that was not. A stage by
    training seconds is for runs compared at equal training time (benchmarks/convergence.py gives every
    method the same seconds, not steps); it begins at the first log step whose training seconds reach it,
    so where it falls depends on the clock, and a checkpoint records the step at which it began."""

    step: int | None = None
    seconds: float | None = None
    rate: float

    @field_validator("step", "seconds", "rate", mode="before")
    @classmethod
    def _not_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        return value

    @field_validator("step")
    @classmethod
    def _step_after_start(cls, step: int | None) -> int | None:
        if step is not None and step < 1:
            raise ValueError(f"a stage begins after step 0 (the routes' own rate holds until the first stage); "
                             f"got {step}")
        return step

    @field_validator("seconds")
    @classmethod
    def _seconds_after_start(cls, seconds: float | None) -> float | None:
        if seconds is not None and not seconds > 0:
            raise ValueError(f"a stage begins after 0 training seconds (the routes' own rate holds until the "
                             f"first stage); got {seconds}")
        return seconds

    @field_validator("rate")
    @classmethod
    def _rate_in_range(cls, rate: float) -> float:
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"rate is the fraction of tokens routed around the blocks and must be in [0, 1), "
                             f"got {rate}")
        return rate

    @model_validator(mode="after")
    def _one_start(self) -> Stage:
        if (self.step is None) == (self.seconds is None):
            raise ValueError(f"a stage begins at a step or at training seconds, exactly one: {STAGE_FORM}")
        return self

    @property
    def begins(self) -> float:
        """Where it begins, in its own unit (steps or training seconds)."""
        return self.step if self.step is not None else self.seconds


class EvalConfig(Section):
    """Metrics cadence: Fréchet distance and classifier accuracy on EMA samples."""

    every: Cadence = 0
    samples: PositiveInt = 500


class SampleConfig(Section):
    """Sample-grid cadence: a PNG of ``per_class`` EMA samples for every class."""

    every: Cadence = 0
    per_class: PositiveInt = 8


class CheckpointConfig(Section):
    """Checkpoint cadence; ``final`` also writes one at the last step; only the newest ``keep`` stay."""

    every: Cadence = 0
    final: bool = True
    keep: PositiveInt = 2


class DataConfig(Section):
    """Dataset: offline MNIST-5k (32x32, 1 channel) or a deterministic synthetic set for smoke tests."""

    name: Literal["mnist", "synthetic"] = "mnist"
    limit: PositiveInt | None = None
    cache_dir: str | None = None


Routes = Annotated[
    Annotated[list[RouteField], Tag("list")] | Annotated[Literal["default"], Tag("default")],
    Discriminator(lambda value: "default" if isinstance(value, str) else "list"),
]
_TAGS = {"list", "default", "edm", "rf"}  # union branch names pydantic puts in error paths; not fields


class TrainConfig(Section):
    """The whole recipe. ``routes: []`` and ``dar: null`` train the unmodified model."""

    model: ModelConfig
    routes: Routes = Field(default_factory=list)
    dar: DARField | None = None
    stages: list[Stage] = Field(default_factory=list)
    objective: Annotated[EDMConfig | RFConfig, Field(discriminator="kind")] = Field(default_factory=EDMConfig)
    optimiser: OptimiserConfig = Field(default_factory=OptimiserConfig)
    batch: PositiveInt = 256
    steps: PositiveInt = 10_000
    ema: EMAConfig = Field(default_factory=EMAConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    sample: SampleConfig = Field(default_factory=SampleConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    seed: int = 0
    bf16: bool = False
    compile: bool = False
    log_every: PositiveInt = 10

    @field_validator("routes")
    @classmethod
    def _routes_in_order(cls, routes: list[rk.Route] | str) -> list[rk.Route] | str:
        if isinstance(routes, list):
            for before, after in zip(routes, routes[1:]):
                if after.start <= before.end:
                    raise ValueError(f"routes must be ordered and disjoint: {before.start}..{before.end} "
                                     f"then {after.start}..{after.end}")
        return routes

    @field_validator("stages")
    @classmethod
    def _stages_in_order(cls, stages: list[Stage]) -> list[Stage]:
        if len({stage.step is None for stage in stages}) > 1:
            raise ValueError(f"stages begin all by step or all by training seconds, not both: {STAGE_FORM}")
        for before, after in zip(stages, stages[1:]):
            if after.begins <= before.begins:
                unit = "step" if after.step is not None else "seconds"
                raise ValueError(f"stages must begin in increasing order of {unit}: {before.begins} then "
                                 f"{after.begins}")
        return stages

    @model_validator(mode="after")
    def _needs_routes(self) -> TrainConfig:
        """Stages change the routes' rate and PDG drops a fused route's blocks: both need those routes."""
        if self.stages and not (self.routes == "default" or self.routes):
            raise _field_error(("stages",), "stages change the routes' rate, and this recipe has no routes "
                               "(routes: []): add a route, or remove stages", self.stages)
        if self.sampler.guidance_kind == "pdg" and not self.fused:
            raise _field_error(("sampler", "guidance_kind"), "path-drop guidance (pdg) runs the model without "
                               "its fused routes' blocks, and this recipe has no fused route: give a route "
                               "`fuse: sprint`, or use guidance_kind: cfg", "pdg")
        return self

    @property
    def fused(self) -> bool:
        """Whether some route ends in SPRINT's fusion, which path-drop guidance needs."""
        return isinstance(self.routes, list) and any(route.fuse is not None for route in self.routes)

    @property
    def routed(self) -> bool:
        """Whether routekit rewrites the model at all (vanilla configs never call rk.apply)."""
        return self.routes == "default" or bool(self.routes) or self.dar is not None


def _field_error(where: tuple[str, ...], message: str, value: Any) -> ValidationError:
    """An error about one field found by a check across fields: reported at that field's path, as pydantic
    reports its own (a plain ValueError here would be reported at the top level)."""
    detail = InitErrorDetails(type=PydanticCustomError("value_error", message), loc=where, input=value)
    return ValidationError.from_exception_data("TrainConfig", [detail])


def _describe(error: ValidationError, source: str) -> ConfigError:
    """A pydantic error as one line per bad field, named by its dotted path."""
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"] if part not in _TAGS) or "<top level>"
        value = item.get("input")
        message = item["msg"].removeprefix("Value error, ")
        shown = item["type"] != "missing" and not isinstance(value, (dict, list)) and "got " not in message
        lines.append(f"  {where}: {message}" + (f" (got {value!r})" if shown else ""))
    return ConfigError(f"invalid config {source}:\n" + "\n".join(lines))


def parse_config(data: dict[str, Any], source: str = "<dict>") -> TrainConfig:
    """Validate a plain dict (e.g. parsed YAML) into a TrainConfig, or raise ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {source}: expected a mapping at the top level, "
                          f"got {type(data).__name__}")
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as error:
        raise _describe(error, source) from None


def load_config(path: str | Path) -> TrainConfig:
    """Read and validate a YAML recipe."""
    path = Path(path)
    with path.open() as handle:
        data = yaml.safe_load(handle)
    return parse_config(data if data is not None else {}, str(path))


def with_overrides(config: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """A copy of config with dotted keys replaced (``{"model.overrides.depth": 2}``), validated again."""
    data = config.model_dump()
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[leaf] = value
    return parse_config(data, "with overrides " + ", ".join(overrides))


RESUMABLE = frozenset({
    "steps", "log_every", "eval.every", "sample.every", "checkpoint.every", "checkpoint.final", "checkpoint.keep",
    "data.cache_dir",
})
"""Fields a resumed run may change: how long it goes on, how often it logs, evaluates, draws grids and
writes checkpoints, and where cached files live. Every other field decides what a training step computes
(model, routes, stages, dar, objective, optimiser, batch, seed, data, ema, precision, compile) or what an
evaluation measures (eval.samples, sampler, sample.per_class), so changing it would silently make a
different run that carries the old one's name and history."""


class _Unset:
    def __repr__(self) -> str:
        return "(unset)"


UNSET = _Unset()  # a field one config has and the other lacks (e.g. P_mean of edm against rf)


def differences(saved: TrainConfig, given: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """Every field where two configs differ, by dotted path: ``{"batch": (256, 64)}``. Lists of sections
    (routes) are compared entry by entry when their lengths agree, so the path names the entry; sections
    of different kinds (an edm against an rf objective) differ as a whole."""
    found: dict[str, tuple[Any, Any]] = {}

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict) and a.get("kind") == b.get("kind"):
            for key in dict.fromkeys([*a, *b]):
                walk(a.get(key, UNSET), b.get(key, UNSET), f"{path}.{key}" if path else key)
        elif (isinstance(a, list) and isinstance(b, list) and len(a) == len(b)
              and any(isinstance(x, dict) for x in a)):
            for index, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}.{index}")
        elif a != b:
            found[path] = (a, b)

    walk(saved.model_dump(mode="json"), given.model_dump(mode="json"), "")
    return found


def resumed(saved: TrainConfig, given: TrainConfig, overridden: Collection[str],
            source: str = "the checkpoint") -> tuple[TrainConfig, dict[str, tuple[Any, Any]]]:
    """The configuration a resumed run continues with (``given``) and what it changes, or ConfigError.

    ``saved`` is the checkpoint's configuration, the source of truth. ``given`` may differ from it only in
    fields named in ``overridden`` (dotted keys, a section's key covering its fields) that are RESUMABLE:
    a YAML that merely differs is refused, so resuming with the wrong recipe can never go unnoticed."""
    changes = differences(saved, given)
    refused = []
    for path, (old, new) in changes.items():
        asked = any(path == key or path.startswith(key + ".") for key in overridden)
        if path not in RESUMABLE:
            why = "fixed for the whole run"
        elif not asked:
            why = f"may change on resume, but only when overridden by name (--set {path}={yaml_value(new)})"
        else:
            continue
        refused.append(f"  {path}: saved {old!r}, given {new!r} ({why})")
    if refused:
        raise ConfigError(
            f"the configuration given differs from the one {source} was trained with:\n" + "\n".join(refused)
            + "\nResume with no YAML to continue with the saved configuration. Only these fields may change "
            f"on resume, each overridden by name: {', '.join(sorted(RESUMABLE))}")
    return given, changes


def yaml_value(value: Any) -> str:
    """A value as ``--set KEY=VALUE`` (YAML) reads it back."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
