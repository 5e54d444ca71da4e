"""Public datasets in their own on-disk formats -> rows ``{"image", "prompt", "completion", ...}``.

Each reader gives rows in the format of the built-in generator of its task, so training and
:func:`emdlm.metrics.compute_task_metrics` treat them alike, and every bad file, line or entry is
a one-line :class:`emdlm.config.ConfigError` naming it before anything trains.

* :mod:`emdlm.datasets.grounding`: RefCOCO / RefCOCO+ / RefCOCOg.
* :mod:`emdlm.datasets.text_detection`: ICDAR2015, MSRA-TD500;
  :mod:`emdlm.datasets.curved_text`: CTW1500, Total-Text.
* :mod:`emdlm.datasets.clock`: folders of clock pictures named by their time.
* :mod:`emdlm.datasets.visual_math`: MathVista, MathVision.
* :mod:`emdlm.datasets.image_rows`: image+text JSONL rows and the image rows of a run, checked.
* :mod:`emdlm.datasets.reading`, :mod:`emdlm.datasets.safe_pickle`,
  :mod:`emdlm.datasets.images`: what the readers share (strict text, image checks, a restricted
  unpickler, one RGB conversion).
"""
