"""The run configuration's schema: the nested dataclasses of :class:`RunConfig`, the legal values
of each setting, and :meth:`RunConfig.validate`, the checks that need no file access."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from emdlm.config.errors import ConfigError, check_choice, did_you_mean
from emdlm.domains import (
    COUNT,
    MAX_SEED,
    NONNEGATIVE,
    NONNEGATIVE_COUNT,
    POSITIVE,
    SEED,
    UNIT,
    Domain,
    shown_value,
)
from emdlm.eval_kinds import EVAL_KIND_SPECS, EVAL_KINDS  # the one registry of eval kinds
from emdlm.objective_specs import (
    OBJECTIVE_NAMES,
    OBJECTIVE_SPECS,
    class_reference_problem,
    is_class_reference,
)

# derived from the one registry (emdlm.objective_specs)
OBJECTIVES = OBJECTIVE_NAMES
DISTILL_OBJECTIVES = tuple(n for n, s in OBJECTIVE_SPECS.items() if s.teacher)  # take a teacher
NUMERIC_OBJECTIVES = tuple(n for n, s in OBJECTIVE_SPECS.items() if s.numeric)  # have a λ
#: λ schedules of the numeric term (emdlm.training.lam_schedule).
LAM_SCHEDULES = ("constant", "linear", "cosine")
DATA_SPLITS = ("train", "dev", "test")  # "dev" only where the task or dataset has one
#: eval.decode: one answer per prompt ("greedy"), or minimum Bayes risk over samples
#: (emdlm.decoding)
DECODE_MODES = ("greedy", "mbr")
#: The legal values of the numeric run settings (emdlm.domains: NaN and ±inf lie in none, an
#: integer fits in 64 bits), checked by RunConfig.validate before anything is loaded or written
#: (a setting whose parent section is null is not checked). ``train.max_steps``: the optimizer
#: steps, >= 1; -1 (the default) leaves the length to ``train.epochs``.
RUN_SETTING_DOMAINS: dict[str, Domain] = {
    "optim.lr": POSITIVE,
    "optim.weight_decay": NONNEGATIVE,  # torch.optim.AdamW refuses < 0
    "optim.eps": NONNEGATIVE,
    "optim.max_grad_norm": NONNEGATIVE,  # 0: no clipping (transformers.Trainer)
    "optim.warmup_steps": NONNEGATIVE_COUNT,
    "optim.warmup_ratio": UNIT,
    "train.batch_size": COUNT,
    "train.grad_accum": COUNT,
    "train.epochs": NONNEGATIVE,
    "train.max_steps": COUNT.or_(-1),
    "train.logging_steps": COUNT,
    "train.save_steps": COUNT,
    "train.save_total_limit": NONNEGATIVE_COUNT.or_(None),  # None or 0: keep every checkpoint
    "train.eval_steps": COUNT.or_(None),
    "train.num_workers": NONNEGATIVE_COUNT,
    "train.torch_threads": NONNEGATIVE_COUNT.or_(None),  # None or 0: torch's default
    "data.max_length": Domain(low=2, integer=True),
    "data.pad_to_multiple_of": COUNT.or_(None),
    "data.train.n": COUNT,
    "data.train.limit": COUNT.or_(None),
    "data.eval.n": COUNT,
    "data.eval.limit": COUNT.or_(None),
    "lora.r": COUNT,
    "lora.alpha": POSITIVE,
    "lora.dropout": Domain(low=0.0, high=1.0, high_open=True),
    "eval.batch_size": COUNT,
    "eval.max_new_tokens": COUNT,
    "eval.num_samples": COUNT,
    "eval.mbr_samples": COUNT,
    "eval.rows_during_training": NONNEGATIVE_COUNT,
}
#: Adam's β1, β2 (``optim.betas``): each in [0, 1), as torch.optim.AdamW requires.
ADAM_BETA = Domain(low=0.0, high=1.0, high_open=True)


@dataclass
class ModelConfig:
    """``name``: a local Hugging Face checkpoint folder, or a named tiny architecture
    ("tiny-gpt2", "tiny-llama") built from ``params`` (n_layer, n_embd, n_head, n_positions,...;
    the vocab size comes from the tokenizer). VLMs ("tiny-qwen2-vl", "tiny-llava", or a folder
    whose config.json is an image-text-to-text model) train on image rows: see
    :mod:`emdlm.vlm`."""

    name: str = "tiny-gpt2"  # a local checkpoint folder or a named tiny architecture
    params: dict[str, Any] = field(default_factory=dict)  # the tiny architecture's sizes
    dtype: str = "float32"  # float32 | bfloat16 | float16: the weights' dtype when loaded
    # VLMs ("tiny-qwen2-vl", "tiny-llava" or an image-text-to-text folder): no gradient into
    # the vision tower and projector
    freeze_vision: bool = False


@dataclass
class DataSourceConfig:
    """One data source: exactly one of ``path`` (a .jsonl file with prompt/completion or text
    fields, or a folder saved by ``datasets.save_to_disk``) or ``task`` (a registered generator,
    see :mod:`emdlm.tasks`, with ``n`` examples of ``split`` and ``params``).

    ``split`` left out (None) means the role's split: "train" for ``data.train``, "test" for
    ``data.eval`` (:class:`DataConfig` fills it in), so an evaluation source never scores the
    training split unless it says so."""

    path: str | None = None  # a JSONL file or a save_to_disk folder (docs/data.md)
    task: str | None = None  # a registered generator (emdlm.tasks), instead of path
    n: int = 1000  # examples the generator makes
    split: str | None = None  # train | dev | test for a task; any split of a dataset folder
    seed: int | None = None  # None: the run seed
    params: dict[str, Any] = field(default_factory=dict)  # the generator's parameters
    limit: int | None = None  # keep only the first `limit` examples

    def describe(self) -> str:
        return self.path if self.path is not None else f"task {self.task} ({self.resolved_split})"

    @property
    def resolved_split(self) -> str:
        """``split``, or "train" for a source built outside a :class:`DataConfig` without one."""
        return self.split if self.split is not None else "train"

    def with_default_split(self, split: str) -> DataSourceConfig:
        """This source, with ``split`` filled in where it was left out."""
        return self if self.split is not None else dataclasses.replace(self, split=split)


@dataclass
class DataConfig:
    train: DataSourceConfig | None = None  # the training data
    eval: DataSourceConfig | None = None  # the test data of `emdlm eval` and train.eval_steps
    max_length: int = 128  # tokens per example: prompt + completion + EOS (images included)
    add_eos: bool = True
    pad_to_multiple_of: int | None = None
    extra_keys: list[str] = field(default_factory=list)  # tensor fields passed to the model
    image_key: str = "image"  # VLMs: the field holding each example's image (path or image)
    # VLMs: a folder that image paths named by data files (absolute, ../, ~, symlinks) must
    # resolve inside; None (default): any path, as documented (emdlm.datasets.image_rows)
    images_root: str | None = None
    # what to do when data.max_length cuts an example's end (its EOS is lost: "truncated") or
    # leaves it no target token (it is removed: "dropped"): "warn" (counted and logged) or "error"
    on_truncate: str = "warn"
    on_drop: str = "warn"
    # which numbers NTIL / digit EMD score (a row's "number_scope" field overrides it): "all",
    # "answer" (the task's answer pattern), "answer:<task>" or "regex:<pattern>" (emdlm.data)
    number_scope: str = "all"

    def __post_init__(self) -> None:
        # a source's split defaults to its role: train data from "train", evaluation data from
        # "test" (a default of "train" for both scored training problems as held-out ones)
        if self.train is not None:
            self.train = self.train.with_default_split("train")
        if self.eval is not None:
            self.eval = self.eval.with_default_split("test")


@dataclass
class ObjectiveConfig:
    """``name``: a registered objective (:data:`emdlm.objective_specs.OBJECTIVE_SPECS`, listed in
    docs/objectives.md) or ``<module>:<Class>``, a loss class of your own; ``params`` go to the
    loss class.
    ``cost_embedding`` (the objectives built from one, EMO's family): "model" (a frozen copy of
    the model's output embedding at the start of training), "teacher" (the teacher's; the
    default of the ones that distil), a local model folder (its output embedding, e.g. an
    oracle's for a student trained from scratch) or a path to a tensor file (.pt /
    .safetensors, [V, d])."""

    name: str = "ce"  # a registered objective (docs/objectives.md) or <module>:<Class>
    params: dict[str, Any] = field(default_factory=dict)  # the loss class's keyword arguments
    # the objectives built from a cost embedding: model | teacher | a folder | a file
    cost_embedding: str | None = None
    # the numeric objectives (a λ): λ over training, from the objective's own λ to lam_final
    # ("constant" | "linear" | "cosine"; emdlm.training.lam_schedule)
    lam_schedule: str = "constant"
    lam_final: float = 0.0


@dataclass
class OptimConfig:
    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    scheduler: str = "linear"  # any transformers SchedulerType: linear, cosine, constant, ...
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    optim: str = "adamw_torch"  # any transformers optimizer name


@dataclass
class TrainConfig:
    batch_size: int = 8  # per device
    grad_accum: int = 1  # micro-batches per optimizer step (exact: the loss is divided once)
    epochs: float = 1.0
    max_steps: int = -1  # optimizer steps (>= 1, overrides epochs); -1: train for `epochs`
    seed: int = 0  # model init, data order and generated data (unless a source sets its own)
    logging_steps: int = 1
    save_steps: int = 500
    save_total_limit: int | None = 2
    eval_steps: int | None = None
    progress_bar: bool = True
    tensorboard: bool = True
    # transformers.Trainer's logging integrations besides emdlm's own train_log.jsonl and tb/:
    # a name or a list ("wandb", "mlflow", "tensorboard", "comet_ml", ...; their packages must be
    # installed; WANDB_MODE=offline / MLFLOW_TRACKING_URI=file:./mlruns keep them offline)
    report_to: list[str] = field(default_factory=list)
    num_workers: int = 0
    gradient_checkpointing: bool = False
    bf16: bool = False
    fp16: bool = False
    torch_threads: int | None = None
    # FSDP2 applied by emdlm (emdlm.integrations.sharding) on CPU (gloo) or GPUs (NCCL); launch
    # with `torchrun --nproc_per_node N` (N >= 2). fsdp_config keys:
    # transformer_layer_cls_to_wrap (list of class names; default the model's _no_split_modules)
    # and reshard_after_forward (default true). accelerate's own FSDP (GPUs only): launch with
    # `accelerate launch --config_file configs/accelerate_fsdp.yaml` and leave this off
    fsdp: bool = False
    fsdp_config: dict[str, Any] = field(default_factory=dict)
    # the loss from the final hidden states and the output embedding, chunked over rows: the
    # [B, T, V] logits are never built while training (make_compute_loss_func(from_hidden=True))
    fused_linear: bool = False


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] | None = None  # None: peft's default for the architecture


@dataclass
class EvalConfig:
    """``kind``: a registered eval kind (:data:`emdlm.eval_kinds.EVAL_KIND_SPECS`): number |
    clock | box | boxes | math (answers generated and parsed) | text (open-ended:
    ``num_samples`` sampled continuations per prompt, always by sampling with ``temperature``
    and ``top_p`` and no top-k; MAUVE, PPL_test, ROUGE, distinct-n, repetition, and PPL_oracle
    under the model folder ``oracle``) | choice (each candidate scored by perplexity)."""

    kind: str = "number"  # how answers are scored: a registered eval kind (emdlm.eval_kinds)
    max_new_tokens: int = 16  # text: the generation length in tokens
    batch_size: int = 64  # sequences per generate call (mbr: batch_size // mbr_samples prompts)
    do_sample: bool = False
    # short answers: "greedy" (one answer per prompt; sampled with do_sample) or "mbr" (sample
    # mbr_samples answers at temperature / top_p and keep the one of least expected distance
    # to the others, by the kind's own distance: emdlm.decoding)
    decode: str = "greedy"
    mbr_samples: int = 16  # decode=mbr: answers sampled per prompt (k; the cost grows with it)
    temperature: float = 1.0  # sampling (do_sample, decode=mbr, kind text); 1 = the model's own
    top_p: float = 1.0
    seed: int = 0
    num_samples: int = 5  # text: continuations sampled per prompt
    oracle: str | None = None  # text: a model folder scoring the samples (PPL_oracle)
    mauve: bool = True  # text: compute MAUVE (MiniLM features)
    # text: "mean" of one MAUVE per sampling run (the EMO paper's), or "pooled" (every sample
    # in one set against the references; emdlm's only mode before)
    mauve_mode: str = "mean"
    # evaluate the final model on data.eval when `emdlm train` ends (as `emdlm train --eval`),
    # writing <output_dir>/eval/ as `emdlm eval <output_dir>` would
    at_end: bool = False
    # train.eval_steps with data.eval: at each evaluation also generate answers for the first
    # rows_during_training test rows and log the kind's metrics (eval_exact_match, ...) beside
    # eval_loss (kinds with a short answer; emdlm.training.generation_eval); 0: eval_loss only
    rows_during_training: int = 64


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: str = "gpt2"  # gpt2 | gpt2-numeric | qwen | llama3-like | char | a folder
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    output_dir: str = "runs/emdlm"  # the run folder (--output); emdlm writes only there
    # distillation: a local Hugging Face causal-LM folder (same tokenizer / vocab as the
    # student), frozen; only for the distillation objectives, which need it
    teacher: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Checks that need no file access (ConfigError on the first problem)."""
        self._validate_objective_name()
        for name, src in (("data.train", self.data.train), ("data.eval", self.data.eval)):
            if src is None:
                continue
            if (src.path is None) == (src.task is None):
                raise ConfigError(f"{name}: give exactly one of 'path' or 'task'")
            if src.task is not None:  # a generator's splits; a dataset folder's are its own
                check_choice(f"{name}.split", src.resolved_split, DATA_SPLITS)
            elif not isinstance(src.split, (str, type(None))) or src.split == "":
                raise ConfigError(f"{name}.split must be a split name, got {src.split!r}")
            if src.seed is not None:
                check_seed(f"{name}.seed", src.seed)
        check_seed("train.seed", self.train.seed)
        self._validate_report_to()
        self._validate_at_end()
        if self.objective.name in OBJECTIVE_SPECS:  # a user's class: checked when imported
            self._validate_teacher()
        check_lam_schedule(self.objective, self._objective_numeric())
        self._validate_domains()
        t = self.train
        if t.max_steps == -1 and t.epochs <= 0:
            raise ConfigError("set train.max_steps >= 1 or train.epochs > 0")
        self._validate_eval()
        check_choice("data.on_truncate", self.data.on_truncate, ("warn", "error"))
        check_choice("data.on_drop", self.data.on_drop, ("warn", "error"))
        self._validate_optim_names()

    def _validate_eval(self) -> None:
        """The eval settings, checked with the rest of the config: otherwise a bad one fails
        only when evaluation starts, i.e. after a whole training run (`emdlm train` with its
        own eval, every cell of an experiment)."""
        e = self.eval
        check_choice("eval.kind", e.kind, EVAL_KINDS)
        check_choice("eval.mauve_mode", e.mauve_mode, ("mean", "pooled"))
        check_choice("eval.decode", e.decode, DECODE_MODES)
        spec = EVAL_KIND_SPECS[e.kind]
        if e.decode == "mbr" and not spec.short_answer:
            raise ConfigError(f"eval.decode=mbr needs a generated short answer; eval.kind="
                              f"{e.kind} has none (use eval.decode=greedy)")
        # transformers' samplers refuse these at generation (open-ended kinds always sample)
        if e.do_sample or e.decode == "mbr" or spec.open_ended:
            if not (math.isfinite(e.temperature) and e.temperature > 0):
                raise ConfigError(f"eval.temperature must be > 0 when sampling (eval.do_sample, "
                                  f"eval.decode=mbr or eval.kind=text), got {e.temperature!r}")
            if not 0 <= e.top_p <= 1:
                raise ConfigError(f"eval.top_p must be in [0, 1] when sampling, got {e.top_p!r}")

    def _validate_domains(self) -> None:
        """Every numeric run setting of :data:`RUN_SETTING_DOMAINS`, Adam's betas and the
        objective's parameters (their domains are the registry's,
        ``emdlm.objective_specs.ObjectiveSpec.domains``)."""
        for key, domain in RUN_SETTING_DOMAINS.items():
            *sections, name = key.split(".")
            node: Any = self
            for part in sections:
                node = getattr(node, part) if node is not None else None
            if node is None:
                continue  # a section left out (data.eval)
            value = getattr(node, name)
            problem = domain.problem(value)
            if problem is not None:
                hint = " (-1, the default, trains for train.epochs)" if key == "train.max_steps" \
                    else ""
                raise ConfigError(f"{key} {problem}, got {shown_value(value)}{hint}")
        betas = self.optim.betas
        if not (isinstance(betas, list) and len(betas) == 2
                and all(ADAM_BETA.problem(b) is None for b in betas)):
            raise ConfigError(f"optim.betas must be Adam's two numbers [β1, β2], each "
                              f"{ADAM_BETA.describe()}, got {betas!r}")
        params = self.objective.params
        if not isinstance(params, dict):
            raise ConfigError(f"objective.params must be a mapping, got {params!r}")
        spec = OBJECTIVE_SPECS.get(self.objective.name)  # a user's class: checked when imported
        problems = spec.param_problems(params, "objective.params.") if spec is not None else []
        if problems:
            raise ConfigError(f"objective {self.objective.name!r}: {'; '.join(problems)}")

    def _validate_at_end(self) -> None:
        if self.eval.at_end and self.data.eval is None:
            raise ConfigError(
                "eval.at_end (emdlm train --eval) evaluates on data.eval, which is not set: "
                "give data.eval.path or data.eval.task"
            )

    def _validate_report_to(self) -> None:
        """``train.report_to``: a name or a list of names (a plain string becomes a list)."""
        value = self.train.report_to
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(
                f"train.report_to must be a name or a list of names (e.g. wandb), got {value!r}"
            )
        self.train.report_to = [n for n in names if n != "none"]

    def _validate_objective_name(self) -> None:
        """A registered objective, or a user's loss class ``<module>:<Class>``, of which only the
        form is checked here: reading a config (a run folder's saved one too) never imports
        code; :func:`emdlm.objectives.build_objective` imports the class and checks it."""
        name = self.objective.name
        if name in OBJECTIVE_SPECS:
            return
        if is_class_reference(name):
            problem = class_reference_problem(name)
            if problem is not None:
                raise ConfigError(f"objective.name: {problem}")
            return
        raise ConfigError(
            f"objective.name must be one of {', '.join(OBJECTIVES)}, or <module>:<Class> for a "
            f"loss class of your own, got {name!r}{did_you_mean(name, OBJECTIVES)}"
        )

    def _objective_numeric(self) -> bool | None:
        """Whether the objective has a numeric term weight λ (None: a user's class, not known
        before it is imported)."""
        spec = OBJECTIVE_SPECS.get(self.objective.name)
        return None if spec is None else spec.numeric

    def _validate_teacher(self) -> None:
        """A teacher exactly for the distillation objectives (before anything is loaded)."""
        name = self.objective.name
        if self.teacher is not None and name not in DISTILL_OBJECTIVES:
            raise ConfigError(
                f"teacher={self.teacher!r} is set but objective {name!r} takes no target "
                f"distribution; use objective.name={' or '.join(DISTILL_OBJECTIVES)} to distil, "
                "or remove `teacher`"
            )
        if self.teacher is None and name in DISTILL_OBJECTIVES:
            raise ConfigError(
                f"objective {name!r} distils from a teacher: set teacher=<local model folder> "
                "(a Hugging Face causal LM with the student's tokenizer)"
            )

    def _validate_optim_names(self) -> None:
        """optim.scheduler / optim.optim against transformers' own lists, so that a typo fails
        here and not inside Trainer after the output folder was written."""
        from transformers.trainer_utils import SchedulerType
        from transformers.training_args import OptimizerNames

        check_choice("optim.scheduler", self.optim.scheduler, [s.value for s in SchedulerType])
        check_choice("optim.optim", self.optim.optim, [o.value for o in OptimizerNames])


def check_lam_schedule(objective: ObjectiveConfig, numeric: bool | None) -> None:
    """ConfigError for a λ schedule that is not one of :data:`LAM_SCHEDULES`, one on an objective
    without a numeric term weight λ (``numeric`` False; None: not known yet, not checked), or a
    ``lam_final`` that is not a finite number >= 0 or is set without a schedule."""
    o = objective
    check_choice("objective.lam_schedule", o.lam_schedule, LAM_SCHEDULES)
    if o.lam_schedule != "constant" and numeric is False:
        raise ConfigError(
            f"objective.lam_schedule={o.lam_schedule} schedules the numeric term's λ of "
            f"{' / '.join(NUMERIC_OBJECTIVES)}; objective {o.name!r} has none"
        )
    if not (isinstance(o.lam_final, (int, float)) and math.isfinite(o.lam_final)
            and o.lam_final >= 0):
        raise ConfigError(f"objective.lam_final must be a finite number >= 0, got "
                          f"{o.lam_final!r}")
    if o.lam_schedule == "constant" and o.lam_final != 0:
        raise ConfigError(f"objective.lam_final={o.lam_final} has no effect with "
                          "objective.lam_schedule=constant; set lam_schedule=linear or cosine")


def check_seed(key: str, value: Any) -> None:
    """ConfigError naming ``key`` unless ``value`` is an integer seed that
    ``transformers.set_seed`` accepts (0 .. :data:`MAX_SEED`; negative seeds fail in numpy)."""
    if SEED.problem(value) is not None:
        raise ConfigError(f"{key}={shown_value(value)} is not a usable seed: seeds are integers "
                          f"from 0 to {MAX_SEED} (numpy, seeded by transformers.set_seed, "
                          "refuses others)")
