"""The experiment config's schema: every key, its type, bounds, default and description (docs/design.md
section 7, docs/configuration.md). Pure pydantic, no registry: ``fedpcd.resolve`` checks and fills the
open-ended sections' extra keys (the partition scheme's, model's and algorithm's own parameters)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from fedpcd.params import LocalTraining, Section

MAX_THREADS = 1024  # engine.threads


class _Strict(Section):
    # allow_inf_nan=False: lr=inf or a NaN anywhere is a bad value, not a run that diverges later
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class _Open(Section):
    """A section whose extra keys are the named component's own parameters (checked by ``fedpcd.resolve``)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, allow_inf_nan=False)

    def params(self) -> dict[str, Any]:
        """The component's own parameters (everything but the name field)."""
        return dict(self.model_extra or {})


class DatasetConfig(_Strict):
    """The config section ``dataset``: which data, where its files are, how much of the training set."""

    name: str = Field(
        "fmnist",
        description="A registered dataset (`fedpcd list` names them), e.g. fmnist, or hf:<owner>/<name>: a "
        "Hugging Face dataset (needs fedpcd[hf]).",
    )
    root: str | None = Field(
        None,
        description="Folder searched first for the dataset's files; null: $FEDPCD_DATA, the system's "
        "folders, the download cache.",
    )
    train_fraction: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Fraction of the training set used, in (0, 1]: a class-stratified subset drawn with the "
        "seed; the test set is always whole.",
    )
    download: bool = Field(
        True, description="Download missing files from their official source; false: never use the network."
    )
    image_column: str | None = Field(
        None,
        description="hf: datasets only: the column of images, where it is not the only Image feature or "
        "named image / img; null: detected.",
    )
    label_column: str | None = Field(
        None,
        description="hf: datasets only: the column of class labels, where it is not the only ClassLabel or "
        "named label / fine_label / labels; null: detected.",
    )


class PartitionConfig(_Open):
    """The config section ``partition``: the scheme that splits the training set over the clients; its other
    keys are the scheme's own parameters (``fedpcd list SCHEME``)."""

    scheme: str = Field(
        "pathological",
        description="A registered partition scheme (`fedpcd list` names them), e.g. pathological, "
        "dirichlet, iid.",
    )


class ModelConfig(_Open):
    """The config section ``model``: the architecture of each client. Extra keys are the architectures' own
    parameters (shared by all; ``fedpcd list MODEL``)."""

    name: str | list[str] = Field(
        "simplecnn",
        description="A registered architecture for every client, or a list: client k uses "
        "name[k % len(name)] (FedSSA's model zoo: [cnn1, cnn2, cnn3, cnn4, cnn5]).",
    )
    clients: dict[int, str] = Field(
        default_factory=dict, description="Per-client architectures {client id: architecture}, over name."
    )

    def architecture(self, client: int) -> str:
        """The architecture of client ``client``."""
        if client in self.clients:
            return self.clients[client]
        return self.name if isinstance(self.name, str) else self.name[client % len(self.name)]

    def architectures(self, num_clients: int) -> list[str]:
        """The distinct architectures of ``num_clients`` clients, in order of first use (from the names and
        the per-client overrides, never a loop over every client)."""
        names = [self.name] if isinstance(self.name, str) else self.name
        first: dict[str, int] = {}
        for j, arch in enumerate(names):  # the first client using names[j]: j, j + len, ... not overridden
            k = j
            while k < num_clients and k in self.clients:
                k += len(names)
            if k < num_clients:
                first[arch] = min(first.get(arch, k), k)
        for k, arch in self.clients.items():
            if 0 <= k < num_clients:
                first[arch] = min(first.get(arch, k), k)
        return sorted(first, key=first.__getitem__)


class AlgorithmConfig(_Open):
    """The config section ``algorithm``: ``name`` and the algorithm's own parameters (``fedpcd list NAME``),
    and optionally ``preset``: one of its named settings (``paper``, ``official``, ...; ``fedpcd list NAME``
    shows them), filled in by ``fedpcd.presets.apply_preset`` wherever the config does not set the
    key itself."""

    name: str = Field(
        "fedavg",
        description="A registered algorithm (`fedpcd list` names them), e.g. fedavg, fedgela, fednh.",
    )

    @property
    def preset(self) -> str | None:
        """The preset the config names (None: none)."""
        return (self.model_extra or {}).get("preset")

    def params(self) -> dict[str, Any]:
        """The algorithm's own parameters (everything but the name and the preset)."""
        return {k: v for k, v in super().params().items() if k != "preset"}


class EngineConfig(_Strict):
    """The config section ``engine``: how the rounds are executed (none of it changes a sequential run's
    numbers but ``device``)."""

    executor: Literal["auto", "sequential", "vectorized"] = Field(
        "auto",
        description="sequential: one client after another; vectorized: a round's clients at once where the "
        "algorithm allows (rounding-level differences); auto: sequential on this release.",
    )
    workers: int | Literal["auto"] = Field(
        "auto",
        union_mode="left_to_right",
        description="Processes training a round's clients: 1, N, or auto (the usable cores, capped by the "
        "clients per round and memory); a sequential run's results are bitwise the same for any value.",
    )
    threads: int | None = Field(None, ge=1, le=MAX_THREADS, description="Torch threads per process; null: 1.")
    checkpoint_every: int = Field(1, ge=0, description="Rounds between checkpoints (and the last); 0: none.")
    device: str = Field(
        "cpu",
        description="Where tensors live: cpu, cuda, cuda:N or auto (cuda if available); cpu keeps the CPU "
        "runs' results on every machine.",
    )
    client_state: Literal["memory", "disk"] = Field(
        "memory",
        description="Where client states (personal parts) live: memory, or disk (one file per client under "
        "<output_dir>/client_states/).",
    )
    on_divergence: Literal["stop", "drop"] = Field(
        "stop",
        description="A non-finite loss or weight from a client: stop the run with an error naming round, "
        "client and algorithm, or drop that client's update for the round and go on.",
    )
    min_clients: int = Field(
        1,
        ge=1,
        description="The fewest client updates a round aggregates; fewer (clients that raised, diverged and "
        "were dropped, or timed out on Flower) stop the run with an error.",
    )

    @field_validator("workers", mode="before")
    @classmethod
    def _check_workers(cls, value: Any) -> int | str:
        if value == "auto":
            return value
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS:
            raise ValueError(f"must be auto or a number of processes from 1 to {MAX_THREADS}")
        return value

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not re.fullmatch(r"cpu|auto|cuda(:[0-9]+)?", value):
            raise ValueError("valid devices: cpu, cuda, cuda:N (N a device index), auto")
        return value


class FlowerConfig(_Strict):
    """The config section ``flower``: the Flower backend's settings, none of which changes a run's numbers."""

    round_timeout: float = Field(
        3600.0,
        gt=0.0,
        description="Seconds the server waits for a round's replies; a ClientApp that has not answered by "
        "then is left out of the round (a simulation stops it once the run is done).",
    )


class AggregationConfig(_Strict):
    """The config section ``aggregation``: the server's means, the algorithm's own or robust ones (Yin et al.,
    ICML 2018; Krum, Blanchard et al., NeurIPS 2017) for algorithms that declare what their server averages
    (``fedpcd.engine.robust``)."""

    robust: Literal["none", "median", "trimmed_mean", "krum", "multi_krum"] = Field(
        "none",
        description="none: the algorithm's own aggregation; median: the coordinate-wise median; "
        "trimmed_mean: the coordinate-wise mean without the trim fraction of largest and of smallest values "
        "(both unweighted, of every quantity the server averages); krum: the model update with the least sum "
        "of squared distances to its n-f-2 nearest; multi_krum: the mean of the krum_select best (Blanchard "
        "et al., NeurIPS 2017).",
    )
    trim: float = Field(
        0.1, ge=0.0, lt=0.5, description="With trimmed_mean: the fraction cut at each end, in [0, 0.5)."
    )
    byzantine: int = Field(
        0,
        ge=0,
        le=10**6,
        description="With krum and multi_krum: f, the Byzantine clients tolerated; needs n > 2f + 2 updates.",
    )
    krum_select: int | None = Field(
        None, ge=1, le=10**6, description="With multi_krum: m, how many updates are averaged; null: n - f."
    )


class TrackingConfig(_Strict):
    """Experiment trackers mirroring every metrics.jsonl row and the resolved config (``fedpcd.trackers``,
    docs/trackers.md; the extra ``fedpcd[trackers]``). By default all they write stays in the run directory:
    W&B offline under ``wandb/``, MLflow in a SQLite store ``mlflow.db``."""

    loggers: list[Literal["csv", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list,
        description="Trackers mirroring the run: any of csv, tensorboard, wandb, mlflow (a name or a list).",
    )
    project: str = Field(
        "fedpcd",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
        description="The W&B project and the MLflow experiment (letters, digits, '.', '_', '-').",
    )
    group: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="The W&B group and MLflow tag 'group'; a sweep's runs get the sweep's name.",
    )
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline: W&B writes under <output_dir>/wandb only; online: it syncs."
    )
    mlflow_uri: str | None = Field(
        None, min_length=1, description="MLflow tracking URI; null: a SQLite store <output_dir>/mlflow.db."
    )

    @field_validator("loggers", mode="before")
    @classmethod
    def _one_or_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("loggers")
    @classmethod
    def _each_once(cls, value: list[str]) -> list[str]:
        if len(set(value)) < len(value):
            raise ValueError("list each logger once (csv, tensorboard, wandb, mlflow)")
        return value


class SecAggConfig(_Strict):
    """The config section ``privacy.secagg``: SecAgg+ on the Flower backend (``fedpcd.flower.secagg``;
    Flower's ``SecAggPlusWorkflow`` parameters)."""

    num_shares: float = Field(
        1.0,
        gt=0.0,
        description="Shares of each client's secret: a count (at least 3), or a fraction <= 1 of the round's "
        "clients.",
    )
    reconstruction_threshold: float = Field(
        0.5,
        gt=0.0,
        description="Shares needed to rebuild a secret: a count below num_shares, or a fraction <= 1 of "
        "the shares.",
    )
    clipping_range: float = Field(
        8.0, gt=0.0, le=1e6, description="Model values are clipped to [-r, r] before quantization."
    )
    quantization_range: int = Field(
        2**22, ge=2, description="Levels of the quantization; less than modulus_range."
    )
    modulus_range: int = Field(
        2**32, ge=4, le=2**32, description="The masks' modulus: a power of 2, at most 2**32."
    )
    max_weight: float | None = Field(
        None,
        gt=0.0,
        description="The largest client weight (sample count); null: the largest client's training set.",
    )

    @model_validator(mode="after")
    def _check(self) -> SecAggConfig:
        if self.modulus_range & (self.modulus_range - 1):
            raise ValueError(f"privacy.secagg.modulus_range must be a power of 2, got {self.modulus_range}")
        if self.quantization_range >= self.modulus_range:
            raise ValueError("privacy.secagg.quantization_range must be less than modulus_range")
        for name in ("num_shares", "reconstruction_threshold"):
            value = getattr(self, name)
            if value != int(value) and value > 1:
                raise ValueError(
                    f"privacy.secagg.{name} is a count (an integer) or a fraction <= 1, got {value}"
                )
        shares, threshold = self.num_shares, self.reconstruction_threshold
        if 1 < shares <= 2:
            raise ValueError("privacy.secagg.num_shares as a count must be at least 3 (or a fraction <= 1)")
        if shares > 1 and threshold > 1 and threshold >= shares:
            raise ValueError("privacy.secagg.reconstruction_threshold must be less than num_shares")
        return self


class ServerConfig(_Strict):
    """The config section ``server``: the server's optimiser on the mean model update
    (``fedpcd.engine.server_opt``): sgd with lr 1 is plain averaging; momentum is FedAvgM (Hsu, Qi & Brown
    2019); adagrad, adam and yogi are FedOpt (Reddi et al., ICLR 2021, Algorithm 2)."""

    optimizer: Literal["sgd", "momentum", "adagrad", "adam", "yogi"] = Field(
        "sgd",
        description="The server's step on the pseudo-gradient Delta = mean(w_k) - w: sgd (lr 1: plain "
        "averaging), momentum (FedAvgM), adagrad, adam, yogi (FedOpt).",
    )
    lr: float = Field(1.0, gt=0.0, le=1e6, description="The server learning rate eta.")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="With momentum: beta of v <- beta v + Delta.")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="With adagrad, adam, yogi: the first-moment decay.")
    beta2: float = Field(0.99, ge=0.0, lt=1.0, description="With adam, yogi: the second-moment decay.")
    tau: float = Field(
        1e-3, gt=0.0, le=1e6, description="With adagrad, adam, yogi: the adaptivity tau (v starts at tau^2)."
    )


class PrivacyConfig(_Strict):
    """The config section ``privacy``: differential privacy with fixed clipping on every backend
    (``fedpcd.engine.privacy``, docs/privacy.md): each client's model update clipped to L2 norm ``clip``,
    Gaussian noise of std ``noise_multiplier * clip / m`` on the aggregate of m updates; the class statistics
    an algorithm declares, bounded by ``stats_clip`` and ``count_clip`` and noised per client; and SecAgg+."""

    clip: float | None = Field(
        None, gt=0.0, le=1e6, description="L2 norm each client's model update is clipped to; null: DP off."
    )
    noise_multiplier: float = Field(
        0.0,
        ge=0.0,
        le=1e6,
        description="Noise std over clip / m on the aggregate of m updates; > 0 needs clip.",
    )
    delta: float = Field(
        1e-5, gt=0.0, lt=1.0, description="The delta at which each evaluated round reports dp_epsilon."
    )
    clipping: Literal["client", "server"] = Field(
        "client", description="Where updates are clipped: on each client, or on the server (not with secagg)."
    )
    stats_clip: float = Field(
        1.0,
        gt=0.0,
        le=1e6,
        description="L2 norm each class row of a class-statistic upload (class means, header rows) is "
        "clipped to; its noise std is noise_multiplier * stats_clip * sqrt(classes).",
    )
    count_clip: float = Field(
        1.0,
        gt=0.0,
        le=1e6,
        description="L2 norm a client's per-class counts are clipped to; their noise std is "
        "noise_multiplier * count_clip.",
    )
    secagg: SecAggConfig | None = Field(
        None,
        description="SecAgg+ secure aggregation on the Flower backend: a mapping of its settings, true for "
        "the defaults, null: off.",
    )

    @field_validator("secagg", mode="before")
    @classmethod
    def _switch(cls, value: Any) -> Any:  # `privacy.secagg=true`: on with the defaults
        return ({} if value else None) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _noise_needs_clip(self) -> PrivacyConfig:
        if self.noise_multiplier > 0 and self.clip is None:
            raise ValueError("privacy.noise_multiplier > 0 needs privacy.clip (the noise is scaled by it)")
        if self.secagg is not None and self.clip is not None and self.clipping == "server":
            raise ValueError(
                "privacy.clipping=server needs every update on the server, which privacy.secagg hides; "
                "use privacy.clipping=client"
            )
        return self


class Config(_Strict):
    """An experiment: every key of a config file, typed and checked, with its default.

    Every key is optional. Build one with `load_config` (a YAML file and dotted overrides), which also fills
    in the chosen partition scheme's, model's and algorithm's own parameters; `to_dict()` is the resolved
    mapping a run writes as its config.yaml. Its keys are listed below, each section's in `help()` of its
    class (e.g. `help(fedpcd.config.EngineConfig)`); `fedpcd list NAME` shows a component's own parameters.

    Example:
        ```python
        config = load_config("configs/example.yaml", ["rounds=5", "partition.scheme=dirichlet"])
        config.partition.params()  # {'beta': 0.5, 'min_size': 10, ...}: the scheme's parameters, filled
        ```
    """

    seed: int = Field(
        0,
        ge=0,
        description="Seed of every random draw (partition, initial weights, client sampling, batches): the "
        "same config and seed give the same run.",
    )
    dataset: DatasetConfig = Field(default_factory=DatasetConfig, description="The data (section dataset).")
    partition: PartitionConfig = Field(
        default_factory=lambda: PartitionConfig(scheme="pathological", classes_per_client=2),
        description="How the training set is split over the clients: the scheme and its own parameters.",
    )
    clients: int = Field(10, ge=1, description="Number of clients in the federation.")
    participation: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Fraction of the clients sampled each round: round(participation * clients), at least 1.",
    )
    rounds: int = Field(20, ge=1, description="Number of communication rounds.")
    model: ModelConfig = Field(
        default_factory=ModelConfig, description="The architecture of each client and its own parameters."
    )
    local: LocalTraining = Field(
        default_factory=LocalTraining, description="Local training: epochs, batch size, SGD settings."
    )
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig,
        description="The federated method: its name, an optional preset and its own parameters.",
    )
    eval_every: int = Field(
        1, ge=1, description="Evaluate (a metrics.jsonl record) every this many rounds, and in the last."
    )
    personal_test: Literal["full", "split"] = Field(
        "full",
        description="Personal models tested on the full test set too (full: PA-L, PA-V, PA-G besides "
        "PA-split) or on each client's local split only (split: PA-split alone, the FedGELA / FedSSA "
        "protocol; far cheaper for many clients or large models).",
    )
    personal_full_every: int = Field(
        5,
        ge=1,
        description="With personal_test full: the full test set (a pass as costly as local training) every "
        "this many evaluated rounds and in the last, each client's split (PA-split) in the others.",
    )
    geometry: bool = Field(
        False,
        description="The last round also records the class-mean angles of FedGELA's Fig. 2-3 (angle_all, "
        "angle_held, angle_missing; fedpcd report --geometry), one pass of features per model.",
    )
    backend: Literal["local", "flower"] = Field(
        "local", description="local: the in-process simulator; flower: the same rounds on Flower."
    )
    flower: FlowerConfig = Field(
        default_factory=FlowerConfig, description="The Flower backend's settings: the round timeout."
    )
    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="How rounds are executed: executor, workers, threads, checkpoints, device, failures.",
    )
    aggregation: AggregationConfig = Field(
        default_factory=AggregationConfig, description="The server's mean of the updates: own or robust."
    )
    server: ServerConfig = Field(
        default_factory=ServerConfig,
        description="The server's optimiser on the mean model update (sgd with lr 1: plain averaging).",
    )
    privacy: PrivacyConfig = Field(
        default_factory=PrivacyConfig, description="Differential privacy and SecAgg+ (off by default)."
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig,
        description="Experiment trackers mirroring metrics.jsonl (none by default).",
    )
    output_dir: str = Field(
        "runs/example",
        description="The run directory (config.yaml, metrics.jsonl, summary.json, checkpoint/); a sweep's "
        "runs go in folders below it.",
    )

    @property
    def clients_per_round(self) -> int:
        """The clients sampled each round: round(participation * clients), at least 1."""
        return max(1, round(self.participation * self.clients))

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data (JSON types): what the run's config.yaml holds."""
        return self.model_dump(mode="json")
