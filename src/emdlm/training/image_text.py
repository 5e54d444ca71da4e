"""The VLM half of ``emdlm train`` / ``emdlm eval``: what :mod:`emdlm.training.train` and
:mod:`emdlm.training.evaluate` call, through :class:`ImageTextAdapter` (chosen by
:mod:`emdlm.training.adapters`), when ``model.name`` is a VLM (a named tiny VLM, or a folder
whose config.json is an image-text-to-text model)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from emdlm.config import ConfigError, RunConfig
from emdlm.data import cap_characters
from emdlm.datasets.image_rows import ImageRowsDataset, cut_image_rows, load_image_examples
from emdlm.eval_kinds import eval_kind
from emdlm.models import load_tokenizer
from emdlm.number_scope import row_scopes
from emdlm.vlm.collator import VLMCollator
from emdlm.vlm.models import (
    LANGUAGE_LORA_TARGETS,
    build_vlm,
    family_of,
    folder_model_type,
    freeze_vision,
    load_image_processor,
    named_family,
    prepare_vlm_tokenizer,
    spec_for,
)
from emdlm.weights import refuse_folder_code, weights_only_refusal


@dataclass
class VLMParts:
    tokenizer: Any
    model: Any
    image_processor: Any
    collator: VLMCollator
    train_dataset: ImageRowsDataset
    eval_dataset: ImageRowsDataset | None


def _family(name: str) -> str:
    model_type = folder_model_type(Path(name).expanduser())
    return family_of(model_type) if model_type is not None else named_family(name)


def prepare_vlm_run(cfg: RunConfig) -> VLMParts:
    """Image rows (checked: file:line errors), tokenizer with the family's special tokens,
    the VLM and its image processor, vision tower frozen when ``model.freeze_vision``. LoRA is
    applied by the caller (:func:`lora_targets` gives the language-model-only default)."""
    assert cfg.data.train is not None
    key, root = cfg.data.image_key, cfg.data.images_root
    train_rows = load_image_examples(cfg.data.train, seed=cfg.train.seed, image_key=key,
                                     images_root=root)
    eval_rows = (
        load_image_examples(cfg.data.eval, seed=cfg.train.seed, image_key=key, images_root=root)
        if cfg.data.eval is not None else None
    )
    tokenizer = prepare_vlm_tokenizer(load_tokenizer(cfg.tokenizer), _family(cfg.model.name))
    built = build_vlm(cfg.model, tokenizer)
    if cfg.model.freeze_vision:
        freeze_vision(built.model)
    collator = VLMCollator(
        tokenizer, built.image_processor, built.spec, built.model.config,
        max_length=cfg.data.max_length, add_eos=cfg.data.add_eos, image_key=key,
        number_scope=cfg.data.number_scope, task=cfg.data.train.task,
    )
    d = cfg.data

    def dataset(rows: list[dict[str, Any]], src: Any) -> ImageRowsDataset:
        row_scopes(rows, d.number_scope, src.task, src.describe())  # bad scopes: now, not mid-run
        rows, cut_rows, chars_cut, cap = cap_characters(rows, tokenizer, d.max_length)
        return cut_image_rows(
            rows, collator.lengths(rows), source=src.describe(), max_length=d.max_length,
            on_truncate=d.on_truncate, on_drop=d.on_drop,
            character_cuts=(len(cut_rows), chars_cut, cap),
        )

    return VLMParts(
        tokenizer, built.model, built.image_processor, collator,
        dataset(train_rows, cfg.data.train),
        dataset(eval_rows, cfg.data.eval) if eval_rows is not None else None,
    )


def lora_targets(configured: Any) -> Any:
    """The configured LoRA target modules, or (None) the language model's attention
    projections only, never the vision tower."""
    return LANGUAGE_LORA_TARGETS if configured is None else configured


def load_trained_vlm(folder: Path, model_type: str, tokenizer: Any, cfg: RunConfig) -> Any:
    """(model, collator in generation mode) for a trained VLM folder or checkpoint. The image
    processor is read from the folder, else from its run folder (checkpoints)."""
    from transformers import AutoModelForImageTextToText

    from emdlm.models import check_vocab

    family = family_of(model_type)
    source = folder if (folder / "preprocessor_config.json").is_file() else folder.parent
    refuse_folder_code(folder)
    processor = load_image_processor(source, model_type)
    try:  # local files only; remote code is never run
        model = AutoModelForImageTextToText.from_pretrained(str(folder), trust_remote_code=False)
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as err:
        refusal = weights_only_refusal(err, folder)  # a pickle that would run code: one line
        raise ConfigError(refusal or f"cannot load the VLM in {folder}: {err}") from err
    prepare_vlm_tokenizer(tokenizer, family)
    check_vocab(model, tokenizer)
    model.eval()
    collator = VLMCollator(
        tokenizer, processor, spec_for(family), model.config, max_length=cfg.data.max_length,
        add_eos=cfg.data.add_eos, image_key=cfg.data.image_key, generation=True,
    )
    return model, collator


def evaluate_vlm(
    run_dir: Path, model_type: str, cfg: RunConfig, sheet: Path | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``emdlm eval`` for a VLM folder: image rows of ``cfg.data.eval`` (checked), greedy (or
    sampled, per ``cfg.eval``) answers with the images, then
    :func:`emdlm.metrics.compute_task_metrics` of ``eval.kind`` (clock, box, boxes, number;
    same keys as for text models) plus the completions' perplexity, with their own images
    (``perplexity``) and with each row shown the next row's image
    (``perplexity_other_images``, 2+ rows; equal to ``perplexity`` when the model ignores the
    image, :func:`emdlm.vlm.generate.other_images`). Parse failures count as
    wrong, never dropped. ``sheet``: where to write a contact sheet (PNG) of the first 32 test
    images with gold and predicted answers (kinds clock / box / boxes, images given as paths).
    Returns (metrics, one prediction row per example)."""
    from emdlm.evaluation import per_example_fields
    from emdlm.generation import cut_at_stop
    from emdlm.metrics import check_references, compute_task_metrics
    from emdlm.models import load_tokenizer as load_tok
    from emdlm.vlm.generate import generate_vlm_answers, other_images, vlm_perplexity

    e = cfg.eval
    if not eval_kind(e.kind).short_answer:
        raise ConfigError(f"eval.kind={e.kind} is not supported for VLMs; use clock, box, boxes "
                          "or number")
    if e.decode != "greedy":  # before the model is loaded
        raise ConfigError(f"eval.decode={e.decode} is not implemented for image-text models; "
                          "use eval.decode=greedy")
    assert cfg.data.eval is not None
    rows = load_image_examples(cfg.data.eval, seed=cfg.train.seed, image_key=cfg.data.image_key,
                               images_root=cfg.data.images_root)
    has_tok = (run_dir / "tokenizer_config.json").exists() or (run_dir / "tokenizer.json").exists()
    tokenizer = load_tok(str(run_dir) if has_tok else cfg.tokenizer)
    stop_at = ("\n",)
    refs = [cut_at_stop(r["completion"], stop_at).strip() for r in rows]
    try:  # before the model is loaded and any answer generated
        check_references(refs, e.kind, rows=rows)
    except ValueError as err:
        raise ConfigError(f"{cfg.data.eval.describe()}: {err}") from err
    model, collator = load_trained_vlm(run_dir, model_type, tokenizer, cfg)
    preds = generate_vlm_answers(
        model, collator, rows, max_new_tokens=e.max_new_tokens, batch_size=e.batch_size,
        do_sample=e.do_sample, temperature=e.temperature, top_p=e.top_p, seed=e.seed,
        stop_at=stop_at,
    )
    preds = [p.strip() for p in preds]
    metrics: dict[str, Any] = compute_task_metrics(preds, refs, e.kind, rows=rows)
    key = cfg.data.image_key
    metrics["perplexity"] = vlm_perplexity(model, collator, rows, batch_size=e.batch_size)
    if len(rows) >= 2:  # the same answers shown the next row's image: does the model look?
        metrics["perplexity_other_images"] = vlm_perplexity(
            model, collator, other_images(rows, key), batch_size=e.batch_size)
    if sheet is not None and eval_kind(e.kind).picture and all(
        isinstance(r[key], str) for r in rows
    ):
        from emdlm.contact_sheet import make_contact_sheet

        sheet_rows = [{**r, "image": r[key], "completion": ref} for r, ref in zip(rows, refs,
                                                                                  strict=True)]
        make_contact_sheet(sheet_rows, preds, sheet, kind=e.kind)
    predictions = [
        {"image": r[key] if isinstance(r[key], str) else None, "prompt": r["prompt"],
         "reference": ref, "prediction": pred, **per_example_fields(pred, ref, e.kind, r)}
        for r, ref, pred in zip(rows, refs, preds, strict=True)
    ]
    return metrics, predictions


class ImageTextAdapter:
    """The image-text model (VLM) adapter of the recipes (:mod:`emdlm.training.adapters` has
    the text one and the methods' contract): image rows, the VLM and its image processor
    (:func:`prepare_vlm_run`), LoRA on the language model only, the VLM collator, the image
    processor saved in the run folder, :func:`evaluate_vlm`. ``model_type``: a trained
    folder's (for ``evaluate``; read from the folder when None)."""

    family = "image-text"

    def __init__(self, model_type: str | None = None) -> None:
        self.model_type = model_type
        self.parts: VLMParts | None = None

    def _built(self) -> VLMParts:
        if self.parts is None:
            raise RuntimeError("ImageTextAdapter.build has not run")
        return self.parts

    def build(self, cfg: RunConfig) -> tuple[Any, Any]:
        from transformers import set_seed

        set_seed(cfg.train.seed)
        self.parts = prepare_vlm_run(cfg)
        return self.parts.tokenizer, self.parts.model

    def lora_targets(self, configured: Any) -> Any:
        return lora_targets(configured)

    def datasets(self, cfg: RunConfig, tokenizer: Any) -> tuple[Any, Any]:
        parts = self._built()  # built (and checked) with the model
        return parts.train_dataset, parts.eval_dataset

    def check_before_training(self, cfg: RunConfig, eval_configs: Any, model: Any,
                              tokenizer: Any) -> None:
        return None  # image rows were checked when built

    def collator(self, cfg: RunConfig, tokenizer: Any) -> VLMCollator:
        return self._built().collator

    def save_beside_model(self, out: Path) -> list[str]:
        """The image processor: before training, so eval of a checkpoint-N finds it in the run
        folder."""
        self._built().image_processor.save_pretrained(str(out))
        return ["preprocessor_config.json"]

    def evaluate(
        self, run_dir: Path, cfg: RunConfig, target: Path
    ) -> tuple[dict[str, Any], list[dict[str, Any]], list[Path]]:
        model_type = self.model_type or folder_model_type(run_dir)
        if model_type is None:
            raise ConfigError(f"{run_dir} holds no image-text-to-text model")
        sheet = target / "contact_sheet.png"
        metrics, predictions = evaluate_vlm(run_dir, model_type, cfg, sheet=sheet)
        return metrics, predictions, [sheet] if sheet.is_file() else []
