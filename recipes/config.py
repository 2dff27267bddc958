"""Training configuration: one YAML file, validated once, so a typo fails before any compute is spent.

Every section forbids unknown fields: a misspelt key is an error that names it, never a silent default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator, model_validator

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


class RouteConfig(Section):
    """One TREAD route: blocks start..end (inclusive) see a ``rate`` fraction of tokens dropped."""

    start: Annotated[int, Field(ge=0)]
    end: Annotated[int, Field(ge=0)]
    rate: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.5
    selector: str = "random"

    @model_validator(mode="after")
    def _ordered(self) -> RouteConfig:
        if self.end < self.start:
            raise ValueError(f"end ({self.end}) must be >= start ({self.start})")
        return self


class DARConfig(Section):
    """DAR residual aggregation: the query kind and the chunk size (sources summarised per chunk)."""

    query: Literal["static", "static_t", "dynamic"] = "static"
    chunk: PositiveInt | None = 4


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
    """How samples are drawn for grids and metrics: ODE steps and classifier-free guidance scale."""

    steps: PositiveInt = 18
    guidance: Annotated[float, Field(ge=0)] = 1.0


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
    Annotated[list[RouteConfig], Tag("list")] | Annotated[Literal["default"], Tag("default")],
    Discriminator(lambda value: "default" if isinstance(value, str) else "list"),
]
_TAGS = {"list", "default", "edm", "rf"}  # union branch names pydantic puts in error paths; not fields


class TrainConfig(Section):
    """The whole recipe. ``routes: []`` and ``dar: null`` train the unmodified model."""

    model: ModelConfig
    routes: Routes = Field(default_factory=list)
    dar: DARConfig | None = None
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
    def _routes_in_order(cls, routes: list[RouteConfig] | str) -> list[RouteConfig] | str:
        if isinstance(routes, list):
            for before, after in zip(routes, routes[1:]):
                if after.start <= before.end:
                    raise ValueError(f"routes must be ordered and disjoint: {before.start}..{before.end} "
                                     f"then {after.start}..{after.end}")
        return routes

    @property
    def routed(self) -> bool:
        """Whether routekit rewrites the model at all (vanilla configs never call rk.apply)."""
        return self.routes == "default" or bool(self.routes) or self.dar is not None


def _describe(error: ValidationError, source: str) -> ConfigError:
    """A pydantic error as one line per bad field, named by its dotted path."""
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"] if part not in _TAGS) or "<top level>"
        value = item.get("input")
        got = f" (got {value!r})" if item["type"] != "missing" and not isinstance(value, (dict, list)) else ""
        lines.append(f"  {where}: {item['msg'].removeprefix('Value error, ')}{got}")
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
